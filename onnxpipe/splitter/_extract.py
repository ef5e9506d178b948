"""From a node -> stage assignment to stage models and the wiring between them.

Every stage model is a plain ONNX model: the stage's compute nodes, the weight nodes, initializers
and local functions they read (also from inside If/Loop/Scan bodies), the original opset imports and
IR version, and typed inputs and outputs that keep their original tensor names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import FunctionProto, ModelProto, NodeProto, ValueInfoProto
from onnx.external_data_helper import load_external_data_for_model

from onnxpipe._errors import SplitError, ort_message
from onnxpipe.builder import without_initializers
from onnxpipe.builder._modules import UNKNOWN
from onnxpipe.splitter._graph import GraphIndex, subgraphs

__all__ = ["SHAPE_OPS", "Boundary", "build_stage_models", "compute_boundary", "infer_types", "observe_ranks", "unranked"]

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
    for v in (*light.graph.output, *light.graph.value_info):
        _negative_dims_dynamic(v)
    _name_input_dims(light)
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
    # The light copy keeps the model's own value_info, so the inferred one holds it too.
    for source in (inferred.graph.value_info, inferred.graph.input, inferred.graph.output):
        for v in source:
            if v.type.WhichOneof("value"):
                types[v.name] = v
    return types, problem


def _negative_dims_dynamic(value: ValueInfoProto) -> None:
    """Make ``dim_value: -1`` (PaddlePaddle's dynamic dim) a dim with neither value nor name, in place.

    Inference would otherwise compute with -1 as a size (a Conv of height -1 is -2 high, say).
    """
    if value.type.HasField("tensor_type"):
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value < 0:
                d.ClearField("dim_value")


def _name_input_dims(model: ModelProto) -> None:
    """Name every dynamic dim of a graph input that has no name by its address, ``<input>.<axis>``, in place.

    Note: input dims without a name.
        A graph input's dim declared ``-1`` (PaddlePaddle), named ``?`` (PaddlePaddle's name for
        "unknown", which binds nothing in onnxruntime) or with neither value nor name is
        dynamic. The splitter names it after its input and axis (``x.0``) before shape inference,
        so the name flows into every tensor that carries the dim, the stages' boundaries say which
        dims are the same (the pipeline's own inputs and outputs show them unnamed, as onnxruntime
        reports the whole model), and a size given for it
        (``dims={"x.0": 8}``, ``--dim x.0=8``) sizes sample inputs and byte counts alike. A name the
        model already uses elsewhere is left alone (the dim stays without a name).
    """
    taken = {d.dim_param for v in (*model.graph.input, *model.graph.output, *model.graph.value_info) for d in v.type.tensor_type.shape.dim if d.dim_param}
    for v in model.graph.input:
        if not v.type.HasField("tensor_type"):
            continue
        for axis, d in enumerate(v.type.tensor_type.shape.dim):
            dynamic = d.dim_value < 0 if d.HasField("dim_value") else d.dim_param in UNKNOWN
            name = f"{v.name}.{axis}"
            if dynamic and name not in taken:
                d.dim_param = name  # setting the name clears the value: they are one oneof


def unranked(types: dict[str, ValueInfoProto], names: Iterable[str]) -> list[str]:
    """The tensors among ``names`` whose type is a tensor with an element type but no shape (unknown rank)."""
    out = []
    for name in names:
        v = types.get(name)
        if v is not None and v.type.HasField("tensor_type") and v.type.tensor_type.elem_type and not v.type.tensor_type.HasField("shape"):
            out.append(name)
    return out


def observe_ranks(index: GraphIndex, types: dict[str, ValueInfoProto], names: list[str], source_dir: Path | None,
                  dims: Mapping[str, int] | None = None) -> dict[str, ValueInfoProto]:
    """Types for boundary tensors of unknown rank: the rank one onnxruntime run on sample inputs
    gives, every dim dynamic (see Note: boundaries of unknown rank).

    Note: boundaries of unknown rank.
        The ONNX checker wants a shape (a rank) on every input and output of a model's graph, but
        shape inference cannot always tell one: an If whose branches make tensors of different
        ranks, or an op whose output rank depends on values, leaves its output -- and everything
        computed from it -- without a shape. A stage boundary at such a tensor takes the rank the
        whole model gives it in one run on sample inputs (sized by ``dims``, other symbolic dims 1,
        like ``random_inputs``), with every dim dynamic; the run is made only when a boundary needs
        it. A tensor whose rank changes with the input (the If takes another branch) then fails at
        that stage's input, as onnxruntime checks ranks. Where the run fails, the cut is refused
        rather than carried without a rank: the ONNX checker requires a shape on every graph input
        and output ("Field 'shape' of 'type' is required but missing"), and every stage must be a
        valid model.

    Raises:
        SplitError: the sample run fails, so no rank is known (the message names the tensors, the
            dims the run used and how to give others).
    """
    import onnxruntime as ort

    from onnxpipe.builder import tensor_spec
    from onnxpipe.runtime import random_inputs
    from onnxpipe.splitter._sizes import sample_dims
    from onnxpipe.splitter._values import graph_values

    what = ", ".join(repr(n) for n in names)
    shapeless = [n for n in names if n in index.inputs]
    if shapeless:
        # No run can tell the rank of what the caller feeds; the whole model fails the checker too.
        listed = ", ".join(repr(n) for n in shapeless)
        raise SplitError(f"model input(s) {listed} declare no shape; every stage input needs one (a rank, dims may be dynamic): declare it in the model")
    probe = ModelProto()
    probe.CopyFrom(index.model)
    outputs = {v.name for v in probe.graph.output}
    for name in (n for n in names if n not in outputs):
        probe.graph.output.append(onnx.helper.make_tensor_value_info(name, types[name].type.tensor_type.elem_type, None))
    specs = [tensor_spec(types[name]) for name in index.inputs]
    feeds, _ = random_inputs(specs, sample_dims(index.model, dims, types), values=graph_values(index.model))  # an unknown dim name: InputError, now
    try:
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in probe.graph.initializer):
            if source_dir is None:
                raise SplitError("its weights are external data and the model's folder is not known")
            load_external_data_for_model(probe, str(source_dir))
        options = ort.SessionOptions()
        options.log_severity_level = 4  # its failure is the SplitError below, not a log line on the user's terminal
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        arrays = session.run(names, feeds)
    except Exception as e:  # onnxruntime's own exception types, InputError, OSError, protobuf's size limit
        used = ", ".join(f"'{n}' {list(a.shape)}" for n, a in feeds.items())
        sized = ", ".join(f"{k}={v}" for k, v in (dims or {}).items())
        raise SplitError(
            f"shape inference cannot tell the rank of boundary tensor(s) {what}, and a sample run to see it failed on inputs {used} "
            f"({'dims ' + sized + '; ' if sized else ''}other symbolic dims sized 1): {ort_message(e)}; give the sizes the model needs with "
            "--dim NAME=SIZE (dims={NAME: SIZE} in Python), cut elsewhere, or declare the tensor's shape in the model's value_info"
        ) from e
    observed = {}
    for name, array in zip(names, arrays, strict=True):
        observed[name] = onnx.helper.make_tensor_value_info(name, types[name].type.tensor_type.elem_type, [None] * np.ndim(array))
    return observed


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
        copies: Nodes of earlier stages each stage computes again (see Note: shape values are
            recomputed), in topological order.
        recomputed: For each stage, the tensors it computes again instead of reading them.
        variants: ``(stage, node) ->`` the copy of a node that stage holds instead (a ``Shape``
            node reading a state of its own: ``_states.StateShapes``).
    """

    members: list[list[int]]
    inputs: list[list[str]]
    outputs: list[list[str]]
    weights: list[set[str]]
    sources: dict[str, int | None] = field(default_factory=dict)
    global_sources: dict[str, int | None] = field(default_factory=dict)
    copies: list[list[int]] = field(default_factory=list)
    recomputed: list[list[str]] = field(default_factory=list)
    variants: dict[tuple[int, int], NodeProto] = field(default_factory=dict)


