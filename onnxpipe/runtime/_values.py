"""What the values of a pipeline input mean, for sample inputs: masks, positions, indices into a table.

Note: sample values.
    Random integers break models whose integer inputs index something: BERT's ``token_type_ids``
    index a table of ``type_vocab_size`` rows (2), so ids drawn from 0..3 fail in the ``Gather``
    that reads it (``indices element out of data bounds``), and T5's mask enters ``(1 - mask) * min``,
    which overflows to NaN for a mask of 2 or 3. So sample inputs (``random_inputs``) give an input
    the values its meaning allows (an :class:`InputValues`):

    - ``mask``: all ones (attend everywhere). By name: ``*attention_mask*``, ``*_mask`` and ``mask``
      (:func:`is_mask_name`), of an integer or boolean input of rank 1 or 2 (a padding mask; a float
      mask may be additive, and a rank-4 integer ``mask`` of an image model is no padding mask);
    - ``positions``: 0, 1, ... along the last axis, in every row (a decoder's count on from its
      past: Note: a decoder's sample inputs). By name: :data:`POSITION_NAMES`;
    - a range ``[low, high)``: integers drawn from it. The splitter finds it in the graph: an
      integer input that reaches the indices of a ``Gather`` on a constant table (through ``Cast``,
      ``Unsqueeze``, ``Reshape``, ``Add`` of a constant, ...) is kept within the table's rows
      (``input_ids`` within the vocabulary, ``token_type_ids`` within ``type_vocab_size``). Without
      a graph, ``token_type_ids`` is all zeros (:data:`TYPE_NAMES`: valid whatever the number of
      types, RoBERTa's being 1), and other integers are drawn from 0..3 as before.

    The runtime never reads a graph, so the split keeps what the graph says in the pipeline's
    metadata under :data:`INPUT_VALUES_KEY` (as it keeps the dims it was made for under
    :data:`INPUT_DIMS_KEY`), and ``bench BUNDLE`` and ``verify BUNDLE`` read it from there
    (:func:`spec_values`); a bundle without the key gets the name rules alone.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from onnxpipe._errors import ConfigError
from onnxpipe.runtime._spec import PipelineSpec, TensorSpec

__all__ = [
    "INPUT_DIMS_KEY",
    "INPUT_VALUES_KEY",
    "MASK_PATTERNS",
    "POSITION_NAMES",
    "TYPE_NAMES",
    "InputValues",
    "format_dims",
    "format_values",
    "is_mask_name",
    "named_values",
    "parse_dims",
    "parse_values",
    "spec_dims",
    "split_sizes",
    "spec_values",
]

#: The pipeline metadata key holding the sizes of symbolic input dims the split was made for
#: (``"W=320,x.2=48"``; the build's batching probe runs at them, ``bench`` and ``verify`` size random inputs by them).
INPUT_DIMS_KEY = "input_dims"
#: The pipeline metadata key holding what each input's values mean (Note: sample values): a JSON
#: object, input name -> ``[low, high]`` (integers from ``low``, below ``high``), ``"mask"`` or ``"positions"``.
INPUT_VALUES_KEY = "input_values"

#: Input names (fnmatch patterns, lowercase) whose values are a mask: all ones in sample inputs.
MASK_PATTERNS = ("*attention_mask*", "*_mask", "mask")
#: Inputs taken as token positions (and, when of rank 2 and integer, a decoder's).
POSITION_NAMES = ("position_ids", "positions", "pos_ids")
#: Inputs taken as token type ids: all zeros in sample inputs unless a graph bounds them.
TYPE_NAMES = ("token_type_ids",)

Kind = Literal["range", "mask", "positions"]


@dataclass(frozen=True)
class InputValues:
    """The values an input's samples take (Note: sample values).

    Attributes:
        kind: ``"range"`` (integers from ``low``, below ``high``), ``"mask"`` (ones) or ``"positions"`` (a count).
        low: The range's first value.
        high: The range's end (exclusive).
    """

    kind: Kind
    low: int = 0
    high: int = 0

    @classmethod
    def range(cls, low: int, high: int) -> InputValues:
        """Integers from ``low``, below ``high``."""
        return cls("range", low, high)

    def to_json(self) -> list[int] | str:
        """``[low, high]``, ``"mask"`` or ``"positions"``."""
        return [self.low, self.high] if self.kind == "range" else self.kind

    @classmethod
    def from_json(cls, value: object, name: str) -> InputValues:
        """Read what :meth:`to_json` wrote.

        Raises:
            ConfigError: neither a range of two integers ``low < high`` nor a known kind.
        """
        if value in ("mask", "positions"):
            return cls("mask" if value == "mask" else "positions")
        if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                and value[0] < value[1]):
            return cls.range(value[0], value[1])
        raise ConfigError(f"pipeline metadata '{INPUT_VALUES_KEY}': input '{name}' has {value!r}; expected [LOW, HIGH] (LOW < HIGH), \"mask\" or \"positions\"")


def is_mask_name(name: str) -> bool:
    """Whether an input so named is a mask (:data:`MASK_PATTERNS`, any case)."""
    lower = name.lower()
    return any(fnmatch.fnmatchcase(lower, p) for p in MASK_PATTERNS)


def named_values(specs: Sequence[TensorSpec]) -> dict[str, InputValues]:
    """What the names of ``specs`` say of their values (Note: sample values): masks, positions, token types."""
    out: dict[str, InputValues] = {}
    for spec in specs:
        integer = spec.dtype.startswith(("int", "uint"))
        if is_mask_name(spec.name) and (integer or spec.dtype == "bool") and spec.shape is not None and len(spec.shape) in (1, 2):
            out[spec.name] = InputValues("mask")
        elif spec.name in POSITION_NAMES and integer:
            out[spec.name] = InputValues("positions")
        elif spec.name in TYPE_NAMES and integer:
            out[spec.name] = InputValues.range(0, 1)
    return out


def format_values(values: Mapping[str, InputValues]) -> str:
    """The text of :data:`INPUT_VALUES_KEY` for ``values``."""
    return json.dumps({name: v.to_json() for name, v in values.items()}, separators=(",", ":"))


def parse_values(text: str) -> dict[str, InputValues]:
    """Read what :func:`format_values` wrote (empty text: none).

    Raises:
        ConfigError: the text is no JSON object of values.
    """
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ConfigError(f"pipeline metadata '{INPUT_VALUES_KEY}' is no JSON object of input name -> [LOW, HIGH], \"mask\" or \"positions\": {text[:80]!r}")
    return {name: InputValues.from_json(value, name) for name, value in data.items()}


def spec_values(spec: PipelineSpec) -> dict[str, InputValues]:
    """What a pipeline's metadata says of its inputs' values (:data:`INPUT_VALUES_KEY`; empty without it).

    Raises:
        ConfigError: as :func:`parse_values`.
    """
    return parse_values(spec.metadata.get(INPUT_VALUES_KEY, ""))


def format_dims(dims: Mapping[str, int]) -> str:
    """``{"W": 320, "x.2": 48}`` -> ``"W=320,x.2=48"`` (``--dim``'s syntax), for :data:`INPUT_DIMS_KEY`."""
    return ",".join(f"{name}={size}" for name, size in dims.items())


def parse_dims(text: str) -> dict[str, int]:
    """Read what :func:`format_dims` wrote.

    Raises:
        ConfigError: an entry is not ``NAME=SIZE`` with a size from 1.
    """
    out: dict[str, int] = {}
    for entry in filter(None, text.split(",")):
        name, _, size = entry.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise ConfigError(f"pipeline metadata '{INPUT_DIMS_KEY}': {entry!r} is not NAME=SIZE with a size from 1 (as --dim gives it)")
        out[name] = int(size)
    return out


def spec_dims(spec: PipelineSpec) -> dict[str, int]:
    """The sizes of symbolic input dims a pipeline was split for (:data:`INPUT_DIMS_KEY`; empty without it).

    Raises:
        ConfigError: as :func:`parse_dims`.
    """
    return parse_dims(spec.metadata.get(INPUT_DIMS_KEY, ""))


def split_sizes(spec: PipelineSpec, dims: Mapping[str, int] | None) -> tuple[dict[str, int], list[str]]:
    """The sizes random inputs of a pipeline take: those its split was made for (:data:`INPUT_DIMS_KEY`),
    with ``dims`` over them; and a note naming those the split gave, when any.

    Raises:
        ConfigError: as :func:`parse_dims`.
    """
    given = dict(dims or {})
    sizes = {**spec_dims(spec), **given}
    kept = [f"{k}={v}" for k, v in sizes.items() if k not in given]
    return sizes, [f"random inputs sized as the pipeline was split for ({INPUT_DIMS_KEY}: {', '.join(kept)})"] if kept else []
