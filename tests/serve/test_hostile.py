"""Hostile and broken requests: each gets one 4xx with a message naming what is wrong (never a
traceback, never a 500), nothing is allocated from a declared size, and the server keeps serving."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from tests.serve.conftest import serve_args
from tests.serve.process import ServerProcess

X = [{"name": "X", "datatype": "FP32", "shape": [1, 4]}]  # twoout's input


def _binary(header: dict[str, Any], data: bytes, length: int | None = None) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + data, {"Inference-Header-Content-Length": str(len(text) if length is None else length)}


def _infer(tensor: dict[str, Any], **request: Any) -> bytes:
    return json.dumps({"inputs": [tensor], **request}).encode()


GOOD = np.arange(4, dtype=np.float32).tobytes()
CASES: list[tuple[str, str, bytes, dict[str, str], int, str]] = [
    ("not JSON", "twoout", b"{inputs: nope", {}, 400, "the request header is not JSON"),
    ("not an object", "twoout", b"[1, 2]", {}, 400, "must be a JSON object with 'inputs'"),
    ("no inputs", "twoout", b"{}", {}, 400, "must have an 'inputs' list"),
    ("unknown request key", "twoout", b'{"inputs": [], "input": []}', {}, 400,
     "unknown key(s) 'input' in the request; valid: id, inputs, model_name, model_version, outputs, parameters"),
    ("wrong datatype", "twoout", _infer({**X[0], "datatype": "FP64", "data": [0, 1, 2, 3]}), {}, 400, "input 'X' has datatype 'FP64'; the model takes FP32"),
    ("unknown datatype", "twoout", _infer({**X[0], "datatype": "FP99", "data": [0, 1, 2, 3]}), {}, 400, "input 'X' has datatype 'FP99'; the model takes FP32"),
    ("wrong rank", "twoout", _infer({**X[0], "shape": [4], "data": [0, 1, 2, 3]}), {}, 400, "input 'X' has shape [4]; the model takes rank 2: [1, 4]"),
    ("wrong fixed dim", "twoout", _infer({**X[0], "shape": [1, 5], "data": [0] * 5}), {}, 400, "the model takes [1, 4] (dim 1 must be 4)"),
    ("negative dim", "labelled", _infer({"name": "prefix", "datatype": "BYTES", "shape": [-1], "data": []}), {}, 400, "dim 0 must be from 0 to"),
    ("shape not ints", "twoout", _infer({**X[0], "shape": [1, "4"], "data": [0] * 4}), {}, 400, "shape must be a list of integers, got [1, '4']"),
    ("too few values", "twoout", _infer({**X[0], "data": [0, 1, 2]}), {}, 400, "'data' holds 3 values; shape [1, 4] takes 4"),
    ("ragged values", "twoout", _infer({**X[0], "data": [[0, 1], [2]]}), {}, 400, "'data' is not a list of numbers nested to one shape"),
    ("strings for floats", "twoout", _infer({**X[0], "data": ["a", "b", "c", "d"]}), {}, 400,
     "input 'X' is FP32, but 'data' holds values that are not numbers"),
    ("deep nesting", "twoout", b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}",
     {}, 400, "the request header is not JSON"),
    ("no data", "twoout", _infer(X[0]), {}, 400, "input 'X' has neither 'data' nor a 'binary_data_size' parameter"),
    ("data and binary", "twoout", _infer({**X[0], "data": [0] * 4, "parameters": {"binary_data_size": 16}}), {}, 400, "has both 'data' and 'binary_data_size'"),
    ("bytes != shape x dtype", "twoout", *_binary({"inputs": [{**X[0], "parameters": {"binary_data_size": 12}}]}, GOOD[:12]), 400,
     "input 'X': 12 bytes of binary data, but shape [1, 4] of FP32 takes 16"),
    ("binary past the body", "twoout", *_binary({"inputs": [{**X[0], "parameters": {"binary_data_size": 1 << 40}}]}, GOOD), 400,
     "binary_data_size 1099511627776, but only 16 bytes of binary data are left in the body"),
    ("10 GB declared shape", "labelled",
     *_binary({"inputs": [{"name": "prefix", "datatype": "BYTES", "shape": [2_500_000_000], "parameters": {"binary_data_size": 8}}]}, b"\0" * 8), 400,
     "8 bytes cannot hold 2500000000 BYTES elements"),
    ("10 GB declared FP32", "twoout", *_binary({"inputs": [{**X[0], "shape": [1, 4], "parameters": {"binary_data_size": 10 << 30}}]}, GOOD), 400,
     "binary_data_size 10737418240, but only 16 bytes"),
    ("header length past the body", "twoout", *_binary({"inputs": []}, b"", length=10_000), 400,
     "Inference-Header-Content-Length 10000 must be a number of bytes from 1"),
    ("header length not a number", "twoout", *_binary({"inputs": []}, b"", length=-3), 400,
     "Inference-Header-Content-Length '-3' is not a number of bytes (ASCII digits, at most 19)"),
    ("bytes left over", "twoout", *_binary({"inputs": [{**X[0], "parameters": {"binary_data_size": 16}}]}, GOOD + b"junk"), 400,
     "4 bytes of binary data after the inputs' (16) are not claimed by any input's binary_data_size"),
    ("BYTES length past the end", "labelled",
     *_binary({"inputs": [{"name": "prefix", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}]}, struct.pack("<I", 1000) + b"ab"), 400,
     "BYTES element 0 of 1 declares 1000 bytes, past the tensor's 6"),
    ("BYTES not UTF-8", "labelled",
     *_binary({"inputs": [{"name": "prefix", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}]},
              struct.pack("<I", 2) + b"\xff\xfe"), 400,
     "BYTES element 0 is not UTF-8 text"),
    ("unknown input", "twoout", _infer({**X[0], "name": "Z", "data": [0] * 4}), {}, 400, "model 'twoout' has no input 'Z'; valid: 'X'"),
    ("input twice", "twoout", json.dumps({"inputs": [{**X[0], "data": [0] * 4}] * 2}).encode(), {}, 400, "input 'X' is given twice"),
    ("missing input", "labelled", _infer({"name": "prefix", "datatype": "BYTES", "shape": [1], "data": ["a"]}), {}, 400,
     "missing input(s) 'x'; it takes 'prefix', 'x'"),
    ("unknown output", "twoout", _infer({**X[0], "data": [0] * 4}, outputs=[{"name": "Q"}]), {}, 400, "model 'twoout' has no output 'Q'; valid: 'M', 'Y'"),
    ("classification", "twoout", _infer({**X[0], "data": [0] * 4}, outputs=[{"name": "Y", "parameters": {"classification": 2}}]), {}, 400,
     "the classification extension is not implemented"),
    ("id not a string", "twoout", _infer({**X[0], "data": [0] * 4}, id=5), {}, 400, "the request's 'id' must be a string, got 5"),
    ("FP16 as JSON", "twoout", _infer({**X[0], "datatype": "FP16", "data": [0] * 4}), {}, 400, "input 'X' has datatype 'FP16'; the model takes FP32"),
    ("unknown encoding", "twoout", _infer({**X[0], "data": [0] * 4}), {"Content-Encoding": "br"}, 400,
     "Content-Encoding 'br' is not supported; valid: gzip, deflate, identity"),
    ("broken gzip", "twoout", b"this is not gzip", {"Content-Encoding": "gzip"}, 400, "the gzip body cannot be inflated"),
]


@pytest.mark.parametrize(("model", "body", "headers", "status", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_request_gets_one_4xx_naming_what_is_wrong(server: ServerProcess, model: str, body: bytes, headers: dict[str, str], status: int,
                                                         message: str) -> None:
    got, answer = server.request("POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json", **headers})
    assert got == status, answer
    error = json.loads(answer)["error"]
    assert message in error, error
    assert "Traceback" not in error


def test_unknown_models_versions_and_paths_are_named(server: ServerProcess) -> None:
    unknown = b'{"error":"unknown model \'nope\'; valid: \'labelled\', \'mlp\', \'rnn\', \'squeeze\', \'twoout\'"}'
    assert server.request("POST", "/v2/models/nope/infer", _infer({**X[0], "data": [0] * 4})) == (404, unknown)  # as Triton 2.51 and KServe
    assert server.request("POST", "/v2/models/twoout/versions/2/infer", b"{}") == (404, b'{"error":"model \'twoout\' has no version \'2\'; versions: 1"}')
    assert server.get("/v2/models/twoout/versions/1/ready")[0] == 200
    assert server.get("/v2/nothing") == (404, b'{"error":"Not Found"}')
    assert server.request("DELETE", "/v2/models/twoout") == (405, b'{"error":"Method Not Allowed"}')


def test_oversized_slow_and_truncated_bodies_are_refused_and_the_server_goes_on(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "twoout"), "--max-body-size", "4KiB", "--body-timeout", "0.5") as proc:
        proc.start(tmp_path / "serve.log")
        big = _infer({**X[0], "data": [0.0] * 4}, id="x" * 5000)
        assert proc.request("POST", "/v2/models/twoout/infer", big)[0] == 413  # Content-Length over the limit: not read
        # Chunked (no Content-Length), over the limit while read.
        status, answer = _raw(proc, b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                              + b"".join(b"%x\r\n%s\r\n" % (1000, b" " * 1000) for _ in range(5)) + b"0\r\n\r\n")
        assert status == 413 and b"the body is over 4096 bytes" in answer
        bomb = gzip.compress(b" " * (1 << 20))  # 1 MiB of spaces in about 1 KiB
        status, answer = proc.request("POST", "/v2/models/twoout/infer", bomb, {"Content-Encoding": "gzip"})
        assert status == 413 and b"inflates to over 4096 bytes" in answer
        # Slow: the body never comes in full.
        status, answer = _raw(proc, b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"inputs\"", linger=2.0)
        assert status == 408 and b"did not arrive within 0.5 s" in answer
        # Truncated: the client goes away mid-body; nothing to answer, nothing breaks.
        with socket.create_connection(("127.0.0.1", proc.http_port)) as s:
            s.sendall(b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"in")
        ok = httpclient.InferenceServerClient(proc.http)
        tensor = httpclient.InferInput("X", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        assert ok.infer("twoout", [tensor]).as_numpy("Y").shape == (1, 4)
        assert proc.get("/v2/health/ready")[0] == 200
        assert proc.stop() == 0
        assert "Traceback" not in proc.log(), proc.log()


def _raw(proc: ServerProcess, request: bytes, linger: float = 5.0) -> tuple[int, bytes]:
    """Send raw bytes; the status and the body of the answer."""
    with socket.create_connection(("127.0.0.1", proc.http_port), timeout=linger + 5) as s:
        s.sendall(request)
        answer = b""
        deadline = time.monotonic() + linger + 5
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            chunk = s.recv(65536)
            if not chunk or time.monotonic() > deadline:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]) if head else 0, body


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_bad_grpc_requests_get_the_status_triton_maps_them_to(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    tensor = grpcclient.InferInput("X", [1, 4], "FP64")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float64))
    with pytest.raises(InferenceServerException, match=r"input 'X' has datatype 'FP64'; the model takes FP32") as e:
        client.infer("twoout", [tensor])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match=r"unknown model 'nope'") as e:
        client.get_model_metadata("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match=r"model 'twoout' has no version '3'") as e:
        client.get_model_config("twoout", "3")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    # Raw contents that do not match the inputs, sent with the canonical messages.
    channel = grpc.insecure_channel(server.grpc)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)
    request = service_pb2.ModelInferRequest(model_name="twoout", raw_input_contents=[GOOD, GOOD])
    request.inputs.add(name="X", datatype="FP32", shape=[1, 4])
    with pytest.raises(grpc.RpcError, match=r"raw_input_contents has 2 entries for 1 inputs") as rpc:
        infer(request)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    request = service_pb2.ModelInferRequest(model_name="twoout", raw_input_contents=[GOOD[:8]])
    request.inputs.add(name="X", datatype="FP32", shape=[1, 4])
    with pytest.raises(grpc.RpcError, match=r"8 bytes of binary data, but shape \[1, 4\] of FP32 takes 16"):
        infer(request)
    request = service_pb2.ModelInferRequest(model_name="twoout")
    request.inputs.add(name="X", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(grpc.RpcError, match=r"contents hold 2 values; shape \[1, 4\] takes 4"):
        infer(request)
    request = service_pb2.ModelInferRequest(model_name="twoout")
    request.inputs.add(name="X", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
    assert len(infer(request).raw_output_contents) == 2  # typed contents in, raw contents out
    channel.close()
    assert server.get("/v2/health/ready")[0] == 200


def test_health_answers_carry_the_rest_specs_bodies_and_kserves_model_keys_are_taken(server: ServerProcess) -> None:
    """The Open Inference Protocol's REST bodies for health and readiness (KServe's client reads
    them); a request's ``model_name`` / ``model_version`` (KServe's client always sends them) are
    taken when they match the URL, and a 400 naming both when not."""
    assert server.get("/v2/health/live") == (200, b'{"live":true}')
    assert server.get("/v2/health/ready") == (200, b'{"ready":true}')
    assert server.get("/v2/models/twoout/ready") == (200, b'{"name":"twoout","ready":true}')
    tensor = {**X[0], "data": [0, 1, 2, 3]}
    assert server.request("POST", "/v2/models/twoout/infer", _infer(tensor, model_name="twoout", model_version="1"))[0] == 200
    status, answer = server.request("POST", "/v2/models/twoout/infer", _infer(tensor, model_name="squeeze"))
    assert status == 400 and json.loads(answer) == {"error": "the request's model_name 'squeeze' is not the URL's (twoout); leave it out or give the same"}


def test_every_answer_says_server_onnxpipe_and_nothing_of_what_runs_it(server: ServerProcess) -> None:
    import http.client

    for method, path in (("GET", "/v2/health/ready"), ("GET", "/v2/models/twoout"), ("GET", "/v2/nothing"), ("POST", "/v2/models/twoout/infer")):
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
        conn.request(method, path, body=b"{}" if method == "POST" else None)
        response = conn.getresponse()
        response.read()
        conn.close()
        assert response.getheader("Server") == "onnxpipe", (path, response.getheader("Server"))


def test_a_raw_binary_request_is_named_not_supported(server: ServerProcess) -> None:
    status, answer = server.request("POST", "/v2/models/twoout/infer", GOOD, {"Inference-Header-Content-Length": "0"})
    assert status == 400 and "a raw binary request (Inference-Header-Content-Length: 0" in json.loads(answer)["error"]


def test_grpc_model_ready_of_a_model_not_served_is_not_ready_not_an_error(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    assert client.is_model_ready("twoout") is True
    assert client.is_model_ready("nope") is False
    assert client.is_model_ready("twoout", "7") is False


def test_a_request_over_the_configs_max_batch_size_is_refused_as_triton_refuses_it(server: ServerProcess) -> None:
    """``mlp`` batches (max_batch 8): its config says ``max_batch_size: 8``, so a request of 9 rows
    is a 400 naming the limit, and one of 8 is answered."""
    assert json.loads(server.get("/v2/models/mlp/config")[1])["max_batch_size"] == 8

    def ids(rows: int) -> bytes:  # ids [batch, n]: n = 4 here
        return json.dumps({"inputs": [{"name": "ids", "datatype": "INT64", "shape": [rows, 4], "data": [1] * (rows * 4)}]}).encode()

    assert server.request("POST", "/v2/models/mlp/infer", ids(8))[0] == 200
    status, answer = server.request("POST", "/v2/models/mlp/infer", ids(9))
    assert status == 400 and json.loads(answer) == {
        "error": "input 'ids' has 9 rows (dim 0); model 'mlp' takes at most 8 (its config's max_batch_size): send them in requests of that many"}


def _expecting(proc: ServerProcess, path: str, length: int, *headers: str, expect: str = "100-continue") -> tuple[int, bytes, bytes]:
    """Send only the head of a request with ``Expect: 100-continue``: the answer's status, head and body."""
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {length}", f"Expect: {expect}", *headers]
    with socket.create_connection(("127.0.0.1", proc.http_port), timeout=30) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, body


