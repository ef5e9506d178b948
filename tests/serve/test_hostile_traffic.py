"""What one client can do to everyone else (issues 28 and 36), driven against a real ``onnxpipe
serve`` on loopback with raw sockets and Triton's clients: the answer's size is bounded before it is
built, memory follows the bytes received (never a declared ``Content-Length``) and stays within
``--max-inflight`` x ``--max-body-size`` for compressed and JSON bodies too, compressed bodies
inflate off the event loop, a stuck JSON worker holds only the requests it has, connections are
capped and timed out, and what aiohttp's parser refuses is one JSON 400 and one log line. Each
attack ends with the server ready, a normal request answered, RSS and open descriptors back within
a bound, and no traceback in the log."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import signal
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.serve.conftest import serve_args
from tests.serve.process import ServerProcess, read_head, unread_bytes
from tests.serve.test_hostile import _raw
from tests.waiting import until

MIB = 1 << 20
#: The server of this module: small limits, so the attacks are quick to mount.
ARGS = ("--idle-timeout", "1", "--max-connections", "40", "--max-body-size", "8MiB", "--max-inflight", "4", "--body-timeout", "3")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cpu_ticks(pid: int) -> tuple[int, int]:
    """CPU time (clock ticks) of the process's main thread, where its event loop runs, and of all its threads."""
    def ticks(stat: Path) -> int:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    threads = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended as it was read
            threads += ticks(task / "stat")
    return ticks(Path(f"/proc/{pid}/task/{pid}/stat")), threads


def _peak_from_now(pid: int) -> Callable[[], float]:
    """The process's peak RSS (MB) from now on, as a function to call later (the kernel's high-water
    mark, reset now: no spike between two samples is missed)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")

    def peak() -> float:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM")

    return peak


def _post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """``POST`` on a connection of its own: (status, body); status 0 when nothing answered in time."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException):
        return 0, b""
    finally:
        conn.close()


