"""Cuts re-measured together where one profile cannot tell them apart (the measured policy's Note: small stages).

Note: small stages.
    The measured policy cuts by one profile's per-node costs. Where the stages take well under a
    millisecond, that profile's noise is as large as the differences between neighbouring cuts, and
    the cut it predicts best may measure worse than its neighbours (PP-OCR's classifier: 1.08x the
    best single cut's slowest stage, in one quiet run). So below :data:`REMEASURE_BELOW` the cut is
    checked the way the planner checks plans: the predicted cut and its neighbours (each cut moved
    by one and two compute nodes either way, one cut at a time) are split, their stages timed alone
    on the same random inputs, all of them in the same interleaved rounds, and the one whose
    slowest stage has the lowest median wins; the predicted cut stays unless a neighbour is faster
    in every round. Moving the last compute node of a stage (in topological order) to the next
    stage, or the next stage's first to this one, keeps every node after the nodes it reads.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import ModelProto

from onnxpipe._errors import SplitError
from onnxpipe.runtime import Endpoint, SequentialPipeline, StageSettings, interleaved_rounds, random_inputs
from onnxpipe.splitter._cost import median_run_seconds
from onnxpipe.splitter._graph import GraphIndex
from onnxpipe.splitter._sizes import sample_dims
from onnxpipe.splitter._values import graph_values

__all__ = ["REMEASURE_BELOW", "remeasure", "stage_seconds"]

#: A predicted slowest stage below this many seconds gets its cut re-measured (see Note: small stages).
REMEASURE_BELOW = 1e-3
_MOVES = (-2, -1, 1, 2)
_ROUNDS = 3


def _moved(assignment: dict[int, int], order: list[int], boundary: int, delta: int) -> dict[int, int] | None:
    """``assignment`` with the cut after stage ``boundary`` moved ``delta`` compute nodes (negative:
    earlier), or ``None`` when a stage would be left empty."""
    moved = dict(assignment)
    for _ in range(abs(delta)):
        members = [i for i in order if moved[i] == boundary] if delta < 0 else [i for i in order if moved[i] == boundary + 1]
        if len(members) <= 1:
            return None
        node = members[-1] if delta < 0 else members[0]
        moved[node] = boundary + 1 if delta < 0 else boundary
    return moved


def stage_seconds(plan: Any, feeds: Mapping[str, np.ndarray], settings: StageSettings, work: Path, runs: int = 20, min_seconds: float = 0.05) -> list[float]:
    """Each stage's median seconds per run (of a ``SplitPlan``), alone, on what the stages before it
    make from ``feeds``: at least ``runs`` runs, more until ``min_seconds`` of them (500 at most)."""
    folder = plan.save(work / f"c{time.monotonic_ns()}")
    spec = plan.spec
    values = SequentialPipeline(spec, folder).run_all(feeds)
    options = settings.replace(affinity=None).session_options()
    options.log_severity_level = 4
    times = []
    for stage in spec.stages:
        assert stage.module is not None  # a split has ONNX stages only
        session = ort.InferenceSession(str(folder / stage.module), sess_options=options, providers=settings.providers())
        stage_feeds = {t.name: values[spec.source_of(Endpoint(stage.name, t.name))] for t in stage.inputs}
        session.run(None, stage_feeds)  # warm-up
        times.append(median_run_seconds(functools.partial(session.run, None, stage_feeds), runs, min_seconds, 500)[0])
    shutil.rmtree(folder, ignore_errors=True)
    return times


def _slowest(plan: Any, feeds: Mapping[str, np.ndarray], settings: StageSettings, work: Path) -> float:
    return max(stage_seconds(plan, feeds, settings, work))


def remeasure(assignment: dict[int, int], index: GraphIndex, model: str | ModelProto, settings: StageSettings,
              dims: Mapping[str, int], split: Callable[..., Any], allowed: Callable[[dict[int, int]], bool] | None = None) -> tuple[dict[int, int], str]:
    """The best of the predicted cut and its neighbours, measured together (see Note: small stages).

    Args:
        split: ``onnxpipe.splitter.split`` (passed in: it calls this).
        allowed: Which moved assignments may be kept (the policy's refused cuts: ``_batchcuts``); default all.

    Returns:
        The assignment kept (or moved to), and a note saying what was measured.
    """
    from onnxpipe.builder import tensor_spec
    from onnxpipe.splitter._extract import infer_types

    order = [i for i in index.compute_nodes() if i in assignment]
    stages = max(assignment.values()) + 1
    names = {i: index.nodes[i].name or index.nodes[i].output[0] for i in order}
    candidates: dict[str, dict[int, int]] = {"predicted": assignment}
    for boundary in range(stages - 1):
        for delta in _MOVES:
            moved = _moved(assignment, order, boundary, delta)
            if moved is not None and (allowed is None or allowed(moved)):
                candidates[f"cut {boundary + 1} moved {delta:+d}"] = moved
    types, _ = infer_types(index.model)
    feeds, _ = random_inputs([tensor_spec(types[n]) for n in index.inputs], sample_dims(index.model, dims, types), values=graph_values(index.model))
    plans = {}
    for label, candidate in candidates.items():
        try:
            plans[label] = split(model, assignment={names[i]: s for i, s in candidate.items()}, check=False, dims=dict(dims) or None)
        except SplitError:  # a neighbour the splitter refuses (a cut inside a subgraph's reach, a state pair): not a candidate
            continue
    if len(plans) < 2:
        return assignment, "its stages are under 1 ms, but no neighbouring cut could be split to compare with"
    with tempfile.TemporaryDirectory(prefix="onnxpipe-remeasure-") as tmp:
        work = Path(tmp)
        rounds = interleaved_rounds({label: functools.partial(_slowest, plan, feeds, settings, work) for label, plan in plans.items()}, _ROUNDS)
    base = rounds.values["predicted"]
    winners = [label for label in plans if label != "predicted" and all(v < b for v, b in zip(rounds.values[label], base, strict=True))]
    shown = f"{len(plans)} cuts near the predicted one timed together ({_ROUNDS} interleaved rounds, stages under 1 ms)"
    if not winners:
        return assignment, f"{shown}: kept the predicted cut (slowest stage {1e3 * rounds.median('predicted'):.3f} ms; no neighbour faster in every round)"
    best = min(winners, key=rounds.median)
    return candidates[best], (f"{shown}: {best}, slowest stage {1e3 * rounds.median(best):.3f} ms against the predicted cut's "
                              f"{1e3 * rounds.median('predicted'):.3f} ms, faster in every round")
