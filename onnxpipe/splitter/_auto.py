"""Automatic splitting: named policies that turn a model into a node -> stage assignment.

``split(model, policy=MeasuredPolicy(stages=3))`` balances stages by measured per-node costs plus
the cost of handing tensors over; :class:`UniformPolicy` (equal node counts) and
:class:`ParamsPolicy` (equal weight bytes, DeepSpeed's "parameters" method) are there to compare
against. Every policy cuts a topological order of the compute nodes into contiguous runs with the
exact minimum-bottleneck partition (:mod:`onnxpipe.splitter._partition`), so every auto split is
valid by construction.

Note: which order.
    A branchy model (inception, densenet) has many topological orders, and where its branches
    interleave decides how many tensors are live at each position. Policies try the file's order
    and a depth-first order (which finishes a branch before starting the next, so fewer tensors
    stay live) and keep the one whose best partition is better: lower bottleneck, then fewer bytes
    crossing.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from onnx import ValueInfoProto

from onnxpipe._errors import SplitError, closest
from onnxpipe.builder import tensor_nbytes, tensor_spec
from onnxpipe.runtime import StageSettings
from onnxpipe.splitter._cost import CostProfile, profile_model
from onnxpipe.splitter._graph import GraphIndex
from onnxpipe.splitter._live import LiveSweep, Sizer, live_sweep
from onnxpipe.splitter._partition import Partition, PartitionProblem, best_partition, partition

__all__ = ["POLICIES", "AutoSplit", "MeasuredPolicy", "ParamsPolicy", "SplitPolicy", "UniformPolicy", "make_policy"]


class CutRefusal(Protocol):
    """Where a policy may not cut (``_batchcuts.UnbatchedCuts``: where stages could not batch)."""

    def __call__(self, order: Sequence[int], live: Mapping[str, tuple[int, int]]) -> set[int]:
        """Positions of ``order`` where no cut may go, given what is live across each (``LiveSweep.live``)."""

    def check(self, order: Sequence[int], cuts: Sequence[int]) -> set[int]:
        """Of the cuts chosen together, those that may not go there after all (the policy solves again)."""


@dataclass(frozen=True)
class AutoSplit:
    """What a policy decided.

    Attributes:
        assignment: Stage of every live compute node, by node index.
        policy: The policy's name.
        predicted_seconds: Predicted time of each stage (compute + incoming hand-over), or ``None``
            when the policy's costs are not times.
        crossing_bytes: Bytes crossing all cuts per request.
        source: Where the costs came from (``measured``, ``analytic``, ``node count``, ``weights``).
        notes: What the user should know.
    """

    assignment: dict[int, int]
    policy: str
    predicted_seconds: tuple[float, ...] | None
    crossing_bytes: int
    source: str
    notes: tuple[str, ...] = ()


class SplitPolicy(Protocol):
    """A named way to choose stages; ``split(model, policy=...)`` calls :meth:`assign`."""

    @property
    def name(self) -> str:
        """The policy's name, as reports show it."""

    def assign(self, index: GraphIndex, types: dict[str, ValueInfoProto], model_path: str | None) -> AutoSplit:
        """Decide the stage of every compute node."""


@dataclass(frozen=True)
class _Options:
    stages: int | None = None
    max_stages: int | None = None
    max_stage_weights: int | None = None
    pinned: Mapping[str, int] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    refuse: CutRefusal | None = None

    def check(self, name: str) -> None:
        if (self.stages is None) == (self.max_stages is None):
            raise SplitError(f"{name}: give stages=N (exactly N stages) or max_stages=K (the best N <= K), not both or neither")
        k = self.stages or self.max_stages
        if k is None or k < 1:
            raise SplitError(f"{name}: the number of stages must be at least 1, got {k}")
        if self.max_stage_weights is not None and self.max_stage_weights < 0:
            raise SplitError(f"{name}: max_stage_weights must be at least 0 bytes, got {self.max_stage_weights}")


def _orders(index: GraphIndex) -> list[list[int]]:
    """The file's topological order and a depth-first one (see the note above)."""
    file_order = index.compute_nodes()
    members = set(file_order)
    position = {node: p for p, node in enumerate(file_order)}
    waiting = {i: sum(1 for x in index.node_inputs[i] if index.producer.get(x) in members) for i in file_order}
    ready = [(0, position[i], i) for i in file_order if waiting[i] == 0]
    heapq.heapify(ready)
    depth_first: list[int] = []
    while ready:
        _, _, node = heapq.heappop(ready)
        depth_first.append(node)
        for out in index.nodes[node].output:
            for consumer in index.consumers.get(out, ()) if out else ():
                if consumer in waiting:
                    waiting[consumer] -= 1
                    if waiting[consumer] == 0:
                        # Most recently enabled first: finish the branch in progress.
                        heapq.heappush(ready, (-len(depth_first), position[consumer], consumer))
    return [file_order] if depth_first == file_order else [file_order, depth_first]


