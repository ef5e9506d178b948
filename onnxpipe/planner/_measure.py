"""Measuring the finalists: each built, exported and loaded, then run side by side in interleaved rounds,
streaming requests or under N in flight.

Note: batching.
    With ``batch`` above 1 (``split --auto --cores C --batch N``), once the plan is chosen and every
    input and output of the model has a symbolic dim 0, the planner builds the chosen plan again
    with ``max_batch=N`` on every stage (the build's probe checks that it can batch; a refusal is
    reported, not raised) and measures it against the chosen plan in interleaved rounds with the
    same rule: batching is kept only if it wins *every* round. CPU models often gain nothing from
    it (docs/batching.md), so it is measured, never assumed.

Note: the served workload.
    With ``concurrency`` (``split --auto --cores C --concurrency 1,16``) the finalists are measured under
    the load a server sees: exactly N requests in flight, closed loop (a request is sent when one
    comes back), each request's latency timed; for each N, in interleaved rounds, each round
    giving a finalist's req/s over ``requests`` timed completions and their p50 and p99 (a
    finalist's figure is the median over the rounds, the spread their min-max). One thread drives
    the load, keeping N futures in flight (``Pipeline.submit``, a done-callback handing each result
    to it through a queue): that is the server's own shape (one event loop submitting, futures
    coming back by callback), it adds no client threads fighting the stages and each other for the
    GIL, and it costs one queue hand-off per request. N client threads each waiting on its own
    request measure the clients instead: on a 3-node model (2 replicas x 1 thread, 2 cores) 16
    threads drove 11,600 req/s where this loop drove 23,400 (paired 1.7-2.4x over 5 rounds); at N
    = 1 the two are within the noise (0.69-1.07x). The first
    ``max(3, N)`` completions are not timed (after them every request in flight was sent in the
    steady state), and the N - 1 in flight when the window closes are drained untimed, so no
    round ends with fewer than N in flight. A round's p99 of R requests is interpolated between
    its slowest ones (R = 40: between the two slowest); ``requests`` buys a steadier tail.

    Every finalist is loaded with queues as deep as the largest N, so that every request in
    flight waits in the pipeline's own queues, as in the server (whose queues are as deep as its
    ``max_inflight``): a batching stage sees them all. A request's latency runs from the moment
    its client would send it (at once, as the request before it in its slot came back) to its
    result, so a moment the driving thread took to get to it counts, as a server's admission
    wait would; then N / req/s is the mean latency (Little's law), as a server's clients see.

    Finalists are the usual ones, the one-session plan with all C threads (N = 1's natural plan:
    per-node profiles predict thread scaling least well), the best-predicted pipeline of each
    depth, and **stateless batching variants** of the best-predicted one-session, replicas and
    pipeline plans, when every input and output has a symbolic dim 0
    (a variant the build's probe refuses is dropped, and the notes say so): ``max_batch`` is
    ``batch`` when given, else min(largest N, 8) -- in a closed loop of N no batch exceeds N, so one
    variant serves every N, and 8 is where CPU batches stop gaining (docs/batching.md; Triton's
    batcher was run at 8 in the comparison this was built for) -- and ``max_delay_ms`` is a tenth
    of the plan's slowest predicted stage, at most 1 ms: long enough for the clients of a batch
    that just finished to send their next requests (tens of microseconds each in-process, about
    0.1 ms through a server), short enough that a request waiting alone loses a tenth of a run.
    With N > max_batch the queue is full when a batch ends and no request waits for the delay.
    Then come the spinning variants, at N = 1 (see Note: spinning).

    The choice, for each N. With ``p99_ms``, the finalists whose p99 (median over the rounds) is
    over the bound leave the choice (the notes name them; none left is a :class:`SplitError`
    listing every finalist's p99 at that N), and the highest throughput of the rest is chosen;
    without it, at N = 1 the lowest p99 and at N > 1 the highest throughput. Either way with the
    choice rule's every-round test: plans are ranked from simple to complex -- one session,
    replicas, pipelines, then the same three batching, a spinning variant with the plan it varies --
    the best of the simplest rank (by median) holds, and a plan of the next rank replaces the
    holder only if it was better in **every** round (req/s: its lowest paired ratio above 1; p99:
    its highest paired ratio of p99s below 1, a lower tail in every round), the best median ratio
    among those that did; then the next rank.
    The plan chosen for each N is written with its settings, ``max_batch``, ``max_delay_ms`` and
    ``spinning`` included; ``onnxpipe serve`` of it serves what was measured (docs/planning.md says how far
    perf_analyzer's figures and the planner's agree). Without ``concurrency`` none of this runs:
    the planner streams requests and chooses by throughput, as above.

"""

