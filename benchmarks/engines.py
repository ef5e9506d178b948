"""Thread engine vs Ray engine on this one host, measured side by side in one run.

1. Throughput: resnet50 (light, from the onnx wheel) in 2 stages x 1 intra-op thread, streamed by
   each engine; the ratio Ray / threads (the issue's goal: >= 0.9).
2. Latency of one request through 2 Identity stages, for a small tensor (16 bytes) and a 588 KiB one
   (1x3x224x224 float32), beside Ray's bare chain of the same shape measured in the same run: two
   actors, ``b.f.remote(a.f.remote(x))`` then ``ray.get``. A request makes 3 hops (driver -> stage 0
   -> stage 1 -> driver); the table shows the round trip and round trip / 3.
3. CPU seconds per request of the resnet50 runs: this process plus, for Ray, the stage actors'
   processes (from /proc; Ray's own daemons are not counted).

Ray runs as a local single-node instance (loopback, no dashboard, usage stats off, files in a
temporary folder), shut down at the end.

    python -m benchmarks.engines [--requests 60] [--latency-requests 200]
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
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

from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import Pipeline, load
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
    placements = getattr(pipe._engine, "placements", None)
    return [rep["pid"] for row in placements() for rep in row] if placements else []


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
    for _ in range(10):
        call()
    samples = []
    for _ in range(requests):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def _identity_bundle(work: Path) -> Path:
    config = PipelineConfig("hops")
    model = onnx.parser.parse_model(IDENTITY)
    s0, s1 = config.add_stage(model, "s0"), config.add_stage(model, "s1")
    config.input("x").connect(s0.input("x"))
    s0.output("y").connect(s1.input("x"))
    s1.output("y").connect(config.output("y"))
    return export(build(config, work / "hops-built").path, work / "hops.onnxpipe")


class _Hop:
    """Ray's bare hop: returns what it is given."""

    def f(self, x: np.ndarray) -> np.ndarray:
        return x


def _bare(ray: Any, a: Any, b: Any, x: np.ndarray) -> Any:
    return ray.get(b.f.remote(a.f.remote(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="resnet50 requests streamed per engine")
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
        bundle = export(build(plan.config, work / "built").path, work / "resnet50.onnxpipe")
        feeds = {"gpu_0/data_0": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
        rows: dict[str, tuple[float, float]] = {}
        for engine in ("thread", "ray"):
            with load(bundle, engine=engine) as pipe:
                rows[engine] = _stream(pipe, feeds, args.requests)
        print(f"resnet50, 2 stages x 1 thread, {args.requests} requests (req/s, CPU s per request):")
        for engine, (rate, cpu) in rows.items():
            print(f"  {engine:<7} {rate:7.2f} req/s   {1e3 * cpu:7.1f} ms CPU/request")
        print(f"  ray / threads throughput: {rows['ray'][0] / rows['thread'][0]:.2f}")

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


if __name__ == "__main__":
    main()
