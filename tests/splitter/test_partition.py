"""The exact partitioner against brute force, on hand cases, on every refusal, and at scale.

Brute force enumerates every cut set with :func:`itertools.combinations` (lexicographic order, so
the first optimum it meets has the earliest cuts) and applies the objective as stated: smallest
bottleneck, ties within the tolerance to the fewest crossing bytes, then the earliest cuts. Random
costs are quarters, so sums are exact and ties are frequent; a second property uses arbitrary
floats and checks the bottleneck only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import combinations, pairwise
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onnxpipe import SplitError
from onnxpipe.splitter import _partition
from onnxpipe.splitter._partition import TIE_TOLERANCE, Partition, PartitionProblem, best_partition, partition

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REFUSAL = re.compile(r"^(no partition into|\d+ stages need|node \d+ is pinned|nodes \d+ \(stage|pinned stages go backwards)")
GIB = 1 << 30


# -- brute force -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    bottleneck: float
    crossing_bytes: int
    cuts: tuple[int, ...]


def _stage_costs(problem: PartitionProblem, cuts: tuple[int, ...]) -> list[float]:
    edges = [-1, *cuts, len(problem.costs) - 1]
    return [sum(problem.costs[a + 1 : b + 1]) + (problem.crossing[a] if a >= 0 else 0.0) for a, b in pairwise(edges)]


def _feasible(problem: PartitionProblem, cuts: tuple[int, ...]) -> bool:
    edges = [-1, *cuts, len(problem.costs) - 1]
    if problem.max_stage_weights is not None:
        assert problem.weights is not None
        if any(sum(problem.weights[a + 1 : b + 1]) > problem.max_stage_weights for a, b in pairwise(edges)):
            return False
    return all(sum(c < p for c in cuts) == t for p, t in (problem.pinned or {}).items())


def brute(problem: PartitionProblem, stages: int) -> Expected | None:
    n = len(problem.costs)
    allowed = sorted(set(range(n - 1) if problem.allowed_cuts is None else problem.allowed_cuts))
    found = [
        Expected(max(_stage_costs(problem, cuts)), sum(problem.crossing_bytes[c] for c in cuts), cuts)
        for cuts in combinations(allowed, stages - 1)
        if _feasible(problem, cuts)
    ]
    if not found:
        return None
    limit = min(f.bottleneck for f in found) * (1 + TIE_TOLERANCE)
    return min((f for f in found if f.bottleneck <= limit), key=lambda f: (f.crossing_bytes, f.cuts))


def brute_best(problem: PartitionProblem, max_stages: int) -> Expected | None:
    per_k = [brute(problem, k) for k in range(1, max_stages + 1)]
    feasible = [e for e in per_k if e is not None]
    if not feasible:
        return None
    limit = min(e.bottleneck for e in feasible) * (1 + TIE_TOLERANCE)
    return next(e for e in feasible if e.bottleneck <= limit)


# -- random problems -------------------------------------------------------------------------------


@st.composite
def problems(draw: st.DrawFn, grid: bool = True) -> PartitionProblem:
    n = draw(st.integers(1, 9))
    value = st.integers(0, 12).map(lambda v: v / 4) if grid else st.floats(0, 100, allow_subnormal=False)
    weights = draw(st.none() | st.lists(st.integers(0, 10), min_size=n, max_size=n))
    pinned = draw(st.none() | st.dictionaries(st.integers(0, n - 1), st.integers(0, 3), max_size=3))
    allowed = draw(st.none() | st.lists(st.integers(0, n - 2), unique=True)) if n > 1 else None
    return PartitionProblem(
        costs=draw(st.lists(value, min_size=n, max_size=n)),
        crossing=draw(st.lists(value, min_size=n - 1, max_size=n - 1)),
        crossing_bytes=draw(st.lists(st.integers(0, 5), min_size=n - 1, max_size=n - 1)),
        weights=weights,
        max_stage_weights=None if weights is None else draw(st.integers(0, 30)),
        pinned=pinned,
        allowed_cuts=allowed,
    )


def _consistent(problem: PartitionProblem, got: Partition) -> None:
    """The returned partition describes itself correctly and meets every constraint."""
    assert list(got.cuts) == sorted(set(got.cuts))
    assert _feasible(problem, got.cuts)
    assert got.stage_costs == pytest.approx(_stage_costs(problem, got.cuts))
    assert got.bottleneck == max(got.stage_costs)
    assert got.crossing_bytes == sum(problem.crossing_bytes[c] for c in got.cuts)
    if problem.allowed_cuts is not None:
        assert set(got.cuts) <= set(problem.allowed_cuts)


def _refused_like_brute(call: Callable[[], Partition], expected: Expected | None) -> Partition | None:
    """Run ``call``; a refusal must match brute force finding nothing and say why."""
    try:
        got = call()
    except SplitError as e:
        event(f"refused: {str(e).split(' ')[0]}")
        assert expected is None, f"refused ({e}) but brute force found {expected}"
        assert REFUSAL.match(str(e)), str(e)
        return None
    assert expected is not None, f"brute force finds nothing but got {got}"
    return got


@SETTINGS
@given(problem=problems(), stages=st.integers(1, 4), block=st.sampled_from([1, 7, 1 << 20]))
def test_partition_matches_brute_force(problem: PartitionProblem, stages: int, block: int) -> None:
    expected = brute(problem, stages)
    with mock.patch.object(_partition, "_BLOCK_ELEMENTS", block):  # tiny blocks: one column each
        got = _refused_like_brute(lambda: partition(problem, stages), expected)
    if got is None or expected is None:
        return
    _consistent(problem, got)
    assert got.bottleneck == pytest.approx(expected.bottleneck, rel=1e-12, abs=1e-12)
    assert got.crossing_bytes == expected.crossing_bytes
    assert got.cuts == expected.cuts


@SETTINGS
@given(problem=problems(), max_stages=st.integers(1, 5))
def test_best_partition_matches_brute_force_over_every_stage_count(problem: PartitionProblem, max_stages: int) -> None:
    expected = brute_best(problem, max_stages)
    got = _refused_like_brute(lambda: best_partition(problem, max_stages), expected)
    if got is None or expected is None:
        return
    _consistent(problem, got)
    assert got.cuts == expected.cuts
    assert got.crossing_bytes == expected.crossing_bytes


@settings(max_examples=150, deadline=None)
@given(problem=problems(grid=False), stages=st.integers(1, 4))
def test_partition_finds_the_smallest_bottleneck_for_any_float_costs(problem: PartitionProblem, stages: int) -> None:
    expected = brute(problem, stages)
    got = _refused_like_brute(lambda: partition(problem, stages), expected)
    if got is None or expected is None:
        return
    _consistent(problem, got)
    assert got.bottleneck == pytest.approx(expected.bottleneck, rel=1e-8)


# -- hand cases ------------------------------------------------------------------------------------


def _problem(costs: list[float], crossing: list[float] | None = None, moved: list[int] | None = None, **kw: Any) -> PartitionProblem:
    gaps = len(costs) - 1
    return PartitionProblem(costs, crossing or [0.0] * gaps, moved or [0] * gaps, **kw)


def test_uniform_costs_split_evenly() -> None:
    got = partition(_problem([1.0] * 12), 4)
    assert got == Partition(cuts=(2, 5, 8), stage_costs=(3.0, 3.0, 3.0, 3.0), bottleneck=3.0, crossing_bytes=0)


def test_a_single_huge_node_sets_the_bottleneck() -> None:
    got = partition(_problem([1, 1, 100, 1, 1]), 3)
    assert got.bottleneck == 100
    assert partition(_problem([1, 1, 100, 1, 1]), 1).bottleneck == 104


def test_crossing_cost_moves_the_cut_and_bytes_break_the_tie() -> None:
    # Without crossing costs 2 | 2 is best; handing over after node 1 costs 1.5 more, so the cut
    # moves to after node 0 or node 2 (both bottleneck 3), and the fewer bytes pick node 2.
    assert partition(_problem([1, 1, 1, 1]), 2).cuts == (1,)
    got = partition(_problem([1, 1, 1, 1], [0, 1.5, 0], [10, 0, 1]), 2)
    assert (got.cuts, got.stage_costs, got.crossing_bytes) == ((2,), (3.0, 1.0), 1)


def test_full_ties_take_the_earliest_cuts() -> None:
    assert partition(_problem([0.0] * 6), 3).cuts == (0, 1)


def test_bottlenecks_within_the_tolerance_tie() -> None:
    # Cutting after node 0 is better by a hair (1e-12 relative) but moves 5 bytes more.
    got = partition(_problem([1.0, 1.0, 1.0 + 2e-12], [0.0, 0.0], [5, 0]), 2)
    assert got.cuts == (1,)


def test_the_crossing_cost_is_what_greedy_filling_misses() -> None:
    # Filling stage 0 as far as a bottleneck of 3 allows cuts after node 2, whose hand-over makes
    # stage 1 cost 5; cutting earlier, where little is live, gives 3.
    got = partition(_problem([1, 1, 1, 1, 1], [0, 0, 3, 0], [0, 0, 9, 0]), 2)
    assert got.cuts == (1,) and got.bottleneck == 3


def test_best_partition_prefers_fewer_stages_on_ties_and_stops_when_hand_overs_cost_more() -> None:
    assert best_partition(_problem([5, 0, 0]), 3).cuts == ()
    assert best_partition(_problem([1, 1], [5]), 2).cuts == ()
    assert best_partition(_problem([1.0] * 8), 4).cuts == (1, 3, 5)


def test_weight_cap_forces_stages_apart() -> None:
    # The even cut after node 2 would put both heavy nodes in stage 1.
    got = partition(_problem([1] * 6, weights=[0, 0, 0, 2, 2, 0], max_stage_weights=2), 2)
    assert (got.cuts, got.bottleneck) == ((3,), 4)


def test_pins_and_allowed_cuts_are_obeyed() -> None:
    assert partition(_problem([1.0] * 8, pinned={5: 0}), 2).cuts == (5,)
    assert partition(_problem([1.0] * 8, allowed_cuts=[0, 6]), 2).cuts == (0,)
    assert partition(_problem([1.0] * 8, pinned={2: 1}, allowed_cuts=[0, 1, 6]), 3).cuts == (1, 6)


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("problem", "stages", "match"),
    [
        (_problem([1, 1]), 3, r"^3 stages need at least 3 nodes, the model has 2 compute nodes$"),
        (_problem([]), 1, r"^the model has no compute nodes to partition$"),
        (_problem([1, 1]), 0, r"^the number of stages must be at least 1, got 0$"),
        (_problem([1] * 6, allowed_cuts=[4]), 3, r"^3 stages need 2 cuts but cuts are allowed after only 1 position: 4$"),
        (_problem([1] * 6, allowed_cuts=[5]), 2, r"^a cut cannot go after position 5; with 6 compute nodes cuts go after positions 0\.\.4$"),
        (_problem([1] * 6, pinned={5: 4}), 3, r"^node 5 is pinned to stage 4 but only 3 stages were asked for \(stages 0\.\.2\)$"),
        (_problem([1] * 6, pinned={6: 0}), 3, r"^node 6 is pinned but the model has 6 compute nodes \(positions 0\.\.5\)$"),
        (_problem([1] * 8, pinned={3: 2, 7: 1}), 3, r"^pinned stages go backwards: node 3 in stage 2 but node 7 in stage 1$"),
        (_problem([1] * 8, pinned={1: 2}), 3, r"^node 1 is pinned to stage 2, which needs 2 cuts before it; allowed cut positions before it: 1$"),
        (
            _problem([1] * 8, pinned={2: 0, 5: 2}, allowed_cuts=[0, 3, 6]),
            3,
            r"^nodes 2 \(stage 0\) and 5 \(stage 2\) need 2 cuts between them; allowed cut positions between them: 1$",
        ),
        (_problem([1] * 8, pinned={6: 0}), 3, r"^node 6 is pinned to stage 0 of 3, which needs 2 cuts after it; allowed cut positions after it: 1$"),
        (
            _problem([1] * 4, weights=[GIB, GIB * 3 // 2, 0, 0], max_stage_weights=GIB),
            3,
            r"^no partition into 3 stages keeps every stage within 1\.0 GiB of weights; the heaviest single node \(position 1\) reads 1\.5 GiB$",
        ),
        (
            _problem([1] * 4, weights=[GIB] * 4, max_stage_weights=GIB),
            2,
            r"^no partition into 2 stages keeps every stage within 1\.0 GiB of weights; the nodes read 4\.0 GiB in all, more than 2 stages of 1\.0 GiB$",
        ),
        (
            _problem([1] * 4, weights=[1 << 20] * 4, max_stage_weights=2 << 20, pinned={2: 0}),
            2,
            r"^no partition into 2 stages keeps every stage within 2\.0 MiB of weights with the pins and allowed cuts given; "
            r"the nodes read 4\.0 MiB in all and the heaviest single node \(position 0\) reads 1\.0 MiB$",
        ),
    ],
)
def test_refusals_say_why(problem: PartitionProblem, stages: int, match: str) -> None:
    with pytest.raises(SplitError, match=match):
        partition(problem, stages)


def test_best_partition_refusals_say_why() -> None:
    with pytest.raises(SplitError, match=r"^max_stages must be at least 1, got 0$"):
        best_partition(_problem([1, 1]), 0)
    with pytest.raises(SplitError, match=r"^no partition into 1 to 2 stages keeps every stage within 10 B of weights; the nodes read 40 B in all"):
        best_partition(_problem([1] * 4, weights=[10] * 4, max_stage_weights=10), 2)
    with pytest.raises(SplitError, match=r"^node 1 is pinned to stage 3 but only 2 stages were asked for"):
        best_partition(_problem([1, 1], pinned={1: 3}), 5)


def test_a_malformed_problem_is_a_bug_not_a_user_error() -> None:
    with pytest.raises(ValueError, match=r"^crossing has 1 entries, expected 2 for 3 nodes$"):
        PartitionProblem([1, 1, 1], [0], [0, 0])
    with pytest.raises(ValueError, match=r"^costs must be finite and >= 0$"):
        PartitionProblem([1, -1], [0], [0])
    with pytest.raises(ValueError, match=r"^max_stage_weights needs weights"):
        PartitionProblem([1, 1], [0], [0], max_stage_weights=3)


# -- scale -----------------------------------------------------------------------------------------


def _random_problem(n: int, seed: int, **kw: Any) -> PartitionProblem:
    rng = np.random.default_rng(seed)
    return PartitionProblem(rng.random(n).tolist(), (rng.random(n - 1) * 0.05).tolist(), rng.integers(0, 1 << 20, n - 1).tolist(), **kw)


@contextmanager
def _cost_entries() -> Iterator[list[int]]:
    """The entries of the stage-cost matrix computed inside the block, block by block: the work of
    the dynamic program (see the Note of onnxpipe/splitter/_partition.py)."""
    built: list[int] = []
    real = _partition._Layout.stage_costs

    def counting(layout: Any, rows: slice, cols: slice) -> Any:
        costs = real(layout, rows, cols)
        built.append(costs.size)
        return costs

    with mock.patch.object(_partition._Layout, "stage_costs", counting):
        yield built


def test_two_thousand_nodes_into_four_stages_is_fast() -> None:
    # Fast means O(k * m**2) for m allowed cuts and k stages, each block of the stage-cost matrix
    # (2001 x 2001 boundaries here) built once per phase and shared by every stage: two phases of
    # one matrix at most (and the traceback's few rows), where building it per stage makes about 5.
    problem = _random_problem(2000, seed=1)
    with _cost_entries() as built:
        got = partition(problem, 4)
    assert sum(built) <= 2.1 * 2001**2
    assert got.bottleneck <= sum(problem.costs) / 4 * 1.02  # uniform-ish costs balance well
    with mock.patch.object(_partition, "_BLOCK_ELEMENTS", 5000):  # many column blocks, same answer
        assert partition(problem, 4) == got


def test_fifty_thousand_nodes_with_two_hundred_allowed_cuts_is_fast() -> None:
    allowed = sorted(np.random.default_rng(2).choice(49_999, 200, replace=False).tolist())
    problem = _random_problem(50_000, seed=2, allowed_cuts=allowed)
    # Fast means work that grows with the 200 allowed cuts (202 boundaries), not with the 50,000
    # nodes: two phases of one 202 x 202 stage-cost matrix at most, for 4 stages and for up to 8.
    with _cost_entries() as built:
        got = partition(problem, 4)
    assert sum(built) <= 2.1 * 202**2
    with _cost_entries() as built:
        best = best_partition(problem, 8)
    assert sum(built) <= 2.1 * 202**2
    assert set(got.cuts) <= set(allowed) and len(got.cuts) == 3
    assert best.bottleneck <= got.bottleneck * (1 + TIE_TOLERANCE)
