"""The planner's arguments checked before anything is profiled: cores, rounds, loads, memory, dims.

Note: symbolic dims.
    What a plan costs depends on the input sizes, so dims are never guessed silently. A dim that
    is symbolic or unknown must be given (``dims``: by name, or ``"input.axis"`` for an unnamed one),
    except a *batch-like* dim (axis 0 of an input of rank 2 or more, named nowhere else), which is
    planned at 1 with a note saying so; any other dim not given is refused with a
    :class:`SplitError` naming each one and how to give it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from onnxpipe._errors import SplitError
from onnxpipe.runtime import TensorSpec
from onnxpipe.runtime._dims import dim_names
from onnxpipe.runtime._stats import resident_bytes

__all__ = ["planning_dims"]


def _named_axes(specs: Sequence[TensorSpec]) -> dict[str, set[int]]:
    """Each named dim of the inputs, and the axes it stands at (a batch-like dim stands at axis 0 only)."""
    axes: dict[str, set[int]] = {}
    for spec in specs:
        for axis, d in enumerate(spec.shape or ()):
            if isinstance(d, str) and d:
                axes.setdefault(d, set()).add(axis)
    return axes


def planning_dims(specs: Sequence[TensorSpec], dims: Mapping[str, int], model: str) -> list[str]:
    """Check that every symbolic or unknown input dim has a size (see the note on symbolic dims).

    A formula dim (``past_sequence_length + sequence_length``, Note: expression dims in
    ``runtime/_dims.py``) is computed from the dims it names, so those are asked for, never the formula.

    Returns:
        Notes on the batch-like dims planned at 1.

    Raises:
        SplitError: dims other than batch-like ones are not given; names every one and how to give it.
    """
    axes = _named_axes(specs)
    notes: list[str] = []
    missing: list[str] = []
    flags: dict[str, None] = {}  # each once, in order
    for spec in specs:
        shape = spec.shape or ()
        for axis, d in enumerate(shape):
            named = d if isinstance(d, str) and d else None
            key = named or f"{spec.name}.{axis}"
            if isinstance(d, int) or key in dims or f"{spec.name}.{axis}" in dims:
                continue
            what = f"input '{spec.name}' dim {axis} " + (f"('{named}')" if named else "(unnamed)")
            unsized = _formula_unsized(named, dims, axes)
            if unsized is not None:  # a formula: asked for by the dims it names
                missing.extend([f"{what}, computed from {', '.join(unsized)}"] if unsized else [])
                flags.update(dict.fromkeys(f"--dim {n}=SIZE" for n in unsized))
            elif axis == 0 and len(shape) >= 2 and (named is None or axes[named] == {0}):
                notes.append(f"{what} not given: planned at batch size 1; give --dim {key}=SIZE (dims={{'{key}': SIZE}}) to plan for larger batches")
            else:
                missing.append(what)
                flags[f"--dim {key}=SIZE"] = None
    if missing:
        raise SplitError(
            f"cannot plan '{model}' without the sizes of its symbolic input dims: the cost depends on them, and 1 would plan for the "
            f"wrong inputs. Not given: {'; '.join(missing)}. Give them: {' '.join(flags)} (in Python: dims={{NAME: SIZE}})"
        )
    return notes


def _formula_unsized(dim: str | None, dims: Mapping[str, int], axes: Mapping[str, set[int]]) -> list[str] | None:
    """The dims a formula dim is computed from that ``dims`` does not size (a batch-like one is
    planned at 1 where it stands), or ``None`` when ``dim`` is no formula."""
    names = dim_names(dim) if dim else None
    return None if names is None else sorted(n for n in names if n not in dims and axes.get(n) != {0})


def _check_loads(concurrency: int | Sequence[int] | None, p99_ms: float | None) -> tuple[int, ...]:
    """The Ns to plan for, each once, in the order given; empty without ``concurrency``.

    Raises:
        SplitError: an N below 1 or not an integer; ``p99_ms`` not above 0, or given without ``concurrency``.
    """
    if concurrency is None:
        if p99_ms is not None:
            raise SplitError("a p99 bound needs the load it holds under: give concurrency (--concurrency N) with p99_ms (--p99)")
        return ()
    values = (concurrency,) if isinstance(concurrency, int) else tuple(concurrency)
    bad = [n for n in values if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad or not values:
        raise SplitError(f"concurrency must be one or more integers from 1 (requests in flight), got {list(values)!r}")
    if p99_ms is not None and not p99_ms > 0:
        raise SplitError(f"the p99 bound must be above 0 ms, got {p99_ms!r}")
    return tuple(dict.fromkeys(values))


def _check_budget(cores: int | None, rounds: int, requests: int) -> tuple[list[int], int]:
    """The cores this process may use, and the budget (all of them by default).

    Raises:
        SplitError: the budget is below 1 or above what this process may use; ``rounds`` or ``requests`` is below 1.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = cores or len(allowed)
    if not 1 <= cores <= len(allowed):
        raise SplitError(f"core budget {cores} is outside 1..{len(allowed)} (the cores this process may use: {allowed})")
    if rounds < 1 or requests < 1:
        raise SplitError(f"rounds and requests must be at least 1, got rounds={rounds}, requests={requests}")
    return allowed, cores


def _check_memory(memory: int | None) -> None:
    """Refuse a memory budget below 1 byte, or one this OS cannot measure a plan against (see Note: memory)."""
    if memory is not None and (memory < 1 or resident_bytes() is None):
        raise SplitError(f"memory budget {memory}: " + ("must be at least 1 byte" if memory < 1 else "this OS has no /proc to measure a plan's memory with"))
