"""Random models through the whole job: split -> build -> export -> load -> run (issue 10, bug 3).

A sibling of the DAG strategy of ``tests/splitter/test_property.py``, with what real exports bring
and that one leaves out: inputs whose dynamic dims are declared ``-1``, without a value or a name, or
by name; float16 models; If nodes reading an outer-scope tensor, whose branches may make tensors of
different ranks (the branch taken is fixed by a constant condition, so shape inference cannot
tell the rank but every run has the same one). Every draw must either be refused by ``split`` with
an :class:`OnnxpipeError` (a cut that leaves a stage empty, say), or go through build, export (a
folder or an archive), load and run to outputs equal to onnxruntime's on the whole model; any other
exception, anywhere, is a bug and fails the test.

Tolerance: float32 models, verify's default (rtol 1e-4, atol 1e-5: the same kernels on the same
values). float16 models, rtol 1e-2 and atol 1e-2: a stage boundary rounds a tensor to float16 where
the whole model's session may keep float32 between cast-wrapped kernels (one fp16 ulp, 2^-10 =
9.8e-4 relative, per boundary), and up to three boundaries and later ops (a Sub of close values)
compound a few ulps. 1500 draws checked at 1e-3 all passed; 1e-2 is headroom against rare draws.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxpipe import OnnxpipeError
from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import UniformPolicy, split

UNARY = ("Relu", "Sigmoid", "Tanh", "Neg", "Abs")
BINARY = ("Add", "Sub", "Mul", "Max")
ROWS, COLS = 2, 3  # every tensor is [ROWS, COLS] at run time, whatever its declared dims
TOLERANCE = {TensorProto.FLOAT: (1e-4, 1e-5), TensorProto.FLOAT16: (1e-2, 1e-2)}


@dataclass
class Case:
    """A random model, the tensors a cut may name (computed and live, in topological order), and its dtype."""

    model: ModelProto
    live: list[str]
    elem_type: int


def _branch(name: str, node: onnx.NodeProto, elem_type: int) -> onnx.GraphProto:
    # Branch outputs declared without a shape, as exporters write them.
    return helper.make_graph([node], name, [], [helper.make_tensor_value_info(node.output[0], elem_type, None)])


@st.composite
def models(draw: st.DrawFn) -> Case:
    elem_type = draw(st.sampled_from([TensorProto.FLOAT, TensorProto.FLOAT16]))
    np_type = helper.tensor_dtype_to_np_dtype(elem_type)
    inputs = []
    for i in range(draw(st.integers(1, 2))):
        # fixed, PaddlePaddle's -1, no value nor name, named, and PaddlePaddle's "?" (a name that binds nothing)
        rows = draw(st.sampled_from([ROWS, -1, None, "N", "?"]))
        cols = draw(st.sampled_from([COLS, COLS, -1, None, "?"]))
        inputs.append(helper.make_tensor_value_info(f"X{i}", elem_type, [rows, cols]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal((ROWS, COLS))).astype(np_type), "W0")]
    available = [v.name for v in inputs] + ["W0"]
    computed: list[str] = []
    reads: dict[str, list[str]] = {}  # tensor -> what its node reads, outer-scope reads included
    nodes = []
    for k in range(draw(st.integers(3, 8))):
        op = draw(st.sampled_from(UNARY + BINARY + ("If", "If")))
        out = f"t{k}"
        # The first operand is most often the newest computed tensor (deep chains).
        pool = computed or [v.name for v in inputs]
        first = pool[-1] if draw(st.booleans()) else draw(st.sampled_from(pool))
        if op == "If":
            then = _branch(f"then{k}", helper.make_node(draw(st.sampled_from(UNARY)), [first], [f"{out}_then"]), elem_type)
            rank_changing = draw(st.booleans())
            if rank_changing:  # never taken: the condition is true
                axes = f"axes{k}"
                inits.append(numpy_helper.from_array(np.array([0], np.int64), axes))
                other = helper.make_node("Unsqueeze", [first, axes], [f"{out}_else"])
                cond = True
            else:
                other = helper.make_node(draw(st.sampled_from(UNARY)), [first], [f"{out}_else"])
                cond = draw(st.booleans())
            inits.append(numpy_helper.from_array(np.array(cond), f"cond{k}"))
            nodes.append(helper.make_node("If", [f"cond{k}"], [out], name=f"n{k}", then_branch=then, else_branch=_branch(f"else{k}", other, elem_type)))
        elif op in BINARY:
            nodes.append(helper.make_node(op, [first, draw(st.sampled_from(available))], [out], name=f"n{k}"))
        else:
            nodes.append(helper.make_node(op, [first], [out], name=f"n{k}"))
        reads[out] = [first, *nodes[-1].input]
        computed.append(out)
        available.append(out)
    extra = draw(st.lists(st.sampled_from(computed[:-1]), max_size=1))
    outputs = [helper.make_tensor_value_info(name, elem_type, [None, COLS]) for name in [computed[-1], *extra]]
    live: set[str] = set()
    stack = [v.name for v in outputs]
    while stack:
        name = stack.pop()
        if name in reads and name not in live:
            live.add(name)
            stack.extend(reads[name])
    graph = helper.make_graph(nodes, "rich", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    # Not full_check: onnx's strict inference takes -1 for a size (-1 vs 2 "Incompatible dimensions"),
    # onnxruntime and the splitter do not.
    onnx.checker.check_model(model)
    return Case(model, [t for t in computed if t in live], elem_type)


@settings(max_examples=int(os.environ.get('PROPERTY_EXAMPLES', 30)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=models(), data=st.data())
def test_whole_job_matches_the_model_or_refuses_as_a_user_error(case: Case, data: st.DataObject) -> None:
    picked = sorted(data.draw(st.lists(st.sampled_from(case.live), min_size=1, max_size=3, unique=True)), key=case.live.index)
    archive = data.draw(st.booleans())
    rng = np.random.default_rng(0)
    np_type = helper.tensor_dtype_to_np_dtype(case.elem_type)
    feeds = {v.name: rng.standard_normal((ROWS, COLS)).astype(np_type) for v in case.model.graph.input}
    want = ort.InferenceSession(case.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    # Mostly hand cuts; sometimes the uniform policy, which places cuts by itself.
    policy = UniformPolicy(stages=len(picked) + 1) if data.draw(st.integers(0, 3)) == 0 else None
    try:
        plan = split(case.model, policy=policy) if policy else split(case.model, picked)
    except OnnxpipeError as e:
        event(f"refused: {type(e).__name__}: {str(e).split(';')[0][:60]}")
        return
    # A split accepted, the rest must reproduce the whole model on inputs it takes: a pipeline that
    # refuses them (a -1 dim read as a size) is a bug even when it says so as an OnnxpipeError.
    with tempfile.TemporaryDirectory(prefix="onnxpipe-property-") as tmp:
        built = build(plan.config, Path(tmp) / "built")
        bundle = export(built.path, Path(tmp) / ("m.onnxpipe" if archive else "bundle"))
        with load(bundle) as pipe:
            got = pipe(feeds)
    event(f"{len(plan.stages)} stages, {'float16' if case.elem_type == TensorProto.FLOAT16 else 'float32'}")
    event("If node in the model" if any(n.op_type == "If" for n in case.model.graph.node) else "no If node")
    if any("cannot tell the rank" in n for n in plan.notes):
        event("a boundary of unknown rank")
    if any(d.dim_value < 0 or not (d.HasField("dim_value") or d.dim_param) for v in case.model.graph.input for d in v.type.tensor_type.shape.dim):
        event("an input dim declared -1 or without value nor name")
    if any(d.dim_param == "?" for v in case.model.graph.input for d in v.type.tensor_type.shape.dim):
        event("an input dim named '?'")
    rtol, atol = TOLERANCE[case.elem_type]
    for v, expected in zip(case.model.graph.output, want, strict=True):
        np.testing.assert_allclose(got[v.name].astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol, err_msg=v.name)
