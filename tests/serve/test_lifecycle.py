"""The server's lifetime as a deployment host sees it: ready only once loaded, failures at start
are one line and exit 1 (or partial), the token guards everything but health, a repository
folder serves what it holds, and SIGTERM drains: every admitted request is answered, later ones
get 503, and it exits 0 leaving no process behind."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.serve.conftest import serve_args
from tests.serve.process import ROOT, ServerProcess, free_ports, read_head, unread_bytes
from tests.waiting import until

SLOW = (256, 1024)


def _slow_request(client: httpclient.InferenceServerClient, k: float) -> np.ndarray:
    tensor = httpclient.InferInput("x", list(SLOW), "FP32")
    tensor.set_data_from_numpy(np.full(SLOW, k, np.float32))
    return client.infer("slow", [tensor]).as_numpy("y")


def _send_slow(proc: ServerProcess, count: int) -> tuple[list[threading.Thread], dict[int, object]]:
    """``count`` slow requests, each from a thread of its own (started); the threads, and where
    each puts its answer (or its exception) by number."""
    results: dict[int, object] = {}

    def send(k: int) -> None:
        try:
            results[k] = _slow_request(httpclient.InferenceServerClient(proc.http, network_timeout=120), float(k))
        except Exception as e:
            results[k] = e

    threads = [threading.Thread(target=send, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    return threads, results


def _metric(proc: ServerProcess, name: str) -> float:
    text = proc.get("/metrics")[1].decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_sigterm_answers_every_admitted_request_refuses_later_ones_and_exits_0(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "slow")) as proc:
        proc.start(tmp_path / "serve.log")
        threads, results = _send_slow(proc, 32)
        deadline = time.monotonic() + 60
        # All 32 admitted (answered or in flight) before the signal, and most still in flight.
        while _metric(proc, "onnxpipe_inflight_requests") + _metric(proc, "onnxpipe_requests_total") < 32 and time.monotonic() < deadline:
            time.sleep(0.005)
        in_flight = _metric(proc, "onnxpipe_inflight_requests")
        children = _children(proc.proc.pid)  # type: ignore[union-attr]
        proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        until(lambda: "draining: " in proc.log(), "the drain began")
        status, answer = proc.request("POST", "/v2/models/slow/infer", json.dumps({"inputs": []}).encode())
        later_refused = status == 503 and b"the server is shutting down" in answer
        for t in threads:
            t.join(120)
        code = proc.stop()
    assert in_flight >= 4, f"only {in_flight} requests were in flight at SIGTERM: the test did not test the drain"
    assert later_refused, f"a request during the drain got {status}: {answer!r}"
    assert code == 0, proc.log()
    for k in range(32):
        assert isinstance(results[k], np.ndarray), f"request {k}: {results[k]!r}"
        np.testing.assert_allclose(results[k], np.full(SLOW, k, np.float32), rtol=1e-5)  # type: ignore[arg-type]
    assert re.search(r"draining: \d+ request\(s\) in flight", proc.log()), proc.log()
    assert all(not _alive(pid) for pid in [proc.proc.pid, *children]), "a process of the server is still running"  # type: ignore[union-attr]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _serve(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``onnxpipe serve ARGS`` that is expected to exit by itself (with no metrics port unless given: tests in parallel would all take 8002)."""
    given = [str(a) for a in args]
    given += [] if "--metrics-port" in given else ["--metrics-port", "0"]
    return subprocess.run([sys.executable, "-m", "onnxpipe.cli", "serve", *given], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_a_model_that_cannot_load_is_one_line_and_exit_1(bundles: dict[str, Path], tmp_path: Path) -> None:
    http, grpc_port = free_ports(2)
    line = _error_line(_serve(*serve_args(bundles, "twoout", "labelled"), "--http-port", http, "--grpc-port", grpc_port))
    assert line.startswith(f"error: model 'labelled' ({bundles['labelled']}): ") and "'tests.code_stages:label' (stage 'label')" in line, line
    line = _error_line(_serve(bundles["twoout"].parent, "--http-port", http, "--grpc-port", 0))
    assert "is not a bundle" in line
    line = _error_line(_serve("--http-port", http))
    assert line == "error: no model to serve: give bundles (PATH or NAME=PATH) or a model repository folder"
    line = _error_line(_serve(f"bad name={bundles['twoout']}", "--http-port", http))
    assert "model name 'bad name'" in line and "letters, digits" in line
    with ServerProcess(*serve_args(bundles, "twoout")) as holder:
        holder.start(tmp_path / "holder.log")
        line = _error_line(_serve(*serve_args(bundles, "twoout"), "--http-port", holder.http_port, "--grpc-port", 0))
        assert f"cannot listen on 127.0.0.1:{holder.http_port} (HTTP)" in line
        line = _error_line(_serve(*serve_args(bundles, "twoout"), "--http-port", http, "--grpc-port", holder.grpc_port))
        assert f"cannot listen on 127.0.0.1:{holder.grpc_port} (gRPC)" in line
        assert holder.stop() == 0


def test_allow_partial_serves_what_loads_and_names_what_did_not(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "twoout", "labelled"), "--allow-partial") as proc:
        proc.start(tmp_path / "serve.log")
        status, answer = proc.get("/v2/models/labelled/ready")
        assert status == 503 and b"model 'labelled' is not available: it failed to load" in answer
        assert proc.get("/v2/models/twoout/ready")[0] == 200
        assert "not serving model 'labelled'" in proc.log()
        assert proc.stop() == 0


