"""A client's mistakes (issue 28, items 5, 7, 8, 9 and 11): each is one 4xx (gRPC INVALID_ARGUMENT or
UNAUTHENTICATED) with a message naming what is wrong and bounded in size, never a 500 or a traceback;
and valid values the server once refused or changed (UINT64 past 2**63, INT64 at its bounds) come
back exactly."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx.parser
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import TensorSpec
from onnxpipe.serve import RequestError, ServeOptions
from onnxpipe.serve._errors import MESSAGE_MOST, shown
from onnxpipe.serve._models import ModelPorts
from onnxpipe.serve._state import ServerState
from onnxpipe.serve._tensors import check_shape, from_binary, from_contents, from_json, port_of
from tests import models
from tests.serve.conftest import serve_args
from tests.serve.process import ServerProcess
from tests.serve.test_hostile import _binary, _raw

pytestmark = pytest.mark.xdist_group("client-mistakes")  # one worker: its server starts once (its tests take under a second)

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: ``U``, ``I``, ``F`` (UINT64, INT64, FP32 of any length) -> the same values as ``U2``, ``I2``, ``F2``.
NUMBERS = """<ir_version: 8, opset_import: ["" : 17]>
numbers (uint64[N] U, int64[N] I, float[N] F) => (uint64[N] U2, int64[N] I2, float[N] F2) {
    U2 = Identity(U)
    I2 = Identity(I)
    F2 = Identity(F)
}"""
U64, I64 = np.iinfo(np.uint64), np.iinfo(np.int64)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _numbers(folder: Path) -> Path:
    config = PipelineConfig("numbers")
    stage = config.add_stage(onnx.parser.parse_model(NUMBERS), "same")
    for name in "UIF":
        config.input(name).connect(stage.input(name))
        stage.output(f"{name}2").connect(config.output(f"{name}2"))
    return models.bundle_of(config, folder)


@pytest.fixture(scope="module")
def guarded(bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a token, of ``mlp`` (INT64 ids of two free dims), ``labelled`` (BYTES) and ``numbers``."""
    root = tmp_path_factory.mktemp("mistakes")
    token = root / "token.txt"
    token.write_text(TOKEN + "\n")
    args = [*serve_args(bundles, "mlp", "labelled"), f"numbers={_numbers(root / 'numbers')}", "--allow-code", "tests.*"]
    with ServerProcess(*args, "--auth-token-file", token) as proc:
        proc.start(root / "serve.log")
        yield proc
        assert proc.stop() == 0, proc.log()


@pytest.fixture(autouse=True)
def _no_traceback(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test of a server: nothing it was sent made a traceback, and it is still ready."""
    yield
    if "guarded" in request.fixturenames:
        proc: ServerProcess = request.getfixturevalue("guarded")
        assert "Traceback" not in proc.log(), proc.log()
        assert proc.get("/v2/health/ready")[0] == 200


def _post(proc: ServerProcess, model: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, answer = proc.request("POST", f"/v2/models/{model}/infer", body, {**AUTH, "Content-Type": "application/json", **(headers or {})})
    return status, json.loads(answer) if answer else None


def _refused(proc: ServerProcess, model: str, body: bytes, message: str | re.Pattern[str], headers: dict[str, str] | None = None, status: int = 400) -> str:
    """The error of a refused request, which holds ``message`` (or matches it, given as a ``re.Pattern``)."""
    got, answer = _post(proc, model, body, headers)
    assert got == status, answer
    error = answer["error"]
    assert (re.search(message, error) if isinstance(message, re.Pattern) else message in error), error
    return str(error)


def _either(std: str, orjson: str) -> re.Pattern[str]:
    """A message as the standard library's parser leaves the value (integers of any size), or as
    orjson's does (integers past 64 bits become floats; NaN and lone surrogates are not JSON)."""
    return re.compile(f"{re.escape(std)}|{re.escape(orjson)}")


def _request(inputs: list[dict[str, Any]], **rest: Any) -> bytes:
    return json.dumps({"inputs": inputs, **rest}).encode()


def _numbers_request(u: list[int], i: list[int] | None = None, f: list[Any] | None = None, **rest: Any) -> bytes:
    i = [0] * len(u) if i is None else i
    f = [0.0] * len(u) if f is None else f
    return _request([{"name": "U", "datatype": "UINT64", "shape": [len(u)], "data": u},
                     {"name": "I", "datatype": "INT64", "shape": [len(i)], "data": i},
                     {"name": "F", "datatype": "FP32", "shape": [len(f)], "data": f}], **rest)


def _stub(proc: ServerProcess) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(proc.grpc)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)
    return channel, infer


