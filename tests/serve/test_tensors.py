"""The tensor codec on its own: raw bytes become views (no copy) of the declared dtype and shape,
JSON becomes arrays without changing a value's kind or range, BYTES round-trip as UTF-8, and
every mismatch is one 400 naming the tensor."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from onnxpipe import ConfigError
from onnxpipe.runtime import TensorSpec
from onnxpipe.serve import RequestError
from onnxpipe.serve._http import _lazy
from onnxpipe.serve._tensors import check_shape, from_binary, from_json, port_of, to_binary, to_json

F32 = port_of(TensorSpec("x", "float32", ("N", 4)), "input")
I8 = port_of(TensorSpec("i", "int8", (3,)), "input")
TEXT = port_of(TensorSpec("s", "string", ("N",)), "input")
FLAG = port_of(TensorSpec("b", "bool", (2,)), "input")


def test_raw_tensors_are_views_of_the_body_where_aligned() -> None:
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    body = _lazy(7 + values.nbytes, 7)
    body[7:] = values.tobytes()
    got = from_binary(F32, (2, 4), body[7:])
    np.testing.assert_array_equal(got, values)
    assert np.shares_memory(got, np.frombuffer(body, np.uint8)) and got.flags.aligned
    misaligned = memoryview(b"\0" + values.tobytes())[1:]
    copied = from_binary(F32, (2, 4), misaligned)
    assert copied.flags.aligned and not np.shares_memory(copied, np.frombuffer(misaligned, np.uint8))
    np.testing.assert_array_equal(copied, values)


def test_the_body_buffer_puts_the_given_offset_on_64_bytes() -> None:
    for offset in (0, 1, 63, 100, 4097):
        buf = _lazy(5000, offset)
        address = np.frombuffer(buf, np.uint8).ctypes.data
        assert len(buf) == 5000 and (address + offset) % 64 == 0


def test_the_body_buffer_holds_memory_only_for_the_bytes_written() -> None:
    """A declared length makes no memory: 256 MiB announced, 1 MiB written, about 1 MiB resident."""
    def rss() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) * 1024

    before = rss()
    buf = _lazy(256 << 20, 0)
    buf[: 1 << 20] = b"x" * (1 << 20)
    assert rss() - before < 16 << 20
    del buf


def test_shapes_and_datatypes_are_checked_before_any_data() -> None:
    assert check_shape(F32, "FP32", [3, 4]) == (3, 4)
    for datatype, shape, message in [
        ("FP64", [1, 4], "input 'x' has datatype 'FP64'; the model takes FP32"),
        ("FP32", [1, 4, 1], r"input 'x' has shape \[1, 4, 1\]; the model takes rank 2: \[-1, 4\]"),
        ("FP32", [1, 5], r"the model takes \[-1, 4\] \(dim 1 must be 4\)"),
        ("FP32", [-2, 4], "dim 0 must be from 0 to 9223372036854775807"),
        ("FP32", [2**63, 4], "dim 0 must be from 0 to"),
        ("FP32", [True, 4], r"shape must be a list of integers, got \[True, 4\]"),
        ("FP32", "1,4", "shape must be a list of integers, got '1,4'"),
    ]:
        with pytest.raises(RequestError, match=message) as e:
            check_shape(F32, datatype, shape)
        assert e.value.status == 400 and e.value.grpc_code == "INVALID_ARGUMENT"


def test_json_keeps_each_value_or_refuses() -> None:
    np.testing.assert_array_equal(from_json(F32, (2, 4), [[0, 1, 2, 3], [4, 5, 6, 7.5]]), np.array([[0, 1, 2, 3], [4, 5, 6, 7.5]], np.float32))
    np.testing.assert_array_equal(from_json(F32, (2, 4), list(range(8))), np.arange(8, dtype=np.float32).reshape(2, 4))  # flat, row-major
    assert from_json(I8, (3,), [-128, 0, 127]).dtype == np.int8
    with pytest.raises(RequestError, match=r"input 'i' is INT8: value 300 is out of its range -128..127"):
        from_json(I8, (3,), [1, 2, 300])
    with pytest.raises(RequestError, match=r"input 'i' is INT8, but 'data' holds fractional numbers"):
        from_json(I8, (3,), [1, 2, 3.5])
    with pytest.raises(RequestError, match=r"input 'b' is BOOL, but 'data' holds integers"):
        from_json(FLAG, (2,), [1, 0])
    assert from_json(FLAG, (2,), [True, False]).tolist() == [True, False]
    with pytest.raises(RequestError, match=r"'data' holds 7 values; shape \[2, 4\] takes 8"):
        from_json(F32, (2, 4), list(range(7)))
    with pytest.raises(RequestError, match="FP16 values cannot travel as JSON"):
        from_json(port_of(TensorSpec("h", "float16", (2,)), "input"), (2,), [1, 2])


def test_bytes_round_trip_as_utf8_and_broken_ones_are_refused() -> None:
    text = np.array(["café", "", "日本語"], dtype=object)
    raw = to_binary(TEXT, text)
    assert raw == b"".join(struct.pack("<I", len(s.encode())) + s.encode() for s in text)
    back = from_binary(TEXT, (3,), memoryview(raw))
    assert back.dtype == object and back.tolist() == ["café", "", "日本語"]
    assert to_json(TEXT, text) == ["café", "", "日本語"]
    assert from_json(TEXT, (3,), ["café", "", "日本語"]).tolist() == ["café", "", "日本語"]
    with pytest.raises(RequestError, match="BYTES element 1 is 5; JSON BYTES elements are strings"):
        from_json(TEXT, (2,), ["a", 5])
    with pytest.raises(RequestError, match="2 bytes left over after its 3 BYTES elements"):
        from_binary(TEXT, (3,), memoryview(raw + b"!!"))
    with pytest.raises(RequestError, match=r"'data' holds more than the 2 values its shape takes"):
        from_json(TEXT, (2,), ["a", "b", "c"])


def test_what_the_protocol_cannot_carry_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"model 'm': input 'z' is complex64, which the inference protocol cannot carry; servable dtypes: bool, uint8"):
        port_of(TensorSpec("z", "complex64", (2,)), "model 'm': input")


def test_outputs_go_back_little_endian_and_contiguous() -> None:
    a = np.arange(6, dtype=">f4").reshape(2, 3).T  # big-endian, not contiguous
    assert to_binary(port_of(TensorSpec("y", "float32", (3, 2)), "output"), a) == np.ascontiguousarray(a, dtype="<f4").tobytes()
    with pytest.raises(RequestError, match="output 'h' is FP16, which cannot travel as JSON"):
        to_json(port_of(TensorSpec("h", "float16", (2,)), "output"), np.zeros(2, np.float16))