class _Prober:
    """A client's health checks on a keep-alive connection of its own, one after another, with their
    latencies (s), for as long as it runs."""

    def __init__(self, port: int) -> None:
        self.latencies: list[float] = []
        self._port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=30)
        while not self._stop.is_set():
            started = time.perf_counter()
            conn.request("GET", "/v2/health/live")
            assert conn.getresponse().read() == b'{"live":true}'
            self.latencies.append(time.perf_counter() - started)
            self._stop.wait(0.002)
        conn.close()

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.fixture(scope="module")
def proc(bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(*serve_args(bundles, "twoout", "squeeze"), *ARGS) as p:
        p.start(tmp_path_factory.mktemp("hostile") / "serve.log")
        yield p


def _works(proc: ServerProcess) -> None:
    """A normal client is answered, and the server is ready."""
    client = httpclient.InferenceServerClient(proc.http)
    tensor = httpclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    assert client.infer("twoout", [tensor]).as_numpy("Y").shape == (1, 4)
    assert proc.get("/v2/health/ready")[0] == 200


def _no_traceback(proc: ServerProcess) -> None:
    assert "Traceback" not in proc.log(), proc.log()[-3000:]


def test_an_output_asked_for_twice_is_a_400_and_the_answer_is_never_multiplied(proc: ServerProcess) -> None:
    """The issue's request: squeezenet's output listed 100,000 times (6.6 MiB) made a 391 MiB answer."""
    assert proc.proc is not None
    before = _rss_mb(proc.proc.pid)
    image = np.zeros((1, 3, 224, 224), np.float32)
    header = {"inputs": [{"name": "data_0", "datatype": "FP32", "shape": [1, 3, 224, 224], "parameters": {"binary_data_size": image.nbytes}}],
              "outputs": [{"name": "softmaxout_1", "parameters": {"binary_data": True}}] * 100_000}
    text = json.dumps(header).encode()
    status, body = proc.request("POST", "/v2/models/squeeze/infer", text + image.tobytes(), {"Inference-Header-Content-Length": str(len(text))})
    assert status == 400 and json.loads(body) == {"error": "output 'softmaxout_1' is asked for twice; ask for each output once"}
    assert _rss_mb(proc.proc.pid) - before < 100
    client = grpcclient.InferenceServerClient(proc.grpc)
    tensor = grpcclient.InferInput("data_0", [1, 3, 224, 224], "FP32")
    tensor.set_data_from_numpy(image)
    asked = [grpcclient.InferRequestedOutput("softmaxout_1")] * 20_000
    with pytest.raises(InferenceServerException, match="output 'softmaxout_1' is asked for twice") as e:
        client.infer("squeeze", [tensor], outputs=asked)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    _works(proc)


def test_a_declared_content_length_allocates_nothing_before_the_bytes_arrive(proc: ServerProcess) -> None:
    """20 connections announce 8 MiB bodies and send nothing (the issue's 20 x 64 MiB: +1.3 GB):
    RSS stays put while they wait, and they are refused 408 at --body-timeout."""
    assert proc.proc is not None
    before = _rss_mb(proc.proc.pid)
    sockets = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", proc.http_port))
        s.sendall(b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n")
        sockets.append(s)
    until(lambda: all(unread_bytes(s) == 0 for s in sockets), "the server has read every head")
    assert _rss_mb(proc.proc.pid) - before < 30, "memory followed the declared length, not the bytes"
    for s in sockets:
        s.close()
    _works(proc)
    _no_traceback(proc)


def test_the_bodies_held_at_once_are_bounded_across_connections(proc: ServerProcess) -> None:
    """--max-inflight 4 x --max-body-size 8 MiB: 32 MiB of bodies held at once across every
    connection. Five clients each send 7 MiB of an 8 MiB body and wait: the fifth is refused 503
    (the budget), the others time out 408; every byte is given back."""
    assert proc.proc is not None
    sockets = []
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", proc.http_port), timeout=10)
        s.sendall(b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n" + b" " * (7 * MIB))
        sockets.append(s)
    statuses = []
    for s in sockets:
        answer = read_head(s)
        statuses.append(int(answer.split()[1]) if answer else 0)
        s.close()
    assert sorted(statuses) == [408, 408, 408, 408, 503], statuses
    _works(proc)


def test_slow_and_idle_connections_are_closed_at_the_idle_timeout(proc: ServerProcess) -> None:
    """--idle-timeout 1: a slowloris client (one header line every 0.3 s), one that sends nothing
    and a kept-alive one after its answer are all closed by it (nothing else would close them within
    the 30 s the test waits: aiohttp keeps a connection alive 75 s)."""
    slow = socket.create_connection(("127.0.0.1", proc.http_port))
    slow.sendall(b"GET /v2/health/ready HTTP/1.1\r\n")
    silent = socket.create_connection(("127.0.0.1", proc.http_port))
    kept = socket.create_connection(("127.0.0.1", proc.http_port))
    kept.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    closed_at: dict[str, float] = {}
    for s in (slow, silent, kept):
        s.settimeout(0.3)
    while len(closed_at) < 3 and time.monotonic() - started < 30:
        for name, s in (("slow", slow), ("silent", silent), ("kept", kept)):
            if name in closed_at:
                continue
            try:
                if name == "slow":
                    slow.sendall(b"X-Slow: 1\r\n")
                if s.recv(4096) == b"":
                    closed_at[name] = time.monotonic() - started
            except TimeoutError:
                pass
            except OSError:
                closed_at[name] = time.monotonic() - started
    for s in (slow, silent, kept):
        s.close()
    assert set(closed_at) == {"slow", "silent", "kept"}, closed_at
    _works(proc)


def test_connections_over_the_cap_are_answered_503_and_the_server_stays_reachable(proc: ServerProcess) -> None:
    """--max-connections 40: 60 idle connections; the 20 over the cap are answered 503 with the
    JSON error at once and closed; once the idle ones time out a new client is served, and the
    descriptors come back."""
    assert proc.proc is not None
    time.sleep(1.5)  # earlier tests' connections gone
    fds = _fds(proc.proc.pid)
    held = [socket.create_connection(("127.0.0.1", proc.http_port)) for _ in range(60)]
    refused = 0
    for s in held:
        s.settimeout(0.2)
        try:
            answer = s.recv(4096)
        except TimeoutError:
            continue
        if answer.startswith(b"HTTP/1.1 503"):
            assert b'"error": "the server holds 40 connections, the most it takes (--max-connections); retry later"' in answer
            refused += 1
    assert refused >= 20 and 60 - refused <= 40  # earlier clients' kept-alive connections may still count
    for s in held:
        s.close()
    until(lambda: _fds(proc.proc.pid) <= fds + 5, "the server let the closed connections go")  # type: ignore[union-attr]
    _works(proc)
    assert "refused" in proc.log() and "--max-connections" in proc.log()
    assert _fds(proc.proc.pid) <= fds + 5


@pytest.mark.parametrize(("name", "request_bytes"), [
    ("a header over 8 KiB", b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"),
    ("a NUL in a header", b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Nul: a\x00b\r\n\r\n"),
    ("a bad chunk size", b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"),
    ("an HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("a TLS hello", bytes.fromhex("16030100a5010000a10303") + bytes(range(32)) + b"\x00" * 40),
], ids=lambda v: v if isinstance(v, str) else "")
def test_what_the_http_parser_refuses_is_one_json_400_and_one_log_line(proc: ServerProcess, name: str, request_bytes: bytes) -> None:
    status, body = _raw(proc, request_bytes, linger=1.0)
    assert status == 400, (name, status, body)
    assert "error" in json.loads(body), body
    _no_traceback(proc)
    _works(proc)


def test_expect_continue_over_the_limit_is_refused_before_the_body(proc: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", proc.http_port), timeout=5) as s:
        s.sendall(b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\nExpect: 100-continue\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer
    assert b"this server takes at most 8388608 (--max-body-size)" in answer
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}).encode()
    with socket.create_connection(("127.0.0.1", proc.http_port), timeout=5) as s:
        s.sendall(b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(("value", "why"), [
    ("\u00b2", "is not a number of bytes (ASCII digits, at most 19)"),
    ("\u0663", "is not a number of bytes"),  # an Arabic-Indic 3
    ("\uff13", "is not a number of bytes"),  # a fullwidth 3
    ("9" * 4301, "(4301 characters)"),
])
def test_header_lengths_are_ascii_digits_of_bounded_length(proc: ServerProcess, value: str, why: str) -> None:
    body = json.dumps({"inputs": []}).encode()
    request = b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nInference-Header-Content-Length: %s\r\n\r\n" % (
        len(body), value.encode())
    status, answer = _raw(proc, request + body, linger=1.0)
    assert status == 400 and why in json.loads(answer)["error"], answer
    _no_traceback(proc)


def test_bytes_after_a_gzip_stream_are_refused(proc: ServerProcess) -> None:
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}).encode()
    status, answer = proc.request("POST", "/v2/models/twoout/infer", gzip.compress(body) + b"junk", {"Content-Encoding": "gzip"})
    assert status == 400 and json.loads(answer) == {"error": "4 byte(s) follow the end of the gzip stream; send one stream, nothing after it"}
    assert proc.request("POST", "/v2/models/twoout/infer", gzip.compress(body), {"Content-Encoding": "gzip"})[0] == 200


def test_an_unparsable_grpc_message_is_invalid_argument_naming_the_message(proc: ServerProcess) -> None:
    import grpc

    with grpc.insecure_channel(proc.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff\xff", timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the message is not a valid ModelInferRequest" in e.value.details()
    _no_traceback(proc)
    _works(proc)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (whichever of its threads started them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _echo_bundle(root: Path) -> Path:
    from benchmarks.serve_faults import echo_bundle

    return echo_bundle(root)


def test_a_large_json_request_is_decoded_by_the_json_worker_exactly_and_its_mistakes_are_400s(tmp_path: Path) -> None:
    """A 2 MiB JSON tensor (over the worker's 1 MiB) comes back equal; a mistake in one is the same
    400 the server's own decoding gives; a worker killed mid-work is replaced (that request 503),
    and the next large request is answered."""
    import signal as signals

    with ServerProcess(f"echo={_echo_bundle(tmp_path)}", "--max-body-size", "32MiB") as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.proc is not None
        values = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
        body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [values.size], "data": values.tolist()}]}).encode()
        assert len(body) > 2 * MIB
        status, answer = proc.request("POST", "/v2/models/echo/infer", body)
        assert status == 200
        np.testing.assert_array_equal(np.array(json.loads(answer)["outputs"][0]["data"], np.float32), values)
        wrong = body.replace(b'"shape": [200000]', b'"shape": [200001]')
        status, answer = proc.request("POST", "/v2/models/echo/infer", wrong)
        assert status == 400 and json.loads(answer) == {"error": "input 'X': 'data' holds 200000 values; shape [200001] takes 200001"}
        workers = [pid for pid in _children(proc.proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1  # the JSON worker (not spawn's resource tracker, its other child)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signals.SIGKILL)
            _gone(pid)
        statuses = [proc.request("POST", "/v2/models/echo/infer", body)[0] for _ in range(2)]
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
        assert proc.get("/v2/health/ready")[0] == 200
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def test_inputs_giving_one_named_dim_two_sizes_are_a_400_not_a_stage_failure(server: ServerProcess) -> None:
    """``labelled`` takes ``x [N, 4]`` and ``prefix [N]``: 2 rows of one and 3 of the other failed
    inside its code stage as a 500 (the issue); the request's fault is named before it runs."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [0.0] * 8},
                                  {"name": "prefix", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]}]}).encode()
    status, answer = server.request("POST", "/v2/models/labelled/infer", body)
    assert status == 400, answer
    assert json.loads(answer) == {"error": "inputs 'prefix' and 'x' give dim 'N' the sizes 3 and 2; the model names that dim in both, so they must agree"}
    client = grpcclient.InferenceServerClient(server.grpc)
    x = grpcclient.InferInput("x", [2, 4], "FP32")
    x.set_data_from_numpy(np.zeros((2, 4), np.float32))
    prefix = grpcclient.InferInput("prefix", [3], "BYTES")
    prefix.set_data_from_numpy(np.array([b"a", b"b", b"c"], dtype=object))
    with pytest.raises(InferenceServerException, match="give dim 'N' the sizes 3 and 2") as e:
        client.infer("labelled", [x, prefix])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"


def _zeros_json(count: int, **request: object) -> bytes:
    """A JSON request of ``count`` FP32 zeros for ``echo`` (``0,`` each: 2 bytes a value, 4 as an array)."""
    head = json.dumps({"parameters": {}, **request})[:-1].encode()
    return head + b', "inputs": [{"name": "X", "datatype": "FP32", "shape": [%d], "data": [' % count + b"0," * (count - 1) + b"0]}]}"


BUDGET = "(134217728: --max-inflight x --max-body-size)"


@pytest.mark.parametrize("encoding", ["gzip", None])
def test_compressed_and_json_bodies_are_held_within_the_budget(encoding: str | None, tmp_path: Path) -> None:
    """The issue's 8 gzip'd JSON tensors of zeros (60 KiB on the wire for 60 MiB): all answered, and
    the server's peak RSS grew 2.1 GB. --max-inflight 4 x --max-body-size 32 MiB: 8 clients at once
    each send a JSON tensor of 8 M zeros (16 MiB, 16 KiB gzip'd; 32 MiB as an array, as the model's
    output and as the answer), as it comes and compressed: each is answered or refused 503 naming a
    limit, some are answered right, and the server's peak RSS stays within the 128 MiB budget plus
    one request's outputs (counted once the model made them) and 16 MB for the allocator (before:
    +250 and +292 MB); a request whose JSON answer cannot fit the budget at all is a 413 naming it."""
    count = 8 << 20
    body = _zeros_json(count, parameters={"binary_data_output": True})
    headers = {"Content-Type": "application/json"}
    if encoding is not None:
        body = gzip.compress(body)
        headers["Content-Encoding"] = encoding
        assert len(body) < 64 << 10
    with ServerProcess(f"echo={_echo_bundle(tmp_path)}", "--max-body-size", "32MiB", "--max-inflight", "4", grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.proc is not None
        before = _rss_mb(proc.proc.pid)
        peak = _peak_from_now(proc.proc.pid)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(proc.http_port, "/v2/models/echo/infer", body, headers), range(8)))
        grown = peak() - before
        refusals = {json.loads(a)["error"] for status, a in answers if status == 503}
        assert all(status in (200, 503) for status, _ in answers), answers
        assert all(BUDGET in r or "its limit (--max-inflight)" in r for r in refusals), refusals
        ok = [a for status, a in answers if status == 200]
        assert ok, refusals
        for answer in ok:
            length = len(answer) - count * 4
            assert json.loads(answer[:length])["outputs"][0]["parameters"] == {"binary_data_size": count * 4}
            assert not np.frombuffer(answer[length:], np.float32).any()
        assert grown < 128 + 32 + 16, f"the server's RSS grew {grown:.0f} MB, past the 128 MiB budget, one request's outputs and a margin"
        # Its answer as JSON may take 33 bytes a value (a double's 24 characters, its comma, the float64 copy): never in 128 MiB.
        status, answer = _post(proc.http_port, "/v2/models/echo/infer", _zeros_json(count), headers={"Content-Type": "application/json"})
        assert status == 413, answer
        error = json.loads(answer)["error"]
        assert error.startswith("this request would hold ") and "for its answer), more than it holds for all requests at once " + BUDGET in error
        _works_echo(proc)
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def _works_echo(proc: ServerProcess, size: int = 4) -> None:
    """``echo`` answers a JSON request of ``size`` values right."""
    values = np.arange(size, dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [size], "data": values.tolist()}]}).encode()
    status, answer = _post(proc.http_port, "/v2/models/echo/infer", body)
    assert status == 200, answer
    np.testing.assert_array_equal(np.array(json.loads(answer)["outputs"][0]["data"], np.float32), values)


def test_deflate_bombs_inflate_off_the_loop_after_admission_within_the_limit(bundles: dict[str, Path], tmp_path: Path) -> None:
    """The issue's 20 deflate bombs (64 KiB inflating to 64 MiB), 4 at a time, held a health check
    2.7 s: inflated on the event loop. Now each is inflated after admission, off the loop, and
    refused 413 at --max-body-size; the event loop's thread spends a small part of the CPU they cost
    while a health check on its own connection is answered throughout, and the server's RSS stays
    within --max-inflight x --max-body-size."""
    bomb = zlib.compress(b"\0" * (65 * MIB), 9)
    assert len(bomb) < 80 << 10
    with ServerProcess(*serve_args(bundles, "twoout"), "--max-body-size", "64MiB", "--max-inflight", "5", grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.proc is not None
        before = _rss_mb(proc.proc.pid)
        peak = _peak_from_now(proc.proc.pid)
        # Not admitted, not inflated: an unknown model's bomb is its 404.
        status, answer = _post(proc.http_port, "/v2/models/nope/infer", bomb, {"Content-Encoding": "deflate"})
        assert status == 404 and json.loads(answer) == {"error": "unknown model 'nope'; valid: 'twoout'"}
        loop_before, all_before = _cpu_ticks(proc.proc.pid)
        with _Prober(proc.http_port) as prober, ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _post(proc.http_port, "/v2/models/twoout/infer", bomb, {"Content-Encoding": "deflate"}), range(20)))
        loop_after, all_after = _cpu_ticks(proc.proc.pid)
        loop, others = loop_after - loop_before, (all_after - all_before) - (loop_after - loop_before)
        grown = peak() - before
        refused = {"error": "the deflate body inflates to over 67108864 bytes, the most this server takes (--max-body-size)"}
        assert all(status == 413 and json.loads(a) == refused for status, a in answers), answers
        assert len(prober.latencies) > 20  # it was probing throughout
        # Inflated off the loop: the other threads spent far more CPU than the event loop's (which
        # also answered every health check); on the loop, the loop's thread would have spent it all.
        assert others > 2 * loop, f"the event loop's thread spent {loop} CPU ticks during the bombs, the others {others}"
        assert grown < 5 * 64 + 64, f"the server's RSS grew {grown:.0f} MB, past --max-inflight 5 x --max-body-size 64 MiB and a margin"
        _works(proc)
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def _json_worker(pid: int) -> int:
    """The server's one JSON worker process (not spawn's resource tracker, its other child)."""
    workers = [child for child in _children(pid) if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]
    assert len(workers) == 1, workers
    return workers[0]


def _gone(pid: int, within: float = 30) -> None:
    """Wait until ``pid`` has ended, every thread of it (its first thread is a zombie before the others end)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:  # reaped, or a thread ended as it was read
            states = ["X"] if not Path(f"/proc/{pid}").exists() else ["?"]
        if all(state in ("Z", "X") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not end within {within:g} s")


def _large_json(size: int = 300_000) -> tuple[bytes, np.ndarray]:
    values = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [size], "data": values.tolist()}]}).encode()
    assert len(body) > 2 * MIB  # the worker's (1 MiB or more)
    return body, values


