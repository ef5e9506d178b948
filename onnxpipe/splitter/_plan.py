"""split(): the splitter's entry point, and SplitPlan, what it returns."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
from onnx import ModelProto

from onnxpipe._errors import SplitError
from onnxpipe.builder import PipelineConfig, tensor_nbytes, tensor_spec, weights_bytes, without_initializers
from onnxpipe.builder._batching import INPUT_DIMS_KEY, format_dims
from onnxpipe.builder._modules import PROTOBUF_LIMIT, move_into_place
from onnxpipe.runtime import ModelMetadata, PipelineSpec, TensorSpec
from onnxpipe.runtime._dims import input_dims
from onnxpipe.runtime._values import INPUT_VALUES_KEY, format_values
from onnxpipe.splitter._batchcuts import UnbatchedCuts
from onnxpipe.splitter._cuts import assign_by_cuts, assign_explicit
from onnxpipe.splitter._extract import build_stage_models, compute_boundary, infer_types, observe_ranks, unranked
from onnxpipe.splitter._graph import GraphIndex, load_model
from onnxpipe.splitter._remeasure import REMEASURE_BELOW, remeasure
from onnxpipe.splitter._sizes import graph_dims
from onnxpipe.splitter._states import StatePair, StateShapes, check_together, fixed_state_dims, genai_head_dims, one_if, pair_states, step_branches, uncuttable
from onnxpipe.splitter._values import graph_values

if TYPE_CHECKING:
    from onnxpipe.splitter._auto import AutoSplit, SplitPolicy

__all__ = ["SplitPlan", "SplitStage", "split"]


@dataclass
class SplitStage:
    """One stage of a split: its model and the numbers a user picks cuts by.

    Attributes:
        index: Position in the pipeline, from 0.
        name: Stage name in the wiring (``stage<index>``).
        model: The stage's ONNX model (weights may still be external references).
        nodes: How many compute nodes the stage has (a count).
        weight_nodes: Weight nodes carried along (Constant, ConstantOfShape, ...).
        weights_bytes: Bytes of the weights the stage's compute nodes read: initializers, and
            tensors that weight nodes compute (``ConstantOfShape`` weights, say).
        inputs: Boundary inputs (pipeline inputs and tensors from earlier stages).
        outputs: Boundary outputs (tensors for later stages and pipeline outputs).
        bytes_in: Bytes received from earlier stages per request (``None`` if a dim is unknown).
        bytes_out: Bytes handed to later stages per request (pipeline outputs not counted).
        predicted_seconds: The automatic policy's predicted time of the stage, if it predicts times.
    """

    index: int
    name: str
    model: ModelProto
    nodes: int
    weight_nodes: int
    weights_bytes: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    bytes_in: int | None
    bytes_out: int | None
    predicted_seconds: float | None = None


@dataclass
class SplitPlan:
    """The result of :func:`split`: stage models plus the wiring as a :class:`PipelineConfig`.

    Attributes:
        stages: The stages in pipeline order.
        config: The wiring, ready for the builder.
        dropped: Labels of dead nodes (they contribute to no output) left out of every stage.
        notes: Things the user should know (IR upgrades, shape inference trouble, ...).
        source_dir: Folder the stage models' external-data references are relative to.
        auto: What the automatic policy decided, for a split made with one.
        states: The state pairs (output -> input on the next step), each inside one stage; their
            inputs and outputs are not pipeline inputs and outputs (see docs/streams.md).
    """

    stages: list[SplitStage]
    config: PipelineConfig
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source_dir: Path | None = None
    auto: AutoSplit | None = None
    states: list[StatePair] = field(default_factory=list)

    @property
    def spec(self) -> PipelineSpec:
        """The wiring as a validated :class:`PipelineSpec`."""
        return self.config.to_spec()

    def save(self, directory: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write ``stage<i>.onnx`` (+ ``stage<i>.onnx.data`` when needed) and ``pipeline.json``.

        The folder is written whole or not at all: files go to a temporary folder beside it first.

        Args:
            directory: Folder to create.
            overwrite: Replace the folder if it exists and is not empty.

        Returns:
            The folder.

        Raises:
            SplitError: the folder exists, is not empty, and ``overwrite`` is false.
        """
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise SplitError(f"output folder '{directory}' is a file; choose another name")
        if directory.exists() and any(directory.iterdir()) and not overwrite:
            raise SplitError(f"output folder '{directory}' exists and is not empty; choose another or overwrite it")
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            self.config.save(tmp)
            move_into_place(tmp, directory)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return directory

    def __str__(self) -> str:
        lines = [f"{len(self.stages)} stages"]
        for s in self.stages:
            lines.append(
                f"  {s.name}: {s.nodes} nodes, {s.weights_bytes} weight bytes, "
                f"in [{', '.join(t.name for t in s.inputs)}] out [{', '.join(t.name for t in s.outputs)}]"
            )
        lines += [f"  state: {p}" for p in self.states]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _declared_dim_names(proto: ModelProto) -> set[str]:
    values = (*proto.graph.input, *proto.graph.output, *proto.graph.value_info)
    return {d.dim_param for v in values if v.type.HasField("tensor_type") for d in v.type.tensor_type.shape.dim if d.dim_param}


