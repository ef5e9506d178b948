"""The planner: the whole deployment plan for a core budget, pipelines and the alternatives alike.

``plan_pipeline(model, cores=C)`` considers, for the ``C`` cores it may use:

- one session with 1..C intra-op threads;
- R replicas of the whole model x t threads (R * t <= C);
- pipelines of k = 2..min(C, max_stages) stages (cut by :class:`MeasuredPolicy`), each stage given
  t threads or r replicas, the cores adding up to at most C.

It predicts each plan's throughput from measured per-node costs at each thread count
(``min over stages of replicas / stage time``), then builds, loads and **measures the most
promising plans for real**, and returns the best *measured* one, a one-stage plan when one session
or replicas win: honesty over pipelines. Cores are assigned in order (stage 0 first), so the
chosen plan also fixes every stage's affinity.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxpipe._errors import SplitError
from onnxpipe.builder import build, export, io_specs
from onnxpipe.runtime import StageSettings, load, random_inputs
from onnxpipe.splitter._auto import MeasuredPolicy
from onnxpipe.splitter._cost import CostProfile, profile_model
from onnxpipe.splitter._plan import SplitPlan, load_model, split

__all__ = ["PlanCandidate", "PlanResult", "plan_pipeline"]

Progress = Callable[[str, int, int], None]


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
        measured: Measured requests per second, when it was measured.
        stage_measured_ms: Measured mean time of each stage inside the pipeline, when measured.
    """

    label: str
    kind: str
    threads: tuple[int, ...]
    replicas: tuple[int, ...]
    predicted: float
    stage_predicted_ms: tuple[float, ...]
    measured: float | None = None
    stage_measured_ms: tuple[float, ...] = ()
    split: SplitPlan | None = field(default=None, repr=False)

    @property
    def cores(self) -> int:
        """Cores the plan occupies."""
        return sum(t * r for t, r in zip(self.threads, self.replicas, strict=True))


@dataclass
class PlanResult:
    """The chosen plan and everything considered.

    Attributes:
        plan: The split of the chosen plan, its stages' settings (threads, replicas, affinity) set;
            one stage when a single session or replicas won.
        chosen: The chosen candidate.
        candidates: Every candidate, best measured first, then by prediction.
        cores: The core budget.
        notes: What the user should know.
    """

    plan: SplitPlan
    chosen: PlanCandidate
    candidates: list[PlanCandidate]
    cores: int
    notes: list[str] = field(default_factory=list)

    def baselines(self) -> dict[str, float]:
        """Measured throughput of the best one-session plan and the best replicas plan."""
        best: dict[str, float] = {}
        for c in self.candidates:
            if c.kind != "pipeline" and c.measured is not None:
                best[c.kind] = max(best.get(c.kind, 0.0), c.measured)
        return best

    def __str__(self) -> str:
        lines = [f"plan for {self.cores} core(s): {self.chosen.label}, {self.chosen.measured or 0:.1f} req/s measured"]
        for kind, value in self.baselines().items():
            if value:
                lines.append(f"  vs best {kind}: {value:.1f} req/s ({(self.chosen.measured or 0) / value:.2f}x)")
        for c in self.candidates:
            measured = f"{c.measured:8.1f}" if c.measured is not None else "       -"
            lines.append(f"  {c.label:<32} predicted {c.predicted:8.1f}  measured {measured} req/s")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


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
            if any(t not in profiles for t in threads) or (any(widen) and all(a == 1 for a in alloc)):
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
    """Give each stage its threads, replicas and a slice of the cores, in order."""
    start = 0
    for stage, t, r in zip(split_plan.config.stages, candidate.threads, candidate.replicas, strict=True):
        cores = allowed[start : start + t * r] if len(allowed) >= candidate.cores else []
        stage.configure(**_settings(t, r, cores))
        start += t * r
    return split_plan


