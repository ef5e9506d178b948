"""Symbolic dims as onnxruntime treats them: a name binds nothing across inputs (onnxruntime runs a
model whose inputs disagree on a named dim, failing only where an op cannot take the sizes), and
PaddlePaddle's ``?`` is no name at all (issue 22, bug 5)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxpipe import StageError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import TensorSpec, check_inputs, load
from tests import models
from tests.cli.helpers import ok


def _add(tmp_path: Path) -> Path:
    """``z = x + y``, both declared [N, 4]: onnxruntime broadcasts N=2 against N=1."""
    graph = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "add",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in ("x", "y")],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    config = PipelineConfig("add")
    stage = config.add_stage(model, "add")
    for name in ("x", "y"):
        config.input(name).connect(stage.input(name))
    stage.output("z").connect(config.output("z"))
    return models.bundle_of(config, tmp_path)


def test_inputs_that_disagree_on_a_named_dim_run_as_onnxruntime_runs_them(tmp_path: Path) -> None:
    x, y = np.ones((2, 4), np.float32), np.full((1, 4), 2.0, np.float32)
    with load(_add(tmp_path)) as pipe:
        np.testing.assert_array_equal(pipe({"x": x, "y": y})["z"], x + y)  # N=2 and N=1: broadcast, as onnxruntime does
        with pytest.raises(StageError, match=r"stage 'add' failed on request \d+: .*Add"):  # N=2 and N=3: the Add cannot, and says so
            pipe({"x": x, "y": np.ones((3, 4), np.float32)})
        np.testing.assert_array_equal(pipe({"x": x, "y": x})["z"], 2 * x)  # the pipeline goes on


def test_a_dim_named_question_mark_binds_nothing() -> None:
    spec = [TensorSpec("x", "float32", (None, 3, "?", "?"))]
    arrays = check_inputs(spec, {"x": np.zeros((1, 3, 48, 192), np.float32)})
    assert arrays["x"].shape == (1, 3, 48, 192)
    declared = [TensorSpec("a", "float32", ("?",)), TensorSpec("b", "float32", ("?",))]
    check_inputs(declared, {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}, same_dims=True)  # even where names must agree


@pytest.mark.skipif(importlib.util.find_spec("rapidocr_onnxruntime") is None, reason="needs the rapidocr_onnxruntime wheel's models")
def test_pp_ocr_classifier_whose_dims_are_named_question_mark_runs_like_onnxruntime(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    assert spec is not None and spec.submodule_search_locations
    model = Path(spec.submodule_search_locations[0]) / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"  # x: [-1, 3, '?', '?']
    config = PipelineConfig("cls")
    stage = config.add_stage(model, "cls")
    config.input("x").connect(stage.input("x"))
    stage.output("save_infer_model/scale_0.tmp_1").connect(config.output("p"))
    assert config.to_spec().inputs[0].shape == (None, 3, None, None)
    bundle = models.bundle_of(config, tmp_path)
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with load(bundle) as pipe:
        np.testing.assert_allclose(pipe({"x": x})["p"], want, rtol=1e-5, atol=1e-6)
    np.savez(tmp_path / "in.npz", x=x)
    ok("run", bundle, "--inputs", tmp_path / "in.npz", "--outputs", tmp_path / "out.npz")
    split_at = tmp_path / "split"
    ok("split", model, "-o", split_at, "--auto", "--stages", "2", "--dim", "x.2=48", "--dim", "x.3=192")
    assert '"x.2"' in (split_at / "pipeline.json").read_text()