@contextlib.contextmanager
def _stuck_worker(tmp_path: Path, *args: str) -> Iterator[tuple[ServerProcess, int]]:
    """A server of ``echo`` (with ``args``) whose one JSON worker is stopped (SIGSTOP), and that
    worker's pid; the worker is continued after, if it still runs."""
    with ServerProcess(f"echo={_echo_bundle(tmp_path)}", "--max-body-size", "32MiB", *args, grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.proc is not None
        stuck = _json_worker(proc.proc.pid)
        os.kill(stuck, signal.SIGSTOP)
        try:
            yield proc, stuck
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGCONT)


def test_a_stuck_json_worker_holds_only_its_requests_and_is_replaced_past_json_timeout(tmp_path: Path) -> None:
    """The issue: with the JSON worker stuck (SIGSTOP), every JSON and binary request of 1 MiB or
    more hung for the client's whole 25 s: the JSON requests' waits held every thread of asyncio's
    default executor, which large binary requests use too. Now 8 JSON requests wait on the stopped
    worker while a 8 MiB binary request is answered, before any of them; each is answered 503
    naming --json-timeout within its two deadlines (the wait for a worker, then its hold), the
    stopped worker is killed and another started, and JSON requests are answered again."""
    with _stuck_worker(tmp_path, "--json-timeout", "3") as (proc, stuck):
        body, _ = _large_json()
        x = np.random.default_rng(1).standard_normal(2 * MIB).astype(np.float32)
        head = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [x.size], "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True}}).encode()
        answered: list[str] = []
        with ThreadPoolExecutor(9) as pool:

            def send_json(_: int) -> tuple[int, bytes]:
                status, answer = _post(proc.http_port, "/v2/models/echo/infer", body)
                answered.append("json")
                return status, answer

            waiting = [pool.submit(send_json, k) for k in range(8)]
            time.sleep(0.5)  # let them reach the worker's queue (the order asserted below does not depend on it)
            binary = _post(proc.http_port, "/v2/models/echo/infer", head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head))})
            answered.append("binary")
            refused = [f.result() for f in waiting]
        assert binary[0] == 200, binary
        length = int(len(binary[1]) - x.nbytes)
        np.testing.assert_array_equal(np.frombuffer(binary[1][length:], np.float32), x)
        assert answered[0] == "binary", answered
        # Each was answered by the server's --json-timeout (the 503 names it), not left for the
        # client to give up on after 60 s (the issue: hung for the client's whole 25 s).
        for status, answer in refused:
            assert status == 503, answer
            assert json.loads(answer)["error"] in (
                "the request's JSON was not decoded within 3 s (--json-timeout); retry later, or send large tensors as binary data",
                "no JSON worker was free to decode the request within 3 s (--json-timeout; --json-workers 1); retry later, or send large "
                "tensors as binary data",
            ), answer
        _gone(stuck)  # killed, stopped as it was
        assert "a JSON worker process took over 3 s (--json-timeout) on a request: killed; starting another" in proc.log()
        _answered_again(proc, body)
        assert _json_worker(proc.proc.pid) != stuck
        assert proc.get("/v2/health/ready")[0] == 200
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def _answered_again(proc: ServerProcess, body: bytes, within: float = 60) -> None:
    """A large JSON request is answered 200 once the new worker has started (until then, 503 naming the time it may wait)."""
    deadline = time.monotonic() + within
    while True:
        status, answer = _post(proc.http_port, "/v2/models/echo/infer", body)
        if status == 200 or time.monotonic() > deadline:
            break
        assert status == 503 and (b"(--json-timeout" in answer or b"(--request-timeout)" in answer), answer
    assert status == 200, answer


