"""interleaved_rounds: every candidate once per round, the order rotated, values kept per round."""

from __future__ import annotations

import pytest

from onnxpipe.runtime import Rounds, interleaved_rounds


def test_each_round_runs_every_candidate_once_in_a_rotated_order() -> None:
    calls: list[str] = []

    def measure(name: str, value: float) -> float:
        calls.append(name)
        return value + len(calls)

    progress: list[tuple[int, int]] = []
    candidates = {n: lambda n=n, v=v: measure(n, v) for n, v in (("a", 100.0), ("b", 200.0), ("c", 300.0))}
    rounds = interleaved_rounds(candidates, 3, lambda d, t: progress.append((d, t)))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert rounds.count == 3
    assert rounds.values == {"a": (101.0, 106.0, 108.0), "b": (202.0, 204.0, 209.0), "c": (303.0, 305.0, 307.0)}
    assert progress[-1] == (9, 9) and len(progress) == 9


def test_medians_and_paired_ratios() -> None:
    rounds = Rounds({"fast": (110.0, 60.0, 105.0), "base": (100.0, 50.0, 100.0)})
    assert rounds.median("fast") == 105.0
    # Round 2 was slow for both: the paired ratio keeps the comparison, the medians would not.
    assert rounds.ratios("fast", "base") == pytest.approx((1.1, 1.2, 1.05))


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        interleaved_rounds({"a": lambda: 1.0}, 0)