from __future__ import annotations

import contextlib
import functools
import queue
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import numpy as np

from onnxpipe._errors import BuildError
from onnxpipe.builder import build, export
from onnxpipe.planner._candidates import LoadMeasure, PlanCandidate, _fixed_batch_dim
from onnxpipe.planner._memory import plan_memory
from onnxpipe.planner._rules import _batching_verdict
from onnxpipe.runtime import DEFAULT_QUEUE_DEPTH, Pipeline, interleaved_rounds, load
from onnxpipe.splitter import SplitPlan

__all__: list[str] = []

Progress = Callable[[str, int, int], None]

#: Untimed requests before each timed round: a pipeline that sat idle while the others ran wakes up first.
_ROUND_WARMUP = 3


def _settings(threads: int, replicas: int, cores: list[int]) -> dict[str, object]:
    return {"intra_op_threads": threads, "replicas": replicas, "affinity": cores or None}


def _configure(candidate: PlanCandidate, split_plan: SplitPlan, allowed: list[int]) -> SplitPlan:
    """Give each stage its threads, replicas, target and a slice of the cores, in order."""
    start = 0
    targets = candidate.targets or ("cpu",) * len(candidate.threads)
    for stage, t, r, target in zip(split_plan.config.stages, candidate.threads, candidate.replicas, targets, strict=True):
        cores = allowed[start : start + t * r] if len(allowed) >= candidate.cores else []
        # Batching and spinning set on every build, since the split is shared: a variant's must not stay on the next finalist's.
        stage.configure(target=target, max_batch=candidate.max_batch, max_delay_ms=candidate.max_delay_ms, spinning=candidate.spinning,
                        **_settings(t, r, cores))
        start += t * r
    return split_plan


