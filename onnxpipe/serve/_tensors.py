"""Tensors on the wire: the protocol's datatypes, shapes and three encodings, checked before use.

A request's tensor arrives as raw bytes (HTTP's binary tensor data extension, gRPC's
``raw_input_contents``), as JSON ``data``, or as gRPC's typed ``contents``. Each becomes a numpy
array of the dtype and shape the model's input declares; outputs go back as raw little-endian
bytes or JSON lists.

Note: checked before anything is allocated.
    A tensor's datatype must be the model input's, its shape a list of sizes that fits the
    input's rank and fixed dims, and its data exactly ``count x itemsize`` bytes (or ``count``
    values): every check runs on the header and the body's length, so a request declaring a 10 GB
    shape in a 1 KB body is refused without allocating anything. A tensor with elements is bounded
    by its data that way; an empty one (a dim 0) has none, so its other dims may multiply to at most
    :data:`_MOST_ELEMENTS` (numpy refuses dims whose product overflows, as a stage may). Raw tensors
    become numpy views over the request body (no copy, no per-element Python), copied once only when
    the body puts them at an offset their dtype cannot be read at.

Note: JSON values keep their kind and their value.
    JSON data is parsed by the JSON parser anyway; it becomes an array in one numpy call, after the
    Python types of its values are collected (one pass in C, no per-element Python): a float for an
    int input is refused, never truncated; ``true`` or ``false`` for a number input is refused
    (booleans are BOOL data only); an int out of the input's range is refused, never wrapped, and a
    number past FP32's range is refused, never made infinite. Integers are exact: where numpy would
    make floats of them (UINT64 values from 2**63 beside smaller ones), they are converted one by
    one. BYTES elements are length-prefixed (4-byte little-endian) and carry UTF-8 text: onnxpipe's
    ``string`` tensors are numpy ``object`` arrays of ``str``, and a JSON string that UTF-8 cannot
    carry (a lone surrogate, ``"\\ud800"``) is refused. A code stage's ``bytes`` port takes the
    elements as they are, never decoded (Note: raw bytes in runtime/_dtypes.py); as JSON, where
    elements are strings, it gets their UTF-8; a BYTES output that is not UTF-8 text is refused as
    JSON, never replaced. Outputs holding NaN or an infinity are
    refused as JSON (JSON has no such numbers; Triton writes them bare, which JavaScript, Go and
    Jackson reject): they travel as binary data.
"""

from __future__ import annotations

import itertools
import math
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxpipe._errors import ConfigError
from onnxpipe.runtime import TensorSpec, numpy_dtype
from onnxpipe.serve._errors import RequestError, bad_request, shown

__all__ = ["DATATYPES", "Port", "answer_bytes", "binary_view", "from_binary", "from_contents", "from_json", "held_bytes", "port_of", "to_binary", "to_json"]

#: onnxpipe dtype -> the protocol's datatype name (the tensor data types of the OIP spec).
DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
    "string": "BYTES",
    "bytes": "BYTES",
}
#: A shape's largest rank when the model does not fix it, and its largest dim (int64 on the wire).
_MAX_RANK = 32
_MAX_DIM = 2**63 - 1
#: The most elements an empty tensor's dims other than 0 may multiply to: the largest gRPC message's
#: bytes (its length is an int32), at a byte or more per element (see Note: checked before anything
#: is allocated).
_MOST_ELEMENTS = 2**31 - 1
#: gRPC's typed contents field for each datatype (FP16 has none: raw contents only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
#: The numpy dtype of each typed contents field, as the proto declares it.
_WIRE = {
    "bool_contents": np.dtype(np.bool_),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}
#: The Python types of JSON values each kind of input takes (see Note: JSON values keep their kind and their value).
_TAKES: dict[str, set[type]] = {"b": {bool}, "i": {int}, "u": {int}, "f": {int, float}}
_LENGTH = struct.Struct("<I")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Port:
    """A model's input or output as the protocol sees it.

    Attributes:
        name: The tensor's name.
        datatype: The protocol's datatype (``FP32``, ``BYTES``, ...).
        dtype: The numpy dtype of its values (little-endian: the wire's byte order).
        shape: The declared shape (ints fixed, anything else any size), or ``None`` for any rank.
        raw: BYTES elements are given and taken as ``bytes``, never decoded (a code stage's
            ``bytes`` port, Note: raw bytes in runtime/_dtypes.py); otherwise they are UTF-8 text.
    """

    name: str
    datatype: str
    dtype: np.dtype
    shape: tuple[Any, ...] | None
    raw: bool = False

    @property
    def dims(self) -> list[int]:
        """The shape as metadata and config give it: ``-1`` for a dim of any size."""
        if self.shape is None:
            return [-1]
        return [d if isinstance(d, int) else -1 for d in self.shape]

    @property
    def is_bytes(self) -> bool:
        return self.datatype == "BYTES"


