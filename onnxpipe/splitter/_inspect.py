"""inspect_model(): what a model holds, and where it is cheap to cut it.

Note: cut candidates.
    Number the live compute nodes ``c_0 .. c_(n-1)`` in topological order. Position ``p`` (``0 < p <
    n``) is the cut between ``c_(p-1)`` and ``c_p``: stage 0 runs the first ``p`` nodes. A tensor made
    by ``c_i`` and last read by a compute node ``c_j`` with ``j > i`` is live across every position in
    ``(i, j]``; one sweep over a difference array adds up, per position, the bytes live across it.
    Pipeline inputs and weights are never counted (every stage gets the inputs it reads and carries
    its own weights), nor are pipeline outputs that no later node reads.

    A candidate's ``at`` is the ``--at`` argument that makes exactly this cut: the crossing tensors,
    plus any pipeline output made before the position that no later node reads (without it the
    splitter's ancestor-closure semantic, see :mod:`onnxpipe.splitter._cuts`, would move that
    output's producer to the later stage). The crossing bytes are then what stage 0 hands on.
    Positions where a sequence or an untyped tensor would cross are skipped: no split can cut there.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from onnx import ModelProto, ValueInfoProto

from onnxpipe._errors import ConfigError, InputError, closest
from onnxpipe.builder import tensor_nbytes, tensor_spec
from onnxpipe.runtime import TensorSpec, check_dims
from onnxpipe.runtime._dims import input_dims
from onnxpipe.splitter._extract import infer_types
from onnxpipe.splitter._graph import GraphIndex, load_model
from onnxpipe.splitter._live import Sizer, live_sweep
from onnxpipe.splitter._states import one_if, uncuttable

__all__ = ["CutCandidate", "ModelSummary", "inspect_model"]

_EDGE = 0.05  # share of positions at either end never proposed: so small a stage is rarely worth one


@dataclass
class CutCandidate:
    """A place where few bytes cross: cut here with ``split(model, [tensors])`` or ``--at <at>``.

    Attributes:
        position: Compute nodes before the cut (stage 0 runs that many).
        fraction: ``position`` over the number of compute nodes.
        bytes: Bytes crossing the cut per request (symbolic dims sized as the summary says).
        tensors: The tensors crossing the cut, in the order they are made.
        at: The cut as the CLI's ``--at`` takes it (see Note: cut candidates).
    """

    position: int
    fraction: float
    bytes: int
    tensors: tuple[str, ...]
    at: str


@dataclass
class ModelSummary:
    """What :func:`inspect_model` found.

    Attributes:
        name: The graph's name.
        ir_version: The model's IR version.
        opsets: Opset version per domain (``ai.onnx`` for the default domain).
        inputs: Inputs a caller feeds (initializers listed as inputs left out).
        outputs: The model's outputs.
        nodes: All top-level nodes.
        compute_nodes: Live compute nodes (what a split assigns to stages).
        weight_nodes: Nodes that compute weights from constants alone.
        dead_nodes: Compute nodes that contribute to no output (a split drops them).
        ops: Node count per op type, most frequent first (all nodes, as ``--at-op`` counts them).
        weights_bytes: Bytes of the weights compute nodes read, stored or computed: what the stages
            of any split hold together when no weight is shared (see ``SplitStage.weights_bytes``).
        computed_weight_bytes: The part of ``weights_bytes`` that weight nodes make
            (``ConstantOfShape`` outputs, say), sized from inferred shapes.
        initializer_bytes: Bytes of every initializer the file stores (used, feeding weight nodes,
            or unused).
        candidates: The best cut positions, sorted by position.
        notes: Assumptions made (dims defaulted, shape inference trouble, ...).
    """

    name: str
    ir_version: int
    opsets: dict[str, int]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    nodes: int
    compute_nodes: int
    weight_nodes: int
    dead_nodes: int
    ops: dict[str, int]
    weights_bytes: int
    computed_weight_bytes: int
    initializer_bytes: int
    candidates: list[CutCandidate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = asdict(self)
        data["inputs"] = [_spec_dict(t) for t in self.inputs]
        data["outputs"] = [_spec_dict(t) for t in self.outputs]
        for c in data["candidates"]:
            c["tensors"] = list(c["tensors"])
        return data


def _spec_dict(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "shape": None if t.shape is None else list(t.shape)}


def inspect_model(
    model_or_path: ModelProto | str | os.PathLike[str],
    dims: Mapping[str, int] | None = None,
    top: int = 8,
) -> ModelSummary:
    """Summarise a model and propose the cut positions with the least bytes crossing.

    Args:
        model_or_path: A ModelProto or the path of an .onnx file (external data is not loaded).
        dims: Sizes of symbolic dims, for byte counts; dims that are formulas of others are computed
            from theirs, the rest count as 1 (see ``onnxpipe.runtime._dims``' Note: dims counted as 1).
        top: How many cut candidates to propose at most (spread over the model).

    Returns:
        The :class:`ModelSummary`.

    Raises:
        SplitError: the file cannot be read or the graph is not valid (cycle, undefined tensor).
        InputError: ``dims`` names a dim the model does not have, or sizes it below 1.
    """
    proto, _ = load_model(model_or_path)
    index = GraphIndex(proto)
    types, problem = infer_types(proto)
    notes = [problem] if problem else []
    dims = dict(dims or {})
    inputs = tuple(_spec(types, v) for v in proto.graph.input if v.name in index.inputs)
    _check_dims(dims, types, inputs)
    sizer = Sizer(types, dims, inputs)
    compute = index.compute_nodes()
    read = {x for i in compute for x in index.node_inputs[i] if index.is_weight_tensor(x)}
    read.update(o for o in index.outputs if index.is_weight_tensor(o))
    stored = {t.name: tensor_nbytes(t) for t in proto.graph.initializer} | {t.values.name: tensor_nbytes(t.values) for t in proto.graph.sparse_initializer}
    computed = sum(sizer.size(name) or 0 for name in sorted(read - stored.keys()))
    candidates = _candidates(index, compute, sizer, max(top, 0))
    notes.extend(sizer.notes())
    condition = one_if(index)
    if condition is not None:
        notes.append(uncuttable(condition))
    g = proto.graph
    return ModelSummary(
        name=g.name,
        ir_version=proto.ir_version,
        opsets={(o.domain or "ai.onnx"): o.version for o in proto.opset_import},
        inputs=inputs,
        outputs=tuple(_spec(types, v) for v in g.output),
        nodes=len(index.nodes),
        compute_nodes=len(compute),
        weight_nodes=sum(index.is_weight),
        dead_nodes=sum(1 for i in range(len(index.nodes)) if not index.live[i] and not index.is_weight[i]),
        ops=dict(Counter(n.op_type for n in index.nodes).most_common()),
        weights_bytes=computed + sum(stored[name] for name in read & stored.keys()),
        computed_weight_bytes=computed,
        initializer_bytes=sum(stored.values()),
        candidates=candidates,
        notes=notes,
    )


def _spec(types: dict[str, ValueInfoProto], declared: ValueInfoProto) -> TensorSpec:
    try:
        return tensor_spec(types.get(declared.name, declared))
    except ConfigError:
        return TensorSpec(declared.name, "unknown", None)


def _check_dims(dims: Mapping[str, int], types: dict[str, ValueInfoProto], inputs: tuple[TensorSpec, ...]) -> None:
    """Every key names a symbolic dim of some tensor, or is ``<input>.<axis>`` of an input's
    dynamic dim without a name (see ``TensorSpec``'s Note: dynamic dims)."""
    known = {d.dim_param for v in types.values() if v.type.HasField("tensor_type") for d in v.type.tensor_type.shape.dim if d.dim_param}
    for name, size in dims.items():
        if name not in known:
            addressable = {f"{t.name}.{axis}" for t in inputs for axis, d in enumerate(t.shape or ()) if d is None}
            if name.rpartition(".")[0] not in {t.name for t in inputs}:
                # Suggest what a user can size (not the unk__N of shape inference), unless there is none.
                suggested = (input_dims(inputs) | addressable) or known
                raise InputError(f"the model has no symbolic dim '{name}'; {closest(name, suggested)}")
            check_dims(inputs, [name])  # INPUT.AXIS: says what that dim is when it takes no size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InputError(f"dim '{name}' must be an integer >= 1, got {size!r}")


def _candidates(index: GraphIndex, compute: list[int], sizer: Sizer, top: int) -> list[CutCandidate]:
    """The ``top`` positions with the least crossing bytes, spread out (see Note: cut candidates)."""
    n = len(compute)
    if n < 2 or top == 0:
        return []
    sweep = live_sweep(index, compute, sizer)
    edge = max(1, round(_EDGE * n))
    positions = [p for p in range(edge, n - edge + 1) if 0 < p < n and not sweep.blocked[p]]
    spacing = max(1, n // (2 * top))
    chosen: list[int] = []
    for p in sorted(positions, key=lambda p: (sweep.crossing[p], p)):
        if all(abs(p - q) >= spacing for q in chosen):
            chosen.append(p)
            if len(chosen) == top:
                break
    return [_candidate(p, n, sweep.crossing[p], sweep.live, index, compute) for p in sorted(chosen)]


def _candidate(p: int, n: int, nbytes: int, live: dict[str, tuple[int, int]], index: GraphIndex, compute: list[int]) -> CutCandidate:
    tensors = sorted((name for name, (i, j) in live.items() if i < p <= j), key=lambda t: (live[t][0], t))
    before = {o for node in compute[:p] for o in index.nodes[node].output if o}
    side_outputs = [o for o in index.outputs if o in before and o not in live]
    at = ",".join(dict.fromkeys(tensors + side_outputs))
    return CutCandidate(position=p, fraction=p / n, bytes=nbytes, tensors=tuple(tensors), at=at)
