"""Hand cuts: from the ways a user names cut points to an assignment of nodes to stages.

Note: cut semantics.
    A cut is a set of tensors. With cuts ``c1 .. cK`` (given in pipeline order), stage 0 holds every
    compute node that ``c1`` depends on (the producers of its tensors and all their compute
    ancestors), stage ``i`` holds what ``c(i+1)`` depends on beyond stages ``0 .. i-1``, and the last
    stage holds every remaining compute node that contributes to an output. Weight nodes follow the
    stages that read them and dead nodes are dropped (see :mod:`onnxpipe.splitter._graph`). The
    tensors crossing a cut are whatever the later stages read from the earlier ones; they often
    include more than the cut's own tensors (the skip connection of a residual block, say).

    A cut may be given as
    - a tensor name, or a list/tuple of tensor names (one cut crossed by several tensors);
    - a node name (``NodeCut``): the cut goes after the node, i.e. at all its outputs;
    - ``(op_type, index)`` (``OpCut``): after the node that is the ``index``-th (from 0, as TVM's
      ``op_index``) node of that op type in the model's topological order;
    A plain string names a tensor when one has that name, else a node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from onnxpipe._errors import SplitError, closest
from onnxpipe.splitter._graph import GraphIndex

__all__ = ["Cut", "NodeCut", "OpCut", "TensorCut", "assign_by_cuts", "assign_explicit"]


@dataclass(frozen=True)
class TensorCut:
    """A cut after the given tensors (one cut, possibly crossed by several tensors)."""

    tensors: tuple[str, ...]

    def __str__(self) -> str:
        return ",".join(self.tensors)


@dataclass(frozen=True)
class NodeCut:
    """A cut after the named node (at all its outputs)."""

    node: str

    def __str__(self) -> str:
        return f"node {self.node}"


@dataclass(frozen=True)
class OpCut:
    """A cut after the ``index``-th (from 0) node of ``op_type`` in topological order."""

    op_type: str
    index: int

    def __str__(self) -> str:
        return f"{self.op_type}:{self.index}"


Cut = TensorCut | NodeCut | OpCut | str | tuple[str, int] | Sequence[str]


def _normalize(cut: object, index: GraphIndex) -> TensorCut | NodeCut | OpCut:
    if isinstance(cut, (TensorCut, NodeCut, OpCut)):
        return cut
    if isinstance(cut, str):
        if cut in index.producer or cut in index.weights or cut in index.inputs or cut in index.inner_owner:
            return TensorCut((cut,))
        if cut in index.by_name:
            return NodeCut(cut)
        if cut in index.inner_nodes:
            raise index.unknown_node(cut)
        names = list(index.tensor_names()) + list(index.by_name)
        raise SplitError(f"unknown tensor or node '{cut}'; {closest(cut, names)}")
    if isinstance(cut, tuple) and len(cut) == 2 and isinstance(cut[0], str) and isinstance(cut[1], int):
        return OpCut(cut[0], cut[1])
    if isinstance(cut, (list, tuple)) and cut and all(isinstance(x, str) for x in cut):
        return TensorCut(tuple(cut))
    raise SplitError(f"cannot read cut {cut!r}: give a tensor name, a node name, a list of tensor names, or (op_type, index)")


def _tensor_producers(cut: TensorCut | NodeCut | OpCut, index: GraphIndex) -> tuple[str, list[int]]:
    """The cut's description for messages and the compute nodes producing its tensors."""
    if isinstance(cut, NodeCut):
        if cut.node not in index.by_name:
            raise index.unknown_node(cut.node)
        return _after_node(index.by_name[cut.node], index, f"node '{cut.node}'")
    if isinstance(cut, OpCut):
        matching = [i for i in index.order if index.nodes[i].op_type == cut.op_type]
        if not matching:
            ops = {n.op_type for n in index.nodes}
            raise SplitError(f"no node of op type '{cut.op_type}'; {closest(cut.op_type, ops)}")
        if not 0 <= cut.index < len(matching):
            raise SplitError(
                f"op cut {cut.op_type}:{cut.index} is out of range: the model has {len(matching)} {cut.op_type} node(s), "
                f"indices 0..{len(matching) - 1}"
            )
        return _after_node(matching[cut.index], index, f"{cut.op_type}:{cut.index}")
    producers = []
    for name in cut.tensors:
        producers.append(_tensor_producer(name, index))
    return f"'{cut}'", producers


