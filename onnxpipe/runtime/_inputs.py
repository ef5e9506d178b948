"""Checking a request's inputs at the door, before any stage sees them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxpipe._errors import InputError, closest
from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._spec import TensorSpec

__all__ = ["check_inputs", "random_inputs"]


def check_inputs(specs: Sequence[TensorSpec], feeds: Mapping[str, Any], what: str = "input") -> dict[str, np.ndarray]:
    """The feeds as arrays, once each is known, present, of the declared dtype, rank and sizes.

    Arrays are not copied. A symbolic dim (``"N"``) may take any size but the same size in every
    input that names it. Values are never cast: a float64 array for a float32 input is an error,
    since a silent cast would hide a caller's mistake and cost a copy per request.

    Args:
        specs: What the pipeline (or a parameter group) declares.
        feeds: The values, by name.
        what: How messages call a value (``input``, ``parameter``).

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
        want = numpy_dtype(spec.dtype)
        if array.dtype != want:
            raise InputError(f"{what} '{spec.name}' has dtype {array.dtype}; expected {spec.dtype}")
        if spec.shape is not None:
            if array.ndim != len(spec.shape):
                raise InputError(f"{what} '{spec.name}' has shape {list(array.shape)}; expected rank {len(spec.shape)}: {_fmt(spec.shape)}")
            for axis, (dim, size) in enumerate(zip(spec.shape, array.shape, strict=True)):
                if isinstance(dim, int) and dim != size:
                    raise InputError(f"{what} '{spec.name}' has shape {list(array.shape)}; expected {_fmt(spec.shape)} (dim {axis} must be {dim})")
                if isinstance(dim, str):
                    seen = sizes.setdefault(dim, (size, spec.name))
                    if seen[0] != size:
                        raise InputError(f"{what} '{spec.name}' has {dim}={size} (dim {axis}) but {what} '{seen[1]}' has {dim}={seen[0]}")
        arrays[spec.name] = array
    return arrays


def _fmt(shape: Sequence[object]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def random_inputs(specs: Sequence[TensorSpec], dims: Mapping[str, int] | None = None, seed: int = 0) -> tuple[dict[str, np.ndarray], list[str]]:
    """Random arrays matching declared inputs; symbolic or unknown dims not in ``dims`` become 1.

    Floats are standard normal, integers are drawn from 0..3 (valid as small indices), booleans
    are fair coins.

    Raises:
        InputError: ``dims`` names a dim no input has, or an input's rank or dtype is unknown.

    Returns:
        The arrays by name, and notes on the dims that were defaulted.
    """
    rng = np.random.default_rng(seed)
    dims = dict(dims or {})
    symbolic = {d for spec in specs for d in (spec.shape or ()) if isinstance(d, str)}
    for name in dims:
        if name not in symbolic:
            raise InputError(f"no input has a dim named '{name}'; {closest(name, symbolic)}")
    notes: list[str] = []
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        if spec.shape is None:
            raise InputError(f"input '{spec.name}' has no known rank; pass its value explicitly")
        shape = []
        for d in spec.shape:
            if isinstance(d, int):
                shape.append(d)
                continue
            if d not in dims:
                notes.append(f"input '{spec.name}': dim {d or '?'} not given, using 1")
            shape.append(dims.get(d, 1) if d else 1)
        dtype = numpy_dtype(spec.dtype)
        if dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, 4, size=shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise InputError(f"input '{spec.name}' of dtype {spec.dtype}: cannot make random values; pass its value explicitly")
    return feeds, notes
