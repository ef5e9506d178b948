"""The choice rules: which measured plan is chosen, and why, from the figures alone (nothing here builds or runs).

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

"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onnxpipe._errors import SplitError
from onnxpipe.planner._candidates import _RANKS, PlanCandidate

__all__ = ["Contest", "LoadChoice", "PlanChoice", "choose_load", "choose_loads", "choose_plan"]

_RANK_NAMES = {"session": "one-session plans", "replicas": "replicas plans", "pipeline": "pipelines", "session, batching": "batching one-session plans",
               "replicas, batching": "batching replicas plans", "pipeline, batching": "batching pipelines"}


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
        among: How many plans of the rival's rank took part.
    """

    rival: str
    holder: str
    ratios: tuple[float, ...]
    won: bool
    among: int = 1

    def reason(self) -> str:
        """Which plan this step of the choice rule kept and why, by req/s (see Note: the choice rule)."""
        measured = f"{statistics.median(self.ratios):.2f}x its req/s, paired ratios {_spread(self.ratios)}"
        faster = sum(r > 1.0 for r in self.ratios)
        if self.won:
            line = f"{self.rival} replaced {self.holder}: {measured}: faster in every round"
        elif faster:
            line = f"{self.holder} kept over {self.rival}: {self.rival} measured {measured}: faster in {faster} of {len(self.ratios)} rounds only"
        else:
            line = f"{self.holder} kept over {self.rival}: {self.rival} measured {measured}: faster in no round"
        return line + self._picked()

    def _picked(self) -> str:
        """Why this rival of its rank, when the rank had several (see :func:`_contender`)."""
        if self.among < 2:
            return ""
        if self.won:
            return f"; of the {self.among} of its kind measured, the highest median ratio of those faster in every round"
        return f"; of the {self.among} of its kind measured, the highest median ratio (none was faster in every round)"




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
        first: Label of the best plan of the simplest kind measured, where the rule started.
        first_kind: Its kind (:attr:`PlanCandidate.kind`).
        first_value: Its req/s, the median over the rounds.
        first_among: How many plans of its kind took part.
        contests: Each richer kind's best against the plan held then, in the rule's order (replicas,
            then pipelines).
    """

    simple: str
    contender: str | None
    ratios: tuple[float, ...]
    rounds: int
    requests: int
    verdict: str
    first: str = ""
    first_kind: str = "session"
    first_value: float = 0.0
    first_among: int = 1
    contests: tuple[Contest, ...] = ()

    def reasons(self) -> list[str]:
        """Why each simpler plan than the chosen one lost, and the chosen one kept its place against
        the next richer kind: one line per step of the choice rule, then the rule itself.

        The first line is where the rule started (the best of the simplest kind by median); each
        :class:`Contest` then says which plan it kept, the paired ratios and whether they were above
        1.00x in every round."""
        if not self.first:
            return []
        names = _RANK_NAMES[self.first_kind]
        which = f"the highest median req/s of the {self.first_among} {names}" if self.first_among > 1 else f"the only {names[:-1]} measured"
        return [f"start: {self.first}, {which} ({self.first_value:.1f} req/s)", *(c.reason() for c in self.contests), RULE]

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


#: The choice rule in one line, as :meth:`PlanChoice.reasons` ends (see Note: the choice rule).
RULE = ("rule: one session, then replicas, then a pipeline: a more complex plan replaces the plan held only if faster in every round "
        "(its lowest paired ratio above 1.00x; of several such, the highest median ratio); the first kind's best is the highest median req/s")


def _spread(ratios: Sequence[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


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
    kinds = [group for kind in ("session", "replicas", "pipeline") if (group := [c for c in measured if c.kind == kind])]
    first = holder = max(kinds[0], key=lambda c: statistics.median(c.rounds))
    contests = []
    for group in kinds[1:]:  # replicas take more cores and memory than one session, a pipeline more still: the same rule
        rival, ratios, won = _contender(holder, group)
        contests.append(Contest(rival.label, holder.label, ratios, won, len(group)))
        holder = rival if won else holder

    def choice(simple: str, contender: str | None, ratios: tuple[float, ...], verdict: str) -> PlanChoice:
        return PlanChoice(simple, contender, ratios, len(first.rounds), requests, verdict, first.label, first.kind,
                          statistics.median(first.rounds), len(kinds[0]), tuple(contests))

    if first.kind == "pipeline":  # none left to compare with (a memory budget dropped them): the fastest pipeline
        return holder, choice("no simple plan (none fits)", first.label, (), "only pipelines")
    if kinds[-1][0].kind != "pipeline":
        return holder, choice(holder.label, None, (), "no pipeline")
    last = contests[-1]
    return holder, choice(last.holder, last.rival, last.ratios, "pipeline" if last.won else ("tie" if max(last.ratios) > 1.0 else "simple"))


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
    pool, dropped = _within_p99([c for c in candidates if concurrency in c.loads], concurrency, p99_ms)
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
        contests.append(Contest(rival.label, holder.label, ratios, won, len(group)))
        holder = rival if won else holder
    choice = LoadChoice(concurrency, holder.label, "p99" if latency else "req/s", first.label, first.rank, statistics.median(values(first)),
                        tuple(contests), tuple((c.label, c.loads[concurrency].p99_ms) for c in dropped), p99_ms,
                        len(values(first)), requests)
    return holder, choice


def _within_p99(every: list[PlanCandidate], concurrency: int, p99_ms: float | None) -> tuple[list[PlanCandidate], list[PlanCandidate]]:
    """The finalists measured at N whose p99 (median over the rounds) is within ``p99_ms``, and those over it.

    Raises:
        SplitError: none is within it; lists every finalist's p99 at this N.
    """
    if p99_ms is None:
        return list(every), []
    dropped = [c for c in every if c.loads[concurrency].p99_ms > p99_ms]
    pool = [c for c in every if c not in dropped]
    if not pool:
        measured = ", ".join(f"{c.label} {c.loads[concurrency].p99_ms:.2f} ms" for c in every)
        raise SplitError(f"no plan meets --p99 {p99_ms:g} ms at N={concurrency}: measured p99 (median of the rounds) {measured}")
    return pool, dropped


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


def _mib(size: int | None) -> str:
    return "unmeasured" if size is None else f"{size / 2**20:.1f} MiB"


def _batching_verdict(ratios: Sequence[float], batch: int, rounds: int, requests: int) -> tuple[bool, str]:
    """Whether batching up to ``batch`` won every round (its paired req/s over the plain plan's, ``ratios``: see
    ``_measure``'s Note: batching), and what to report."""
    won = min(ratios) > 1.0
    spread = f"paired ratios {min(ratios):.2f}-{max(ratios):.2f} over {rounds} round(s) of {requests} requests"
    median = statistics.median(ratios)
    if won:
        return won, f"max_batch {batch} kept: {median:.2f}x without ({spread})"
    return won, f"max_batch {batch} does not pay here: {median:.2f}x without ({spread}); kept max_batch 1"
