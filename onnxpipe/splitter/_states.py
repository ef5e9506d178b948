"""Pairing a model's state outputs with its state inputs, and keeping each pair in one stage.

Note: state pairs.
    A streaming model reads its state as graph inputs and writes the next state as graph outputs
    (``past_key_values.0.key`` -> ``present.0.key``, ``state`` -> ``stateN``). :func:`pair_states`
    finds such pairs by the common naming conventions (``"auto"``) or takes them as given
    (``{"present.0.key": "past_key_values.0.key"}``), checks that both tensors exist with the same
    dtype and rank, and finds the axis along which the first state is empty: the first axis where
    the input's dim is dynamic and the output's differs (a past's sequence length grows by each
    step's tokens). A split then keeps each pair in one stage (:func:`check_together`), since a
    stage's state never leaves it.

Note: merged decoders.
    optimum's ``decoder_model_merged.onnx`` is one ``If`` node on a bool graph input
    (``use_cache_branch``): one branch runs without a past (a stream's first step), the other
    reads it. :func:`step_branches` finds such an ``If`` (its condition a bool graph input; one
    branch reads some state input, the other none) and makes its condition a step flag
    (``StepFlag``: the value choosing the branch that reads no past on the first step, the other
    after), so a stream's steps feed only the tokens. A state pair whose output, in the branch the
    later steps take, is made by no computation -- a ``Constant`` or an initializer (optimum's
    ``[0, heads, 1, dkv]`` placeholder for ``present.N.encoder.*``), or its own past passed
    through (directly or by ``Identity``) -- is set once (``StateLink.once``): its state is the
    first step's output, kept. Any other output of that branch is a state update as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from onnx import GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto

from onnxpipe._errors import SplitError, closest
from onnxpipe.builder import tensor_spec
from onnxpipe.runtime import TensorSpec
from onnxpipe.splitter._graph import GraphIndex, reroute

__all__ = ["AUTO", "StatePair", "StateShapes", "check_together", "fixed_state_dims", "genai_head_dims", "one_if", "pair_states", "step_branches", "uncuttable"]

#: Ask :func:`pair_states` to pair names by convention.
AUTO = "auto"

#: Output name -> input name rewrites tried by ``"auto"``, in order (see docs/streams.md).
_CONVENTIONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^present(?P<rest>[._].*)$"), r"past_key_values\g<rest>"),  # optimum: present.0.key -> past_key_values.0.key
    (re.compile(r"^present(?P<rest>[._].*)$"), r"past\g<rest>"),  # present.0.key -> past.0.key, present_0 -> past_0
    (re.compile(r"^(?P<base>.+?)_?(?:N|n|_out|_new|_next)$"), r"\g<base>"),  # stateN -> state, hn -> h, state_out -> state
)


@dataclass(frozen=True)
class StatePair:
    """A model output that feeds a model input on the stream's next step.

    Attributes:
        output: The output holding the new state.
        input: The input fed the state.
        empty_axis: The axis along which the first state is empty, or ``None`` (zeros).
    """

    output: str
    input: str
    empty_axis: int | None = None
    once: bool = False

    def __str__(self) -> str:
        axis = f"starts empty along axis {self.empty_axis}" if self.empty_axis is not None else "starts as zeros"
        once = "; set once, by the first step" if self.once else ""
        return f"{self.output} -> {self.input} ({axis}{once})"


def pair_states(
    inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], asked: str | Mapping[str, str] | Sequence[tuple[str, str]]
) -> list[StatePair]:
    """The state pairs of a model, by convention (``"auto"``) or as given (output -> input).

    Args:
        inputs: The model's graph inputs.
        outputs: The model's graph outputs.
        asked: ``"auto"``, or the pairs output -> input.

    Returns:
        The pairs, in the order of the model's outputs (auto) or as given.

    Raises:
        SplitError: a named tensor does not exist (with the closest names), dtypes or ranks differ,
            an input is fed by two outputs, or ``"auto"`` finds no pair.
    """
    ins = {t.name: t for t in inputs}
    outs = {t.name: t for t in outputs}
    if isinstance(asked, str):
        if asked != AUTO:
            raise SplitError(f"states must be '{AUTO}' or pairs output -> input, got {asked!r}")
        wanted = _by_convention(ins, outs)
        if not wanted:
            raise SplitError(
                "no state pairs found by name (present.N... -> past_key_values.N... or past.N..., <name>N -> <name>); "
                f"outputs: {', '.join(outs) or 'none'}; inputs: {', '.join(ins) or 'none'}; give them as OUTPUT=INPUT"
            )
    else:
        wanted = list(asked.items()) if isinstance(asked, Mapping) else list(asked)
    pairs: list[StatePair] = []
    fed: dict[str, str] = {}
    for out_name, in_name in wanted:
        if out_name not in outs:
            raise SplitError(f"state {out_name}={in_name}: the model has no output '{out_name}'; {closest(out_name, outs)}")
        if in_name not in ins:
            raise SplitError(f"state {out_name}={in_name}: the model has no input '{in_name}'; {closest(in_name, ins)}")
        if in_name in fed:
            raise SplitError(f"state input '{in_name}' is paired with two outputs: '{fed[in_name]}' and '{out_name}'")
        fed[in_name] = out_name
        out, inp = outs[out_name], ins[in_name]
        if out.dtype != inp.dtype:
            raise SplitError(f"state {out_name}={in_name}: output '{out_name}' is {out.dtype} but input '{in_name}' is {inp.dtype}; a state keeps its dtype")
        if out.shape is not None and inp.shape is not None and len(out.shape) != len(inp.shape):
            raise SplitError(f"state {out_name}={in_name}: output has rank {len(out.shape)} but input has rank {len(inp.shape)}")
        for axis, (a, b) in enumerate(zip(inp.shape or (), out.shape or (), strict=False)):
            if isinstance(a, int) and isinstance(b, int) and a != b:
                raise SplitError(f"state {out_name}={in_name}: dim {axis} is {b} in output '{out_name}' but {a} in input '{in_name}'")
        pairs.append(StatePair(out_name, in_name, _empty_axis(out, inp)))
    return pairs


def _by_convention(ins: Mapping[str, TensorSpec], outs: Mapping[str, TensorSpec]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    taken: set[str] = set()
    for name, out in outs.items():
        for pattern, replace in _CONVENTIONS:
            if not pattern.match(name):
                continue
            candidate = pattern.sub(replace, name)
            inp = ins.get(candidate)
            if inp is not None and candidate not in taken and inp.dtype == out.dtype:
                found.append((name, candidate))
                taken.add(candidate)
                break
    return found


def _empty_axis(out: TensorSpec, inp: TensorSpec) -> int | None:
    """The first axis where the input's dim is dynamic and the output's differs (see Note: state pairs)."""
    if out.shape is None or inp.shape is None:
        return None
    for axis, (a, b) in enumerate(zip(inp.shape, out.shape, strict=True)):
        if not isinstance(a, int) and (a is None or a != b):
            return axis
    return None


def step_branches(model: ModelProto, pairs: Sequence[StatePair]) -> tuple[list[StatePair], dict[str, bool]]:
    """The state pairs with those set once marked, and the step flags (input -> its value on a
    stream's first step), of the ``If`` nodes that choose between a first step and a later one
    (see Note: merged decoders). A model without one gets ``pairs`` as they are and no flags."""
    graph = model.graph
    bools = {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.BOOL} - {t.name for t in graph.initializer}
    pasts = {p.input for p in pairs}
    once: set[str] = set()
    flags: dict[str, bool] = {}
    for node in graph.node:
        if node.op_type != "If" or node.domain not in ("", "ai.onnx") or not node.input or node.input[0] not in bools:
            continue
        later = _later_branch(node, pasts)
        if later is None:
            continue
        flags[node.input[0]] = later[0] == "else_branch"  # the first step takes the branch that reads no past
        made = dict(zip(node.output, (o.name for o in later[1].output), strict=False))
        once.update(p.output for p in pairs if p.output in made and _made_by_nothing(later[1], made[p.output], p.input))
    return [StatePair(p.output, p.input, p.empty_axis, p.output in once) for p in pairs], flags


def _later_branch(node: NodeProto, pasts: set[str]) -> tuple[str, GraphProto] | None:
    """The branch of an ``If`` the later steps take (its attribute's name and graph): the one of two
    that reads some state input, the other reading none; ``None`` otherwise."""
    branches = {a.name: a.g for a in node.attribute if a.name in ("then_branch", "else_branch")}
    reading = [(name, g) for name, g in branches.items() if _outer_reads(g) & pasts]
    return reading[0] if len(branches) == 2 and len(reading) == 1 else None


def one_if(index: GraphIndex) -> str | None:
    """The condition of the model's one ``If`` node, when its compute is that node alone (optimum's
    merged decoders, whose branches cannot be cut: docs/limitations.md); ``None`` otherwise."""
    compute = index.compute_nodes()
    return index.nodes[compute[0]].input[0] if len(compute) == 1 and index.nodes[compute[0]].op_type == "If" else None


def uncuttable(condition: str) -> str:
    """What a split asked to cut a model that is one ``If`` node on ``condition`` says (see :func:`one_if`)."""
    return (f"the model is one If node on '{condition}' (as optimum's merged decoders are): cuts inside its branches are not supported; "
            "run it as one stage (split --auto --stages 1, or a pipeline file stage without at/auto; with states \"auto\": "
            "docs/streams.md#merged-decoders) or split decoder_model.onnx and decoder_with_past_model.onnx instead")


def _outer_reads(graph: GraphProto) -> set[str]:
    """The names a subgraph reads from outside it (its own nodes' and its nested subgraphs')."""
    made = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    reads: set[str] = set()
    for node in graph.node:
        reads.update(n for n in node.input if n)
        for attr in node.attribute:
            for sub in ((attr.g,) if attr.HasField("g") else ()) + tuple(attr.graphs):
                reads |= _outer_reads(sub)
        made.update(node.output)
    reads.update(o.name for o in graph.output)
    return reads - made


def _made_by_nothing(branch: GraphProto, name: str, past: str) -> bool:
    """Whether ``name`` in ``branch`` is made by no computation (see Note: merged decoders): a
    constant, or ``past`` passed through, directly or by ``Identity``."""
    producer = {o: n for n in branch.node for o in n.output}
    while name in producer and producer[name].op_type == "Identity":
        name = producer[name].input[0]
    node = producer.get(name)
    if node is None:
        return name == past or name in {t.name for t in branch.initializer}
    return node.op_type == "Constant"


def check_together(pairs: Sequence[StatePair], readers: Mapping[str, Sequence[int]], makers: Mapping[str, int | None]) -> None:
    """Refuse a split that separates a state's input from its output.

    Args:
        pairs: The state pairs.
        readers: Stage indices reading each state input.
        makers: The stage making each state output (``None``: the output is an input handed through).

    Raises:
        SplitError: naming the pair and the stages, and what to do.
    """
    for pair in pairs:
        maker = makers.get(pair.output)
        read = sorted(set(readers.get(pair.input, ())))
        if maker is None:
            raise SplitError(f"state {pair.output}={pair.input}: output '{pair.output}' is a model input handed straight through, not made by any stage")
        if not read:
            raise SplitError(f"state {pair.output}={pair.input}: no stage reads input '{pair.input}', so it is no state of stage{maker}")
        if read != [maker]:
            where = ", ".join(f"stage{s}" for s in read)
            raise SplitError(
                f"the cuts separate state '{pair.input}' (read by {where}) from '{pair.output}' (made by stage{maker}): "
                f"a state stays in one stage; move the cut so that the nodes reading '{pair.input}' and the node making '{pair.output}' are in one stage"
            )


def fixed_state_dims(pairs: Sequence[StatePair], inputs: Sequence[TensorSpec], named: set[str], dims: Mapping[str, int] | None,
                     head_dims: Mapping[str, int]) -> tuple[dict[str, int], list[str]]:
    """Sizes for the symbolic dims of state inputs that no other pipeline input names (onnxruntime-genai's
    ``kv_cache_dim``): from ``dims`` (``--dim kv_cache_dim=64``) or from ``head_dims`` (a cache's head
    dim sized by the ``genai_config.json`` beside the model: :func:`genai_head_dims`). The split fixes them in every stage
    (they are a layer's constant, not a stream's), so a stream's first state has a size.

    Note: a state's constant dims.
        A state input's initial value is zeros of its shape with the empty axis 0 long (see
        ``StateLink``, Note: initial values); each other symbolic dim must be sized by a pipeline
        input that names it on the stream's first step. onnxruntime-genai's model builder names the
        KV cache's head dim ``kv_cache_dim``, which no other input carries: it is a constant of the
        model (its config's ``head_size``), so the split writes it into the stage models' ports.

    Returns:
        The sizes by dim name, and a note on where each came from.

    Raises:
        SplitError: such a dim has no size from either, saying to give it with ``--dim``.
    """
    by_name = {t.name: t for t in inputs}
    given = dict(dims or {})
    sizes: dict[str, int] = {}
    notes: list[str] = []
    for pair in pairs:
        shape = by_name[pair.input].shape or ()
        for axis, d in enumerate(shape):
            if axis == pair.empty_axis or not isinstance(d, str) or d in named or d in sizes:
                continue
            if d in given:
                sizes[d] = int(given[d])
                notes.append(f"state dim '{d}' fixed at {sizes[d]} in every stage (given)")
            elif d in head_dims:
                sizes[d] = head_dims[d]
                notes.append(f"state dim '{d}' fixed at {sizes[d]} in every stage (head_size of genai_config.json)")
            else:
                raise SplitError(
                    f"state input '{pair.input}' {_fmt(shape)}: dim {axis} ('{d}') is named by no other input, so a stream's first state has no "
                    f"size for it; give it with --dim {d}=N (dims=) -- it is a constant of the model, such as a head size"
                )
    return sizes, notes


def genai_head_dims(inputs: Sequence[TensorSpec], folder: Path | None) -> dict[str, int]:
    """The symbolic head dims of a genai export's caches (the last axis of its rank-4 ``past*``
    inputs: ``kv_cache_dim``) sized by the ``head_size`` of the ``genai_config.json`` in ``folder``;
    empty without one. A stateless split's profiling sizes them so (its stages keep them symbolic)."""
    head_size = _genai_head_size(folder)
    if head_size is None:
        return {}
    return {t.shape[-1]: head_size for t in inputs if t.name.startswith("past") and t.shape is not None and len(t.shape) == 4
            and isinstance(t.shape[-1], str)}


