"""The server's log (issue 29, item 2): one line per request with ``--access-log`` (HTTP and gRPC,
health checks and metrics too), every failure once whether or not (its model, request id and the
message the client got), ``--log-format json`` for every line of a run, and nothing else: no
onnxruntime line of a failed stage, no ANSI colour, no numpy warning.

Three real servers, started at once and shared by the module: ``access`` (text, --access-log),
``shipped`` (JSON, --access-log) and ``quiet`` (text, no --access-log, a token, a small body limit).
"""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from onnxpipe._errors import ConfigError
from onnxpipe.serve import ServeOptions
from onnxpipe.serve._logs import KEYS, REQUEST_KEYS, Request, configured, log_request
from onnxpipe.serve._models import client_text
from onnxpipe.splitter import split
from tests import models
from tests.serve.conftest import _mlp
from tests.serve.process import ROOT, ServerProcess, free_ports, read_head

pytestmark = pytest.mark.xdist_group("serve-logs")  # one worker: the module's three servers start once

TOKEN = "logs-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 4096  # --max-body-size of the quiet server
ANSI = "\x1b["
INT64_RANGE = "-9223372036854775808..9223372036854775807"
STARTED = re.compile(r"^onnxpipe serve: (loading|model|ready)", re.M)
#: twoout's input, and the failing model's: its second stage reshapes to [2, 4], so any other N fails in onnxruntime.
X = {"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1.0, 2.0, 3.0, 4.0]}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("logged")
    return {
        "twoout": models.bundle_of(split(models.two_outputs(), ["a", "M"]), root / "twoout"),
        "failing": models.bundle_of(models.failing_config("failing"), root / "failing"),
        "mlp": models.bundle_of(_mlp(), root / "mlp"),
    }


@pytest.fixture(scope="module")
def servers(made: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    root = tmp_path_factory.mktemp("logs")
    token = root / "token.txt"
    token.write_text(TOKEN + "\n")
    served = [f"{name}={path}" for name, path in made.items()]
    procs = {
        "access": ServerProcess(*served, "--access-log"),
        "shipped": ServerProcess(*served, "--access-log", "--log-format", "json"),
        "quiet": ServerProcess(*served, "--auth-token-file", token, "--max-body-size", str(LIMIT)),
    }
    try:
        for name, proc in procs.items():
            proc.start(root / f"{name}.log", wait=False)
        for proc in procs.values():
            proc.wait_ready()
        yield procs
        for name, proc in procs.items():
            assert proc.stop() == 0, proc.log()
            _check_whole_log(name, proc.log())
    finally:
        for proc in procs.values():
            proc.__exit__()


def _check_whole_log(name: str, log: str) -> None:
    """What every run's log must be, read once it stopped: the progress lines in the run's format, nothing else."""
    assert ANSI not in log and "[E:onnxruntime" not in log and "RuntimeWarning" not in log and "Traceback" not in log, log
    if name != "shipped":
        for line in ("onnxpipe serve: model 'twoout': 3 stage(s), no reference samples to verify", "onnxpipe serve: ready: http://127.0.0.1:",
                     "onnxpipe serve: draining: 0 request(s) in flight", "onnxpipe serve: stopped"):
            assert line in log, (line, log)
        return
    records = [json.loads(line) for line in log.splitlines()]  # every line one JSON object
    events = [r["event"] for r in records if r["logger"] == "onnxpipe.serve"]
    assert events[:2] == ["loading", "loaded"] and events[-3:] == ["ready", "draining", "stopped"], events
    for r in records:
        extra = set(REQUEST_KEYS) if r["event"] == "request" else set()
        assert set(r) == set(KEYS) | extra, r
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["time"]), r
        assert r["level"] in ("info", "warning", "error"), r
    ready = next(r for r in records if r["event"] == "ready")
    assert ready["message"].startswith("ready: http://127.0.0.1:") and ready["level"] == "info", ready


def _lines(proc: ServerProcess, needle: str, count: int = 1, timeout: float = 10.0) -> list[str]:
    """The log's lines holding ``needle``, once there are ``count`` (a line is written before its answer is sent; the wait is a margin)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in proc.log().splitlines() if needle in line]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _records(proc: ServerProcess, needle: str, count: int = 1) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _lines(proc, needle, count)]


def _post(proc: ServerProcess, model: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, answer = proc.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(), headers)
    return status, json.loads(answer) if answer else None


def _ids() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def _settled(proc: ServerProcess) -> str:
    """The log once the line of a last request (a failure: every server logs it) is in it: what came before is written by then."""
    mark = _ids()
    assert proc.get("/v2/settled", {"X-Request-Id": mark})[0] in (401, 404)
    _lines(proc, f"id={mark} ")
    return proc.log()


# -- --access-log: one line per request --------------------------------------------------------


def test_every_request_has_one_line_with_its_model_status_duration_and_id(servers: dict[str, ServerProcess]) -> None:
    proc = servers["access"]
    given, header = _ids(), _ids()
    status, answer = _post(proc, "twoout", {"id": given, "inputs": [X]}, {"X-Request-Id": header})
    assert status == 200 and answer["id"] == given
    (line,) = _lines(proc, f"id={given}")
    assert re.fullmatch(rf"onnxpipe serve: POST /v2/models/twoout/infer 200 \d+\.\d\d ms model=twoout id={given} peer=127\.0\.0\.1:\d+", line), line
    _post(proc, "twoout", {"inputs": [X]}, {"X-Request-Id": header})  # no protocol id: the header's
    (line,) = _lines(proc, f"id={header}")
    assert line.startswith("onnxpipe serve: POST /v2/models/twoout/infer 200 "), line

    # Health checks, metadata and metrics are requests too; a server-made id where the client gave none.
    for path in ("/v2/health/ready", "/v2/models/twoout/versions/1"):
        assert proc.get(path)[0] == 200
    scraped = _ids()
    with urllib.request.urlopen(urllib.request.Request(f"http://{proc.metrics}/metrics", headers={"X-Request-Id": scraped})) as answer:
        assert answer.status == 200 and answer.headers["X-Request-Id"] == scraped  # the metrics port's scrape, its id echoed
    log = _settled(proc)
    assert re.search(r"^onnxpipe serve: GET /v2/health/ready 200 [\d.]+ ms id=[0-9a-f]{16} peer=", log, re.M), log
    assert re.search(r"^onnxpipe serve: GET /v2/models/twoout/versions/1 200 [\d.]+ ms model=twoout version=1 id=[0-9a-f]{16} ", log, re.M), log
    assert re.search(rf"^onnxpipe serve: GET /metrics 200 [\d.]+ ms id={scraped} ", log, re.M), log


def test_grpc_calls_have_their_line_too(servers: dict[str, ServerProcess]) -> None:
    proc = servers["access"]
    client = grpcclient.InferenceServerClient(proc.grpc)
    given, header = _ids(), _ids()
    x = grpcclient.InferInput("X", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    client.infer("twoout", [x], request_id=given)
    client.infer("twoout", [x], headers={"x-request-id": header})
    assert client.is_server_ready()
    (line,) = _lines(proc, f"id={given}")
    assert re.fullmatch(rf"onnxpipe serve: gRPC ModelInfer OK \d+\.\d\d ms model=twoout id={given} peer=127\.0\.0\.1:\d+", line), line
    assert _lines(proc, f"id={header}")[0].startswith("onnxpipe serve: gRPC ModelInfer OK "), proc.log()
    assert re.search(r"^onnxpipe serve: gRPC ServerReady OK [\d.]+ ms id=[0-9a-f]{16} peer=127\.0\.0\.1:\d+$", _settled(proc), re.M), proc.log()


def test_a_failure_with_the_access_log_on_is_one_line_carrying_its_message(servers: dict[str, ServerProcess]) -> None:
    proc = servers["access"]
    given = _ids()
    status, answer = _post(proc, "twoout", {"id": given, "inputs": [{**X, "data": [1e39, 0, 0, 0]}]})
    assert (status, answer["error"]) == (400, "input 'X' is FP32: value 1e+39 is out of its range -3.4028235e+38..3.4028235e+38")
    (line,) = [line for line in _settled(proc).splitlines() if given in line]
    assert re.fullmatch(rf"onnxpipe serve: POST /v2/models/twoout/infer 400 [\d.]+ ms model=twoout id={given} peer=127\.0\.0\.1:\d+: (.*)", line)[1] == (  # type: ignore[index]
        answer["error"]), line


def test_a_stage_failure_is_one_line_with_its_model_and_id_and_no_onnxruntime_line(servers: dict[str, ServerProcess]) -> None:
    proc = servers["access"]
    given = _ids()
    status, answer = _post(proc, "failing", {"id": given, "inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": [0.0] * 12}]})
    assert status == 500 and "stage 'reshape' failed on request" in answer["error"] and "cannot be reshaped" in answer["error"], answer
    log = _settled(proc)
    (line,) = [line for line in log.splitlines() if given in line]
    logged = re.fullmatch(rf"onnxpipe serve: POST /v2/models/failing/infer 500 [\d.]+ ms model=failing id={given} peer=127\.0\.0\.1:\d+: (.*)", line)
    assert logged is not None, line
    # on one line, the whole text (onnxruntime's source too), which the answer gives without its source
    assert client_text(logged[1]) == answer["error"] and "reshape_helper.h:" in logged[1] and "reshape_helper.h" not in answer["error"], line
    assert ANSI not in log and "[E:onnxruntime" not in log and "sequential_executor" not in log, log


# -- JSON lines ---------------------------------------------------------------------------------


def test_json_lines_carry_the_fields_of_each_request(servers: dict[str, ServerProcess]) -> None:
    proc = servers["shipped"]
    client = httpclient.InferenceServerClient(proc.http)
    given = _ids()
    x = httpclient.InferInput("X", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    client.infer("twoout", [x], request_id=given)
    (ok,) = _records(proc, given)
    keys = ("level", "logger", "event", "protocol", "method", "path", "model", "version", "status", "grpc_status", "request_id", "error")
    assert {k: ok[k] for k in keys} == {
        "level": "info", "logger": "onnxpipe.serve.access", "event": "request", "protocol": "http", "method": "POST",
        "path": "/v2/models/twoout/infer", "model": "twoout", "version": None, "status": 200, "grpc_status": None, "request_id": given, "error": None}
    assert isinstance(ok["duration_ms"], float) and ok["duration_ms"] > 0 and re.fullmatch(r"127\.0\.0\.1:\d+", ok["peer"]), ok
    assert ok["message"].startswith("POST /v2/models/twoout/infer 200 "), ok

    given = _ids()
    status, answer = _post(proc, "failing", {"id": given, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}]})
    assert status == 500
    (failed,) = _records(proc, given)
    assert (failed["level"], failed["status"], failed["model"], failed["request_id"]) == ("error", 500, "failing", given)
    assert client_text(failed["error"]) == answer["error"] and "onnxruntime::ReshapeHelper" in failed["error"], failed  # the whole text is the log's


def test_a_grpc_failure_in_json_has_the_http_status_and_the_code_name(servers: dict[str, ServerProcess]) -> None:
    proc = servers["shipped"]
    client = grpcclient.InferenceServerClient(proc.grpc)
    given = _ids()
    ids = grpcclient.InferInput("ids", [1, 2], "INT64")
    ids.set_data_from_numpy(np.array([[99, 1]], np.int64))  # past the embedding's 16 rows: its Gather fails
    with pytest.raises(InferenceServerException, match="stage 'mlp' failed on request .*indices element out of data bounds, idx=99") as failed:
        client.infer("mlp", [ids], request_id=given)
    (line,) = _records(proc, given)
    assert {k: line[k] for k in ("level", "protocol", "method", "path", "model", "status", "grpc_status", "request_id")} == {
        "level": "error", "protocol": "grpc", "method": "ModelInfer", "path": "/inference.GRPCInferenceService/ModelInfer", "model": "mlp",
        "status": 500, "grpc_status": "INTERNAL", "request_id": given}
    assert client_text(line["error"]) == failed.value.message(), line  # the log keeps onnxruntime's whole text (Note: a failure's whole text)
    assert "Non-zero status code returned while running Gather node" in line["error"]
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_metadata("nope", headers={"x-request-id": (given := _ids())})
    (line,) = _records(proc, given)
    assert (line["level"], line["method"], line["model"], line["status"], line["grpc_status"]) == ("warning", "ModelMetadata", "nope", 404, "NOT_FOUND")


# -- without --access-log: failures only, each once ----------------------------------------------


def test_without_the_access_log_only_failures_are_logged_each_once(servers: dict[str, ServerProcess]) -> None:
    proc = servers["quiet"]
    before = len(proc.log().splitlines())
    assert _post(proc, "twoout", {"inputs": [X]}, AUTH)[0] == 200
    assert proc.get("/v2/health/ready")[0] == 200 and proc.get("/metrics", AUTH)[0] == 200
    client = grpcclient.InferenceServerClient(proc.grpc)
    assert client.is_server_live()

    unknown, big, refused, wrong = _ids(), _ids(), _ids(), _ids()
    assert _post(proc, "nope", {"inputs": [X]}, {**AUTH, "X-Request-Id": unknown})[0] == 404
    body = json.dumps({"inputs": [X], "id": "x" * LIMIT}).encode()
    assert proc.request("POST", "/v2/models/twoout/infer", body, {**AUTH, "X-Request-Id": big})[0] == 413
    status, answer = _post(proc, "twoout", {"inputs": [X]}, {"X-Request-Id": refused})
    assert (status, answer) == (401, {"error": "this server needs a bearer token: send the header 'Authorization: Bearer <token>'"})
    status, _ = _post(proc, "mlp", {"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [2**64]}]}, {**AUTH, "X-Request-Id": wrong})
    assert status == 400
    with pytest.raises(InferenceServerException, match="this server needs a bearer token"):
        client.get_model_metadata("twoout", headers={"x-request-id": (grpc_refused := _ids())})

    log = _settled(proc)
    assert len(log.splitlines()) == before + 5 + 1, log  # the five failures and _settled's (nothing for what was answered)
    for request_id, status_text, message in [
        (unknown, "POST /v2/models/nope/infer 404", "unknown model 'nope'; valid: 'failing', 'mlp', 'twoout'"),
        (big, "POST /v2/models/twoout/infer 413", f"the body has {len(body)} bytes; this server takes at most {LIMIT} (--max-body-size)"),
        (refused, "POST /v2/models/twoout/infer 401", answer["error"]),
        (wrong, "POST /v2/models/mlp/infer 400", f"input 'ids' is INT64: value 18446744073709551616 is out of its range {INT64_RANGE}"),
        (grpc_refused, "gRPC ModelMetadata UNAUTHENTICATED", "this server needs a bearer token: send the metadata 'authorization: Bearer <token>'"),
    ]:
        (line,) = [line for line in log.splitlines() if f"id={request_id} " in line]
        assert line.startswith(f"onnxpipe serve: {status_text} ") and line.endswith(f": {message}"), line


def test_an_error_answer_carries_the_id_of_its_line(servers: dict[str, ServerProcess]) -> None:
    proc = servers["quiet"]
    with socket.create_connection(("127.0.0.1", proc.http_port)) as sock:
        sock.sendall(b"GET /v2/models/nope HTTP/1.1\r\nHost: x\r\n" + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
        head = read_head(sock).decode()
    made = re.search(r"(?im)^X-Request-Id: ([0-9a-f]{16})\r$", head)
    assert head.startswith("HTTP/1.1 404 ") and made, head
    (line,) = _lines(proc, f"id={made[1]} ")
    assert line.startswith("onnxpipe serve: GET /v2/models/nope 404 ") and "model=nope" in line, line


def test_a_body_refused_before_it_is_sent_is_logged(servers: dict[str, ServerProcess]) -> None:
    """``Expect: 100-continue`` with a body over the limit: refused before the body, outside the middleware."""
    proc = servers["quiet"]
    given = _ids()
    with socket.create_connection(("127.0.0.1", proc.http_port)) as sock:
        sock.sendall(f"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nX-Request-Id: {given}\r\n"
                     f"Content-Length: {10 * LIMIT}\r\nExpect: 100-continue\r\n\r\n".encode())
        assert read_head(sock).startswith(b"HTTP/1.1 413 ")
    (line,) = _lines(proc, f"id={given} ")
    assert line.startswith("onnxpipe serve: POST /v2/models/twoout/infer 413 ") and line.endswith(
        f": the body has {10 * LIMIT} bytes; this server takes at most {LIMIT} (--max-body-size)"), line


def test_numbers_out_of_a_tensors_range_are_400s_and_no_numpy_warning(servers: dict[str, ServerProcess]) -> None:
    """Values numpy would wrap or make infinite are refused before any cast (as Triton's open PR 8821
    for its narrow integers); the casts that may overflow are silenced and checked (``_tensors``)."""
    proc = servers["quiet"]
    ids = {"name": "ids", "datatype": "INT64", "shape": [1, 2]}
    for model, tensor, message in [
        ("twoout", {**X, "data": [1.0, -1e300, 3.5e38, 1e308]}, "input 'X' is FP32: value -1e+300 is out of its range -3.4028235e+38..3.4028235e+38"),
        ("twoout", {**X, "data": [2**200, 1, 2, 3]}, f"input 'X' is FP32: value {2**200} is out of its range -3.4028235e+38..3.4028235e+38"),
        ("twoout", {**X, "data": [1.5, 2**1100, 2, 3]}, "input 'X' is FP32: value "),
        ("mlp", {**ids, "data": [-(2**63) - 1, 1]}, f"input 'ids' is INT64: value -9223372036854775809 is out of its range {INT64_RANGE}"),
        ("mlp", {**ids, "data": [1.5, 2**70]}, "input 'ids' is INT64, but 'data' holds fractional numbers"),
    ]:
        status, answer = _post(proc, model, {"inputs": [tensor]}, AUTH)
        assert status == 400 and answer["error"].startswith(message), (tensor, answer)
    log = _settled(proc)
    assert "Warning" not in log and "overflow" not in log, log


def test_a_request_cannot_write_a_line_of_its_own(servers: dict[str, ServerProcess]) -> None:
    """What a client chooses (its id, its path) reaches a text line with its control characters escaped: no forged line, no colour."""
    proc = servers["access"]
    forged = f"{_ids()}\nonnxpipe serve: ready: forged\x1b[31m"
    status, _ = _post(proc, "twoout", {"id": forged, "inputs": [{**X, "datatype": "INT8"}]})
    assert status == 400
    log = _settled(proc)
    (line,) = [line for line in log.splitlines() if "forged" in line]
    assert "id=" + forged.encode("unicode_escape").decode() + " peer=" in line and ANSI not in log, line
    assert proc.get("/v2/models/a%0Ab%1B")[0] == 404
    assert "GET /v2/models/a\\nb\\x1b 404 " in _settled(proc)


def test_a_file_of_the_repository_cannot_write_a_line_of_its_own(made: dict[str, Path], tmp_path: Path) -> None:
    """Issue 36 item 11: the names of a repository's entries reach the "skipped" lines (and the error
    of a repository with no model) with their control characters escaped: no forged line, no colour."""
    evil = "notes\nonnxpipe serve: ready: http:evil:1\x1b[31m.txt"
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / evil).write_text("not a bundle")
    escaped = str(repo / evil).encode("unicode_escape").decode()
    http = str(free_ports(1)[0])
    done = subprocess.run([sys.executable, "-m", "onnxpipe.cli", "serve", "--model-repository", repo, "--http-port", http, "--grpc-port", "0",
                           "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and ANSI not in done.stderr, done.stderr
    assert done.stderr.splitlines() == [f"error: model repository '{repo}' holds no bundle (folders with a manifest.json, .onnxpipe archives, or "
                                        f"NAME/VERSION/ folders holding one): '{evil.encode('unicode_escape').decode()}' is not a bundle (a folder "
                                        "with a manifest.json, or a .onnxpipe archive)"], done.stderr
    shutil.copytree(made["twoout"], repo / "pair")
    shutil.copytree(made["twoout"], repo / "m\x1b[2J")  # a bundle named so that clients cannot call it: its line is escaped too
    with ServerProcess("--model-repository", repo, grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.stop() == 0
    log = proc.log()
    assert ANSI not in log and "\x1b" not in log, log
    (ready,) = [line for line in log.splitlines() if line.startswith("onnxpipe serve: ready: ")]
    assert ready.startswith(f"onnxpipe serve: ready: http://127.0.0.1:{proc.http_port}, ") and ready.endswith(" (pair)"), log
    skipped = [line for line in log.splitlines() if "skipped" in line]
    assert skipped == [f"onnxpipe serve: skipped {str(repo / 'm') + chr(92) + 'x1b[2J'}: named so that clients cannot call it: a model's name is letters, "
                       "digits, '_', '.' and '-', starting with a letter or digit; rename it",
                       f"onnxpipe serve: skipped {escaped}: not a bundle (a folder with a manifest.json, or a .onnxpipe archive)"], log


def test_json_lines_in_process_carry_a_bugs_traceback_and_pythons_warnings() -> None:
    """``configured`` on its own (as ``serve`` calls it): a line with a bug's traceback, a Python warning as a line of the run's format;
    an application's own handlers are left alone."""
    root = logging.getLogger()
    kept = root.handlers[:]
    root.handlers.clear()  # pytest's own; a process that configured nothing has none
    out = io.StringIO()
    try:
        with configured("json", out):
            try:
                raise KeyError("boom")
            except KeyError as e:
                log_request(Request("grpc", "ModelInfer", "/inference.GRPCInferenceService/ModelInfer", "m", None, 500, "INTERNAL", 1.5, "r1",
                                    "127.0.0.1:1", "internal error: KeyError: 'boom'"), e)
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        assert not root.handlers  # taken away after
        root.addHandler(handler := logging.StreamHandler(io.StringIO()))
        with configured("json"):
            assert root.handlers == [handler]  # an application's logging: its handlers only
    finally:
        root.handlers[:] = kept
    bug, warned = (json.loads(line) for line in out.getvalue().splitlines())
    assert (bug["level"], bug["event"], bug["status"], bug["grpc_status"], bug["request_id"]) == ("error", "request", 500, "INTERNAL", "r1"), bug
    assert bug["exc"].startswith("Traceback (most recent call last):") and bug["exc"].endswith("KeyError: 'boom'"), bug
    assert (warned["logger"], warned["level"], warned["event"]) == ("py.warnings", "warning", "log") and "a library's warning" in warned["message"], warned
    with pytest.raises(ValueError, match="unknown log format 'xml'; valid: text, json"), configured("xml"):
        pass
    with pytest.raises(ConfigError, match="unknown log format 'xml'; valid: text, json"):
        ServeOptions(log_format="xml")


def test_onnxpipe_run_says_a_stage_failure_once(made: dict[str, Path], tmp_path: Path) -> None:
    """The runtime's side of it: a failed run's onnxruntime line is off for ``onnxpipe run`` too, whose own error line is as it was."""
    inputs = tmp_path / "x.npz"
    np.savez(inputs, x=np.zeros((3, 4), np.float32))
    done = subprocess.run([sys.executable, "-m", "onnxpipe.cli", "run", str(made["failing"]), "--inputs", str(inputs), "--outputs", str(tmp_path / "y.npz")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: inputs file '{inputs}': stage 'reshape' failed on request 0: ") and "cannot be reshaped" in line, done.stderr