def port_of(spec: TensorSpec, where: str) -> Port:
    """The protocol's view of a pipeline input or output.

    Raises:
        ConfigError: the protocol (or numpy) has no datatype for it, naming ``where``.
    """
    datatype = DATATYPES.get(spec.dtype)
    if datatype is None:
        valid = ", ".join(DATATYPES)
        raise ConfigError(f"{where} '{spec.name}' is {spec.dtype}, which the inference protocol cannot carry; servable dtypes: {valid}")
    dtype = numpy_dtype(spec.dtype)
    return Port(spec.name, datatype, dtype if dtype.kind == "O" else dtype.newbyteorder("<"), spec.shape, raw=spec.dtype == "bytes")


def check_shape(port: Port, datatype: object, shape: object) -> tuple[int, ...]:
    """The shape of a request's tensor, once it and the datatype fit the model's input.

    Raises:
        RequestError: 400 naming the tensor and what was expected.
    """
    if datatype != port.datatype:
        raise bad_request(f"input '{port.name}' has datatype {shown(datatype)}; the model takes {port.datatype}")
    if not isinstance(shape, (list, tuple)):
        raise bad_request(f"input '{port.name}': shape must be a list of integers, got {shown(shape)}")
    if port.shape is not None and len(shape) != len(port.shape):
        raise bad_request(f"input '{port.name}' has shape {shown(list(shape))}; the model takes rank {len(port.shape)}: {port.dims}")
    if len(shape) > _MAX_RANK:
        raise bad_request(f"input '{port.name}' has rank {len(shape)}; at most {_MAX_RANK}")
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise bad_request(f"input '{port.name}': shape must be a list of integers, got {shown(list(shape))}")
    for axis, d in enumerate(shape):
        if not 0 <= d <= _MAX_DIM:
            raise bad_request(f"input '{port.name}' has shape {list(shape)}: dim {axis} must be from 0 to {_MAX_DIM}")
        want = port.shape[axis] if port.shape is not None else None
        if isinstance(want, int) and d != want:
            raise bad_request(f"input '{port.name}' has shape {list(shape)}; the model takes {port.dims} (dim {axis} must be {want})")
    if 0 in shape and (filled := math.prod(d for d in shape if d)) > _MOST_ELEMENTS:
        axis = max(range(len(shape)), key=shape.__getitem__)
        raise bad_request(
            f"input '{port.name}' has shape {list(shape)}: its dims other than 0 multiply to {filled} (dim {axis} is {shape[axis]}); "
            f"at most {_MOST_ELEMENTS}, even in an empty tensor"
        )
    return tuple(shape)


def from_binary(port: Port, shape: tuple[int, ...], data: memoryview) -> np.ndarray:
    """A tensor from its raw bytes (a view of the request body where its dtype allows).

    Raises:
        RequestError: 400 when the bytes are not exactly the shape's elements.
    """
    count = math.prod(shape)
    if port.is_bytes:
        return _bytes_array(port, shape, count, data)
    expected = count * port.dtype.itemsize
    if len(data) != expected:
        raise bad_request(
            f"input '{port.name}': {len(data)} bytes of binary data, but shape {list(shape)} of {port.datatype} takes {expected}"
        )
    array = np.frombuffer(data, port.dtype, count).reshape(shape)
    if not array.flags.aligned:
        array = array.copy()  # the body put it at an offset its dtype cannot be read at
    if port.datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
        raise bad_request(f"input '{port.name}': BOOL elements must be bytes 0 or 1")
    return array