def test_a_json_worker_that_died_while_idle_costs_no_request(tmp_path: Path) -> None:
    """The issue: a worker killed while idle cost the next request a 503. Now the request finds it
    ended, and waits for its replacement: the first request after the kill is answered."""
    with ServerProcess(f"echo={_echo_bundle(tmp_path)}", "--max-body-size", "32MiB", grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.proc is not None
        body, values = _large_json()
        worker = _json_worker(proc.proc.pid)
        os.kill(worker, signal.SIGKILL)
        _gone(worker)
        status, answer = _post(proc.http_port, "/v2/models/echo/infer", body)
        assert status == 200, answer
        np.testing.assert_array_equal(np.array(json.loads(answer)["outputs"][0]["data"], np.float32), values)
        assert "a JSON worker process had ended while idle; starting another" in proc.log()
        assert _json_worker(proc.proc.pid) != worker
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def test_request_timeout_bounds_a_json_requests_wait_on_a_stuck_worker(tmp_path: Path) -> None:
    """The issue's JSON requests hung 25 s even with --request-timeout 5. With --request-timeout 1,
    a JSON request on a stopped worker is answered 503 naming it after a second; the worker, left
    to finish, is killed at --json-timeout all the same, and another takes the next request."""
    with _stuck_worker(tmp_path, "--request-timeout", "1", "--json-timeout", "3") as (proc, stuck):
        body, _ = _large_json()
        status, answer = _post(proc.http_port, "/v2/models/echo/infer", body)
        # --request-timeout's 1 s answered, before --json-timeout's 3 s could (and long before the client's 60 s).
        assert (status, json.loads(answer)) == (503, {"error": "Request timeout expired: model 'echo' had not started the request 1 s after it "
                                                                "came in (--request-timeout); retry later, or give it more time"})
        _gone(stuck)
        assert "a JSON worker process took over 3 s (--json-timeout) on a request: killed; starting another" in proc.log()
        _answered_again(proc, body)
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()
