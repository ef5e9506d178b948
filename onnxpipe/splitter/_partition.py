"""The automatic splitter's core: an exact minimum-bottleneck contiguous partition of a node sequence.

The nodes are a topological order of a model's compute nodes; a partition cuts that sequence into
stages. Stage ``s`` holding positions ``i..j`` costs ``sum(costs[i..j])`` plus, unless it starts
at 0, ``crossing[i - 1]``: the hand-over of the tensors live across the cut in front of it. The
best partition has the smallest bottleneck (most expensive stage); among bottlenecks equal within
:data:`TIE_TOLERANCE`, the fewest bytes over the cuts; among those, the earliest cuts.

Note: why a dynamic program, and why it is exact.
    Let the boundaries be ``-1`` (the start), every position a cut may follow, and ``n - 1`` (the
    end); a stage is a pair of boundaries ``a < b`` and a partition into ``k`` stages is a chain of
    ``k + 1`` boundaries from the start to the end. Pins and the weight cap only remove stages
    (pairs) and stage ends, so every feasible partition is such a chain and every such chain is
    enumerated. Phase 1 finds the smallest bottleneck over all chains with
    ``best[s][b] = min over a < b of max(best[s - 1][a], cost(a, b))``; phase 2 keeps the stages
    costing at most that bottleneck (plus the tie tolerance) and finds the fewest cut bytes with
    ``rest[s][a] = min over b > a of bytes(b) + rest[s + 1][b]``; the cuts are then traced from the
    start taking the earliest boundary that keeps the optimum. Both recurrences are exact because
    the objective of a chain is a max (phase 1) or a sum (phase 2) of per-stage terms that depend
    only on the stage's own two boundaries. The two phases cannot be merged into one
    lexicographic (bottleneck, bytes) recurrence: a prefix with a worse bottleneck but fewer bytes
    wins once a later stage dominates the bottleneck. A greedy sweep ("fill each stage up to a
    guessed bottleneck") is not exact either: a stage's incoming crossing cost depends on where the
    previous cut falls, so cutting as late as possible can make the next stage dearer.

    With ``m`` allowed cut positions and ``k`` stages both phases take ``O(k * m**2)`` time after
    ``O(n)`` prefix sums, and ``O(k * m)`` memory plus one block of the stage-cost matrix
    (:data:`_BLOCK_ELEMENTS` entries; blocks are built once per phase and shared by every stage
    layer). :func:`best_partition` gets the bottleneck of every ``k`` up to its maximum from a
    single phase 1. Cut bytes are summed in float64, exact below 2**53 bytes (8 PiB).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

from onnxpipe._errors import SplitError

__all__ = ["TIE_TOLERANCE", "Partition", "PartitionProblem", "best_partition", "partition"]

#: Bottlenecks within this relative distance of the best count as equal (then bytes decide).
TIE_TOLERANCE = 1e-9
#: Entries of the stage-cost matrix held at once (8 MiB of float64).
_BLOCK_ELEMENTS = 1 << 20
_SHOWN_CUTS = 8

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]
Bools = NDArray[np.bool_]


@dataclass(frozen=True)
class PartitionProblem:
    """A sequence of nodes to cut into stages, with its costs and constraints.

    Attributes:
        costs: Seconds per node, by position ``0..n-1``; ``>= 0``.
        crossing: ``n - 1`` seconds; ``crossing[j]`` is charged to the stage that starts after a
            cut after position ``j`` (the hand-over of the tensors live across that cut).
        crossing_bytes: ``n - 1`` bytes live across a cut after position ``j`` (the tie-breaker).
        weights: Weight bytes each node reads; a stage reads the sum over its nodes.
        max_stage_weights: Most weight bytes one stage may read; needs ``weights``.
        pinned: Node position -> the stage index (from 0) that must hold it.
        allowed_cuts: Positions a cut may follow; by default any position.
    """

    costs: Sequence[float]
    crossing: Sequence[float]
    crossing_bytes: Sequence[int]
    weights: Sequence[int] | None = None
    max_stage_weights: int | None = None
    pinned: Mapping[int, int] | None = None
    allowed_cuts: Sequence[int] | None = None

    def __post_init__(self) -> None:
        # A malformed problem is a bug in the code that built it, not a user error.
        n = len(self.costs)
        gaps = max(n - 1, 0)
        for name, values, size in (
            ("costs", self.costs, n),
            ("crossing", self.crossing, gaps),
            ("crossing_bytes", self.crossing_bytes, gaps),
            ("weights", self.weights, n),
        ):
            if values is None:
                continue
            if len(values) != size:
                raise ValueError(f"{name} has {len(values)} entries, expected {size} for {n} nodes")
            array = np.asarray(values, dtype=np.float64)
            if not np.all(np.isfinite(array) & (array >= 0)):
                raise ValueError(f"{name} must be finite and >= 0")
        if self.max_stage_weights is not None and (self.weights is None or self.max_stage_weights < 0):
            raise ValueError("max_stage_weights needs weights and must be >= 0")


@dataclass(frozen=True)
class Partition:
    """A partition of the node sequence into stages.

    Attributes:
        cuts: Cut after these positions, increasing; ``k`` stages have ``k - 1`` cuts.
        stage_costs: Per stage, its compute plus its incoming crossing cost, in seconds.
        bottleneck: The largest stage cost.
        crossing_bytes: Bytes live across all the cuts together.
    """

    cuts: tuple[int, ...]
    stage_costs: tuple[float, ...]
    bottleneck: float
    crossing_bytes: int


def partition(problem: PartitionProblem, stages: int) -> Partition:
    """Cut the nodes into exactly ``stages`` non-empty stages with the smallest bottleneck.

    Ties (within :data:`TIE_TOLERANCE`) go to the fewest bytes over the cuts, then the earliest cuts.
    See the module's Note for the algorithm and why it is exact.

    Args:
        problem: The nodes, their costs and constraints.
        stages: How many stages to make.

    Returns:
        The best partition.

    Raises:
        SplitError: No partition into ``stages`` stages meets the constraints; the message says why.
    """
    layout = _Layout.of(problem)
    _check_counts(layout, stages)
    masks = _end_masks(layout, _checked_pins(problem, layout, stages), stages)
    best = float(_bottlenecks(layout, masks)[-1])
    if math.isinf(best):
        raise _weight_refusal(problem, stages, f"{stages} stages")
    return _solve(problem, layout, masks, best)


def best_partition(problem: PartitionProblem, max_stages: int) -> Partition:
    """The best partition into any number of stages from 1 to ``max_stages``.

    More stages do not always help: every cut adds a hand-over cost to the stage after it. Among
    bottlenecks equal within :data:`TIE_TOLERANCE` the fewest stages win.

    Args:
        problem: The nodes, their costs and constraints.
        max_stages: The most stages to consider.

    Returns:
        The best partition over every feasible number of stages.

    Raises:
        SplitError: No number of stages up to ``max_stages`` works; the message says why for the
            largest one that could.
    """
    if max_stages < 1:
        raise SplitError(f"max_stages must be at least 1, got {max_stages}")
    layout = _Layout.of(problem)
    top = max(1, min(max_stages, layout.nodes, len(layout.cuts) + 1))
    _check_counts(layout, top)
    masks = _end_masks(layout, _pins_for_any(problem, layout, top), top)
    bottlenecks = _bottlenecks(layout, masks)
    best = float(bottlenecks.min())
    if math.isinf(best):
        raise _weight_refusal(problem, top, f"1 to {top} stages")
    stages = int(np.flatnonzero(bottlenecks <= _limit(best))[0]) + 1
    return _solve(problem, layout, masks[:stages], float(bottlenecks[stages - 1]))


# -- the dynamic program ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """The problem seen from its boundaries: ``-1``, every allowed cut position, ``n - 1``."""

    nodes: int
    cuts: Ints  # allowed cut positions, increasing
    bounds: Ints  # -1, *cuts, n - 1
    prefix: Floats  # compute cost of positions 0..bound
    crossing: Floats  # seconds into a stage starting after the boundary (0 at the start)
    moved: Floats  # bytes over a cut at the boundary (0 at the start and the end)
    weights: Ints | None  # weight bytes of positions 0..bound
    cap: int | None

    @classmethod
    def of(cls, problem: PartitionProblem) -> _Layout:
        n = len(problem.costs)
        cuts = _allowed_cuts(problem, n)
        bounds = np.concatenate([[-1], cuts, [n - 1]]).astype(np.int64)
        prefix = np.concatenate([[0.0], np.cumsum(np.asarray(problem.costs, dtype=np.float64))])
        crossing, moved = np.zeros(len(bounds)), np.zeros(len(bounds))
        crossing[1:-1] = np.asarray(problem.crossing, dtype=np.float64)[cuts]
        moved[1:-1] = np.asarray(problem.crossing_bytes, dtype=np.float64)[cuts]
        weights = None
        if problem.max_stage_weights is not None and problem.weights is not None:
            weights = np.concatenate([[0], np.cumsum(np.asarray(problem.weights, dtype=np.int64))])[bounds + 1]
        return cls(n, cuts, bounds, prefix[bounds + 1], crossing, moved, weights, problem.max_stage_weights)

    def stage_costs(self, rows: slice, cols: slice) -> Floats:
        """Cost of the stage from boundary ``row`` to boundary ``col``; inf for no stage or over the cap."""
        starts = np.arange(len(self.bounds))[rows, None]
        ends = np.arange(len(self.bounds))[None, cols]
        cost = self.prefix[cols][None, :] - self.prefix[rows][:, None] + self.crossing[rows][:, None]
        invalid = starts >= ends
        if self.weights is not None and self.cap is not None:
            invalid |= self.weights[cols][None, :] - self.weights[rows][:, None] > self.cap
        cost[invalid] = np.inf
        return cost

    def blocks(self, *, reverse: bool = False) -> Iterator[tuple[int, int, Floats]]:
        """Column blocks ``lo..hi`` of the stage-cost matrix, with every row that can start before them."""
        size = len(self.bounds)
        width = max(1, _BLOCK_ELEMENTS // size)
        starts = range(1, size, width)
        for lo in reversed(starts) if reverse else starts:
            hi = min(lo + width, size)
            yield lo, hi, self.stage_costs(slice(0, hi), slice(lo, hi))


def _end_masks(layout: _Layout, pins: list[tuple[int, int]], stages: int) -> Bools:
    """``masks[s, b]``: stage ``s`` may end at boundary ``b`` as far as the pins are concerned."""
    masks = np.ones((stages, len(layout.bounds)), dtype=np.bool_)
    for s in range(stages):
        last_before = max((p for p, t in pins if t <= s), default=-1)
        first_after = min((p for p, t in pins if t > s), default=layout.nodes)
        masks[s] = (layout.bounds >= last_before) & (layout.bounds < first_after)
    return masks


def _bottlenecks(layout: _Layout, masks: Bools) -> Floats:
    """Phase 1: the smallest bottleneck for 1, 2, ... ``len(masks)`` stages (inf: none)."""
    layers, size = masks.shape
    best = np.full((layers + 1, size), np.inf)  # best[s + 1, b]: stages 0..s, stage s ending at b
    best[0, 0] = 0.0
    for lo, hi, cost in layout.blocks():
        for s in range(layers):
            # Rows below lo were finished by earlier blocks, rows lo..hi by layer s - 1 just now.
            reach = np.maximum(best[s, :hi, None], cost).min(axis=0)
            best[s + 1, lo:hi] = np.where(masks[s, lo:hi], reach, np.inf)
    return best[1:, -1]


def _fewest_bytes(layout: _Layout, masks: Bools, limit: float) -> Floats:
    """Phase 2: ``rest[s, a]``, the fewest cut bytes after boundary ``a`` for stages ``s..`` within ``limit``."""
    layers, size = masks.shape
    rest = np.full((layers + 1, size), np.inf)
    rest[layers, -1] = 0.0
    for lo, hi, cost in layout.blocks(reverse=True):
        fits = cost <= limit
        for s in reversed(range(layers)):
            ahead = _ahead(layout, masks[s, lo:hi], rest[s + 1, lo:hi], slice(lo, hi))
            rest[s, :hi] = np.minimum(rest[s, :hi], np.where(fits, ahead[None, :], np.inf).min(axis=1))
    return rest


def _ahead(layout: _Layout, mask: Bools, rest: Floats, cols: slice) -> Floats:
    """Bytes of ending a stage at each boundary in ``cols`` and doing the rest as well as possible."""
    return np.where(mask, layout.moved[cols] + rest, np.inf)


def _trace(layout: _Layout, masks: Bools, rest: Floats, limit: float) -> tuple[int, ...]:
    """The earliest cuts that reach the fewest bytes of phase 2."""
    cuts: list[int] = []
    start = 0
    for s in range(len(masks) - 1):
        fits = layout.stage_costs(slice(start, start + 1), slice(None))[0] <= limit
        ahead = np.where(fits, _ahead(layout, masks[s], rest[s + 1], slice(None)), np.inf)
        start = int(np.flatnonzero(ahead == rest[s, start])[0])
        cuts.append(int(layout.bounds[start]))
    return tuple(cuts)


def _solve(problem: PartitionProblem, layout: _Layout, masks: Bools, bottleneck: float) -> Partition:
    limit = _limit(bottleneck)
    rest = _fewest_bytes(layout, masks, limit)
    assert math.isfinite(rest[0, 0]), "phase 2 lost the partition phase 1 found"
    return _partition_of(problem, _trace(layout, masks, rest, limit))


def _partition_of(problem: PartitionProblem, cuts: tuple[int, ...]) -> Partition:
    costs = np.asarray(problem.costs, dtype=np.float64)
    edges = [-1, *cuts, len(costs) - 1]
    stage_costs = tuple(math.fsum(costs[a + 1 : b + 1]) + (float(problem.crossing[a]) if a >= 0 else 0.0) for a, b in pairwise(edges))
    moved = sum(int(problem.crossing_bytes[c]) for c in cuts)
    return Partition(cuts, stage_costs, max(stage_costs), moved)


def _limit(bottleneck: float) -> float:
    return bottleneck + TIE_TOLERANCE * abs(bottleneck)


# -- refusals --------------------------------------------------------------------------------------


def _allowed_cuts(problem: PartitionProblem, n: int) -> Ints:
    if problem.allowed_cuts is None:
        return np.arange(max(n - 1, 0), dtype=np.int64)
    cuts = np.unique(np.asarray(problem.allowed_cuts, dtype=np.int64))
    bad = cuts[(cuts < 0) | (cuts > n - 2)]
    if len(bad):
        raise SplitError(f"a cut cannot go after position {int(bad[0])}; with {n} compute nodes cuts go after positions 0..{n - 2}")
    return cuts


def _check_counts(layout: _Layout, stages: int) -> None:
    n, cuts = layout.nodes, layout.cuts
    if stages < 1:
        raise SplitError(f"the number of stages must be at least 1, got {stages}")
    if n == 0:
        raise SplitError("the model has no compute nodes to partition")
    if stages > n:
        raise SplitError(f"{stages} stages need at least {stages} nodes, the model has {_count(n, 'compute node')}")
    if stages - 1 > len(cuts):
        shown = ", ".join(str(c) for c in cuts[:_SHOWN_CUTS]) + (", ..." if len(cuts) > _SHOWN_CUTS else "")
        raise SplitError(f"{stages} stages need {_count(stages - 1, 'cut')} but cuts are allowed after only {_count(len(cuts), 'position')}: {shown or 'none'}")


def _checked_pins(problem: PartitionProblem, layout: _Layout, stages: int) -> list[tuple[int, int]]:
    """The pins sorted by position, once each is in range, in order and leaves room for its cuts."""
    pins = sorted((problem.pinned or {}).items())
    for p, t in pins:
        if not 0 <= p < layout.nodes:
            raise SplitError(f"node {p} is pinned but the model has {layout.nodes} compute nodes (positions 0..{layout.nodes - 1})")
        if not 0 <= t < stages:
            raise SplitError(f"node {p} is pinned to stage {t} but only {stages} stages were asked for (stages 0..{stages - 1})")
    for (p, t), (q, u) in pairwise(pins):
        if u < t:
            raise SplitError(f"pinned stages go backwards: node {p} in stage {t} but node {q} in stage {u}")
    _check_room(layout, pins, stages)
    return pins


def _pins_for_any(problem: PartitionProblem, layout: _Layout, top: int) -> list[tuple[int, int]]:
    """The checked pins if some stage count up to ``top`` can meet them; else the refusal for ``top``."""
    for stages in range(1, top):
        try:
            return _checked_pins(problem, layout, stages)
        except SplitError:
            continue  # the pins may fit more stages; the refusal worth showing is the one for top
    return _checked_pins(problem, layout, top)


def _check_room(layout: _Layout, pins: list[tuple[int, int]], stages: int) -> None:
    """Each stretch before, between and after the pins must hold as many allowed cuts as stages change."""
    if not pins:
        return
    p, t = pins[0]
    if (free := _cuts_in(layout, 0, p - 1)) < t:
        raise SplitError(f"node {p} is pinned to stage {t}, which needs {_count(t, 'cut')} before it; allowed cut positions before it: {free}")
    for (p, t), (q, u) in pairwise(pins):
        if (free := _cuts_in(layout, p, q - 1)) < u - t:
            raise SplitError(f"nodes {p} (stage {t}) and {q} (stage {u}) need {_count(u - t, 'cut')} between them; allowed cut positions between them: {free}")
    q, u = pins[-1]
    if (free := _cuts_in(layout, q, layout.nodes - 2)) < (need := stages - 1 - u):
        raise SplitError(f"node {q} is pinned to stage {u} of {stages}, which needs {_count(need, 'cut')} after it; allowed cut positions after it: {free}")


def _cuts_in(layout: _Layout, first: int, last: int) -> int:
    """How many allowed cuts go after positions ``first..last``."""
    return int(np.searchsorted(layout.cuts, last, side="right") - np.searchsorted(layout.cuts, first))


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _weight_refusal(problem: PartitionProblem, stages: int, what: str) -> SplitError:
    # The count and pin checks passed, so some partition exists without the cap: the cap is why.
    assert problem.weights is not None and problem.max_stage_weights is not None, "infeasible without a weight cap"
    weights = np.asarray(problem.weights, dtype=np.int64)
    cap, heaviest, total = problem.max_stage_weights, int(np.argmax(weights)), int(weights.sum())
    head = f"no partition into {what} keeps every stage within {_size(cap)} of weights"
    node = f"the heaviest single node (position {heaviest}) reads {_size(int(weights[heaviest]))}"
    if weights[heaviest] > cap:
        return SplitError(f"{head}; {node}")
    if total > stages * cap:
        return SplitError(f"{head}; the nodes read {_size(total)} in all, more than {stages} stages of {_size(cap)}")
    return SplitError(f"{head} with the pins and allowed cuts given; the nodes read {_size(total)} in all and {node}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