def _bytes_array(port: Port, shape: tuple[int, ...], count: int, data: memoryview) -> np.ndarray:
    """BYTES elements: a 4-byte little-endian length, then that many bytes (UTF-8 unless the port is raw), ``count`` times."""
    if count * _LENGTH.size > len(data):
        raise bad_request(f"input '{port.name}': {len(data)} bytes cannot hold {count} BYTES elements (4 bytes of length each at least)")
    items: list[str | bytes] = []
    at = 0
    for i in range(count):
        if at + _LENGTH.size > len(data):
            raise bad_request(f"input '{port.name}': BYTES element {i} of {count} runs past the tensor's {len(data)} bytes")
        (length,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        if at + length > len(data):
            raise bad_request(f"input '{port.name}': BYTES element {i} of {count} declares {length} bytes, past the tensor's {len(data)}")
        items.append(_element(port, i, data[at : at + length]))
        at += length
    if at != len(data):
        raise bad_request(f"input '{port.name}': {len(data) - at} bytes left over after its {count} BYTES elements")
    return _objects(items, shape)


def _element(port: Port, index: int, raw: bytes | memoryview) -> str | bytes:
    """A BYTES element as the port takes it: the bytes themselves for a raw port, else UTF-8 text."""
    return bytes(raw) if port.raw else _utf8(port, index, raw)


def _utf8(port: Port, index: int, raw: bytes | memoryview) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"input '{port.name}': BYTES element {index} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _objects(items: Sequence[Any], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(shape)


def from_json(port: Port, shape: tuple[int, ...], data: object) -> np.ndarray:
    """A tensor from JSON ``data``: flat (row-major) or nested to the shape.

    Raises:
        RequestError: 400 when the values are not the shape's elements of the input's kind.
    """
    if port.datatype == "FP16":
        raise bad_request(f"input '{port.name}': FP16 values cannot travel as JSON; send them as binary data (the binary tensor data extension)")
    if not isinstance(data, list):
        raise bad_request(f"input '{port.name}': 'data' must be a list of values, got {shown(data)}")
    count = math.prod(shape)
    if port.is_bytes:
        flat = _flatten(port, data, count)
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise bad_request(f"input '{port.name}': BYTES element {i} is {shown(item)}; JSON BYTES elements are strings")
        _check_utf8(port, flat)
        return _objects([item.encode("utf-8") for item in flat] if port.raw else flat, shape)  # JSON carries text: a raw port gets its UTF-8
    try:
        values = np.asarray(data)
    except (ValueError, TypeError):
        raise bad_request(f"input '{port.name}': 'data' is not a list of numbers nested to one shape") from None
    if values.size != count:
        raise bad_request(f"input '{port.name}': 'data' holds {values.size} values; shape {list(shape)} takes {count}")
    return _numbers(port, data, values).reshape(shape)


def _check_utf8(port: Port, items: list[str]) -> None:
    """Refuse strings UTF-8 cannot carry (a lone surrogate, which JSON's ``\\ud800`` makes): the
    output would fail to encode them. One look at the joined text; ASCII text is known as such."""
    text = "".join(items)
    if text.isascii() or not _SURROGATE.search(text):
        return
    index = next(i for i, item in enumerate(items) if _SURROGATE.search(item))
    raise bad_request(f"input '{port.name}': BYTES element {index} ({shown(items[index])}) holds a lone surrogate, which is not UTF-8 text")


def _flatten(port: Port, data: list[Any], count: int) -> list[Any]:
    """The leaves of nested lists, row-major; at most ``count`` of them (the parser bounded the depth)."""
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
            if len(flat) > count:
                raise bad_request(f"input '{port.name}': 'data' holds more than the {count} values its shape takes")
        else:
            stack.pop()
    if len(flat) != count:
        raise bad_request(f"input '{port.name}': 'data' holds {len(flat)} values; its shape takes {count}")
    return flat


def _numbers(port: Port, data: list[Any], values: np.ndarray) -> np.ndarray:
    """JSON numbers as the input's dtype (see Note: JSON values keep their kind and their value).

    Args:
        port: The input.
        data: The values as parsed.
        values: ``np.asarray(data)``, with the shape's count of values.
    """
    if not values.size:
        return np.empty(values.shape, port.dtype)
    want = port.dtype.kind
    wrong = set(map(type, _leaves(data, values.ndim))) - _TAKES[want]
    if wrong == {float} and want in "iu":
        _check_floats(port, data, values.ndim)
    if wrong:
        raise bad_request(f"input '{port.name}' is {port.datatype}, but 'data' holds {_kinds(wrong)}")
    if want == "f":
        return _floats(port, values)
    if want == "b":
        return values  # booleans only: numpy made bools of them
    if values.dtype.kind in "iu":
        _check_range(port, values.min().item(), values.max().item())
        return values.astype(port.dtype, copy=False)
    # Integers numpy made floats of (past int64 beside others) or objects (past uint64): exact, one by one.
    exact = list(_leaves(data, values.ndim))
    _check_range(port, min(exact), max(exact))
    return np.array(exact, port.dtype).reshape(values.shape)


def _leaves(data: list[Any], depth: int) -> Iterator[Any]:
    """The values of ``data``, ``depth`` lists deep as numpy found them, row-major (iterated in C)."""
    leaves: Iterable[Any] = data
    for _ in range(depth - 1):
        leaves = itertools.chain.from_iterable(leaves)
    return iter(leaves)


def _kinds(wrong: set[type]) -> str:
    if not wrong <= {bool, int, float}:
        return "values that are not numbers"
    if bool in wrong:
        return "booleans; true and false are BOOL data only"
    return "integers" if int in wrong else "fractional numbers"


def _check_floats(port: Port, data: list[Any], depth: int) -> None:
    """Refuse floats for an integer input, naming one that is whole: written as ``1.0``, or an
    integer past 64 bits that the parser read as a float (orjson does). Others fall through to the
    message about fractional numbers."""
    whole = next((v for v in _leaves(data, depth) if isinstance(v, float) and v.is_integer()), None)
    if whole is not None:
        info = np.iinfo(port.dtype)
        raise bad_request(f"input '{port.name}' is {port.datatype}, but 'data' holds {shown(whole)}, a float: it takes integers from {info.min} to {info.max}")


def _check_range(port: Port, low: Any, high: Any) -> None:
    """Raises:
        RequestError: 400 naming a value out of the integer input's range (BOOL has none)."""
    if port.dtype.kind not in "iu":
        return
    info = np.iinfo(port.dtype)
    if low < info.min or high > info.max:
        raise bad_request(f"input '{port.name}' is {port.datatype}: value {shown(low if low < info.min else high)} is out of its range {info.min}..{info.max}")


def _floats(port: Port, values: np.ndarray) -> np.ndarray:
    """Numbers as the float input's dtype, refused where one is past its range (never made infinite)."""
    most = float(np.finfo(port.dtype).max)
    try:
        with np.errstate(over="ignore"):  # refused below
            array = values.astype(port.dtype, copy=False)
    except OverflowError:  # an integer past float64's (numpy made objects of integers past uint64)
        raise _out_of_range(port, next(v for v in values.flat if abs(v) > most), most) from None
    infinite = np.isinf(array)
    if infinite.any():
        grown = np.flatnonzero(infinite & np.isfinite(values.astype(np.float64)))
        if grown.size:
            raise _out_of_range(port, values.reshape(-1)[grown[:1]].tolist()[0], most)
    return array


def _out_of_range(port: Port, value: object, most: float) -> RequestError:
    most_text = str(port.dtype.type(most))  # as the dtype writes it: 3.4028235e+38
    return bad_request(f"input '{port.name}' is {port.datatype}: value {shown(value)} is out of its range -{most_text}..{most_text}")


def from_contents(port: Port, shape: tuple[int, ...], contents: Any) -> np.ndarray:
    """A tensor from gRPC's typed ``InferTensorContents``.

    Raises:
        RequestError: 400 when the datatype has no typed contents or the count is wrong.
    """
    field = _CONTENTS.get(port.datatype)
    if field is None:
        raise bad_request(f"input '{port.name}': {port.datatype} values travel in raw_input_contents only")
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise bad_request(f"input '{port.name}': contents hold {len(values)} values; shape {list(shape)} takes {count}")
    if port.is_bytes:
        return _objects([_element(port, i, v) for i, v in enumerate(values)], shape)
    array = np.fromiter(values, _WIRE[field], count)  # the field's own dtype: exact (UINT64 past 2**63 too)
    if count:
        _check_range(port, array.min().item(), array.max().item())  # UINT8..32 and INT8..32 travel wider
    return array.astype(port.dtype, copy=False).reshape(shape)


def to_binary(port: Port, array: np.ndarray) -> bytes:
    """An output's raw bytes: row-major, little-endian; BYTES length-prefixed UTF-8."""
    if port.is_bytes:
        parts: list[bytes] = []
        for item in array.reshape(-1):
            raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
            parts += (_LENGTH.pack(len(raw)), raw)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=port.dtype).tobytes()


