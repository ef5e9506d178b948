"""From a node -> stage assignment to stage models and the wiring between them.

Every stage model is a plain ONNX model: the stage's compute nodes, the weight nodes, initializers
and local functions they read (also from inside If/Loop/Scan bodies), the original opset imports and
IR version, and typed inputs and outputs that keep their original tensor names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx
from onnx import FunctionProto, ModelProto, NodeProto, ValueInfoProto

from onnxpipe._errors import SplitError
from onnxpipe.builder import without_initializers
from onnxpipe.splitter._graph import GraphIndex, subgraphs

__all__ = ["Boundary", "build_stage_models", "compute_boundary", "infer_types"]

_INLINE_FOR_INFERENCE = 4096  # initializers up to this size keep their values for data propagation


def infer_types(model: ModelProto) -> tuple[dict[str, ValueInfoProto], str | None]:
    """Types and shapes of every top-level tensor, by name.

    Shape inference runs on a light copy of the model: large initializers are replaced by typed
    inputs, so inference neither copies nor needs the weights' bytes (small ones keep their values,
    which shape computations read).

    Returns:
        The value infos by name and, when inference failed, why (the declared types are used then).
    """
    light = without_initializers(model)
    listed = {v.name for v in light.graph.input}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) + 8 * len(t.float_data) <= _INLINE_FOR_INFERENCE:
            light.graph.initializer.append(t)
        elif t.name not in listed:
            light.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    problem = None
    try:
        inferred = onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=True)
    except Exception as e:  # onnx raises InferenceError, ValidationError or RuntimeError here
        inferred, problem = light, f"shape inference failed ({type(e).__name__}: {e}); using the types the model declares"
    types: dict[str, ValueInfoProto] = {}
    for source in (model.graph.value_info, inferred.graph.value_info, inferred.graph.input, inferred.graph.output):
        for v in source:
            if v.type.WhichOneof("value"):
                types[v.name] = v
    return types, problem


@dataclass
class Boundary:
    """What crosses stage boundaries, as computed from an assignment.

    Attributes:
        members: Compute nodes of each stage, in topological order.
        inputs: Tensors each stage reads from outside (pipeline inputs or earlier stages).
        outputs: Tensors each stage hands on (to later stages or as pipeline outputs).
        weights: Weight tensors each stage reads.
        sources: For each stage input tensor: the stage that produces it, or ``None`` for a pipeline input.
        global_sources: For each pipeline output: the stage producing it, or ``None`` when it is a
            pipeline input passed straight through.
    """

    members: list[list[int]]
    inputs: list[list[str]]
    outputs: list[list[str]]
    weights: list[set[str]]
    sources: dict[str, int | None] = field(default_factory=dict)
    global_sources: dict[str, int | None] = field(default_factory=dict)


def compute_boundary(index: GraphIndex, stage_of: dict[int, int]) -> Boundary:
    """The tensors crossing between stages; one pass over the stage's nodes.

    Raises:
        SplitError: a node reads a tensor that only a later stage computes.
    """
    n = max(stage_of.values()) + 1
    b = Boundary([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [set() for _ in range(n)])
    ins: list[dict[str, None]] = [{} for _ in range(n)]
    outs: list[dict[str, None]] = [{} for _ in range(n)]
    for i in index.order:
        s = stage_of.get(i)
        if s is None:
            continue
        b.members[s].append(i)
        for name in index.node_inputs[i]:
            if index.is_weight_tensor(name):
                b.weights[s].add(name)
                continue
            p = index.producer.get(name)
            src = None if p is None else stage_of[p]
            if p is not None and stage_of[p] > s:
                raise SplitError(
                    f"node {index.label(i)} in stage {s} reads '{name}' from node {index.label(p)} in stage {stage_of[p]}; "
                    "a stage can only read tensors of earlier stages"
                )
            if src != s:
                ins[s][name] = None
                b.sources[name] = src
                if src is not None:
                    outs[src][name] = None
    last = n - 1
    for name in index.outputs:
        p = index.producer.get(name)
        if p is not None and p in stage_of:
            outs[stage_of[p]][name] = None
            b.global_sources[name] = stage_of[p]
        elif index.is_weight_tensor(name):
            # A constant output: the last stage computes it from its weights.
            b.weights[last].add(name)
            outs[last][name] = None
            b.global_sources[name] = last
        elif name in index.inputs:
            b.global_sources[name] = None
        else:
            raise SplitError(f"model output '{name}' is not computed by any node")
    for s in range(n):
        b.inputs[s] = sorted(ins[s], key=lambda t: _tensor_key(index, t))
        b.outputs[s] = sorted(outs[s], key=lambda t: _tensor_key(index, t))
    return b


def _tensor_key(index: GraphIndex, name: str) -> tuple[int, int, int]:
    p = index.producer.get(name)
    if p is None:
        return (0, index.inputs.index(name) if name in index.inputs else -1, 0)
    return (1, index.position[p], list(index.nodes[p].output).index(name))


def _used_functions(nodes: Iterable[NodeProto], functions: dict[tuple[str, str], FunctionProto]) -> list[FunctionProto]:
    """Local functions called by ``nodes`` (in subgraphs too), and the functions those call."""
    found: dict[tuple[str, str], FunctionProto] = {}
    stack = list(nodes)
    while stack:
        node = stack.pop()
        key = (node.domain, node.op_type)
        if key in functions and key not in found:
            found[key] = functions[key]
            stack.extend(functions[key].node)
        for sub in subgraphs(node):
            stack.extend(sub.node)
    return [f for k, f in functions.items() if k in found]


def build_stage_models(
    index: GraphIndex,
    boundary: Boundary,
    types: dict[str, ValueInfoProto],
    ir_version: int | None = None,
) -> list[ModelProto]:
    """One ONNX model per stage.

    Args:
        index: The analysed source model.
        boundary: What each stage holds and exchanges.
        types: Value infos by tensor name (see :func:`infer_types`).
        ir_version: IR version to write (default: the source model's).

    Raises:
        SplitError: a boundary tensor's element type is unknown.
    """
    model = index.model
    g = model.graph
    initializers = {t.name: t for t in g.initializer}
    sparse = {t.values.name: t for t in g.sparse_initializer}
    declared_inputs = {v.name: v for v in g.input}
    functions = {(f.domain, f.name): f for f in model.functions}
    n = len(boundary.members)
    stages = []
    for s in range(n):
        weight_nodes, inits = index.weight_closure(boundary.weights[s])
        node_ids = sorted(boundary.members[s] + weight_nodes, key=index.position.__getitem__)
        stage = ModelProto(
            ir_version=ir_version or model.ir_version,
            producer_name=model.producer_name,
            producer_version=model.producer_version,
            domain=model.domain,
            model_version=model.model_version,
            doc_string=model.doc_string,
        )
        stage.opset_import.extend(model.opset_import)
        sg = stage.graph
        sg.name = f"{g.name or 'model'}_stage{s}"
        sg.node.extend(index.nodes[i] for i in node_ids)
        sg.initializer.extend(initializers[name] for name in initializers if name in inits)
        sg.sparse_initializer.extend(sparse[name] for name in sparse if name in inits)
        sg.input.extend(_typed(types, name, f"stage {s} input") for name in boundary.inputs[s])
        if stage.ir_version < 4:
            # IR < 4 requires every initializer to be listed as a graph input too.
            sg.input.extend(declared_inputs.get(name) or _init_info(initializers[name]) for name in initializers if name in inits)
        sg.output.extend(_typed(types, name, f"stage {s} output") for name in boundary.outputs[s])
        boundary_names = set(boundary.inputs[s]) | set(boundary.outputs[s])
        inner = [o for i in node_ids for o in index.nodes[i].output if o and o not in boundary_names and o in types]
        sg.value_info.extend(types[name] for name in inner)
        stage.functions.extend(_used_functions(sg.node, functions))
        stage.metadata_props.extend(model.metadata_props)
        for key, value in (("onnxpipe.stage", str(s)), ("onnxpipe.num_stages", str(n)), ("onnxpipe.source", g.name)):
            stage.metadata_props.add(key=key, value=value)
        stages.append(stage)
    return stages


def _typed(types: dict[str, ValueInfoProto], name: str, what: str) -> ValueInfoProto:
    v = types.get(name)
    if v is None or not v.type.HasField("tensor_type") or not v.type.tensor_type.elem_type:
        kind = v.type.WhichOneof("value") if v is not None else None
        if kind and kind != "tensor_type":
            raise SplitError(f"{what} '{name}' is a {kind} value; only tensors can cross a stage boundary, move the cut")
        raise SplitError(f"cannot tell the element type of {what} '{name}': shape inference found none; add it to the model's value_info")
    return v


def _init_info(t: onnx.TensorProto) -> ValueInfoProto:
    return onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
