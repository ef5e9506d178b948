"""The planner's entry, the whole deployment plan for a core budget, pipelines and the alternatives alike.

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

The steps live in their modules: ``_checks`` (the arguments), ``_candidates`` (what is considered
and predicted), ``_targets`` (several targets), ``_measure`` (building, loading and measuring the
finalists), ``_rules`` (the pure choice rules) and ``_report`` (the result).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from onnxpipe._errors import SplitError
from onnxpipe.builder import io_specs
from onnxpipe.planner._candidates import PlanCandidate, _baselines, _finalists, _load_variants, _pipelines, _served_finalists
from onnxpipe.planner._checks import _check_budget, _check_loads, _check_memory, planning_dims
from onnxpipe.planner._measure import Progress, _configure, _measure, _measure_loads, _try_batching
from onnxpipe.planner._report import LoadPlan, PlanResult
from onnxpipe.planner._rules import _over_memory, choose_loads, choose_plan
from onnxpipe.planner._targets import _check_targets, _target_candidates
from onnxpipe.runtime import StageSettings, random_inputs
from onnxpipe.splitter import CostProfile, MeasuredPolicy, SplitPlan, load_model, profile_model, split
from onnxpipe.splitter._extract import infer_types
from onnxpipe.splitter._sizes import sample_dims
from onnxpipe.splitter._values import graph_values

__all__ = ["plan_pipeline"]


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
    allowed, cores = _check_budget(cores, rounds, requests)
    loads = _check_loads(concurrency, p99_ms)
    planned_targets = _check_targets(targets)
    _check_memory(memory)
    proto, _ = load_model(model)
    dims = sample_dims(proto, dims, infer_types(proto)[0])  # sizes the graph fixes are no dims to ask for (Note: dims the graph fixes, splitter/_sizes.py)
    specs = io_specs(proto)[0]
    notes = planning_dims(specs, dims, Path(model).name)
    # every dim is given or batch-like (noted); refuses unknown dim names now, not after profiling
    feeds, _ = random_inputs(specs, dims, values=graph_values(proto))
    report = progress or (lambda step, done, total: None)
    profiles = _profiles(model, cores, runs, dims, report)
    candidates, plans = _cpu_candidates(model, profiles, cores, max_stages or cores, dims, notes)
    whole = split(model, assignment={n.name or n.output[0]: 0 for n in proto.graph.node}, dims=dims)
    if planned_targets != ("cpu",):
        candidates = _target_candidates(whole, plans, profiles[1], planned_targets, cores, feeds, requests, report)
        notes.append(f"targets {', '.join(planned_targets)} share this host's cores: a stage's threads count against the {cores}-core budget "
                     "whatever its provider (OpenVINO's run on its own threads, sized by the stage's); cuts come from the CPU profile, "
                     "each stage measured on each target")
    ranked = sorted(candidates, key=lambda c: -c.predicted)
    finalists = _finalists(ranked, measure, memory is not None)
    if loads:
        served = _served_finalists(finalists, ranked, cores)
        return _plan_loads(served, candidates, whole, allowed, feeds, rounds, requests, loads, p99_ms, report, notes, cores, batch, memory, dims)
    return _plan_stream(finalists, candidates, whole, allowed, feeds, rounds, requests, report, notes, cores, batch, memory, dims)


def _profiles(model: str | os.PathLike[str], cores: int, runs: int, dims: Mapping[str, int], report: Progress) -> dict[int, CostProfile]:
    """The model's per-node costs at each thread count from 1 to ``cores``."""
    profiles = {}
    for t in range(1, cores + 1):
        report("profiling", t - 1, cores)
        profiles[t] = profile_model(model, StageSettings(intra_op_threads=t), runs=runs, dims=dims)
    report("profiling", cores, cores)
    return profiles


def _cpu_candidates(model: str | os.PathLike[str], profiles: dict[int, CostProfile], cores: int, max_stages: int, dims: Mapping[str, int],
                    notes: list[str]) -> tuple[list[PlanCandidate], list[SplitPlan]]:
    """Every one-session, replicas and pipeline plan on the CPU, predicted, and the pipelines' cuts (of 2 to ``max_stages``
    stages; a depth the measured policy cannot cut is noted)."""
    candidates = _baselines(profiles, cores)
    plans = []
    for k in range(2, min(cores, max_stages) + 1):
        try:
            plan_k = split(model, policy=MeasuredPolicy(stages=k, profile=profiles[1], dims=dims))
        except SplitError as e:
            notes.append(f"no {k}-stage pipeline: {e}")
            continue
        plans.append(plan_k)
        candidates.extend(_pipelines(plan_k, profiles, cores))
    return candidates, plans


def _plan_stream(finalists: list[PlanCandidate], candidates: list[PlanCandidate], whole: SplitPlan, allowed: list[int], feeds: dict[str, np.ndarray],
                 rounds: int, requests: int, report: Progress, notes: list[str], cores: int, batch: int, memory: int | None,
                 dims: Mapping[str, int]) -> PlanResult:
    """``plan_pipeline`` without ``concurrency``: the finalists measured streaming requests, the plan chosen by throughput, and with
    ``batch`` its batching measured (see Note: the choice rule, Note: memory, Note: batching)."""
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


def _plan_loads(finalists: list[PlanCandidate], candidates: list[PlanCandidate], whole: SplitPlan, allowed: list[int], feeds: dict[str, np.ndarray],
                rounds: int, requests: int, loads: Sequence[int], p99_ms: float | None, report: Progress, notes: list[str], cores: int,
                batch: int, memory: int | None, dims: Mapping[str, int]) -> PlanResult:
    """``plan_pipeline`` with ``concurrency``: the finalists and their batching variants measured under each N, a plan chosen for each
    (see Note: the served workload)."""
    variants = _load_variants(finalists, whole, loads, batch, notes)
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


