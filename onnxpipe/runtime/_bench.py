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

Note: benchmarking streams.
    A pipeline with state links (a decoder split with ``states="auto"``, an encoder + decoder
    bundle) has no single request to time: its stages keep each stream's past. So it times
    ``streams`` streams stepping together, as a generation loop drives them: each a first (prompt)
    step of ``prompt`` tokens, then ``steps`` one-token steps, the token the greedy one of the
    ``logits`` at the step before (Note: a stream's sample steps, ``_feeds.py``, the same steps
    ``verify`` runs), every stream's step of a round submitted at once (``Pipeline.submit_steps``:
    stages that batch take them as one batch) and the round awaited before the next. One untimed
    round of the streams (``warmup`` steps after the prompt) goes first. The report gives steps per
    second (tokens per second for a decoder: each step yields one greedy token per stream), the
    first step's latency and the later steps' (:class:`StreamBench`), and per stage its session
    calls, batch sizes, mean time and utilization. Standalone times are not measured: a stage with
    state runs on the past its stream has built, which no single request reproduces.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from onnxpipe._errors import ConfigError, InputError, StageError, StreamError
from onnxpipe.runtime._engine import engine_class
from onnxpipe.runtime._feeds import StreamFeeds
from onnxpipe.runtime._inputs import check_inputs, defaulted_dims, dims_hint, random_inputs
from onnxpipe.runtime._pipeline import Pipeline
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stage import Request
from onnxpipe.runtime._stats import PipelineStats
from onnxpipe.runtime._stream import Stream
from onnxpipe.runtime._values import spec_values, split_sizes

__all__ = ["BenchReport", "StageBench", "StreamBench", "benchmark"]

REQUESTS = 200  # timed requests by default
STREAMS = 4  # streams by default, for a pipeline with state whose stages do not batch (Note: benchmarking streams)
STEPS = 16  # one-token steps after the prompt, by default
PROMPT = 8  # the first step's tokens, by default


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
    #: Session calls in the timed window (a call of a stage that batches runs several requests).
    calls: int = 0


@dataclass(frozen=True)
class StreamBench:
    """What :func:`benchmark` measured of a pipeline with state (Note: benchmarking streams).

    Attributes:
        streams: Streams timed together.
        steps: One-token steps of each stream after its first (prompt) step.
        prompt: Tokens of the first step (0: the pipeline has no token ids; every step takes sample values).
        steps_per_s: Steps of all streams per second: tokens per second for a decoder (each
            step yields one greedy token per stream).
        first_step_p50_ms, first_step_p99_ms: Latency of the first step (submission to result), over streams.
        step_mean_ms, step_p50_ms, step_p99_ms: Latency of the later steps, over streams and steps.
    """

    streams: int
    steps: int
    prompt: int
    steps_per_s: float
    first_step_p50_ms: float
    first_step_p99_ms: float
    step_mean_ms: float
    step_p50_ms: float
    step_p99_ms: float