def _weights_read(index: GraphIndex, node: int, types: dict[str, ValueInfoProto], stored: Mapping[str, object]) -> int:
    total = 0
    for name in index.node_inputs[node]:
        if name in stored:
            total += tensor_nbytes(stored[name])  # type: ignore[arg-type]
        elif index.is_weight_tensor(name) and name in types:
            total += tensor_spec(types[name]).nbytes(default=1) or 0
    return total


def _pins(index: GraphIndex, pinned: Mapping[str, int], order: list[int]) -> dict[int, int]:
    position = {node: p for p, node in enumerate(order)}
    out = {}
    for name, stage in pinned.items():
        node = index.by_name.get(name)
        if node is None and name in index.producer:
            node = index.producer[name]
        if node is None:
            raise SplitError(f"pinned node '{name}' is unknown; {closest(name, index.by_name)}")
        if node not in position:
            raise SplitError(f"pinned node '{name}' is not a compute node (it computes a weight, or contributes to no output)")
        out[position[node]] = stage
    return out


def _solve(problem: PartitionProblem, options: _Options, index: GraphIndex, order: list[int]) -> Partition:
    try:
        if options.stages is not None:
            return partition(problem, options.stages)
        assert options.max_stages is not None
        return best_partition(problem, options.max_stages)
    except SplitError as e:
        # The partition speaks of positions in the order; users know nodes by name.
        named = re.sub(r"\b(node|nodes|position) (\d+)\b", lambda m: f"node {index.label(order[int(m.group(2))])}", str(e))
        raise SplitError(named) from None


def _solve_refusing(problem: PartitionProblem, options: _Options, index: GraphIndex, order: list[int], sweep: LiveSweep) -> Partition:
    """:func:`_solve` without the positions ``options.refuse`` leaves out, alone or among the cuts chosen (then solved again)."""
    refuse = options.refuse
    if refuse is None:
        return _solve(problem, options, index, order)
    refused = set(refuse(order, sweep.live))
    while True:
        allowed = [p for p in (problem.allowed_cuts if problem.allowed_cuts is not None else range(len(order) - 1)) if p not in refused]
        result = _solve(dataclasses.replace(problem, allowed_cuts=allowed), options, index, order)
        wrong = refuse.check(order, result.cuts) - refused
        if not wrong:
            return result
        refused |= wrong  # cuts that fail only together (CutRefusal.check)


def _run(
    name: str,
    index: GraphIndex,
    types: dict[str, ValueInfoProto],
    options: _Options,
    node_cost: Mapping[int, float],
    crossing_cost: Callable[[int], float],
    source: str,
    timed: bool,
) -> AutoSplit:
    options.check(name)
    stored = {t.name: t for t in index.model.graph.initializer}
    sizer = Sizer(types, dict(options.dims), [tensor_spec(types[n]) for n in index.inputs if n in types])
    best: tuple[tuple[float, int], Partition, list[int]] | None = None
    for order in _orders(index):
        if len(order) == 0:
            raise SplitError("the model has no compute node to split")
        sweep = live_sweep(index, order, sizer)
        n = len(order)
        cross_bytes = [sweep.crossing[p + 1] for p in range(n - 1)]
        problem = PartitionProblem(
            costs=[node_cost.get(i, 0.0) for i in order],
            crossing=[crossing_cost(b) for b in cross_bytes],
            crossing_bytes=cross_bytes,
            weights=[_weights_read(index, i, types, stored) for i in order] if options.max_stage_weights is not None else None,
            max_stage_weights=options.max_stage_weights,
            pinned=_pins(index, options.pinned, order) or None,
            allowed_cuts=[p for p in range(n - 1) if not sweep.blocked[p + 1]],
        )
        result = _solve_refusing(problem, options, index, order, sweep)
        key = (result.bottleneck, result.crossing_bytes)
        if best is None or key < best[0]:
            best = (key, result, order)
    assert best is not None
    _, result, order = best
    assignment: dict[int, int] = {}
    stage, cuts = 0, set(result.cuts)
    for p, node in enumerate(order):
        assignment[node] = stage
        if p in cuts:
            stage += 1
    return AutoSplit(
        assignment=assignment,
        policy=name,
        predicted_seconds=tuple(result.stage_costs) if timed else None,
        crossing_bytes=result.crossing_bytes,
        source=source,
        notes=tuple(sizer.notes()),
    )


