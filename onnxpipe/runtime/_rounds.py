"""interleaved_rounds(): measure several candidates side by side, so that a busy moment of the
machine hits all of them alike.

Note: why interleaved rounds.
    On a shared machine the load changes over seconds. Measuring candidate A for a while and then B
    compares A's quiet moment with B's busy one, and one such measurement per candidate decides by
    luck when they are close. Round i runs every candidate once, in an order rotated by i (none
    always runs first, after the others warmed the caches, or last); a candidate's number is the
    median of its rounds, and two candidates compare by their ratio *within* each round (paired):
    the load both met in that round divides out, and the spread of the ratios over the rounds says
    how much the comparison itself can be trusted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Rounds", "interleaved_rounds"]


@dataclass(frozen=True)
class Rounds:
    """What :func:`interleaved_rounds` measured.

    Attributes:
        values: Each candidate's value in each round, in round order.
    """

    values: dict[str, tuple[float, ...]]

    @property
    def count(self) -> int:
        """Rounds run."""
        return min((len(v) for v in self.values.values()), default=0)

    def median(self, key: str) -> float:
        """The median of ``key``'s values over the rounds."""
        return statistics.median(self.values[key])

    def ratios(self, key: str, baseline: str) -> tuple[float, ...]:
        """``key``'s value over ``baseline``'s in each round (paired: both ran in the same round)."""
        return tuple(v / b if b else float("inf") for v, b in zip(self.values[key], self.values[baseline], strict=True))


def interleaved_rounds(
    candidates: Mapping[str, Callable[[], float]],
    rounds: int,
    progress: Callable[[int, int], None] | None = None,
) -> Rounds:
    """Call every candidate once per round, ``rounds`` times, the order rotated each round.

    Args:
        candidates: Name -> a callable that measures the candidate once and returns its value
            (requests per second, seconds, ...; whatever the caller compares).
        rounds: How many rounds.
        progress: Called with (calls done, calls in all) after each call.

    Returns:
        The :class:`Rounds`: every candidate's value in every round.

    Raises:
        ValueError: ``rounds`` is below 1 (callers check user-given counts first).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(candidates)
    values: dict[str, list[float]] = {n: [] for n in names}
    total = rounds * len(names)
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for i, name in enumerate(names[shift:] + names[:shift]):
            values[name].append(candidates[name]())
            if progress is not None:
                progress(r * len(names) + i + 1, total)
    return Rounds({n: tuple(v) for n, v in values.items()})
