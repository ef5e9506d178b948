"""The CLI on a model whose dynamic dims are declared -1 or without a name (issue 10, bug 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests import models
from tests.cli.helpers import assert_user_error, ok, run


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`models.dynamic_dims` in a folder of its own (profiles are cached next to it)."""
    path = tmp_path_factory.mktemp("dynamic") / "paddle.onnx"
    onnx.save(models.dynamic_dims(), path)
    return path


def test_run_takes_any_size_for_a_minus_one_dim(model: Path, tmp_path: Path) -> None:
    ok("split", model, "-o", tmp_path / "split", "--at", "a")
    ok("build", tmp_path / "split", "-o", tmp_path / "built")
    ok("export", tmp_path / "built", "-o", tmp_path / "m.onnxpipe", "--reference", 1, "--model", model, "--dim", "x.0=2")
    x = np.random.default_rng(1).standard_normal((1, 3, 48, 192)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    result = ok("run", tmp_path / "m.onnxpipe", "--inputs", tmp_path / "in.npz", "--outputs", tmp_path / "out.npz")
    assert "outputs: y: float32[1, 2, 48, 192]" in result.stdout
    want = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["y"], want, rtol=1e-5, atol=1e-6)
    assert "ok" in ok("verify", tmp_path / "m.onnxpipe").stdout
    np.savez(tmp_path / "bad.npz", x=x[:, :2])
    refused = run("run", tmp_path / "m.onnxpipe", "--inputs", tmp_path / "bad.npz", "--outputs", tmp_path / "o2.npz")
    assert_user_error(refused, "expected [?, 3, ?, ?] (dim 1 must be 3)")


def test_split_auto_sizes_dynamic_dims_as_one_and_says_so(model: Path, tmp_path: Path) -> None:
    result = ok("split", model, "-o", tmp_path / "auto", "--auto", "--stages", 2)
    assert "note: profiled with input 'x': dims x.0, x.2, x.3 not given, using 1" in result.stdout
    assert "Traceback" not in result.output
    assert "ok: all" in ok("verify", tmp_path / "auto", "--model", model, "--dim", "x.0=3").stdout
    sized = ok("split", model, "-o", tmp_path / "sized", "--auto", "--stages", 2, "--dim", "x.0=2", "--dim", "x.2=16", "--dim", "x.3=16")
    assert "not given" not in sized.stdout


def test_inspect_shows_the_dims_as_dynamic(model: Path) -> None:
    out = ok("inspect", model, "--dim", "x.0=2").stdout
    assert "input   x: float32[x.0, 3, x.2, x.3]" in out and "-16 B" not in out
    assert_user_error(run("inspect", model, "--dim", "x.1=2"), "dim 'x.1': dim 1 of input 'x' is fixed at 3")
