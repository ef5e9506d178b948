"""Named arrays in .npz files, read and written without pickle: a bundle's reference data, and the
CLI's input and output files. Every array's header is checked before any data is read
(:func:`npz_layout`)."""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxpipe._errors import BundleError
from onnxpipe.runtime.bundle._limits import Limits, check_ratio

__all__ = ["load_npz", "npz_layout", "save_npz"]


def load_npz(path: str | os.PathLike[str], limits: Limits | None = None) -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name, read without pickle.

    Every array's header is read and checked first (see :func:`npz_layout`), so no array is
    allocated bigger than the bytes its file holds.

    Args:
        path: The .npz file.
        limits: Also refuse a member deflated beyond ``limits.max_compression_ratio``.

    Raises:
        BundleError: the file is missing or not an .npz of plain arrays.
    """
    npz_layout(path, limits)
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise BundleError(f"'{Path(path).name}' holds a single array, not an .npz of named arrays")
        with data:
            return {k: _loaded(data[k]) for k in data.files}
    except FileNotFoundError:
        raise BundleError(f"'{path}' does not exist") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise BundleError(f"cannot read '{Path(path).name}' as an .npz of arrays: {e}") from e


def _loaded(array: np.ndarray) -> np.ndarray:
    """A stored array as the pipeline uses it: fixed-width unicode back to an ``object`` array of ``str``."""
    return array.astype(object) if array.dtype.kind == "U" else array


def npz_layout(path: str | os.PathLike[str], limits: Limits | None = None) -> dict[str, np.ndarray]:
    """Stand-ins for the arrays of an .npz file, read from the ``.npy`` headers only: each a
    read-only broadcast view of one zero, of the array's dtype and shape, taking no memory (so
    ``check_inputs`` can check thousands of files, or a hostile one, without reading their data).

    Each header is checked against its zip member: the member holds exactly the header and the
    bytes the header's dtype and shape make (a 16 KiB file cannot declare a 2 GiB array), and no
    array holds Python objects.

    Args:
        path: The .npz file.
        limits: Also refuse a member deflated beyond ``limits.max_compression_ratio``.

    Raises:
        BundleError: the file is missing, not an .npz of arrays, or an array's header lies.
    """
    fmt = np.lib.format
    name = Path(path).name
    layout: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for m in zf.infolist():
                if not m.filename.endswith(".npy"):
                    raise BundleError(f"'{name}' member '{m.filename}' is not an .npy array")
                if limits is not None:
                    check_ratio(m, m.filename, limits, f"'{name}' member")
                with zf.open(m) as f:
                    major, _ = fmt.read_magic(f)
                    shape, _, dtype = fmt.read_array_header_1_0(f) if major == 1 else fmt.read_array_header_2_0(f)
                    header = f.tell()
                if dtype.hasobject:
                    raise BundleError(f"'{name}' array '{m.filename}' holds Python objects; only plain arrays are read (no pickle)")
                nbytes = math.prod(shape) * dtype.itemsize
                if header + nbytes != m.file_size:
                    held = m.file_size - header
                    raise BundleError(f"'{name}' array '{m.filename}' declares {dtype} {list(shape)} ({nbytes} bytes) but its member holds {held}")
                layout[m.filename.removesuffix(".npy")] = np.broadcast_to(np.zeros((), dtype), shape)
    except FileNotFoundError:
        raise BundleError(f"'{path}' does not exist") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise BundleError(f"cannot read '{name}' as an .npz of arrays: {e}") from e
    return layout


def save_npz(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> Path:
    """Write arrays by name to exactly ``path`` as an .npz, without pickle.

    Unlike ``numpy.savez`` it takes any name (``file``, ``allow_pickle``, names with ``/``) and
    never appends ``.npz``. The file is written whole or not at all. A ``string`` tensor (a numpy
    ``object`` array of ``str``, as onnxruntime returns it) is stored as numpy's fixed-width
    unicode (``<U``, no pickle), which :func:`load_npz` turns back into an ``object`` array of ``str``.

    Raises:
        BundleError: an array holds Python objects other than ``str`` (nothing is written).
    """
    path = Path(path)
    plain = {name: _storable(name, value) for name, value in arrays.items()}  # checked before anything is written
    tmp = path.with_name(f".{path.name}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        for name, value in plain.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, value, allow_pickle=False)
    os.replace(tmp, path)
    return path


def _storable(name: str, value: object) -> np.ndarray:
    """The array as .npy stores it without pickle: strings as fixed-width unicode."""
    array = np.asanyarray(value)
    if array.dtype != object:
        return array
    odd = next((v for v in array.reshape(-1) if not isinstance(v, str)), None)
    if odd is not None:
        raise BundleError(f"array '{name}' holds a {type(odd).__name__}; of Python objects only str (a string tensor) can be saved, without pickle")
    return array.astype(str) if array.size else np.zeros(array.shape, "<U1")
