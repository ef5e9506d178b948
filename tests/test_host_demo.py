"""The deployment host's side of ``make demo`` runs with only the runtime and says the pipeline is right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from onnxpipe.builder import build, export
from onnxpipe.splitter import UniformPolicy, split
from tests import models

ROOT = Path(__file__).resolve().parents[1]


def test_host_demo_on_a_small_bundle(tmp_path: Path) -> None:
    model = models.light_model_path("squeezenet")
    plan = split(model, policy=UniformPolicy(stages=2))
    inputs = [{"data_0": np.zeros((1, 3, 224, 224), np.float32)}]
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "sq.onnxpipe", reference_inputs=inputs, reference_model=model)
    trace = tmp_path / "trace.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tutorials" / "host_demo.py"), str(bundle), str(model), "--requests", "12", "--trace", str(trace)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no onnx, networkx, click" in out.stdout
    assert "reference outputs reproduced: True" in out.stdout
    assert "equal (rtol 1e-4, atol 1e-5" in out.stdout
    assert {"onnxpipe pipeline", "one session, 1 thread", "2 replicas x 1 thread"} <= {line[:28].strip() for line in out.stdout.splitlines()}
    assert json.loads(trace.read_text())["traceEvents"]
