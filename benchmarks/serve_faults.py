"""What one client's attack does to everyone else: a normal client's latency on ``onnxpipe serve``,
idle and during each attack, side by side in one run (issue 28).

One server on loopback serves ``twoout`` (a small model, tests/models.py) and ``echo`` (``Y = X + 0``
over a float vector of any length: a model whose tensors are as large as a request makes them). A
prober thread, its own keep-alive connections, asks ``GET /v2/health/live`` and a small ``twoout``
inference in turn, every 5 ms, for each phase:

- **idle**: nothing else;
- **slowloris**: 200 connections each sending one header line every 0.5 s;
- **1,000 idle connections**: opened and left silent;
- **20 preallocating connections**: each announces a body of ``--max-body-size`` and sends nothing;
- **one 16 MiB JSON request**: a 16 MiB JSON tensor to ``echo``, answered as JSON, sent again as soon
  as it is answered;
- **one 64 MiB binary request**: the same with a 64 MiB binary tensor, answered binary.

Printed per phase: the health check's and the inference's p50 / p99 / max latency in ms, the ratio
of p99 to idle's, the server's RSS (MB) and open descriptors at the phase's end. Goals (issue 28):
p99 under attack <= 3x idle, a health check never above 100 ms, RSS never above ``--max-inflight``
x ``--max-body-size`` plus the models.

    python -m benchmarks.serve_faults [--seconds 4] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxpipe.builder import PipelineConfig
from onnxpipe.splitter import split
from tests import models
from tests.serve.process import ServerProcess

MIB = 1 << 20
MAX_BODY = "80MiB"
MAX_INFLIGHT = 4


def _echo() -> onnx.ModelProto:
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    graph = helper.make_graph([helper.make_node("Add", ["X", "zero"], ["Y"])], "echo",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n"])], [zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _bundles(root: Path) -> dict[str, Path]:
    echo = PipelineConfig("echo")
    stage = echo.add_stage(_echo(), "echo")
    echo.input("X").connect(stage.input("X"))
    stage.output("Y").connect(echo.output("Y"))
    return {"twoout": models.bundle_of(split(models.two_outputs(), ["a", "M"]), root / "twoout"), "echo": models.bundle_of(echo, root / "echo")}


class _Prober:
    """A normal client: its own keep-alive connection, a health check and a small inference in turn."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.health: list[float] = []
        self.infer: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}).encode()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self._stop.is_set():
            for path, body, into in (("/v2/health/live", None, self.health), ("/v2/models/twoout/infer", self._body, self.infer)):
                start = time.perf_counter()
                try:
                    conn.request("POST" if body else "GET", path, body=body)
                    response = conn.getresponse()
                    response.read()
                    ok = response.status == 200
                except (OSError, http.client.HTTPException):
                    ok = False
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                if ok:
                    into.append(time.perf_counter() - start)
                else:
                    self.failed += 1
            time.sleep(0.005)
        conn.close()


def _slowloris(port: int, stop: threading.Event) -> None:
    held = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        held.append(s)
    while not stop.wait(0.5):
        for s in list(held):
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                held.remove(s)  # closed by the server: open another, as an attacker would
                with _quiet():
                    fresh = socket.create_connection(("127.0.0.1", port))
                    fresh.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
                    held.append(fresh)
    for s in held:
        s.close()


def _idle(port: int, stop: threading.Event, count: int = 1000) -> None:
    held = []
    for _ in range(count):
        with _quiet():
            held.append(socket.create_connection(("127.0.0.1", port)))
    stop.wait()
    for s in held:
        s.close()


def _preallocating(port: int, stop: threading.Event, size: int) -> None:
    held = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
        held.append(s)
    stop.wait()
    for s in held:
        s.close()