def _invented_dim_names(proto: ModelProto) -> set[str]:
    """Names the splitter may give an unnamed input dim (``<input>.<axis>``, see Note: input dims without a name)."""
    return {f"{v.name}.{axis}" for v in proto.graph.input for axis in range(len(v.type.tensor_type.shape.dim))}


def _without_invented_dims(spec: TensorSpec, named: set[str], invented: set[str]) -> TensorSpec:
    """The spec with the dim names that neither the model nor its user chose left unnamed, as
    onnxruntime reports the whole model's inputs and outputs: those onnx's shape inference made up
    (``unk__0``...) and the addresses the splitter named unnamed input dims by (``x.0``). Names the
    model uses are kept. The stages keep the addresses: they say which boundary dims are the same."""
    if spec.shape is None:
        return spec
    shape = tuple(None if isinstance(d, str) and d not in named and (d.startswith("unk__") or d in invented) else d for d in spec.shape)
    return dataclasses.replace(spec, shape=shape)


def _model_metadata(proto: ModelProto) -> ModelMetadata:
    """The model's metadata as onnxruntime's ``get_modelmeta()`` reports it; the bundle keeps it so
    that a pipeline's ``get_modelmeta()`` is the whole model's (stage modules have their own graph names)."""
    meta = ModelMetadata(
        producer_name=proto.producer_name,
        graph_name=proto.graph.name,
        domain=proto.domain,
        description=proto.doc_string,
        graph_description=proto.graph.doc_string,
        custom_metadata_map={p.key: p.value for p in proto.metadata_props},
    )
    # An unset model_version is reported as INT64_MAX (ModelMetadata's default); 0 is a real version.
    return dataclasses.replace(meta, version=proto.model_version) if proto.HasField("model_version") else meta


def _small_enough_to_remeasure(policy: SplitPolicy, auto: AutoSplit) -> bool:
    """Whether a policy asked to re-measure (``MeasuredPolicy(remeasure=True)``) and its cut's
    stages are predicted under 1 ms, with no pins or weight cap a moved cut could break (``_remeasure``)."""
    if not getattr(policy, "remeasure", False) or not auto.predicted_seconds or len(set(auto.assignment.values())) < 2:
        return False
    return max(auto.predicted_seconds) < REMEASURE_BELOW and not getattr(policy, "pinned", None) and getattr(policy, "max_stage_weights", None) is None


