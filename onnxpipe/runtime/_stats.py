"""Statistics and timelines of a running pipeline.

Workers record each stage run (start, end, request) into a :class:`StageRecorder`; the pipeline
records each finished request. Recording is a few appends under no lock (each recorder has one
writer, its worker thread; CPython's deque appends are atomic), so it stays on for every request.
Latencies keep the most recent ``window`` values, enough for stable p99 without unbounded memory.

Note: reading while workers write.
    ``stats()`` and ``save_trace()`` may be called from any thread while requests flow. A Python
    loop over a deque that its worker appends to fails (``deque mutated during iteration``) when
    the interpreter switches threads mid-loop, so readers first take a snapshot with
    :meth:`StageRecorder.snapshot` -- ``deque.copy()`` runs in C without releasing the GIL, hence
    atomically with respect to the writer -- and compute on the copy. The writer's path is
    unchanged: no lock per request.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onnxpipe.runtime._stage import Call

__all__ = ["PipelineStats", "StageRecorder", "StageStats", "resident_bytes", "write_trace"]

_WINDOW = 10_000


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of values sorted once by the caller (``stats()`` is polled by servers)."""
    if not ordered:
        return 0.0
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


class StageRecorder:
    """What one worker (a stage replica) did; written by that worker only (on Ray: by the driver's
    collector thread, from the records the actors return).

    Args:
        stage: The stage's name.
        replica: Which replica.
        trace: Keep every run for a timeline.
        window: Latencies kept.
        batches: The stage's runs are counted by their size (``StagePlan.batches``): calls, a
            histogram of their sizes, their time per size and their wait to form.
    """

    def __init__(self, stage: str, replica: int, trace: bool, window: int = _WINDOW, batches: bool = False) -> None:
        self.stage = stage
        self.replica = replica
        self.count = 0
        self.failed = 0
        self.busy = 0.0
        self.queued = 0.0
        self.latencies: deque[float] = deque(maxlen=window)
        self.events: deque[tuple[int, float, float, bool, int]] | None = deque(maxlen=100_000) if trace else None
        self.counts_batches = batches
        self.calls = 0
        self.batches: dict[int, int] = {}  # batch size -> calls of that size (only with batching)
        self.batch_busy: dict[int, float] = {}  # batch size -> seconds its calls ran (Triton's batch_stats)
        self.batch_wait = 0.0
        self.copied = 0  # bytes of streams' state its runs copied (Call.copied)

    def record(self, call: Call, requests: Sequence[Any]) -> None:
        """One run of the stage, as its runner reported it (:class:`~onnxpipe.runtime._stage.Call`,
        timed with ``time.perf_counter()``): the one way every engine records a run.

        ``requests`` are the run's requests, in ``call.requests`` order: each one's wait in the
        stage's queue is read from its ``queued_at`` (the end of the stage before it, or its
        submission), which then moves to the run's end. A request carrying several steps (a batch
        of streams' steps) counts its wait once per step; the run's time counts once. A run of
        size 0 (a close, a batch whose members all failed before) is not counted.
        """
        start, end, size = call.start, call.end, call.size
        if len(requests) == 1:  # the common case, kept short: one request (or one batch of steps) a run
            request = requests[0]
            queued = start - request.queued_at
            queued = queued * size if queued > 0.0 else 0.0  # clocks of other hosts (Ray) may put a start before it
            request.queued_at = end
        else:  # stateless requests run together: each carries one
            queued = 0.0
            for request in requests:
                queued += max(0.0, start - request.queued_at)
                request.queued_at = end
        if not size:
            return
        took = end - start
        self.count += size
        self.failed += len(call.failures)
        self.busy += took
        self.queued += queued
        self.copied += call.copied
        self.latencies.append(took)
        if self.counts_batches:
            self.calls += 1
            self.batches[size] = self.batches.get(size, 0) + 1
            self.batch_busy[size] = self.batch_busy.get(size, 0.0) + took
            self.batch_wait += call.waited
        if self.events is not None:
            failed = {f.request for f in call.failures}
            for rid in call.requests:  # a run of one request failed when anything in it did (a batch's member)
                self.events.append((rid, start, end, not failed if len(call.requests) == 1 else rid not in failed, size))

    def snapshot(self) -> tuple[int, int, float, list[float], float]:
        """``(count, failed, busy, latencies, queued)`` as of now, safe to take while the worker records (see Note above)."""
        return self.count, self.failed, self.busy, list(self.latencies.copy()), self.queued

    def batch_snapshot(self) -> tuple[int, dict[int, int], float, dict[int, float]]:
        """``(calls, batch size histogram, seconds waited for batches, seconds run per batch size)``
        of a worker that batches."""
        return self.calls, dict(self.batches.copy()), self.batch_wait, dict(self.batch_busy.copy())

    def trace_events(self) -> list[tuple[int, float, float, bool, int]]:
        """The recorded trace events as of now, safe to take while the worker records."""
        return list(self.events.copy()) if self.events is not None else []

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self.count = self.failed = self.calls = 0
        self.busy = self.queued = self.batch_wait = 0.0
        self.copied = 0
        self.batches = {}
        self.batch_busy = {}
        self.latencies.clear()
        if self.events is not None:
            self.events.clear()