@dataclass(frozen=True)
class UniformPolicy:
    """Equal numbers of compute nodes per stage (for comparison); ``refuse`` as :class:`MeasuredPolicy`'s."""

    stages: int | None = None
    max_stages: int | None = None
    refuse: CutRefusal | None = None
    name: str = "uniform"

    def assign(self, index: GraphIndex, types: dict[str, ValueInfoProto], model_path: str | None) -> AutoSplit:
        """Balance node counts."""
        options = _Options(self.stages, self.max_stages, refuse=self.refuse)
        return _run(self.name, index, types, options, dict.fromkeys(index.compute_nodes(), 1.0), lambda b: 0.0, "node count", False)


@dataclass(frozen=True)
class ParamsPolicy:
    """Equal weight bytes per stage, DeepSpeed's "parameters" method (for comparison); ``refuse`` as :class:`MeasuredPolicy`'s."""

    stages: int | None = None
    max_stages: int | None = None
    refuse: CutRefusal | None = None
    name: str = "params"

    def assign(self, index: GraphIndex, types: dict[str, ValueInfoProto], model_path: str | None) -> AutoSplit:
        """Balance the weights the stages read."""
        stored = {t.name: t for t in index.model.graph.initializer}
        costs = {i: float(_weights_read(index, i, types, stored)) for i in index.compute_nodes()}
        return _run(self.name, index, types, _Options(self.stages, self.max_stages, refuse=self.refuse), costs, lambda b: 0.0, "weights", False)


@dataclass(frozen=True)
class MeasuredPolicy:
    """Minimum bottleneck by measured node costs plus hand-over costs (see ``_cost``).

    Attributes:
        stages: Exactly this many stages, or
        max_stages: the best number of stages up to this many.
        settings: The settings stages will run with (provider, threads) for profiling.
        max_stage_weights: Memory cap: at most this many weight bytes per stage.
        pinned: Node (or output tensor) name -> stage it must be in (e.g. ops a provider cannot run).
        profile: Use this profile instead of measuring.
        dims: Sizes of symbolic dims for profiling and byte counts.
        runs: Profiled runs.
        remeasure: Where the slowest stage is predicted under 1 ms, time the predicted cut and its
            neighbours together and keep the fastest (``_remeasure``'s Note: small stages; ``split
            --auto`` asks for it). Not with ``pinned`` or ``max_stage_weights``, whose limits a
            moved cut could break.
        cache_dir: Where the profile is cached (see ``profile_model``); None: next to the model,
            or ``$ONNXPIPE_CACHE_DIR``, or the user's cache folder.
        refuse: Positions where no cut may go (:class:`CutRefusal`); ``split`` sets it for a model
            with states, so that its stages batch (``_batchcuts``, Note: cuts that batch).
    """

    stages: int | None = None
    max_stages: int | None = None
    settings: StageSettings = field(default_factory=StageSettings)
    max_stage_weights: int | None = None
    pinned: Mapping[str, int] = field(default_factory=dict)
    profile: CostProfile | None = None
    dims: Mapping[str, int] = field(default_factory=dict)
    runs: int = 5
    cache_dir: str | None = None
    remeasure: bool = False
    refuse: CutRefusal | None = None
    name: str = "measured"

    def assign(self, index: GraphIndex, types: dict[str, ValueInfoProto], model_path: str | None) -> AutoSplit:
        """Profile (or reuse the profile) and minimize the slowest stage."""
        profile = self.profile or profile_model(model_path or index.model, self.settings, runs=self.runs, dims=self.dims, cache_dir=self.cache_dir)
        options = _Options(self.stages, self.max_stages, self.max_stage_weights, self.pinned, self.dims, self.refuse)
        result = _run(self.name, index, types, options, profile.node_seconds, profile.crossing_seconds, profile.source, True)
        return dataclasses.replace(result, notes=(*profile.notes, *result.notes))  # with remeasure, split() checks the cut next (_remeasure)


#: Policies by name, for ``make_policy`` and the CLI's ``--policy``.
POLICIES: dict[str, type[UniformPolicy] | type[ParamsPolicy] | type[MeasuredPolicy]] = {
    "measured": MeasuredPolicy,
    "uniform": UniformPolicy,
    "params": ParamsPolicy,
}


def make_policy(name: str, **options: object) -> SplitPolicy:
    """The policy called ``name`` with the given options (``stages=3``, ...).

    Raises:
        SplitError: no such policy, or an option it does not take.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise SplitError(f"unknown split policy '{name}'; valid: {', '.join(POLICIES)}")
    try:
        return cls(**options)  # type: ignore[arg-type]  # options are checked by the dataclass
    except TypeError as e:
        raise SplitError(f"policy '{name}': {e}") from None
