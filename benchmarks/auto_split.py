"""How good is the automatic splitter? Three quality bars, measured side by side in one run on the
onnx light models:

1. **prediction**: each stage's predicted time (from the measured cost model) against its measured
   standalone time, for auto splits into 2 and 3 stages (goal: within 15 %);
2. **optimality**: the auto 2-stage split's measured bottleneck against the best single cut found by
   trying cut positions exhaustively and measuring both stages of each (goal: <= 1.05x);
   ``--stride S`` tries every S-th position only (then the best one's neighbours), for speed. The
   three best cuts and the auto cut are then measured again together in interleaved rounds
   (``onnxpipe.runtime.interleaved_rounds``, as the planner measures its finalists), with five
   times the runs: the minimum of many noisy measurements is biased low;
3. **planner**: the planner's measured throughput against the best measured baseline (one session,
   replicas) on this machine's cores (goal: >= 1.0x everywhere, >= 1.5x one session x 2 threads on
   shufflenet).

Stage times are medians of at least ``--runs`` runs (more for fast stages, until 0.2 s) of the
stage alone, 1 thread, fed its real inputs.

    python -m benchmarks.auto_split [--models squeezenet resnet50 ...] [--stride 1] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from onnxpipe.planner import plan_pipeline
from onnxpipe.runtime import StageSettings, interleaved_rounds
from onnxpipe.splitter import MeasuredPolicy, SplitPlan, profile_model, split
from onnxpipe.splitter._graph import GraphIndex
from onnxpipe.splitter._remeasure import stage_seconds

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
MODELS = ["bvlc_alexnet", "zfnet512", "vgg19", "squeezenet", "inception_v1", "resnet50", "shufflenet", "inception_v2", "densenet121"]
ort.set_default_logger_severity(3)


def _stage_times(plan: SplitPlan, feeds: dict[str, np.ndarray], runs: int, work: Path) -> list[float]:
    """Seconds per run of each stage alone (1 thread), fed the values the previous stages make."""
    return stage_seconds(plan, feeds, StageSettings(intra_op_threads=1), work, runs=runs, min_seconds=0.2)  # fast stages: more runs


def _cut_at(path: Path, order: list[int], index: GraphIndex, p: int) -> SplitPlan:
    """Two stages: positions 0..p of ``order`` and the rest."""
    names = {i: index.nodes[i].name or index.nodes[i].output[0] for i in order}
    return split(path, assignment={names[i]: (0 if k <= p else 1) for k, i in enumerate(order)}, check=False)


def bench_model(name: str, stride: int, runs: int, work: Path) -> dict[str, Any]:
    path = Path(shutil.copy(LIGHT / f"light_{name}.onnx", work / f"{name}.onnx"))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inp = session.get_inputs()[0]
    feeds = {inp.name: np.random.default_rng(0).standard_normal(inp.shape).astype(np.float32)}
    profile = profile_model(path, runs=5)
    row: dict[str, Any] = {"model": name}
    for k in (2, 3):
        plan = split(path, policy=MeasuredPolicy(stages=k, profile=profile))
        measured = _stage_times(plan, feeds, runs, work)
        predicted = [s.predicted_seconds or 0.0 for s in plan.stages]
        row[f"k{k}_predicted_ms"] = [round(p * 1e3, 3) for p in predicted]
        row[f"k{k}_measured_ms"] = [round(m * 1e3, 3) for m in measured]
        row[f"k{k}_max_error"] = max(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))
        if k == 2:
            auto_plan = plan
    index = GraphIndex(onnx.load(path))
    order = index.compute_nodes()
    tried: dict[int, float] = {}

    def bottleneck(p: int) -> float:
        if p not in tried:
            tried[p] = max(_stage_times(_cut_at(path, order, index, p), feeds, runs, work))
        return tried[p]

    for p in range(0, len(order) - 1, stride):
        bottleneck(p)
    best_p = min(tried, key=tried.__getitem__)
    for p in range(max(0, best_p - stride + 1), min(len(order) - 1, best_p + stride)):
        bottleneck(p)  # the neighbours a coarse stride skipped
    # The minimum of many noisy measurements is biased low (the winner's curse): re-measure the
    # three best cuts and the auto cut together, interleaved, with 5x the runs, and compare those.
    finalists = {f"cut {p}": _cut_at(path, order, index, p) for p in sorted(tried, key=tried.__getitem__)[:3]}
    finalists["auto"] = auto_plan

    def worst_stage(plan: SplitPlan) -> float:
        return max(_stage_times(plan, feeds, runs * 5, work))

    again = interleaved_rounds({k: functools.partial(worst_stage, plan) for k, plan in finalists.items()}, 3)
    confirmed = {k: again.median(k) for k in finalists}
    best = min(v for k, v in confirmed.items() if k != "auto")
    row["exhaustive_positions"] = len(tried)
    row["exhaustive_of"] = len(order) - 1
    row["best_cut_bottleneck_ms"] = best * 1e3
    row["auto_bottleneck_ms"] = confirmed["auto"] * 1e3
    row["auto_vs_best"] = confirmed["auto"] / best
    result = plan_pipeline(path, rounds=5, requests=40, runs=3)
    baselines = result.baselines()
    row["planner"] = result.chosen.label
    row["planner_certainty"] = str(result.choice)
    row["planner_req_s"] = result.chosen.measured
    row["planner_vs_best_baseline"] = (result.chosen.measured or 0) / max(baselines.values())
    one_2t = next((c.measured for c in result.candidates if c.label == "1 session x 2t"), None)
    row["planner_vs_one_session_2t"] = (result.chosen.measured or 0) / one_2t if one_2t else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--stride", type=int, default=1, help="try every S-th cut position exhaustively (then the best one's neighbours)")
    parser.add_argument("--runs", type=int, default=5, help="runs per stage timing (median)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    header = (
        f"{'model':<13} {'pred err k=2':>12} {'k=3':>6} {'auto/best cut':>13} {'positions':>10} {'planner':>24} {'vs best base':>12} {'vs 1x2t':>8}"
    )
    rows = []
    if not args.json:
        print(f"cores: {len(os.sched_getaffinity(0))}; onnxruntime {ort.__version__}; stage times: median of {args.runs} runs, 1 thread")
        print(header, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.models:
            r = bench_model(m, args.stride, args.runs, Path(tmp))
            rows.append(r)
            if not args.json:
                vs2 = f"{r['planner_vs_one_session_2t']:.2f}" if r["planner_vs_one_session_2t"] else "-"
                print(
                    f"{r['model']:<13} {r['k2_max_error']:>11.1%} {r['k3_max_error']:>6.1%} {r['auto_vs_best']:>13.3f} "
                    f"{r['exhaustive_positions']:>4}/{r['exhaustive_of']:<5} {r['planner']:>24} {r['planner_vs_best_baseline']:>12.2f} {vs2:>8}",
                    flush=True,
                )
                print(f"{'':<13} planner: {r['planner_certainty']}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("goals: prediction error <= 15%; auto 2-stage bottleneck <= 1.05x the best measured cut; planner >= 1.0x the best baseline")


if __name__ == "__main__":
    main()