#: Ops a shape value is computed with: a few integers in, a few out (see Note: shape values are recomputed).
SHAPE_OPS = frozenset({
    "Shape", "Size", "Gather", "Cast", "Unsqueeze", "Squeeze", "Concat", "Slice", "Reshape", "Identity", "Add", "Sub", "Mul",
    "Div", "Mod", "Neg", "Abs", "Floor", "Ceil", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
    "Not", "And", "Or", "Where", "Range", "ReduceProd", "ReduceMax", "ReduceMin",
})
_MOST_COPIED = 64  # nodes in one recomputed cone: beyond it the value is not a mere shape computation


#: ``(Shape node, the tensor it reads, stage, what the stage reads anyway) ->`` what that stage may
#: read for it (the same tensor, or another of the same dims), or ``None`` when it has none.
ShapeSource = Callable[[int, str, int, Mapping[str, "int | None"]], "str | None"]


def compute_boundary(index: GraphIndex, stage_of: dict[int, int], shape_source: ShapeSource | None = None) -> Boundary:
    """The tensors crossing between stages; one pass over the stage's nodes.

    Note: shape values are recomputed.
        A value computed from tensors' shapes alone (``Shape -> Gather -> Cast``: a decoder's
        ``total_sequence_length``, a ``Reshape``'s target shape, a sequence's positions made by
        ``Range``) has no batch axis, so a stage boundary carrying it could not batch, and it
        costs a few integers to compute. A later stage that reads one computes it again instead,
        from the same shapes: the nodes that make it (:data:`SHAPE_OPS`, at most
        :data:`_MOST_COPIED`, reading nothing but weights, each other and the shapes of their
        roots) are copied into the stage, and the stage reads their roots instead: a pipeline
        input (an attention mask, the input ids) or a tensor it reads anyway. A cone whose root is
        an activation the stage does not otherwise read, or another stage's state input with no
        state of this stage declared alike (``shape_source``: ``_states.StateShapes``), is not
        copied: the value crosses as before.

    Args:
        index: The analysed model.
        stage_of: Compute node -> stage.
        shape_source: What a copied ``Shape`` node may read in a stage (default: what it read).

    Raises:
        SplitError: a node reads a tensor that only a later stage computes.
    """
    n = max(stage_of.values()) + 1
    b = Boundary([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [set() for _ in range(n)],
                 copies=[[] for _ in range(n)], recomputed=[[] for _ in range(n)])
    ins: list[dict[str, int | None]] = [{} for _ in range(n)]
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
                ins[s][name] = src
    for s in range(n):
        _recompute_shapes(index, stage_of, s, ins[s], b, shape_source or _same)
        for name, src in ins[s].items():
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
        if not outs[s]:
            raise _nothing_handed_on(index, stage_of, b, s)
        b.inputs[s] = sorted(ins[s], key=lambda t: _tensor_key(index, t))
        b.outputs[s] = sorted(outs[s], key=lambda t: _tensor_key(index, t))
    return b


def _nothing_handed_on(index: GraphIndex, stage_of: dict[int, int], b: Boundary, s: int) -> SplitError:
    """Why stage ``s`` would have no outputs: every node of it contributes only to shape values that
    later stages compute again (Note: shape values are recomputed), and onnxruntime runs no model that outputs nothing."""
    again = [(t, later) for later in range(s + 1, len(b.recomputed)) for t in b.recomputed[later]
             if (p := index.producer.get(t)) is not None and stage_of.get(p) == s]
    shown = ", ".join(f"'{t}'" for t, _ in again[:3]) + (f" +{len(again) - 3} more" if len(again) > 3 else "")
    later = ", ".join(str(k) for k in sorted({k for _, k in again}))
    return SplitError(f"stage {s} would output nothing: its {len(b.members[s])} node(s) compute only shape values ({shown}), which stage(s) {later} "
                      "compute again from the shapes they read; cut after a node that computes data (an activation), not a shape")


def _same(node: int, root: str, stage: int, reads: Mapping[str, int | None]) -> str:
    return root


def _recompute_shapes(index: GraphIndex, stage_of: dict[int, int], s: int, reads: dict[str, int | None], b: Boundary,
                      shape_source: ShapeSource) -> None:
    """Stage ``s`` computes again the shape values it reads from earlier stages (Note: shape values
    are recomputed): ``reads``, ``b.copies[s]``, ``b.recomputed[s]`` and ``b.weights[s]`` updated in place."""
    copied: dict[int, None] = {}
    for name in list(reads):
        if reads[name] is None:
            continue
        cone = _shape_cone(index, stage_of, s, name, reads, shape_source)
        if cone is None:
            continue
        nodes, roots, variants = cone
        b.variants.update({(s, i): node for i, node in variants.items()})
        copied.update(dict.fromkeys(nodes))
        del reads[name]
        b.recomputed[s].append(name)
        for root in roots:
            if root not in reads:
                p = index.producer.get(root)
                reads[root] = None if p is None else stage_of[p]
    if not copied:
        return
    made = {o for i in copied for o in index.nodes[i].output}
    for i in copied:
        for name in index.node_inputs[i]:
            if index.is_weight_tensor(name):
                b.weights[s].add(name)
    for name in [t for t in reads if t in made]:
        del reads[name]  # another recomputed value's intermediate: made here now
    b.copies[s] = sorted(copied, key=index.position.__getitem__)


def _shape_cone(index: GraphIndex, stage_of: dict[int, int], s: int, name: str, reads: Mapping[str, int | None],
                shape_source: ShapeSource) -> tuple[list[int], set[str], dict[int, NodeProto]] | None:
    """The nodes computing ``name`` from shapes alone, the tensors whose shapes they read and the
    ``Shape`` nodes that read another tensor in ``s`` (copies), if stage ``s`` can compute it again
    (every root a pipeline input or a tensor ``s`` reads or makes anyway); else ``None``."""
    nodes: list[int] = []
    roots: set[str] = set()
    variants: dict[int, NodeProto] = {}
    seen: set[str] = set()
    stack = [name]
    while stack:
        t = stack.pop()
        if t in seen or index.is_weight_tensor(t):
            continue
        seen.add(t)
        p = index.producer.get(t)
        if p is None or index.nodes[p].op_type not in SHAPE_OPS or index.nodes[p].domain not in ("", "ai.onnx") or len(nodes) >= _MOST_COPIED:
            return None
        nodes.append(p)
        node = index.nodes[p]
        if node.op_type in ("Shape", "Size"):
            root = node.input[0]
            rp = index.producer.get(root)
            if index.is_weight_tensor(root) or (rp is not None and stage_of.get(rp) == s):
                continue
            read = shape_source(p, root, s, reads)
            if read is None or not (read in reads or (index.producer.get(read) is None and read in index.inputs)):
                if rp is not None and index.nodes[rp].op_type in SHAPE_OPS:
                    stack.append(root)  # the shape of a shape value (a Range's): the stage computes that value too
                    continue
                return None
            if read != root:
                variant = NodeProto()
                variant.CopyFrom(node)
                variant.input[0] = read
                variants[p] = variant
            roots.add(read)
            continue
        stack.extend(index.node_inputs[p])
    return nodes, roots, variants


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
        copies = boundary.copies[s] if boundary.copies else []
        node_ids = sorted(boundary.members[s] + copies + weight_nodes, key=index.position.__getitem__)
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
        sg.node.extend(boundary.variants.get((s, i), index.nodes[i]) for i in node_ids)
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
