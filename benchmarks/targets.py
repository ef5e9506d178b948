"""Stages on OpenVINO and on the CPU: per-stage times on each provider, and the pipeline all on the
CPU, all on OpenVINO and mixed, side by side in one run. Run it where onnxruntime has OpenVINO
(the venv of `make test-openvino`):

    .venv-openvino/bin/python -m benchmarks.targets [--requests 200] [--rounds 3] [--json]

The model is PP-OCRv4's text recognizer (the rapidocr_onnxruntime wheel's, real weights), input
[1, 3, 48, 320], cut in 2 stages near its middle (tests/targets/models.py). Every session has one
thread (OpenVINO's ``num_of_threads`` 1, from the stage's threads); pipeline stages are pinned to a
core each where the machine has 2. Per stage: its session's median time per run on each provider
and how many nodes each provider took (``placement``). Per pipeline: requests/s through
``pipe.map``, in interleaved rounds with the whole model in one session on each provider beside
them; medians with their spread (min-max).

The planner does not choose targets yet (issue 21 asks for it): no "planner's choice" row.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks._timing import median_seconds
from benchmarks.pipeline_efficiency import _stream as map_rate
from onnxpipe.builder import build, export
from onnxpipe.runtime import interleaved_rounds, load
from tests.targets.models import INPUT, recognizer, split_on

ort.set_default_logger_severity(3)
OV, CPU = "OpenVINOExecutionProvider", "CPUExecutionProvider"
TARGETS = {"cpu": CPU, "openvino": OV}
PIPELINES = (("cpu", "cpu"), ("openvino", "openvino"), ("cpu", "openvino"), ("openvino", "cpu"))


def _session(model: bytes | str, target: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    providers: list[Any] = [(OV, {"num_of_threads": "1"}), CPU] if target == "openvino" else [CPU]
    return ort.InferenceSession(model, options, providers=providers)


def _nodes(session: ort.InferenceSession) -> dict[str, int]:
    counts: dict[str, int] = {}
    for subgraph in session.get_provider_graph_assignment_info():
        counts[subgraph.ep_name] = counts.get(subgraph.ep_name, 0) + len(subgraph.get_nodes())
    return counts


def run(requests: int, rounds: int) -> dict[str, Any]:
    model = recognizer()
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 48, 320)).astype(np.float32)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        bundles: dict[str, Path] = {}
        for targets in PIPELINES:
            plan = split_on(model, list(targets))
            for k, stage in enumerate(plan.config.stages):
                stage.configure(affinity=[cores[k]] if len(cores) >= 2 else None)
            name = " -> ".join(targets)
            bundles[name] = export(build(plan.config, Path(tmp) / f"built-{len(bundles)}").path, Path(tmp) / f"bundle-{len(bundles)}")
        # Each stage's module (the portable one, from the all-OpenVINO build) alone on each provider.
        stages = []
        portable = bundles["openvino -> openvino"]
        with load(portable) as pipe:
            names = [s.name for s in pipe.spec.stages]
        feeds = {INPUT: x}
        for name in names:  # each stage fed what the stages before it make
            module = str(portable / "stages" / f"{name}.onnx")
            sessions = {t: _session(module, t) for t in TARGETS}
            row: dict[str, Any] = {"stage": name}
            for target, session in sessions.items():
                row[target] = {"ms": 1e3 * median_seconds(functools.partial(session.run, None, feeds), runs=30, warmup=3), "nodes": _nodes(session)}
            stages.append(row)
            cpu = sessions["cpu"]
            feeds = dict(zip([o.name for o in cpu.get_outputs()], cpu.run(None, feeds), strict=True))

        wholes = {t: _session(model.SerializeToString(), t) for t in TARGETS}

        def whole_rate(target: str) -> float:
            session = wholes[target]
            return 1.0 / median_seconds(lambda: session.run(None, {INPUT: x}), runs=requests // 4, warmup=3)

        def pipeline_rate(bundle: Path) -> float:
            with load(bundle, queue_depth=4) as pipe:
                return map_rate(pipe, {INPUT: x}, requests)

        candidates = {f"one session, {t}": (lambda t=t: whole_rate(t)) for t in TARGETS}
        candidates.update({f"pipeline {name}": (lambda b=b: pipeline_rate(b)) for name, b in bundles.items()})
        measured = interleaved_rounds(candidates, rounds)
    return {
        "onnxruntime": ort.__version__,
        "cores": len(cores),
        "rounds": rounds,
        "stages": stages,
        "rates": {n: {"median": measured.median(n), "min": min(v), "max": max(v)} for n, v in measured.values.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if OV not in ort.get_available_providers():
        raise SystemExit(f"this onnxruntime ({ort.__version__}) has no {OV}: run it with .venv-openvino/bin/python (make test-openvino makes it)")
    result = run(args.requests, args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"PP-OCRv4 rec [1, 3, 48, 320], 2 stages x 1 thread; onnxruntime {result['onnxruntime']}, {result['cores']} cores; "
          f"median (min-max) of {result['rounds']} interleaved rounds")
    for row in result["stages"]:
        cells = []
        for t in TARGETS:
            nodes = ", ".join(f"{ep.removesuffix('ExecutionProvider')} {n}" for ep, n in row[t]["nodes"].items())
            cells.append(f"{t} {row[t]['ms']:.2f} ms ({nodes} nodes)")
        print(f"  {row['stage']}: " + "; ".join(cells))
    base = result["rates"]["one session, cpu"]["median"]
    for name, r in result["rates"].items():
        print(f"  {name:<32} {r['median']:8.1f} req/s ({r['min']:.1f}-{r['max']:.1f})  {r['median'] / base:5.2f}x one CPU session")
    print("  planner's choice: the planner does not choose targets yet")


if __name__ == "__main__":
    main()
