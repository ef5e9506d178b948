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

**Against Triton** (``--vs-triton``, issue 30): for each model (resnet50 and squeezenet with seeded
random weights and a free batch dim, ``benchmarks/_models.py``; PP-OCRv4's recognizer from the
rapidocr_onnxruntime wheel, [1, 3, 48, 320]), each N of 1, 8 and 16 and each protocol, perf_analyzer
at concurrency N against, in interleaved rounds:

- **onnxpipe planned**: ``onnxpipe serve`` of the plan for N of ``onnxpipe split MODEL --auto --cores 2
  --concurrency 1,8,16`` (one call, a plan per N), built and exported as a user does (without ``--concurrency`` in this onnxpipe, the ``--cores 2``
  plan at every N, and the report says so);
- **onnxpipe 2x1**: the 2 stages x 1 thread pipeline it replaces (the bundle of the rows above);
- **pytriton plain / batched**: the whole model as one onnxruntime session x 2 threads behind
  PyTriton 0.7.0 (tritonserver 2.51; ``benchmarks/pytriton_peer.py``, in ``.venv-pytriton``), without
  batching and with Triton's dynamic batcher, max batch 8.

Every server's answer to one request is first checked against onnxruntime on the whole model.
Printed: each row's req/s (median [range]) and p50/p99, and per point the ratios planned /
PyTriton's best (the better variant in each round: the stricter pairing) and planned / 2x1, with
the goal (>= 1.0x) and moonshot (1.3x). perf_analyzer takes 3 windows of ``seconds / 2`` a
measurement; the full run (3 models x 3 N x 2 protocols x 4 servers x 3 rounds, 2 s: 216
measurements) took 18 minutes on 2 cores, 4 of them planning (docs/serving.md). ``--quick``:
squeezenet at N = 8, one round, for a smoke run (a minute).

    python -m benchmarks.serve --vs-triton [--quick] [--models resnet50,squeezenet,ppocr-rec] [--concurrency 1,8,16]
        [--rounds 3] [--seconds 2] [--triton-python .venv-pytriton/bin/python] [--split-arg=--rounds --split-arg=3] [--json]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import re
import shutil
import signal
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

from benchmarks._models import light_copy
from benchmarks._timing import spread
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


def perf_analyzer(binary: str, url: str, protocol: str, model: str, concurrency: int, seconds: float, folder: Path,
                  extra: list[str] | None = None, stability: int = 100) -> Sample:
    """Triton's perf_analyzer at one concurrency: the mean of its last 3 windows of ``seconds / 2``
    (within ``stability`` percent of each other); ``extra``: more of its options (``--shape``)."""
    out = folder / f"pa-{model}-{protocol}-{concurrency}.csv"
    cmd = [binary, "-m", model, "-u", url, "-i", protocol, "--concurrency-range", str(concurrency), "-p", str(int(seconds * 500)),
           "-s", str(stability), "-f", str(out), *(extra or [])]
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

            measured = interleaved_rounds(candidates, rounds, _progress)
            print(file=sys.stderr)
            assert server.stop() == 0, server.log()
        finally:
            for p in pipes.values():
                p.close()
            for peer in peers.values():
                peer.stop()
            server.kill()
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
            ratios[key] = spread(r)
        if how.startswith("kserve"):
            r = measured.ratios(key, key.replace("kserve", "onnxpipe"))
            ratios[key] = spread(r)
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


# -- against Triton (issue 30) ------------------------------------------------------------------

VS_MODELS = ("resnet50", "squeezenet", "ppocr-rec")
VS_CONCURRENCY = (1, 8, 16)
#: onnxpipe serve of the planner's bundle over PyTriton's best variant: the goal and the moonshot (issue 30).
TRITON_GOAL, TRITON_MOONSHOT = 1.0, 1.3
PPOCR = "ppocr-rec"
#: The recognizer's request: its input's height (an unnamed dim) and width are free.
_PPOCR_SHAPE = (1, 3, 48, 320)
_TRITON_START_S = 300
_ATOL = 1e-3
#: perf_analyzer's stability bound, in percent: any 3 windows do, so that every point costs the same
#: 3 windows (a 1-2 s window at concurrency 1 holds few resnet50 requests; rounds give the spread).
_VS_STABILITY = 1000