@dataclass(frozen=True)
class StageStats:
    """One stage over the measured window (all its replicas together).

    Attributes:
        stage: Stage name.
        replicas: Workers running it.
        count: Runs completed (failed ones included).
        failed: Runs that raised.
        busy_s: Seconds spent running, summed over replicas.
        utilization: ``busy_s / (elapsed_s * replicas)``: 1.0 means never idle.
        mean_ms, p50_ms, p99_ms: Time of one run.
        queued_s: Seconds the runs waited in the stage's queue, summed (from the end of the stage
            before, or the request's submission, to the start of the run).
        queue_mean_ms: Mean wait of a run in the stage's queue.
        batch_sizes: For a stage that batches (``max_batch`` above 1): batch size -> session calls
            of that size; empty otherwise. ``mean_ms`` and the percentiles are then per call.
        batch_mean: Requests per session call (1.0 for a stage that does not batch).
        batch_wait_ms: Mean time a call waited, after taking its first request, for others to
            join it (``max_delay_ms``; 0 when it only takes what is queued).
        batch_busy_s: For a stage that batches: batch size -> seconds its calls of that size ran,
            summed over replicas (Triton's ``batch_stats``); empty otherwise.
        queue_depth: Requests waiting for the stage now.
        queue_high_water: The most that ever waited.
        queue_capacity: How many may wait before the stage before it blocks.
        nodes: Execution provider -> how many nodes of the stage's optimized graph it runs
            (``Pipeline.placement()`` names them); empty where onnxruntime cannot tell, and for
            code stages.
        intra_op_threads, inter_op_threads, affinity, max_batch: The stage's settings in effect
            (the bundle's, or the host's deploy-time overrides: ``load(..., overrides=...)``);
            ``replicas`` above is the workers running it.
        bytes_copied: Bytes of streams' state its runs copied (``_stage``, Note: state bytes
            copied): onnxpipe's own (a block made anew when members join, compacted when they
            leave, grown) and the past a session copied into a present it made apart from it (a
            KV cache not bound in place). Divided by ``batch_sizes``' calls: bytes per step.
    """

    stage: str
    replicas: int
    count: int
    failed: int
    busy_s: float
    utilization: float
    mean_ms: float
    p50_ms: float
    p99_ms: float
    queue_depth: int
    queue_high_water: int
    queue_capacity: int
    queued_s: float = 0.0
    queue_mean_ms: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    batch_mean: float = 1.0
    batch_wait_ms: float = 0.0
    nodes: dict[str, int] = field(default_factory=dict)
    batch_busy_s: dict[int, float] = field(default_factory=dict)
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    affinity: tuple[int, ...] | None = None
    max_batch: int = 1
    bytes_copied: int = 0