def split(
    model: ModelProto | str | os.PathLike[str],
    cuts: Sequence[object] | None = None,
    *,
    assignment: Mapping[str, int] | None = None,
    policy: SplitPolicy | None = None,
    source_dir: str | os.PathLike[str] | None = None,
    check: bool = True,
    states: str | Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    dims: Mapping[str, int] | None = None,
) -> SplitPlan:
    """Split a model into stages at hand-picked cuts, or by an explicit node -> stage assignment.

    See :mod:`onnxpipe.splitter._cuts` for what a cut means; ``docs/splitting.md`` has examples.

    Args:
        model: A ModelProto or the path of an .onnx file (external data is not loaded: stages refer
            to it and copy only their own weights when saved).
        cuts: Cut points in pipeline order: tensor names, node names, lists of tensor names,
            ``(op_type, index)`` pairs, or :class:`TensorCut` / :class:`NodeCut` / :class:`OpCut`.
        assignment: Instead of cuts: stage index per node name.
        policy: Instead of cuts: an automatic policy (:class:`MeasuredPolicy`, :class:`UniformPolicy`,
            :class:`ParamsPolicy`, or any object with ``name`` and ``assign``).
        source_dir: For an in-memory model with external data: the folder its data files are in.
        check: Run ``onnx.checker`` on every stage model (ops it has no schema for are onnxruntime's
            to judge, at build: see Note: who says an op is valid).
        states: State pairs (a model output that feeds a model input on a stream's next step):
            ``"auto"`` pairs them by name (``present.N.key`` -> ``past_key_values.N.key``,
            ``stateN`` -> ``state``...), or give them as output -> input. Each pair must end up in
            one stage; it becomes a state link of that stage (see docs/streams.md).
        dims: Sizes of symbolic input dims (by name, or ``"input.axis"``) for the sample run that
            finds the rank of a boundary tensor shape inference cannot tell (see Note: boundaries
            of unknown rank in ``_extract``); others are sized 1. A policy that profiles takes its
            own ``dims``. With ``states``, also the size of a state's dim that no other input names
            (onnxruntime-genai's ``kv_cache_dim``), fixed in every stage (``_states``, Note: a
            state's constant dims); without it, the ``head_size`` of a ``genai_config.json``
            beside the model.

    Returns:
        The :class:`SplitPlan`.

    Raises:
        SplitError: the cuts or the assignment are invalid, a state pair names a missing tensor
            or differs in dtype, or the cuts separate a state pair; the message says which and why.
    """
    given = [name for name, value in (("cuts", cuts), ("assignment", assignment), ("policy", policy)) if value is not None]
    if len(given) != 1:
        raise SplitError(f"give one of cuts, assignment or policy, not {' and '.join(given)}" if given else "give cuts, an assignment or a policy")
    proto, folder = load_model(model)
    folder = Path(source_dir) if source_dir is not None else folder
    index = GraphIndex(proto)
    condition = one_if(index)
    if condition is not None and (cuts is not None or (getattr(policy, "stages", None) or 0) > 1):
        raise SplitError(uncuttable(condition))
    types, problem = infer_types(proto)
    pairs: list[StatePair] = []
    flags: dict[str, bool] = {}  # step flags: input -> its value on a stream's first step (_states, Note: merged decoders)
    constants: dict[str, int] = {}
    fixed_notes: list[str] = []
    input_specs = [tensor_spec(types[n]) for n in index.inputs]
    head_dims = genai_head_dims(input_specs, folder)  # onnxruntime-genai's kv_cache_dim, from its genai_config.json
    sized = {**(getattr(policy, "dims", None) or {}), **(dims or {})}  # a profiling policy's dims size them too (split --auto --dim)
    if states is not None:
        pairs, flags = step_branches(proto, pair_states(input_specs, [tensor_spec(types[n]) for n in index.outputs], states))
        state_inputs = {p.input for p in pairs}
        named = {d for t in input_specs if t.name not in state_inputs for d in (t.shape or ()) if isinstance(d, str)}
        constants, fixed_notes = fixed_state_dims(pairs, input_specs, named, sized, head_dims)
        types = _with_dims_fixed(types, constants)  # see Note: a state's constant dims (_states)
    profiled = {**head_dims, **constants}
    if policy is not None and profiled and isinstance(getattr(policy, "dims", None), Mapping):
        policy = dataclasses.replace(policy, dims={**profiled, **policy.dims})  # type: ignore[type-var, attr-defined]  # profiled with them
    if policy is not None and pairs and dataclasses.is_dataclass(policy) and getattr(policy, "refuse", False) is None:
        policy = dataclasses.replace(policy, refuse=UnbatchedCuts(index, types, pairs))  # see Note: cuts that batch (_batchcuts)
    auto = None
    if policy is not None:
        auto = policy.assign(index, types, None if isinstance(model, ModelProto) else str(model))
        if _small_enough_to_remeasure(policy, auto):
            moved, note = remeasure(auto.assignment, index, model if isinstance(model, ModelProto) else str(model), policy.settings,  # type: ignore[attr-defined]
                                    policy.dims, split, _allowed(policy))  # type: ignore[attr-defined]
            # A moved cut is measured, not predicted: the profile's stage times are not its own.
            auto = dataclasses.replace(auto, assignment=moved, predicted_seconds=None if moved is not auto.assignment else auto.predicted_seconds,
                                       notes=(*auto.notes, note))
        stage_of = auto.assignment
    elif cuts is not None:
        stage_of = assign_by_cuts(index, [cuts] if isinstance(cuts, (str, bytes)) else list(cuts))
    else:
        stage_of = assign_explicit(index, assignment or {})
    shapes = StateShapes(index, stage_of, pairs, types)
    rehomed = shapes.rehome(stage_of)
    boundary = compute_boundary(index, stage_of, shapes.source)
    if pairs:
        readers = {p.input: [s for s, names in enumerate(boundary.inputs) if p.input in names] for p in pairs}
        check_together(pairs, readers, {p.output: boundary.global_sources.get(p.output) for p in pairs})
    state_inputs = {p.input for p in pairs} | set(flags)  # fed by the pipeline itself
    state_outputs = {p.output for p in pairs}
    notes = [problem] if problem else []
    if condition is not None:  # one stage, as asked; said for a user looking for cuts
        notes.append(f"the model is one If node on '{condition}': it stays whole in one stage (cuts inside an If are not supported)")
    notes.extend(rehomed)
    notes.extend(fixed_notes)
    foreign = unregistered_ops(proto)
    if foreign:
        notes.append(f"op(s) {', '.join(foreign)} in the default domain are registered neither by ONNX nor by this onnxruntime: "
                     "a stage holding them builds only where a custom-op library registers them")
    crossing = dict.fromkeys(name for names in (*boundary.inputs, *boundary.outputs) for name in names)
    blind = unranked(types, crossing)
    if blind:
        # See Note: boundaries of unknown rank (_extract.py).
        observed = observe_ranks(index, types, blind, folder, dims)
        types = {**types, **observed}
        ranks = ", ".join(f"'{n}' (rank {len(observed[n].type.tensor_type.shape.dim)})" for n in blind)
        notes.append(f"shape inference cannot tell the rank of boundary tensor(s) {ranks}: declared with the rank a sample run gave, every dim dynamic")
    if auto is not None:
        notes.extend(auto.notes)
    ir_version = proto.ir_version
    has_external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    if ir_version < 4 and (has_external or weights_bytes(proto) >= PROTOBUF_LIMIT):
        notes.append(f"IR version {ir_version} -> 4 in every stage: external data needs IR version 4 or later")
        ir_version = 4
    models = build_stage_models(index, boundary, types, ir_version)
    if check:
        for i, m in enumerate(models):
            _check(m, i)
    config = PipelineConfig(proto.graph.name or "pipeline")
    config.metadata["source"] = Path(model).name if not isinstance(model, ModelProto) else proto.graph.name
    config.metadata.update(_model_metadata(proto).to_metadata())
    stages = []
    for i, m in enumerate(models):
        config.add_stage(m, f"stage{i}", source_dir=folder)
    named, invented = _declared_dim_names(proto), _invented_dim_names(proto)
    inputs = {name: _without_invented_dims(tensor_spec(types[name]), named, invented) for name in index.inputs if name not in state_inputs}
    pipeline_dims = input_dims(inputs.values())
    sized = {**{k: v for k, v in graph_dims(proto, types).items() if k in pipeline_dims}, **sized}  # Note: dims the graph fixes (_sizes)
    if sized:  # the sizes the plan was made for: the build's batching probe runs at them (_batching, Note: the batching probe)
        config.metadata[INPUT_DIMS_KEY] = format_dims(sized)
    for spec in inputs.values():  # the pipeline feeds states itself
        config.add_input(spec)
    values = graph_values(proto, inputs)
    if values:  # what the inputs' values mean, for sample inputs where no graph is read (Note: sample values)
        config.metadata[INPUT_VALUES_KEY] = format_values(values)
    for name in index.outputs:
        if name not in state_outputs:
            config.add_output(_without_invented_dims(tensor_spec(types[name]), named, invented))
    for s, names in enumerate(boundary.inputs):
        for t in names:
            if t in state_inputs:
                continue
            src = boundary.sources[t]
            source = config.input(t) if src is None else config.stage(f"stage{src}").output(t)
            source.connect(config.stage(f"stage{s}").input(t))
    for name, src in boundary.global_sources.items():
        if name in state_outputs:
            continue
        source = config.input(name) if src is None else config.stage(f"stage{src}").output(name)
        source.connect(config.output(name))
    for p in pairs:
        stage = config.stage(f"stage{boundary.global_sources[p.output]}")
        config.add_state(stage.output(p.output), stage.input(p.input), p.empty_axis, p.once)
    for flag, first in flags.items():
        for s, names in enumerate(boundary.inputs):
            if flag in names:
                config.add_step_flag(config.stage(f"stage{s}").input(flag), first)
    for i, m in enumerate(models):
        stage = config.stage(f"stage{i}")
        stages.append(
            SplitStage(
                index=i,
                name=stage.name,
                model=m,
                nodes=len(boundary.members[i]),
                weight_nodes=len(m.graph.node) - len(boundary.members[i]) - len(boundary.copies[i]),
                weights_bytes=_weights_read(boundary.weights[i], proto, types),
                inputs=stage.inputs,
                outputs=stage.outputs,
                bytes_in=_sum_bytes((t for t in stage.inputs if boundary.sources[t.name] is not None), dims),
                bytes_out=_sum_bytes((t for t in stage.outputs if boundary.sources.get(t.name) == i), dims),
                predicted_seconds=auto.predicted_seconds[i] if auto is not None and auto.predicted_seconds else None,
            )
        )
    for i, names in enumerate(boundary.recomputed):
        if names:
            shown = ", ".join(f"'{t}'" for t in names[:3]) + (f" +{len(names) - 3} more" if len(names) > 3 else "")
            notes.append(f"stage{i} computes {shown} again from shapes it has ({len(boundary.copies[i])} node(s) copied) instead of reading "
                         "them from an earlier stage: a shape value has no batch axis to batch along")
    dropped = [index.label(i) for i in index.order if not index.live[i] and not index.is_weight[i]]
    if dropped:
        notes.append(f"{len(dropped)} dead node(s) left out (they contribute to no output): {', '.join(dropped[:5])}{' ...' if len(dropped) > 5 else ''}")
    return SplitPlan(stages=stages, config=config, dropped=dropped, notes=notes, source_dir=folder, auto=auto, states=pairs)


