"""benchmarks.gpu_check says plainly that it did not run where there is no CUDA provider, and what it would measure;
benchmarks.targets runs end to end where OpenVINO is (tests/targets does that in its venv)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this host has CUDA: the check would run for real")
def test_the_gpu_check_says_it_did_not_run_without_cuda_and_what_it_would_measure() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--mb", "8"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"not run: this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider")
    assert "it would measure: " in done.stdout and "host <-> device bytes per hop" in done.stdout and "per decode step" in done.stdout
    # What it measures on any host: a CPU stage's hand-off reads its input in place and wraps onnxruntime's output.
    assert "output owns its memory: False" in done.stdout and "OrtValue.numpy() shares the input: True" in done.stdout


def test_the_targets_benchmark_refuses_a_host_without_openvino_naming_the_venv() -> None:
    if "OpenVINOExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has OpenVINO: tests/targets runs the benchmark")
    done = subprocess.run([sys.executable, "-m", "benchmarks.targets"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "has no OpenVINOExecutionProvider: run it with .venv-openvino/bin/python" in done.stderr
