"""``GET /metrics`` is Prometheus text that prometheus-client's own parser reads, and its counts
match the requests sent: by outcome and protocol, durations, and per stage from the pipeline's
own statistics; Triton's families under Triton's names agree with the statistics extension, on a
metrics port of its own; batch_stats count the batches a stage ran."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from onnxpipe._errors import ConfigError
from onnxpipe.serve import ServeOptions
from onnxpipe.serve._metrics import TRITON_FAMILIES
from tests import code_stages, models
from tests.serve.conftest import serve_args
from tests.serve.process import ROOT, ServerProcess, free_ports


def _samples(proc: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = proc.get("/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_metrics_parse_and_count_what_was_sent(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "twoout", "rnn"), "--allow-code", "tests.*") as proc:
        proc.start(tmp_path / "serve.log")
        x = np.ones((1, 4), np.float32)
        http = httpclient.InferenceServerClient(proc.http)
        for _ in range(5):
            tensor = httpclient.InferInput("X", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            http.infer("twoout", [tensor])
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        for _ in range(2):
            tensor = grpcclient.InferInput("X", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            grpc.infer("twoout", [tensor])
        bad = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1]}]}).encode()
        for _ in range(3):
            assert proc.request("POST", "/v2/models/twoout/infer", bad)[0] == 400
        rnn = httpclient.InferInput("x", [1, 4], "FP32")
        rnn.set_data_from_numpy(x)
        http.infer("rnn", [rnn], sequence_id=9, sequence_start=True)
        got = _samples(proc)
        assert proc.stop() == 0

    def value(name: str, **labels: str) -> float:
        return got.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("onnxpipe_requests_total", model="twoout", protocol="http", outcome="success") == 5
    assert value("onnxpipe_requests_total", model="twoout", protocol="grpc", outcome="success") == 2
    assert value("onnxpipe_requests_total", model="twoout", protocol="http", outcome="bad_request") == 3
    assert value("onnxpipe_request_duration_seconds_count", model="twoout", protocol="http") == 5
    assert value("onnxpipe_request_duration_seconds_bucket", model="twoout", protocol="http", le="+Inf") == 5
    assert value("onnxpipe_request_duration_seconds_sum", model="twoout", protocol="http") > 0
    for stage in ("stage0", "stage1", "stage2"):
        assert value("onnxpipe_stage_runs_total", model="twoout", stage=stage) == 7, stage  # the 400s never reached a stage
        assert value("onnxpipe_stage_failures_total", model="twoout", stage=stage) == 0
        assert value("onnxpipe_stage_compute_seconds_total", model="twoout", stage=stage) > 0
        assert ("onnxpipe_stage_queue_seconds_total", (("model", "twoout"), ("stage", stage))) in got
    assert value("onnxpipe_inflight_requests", model="twoout") == 0
    assert value("onnxpipe_open_streams", model="rnn") == 1


# -- Triton's names, the metrics port, the process, batch_stats ------------------------------------

TOKEN = "metrics-token"


def auth() -> dict[str, str]:
    """The token's header, a new dict each time: tritonclient adds its own headers to the dict it is given."""
    return {"Authorization": f"Bearer {TOKEN}"}

#: Triton's per-model counters (written without ``_total``) and what each is of the statistics extension.
TRITON_COUNTS = {
    "nv_inference_request_success": lambda s: s["inference_stats"]["success"]["count"],
    "nv_inference_count": lambda s: s["inference_count"],
    "nv_inference_exec_count": lambda s: s["execution_count"],
    "nv_inference_request_duration_us": lambda s: s["inference_stats"]["success"]["ns"] // 1000,
    "nv_inference_queue_duration_us": lambda s: s["inference_stats"]["queue"]["ns"] // 1000,
    "nv_inference_compute_input_duration_us": lambda s: s["inference_stats"]["compute_input"]["ns"] // 1000,
    "nv_inference_compute_infer_duration_us": lambda s: s["inference_stats"]["compute_infer"]["ns"] // 1000,
    "nv_inference_compute_output_duration_us": lambda s: s["inference_stats"]["compute_output"]["ns"] // 1000,
}