class Subject:
    """A model made ready for the comparison: its file, one request, and the ``--dim`` options
    ``onnxpipe split`` needs for it."""

    def __init__(self, name: str, path: Path, feeds: dict[str, np.ndarray], dims: tuple[str, ...] = ()) -> None:
        self.name, self.path, self.feeds, self.dims = name, path, feeds, dims


def _subject(model: str, folder: Path) -> Subject:
    """resnet50 and squeezenet: the light models with seeded random weights and a free batch dim
    (benchmarks/_models.py); ppocr-rec: PP-OCRv4's recognizer from the rapidocr_onnxruntime
    wheel's folder (real weights, every dim free)."""
    if model == PPOCR:
        spec = importlib.util.find_spec("rapidocr_onnxruntime")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("ppocr-rec needs the rapidocr_onnxruntime wheel's models: pip install --no-deps rapidocr_onnxruntime==1.4.4")
        x = np.random.default_rng(0).uniform(-1, 1, _PPOCR_SHAPE).astype(np.float32)
        path = Path(spec.submodule_search_locations[0]) / "models" / "ch_PP-OCRv4_rec_infer.onnx"
        return Subject(model, path, {"x": x}, ("--dim", f"x.2={_PPOCR_SHAPE[2]}", "--dim", f"p2o.DynamicDimension.1={_PPOCR_SHAPE[3]}"))
    path = light_copy(model, folder)
    port = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0]
    return Subject(model, path, {port.name: np.random.default_rng(0).standard_normal([1, *port.shape[1:]]).astype(np.float32)})


