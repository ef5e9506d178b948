"""The nine onnx light models (IR 3, ConstantOfShape weights, initializers listed as inputs), split
for real: a 4-stage split whose middle cut is crossed by two named tensors, and a 2-stage split by
node name and by (op_type, index). Chained stages must equal the whole model on every output and
every boundary tensor (rtol 1e-4, atol 1e-5, two random inputs).

The light models' weights are constants, so their softmax outputs are nearly input-independent;
comparing every boundary tensor, whose values do depend on the input, is what makes the check bite.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest

from onnxpipe.splitter import NodeCut, OpCut, split, verify
from onnxpipe.splitter._graph import GraphIndex

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
MODELS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet", "vgg19", "zfnet512"]


def _compute_tensors(path: Path) -> list[str]:
    index = GraphIndex(onnx.load(path))
    return [index.nodes[i].output[0] for i in index.compute_nodes()]


@pytest.mark.parametrize("name", MODELS)
def test_four_stages_with_a_multi_tensor_cut(name: str, tmp_path: Path) -> None:
    path = LIGHT / f"light_{name}.onnx"
    tensors = _compute_tensors(path)
    k = len(tensors)
    cuts = [tensors[k // 4], [tensors[k // 2], tensors[k // 2 + 1]], tensors[3 * k // 4]]
    plan = split(path, cuts)
    assert len(plan.stages) == 4
    assert all(s.nodes > 0 for s in plan.stages)
    report = verify(plan.save(tmp_path / "split"), path, samples=2)
    assert report.ok, [r for r in report.rows if not r.ok]
    kinds = {r.kind for r in report.rows}
    assert kinds == {"output", "boundary"}
    for stage in plan.stages:
        assert stage.model.ir_version == 3  # kept as the source has it
        assert {p.key: p.value for p in stage.model.metadata_props}["onnxpipe.stage"] == str(stage.index)
        onnx.checker.check_model(stage.model, full_check=True)


@pytest.mark.parametrize("name", ["resnet50", "inception_v2", "shufflenet"])
def test_two_stages_by_node_and_by_op_index(name: str) -> None:
    path = LIGHT / f"light_{name}.onnx"
    model = onnx.load(path)
    index = GraphIndex(model)
    compute = index.compute_nodes()
    middle = index.nodes[compute[len(compute) // 2]]
    by_node = split(model, [NodeCut(middle.name)])
    convs = [i for i in index.order if index.nodes[i].op_type == "Conv"]
    by_op = split(model, [OpCut("Conv", len(convs) // 2)])
    for plan in (by_node, by_op):
        assert len(plan.stages) == 2
        assert verify(plan, model).ok
    # The node cut's tensor is one of the boundary tensors of stage 0.
    assert middle.output[0] in {t.name for t in by_node.stages[0].outputs}