def _allowed(policy: object) -> Callable[[dict[int, int]], bool] | None:
    """Which moved cuts ``remeasure`` may keep: those whose boundaries batch, where the policy refuses the others."""
    refuse = getattr(policy, "refuse", None)
    return refuse.batches if isinstance(refuse, UnbatchedCuts) else None


def _with_dims_fixed(types: dict[str, onnx.ValueInfoProto], sizes: Mapping[str, int]) -> dict[str, onnx.ValueInfoProto]:
    """``types`` with every dim named in ``sizes`` fixed at its size (copies of the value infos that have one)."""
    if not sizes:
        return types
    out = dict(types)
    for name, info in types.items():
        if not info.type.HasField("tensor_type") or not any(d.dim_param in sizes for d in info.type.tensor_type.shape.dim):
            continue
        fixed = onnx.ValueInfoProto()
        fixed.CopyFrom(info)
        for d in fixed.type.tensor_type.shape.dim:
            if d.dim_param in sizes:
                d.dim_value = sizes[d.dim_param]  # clears dim_param: the two are a oneof
        out[name] = fixed
    return out


def _sum_bytes(specs: Iterable[TensorSpec], dims: Mapping[str, int] | None) -> int | None:
    """The bytes of ``specs`` with the symbolic dims in ``dims`` sized; ``None`` when one is unsized."""
    total = 0
    for t in specs:
        size = t.nbytes(dims)
        if size is None:
            return None
        total += size
    return total