def _text(port: Port, index: int, item: object) -> str:
    """A BYTES output element as a JSON string; bytes that are not UTF-8 text cannot be one, and are never replaced."""
    if not isinstance(item, bytes):
        return str(item)
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(
            f"output '{port.name}': BYTES element {index} is not UTF-8 text, which JSON cannot carry; ask for it as binary data (binary_data: true)"
        ) from None


def binary_view(port: Port, array: np.ndarray) -> bytes | memoryview:
    """:func:`to_binary`, as a view of the array's own bytes where it has them in order (no copy)."""
    if port.is_bytes:
        return to_binary(port, array)
    return np.ascontiguousarray(array.reshape(-1), dtype=port.dtype).data.cast("B")


def to_json(port: Port, array: np.ndarray) -> list[Any] | np.ndarray:
    """An output's values as a flat JSON list (BYTES as strings), or for numbers the flat array
    itself, which orjson writes as that list without a Python object per value (``OPT_SERIALIZE_NUMPY``:
    4 M floats in 0.018 s, against 0.085 s for ``tolist`` alone); a float32 is written as the double
    it is (``3.4028234663852886e+38``), as ``tolist`` and Triton write it.

    Raises:
        RequestError: 400 for FP16, for NaN or an infinity, and for BYTES that are not UTF-8 text,
            which JSON cannot carry (ask for binary data; see Note: JSON values keep their kind
            and their value).
    """
    if port.datatype == "FP16":
        raise bad_request(f"output '{port.name}' is FP16, which cannot travel as JSON; ask for it as binary data (binary_data: true)")
    flat = array.reshape(-1)
    if port.is_bytes:
        return [_text(port, i, item) for i, item in enumerate(flat)]
    if flat.dtype.kind == "f" and flat.size:
        finite = np.isfinite(flat)
        if not finite.all():
            index = int(np.argmin(finite))
            value = flat[index]
            what = "NaN" if np.isnan(value) else "Infinity" if value > 0 else "-Infinity"
            raise bad_request(
                f"output '{port.name}' holds {what} (element {index}), which JSON cannot carry; ask for it as binary data (binary_data: true)"
            )
    return flat.astype(np.float64) if flat.dtype.kind == "f" else np.ascontiguousarray(flat)  # a float32 written as the double it is, as tolist and Triton do


