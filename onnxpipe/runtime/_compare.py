"""Two tensors compared within a tolerance, the one comparison of ``verify`` (a split against the
whole model) and ``Pipeline.check`` (a bundle against its stored reference).

Note: non-finite values prove nothing.
    Values match when ``|got - want| <= atol + rtol * |want|``, computed on the values finite on
    both sides only (so numpy never warns of an invalid value). A NaN or inf is no value to be
    within a tolerance of: where one side holds one and the other side does not hold the same
    (NaN where the other is finite, +inf against -inf), the tensors differ, and the difference
    says how many of which on which side. Where both sides hold the same non-finite value, they
    agree, but the check proves nothing there (a T5 decoder whose mask overflows gives NaN on
    either side of any cut): :attr:`Difference.nonfinite` says so, and each caller refuses it
    for what it must prove (a model's outputs) unless told its outputs hold inf or NaN by design
    (``allow_nonfinite``: ``-inf`` masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Difference", "difference", "nonfinite_count"]


@dataclass(frozen=True)
class Difference:
    """How far ``got`` is from ``want`` (see :func:`difference`).

    Attributes:
        max_abs: The largest ``|got - want|`` over the values finite on both sides (``inf`` for a
            shape, dtype or value mismatch of integers, or non-finite values on one side).
        max_rel: The largest ``|got - want| / max(|want|, atol)`` over the same values.
        ok: Every value within tolerance, non-finite ones the same on both sides.
        problem: Why not ``ok``, in words (``""`` when within tolerance, or only past it).
        nonfinite: The non-finite values both sides share (``"12 of 12 values NaN"``); ``""`` when
            there are none.
    """

    max_abs: float
    max_rel: float
    ok: bool
    problem: str = ""
    nonfinite: str = ""


def difference(got: np.ndarray, want: np.ndarray, rtol: float, atol: float, sides: tuple[str, str] = ("got", "want")) -> Difference:
    """Compare ``got`` with ``want`` (Note: non-finite values prove nothing).

    Args:
        got: The tensor checked.
        want: The tensor it should equal.
        rtol: Relative tolerance.
        atol: Absolute tolerance.
        sides: What ``got`` and ``want`` are, for :attr:`Difference.problem` (``("the split",
            "the whole model")``).
    """
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return Difference(np.inf, np.inf, False, f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    if want.size == 0:
        return Difference(0.0, 0.0, True)
    if want.dtype.kind not in "fc":  # integers, booleans, strings: equal or not
        equal = bool(np.array_equal(got, want))
        return Difference(0.0 if equal else np.inf, 0.0 if equal else np.inf, equal)
    finite_got, finite_want = np.isfinite(got), np.isfinite(want)
    both = finite_got & finite_want
    shared = ~finite_got & ~finite_want & ((got == want) | (np.isnan(got) & np.isnan(want)))
    apart = ~both & ~shared
    max_abs, max_rel, ok = _errors(got[both], want[both], rtol, atol) if both.any() else (0.0, 0.0, True)
    shared_text = nonfinite_count(want[shared], want.size) if shared.any() else ""
    if not apart.any():
        return Difference(max_abs, max_rel, ok, nonfinite=shared_text)
    mine, theirs = sides
    parts = [f"{who} has {_kinds(values)} where {other} has other values"
             for who, other, values in ((mine, theirs, got[apart & ~finite_got]), (theirs, mine, want[apart & ~finite_want])) if values.size]
    return Difference(np.inf, np.inf, False, f"not finite on one side: {'; '.join(parts)}", shared_text)


def _errors(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> tuple[float, float, bool]:
    """The largest absolute and relative errors of finite values, and whether all are within tolerance."""
    wide = np.complex128 if want.dtype.kind == "c" else np.float64
    with np.errstate(over="ignore"):  # float64's own overflow of a difference near its largest values: inf, past any tolerance
        diff = np.abs(got.astype(wide) - want.astype(wide))
        scale = np.abs(want.astype(wide))
        rel = diff / np.maximum(scale, max(atol, np.finfo(np.float64).tiny))
    return float(diff.max()), float(rel.max()), bool(np.all(diff <= atol + rtol * scale))


def nonfinite_count(values: np.ndarray, total: int) -> str:
    """``values`` (non-finite ones) as a message counts them: ``"12 of 48 values NaN"``,
    ``"3 NaN and 2 -inf of 48 values"``."""
    kinds = _kinds(values)
    if " and " not in kinds:
        count, kind = kinds.split(" ", 1)
        return f"{count} of {total} values {kind}"
    return f"{kinds} of {total} values"


def _kinds(values: np.ndarray) -> str:
    """How many NaN, +inf and -inf ``values`` (non-finite ones) hold: ``"3 NaN and 2 -inf"``."""
    flat = np.asarray(values).ravel()
    if flat.dtype.kind == "c":
        return f"{flat.size} non-finite"
    counts = [(int(np.isnan(flat).sum()), "NaN"), (int(np.isposinf(flat).sum()), "inf"), (int(np.isneginf(flat).sum()), "-inf")]
    said = [f"{n} {kind}" for n, kind in counts if n]
    return " and ".join([", ".join(said[:-1]), said[-1]]) if len(said) > 1 else said[0]
