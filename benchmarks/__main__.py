"""The benchmark suite: every way to run a model on this machine's cores, side by side in one run.

For each model: one session at 1..C threads, C replicas x 1 thread, a hand split (2 stages at the
cut candidate nearest the middle, from ``inspect``), an automatic split (C stages by measured costs,
one core each) and the planner's choice, each streaming the same requests. Prints the table with
ratios to one session x 1 thread, and writes ``results.json``, ``results.md`` and ``results.png``
into ``--out``.

    python -m benchmarks [--models squeezenet shufflenet resnet50] [--requests 100] [--out bench-out]
    make bench
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks.pipeline_efficiency import LIGHT, _bundle, _session, _stream, _throughput
from onnxpipe.builder import PipelineConfig
from onnxpipe.planner import plan_pipeline
from onnxpipe.runtime import load
from onnxpipe.splitter import MeasuredPolicy, SplitPlan, inspect_model, split

ort.set_default_logger_severity(3)


def _pinned(plan: SplitPlan, cores: list[int]) -> SplitPlan:
    for k, stage in enumerate(plan.config.stages):
        stage.configure(intra_op_threads=1, affinity=[cores[k % len(cores)]] if len(cores) >= len(plan.stages) else None)
    return plan


def _run_plan(plan: SplitPlan | PipelineConfig, feeds: dict[str, np.ndarray], requests: int, work: Path, name: str) -> float:
    config = plan.config if isinstance(plan, SplitPlan) else plan
    with load(_bundle(config, work, name)) as pipe:
        return _stream(pipe, feeds, requests)


def bench_model(name: str, requests: int, work: Path) -> dict[str, Any]:
    path = LIGHT / f"light_{name}.onnx"
    cores = sorted(os.sched_getaffinity(0))
    c = len(cores)
    base = _session(str(path), 1)
    inp = base.get_inputs()[0]
    feeds = {inp.name: np.random.default_rng(0).standard_normal(inp.shape).astype(np.float32)}
    row: dict[str, float] = {}
    for t in range(1, c + 1):
        session = base if t == 1 else _session(str(path), t)
        row[f"1 session x {t}t"] = _throughput(functools.partial(session.run, None, feeds), requests)
    replicas = PipelineConfig(name)
    whole = replicas.add_stage(path, "whole")
    whole.configure(intra_op_threads=1, replicas=c)
    replicas.input(inp.name).connect(whole.input(inp.name))
    for out in whole.outputs:
        whole.output(out.name).connect(replicas.output(out.name))
    row[f"{c} replicas x 1t"] = _run_plan(replicas, feeds, requests, work, f"{name}-replicas")
    candidates = inspect_model(path, top=8).candidates
    middle = min(candidates, key=lambda cand: abs(cand.fraction - 0.5))
    row["hand split, 2 stages"] = _run_plan(_pinned(split(path, [middle.at.split(",")]), cores), feeds, requests, work, f"{name}-hand")
    if c >= 2:
        auto = _pinned(split(path, policy=MeasuredPolicy(stages=c)), cores)
        row[f"auto split, {c} stages"] = _run_plan(auto, feeds, requests, work, f"{name}-auto")
    planned = plan_pipeline(path, cores=c, rounds=5, requests=max(20, requests // 5))  # ~ requests per finalist in all
    row[f"planner ({planned.chosen.label})"] = _run_plan(planned.plan, feeds, requests, work, f"{name}-plan")
    return {"model": name, "req_s": row}


def _markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, ""]
    for r in rows:
        base = r["req_s"]["1 session x 1t"]
        lines += [f"**{r['model']}**", "", "| how | req/s | vs 1 session x 1 thread |", "| --- | --- | --- |"]
        lines += [f"| {how} | {v:.1f} | {v / base:.2f}x |" for how, v in r["req_s"].items()]
        lines.append("")
    return "\n".join(lines)


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=True):
        base = r["req_s"]["1 session x 1t"]
        labels = list(r["req_s"])
        ax.barh(labels, [r["req_s"][k] / base for k in labels])
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_title(r["model"])
        ax.set_xlabel("throughput vs 1 session x 1 thread")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["squeezenet", "shufflenet", "resnet50"])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (
        f"onnxpipe benchmark, {datetime.date.today().isoformat()}: {len(os.sched_getaffinity(0))} cores ({platform.processor() or platform.machine()}), "
        f"onnxruntime {ort.__version__}, {args.requests} requests streamed per row"
    )
    print(header)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.models:
            r = bench_model(m, args.requests, Path(tmp))
            rows.append(r)
            base = r["req_s"]["1 session x 1t"]
            print(f"\n{m}")
            for how, v in r["req_s"].items():
                print(f"  {how:<40} {v:8.1f} req/s  {v / base:5.2f}x")
    (out / "results.json").write_text(json.dumps({"header": header, "models": rows}, indent=2))
    (out / "results.md").write_text(_markdown(rows, header))
    _chart(rows, out / "results.png")
    print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}")


if __name__ == "__main__":
    main()
