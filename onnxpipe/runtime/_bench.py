"""benchmark(): drive a loaded pipeline with synthetic requests and put its numbers next to what
its stages do alone.

The standalone time of a stage is measured with the pipeline's own session of the stage (its first
replica's) while the pipeline is idle, fed the real tensors the stage receives, one run at a time on
a thread pinned like that replica's worker, median of several runs. Those tensors are computed by
the same sessions, stage after stage, so measuring never creates a second session of a stage: a
second copy of its weights in memory, which for a large model is more than the host may have. The slowest stage (per replica) bounds the pipeline: its *ideal*
throughput is ``min over stages of replicas / standalone time``, and ``efficiency`` is the measured
throughput over that bound.

The thread that feeds the pipeline needs CPU too. On a machine where every core runs a stage it
preempts whichever stage shares its core; ``caller_cores="auto"`` pins it, for the timed requests,
to the cores of the stage with the most slack (the fastest per replica, among pinned stages), so it
does not slow the bottleneck. The report says where it ran.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from onnxpipe._errors import ConfigError, InputError, StageError, StreamError
from onnxpipe.runtime._engine import engine_class
from onnxpipe.runtime._inputs import check_inputs, defaulted_dims, dims_hint, random_inputs
from onnxpipe.runtime._pipeline import Pipeline
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stage import Request
from onnxpipe.runtime._stats import PipelineStats
from onnxpipe.runtime._values import spec_values, split_sizes

__all__ = ["BenchReport", "StageBench", "benchmark"]


@dataclass(frozen=True)
class StageBench:
    """One stage: alone, and inside the pipeline (``pipeline_mean_ms`` per session call: for a
    stage that batches, a call runs ``batch_mean`` requests on average), with the settings it ran
    with (``replicas``, ``intra_op_threads``, ``affinity``: the bundle's, or the host's overrides)."""

    stage: str
    replicas: int
    standalone_ms: float
    pipeline_mean_ms: float
    utilization: float
    batch_mean: float = 1.0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    intra_op_threads: int = 1
    affinity: tuple[int, ...] | None = None


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
        caller_cores: Cores the feeding thread was pinned to while timed, or ``None``.
        resident_bytes: The physical memory of the process the pipeline runs in (``PipelineStats.resident_bytes``), or ``None``.
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
    caller_cores: tuple[int, ...] | None = None
    resident_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


class _CodeSession:
    """A code stage's runner seen as a session (``run(names, feeds)``), to time it like the others."""

    def __init__(self, runner: Any) -> None:
        self.compute = runner.compute

    def run(self, names: list[str], feeds: Mapping[str, Any]) -> list[Any]:
        outputs = self.compute(dict(feeds))
        return [outputs[n] for n in names]


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


def _standalone_ms(pipe: Pipeline, feeds: Mapping[str, np.ndarray], runs: int) -> list[float]:
    """Each stage alone on the pipeline's own session (see the module docstring), in pipeline order."""
    request = Request(-1, {Endpoint(None, n): a for n, a in check_inputs(pipe.spec.inputs, feeds).items()}, {}, time.perf_counter())
    times: list[float] = []
    for runner in pipe.idle_runners():
        stage_feeds = {name: request.values[key] for name, key in runner.plan.sources}
        cores = runner.plan.stage.settings.for_replica(0).worker_cores()
        result: list[float] = []
        # A code stage (no session) is timed through its runner: its function and the output checks.
        session = runner.session if runner.session is not None else _CodeSession(runner)
        args = (session, stage_feeds, list(runner.plan.outputs), cores, runs, result)
        worker = threading.Thread(target=_time_runs, args=args, name=f"bench-{runner.name}")
        worker.start()
        worker.join()
        times.append(result[0] * 1e3)
        runner(request)  # the same session computes what the next stages are fed
    return times


def benchmark(
    pipe: Pipeline,
    requests: int = 200,
    *,
    warmup: int = 10,
    inputs: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    standalone_runs: int = 20,
    progress: Callable[[int, int], None] | None = None,
    caller_cores: Collection[int] | Literal["auto"] | None = None,
) -> BenchReport:
    """Stream ``requests`` synthetic requests through ``pipe`` and measure it against its stages.

    Args:
        pipe: A loaded pipeline.
        requests: Requests to time.
        warmup: Requests run first and not timed.
        inputs: One request's inputs. Default: without ``dims``, the bundle's first reference
            input set when it stores one (inputs of the bundle's own sizes), else random inputs
            (Note: sample values) with the symbolic dims the split was made for (the pipeline's
            ``input_dims`` metadata) and ``dims`` over them.
        dims: Sizes of symbolic dims for random inputs.
        standalone_runs: Runs per stage for its standalone time (0 skips that measurement), on the
            pipeline's own sessions while it is idle.
        progress: Called with (done, total) as timed requests finish.
        caller_cores: Pin this thread to these cores while the requests run (restored after);
            ``"auto"``: the cores of the pinned stage with the most slack (needs
            ``standalone_runs``; unpinned, with a note, when no stage is pinned).

    Returns:
        The :class:`BenchReport`.

    Raises:
        ConfigError: the OS refused ``caller_cores``.
        InputError: a stage fails on random inputs with dims no one gave (sized 1): names them.
        StreamError: the pipeline keeps state between steps: it runs streams, not the requests timed here.
    """
    states = pipe.spec.states
    if states:  # refused before any input is made, so no dims hint blames the sizes
        raise StreamError(f"bench times single requests, but this pipeline keeps state between steps ({len(states)} state link(s), e.g. {states[0]}): "
                          "time its streams in Python, `with pipe.stream() as s: s.step(inputs)` (docs/streams.md)")
    notes: list[str] = []
    hint = ""
    if inputs is None:
        inputs, notes, hint = _sample_inputs(pipe, dims or {})
    try:
        return _benchmark(pipe, inputs, requests, warmup, standalone_runs, progress, caller_cores, notes)
    except (InputError, StageError) as e:
        if not hint:
            raise
        raise InputError(f"{' '.join(str(e).split())}; {hint}") from e


