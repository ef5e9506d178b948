"""The code stays lint-clean (ruff) and type-clean (mypy on the package), as STYLE.md asks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.fail(f"{name} is not installed in this environment; install the dev extras: pip install -e '.[dev]'")
    return path


def test_ruff() -> None:
    out = subprocess.run([_tool("ruff"), "check", "onnxpipe", "tests", "benchmarks", "tutorials", "examples"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy() -> None:
    out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
