"""Stage modules as files: their boundary specs, and saving them with or without external data.

Note: external data.
    A model loaded with ``load_external_data=False`` keeps, for each large weight, only a reference
    (file, offset, length) into its original data file. A stage taken from it carries the same
    references, so splitting never holds all weights in memory. :func:`save_model` then streams each
    referenced weight from the original file into the stage's own data file (``<stage>.onnx.data``),
    so every stage file holds its own weights and nothing else. A model with its weights in memory is
    written with external data too when it would pass protobuf's 2 GB limit.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import ModelProto, TensorProto

from onnxpipe._errors import ConfigError, SplitError
from onnxpipe.runtime import DTYPES, UNKNOWN_DIM_NAMES, TensorSpec, dtype_from_onnx

#: Dim names read as no name at all (``""`` and PaddlePaddle's ``?``): the dim is dynamic and unnamed.
UNKNOWN = UNKNOWN_DIM_NAMES | {""}

__all__ = [
    "PROTOBUF_LIMIT",
    "io_specs",
    "move_into_place",
    "save_model",
    "tensor_nbytes",
    "tensor_spec",
    "weight_specs",
    "weights_bytes",
    "without_initializers",
]

#: Serialized protobuf messages cannot exceed 2 GiB; stay clearly below it.
PROTOBUF_LIMIT = 2**31 - 2**26
_INLINE_BELOW = 1024  # tensors smaller than this stay inside the .onnx file
_ALIGN = 4096  # page-aligned offsets let onnxruntime map weights instead of copying them
_CHUNK = 1 << 24


def tensor_spec(value: onnx.ValueInfoProto) -> TensorSpec:
    """The :class:`TensorSpec` of a typed ONNX value (symbolic dims kept by name).

    A dim with neither value nor name, or with a negative value (PaddlePaddle's ``-1``), is
    dynamic: ``None`` (see ``TensorSpec``'s Note: dynamic dims).

    Raises:
        ConfigError: the value is not a tensor, or has no element type or one onnxpipe does not know.
    """
    if value.type.WhichOneof("value") != "tensor_type":
        kind = value.type.WhichOneof("value") or "untyped"
        raise ConfigError(f"tensor '{value.name}' is a {kind} value; only tensors can cross a stage boundary")
    tt = value.type.tensor_type
    if not tt.elem_type:
        raise ConfigError(f"tensor '{value.name}' has no element type")
    shape = None
    if tt.HasField("shape"):
        shape = tuple(
            (d.dim_value if d.dim_value >= 0 else None) if d.HasField("dim_value") else (d.dim_param if d.dim_param not in UNKNOWN else None)
            for d in tt.shape.dim
        )
    return TensorSpec(value.name, _dtype(tt.elem_type, value.name), shape)


def io_specs(model: ModelProto) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The inputs a caller must feed (initializers listed as inputs excluded) and the outputs."""
    weights = {t.name for t in model.graph.initializer} | {t.values.name for t in model.graph.sparse_initializer}
    inputs = tuple(tensor_spec(v) for v in model.graph.input if v.name not in weights)
    outputs = tuple(tensor_spec(v) for v in model.graph.output)
    return inputs, outputs


def move_into_place(staging: Path, target: Path) -> None:
    """Make the finished folder ``staging`` become ``target``, replacing what was there, so that
    ``target`` is never seen half-written (both must be on one file system: stage beside it)."""
    if target.exists():
        old = staging.with_name(staging.name + ".old")
        target.rename(old)
        staging.rename(target)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        staging.rename(target)


def weight_specs(model: ModelProto) -> dict[str, TensorSpec]:
    """The model's top-level initializers as specs, by name (no weight bytes are read)."""
    return {t.name: TensorSpec(t.name, _dtype(t.data_type, t.name), tuple(t.dims)) for t in model.graph.initializer}


def _dtype(elem_type: int, name: str) -> str:
    try:
        return dtype_from_onnx(elem_type)
    except ValueError:
        raise ConfigError(f"tensor '{name}' has ONNX element type {elem_type}, which onnxpipe does not know; known: {', '.join(DTYPES)}") from None


def tensor_nbytes(t: TensorProto) -> int:
    """Bytes of a stored tensor's data, in memory or in an external file."""
    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        if "length" in info:
            return int(info["length"])
    if t.HasField("raw_data"):
        return len(t.raw_data)
    count = 1
    for d in t.dims:
        count *= d
    try:
        return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 0


def weights_bytes(model: ModelProto) -> int:
    """Bytes of the model's top-level initializers, in memory or in external files."""
    return sum(tensor_nbytes(t) for t in model.graph.initializer) + sum(tensor_nbytes(t.values) for t in model.graph.sparse_initializer)


def _external(model: ModelProto) -> Iterator[TensorProto]:
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            yield t


def save_model(model: ModelProto, path: str | Path, source_dir: str | Path | None = None) -> list[str]:
    """Write a stage module; weights go to ``<path>.data`` when needed.

    External data is written when the model refers to external data (copied, tensor by tensor, from
    ``source_dir``) or when its weights would pass the protobuf limit. The model is not modified.

    Args:
        model: The module to write.
        path: The .onnx file to write.
        source_dir: Folder the model's external-data references are relative to.

    Returns:
        The names of the files written, relative to ``path``'s folder.

    Raises:
        SplitError: a referenced external data file is missing or shorter than it should be.
    """
    path = Path(path)
    has_refs = any(True for _ in _external(model))
    if not has_refs and weights_bytes(model) < PROTOBUF_LIMIT:
        onnx.save_model(model, path)
        return [path.name]
    data_name = path.name + ".data"
    out = ModelProto()
    out.CopyFrom(without_initializers(model))
    if out.ir_version < 4:
        # TensorProto.data_location and external data came with IR version 4.
        warnings.warn(f"{path.name}: IR version {out.ir_version} -> 4, as external data needs", stacklevel=2)
        out.ir_version = 4
    with open(path.parent / data_name, "wb") as data:
        for t in model.graph.initializer:
            out.graph.initializer.append(_externalize(t, data, data_name, source_dir))
    onnx.save_model(out, path)
    return [path.name, data_name]


def without_initializers(model: ModelProto) -> ModelProto:
    """A copy of ``model`` with no initializers, made without copying their bytes first."""
    saved = list(model.graph.initializer)
    del model.graph.initializer[:]
    try:
        out = ModelProto()
        out.CopyFrom(model)
    finally:
        model.graph.initializer.extend(saved)
    return out


def _externalize(t: TensorProto, fh: BinaryIO, data_name: str, source_dir: str | Path | None) -> TensorProto:
    """``t`` itself when it stays inline, else a copy whose bytes are appended to ``fh``."""
    external = t.data_location == TensorProto.EXTERNAL
    if t.data_type == TensorProto.STRING or (not external and tensor_nbytes(t) < _INLINE_BELOW):
        return t
    new = TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, doc_string=t.doc_string)
    fh.write(b"\0" * ((-fh.tell()) % _ALIGN))
    offset = fh.tell()
    if external:
        length = _copy_external(t, fh, source_dir)
    else:
        raw = t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes()
        fh.write(raw)
        length = len(raw)
    new.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
        new.external_data.add(key=key, value=value)
    return new


def _copy_external(t: TensorProto, fh: BinaryIO, source_dir: str | Path | None) -> int:
    info = {e.key: e.value for e in t.external_data}
    if source_dir is None:
        raise SplitError(f"weight '{t.name}' refers to external data but the model's folder is not known")
    src = Path(source_dir) / info.get("location", "")
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else (src.stat().st_size - offset if src.is_file() else -1)
    if not src.is_file():
        raise SplitError(f"weight '{t.name}': external data file '{src}' is missing")
    copied = 0
    with open(src, "rb") as f:
        f.seek(offset)
        while copied < length:
            chunk = f.read(min(_CHUNK, length - copied))
            if not chunk:
                raise SplitError(f"weight '{t.name}': external data file '{src}' ends before offset {offset}+{length}")
            fh.write(chunk)
            copied += len(chunk)
    return length
