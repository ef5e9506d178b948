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
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from onnxpipe._errors import SplitError, closest
from onnxpipe.runtime import TensorSpec

__all__ = ["AUTO", "StatePair", "check_together", "pair_states"]

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

    def __str__(self) -> str:
        axis = f" (starts empty along axis {self.empty_axis})" if self.empty_axis is not None else " (starts as zeros)"
        return f"{self.output} -> {self.input}{axis}"


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
