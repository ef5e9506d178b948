"""What the planner considers: every way to use the cores, each predicted from the measured per-node costs.

One session with 1..C intra-op threads, R replicas of the whole model x t threads (R * t <= C),
and pipelines of k stages, each stage given t threads or r replicas, the cores adding up to at most
C; each plan's throughput predicted as ``min over stages of replicas / stage time``. The finalists
are the best-predicted ones, and with ``concurrency`` their batching and spinning variants (see
``_measure``'s Note: the served workload).

Note: spinning.
    Stages do not spin by default (``StageSettings.spinning``): an idle onnxruntime pool that spins
    takes cores from the other stages and from the front door. But a pool whose threads block
    between the parallel sections of one run pays a thread wake-up at each of them, and where one
    session has the cores to itself that is a cost spinning avoids: PP-OCRv4's recognizer, 1
    session x 2 threads on 2 cores, one request at a time, 8.2 ms a request spinning against
    10.9 ms not (in process, medians of 5 interleaved rounds; served at N = 1, 100-120 req/s
    against 67-77). So with ``concurrency`` including 1 the finalists gain the **spinning
    variant** of the best-predicted plan of each rank that has a stage of two threads or more (a
    one-thread stage has no pool to spin), its label ending ``, spinning``, measured and chosen
    from **at N = 1 only**. With one request in flight the front door is idle while the model
    runs; with more, it decodes and answers other requests meanwhile, and a spinning pool takes
    its cores, which the in-process loop does not show: planned at N = 8 and 16 too, the spinning
    session held squeezenet's choice in process (2 replicas x 1t, 0.95-1.26x its req/s, did not
    beat it in every round) and served at 0.81-0.94x the 2 x 1 pipeline, and resnet50's at N = 16
    served at 0.93-0.96x PyTriton's best
    (``benchmarks.serve --vs-triton``, docs/serving.md).

    A spinning variant ranks with the plan it varies: it is that plan with one setting changed, as
    a thread count is, and within a rank the choice rule takes the best median (the every-round
    test is for a plan more complex than the holder: more cores, copies or hand-overs). An
    every-round test on a p99 of 40 requests (about their maximum) is lost to one scheduling
    hiccup: in two planner runs PP-OCR rec's spinning session had 0.72x and 0.75x the plain
    session's p99 by median (1.41x its req/s), and lost the test in one round of five each time.
    The plan chosen writes ``spinning`` into its stages' settings, and the server runs it so.

"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from onnxpipe.splitter import CostProfile, SplitPlan

__all__ = ["LoadMeasure", "PlanCandidate"]

#: The largest ``max_batch`` of a batching variant when ``batch`` is not given (see Note: the served workload).
_VARIANT_MAX_BATCH = 8
#: A batching variant's ``max_delay_ms``: this share of its slowest predicted stage, at most ``_VARIANT_MAX_DELAY_MS``.
_VARIANT_DELAY_SHARE = 0.1
_VARIANT_MAX_DELAY_MS = 1.0
#: Plans from simple to complex, as the choice rule ranks them; batching variants rank after every plain plan, in the same order.
_RANKS = ("session", "replicas", "pipeline", "session, batching", "replicas, batching", "pipeline, batching")


@dataclass(frozen=True)
class LoadMeasure:
    """One finalist under N requests in flight, closed loop, each round's figures in round order
    (see Note: the served workload).

    Attributes:
        concurrency: N, the requests in flight.
        rounds: Requests per second in each round.
        p50_rounds: Each round's median latency (ms, submit to result).
        p99_rounds: Each round's 99th percentile latency (ms).
        mean_rounds: Each round's mean latency (ms): with its req/s, the requests it kept in flight
            (Little's law, exact for the mean: N for a closed loop of N).
    """

    concurrency: int
    rounds: tuple[float, ...]
    p50_rounds: tuple[float, ...]
    p99_rounds: tuple[float, ...]
    mean_rounds: tuple[float, ...] = ()

    @property
    def throughput(self) -> float:
        """Requests per second, the median over the rounds."""
        return statistics.median(self.rounds)

    @property
    def p50_ms(self) -> float:
        """The median latency, the median over the rounds."""
        return statistics.median(self.p50_rounds)

    @property
    def p99_ms(self) -> float:
        """The p99 latency, the median over the rounds."""
        return statistics.median(self.p99_rounds)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form: the medians and each round's figures."""
        return {"req_s": self.throughput, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "req_s_rounds": list(self.rounds),
                "p50_ms_rounds": list(self.p50_rounds), "p99_ms_rounds": list(self.p99_rounds), "mean_ms_rounds": list(self.mean_rounds)}


@dataclass
class PlanCandidate:
    """One way to use the cores.

    Attributes:
        label: Human-readable (``pipeline 2 x (1t, 1t)``, ``1 session x 2t``, ``2 replicas x 1t``).
        kind: ``pipeline``, ``session`` or ``replicas``.
        threads: Intra-op threads of each stage (one entry for a session or replicas).
        replicas: Replicas of each stage.
        predicted: Predicted requests per second.
        stage_predicted_ms: Predicted time of one run of each stage.
        measured: Measured requests per second (the median over the rounds), when it was measured.
        rounds: Measured requests per second in each round, in round order.
        stage_measured_ms: Measured mean time of each stage inside the pipeline (median over the
            rounds), when measured.
        targets: Each stage's target when the planner chose among several (see Note: targets);
            empty: every stage on the CPU.
        memory_bytes: The physical memory the plan took once loaded and warmed up, measured
            (see Note: memory), when it was measured.
        max_batch: The most requests a stage runs as one call (a batching variant's is above 1:
            see Note: the served workload).
        max_delay_ms: How long a stage that took a request waits for others to join it.
        loads: What it measured under each N requests in flight, by N (with ``concurrency``).
        spinning: Whether its stages' idle onnxruntime threads spin (a spinning variant: see Note: spinning).
    """

    label: str
    kind: str
    threads: tuple[int, ...]
    replicas: tuple[int, ...]
    predicted: float
    stage_predicted_ms: tuple[float, ...]
    measured: float | None = None
    rounds: tuple[float, ...] = ()
    stage_measured_ms: tuple[float, ...] = ()
    split: SplitPlan | None = field(default=None, repr=False)
    targets: tuple[str, ...] = ()
    memory_bytes: int | None = None
    max_batch: int = 1
    max_delay_ms: float = 0.0
    loads: dict[int, LoadMeasure] = field(default_factory=dict)
    spinning: bool = False

    @property
    def simple(self) -> bool:
        """One session or replicas of the whole model: no hand-overs, nothing to cut."""
        return self.kind != "pipeline"

    @property
    def cores(self) -> int:
        """Cores the plan occupies."""
        return sum(t * r for t, r in zip(self.threads, self.replicas, strict=True))

    @property
    def rank(self) -> str:
        """Where the choice rule ranks it, simple to complex: ``session``, ``replicas``, ``pipeline``, then the
        same batching (``session, batching``, ...); a spinning variant ranks with the plan it varies (see Note: spinning)."""
        return f"{self.kind}, batching" if self.max_batch > 1 else self.kind


def _stage_ms(profile: CostProfile, nodes: Sequence[int], crossing_bytes: int, first: bool) -> float:
    compute = sum(profile.node_seconds.get(i, 0.0) for i in nodes)
    return 1e3 * (compute + (0.0 if first else profile.crossing_seconds(crossing_bytes)))


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Ways to give ``parts`` stages at least one core each, ``total`` cores at most."""
    out = []
    for used in range(parts, total + 1):
        for cut in itertools.combinations(range(1, used), parts - 1):
            bounds = (0, *cut, used)
            out.append(tuple(bounds[i + 1] - bounds[i] for i in range(parts)))
    return out


def _baselines(profiles: dict[int, CostProfile], cores: int) -> list[PlanCandidate]:
    out = []
    for t, p in profiles.items():
        out.append(PlanCandidate(f"1 session x {t}t", "session", (t,), (1,), 1.0 / p.total_seconds, (1e3 * p.total_seconds,)))
        for r in range(2, cores // t + 1):
            out.append(PlanCandidate(f"{r} replicas x {t}t", "replicas", (t,), (r,), r / p.total_seconds, (1e3 * p.total_seconds,)))
    return out


def _pipelines(split_plan: SplitPlan, profiles: dict[int, CostProfile], cores: int) -> list[PlanCandidate]:
    """Every way to give the stages of ``split_plan`` threads or replicas within ``cores``."""
    assert split_plan.auto is not None
    assignment = split_plan.auto.assignment
    k = len(split_plan.stages)
    members = [[n for n, s in assignment.items() if s == i] for i in range(k)]
    out = []
    for threads, replicas in _allocations(cores, k, profiles):
        ms = tuple(
            _stage_ms(profiles[t], members[i], split_plan.stages[i].bytes_in or 0, i == 0) for i, t in enumerate(threads)
        )
        predicted = min(r / (m / 1e3) for r, m in zip(replicas, ms, strict=True) if m > 0)
        parts = ", ".join(f"{t}t" + (f"x{r}" if r > 1 else "") for t, r in zip(threads, replicas, strict=True))
        out.append(PlanCandidate(f"pipeline {k} x ({parts})", "pipeline", threads, replicas, predicted, ms, split=split_plan))
    return out


def _allocations(cores: int, k: int, profiles: dict[int, CostProfile]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each ``(threads, replicas)`` of ``k`` stages within ``cores``: a stage's cores go to one session's threads or to
    one-thread replicas, at thread counts that were profiled."""
    out = []
    for alloc in _compositions(cores, k):
        for widen in itertools.product((False, True), repeat=k):
            threads = tuple(1 if w else a for a, w in zip(alloc, widen, strict=True))
            replicas = tuple(a if w else 1 for a, w in zip(alloc, widen, strict=True))
            # Widening a one-core stage gives it one replica of one thread: the same plan as not widening it.
            if any(t not in profiles for t in threads) or any(w and a == 1 for a, w in zip(alloc, widen, strict=True)):
                continue
            out.append((threads, replicas))
    return out


def _fixed_batch_dim(split_plan: SplitPlan) -> str | None:
    """Why the plan's requests cannot be stacked along dim 0 (an input or output whose dim 0 is not symbolic), or ``None``."""
    spec = split_plan.spec
    fixed = [t for t in (*spec.inputs, *spec.outputs) if not t.shape or isinstance(t.shape[0], int)]
    if not fixed:
        return None
    return f"'{fixed[0].name}' has no symbolic batch dim (dim 0 is {'unknown' if not fixed[0].shape else fixed[0].shape[0]})"


def _variants(plans: Sequence[PlanCandidate], whole: SplitPlan, max_batch: int, notes: list[str]) -> list[PlanCandidate]:
    """The stateless batching variants of ``plans`` (see Note: the served workload), or none, with a note, when the
    model's requests cannot be stacked."""
    fixed = _fixed_batch_dim(whole)
    if fixed:
        notes.append(f"no batching variants: {fixed}")
        return []
    out = []
    for c in plans:
        delay = round(min(_VARIANT_MAX_DELAY_MS, _VARIANT_DELAY_SHARE * max(c.stage_predicted_ms)), 2)
        label = f"{c.label}, max_batch {max_batch}" + (f", delay {delay:g} ms" if delay else "")
        out.append(replace(c, label=label, max_batch=max_batch, max_delay_ms=delay, loads={}))
    return out


def _spinning_variants(plans: Sequence[PlanCandidate]) -> list[PlanCandidate]:
    """The spinning variants (see Note: spinning): of the best-predicted plan of each rank that has a stage of
    more than one thread (a one-thread stage has no pool to spin)."""
    out = []
    for rank in _RANKS:
        best = max((c for c in plans if c.rank == rank and max(c.threads) > 1), key=lambda c: c.predicted, default=None)
        if best is not None:
            out.append(replace(best, label=f"{best.label}, spinning", spinning=True, loads={}))
    return out


def _served_finalists(finalists: Sequence[PlanCandidate], ranked: Sequence[PlanCandidate], cores: int) -> list[PlanCandidate]:
    """The finalists for the served workload (see Note: the served workload): the usual ones, the one-session plan with
    all ``cores`` threads (N = 1's plan, whose thread scaling the per-node profiles predict least well) and the
    best-predicted pipeline of each depth."""
    out = list(finalists)
    wide = next((c for c in ranked if c.kind == "session" and c.threads == (cores,)), None)
    depths: dict[int, PlanCandidate] = {}
    for c in ranked:
        if c.kind == "pipeline":
            depths.setdefault(len(c.threads), c)
    for extra in (wide, *depths.values()):
        if extra is not None and all(extra is not f for f in out):
            out.append(extra)
    return out




def _load_variants(finalists: Sequence[PlanCandidate], whole: SplitPlan, loads: Sequence[int], batch: int, notes: list[str]) -> list[PlanCandidate]:
    """The variants measured beside the finalists under the served workload (see Note: the served workload): the batching
    variants of the best-predicted plan of each kind (``max_batch`` is ``batch``, else min(largest N, 8)), and with N = 1
    the spinning variants (see Note: spinning)."""
    max_batch = batch if batch > 1 else min(max(loads), _VARIANT_MAX_BATCH)
    if max_batch > 1:  # the best-predicted plan of each kind, batching
        best = [next(c for c in finalists if c.kind == kind) for kind in ("session", "replicas", "pipeline") if any(c.kind == kind for c in finalists)]
        variants = _variants(best, whole, max_batch, notes)
    else:
        variants = []
        notes.append("no batching variants: with 1 request in flight no batch forms")
    if 1 in loads:
        variants += _spinning_variants([*finalists, *variants])
    return variants


def _finalists(ranked: Sequence[PlanCandidate], measure: int, lean: bool) -> list[PlanCandidate]:
    """The finalists among ``ranked`` (best predicted first): the ``measure`` best-predicted pipelines, the best-predicted
    one-session and replicas plans, and with ``lean`` (a memory budget) the one-session plan at one thread too."""
    finalists = [c for c in ranked if not c.simple][:measure]
    finalists += [best for kind in ("session", "replicas") if (best := next((c for c in ranked if c.kind == kind), None))]
    if lean:  # the best one-session plan always fits what a session needs: keep one at 1 thread too, the leanest
        cheapest = next((c for c in ranked if c.kind == "session" and c.threads == (1,)), None)
        if cheapest is not None and cheapest not in finalists:
            finalists.append(cheapest)
    return finalists