@dataclass(frozen=True)
class BenchReport:
    """What :func:`benchmark` measured.

    Attributes:
        requests: Requests timed (after warm-up); for a pipeline with state, the steps of all streams.
        seconds: Wall time of those requests.
        throughput: Requests (steps) per second.
        latency_mean_ms, latency_p50_ms, latency_p99_ms: Submission-to-result times (of every step, for streams).
        ideal_throughput: What the slowest stage allows (``replicas / standalone time``); ``None``
            when standalone times were not measured.
        efficiency: ``throughput / ideal_throughput``, or ``None``.
        bottleneck: The stage with the highest utilization in the pipeline.
        stages: Per-stage numbers, in pipeline order.
        notes: Things to know (defaulted dims, ...).
        caller_cores: Cores the feeding thread was pinned to while timed, or ``None``.
        resident_bytes: The physical memory of the process the pipeline runs in (``PipelineStats.resident_bytes``), or ``None``.
        streams: For a pipeline with state, what its streams did (:class:`StreamBench`), else ``None``.
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
    streams: StreamBench | None = None

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
    requests: int | None = None,
    *,
    warmup: int = 10,
    inputs: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    standalone_runs: int = 20,
    progress: Callable[[int, int], None] | None = None,
    caller_cores: Collection[int] | Literal["auto"] | None = None,
    streams: int | None = None,
    steps: int | None = None,
    prompt: int | None = None,
) -> BenchReport:
    """Stream ``requests`` synthetic requests through ``pipe`` and measure it against its stages;
    for a pipeline with state, step ``streams`` streams together (Note: benchmarking streams).

    Args:
        pipe: A loaded pipeline.
        requests: Requests to time (default 200); not for a pipeline with state.
        warmup: Requests run first and not timed; for a pipeline with state, the steps after the
            prompt of one untimed round of the streams (0: none).
        inputs: One request's inputs (not for a pipeline with state). Default: without ``dims``,
            the bundle's first reference input set when it stores one (inputs of the bundle's own
            sizes), else random inputs (Note: sample values) with the symbolic dims the split was
            made for (the pipeline's ``input_dims`` metadata) and ``dims`` over them.
        dims: Sizes of symbolic dims for random inputs (for streams: those the stream does not size).
        standalone_runs: Runs per stage for its standalone time (0 skips that measurement), on the
            pipeline's own sessions while it is idle; not measured for a pipeline with state.
        progress: Called with (done, total) as timed requests (steps) finish.
        caller_cores: Pin this thread to these cores while the requests run (restored after);
            ``"auto"``: the cores of the pinned stage with the most slack (needs
            ``standalone_runs``; unpinned, with a note, when no stage is pinned).
        streams: For a pipeline with state: streams stepping together (default: the largest
            ``max_batch`` of its stages when one batches, else 4; at most ``pipe.max_streams``).
        steps: For a pipeline with state: one-token steps of each stream after its prompt (default 16).
        prompt: For a pipeline with state: the first step's tokens (default 8).

    Returns:
        The :class:`BenchReport` (with ``streams`` for a pipeline with state).

    Raises:
        ConfigError: the OS refused ``caller_cores``; an argument that does not fit the pipeline
            (``requests`` or ``inputs`` for one with state, ``streams``, ``steps`` or ``prompt``
            for one without; more streams than ``pipe.max_streams``).
        InputError: a stage fails on random inputs with dims no one gave (sized 1): names them.
    """
    stateful = bool(pipe.spec.states)
    _refuse_given({"requests": requests, "inputs": inputs} if stateful else {"streams": streams, "steps": steps, "prompt": prompt}, stateful)
    if stateful:
        return _bench_streams(pipe, _streams(pipe, streams), STEPS if steps is None else steps, PROMPT if prompt is None else prompt,
                              warmup, dims or {}, progress, caller_cores)
    notes: list[str] = []
    hint = ""
    if inputs is None:
        inputs, notes, hint = _sample_inputs(pipe, dims or {})
    try:
        return _benchmark(pipe, inputs, REQUESTS if requests is None else requests, warmup, standalone_runs, progress, caller_cores, notes)
    except (InputError, StageError) as e:
        if not hint:
            raise
        raise InputError(f"{' '.join(str(e).split())}; {hint}") from e


def _refuse_given(wrong: Mapping[str, object], stateful: bool) -> None:
    """Refuse the first argument of ``wrong`` given (not ``None``): it does not apply to this pipeline."""
    given = [name for name, value in wrong.items() if value is not None]
    if given:
        kind = "keeps state between steps: it times streams (streams, steps, prompt)" if stateful else "keeps no state: it times single requests"
        raise ConfigError(f"benchmark: {given[0]} does not apply, the pipeline {kind}")


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
            StageBench(s.stage, s.replicas, ms, s.mean_ms, s.utilization, s.batch_mean, s.batch_sizes, s.intra_op_threads, s.affinity,
                       sum(s.batch_sizes.values()) if s.batch_sizes else s.count)
            for s, ms in zip(stats.stages, standalone, strict=True)
        ),
        notes=tuple(notes),
        caller_cores=tuple(sorted(cores)) if cores is not None else None,
        resident_bytes=stats.resident_bytes,
    )


def _streams(pipe: Pipeline, wanted: int | None) -> int:
    """How many streams :func:`benchmark` steps together (Note: benchmarking streams)."""
    if wanted is None:
        batch = max(stage.settings.max_batch for stage in pipe.spec.stages)
        return min(batch if batch > 1 else STREAMS, pipe.max_streams)
    if not 1 <= wanted <= pipe.max_streams:
        raise ConfigError(f"benchmark: streams must be 1..{pipe.max_streams} (the pipeline's max_streams), got {wanted}")
    return wanted


def _bench_streams(
    pipe: Pipeline,
    count: int,
    steps: int,
    prompt: int,
    warmup: int,
    dims: Mapping[str, int],
    progress: Callable[[int, int], None] | None,
    caller_cores: Collection[int] | Literal["auto"] | None,
) -> BenchReport:
    """:func:`benchmark` of a pipeline with state (Note: benchmarking streams)."""
    for name, value, least in (("steps", steps, 0), ("prompt", prompt, 1), ("warmup", warmup, 0)):
        if value < least:
            raise ConfigError(f"benchmark: {name} must be at least {least}, got {value}")
    sizes, notes = split_sizes(pipe.spec, dims)
    feeder = StreamFeeds(pipe.spec, sizes, prompt)
    cores = _caller_cores(pipe, None, caller_cores, notes) if caller_cores != "auto" else None
    if caller_cores == "auto":
        notes.append("the calling thread was left unpinned: choosing its cores needs the stages' standalone times, not measured for streams")
    before = os.sched_getaffinity(0)
    try:
        if cores is not None:
            _pin(cores)
        if warmup:
            _round(pipe, feeder, count, min(warmup, steps), None)
        pipe.reset_stats()
        start = time.perf_counter()
        first, later = _round(pipe, feeder, count, steps, progress)
        seconds = time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, before)
    report = _report(pipe.stats(), [0.0] * len(pipe.spec.stages), count * (steps + 1), seconds, notes + _stream_notes(feeder, count, steps), cores)
    every = first + later
    return replace(report, latency_mean_ms=statistics.fmean(every) * 1e3, latency_p50_ms=_percentile(every, 50), latency_p99_ms=_percentile(every, 99),
                   streams=StreamBench(count, steps, feeder.prompt, report.throughput, _percentile(first, 50), _percentile(first, 99),
                                       statistics.fmean(later) * 1e3 if later else 0.0, _percentile(later, 50), _percentile(later, 99)))


def _stream_notes(feeder: StreamFeeds, count: int, steps: int) -> list[str]:
    """What the report says of the streams' steps."""
    if feeder.new is None:
        what = f"{steps + 1} step(s) of sample values"
    else:
        token = f"the greedy token of '{feeder.logits}' at the step before" if feeder.logits is not None else "a random token"
        what = f"a prompt of {feeder.prompt} token(s), then {steps} step(s) of one token: {token}"
    notes = [f"{count} stream(s) stepping together, each {what}",
             "no standalone stage times: a stage with state runs on the past its stream built, which no single request reproduces"]
    if feeder.defaulted:
        notes.append(f"dim(s) {', '.join(feeder.defaulted)} not given, using 1 (--dim NAME=N)")
    return notes


def _round(pipe: Pipeline, feeder: StreamFeeds, count: int, steps: int, progress: Callable[[int, int], None] | None) -> tuple[list[float], list[float]]:
    """Seconds from submission to result of the first steps and of the later ones, of ``count``
    streams stepping together through a prompt and ``steps`` steps (Note: benchmarking streams)."""
    first: list[float] = []
    later: list[float] = []
    total = count * (steps + 1)
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(pipe.stream()) for _ in range(count)]
        outputs: list[Mapping[str, np.ndarray]] = [{} for _ in opened]
        for step in range(steps + 1):
            feeds, hint = {}, ""
            for k, stream in enumerate(opened):
                feeds[stream], hint = feeder.pipeline_step(step, outputs[k], k * (steps + 1) + step)
            outputs, seconds = _step_all(pipe, feeds, hint)
            (first if step == 0 else later).extend(seconds)
            if progress is not None:
                progress(count * (step + 1), total)
    return first, later


def _step_all(pipe: Pipeline, feeds: Mapping[Stream, Mapping[str, np.ndarray]], hint: str) -> tuple[list[Mapping[str, np.ndarray]], list[float]]:
    """One step of every stream, submitted at once: their outputs, and the seconds from submission
    to each result (taken as this thread sees it finish).

    Raises:
        InputError: a step failed on sample values with dims no one gave (``hint`` says which).
    """
    start = time.perf_counter()
    futures = pipe.submit_steps(feeds)
    seconds: list[float] = []
    try:
        for future in as_completed(futures.values()):
            seconds.append(time.perf_counter() - start)
            future.result()  # the first failure, as soon as it is known
        outputs: list[Mapping[str, np.ndarray]] = [futures[stream].result() for stream in feeds]
    except (InputError, StageError, StreamError) as e:
        if not hint:
            raise
        raise InputError(f"{' '.join(str(e).split())}; {hint}") from e
    return outputs, seconds


def _percentile(seconds: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``seconds``, in ms (0 without any)."""
    return float(np.percentile(seconds, q)) * 1e3 if seconds else 0.0


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