def test_expect_continue_is_answered_only_once_the_head_is_one_the_server_takes(bundles: dict[str, Path], tmp_path: Path) -> None:
    """The issue: ``Expect: 100-continue`` got ``100 Continue`` before the token, the model and the
    encoding were checked. Each refusal is now the final answer to the head, with its message, and
    the client never sends the body: no token or a wrong one (401), an unknown model (404), an
    encoding the server cannot inflate (400), a body over --max-body-size (413), an Expect it does
    not know (417), and a server draining (503); a head it takes gets 100 Continue, then its answer."""
    from tests.serve.test_hostile_traffic import _echo_bundle, _json_worker, _large_json, _post

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    auth = "Authorization: Bearer s3cret"
    with ServerProcess(*serve_args(bundles, "twoout"), f"echo={_echo_bundle(tmp_path)}", "--auth-token-file", token, "--max-body-size", "8MiB",
                       grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.proc is not None
        path = "/v2/models/twoout/infer"
        for headers, status, message in [
            ((), 401, "this server needs a bearer token: send the header 'Authorization: Bearer <token>'"),
            (("Authorization: Bearer nope",), 401, "the bearer token is not valid"),
            ((auth, "Content-Encoding: br"), 400, "Content-Encoding 'br' is not supported; valid: gzip, deflate, identity"),
        ]:
            got, head, body = _expecting(proc, path, 100, *headers)
            assert (got, json.loads(body)) == (status, {"error": message}), head
            assert (b"WWW-Authenticate: Bearer" in head) == (status == 401), head
        got, _, body = _expecting(proc, "/v2/models/nope/infer", 100, auth)
        assert (got, json.loads(body)) == (404, {"error": "unknown model 'nope'; valid: 'echo', 'twoout'"})
        got, _, body = _expecting(proc, path, 9 << 20, auth)
        assert (got, json.loads(body)) == (413, {"error": f"the body has {9 << 20} bytes; this server takes at most {8 << 20} (--max-body-size)"})
        got, _, body = _expecting(proc, path, 100, auth, expect="200-ok")
        assert (got, json.loads(body)) == (417, {"error": "Expect '200-ok' is not supported; valid: 100-continue"})
        request = _infer({**X[0], "data": [0, 1, 2, 3]})
        with socket.create_connection(("127.0.0.1", proc.http_port), timeout=30) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Length: {len(request)}\r\nExpect: 100-continue\r\n\r\n".encode())
            assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
            s.sendall(request)
            assert s.recv(65536).startswith(b"HTTP/1.1 200 OK")
        # Draining: a request held in flight by a stopped JSON worker keeps the server draining.
        worker = _json_worker(proc.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        try:
            body, _ = _large_json()
            with ThreadPoolExecutor(1) as pool:
                held = pool.submit(_post, proc.http_port, "/v2/models/echo/infer", body, {"Authorization": "Bearer s3cret"})
                deadline = time.monotonic() + 30
                while b'onnxpipe_inflight_requests{model="echo"} 1.0' not in proc.request("GET", "/metrics", port=proc.metrics_port)[1]:
                    assert time.monotonic() < deadline, "the request was not admitted"
                    time.sleep(0.01)
                proc.proc.send_signal(signal.SIGTERM)
                while proc.get("/v2/health/ready")[0] != 400:
                    assert time.monotonic() < deadline, "the server did not begin to drain"
                    time.sleep(0.01)
                got, _, answer = _expecting(proc, path, 100, auth)
                assert (got, json.loads(answer)) == (503, {"error": "the server is shutting down: it takes no new requests"})
                os.kill(worker, signal.SIGCONT)
                assert held.result()[0] == 200
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()
