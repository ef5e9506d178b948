"""``split --auto`` and ``inspect --profile``: options to a split policy, the planner, the cost profile.

``split --auto --stages N`` / ``--max-stages K`` call ``split(model, policy=make_policy(...))``;
``split --auto --cores C`` calls ``plan_pipeline``; ``inspect --profile`` calls ``profile_model`` and
``split`` with a :class:`~onnxpipe.splitter.MeasuredPolicy` reusing that profile for each number of
stages. Heavy modules are imported inside the functions: ``onnxpipe --help`` loads this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from onnxpipe._errors import SplitError
from onnxpipe.cli._common import UserError, quiet_onnxruntime
from onnxpipe.cli._progress import step_progress, working

__all__ = ["POLICY_NAMES", "planned_split", "policy_split", "profile_report"]

#: The names of ``onnxpipe.splitter.POLICIES``, spelled out so that ``--help`` needs no onnx (a test keeps them equal).
POLICY_NAMES = ("measured", "uniform", "params")

#: Policy field -> the option that sets it, for the options a policy may not take.
_POLICY_FLAGS = {"settings": "--threads", "max_stage_weights": "--max-stage-weights", "pinned": "--pin", "dims": "--dim"}


def policy_split(
    model: Path,
    out: Path,
    *,
    policy: str,
    count: Mapping[str, int],
    threads: int,
    max_stage_weights: int | None,
    pins: Mapping[str, int],
    dims: Mapping[str, int],
    asked: Sequence[str],
    overwrite: bool,
    states: str | Sequence[tuple[str, str]] | None = None,
) -> None:
    """Split ``model`` with the named policy and write the stages to ``out``.

    Args:
        count: ``{"stages": N}`` or ``{"max_stages": K}``.
        asked: The options the user set (as flags), to refuse those the policy does not take.
        states: State pairs to keep in one stage each (``split``'s ``states``).

    Raises:
        click.UsageError: an option the policy does not take.
    """
    from onnxpipe.cli import _render
    from onnxpipe.runtime import StageSettings
    from onnxpipe.splitter import POLICIES, make_policy, split

    takes = {f.name for f in dataclasses.fields(POLICIES[policy])}
    refused = [flag for field, flag in _POLICY_FLAGS.items() if flag in asked and field not in takes]
    if refused:
        users = {flag: [name for name, cls in POLICIES.items() if _field(cls, flag)] for flag in refused}
        hint = "; ".join(f"{flag} is for policy {' or '.join(names) or 'none'}" for flag, names in users.items())
        raise click.UsageError(f"policy '{policy}' does not take {', '.join(refused)} ({hint})")
    wanted: dict[str, object] = {"settings": StageSettings(intra_op_threads=threads), "max_stage_weights": max_stage_weights, "pinned": pins, "dims": dims,
                                 "remeasure": True}  # the CLI checks sub-millisecond cuts against their neighbours (_remeasure)
    options = {name: value for name, value in wanted.items() if name in takes and value not in (None, {})}
    _check_paths(model, out, overwrite)
    quiet_onnxruntime()
    with working(f"splitting {model.name} with policy '{policy}'" + (" (profiling node costs unless cached)" if "settings" in takes else "")):
        plan = split(model, policy=make_policy(policy, **count, **options), states=states)
    folder = plan.save(out, overwrite=overwrite)
    _render.split_plan(plan, folder, threads if "settings" in takes else None)


def _field(cls: type, flag: str) -> bool:
    return any(_POLICY_FLAGS.get(f.name) == flag for f in dataclasses.fields(cls))


def planned_split(model: Path, out: Path, *, cores: int, rounds: int, requests: int, measure: int, dims: Mapping[str, int], overwrite: bool,
                  batch: int = 1, targets: Sequence[str] = ("cpu",), memory: int | None = None, concurrency: Sequence[int] | None = None,
                  p99: float | None = None) -> None:
    """Plan ``model`` for ``cores`` cores, measure the finalists in interleaved rounds, write the chosen one with its settings
    (with ``concurrency``, the one chosen for each N: ``out`` for one N, ``out/concurrency-N/`` for several)."""
    from onnxpipe.cli import _render
    from onnxpipe.planner import plan_pipeline
    from onnxpipe.splitter import load_model

    _check_paths(model, out, overwrite)
    load_model(model)  # plan_pipeline meets a file that is no ONNX model with a bare protobuf DecodeError
    quiet_onnxruntime()
    with step_progress() as report:
        result = plan_pipeline(model, cores, measure=measure, rounds=rounds, requests=requests, dims=dims, progress=report, batch=batch, targets=targets,
                               memory=memory, concurrency=concurrency, p99_ms=p99)
    folder = result.save(out, overwrite=overwrite)
    if result.loads:
        _render.load_plans(result, folder)
    else:
        _render.plan_result(result, folder)


def _check_paths(model: Path, out: Path, overwrite: bool) -> None:
    """Refuse a missing model (plan_pipeline meets one with a bare FileNotFoundError) and an output
    folder ``SplitPlan.save`` would refuse, before minutes of profiling rather than after."""
    if not model.is_file():
        raise UserError(f"model file '{model}' does not exist")
    if out.exists() and not out.is_dir():
        raise UserError(f"output folder '{out}' is a file; choose another name")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output folder '{out}' exists and is not empty; choose another or pass --overwrite")


def profile_report(model: Path, threads: int, max_stages: int, dims: Mapping[str, int], quiet: bool = False) -> dict[str, Any]:
    """Every node's cost (costliest first) and, for 2..``max_stages`` stages, the best cut's predicted times.

    A spinner shows on a terminal while profiling, unless ``quiet`` (--json).

    Returns:
        A JSON-ready dict: ``source``, ``threads``, ``runs``, ``total_ms``, ``nodes`` (index, node, op,
        ms, share), ``unmatched``, ``splits`` (stages, stage_ms, bottleneck_ms, bottleneck_stage,
        crossing_bytes, speedup_bound, nodes; or stages and error), ``notes``.
    """
    from onnxpipe.runtime import StageSettings
    from onnxpipe.splitter import MeasuredPolicy, load_model, profile_model, split
    from onnxpipe.splitter._graph import node_label

    quiet_onnxruntime()
    proto, _ = load_model(model)
    with working(f"profiling {model.name} with {threads} thread(s)", quiet):
        profile = profile_model(model, StageSettings(intra_op_threads=threads), dims=dims)
    total = profile.total_seconds
    nodes = [
        {"index": i, "node": node_label(proto.graph.node[i], i), "op": proto.graph.node[i].op_type, "ms": 1e3 * s, "share": s / total if total else 0.0}
        for i, s in sorted(profile.node_seconds.items(), key=lambda item: (-item[1], item[0]))
    ]
    splits: list[dict[str, Any]] = []
    notes: list[str] = []
    for k in range(2, max_stages + 1):
        try:
            plan = split(model, policy=MeasuredPolicy(stages=k, profile=profile, dims=dims))
        except SplitError as e:
            splits.append({"stages": k, "error": str(e)})
            continue
        assert plan.auto is not None and plan.auto.predicted_seconds is not None
        seconds = plan.auto.predicted_seconds
        slow = max(range(k), key=seconds.__getitem__)
        splits.append(
            {
                "stages": k,
                "stage_ms": [1e3 * s for s in seconds],
                "bottleneck_ms": 1e3 * seconds[slow],
                "bottleneck_stage": plan.stages[slow].name,
                "crossing_bytes": plan.auto.crossing_bytes,
                "speedup_bound": total / seconds[slow] if seconds[slow] else None,
                "nodes": [s.nodes for s in plan.stages],
            }
        )
        notes.extend(n for n in plan.auto.notes if n not in notes)
    if profile.unmatched:
        notes.append(f"{len(profile.unmatched)} profiled kernel(s) matched no node by name and were charged to the node run before them")
    return {
        "source": profile.source,
        "threads": threads,
        "runs": profile.runs,
        "total_ms": 1e3 * total,
        "nodes": nodes,
        "unmatched": profile.unmatched,
        "splits": splits,
        "notes": notes,
    }
