"""The planner: the whole deployment plan for a core budget, pipelines and the alternatives alike.

``plan_pipeline(model, cores=C)`` considers, for the ``C`` cores it may use:

- one session with 1..C intra-op threads;
- R replicas of the whole model x t threads (R * t <= C);
- pipelines of k = 2..min(C, max_stages) stages (cut by :class:`MeasuredPolicy`), each stage given
  t threads or r replicas, the cores adding up to at most C.

It predicts each plan's throughput from measured per-node costs at each thread count
(``min over stages of replicas / stage time``), then builds and loads the finalists (the best
predicted pipelines, the best one-session plan and the best replicas plan) and **measures them
together in interleaved rounds** (:func:`~onnxpipe.runtime.interleaved_rounds`). Cores are assigned
in order (stage 0 first), so the chosen plan also fixes every stage's affinity.

Note: the choice rule.
    A more complex plan replaces a simpler one only if it was faster in **every** round, i.e. its
    lowest paired ratio (its req/s / the simpler plan's req/s, both from the same round) is above
    1: its margin is then larger than the rounds' spread below the median. Simplest is one session
    (the best of them by median over the rounds), then replicas of the whole model (more cores and
    memory), then a pipeline; among several that beat the simpler plan in every round the highest
    median ratio wins. The *simple* plan is the one session or the replicas that this leaves, and
    ``PlanChoice`` compares the best pipeline with it. Two equally fast plans pass this by luck
    with probability 2^-rounds (1 in 32 with 5 rounds), and a pipeline that wins some rounds and
    loses others is no clear winner (a tie): the simpler plan is kept. On 2 cores the candidates
    are often within a few percent, and one noisy measurement per plan used to decide.

Note: batching.
    With ``batch`` above 1 (``split --auto --cores C --batch N``), once the plan is chosen and every
    input and output of the model has a symbolic dim 0, the planner builds the chosen plan again
    with ``max_batch=N`` on every stage (the build's probe checks that it can batch; a refusal is
    reported, not raised) and measures it against the chosen plan in interleaved rounds with the
    same rule: batching is kept only if it wins *every* round. CPU models often gain nothing from
    it (docs/batching.md), so it is measured, never assumed.

Note: targets.
    With ``targets`` naming more than the CPU (``split --auto --cores C --targets cpu,openvino``), a
    node's cost on another provider cannot be read from the CPU profile (a provider that compiles
    its part of the graph runs it as one fused node, so its profile has no per-node costs). So the
    cut stays the one the CPU profile chooses, and **each stage of each cut, and the whole model,
    is measured on each target** at each thread count (built, loaded and run one request at a time:
    each stage's median time alone). Every pipeline allocation is then predicted with every
    assignment of targets to its stages, and the one-session and replicas plans on every target;
    the finalists are measured in interleaved rounds as always. Moving a boundary tensor between
    host providers (the CPU's, OpenVINO's on the CPU) costs what any hand-off does, so no transfer
    cost is added; a device provider would need its copies counted, and is refused here. On one
    CPU every target shares the same cores: a stage's threads count against the budget whatever
    its provider, and the plan's notes say so.

Note: memory.
    On one host, replicas of the whole model often match a pipeline's throughput, but hold the
    weights once per replica, where a pipeline of k stages holds them once and still uses k
    cores. With ``memory`` (``split --auto --cores C --memory 1.5GiB``), each finalist's memory is
    **measured**, not estimated from its weights: its bundle loaded in a process of its own
    (``_memory.plan_memory``), the proportional set size (``runtime._stats.resident_bytes``: weights
    mapped in place count once) before loading and after loading and warming up (sessions,
    prepacked weights, arenas after the first runs). A process of its own, since in the planner's
    memory that earlier sessions freed is handed out again without the process growing.
    Finalists over the budget leave the choice, and the notes list them with what they measured;
    the one-session plan at one thread is always a finalist then, as the leanest simple plan. No
    plan fitting is a :class:`SplitError` listing every finalist's memory.

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

Note: symbolic dims.
    What a plan costs depends on the input sizes, so dims are never guessed silently. A dim that
    is symbolic or unknown must be given (``dims``: by name, or ``"input.axis"`` for an unnamed one),
    except a *batch-like* dim (axis 0 of an input of rank 2 or more, named nowhere else), which is
    planned at 1 with a note saying so; any other dim not given is refused with a
    :class:`SplitError` naming each one and how to give it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import os
import queue
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from onnxpipe._errors import BuildError, ConfigError, SplitError
from onnxpipe.builder import build, export, io_specs
from onnxpipe.builder._modules import move_into_place
from onnxpipe.runtime import DEFAULT_QUEUE_DEPTH, Pipeline, StageSettings, TensorSpec, interleaved_rounds, load, random_inputs
from onnxpipe.runtime._stats import resident_bytes
from onnxpipe.splitter._auto import MeasuredPolicy
from onnxpipe.splitter._cost import CostProfile, profile_model
from onnxpipe.splitter._graph import load_model
from onnxpipe.splitter._memory import plan_memory
from onnxpipe.splitter._plan import SplitPlan, split

__all__ = ["Contest", "LoadChoice", "LoadMeasure", "LoadPlan", "PlanCandidate", "PlanChoice", "PlanResult", "plan_pipeline"]

Progress = Callable[[str, int, int], None]

#: Providers that run in host memory: moving a tensor between them is a hand-off like any other.
_HOST_PROVIDERS = frozenset({"CPUExecutionProvider", "OpenVINOExecutionProvider", "DnnlExecutionProvider", "XnnpackExecutionProvider"})
#: Untimed requests before each timed round: a pipeline that sat idle while the others ran wakes up first.
_ROUND_WARMUP = 3
#: The largest ``max_batch`` of a batching variant when ``batch`` is not given (see Note: the served workload).
_VARIANT_MAX_BATCH = 8
#: A batching variant's ``max_delay_ms``: this share of its slowest predicted stage, at most ``_VARIANT_MAX_DELAY_MS``.
_VARIANT_DELAY_SHARE = 0.1
_VARIANT_MAX_DELAY_MS = 1.0
#: Plans from simple to complex, as the choice rule ranks them; batching variants rank after every plain plan, in the same order.
_RANKS = ("session", "replicas", "pipeline", "session, batching", "replicas, batching", "pipeline, batching")
_RANK_NAMES = {"session": "one-session plans", "replicas": "replicas plans", "pipeline": "pipelines", "session, batching": "batching one-session plans",
               "replicas, batching": "batching replicas plans", "pipeline, batching": "batching pipelines"}


@dataclass(frozen=True)
class LoadMeasure:
    """One finalist under N requests in flight, closed loop, each round's figures in round order
    (see Note: the served workload).

    Attributes:
        concurrency: N, the requests in flight.
        rounds: Requests per second in each round.
        p50_rounds: Each round's median latency (ms, submit to result).
        p99_rounds: Each round's 99th percentile latency (ms).
    """

    concurrency: int
    rounds: tuple[float, ...]
    p50_rounds: tuple[float, ...]
    p99_rounds: tuple[float, ...]

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
                "p50_ms_rounds": list(self.p50_rounds), "p99_ms_rounds": list(self.p99_rounds)}


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


@dataclass(frozen=True)
class PlanChoice:
    """Why the chosen plan was chosen, and how sure that is (see the choice rule in the module's notes).

    Attributes:
        simple: Label of the simple plan the rule kept (one session, or replicas that beat it every round).
        contender: Label of the pipeline compared with it (the chosen one, else the one with the
            highest median ratio), or ``None`` when no pipeline was measured.
        ratios: The contender's req/s over the simple plan's in each round (paired), in round order.
        rounds: Rounds run.
        requests: Timed requests per plan and round.
        verdict: ``pipeline`` (it won every round), ``tie`` (it won some rounds, lost others),
            ``simple`` (the simple plan won every round), ``no pipeline`` (none was measured) or
            ``only pipelines`` (no simple plan was left to compare with: a memory budget).
    """

    simple: str
    contender: str | None
    ratios: tuple[float, ...]
    rounds: int
    requests: int
    verdict: str

    def __str__(self) -> str:
        if self.contender is None:
            return f"{self.simple}: no pipeline was measured (best simple plan over {self.rounds} round(s) of {self.requests} requests)"
        if self.verdict == "only pipelines":
            measured = f"{self.rounds} round(s) of {self.requests} requests"
            return f"{self.contender}: the fastest of the pipelines, since no one-session or replicas plan fits ({measured})"
        median = statistics.median(self.ratios)
        spread = f"paired ratios {min(self.ratios):.2f}-{max(self.ratios):.2f} over {self.rounds} round(s) of {self.requests} requests"
        if self.verdict == "pipeline":
            return f"{self.contender} wins by {median:.2f}x {self.simple} ({spread})"
        if self.verdict == "tie":
            return f"no clear winner: {self.contender} is {median:.2f}x {self.simple} ({spread}), within the rounds' spread: kept the simpler plan"
        return f"{self.simple} wins: the best pipeline, {self.contender}, is {median:.2f}x it ({spread})"


@dataclass(frozen=True)
class Contest:
    """One step of the choice rule at one N: the best plan of the next rank against the holder.

    Attributes:
        rival: Label of the plan of the next rank (the best by median ratio among those better in
            every round, else among all of its rank).
        holder: Label of the plan it was compared with.
        ratios: The rival's figure over the holder's in each round (paired): req/s, or p99 when
            the choice is by latency.
        won: Whether it was better in every round (then it holds from here on).
    """

    rival: str
    holder: str
    ratios: tuple[float, ...]
    won: bool


@dataclass(frozen=True)
class LoadChoice:
    """Why a plan was chosen for N requests in flight (see Note: the served workload).

    Attributes:
        concurrency: N.
        chosen: Label of the chosen plan.
        metric: ``req/s`` (the highest throughput) or ``p99`` (the lowest p99: at N = 1 without a bound).
        first: Label of the best plan of the simplest rank, where the rule started.
        first_rank: Its rank (:attr:`PlanCandidate.rank`).
        first_value: Its figure (req/s or p99 ms), the median over the rounds.
        contests: Each later rank's best against the holder, in rank order.
        dropped: ``(label, p99 ms)`` of each finalist over the p99 bound.
        p99_bound: The bound in ms, or ``None``.
        rounds: Rounds run at this N.
        requests: Timed requests per plan and round.
    """

    concurrency: int
    chosen: str
    metric: str
    first: str
    first_rank: str
    first_value: float
    contests: tuple[Contest, ...] = ()
    dropped: tuple[tuple[str, float], ...] = ()
    p99_bound: float | None = None
    rounds: int = 0
    requests: int = 0

    def __str__(self) -> str:
        latency = self.metric == "p99"
        what = "p99" if latency else "req/s"
        won = [i for i, c in enumerate(self.contests) if c.won]
        if won:
            last = self.contests[won[-1]]
            median = statistics.median(last.ratios)
            if latency:
                why = f"lower p99 than {last.holder} in every round, {median:.2f}x its p99 ({_spread(last.ratios)})"
            else:
                why = f"{median:.2f}x {last.holder}'s req/s in every round ({_spread(last.ratios)})"
        else:
            figure = f"{self.first_value:.2f} ms" if latency else f"{self.first_value:.1f} req/s"
            best = "lowest p99" if latency else "highest req/s"
            why = f"the {best} of the {_RANK_NAMES[self.first_rank]} ({figure})"
        later = self.contests[won[-1] + 1 :] if won else self.contests
        if later:
            pick = min if latency else max
            closest = pick(later, key=lambda c: statistics.median(c.ratios))
            median = statistics.median(closest.ratios)
            some = any(r < 1.0 for r in closest.ratios) if latency else any(r > 1.0 for r in closest.ratios)
            why += (f"; no more complex plan was better in every round (the closest, {closest.rival}, {median:.2f}x its {what}, "
                    f"{_spread(closest.ratios)}{': within the spread, kept the simpler plan' if some else ''})")
        bound = f" within --p99 {self.p99_bound:g} ms" if self.p99_bound is not None else ""
        line = f"at N={self.concurrency}{bound}: {self.chosen}: {why} [{self.rounds} round(s) of {self.requests} requests]"
        if self.dropped:
            line += f"; --p99 {self.p99_bound:g} ms dropped " + ", ".join(f"{label} (p99 {ms:.2f} ms)" for label, ms in self.dropped)
        return line


@dataclass
class LoadPlan:
    """The plan chosen for N requests in flight.

    Attributes:
        concurrency: N.
        plan: Its split, the stages' settings set (threads, replicas, affinity, ``max_batch``, ``max_delay_ms``).
        chosen: The chosen candidate (its ``loads`` hold what every N measured).
        choice: Why it won at this N.
    """

    concurrency: int
    plan: SplitPlan
    chosen: PlanCandidate
    choice: LoadChoice


def _spread(ratios: Sequence[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


@dataclass
class PlanResult:
    """The chosen plan and everything considered.

    Attributes:
        plan: The split of the chosen plan, its stages' settings (threads, replicas, affinity) set;
            one stage when a single session or replicas won.
        chosen: The chosen candidate.
        candidates: Every candidate, best measured first, then by prediction.
        cores: The core budget.
        choice: Why the chosen plan won and how sure that is.
        notes: What the user should know.
        batching: Whether batching requests (``max_batch``) paid for the chosen plan, measured
            (see Note: batching), or why it was not considered; ``None`` when it was not asked for.
        loads: With ``concurrency``: the plan chosen for each N, in the order given (``plan``,
            ``chosen`` and ``choice`` are then the first one's; see Note: the served workload).
        p99_ms: The p99 bound the choice met, or ``None``.
    """

    plan: SplitPlan
    chosen: PlanCandidate
    candidates: list[PlanCandidate]
    cores: int
    choice: PlanChoice | LoadChoice
    notes: list[str] = field(default_factory=list)
    batching: str | None = None
    loads: list[LoadPlan] = field(default_factory=list)
    p99_ms: float | None = None

    def baselines(self) -> dict[str, float]:
        """Measured throughput of the best one-session plan and the best replicas plan (of those
        that took part in the choice: a plan a memory budget dropped does not)."""
        best: dict[str, float] = {}
        for c in self.candidates:
            if c.kind != "pipeline" and c.measured is not None and c.rounds:
                best[c.kind] = max(best.get(c.kind, 0.0), c.measured)
        return best

    def load_table(self) -> tuple[list[str], list[list[str]]]:
        """With ``concurrency``: the header and one row per finalist, its req/s, p50 and p99 at each N
        (medians, the rounds' min-max in brackets) and the Ns it was chosen at."""
        header = ["plan"]
        for lp in self.loads:
            header += [f"N={lp.concurrency} req/s", "p50 ms", "p99 ms"]
        rows = []
        for c in self.candidates:
            if not c.loads:
                continue
            row = [c.label]
            for lp in self.loads:
                m = c.loads.get(lp.concurrency)
                if m is None:
                    row += ["-", "-", "-"]
                    continue
                row += [f"{m.throughput:.1f} ({min(m.rounds):.1f}-{max(m.rounds):.1f})", _ms(m.p50_ms),
                        f"{_ms(m.p99_ms)} ({_ms(min(m.p99_rounds))}-{_ms(max(m.p99_rounds))})"]
            rows.append([*row, ", ".join(f"N={lp.concurrency}" for lp in self.loads if lp.chosen is c)])
        return [*header, "chosen at"], rows

    def load_summary(self) -> dict[str, object]:
        """With ``concurrency``: a JSON-ready summary, every finalist's figures at each N and the choice at each N."""
        finalists = [
            {"plan": c.label, "kind": c.kind, "threads": list(c.threads), "replicas": list(c.replicas), "targets": list(c.targets),
             "max_batch": c.max_batch, "max_delay_ms": c.max_delay_ms, "spinning": c.spinning, "memory_bytes": c.memory_bytes,
             "loads": {str(n): m.to_dict() for n, m in c.loads.items()}}
            for c in self.candidates if c.loads
        ]
        chosen = {str(lp.concurrency): {"plan": lp.chosen.label, "why": str(lp.choice), "stages": len(lp.plan.stages)} for lp in self.loads}
        first = self.loads[0].choice if self.loads else None
        return {"cores": self.cores, "concurrency": [lp.concurrency for lp in self.loads], "p99_ms": self.p99_ms,
                "rounds": first.rounds if first else 0, "requests": first.requests if first else 0, "finalists": finalists,
                "chosen": chosen, "notes": list(self.notes)}

    def save(self, directory: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the chosen plan with its settings to ``directory`` (:meth:`SplitPlan.save`); with
        several N, each N's plan to ``directory/concurrency-N/`` (see :meth:`folders`) and
        :meth:`load_summary` to ``directory/summary.json``, the whole folder written or not at all.

        Raises:
            SplitError: the folder exists, is not empty, and ``overwrite`` is false.
        """
        if len(self.loads) < 2:
            return self.plan.save(directory, overwrite=overwrite)
        directory = Path(directory)
        if directory.exists() and (not directory.is_dir() or (any(directory.iterdir()) and not overwrite)):
            raise SplitError(f"output folder '{directory}' " + ("is a file; choose another name" if not directory.is_dir() else
                                                                "exists and is not empty; choose another or overwrite it"))
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            for lp, folder in zip(self.loads, self.folders(staging).values(), strict=True):
                lp.plan.save(folder)
            (staging / "summary.json").write_text(json.dumps(self.load_summary(), indent=2) + "\n")
            move_into_place(staging, directory)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
        return directory

    def folders(self, directory: str | os.PathLike[str]) -> dict[int, Path]:
        """Where :meth:`save` writes each N's plan: ``directory`` itself for one N (or none), else ``directory/concurrency-N``."""
        directory = Path(directory)
        if len(self.loads) < 2:
            return {lp.concurrency: directory for lp in self.loads}
        return {lp.concurrency: directory / f"concurrency-{lp.concurrency}" for lp in self.loads}

    def __str__(self) -> str:
        if self.loads:
            return self._loads_str()
        lines = [f"plan for {self.cores} core(s): {self.chosen.label}, {self.chosen.measured or 0:.1f} req/s measured", f"  {self.choice}"]
        for kind, value in self.baselines().items():
            if value:
                lines.append(f"  vs best {kind}: {value:.1f} req/s ({(self.chosen.measured or 0) / value:.2f}x)")
        for c in self.candidates:
            measured = f"{c.measured:8.1f}" if c.measured is not None else "       -"
            spread = f" ({min(c.rounds):.1f}-{max(c.rounds):.1f})" if c.rounds else ""
            lines.append(f"  {c.label:<32} predicted {c.predicted:8.1f}  measured {measured} req/s{spread}")
        if self.batching:
            lines.append(f"  batching: {self.batching}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def _loads_str(self) -> str:
        first = self.loads[0].choice
        chosen = ", ".join(f"N={lp.concurrency}: {lp.chosen.label}" for lp in self.loads)
        lines = [f"plans for {self.cores} core(s) under N requests in flight (closed loop): {chosen}",
                 f"  median of {first.rounds} round(s) of {first.requests} requests at each N, the rounds' min-max in brackets"]
        header, rows = self.load_table()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = (cell.ljust(w) if i in (0, len(row) - 1) else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
            lines.append(("  " + "  ".join(cells)).rstrip())
        lines += [f"  {lp.choice}" for lp in self.loads]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


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
    for alloc in _compositions(cores, k):
        for widen in itertools.product((False, True), repeat=k):
            threads = tuple(1 if w else a for a, w in zip(alloc, widen, strict=True))
            replicas = tuple(a if w else 1 for a, w in zip(alloc, widen, strict=True))
            # Widening a one-core stage gives it one replica of one thread: the same plan as not widening it.
            if any(t not in profiles for t in threads) or any(w and a == 1 for a, w in zip(alloc, widen, strict=True)):
                continue
            ms = tuple(
                _stage_ms(profiles[t], members[i], split_plan.stages[i].bytes_in or 0, i == 0) for i, t in enumerate(threads)
            )
            predicted = min(r / (m / 1e3) for r, m in zip(replicas, ms, strict=True) if m > 0)
            parts = ", ".join(f"{t}t" + (f"x{r}" if r > 1 else "") for t, r in zip(threads, replicas, strict=True))
            out.append(PlanCandidate(f"pipeline {k} x ({parts})", "pipeline", threads, replicas, predicted, ms, split=split_plan))
    return out


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


def _check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """The targets to plan over, each checked: known, on this host, and using host memory.

    Raises:
        SplitError: an unknown target, one this host lacks, or a device provider (its copies are not counted).
    """
    import onnxruntime as ort

    from onnxpipe.runtime import resolve_provider
    from onnxpipe.runtime._distributions import conflict

    out = []
    for target in targets:
        try:
            provider, device = resolve_provider(target)
        except ConfigError as e:
            raise SplitError(f"--targets: {e}") from None
        if provider not in ort.get_available_providers():
            two = conflict(provider)  # two onnxruntime builds over each other: say so, and how to keep one
            raise SplitError(f"cannot plan for target '{target}': this host's onnxruntime ({ort.__version__}) does not have {provider} "
                             f"(it has {', '.join(ort.get_available_providers())}); the planner measures every stage on every target"
                             + (f"; {two}" if two else ""))
        if device is not None or provider not in _HOST_PROVIDERS:
            raise SplitError(f"cannot plan for target '{target}': the planner counts no device copies, so it plans over providers that run "
                             f"in host memory only ({', '.join(sorted(_HOST_PROVIDERS))})")
        if target not in out:
            out.append(target)
    if not out:
        raise SplitError("--targets names no target")
    return tuple(out)


def _measure_on_targets(split_plan: SplitPlan, targets: Sequence[str], threads: Sequence[int], feeds: dict[str, np.ndarray], requests: int,
                        work: Path) -> dict[tuple[int, str, int], float]:
    """Each stage's median milliseconds alone, per (stage, target, threads): the plan built for each
    target and thread count, loaded, and run one request at a time (see Note: targets)."""
    out: dict[tuple[int, str, int], float] = {}
    for target in targets:
        for t in threads:
            for stage in split_plan.config.stages:
                stage.configure(target=target, intra_op_threads=t, replicas=1, affinity=None)
            folder = work / f"t{time.monotonic_ns()}"
            with load(export(build(split_plan.config, folder / "built").path, folder / "bundle")) as pipe:
                for _ in range(3):
                    pipe(feeds)
                pipe.reset_stats()
                for _ in range(max(10, requests // 4)):
                    pipe(feeds)
                for i, stage_stats in enumerate(pipe.stats().stages):
                    out[(i, target, t)] = stage_stats.p50_ms
    return out


def _target_candidates(whole: SplitPlan, plans: Sequence[SplitPlan], profile: CostProfile, targets: Sequence[str], cores: int,
                       feeds: dict[str, np.ndarray], requests: int, report: Progress) -> list[PlanCandidate]:
    """Every one-session, replicas and pipeline plan with every assignment of ``targets``, predicted
    from each stage measured on each target (see Note: targets)."""
    threads = list(range(1, cores + 1))
    out: list[PlanCandidate] = []
    with tempfile.TemporaryDirectory(prefix="onnxpipe-plan-") as tmp:
        todo = [whole, *plans]
        measured = []
        for done, plan in enumerate(todo):
            report("targets", done, len(todo))
            measured.append(_measure_on_targets(plan, targets, threads, feeds, requests, Path(tmp)))
        report("targets", len(todo), len(todo))
    whole_ms = measured[0]
    for target in targets:
        for t in threads:
            alone = whole_ms[(0, target, t)]
            out.append(PlanCandidate(f"1 session x {t}t {target}", "session", (t,), (1,), 1e3 / alone, (alone,), targets=(target,)))
            for r in range(2, cores // t + 1):
                out.append(PlanCandidate(f"{r} replicas x {t}t {target}", "replicas", (t,), (r,), r * 1e3 / alone, (alone,), targets=(target,)))
    for plan, stage_ms in zip(plans, measured[1:], strict=True):
        k = len(plan.stages)
        for base in _pipelines(plan, {t: profile for t in threads}, cores):
            for chosen in itertools.product(targets, repeat=k):
                ms = tuple(stage_ms[(i, target, t)] + (0.0 if i == 0 else 1e3 * profile.crossing_seconds(plan.stages[i].bytes_in or 0))
                           for i, (target, t) in enumerate(zip(chosen, base.threads, strict=True)))
                predicted = min(r / (m / 1e3) for r, m in zip(base.replicas, ms, strict=True) if m > 0)
                parts = ", ".join(f"{t}t" + (f"x{r}" if r > 1 else "") + f" {target}" for t, r, target in zip(base.threads, base.replicas, chosen, strict=True))
                out.append(PlanCandidate(f"pipeline {k} x ({parts})", "pipeline", base.threads, base.replicas, predicted, ms, split=plan, targets=chosen))
    return out


def _contender(base: PlanCandidate, rivals: Sequence[PlanCandidate], values: Callable[[PlanCandidate], tuple[float, ...]] = lambda c: c.rounds,
               lower: bool = False) -> tuple[PlanCandidate, tuple[float, ...], bool]:
    """The rival to compare with ``base``, its paired ratios, and whether it won every round.

    The rival with the best median ratio among those that won every round, else among all. A
    round is won by a higher value (req/s), or with ``lower`` by a lower one (p99).
    """
    ratios = {id(c): tuple(v / b if b else float("inf") for v, b in zip(values(c), values(base), strict=True)) for c in rivals}
    winners = [c for c in rivals if (max(ratios[id(c)]) < 1.0 if lower else min(ratios[id(c)]) > 1.0)]
    pick = min if lower else max
    best = pick(winners or rivals, key=lambda c: statistics.median(ratios[id(c)]))
    return best, ratios[id(best)], bool(winners)


def choose_plan(candidates: Sequence[PlanCandidate], requests: int) -> tuple[PlanCandidate, PlanChoice]:
    """Apply the choice rule (module notes) to candidates measured in the same rounds.

    Args:
        candidates: Every candidate; those with ``rounds`` take part, at least one of them simple.
        requests: Timed requests per plan and round (for the report).

    Returns:
        The chosen candidate, and the :class:`PlanChoice` saying why and how sure.
    """
    measured = [c for c in candidates if c.rounds]
    sessions, replicas, pipelines = ([c for c in measured if c.kind == kind] for kind in ("session", "replicas", "pipeline"))
    if not sessions and not replicas:  # none left to compare with (a memory budget dropped them): the fastest pipeline
        best = max(pipelines, key=lambda c: statistics.median(c.rounds))
        return best, PlanChoice("no simple plan (none fits)", best.label, (), len(best.rounds), requests, "only pipelines")
    simple = max(sessions or replicas, key=lambda c: statistics.median(c.rounds))
    if sessions and replicas:  # replicas take more cores and memory than one session: the same rule
        rival, _, won = _contender(simple, replicas)
        simple = rival if won else simple
    if not pipelines:
        return simple, PlanChoice(simple.label, None, (), len(simple.rounds), requests, "no pipeline")
    contender, ratios, won = _contender(simple, pipelines)
    verdict = "pipeline" if won else ("tie" if max(ratios) > 1.0 else "simple")
    return (contender if won else simple), PlanChoice(simple.label, contender.label, ratios, len(simple.rounds), requests, verdict)


def choose_load(candidates: Sequence[PlanCandidate], concurrency: int, requests: int, p99_ms: float | None = None) -> tuple[PlanCandidate, LoadChoice]:
    """Apply the choice rule for N requests in flight (see Note: the served workload).

    Args:
        candidates: The finalists; those with ``loads[concurrency]`` take part.
        concurrency: N.
        requests: Timed requests per plan and round (for the report).
        p99_ms: A bound on the p99 (median over the rounds), or ``None``.

    Returns:
        The chosen candidate, and the :class:`LoadChoice` saying why.

    Raises:
        SplitError: no finalist's p99 meets the bound; lists every finalist's p99 at this N.
    """
    every = [c for c in candidates if concurrency in c.loads]
    pool = list(every)
    dropped: list[PlanCandidate] = []
    if p99_ms is not None:
        dropped = [c for c in pool if c.loads[concurrency].p99_ms > p99_ms]
        pool = [c for c in pool if c not in dropped]
        if not pool:
            measured = ", ".join(f"{c.label} {c.loads[concurrency].p99_ms:.2f} ms" for c in every)
            raise SplitError(f"no plan meets --p99 {p99_ms:g} ms at N={concurrency}: measured p99 (median of the rounds) {measured}")
    latency = p99_ms is None and concurrency == 1

    def values(c: PlanCandidate) -> tuple[float, ...]:
        load = c.loads[concurrency]
        return load.p99_rounds if latency else load.rounds

    ranks = [[c for c in pool if c.rank == rank] for rank in _RANKS]
    ranks = [group for group in ranks if group]
    pick = min if latency else max
    holder = pick(ranks[0], key=lambda c: statistics.median(values(c)))
    first = holder
    contests = []
    for group in ranks[1:]:
        rival, ratios, won = _contender(holder, group, values, lower=latency)
        contests.append(Contest(rival.label, holder.label, ratios, won))
        holder = rival if won else holder
    choice = LoadChoice(concurrency, holder.label, "p99" if latency else "req/s", first.label, first.rank, statistics.median(values(first)),
                        tuple(contests), tuple((c.label, c.loads[concurrency].p99_ms) for c in dropped), p99_ms,
                        len(values(first)), requests)
    return holder, choice


def choose_loads(candidates: Sequence[PlanCandidate], concurrency: Sequence[int], requests: int, p99_ms: float | None,
                 notes: list[str]) -> list[tuple[PlanCandidate, LoadChoice]]:
    """:func:`choose_load` at each N, in order; the finalists a p99 bound dropped at each N go to ``notes``.

    Raises:
        SplitError: no finalist meets ``p99_ms`` at some N.
    """
    out = []
    for n in concurrency:
        winner, choice = choose_load(candidates, n, requests, p99_ms)
        if choice.dropped:
            notes.append(f"at N={n}, over --p99 {p99_ms:g} ms: " + ", ".join(f"{label} (p99 {ms:.2f} ms)" for label, ms in choice.dropped))
        out.append((winner, choice))
    return out


def _planning_dims(specs: Sequence[TensorSpec], dims: Mapping[str, int], model: str) -> list[str]:
    """Check that every symbolic or unknown input dim has a size (see the note on symbolic dims).

    Returns:
        Notes on the batch-like dims planned at 1.

    Raises:
        SplitError: dims other than batch-like ones are not given; names every one and how to give it.
    """
    axes: dict[str, set[int]] = {}
    for spec in specs:
        for axis, d in enumerate(spec.shape or ()):
            if isinstance(d, str) and d:
                axes.setdefault(d, set()).add(axis)
    notes, missing, flags = [], [], []
    for spec in specs:
        shape = spec.shape or ()
        for axis, d in enumerate(shape):
            named = d if isinstance(d, str) and d else None
            key = named or f"{spec.name}.{axis}"
            if isinstance(d, int) or key in dims or f"{spec.name}.{axis}" in dims:
                continue
            what = f"input '{spec.name}' dim {axis} " + (f"('{named}')" if named else "(unnamed)")
            if axis == 0 and len(shape) >= 2 and (named is None or axes[named] == {0}):
                notes.append(f"{what} not given: planned at batch size 1; give --dim {key}=SIZE (dims={{'{key}': SIZE}}) to plan for larger batches")
                continue
            missing.append(what)
            if f"--dim {key}=SIZE" not in flags:
                flags.append(f"--dim {key}=SIZE")
    if missing:
        raise SplitError(
            f"cannot plan '{model}' without the sizes of its symbolic input dims: the cost depends on them, and 1 would plan for the "
            f"wrong inputs. Not given: {'; '.join(missing)}. Give them: {' '.join(flags)} (in Python: dims={{NAME: SIZE}})"
        )
    return notes


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

        def run(pipe: Pipeline, n: int, out: list[tuple[float, float]]) -> float:
            rate, ms = _closed_loop(pipe, feeds, n, requests)
            p50, p99 = np.percentile(ms, [50, 99])
            out.append((float(p50), float(p99)))
            return rate

        for n in concurrency:
            at_n = [c for c in measured if n == 1 or not c.spinning]  # spinning variants take part at N = 1 only (Note: spinning)
            latencies: dict[str, list[tuple[float, float]]] = {c.label: [] for c in at_n}
            runners = {c.label: functools.partial(run, pipes[c.label], n, latencies[c.label]) for c in at_n}
            values = interleaved_rounds(runners, rounds, functools.partial(report, f"measuring at N={n}")).values
            for c in at_n:
                c.loads[n] = LoadMeasure(n, values[c.label], tuple(p for p, _ in latencies[c.label]), tuple(p for _, p in latencies[c.label]))
    return measured


def plan_pipeline(
    model: str | os.PathLike[str],
    cores: int | None = None,
    *,
    max_stages: int | None = None,
    measure: int = 3,
    rounds: int = 5,
    requests: int = 40,
    dims: Mapping[str, int] | None = None,
    runs: int = 3,
    progress: Progress | None = None,
    batch: int = 1,
    targets: Sequence[str] = ("cpu",),
    memory: int | None = None,
    concurrency: int | Sequence[int] | None = None,
    p99_ms: float | None = None,
) -> PlanResult:
    """Plan how to run ``model`` on ``cores`` cores, measure the finalists side by side, choose.

    Args:
        model: The model file.
        cores: Core budget (default: the cores this process may use).
        max_stages: Most pipeline stages to consider (default: ``cores``).
        measure: How many of the best-predicted pipelines are finalists; the best predicted
            one-session and replicas plans always are.
        rounds: Interleaved rounds of measurement: each runs every finalist once, the order rotated.
        requests: Timed requests per finalist and round.
        dims: Sizes of symbolic input dims, by name (``"input.axis"`` for an unnamed one); every
            symbolic dim but a batch-like one must be given (see the note on symbolic dims).
        runs: Profiled runs per thread count.
        progress: Called with (step, done, total); steps ``profiling``, ``loading``, ``measuring``
            (and ``batching`` when ``batch`` is above 1).
        batch: Also measure the chosen plan batching up to this many requests per call, and keep
            it if it wins every round (see Note: batching); 1: do not consider batching.
        targets: The targets a stage (or the whole model) may run on; with more than ``cpu``,
            every stage is measured on each and the plan sets each stage's target (see Note: targets).
        memory: A budget in bytes: finalists whose measured memory is over it are dropped, and
            the notes say which, with what they measured (see Note: memory).
        concurrency: Plan for the served workload: measure the finalists (and batching variants)
            with exactly N requests in flight, closed loop, for each N given, and choose a plan for
            each (see Note: the served workload); ``batch`` then sets the variants' ``max_batch``.
            ``None``: stream requests and choose by throughput, as without a server in mind.
        p99_ms: With ``concurrency``: the highest throughput whose p99 (median over the rounds)
            is at most this many milliseconds.

    Returns:
        The :class:`PlanResult`; ``result.plan.save(folder)`` writes the chosen stages with their
        settings, ``result.choice`` says how sure the choice is; with ``concurrency``,
        ``result.loads`` holds the plan chosen for each N.

    Raises:
        SplitError: the core budget is below 1 or above what this process may use; ``rounds`` or
            ``requests`` is below 1; an input dim the cost depends on is not given; a target is
            unknown, missing here, or a device's; a concurrency below 1, or ``p99_ms`` not above 0
            or without ``concurrency``; no finalist meets ``p99_ms`` at some N (every p99 listed).
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = cores or len(allowed)
    if not 1 <= cores <= len(allowed):
        raise SplitError(f"core budget {cores} is outside 1..{len(allowed)} (the cores this process may use: {allowed})")
    if rounds < 1 or requests < 1:
        raise SplitError(f"rounds and requests must be at least 1, got rounds={rounds}, requests={requests}")
    loads = _check_loads(concurrency, p99_ms)
    planned_targets = _check_targets(targets)
    if memory is not None and (memory < 1 or resident_bytes() is None):
        raise SplitError(f"memory budget {memory}: " + ("must be at least 1 byte" if memory < 1 else "this OS has no /proc to measure a plan's memory with"))
    dims = dict(dims or {})
    proto, _ = load_model(model)
    specs = io_specs(proto)[0]
    notes = _planning_dims(specs, dims, Path(model).name)
    feeds, _ = random_inputs(specs, dims)  # every dim is given or batch-like (noted); refuses unknown dim names now, not after profiling
    report = progress or (lambda step, done, total: None)
    profiles = {}
    for t in range(1, cores + 1):
        report("profiling", t - 1, cores)
        profiles[t] = profile_model(model, StageSettings(intra_op_threads=t), runs=runs, dims=dims)
    report("profiling", cores, cores)
    candidates = _baselines(profiles, cores)
    plans = []
    for k in range(2, min(cores, max_stages or cores) + 1):
        try:
            plan_k = split(model, policy=MeasuredPolicy(stages=k, profile=profiles[1], dims=dims))
        except SplitError as e:
            notes.append(f"no {k}-stage pipeline: {e}")
            continue
        plans.append(plan_k)
        candidates.extend(_pipelines(plan_k, profiles, cores))
    whole = split(model, assignment={n.name or n.output[0]: 0 for n in proto.graph.node}, dims=dims)
    if planned_targets != ("cpu",):
        candidates = _target_candidates(whole, plans, profiles[1], planned_targets, cores, feeds, requests, report)
        notes.append(f"targets {', '.join(planned_targets)} share this host's cores: a stage's threads count against the {cores}-core budget "
                     "whatever its provider (OpenVINO's run on its own threads, sized by the stage's); cuts come from the CPU profile, "
                     "each stage measured on each target")
    ranked = sorted(candidates, key=lambda c: -c.predicted)
    finalists = [c for c in ranked if not c.simple][:measure]
    finalists += [best for kind in ("session", "replicas") if (best := next((c for c in ranked if c.kind == kind), None))]
    if memory is not None:  # the best one-session plan always fits what a session needs: keep one at 1 thread too, the leanest
        lean = next((c for c in ranked if c.kind == "session" and c.threads == (1,)), None)
        if lean is not None and lean not in finalists:
            finalists.append(lean)
    if loads:
        served = _served_finalists(finalists, ranked, cores)
        return _plan_loads(served, candidates, whole, allowed, feeds, rounds, requests, loads, p99_ms, report, notes, cores, batch, memory, dims)
    _measure(finalists, whole, allowed, feeds, rounds, requests, report, dims if memory is not None else None)
    if memory is not None:
        over = _over_memory(finalists, memory, notes)
        for c in over:  # out of the choice: only what fits is chosen from
            c.rounds = ()
    chosen, choice = choose_plan(candidates, requests)
    final = chosen.split or whole
    _configure(chosen, final, allowed)
    batching = _try_batching(chosen, final, allowed, feeds, rounds, requests, report, batch) if batch > 1 else None
    candidates.sort(key=lambda c: (c.measured is None, -(c.measured or 0.0), -c.predicted))
    return PlanResult(final, chosen, candidates, cores, choice, notes, batching)


def _over_memory(finalists: Sequence[PlanCandidate], memory: int, notes: list[str]) -> list[PlanCandidate]:
    """The finalists whose measured memory is over ``memory`` (see Note: memory); the notes say which, and what each measured.

    Raises:
        SplitError: none fits; lists what each measured.
    """
    over = [c for c in finalists if c.memory_bytes is not None and c.memory_bytes > memory]
    budget = f"the {_mib(memory)} memory budget"
    if len(over) == len(finalists):
        measured = ", ".join(f"{c.label} {_mib(c.memory_bytes)}" for c in finalists)
        raise SplitError(f"no plan fits {budget}: measured {measured}")
    if over:
        notes.append(f"dropped over {budget}: " + ", ".join(f"{c.label} ({_mib(c.memory_bytes)} measured)" for c in over))
    notes.append("memory measured per plan once loaded and warmed up: " + ", ".join(f"{c.label} {_mib(c.memory_bytes)}" for c in finalists))
    return over


def _check_loads(concurrency: int | Sequence[int] | None, p99_ms: float | None) -> tuple[int, ...]:
    """The Ns to plan for, each once, in the order given; empty without ``concurrency``.

    Raises:
        SplitError: an N below 1 or not an integer; ``p99_ms`` not above 0, or given without ``concurrency``.
    """
    if concurrency is None:
        if p99_ms is not None:
            raise SplitError("a p99 bound needs the load it holds under: give concurrency (--concurrency N) with p99_ms (--p99)")
        return ()
    values = (concurrency,) if isinstance(concurrency, int) else tuple(concurrency)
    bad = [n for n in values if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad or not values:
        raise SplitError(f"concurrency must be one or more integers from 1 (requests in flight), got {list(values)!r}")
    if p99_ms is not None and not p99_ms > 0:
        raise SplitError(f"the p99 bound must be above 0 ms, got {p99_ms!r}")
    return tuple(dict.fromkeys(values))


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


def _plan_loads(finalists: list[PlanCandidate], candidates: list[PlanCandidate], whole: SplitPlan, allowed: list[int], feeds: dict[str, np.ndarray],
                rounds: int, requests: int, loads: Sequence[int], p99_ms: float | None, report: Progress, notes: list[str], cores: int,
                batch: int, memory: int | None, dims: Mapping[str, int]) -> PlanResult:
    """``plan_pipeline`` with ``concurrency``: the finalists and their batching variants measured under each N, a plan chosen for each
    (see Note: the served workload)."""
    max_batch = batch if batch > 1 else min(max(loads), _VARIANT_MAX_BATCH)
    if max_batch > 1:  # the best-predicted plan of each kind, batching
        best = [next(c for c in finalists if c.kind == kind) for kind in ("session", "replicas", "pipeline") if any(c.kind == kind for c in finalists)]
        variants = _variants(best, whole, max_batch, notes)
    else:
        variants = []
        notes.append("no batching variants: with 1 request in flight no batch forms")
    if 1 in loads:
        variants += _spinning_variants([*finalists, *variants])
    measured = _measure_loads([*finalists, *variants], whole, allowed, feeds, rounds, requests, loads, report, notes, dims if memory is not None else None)
    candidates.extend(c for c in measured if c.max_batch > 1 or c.spinning)
    over = _over_memory(measured, memory, notes) if memory is not None else []
    pool = [c for c in measured if c not in over]
    chosen: list[LoadPlan] = []
    used: set[int] = set()
    for n, (winner, choice) in zip(loads, choose_loads(pool, loads, requests, p99_ms, notes), strict=True):
        final = winner.split or whole
        if id(final) in used:  # another N's plan shares this split: its settings are its own
            final = copy.deepcopy(final)
        used.add(id(final))
        chosen.append(LoadPlan(n, _configure(winner, final, allowed), winner, choice))
    last = loads[-1]
    candidates.sort(key=lambda c: (not c.loads, last not in c.loads, -(c.loads[last].throughput if last in c.loads else 0.0), -c.predicted))
    first = chosen[0]
    return PlanResult(first.plan, first.chosen, candidates, cores, first.choice, notes, None, chosen, p99_ms)


def _mib(size: int | None) -> str:
    return "unmeasured" if size is None else f"{size / 2**20:.1f} MiB"


def _fixed_batch_dim(split_plan: SplitPlan) -> str | None:
    """Why the plan's requests cannot be stacked along dim 0 (an input or output whose dim 0 is not symbolic), or ``None``."""
    spec = split_plan.spec
    fixed = [t for t in (*spec.inputs, *spec.outputs) if not t.shape or isinstance(t.shape[0], int)]
    if not fixed:
        return None
    return f"'{fixed[0].name}' has no symbolic batch dim (dim 0 is {'unknown' if not fixed[0].shape else fixed[0].shape[0]})"


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
    won = min(ratios) > 1.0
    for stage in final.config.stages:
        stage.configure(max_batch=batch if won else 1)
    spread = f"paired ratios {min(ratios):.2f}-{max(ratios):.2f} over {rounds} round(s) of {requests} requests"
    median = statistics.median(ratios)
    if won:
        return f"max_batch {batch} kept: {median:.2f}x without ({spread})"
    return f"max_batch {batch} does not pay here: {median:.2f}x without ({spread}); kept max_batch 1"
