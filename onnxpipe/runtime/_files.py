"""Requests in files: ``.npz`` files streamed through a :class:`Pipeline`, each result written as it comes.

The in-memory API is the pipeline's own (:meth:`Pipeline.map`: requests in, outputs out, in
order, bounded in flight); this module is the thin layer that puts files at both ends of it and
says, when a request fails, which file it came from. ``onnxpipe run`` is these functions, ``load``
and a summary.

Note: requests in files.
    A request file is an ``.npz`` keyed by pipeline input name (read without pickle, as the
    bundle's reference data is). :func:`check_request_files` checks every file against the
    pipeline's inputs from the ``.npy`` headers alone, so thousands of files are refused or
    accepted before any runs (give it to :func:`load` as ``before_start`` to do so before any
    session starts). :func:`map_files` then reads each file only when the pipeline takes it and
    writes each result as soon as it is ready, in request order, so memory stays bounded however
    many files there are. A result file is written whole or not at all (:func:`save_npz`), so a
    failed run leaves the results before the failure complete and nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from onnxpipe._errors import BundleError, ConfigError, InputError, StageError
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime.bundle import load_npz, npz_layout, save_npz

if TYPE_CHECKING:
    import numpy as np

    from onnxpipe.runtime._pipeline import Pipeline
    from onnxpipe.runtime._spec import TensorSpec

__all__ = ["check_request_files", "map_files", "request_files"]

#: How a request file is named in messages.
_WHAT = "inputs file"


def request_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The request files ``paths`` name, in order: a folder stands for every ``*.npz`` in it, sorted by name.

    Raises:
        InputError: a path does not exist, or a folder holds no ``.npz`` file.
    """
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.glob("*.npz") if p.is_file())
            if not found:
                raise InputError(f"inputs folder '{path}' holds no .npz file")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise InputError(f"{_WHAT} '{path}' does not exist")
    return files


def check_request_files(specs: Sequence[TensorSpec], files: Iterable[str | os.PathLike[str]]) -> None:
    """Check every request file against the pipeline's inputs (names, dtypes, shapes) from its headers alone.

    Nothing but the ``.npy`` headers is read (:func:`npz_layout`), so this is quick for thousands of files.

    Args:
        specs: The pipeline's inputs (``pipe.spec.inputs``).
        files: The request files.

    Raises:
        InputError: a file is missing, is not an ``.npz`` of arrays, or does not fit the inputs
            (the message names the file, then what :func:`check_inputs` says).
    """
    for file in map(Path, files):
        layout = _read(file, npz_layout)  # its own message: not wrapped again below
        try:
            check_inputs(specs, layout)
        except InputError as e:
            raise InputError(f"{_WHAT} '{file}': {e}") from e


def map_files(pipe: Pipeline, inputs: Sequence[str | os.PathLike[str]], outputs: Sequence[str | os.PathLike[str]]) -> Iterator[dict[str, np.ndarray]]:
    """Stream the requests in ``inputs`` through ``pipe``; write each one's outputs to its file in ``outputs``.

    Each file is read when the pipeline takes its request (:meth:`Pipeline.map`: at most what the
    queues and workers hold is in flight) and each result is written, keyed by pipeline output
    name, as soon as it is ready, in request order; a missing folder is made (Note: requests in
    files). Check the files first with :func:`check_request_files`.

    Args:
        pipe: The pipeline.
        inputs: The request files, ``.npz`` keyed by pipeline input name.
        outputs: Where each request's outputs go, one file per request (replaced if it exists).

    Yields:
        Each request's outputs, in request order, once its file is written.

    Raises:
        StageError: a request failed in a stage; the message names its inputs file and says how
            many result files were written before it (complete, and kept).
        InputError: a request file is missing or cannot be read (it changed since it was checked).
        ConfigError: ``inputs`` and ``outputs`` differ in length, or a result file cannot be written.
        BundleError: an output holds Python objects an ``.npz`` cannot store without pickle.
    """
    sources, targets = [Path(p) for p in inputs], [Path(p) for p in outputs]
    if len(sources) != len(targets):
        raise ConfigError(f"{len(sources)} inputs file(s) but {len(targets)} outputs file(s); give one outputs file per inputs file")
    written = 0
    try:
        for target, result in zip(targets, pipe.map(_read(f, load_npz) for f in sources), strict=True):
            _write(target, result)
            written += 1
            yield result
    except StageError as e:
        # map() yields in request order, so the failed request is the first one not written.
        kept = f"the {written} output file(s) written before it are complete and stay" if written else "no output file was written"
        raise StageError(f"{_WHAT} '{sources[written]}': {e}; {kept}", stage=e.stage, request=e.request) from e


def _read(path: Path, reader: Callable[[Path], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``reader(path)`` (:func:`load_npz` or :func:`npz_layout`), its refusal naming the file.

    Raises:
        InputError: the file is missing or is not an ``.npz`` of plain arrays.
    """
    if not path.is_file():
        raise InputError(f"{_WHAT} '{path}' does not exist")
    try:
        return reader(path)
    except BundleError as e:
        raise InputError(f"{_WHAT} '{path}': {e}") from e


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write a result file, making its folder.

    Raises:
        ConfigError: the file or its folder cannot be written.
    """
    try:
        if path.parent != Path():
            path.parent.mkdir(parents=True, exist_ok=True)
        save_npz(path, arrays)
    except OSError as e:
        raise ConfigError(f"cannot write '{path}': {e.strerror or e}") from e