def _weights_read(names: set[str], proto: ModelProto, types: dict[str, onnx.ValueInfoProto]) -> int:
    stored = {t.name: t for t in proto.graph.initializer}
    total = 0
    for name in names:
        if name in stored:
            total += tensor_nbytes(stored[name])
        elif name in types:
            total += tensor_spec(types[name]).nbytes(default=1) or 0
    return total


def _check(model: ModelProto, i: int) -> None:
    """Check stage ``i``'s model with ``onnx.checker``, ops it has no schema for left to onnxruntime.

    Note: who says an op is valid.
        Exporters for onnxruntime put onnxruntime's own ops in the default domain (the genai model
        builder's ``SimplifiedLayerNormalization``), and onnxruntime runs them; ``onnx.checker``
        knows only ONNX's schemas and refuses them (``No Op registered for ... with
        domain_version of 22``). The splitter copies nodes, it never makes ops up, so an op is for
        the model's runtime to judge, at build: here the checker sees such nodes under a private
        domain (:data:`_DEFERRED`), which it leaves alone, and checks everything else as before
        (graph order, names, types, attributes of ONNX's ops). What it still refuses is then the
        splitter's doing, not the exporter's.
    """
    try:
        onnx.checker.check_model(_ops_deferred(_without_external(model)))
    except onnx.checker.ValidationError as e:
        # A bug of the splitter rather than of the user's input, but name the stage.
        raise AssertionError(f"stage {i} is not a valid ONNX model: {e}") from e


