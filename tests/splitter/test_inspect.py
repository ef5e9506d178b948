"""inspect_model: counts, weight bytes, and cut candidates that split() makes exactly as promised."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxpipe import InputError
from onnxpipe.splitter import inspect_model, split

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
RESNET = LIGHT / "light_resnet50.onnx"

# Five compute nodes in a chain with a skip edge, an early side output ('aux') and a dead node.
SIDE_OUTPUT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] aux, float[N, 4] y) {
  a = Relu(x)
  aux = Neg(a)
  b = Sigmoid(a)
  c = Tanh(b)
  dead = Abs(c)
  y = Add(c, a)
}
"""

# A sequence crosses position 2: no split can cut there.
SEQUENCE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) <int64 zero = {0}> {
  a = Relu(x)
  s = SequenceConstruct(a, a)
  t = SequenceAt(s, zero)
  y = Neg(t)
}
"""


@pytest.fixture(scope="module")
def resnet() -> onnx.ModelProto:
    return onnx.load(RESNET)


def test_resnet50_counts_ops_and_weights(resnet: onnx.ModelProto) -> None:
    summary = inspect_model(RESNET)
    assert (summary.name, summary.ir_version, summary.opsets) == ("resnet50", 3, {"ai.onnx": 9})
    assert [t.name for t in summary.inputs] == ["gpu_0/data_0"]  # initializers listed as inputs left out
    assert summary.inputs[0].shape == (1, 3, 224, 224)
    assert [t.name for t in summary.outputs] == ["gpu_0/softmax_1"]
    assert (summary.nodes, summary.compute_nodes, summary.weight_nodes, summary.dead_nodes) == (415, 176, 239, 0)
    assert summary.ops["ConstantOfShape"] == 239 and summary.ops["Conv"] == 53
    assert sum(summary.ops.values()) == summary.nodes
    assert list(summary.ops.values()) == sorted(summary.ops.values(), reverse=True)
    # Every weight is a float32 ConstantOfShape of a stored shape: size it independently.
    shapes = {t.name: numpy_helper.to_array(t) for t in resnet.graph.initializer}
    expected = sum(4 * int(np.prod(shapes[n.input[0]])) for n in resnet.graph.node if n.op_type == "ConstantOfShape")
    assert summary.computed_weight_bytes == expected
    direct = {x for n in resnet.graph.node if n.op_type != "ConstantOfShape" for x in n.input if x in shapes}  # Reshape's shape
    assert summary.weights_bytes == expected + sum(shapes[x].nbytes for x in direct)
    assert summary.initializer_bytes == sum(len(t.raw_data) or 8 * len(t.int64_data) for t in resnet.graph.initializer)
    assert 24_000_000 * 4 < summary.weights_bytes < 27_000_000 * 4  # resnet50 has ~25.6M parameters
    assert summary.notes == []
    json.dumps(summary.to_dict())


def test_resnet50_candidates_are_exact_two_stage_splits(resnet: onnx.ModelProto) -> None:
    summary = inspect_model(resnet, top=8)
    candidates = summary.candidates
    assert len(candidates) == 8
    positions = [c.position for c in candidates]
    assert positions == sorted(positions)
    n = summary.compute_nodes
    assert all(b - a >= n // 16 for a, b in itertools.pairwise(positions))  # spread out
    assert 0 < positions[0] and positions[-1] < n - 1
    for c in candidates:
        assert c.fraction == pytest.approx(c.position / n)
        assert c.at == ",".join(c.tensors)  # a single output at the end: no side outputs to add
        plan = split(resnet, [list(c.tensors)], check=False)
        assert len(plan.stages) == 2
        assert plan.stages[0].nodes == c.position
        assert plan.stages[0].bytes_out == c.bytes == plan.stages[1].bytes_in
        assert {t.name for t in plan.stages[0].outputs} == set(c.tensors)
        assert sum(s.weights_bytes for s in plan.stages) == summary.weights_bytes  # resnet shares no weight


def test_candidates_are_the_cheapest_positions(resnet: onnx.ModelProto) -> None:
    every = inspect_model(resnet, top=1000).candidates  # spacing 1: every allowed position
    best = inspect_model(resnet, top=1).candidates
    assert len(best) == 1
    assert best[0].bytes == min(c.bytes for c in every)
    assert len(every) > 150


def test_side_output_joins_the_at_argument_and_symbolic_dims_default_to_one() -> None:
    model = onnx.parser.parse_model(SIDE_OUTPUT)
    summary = inspect_model(model)
    assert (summary.compute_nodes, summary.weight_nodes, summary.dead_nodes) == (5, 0, 1)
    rows = [(c.position, c.bytes, c.tensors, c.at) for c in summary.candidates]
    assert rows == [
        (1, 16, ("a",), "a"),
        (2, 16, ("a",), "a,aux"),
        (3, 32, ("a", "b"), "a,b,aux"),
        (4, 32, ("a", "c"), "a,c,aux"),
    ]
    assert any("N counted as 1" in note for note in summary.notes)
    # With 'aux' in the cut its producer stays in stage 0, as the position promises.
    plan = split(model, [summary.candidates[1].at.split(",")])
    assert [s.nodes for s in plan.stages] == [2, 3]
    assert [t.name for t in plan.stages[1].inputs] == ["a"]


def test_dims_size_symbolic_dims() -> None:
    summary = inspect_model(onnx.parser.parse_model(SIDE_OUTPUT), dims={"N": 3})
    assert [c.bytes for c in summary.candidates] == [48, 48, 96, 96]
    assert not any("counted as 1" in note for note in summary.notes)


@pytest.mark.parametrize(
    ("dims", "message"),
    [({"M": 2}, r"no symbolic dim 'M'; valid: 'N'"), ({"N": 0}, r"dim 'N' must be an integer >= 1, got 0")],
)
def test_bad_dims(dims: dict[str, int], message: str) -> None:
    with pytest.raises(InputError, match=message):
        inspect_model(onnx.parser.parse_model(SIDE_OUTPUT), dims=dims)


def test_top_limits_and_spreads() -> None:
    model = onnx.parser.parse_model(SIDE_OUTPUT)
    assert inspect_model(model, top=0).candidates == []
    assert [c.position for c in inspect_model(model, top=2).candidates] == [1, 2]


def test_positions_where_a_sequence_crosses_are_skipped() -> None:
    summary = inspect_model(onnx.parser.parse_model(SEQUENCE))
    assert [(c.position, c.at) for c in summary.candidates] == [(1, "a"), (3, "t")]


def test_one_compute_node_has_no_candidates() -> None:
    model = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) { y = Relu(x) }')
    summary = inspect_model(model)
    assert summary.candidates == [] and summary.compute_nodes == 1


def test_path_and_proto_give_the_same_summary(resnet: onnx.ModelProto) -> None:
    assert inspect_model(RESNET, top=3).to_dict() == inspect_model(resnet, top=3).to_dict()
