"""Stage modules as files: external data written when needed, holding only the module's own weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.builder import _modules, save_model, weights_bytes


def _model_with_weights(ir_version: int = 8) -> onnx.ModelProto:
    w1 = numpy_helper.from_array(np.arange(3000, dtype=np.float32).reshape(10, 300), "w1")
    w2 = numpy_helper.from_array(np.full((300,), 2.0, dtype=np.float32), "w2")
    small = numpy_helper.from_array(np.array([1.0], dtype=np.float32), "small")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Add", ["h", "w2"], ["g"]),
            helper.make_node("Mul", ["g", "small"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 300])],
        initializer=[w1, w2, small],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = ir_version
    return model


def test_small_model_is_one_file(tmp_path: Path) -> None:
    assert save_model(_model_with_weights(), tmp_path / "m.onnx") == ["m.onnx"]


def test_model_past_the_protobuf_limit_gets_its_own_data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_modules, "PROTOBUF_LIMIT", 10_000)
    model = _model_with_weights()
    before = model.SerializeToString()
    assert save_model(model, tmp_path / "m.onnx") == ["m.onnx", "m.onnx.data"]
    assert model.SerializeToString() == before  # the caller's model is untouched
    data = (tmp_path / "m.onnx.data").stat().st_size
    assert 12000 + 1200 <= data < 12000 + 1200 + 2 * 4096  # both big weights, page-aligned; 'small' stays inline
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)
    stored = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    external = {t.name for t in stored.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert external == {"w1", "w2"}
    loaded = onnx.load(tmp_path / "m.onnx")
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), np.arange(3000, dtype=np.float32).reshape(10, 300))


def test_ir3_model_is_raised_to_ir4_for_external_data_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_modules, "PROTOBUF_LIMIT", 10_000)
    with pytest.warns(UserWarning, match="IR version 3 -> 4"):
        save_model(_model_with_weights(ir_version=3), tmp_path / "m.onnx")
    assert onnx.load(tmp_path / "m.onnx", load_external_data=False).ir_version == 4


def test_weights_bytes_counts_external_lengths(tmp_path: Path) -> None:
    model = _model_with_weights()
    assert weights_bytes(model) == 12000 + 1200 + 4
    onnx.save_model(model, tmp_path / "e.onnx", save_as_external_data=True, all_tensors_to_one_file=True, location="e.data", size_threshold=0)
    assert weights_bytes(onnx.load(tmp_path / "e.onnx", load_external_data=False)) == 12000 + 1200 + 4
