"""Checking a request's inputs at the door, before any stage sees them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from onnxpipe._errors import InputError, closest
from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._spec import TensorSpec

__all__ = ["UNKNOWN_DIM_NAMES", "InputCheck", "check_dims", "check_inputs", "random_array", "random_inputs", "sample_shapes"]


#: Dim names that mean "unknown", not a symbol shared between dims: PaddlePaddle's exports name
#: every unknown dim ``?`` (PP-OCR's classifier: ``x: [-1, 3, '?', '?']``).
UNKNOWN_DIM_NAMES = frozenset({"?"})


def check_inputs(specs: Sequence[TensorSpec], feeds: Mapping[str, Any], what: str = "input", same_dims: bool = False) -> dict[str, np.ndarray]:
    """The feeds as arrays, once each is known, present, of the declared dtype, rank and sizes.

    Arrays are not copied. A symbolic dim (``"N"``) may take any size. As onnxruntime does, two
    dims of the same name need not agree (onnxruntime runs a model whose inputs disagree on a
    named dim, and fails only where an op cannot take the sizes), unless ``same_dims`` asks for it
    (a code stage's outputs: its declared contract). A name that means "unknown"
    (:data:`UNKNOWN_DIM_NAMES`) never binds. Values are never cast: a float64 array for a float32
    input is an error, since a silent cast would hide a caller's mistake and cost a copy per
    request; numpy's own str arrays are taken for a string input (as an ``object`` array of ``str``).

    Args:
        specs: What the pipeline (or a parameter group) declares.
        feeds: The values, by name.
        what: How messages call a value (``input``, ``parameter``).
        same_dims: Refuse a symbolic dim given two sizes among the values.

    Raises:
        InputError: one message naming the input and what was expected.
    """
    by_name = {s.name: s for s in specs}
    for name in feeds:
        if name not in by_name:
            raise InputError(f"unknown {what} '{name}'; {closest(name, by_name)}")
    missing = [s.name for s in specs if s.name not in feeds]
    if missing:
        raise InputError(f"missing {what}(s) {', '.join(repr(n) for n in missing)}; expected {', '.join(repr(s.name) for s in specs)}")
    arrays: dict[str, np.ndarray] = {}
    sizes: dict[str, tuple[int, str]] = {}
    for spec in specs:
        value = feeds[spec.name]
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        want = _numpy(spec, what)
        if want.kind == "O" and array.dtype.kind == "U":  # numpy's own str arrays (np.array(["a"])): onnxruntime's string tensors are object arrays of str
            array = array.astype(object)
        if array.dtype != want:
            hint = " (a numpy object array of str, np.array([...], dtype=object), or numpy's own str array)" if want.kind == "O" else ""
            raise InputError(f"{what} '{spec.name}' has dtype {array.dtype}; expected {spec.dtype}{hint}")
        if spec.shape is not None:
            if array.ndim != len(spec.shape):
                raise InputError(f"{what} '{spec.name}' has shape {list(array.shape)}; expected rank {len(spec.shape)}: {_fmt(spec.shape)}")
            for axis, (dim, size) in enumerate(zip(spec.shape, array.shape, strict=True)):
                if isinstance(dim, int) and dim != size:
                    raise InputError(f"{what} '{spec.name}' has shape {list(array.shape)}; expected {_fmt(spec.shape)} (dim {axis} must be {dim})")
                if same_dims and isinstance(dim, str) and dim not in UNKNOWN_DIM_NAMES:
                    seen = sizes.setdefault(dim, (size, spec.name))
                    if seen[0] != size:
                        raise InputError(f"{what} '{spec.name}' has {dim}={size} (dim {axis}) but {what} '{seen[1]}' has {dim}={seen[0]}")
        arrays[spec.name] = array
    return arrays


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


def random_inputs(specs: Sequence[TensorSpec], dims: Mapping[str, int] | None = None, seed: int = 0) -> tuple[dict[str, np.ndarray], list[str]]:
    """Random arrays matching declared inputs, shaped by :func:`sample_shapes`.

    Floats are standard normal, integers are drawn from 0..3 (valid as small indices), booleans
    are fair coins.

    Raises:
        InputError: ``dims`` names no dynamic dim of an input, or an input's rank or dtype is unknown.

    Returns:
        The arrays by name, and notes on the dims that were defaulted.
    """
    rng = np.random.default_rng(seed)
    shapes, notes = sample_shapes(specs, dims)
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        feeds[spec.name] = random_array(spec, shapes[spec.name], rng)
    return feeds, notes


def random_array(spec: TensorSpec, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Random values of ``spec``'s dtype and the given shape, as :func:`random_inputs` makes them.

    Raises:
        InputError: numpy has no such dtype, or it is not a number or a boolean.
    """
    dtype = _numpy(spec, "input")
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 4, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    raise InputError(f"input '{spec.name}' of dtype {spec.dtype}: cannot make random values; pass its value explicitly")


def sample_shapes(specs: Sequence[TensorSpec], dims: Mapping[str, int] | None = None) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Concrete shapes for declared inputs, for sample or random values.

    A named dim takes ``dims[name]``; a dynamic dim without a name (``None``, or ``-1`` as
    PaddlePaddle declares it) takes ``dims["<input>.<axis>"]``, e.g. ``dims={"x.0": 8}``; a dim
    not given is 1, and a note says so.

    Raises:
        InputError: a key of ``dims`` is no dynamic dim of these inputs (unknown, fixed, or named
            otherwise), or an input's rank is unknown.

    Returns:
        The shapes by input name, and notes on the dims that were defaulted to 1.
    """
    dims = dict(dims or {})
    check_dims(specs, dims)
    notes: list[str] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        if spec.shape is None:
            raise InputError(f"input '{spec.name}' has no known rank; pass its value explicitly")
        shape: list[int] = []
        defaulted: list[str] = []
        for axis, d in enumerate(spec.shape):
            if isinstance(d, int):
                shape.append(d)
                continue
            key = d if isinstance(d, str) else f"{spec.name}.{axis}"
            if key not in dims:
                defaulted.append(key)
            shape.append(dims.get(key, 1))
        if defaulted:
            unnamed = [f"{spec.name}.{axis}" for axis, d in enumerate(spec.shape) if d is None]
            hint = f" (a dim without a name goes by input and axis: --dim {unnamed[0]}=N)" if unnamed else ""
            notes.append(f"input '{spec.name}': dim{'s' if len(defaulted) > 1 else ''} {', '.join(defaulted)} not given, using 1{hint}")
        shapes[spec.name] = tuple(shape)
    return shapes, notes


def check_dims(specs: Sequence[TensorSpec], dims: Iterable[str]) -> None:
    """Check that every key of ``dims`` is a dim name of ``specs`` or ``<input>.<axis>`` of a
    dynamic dim without a name.

    Raises:
        InputError: the first key that is neither, saying what the dim is instead.
    """
    for key in dims:
        _check_dim_key(specs, key)


def _check_dim_key(specs: Sequence[TensorSpec], key: str) -> None:
    named = {d for spec in specs for d in (spec.shape or ()) if isinstance(d, str)}
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
