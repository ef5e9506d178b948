"""The pipeline spec: stages, their boundary tensors and the wiring between them.

Plain dataclasses and their JSON form, in one place. The builder writes a :class:`PipelineSpec`, the
runtime reads it; neither needs onnx to do so.

Note: wiring model.
    A pipeline has global inputs, global outputs and stages. Each stage declares its input and output
    tensors. A :class:`Link` connects a *source* -- a global input or a stage output -- to a
    *destination* -- a stage input or a global output. One source may feed many destinations (fan-out,
    also two inputs of one stage); every destination is fed by exactly one link. Stages are listed in
    an order where every link goes forward, so a tensor made by stage 0 and used by stage 2 is linked
    straight from 0 to 2 (a skip edge), never relayed through stage 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from onnxpipe._errors import ConfigError, OnnxpipeError, closest
from onnxpipe.runtime._dims import dim_size
from onnxpipe.runtime._dtypes import CODE_DTYPES, DTYPES, itemsize
from onnxpipe.runtime._settings import StageSettings

__all__ = [
    "SPEC_FORMAT",
    "SPEC_VERSION",
    "RUNS",
    "Batching",
    "Dim",
    "Endpoint",
    "Link",
    "ParamGroup",
    "PipelineSpec",
    "StageSpec",
    "StateLink",
    "StepFlag",
    "TensorSpec",
    "check_state_ends",
    "describe_json",
    "CodeSpec",
    "check_entry_point",
    "find_tensor",
    "parse_json",
]

SPEC_FORMAT = "onnxpipe.pipeline"
#: The version this onnxpipe writes. Version 2 adds stage kinds (code stages) and state links; a
#: reader that ignored them would run a different pipeline, so version 1 readers refuse it.
SPEC_VERSION = 2
#: The versions this onnxpipe reads: a version 1 spec is a version 2 spec without the new fields.
READ_VERSIONS = (1, 2)

#: When a stage runs in a stream (``StageSpec.runs``): on every step, or on the first step only.
RUNS = ("every", "first")

#: One dimension of a shape: a size, a symbolic name (``"batch"``), or ``None`` when dynamic
#: without a name (see Note: dynamic dims).
Dim = int | str | None


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor with its element type and shape.

    Note: dynamic dims.
        A dim is fixed (an int >= 0), dynamic with a name (``"batch"``: any size, the same in every
        tensor that names it), or dynamic without one (``None``: any size). Some exporters
        (PaddlePaddle) declare dynamic dims as ``dim_value: -1``, and onnxruntime takes any size
        for them, so a negative int is read as ``None`` when a spec is made, from ONNX or from an
        older ``pipeline.json`` alike: no check, sample input or byte count ever sees one. A
        dynamic dim without a name is addressed by its tensor and axis, ``x.0``, where sizes are
        given (``random_inputs``' ``dims``, ``--dim x.0=8``).

    Attributes:
        name: The tensor's name, as in the original model.
        dtype: Element type name (see :data:`onnxpipe.runtime._dtypes.DTYPES`), e.g. ``"float32"``.
        shape: One entry per dimension, or ``None`` when even the rank is unknown.
    """

    name: str
    dtype: str
    shape: tuple[Dim, ...] | None = None

    def __post_init__(self) -> None:
        if self.shape is not None and any(isinstance(d, int) and d < 0 for d in self.shape):
            object.__setattr__(self, "shape", tuple(None if isinstance(d, int) and d < 0 else d for d in self.shape))

    def mismatch(self, other: TensorSpec) -> str | None:
        """Why a value of this spec cannot feed ``other``, or ``None`` when it can.

        Symbolic and unknown dimensions match any size; two different fixed sizes do not.
        """
        if self.dtype != other.dtype:
            return f"dtype {self.dtype} != {other.dtype}"
        if self.shape is None or other.shape is None:
            return None
        if len(self.shape) != len(other.shape):
            return f"rank {len(self.shape)} != {len(other.shape)} ({_shape(self.shape)} vs {_shape(other.shape)})"
        for i, (a, b) in enumerate(zip(self.shape, other.shape, strict=True)):
            if isinstance(a, int) and isinstance(b, int) and a != b:
                return f"dim {i}: {a} != {b} ({_shape(self.shape)} vs {_shape(other.shape)})"
        return None

    def nbytes(self, dims: Mapping[str, int] | None = None, default: int | None = None) -> int | None:
        """Size in bytes, with symbolic dims taken from ``dims`` (else ``default``).

        A dim that is a formula of other dims (``floor(H/2 - 1/2) + 1``) is computed from their
        sizes (see ``onnxpipe.runtime._dims``' Note: expression dims).

        Returns:
            The size, or ``None`` when the rank or a dimension stays unknown.
        """
        if self.shape is None:
            return None
        count = itemsize(self.dtype)
        for d in self.shape:
            size = d if isinstance(d, int) else dim_size(d, dims or {}, default) if isinstance(d, str) else default
            if size is None:
                return None
            count *= size
        return count

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}{_shape(self.shape)}"


def _shape(shape: tuple[Dim, ...] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


class Endpoint(NamedTuple):
    """One end of a link: a stage's tensor, or (``stage is None``) a global input or output.

    A named tuple, not a dataclass: it keys every request's bag, and a tuple hashes in C (a
    frozen dataclass's hash runs Python code on every lookup of every step)."""

    stage: str | None
    tensor: str

    def __str__(self) -> str:
        return f"{self.stage}.{self.tensor}" if self.stage is not None else f"pipeline.{self.tensor}"


@dataclass(frozen=True)
class Link:
    """A source (global input or stage output) feeding a destination (stage input or global output)."""

    src: Endpoint
    dst: Endpoint

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}"