def _load_finalist(candidate: PlanCandidate, target: SplitPlan, allowed: list[int], feeds: dict[str, np.ndarray], requests: int, work: Path,
                   memory_dims: Mapping[str, int] | None = None, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> Pipeline:
    """Build, export and load one finalist, and warm it up; with ``memory_dims``, also measure its
    memory in a process of its own (see Note: memory), into ``candidate.memory_bytes``."""
    folder = work / f"m{time.monotonic_ns()}"
    # _configure changes the shared split's settings in place: build right after it, before the next finalist's.
    bundle = export(build(_configure(candidate, target, allowed).config, folder / "built").path, folder / "bundle")
    if memory_dims is not None:
        candidate.memory_bytes = plan_memory(bundle, memory_dims)
    pipe = load(bundle, queue_depth=queue_depth)
    for _ in pipe.map(feeds for _ in range(max(5, requests // 10))):
        pass
    return pipe


def _load_finalists(stack: contextlib.ExitStack, finalists: Sequence[PlanCandidate], whole: SplitPlan, allowed: list[int],
                    feeds: dict[str, np.ndarray], requests: int, report: Progress, memory_dims: Mapping[str, int] | None = None,
                    queue_depth: int = DEFAULT_QUEUE_DEPTH, refused: list[str] | None = None) -> dict[str, Pipeline]:
    """Every finalist built, loaded and warmed up at once (each closed with ``stack``), by label.
    With ``refused``, a batching variant the build refuses is left out and noted there; otherwise
    (and for a plain plan always) the refusal is raised."""
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="onnxpipe-plan-"))
    pipes: dict[str, Pipeline] = {}
    for done, c in enumerate(finalists):
        report("loading", done, len(finalists))
        try:
            pipes[c.label] = stack.enter_context(_load_finalist(c, c.split or whole, allowed, feeds, requests, Path(tmp), memory_dims, queue_depth))
        except BuildError as e:
            if refused is None or c.max_batch == 1:
                raise
            refused.append(f"{c.label}: left out, the build refuses max_batch {c.max_batch}: {e}")
    report("loading", len(finalists), len(finalists))
    return pipes


def _timed_round(pipe: Pipeline, feeds: dict[str, np.ndarray], requests: int, stage_ms: list[tuple[float, ...]]) -> float:
    """Stream ``requests`` requests through ``pipe``; requests per second, each stage's mean ms appended to ``stage_ms``."""
    for _ in pipe.map(feeds for _ in range(_ROUND_WARMUP)):
        pass
    pipe.reset_stats()
    start = time.perf_counter()
    for _ in pipe.map(feeds for _ in range(requests)):
        pass
    seconds = time.perf_counter() - start
    stage_ms.append(tuple(s.mean_ms for s in pipe.stats().stages))
    return requests / seconds


def _measure(
    finalists: Sequence[PlanCandidate],
    whole: SplitPlan,
    allowed: list[int],
    feeds: dict[str, np.ndarray],
    rounds: int,
    requests: int,
    report: Progress,
    memory_dims: Mapping[str, int] | None = None,
) -> None:
    """Measure the finalists, all loaded at once, in interleaved rounds; set their ``rounds``, ``measured``, ``stage_measured_ms``
    (and with ``memory_dims``, their ``memory_bytes``: see Note: memory)."""
    stage_ms: dict[str, list[tuple[float, ...]]] = {c.label: [] for c in finalists}
    with contextlib.ExitStack() as stack:
        pipes = _load_finalists(stack, finalists, whole, allowed, feeds, requests, report, memory_dims)
        runners = {label: (lambda p=pipe, ms=stage_ms[label]: _timed_round(p, feeds, requests, ms)) for label, pipe in pipes.items()}
        measured = interleaved_rounds(runners, rounds, lambda done, total: report("measuring", done, total))
    for c in finalists:
        c.rounds = measured.values[c.label]
        c.measured = measured.median(c.label)
        c.stage_measured_ms = tuple(statistics.median(column) for column in zip(*stage_ms[c.label], strict=True))


def _closed_loop(pipe: Pipeline, feeds: dict[str, np.ndarray], concurrency: int, requests: int) -> tuple[float, list[float]]:
    """Keep exactly ``concurrency`` requests in flight, one sent as each comes back, from this one
    thread (see Note: the served workload); requests per second over ``requests`` timed completions,
    and their latencies (ms, submit to result)."""
    done: queue.SimpleQueue[tuple[Future[dict[str, np.ndarray]], float, float]] = queue.SimpleQueue()

    def send(start: float) -> None:
        pipe.submit(feeds).add_done_callback(lambda f: done.put((f, start, time.perf_counter())))

    warmup = max(_ROUND_WARMUP, concurrency)
    total = warmup + requests
    for _ in range(concurrency):
        send(time.perf_counter())
    latencies: list[float] = []
    began = ended = time.perf_counter()
    for finished in range(1, total + 1):
        future, start, ended = done.get()
        future.result()  # a failed request fails the round, as in _timed_round
        if finished > warmup:
            latencies.append(1e3 * (ended - start))
        elif finished == warmup:
            began = ended
        if finished < total:
            # The next request starts when this one came back (a client sends again at once): time this
            # thread takes to get to it counts in its latency, as a server's admission wait would.
            send(ended)
    elapsed = ended - began
    for _ in range(concurrency - 1):  # those in flight when the window closed, untimed
        done.get()[0].result()
    return requests / elapsed, latencies


def _measure_loads(
    finalists: Sequence[PlanCandidate],
    whole: SplitPlan,
    allowed: list[int],
    feeds: dict[str, np.ndarray],
    rounds: int,
    requests: int,
    concurrency: Sequence[int],
    report: Progress,
    notes: list[str],
    memory_dims: Mapping[str, int] | None = None,
) -> list[PlanCandidate]:
    """Load the finalists at once and measure them under each N in flight, in interleaved rounds per N;
    set their ``loads``. A batching variant the build refuses is left out, with a note.

    Returns:
        The finalists measured.
    """
    with contextlib.ExitStack() as stack:
        # Every request in flight waits in the pipeline's own queues, as in the server (Note: the served workload).
        depth = max(DEFAULT_QUEUE_DEPTH, *concurrency)
        pipes = _load_finalists(stack, finalists, whole, allowed, feeds, requests, report, memory_dims, depth, notes)
        measured = [c for c in finalists if c.label in pipes]

        def run(pipe: Pipeline, n: int, out: list[tuple[float, float, float]]) -> float:
            rate, ms = _closed_loop(pipe, feeds, n, requests)
            p50, p99 = np.percentile(ms, [50, 99])
            out.append((float(p50), float(p99), statistics.fmean(ms)))
            return rate

        for n in concurrency:
            at_n = [c for c in measured if n == 1 or not c.spinning]  # spinning variants take part at N = 1 only (Note: spinning)
            latencies: dict[str, list[tuple[float, float, float]]] = {c.label: [] for c in at_n}
            runners = {c.label: functools.partial(run, pipes[c.label], n, latencies[c.label]) for c in at_n}
            values = interleaved_rounds(runners, rounds, functools.partial(report, f"measuring at N={n}")).values
            for c in at_n:
                p50s, p99s, means = zip(*latencies[c.label], strict=True)
                c.loads[n] = LoadMeasure(n, values[c.label], p50s, p99s, means)
    return measured


def _try_batching(chosen: PlanCandidate, final: SplitPlan, allowed: list[int], feeds: dict[str, np.ndarray], rounds: int, requests: int,
                  report: Progress, batch: int) -> str:
    """Measure the chosen plan batching up to ``batch`` requests against it (see Note: batching); keep it
    on ``final``'s stages only if it won every round. Returns what was found."""
    fixed = _fixed_batch_dim(final)
    if fixed:
        return f"not considered: {fixed}"
    variants = {"plain": chosen, "batched": replace(chosen, label=f"{chosen.label}, max_batch {batch}", max_batch=batch, loads={})}
    stage_ms: dict[str, list[tuple[float, ...]]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory(prefix="onnxpipe-plan-") as tmp, contextlib.ExitStack() as stack:
        pipes: dict[str, Pipeline] = {}
        for key, variant in variants.items():
            report("batching", len(pipes), 2)
            try:
                pipes[key] = stack.enter_context(_load_finalist(variant, final, allowed, feeds, requests, Path(tmp)))
            except BuildError as e:
                for stage in final.config.stages:
                    stage.configure(max_batch=1)
                return f"the build refuses max_batch {batch}: {e}"
        report("batching", 2, 2)
        runners = {key: (lambda p=pipe, ms=stage_ms[key]: _timed_round(p, feeds, requests, ms)) for key, pipe in pipes.items()}
        measured = interleaved_rounds(runners, rounds, lambda done, total: report("batching", done, total))
    ratios = [b / p if p else float("inf") for b, p in zip(measured.values["batched"], measured.values["plain"], strict=True)]
    won, verdict = _batching_verdict(ratios, batch, rounds, requests)
    for stage in final.config.stages:
        stage.configure(max_batch=batch if won else 1)
    return verdict
