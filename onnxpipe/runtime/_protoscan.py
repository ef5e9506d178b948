"""Read what a bundle must check in an .onnx file without the onnx package: a protobuf wire scan.

The runtime cannot import onnx, yet before onnxruntime opens a stage module it must know which
external-data files the module points at (a hostile module could name ``../../etc/shadow``). This
module walks the protobuf wire format of a ModelProto, descending only into the messages that can
hold tensors (graphs, nodes, attributes, subgraphs, functions and their attribute defaults, training
graphs, sparse tensors, to any depth up to ``_MAX_DEPTH``) and skipping every other field by its
length, so even a 2 GB module is scanned without reading its weights.

Field numbers are those of onnx.proto (stable across ONNX versions).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from onnxpipe._errors import BundleError

__all__ = ["Relocation", "external_locations", "relocate_external"]

_MAX_DEPTH = 64

# message name -> {field number: message name} for the length-delimited fields to descend into:
# every field through which a TensorProto can be reached, and a tensor's external_data entries.
# tests/runtime/test_protoscan.py derives the same table from onnx's own descriptors.
_CHILDREN: dict[str, dict[int, str]] = {
    # graph, functions (local functions, inlined by onnxruntime), training_info
    "model": {7: "graph", 20: "training", 25: "function"},
    # TrainingInfoProto: initialization, algorithm
    "training": {1: "graph", 2: "graph"},
    # node, initializer, sparse_initializer
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    # node, attribute_proto (attribute defaults, whose tensors onnxruntime inlines into the graph)
    "function": {7: "node", 11: "attribute"},
    "node": {5: "attribute"},
    # t, g, tensors, graphs, sparse_tensor, sparse_tensors
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    # values, indices
    "sparse": {1: "tensor", 2: "tensor"},
    # external_data
    "tensor": {13: "entry"},
    "entry": {},
}


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start, stop) of each field in buf[pos:end]; stop bounds the payload."""
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, stop = _varint(buf, pos, end)
            yield number, wire, pos, stop
        elif wire == 1:
            stop = pos + 8
            yield number, wire, pos, stop
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            stop = pos + length
            yield number, wire, pos, stop
        elif wire == 5:
            stop = pos + 4
            yield number, wire, pos, stop
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if stop > end:
            raise ValueError("field runs past the end of its message")
        pos = stop


def _walk(buf: memoryview, kind: str, pos: int, end: int, depth: int, found: list[str]) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError(f"messages nested deeper than {_MAX_DEPTH}")
    children = _CHILDREN[kind]
    if kind == "entry":
        key = value = b""
        for number, wire, start, stop in _fields(buf, pos, end):
            if wire == 2 and number == 1:
                key = bytes(buf[start:stop])
            elif wire == 2 and number == 2:
                value = bytes(buf[start:stop])
        if key == b"location":
            found.append(value.decode("utf-8", errors="replace"))
        return
    for number, wire, start, stop in _fields(buf, pos, end):
        child = children.get(number)
        if child is not None and wire == 2:
            _walk(buf, child, start, stop, depth + 1, found)


def external_locations(path: str | Path, label: str | None = None) -> list[str]:
    """Every external-data ``location`` named by tensors in an .onnx file, in file order.

    Args:
        path: The file.
        label: How messages name the file (default: its path).

    Raises:
        BundleError: the file is not a well-formed protobuf message.
    """
    found: list[str] = []
    label = label or str(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            raise BundleError(f"module '{label}' is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                _walk(buf, "model", 0, size, 0, found)
            except ValueError as e:
                raise BundleError(f"module '{label}' is not a valid ONNX file: {e}") from None
            finally:
                buf.release()
    return found


@dataclass(frozen=True)
class Relocation:
    """Where an external-data file's bytes really are: ``size`` bytes at ``offset`` in ``location``."""

    location: str
    offset: int
    size: int


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _length_field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def _entries(buf: memoryview, pos: int, end: int) -> list[tuple[bytes, bytes]]:
    pairs = []
    for number, wire, start, stop in _fields(buf, pos, end):
        if number == 13 and wire == 2:
            key = value = b""
            for n, w, s, e in _fields(buf, start, stop):
                if w == 2 and n in (1, 2):
                    key, value = (bytes(buf[s:e]), value) if n == 1 else (key, bytes(buf[s:e]))
            pairs.append((key, value))
    return pairs


def _moved_entries(pairs: list[tuple[bytes, bytes]], moves: Callable[[str], Relocation | None]) -> list[tuple[bytes, bytes]] | None:
    info = dict(pairs)
    if b"location" not in info:
        return None
    moved = moves(info[b"location"].decode("utf-8", errors="replace"))
    if moved is None:
        return None
    location = info[b"location"].decode("utf-8", errors="replace")
    try:
        offset, length = int(info.get(b"offset", b"0")), int(info[b"length"])
    except (KeyError, ValueError):
        raise ValueError(f"a tensor in '{location}' does not say its offset and length") from None
    if offset < 0 or length < 0 or offset + length > moved.size:
        raise ValueError(f"a tensor at {offset}+{length} runs past the end of '{location}' ({moved.size} bytes)")
    new = {b"location": moved.location.encode(), b"offset": str(moved.offset + offset).encode(), b"length": str(length).encode()}
    return [(k, new.get(k, v)) for k, v in pairs] + [(k, v) for k, v in new.items() if k not in info]


def _rewrite(buf: memoryview, kind: str, pos: int, end: int, depth: int, moves: Callable[[str], Relocation | None]) -> bytes:
    if depth > _MAX_DEPTH:
        raise ValueError(f"messages nested deeper than {_MAX_DEPTH}")
    children = _CHILDREN[kind]
    moved = _moved_entries(_entries(buf, pos, end), moves) if kind == "tensor" else None
    out = bytearray()
    field_start = pos
    for number, wire, start, stop in _fields(buf, pos, end):
        if kind == "tensor" and number == 13 and wire == 2 and moved is not None:
            if moved:  # every entry goes where the first one was
                out += b"".join(_length_field(13, _length_field(1, k) + _length_field(2, v)) for k, v in moved)
                moved = []
        elif number in children and children[number] != "entry" and wire == 2:
            out += _length_field(number, _rewrite(buf, children[number], start, stop, depth + 1, moves))
        else:
            out += buf[field_start:stop]
        field_start = stop
    return bytes(out)


def relocate_external(path: str | Path, moves: Callable[[str], Relocation | None], label: str | None = None) -> bytes:
    """The bytes of an .onnx file with the external data of some files pointing elsewhere.

    Every tensor whose ``location`` ``moves`` maps to a :class:`Relocation` gets that location and
    its offset shifted by the relocation's offset; each such tensor must state its offset and
    length, and lie within the relocated file's size, so nothing outside it can be read. The rest of
    the file is copied byte for byte.

    Raises:
        BundleError: the file is not a well-formed protobuf message, or a moved tensor has no
            length or does not fit.
    """
    label = label or str(path)
    with open(path, "rb") as f:
        data = f.read()  # a module whose weights are external: small
    try:
        return _rewrite(memoryview(data), "model", 0, len(data), 0, moves)
    except ValueError as e:
        raise BundleError(f"module '{label}': {e}") from None