def _after_node(i: int, index: GraphIndex, what: str) -> tuple[str, list[int]]:
    if index.is_weight[i]:
        raise SplitError(f"cannot cut after {what}: node {index.label(i)} computes a weight (it reads no pipeline input); cut after a compute node")
    if not index.live[i]:
        raise SplitError(f"cannot cut after {what}: node {index.label(i)} contributes to no model output")
    return what, [i]


def _tensor_producer(name: str, index: GraphIndex) -> int:
    if name in index.inputs:
        raise SplitError(f"cannot cut at '{name}': it is a model input; a cut goes after a node that computes a tensor")
    if name in index.weights:
        raise SplitError(f"cannot cut at '{name}': it is an initializer (a weight); weights go with the stages that read them")
    if name not in index.producer:
        if name in index.inner_owner:
            owner = index.inner_owner[name]
            raise SplitError(
                f"cannot cut at '{name}': it is inside a subgraph of node {index.label(owner)} "
                f"({index.nodes[owner].op_type}); cuts go between top-level nodes, e.g. after that node"
            )
        raise SplitError(f"unknown tensor '{name}'; {closest(name, index.tensor_names())}")
    p = index.producer[name]
    if index.is_weight[p]:
        raise SplitError(
            f"cannot cut at '{name}': it is a weight computed by node {index.label(p)} from constants alone; "
            "weights go with the stages that read them"
        )
    if not index.live[p]:
        raise SplitError(f"cannot cut at '{name}': it contributes to no model output (node {index.label(p)} is dead)")
    return p


def assign_by_cuts(index: GraphIndex, cuts: Sequence[object]) -> dict[int, int]:
    """Assign every live compute node to a stage, following the cut semantics above.

    Raises:
        SplitError: unknown names, a cut at a non-cuttable tensor, cuts out of order, or a cut that
            leaves a stage empty.
    """
    if not cuts:
        raise SplitError("no cuts given: name at least one tensor, node or (op_type, index) to cut after")
    stage_of: dict[int, int] = {}
    previous = "the start"
    for k, raw in enumerate(cuts):
        what, producers = _tensor_producers(_normalize(raw, index), index)
        for p in producers:
            if p in stage_of:
                raise SplitError(
                    f"cut {k + 1} at {what} is not after cut {k} at {previous}: node {index.label(p)} "
                    f"is already in stage {stage_of[p]} (cuts must be given in pipeline order)"
                )
        stack = list(producers)
        while stack:
            i = stack.pop()
            if i in stage_of:
                continue
            stage_of[i] = k
            for name in index.node_inputs[i]:
                q = index.producer.get(name)
                if q is not None and q not in stage_of and not index.is_weight[q]:
                    stack.append(q)
        previous = what
    last = len(cuts)
    rest = [i for i in index.compute_nodes() if i not in stage_of]
    if not rest:
        raise SplitError(f"the last cut at {previous} leaves stage {last} empty: every node that computes a model output comes before it")
    for i in rest:
        stage_of[i] = last
    return stage_of


def assign_explicit(index: GraphIndex, assignment: Mapping[str, int]) -> dict[int, int]:
    """Check and resolve an explicit node -> stage assignment.

    Keys name nodes; a node without a name is named by one of its output tensors. Every live compute
    node must be assigned; weight nodes and dead nodes may be listed and are ignored (weights follow
    their readers). Stages are numbered from 0 with no gap.

    Raises:
        SplitError: unknown node, missing nodes, bad or gapped stage numbers, or a node reading a
            tensor from a later stage.
    """
    stage_of: dict[int, int] = {}
    for key, stage in assignment.items():
        i = index.by_name.get(key)
        if i is None and key in index.producer and not index.nodes[index.producer[key]].name:
            i = index.producer[key]
        if i is None:
            raise index.unknown_node(key, "assignment names unknown node")
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise SplitError(f"assignment of node '{key}': stage must be an integer >= 0, got {stage!r}")
        if index.is_compute(i):
            stage_of[i] = stage
    missing = [index.label(i) for i in index.compute_nodes() if i not in stage_of]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise SplitError(f"assignment leaves {len(missing)} compute node(s) without a stage: {', '.join(missing[:5])}{more}")
    used = sorted(set(stage_of.values()))
    if used != list(range(len(used))):
        gap = next(s for s in range(len(used) + 1) if s not in used)
        raise SplitError(f"assignment leaves stage {gap} empty (stages used: {used}); number stages 0, 1, 2, ... without gaps")
    return stage_of