def _grpc_refused(proc: ServerProcess, request: Any, code: grpc.StatusCode, message: str, metadata: list[tuple[str, str]] | None = None) -> str:
    channel, infer = _stub(proc)
    with channel, pytest.raises(grpc.RpcError) as rpc:
        infer(request, metadata=[("authorization", f"Bearer {TOKEN}")] if metadata is None else metadata)
    assert rpc.value.code() == code, rpc.value.details()
    assert message in rpc.value.details(), rpc.value.details()
    return str(rpc.value.details())


# -- 5: the token ---------------------------------------------------------------------------------


@pytest.mark.parametrize("header", ["Bearer \xff\xfe", "Bearer caf\xe9", "Bearer s3cret-token\xff", "Bearer \x80"])
def test_a_token_of_bytes_utf8_cannot_decode_is_a_401_not_a_500(guarded: ServerProcess, header: str) -> None:
    # urllib sends the header's characters as latin-1 bytes: 0xff 0xfe, 0xe9, ... (aiohttp hands them over surrogate-escaped)
    for method, path in [("GET", "/v2/models/mlp"), ("GET", "/metrics"), ("POST", "/v2/models/mlp/infer")]:
        status, answer = guarded.request(method, path, b"{}" if method == "POST" else None, {"Authorization": header})
        assert (status, answer) == (401, b'{"error":"the bearer token is not valid"}'), (path, answer)
    assert guarded.request("GET", "/v2/models/mlp", headers={"Authorization": "\xff\xfe"}) == (
        401, b'{"error":"this server needs a bearer token: send the header \'Authorization: Bearer <token>\'"}')
    assert guarded.get("/v2/models/mlp", AUTH)[0] == 200


def test_authorize_takes_every_value_and_refuses_more_than_one() -> None:
    state = ServerState(ServeOptions(auth_token=TOKEN), [])
    state.authorize(f"Bearer {TOKEN}")  # one string, as the callers give it today
    state.authorize([f"Bearer {TOKEN}"])
    state.authorize((f"Bearer  {TOKEN} ",))
    for values, status, message in [
        ([f"Bearer {TOKEN}", "Bearer wrong"], 400, "the request has 2 Authorization headers; send one"),
        ([f"Bearer {TOKEN}"] * 3, 400, "the request has 3 Authorization headers"),
        ([], 401, "this server needs a bearer token"),
        (None, 401, "this server needs a bearer token"),
        (["Bearer caf\udce9"], 401, "the bearer token is not valid"),  # aiohttp's escape of the byte 0xe9
        (["Bearer \ud800"], 401, "the bearer token is not valid"),  # a surrogate no byte decodes to
        (["Bearer"], 401, "the bearer token is not valid"),
    ]:
        with pytest.raises(RequestError, match=message) as e:
            state.authorize(values)
        assert e.value.status == status
    ServerState(ServeOptions(), []).authorize(["a", "b"])  # no token: nothing to check


# Two tokens: refused, whichever is right (HTTP took the first, gRPC the last before issue 28).