def held_bytes(arrays: dict[str, np.ndarray], views: bool = False) -> int:
    """The bytes held by ``arrays``: each array's and a BYTES one's elements; with ``views`` false,
    not those of an array that is a view of something else than an array (the body)."""
    made = 0
    for array in arrays.values():
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        if views or base.base is None:  # its own memory, not the body's
            made += array.nbytes
        if array.dtype.kind == "O":
            made += sum(map(sys.getsizeof, array.flat))
    return made


#: The most bytes one value of each numpy kind takes in a JSON answer, its separator included: a
#: float is written as the double it is (``to_json``), at most 24 characters, from a float64 copy (8 bytes).
_JSON_VALUE = {"b": 6, "f": 25 + 8}
#: A JSON answer's bytes besides its values: keys, names, shapes (each output's, and the answer's own).
_JSON_OVERHEAD = 1024


def answer_bytes(outputs: list[tuple[Port, np.ndarray, bool]], id_length: int) -> int:
    """The most bytes the answer of ``outputs`` (port, array, as binary) can take while it is built
    (``_http``, Note: what a request holds): the JSON header, and with binary data the one buffer joining
    the header to the data."""
    text = _JSON_OVERHEAD * (len(outputs) + 1) + 6 * id_length
    data = 0
    for port, array, binary in outputs:
        if port.is_bytes:
            if binary:  # 4 bytes of length, then the element: bytes, or characters of at most 4 bytes in UTF-8
                data += sum(4 + len(item) * (1 if isinstance(item, bytes) else 4) for item in array.flat)
            else:  # a string of at most 6 bytes a character (a \u00XX escape), quotes and a separator
                text += sum(6 * len(item) + 3 for item in array.flat)
        elif binary:
            data += array.size * port.dtype.itemsize
        elif port.dtype.kind in "iu":
            info = np.iinfo(port.dtype)
            text += array.size * (len(str(info.min if port.dtype.kind == "i" else info.max)) + 1)
        else:
            text += array.size * _JSON_VALUE.get(port.dtype.kind, 25)
    return text + (text + data if data else 0)
