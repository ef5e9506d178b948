"""Every way to ask for an impossible split is refused with a message that says why and what to do."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import onnx
import pytest

from onnxpipe import OnnxpipeError, SplitError
from onnxpipe.splitter import NodeCut, OpCut, TensorCut, split, verify
from tests import models


def _refused(model: onnx.ModelProto, cuts: Any = None, *, assignment: Any = None, match: str) -> None:
    with pytest.raises(SplitError, match=match):
        split(model, cuts, assignment=assignment)


# -- names that do not exist -----------------------------------------------------------------------


def test_unknown_tensor_suggests_the_closest_names() -> None:
    _refused(models.branchy(), [TensorCut(("ee",))], match=r"^unknown tensor 'ee'; closest: 'e'")
    _refused(models.branchy(), [["a", "f_"]], match=r"^unknown tensor 'f_'; closest: 'f'")


def test_unknown_plain_name_is_neither_tensor_nor_node() -> None:
    _refused(models.chain(), ["relu"], match=r"^unknown tensor or node 'relu'; closest: 'relu0'")


def test_unknown_node() -> None:
    _refused(models.chain(), [NodeCut("sig")], match=r"^unknown node 'sig'; closest: 'sig2'")
    # A node inside an If branch is not a top-level node.
    _refused(models.outer_scope(), [NodeCut("then_add")], match=r"^node 'then_add' is inside a subgraph of node 'if4' \(If\); only top-level nodes")
    _refused(models.outer_scope(), ["then_add"], match=r"^node 'then_add' is inside a subgraph of node 'if4'")


def test_op_type_missing() -> None:
    _refused(models.chain(), [("Relu2", 0)], match=r"^no node of op type 'Relu2'; closest: 'Relu'")
    # Every op type there is: a message never hides a choice the user needs (issue 22).
    _refused(models.chain(), [OpCut("Conv", 0)], match=r"^no node of op type 'Conv'; valid: 'Add', 'Mul', 'Relu', 'Sigmoid'$")


@pytest.mark.parametrize("index", [2, -1])
def test_op_index_out_of_range(index: int) -> None:
    _refused(
        models.branchy(),
        [("Relu", index)],
        match=rf"^op cut Relu:{index} is out of range: the model has 2 Relu node\(s\), indices 0\.\.1$",
    )


def test_unreadable_cut() -> None:
    _refused(models.chain(), [3], match=r"^cannot read cut 3: give a tensor name, a node name, a list of tensor names, or \(op_type, index\)$")


# -- cuts in the wrong place -----------------------------------------------------------------------


def test_cuts_out_of_order() -> None:
    _refused(
        models.chain(),
        ["c", "a"],
        match=re.escape("cut 2 at 'a' is not after cut 1 at 'c': node 'relu0' is already in stage 0 (cuts must be given in pipeline order)"),
    )
    # The same cut twice is not "after" itself either.
    _refused(models.branchy(), [NodeCut("n0"), "a"], match=r"^cut 2 at 'a' is not after cut 1 at node 'n0': node 'n0' is already in stage 0")
    # One tensor of a multi-tensor cut is enough to put it out of order.
    _refused(models.branchy(), ["d", ["e", "b"]], match=r"^cut 2 at 'e,b' is not after cut 1 at 'd': node 'n1' is already in stage 0")


def test_cut_leaving_the_last_stage_empty() -> None:
    _refused(models.chain(), ["a", "Y"], match=r"^the last cut at 'Y' leaves stage 2 empty: every node that computes a model output comes before it$")
    _refused(models.chain(), [("Mul", 0)], match=r"^the last cut at Mul:0 leaves stage 1 empty")
    # Both outputs made before the cut.
    _refused(models.two_outputs(), [["M", "Y"]], match=r"^the last cut at 'M,Y' leaves stage 1 empty")


def test_no_cuts() -> None:
    _refused(models.chain(), [], match=r"^no cuts given: name at least one tensor, node or \(op_type, index\) to cut after$")


def test_cut_at_a_model_input() -> None:
    _refused(models.two_inputs(), ["a", "Z"], match=r"^cannot cut at 'Z': it is a model input; a cut goes after a node that computes a tensor$")


@pytest.mark.parametrize(
    ("model", "name"),
    [(models.chain, "W"), (models.outer_scope, "zero"), (models.ir3_initializer_inputs, "W")],
    ids=["initializer", "initializer-read-by-a-body", "ir3-initializer-listed-as-input"],
)
def test_cut_at_an_initializer(model: Any, name: str) -> None:
    _refused(model(), [name], match=rf"^cannot cut at '{name}': it is an initializer \(a weight\); weights go with the stages that read them$")


def test_cut_at_a_weight_node_output() -> None:
    for tensor, node in (("C", "cC"), ("S", "cS"), ("K", "cK")):
        _refused(
            models.constants_shared(),
            ["a", tensor],
            match=rf"^cannot cut at '{tensor}': it is a weight computed by node '{node}' from constants alone; weights go with the stages that read them$",
        )
    _refused(models.constants_shared(), [NodeCut("cK")], match=r"^cannot cut after node 'cK': node 'cK' computes a weight \(it reads no pipeline input\)")
    _refused(models.constants_shared(), [("ConstantOfShape", 0)], match=r"^cannot cut after ConstantOfShape:0: node 'cK' computes a weight")


@pytest.mark.parametrize(
    ("model", "tensor", "owner"),
    [
        (models.outer_scope, "t_then", "'if4' (If)"),
        (models.outer_scope, "t_else", "'if4' (If)"),
        (models.outer_scope, "v_out", "'loop5' (Loop)"),
        (models.outer_scope, "v", "'loop5' (Loop)"),  # a body input
        (models.functions, "t_then", "'if3' (If)"),
    ],
)
def test_cut_inside_a_subgraph_names_the_owner(model: Any, tensor: str, owner: str) -> None:
    _refused(
        model(),
        [tensor],
        match=rf"^cannot cut at '{tensor}': it is inside a subgraph of node {re.escape(owner)}; cuts go between top-level nodes, e\.g\. after that node$",
    )


def test_cut_at_a_dead_tensor() -> None:
    _refused(models.dead_nodes(), ["na"], match=r"^cannot cut at 'na': it contributes to no model output \(node 'dead_neg' is dead\)$")
    _refused(models.dead_nodes(), ["a", ["ea"]], match=r"^cannot cut at 'ea': it contributes to no model output \(node 'dead_exp' is dead\)$")
    _refused(models.dead_nodes(), [NodeCut("dead_x")], match=r"^cannot cut after node 'dead_x': node 'dead_x' contributes to no model output$")


def test_cut_at_a_sequence_value() -> None:
    _refused(
        models.sequence_boundary(),
        ["s"],
        match=r"^stage 0 output 's' is a sequence_type value; only tensors can cross a stage boundary, move the cut$",
    )
    _refused(models.sequence_boundary(), assignment={"r0": 0, "mk1": 0, "at2": 1}, match=r"^stage 0 output 's' is a sequence_type value")
    assert verify(split(models.sequence_boundary(), ["a"]), models.sequence_boundary()).ok


# -- explicit assignments --------------------------------------------------------------------------

BRANCHY = {"n0": 0, "n1": 1, "n2": 1, "n3": 2, "n4": 2, "n5": 3, "n6": 3}


def test_assignment_with_a_backward_edge() -> None:
    _refused(
        models.branchy(),
        assignment=BRANCHY | {"n5": 1},  # n5 reads e from n4 in the later stage 2
        match=re.escape("node 'n5' in stage 1 reads 'e' from node 'n4' in stage 2; a stage can only read tensors of earlier stages"),
    )
    _refused(
        models.outer_scope(),
        assignment={"relu0": 1, "sig1": 0, "sum2": 1, "gt3": 1, "if4": 1, "loop5": 1},  # sig1 reads a from stage 1
        match=r"^node 'sig1' in stage 0 reads 'a' from node 'relu0' in stage 1",
    )
    # A read from inside a body counts: the If in stage 0 reads 'b' of stage 1 only in its branches.
    _refused(
        models.outer_scope(),
        assignment={"relu0": 1, "sig1": 1, "sum2": 0, "gt3": 0, "if4": 0, "loop5": 1},
        match=r"^node 'if4' in stage 0 reads 'b' from node 'sig1' in stage 1",
    )


def test_assignment_missing_nodes() -> None:
    partial = {k: v for k, v in BRANCHY.items() if k not in ("n2", "n6")}
    _refused(models.branchy(), assignment=partial, match=r"^assignment leaves 2 compute node\(s\) without a stage: 'n2', 'n6'$")
    _refused(models.branchy(), assignment={}, match=r"^assignment leaves 7 compute node\(s\) without a stage: 'n0', 'n1', 'n2', 'n3', 'n4' \(and 2 more\)$")


def test_assignment_with_a_gap_in_stage_numbers() -> None:
    _refused(
        models.branchy(),
        assignment={k: 2 * v for k, v in BRANCHY.items()},
        match=re.escape("assignment leaves stage 1 empty (stages used: [0, 2, 4, 6]); number stages 0, 1, 2, ... without gaps"),
    )
    _refused(models.chain(), assignment=dict.fromkeys(["relu0", "add1", "sig2", "mul3"], 1), match=r"^assignment leaves stage 0 empty")


@pytest.mark.parametrize("stage", [-1, 1.0, "1", True])
def test_assignment_with_a_bad_stage_number(stage: Any) -> None:
    _refused(
        models.chain(),
        assignment={"relu0": 0, "add1": 0, "sig2": 0, "mul3": stage},
        match=rf"^assignment of node 'mul3': stage must be an integer >= 0, got {re.escape(repr(stage))}$",
    )


def test_assignment_with_an_unknown_node() -> None:
    _refused(models.branchy(), assignment=BRANCHY | {"n7": 3}, match=r"^assignment names unknown node 'n7'; closest: ")
    # A named node is named by its name, not by its output tensor.
    _refused(models.branchy(), assignment={"a" if k == "n0" else k: v for k, v in BRANCHY.items()}, match=r"^assignment names unknown node 'a'")


def test_cuts_and_assignment_together() -> None:
    _refused(models.branchy(), ["a"], assignment=BRANCHY, match=r"^give one of cuts, assignment or policy, not cuts and assignment$")


def test_neither_cuts_nor_assignment() -> None:
    _refused(models.branchy(), match=r"^give cuts, an assignment or a policy$")


# -- files -----------------------------------------------------------------------------------------


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(SplitError, match=r"^model file '.*nothing\.onnx' does not exist$"):
        split(tmp_path / "nothing.onnx", ["a"])


def test_file_that_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\xff\xfe not protobuf")
    with pytest.raises(SplitError, match=r"^cannot read '.*bad\.onnx' as an ONNX model: "):
        split(path, ["a"])


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_save_into_a_non_empty_folder_needs_overwrite(tmp_path: Path) -> None:
    plan = split(models.chain(), ["a"])
    folder = tmp_path / "out"
    (folder / "sub").mkdir(parents=True)
    (folder / "keep.txt").write_text("mine")
    (folder / "sub" / "stage0.onnx").write_bytes(b"not a stage")
    before = _snapshot(folder)
    with pytest.raises(SplitError, match=r"^output folder '.*out' exists and is not empty; choose another or overwrite it$"):
        plan.save(folder)
    assert _snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left beside it
    # With overwrite the folder is replaced whole.
    plan.save(folder, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["pipeline.json", "stage0.onnx", "stage1.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert verify(folder, models.chain()).ok


def test_save_into_an_empty_folder_is_fine(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    split(models.chain(), ["a"]).save(folder)
    assert (folder / "pipeline.json").is_file()


def test_verify_refuses_a_folder_without_a_pipeline(tmp_path: Path) -> None:
    with pytest.raises(SplitError, match=r"is not a split folder: it has no pipeline\.json$"):
        verify(tmp_path, models.chain())


def test_split_errors_are_onnxpipe_errors() -> None:
    with pytest.raises(OnnxpipeError, match=r"^give cuts, an assignment or a policy$"):
        split(models.chain())
