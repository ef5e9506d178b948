"""What one client's attack does to everyone else: a normal client's latency and the server's memory
on ``onnxpipe serve``, idle and during each attack (issues 28 and 36), this checkout beside an older
one (``--against REV``) in one run.

One server on loopback (``--max-body-size 80MiB --max-inflight 4 --body-timeout 5 --request-timeout 5``
and a token; this checkout's with a sequence state budget of 64 MiB too) serves ``twoout`` (a small
model, tests/models.py), ``echo`` (``Y = X + 0`` over a float vector of any length: a model whose
tensors are as large as a request makes them) and ``grow`` (a model with state that grows by its
input each step, as a KV cache does). A prober thread, its own keep-alive
connection, asks ``GET /v2/health/live`` and a small ``twoout`` inference in turn, every 5 ms, for
each phase:

- **idle**: nothing else;
- **slowloris**: 200 connections each sending one header line every 0.5 s;
- **1,000 idle connections**: opened and left silent;
- **20 preallocating connections**: each announces a body of ``--max-body-size`` and sends nothing;
- **one 16 MiB JSON request** / **one 64 MiB binary request**: sent again as soon as answered;
- **gRPC partial messages, no token**: 8 connections of one call and one of 16, each announcing a
  60 MiB message and sending what flow control lets through, without the token (a raw HTTP/2
  client);
- **gRPC partial messages, token**: 24 calls with the token, each announcing 80 MiB and sending 60;
- **gzip JSON**: 8 requests at once, each a 60 MiB JSON tensor of zeros gzipped to 60 KiB;
- **deflate bombs**: 64 KiB deflate bodies inflating to 64 MiB, 4 at a time;
- **growing sequences**: 8 sequences of ``grow`` stepped in turn, 1 MiB a step, 24 steps each;
- **stuck JSON worker**: the JSON worker process stopped (SIGSTOP), while 8 clients send 2 MiB JSON
  requests (to two copies of ``echo``: 4 places each) and one a 1 MiB binary request, each with a
  25 s client timeout (the worker is continued at the phase's end).

Printed per phase and per server: the health check's and the inference's p99 / max latency in ms,
the server's RSS at the phase's start, its peak and after (MB, its process and its children, the
peak sampled every 20 ms) and how the attack's
own requests ended. Goals (issue 36): a health check never above 100 ms, RSS within
``--max-inflight`` x ``--max-body-size`` plus the models, no request waiting past its deadline.

    python -m benchmarks.serve_faults [--seconds 4] [--against REV] [--only TEXT[,TEXT...]] [--json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import http.client
import json
import os
import signal
import socket
import statistics
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from benchmarks._checkout import checkout
from onnxpipe.builder import PipelineConfig
from onnxpipe.splitter import split
from tests import models
from tests.serve.h2calls import PartialCalls
from tests.serve.process import ROOT, ServerProcess

MIB = 1 << 20
MAX_BODY = "80MiB"
MAX_INFLIGHT = 4
TOKEN = "bench-token"
ARGS = ("--max-body-size", MAX_BODY, "--max-inflight", str(MAX_INFLIGHT), "--max-connections", "4000", "--body-timeout", "5", "--request-timeout", "5")
#: This checkout's server only (an older one has no such flags): a sequence state budget small enough to see.
NEW_ARGS = ("--max-sequence-state", "16MiB", "--sequence-state-budget", "64MiB")


def _echo() -> onnx.ModelProto:
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    graph = helper.make_graph([helper.make_node("Add", ["X", "zero"], ["Y"])], "echo",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n"])], [zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _grow() -> onnx.ModelProto:
    """``state' = Concat(state, x)``, ``y = ReduceSum(state')``: a state that grows by each step's input."""
    graph = helper.make_graph(
        [helper.make_node("Concat", ["state", "x"], ["state_out"], axis=0), helper.make_node("ReduceSum", ["state_out"], ["y"], keepdims=1)],
        "grow",
        [helper.make_tensor_value_info("state", TensorProto.FLOAT, ["past"]), helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("state_out", TensorProto.FLOAT, ["total"]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def echo_bundle(root: Path) -> Path:
    """The ``echo`` bundle, in ``root / "echo"`` (tests/serve use it too)."""
    echo = PipelineConfig("echo")
    stage = echo.add_stage(_echo(), "echo")
    echo.input("X").connect(stage.input("X"))
    stage.output("Y").connect(echo.output("Y"))
    return models.bundle_of(echo, root / "echo")


def _bundles(root: Path) -> dict[str, Path]:
    return {
        "twoout": models.bundle_of(split(models.two_outputs(), ["a", "M"]), root / "twoout"),
        "echo": echo_bundle(root),
        "grow": models.bundle_of(split(_grow(), ["state_out"], states={"state_out": "state"}), root / "grow"),
    }


@dataclass
class Target:
    """The server under attack."""

    http_port: int
    grpc_port: int
    pid: int


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
        auth = {"Authorization": f"Bearer {TOKEN}"}
        while not self._stop.is_set():
            for path, body, into in (("/v2/health/live", None, self.health), ("/v2/models/twoout/infer", self._body, self.infer)):
                start = time.perf_counter()
                try:
                    conn.request("POST" if body else "GET", path, body=body, headers=auth)
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


Outcomes = collections.Counter[str]
Attack = Callable[[Target, threading.Event, Outcomes], None]


def _post(port: int, path: str, body: bytes, headers: dict[str, str], timeout: float = 120) -> tuple[str, float]:
    """One request on its own connection: how it ended (its status, or the client's error) and its time."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {TOKEN}", **headers})
        response = conn.getresponse()
        response.read()
        outcome = str(response.status)
    except TimeoutError:
        outcome = f"no answer in {timeout:g} s"
    except (OSError, http.client.HTTPException) as e:
        outcome = type(e).__name__
    finally:
        conn.close()
    return outcome, time.perf_counter() - start


def _slowloris(target: Target, stop: threading.Event, _: Outcomes) -> None:
    held = []
    for _i in range(200):
        s = socket.create_connection(("127.0.0.1", target.http_port))
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        held.append(s)
    while not stop.wait(0.5):
        for s in list(held):
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                held.remove(s)  # closed by the server: open another, as an attacker would
                with contextlib.suppress(OSError):
                    fresh = socket.create_connection(("127.0.0.1", target.http_port))
                    fresh.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
                    held.append(fresh)
    for s in held:
        s.close()


def _idle(target: Target, stop: threading.Event, _: Outcomes) -> None:
    held = []
    for _i in range(1000):
        with contextlib.suppress(OSError):
            held.append(socket.create_connection(("127.0.0.1", target.http_port)))
    stop.wait()
    for s in held:
        s.close()


def _preallocating(target: Target, stop: threading.Event, _: Outcomes) -> None:
    held = []
    for _i in range(20):
        s = socket.create_connection(("127.0.0.1", target.http_port))
        s.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (80 * MIB))
        held.append(s)
    stop.wait()
    for s in held:
        s.close()


def _big(binary: bool) -> Attack:
    if binary:
        data = np.zeros(16 * MIB, np.float32)  # 64 MiB
        header = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [data.size], "parameters": {"binary_data_size": data.nbytes}}],
                             "parameters": {"binary_data_output": True}}).encode()
        body, headers = header + data.tobytes(), {"Inference-Header-Content-Length": str(len(header))}
    else:
        count = 16 * MIB // 4  # "0.0," per value: 16 MiB of JSON
        body = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [%d], "data": [' % count + b",".join([b"0.0"] * count) + b"]}]}"
        headers = {}

    def attack(target: Target, stop: threading.Event, outcomes: Outcomes) -> None:
        while not stop.is_set():
            outcomes[_post(target.http_port, "/v2/models/echo/infer", body, headers)[0]] += 1

    return attack


def _grpc_partial(token: bool) -> Attack:
    def attack(target: Target, stop: threading.Event, outcomes: Outcomes) -> None:
        where = f"127.0.0.1:{target.grpc_port}"
        if token:
            calls = [PartialCalls(where, 1, 80 * MIB, 60 * MIB, (("authorization", f"Bearer {TOKEN}"),)) for _ in range(24)]
        else:
            calls = [PartialCalls(where, 1, 60 * MIB, 16 * MIB) for _ in range(8)] + [PartialCalls(where, 16, 60 * MIB, 8 * MIB)]
        while not stop.is_set():
            for c in calls:
                c.pump(0.01)
            if not any(c.open_calls() for c in calls):
                stop.wait(0.05)  # every call ended: no busy loop to slow the prober, which shares this process
        for c in calls:
            for status, _ in c.ended.values():
                outcomes[f"grpc {status}" if status >= 0 else "reset"] += 1
            if c.open_calls():
                outcomes["still open"] += c.open_calls()
            c.close()

    return attack


def _gzip_json(target: Target, stop: threading.Event, outcomes: Outcomes) -> None:
    count = 30 * MIB  # "0," a value: 60 MiB of JSON once inflated, 120 MiB as float32
    text = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [%d], "data": [' % count + b",".join([b"0"] * count) + b"]}]}"
    body = gzip.compress(text, 6)
    while not stop.is_set():
        _together(8, lambda: _post(target.http_port, "/v2/models/echo/infer", body, {"Content-Encoding": "gzip"}), outcomes)


def _deflate_bombs(target: Target, stop: threading.Event, outcomes: Outcomes) -> None:
    body = zlib.compress(b"\0" * (64 * MIB), 9)  # about 64 KiB
    while not stop.is_set():
        _together(4, lambda: _post(target.http_port, "/v2/models/echo/infer", body, {"Content-Encoding": "deflate"}), outcomes)


def _growing_sequences(target: Target, stop: threading.Event, outcomes: Outcomes) -> None:
    """8 sequences stepped in turn, 1 MiB a step, 24 steps each; one refused is started again at once."""
    step = np.zeros(MIB // 4, np.float32).tobytes()
    steps = dict.fromkeys(range(1, 9), 0)  # sequence id -> its steps so far
    while not stop.is_set():
        for sid in list(steps):
            params = {"sequence_id": sid, "sequence_start": steps[sid] == 0, "sequence_end": steps[sid] == 23}
            head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(step) // 4], "parameters": {"binary_data_size": len(step)}}],
                               "parameters": params}).encode()
            outcome, _ = _post(target.http_port, "/v2/models/grow/infer", head + step, {"Inference-Header-Content-Length": str(len(head))})
            outcomes[outcome] += 1
            steps[sid] = (steps[sid] + 1) % 24 if outcome == "200" else 0


def _stuck_json_worker(target: Target, stop: threading.Event, outcomes: Outcomes) -> None:
    workers = _children(target.pid)
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        values = MIB // 4  # 1 MiB as binary FP32, 2 MiB as JSON ("0," a value): both past what is decoded on the loop
        json_body = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [%d], "data": [' % (4 * values) + b",".join([b"0"] * (4 * values)) + b"]}]}"
        data = np.zeros(values, np.float32)
        head = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [values], "parameters": {"binary_data_size": data.nbytes}}]}).encode()
        binary = (head + data.tobytes(), {"Inference-Header-Content-Length": str(len(head))})
        times: dict[str, list[float]] = {"json": [], "binary": []}

        def send(kind: str, model: str, body: bytes, headers: dict[str, str]) -> None:
            while not stop.is_set():
                outcome, took = _post(target.http_port, f"/v2/models/{model}/infer", body, headers, timeout=25)
                outcomes[f"{kind} {outcome}"] += 1
                times[kind].append(took)

        # 8 JSON requests waiting (two models of 4 places each), as the issue's; a binary one beside them.
        threads = [threading.Thread(target=send, args=("json", model, json_body, {})) for model in ("echo2", "echo3") for _ in range(4)]
        threads.append(threading.Thread(target=send, args=("binary", "echo", *binary)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for kind, took in times.items():
            if took:
                outcomes[f"the slowest {kind} in {max(took):.1f} s"] = 1
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _together(count: int, send: Callable[[], tuple[str, float]], outcomes: Outcomes) -> None:
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(send()[0])) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outcomes.update(results)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _rss_mb(pid: int) -> float:
    """The RSS of ``pid`` and its children (the JSON worker), in MB."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError, StopIteration):
            total += next(int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines() if line.startswith("VmRSS:")) / 1024
    return total


class _Peak:
    """The highest RSS of a process tree, sampled every 20 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, _rss_mb(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


PHASES: list[tuple[str, Attack | None]] = [
    ("idle", None),
    ("slowloris (200 connections)", _slowloris),
    ("1,000 idle connections", _idle),
    ("20 preallocating connections", _preallocating),
    ("one 16 MiB JSON request", _big(binary=False)),
    ("one 64 MiB binary request", _big(binary=True)),
    ("gRPC partial messages, no token", _grpc_partial(token=False)),
    ("gRPC partial messages, token", _grpc_partial(token=True)),
    ("gzip JSON (8 x 60 MiB as 60 KiB)", _gzip_json),
    ("deflate bombs (64 KiB -> 64 MiB, 4 at once)", _deflate_bombs),
    ("growing sequences (8 x 1 MiB a step)", _growing_sequences),
    ("stuck JSON worker (2 MiB JSON, 1 MiB binary)", _stuck_json_worker),
]


def _stats(times: list[float]) -> dict[str, float]:
    if not times:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan"), "count": 0}
    ordered = sorted(times)
    return {"p50_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "max_ms": 1e3 * ordered[-1], "count": len(ordered)}


def run(seconds: float, root: Path = ROOT, phases: list[tuple[str, Attack | None]] = PHASES) -> dict[str, Any]:
    """The ``phases`` (the first is the baseline: idle) against a server of the checkout at ``root``."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        bundles = _bundles(Path(tmp))
        (Path(tmp) / "token").write_text(TOKEN)
        args = [f"{name}={path}" for name, path in bundles.items()] + [f"echo2={bundles['echo']}", f"echo3={bundles['echo']}"]
        new = NEW_ARGS if root == ROOT else ()
        with ServerProcess(*args, *ARGS, *new, "--auth-token-file", Path(tmp) / "token", root=root) as proc:
            proc.start(Path(tmp) / "serve.log")
            assert proc.proc is not None
            target = Target(proc.http_port, proc.grpc_port, proc.proc.pid)
            base_rss = _rss_mb(target.pid)
            for name, attack in phases:
                stop = threading.Event()
                outcomes: Outcomes = collections.Counter()
                start_rss = _rss_mb(target.pid)
                peak = _Peak(target.pid)
                attacker = threading.Thread(target=attack, args=(target, stop, outcomes), daemon=True) if attack else None
                if attacker:
                    attacker.start()
                    time.sleep(0.5)  # the attack in place
                prober = _Prober(proc.http_port)
                prober.start()
                time.sleep(seconds)
                prober.stop()
                stop.set()
                if attacker:
                    attacker.join(60)
                rows.append({"phase": name, "health": _stats(prober.health), "infer": _stats(prober.infer), "failed": prober.failed,
                             "rss_start_mb": start_rss, "rss_peak_mb": peak.stop(), "rss_after_mb": _rss_mb(target.pid),
                             "outcomes": dict(outcomes)})
                time.sleep(1.0)
            proc.stop()
    return {"seconds": seconds, "root": str(root), "base_rss_mb": base_rss, "rows": rows}


def _outcomes(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} x {what}" if n > 1 else what for what, n in sorted(counts.items())) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="the prober's time in each phase")
    parser.add_argument("--against", metavar="REV", help="also run the phases against this git revision's server, printed beside")
    parser.add_argument("--only", metavar="TEXT", help="run idle and the phases whose name contains TEXT (comma-separated) only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    wanted = [w.strip() for w in args.only.split(",")] if args.only else None
    phases = [p for i, p in enumerate(PHASES) if not i or wanted is None or any(w in p[0] for w in wanted)]
    results = {}
    if args.against:
        with checkout(args.against) as old:
            results[args.against] = run(args.seconds, old, phases)
    results["this checkout"] = run(args.seconds, ROOT, phases)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"onnxpipe serve, loopback, {' '.join(ARGS)} and a token ({' '.join(NEW_ARGS)} on this checkout's); a prober alternating "
          f"a health check and a small inference every 5 ms for {args.seconds:g} s per phase; RSS: the server and its JSON worker")
    for i, (name, _) in enumerate(phases):
        print(f"\n{name}")
        for label, result in results.items():
            r = result["rows"][i]
            h, inf = r["health"], r["infer"]
            print(f"  {label:>14}: health p99 {h['p99_ms']:7.2f} max {h['max_ms']:7.1f} ms | infer p99 {inf['p99_ms']:7.2f} ms, {r['failed']} failed | "
                  f"RSS {r['rss_start_mb']:5.0f} -> peak {r['rss_peak_mb']:5.0f}, after {r['rss_after_mb']:5.0f} MB | "
                  f"the attack's requests: {_outcomes(r['outcomes'])}")


if __name__ == "__main__":
    main()
