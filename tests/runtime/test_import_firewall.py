"""The runtime is the floor: importing it must pull in neither onnx, networkx, click, ray nor any
server library; the server (onnxpipe.serve) pulls in nothing of the build side."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_runtime_imports_only_stdlib_numpy_onnxruntime() -> None:
    code = (
        "import sys, onnxpipe.runtime\n"
        "leaked = [m for m in ('onnx', 'networkx', 'click', 'rich', 'ray', 'onnxpipe.builder', 'onnxpipe.splitter', 'onnxpipe.planner',"
        " 'onnxpipe.cli', 'onnxpipe.serve', 'aiohttp', 'grpc', 'google.protobuf', 'prometheus_client', 'uvloop')"
        " if m in sys.modules]\n"
        "print(','.join(leaked))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"onnxpipe.runtime imported {out.stdout.strip()}"


def test_the_ray_engine_without_ray_is_one_error_naming_the_extra(tmp_path: object) -> None:
    # ray made unimportable in a child process: the engine asks for the extra, nothing else breaks.
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from onnxpipe.runtime._ray import import_ray\n"
        "from onnxpipe import ConfigError\n"
        "try:\n    import_ray()\nexcept ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "the Ray engine needs Ray, which is not installed: pip install 'onnxpipe[ray]'"


def test_the_server_imports_nothing_of_the_build_side() -> None:
    pytest.importorskip("aiohttp", reason="the serve extra is not installed")
    code = (
        "import sys, onnxpipe.serve\n"
        "leaked = [m for m in ('onnx', 'networkx', 'click', 'rich', 'ray', 'onnxpipe.builder', 'onnxpipe.splitter', 'onnxpipe.planner',"
        " 'onnxpipe.cli') if m in sys.modules]\n"
        "print(','.join(leaked))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"onnxpipe.serve imported {out.stdout.strip()}"