def _triton_lines(text: str) -> dict[tuple[str, str, str], int]:
    """``(family, model, reason)`` -> value of every ``nv_inference_*`` sample, read as written
    (prometheus-client's parser would rename a counter ``..._total``)."""
    found = {}
    for line in text.splitlines():
        m = re.fullmatch(r'(nv_inference_[a-z_]+)\{model="([^"]+)",(?:reason="([A-Z]+)",)?version="1"\} (\d+)', line)
        if m:
            found[(m[1], m[2], m[3] or "")] = int(m[4])
    return found


def _batches(stats: dict[str, Any]) -> dict[int, tuple[int, ...]]:
    """A model's batch_stats as batch size -> (count, ns) of compute_input, _infer, _output; HTTP's
    JSON or gRPC's (whose uint64s are strings, and zeros left out)."""
    parts = ("compute_input", "compute_infer", "compute_output")
    return {int(b["batch_size"]): tuple(int(b.get(p, {}).get(k, 0)) for p in parts for k in ("count", "ns")) for b in stats.get("batch_stats", [])}


def test_tritons_metrics_on_the_metrics_port_agree_with_the_statistics_and_batch_stats_count_batches(bundles: dict[str, Path], tmp_path: Path) -> None:
    """Requests of every outcome to a model whose stage batches (mlp, max_batch 8), a two-output
    model, a model with state and a code stage that raises: the metrics port answers without the
    token (the HTTP port's /metrics asks for it) with Triton's families under Triton's names, HELP
    and labels, equal to the statistics extension over HTTP and gRPC; batch_stats count the calls
    the batching stage made, batches of several requests among them."""
    (tmp_path / "token").write_text(TOKEN)
    coded = models.bundle_of(code_stages.config("tests.code_stages:misbehave"), tmp_path / "coded")
    args = [*serve_args(bundles, "mlp", "twoout", "rnn"), f"coded={coded}", "--allow-code", "tests.*", "--max-streams", "1"]
    with ServerProcess(*args, "--auth-token-file", tmp_path / "token") as proc:
        proc.start(tmp_path / "serve.log")
        assert f"metrics http://127.0.0.1:{proc.metrics_port}/metrics" in proc.log()
        http = httpclient.InferenceServerClient(proc.http)
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        # 48 at once over gRPC (tritonclient's HTTP client sends its async requests nearly one by
        # one): the stage takes what is queued, up to 8 a call.
        tensor = grpcclient.InferInput("ids", [1, 4], "INT64")
        tensor.set_data_from_numpy(np.ones((1, 4), np.int64))
        answered: queue.Queue[Any] = queue.Queue()
        for _ in range(48):
            grpc.async_infer("mlp", [tensor], lambda result, error: answered.put(error), headers={"authorization": f"Bearer {TOKEN}"})
        assert [answered.get(timeout=60) for _ in range(48)] == [None] * 48
        for rows in (3, 1):  # 4 inferences, 2 requests
            ids = httpclient.InferInput("ids", [rows, 4], "INT64")
            ids.set_data_from_numpy(np.ones((rows, 4), np.int64))
            http.infer("mlp", [ids], headers=auth())
        bad = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1]}]}).encode()
        for _ in range(2):
            assert proc.request("POST", "/v2/models/twoout/infer", bad, headers=auth())[0] == 400  # OTHER
        raises = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [106.0, 1, 1, 1]}]}).encode()
        failed = proc.request("POST", "/v2/models/coded/infer", raises, headers=auth())
        assert failed[0] == 500 and b"misbehave was asked to raise" in failed[1], failed  # BACKEND: the code stage raised
        step = httpclient.InferInput("x", [1, 4], "FP32")
        step.set_data_from_numpy(np.ones((1, 4), np.float32))
        http.infer("rnn", [step], sequence_id=1, sequence_start=True, headers=auth())
        with pytest.raises(InferenceServerException, match="cannot start sequence 2"):
            http.infer("rnn", [step], sequence_id=2, sequence_start=True, headers=auth())  # REJECTED: --max-streams 1

        status, scraped = proc.request("GET", "/metrics", port=proc.metrics_port)  # no token
        assert status == 200, scraped
        text = scraped.decode()
        assert proc.get("/metrics")[0] == 401  # the HTTP port's asks for it, as every endpoint there
        status, behind = proc.get("/metrics", headers=auth())
        assert status == 200
        assert proc.request("GET", "/v2/models/mlp/stats", port=proc.metrics_port)[0] == 404  # the metrics port answers /metrics alone
        stats = {s["name"]: s for s in http.get_inference_statistics(headers=auth())["model_stats"]}
        grpc_stats = grpc.get_inference_statistics("mlp", headers={"authorization": f"Bearer {TOKEN}"}, as_json=True)["model_stats"][0]
        assert proc.stop() == 0

    got = _triton_lines(text)
    assert _triton_lines(behind.decode()) == got  # one source: either port says the same
    for name, (kind, help_text) in TRITON_FAMILIES.items():
        assert f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" in text, name
    for model in ("mlp", "twoout", "rnn", "coded"):
        for family, of in TRITON_COUNTS.items():
            assert got[(family, model, "")] == of(stats[model]), (family, model)
        reasons = {r: got[("nv_inference_request_failure", model, r)] for r in ("REJECTED", "CANCELED", "BACKEND", "OTHER")}
        assert sum(reasons.values()) == stats[model]["inference_stats"]["fail"]["count"], (model, reasons)
        assert got[("nv_inference_pending_request_count", model, "")] == 0
    assert [got[("nv_inference_request_failure", m, r)] for m, r in (("twoout", "OTHER"), ("coded", "BACKEND"), ("rnn", "REJECTED"))] == [2, 1, 1]
    assert got[("nv_inference_request_success", "mlp", "")] == 50 and got[("nv_inference_count", "mlp", "")] == 52  # rows: 49 of 1 row, one of 3

    # batch_stats: per size, the calls of mlp's stage, which together ran every request once.
    mlp = stats["mlp"]
    sizes = {b["batch_size"]: b for b in mlp["batch_stats"]}
    assert max(sizes) >= 2, sizes  # requests sent together ran together
    assert sum(b["compute_infer"]["count"] for b in sizes.values()) == mlp["execution_count"] < 50
    assert sum(k * b["compute_infer"]["count"] for k, b in sizes.items()) == 50
    for b in sizes.values():
        assert b["compute_infer"]["ns"] > 0 and b["compute_input"]["count"] == b["compute_output"]["count"] == b["compute_infer"]["count"], b
    # One stage: the sizes' times are all of its time (each rounded down to a ns).
    assert 0 <= mlp["inference_stats"]["compute_infer"]["ns"] - sum(b["compute_infer"]["ns"] for b in sizes.values()) <= len(sizes)
    assert _batches(grpc_stats) == _batches(mlp)  # gRPC says the same
    # No stage batches: one call of the first stage a request that reached it (the failed one too, as Triton counts it).
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["coded"]["batch_stats"]] == [(1, 1)] and stats["coded"]["execution_count"] == 1
    assert stats["twoout"]["batch_stats"] == [] and stats["twoout"]["execution_count"] == 0  # its 400s never ran

    # The process's and the host's, parsed by prometheus-client's own parser.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds", "process_max_fds", "python_info"):
        assert name in families and families[name].samples[0].value > 0, name
    host = {name: families[name].samples[0].value for name in ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes")}
    assert 0.0 <= host["nv_cpu_utilization"] <= 1.0 and host["nv_cpu_memory_total_bytes"] > host["nv_cpu_memory_used_bytes"] > 0, host


def test_a_metrics_port_in_use_is_one_error_before_any_model_loads(bundles: dict[str, Path]) -> None:
    http = free_ports(1)[0]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "onnxpipe.cli", "serve", *serve_args(bundles, "twoout"), "--http-port", str(http), "--grpc-port", "0",
                               "--metrics-port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot listen on 127.0.0.1:{port} (metrics): Address already in use"), done.stderr
    assert errors[0].endswith("; choose another --metrics-port (0 for none) or --metrics-address"), done.stderr
    assert "loading" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    with pytest.raises(ConfigError, match="http_port and metrics_port are both 8000; give them different ports, or 0 for no metrics port"):
        ServeOptions(metrics_port=8000)
    with pytest.raises(ConfigError, match="metrics_port must be from 0 to 65535, got 70000"):
        ServeOptions(metrics_port=70000)
    assert ServeOptions(metrics_port=8000, allow_metrics=False).metrics_port == 8000  # no metrics port: nothing to collide


