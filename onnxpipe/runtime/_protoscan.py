"""Read what a bundle must check in an .onnx file without the onnx package: a protobuf wire scan.

The runtime cannot import onnx, yet before onnxruntime opens a stage module it must know which
external-data files the module points at (a hostile module could name ``../../etc/shadow``). This
module walks the protobuf wire format of a ModelProto, descending only into the messages that can
hold tensors (graph, nodes, attributes, subgraphs, functions) and skipping every other field by its
length, so even a 2 GB module is scanned without reading its weights.

Field numbers are those of onnx.proto (stable across ONNX versions).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

from onnxpipe._errors import BundleError

__all__ = ["external_locations"]

_MAX_DEPTH = 64

# message name -> {field number: message name} for the length-delimited fields to descend into.
_CHILDREN: dict[str, dict[int, str]] = {
    "model": {7: "graph", 25: "function"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
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
