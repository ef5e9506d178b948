"""Planning over several targets: each checked, each stage measured on each, every assignment predicted.

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

"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from onnxpipe._errors import ConfigError, SplitError
from onnxpipe.builder import build, export
from onnxpipe.planner._candidates import PlanCandidate, _pipelines
from onnxpipe.planner._measure import Progress
from onnxpipe.runtime import load
from onnxpipe.splitter import CostProfile, SplitPlan

__all__: list[str] = []

#: Providers that run in host memory: moving a tensor between them is a hand-off like any other.
_HOST_PROVIDERS = frozenset({"CPUExecutionProvider", "OpenVINOExecutionProvider", "DnnlExecutionProvider", "XnnpackExecutionProvider"})


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