@dataclass(frozen=True)
class PipelineStats:
    """The pipeline over the measured window (since load or the last ``reset_stats``).

    Attributes:
        elapsed_s: Length of the window.
        completed: Requests finished (failed ones included).
        failed: Requests that failed.
        in_flight: Requests submitted and not finished.
        throughput: Finished requests per second, from the first submission to the last finish.
        latency_mean_ms, latency_p50_ms, latency_p99_ms: Submission-to-finish time.
        bottleneck: The stage with the highest utilization: the one that limits throughput.
        stages: Per-stage numbers, in pipeline order.
        resident_bytes: The physical memory of the process the thread engine's sessions run in
            (:func:`resident_bytes`, now: the pipeline's sessions, weights and arenas, and whatever
            else the process holds); ``None`` for the Ray engine (its sessions run in the actors'
            processes) and where Linux's ``/proc`` is not there. Not the difference since loading:
            memory the process freed before is handed out again without the process growing.
    """

    elapsed_s: float
    completed: int
    failed: int
    in_flight: int
    throughput: float
    latency_mean_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    bottleneck: str
    stages: tuple[StageStats, ...]
    resident_bytes: int | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"{self.completed} requests ({self.failed} failed) in {self.elapsed_s:.2f} s: {self.throughput:.1f} req/s, "
            f"latency mean {self.latency_mean_ms:.2f} ms, p50 {self.latency_p50_ms:.2f} ms, p99 {self.latency_p99_ms:.2f} ms; "
            f"bottleneck: {self.bottleneck}" + (f"; resident {self.resident_bytes / 2**20:.1f} MiB" if self.resident_bytes is not None else "")
        ]
        for s in self.stages:
            lines.append(
                f"  {s.stage:<12} x{s.replicas} runs {s.count:>6}  util {s.utilization:6.1%}  mean {s.mean_ms:7.2f} ms  "
                f"threads {s.intra_op_threads}{' cores ' + ','.join(map(str, s.affinity)) if s.affinity is not None else ''}  "
                f"p99 {s.p99_ms:7.2f} ms  queue {s.queue_depth}/{s.queue_capacity} (max {s.queue_high_water})"
                + (f"  batch mean {s.batch_mean:.2f} (max {max(s.batch_sizes)})" if s.batch_sizes else "")
            )
        return "\n".join(lines)


