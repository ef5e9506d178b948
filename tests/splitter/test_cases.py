"""Every tiny model of the registry, split in every way a cut can be written.

Each case names the expected stages (node names, weight nodes included), the initializers and local
functions each stage carries, and the tensors at each stage's boundary. Every cut form of a case --
tensor names, a list of tensors as one cut, node names, ``(op_type, index)`` and an explicit
assignment -- must give exactly those stages, and every split must pass ``verify`` on two random
inputs, the full onnx checker, and the generic checks of :func:`check_plan`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import GraphProto, ModelProto

from onnxpipe.runtime import Endpoint, Link, dtype_from_onnx
from onnxpipe.splitter import NodeCut, OpCut, SplitPlan, TensorCut, split, verify
from tests import models

# -- generic checks --------------------------------------------------------------------------------


def _subgraphs(node: onnx.NodeProto) -> Iterable[GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        yield from attr.graphs


def _reads(graph: GraphProto) -> set[str]:
    """Every name a graph's nodes read, including what nested bodies read from outer scopes."""
    names: set[str] = set()
    for node in graph.node:
        names.update(x for x in node.input if x)
        for sub in _subgraphs(node):
            names |= _reads(sub)
    return names


def _called(nodes: Iterable[onnx.NodeProto], functions: dict[tuple[str, str], onnx.FunctionProto]) -> set[str]:
    """Names of local functions called by ``nodes``, through bodies and other functions."""
    found: set[str] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        f = functions.get((node.domain, node.op_type))
        if f is not None and f.name not in found:
            found.add(f.name)
            stack.extend(f.node)
        for sub in _subgraphs(node):
            stack.extend(sub.node)
    return found