def _measure(split_plan: SplitPlan, feeds: dict[str, np.ndarray], requests: int, work: Path) -> tuple[float, tuple[float, ...]]:
    folder = work / f"m{time.monotonic_ns()}"
    bundle = export(build(split_plan.config, folder / "built").path, folder / "bundle")
    with load(bundle) as pipe:
        for _ in pipe.map(feeds for _ in range(max(5, requests // 10))):
            pass
        pipe.reset_stats()
        start = time.perf_counter()
        for _ in pipe.map(feeds for _ in range(requests)):
            pass
        throughput = requests / (time.perf_counter() - start)
        stages = tuple(s.mean_ms for s in pipe.stats().stages)
    return throughput, stages


def plan_pipeline(
    model: str | os.PathLike[str],
    cores: int | None = None,
    *,
    max_stages: int | None = None,
    measure: int = 3,
    requests: int = 50,
    dims: dict[str, int] | None = None,
    runs: int = 3,
    progress: Progress | None = None,
) -> PlanResult:
    """Plan how to run ``model`` on ``cores`` cores and measure the best candidates.

    Args:
        model: The model file.
        cores: Core budget (default: the cores this process may use).
        max_stages: Most pipeline stages to consider (default: ``cores``).
        measure: How many of the best-predicted pipelines to measure; the best predicted one-session
            and replicas plans are always measured too.
        requests: Requests per measurement.
        dims: Sizes of symbolic input dims.
        runs: Profiled runs per thread count.
        progress: Called with (step, done, total).

    Returns:
        The :class:`PlanResult`; ``result.plan.save(folder)`` writes the chosen stages with their settings.

    Raises:
        SplitError: the core budget is below 1 or above what this process may use.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = cores or len(allowed)
    if not 1 <= cores <= len(allowed):
        raise SplitError(f"core budget {cores} is outside 1..{len(allowed)} (the cores this process may use: {allowed})")
    report = progress or (lambda step, done, total: None)
    profiles = {}
    for t in range(1, cores + 1):
        report("profiling", t - 1, cores)
        profiles[t] = profile_model(model, StageSettings(intra_op_threads=t), runs=runs, dims=dims)
    report("profiling", cores, cores)
    candidates = _baselines(profiles, cores)
    notes = []
    for k in range(2, min(cores, max_stages or cores) + 1):
        try:
            plan_k = split(model, policy=MeasuredPolicy(stages=k, profile=profiles[1], dims=dims or {}))
        except SplitError as e:
            notes.append(f"no {k}-stage pipeline: {e}")
            continue
        candidates.extend(_pipelines(plan_k, profiles, cores))
    proto, _ = load_model(model)
    whole = split(model, assignment={n.name or n.output[0]: 0 for n in proto.graph.node})
    feeds, input_notes = random_inputs(io_specs(proto)[0], dims)
    notes.extend(f"measured with {n}" for n in input_notes)
    ranked = sorted(candidates, key=lambda c: -c.predicted)
    chosen_for_measure = [c for c in ranked if c.kind == "pipeline"][:measure]
    for kind in ("session", "replicas"):
        best = next((c for c in ranked if c.kind == kind), None)
        if best is not None:
            chosen_for_measure.append(best)
    with tempfile.TemporaryDirectory(prefix="onnxpipe-plan-") as tmp:
        for done, c in enumerate(chosen_for_measure):
            report("measuring", done, len(chosen_for_measure))
            target = c.split if c.kind == "pipeline" else whole
            assert target is not None
            c.measured, c.stage_measured_ms = _measure(_configure(c, target, allowed), feeds, requests, Path(tmp))
        report("measuring", len(chosen_for_measure), len(chosen_for_measure))
    measured = [c for c in candidates if c.measured is not None]
    chosen = max(measured, key=lambda c: c.measured or 0.0)
    final = chosen.split if chosen.kind == "pipeline" else whole
    assert final is not None
    _configure(chosen, final, allowed)
    candidates.sort(key=lambda c: (c.measured is None, -(c.measured or 0.0), -c.predicted))
    if chosen.kind != "pipeline":
        notes.append(f"a pipeline did not beat {chosen.label} here; the plan is that, as one stage")
    return PlanResult(final, chosen, candidates, cores, notes)