def _genai_head_size(folder: Path | None) -> int | None:
    """``model.decoder.head_size`` of the ``genai_config.json`` in ``folder``, if there is one."""
    if folder is None:
        return None
    path = Path(folder) / "genai_config.json"
    if not path.is_file():
        return None
    try:
        size = json.loads(path.read_text())["model"]["decoder"]["head_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def _fmt(shape: Sequence[object]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


class StateShapes:
    """Where a ``Shape`` node may read its shape from in a stage (see Note: a shape read elsewhere).

    Note: a shape read elsewhere.
        Two cases, one rule: a ``Shape`` node may read any tensor its stage holds whose declared
        (or inferred) dims, in the range the node reads, are the very dims of the tensor it read.

        - torch's dynamo exporter computes a decoder's past length once, from the shape of one
          layer's cache (``Shape(past_key_values.1.key)``), and every layer's mask and positions
          from it; cut between layers, that read lands in a stage that does not hold that cache,
          and a state stays in one stage. Every layer's cache is declared with the same dims
          (``[batch, 2, past_sequence_length, 16]``) and the pipeline grows them together, so the
          node reads the shape of a cache its own stage holds (:meth:`rehome`).
        - A shape value a later stage computes again (``_extract``, Note: shape values are
          recomputed) may start from the shape of an activation that stays behind
          (``Shape(input_layernorm output)`` of ``[batch_size, sequence_length, 64]``); the copy
          reads a tensor of the same dims that the stage has anyway (the residual stream crossing
          the cut, the input ids) (:meth:`source`).

        A dim that is unknown (no name, no value) matches nothing. Where no tensor matches, the
        value crosses as before (and a state read elsewhere is refused by ``check_together``).
    """

    def __init__(self, index: GraphIndex, stage_of: Mapping[int, int], pairs: Sequence[StatePair], types: Mapping[str, ValueInfoProto]) -> None:
        self.index = index
        self.types = types
        self.pairs = list(pairs)
        self.owner = {p.input: stage_of.get(index.producer[p.output]) if p.output in index.producer else None for p in pairs}
        self._specs: dict[str, TensorSpec | None] = {}

    def _shape(self, name: str) -> tuple[int | str | None, ...] | None:
        if name not in self._specs:
            info = self.types.get(name)
            self._specs[name] = tensor_spec(info) if info is not None and info.type.HasField("tensor_type") else None
        spec = self._specs[name]
        return None if spec is None else spec.shape

    def readable(self, name: str, stage: int, reads: Mapping[str, object]) -> bool:
        """Whether ``stage`` may read ``name``: its own state, or what it reads anyway, or a pipeline input."""
        if name in self.owner:
            return self.owner[name] == stage
        return name in reads or (name not in self.index.producer and name in self.index.inputs)

    def source(self, node: int, root: str, stage: int, reads: Mapping[str, object] = {}) -> str | None:
        """What the ``Shape`` node ``node`` reads in ``stage`` instead of ``root``: ``root`` itself
        when the stage may read it, else a tensor it may read with the same dims in the range the
        node reads (its own states first), or ``None``."""
        if self.readable(root, stage, reads):
            return root
        n = self.index.nodes[node]
        shape = self._shape(root)
        if n.op_type != "Shape" or n.domain not in ("", "ai.onnx") or not shape:
            return None
        attrs = {a.name: a.i for a in n.attribute}
        read = slice(attrs.get("start", 0), attrs.get("end", len(shape)))
        want = shape[read]
        if not want or any(d is None or (isinstance(d, str) and not d) for d in want):
            return None
        owned = [p.input for p in self.pairs if self.owner[p.input] == stage]
        inputs = [t for t in self.index.inputs if t not in self.owner]
        for other in (*owned, *reads, *inputs):
            theirs = self._shape(other)
            if other != root and theirs is not None and len(theirs) == len(shape) and theirs[read] == want and self.readable(other, stage, reads):
                return other
        return None

    def rehome(self, stage_of: Mapping[int, int]) -> list[str]:
        """Reroute (in the index) every ``Shape`` node that reads another stage's state to one of
        its own stage's (:meth:`source`); a note per node rerouted."""
        notes = []
        for root in self.owner:
            for i in list(self.index.consumers.get(root, [])):
                stage = stage_of.get(i)
                if stage is None or stage == self.owner[root]:
                    continue
                other = self.source(i, root, stage)
                if other is not None and other != root:
                    reroute(self.index, i, root, other)
                    notes.append(f"node {self.index.label(i)} in stage{stage} reads the shape of '{other}' for that of '{root}' "
                                 "(declared alike: see docs/streams.md)")
        return notes