def test_strict_readiness_answers_not_ready_while_a_model_failed_and_serves_the_rest(bundles: dict[str, Path], tmp_path: Path) -> None:
    """Triton's --strict-readiness: with --allow-partial, what loaded is served, and readiness (HTTP
    and gRPC) says something is wrong; without it the server is ready (the test above)."""
    with ServerProcess(*serve_args(bundles, "twoout", "labelled"), "--allow-partial", "--strict-readiness") as proc:
        proc.start(tmp_path / "serve.log", wait=False)
        deadline = time.monotonic() + 60
        while proc.get("/v2/models/twoout/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.get("/v2/models/twoout/ready")[0] == 200
        assert proc.get("/v2/health/ready") == (400, b'{"ready":false}')
        assert proc.get("/v2/health/live") == (200, b'{"live":true}')
        assert grpcclient.InferenceServerClient(proc.grpc).is_server_ready() is False
        assert proc.stop() == 0


def test_the_token_guards_everything_but_health_on_both_protocols(bundles: dict[str, Path], tmp_path: Path) -> None:
    token = tmp_path / "token.txt"
    token.write_text("s3cret-token\n")
    with ServerProcess(*serve_args(bundles, "twoout"), "--auth-token-file", token) as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.get("/v2/health/ready")[0] == 200  # open
        assert proc.get("/v2/models/twoout") == (401, b'{"error":"this server needs a bearer token: send the header \'Authorization: Bearer <token>\'"}')
        assert proc.get("/v2/models/twoout", {"Authorization": "Bearer wrong"}) == (401, b'{"error":"the bearer token is not valid"}')
        assert proc.get("/metrics")[0] == 401
        assert proc.get("/v2/models/twoout", {"Authorization": "Bearer s3cret-token"})[0] == 200
        http = httpclient.InferenceServerClient(proc.http)
        tensor = httpclient.InferInput("X", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException, match="needs a bearer token"):
            http.infer("twoout", [tensor])
        assert http.infer("twoout", [tensor], headers={"Authorization": "Bearer s3cret-token"}).as_numpy("Y").shape == (1, 4)
        g = grpcclient.InferenceServerClient(proc.grpc)
        assert g.is_server_ready()  # open
        with pytest.raises(InferenceServerException, match="needs a bearer token") as e:
            g.get_model_metadata("twoout")
        assert e.value.status() == str(grpc.StatusCode.UNAUTHENTICATED)
        assert g.get_model_metadata("twoout", headers={"authorization": "Bearer s3cret-token"}).name == "twoout"
        assert proc.stop() == 0


def test_a_model_repository_serves_every_bundle_in_it_by_its_name(bundles: dict[str, Path], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(bundles["squeeze"], repo / "squeezenet.onnxpipe")
    shutil.copytree(bundles["twoout"], repo / "pair")
    (repo / "notes.txt").write_text("not a bundle")
    with ServerProcess("--model-repository", repo, grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        stats = json.loads(proc.get("/v2/models/stats")[1])
        assert sorted(s["name"] for s in stats["model_stats"]) == ["pair", "squeezenet"]
        assert "verified against 1 reference sample(s)" in proc.log()
        assert proc.stop(signal.SIGINT) == 0


def test_bodies_still_arriving_at_sigterm_are_refused_at_once_and_the_exit_does_not_wait_for_them(bundles: dict[str, Path], tmp_path: Path) -> None:
    """10 clients each half way through a large body at SIGTERM (the issue: a false 408 after
    --body-timeout, and the exit that long after): each is answered 503 at once, and the server
    exits 0 well before the body timeout."""
    import socket

    with ServerProcess(*serve_args(bundles, "twoout"), "--body-timeout", "30") as proc:
        proc.start(tmp_path / "serve.log")
        sockets = []
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", proc.http_port), timeout=20)
            s.sendall(b"POST /v2/models/twoout/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 27000000\r\n\r\n" + b" " * 1_000_000)
            sockets.append(s)
        # Each sent its head and 1,000,000 bytes of body: the server has read past the head.
        until(lambda: all(unread_bytes(s) <= 1_000_000 for s in sockets), "the server has read every request's head")
        proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        answers = []
        for s in sockets:  # each socket waits 20 s at most: an answer after --body-timeout (30 s) cannot come
            answers.append(read_head(s))
            s.close()
        code = proc.stop(within=20)  # an exit that waited for the bodies would come 30 s after they began
    assert code == 0, proc.log()
    assert all(a.startswith(b"HTTP/1.1 503") and b"the server is shutting down" in a for a in answers), answers
    assert "Traceback" not in proc.log()


def test_a_second_signal_cuts_the_drain_short_and_a_third_after_it_is_ignored(bundles: dict[str, Path], tmp_path: Path) -> None:
    """A second SIGTERM ends the drain's wait at once (the slow requests in flight are cut off, and
    the log says so truthfully); signals while the server stops do not kill it (no exit 143)."""
    with ServerProcess(*serve_args(bundles, "slow"), "--drain-timeout", "60") as proc:
        proc.start(tmp_path / "serve.log")
        threads, results = _send_slow(proc, 60)
        deadline = time.monotonic() + 60
        while _metric(proc, "onnxpipe_inflight_requests") < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        until(lambda: "draining: " in proc.log(), "the drain began")
        proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        while "stopped" not in proc.log() and proc.proc.poll() is None and time.monotonic() - started < 20:  # type: ignore[union-attr]
            time.sleep(0.01)
        for _ in range(3):
            if proc.proc.poll() is None:  # type: ignore[union-attr]
                proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        # Within 40 s of the first signal at most: a drain that the second one did not cut short waits 60.
        code = proc.stop(within=20)
        for t in threads:
            t.join(60)
    assert code == 0, proc.log()
    assert "after the drain (a second signal)" in proc.log(), proc.log()
    assert any(not isinstance(r, np.ndarray) for r in results.values()), "nothing was cut off: the test did not test the second signal"


def test_a_model_is_ready_exactly_when_its_inference_is_accepted(bundles: dict[str, Path], tmp_path: Path) -> None:
    """Issue 36 item 20: polled from the moment the process starts, a model's readiness (HTTP and
    gRPC's ModelReady) turns true only when the server takes its requests: ``twoout`` loads first,
    then squeezenet loads and is verified while ``twoout`` is loaded but not yet ready (the window
    where it answered 200 and its inference 503), and at the first ready answer an inference is
    accepted at once, on each protocol."""
    x = np.array([[0.5, -1.0, 2.0, 3.5]], np.float32)
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": x.ravel().tolist()}]}).encode()
    with ServerProcess(*serve_args(bundles, "twoout", "squeeze")) as proc:
        proc.start(tmp_path / "serve.log", wait=False)
        g = grpcclient.InferenceServerClient(proc.grpc)
        http_answer: tuple[int, bytes] | None = None
        grpc_answer: object = None
        loaded_not_ready: set[str] = set()  # the protocols that answered not ready while twoout was loaded (the window tested)
        deadline = time.monotonic() + 90
        while (http_answer is None or grpc_answer is None) and time.monotonic() < deadline:
            assert proc.proc.poll() is None, proc.log()  # type: ignore[union-attr]
            loaded = "onnxpipe serve: model 'twoout': " in proc.log()  # read before asking: twoout was loaded by then
            if http_answer is None:
                status, answer = proc.get("/v2/models/twoout/ready")
                if status == 200:
                    http_answer = proc.request("POST", "/v2/models/twoout/infer", body)
                elif loaded:
                    assert (status, answer) == (503, b'{"error":"the server is not ready: its models are loading"}')
                    loaded_not_ready.add("http")
            if grpc_answer is None:
                try:
                    ready = g.is_model_ready("twoout")
                except InferenceServerException:  # nothing listens yet
                    ready = False
                if ready:
                    tensor = grpcclient.InferInput("X", [1, 4], "FP32")
                    tensor.set_data_from_numpy(x)
                    try:
                        grpc_answer = g.infer("twoout", [tensor]).as_numpy("Y")
                    except InferenceServerException as e:
                        grpc_answer = e
                elif loaded:
                    loaded_not_ready.add("grpc")
        assert http_answer is not None and http_answer[0] == 200, (http_answer, proc.log())
        assert isinstance(grpc_answer, np.ndarray), grpc_answer
        assert loaded_not_ready == {"http", "grpc"}, f"no poll fell between twoout's load and the server's readiness: {loaded_not_ready}"
        assert proc.stop() == 0, proc.log()
