"""inspect_model on models as exporters write them (issue 27): dims that are formulas of the input
dims (PaddlePaddle, onnxruntime's symbolic shape inference) computed, so the bytes crossing a cut are
what onnxruntime makes; the hundreds of ``unk__N`` dims of an optimum export counted, not listed."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe import InputError
from onnxpipe.splitter import inspect_model

D0, D1, D2 = "DynamicDimension.0", "DynamicDimension.1", "DynamicDimension.2"  # paddle2onnx's input dims
HALF = [f"floor({d}/2 - 1/2) + 1" for d in (D1, D2)]  # a 3x3 stride-2 Conv, pad 1, as sympy prints it
DOUBLE = [f"2*floor({d}/2 - 1/2) + 2" for d in (D1, D2)]  # that, resized x2


def paddle_formulas() -> onnx.ModelProto:
    """A PaddlePaddle export after symbolic shape inference: its internal dims are formulas of the
    input dims. ``x[D0, 3, D1, D2] -c0 Conv(s2, pad 1)-> a[D0, 8, HALF] -r1 Relu-> b -u2 Resize(x2)->
    c[D0, 8, DOUBLE] -c3 Conv(1x1)-> y[D0, 2, DOUBLE]``."""
    rng = np.random.default_rng(0)
    half: list[str | int] = [D0, 8, *HALF]
    double: list[str | int] = [D0, 8, *DOUBLE]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W0"], ["a"], name="c0", strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["a"], ["b"], name="r1"),
            helper.make_node("Resize", ["b", "", "scales"], ["c"], name="u2", mode="nearest"),
            helper.make_node("Conv", ["c", "W1"], ["y"], name="c3"),
        ],
        "paddle_formulas",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [D0, 3, D1, D2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [D0, 2, *DOUBLE])],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "W0"),
            numpy_helper.from_array(rng.standard_normal((2, 8, 1, 1)).astype(np.float32), "W1"),
            numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        ],
        value_info=[
            helper.make_tensor_value_info("a", TensorProto.FLOAT, half),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, half),
            helper.make_tensor_value_info("c", TensorProto.FLOAT, double),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def measured(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], tensors: Sequence[str]) -> dict[str, int]:
    """The bytes onnxruntime makes of each of ``tensors`` (added as outputs of a copy of ``model``)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in tensors if t not in {o.name for o in model.graph.output})
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return {n: a.nbytes for n, a in zip(names, session.run(None, dict(feeds)), strict=True) if n in tensors}


def assert_candidates_measure_as_run(model: onnx.ModelProto, dims: Mapping[str, int], feeds: Mapping[str, np.ndarray], top: int) -> int:
    summary = inspect_model(model, dims=dims, top=top)
    assert summary.candidates
    sizes = measured(model, feeds, sorted({t for c in summary.candidates for t in c.tensors}))
    for c in summary.candidates:
        assert c.bytes == sum(sizes[t] for t in c.tensors), c
    return max(c.bytes for c in summary.candidates)


def test_formula_dims_are_computed_from_the_input_dims() -> None:
    model = paddle_formulas()
    dims = {D0: 2, D1: 64, D2: 47}
    x = np.zeros((2, 3, 64, 47), np.float32)
    most = assert_candidates_measure_as_run(model, dims, {"x": x}, top=10)
    assert most == 4 * 2 * 8 * 64 * 48  # c: 32 x 24 resized to 64 x 48
    assert inspect_model(model, dims=dims).notes == []


def test_the_note_asks_for_the_input_dims_the_formulas_name() -> None:
    notes = inspect_model(paddle_formulas()).notes
    assert notes == [
        f"input dim(s) {D0}, {D1}, {D2} counted as 1 (4 dim(s) computed from them, e.g. '{HALF[0]}', follow); "
        "give sizes with dims / --dim NAME=VALUE"
    ]
    notes = inspect_model(paddle_formulas(), dims={D1: 64}).notes
    assert notes == [f"input dim(s) {D0}, {D2} counted as 1 (2 dim(s) computed from them, e.g. '{HALF[1]}', follow); give sizes with dims / --dim NAME=VALUE"]
    # Every formula sized at 1: the bytes a run at 1 x 3 x 1 x 1 makes (a: 1 x 1, c: 2 x 2).
    assert [c.bytes for c in inspect_model(paddle_formulas()).candidates] == [4 * 8, 4 * 8, 4 * 8 * 4]


def test_optimum_unk_dims_are_counted_not_listed(llama: onnx.ModelProto) -> None:
    asked, internal = inspect_model(llama).notes
    # The mask's 'past_sequence_length + sequence_length' is no dim to give: its names are.
    assert asked.startswith("input dim(s) batch_size, past_sequence_length, sequence_length counted as 1 (1 dim(s) computed from them")
    m = re.fullmatch(r"(\d+) internal dim\(s\) that no input has \(unk__0, unk__1, unk__2, \.\.\.: shape inference could not relate them "
                     r"to the inputs\) counted as 1; the bytes of tensors that have them may be low", internal)
    assert m is not None, internal
    assert int(m.group(1)) > 100
    given = inspect_model(llama, dims={"batch_size": 2, "sequence_length": 5, "past_sequence_length": 3}).notes
    assert given == [internal]


def test_a_wrong_dim_name_is_told_the_input_dims_not_the_unk_ones(llama: onnx.ModelProto) -> None:
    with pytest.raises(InputError, match=r"no symbolic dim 'batch'; closest: 'batch_size'; valid: 'batch_size', 'past_sequence_length', 'sequence_length'$"):
        inspect_model(llama, dims={"batch": 2})
    inspect_model(llama, dims={"unk__3": 2})  # still taken: it is a dim of the model


RAPIDOCR = importlib.util.find_spec("rapidocr_onnxruntime")


@pytest.mark.slow
@pytest.mark.skipif(RAPIDOCR is None, reason="needs the rapidocr_onnxruntime wheel (PP-OCR det)")
def test_pp_ocr_det_at_640_crosses_what_onnxruntime_makes() -> None:
    # The PP-OCRv4 det of rapidocr_onnxruntime 1.x declares no internal shapes; rapidocr 3.x's
    # exports carry symbolic shape inference's formulas, as this makes them.
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    assert RAPIDOCR is not None and RAPIDOCR.origin is not None
    det = onnx.load(Path(RAPIDOCR.origin).parent / "models" / "ch_PP-OCRv4_det_infer.onnx")
    formulas = SymbolicShapeInference.infer_shapes(det, auto_merge=True)
    assert any("floor(p2o.DynamicDimension.1/2 - 1/2) + 1" == d.dim_param for v in formulas.graph.value_info for d in v.type.tensor_type.shape.dim)
    dims = {"p2o.DynamicDimension.0": 1, "p2o.DynamicDimension.1": 640, "p2o.DynamicDimension.2": 640}
    x = np.random.default_rng(0).standard_normal((1, 3, 640, 640), dtype=np.float32)
    most = assert_candidates_measure_as_run(formulas, dims, {"x": x}, top=8)
    assert most > 8 * 2**20  # the 8.2 MiB, where the dims counted as 1 said 1.3 KiB
    notes = inspect_model(formulas, dims=dims).notes
    assert len(notes) == 1 and notes[0].startswith("6 internal dim(s) that no input has (ConvTranspose_"), notes