def _meta(model: ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _types(model: ModelProto) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """(dtype, shape) of every top-level tensor of the whole model, by name (shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tt = v.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim)
        out[v.name] = (dtype_from_onnx(tt.elem_type), shape)
    return out


def check_plan(plan: SplitPlan, model: ModelProto | Path, tmp_path: Path, dims: dict[str, int] | None = None) -> Path:
    """Checks every split must pass; returns the folder the plan was saved to.

    - the chained stages equal the whole model on two random inputs (outputs and boundaries);
    - every stage passes the full onnx checker (the saved file when it has external data);
    - every stage is tagged with its index and the number of stages;
    - every boundary tensor keeps its original name, dtype and shape;
    - a stage carries exactly the initializers, weight nodes and functions its nodes read;
    - every stage input is linked from a pipeline input or straight from the stage that makes it.
    """
    folder = plan.save(tmp_path / "split")
    report = verify(folder, model, samples=2, dims=dims)
    assert report.ok, [r for r in report.rows if not r.ok]
    assert report.samples == 2
    whole = onnx.load(model, load_external_data=False) if isinstance(model, Path) else model
    types = _types(whole)
    functions = {(f.domain, f.name): f for f in whole.functions}
    weights = {t.name for t in whole.graph.initializer}
    spec = plan.spec
    links = set(spec.links)
    made_by: dict[str, str] = {}
    n = len(plan.stages)
    for stage in plan.stages:
        m = stage.model
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
        onnx.checker.check_model(folder / f"{stage.name}.onnx" if external else m, full_check=True)
        assert _meta(m)["onnxpipe.stage"] == str(stage.index)
        assert _meta(m)["onnxpipe.num_stages"] == str(n)
        assert stage.name == f"stage{stage.index}"
        for t in [*stage.inputs, *stage.outputs]:
            assert (t.dtype, t.shape) == types[t.name], t
        assert [v.name for v in m.graph.output] == [t.name for t in stage.outputs]
        assert [v.name for v in m.graph.input if v.name not in weights] == [t.name for t in stage.inputs]
        reads = _reads(m.graph) | {v.name for v in m.graph.output}
        assert {t.name for t in m.graph.initializer} == reads & weights
        for node in m.graph.node:
            assert any(o in reads for o in node.output), f"{node.name} computes nothing the stage uses"
        assert {f.name for f in m.functions} == _called(m.graph.node, functions)
        for t in stage.inputs:
            src = Endpoint(made_by[t.name], t.name) if t.name in made_by else Endpoint(None, t.name)
            assert Link(src, Endpoint(stage.name, t.name)) in links
        for t in stage.outputs:
            made_by[t.name] = stage.name
    return folder


# -- the cases -------------------------------------------------------------------------------------


@dataclass
class Case:
    """A model, the equivalent cut forms that split it, and what the stages must then be."""

    model: Callable[[], ModelProto]
    forms: list[Any]  # cut lists, or an assignment dict
    nodes: list[set[str]]  # every node of each stage, weight nodes included
    inputs: list[set[str]]
    outputs: list[set[str]]
    initializers: list[set[str]] = field(default_factory=list)
    functions: list[set[str]] = field(default_factory=list)
    dims: dict[str, int] | None = None


CASES = {
    "chain": Case(
        models.chain,
        forms=[
            ["a", "c"],
            ("a", "c"),  # a tuple of two strings reads as two cuts, not as one op cut
            ["relu0", "sig2"],
            [TensorCut(("a",)), NodeCut("sig2")],
            [("Relu", 0), ("Sigmoid", 0)],
            [OpCut("Relu", 0), ["c"]],
            {"relu0": 0, "add1": 1, "sig2": 1, "mul3": 2},
        ],
        nodes=[{"relu0"}, {"add1", "sig2"}, {"mul3"}],
        inputs=[{"X"}, {"a"}, {"c"}],
        outputs=[{"a"}, {"c"}, {"Y"}],
        initializers=[set(), {"W"}, set()],
    ),
    "branchy": Case(
        models.branchy,
        forms=[
            ["a", ["b", "c"], "e"],
            ["n0", TensorCut(("c", "b")), "n4"],
            [("Relu", 0), ["b", "c"], ("Mul", 0)],
            {"n0": 0, "n1": 1, "n2": 1, "n3": 2, "n4": 2, "n5": 3, "n6": 3},
        ],
        nodes=[{"n0"}, {"n1", "n2"}, {"n3", "n4"}, {"n5", "n6"}],
        inputs=[{"X"}, {"a"}, {"b", "c"}, {"a", "e"}],
        outputs=[{"a"}, {"b", "c"}, {"e"}, {"Y"}],
        initializers=[set(), set(), {"W"}, set()],
    ),
    "two_inputs": Case(
        models.two_inputs,
        forms=[["a", "b"], ["r0", "s1"], [("Relu", 0), ("Sigmoid", 0)], {"r0": 0, "s1": 1, "add2": 2}],
        nodes=[{"r0"}, {"s1"}, {"add2"}],
        inputs=[{"X"}, {"a"}, {"b", "Z"}],
        outputs=[{"a"}, {"b"}, {"Y"}],
    ),
    "two_outputs": Case(
        models.two_outputs,
        forms=[["a", "M"], ["r0", NodeCut("s1")], [("Relu", 0), ("Sigmoid", 0)], {"r0": 0, "s1": 1, "t2": 2, "add3": 2}],
        nodes=[{"r0"}, {"s1"}, {"t2", "add3"}],
        inputs=[{"X"}, {"a"}, {"a", "M"}],
        outputs=[{"a"}, {"M"}, {"Y"}],
    ),
    "dead_nodes": Case(
        models.dead_nodes,
        forms=[["a"], ["r0"], [("Relu", 0)], {"r0": 0, "s1": 1, "t2": 1}, {"r0": 0, "s1": 1, "t2": 1, "dead_neg": 0, "dead_w": 7}],
        nodes=[{"r0"}, {"s1", "t2"}],
        inputs=[{"X"}, {"a"}],
        outputs=[{"a"}, {"Y"}],
        initializers=[set(), set()],
    ),
    "ir3_initializer_inputs": Case(
        models.ir3_initializer_inputs,
        forms=[["a", "b"], ["add0", "r1"], [("Add", 0), ("Relu", 0)], {"add0": 0, "r1": 1, "mul2": 2, "add3": 2}],
        nodes=[{"add0"}, {"r1"}, {"mul2", "add3"}],
        inputs=[{"X"}, {"a"}, {"b"}],
        outputs=[{"a"}, {"b"}, {"Y"}],
        initializers=[{"W"}, set(), {"W", "V"}],
    ),
    "constants_shared": Case(
        models.constants_shared,
        forms=[["a", "b"], ["n0", "n1"], [("Add", 0), ("Mul", 0)], {"n0": 0, "n1": 1, "n2": 2, "n3": 2, "cC": 1}],
        nodes=[{"cC", "n0"}, {"cS", "cK", "n1"}, {"cC", "cS", "cK", "n2", "n3"}],
        inputs=[{"X"}, {"a"}, {"b"}],
        outputs=[{"a"}, {"b"}, {"Y"}],
    ),
    "outer_scope": Case(
        models.outer_scope,
        forms=[["b", "i"], ["sig1", "if4"], [("Sigmoid", 0), ("If", 0)], {"relu0": 0, "sig1": 0, "sum2": 1, "gt3": 1, "if4": 1, "loop5": 2}],
        nodes=[{"relu0", "sig1"}, {"sum2", "gt3", "if4"}, {"loop5"}],
        inputs=[{"X"}, {"X", "b"}, {"a", "i"}],
        outputs=[{"a", "b"}, {"i"}, {"Y"}],
        initializers=[set(), {"zero", "W"}, {"M"}],
    ),
    "functions": Case(
        models.functions,
        forms=[["a", "i"], ["f0", "if3"], [("AddOne", 0), ("If", 0)], {"f0": 0, "sum1": 1, "gt2": 1, "if3": 1, "f4": 2}],
        nodes=[{"f0"}, {"sum1", "gt2", "if3"}, {"f4"}],
        inputs=[{"X"}, {"a"}, {"i"}],
        outputs=[{"a"}, {"i"}, {"Y"}],
        initializers=[set(), {"zero"}, set()],
        functions=[{"AddOne"}, {"Twice"}, {"Wrap", "Inner"}],
    ),
    "symbolic_batch": Case(
        models.symbolic_batch,
        forms=[["a"], "a", ["mm0"], [("MatMul", 0)], {"mm0": 0, "r1": 1, "add2": 1}],
        nodes=[{"mm0"}, {"r1", "add2"}],
        inputs=[{"X"}, {"a"}],
        outputs=[{"a"}, {"Y"}],
        initializers=[{"W"}, {"B"}],
        dims={"N": 3},
    ),
}

FORMS = [pytest.param(name, k, id=f"{name}-{k}") for name, case in CASES.items() for k in range(len(case.forms))]


def _split(model: ModelProto | Path, form: Any) -> SplitPlan:
    return split(model, assignment=form) if isinstance(form, dict) else split(model, form)


@pytest.mark.parametrize(("name", "k"), FORMS)
def test_every_cut_form_gives_the_expected_stages(name: str, k: int, tmp_path: Path) -> None:
    case = CASES[name]
    model = case.model()
    source = model.SerializeToString()
    plan = _split(model, case.forms[k])
    assert model.SerializeToString() == source, "split must not modify the model it is given"
    assert [{n.name for n in s.model.graph.node} for s in plan.stages] == case.nodes
    assert [{t.name for t in s.inputs} for s in plan.stages] == case.inputs
    assert [{t.name for t in s.outputs} for s in plan.stages] == case.outputs
    assert [{t.name for t in s.model.graph.initializer} for s in plan.stages] == (case.initializers or [set()] * len(case.nodes))
    assert [{f.name for f in s.model.functions} for s in plan.stages] == (case.functions or [set()] * len(case.nodes))
    check_plan(plan, model, tmp_path, case.dims)


# -- what each model is there to show --------------------------------------------------------------


def _links(plan: SplitPlan) -> set[str]:
    return {str(link) for link in plan.spec.links}


def test_skip_edge_is_linked_straight_from_its_producer() -> None:
    plan = split(models.branchy(), ["a", ["b", "c"], "e"])
    assert _links(plan) == {
        "pipeline.X -> stage0.X",
        "stage0.a -> stage1.a",
        "stage0.a -> stage3.a",  # the skip edge: not relayed through stages 1 and 2
        "stage1.b -> stage2.b",
        "stage1.c -> stage2.c",
        "stage2.e -> stage3.e",
        "stage3.Y -> pipeline.Y",
    }
    assert [s.name for s in plan.spec.stages] == ["stage0", "stage1", "stage2", "stage3"]
    # Bytes per request: two float[1,4] tensors cross the middle cut.
    assert (plan.stages[2].bytes_in, plan.stages[1].bytes_out) == (32, 32)


def test_late_input_is_fed_straight_to_its_stage() -> None:
    plan = split(models.two_inputs(), ["a"])
    assert _links(plan) == {"pipeline.X -> stage0.X", "stage0.a -> stage1.a", "pipeline.Z -> stage1.Z", "stage1.Y -> pipeline.Y"}
    assert [t.name for t in plan.spec.inputs] == ["X", "Z"]


def test_middle_output_feeds_the_pipeline_and_the_next_stage() -> None:
    plan = split(models.two_outputs(), ["a", "M"])
    assert _links(plan) == {
        "pipeline.X -> stage0.X",
        "stage0.a -> stage1.a",
        "stage0.a -> stage2.a",
        "stage1.M -> stage2.M",
        "stage1.M -> pipeline.M",
        "stage2.Y -> pipeline.Y",
    }
    assert [t.name for t in plan.spec.outputs] == ["M", "Y"]


def test_dead_nodes_are_dropped_and_reported() -> None:
    plan = split(models.dead_nodes(), ["a"])
    assert plan.dropped == ["'dead_neg'", "'dead_exp'", "'dead_x'"]
    assert any("3 dead node(s)" in n and "'dead_exp'" in n for n in plan.notes)
    kept = {n.name for s in plan.stages for n in s.model.graph.node}
    assert kept == {"r0", "s1", "t2"}
    assert not any(s.model.graph.initializer for s in plan.stages)  # K is read by dead nodes only


def test_no_dead_nodes_no_drop_note() -> None:
    plan = split(models.chain(), ["a"])
    assert plan.dropped == []
    assert plan.notes == []


def test_ir3_keeps_its_ir_version_and_lists_initializers_as_inputs() -> None:
    plan = split(models.ir3_initializer_inputs(), ["a", "b"])
    assert [s.model.ir_version for s in plan.stages] == [3, 3, 3]
    assert [[v.name for v in s.model.graph.input] for s in plan.stages] == [["X", "W"], ["a"], ["b", "W", "V"]]
    # ... but only real inputs are boundary tensors a caller or an earlier stage feeds.
    assert [[t.name for t in s.inputs] for s in plan.stages] == [["X"], ["a"], ["b"]]
    assert [t.name for t in plan.spec.inputs] == ["X"]
    assert not any("IR" in n for n in plan.notes)
    for s in plan.stages:
        assert s.model.opset_import[0].version == 9


def test_shared_weights_are_stored_in_every_stage_that_reads_them() -> None:
    plan = split(models.ir3_initializer_inputs(), ["a"])
    assert [s.weights_bytes for s in plan.stages] == [16, 32]
    assert [s.weight_nodes for s in plan.stages] == [0, 0]
    plan = split(models.constants_shared(), ["a", "b"])
    assert [(s.nodes, s.weight_nodes) for s in plan.stages] == [(1, 1), (1, 2), (2, 3)]
    # Weights computed by nodes count by what the compute nodes read: C and K, not the shape S.
    assert [s.weights_bytes for s in plan.stages] == [16, 16, 32]


def test_outer_scope_reads_become_stage_inputs() -> None:
    plan = split(models.outer_scope(), ["b", "i"])
    # Stage 1 reads b only inside the If's branches, stage 2 reads a only inside the Loop's body.
    assert "b" not in plan.stages[1].model.graph.node[2].input
    assert _links(plan) >= {"stage0.b -> stage1.b", "stage0.a -> stage2.a"}


def test_symbolic_batch_dim_is_kept_by_name() -> None:
    plan = split(models.symbolic_batch(), ["a"])
    assert plan.stages[0].outputs[0].shape == ("N", 3)
    assert plan.stages[1].inputs[0].shape == ("N", 3)
    dim = plan.stages[1].model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dim] == ["N", 3]
    assert plan.stages[0].bytes_out is None  # unknown until the batch size is


def test_split_reads_a_model_file(tmp_path: Path) -> None:
    path = tmp_path / "chain.onnx"
    onnx.save_model(models.chain(), path)
    plan = split(path, ["a"])
    check_plan(plan, path, tmp_path)


def test_verify_takes_a_plan_or_a_folder(tmp_path: Path) -> None:
    model = models.branchy()
    plan = split(model, ["a", ["b", "c"], "e"])
    for report in (verify(plan, model, samples=3), verify(plan.save(tmp_path / "s"), model, samples=3)):
        assert report.ok
        assert report.samples == 3
        assert {(r.tensor, r.kind) for r in report.rows} == {("Y", "output"), ("a", "boundary"), ("b", "boundary"), ("c", "boundary"), ("e", "boundary")}


# -- external data ---------------------------------------------------------------------------------

EXTERNAL_STAGES = [{"W0", "Wsh"}, {"W1"}, {"W2", "Wsh"}]


@pytest.mark.parametrize(
    "form",
    [["b", "c"], ["add1", NodeCut("mm2")], [("Add", 0), ("MatMul", 0)], {"mul0": 0, "add1": 0, "mm2": 1, "add3": 2, "mul4": 2}],
    ids=["tensors", "nodes", "ops", "assignment"],
)
def test_external_data_each_stage_stores_exactly_its_weights(form: Any, tmp_path: Path) -> None:
    path = models.external_data(tmp_path / "model")
    plan = _split(path, form)
    assert [{t.name for t in s.model.graph.initializer} for s in plan.stages] == EXTERNAL_STAGES
    assert [s.weights_bytes for s in plan.stages] == [sum(models.EXTERNAL_WEIGHT_BYTES[w] for w in ws) for ws in EXTERNAL_STAGES]
    assert not any("IR" in n for n in plan.notes)
    assert [s.model.ir_version for s in plan.stages] == [8, 8, 8]
    folder = check_plan(plan, path, tmp_path)
    _assert_own_data_files(folder, onnx.load(path))


def test_external_data_of_an_ir3_model_upgrades_stages_to_ir4(tmp_path: Path) -> None:
    path = models.external_data(tmp_path / "model", ir_version=3)
    plan = split(path, ["b", "c"])
    assert [s.model.ir_version for s in plan.stages] == [4, 4, 4]
    assert [n for n in plan.notes if "IR" in n] == ["IR version 3 -> 4 in every stage: external data needs IR version 4 or later"]
    folder = check_plan(plan, path, tmp_path)
    _assert_own_data_files(folder, onnx.load(path))


def _assert_own_data_files(folder: Path, whole: ModelProto) -> None:
    """Each stage's data file holds its own weights, byte for byte, and nothing else."""
    values = {t.name: onnx.numpy_helper.to_array(t) for t in whole.graph.initializer}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["pipeline.json"] + [f"stage{i}.onnx" for i in range(3)] + [f"stage{i}.onnx.data" for i in range(3)]
    )
    for i, expected in enumerate(EXTERNAL_STAGES):
        stage_file = folder / f"stage{i}.onnx"
        refs = onnx.load(stage_file, load_external_data=False).graph.initializer
        assert {t.name for t in refs} == expected
        spans = []
        for t in refs:
            info = {e.key: e.value for e in t.external_data}
            assert info["location"] == f"stage{i}.onnx.data"
            spans.append((int(info["offset"]), int(info["length"])))
            assert int(info["length"]) == models.EXTERNAL_WEIGHT_BYTES[t.name]
        spans.sort()
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans)), "weights overlap"
        size = (folder / f"stage{i}.onnx.data").stat().st_size
        assert size >= sum(models.EXTERNAL_WEIGHT_BYTES[w] for w in expected)
        assert size == max(a + n for a, n in spans), "the data file holds bytes after its last weight"
        loaded = onnx.load(stage_file)
        for t in loaded.graph.initializer:
            assert (onnx.numpy_helper.to_array(t) == values[t.name]).all()


