"""The runtime is the floor: importing it must pull in neither onnx, networkx nor click."""

from __future__ import annotations

import subprocess
import sys


def test_runtime_imports_only_stdlib_numpy_onnxruntime() -> None:
    code = (
        "import sys, onnxpipe.runtime\n"
        "leaked = [m for m in ('onnx', 'networkx', 'click', 'rich', 'onnxpipe.builder', 'onnxpipe.splitter', 'onnxpipe.cli')"
        " if m in sys.modules]\n"
        "print(','.join(leaked))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"onnxpipe.runtime imported {out.stdout.strip()}"