#: What a code stage's entry point looks like, for error messages.
ENTRY_POINT_FORM = "'package.module:function' (a dotted module path, a colon, a dotted attribute path; e.g. 'mypkg.ocr:decode')"


def check_entry_point(entry: object, where: str) -> str:
    """Refuse an entry point that is not ``"pkg.module:qualname"`` (both sides dotted identifiers).

    Returns:
        The entry point, unchanged.

    Raises:
        ConfigError: naming ``where`` (e.g. the stage) and what a valid entry point looks like.
    """
    if isinstance(entry, str):
        module, colon, attr = entry.partition(":")
        if colon and all(p.isidentifier() for p in module.split(".")) and all(p.isidentifier() for p in attr.split(".")):
            return entry
    raise ConfigError(f"{where}: entry point {describe_json(entry)} is malformed; an entry point is {ENTRY_POINT_FORM}")


@dataclass(frozen=True)
class CodeSpec:
    """What a code stage runs: a Python callable named by import path, and its JSON parameters.

    The callable is ``fn(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> Mapping[str,
    np.ndarray]``; it must be importable on the host that runs the bundle, which refuses it unless
    its allow-list matches the entry point (see ``onnxpipe.runtime._code``). Nothing else of the
    code is stored: a bundle never carries code, and nothing is pickled.

    Attributes:
        entry: ``"pkg.module:qualname"``.
        params: Plain JSON values (objects, lists, strings, numbers, booleans, null) given to every call.
    """

    entry: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_entry_point(self.entry, "code stage")
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"code stage '{self.entry}': params must be a JSON object, got {describe_json(self.params)}")
        try:
            plain = json.loads(json.dumps(dict(self.params), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"code stage '{self.entry}': params must be plain JSON values: {e}") from None
        object.__setattr__(self, "params", plain)

    @property
    def module(self) -> str:
        """The module part of the entry point."""
        return self.entry.partition(":")[0]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"entry": self.entry, "params": dict(self.params)}


