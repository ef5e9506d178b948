"""benchmark(): drive a loaded pipeline with synthetic requests and put its numbers next to what
its stages do alone.

The standalone time of a stage is measured with a session of its own (same module, same settings),
fed the real tensors the stage receives, one run at a time on a thread pinned like the stage's
worker, median of several runs. The slowest stage (per replica) bounds the pipeline: its *ideal*
throughput is ``min over stages of replicas / standalone time``, and ``efficiency`` is the measured
throughput over that bound.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from onnxpipe.runtime._inputs import random_inputs
from onnxpipe.runtime._pipeline import Pipeline
from onnxpipe.runtime._sequential import SequentialPipeline
from onnxpipe.runtime._session import make_session
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stats import PipelineStats

__all__ = ["BenchReport", "StageBench", "benchmark"]


@dataclass(frozen=True)
class StageBench:
    """One stage: alone, and inside the pipeline."""

    stage: str
    replicas: int
    standalone_ms: float
    pipeline_mean_ms: float
    utilization: float


@dataclass(frozen=True)
class BenchReport:
    """What :func:`benchmark` measured.

    Attributes:
        requests: Requests timed (after warm-up).
        seconds: Wall time of those requests.
        throughput: Requests per second.
        latency_mean_ms, latency_p50_ms, latency_p99_ms: Submission-to-result times.
        ideal_throughput: What the slowest stage allows (``replicas / standalone time``); ``None``
            when standalone times were not measured.
        efficiency: ``throughput / ideal_throughput``, or ``None``.
        bottleneck: The stage with the highest utilization in the pipeline.
        stages: Per-stage numbers, in pipeline order.
        notes: Things to know (defaulted dims, ...).
    """

    requests: int
    seconds: float
    throughput: float
    latency_mean_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    ideal_throughput: float | None
    efficiency: float | None
    bottleneck: str
    stages: tuple[StageBench, ...]
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _time_runs(session: Any, feeds: Mapping[str, Any], names: list[str], cores: set[int] | None, runs: int, out: list[float]) -> None:
    """Median seconds of ``runs`` runs after 3 warm-ups, on this thread pinned like the stage's worker."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    for _ in range(3):
        session.run(names, feeds)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(names, feeds)
        samples.append(time.perf_counter() - start)
    out.append(statistics.median(samples))


def _standalone_ms(pipe: Pipeline, feeds: Mapping[str, np.ndarray], runs: int, target: str | None) -> list[float]:
    spec = pipe.spec
    values = SequentialPipeline(spec, pipe.bundle.root, target).run_all(feeds)
    times: list[float] = []
    for stage in spec.stages:
        session = make_session(pipe.bundle.root / stage.module, stage, target)
        stage_feeds = {t.name: values[spec.source_of(Endpoint(stage.name, t.name))] for t in stage.inputs}
        result: list[float] = []
        args = (session, stage_feeds, [t.name for t in stage.outputs], stage.settings.worker_cores(), runs, result)
        worker = threading.Thread(target=_time_runs, args=args, name=f"bench-{stage.name}")
        worker.start()
        worker.join()
        times.append(result[0] * 1e3)
    return times


def benchmark(
    pipe: Pipeline,
    requests: int = 200,
    *,
    warmup: int = 10,
    inputs: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    standalone_runs: int = 20,
    target: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BenchReport:
    """Stream ``requests`` synthetic requests through ``pipe`` and measure it against its stages.

    Args:
        pipe: A loaded pipeline.
        requests: Requests to time.
        warmup: Requests run first and not timed.
        inputs: One request's inputs (default: random ones of the declared shapes).
        dims: Sizes of symbolic dims for random inputs.
        standalone_runs: Runs per stage for its standalone time (0 skips that measurement).
        target: Target for the standalone sessions (default: the one the pipeline was loaded with).
        progress: Called with (done, total) as timed requests finish.

    Returns:
        The :class:`BenchReport`.
    """
    target = target if target is not None else pipe.target
    notes: list[str] = []
    if inputs is None:
        inputs, notes = random_inputs(pipe.spec.inputs, dims)
    for _ in pipe.map(inputs for _ in range(warmup)):
        pass
    pipe.reset_stats()
    start = time.perf_counter()
    for done, _ in enumerate(pipe.map(inputs for _ in range(requests)), 1):
        if progress is not None:
            progress(done, requests)
    seconds = time.perf_counter() - start
    stats: PipelineStats = pipe.stats()
    standalone = _standalone_ms(pipe, inputs, standalone_runs, target) if standalone_runs else [0.0] * len(stats.stages)
    bounds = [s.replicas / (ms / 1e3) for s, ms in zip(stats.stages, standalone, strict=True) if ms > 0]
    ideal = min(bounds) if bounds else None
    throughput = requests / seconds if seconds > 0 else 0.0
    return BenchReport(
        requests=requests,
        seconds=seconds,
        throughput=throughput,
        latency_mean_ms=stats.latency_mean_ms,
        latency_p50_ms=stats.latency_p50_ms,
        latency_p99_ms=stats.latency_p99_ms,
        ideal_throughput=ideal,
        efficiency=throughput / ideal if ideal else None,
        bottleneck=stats.bottleneck,
        stages=tuple(
            StageBench(s.stage, s.replicas, ms, s.mean_ms, s.utilization) for s, ms in zip(stats.stages, standalone, strict=True)
        ),
        notes=tuple(notes),
    )
