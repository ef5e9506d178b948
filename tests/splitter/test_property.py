"""Random DAG models, random cuts and assignments: the chained stages must equal the whole model.

The expected stages are worked out here from the cut semantics of :mod:`onnxpipe.splitter._cuts`
(stage ``i`` holds what cut ``i`` depends on beyond earlier stages, the last stage the rest),
independently of the splitter's own graph analysis. A draw the splitter must refuse is checked for
the right refusal, never skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxpipe import SplitError
from onnxpipe.splitter import NodeCut, OpCut, SplitPlan, split, verify

UNARY = ("Relu", "Sigmoid", "Tanh", "Neg", "Abs")
BINARY = ("Add", "Sub", "Mul", "Max")
SHAPE = [2, 3]

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Dag:
    """A random model and what the tests need to know about it, worked out without the splitter."""

    model: ModelProto
    names: list[str]  # node names, in topological (file) order; node k makes tensor t<k>
    ops: list[str]
    reads: list[list[str]]
    weight: list[bool]  # the node computes from initializers alone
    live: list[bool]  # the node contributes to an output
    outputs: list[str]

    @property
    def compute(self) -> list[int]:
        """Live compute nodes in topological order: the nodes a split assigns."""
        return [k for k in range(len(self.names)) if self.live[k] and not self.weight[k]]

    def ancestors(self, k: int) -> set[int]:
        """Compute nodes ``k`` depends on, ``k`` included."""
        found: set[int] = set()
        stack = [k]
        while stack:
            j = stack.pop()
            if j in found or self.weight[j]:
                continue
            found.add(j)
            stack.extend(int(x[1:]) for x in self.reads[j] if x.startswith("t"))
        return found

    def weight_nodes(self, reads: set[str]) -> set[int]:
        """Weight nodes needed to compute the tensors in ``reads``."""
        found: set[int] = set()
        stack = [int(x[1:]) for x in reads if x.startswith("t")]
        while stack:
            j = stack.pop()
            if j in found or not self.weight[j]:
                continue
            found.add(j)
            stack.extend(int(x[1:]) for x in self.reads[j] if x.startswith("t"))
        return found


@st.composite
def dags(draw: st.DrawFn) -> Dag:
    n_inputs = draw(st.integers(1, 3))
    n_inits = draw(st.integers(0, 2))
    n_nodes = draw(st.sampled_from(range(10, 2, -1)))  # drawn from 10 down: shrinks to big graphs, not to trivial ones
    inputs = [f"X{i}" for i in range(n_inputs)]
    inits = [f"W{i}" for i in range(n_inits)]
    weight_tensors = set(inits)
    available = inputs + inits
    ops: list[str] = []
    reads: list[list[str]] = []
    weight: list[bool] = []
    for k in range(n_nodes):
        op = draw(st.sampled_from(UNARY + BINARY))
        pool = available
        # The first operand is most often the newest computed tensor (deep chains), sometimes a
        # weight (making a weight node); the second any earlier one (skip edges, fan-out, shared
        # initializers). The last node reads a computed tensor, so some node computes an output.
        computed = [t for t in available if t not in weight_tensors]
        if k == n_nodes - 1:
            args = [computed[-1]]
        else:
            first = available if draw(st.sampled_from([False, False, False, True])) else computed
            args = [first[-1] if draw(st.sampled_from([True, True, False])) else draw(st.sampled_from(first))]
        if op in BINARY:
            args.append(draw(st.sampled_from(pool)))
        ops.append(op)
        reads.append(args)
        weight.append(all(a in weight_tensors for a in args))
        if weight[-1]:
            weight_tensors.add(f"t{k}")
        available.append(f"t{k}")
    produced = [f"t{k}" for k in range(n_nodes)]
    extra = draw(st.lists(st.sampled_from(produced[:-1]), max_size=2, unique=True))
    outputs = draw(st.permutations([produced[-1], *extra]))
    live = [False] * n_nodes
    stack = [int(o[1:]) for o in outputs]
    while stack:
        k = stack.pop()
        if not live[k]:
            live[k] = True
            stack.extend(int(x[1:]) for x in reads[k] if x.startswith("t"))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    value = [helper.make_tensor_value_info(name, TensorProto.FLOAT, SHAPE) for name in inputs]
    graph = helper.make_graph(
        [helper.make_node(op, args, [f"t{k}"], name=f"n{k}") for k, (op, args) in enumerate(zip(ops, reads, strict=True))],
        "dag",
        value,
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, SHAPE) for o in outputs],
        initializer=[numpy_helper.from_array(rng.standard_normal(SHAPE).astype(np.float32), w) for w in inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return Dag(model, [f"n{k}" for k in range(n_nodes)], ops, reads, weight, live, outputs)


def _cut_form(dag: Dag, k: int, how: int) -> object:
    """One way to write the cut after node ``k``: its tensor, its name, NodeCut or OpCut."""
    if how == 0:
        return f"t{k}"
    if how == 1:
        return dag.names[k]
    if how == 2:
        return NodeCut(dag.names[k])
    return OpCut(dag.ops[k], dag.ops[:k].count(dag.ops[k]))


def _assert_equal_to_whole(plan: SplitPlan, dag: Dag, expected: list[set[int]]) -> None:
    """The plan has the expected compute nodes per stage, and the weight nodes they read, and
    its chained stages compute what the whole model does."""
    got = [{int(n.name[1:]) for n in s.model.graph.node} for s in plan.stages]
    assert [g - set(dag.weight_nodes({f"t{k}" for k in g})) for g in got] == expected
    for s, (g, nodes) in enumerate(zip(got, expected, strict=True)):
        reads = {x for k in nodes for x in dag.reads[k]}
        if s == len(expected) - 1:
            reads |= set(dag.outputs)  # an output computed from weights alone comes from the last stage
        assert g - nodes == dag.weight_nodes(reads), f"stage {s}: weight nodes"
    report = verify(plan, dag.model, samples=2)
    assert report.ok, [r for r in report.rows if not r.ok]


@SETTINGS
@given(data=st.data())
def test_random_valid_cuts(data: st.DataObject) -> None:
    dag = data.draw(dags())
    compute = dag.compute
    event(f"{len(compute)} compute nodes")
    # The last node makes an output and feeds nothing: leaving it out of the picks keeps the last
    # stage non-empty; one draw in four may pick it (and maybe get the 'empty' refusal).
    pool = compute if len(compute) == 1 or data.draw(st.integers(0, 3)) == 0 else compute[:-1]
    k = min(len(pool), data.draw(st.sampled_from([3, 2, 1])))
    picked = sorted(data.draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k, unique=True)))
    # Adjacent picks may be merged into one cut crossed by several tensors.
    groups: list[list[int]] = [[picked[0]]]
    for p in picked[1:]:
        if data.draw(st.booleans()):
            groups[-1].append(p)
        else:
            groups.append([p])
    cuts: list[Any] = []
    for g in groups:
        if len(g) > 1:
            cuts.append([f"t{p}" for p in g])
        else:
            cuts.append(_cut_form(dag, g[0], data.draw(st.integers(0, 3))))
    expected: list[set[int]] = []
    done: set[int] = set()
    for g in groups:
        stage = set().union(*(dag.ancestors(p) for p in g)) - done
        expected.append(stage)
        done |= stage
    rest = set(compute) - done
    event(f"{len(groups)} cut(s), {'some merged' if len(groups) < len(picked) else 'none merged'}")
    if not rest:
        event("last stage empty: refused")
        with pytest.raises(SplitError, match=rf"^the last cut at .* leaves stage {len(groups)} empty"):
            split(dag.model, cuts)
        return
    expected.append(rest)
    _assert_equal_to_whole(split(dag.model, cuts), dag, expected)


@SETTINGS
@given(data=st.data())
def test_random_cuts_out_of_order(data: st.DataObject) -> None:
    dag = data.draw(dags())
    pairs = [(a, b) for b in dag.compute for a in sorted(dag.ancestors(b) - {b})]
    assume(pairs)
    early, late = data.draw(st.sampled_from(pairs))
    cuts = [_cut_form(dag, late, data.draw(st.integers(0, 3))), _cut_form(dag, early, data.draw(st.integers(0, 3)))]
    with pytest.raises(SplitError, match=rf"^cut 2 at .* is not after cut 1 at .*: node '{dag.names[early]}' is already in stage 0"):
        split(dag.model, cuts)


@SETTINGS
@given(data=st.data())
def test_random_assignments(data: st.DataObject) -> None:
    dag = data.draw(dags())
    compute = dag.compute
    stage_of: dict[int, int] = {}
    monotone = data.draw(st.integers(0, 3)) > 0  # else any stage for any node: mostly refused
    for k in compute:
        if monotone:
            before = [stage_of[j] for x in dag.reads[k] if x.startswith("t") and (j := int(x[1:])) in stage_of]
            stage_of[k] = max(before, default=0) + data.draw(st.sampled_from([1, 0]))
        else:
            stage_of[k] = data.draw(st.integers(0, 2))
    if monotone:  # number the stages used 0, 1, 2, ...: a valid assignment
        renumber = {s: i for i, s in enumerate(sorted(set(stage_of.values())))}
        stage_of = {k: renumber[s] for k, s in stage_of.items()}
    assignment = {dag.names[k]: s for k, s in stage_of.items()}
    # Weight nodes and dead nodes may be listed too; whatever stage they are given is ignored.
    ignored = [k for k in range(len(dag.names)) if k not in stage_of]
    for k in data.draw(st.lists(st.sampled_from(ignored), unique=True)) if ignored else []:
        assignment[dag.names[k]] = data.draw(st.integers(0, 5))
    used = sorted(set(stage_of.values()))
    backward = [(k, j) for k in compute for x in dag.reads[k] if x.startswith("t") and (j := int(x[1:])) in stage_of and stage_of[j] > stage_of[k]]
    if used != list(range(len(used))):
        event("gap: refused")
        with pytest.raises(SplitError, match=r"^assignment leaves stage \d empty"):
            split(dag.model, assignment=assignment)
    elif backward:
        event("backward edge: refused")
        k, j = backward[0]
        with pytest.raises(SplitError, match=re.escape(f"node '{dag.names[k]}' in stage {stage_of[k]} reads 't{j}' from node '{dag.names[j]}'")):
            split(dag.model, assignment=assignment)
    else:
        event(f"valid, {len(used)} stage(s)")
        expected = [{k for k in compute if stage_of[k] == s} for s in used]
        _assert_equal_to_whole(split(dag.model, assignment=assignment), dag, expected)