#: The domain :func:`_check` moves ops without an ONNX schema into (see Note: who says an op is valid).
_DEFERRED = "onnxpipe.deferred"


def _ops_deferred(model: ModelProto) -> ModelProto:
    """``model``, or a copy whose default-domain nodes that ONNX has no schema for are in :data:`_DEFERRED`."""
    unknown = {n.op_type for n in _all_nodes(model.graph) if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)}
    if not unknown:
        return model
    copy = ModelProto()
    copy.CopyFrom(model)
    for node in _all_nodes(copy.graph):
        if node.domain in ("", "ai.onnx") and node.op_type in unknown:
            node.domain = _DEFERRED
    copy.opset_import.append(onnx.helper.make_opsetid(_DEFERRED, 1))
    return copy


def unregistered_ops(model: ModelProto) -> list[str]:
    """Default-domain op types of ``model`` that neither ONNX nor this onnxruntime registers (a
    custom-op library must, or no stage holding them builds)."""
    unknown = sorted({n.op_type for n in _all_nodes(model.graph) if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)})
    if not unknown:
        return []
    known = _onnxruntime_ops()
    return [op for op in unknown if op not in known]


@functools.cache
def _onnxruntime_ops() -> frozenset[str]:
    """The default-domain op types this onnxruntime has schemas for (its contrib ops included)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as binding

    schemas = getattr(binding, "get_all_operator_schema", None)
    return frozenset(s.name for s in schemas() if s.domain in ("", "ai.onnx")) if schemas is not None else frozenset()


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _all_nodes(g)


def _without_external(model: ModelProto) -> ModelProto:
    """``model``, or a copy whose external-data weights are typed graph inputs instead.

    Note: the checker resolves an in-memory model's external-data locations against the working
    directory, not the model's folder, so a stage of a model loaded from another folder would fail
    the check; the references themselves are checked when :func:`save_model` copies the weights.
    """
    external = {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    if not external:
        return model
    light = without_initializers(model)
    listed = {v.name for v in light.graph.input}
    for t in model.graph.initializer:
        if t.name not in external:
            light.graph.initializer.append(t)
        elif t.name not in listed:
            light.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light