def _big(port: int, stop: threading.Event, binary: bool) -> None:
    if binary:
        data = np.zeros(16 * MIB, np.float32)  # 64 MiB
        header = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [data.size], "parameters": {"binary_data_size": data.nbytes}}],
                             "parameters": {"binary_data_output": True}}).encode()
        body, headers = header + data.tobytes(), {"Inference-Header-Content-Length": str(len(header))}
    else:
        count = 16 * MIB // 4  # "0.0," per value: 16 MiB of JSON
        body = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [%d], "data": [' % count + b",".join([b"0.0"] * count) + b"]}]}"
        headers = {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while not stop.is_set():
        try:
            conn.request("POST", "/v2/models/echo/infer", body=body, headers=headers)
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.close()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)  # type: ignore[arg-type]


def _stats(times: list[float]) -> dict[str, float]:
    if not times:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan"), "count": 0}
    ordered = sorted(times)
    return {"p50_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "max_ms": 1e3 * ordered[-1], "count": len(ordered)}


def _proc_status(pid: int) -> tuple[float, int]:
    rss = next(int(line.split()[1]) / 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def run(seconds: float) -> dict[str, Any]:
    phases: list[tuple[str, Callable[[int, threading.Event], None] | None]] = [
        ("idle", None),
        ("slowloris (200 connections)", _slowloris),
        ("1,000 idle connections", _idle),
        ("20 preallocating connections", lambda port, stop: _preallocating(port, stop, 80 * MIB)),
        ("one 16 MiB JSON request", lambda port, stop: _big(port, stop, binary=False)),
        ("one 64 MiB binary request", lambda port, stop: _big(port, stop, binary=True)),
    ]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        bundles = _bundles(Path(tmp))
        args = [f"{name}={path}" for name, path in bundles.items()]
        with ServerProcess(*args, "--max-body-size", MAX_BODY, "--max-inflight", str(MAX_INFLIGHT), "--max-connections", "4000") as proc:
            proc.start(Path(tmp) / "serve.log")
            assert proc.proc is not None
            base_rss, _ = _proc_status(proc.proc.pid)
            for name, attack in phases:
                stop = threading.Event()
                attacker = threading.Thread(target=attack, args=(proc.http_port, stop), daemon=True) if attack else None
                if attacker:
                    attacker.start()
                    time.sleep(0.5)  # the attack in place
                prober = _Prober(proc.http_port)
                prober.start()
                time.sleep(seconds)
                prober.stop()
                rss, fds = _proc_status(proc.proc.pid)
                stop.set()
                if attacker:
                    attacker.join(60)
                rows.append({"phase": name, "health": _stats(prober.health), "infer": _stats(prober.infer), "failed": prober.failed,
                             "rss_mb": rss, "fds": fds})
                time.sleep(1.0)
            proc.stop()
    idle = rows[0]
    for row in rows:
        for what in ("health", "infer"):
            row[what]["p99_vs_idle"] = row[what]["p99_ms"] / idle[what]["p99_ms"]
    return {"seconds": seconds, "max_body": MAX_BODY, "max_inflight": MAX_INFLIGHT, "base_rss_mb": base_rss, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="the prober's time in each phase")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.seconds)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"onnxpipe serve, loopback, --max-body-size {MAX_BODY} --max-inflight {MAX_INFLIGHT}; a prober alternating a health check and a small "
          f"inference every 5 ms for {args.seconds:g} s per phase; RSS at start {result['base_rss_mb']:.0f} MB")
    print(f"{'phase':32} {'health p50 / p99 / max ms':>27} {'p99 x idle':>10} {'infer p50 / p99 / max ms':>27} {'p99 x idle':>10} "
          f"{'failed':>6} {'RSS MB':>7} {'fds':>5}")
    for r in result["rows"]:
        h, i = r["health"], r["infer"]
        print(f"{r['phase']:32} {h['p50_ms']:8.2f} / {h['p99_ms']:7.2f} / {h['max_ms']:7.1f} {h['p99_vs_idle']:9.1f}x "
              f"{i['p50_ms']:8.2f} / {i['p99_ms']:7.2f} / {i['max_ms']:7.1f} {i['p99_vs_idle']:9.1f}x {r['failed']:6d} {r['rss_mb']:7.0f} {r['fds']:5d}")


if __name__ == "__main__":
    main()
