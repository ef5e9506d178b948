"""Element types of stage boundary tensors, named once for the whole project.

The bundle spec names element types by short strings (``"float32"``, ``"int64"``, ...). This module maps
ONNX's ``TensorProto.DataType`` numbers and onnxruntime's ``tensor(...)`` strings to those names, and the
names to numpy dtypes where numpy has one. The ONNX numbers are fixed by the ONNX spec, so no onnx
import is needed here.

Note: raw bytes.
    ONNX's strings are text: onnxruntime takes and gives ``string`` tensors as numpy ``object``
    arrays of ``str``, and the server decodes a BYTES tensor for one as UTF-8. A code stage may
    ask for the bytes themselves instead (an encoded image, a protobuf, a compressed blob: Triton's
    usual ensemble front, whose Python backend gets ``bytes``) by declaring a port ``bytes``: an
    ``object`` array of ``bytes``, which travels as BYTES on the wire, unchecked, and is never
    decoded. ONNX has no such type, so only code stages' ports may be ``bytes`` (:data:`CODE_DTYPES`);
    a link from a ``bytes`` output to an ONNX stage's ``string`` input is a dtype mismatch, as it
    would be in onnxruntime.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CODE_DTYPES", "DTYPES", "dtype_from_onnx", "dtype_from_ort", "itemsize", "numpy_dtype", "ort_type"]

# ONNX TensorProto.DataType number -> onnxpipe name (the ORT type string is "tensor(<ort name>)").
_ONNX: dict[int, tuple[str, str]] = {
    1: ("float32", "float"),
    2: ("uint8", "uint8"),
    3: ("int8", "int8"),
    4: ("uint16", "uint16"),
    5: ("int16", "int16"),
    6: ("int32", "int32"),
    7: ("int64", "int64"),
    8: ("string", "string"),
    9: ("bool", "bool"),
    10: ("float16", "float16"),
    11: ("float64", "double"),
    12: ("uint32", "uint32"),
    13: ("uint64", "uint64"),
    14: ("complex64", "complex64"),
    15: ("complex128", "complex128"),
    16: ("bfloat16", "bfloat16"),
    17: ("float8e4m3fn", "float8e4m3fn"),
    18: ("float8e4m3fnuz", "float8e4m3fnuz"),
    19: ("float8e5m2", "float8e5m2"),
    20: ("float8e5m2fnuz", "float8e5m2fnuz"),
    21: ("uint4", "uint4"),
    22: ("int4", "int4"),
    23: ("float4e2m1", "float4e2m1"),
}

#: Dtypes only code stages' ports may have (see Note: raw bytes).
CODE_DTYPES: tuple[str, ...] = ("bytes",)
DTYPES: tuple[str, ...] = (*(name for name, _ in _ONNX.values()), *CODE_DTYPES)
_FROM_ORT = {f"tensor({ort})": name for name, ort in _ONNX.values()}
_TO_ORT = {**{name: ort for ort, name in _FROM_ORT.items()}, "bytes": "tensor(string)"}  # as the drop-in session reports a bytes input
_NUMPY = {"string": np.dtype(object), "bytes": np.dtype(object)}


def dtype_from_onnx(elem_type: int) -> str:
    """Name of an ONNX ``TensorProto.DataType`` number, e.g. ``1 -> "float32"``.

    Raises:
        ValueError: the number is not a known element type.
    """
    try:
        return _ONNX[elem_type][0]
    except KeyError:
        raise ValueError(f"unknown ONNX element type {elem_type}") from None


def dtype_from_ort(type_str: str) -> str:
    """Name of an onnxruntime type string, e.g. ``"tensor(float)" -> "float32"``.

    Raises:
        ValueError: the string is not a tensor type onnxpipe knows.
    """
    try:
        return _FROM_ORT[type_str]
    except KeyError:
        raise ValueError(f"unsupported onnxruntime type {type_str!r}") from None


def ort_type(name: str) -> str:
    """The onnxruntime type string of a dtype name, as ``NodeArg.type`` prints it: ``"float32" -> "tensor(float)"``.

    Raises:
        ValueError: the name is not a known dtype.
    """
    try:
        return _TO_ORT[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}") from None


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an onnxpipe dtype name.

    Raises:
        ValueError: numpy has no such dtype (e.g. ``bfloat16`` without ml_dtypes).
    """
    if name in _NUMPY:
        return _NUMPY[name]
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"numpy has no dtype for {name!r}") from None


_SUB_BYTE = {"uint4": 1, "int4": 1, "float4e2m1": 1}  # packed two per byte; count a byte each, an upper bound


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name (strings and bytes count as 8, a pointer; 4-bit types as 1)."""
    if name in _SUB_BYTE:
        return _SUB_BYTE[name]
    if name.startswith("float8"):
        return 1
    if name == "bfloat16":
        return 2
    return 8 if name in ("string", "bytes") else numpy_dtype(name).itemsize