def _sample_inputs(pipe: Pipeline, dims: Mapping[str, int]) -> tuple[Mapping[str, np.ndarray], list[str], str]:
    """The inputs :func:`benchmark` makes, notes on them, and the hint for a stage that fails on them
    (the dims sized 1 because neither ``dims`` nor the bundle gives them)."""
    if not dims and pipe.bundle.manifest.reference:
        return pipe.bundle.reference()[0][0], ["inputs: the bundle's first reference input set (--dim or --inputs for others)"], ""
    sizes, notes = split_sizes(pipe.spec, dims)
    inputs, dim_notes = random_inputs(pipe.spec.inputs, sizes, values=spec_values(pipe.spec))
    return inputs, notes + dim_notes, dims_hint(defaulted_dims(pipe.spec.inputs, sizes))


def _benchmark(
    pipe: Pipeline,
    inputs: Mapping[str, np.ndarray],
    requests: int,
    warmup: int,
    standalone_runs: int,
    progress: Callable[[int, int], None] | None,
    caller_cores: Collection[int] | Literal["auto"] | None,
    notes: list[str],
) -> BenchReport:
    """:func:`benchmark` on these inputs."""
    if standalone_runs and not engine_class(pipe.engine).in_process:
        notes.append(f"no standalone stage times: the stages run on {pipe.engine} actors, not in this process")
        standalone_runs = 0
    standalone: list[float] | None = None
    if caller_cores == "auto" and standalone_runs:  # the stages' slack decides where the caller goes
        standalone = _standalone_ms(pipe, inputs, standalone_runs)
    cores = _caller_cores(pipe, standalone, caller_cores, notes)
    seconds = _timed(pipe, inputs, requests, warmup, progress, cores)
    stats: PipelineStats = pipe.stats()
    if standalone is None:
        standalone = _standalone_ms(pipe, inputs, standalone_runs) if standalone_runs else [0.0] * len(stats.stages)
    return _report(stats, standalone, requests, seconds, notes, cores)


def _timed(
    pipe: Pipeline,
    inputs: Mapping[str, np.ndarray],
    requests: int,
    warmup: int,
    progress: Callable[[int, int], None] | None,
    cores: set[int] | None,
) -> float:
    """Seconds ``requests`` requests take through ``pipe`` after ``warmup`` untimed ones (the
    statistics reset between), this thread pinned to ``cores`` meanwhile (restored after)."""
    before = os.sched_getaffinity(0)
    try:
        if cores is not None:
            _pin(cores)
        for _ in pipe.map(inputs for _ in range(warmup)):
            pass
        pipe.reset_stats()
        start = time.perf_counter()
        for done, _ in enumerate(pipe.map(inputs for _ in range(requests)), 1):
            if progress is not None:
                progress(done, requests)
        seconds = time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, before)
    return seconds


def _report(stats: PipelineStats, standalone: list[float], requests: int, seconds: float, notes: list[str], cores: set[int] | None) -> BenchReport:
    """The pipeline's numbers next to its stages' standalone times (0: not measured)."""
    if any(s.batch_sizes for s in stats.stages):
        notes.append("stages that batch run several requests per call: 'in pipeline ms' is per call, and the ideal (one request per call) can be beaten")
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
            StageBench(s.stage, s.replicas, ms, s.mean_ms, s.utilization, s.batch_mean, s.batch_sizes, s.intra_op_threads, s.affinity)
            for s, ms in zip(stats.stages, standalone, strict=True)
        ),
        notes=tuple(notes),
        caller_cores=tuple(sorted(cores)) if cores is not None else None,
        resident_bytes=stats.resident_bytes,
    )


def _caller_cores(pipe: Pipeline, standalone_ms: list[float] | None, wanted: Collection[int] | Literal["auto"] | None, notes: list[str]) -> set[int] | None:
    if wanted is None:
        return None
    if wanted != "auto":
        return set(wanted)
    if standalone_ms is None:
        notes.append("the calling thread was left unpinned: choosing its cores needs the stages' standalone times (standalone runs were 0)")
        return None
    pinned = [(ms / s.settings.replicas, s) for s, ms in zip(pipe.spec.stages, standalone_ms, strict=True) if s.settings.affinity is not None]
    if not pinned:
        notes.append("the calling thread was left unpinned: no stage is pinned to cores")
        return None
    _, stage = min(pinned, key=lambda p: p[0])
    assert stage.settings.affinity is not None
    return set(stage.settings.affinity)


def _pin(cores: set[int]) -> None:
    try:
        os.sched_setaffinity(0, cores)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        allowed = sorted(os.sched_getaffinity(0))
        raise ConfigError(f"cannot pin the calling thread to cores {sorted(cores)}: {reason}; this process may use cores {allowed}") from None
