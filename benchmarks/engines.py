"""Thread engine vs Ray engine on this one host, measured side by side in one run.

1. Throughput: resnet50 (light, from the onnx wheel) in 2 stages x 1 intra-op thread, streamed by
   each engine in interleaved rounds (each loaded anew per round, load not timed); the ratio Ray / threads within
   each round and its median (the issue's goal: >= 0.9).
2. Latency of one request through 2 Identity stages, for a small tensor (16 bytes) and a 588 KiB one
   (1x3x224x224 float32), beside Ray's bare chain of the same shape measured in the same run: two
   actors, ``b.f.remote(a.f.remote(x))`` then ``ray.get``. A request makes 3 hops (driver -> stage 0
   -> stage 1 -> driver); the table shows the round trip and round trip / 3.
3. CPU seconds per request of the resnet50 runs: this process plus, for Ray, the stage actors'
   processes (from /proc; Ray's own daemons are not counted).

The Ray engine runs twice per round: as it comes (requests that queue up for a busy actor share
its next call) and with ``RayOptions(requests_per_call=1)`` (every request in a call of its own).

Ray runs as a local single-node instance (loopback, no dashboard, usage stats off, files in a
temporary folder), shut down at the end.

    python -m benchmarks.engines [--requests 60] [--rounds 3] [--latency-requests 200]
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort

from benchmarks._timing import median_seconds
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import Pipeline, PipelineSpec, RayOptions, interleaved_rounds, load
from onnxpipe.splitter import UniformPolicy, split

ort.set_default_logger_severity(3)
RESNET50 = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_resnet50.onnx"
IDENTITY = """<ir_version: 8, opset_import: ["" : 17]>
ident (float[N, C, H, W] x) => (float[N, C, H, W] y) { y = Identity(x) }"""


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_pids(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _actor_pids(pipe: Pipeline) -> list[int]:
    """The processes the stages run in, other than this one (the Ray engine's actors)."""
    diagnostics = pipe.diagnostics()
    return [] if diagnostics.in_process else [r.pid for stage in diagnostics.stages for r in stage.replicas if r.pid is not None]


def _stream(pipe: Pipeline, feeds: dict[str, np.ndarray], requests: int) -> tuple[float, float]:
    """Requests per second and CPU seconds per request."""
    for _ in pipe.map(feeds for _ in range(5)):
        pass
    pids = _actor_pids(pipe)
    cpu0, others0, start = _cpu_self(), _cpu_pids(pids), time.perf_counter()
    for _ in pipe.map(feeds for _ in range(requests)):
        pass
    seconds = time.perf_counter() - start
    cpu = _cpu_self() - cpu0 + _cpu_pids(pids) - others0
    return requests / seconds, cpu / requests


def _p50_ms(call: Callable[[], Any], requests: int) -> float:
    return 1e3 * median_seconds(call, requests, warmup=10)


def _identity_bundle(work: Path) -> Path:
    config = PipelineConfig("hops")
    model = onnx.parser.parse_model(IDENTITY)
    s0, s1 = config.add_stage(model, "s0"), config.add_stage(model, "s1")
    config.input("x").connect(s0.input("x"))
    s0.output("y").connect(s1.input("x"))
    s1.output("y").connect(config.output("y"))
    return export(build(config, work / "hops-built").path, work / "hops.onnxpipe")


class _BareStage:
    """Ray's bare pipeline stage (on this host: its module is read from the build folder): one onnxruntime session (1 thread, no spinning, as the engines'),
    fed the merged outputs of the calls before it; what the Ray engine is measured against."""

    def __init__(self, module: str) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(module, options, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.inputs = [i.name for i in self.session.get_inputs()]

    def run(self, *feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        merged = {k: v for feed in feeds for k, v in feed.items()}
        return dict(zip(self.names, self.session.run(None, {k: merged[k] for k in self.inputs}), strict=True))


def _bare_pipeline(ray: Any, modules: list[str], feeds: dict[str, np.ndarray], requests: int, window: int) -> float:
    """Requests per second through a chain of bare Ray actors, ``window`` requests in flight."""
    stage: Any = ray.remote(num_cpus=1)(_BareStage)
    actors = [stage.remote(m) for m in modules]
    try:

        def one() -> Any:
            ref = ray.put(feeds)
            for actor in actors:
                ref = actor.run.remote(ref)
            return ref

        for _ in range(5):
            ray.get(one())
        start, pending = time.perf_counter(), []
        for _ in range(requests):
            pending.append(one())
            if len(pending) >= window:
                ray.get(pending.pop(0))
        ray.get(pending)
        return requests / (time.perf_counter() - start)
    finally:
        for actor in actors:
            ray.kill(actor)


class _Hop:
    """Ray's bare hop: returns what it is given."""

    def f(self, x: np.ndarray) -> np.ndarray:
        return x


def _bare(ray: Any, a: Any, b: Any, x: np.ndarray) -> Any:
    return ray.get(b.f.remote(a.f.remote(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="resnet50 requests streamed per engine")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved throughput rounds")
    parser.add_argument("--latency-requests", type=int, default=200, help="requests timed one at a time per latency row")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="onnxpipe-engines-"))
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    import ray

    ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, _temp_dir=str(work / "ray"), logging_level=40,
             log_to_driver=False, _node_ip_address="127.0.0.1", object_store_memory=200 << 20)
    try:
        plan = split(RESNET50, policy=UniformPolicy(stages=2))
        for stage in plan.config.stages:
            stage.configure(intra_op_threads=1)
        built = build(plan.config, work / "built").path
        bundle = export(built, work / "resnet50.onnxpipe")
        modules = [str(built / str(st.module)) for st in PipelineSpec.from_json((built / "pipeline.json").read_text()).stages]
        feeds = {"gpu_0/data_0": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
        cpu: dict[str, list[float]] = {"thread": [], "ray": [], "ray-1": []}
        per_call: list[float] = []

        def measure(key: str) -> float:
            # Loaded for each round (not timed): one engine's idle workers never share the cores
            # with the other's run. "ray-1": the Ray engine with every request in a call of its own.
            engine = key.split("-")[0]
            options = RayOptions(requests_per_call=1) if key == "ray-1" else None
            with load(bundle, engine=engine, ray_options=options) as pipe:
                rate, per_request = _stream(pipe, feeds, args.requests)
                if key == "ray":
                    per_call.append((args.requests + 5) / (pipe.diagnostics().stages[0].calls or 1))
            cpu[key].append(per_request)
            return rate

        # The same window of requests in flight as the engines' pipelines (queue depth 4 + 1 per stage).
        bare_chain = functools.partial(_bare_pipeline, ray, modules, feeds, args.requests, 2 * (4 + 1))
        runs = {key: functools.partial(measure, key) for key in cpu}
        rounds = interleaved_rounds({**runs, "bare": bare_chain}, args.rounds)
        print(f"resnet50, 2 stages x 1 thread, {args.requests} requests x {args.rounds} interleaved rounds (medians):")
        for key in cpu:
            print(f"  {key:<7} {rounds.median(key):7.2f} req/s   {1e3 * statistics.median(cpu[key]):7.1f} ms CPU/request")
        print(f"  bare    {rounds.median('bare'):7.2f} req/s   (Ray's bare chain of 2 actors with the same two sessions)")
        print(f"  ray: {statistics.median(per_call):.1f} requests per call to stage 0; ray-1: every request in a call of its own")
        for key, base in (("ray", "thread"), ("ray-1", "thread"), ("bare", "thread"), ("ray", "bare")):
            ratios = rounds.ratios(key, base)
            print(f"  {key} / {base} throughput: {statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")

        hops = _identity_bundle(work)
        actor: Any = ray.remote(num_cpus=0)(_Hop)
        a, b = actor.remote(), actor.remote()
        print(f"\nOne request through 2 Identity stages, p50 of {args.latency_requests} (3 hops: driver -> s0 -> s1 -> driver):")
        for label, shape in (("16 B", (1, 1, 1, 4)), ("588 KiB", (1, 3, 224, 224))):
            x = np.ones(shape, np.float32)
            feed = {"x": x}
            with load(hops) as pipe:
                threads = _p50_ms(functools.partial(pipe, feed), args.latency_requests)
            with load(hops, engine="ray") as pipe:
                on_ray = _p50_ms(functools.partial(pipe, feed), args.latency_requests)
            bare = _p50_ms(functools.partial(_bare, ray, a, b, x), args.latency_requests)
            print(f"  {label:<8} threads {threads:7.3f} ms   ray engine {on_ray:7.3f} ms ({on_ray / 3:.3f}/hop)   "
                  f"bare ray actors {bare:7.3f} ms ({bare / 3:.3f}/hop)")
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
