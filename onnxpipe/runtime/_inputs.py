"""Checking a request's inputs at the door, before any stage sees them."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxpipe._errors import InputError, closest
from onnxpipe.runtime._dims import dim_names, dim_size, input_dims
from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._spec import Dim, TensorSpec
from onnxpipe.runtime._values import POSITION_NAMES, InputValues, named_values

__all__ = [
    "MASK_NAMES",
    "POSITION_NAMES",
    "TOKEN_NAMES",
    "UNKNOWN_DIM_NAMES",
    "DecoderInputs",
    "InputCheck",
    "check_dims",
    "check_inputs",
    "defaulted_dims",
    "dim_key",
    "dims_hint",
    "feed_shapes",
    "random_array",
    "random_inputs",
    "sample_shapes",
]


#: Dim names that mean "unknown", not a symbol shared between dims: PaddlePaddle's exports name
#: every unknown dim ``?`` (PP-OCR's classifier: ``x: [-1, 3, '?', '?']``).
UNKNOWN_DIM_NAMES = frozenset({"?"})

#: Inputs taken as a decoder's attention mask when of rank 2 and integer or boolean, in order of
#: preference: all ones in sample inputs (Note: a decoder's sample inputs), the padding mask of
#: batched streams (``builder/_batching.py``).
#: Each is a mask by :data:`MASK_PATTERNS` too (all ones in any model's sample inputs, Note: sample values).
MASK_NAMES = ("attention_mask", "attn_mask", "mask")
# POSITION_NAMES (runtime/_values.py): inputs taken as a decoder's token positions when of rank 2 and integer.
#: Inputs taken as a decoder's token ids when of rank 2 and integer: their dim 1 is a step's new tokens.
TOKEN_NAMES = ("input_ids",)


def check_inputs(specs: Sequence[TensorSpec], feeds: Mapping[str, Any], what: str = "input", same_dims: bool = False) -> dict[str, np.ndarray]:
    """The feeds as arrays, once each is known, present, of the declared dtype, rank and sizes.

    Arrays are not copied. A symbolic dim (``"N"``) may take any size. As onnxruntime does, two
    dims of the same name need not agree (onnxruntime runs a model whose inputs disagree on a
    named dim, and fails only where an op cannot take the sizes), unless ``same_dims`` asks for it
    (a code stage's outputs: its declared contract). A name that means "unknown"
    (:data:`UNKNOWN_DIM_NAMES`) never binds. Values are never cast: a float64 array for a float32
    input is an error, since a silent cast would hide a caller's mistake and cost a copy per
    request; numpy's own str arrays are taken for a string input (as an ``object`` array of ``str``),
    and a code stage's ``bytes`` input takes an ``object`` array of ``bytes`` only (Note: raw bytes).

    Args:
        specs: What the pipeline (or a parameter group) declares.
        feeds: The values, by name.
        what: How messages call a value (``input``, ``parameter``).
        same_dims: Refuse a symbolic dim given two sizes among the values.

    Raises:
        InputError: one message naming the input and what was expected.
    """
    _check_names(specs, feeds, what)
    arrays: dict[str, np.ndarray] = {}
    sizes: dict[str, tuple[int, str]] | None = {} if same_dims else None
    for spec in specs:
        value = feeds[spec.name]
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        want = _numpy(spec, what)
        raw = spec.dtype == "bytes"  # see Note: raw bytes (runtime/_dtypes.py)
        if want.kind == "O" and array.dtype.kind == "U" and not raw:  # numpy's own str arrays (np.array(["a"])): string tensors are object arrays of str
            array = array.astype(object)
        if array.dtype != want:
            raise InputError(f"{what} '{spec.name}' has dtype {array.dtype}; expected {spec.dtype}{_object_hint(spec) if want.kind == 'O' else ''}")
        if raw:
            _check_bytes(spec, array, what)
        if spec.shape is not None:
            _check_shape(spec, spec.shape, array, what, sizes)
        arrays[spec.name] = array
    return arrays


def _check_names(specs: Sequence[TensorSpec], feeds: Mapping[str, Any], what: str) -> None:
    """Refuse a feed the specs do not name, then a spec no feed gives."""
    by_name = {s.name: s for s in specs}
    for name in feeds:
        if name not in by_name:
            raise InputError(f"unknown {what} '{name}'; {closest(name, by_name)}")
    missing = [s.name for s in specs if s.name not in feeds]
    if missing:
        raise InputError(f"missing {what}(s) {', '.join(repr(n) for n in missing)}; expected {', '.join(repr(s.name) for s in specs)}")


def _check_shape(spec: TensorSpec, shape: tuple[Dim, ...], array: np.ndarray, what: str, sizes: dict[str, tuple[int, str]] | None) -> None:
    """The array of the spec's rank and fixed sizes (``shape``, the spec's); with ``sizes`` (a
    symbolic dim -> the first size seen and the value that had it), each named dim of one size
    among the values."""
    if array.ndim != len(shape):
        raise InputError(f"{what} '{spec.name}' has shape {list(array.shape)}; expected rank {len(shape)}: {_fmt(shape)}")
    for axis, (dim, size) in enumerate(zip(shape, array.shape, strict=True)):
        if isinstance(dim, int) and dim != size:
            raise InputError(f"{what} '{spec.name}' has shape {list(array.shape)}; expected {_fmt(shape)} (dim {axis} must be {dim})")
        if sizes is not None and isinstance(dim, str) and dim not in UNKNOWN_DIM_NAMES:
            seen = sizes.setdefault(dim, (size, spec.name))
            if seen[0] != size:
                raise InputError(f"{what} '{spec.name}' has {dim}={size} (dim {axis}) but {what} '{seen[1]}' has {dim}={seen[0]}")


def _object_hint(spec: TensorSpec) -> str:
    if spec.dtype == "bytes":  # numpy's fixed-width bytes arrays drop trailing zero bytes: never taken for raw bytes
        return " (a numpy object array of bytes, np.array([...], dtype=object); numpy's own bytes arrays drop trailing zero bytes)"
    return " (a numpy object array of str, np.array([...], dtype=object), or numpy's own str array)"


def _check_bytes(spec: TensorSpec, array: np.ndarray, what: str) -> None:
    """Refuse a ``bytes`` value holding anything but ``bytes`` (a ``str`` most likely: text is a ``string`` port's)."""
    for index, item in enumerate(array.reshape(-1)):
        if not isinstance(item, bytes):
            kind = type(item).__name__
            raise InputError(f"{what} '{spec.name}' is bytes, but element {index} is {kind}; encode it (str.encode) or declare the port 'string'")


class InputCheck:
    """:func:`check_inputs` for one set of specs, with what it needs worked out once: what the
    pipeline's door runs on every request and every stream's step.

    Feeds that are exactly what the specs declare (numpy arrays of the declared dtype and rank,
    the declared size on every fixed dim, nothing missing or unknown) are taken as they are, in
    about a microsecond per input; anything else goes through :func:`check_inputs`, which converts
    what it may and raises the message it would. Measured on a decoder step's 3 inputs:
    check_inputs 3.8-5.2 us, this 0.6-0.9 us (docs/batching.md).
    """

    def __init__(self, specs: Sequence[TensorSpec], what: str = "input") -> None:
        self.specs = tuple(specs)
        self.what = what
        self._plan: list[tuple[str, np.dtype, int, tuple[tuple[int, int], ...]]] | None = []
        for spec in self.specs:
            try:
                dtype = numpy_dtype(spec.dtype)
            except ValueError:
                self._plan = None  # check_inputs says what is wrong with it
                break
            if spec.shape is None or dtype.kind == "O":
                self._plan = None  # unknown ranks and strings: the general path
                break
            fixed = tuple((axis, d) for axis, d in enumerate(spec.shape) if isinstance(d, int))
            self._plan.append((spec.name, dtype, len(spec.shape), fixed))

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The feeds, checked (see :func:`check_inputs`).

        Raises:
            InputError: as :func:`check_inputs`.
        """
        plan = self._plan
        if plan is None or len(feeds) != len(plan):
            return check_inputs(self.specs, feeds, self.what)
        arrays: dict[str, np.ndarray] = {}
        ndarray = np.ndarray
        for name, dtype, rank, fixed in plan:
            value = feeds.get(name)
            if type(value) is not ndarray or value.dtype != dtype or value.ndim != rank:
                return check_inputs(self.specs, feeds, self.what)
            if fixed:
                shape = value.shape
                for axis, size in fixed:
                    if shape[axis] != size:
                        return check_inputs(self.specs, feeds, self.what)
            arrays[name] = value
        return arrays


def _numpy(spec: TensorSpec, what: str) -> np.dtype:
    try:
        return numpy_dtype(spec.dtype)
    except ValueError:
        raise InputError(f"{what} '{spec.name}' is {spec.dtype}: numpy has no such dtype, so onnxpipe can neither check nor make its values") from None


def _fmt(shape: Sequence[object]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


@dataclass(frozen=True)
class DecoderInputs:
    """The inputs of a decoder (an LLM's export) that sample inputs make valid values for.

    Note: a decoder's sample inputs.
        Random integers break a decoder: its attention mask is summed into sequence lengths
        (onnxruntime's ``GroupQueryAttention`` refuses ``seqlens_k`` past the mask's width), and a
        mask that is not as wide as the past and the new tokens together fails in the ``Gather`` that
        reads the causal mask (``indices element out of data bounds``). So :func:`sample_shapes` and
        :func:`random_inputs` give the inputs that play a decoder's roles the values of a decode
        step (by default one token after a past of 1), found by name, rank and dtype:

        - the attention mask (:data:`MASK_NAMES`, rank 2, integer or boolean) is all ones, and as wide
          as the past and the new tokens together when its dim 1 is symbolic and not given in
          ``dims`` (a width given there, even one that does not add up, is kept);
        - the past is dim 2 of the first rank-4 input named ``past_*`` or ``*cache*``
          (``past_key_values.0.key [batch, kv_heads, past_sequence_length, head_dim]``), 0 without one;
          the new tokens are dim 1 of the token ids (:data:`TOKEN_NAMES`);
        - the positions (:data:`POSITION_NAMES`, rank 2, integer) count on from the past in every row;
        - the token ids are random within the vocabulary where the graph says it (Note: sample
          values, ``runtime/_values.py``), else in 0..3, valid in any vocabulary.

        Every other input is random as usual.

    Attributes:
        tokens: The token ids, if any.
        mask: The attention mask, if any.
        positions: The token positions, if any.
        pasts: The past states (KV caches), in input order.
    """

    tokens: TensorSpec | None = None
    mask: TensorSpec | None = None
    positions: TensorSpec | None = None
    pasts: tuple[TensorSpec, ...] = ()

    @classmethod
    def of(cls, specs: Sequence[TensorSpec]) -> DecoderInputs:
        """The inputs of ``specs`` that play each role (none play any in a model that is no decoder)."""
        return cls(
            tokens=_first(specs, TOKEN_NAMES, "iu"),
            mask=_first(specs, MASK_NAMES, "iub"),
            positions=_first(specs, POSITION_NAMES, "iu"),
            pasts=tuple(s for s in specs if _is_past(s)),
        )

    def mask_width_key(self, dims: Mapping[str, int]) -> str | None:
        """The ``dims`` key of the mask's width when sample inputs size it as past plus new (see the
        note), else ``None``: no mask, no token ids, a fixed width, or a width ``dims`` gives."""
        if self.mask is None or self.tokens is None:
            return None
        key = dim_key(self.mask, 1)
        return key if key is not None and key not in dims else None

    def past_length(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """The past's length in these shapes (0 without a past input)."""
        return shapes[self.pasts[0].name][2] if self.pasts else 0


def _first(specs: Sequence[TensorSpec], names: Sequence[str], kinds: str) -> TensorSpec | None:
    for name in names:
        for spec in specs:
            if spec.name == name and spec.shape is not None and len(spec.shape) == 2 and _kind(spec) in kinds:
                return spec
    return None


def _is_past(spec: TensorSpec) -> bool:
    name = spec.name.lower()
    return (name.startswith("past_") or "cache" in name) and spec.shape is not None and len(spec.shape) == 4


def _kind(spec: TensorSpec) -> str:
    try:
        return numpy_dtype(spec.dtype).kind
    except ValueError:
        return ""


def dim_key(spec: TensorSpec, axis: int) -> str | None:
    """How ``dims`` names dim ``axis`` of ``spec``: its name, ``<input>.<axis>`` for a dynamic dim
    without one, ``None`` for a fixed dim."""
    assert spec.shape is not None
    d = spec.shape[axis]
    return None if isinstance(d, int) else _key(spec, axis, d)


def _key(spec: TensorSpec, axis: int, d: str | None) -> str:
    return d if d is not None else f"{spec.name}.{axis}"


def random_inputs(
    specs: Sequence[TensorSpec],
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    values: Mapping[str, InputValues] | None = None,
    only: Collection[str] | None = None,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Random arrays matching declared inputs, shaped by :func:`sample_shapes`.

    Floats are standard normal, integers are drawn from 0..3 (valid as small indices), booleans
    are fair coins; an input whose values mean something gets values of that meaning (Note: sample
    values, in ``runtime/_values.py``): masks are all ones, positions count, token type ids are 0,
    and an input ``values`` bounds (what the graph says: a table's rows) is drawn within its range.
    A decoder's attention mask is as wide as its past and new tokens and its positions count on
    from its past (Note: a decoder's sample inputs, :class:`DecoderInputs`), so that a decoder
    exported by optimum-onnx, onnxruntime-genai or torch runs on them.

    Args:
        specs: The inputs.
        dims: Sizes of symbolic dims (see :func:`sample_shapes`).
        seed: The random generator's seed.
        values: What inputs' values mean, by name, over what their names say: a pipeline's
            ``spec_values(spec)`` (its metadata), or what the splitter finds in a graph.
        only: Make these inputs only (the others still size them: a decoder's past sizes its
            mask); default all. The random draws of the others are skipped, so their values differ
            from those made among all.

    Raises:
        InputError: ``dims`` names no dynamic dim of an input, or an input's rank or dtype is unknown.

    Returns:
        The arrays by name, and notes on the dims that were defaulted.
    """
    rng = np.random.default_rng(seed)
    shapes, notes = sample_shapes(specs, dims)
    roles = DecoderInputs.of(specs)
    past = roles.past_length(shapes)
    meanings = {**named_values(specs), **(values or {})}
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = shapes[spec.name]
        if only is not None and spec.name not in only:
            continue
        if spec is roles.mask:
            feeds[spec.name] = np.ones(shape, _numpy(spec, "input"))
        elif spec is roles.positions:
            feeds[spec.name] = np.tile(np.arange(past, past + shape[1]), (shape[0], 1)).astype(_numpy(spec, "input"))
        else:
            feeds[spec.name] = random_array(spec, shape, rng, meanings.get(spec.name))
    return feeds, notes


def random_array(spec: TensorSpec, shape: Sequence[int], rng: np.random.Generator, values: InputValues | None = None) -> np.ndarray:
    """Random values of ``spec``'s dtype and the given shape, as :func:`random_inputs` makes them.

    Args:
        spec: The input.
        shape: The array's shape.
        rng: The random generator.
        values: What the values mean (Note: sample values): ones, a count along the last axis,
            or integers within a range (a float input's range is ignored).

    Raises:
        InputError: numpy has no such dtype, or it is not a number or a boolean.
    """
    dtype = _numpy(spec, "input")
    if dtype.kind not in "fiub":
        raise InputError(f"input '{spec.name}' of dtype {spec.dtype}: cannot make random values; pass its value explicitly")
    meant = _meant(values, dtype, shape, rng) if values is not None else None
    if meant is not None:
        return meant
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.integers(0, 4, size=shape).astype(dtype)


def _meant(values: InputValues, dtype: np.dtype, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray | None:
    """Values of what an input means (Note: sample values), or ``None`` where its dtype cannot hold
    them (a float's range, positions of no axis, a range outside the dtype): random as usual then."""
    if values.kind == "mask":
        return np.ones(shape, dtype)
    if values.kind == "positions" and dtype.kind in "iu" and len(shape) > 0:
        return np.broadcast_to(np.arange(shape[-1]), tuple(shape)).astype(dtype)
    if values.kind == "range" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = max(values.low, int(info.min)), min(values.high, int(info.max) + 1)
        return rng.integers(low, high, size=shape).astype(dtype) if low < high else None
    return None


def sample_shapes(specs: Sequence[TensorSpec], dims: Mapping[str, int] | None = None) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Concrete shapes for declared inputs, for sample or random values.

    A named dim takes ``dims[name]``; a dynamic dim without a name (``None``, or ``-1`` as
    PaddlePaddle declares it) takes ``dims["<input>.<axis>"]``, e.g. ``dims={"x.0": 8}``; a dim
    not given is 1, and a note says so. A decoder's attention mask not given a width is as wide
    as its past and its new tokens together (Note: a decoder's sample inputs).

    Raises:
        InputError: a key of ``dims`` is no dynamic dim of these inputs (unknown, fixed, or named
            otherwise), or an input's rank is unknown.

    Returns:
        The shapes by input name, and notes on the dims that were defaulted to 1.
    """
    shapes, defaulted = _sample(specs, dims)
    notes: list[str] = []
    for spec in specs:
        keys = defaulted[spec.name]
        if keys:
            assert spec.shape is not None
            unnamed = [f"{spec.name}.{axis}" for axis, d in enumerate(spec.shape) if d is None]
            hint = f" (a dim without a name goes by input and axis: --dim {unnamed[0]}=N)" if unnamed else ""
            notes.append(f"input '{spec.name}': dim{'s' if len(keys) > 1 else ''} {', '.join(keys)} not given, using 1{hint}")
    return shapes, notes


def defaulted_dims(specs: Sequence[TensorSpec], dims: Mapping[str, int] | None = None) -> list[str]:
    """The keys of the dims that :func:`sample_shapes` sizes 1 because ``dims`` does not give them,
    in input order, each once.

    Raises:
        InputError: as :func:`sample_shapes`.
    """
    _, defaulted = _sample(specs, dims)
    return list(dict.fromkeys(key for spec in specs for key in defaulted[spec.name]))


def dims_hint(keys: Sequence[str]) -> str:
    """What to tell a user whose model fails on sample inputs with ``keys`` (:func:`defaulted_dims`)
    sized 1: which they are, and how to size them. Empty without any."""
    if not keys:
        return ""
    several = len(keys) > 1
    them = "their sizes" if several else "its size"
    return f"dim{'s' if several else ''} {', '.join(keys)} not given, so 1: give {them} with --dim NAME=N (--dim {keys[-1]}=N)"


def feed_shapes(feeds: Mapping[str, Any]) -> str:
    """``input_ids[1, 3], attention_mask[1, 3]``: the shapes of some inputs, for a message."""
    return ", ".join(f"{name}{list(np.shape(value))}" for name, value in feeds.items())


def _sample(specs: Sequence[TensorSpec], dims: Mapping[str, int] | None) -> tuple[dict[str, tuple[int, ...]], dict[str, list[str]]]:
    """The shapes of :func:`sample_shapes`, and per input the keys of its dims defaulted to 1."""
    dims = dict(dims or {})
    check_dims(specs, dims)
    shapes: dict[str, tuple[int, ...]] = {}
    defaulted: dict[str, list[str]] = {}
    for spec in specs:
        if spec.shape is None:
            raise InputError(f"input '{spec.name}' has no known rank; pass its value explicitly")
        shape: list[int] = []
        defaulted[spec.name] = []
        for axis, d in enumerate(spec.shape):
            if isinstance(d, int):
                shape.append(d)
                continue
            size, keys = _dim_size(_key(spec, axis, d), dims)
            defaulted[spec.name].extend(k for k in keys if k not in defaulted[spec.name])
            shape.append(size)
        shapes[spec.name] = tuple(shape)
    roles = DecoderInputs.of(specs)
    width = roles.mask_width_key(dims)
    if width is not None:
        assert roles.mask is not None and roles.tokens is not None
        shapes[roles.mask.name] = (shapes[roles.mask.name][0], roles.past_length(shapes) + shapes[roles.tokens.name][1])
        sized = {width} | (dim_names(width) or set())  # the past's and the tokens' dims: their own inputs say when those are defaulted
        defaulted[roles.mask.name] = [key for key in defaulted[roles.mask.name] if key not in sized]
    return shapes, defaulted


def _dim_size(key: str, dims: Mapping[str, int]) -> tuple[int, list[str]]:
    """The size of the dynamic dim ``key`` (:func:`dim_key`) in ``dims``, and the keys defaulted to 1
    for it: a formula (Note: expression dims, ``runtime/_dims.py``) is computed from the dims it
    names, each of those not given taking 1 (and being named, not the formula: ``--dim`` takes
    names); a formula that gives no size there is 1 too."""
    if key in dims:
        return dims[key], []
    names = dim_names(key)
    if names is None:
        return 1, [key]
    size = dim_size(key, dims, 1)
    assert size is not None  # a default gives one
    return size, sorted(n for n in names if n not in dims)


def check_dims(specs: Sequence[TensorSpec], dims: Iterable[str]) -> None:
    """Check that every key of ``dims`` is a dim name of ``specs`` or ``<input>.<axis>`` of a
    dynamic dim without a name.

    Raises:
        InputError: the first key that is neither, saying what the dim is instead.
    """
    for key in dims:
        _check_dim_key(specs, key)


def _check_dim_key(specs: Sequence[TensorSpec], key: str) -> None:
    named = {d for spec in specs for d in (spec.shape or ()) if isinstance(d, str)} | input_dims(specs)  # and the names formulas are computed from
    if key in named:
        return
    by_name = {s.name: s for s in specs}
    tensor, _, axis_text = key.rpartition(".")
    spec = by_name.get(tensor)
    if spec is not None and axis_text.isdigit() and spec.shape is not None:
        axis = int(axis_text)
        if axis >= len(spec.shape):
            raise InputError(f"dim '{key}': input '{spec.name}' has rank {len(spec.shape)} ({_fmt(spec.shape)}); axes are 0..{len(spec.shape) - 1}")
        d = spec.shape[axis]
        if d is None:
            return
        if isinstance(d, str):
            raise InputError(f"dim '{key}': dim {axis} of input '{spec.name}' is named '{d}'; give its size by that name")
        raise InputError(f"dim '{key}': dim {axis} of input '{spec.name}' is fixed at {d}; only dynamic dims take a size")
    addressable = named | {f"{s.name}.{axis}" for s in specs for axis, d in enumerate(s.shape or ()) if d is None}
    raise InputError(f"no input has a dim named '{key}'; {closest(key, addressable)}")
