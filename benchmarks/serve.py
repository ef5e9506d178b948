"""What serving costs: ``onnxpipe serve`` driven over HTTP (binary tensors) and gRPC, beside the
same bundle in process, and beside the peer a Python user would deploy instead, in one run.

Models: resnet50 and squeezenet from the onnx wheel, each split automatically in 2 stages x 1
thread, and ``floor``: squeezenet's 600 KB input into one stage that computes almost nothing,
whose latency at concurrency 1 is what the front door and the loopback alone add. Measured, in
interleaved rounds (medians with their range):

- **in process**: ``Pipeline.submit`` with ``C`` requests in flight (what ``pipe.map`` does), the
  ceiling of the served numbers;
- **served**: Triton's ``perf_analyzer`` at concurrency ``C`` (1, 4, 16) over HTTP and gRPC:
  throughput, p50 and p99 latency;
- **the peer**: the whole model as one onnxruntime session behind KServe's Python ModelServer
  (``benchmarks/kserve_peer.py``, in a venv with kserve: ``make bench-serve`` makes
  ``.venv-kserve``). perf_analyzer cannot drive it (it has no model configuration), so the peer
  and onnxpipe serve are both driven by the same closed-loop ``tritonclient`` load generator at
  concurrency 8 (binary tensors), and the ratio is printed.

Without perf_analyzer (``.ci/install-perf-analyzer``), the served rows use the ``tritonclient``
generator too, and say so. Goals (issue 19): at concurrency 16, served >= 0.9x in process for
resnet50 and >= 0.8x for squeezenet; at concurrency 1, served p99 <= in-process p99 + 2 ms.

    python -m benchmarks.serve [--rounds 3] [--seconds 3] [--models resnet50,squeezenet] [--peer .venv-kserve/bin/python] [--json]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxpipe.builder import build, export
from onnxpipe.runtime import interleaved_rounds, load
from onnxpipe.splitter import MeasuredPolicy, split
from tests.models import light_model_path
from tests.serve.process import ROOT, ServerProcess, free_ports

ort.set_default_logger_severity(3)

CONCURRENCY = (1, 4, 16)
PEER_CONCURRENCY = 8
GOALS = {"resnet50": 0.9, "squeezenet": 0.8}
_PEER_START_S = 120


def _inputs(model: str) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(light_model_path(model)), providers=["CPUExecutionProvider"])
    i = session.get_inputs()[0]
    return {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)}


FLOOR = "floor"


def _floor_bundle(folder: Path) -> Path:
    """One stage that takes squeezenet's 600 KB input and computes almost nothing (a ReduceMax): at
    concurrency 1 its served latency is what the front door and the loopback add, nothing else."""
    from onnx import TensorProto, helper

    from onnxpipe.builder import PipelineConfig

    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["data_0"], ["m"], keepdims=1)],
        FLOOR,
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, 1, 1, 1])],
    )
    config = PipelineConfig(FLOOR)
    stage = config.add_stage(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), FLOOR)
    config.input("data_0").connect(stage.input("data_0"))
    stage.output("m").connect(config.output("m"))
    return export(build(config, folder / "floor-built").path, folder / "floor.onnxpipe")


def _bundle(model: str, folder: Path) -> Path:
    plan = split(str(light_model_path(model)), policy=MeasuredPolicy(stages=2))
    for stage in plan.config.stages:
        stage.configure(intra_op_threads=1)
    return export(build(plan.config, folder / f"{model}-built").path, folder / f"{model}.onnxpipe")


class Sample:
    """One measurement: requests per second and latency percentiles in ms."""

    def __init__(self, rate: float, p50: float, p99: float) -> None:
        self.rate, self.p50, self.p99 = rate, p50, p99


def _percentiles(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    pick = lambda q: 1e3 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return pick(0.5), pick(0.99)


def in_process(pipe: Any, feeds: dict[str, np.ndarray], concurrency: int, seconds: float) -> Sample:
    """``concurrency`` requests kept in flight for ``seconds``: what pipe.map does, timed per request."""
    latencies: list[float] = []
    window: list[tuple[float, Future[Any]]] = []
    for _ in range(concurrency * 2):  # warm-up
        pipe.submit(feeds).result()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or window:
        while len(window) < concurrency and time.perf_counter() - start < seconds:
            window.append((time.perf_counter(), pipe.submit(feeds)))
        submitted, future = window.pop(0)
        future.result()
        latencies.append(time.perf_counter() - submitted)
    elapsed = time.perf_counter() - start
    return Sample(len(latencies) / elapsed, *_percentiles(latencies))


def perf_analyzer(binary: str, url: str, protocol: str, model: str, concurrency: int, seconds: float, folder: Path) -> Sample:
    """Triton's perf_analyzer at one concurrency: the mean of its last 3 windows of ``seconds / 2``."""
    out = folder / f"pa-{model}-{protocol}-{concurrency}.csv"
    cmd = [binary, "-m", model, "-u", url, "-i", protocol, "--concurrency-range", str(concurrency), "-p", str(int(seconds * 500)), "-s", "100",
           "-f", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    with out.open() as f:
        row = next(csv.DictReader(f))
    return Sample(float(row["Inferences/Second"]), float(row["p50 latency"]) / 1e3, float(row["p99 latency"]) / 1e3)


def closed_loop(url: str, protocol: str, model: str, feeds: dict[str, np.ndarray], concurrency: int, seconds: float) -> Sample:
    """``concurrency`` threads, each sending its next request when the last one is answered, with
    ``tritonclient`` and binary tensors (the client for servers perf_analyzer cannot drive)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    lib: Any = httpclient if protocol == "http" else grpcclient
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds + 0.5

    def worker() -> None:
        client = lib.InferenceServerClient(url, **({"network_timeout": 600.0, "connection_timeout": 600.0} if protocol == "http" else {}))
        tensors = []
        for name, value in feeds.items():
            tensor = lib.InferInput(name, list(value.shape), "FP32")
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        client.infer(model, tensors)  # warm-up, not counted
        mine = []
        while time.perf_counter() < stop:
            t = time.perf_counter()
            client.infer(model, tensors)
            mine.append((t, time.perf_counter() - t))
        with lock:
            latencies.extend(d for t, d in mine if t >= stop - seconds)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not latencies:
        return Sample(0.0, float("inf"), float("inf"))
    return Sample(len(latencies) / seconds, *_percentiles(latencies))


class Peer:
    """The whole model as one onnxruntime session behind KServe's ModelServer, in another venv."""

    def __init__(self, python: str, model: str, folder: Path) -> None:
        self.http_port, self.grpc_port = free_ports(2)
        self.log = (folder / f"kserve-{model}.log").open("w")
        cmd = [python, str(ROOT / "benchmarks" / "kserve_peer.py"), "--model_name", model, "--model_path", str(light_model_path(model)),
               "--http_port", str(self.http_port), "--grpc_port", str(self.grpc_port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=folder)
        deadline = time.monotonic() + _PEER_START_S
        import urllib.request

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the KServe peer exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the KServe peer did not start: see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run(models: list[str], rounds: int, seconds: float, peer_python: str | None) -> dict[str, Any]:
    pa = shutil.which("perf_analyzer", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        bundles = {**{m: _bundle(m, folder) for m in models}, FLOOR: _floor_bundle(folder)}
        feeds = {**{m: _inputs(m) for m in models}, FLOOR: _inputs("squeezenet")}
        server = ServerProcess(*[f"{m}={path}" for m, path in bundles.items()], "--max-inflight", "64")
        peers: dict[str, Peer] = {}
        pipes = {m: load(path) for m, path in bundles.items()}
        try:
            server.start(folder / "serve.log")
            if peer_python:
                peers = {m: Peer(peer_python, m, folder) for m in models}
            samples: dict[str, list[Sample]] = {}
            candidates: dict[str, Callable[[], float]] = {}

            def add(key: str, measure: Callable[[], Sample]) -> None:
                samples[key] = []

                def once() -> float:
                    s = measure()
                    samples[key].append(s)
                    return s.rate

                candidates[key] = once

            for m in [*models, FLOOR]:
                for c in CONCURRENCY if m != FLOOR else (1,):
                    add(f"{m}|in process|{c}", partial(in_process, pipes[m], feeds[m], c, seconds))
                    for proto in ("http", "grpc"):
                        url = server.http if proto == "http" else server.grpc
                        if pa:
                            add(f"{m}|served {proto}|{c}", partial(perf_analyzer, pa, url, proto, m, c, seconds, folder))
                        else:
                            add(f"{m}|served {proto}|{c}", partial(closed_loop, url, proto, m, feeds[m], c, seconds))
                for proto in ("http", "grpc") if peers and m != FLOOR else ():
                    ours = server.http if proto == "http" else server.grpc
                    theirs = f"127.0.0.1:{peers[m].http_port if proto == 'http' else peers[m].grpc_port}"
                    add(f"{m}|onnxpipe {proto} (tritonclient)|{PEER_CONCURRENCY}", partial(closed_loop, ours, proto, m, feeds[m], PEER_CONCURRENCY, seconds))
                    add(f"{m}|kserve {proto} (tritonclient)|{PEER_CONCURRENCY}", partial(closed_loop, theirs, proto, m, feeds[m], PEER_CONCURRENCY, seconds))

            def progress(done: int, total: int) -> None:
                print(f"\r  measured {done}/{total}", end="", file=sys.stderr, flush=True)

            measured = interleaved_rounds(candidates, rounds, progress)
            print(file=sys.stderr)
            assert server.stop() == 0, server.log()
        finally:
            for p in pipes.values():
                p.close()
            for peer in peers.values():
                peer.stop()
            if server.proc is not None and server.proc.poll() is None:
                server.proc.kill()
    rows = []
    for key, values in samples.items():
        model, how, concurrency = key.split("|")
        rows.append({
            "model": model, "how": how, "concurrency": int(concurrency),
            "rate": statistics.median(s.rate for s in values), "rate_min": min(s.rate for s in values), "rate_max": max(s.rate for s in values),
            "p50_ms": statistics.median(s.p50 for s in values), "p99_ms": statistics.median(s.p99 for s in values),
        })
    ratios = {}
    for key in samples:
        model, how, concurrency = key.split("|")
        if how.startswith("served"):
            r = measured.ratios(key, f"{model}|in process|{concurrency}")
            ratios[key] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
        if how.startswith("kserve"):
            r = measured.ratios(key, key.replace("kserve", "onnxpipe"))
            ratios[key] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    return {"rounds": rounds, "seconds": seconds, "client": "perf_analyzer" if pa else "tritonclient closed loop", "cores": len(os.sched_getaffinity(0)),
            "rows": rows, "ratios": ratios}


def _report(result: dict[str, Any]) -> None:
    print(f"{result['cores']} cores; served rows by {result['client']}; median of {result['rounds']} interleaved rounds of {result['seconds']:g} s "
          "(range in brackets); ratios paired per round")
    print(f"{'model':<11} {'how':<32} {'C':>3} {'req/s':>18} {'p50 ms':>8} {'p99 ms':>8} {'ratio':>22}")
    for row in result["rows"]:
        key = f"{row['model']}|{row['how']}|{row['concurrency']}"
        ratio = result["ratios"].get(key)
        base = "vs in process" if row["how"].startswith("served") else "vs onnxpipe"
        shown = f"{ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}] {base}" if ratio else ""
        rate = f"{row['rate']:.1f} [{row['rate_min']:.0f}-{row['rate_max']:.0f}]"
        print(f"{row['model']:<11} {row['how']:<32} {row['concurrency']:>3} {rate:>18} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {shown:>22}")
    print("goals:")
    rows = {(r["model"], r["how"], r["concurrency"]): r for r in result["rows"]}
    for model, goal in GOALS.items():
        for proto in ("http", "grpc"):
            ratio = result["ratios"].get(f"{model}|served {proto}|16")
            if ratio is None:
                continue
            served, local = rows[(model, f"served {proto}", 1)], rows[(model, "in process", 1)]
            print(f"  {model} {proto}: c=16 {ratio['median']:.2f}x in process (goal >= {goal}) {'met' if ratio['median'] >= goal else 'NOT met'}; "
                  f"c=1 p99 {served['p99_ms']:.2f} ms vs in-process p99 {local['p99_ms']:.2f} ms + 2 "
                  f"{'met' if served['p99_ms'] <= local['p99_ms'] + 2 else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,squeezenet")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds measured per configuration and round")
    default_peer = ROOT / ".venv-kserve" / "bin" / "python"
    parser.add_argument("--peer", default=str(default_peer) if default_peer.exists() else None,
                        help="the Python of a venv with kserve, for the peer (default: .venv-kserve/bin/python if present)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()
    if args.peer is None:
        print("no KServe peer: make bench-serve creates .venv-kserve (or give --peer PYTHON)", file=sys.stderr)
    result = run(args.models.split(","), args.rounds, args.seconds, args.peer)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _report(result)


if __name__ == "__main__":
    main()