@dataclass(frozen=True)
class Batching:
    """How a stage runs several requests as one session call (docs/batching.md): what the build
    found and checked when the stage's ``max_batch`` is above 1.

    Every port's batch axis is dim 0 (the build refuses a stage where some port's dim 0 is a
    fixed size). Requests are stacked along it; a stream's steps are stacked too, after their
    *padded* inputs (a KV cache, an attention mask, a mask made from it) are padded on the left
    of their growing axis to the longest in the batch, so a padded position is never attended;
    after the call each member's rows of every *stripped* output lose that padding again.

    Attributes:
        padded: Input name -> (axis, pad value): inputs whose length along ``axis`` grows with
            the stream's past.
        stripped: Output name -> axis: outputs whose length along ``axis`` grows with the past.
        probe: How the build checked it: the largest difference between batched and alone
            (``"max abs diff 3.1e-07 <= 1e-04"``), or why it could not.
        state_padding: Where a shorter stream's padding goes in the stage's state (its KV cache)
            when steps are batched: ``"left"``, before its past, so that every member's past ends
            in the same column (a model that hides padded positions with the attention mask), or
            ``"right"``, after it, so that every member's past starts at position 0 (a model whose
            attention reads each row's past from its start up to its own length, as
            onnxruntime's ``GroupQueryAttention`` does from ``seqlens_k``). Inputs in the bag are
            left-padded either way.
    """

    padded: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    stripped: Mapping[str, int] = field(default_factory=dict)
    probe: str = ""
    state_padding: str = "left"

    def describe(self) -> str:
        """One line: what is padded and stripped, and how it was checked."""
        if not self.padded and not self.stripped:
            what = "requests stacked along dim 0, nothing padded"
        else:
            pads = ", ".join(f"{name} (axis {axis}, {value:g})" for name, (axis, value) in self.padded.items())
            strips = ", ".join(f"{name} (axis {axis})" for name, axis in self.stripped.items())
            what = f"pads {pads or 'nothing'}; strips {strips or 'nothing'}"
            if self.state_padding == "right":
                what += "; state padded on the right"
        return f"{what}; {self.probe}" if self.probe else what

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "padded": {k: {"axis": a, "value": v} for k, (a, v) in self.padded.items()},
            "stripped": dict(self.stripped),
            "probe": self.probe,
            **({"state_padding": self.state_padding} if self.state_padding != "left" else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Batching:
        """Read the JSON form; anything malformed is a :class:`ConfigError` naming the key."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: batching must be an object, got {describe_json(data)}")
        unknown = sorted(set(data) - {"padded", "stripped", "probe", "state_padding"})
        if unknown:
            raise ConfigError(f"{where}: batching: unknown key '{unknown[0]}'; valid: 'padded', 'stripped', 'probe', 'state_padding'")
        side = data.get("state_padding", "left")
        if side not in ("left", "right"):
            raise ConfigError(f"{where}: batching: state_padding must be \"left\" or \"right\", got {_brief_json(side)}")
        padded: dict[str, tuple[int, float]] = {}
        for name, pad in _need(data, "padded", dict, f"{where}: batching", {}).items():
            if not isinstance(pad, dict) or set(pad) != {"axis", "value"} or not _is_index(pad["axis"]) or not _is_number(pad["value"]):
                raise ConfigError(f"{where}: batching: padded '{name}' must be {{\"axis\": int >= 1, \"value\": number}}, got {_brief_json(pad)}")
            padded[name] = (pad["axis"], float(pad["value"]))
        stripped: dict[str, int] = {}
        for name, axis in _need(data, "stripped", dict, f"{where}: batching", {}).items():
            if not _is_index(axis):
                raise ConfigError(f"{where}: batching: stripped '{name}' must be an axis (an int >= 1), got {_brief_json(axis)}")
            stripped[name] = axis
        return cls(padded, stripped, _need(data, "probe", str, f"{where}: batching", ""), side)


def _brief_json(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class StageSpec:
    """What one stage needs to run: its module (or its code) and the tensors at its boundary.

    Attributes:
        name: Unique stage name.
        module: Path of the stage's .onnx module, relative to the folder holding the spec;
            ``None`` for a code stage.
        inputs: The stage's input tensors, in the module's order.
        outputs: The stage's output tensors, in the module's order.
        settings: How the stage's session is made (target, threads, affinity, ...).
        build: What the builder did to the module (free-form strings and numbers, e.g. which
            provider it was optimized for and whether the target still optimizes it at load).
        code: For a code stage, its entry point and parameters (spec version 2; ``module`` is
            then ``None``).
        batching: How it batches (written by the build when ``settings.max_batch`` is above 1).
        runs: When it runs in a stream (:data:`RUNS`): ``"every"`` step, or on the ``"first"``
            step only (an encoder: see Note: first-step stages, :class:`PipelineSpec`).
    """

    name: str
    module: str | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    settings: StageSettings = field(default_factory=StageSettings)
    build: Mapping[str, Any] = field(default_factory=dict)
    code: CodeSpec | None = None
    batching: Batching | None = None
    runs: str = "every"

    @property
    def first_step_only(self) -> bool:
        """Whether the stage runs on a stream's first step only (``runs == "first"``)."""
        return self.runs == "first"

    @property
    def is_code(self) -> bool:
        """Whether the stage runs a Python callable rather than an ONNX module. Code that goes on
        to read ``code`` tests ``code is not None`` instead, which narrows its type for mypy."""
        return self.code is not None

    def check(self) -> None:
        """Check the stage on its own: a module or code (not both), unique port names, known
        dtypes, and for a code stage a shape on every port (its values are checked against it).

        Raises:
            ConfigError: naming the stage and the port.
        """
        if (self.module is None) == (self.code is None):
            raise ConfigError(f"stage '{self.name}' must have either a module or code (an entry point), not {'both' if self.code else 'neither'}")
        if self.runs not in RUNS:
            raise ConfigError(f"stage '{self.name}': runs must be one of {', '.join(repr(r) for r in RUNS)}, got {describe_json(self.runs)}")
        _unique(f"input of stage '{self.name}'", (t.name for t in self.inputs))
        _unique(f"output of stage '{self.name}'", (t.name for t in self.outputs))
        for spec in (*self.inputs, *self.outputs):
            if spec.dtype not in DTYPES:
                raise ConfigError(f"stage '{self.name}': tensor '{spec.name}' has unknown dtype '{spec.dtype}'; valid: {', '.join(DTYPES)}")
            if not self.is_code and spec.dtype in CODE_DTYPES:
                raise ConfigError(
                    f"stage '{self.name}': tensor '{spec.name}' is {spec.dtype}, which only code stages' ports may be "
                    "(raw bytes; ONNX's text tensors are 'string')"
                )
            if self.is_code and spec.shape is None:
                raise ConfigError(f"code stage '{self.name}': port '{spec.name}' needs a shape (a list of sizes, names or nulls) so its values can be checked")
        if self.settings.max_batch > 1 and self.is_code:
            raise ConfigError(f"code stage '{self.name}': max_batch {self.settings.max_batch}: code stages run one request at a time; set max_batch=1")
        if self.batching is not None:
            for names, ports, what in ((self.batching.padded, self.inputs, "input"), (self.batching.stripped, self.outputs, "output")):
                for name in names:
                    find_tensor(ports, name, f"stage '{self.name}': batching names a padded or stripped {what} it does not have:")

    def input(self, name: str) -> TensorSpec:
        """The input named ``name``; :class:`ConfigError` naming the valid ones otherwise."""
        return find_tensor(self.inputs, name, f"stage '{self.name}' has no input")

    def output(self, name: str) -> TensorSpec:
        """The output named ``name``; :class:`ConfigError` naming the valid ones otherwise."""
        return find_tensor(self.outputs, name, f"stage '{self.name}' has no output")


def check_state_ends(state: StateLink, inputs: Iterable[TensorSpec], outputs: Iterable[TensorSpec]) -> TensorSpec:
    """Check that a state link's output and input exist in its stage (whose boundary is given) and
    fit: same dtype and rank, a known rank, an ``empty_axis`` in range. Returns the input's spec.

    Raises:
        ConfigError: naming the link and the valid choices.
    """
    where = f"state link {state.output} -> {state.input}"
    out = find_tensor(outputs, state.output, f"{where}: stage '{state.stage}' has no output")
    inp = find_tensor(inputs, state.input, f"{where}: stage '{state.stage}' has no input")
    if out.dtype != inp.dtype:
        raise ConfigError(f"{where}: dtype {out.dtype} != {inp.dtype}; a state output must have its input's dtype")
    if inp.shape is None:
        raise ConfigError(f"{where}: the rank of input '{inp.name}' is unknown, so its initial value has no shape")
    if out.shape is not None and len(out.shape) != len(inp.shape):
        raise ConfigError(f"{where}: rank {len(out.shape)} != {len(inp.shape)} ({_shape(out.shape)} vs {_shape(inp.shape)})")
    for i, (a, b) in enumerate(zip(inp.shape, out.shape or (), strict=False)):
        if i != state.empty_axis and isinstance(a, int) and isinstance(b, int) and a != b:
            raise ConfigError(f"{where}: dim {i} is {b} in the output but {a} in the input ({_shape(out.shape)} vs {_shape(inp.shape)})")
    if state.once and state.shared:
        raise ConfigError(f"{where}: a state set once is never written in place; it cannot be both once and shared")
    axis = state.empty_axis
    if axis is not None and not 0 <= axis < len(inp.shape):
        raise ConfigError(f"{where}: empty_axis {axis} is out of range for {inp}; valid: 0..{len(inp.shape) - 1}")
    if axis is not None and isinstance(inp.shape[axis], int) and inp.shape[axis] != 0:
        raise ConfigError(f"{where}: empty_axis {axis} of {inp} has the fixed size {inp.shape[axis]}, so it cannot start empty")
    return inp


def find_tensor(specs: Iterable[TensorSpec], name: str, what: str) -> TensorSpec:
    """The spec named ``name`` in ``specs``, or a :class:`ConfigError` starting with ``what``."""
    specs = tuple(specs)
    for spec in specs:
        if spec.name == name:
            return spec
    raise ConfigError(f"{what} '{name}'; {closest(name, (s.name for s in specs))}")


@dataclass(frozen=True)
class ParamGroup:
    """Weights of one stage that a user may swap at run time, under one name (TVM's param group).

    Attributes:
        name: The group's name, as ``set_params`` takes it.
        stage: The stage whose initializers these are.
        params: The initializers, with their dtypes and shapes.
    """

    name: str
    stage: str
    params: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class StateLink:
    """A stage output that feeds the same stage's input on its stream's next step (a recurrent
    state, a layer's KV cache): see docs/streams.md.

    Note: initial values.
        A stream's first step feeds the state input zeros of the input's declared shape. Fixed
        sizes are taken as they are; a symbolic dim takes its size from the pipeline input that
        names it on the stream's first step (``"batch"``), or else from a kept input of the same
        stage that names it (the encoder's output, ``encoder_sequence_length``: Note: first-step
        stages, ``PipelineSpec``); the ``empty_axis``, if given, is 0 long, as a decoder's first
        step feeds an empty past. Any other dim (unnamed, or named by neither) has no size to
        start from, and :meth:`PipelineSpec.validate` refuses it.

    Attributes:
        stage: The stage both tensors belong to.
        output: The stage output holding the new state after a step (``present.0.key``).
        input: The stage input fed the state on the next step (``past_key_values.0.key``).
        empty_axis: The axis along which the initial state is empty (a past's sequence axis), or
            ``None`` for zeros of the full shape.
        shared: The stage's module may write the output into the input's own buffer, so the
            runtime keeps the state in place (``_stage``, Note: state in place): the build sets it
            where onnxruntime's ``GroupQueryAttention`` reads the input as its past and makes the
            output as its present (``past_present_share_buffer``).
        once: The state is set once and kept (Note: a state set once): the input is fed the
            output of the stream's first step on every later step; the output of a later step is
            no state update (an encoder's cross-attention KV, which optimum's merged decoder
            computes on its first step and only passes through, or stubs out, after).

    Note: a state set once.
        A ``once`` link's state is what the stream's first step made: each later step is fed it
        as it was, and what the stage outputs there is not kept (optimum's merged decoder emits
        a ``[0, heads, 1, dkv]`` placeholder for each ``present.N.encoder.*`` on its cached
        branch). Its initial value is as for any link (Note: initial values: optimum feeds an
        empty past on the first step, so its ``empty_axis`` is the encoder's length). It never
        grows, so a batch of steps joins the members' once-states only where their shapes agree
        (the same encoder length), and runs each member alone otherwise; and a batch mixing
        first steps with later ones runs each member alone too.
    """

    stage: str
    output: str
    input: str
    empty_axis: int | None = None
    shared: bool = False
    once: bool = False

    def __str__(self) -> str:
        when = "every later step, set by the first" if self.once else "next step"
        return f"{self.stage}.{self.output} -> {self.stage}.{self.input} ({when})"


@dataclass(frozen=True)
class StepFlag:
    """A stage input the runtime feeds by a stream's step: ``first`` on the stream's first step,
    ``not first`` on every later one (a bool tensor of the input's fixed shape, ``[1]`` as a
    rule). optimum's merged decoders take ``use_cache_branch``: ``False`` selects the branch that
    runs without a past (the first step), ``True`` the one that reads it; with a step flag, a
    stream's steps feed only the tokens (docs/streams.md). A pipeline without state links has no
    steps, so it has no step flags: the input stays a pipeline input.

    Attributes:
        stage: The stage whose input it is.
        input: The input (dtype bool, every dim fixed).
        first: Its value on a stream's first step; every later step feeds the other.
    """

    stage: str
    input: str
    first: bool = False

    def __str__(self) -> str:
        return f"{self.stage}.{self.input} ({self.first} on a stream's first step, {not self.first} after)"


@dataclass(frozen=True)
class PipelineSpec:
    """A whole pipeline: global inputs and outputs, stages in pipeline order, and the links.

    Build one through :class:`onnxpipe.builder.PipelineConfig`; :meth:`validate` checks the
    invariants the runtime relies on.

    Note: first-step stages.
        A stage with ``runs == "first"`` (an encoder: Whisper's audio encoder, T5's text encoder)
        runs on a stream's first step only; on its later steps every engine passes the request
        through it without a call. What it makes is needed on every step all the same (the
        decoder's cross-attention reads the encoder's output each step), so each later stage
        that reads it *keeps* it: a **kept input** is an input of an every-step stage fed by a
        first-step stage's output, or by a pipeline input that a first-step stage reads (a
        **first-step input**: T5's ``attention_mask``, which the encoder reads and the decoder
        reads as ``encoder_attention_mask``). The stage takes a kept input from the bag on the
        stream's first step and keeps that value per stream, feeding it on every later step as
        it feeds a state (``StageRunner``: held with the stream's state, batched as one block,
        dropped when the stream closes). First-step inputs are given on a stream's first step
        and on no other (a later step that gives one is refused: the stream would not use it).
        A kept input is not a state link: a state link feeds a stage's *output* back to its own
        input; a kept input is the first step's *input*, kept as it came. Validation refuses a
        first-step stage with state links, in a pipeline without state links (no streams), or
        feeding a pipeline output (later steps would have no value for it).
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    stages: tuple[StageSpec, ...]
    links: tuple[Link, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)
    param_groups: tuple[ParamGroup, ...] = ()
    states: tuple[StateLink, ...] = ()
    step_flags: tuple[StepFlag, ...] = ()

    def flags_of(self, stage: str) -> tuple[StepFlag, ...]:
        """The step flags of one stage (see :class:`StepFlag`)."""
        return tuple(f for f in self.step_flags if f.stage == stage)

    def states_of(self, stage: str) -> tuple[StateLink, ...]:
        """The state links of one stage (empty for a stateless stage)."""
        return tuple(s for s in self.states if s.stage == stage)

    def stage(self, name: str) -> StageSpec:
        """The stage named ``name``; :class:`ConfigError` naming the valid ones otherwise."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ConfigError(f"no stage '{name}'; {closest(name, (s.name for s in self.stages))}")

    def source_of(self, dst: Endpoint) -> Endpoint:
        """The endpoint that feeds ``dst`` (a stage input or a global output)."""
        try:
            return self._sources[dst]
        except KeyError:
            raise ConfigError(f"nothing feeds {dst}") from None

    @cached_property
    def _sources(self) -> dict[Endpoint, Endpoint]:
        return {link.dst: link.src for link in self.links}

    @property
    def first_step_inputs(self) -> tuple[str, ...]:
        """The pipeline inputs a stream gives on its first step only: those a first-step stage
        reads (Note: first-step stages); empty without first-step stages."""
        return self._first_steps[0]

    def kept_inputs(self, stage: str) -> tuple[str, ...]:
        """The inputs of ``stage`` it keeps per stream from the stream's first step (Note:
        first-step stages); empty for a first-step stage and where there is none."""
        return self._first_steps[1].get(stage, ())

    @cached_property
    def _first_steps(self) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
        first = {s.name for s in self.stages if s.first_step_only}
        if not first:
            return (), {}
        read = {lk.src.tensor for lk in self.links if lk.src.stage is None and lk.dst.stage in first}
        inputs = tuple(t.name for t in self.inputs if t.name in read)
        kept: dict[str, list[str]] = {}
        for lk in self.links:
            once = lk.src.stage in first if lk.src.stage is not None else lk.src.tensor in read
            if once and lk.dst.stage is not None and lk.dst.stage not in first:
                kept.setdefault(lk.dst.stage, []).append(lk.dst.tensor)
        order = {s.name: [t.name for t in s.inputs] for s in self.stages}
        return inputs, {name: tuple(sorted(names, key=order[name].index)) for name, names in kept.items()}

    def validate(self) -> None:
        """Check the wiring; raise one :class:`ConfigError` describing the first problem found.

        Checked: unique names, known dtypes, links between existing endpoints going the right way,
        matching dtypes and shapes, every stage input and global output fed exactly once, and stages
        listed so that every link goes forward (which also rules out cycles).
        """
        self._check_names()
        for stage in self.stages:
            stage.check()
            if stage.is_code and any(g.stage == stage.name for g in self.param_groups):
                raise ConfigError(f"stage '{stage.name}' is a code stage; param groups name initializers of ONNX stages only")
        for spec in self._all_tensors():
            if spec.dtype not in DTYPES:
                raise ConfigError(f"tensor '{spec.name}' has unknown dtype '{spec.dtype}'; valid: {', '.join(DTYPES)}")
        fed = self._check_links()
        for state in self.states:
            self._check_state(state, fed)
            fed[Endpoint(state.stage, state.input)] = Link(Endpoint(state.stage, state.output), Endpoint(state.stage, state.input))
        for flag in self.step_flags:
            self._check_flag(flag, fed)
            fed[Endpoint(flag.stage, flag.input)] = Link(Endpoint(flag.stage, flag.input), Endpoint(flag.stage, flag.input))
        self._check_fed(fed)
        self._check_first_steps()

    def _check_names(self) -> None:
        """Unique names of stages, pipeline inputs and outputs, param groups, and of each group's
        parameters; every group names a stage."""
        _unique("stage", (s.name for s in self.stages))
        _unique("pipeline input", (t.name for t in self.inputs))
        _unique("pipeline output", (t.name for t in self.outputs))
        _unique("param group", (g.name for g in self.param_groups))
        for group in self.param_groups:
            self.stage(group.stage)
            _unique(f"parameter of group '{group.name}'", (t.name for t in group.params))

    def _check_links(self) -> dict[Endpoint, Link]:
        """Every link between existing endpoints, feeding its end alone, going forward, between
        tensors that match; returns the links by the endpoint each feeds."""
        position = {s.name: i for i, s in enumerate(self.stages)}
        fed: dict[Endpoint, Link] = {}
        for link in self.links:
            src = self._source_spec(link.src)
            dst = self._destination_spec(link.dst)
            if link.dst in fed:
                raise ConfigError(f"{link.dst} is fed twice: by {fed[link.dst].src} and by {link.src}")
            fed[link.dst] = link
            if link.src.stage is not None and link.src.stage == link.dst.stage:
                raise ConfigError(f"link {link} connects stage '{link.src.stage}' to itself")
            if link.src.stage is not None and link.dst.stage is not None and position[link.src.stage] > position[link.dst.stage]:
                raise ConfigError(self._backward(link, position))
            reason = src.mismatch(dst)
            if reason:
                raise ConfigError(f"link {link}: {reason}")
        return fed

    def _check_fed(self, fed: Mapping[Endpoint, Link]) -> None:
        """Every stage input and pipeline output fed (by a link or a state link)."""
        for stage in self.stages:
            for t in stage.inputs:
                if Endpoint(stage.name, t.name) not in fed:
                    raise ConfigError(f"input '{t.name}' of stage '{stage.name}' is not fed by any link")
        for t in self.outputs:
            if Endpoint(None, t.name) not in fed:
                raise ConfigError(f"pipeline output '{t.name}' is not fed by any link")

    def _check_first_steps(self) -> None:
        """First-step stages (Note: first-step stages): in a pipeline with streams, keeping no
        state of their own, feeding no pipeline output."""
        for stage in self.stages:
            if not stage.first_step_only:
                continue
            where = f"stage '{stage.name}' runs on a stream's first step only (runs \"first\")"
            if not self.states:
                raise ConfigError(f"{where}, but the pipeline keeps no state between steps (no state links), so it has no streams; "
                                  "make it run on every step, or add the decoder's state links")
            if self.states_of(stage.name):
                raise ConfigError(f"{where}, yet it has state links ({self.states_of(stage.name)[0]}): a stage that runs once has no next step to feed")
            outputs = [lk.dst.tensor for lk in self.links if lk.src.stage == stage.name and lk.dst.stage is None]
            if outputs:
                raise ConfigError(f"{where}, yet it feeds pipeline output '{outputs[0]}', which its later steps would lack; "
                                  "read it in a later stage, or make the stage run on every step")

    def _check_state(self, state: StateLink, fed: Mapping[Endpoint, Link]) -> None:
        """One state link: its ends (see :func:`check_state_ends`), its input fed by it alone, and
        an initial value whose every size is known (see Note: initial values)."""
        where = f"state link {state.output} -> {state.input}"
        try:
            stage = self.stage(state.stage)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        inp = check_state_ends(state, stage.inputs, stage.outputs)
        if Endpoint(stage.name, inp.name) in fed:
            other = fed[Endpoint(stage.name, inp.name)].src
            raise ConfigError(f"{where}: input '{inp.name}' of stage '{stage.name}' is fed twice: by {other} and by its state")
        kept = self.kept_inputs(stage.name)  # an encoder's output, on the first step (Note: first-step stages)
        named = {d for t in (*self.inputs, *(stage.input(k) for k in kept)) for d in (t.shape or ()) if isinstance(d, str)}
        for i, d in enumerate(inp.shape or ()):
            if i != state.empty_axis and not isinstance(d, int) and d not in named:
                dim = "unnamed" if d is None else f"'{d}'"
                choices = ", ".join(repr(n) for n in sorted(named)) or "none"
                raise ConfigError(
                    f"{where}: dim {i} ({dim}) of {inp} has no initial size: no pipeline input names it "
                    f"(named dims: {choices}); make it the empty_axis or give it a fixed size or a named one"
                )

    def _check_flag(self, flag: StepFlag, fed: Mapping[Endpoint, Link]) -> None:
        """One step flag: a bool input of fixed shape of a stage in a pipeline with state links
        (a stream's steps), fed by nothing else."""
        where = f"step flag {flag.stage}.{flag.input}"
        try:
            stage = self.stage(flag.stage)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        inp = find_tensor(stage.inputs, flag.input, f"{where}: stage '{stage.name}' has no input")
        if not self.states:
            raise ConfigError(f"{where}: the pipeline has no state links, so no stream's steps to flag; feed '{inp.name}' as a pipeline input")
        if inp.dtype != "bool" or inp.shape is None or not all(isinstance(d, int) for d in inp.shape):
            raise ConfigError(f"{where}: {inp} must be a bool of fixed shape (as use_cache_branch [1])")
        if Endpoint(stage.name, inp.name) in fed:
            raise ConfigError(f"{where}: input '{inp.name}' of stage '{stage.name}' is fed by {fed[Endpoint(stage.name, inp.name)].src} as well")

    def _backward(self, link: Link, position: dict[str, int]) -> str:
        # Tell a cycle apart from a mere listing order: the first is a wiring bug, the second is not
        # possible for a spec built by PipelineConfig, which lists stages in topological order.
        edges: dict[str, set[str]] = {s.name: set() for s in self.stages}
        for lk in self.links:
            if lk.src.stage is not None and lk.dst.stage is not None:
                edges[lk.src.stage].add(lk.dst.stage)
        cycle = _find_cycle(edges)
        if cycle:
            return "stages form a cycle: " + " -> ".join(cycle)
        return (
            f"link {link} goes backwards: stage '{link.src.stage}' is listed after "
            f"'{link.dst.stage}'; stages must be listed in pipeline order"
        )

    def _source_spec(self, ep: Endpoint) -> TensorSpec:
        if ep.stage is None:
            return find_tensor(self.inputs, ep.tensor, "a link starts at unknown pipeline input")
        return self._stage_for(ep).output(ep.tensor)

    def _destination_spec(self, ep: Endpoint) -> TensorSpec:
        if ep.stage is None:
            return find_tensor(self.outputs, ep.tensor, "a link ends at unknown pipeline output")
        return self._stage_for(ep).input(ep.tensor)

    def _stage_for(self, ep: Endpoint) -> StageSpec:
        assert ep.stage is not None
        try:
            return self.stage(ep.stage)
        except ConfigError as e:
            raise ConfigError(f"link endpoint {ep}: {e}") from None

    def _all_tensors(self) -> Iterable[TensorSpec]:
        yield from self.inputs
        yield from self.outputs
        for stage in self.stages:
            yield from stage.inputs
            yield from stage.outputs

    # -- JSON --------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (see docs/bundle-format.md)."""
        return {
            "format": SPEC_FORMAT,
            "version": SPEC_VERSION,
            "metadata": dict(self.metadata),
            "inputs": [_tensor_to_dict(t) for t in self.inputs],
            "outputs": [_tensor_to_dict(t) for t in self.outputs],
            "stages": [_stage_to_dict(s) for s in self.stages],
            "param_groups": [
                {"name": g.name, "stage": g.stage, "params": [_tensor_to_dict(t) for t in g.params]} for g in self.param_groups
            ],
            "links": [{"from": _endpoint_to_dict(lk.src, "input"), "to": _endpoint_to_dict(lk.dst, "output")} for lk in self.links],
            # Written only when there are some, so a stateless pipeline's JSON is as before.
            **({"states": [_state_to_dict(s) for s in self.states]} if self.states else {}),
            **({"step_flags": [{"stage": f.stage, "input": f.input, "first": f.first} for f in self.step_flags]} if self.step_flags else {}),
        }

    def to_json(self) -> str:
        """The spec as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> PipelineSpec:
        """Read the JSON form; :class:`ConfigError` naming the field on any structural problem (not validated)."""
        return _from_dict(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> PipelineSpec:
        """Parse and read JSON text; :class:`ConfigError` if it is not a pipeline spec (see :func:`parse_json`)."""
        return cls.from_dict(parse_json(text, "pipeline spec"))


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(f"key '{key}' appears twice in one object")
        data[key] = value
    return data


def parse_json(text: str | bytes, what: str, error: type[OnnxpipeError] = ConfigError) -> Any:
    """Parse the JSON text of ``what``, strictly: one error for anything a reader could misread.

    Refused: malformed JSON, text that is not UTF-8, a key given twice in one object (Python's
    ``json`` would keep the last one silently, so two readers could disagree), nesting deeper than
    the interpreter's recursion limit, and integers with more digits than Python converts.

    Raises:
        OnnxpipeError: an ``error`` (default :class:`ConfigError`) naming ``what`` and the problem.
    """
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise error(f"{what}: {e}") from None
    except RecursionError:
        raise error(f"{what} is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and ints of more than 4300 digits
        raise error(f"{what} is not valid JSON: {e}") from None


def _unique(what: str, names: Iterable[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"duplicate {what} '{name}'")
        seen.add(name)


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in edges:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _tensor_to_dict(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "shape": None if t.shape is None else list(t.shape)}


def _need(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    """``data[key]``, checked to be of ``kind`` (an optional key may be missing: ``default``)."""
    if key not in data:
        if default is not ...:
            return default
        raise ConfigError(f"{where}: '{key}' is missing")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    value = data[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # JSON true is no integer
        raise ConfigError(f"{where}: '{key}' must be {' or '.join(_JSON_NAMES[k] for k in kinds)}, got {describe_json(value)}")
    return value


_JSON_NAMES: dict[type, str] = {str: "a string", int: "an integer", bool: "true or false", list: "a list", dict: "an object", type(None): "null"}


def describe_json(value: Any) -> str:
    """A JSON value as an error message shows it: numbers and short strings in full, anything else by kind."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        text = json.dumps(value)
        if len(text) <= 40:
            return text
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _items(data: Mapping[str, Any], key: str, where: str, optional: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The objects in the list ``data[key]``, each with how a message names it."""
    values = _need(data, key, list, where, [] if optional else ...)
    for i, value in enumerate(values):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key}[{i}] must be an object, got {describe_json(value)}")
    return [(f"{where}: {key}[{i}]" + (f" ('{v['name']}')" if isinstance(v.get("name"), str) else ""), v) for i, v in enumerate(values)]


def _strings(data: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    """An optional object of strings (``metadata``)."""
    values = _need(data, key, dict, where, {})
    for k, v in values.items():
        if not isinstance(v, str):
            raise ConfigError(f"{where}: {key}['{k}'] must be a string, got {describe_json(v)}")
    return dict(values)


def _tensor_from_dict(d: Mapping[str, Any], where: str = "tensor") -> TensorSpec:
    name = _need(d, "name", str, where)
    dtype = _need(d, "dtype", str, where)
    shape = _need(d, "shape", (list, type(None)), f"{where} ('{name}')", None)
    if shape is not None:
        if not all(x is None or (isinstance(x, (int, str)) and not isinstance(x, bool)) for x in shape):
            raise ConfigError(f"tensor '{name}': shape must be a list of ints, names or nulls, got {shape!r}")
        shape = tuple(shape)
    return TensorSpec(name, dtype, shape)


def _state_to_dict(state: StateLink) -> dict[str, Any]:
    data: dict[str, Any] = {"stage": state.stage, "output": state.output, "input": state.input}
    if state.empty_axis is not None:
        data["empty_axis"] = state.empty_axis
    if state.shared:
        data["shared"] = True
    if state.once:
        data["once"] = True
    return data


def _state_from_dict(d: Mapping[str, Any], where: str) -> StateLink:
    unknown = set(d) - {"stage", "output", "input", "empty_axis", "shared", "once"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; valid: stage, output, input, empty_axis, shared, once")
    axis = _need(d, "empty_axis", (int, type(None)), where, None)
    shared = _need(d, "shared", bool, where, False)
    once = _need(d, "once", bool, where, False)
    return StateLink(_need(d, "stage", str, where), _need(d, "output", str, where), _need(d, "input", str, where), axis, shared, once)


def _flag_from_dict(d: Mapping[str, Any], where: str) -> StepFlag:
    unknown = set(d) - {"stage", "input", "first"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; valid: stage, input, first")
    return StepFlag(_need(d, "stage", str, where), _need(d, "input", str, where), _need(d, "first", bool, where, False))


def _endpoint_to_dict(ep: Endpoint, global_key: str) -> dict[str, str]:
    return {global_key: ep.tensor} if ep.stage is None else {"stage": ep.stage, "tensor": ep.tensor}


def _endpoint_from_dict(d: Any, global_key: str, where: str) -> Endpoint:
    if isinstance(d, dict) and all(isinstance(v, str) for v in d.values()):
        if set(d) == {global_key}:
            return Endpoint(None, d[global_key])
        if set(d) == {"stage", "tensor"}:
            return Endpoint(d["stage"], d["tensor"])
    raise ConfigError(f"{where}: a link end must be {{\"{global_key}\": name}} or {{\"stage\": s, \"tensor\": t}} with string values, got {describe_json(d)}")


def _stage_to_dict(s: StageSpec) -> dict[str, Any]:
    # A code stage has "code" instead of "module" (version 2); an ONNX stage is written as in version 1.
    head: dict[str, Any] = {"name": s.name, "module": s.module} if s.code is None else {"name": s.name, "code": s.code.to_dict()}
    return {
        **head,
        "inputs": [_tensor_to_dict(t) for t in s.inputs],
        "outputs": [_tensor_to_dict(t) for t in s.outputs],
        "settings": s.settings.to_dict(),
        "build": dict(s.build),
        **({"batching": s.batching.to_dict()} if s.batching is not None else {}),
        **({"runs": s.runs} if s.runs != "every" else {}),  # written only when set, so other stages' JSON is as before
    }


def _code_from_dict(s: dict[str, Any], where: str) -> CodeSpec | None:
    code = _need(s, "code", dict, where, None)
    if code is None:
        return None
    unknown = sorted(set(code) - {"entry", "params"})
    if unknown:
        raise ConfigError(f"{where}: code: unknown key '{unknown[0]}'; valid: 'entry', 'params'")
    entry = check_entry_point(_need(code, "entry", str, f"{where}: code"), where)
    return CodeSpec(entry, _need(code, "params", dict, f"{where}: code", {}))


def _stage_from_dict(s: dict[str, Any], where: str) -> StageSpec:
    settings = _need(s, "settings", dict, where, {})
    build = _need(s, "build", dict, where, {})
    try:
        parsed = StageSettings.from_dict(settings)
    except ConfigError as e:
        raise ConfigError(f"{where}: settings: {e}") from None
    code = _code_from_dict(s, where)
    if code is not None and "module" in s:
        raise ConfigError(f"{where}: a stage has either 'module' (ONNX) or 'code' (an entry point), not both")
    return StageSpec(
        name=_need(s, "name", str, where),
        module=None if code is not None else _need(s, "module", str, where),
        code=code,
        inputs=tuple(_tensor_from_dict(t, w) for w, t in _items(s, "inputs", where)),
        outputs=tuple(_tensor_from_dict(t, w) for w, t in _items(s, "outputs", where)),
        settings=parsed,
        build=dict(build),
        batching=Batching.from_dict(s["batching"], where) if "batching" in s else None,
        runs=_need(s, "runs", str, where, "every"),
    )


def _from_dict(data: Any) -> PipelineSpec:
    if not isinstance(data, dict) or data.get("format") != SPEC_FORMAT:
        raise ConfigError(f"not a pipeline spec: expected \"format\": \"{SPEC_FORMAT}\"")
    version = data.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        readable = " and ".join(str(v) for v in READ_VERSIONS)
        raise ConfigError(f"pipeline spec version {describe_json(version)} is not supported; this onnxpipe reads versions {readable}")
    where = "pipeline spec"
    groups = tuple(
        ParamGroup(_need(g, "name", str, w), _need(g, "stage", str, w), tuple(_tensor_from_dict(t, pw) for pw, t in _items(g, "params", w)))
        for w, g in _items(data, "param_groups", where, optional=True)
    )
    spec = PipelineSpec(
        inputs=tuple(_tensor_from_dict(t, w) for w, t in _items(data, "inputs", where)),
        outputs=tuple(_tensor_from_dict(t, w) for w, t in _items(data, "outputs", where)),
        stages=tuple(_stage_from_dict(s, w) for w, s in _items(data, "stages", where)),
        links=tuple(
            Link(_endpoint_from_dict(_need(lk, "from", dict, w), "input", w), _endpoint_from_dict(_need(lk, "to", dict, w), "output", w))
            for w, lk in _items(data, "links", where)
        ),
        metadata=_strings(data, "metadata", where),
        param_groups=groups,
        states=tuple(_state_from_dict(s, w) for w, s in _items(data, "states", where, optional=True)),
        step_flags=tuple(_flag_from_dict(f, w) for w, f in _items(data, "step_flags", where, optional=True)),
    )
    coded = [s.name for s in spec.stages if s.is_code]
    if coded and version == 1:
        raise ConfigError(f"pipeline spec version 1 has no code stages, yet stage '{coded[0]}' has code; code stages need version 2")
    return spec