def test_without_allow_metrics_no_metrics_are_served(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "twoout"), "--no-allow-metrics") as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.get("/metrics")[0] == 404
        assert proc.request("GET", "/metrics", port=proc.metrics_port)[0] == 0  # nothing listens there
        assert [line for line in proc.log().splitlines() if "ready: " in line and "metrics" not in line], proc.log()  # the start line names no metrics port
        assert proc.stop() == 0


def _stalled_scrapes(port: int) -> socket.socket:
    """A connection to ``port`` that sends scrapes back to back (pipelined, until its send buffer is
    full) and never reads an answer: once the answers fill the socket buffers, its handler waits to
    write, a request in progress for good."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    request = b"GET /metrics HTTP/1.1\r\nHost: scraper\r\n\r\n" * 1024
    try:
        for _ in range(64):
            sock.send(request)
    except BlockingIOError:
        pass
    return sock


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_and_stalled_connections_do_not_lock_prometheus_out_of_the_metrics_port(bundles: dict[str, Path], tmp_path: Path) -> None:
    """Issue 36 item 13: with 24 idle sockets and 48 that pipeline scrapes and never read on the
    metrics port (16 connections at once), a scrape still gets its 200 at once, well before
    --idle-timeout; the server holds no more descriptors than the port's 16 connections (a
    connection closed to let another in is gone, its unread answers dropped); below the cap, idle
    sockets are closed by the port's short head deadline (5 s), not --idle-timeout."""
    with ServerProcess(*serve_args(bundles, "twoout"), "--idle-timeout", "120") as proc:
        proc.start(tmp_path / "serve.log")
        pid = proc.proc.pid  # type: ignore[union-attr]
        assert proc.request("GET", "/metrics", port=proc.metrics_port)[0] == 200
        before = _fds(pid)
        idle = [socket.create_connection(("127.0.0.1", proc.metrics_port)) for _ in range(24)]
        stalled = [_stalled_scrapes(proc.metrics_port) for _ in range(48)]
        try:
            for _ in range(5):
                # At once, not when --idle-timeout (120 s) frees a connection (before: 503 until then):
                # the client gives up after 60 s (status 0).
                status, body = proc.request("GET", "/metrics", port=proc.metrics_port, timeout=60)
                assert status == 200 and b"nv_inference_count" in body, (status, body[:300])
            held = _fds(pid) - before
            assert held <= 16 + 4, f"the server holds {held} more descriptors under the attack"
            for sock in idle:
                sock.settimeout(60)
                assert sock.recv(1) == b""  # closed by the server (to let the later ones in)
        finally:
            for sock in idle + stalled:
                sock.close()
        # Below the cap, an idle socket is closed by the head deadline: 5 s, not --idle-timeout's 120.
        opened = time.monotonic()
        quiet = [socket.create_connection(("127.0.0.1", proc.metrics_port)) for _ in range(4)]
        for sock in quiet:
            sock.settimeout(60)  # closed before --idle-timeout (120 s) could, or recv raises TimeoutError
            assert sock.recv(1) == b""
            sock.close()
        closed_after = time.monotonic() - opened
        assert closed_after > 4, f"idle sockets on the metrics port were closed {closed_after:.1f} s after they connected"  # the timer elapsed
        assert proc.get("/v2/health/ready")[0] == 200
        assert "connection(s) of the metrics port, the oldest idle first, to let new ones in: it holds 16 at once" in proc.log(), proc.log()
        assert proc.stop() == 0, proc.log()