# -- a real model ----------------------------------------------------------------------------------


def test_light_model_stages_carry_only_the_weight_nodes_they_read(tmp_path: Path) -> None:
    # squeezenet: unnamed nodes, every weight made by a ConstantOfShape from an IR 3 initializer.
    path = models.light_model_path("squeezenet")
    model = onnx.load(path)
    relus = [n.output[0] for n in model.graph.node if n.op_type == "Relu"]
    plan = split(path, [relus[len(relus) // 3], relus[2 * len(relus) // 3]])
    assert len(plan.stages) == 3
    assert all(s.weight_nodes > 0 for s in plan.stages)
    kept = [n for s in plan.stages for n in s.model.graph.node if n.op_type != "ConstantOfShape"]
    assert len(kept) == sum(s.nodes for s in plan.stages)
    check_plan(plan, path, tmp_path)
    # Nodes without a name are assigned by one of their output tensors.
    anonymous = onnx.ModelProto()
    anonymous.CopyFrom(model)
    for node in anonymous.graph.node:
        node.name = ""
    by_output = {n.output[-1]: s.index for s in plan.stages for n in s.model.graph.node if n.op_type != "ConstantOfShape"}
    again = split(anonymous, assignment=by_output)
    assert [{n.output[0] for n in s.model.graph.node} for s in again.stages] == [{n.output[0] for n in s.model.graph.node} for s in plan.stages]
