"""Sizes a graph fixes of its inputs' symbolic dims, and a convolution's least input (Note: dims the
graph fixes, Note: a convolution's least input, splitter/_sizes.py): found, used by sample runs and kept
in the split's ``input_dims``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe import SplitError
from onnxpipe.runtime import INPUT_DIMS_KEY
from onnxpipe.splitter import profile_model, split, verify
from onnxpipe.splitter._extract import infer_types
from onnxpipe.splitter._sizes import graph_dims, kernel_floors, sample_dims

F32 = TensorProto.FLOAT


def _weight(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(len(name)).standard_normal(shape).astype(np.float32), name)


def _model(inputs: list[onnx.ValueInfoProto], nodes: list[onnx.NodeProto], weights: list[onnx.TensorProto], output: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(output, F32, None)], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def image_model() -> onnx.ModelProto:
    """``x [N, C, H, W]`` through a grouped Conv (weight ``[8, 2, 3, 3]``, 2 groups: C is 4), pooled,
    flattened and through a MatMul: ``y [N, 8] @ [8, 5] + b [5]``."""
    x = helper.make_tensor_value_info("x", F32, ["N", "C", "H", "W"])
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], group=2, pads=[0, 0, 0, 0], name="conv"),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "m"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "b"], ["y"], name="add"),
    ]
    return _model([x], nodes, [_weight("w", 8, 2, 3, 3), _weight("m", 8, 5), _weight("b", 5)], "y")


def test_a_convs_weight_fixes_the_channels_and_its_kernel_the_least_size() -> None:
    model = image_model()
    types, _ = infer_types(model)
    assert graph_dims(model, types) == {"C": 4}
    assert kernel_floors(model, types) == {"H": (3, "conv"), "W": (3, "conv")}
    assert sample_dims(model, {"C": 6, "H": 9}, types) == {"C": 6, "H": 9}  # a size given goes over the graph's


@pytest.mark.parametrize(("node", "weights", "shape", "fixed"), [
    (helper.make_node("MatMul", ["x", "k"], ["y"]), [_weight("k", 7, 3)], ["B", "K"], {"K": 7}),
    (helper.make_node("Gemm", ["x", "k"], ["y"], transB=1), [_weight("k", 3, 7)], ["B", "K"], {"K": 7}),
    (helper.make_node("Gemm", ["x", "k"], ["y"], transA=1), [_weight("k", 7, 3)], ["K", "B"], {"K": 7}),
    (helper.make_node("Add", ["x", "k"], ["y"]), [_weight("k", 1, 6)], ["B", "L"], {"L": 6}),
    (helper.make_node("Add", ["x", "k"], ["y"]), [_weight("k", 1, 1)], ["B", "L"], {}),  # a 1 broadcasts: it fixes nothing
    (helper.make_node("Concat", ["x", "k"], ["y"], axis=1), [_weight("k", 2, 4)], ["B", "L"], {"B": 2}),  # not along the axis joined
])
def test_a_constant_operand_fixes_the_dim_it_meets(node: onnx.NodeProto, weights: list[onnx.TensorProto], shape: list[str],
                                                   fixed: dict[str, int]) -> None:
    model = _model([helper.make_tensor_value_info("x", F32, shape)], [node], weights, "y")
    assert graph_dims(model, infer_types(model)[0]) == fixed


def test_a_dim_fixed_at_two_sizes_is_fixed_by_neither() -> None:
    x = helper.make_tensor_value_info("x", F32, ["B", "K"])
    nodes = [helper.make_node("MatMul", ["x", "a"], ["p"]), helper.make_node("MatMul", ["x", "b"], ["q"]),
             helper.make_node("Concat", ["p", "q"], ["y"], axis=1)]
    model = _model([x], nodes, [_weight("a", 4, 2), _weight("b", 5, 2)], "y")
    assert graph_dims(model, infer_types(model)[0]) == {}


def test_a_split_runs_and_keeps_the_sizes_its_graph_fixes() -> None:
    model = image_model()
    plan = split(model, ["p"], dims={"H": 5, "W": 5})
    assert plan.spec.metadata[INPUT_DIMS_KEY] == "C=4,H=5,W=5"  # bench and verify of the bundle take them
    assert verify(plan, model).ok
    with pytest.raises(SplitError, match=r"Symbolic dims not given were sized 1 \(H, W, N\), which this model may not take \(H, W: 1 is shorter "
                                         r"than the kernel of Conv 'conv', which needs at least 3\); give them: --dim H=SIZE --dim W=SIZE --dim N=SIZE"):
        profile_model(model, cache=False)