def test_two_authorization_headers_are_refused_over_http(guarded: ServerProcess) -> None:
    for first, second in [(TOKEN, "wrong"), ("wrong", TOKEN)]:
        status, answer = _raw(guarded, b"GET /v2/models/mlp HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              + f"Authorization: Bearer {first}\r\nAuthorization: Bearer {second}\r\n\r\n".encode())
        assert status == 400 and b"the request has 2 Authorization headers" in answer, answer


def test_two_authorization_values_are_refused_over_grpc(guarded: ServerProcess) -> None:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    for first, second in [(TOKEN, "wrong"), ("wrong", TOKEN)]:
        _grpc_refused(guarded, request, grpc.StatusCode.INVALID_ARGUMENT,
                      "the request has 2 'authorization' metadata values; send one: 'authorization: Bearer <token>'",
                      [("authorization", f"Bearer {first}"), ("authorization", f"Bearer {second}")])


def test_a_wrong_token_over_grpc_is_unauthenticated(guarded: ServerProcess) -> None:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    _grpc_refused(guarded, request, grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid", [("authorization", "Bearer caf")])
    _grpc_refused(guarded, request, grpc.StatusCode.UNAUTHENTICATED, "needs a bearer token", [])


# -- 7: an empty tensor's other dims ---------------------------------------------------------------

HUGE = 2**62


@pytest.mark.parametrize("shape", [[0, HUGE], [HUGE, 0], [0, 2**31]], ids=str)
def test_an_empty_tensor_with_a_huge_dim_is_a_400_on_both_doors(guarded: ServerProcess, shape: list[int]) -> None:
    message = f"input 'ids' has shape {shape}: its dims other than 0 multiply to {math.prod(d for d in shape if d)}"
    tensor = {"name": "ids", "datatype": "INT64", "shape": shape}
    _refused(guarded, "mlp", _request([{**tensor, "data": []}]), message)
    body, headers = _binary({"inputs": [{**tensor, "parameters": {"binary_data_size": 0}}]}, b"")
    _refused(guarded, "mlp", body, message, headers)
    raw = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[b""])
    raw.inputs.add(name="ids", datatype="INT64", shape=shape)
    _grpc_refused(guarded, raw, grpc.StatusCode.INVALID_ARGUMENT, message)
    typed = service_pb2.ModelInferRequest(model_name="mlp")
    typed.inputs.add(name="ids", datatype="INT64", shape=shape).contents.int64_contents.extend([])
    _grpc_refused(guarded, typed, grpc.StatusCode.INVALID_ARGUMENT, message)


def test_an_empty_tensor_s_other_dims_are_bounded_together() -> None:
    ids = port_of(TensorSpec("ids", "int64", None), "input")
    with pytest.raises(RequestError, match=r"its dims other than 0 multiply to 1099511627776 \(dim 0 is 1048576\); at most 2147483647, even in an empty"):
        check_shape(ids, "INT64", [2**20, 0, 2**20])
    assert check_shape(ids, "INT64", [2**15, 0, 2**15]) == (2**15, 0, 2**15)


def test_an_empty_tensor_of_sane_dims_still_runs(guarded: ServerProcess) -> None:
    status, answer = _post(guarded, "mlp", _request([{"name": "ids", "datatype": "INT64", "shape": [0, 5], "data": []}]))
    assert status == 200, answer
    assert answer["outputs"][0]["shape"] == [0, 5, 8] and answer["outputs"][0]["data"] == []


DIMS = st.one_of(st.just(0), st.integers(1, 8), st.integers(2**31 - 2, 2**31 + 2), st.integers(0, 2**63 - 1))


@FAST
@given(shape=st.lists(DIMS, min_size=0, max_size=5), body=st.sampled_from([b"", b"\0" * 8, b"\0" * 64]))
def test_any_shape_is_an_array_or_a_400_never_another_error(shape: list[int], body: bytes) -> None:
    """In process: whatever the dims, the checks and the decoders give an array or a 400 (numpy never
    gets a shape it cannot make), and an empty tensor's other dims stay within the bound."""
    port = port_of(TensorSpec("x", "float64", None), "input")
    try:
        checked = check_shape(port, "FP64", shape)
        binary = from_binary(port, checked, memoryview(body))
    except RequestError as e:
        assert e.status == 400 and "input 'x'" in str(e)
        return
    assert binary.shape == tuple(shape) and binary.nbytes == len(body)
    assert math.prod(d for d in shape if d) <= 2**31 - 1 or binary.size


@FAST
@given(other=DIMS, first=st.booleans())
def test_generated_empty_shapes_over_http_are_answered_or_refused_by_name(guarded: ServerProcess, other: int, first: bool) -> None:
    dims = (0, other) if first else (other, 0)
    status, answer = _post(guarded, "mlp", _request([{"name": "ids", "datatype": "INT64", "shape": list(dims), "data": []}]))
    if max(dims) > 2**31 - 1:  # the shape's own check comes first
        assert status == 400 and "its dims other than 0 multiply to" in answer["error"], answer
    elif dims[0] > 8:  # over mlp's max_batch_size, empty or not (as Triton refuses it)
        assert status == 400 and "takes at most 8 (its config's max_batch_size)" in answer["error"], answer
    else:
        assert status == 200 and answer["outputs"][0]["shape"] == [*dims, 8], answer


# -- 8: integers, exactly -------------------------------------------------------------------------


def test_uint64_past_2_63_and_int64_at_its_bounds_come_back_exactly(guarded: ServerProcess) -> None:
    u = [U64.max, 1, 2**63, 2**63 - 1, 0]
    i = [I64.min, I64.max, -1, 0, 2**53 + 1]
    status, answer = _post(guarded, "numbers", _numbers_request(u, i))
    assert status == 200, answer
    got = {o["name"]: o["data"] for o in answer["outputs"]}
    assert got["U2"] == u and got["I2"] == i
    # gRPC's typed contents, back as raw bytes.
    request = service_pb2.ModelInferRequest(model_name="numbers")
    request.inputs.add(name="U", datatype="UINT64", shape=[len(u)]).contents.uint64_contents.extend(u)
    request.inputs.add(name="I", datatype="INT64", shape=[len(i)]).contents.int64_contents.extend(i)
    request.inputs.add(name="F", datatype="FP32", shape=[len(u)]).contents.fp32_contents.extend([0.0] * len(u))
    channel, infer = _stub(guarded)
    with channel:
        response = infer(request, metadata=[("authorization", f"Bearer {TOKEN}")])
    assert np.frombuffer(response.raw_output_contents[0], "<u8").tolist() == u
    assert np.frombuffer(response.raw_output_contents[1], "<i8").tolist() == i


@pytest.mark.parametrize(("u", "i", "message"), [
    ([U64.max + 1, 1], None, _either("input 'U' is UINT64: value 18446744073709551616 is out of its range 0..18446744073709551615",
                                     "input 'U' is UINT64, but 'data' holds 1.8446744073709552e+19, a float: it takes integers from 0 to ")),
    ([-1, 2**63], None, "input 'U' is UINT64: value -1 is out of its range 0..18446744073709551615"),
    ([1, 2], [I64.max + 1, -1], "input 'I' is INT64: value 9223372036854775808 is out of its range -9223372036854775808..9223372036854775807"),
    ([1, 2], [I64.min - 1, 1], _either("input 'I' is INT64: value -9223372036854775809 is out of its range",
                                       "input 'I' is INT64, but 'data' holds -9.223372036854776e+18, a float: it takes integers from -9223372036854775808")),
    ([1, 2], [10**80, 1], _either("input 'I' is INT64: value 100000000000000000000000000000000000000000000000000000000000000000000000000000000 is out",
                                  "input 'I' is INT64, but 'data' holds 1e+80, a float")),
    ([1.0, 2], None, "input 'U' is UINT64, but 'data' holds 1.0, a float: it takes integers from 0 to 18446744073709551615"),
    ([1, 2.5], None, "input 'U' is UINT64, but 'data' holds fractional numbers"),
    ([1, True], None, "input 'U' is UINT64, but 'data' holds booleans; true and false are BOOL data only"),
], ids=["past UINT64", "negative UINT64", "past INT64", "below INT64", "80 digits", "a whole float", "a fraction", "a boolean"])
def test_an_integer_out_of_its_range_or_kind_is_a_400_naming_it(guarded: ServerProcess, u: list[Any], i: list[Any] | None,
                                                                message: str | re.Pattern[str]) -> None:
    _refused(guarded, "numbers", _numbers_request(u, i), message)


def test_typed_contents_out_of_a_narrower_range_are_a_400() -> None:
    request = service_pb2.ModelInferRequest()
    request.inputs.add(name="b", datatype="UINT8", shape=[2]).contents.uint_contents.extend([300, 1])
    with pytest.raises(RequestError, match=r"input 'b' is UINT8: value 300 is out of its range 0..255"):
        from_contents(port_of(TensorSpec("b", "uint8", (2,)), "input"), (2,), request.inputs[0].contents)


@FAST
@given(u=st.lists(st.integers(0, int(U64.max)), min_size=1, max_size=16), i=st.lists(st.integers(int(I64.min), int(I64.max)), min_size=1, max_size=16))
def test_generated_64_bit_integers_round_trip_exactly_through_json(guarded: ServerProcess, u: list[int], i: list[int]) -> None:
    n = min(len(u), len(i))
    status, answer = _post(guarded, "numbers", _numbers_request(u[:n], i[:n]))
    assert status == 200, answer
    got = {o["name"]: o["data"] for o in answer["outputs"]}
    assert got["U2"] == u[:n] and got["I2"] == i[:n]


# -- 9 and 11: values JSON or the input's type cannot carry -----------------------------------------


def test_a_lone_surrogate_in_a_bytes_element_is_a_400_at_decode(guarded: ServerProcess) -> None:
    x = {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [0.0] * 8}
    for prefix, index in [(["\ud800", "ok"], 0), (["ok", "a\udfffb"], 1), (["\ud83d", "\ude00"], 0)]:  # a pair split over two elements too
        body = _request([x, {"name": "prefix", "datatype": "BYTES", "shape": [2], "data": prefix}],
                        outputs=[{"name": "label", "parameters": {"binary_data": True}}])
        assert b"\\ud" in body  # the JSON escape, as a client writes it
        _refused(guarded, "labelled", body, _either(f"input 'prefix': BYTES element {index} (", "surrogate in string"))  # orjson: not JSON
    good = _request([x, {"name": "prefix", "datatype": "BYTES", "shape": [2], "data": ["caf\u00e9", "\U0001f600"]}],
                    outputs=[{"name": "label", "parameters": {"binary_data": True}}])
    status, answer = guarded.request("POST", "/v2/models/labelled/infer", good, AUTH)
    assert status == 200 and "café:0".encode() in answer and "\U0001f600:0".encode() in answer  # UTF-8 beyond ASCII; the pair as one character


@pytest.mark.parametrize(("f", "message"), [
    ([1e300, 1.0], "input 'F' is FP32: value 1e+300 is out of its range -3.4028235e+38..3.4028235e+38"),
    ([-1e39, 1.0], "input 'F' is FP32: value -1e+39 is out of its range"),
    ([2**200, 1], _either("input 'F' is FP32: value 1606938044258990275541962092341162602522202993782792835301376 is out of its range",
                          "input 'F' is FP32: value 1.6069380442589903e+60 is out of its range")),
    ([1.5, True], "input 'F' is FP32, but 'data' holds booleans; true and false are BOOL data only"),
    ([False, 0.5], "input 'F' is FP32, but 'data' holds booleans"),
    ([1.0, "2"], "input 'F' is FP32, but 'data' holds values that are not numbers"),
], ids=["1e300", "-1e39", "2**200", "true", "false", "a string"])
def test_a_number_fp32_cannot_hold_or_a_boolean_is_a_400(guarded: ServerProcess, f: list[Any], message: str | re.Pattern[str]) -> None:
    _refused(guarded, "numbers", _numbers_request([1, 2], f=f), message)


def test_fp32_keeps_what_it_can_hold(guarded: ServerProcess) -> None:
    f = [3.4028234663852886e38, -1e-45, 1e-50, 16777217]  # the largest, denormal, underflow to 0, rounded: all FP32 values
    status, answer = _post(guarded, "numbers", _numbers_request([1, 2, 3, 4], f=f))
    assert status == 200, answer
    assert next(o["data"] for o in answer["outputs"] if o["name"] == "F2") == np.array(f, np.float32).tolist()


@pytest.mark.parametrize(("value", "name"), [(math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")])
def test_an_output_holding_nan_or_infinity_is_refused_as_json_and_sent_as_binary(guarded: ServerProcess, value: float, name: str) -> None:
    f = np.array([1.0, value], np.float32).tobytes()
    inputs = [{"name": "U", "datatype": "UINT64", "shape": [2], "data": [1, 2]}, {"name": "I", "datatype": "INT64", "shape": [2], "data": [1, 2]},
              {"name": "F", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]
    as_json = {"inputs": inputs, "outputs": [{"name": "F2"}]}
    body, headers = _binary(as_json, f)
    _refused(guarded, "numbers", body, f"output 'F2' holds {name} (element 1), which JSON cannot carry; ask for it as binary data (binary_data: true)", headers)
    body, headers = _binary({"inputs": inputs, "outputs": [{"name": "F2", "parameters": {"binary_data": True}}]}, f)
    status, answer = guarded.request("POST", "/v2/models/numbers/infer", body, {**AUTH, **headers})
    assert status == 200
    header, data = json.loads(answer[:len(answer) - 8]), answer[-8:]
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 8 and data == f  # the same bits back


# -- 11: messages show a bounded part of the request ------------------------------------------------


def test_a_huge_unknown_name_comes_back_cut_and_fast(guarded: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "a" * (16 << 20)
    error = _refused(guarded, "mlp", _request([{"name": name, "datatype": "INT64", "shape": [1, 1], "data": [0]}]),
                     "model 'mlp' has no input 'aaaa")
    assert f"…' ({16 << 20} characters); valid: 'ids'" in error and len(error) < 400, error
    error = _refused(guarded, "mlp", _request([{"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [0]}], outputs=[{"name": "y" * 10**6}]),
                     "model 'mlp' has no output 'yyyy")
    assert "(1000000 characters); valid: 'y'" in error and len(error) < 400, error
    close = _refused(guarded, "mlp", _request([{"name": "idz", "datatype": "INT64", "shape": [1, 1], "data": [0]}]), "has no input 'idz'")
    assert close.endswith("closest: 'ids'"), close  # a name of sane length still gets the closest ones
    # Fast: a huge name is never compared with the valid ones (difflib over it took 2.6-5.7 s and
    # 680 MB, item 4). The server's own check of a request's names, here, counting what is compared.
    compared: list[str] = []
    real = difflib.get_close_matches
    monkeypatch.setattr(difflib, "get_close_matches", lambda word, *args, **kwargs: compared.append(word) or real(word, *args, **kwargs))
    ports = ModelPorts("mlp", {"ids": port_of(TensorSpec("ids", "int64", None), "input")}, {"y": port_of(TensorSpec("y", "float32", None), "output")})
    with pytest.raises(RequestError, match=f"…' \\({16 << 20} characters\\); valid: 'ids'$"):
        ports.input_port(name, {})
    with pytest.raises(RequestError, match=r"\(1000000 characters\); valid: 'y'$"):
        ports.output_port("y" * 10**6, {})
    with pytest.raises(RequestError, match="closest: 'ids'$"):
        ports.input_port("idz", {})
    assert compared == ["", "", "idz"]


def test_a_huge_unknown_name_over_grpc_is_invalid_argument_not_resource_exhausted(guarded: ServerProcess) -> None:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="b" * (1 << 20), datatype="INT64", shape=[1, 1]).contents.int64_contents.append(0)
    details = _grpc_refused(guarded, request, grpc.StatusCode.INVALID_ARGUMENT, "has no input 'bbbb")
    assert f"({1 << 20} characters)" in details and len(details) < 400


@pytest.mark.parametrize(("tensor", "message"), [
    ({"datatype": "X" * 10**6}, "input 'ids' has datatype 'XXXX"),
    ({"shape": [1] * 10**6}, "input 'ids' has shape [1, 1, 1"),
    ({"shape": ["1" * 10**6, 1]}, "input 'ids': shape must be a list of integers, got ['1111"),
    ({"data": "d" * 10**6}, "input 'ids': 'data' must be a list of values, got 'dddd"),
], ids=["datatype", "rank", "dim", "data"])
def test_values_echoed_in_messages_are_cut(guarded: ServerProcess, tensor: dict[str, Any], message: str) -> None:
    body = _request([{"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [0], **tensor}])
    error = _refused(guarded, "mlp", body, message)
    assert "…" in error and len(error) < 400, error


def test_a_sequence_parameter_echoed_is_cut(guarded: ServerProcess) -> None:
    body = _request([{"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [0]}], parameters={"sequence_start": [0] * 10**5})
    error = _refused(guarded, "mlp", body, "parameter 'sequence_start' must be a boolean, got [0, 0")
    assert "(100000 values)" in error and len(error) < 400, error


def test_shown_cuts_names_and_values_with_their_full_length() -> None:
    assert shown("ids") == "'ids'" and shown("it's") == '"it\'s"' and shown("\ud800") == "'\\ud800'"
    assert shown("a" * 1000) == f"'{'a' * 100}…' (1000 characters)"
    assert shown([1, 4]) == "[1, 4]" and shown(300) == "300"
    assert shown(list(range(1000))).endswith("… (1000 values)") and len(shown(list(range(1000)))) < 130
    assert len(str(RequestError(400, "x" * 10**6))) <= MESSAGE_MOST + 40  # every message, whatever builds it
    with pytest.raises(RequestError, match=r"input 'v': BYTES element 0 \('\\ud800'\) holds a lone surrogate"):
        from_json(port_of(TensorSpec("v", "string", ("N",)), "input"), (1,), ["\ud800"])