def resident_bytes() -> int | None:
    """The physical memory this process holds now, or ``None`` where Linux's ``/proc`` is not there.

    Its proportional set size (``Pss`` of ``/proc/self/smaps_rollup``): a weight file that two
    sessions map in place counts once, as the RAM it takes, where the plain resident size counts
    it per mapping (measured: 64 MiB mapped twice and read, Rss +128 MiB, Pss +64 MiB). A kernel
    before 4.14 has no ``smaps_rollup``: the resident size (``/proc/self/statm``) then.
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class RequestRecorder:
    """End-to-end numbers; written by whichever worker finishes a request, hence the lock."""

    def __init__(self, window: int = _WINDOW) -> None:
        self._lock = threading.Lock()
        self.latencies: deque[float] = deque(maxlen=window)
        self.reset()

    def reset(self) -> None:
        """Start a new window now."""
        with self._lock:
            self.started = time.perf_counter()
            self.first_submit: float | None = None
            self.last_done: float | None = None
            self.completed = self.failed = 0
            self.latencies.clear()

    def submitted(self, at: float) -> None:
        """A request entered the pipeline at ``at``."""
        if self.first_submit is None:
            with self._lock:
                if self.first_submit is None:
                    self.first_submit = at

    def finished(self, submitted: float, at: float, ok: bool) -> None:
        """A request left the pipeline at ``at``."""
        with self._lock:
            self.completed += 1
            self.failed += not ok
            self.last_done = at
            self.latencies.append(at - submitted)

    def finished_many(self, ended: list[tuple[float, bool]], at: float) -> None:
        """Requests (a batch of steps) left the pipeline at ``at``: each ``(submitted, ok)``."""
        with self._lock:
            self.completed += len(ended)
            self.failed += sum(not ok for _, ok in ended)
            self.last_done = at
            self.latencies.extend(at - submitted for submitted, _ in ended)


def summarize(stages: Sequence[tuple[str, Sequence[StageRecorder], int, int, int]], requests: RequestRecorder, in_flight: int) -> PipelineStats:
    """Combine the recorders into a :class:`PipelineStats`.

    Args:
        stages: Per stage: name, its replicas' recorders, queue depth, high water, capacity.
        requests: The end-to-end recorder.
        in_flight: Requests submitted and not finished.
    """
    now = time.perf_counter()
    elapsed = max(now - requests.started, 1e-9)
    rows = [_stage_stats(name, recorders, depth, high, capacity, elapsed) for name, recorders, depth, high, capacity in stages]
    lat, span, completed, failed = _request_window(requests)
    bottleneck = max(rows, key=lambda r: r.utilization).stage if rows else ""
    return PipelineStats(
        elapsed_s=elapsed,
        completed=completed,
        failed=failed,
        in_flight=in_flight,
        throughput=completed / span if span > 0 else 0.0,
        latency_mean_ms=_mean_ms(lat),
        latency_p50_ms=1e3 * _percentile(lat, 50),
        latency_p99_ms=1e3 * _percentile(lat, 99),
        bottleneck=bottleneck,
        stages=tuple(rows),
    )


def _stage_stats(name: str, recorders: Sequence[StageRecorder], depth: int, high: int, capacity: int, elapsed: float) -> StageStats:
    """One stage's row of :func:`summarize`: its replicas' recorders over ``elapsed`` seconds."""
    snapshots = [r.snapshot() for r in recorders]
    latencies = sorted(x for snap in snapshots for x in snap[3])
    busy = sum(snap[2] for snap in snapshots)
    count = sum(snap[0] for snap in snapshots)
    queued = sum(snap[4] for snap in snapshots)
    calls, sizes, wait, sized = _batch_totals(recorders)
    batched = sum(k * v for k, v in sizes.items())
    return StageStats(
        stage=name,
        replicas=len(recorders),
        count=count,
        failed=sum(snap[1] for snap in snapshots),
        busy_s=busy,
        utilization=busy / (elapsed * len(recorders)),
        mean_ms=_mean_ms(latencies),
        p50_ms=1e3 * _percentile(latencies, 50),
        p99_ms=1e3 * _percentile(latencies, 99),
        queue_depth=depth,
        queue_high_water=high,
        queue_capacity=capacity,
        queued_s=queued,
        queue_mean_ms=1e3 * queued / count if count else 0.0,
        batch_sizes=dict(sorted(sizes.items())),
        batch_mean=batched / sum(sizes.values()) if sizes else 1.0,
        batch_wait_ms=1e3 * wait / calls if calls else 0.0,
        batch_busy_s=dict(sorted(sized.items())),
        bytes_copied=sum(r.copied for r in recorders),
    )


def _batch_totals(recorders: Sequence[StageRecorder]) -> tuple[float, dict[int, int], float, dict[int, float]]:
    """:meth:`StageRecorder.batch_snapshot` summed over a stage's replicas: ``(calls, batch size
    histogram, seconds waited for batches, seconds run per batch size)``."""
    sizes: dict[int, int] = {}
    sized: dict[int, float] = {}
    calls = wait = 0.0
    for r in recorders:
        n, histogram, waited, ran = r.batch_snapshot()
        calls += n
        wait += waited
        for k, v in histogram.items():
            sizes[k] = sizes.get(k, 0) + v
        for k, seconds in ran.items():
            sized[k] = sized.get(k, 0.0) + seconds
    return calls, sizes, wait, sized


def _request_window(requests: RequestRecorder) -> tuple[list[float], float, int, int]:
    """``(latencies sorted, seconds from the first submission to the last finish, completed,
    failed)`` of the end-to-end recorder, read under its lock."""
    with requests._lock:
        lat = list(requests.latencies)
        span = (requests.last_done - requests.first_submit) if requests.first_submit is not None and requests.last_done is not None else 0.0
        completed, failed = requests.completed, requests.failed
    lat.sort()  # outside the lock: finishing requests do not wait for it
    return lat, span, completed, failed


def _mean_ms(ordered: Sequence[float]) -> float:
    """The mean of ``ordered`` seconds in milliseconds (0 for none)."""
    return 1e3 * sum(ordered) / len(ordered) if ordered else 0.0


def write_trace(path: str | os.PathLike[str], recorders: Sequence[StageRecorder], origin: float) -> Path:
    """Write a Chrome-trace / Perfetto JSON timeline: one track per stage worker.

    Open it in ``chrome://tracing`` or https://ui.perfetto.dev. Each slice is one stage run, named
    by its request (and, for a batched call, the batch's size); failed runs are marked.

    Args:
        path: The .json file to write.
        recorders: The workers' recorders (their ``events`` must be enabled).
        origin: ``time.perf_counter()`` value that becomes time 0.
    """
    events: list[dict[str, object]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "onnxpipe"}}]
    for tid, rec in enumerate(recorders):
        label = f"{rec.stage}" + (f" #{rec.replica}" if rec.replica else "")
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
        for request, start, end, ok, batch in rec.trace_events():
            events.append(
                {
                    "name": f"request {request}" + (f" (batch of {batch})" if batch > 1 else "") + ("" if ok else " (failed)"),
                    "cat": rec.stage,
                    "ph": "X",
                    "pid": 0,
                    "tid": tid,
                    "ts": round((start - origin) * 1e6, 3),
                    "dur": round((end - start) * 1e6, 3),
                    "args": {"request": request, "stage": rec.stage, "replica": rec.replica, "ok": ok, "batch": batch},
                }
            )
    out = Path(path)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
