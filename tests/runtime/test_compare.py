"""The one comparison of verify and Pipeline.check (runtime/_compare.py): errors on finite values
only, NaN and inf on one side a mismatch, the same on both sides said (Note: non-finite values
prove nothing)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from onnxpipe.runtime._compare import difference, nonfinite_count

NAN, INF = np.float32(np.nan), np.float32(np.inf)
SIDES = ("the split", "the whole model")


@pytest.fixture(autouse=True)
def _no_numpy_warnings() -> None:
    warnings.simplefilter("error", RuntimeWarning)  # pytest restores the filters after each test


def test_finite_values_within_and_past_tolerance() -> None:
    want = np.array([1.0, 0.0, -2.0], np.float32)
    within = difference(want + np.float32(1e-6), want, 1e-4, 1e-5)
    assert within.ok and within.max_abs == pytest.approx(1e-6, rel=0.1) and not within.problem and not within.nonfinite
    past = difference(want + np.float32(1.0), want, 1e-4, 1e-5)
    assert not past.ok and past.max_abs == pytest.approx(1.0) and past.max_rel == pytest.approx(1e5) and not past.problem  # 1 / max(|0|, atol)


def test_a_zero_atol_divides_safely() -> None:
    zeros = np.zeros(3, np.float32)
    d = difference(zeros, zeros, 0.0, 0.0)
    assert d.ok and d.max_abs == 0.0 and d.max_rel == 0.0


def test_nan_on_both_sides_agrees_but_is_said() -> None:
    nans = np.full((2, 3), NAN)
    d = difference(nans, nans.copy(), 1e-4, 1e-5, SIDES)
    assert d.ok and d.nonfinite == "6 of 6 values NaN" and (d.max_abs, d.max_rel) == (0.0, 0.0)


def test_nan_or_inf_on_one_side_is_a_mismatch_that_says_which_side() -> None:
    want = np.array([1.0, 2.0, INF, -INF], np.float32)
    got = np.array([NAN, 2.0, INF, INF], np.float32)
    d = difference(got, want, 1e-4, 1e-5, SIDES)
    assert not d.ok and d.max_abs == np.inf
    assert d.problem == ("not finite on one side: the split has 1 NaN and 1 inf where the whole model has other values; "
                         "the whole model has 1 -inf where the split has other values")
    assert d.nonfinite == "1 of 4 values inf"  # the inf both share
    assert not difference(want, np.array([1.0, 2.0, 3.0, 4.0], np.float32), 1e-4, 1e-5, SIDES).ok


def test_integers_and_mismatched_shapes() -> None:
    assert difference(np.arange(3), np.arange(3), 0, 0).ok
    assert not difference(np.arange(3), np.arange(1, 4), 0, 0).ok
    d = difference(np.zeros((1, 2), np.float32), np.zeros((2, 1), np.float32), 0, 0)
    assert not d.ok and d.problem == "got float32[1, 2], want float32[2, 1]"


def test_nonfinite_count() -> None:
    assert nonfinite_count(np.array([NAN, NAN]), 8) == "2 of 8 values NaN"
    assert nonfinite_count(np.array([NAN, -INF, INF, -INF]), 8) == "1 NaN, 1 inf and 2 -inf of 8 values"