def _onnxpipe(*args: object, log: Path) -> str:
    """``onnxpipe ARGS`` as a user runs it; its output (also appended to ``log``), or its failure."""
    done = subprocess.run([sys.executable, "-m", "onnxpipe.cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    with log.open("a") as f:
        f.write(f"$ onnxpipe {' '.join(map(str, args))}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        raise RuntimeError(f"onnxpipe {' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _split_has_concurrency() -> bool:
    return "--concurrency" in _onnxpipe("split", "--help", log=Path(os.devnull))


def _planned(subject: Subject, concurrencies: list[int] | None, folder: Path, split_args: list[str], log: Path) -> tuple[dict[int | None, Path], str]:
    """The planner's bundles for these Ns on 2 cores, from one ``onnxpipe split --concurrency``
    (which writes ``OUT/concurrency-N/`` for several: ``None``, the planner without it), each
    built and exported as a user does; the bundle for each N, and the planner's summary."""
    plan = folder / f"{subject.name}-plan"
    concurrency = ["--concurrency", ",".join(map(str, concurrencies))] if concurrencies else []
    summary = _onnxpipe("split", subject.path, "-o", plan, "--auto", "--cores", "2", *concurrency, *subject.dims, *split_args, "--overwrite", log=log)
    bundles: dict[int | None, Path] = {}
    wanted: list[int | None] = list(concurrencies) if concurrencies else [None]
    for n in wanted:
        split_dir = plan / f"concurrency-{n}" if n is not None and (plan / f"concurrency-{n}").is_dir() else plan
        tag = f"{subject.name}-n{n}" if n is not None else f"{subject.name}-auto"
        _onnxpipe("build", split_dir, "-o", folder / f"{tag}-built", "--overwrite", log=log)
        _onnxpipe("export", folder / f"{tag}-built", "-o", folder / f"{tag}.onnxpipe", "--overwrite", log=log)
        bundles[n] = folder / f"{tag}.onnxpipe"
    return bundles, summary.rstrip()


def _progress(done: int, total: int) -> None:
    print(f"\r  measured {done}/{total}", end="", file=sys.stderr, flush=True)


def _plan_line(summary: str, n: int) -> str:
    """The planner's line about N (``chosen at N=8: ...``), or its first line (the plan, without --concurrency)."""
    lines = [line.strip() for line in summary.splitlines() if line.strip()]
    return next((line for line in lines if re.match(rf"(chosen )?at N={n}\b", line)), lines[0] if lines else "")


def _two_by_one(subject: Subject, folder: Path, log: Path) -> Path:
    """What the planner's bundle replaces: 2 stages cut by measured costs, 1 thread each (the
    bundle of this benchmark's other rows)."""
    tag = f"{subject.name}-2x1"
    _onnxpipe("split", subject.path, "-o", folder / f"{tag}-split", "--auto", "--stages", "2", *subject.dims, "--overwrite", log=log)
    _onnxpipe("build", folder / f"{tag}-split", "-o", folder / f"{tag}-built", "--stage", "*:threads=1", "--overwrite", log=log)
    _onnxpipe("export", folder / f"{tag}-built", "-o", folder / f"{tag}.onnxpipe", "--overwrite", log=log)
    return folder / f"{tag}.onnxpipe"


class TritonPeer:
    """The model behind PyTriton (``benchmarks/pytriton_peer.py``) in its own venv: served as
    ``NAME-plain`` (no batching) and ``NAME-batched`` (Triton's dynamic batcher, max batch 8)."""

    VARIANTS = ("plain", "batched")

    def __init__(self, python: str, subject: Subject, folder: Path) -> None:
        self.http_port, self.grpc_port = free_ports(2)
        self.log = (folder / f"pytriton-{subject.name}.log").open("w")
        cmd = [python, str(ROOT / "benchmarks" / "pytriton_peer.py"), "--name", subject.name, "--model", str(subject.path),
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--threads", "2"]
        # A session of its own: tritonserver and its Python stubs are its children, stopped with it.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
        import urllib.request

        deadline = time.monotonic() + _TRITON_START_S
        pending = [f"{subject.name}-{v}" for v in self.VARIANTS]
        while pending and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the PyTriton peer exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/models/{pending[0]}/ready", timeout=1) as r:
                    if r.status == 200:
                        pending.pop(0)
                        continue
            except OSError:
                pass
            time.sleep(0.5)
        if pending:
            self.stop()
            raise RuntimeError(f"the PyTriton peer did not load {pending} in {_TRITON_START_S} s: see {self.log.name}")

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.http_port if protocol == 'http' else self.grpc_port}"

    def stop(self) -> None:
        self.proc.terminate()  # pytriton_peer turns SIGTERM into Triton.stop()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _shape_options(http: str, model: str, feeds: dict[str, np.ndarray]) -> list[str]:
    """perf_analyzer's ``--shape`` for the inputs whose config has a free dim, from the request's
    shape (less the batch dim when the model batches, as Triton's config leaves it out)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/config", timeout=10) as r:
        config = json.load(r)
    skip = 1 if config.get("max_batch_size", 0) else 0
    options = []
    for port in config["input"]:
        if any(int(d) < 0 for d in port["dims"]):
            options += ["--shape", f"{port['name']}:{','.join(str(d) for d in feeds[port['name']].shape[skip:])}"]
    return options


def _check_answer(http: str, model: str, subject: Subject, expected: dict[str, np.ndarray]) -> float:
    """One request over HTTP: its outputs must be the whole model's in onnxruntime (within
    ``_ATOL``), so that every server measured computes the same thing; the largest difference."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http, network_timeout=120.0)
    tensors = []
    for name, value in subject.feeds.items():
        tensor = httpclient.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    result = client.infer(model, tensors)
    worst = 0.0
    for name, want in expected.items():
        got = result.as_numpy(name)
        if got is None or got.shape != want.shape:
            raise RuntimeError(f"{model} at {http}: output '{name}' is {None if got is None else got.shape}, expected {want.shape}")
        worst = max(worst, float(np.max(np.abs(got - want))))
    if worst > _ATOL:
        raise RuntimeError(f"{model} at {http}: outputs differ from the whole model by {worst:.2e} (> {_ATOL})")
    return worst


def _how(variant: str) -> str:
    return {"planned": "onnxpipe planned", "2x1": "onnxpipe 2x1", "plain": "pytriton plain", "batched": "pytriton batched"}[variant]


def run_vs_triton(models: list[str], concurrencies: list[int], rounds: int, seconds: float, triton_python: str,
                  split_args: list[str]) -> dict[str, Any]:
    """For each model, N and protocol, in interleaved rounds, perf_analyzer against ``onnxpipe
    serve`` of the planner's bundle for N, of the 2 x 1 pipeline, and PyTriton's two variants."""
    started = time.monotonic()
    pa = shutil.which("perf_analyzer", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if pa is None:
        raise SystemExit("--vs-triton needs perf_analyzer: make perf-analyzer (.ci/install-perf-analyzer .venv)")
    with_concurrency = _split_has_concurrency()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        log = folder / "onnxpipe.log"
        subjects = {m: _subject(m, folder) for m in models}
        bundles: dict[str, Path] = {}
        plans: dict[str, str] = {}
        for m, subject in subjects.items():
            print(f"  planning {m}{' for N = ' + ', '.join(map(str, concurrencies)) if with_concurrency else ''} ...", file=sys.stderr, flush=True)
            planned, plans[m] = _planned(subject, concurrencies if with_concurrency else None, folder, split_args, log)
            for n in concurrencies:
                bundles[f"{m}-n{n}"] = planned[n if with_concurrency else None]
            bundles[f"{m}-2x1"] = _two_by_one(subject, folder, log)
        planned_s = time.monotonic() - started
        expected = {}
        for m, subject in subjects.items():
            session = ort.InferenceSession(str(subject.path), providers=["CPUExecutionProvider"])
            expected[m] = dict(zip([o.name for o in session.get_outputs()], session.run(None, subject.feeds), strict=True))
        server = ServerProcess(*[f"{name}={path}" for name, path in bundles.items()], "--max-inflight", "64")
        peers: dict[str, TritonPeer] = {}
        try:
            server.start(folder / "serve.log")
            for m, subject in subjects.items():
                print(f"  starting PyTriton for {m} ...", file=sys.stderr, flush=True)
                peers[m] = TritonPeer(triton_python, subject, folder)
            diffs: dict[str, float] = {}
            targets: dict[str, tuple[str, str]] = {}  # variant key -> (served name, server) per model and N
            for m, subject in subjects.items():
                for n in concurrencies:
                    for variant, name, http in (("planned", f"{m}-n{n}", server.http), ("2x1", f"{m}-2x1", server.http),
                                                ("plain", f"{m}-plain", peers[m].url("http")), ("batched", f"{m}-batched", peers[m].url("http"))):
                        targets[f"{m}|{n}|{variant}"] = (name, http)
                        if f"{name}@{http}" not in diffs:
                            diffs[f"{name}@{http}"] = _check_answer(http, name, subject, expected[m])
            samples: dict[str, list[Sample]] = {}
            candidates: dict[str, Callable[[], float]] = {}
            for m, subject in subjects.items():
                for n in concurrencies:
                    for proto in ("http", "grpc"):
                        for variant in ("planned", "2x1", "plain", "batched"):
                            name, http = targets[f"{m}|{n}|{variant}"]
                            url = (server.http if proto == "http" else server.grpc) if variant in ("planned", "2x1") else peers[m].url(proto)
                            key = f"{m}|{proto}|{n}|{variant}"
                            samples[key] = []
                            measure = partial(perf_analyzer, pa, url, proto, name, n, seconds, folder, _shape_options(http, name, subject.feeds), _VS_STABILITY)

                            def once(measure: Callable[[], Sample] = measure, key: str = key) -> float:
                                s = measure()
                                samples[key].append(s)
                                return s.rate

                            candidates[key] = once

            measured = interleaved_rounds(candidates, rounds, _progress)
            print(file=sys.stderr)
            assert server.stop() == 0, server.log()
        finally:
            for peer in peers.values():
                peer.stop()
            server.kill()
    points = []
    for m in models:
        for n in concurrencies:
            for proto in ("http", "grpc"):
                key = f"{m}|{proto}|{n}"
                values = {v: samples[f"{key}|{v}"] for v in ("planned", "2x1", "plain", "batched")}
                # PyTriton's best in each round (the better variant there): the stricter comparison.
                best = [max(p, b) for p, b in zip(measured.values[f"{key}|plain"], measured.values[f"{key}|batched"], strict=True)]
                vs_triton = [a / b if b else float("inf") for a, b in zip(measured.values[f"{key}|planned"], best, strict=True)]
                vs_pipeline = measured.ratios(f"{key}|planned", f"{key}|2x1")
                points.append({
                    "model": m, "concurrency": n, "protocol": proto,
                    "plan": _plan_line(plans[m], n),
                    "rows": {_how(v): _summary(s) for v, s in values.items()},
                    "pytriton_best": max(("plain", "batched"), key=lambda v: statistics.median(measured.values[f"{key}|{v}"])),
                    "vs_pytriton": spread(vs_triton), "vs_2x1": spread(vs_pipeline),
                })
    return {"mode": "vs-triton", "rounds": rounds, "seconds": seconds, "cores": len(os.sched_getaffinity(0)), "points": points,
            "planner_concurrency": with_concurrency, "planner_summaries": plans,
            "answers_max_abs_diff": diffs, "planning_s": planned_s, "total_s": time.monotonic() - started}


def _summary(samples: list[Sample]) -> dict[str, float]:
    return {"rate": statistics.median(s.rate for s in samples), "rate_min": min(s.rate for s in samples), "rate_max": max(s.rate for s in samples),
            "p50_ms": statistics.median(s.p50 for s in samples), "p99_ms": statistics.median(s.p99 for s in samples)}


def _plan_label(line: str) -> str:
    """The plan's label in the planner's line about N (``chosen at N=8: 2 replicas x 1t: ...``)."""
    found = re.match(r"(?:chosen )?at N=\d+[^:]*: (.+?): ", line)
    return found.group(1) if found else line


def _report_vs_triton(result: dict[str, Any]) -> None:
    print(f"{result['cores']} cores; perf_analyzer; median of {result['rounds']} interleaved round(s) of {result['seconds']:g} s a point (range in brackets); "
          f"ratios paired per round, PyTriton's best = the better of its two variants in that round")
    if not result["planner_concurrency"]:
        print("NOTE: onnxpipe split has no --concurrency here: 'planned' is the --auto --cores 2 plan at every N")
    for model, summary in result["planner_summaries"].items():
        print(f"the planner on {model} (onnxpipe split --auto --cores 2{' --concurrency ...' if result['planner_concurrency'] else ''}):")
        print("\n".join("  " + line for line in summary.splitlines()))
    print(f"{'model':<11} {'N':>3} {'proto':<5} {'how':<17} {'req/s':>18} {'p50 ms':>8} {'p99 ms':>8}")
    for point in result["points"]:
        for how, row in point["rows"].items():
            rate = f"{row['rate']:.1f} [{row['rate_min']:.0f}-{row['rate_max']:.0f}]"
            print(f"{point['model']:<11} {point['concurrency']:>3} {point['protocol']:<5} {how:<17} {rate:>18} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}")
    print(f"ratios (goal >= {TRITON_GOAL:g}x PyTriton's best at every point, moonshot {TRITON_MOONSHOT:g}x):")
    print(f"{'model':<11} {'N':>3} {'proto':<5} {'planned/PyTriton best':>24} {'best':>8} {'planned/2x1':>20} {'p99 planned':>12} {'p99 PyTriton':>13}"
          "  verdict   plan")
    met = 0
    for point in result["points"]:
        vt, vp = point["vs_pytriton"], point["vs_2x1"]
        theirs = point["rows"][_how(point["pytriton_best"])]
        verdict = "moonshot" if vt["median"] >= TRITON_MOONSHOT else "goal met" if vt["median"] >= TRITON_GOAL else "NOT met"
        met += vt["median"] >= TRITON_GOAL
        print(f"{point['model']:<11} {point['concurrency']:>3} {point['protocol']:<5} "
              f"{vt['median']:>8.2f}x [{vt['min']:.2f}-{vt['max']:.2f}] {point['pytriton_best']:>8} {vp['median']:>6.2f}x [{vp['min']:.2f}-{vp['max']:.2f}] "
              f"{point['rows']['onnxpipe planned']['p99_ms']:>12.2f} {theirs['p99_ms']:>13.2f}  {verdict:<9} {_plan_label(point['plan'])}")
    print(f"goal met at {met} of {len(result['points'])} points; outputs checked against onnxruntime on the whole model "
          f"(largest difference {max(result['answers_max_abs_diff'].values()):.1e}); planning took {result['planning_s']:.0f} s, "
          f"the whole run {result['total_s'] / 60:.1f} min")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="default: resnet50,squeezenet; with --vs-triton, resnet50,squeezenet,ppocr-rec")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=None, help="seconds measured per configuration and round (default 3; with --vs-triton 2)")
    default_peer = ROOT / ".venv-kserve" / "bin" / "python"
    parser.add_argument("--peer", default=str(default_peer) if default_peer.exists() else None,
                        help="the Python of a venv with kserve, for the peer (default: .venv-kserve/bin/python if present)")
    parser.add_argument("--vs-triton", action="store_true",
                        help="onnxpipe serve of the planner's bundle for each N against PyTriton and the 2 x 1 pipeline (issue 30)")
    parser.add_argument("--concurrency", default=None, help="with --vs-triton: the Ns (default 1,8,16)")
    default_triton = ROOT / ".venv-pytriton" / "bin" / "python"
    parser.add_argument("--triton-python", default=str(default_triton),
                        help="with --vs-triton: the Python of a venv with nvidia-pytriton and onnxruntime (default: .venv-pytriton/bin/python)")
    parser.add_argument("--split-arg", action="append", default=[], metavar="ARG",
                        help="with --vs-triton: one more option for the planner's onnxpipe split (repeatable), e.g. --split-arg=--rounds --split-arg=3")
    parser.add_argument("--quick", action="store_true", help="with --vs-triton: a smoke run: squeezenet, N = 8, one round (unless given)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()
    if args.vs_triton:
        if not Path(args.triton_python).exists():
            raise SystemExit(f"no PyTriton peer at {args.triton_python}: make bench-serve creates .venv-pytriton (or give --triton-python PYTHON)")
        models = (args.models or ("squeezenet" if args.quick else ",".join(VS_MODELS))).split(",")
        unknown = [m for m in models if m not in VS_MODELS]
        if unknown:
            raise SystemExit(f"--vs-triton: unknown model(s) {unknown}; choose from {', '.join(VS_MODELS)}")
        concurrencies = [int(c) for c in (args.concurrency or ("8" if args.quick else ",".join(map(str, VS_CONCURRENCY)))).split(",")]
        rounds = 1 if args.quick and "--rounds" not in sys.argv else args.rounds
        # Absolute, not resolved: the peer runs in a folder of its own, and a venv's python is a link it must be called by.
        triton_python = os.path.abspath(args.triton_python)
        result = run_vs_triton(models, concurrencies, rounds, args.seconds or 2.0, triton_python, args.split_arg)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            _report_vs_triton(result)
        return
    if args.peer is None:
        print("no KServe peer: make bench-serve creates .venv-kserve (or give --peer PYTHON)", file=sys.stderr)
    result = run((args.models or "resnet50,squeezenet").split(","), args.rounds, args.seconds or 3.0, args.peer)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _report(result)


if __name__ == "__main__":
    main()
