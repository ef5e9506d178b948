"""Models the shape-inference path finds hard: dims declared -1 or without a name, and an fp16
decoder whose If nodes leave tensors of unknown rank (issue 10, bugs 1 and 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnxpipe import InputError, SplitError
from onnxpipe.builder import PipelineConfig, tensor_spec
from onnxpipe.runtime import load
from onnxpipe.splitter import MeasuredPolicy, inspect_model, profile_model, split, verify
from tests import models

#: Chained fp16 stages round each boundary tensor to float16 where the whole model's session keeps
#: float32 between its (cast-wrapped) fp16 kernels: measured differences are one fp16 ulp (2^-10,
#: 9.8e-4 relative; 0.00195 absolute at values in [2, 4)). rtol 1e-3 admits one ulp, atol 1e-3 the
#: values near zero; float32 models keep verify's default tolerance.
FP16_TOL = {"rtol": 1e-3, "atol": 1e-3}


def test_tensor_spec_reads_minus_one_and_empty_dims_as_dynamic() -> None:
    x = models.dynamic_dims().graph.input[0]
    assert tensor_spec(x).shape == (None, 3, None, None)


def test_split_names_dynamic_input_dims_by_address_and_never_fixes_them(tmp_path: Path) -> None:
    plan = split(models.dynamic_dims(), ["a"])
    # The pipeline's faces read like onnxruntime's view of the whole model (dynamic dims unnamed);
    # inside, the stages carry the addresses, so the boundaries say which dims are the same.
    assert plan.spec.inputs[0].shape == (None, 3, None, None)
    assert plan.stages[0].inputs[0].shape == ("x.0", 3, "x.2", "x.3")
    for stage in plan.stages:
        for t in (*stage.inputs, *stage.outputs):
            assert t.shape is not None and not any(isinstance(d, int) and d < 0 for d in t.shape), t
    assert plan.stages[1].inputs[0].shape is not None and plan.stages[1].inputs[0].shape[0] == "x.0"  # the batch flows on by name
    report = verify(plan, models.dynamic_dims(), dims={"x.0": 2, "x.2": 48, "x.3": 20}, samples=2)
    assert report.ok and not report.notes
    with load(models.bundle_of(plan, tmp_path)) as pipe:  # any batch and image size, as onnxruntime takes them
        for shape in ((1, 3, 48, 192), (3, 3, 5, 7)):
            x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            want = ort.InferenceSession(models.dynamic_dims().SerializeToString()).run(None, {"x": x})[0]
            np.testing.assert_allclose(pipe({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def test_inspect_shows_dynamic_dims_and_sizes_them_by_address() -> None:
    summary = inspect_model(models.dynamic_dims())
    assert str(summary.inputs[0]) == "x: float32[x.0, 3, x.2, x.3]"
    one = {c.at: c.bytes for c in summary.candidates}
    assert one == {"a": 16, "b": 16}  # [x.0, 4, ?, ?] floats, dims counted as 1: never negative
    two = {c.at: c.bytes for c in inspect_model(models.dynamic_dims(), dims={"x.0": 2}).candidates}
    assert two == {"a": 32, "b": 32}
    with pytest.raises(InputError, match=r"dim 'x.1': dim 1 of input 'x' is fixed at 3; only dynamic dims take a size"):
        inspect_model(models.dynamic_dims(), dims={"x.1": 2})
    with pytest.raises(InputError, match=r"the model has no symbolic dim 'batch'; "):
        inspect_model(models.dynamic_dims(), dims={"batch": 2})


def test_cost_model_profiles_a_minus_one_model_and_says_which_dims_it_sized(tmp_path: Path) -> None:
    profile = profile_model(models.dynamic_dims(), runs=2, cache=False)
    assert profile.notes == ["profiled with input 'x': dims x.0, x.2, x.3 not given, using 1"]
    sized = profile_model(models.dynamic_dims(), runs=2, cache=False, dims={"x.0": 2, "x.2": 8, "x.3": 8})
    assert sized.notes == []
    plan = split(models.dynamic_dims(), policy=MeasuredPolicy(stages=2, profile=profile))
    assert len(plan.stages) == 2 and profile.notes[0] in plan.notes
    assert verify(plan, models.dynamic_dims(), samples=1).ok


def test_connect_takes_a_minus_one_dim_as_dynamic() -> None:
    head = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["h"])],
            "head",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [-1, 4])],
            [helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [-1, 4])],
        )
    )
    tail = helper.make_model(
        helper.make_graph(
            [helper.make_node("Neg", ["h"], ["y"])],
            "tail",
            [helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [2, 4])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, -1])],
        )
    )
    config = PipelineConfig()
    a, b = config.add_stage(head, "head"), config.add_stage(tail, "tail")
    config.input("x").connect(a.input("x"))
    a.output("h").connect(b.input("h"))  # [?, 4] -> [2, 4]: fine, the -1 is no size 1 != 2
    b.output("y").connect(config.output("y"))
    assert config.to_spec().inputs[0].shape == (None, 4)


@pytest.mark.parametrize("cuts", [["g"], ["r"], ["p"], ["q"], ["d"], ["g", "p"], ["e", "q"]])
def test_fp16_decoder_with_if_nodes_splits_anywhere(cuts: list[str]) -> None:
    model = models.fp16_if_decoder()
    plan = split(model, cuts)
    for stage in plan.stages:
        onnx.checker.check_model(stage.model, full_check=True)
        for v in (*stage.model.graph.input, *stage.model.graph.output):
            assert v.type.tensor_type.HasField("shape"), v.name
    unranked = [t for t in cuts if t not in ("e",)]
    assert any(f"'{unranked[0]}' (rank 4)" in n for n in plan.notes), plan.notes
    report = verify(plan, model, samples=3, **FP16_TOL)
    assert report.ok, [r for r in report.rows if not r.ok]


def test_a_boundary_whose_rank_no_sample_run_tells_is_refused_by_name() -> None:
    model = models.fp16_if_decoder()
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 5  # the first Conv now fails at run time
    with pytest.raises(SplitError, match=r"shape inference cannot tell the rank of boundary tensor\(s\) 'g', and a sample run to see it failed"):
        split(model, ["g"], check=False)


def test_an_element_type_onnxpipe_does_not_know_is_a_config_error() -> None:
    from onnxpipe import ConfigError

    with pytest.raises(ConfigError, match=r"tensor 'x' has ONNX element type 99, which onnxpipe does not know; known: float32, "):
        tensor_spec(helper.make_tensor_value_info("x", 99, [1]))


def test_a_negative_weight_cap_is_a_split_error() -> None:
    with pytest.raises(SplitError, match=r"measured: max_stage_weights must be at least 0 bytes, got -1"):
        split(models.chain(), policy=MeasuredPolicy(stages=2, max_stage_weights=-1))


def test_a_model_input_without_a_shape_is_refused_by_name() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"], name="r"), helper.make_node("Neg", ["a"], ["y"], name="n")],
        "shapeless",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    with pytest.raises(SplitError, match=r"model input\(s\) 'x' declare no shape; every stage input needs one"):
        split(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), ["a"])


def test_a_model_output_declared_without_a_shape_gets_its_rank_from_a_sample_run() -> None:
    model = models.fp16_if_decoder()
    model.graph.output[0].type.tensor_type.ClearField("shape")  # onnxruntime runs it; onnx's checker would not
    model.graph.node[-1].op_type = "Flatten"  # and inference cannot tell Y's rank from the shapeless p
    plan = split(model, ["g"])
    assert "'g' (rank 4), 'Y' (rank 2)" in plan.notes[0] and plan.spec.outputs[0].shape == (None, None)
    for stage in plan.stages:
        onnx.checker.check_model(stage.model, full_check=True)
    assert verify(plan, model, samples=1, **FP16_TOL).ok


def _reflect_padded_if_decoder() -> onnx.ModelProto:
    """fp16_if_decoder with symbolic spatial dims ``S`` and a reflect Pad first (as silero-vad has):
    at S = 1 onnxruntime refuses the Pad ("reflect requires axis length >= 2"), at S = 8 it runs."""
    model = models.fp16_if_decoder()
    graph = model.graph
    for axis in (2, 3):
        graph.input[0].type.tensor_type.shape.dim[axis].dim_param = "S"
        graph.output[0].type.tensor_type.shape.dim[axis].dim_param = "T"
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "reflect_pads"))
    graph.node[0].input[0] = "x_padded"
    graph.node.insert(0, helper.make_node("Pad", ["x", "reflect_pads"], ["x_padded"], mode="reflect", name="pad0"))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_the_sample_run_that_finds_a_boundary_rank_takes_dims_and_says_which_it_used(capfd: pytest.CaptureFixture[str]) -> None:
    model = _reflect_padded_if_decoder()
    with pytest.raises(SplitError, match=r"a sample run to see it failed on inputs 'x' \[1, 4, 1, 1\] \(other symbolic dims sized 1\): .*Pad.*; "
                                         r"give the sizes the model needs with --dim NAME=SIZE"):
        split(model, ["g"])
    assert "[E:onnxruntime" not in capfd.readouterr().err  # onnxruntime's own log line stays out of the user's terminal
    plan = split(model, ["g"], dims={"S": 8})
    assert any("'g' (rank 4)" in n for n in plan.notes), plan.notes
    report = verify(plan, model, samples=2, dims={"S": 8}, **FP16_TOL)
    assert report.ok, [r for r in report.rows if not r.ok]


def test_split_cli_passes_dims_to_the_sample_run_of_a_hand_cut(tmp_path: Path) -> None:
    from tests.cli.helpers import assert_user_error, ok, run

    path = tmp_path / "m.onnx"
    onnx.save(_reflect_padded_if_decoder(), str(path))
    assert_user_error(run("split", path, "-o", tmp_path / "a", "--at", "g"), "a sample run to see it failed on inputs 'x' [1, 4, 1, 1]", "--dim NAME=SIZE")
    ok("split", path, "-o", tmp_path / "b", "--at", "g", "--dim", "S=8")
