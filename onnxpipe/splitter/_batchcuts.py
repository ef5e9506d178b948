"""Where an automatic split of a model with states may not cut: positions whose boundary would carry
a value with no batch axis.

Note: cuts that batch.
    A stage batches streams by stacking their requests along dim 0 of every port (docs/batching.md),
    so the build refuses a stage that hands on or reads a scalar, a tensor of unknown rank or one
    whose dim 0 is fixed (``cannot batch: ... is a scalar, with no batch axis``). Most shape values
    never cross: the later stage computes them again (``_extract``, Note: shape values are
    recomputed). Some cannot be: optimum's attention expands its values by
    ``Gather(Shape(present.N.value))`` and a 5-int ``ConstantOfShape``, and a later stage holds no
    tensor of the cache's dims to read the shape from. Where states are paired (a decoder, whose
    stages batch streams), the automatic policies leave such positions out of the candidates, a
    constraint of the partition like a tensor that cannot cross at all: every cut they choose can
    batch. A hand split (cuts, an assignment) may still cut there; the build then refuses to batch
    it with the message above, and ``max_batch=1`` runs it.

    A position is left out when a tensor made at or before it and read after it is such a value
    (by its inferred type) and the later side cannot compute it again: its shape cone
    (:func:`_extract._shape_cone`) reads the shape of a tensor that neither crosses the cut nor is
    a pipeline input, and no tensor of the same dims does (``_states.StateShapes``). Left out too,
    as the split or the build would refuse them anyway: a cut that separates a state's readers from
    its maker (``check_together``), and one whose earlier side would hand on nothing (shape nodes
    only, every value computed again after it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from onnx import ValueInfoProto

from onnxpipe.builder import tensor_spec
from onnxpipe.splitter._extract import SHAPE_OPS, _shape_cone, compute_boundary
from onnxpipe.splitter._graph import GraphIndex
from onnxpipe.splitter._states import StatePair, StateShapes

__all__ = ["UnbatchedCuts"]


class _Side(Mapping[int, int]):
    """Node -> 0 at or before position ``p`` of an order, 1 after it (two stages, lazily)."""

    def __init__(self, position: Mapping[int, int], p: int) -> None:
        self.position, self.p = position, p

    def __getitem__(self, node: int) -> int:
        return 0 if self.position[node] <= self.p else 1

    def __iter__(self) -> Iterator[int]:
        return iter(self.position)

    def __len__(self) -> int:
        return len(self.position)


class _Crossing(Mapping[str, "int | None"]):
    """The tensors crossing a cut after position ``p`` (made at or before it, read after it), each from stage 0."""

    def __init__(self, live: Mapping[str, tuple[int, int]], p: int) -> None:
        self.live, self.p = live, p

    def __getitem__(self, name: str) -> int | None:
        i, j = self.live[name]
        if not i <= self.p < j:
            raise KeyError(name)
        return 0

    def __contains__(self, name: object) -> bool:
        span = self.live.get(name)  # type: ignore[call-overload]  # any object may be asked
        return span is not None and span[0] <= self.p < span[1]

    def __iter__(self) -> Iterator[str]:
        return (name for name, (i, j) in self.live.items() if i <= self.p < j)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class UnbatchedCuts:
    """The positions of an order where a cut would hand on a value with no batch axis (see Note: cuts that batch).

    Set on a policy by ``split`` when the model has states; the policy calls it once per order it tries.
    """

    def __init__(self, index: GraphIndex, types: Mapping[str, ValueInfoProto], pairs: Sequence[StatePair]) -> None:
        self.index, self.types, self.pairs = index, types, list(pairs)

    def _batchless(self, name: str) -> bool:
        info = self.types.get(name)
        if info is None or not info.type.HasField("tensor_type"):
            return False  # no tensor: the sweep's blocked positions say so already
        shape = tensor_spec(info).shape
        return shape is None or not shape or isinstance(shape[0], int)

    def batches(self, stage_of: Mapping[int, int]) -> bool:
        """Whether every boundary of a whole assignment carries values with a batch axis only (for a moved cut: ``_remeasure``)."""
        return not self._readers(stage_of)

    def _readers(self, stage_of: Mapping[int, int]) -> set[int]:
        """The stages of a whole assignment that read a value with no batch axis from an earlier stage."""
        shapes = StateShapes(self.index, stage_of, self.pairs, self.types)
        boundary = compute_boundary(self.index, dict(stage_of), shapes.source)
        return {s for s, names in enumerate(boundary.inputs) for name in names if boundary.sources.get(name) is not None and self._batchless(name)}

    def check(self, order: Sequence[int], cuts: Sequence[int]) -> set[int]:
        """Of the cuts (positions) chosen together, those right before a stage that would read a value with no batch axis.

        A position alone may pass (``__call__`` sees two sides) and fail among others: a stage between two cuts holds no
        state of its own to read a cache's shape from. The policy then solves again without it.
        """
        stage_of, stage = {}, 0
        for p, node in enumerate(order):
            stage_of[node] = stage
            if p in cuts:
                stage += 1
        ordered = sorted(cuts)
        return {ordered[s - 1] for s in self._readers(stage_of)}

    def _separating(self, position: Mapping[int, int]) -> set[int]:
        """Positions whose cut would separate a state's readers from its maker (``check_together`` refuses them). A
        ``Shape`` of it counts only where its side holds no state of its own (``StateShapes.rehome`` reroutes it to one)."""
        refused: set[int] = set()
        spans = []
        for pair in self.pairs:
            readers = [i for i in self.index.consumers.get(pair.input, ()) if i in position]
            made = self.index.producer.get(pair.output)
            ends = [position[i] for i in readers if self.index.nodes[i].op_type not in ("Shape", "Size")]
            ends += [position[made]] if made is not None and made in position else []
            if ends:
                spans.append((min(ends), max(ends), [position[i] for i in readers if self.index.nodes[i].op_type in ("Shape", "Size")]))
        if not spans:
            return refused
        first_whole = min(last for _, last, _ in spans)  # a cut at or after it leaves a whole state on the earlier side
        last_whole = max(first for first, _, _ in spans)  # a cut before it leaves one on the later side
        for first, last, shapes in spans:
            refused.update(range(first, last))
            for r in shapes:
                refused.update(p for p in range(r, first) if p < first_whole)
                refused.update(p for p in range(last, r) if p >= last_whole)
        return refused

    def __call__(self, order: Sequence[int], live: Mapping[str, tuple[int, int]]) -> set[int]:
        """Positions ``p`` (a cut after ``order[p]``) to leave out."""
        position = {node: p for p, node in enumerate(order)}
        refused = self._separating(position)
        for name, (i, j) in live.items():
            if self._batchless(name):
                refused.update(p for p in range(i, j) if p not in refused and not self._recomputed(name, position, live, p))
        return refused | self._empty(order, position, live)

    def _recomputed(self, name: str, position: Mapping[int, int], live: Mapping[str, tuple[int, int]], p: int) -> bool:
        """Whether the side after position ``p`` computes ``name`` again instead of reading it."""
        side = _Side(position, p)
        shapes = StateShapes(self.index, side, self.pairs, self.types)
        return _shape_cone(self.index, side, 1, name, _Crossing(live, p), shapes.source) is not None  # type: ignore[arg-type]

    def _empty(self, order: Sequence[int], position: Mapping[int, int], live: Mapping[str, tuple[int, int]]) -> set[int]:
        """Positions whose earlier side would hand on nothing: shape nodes only, every value computed again after the cut
        (the build cannot run a stage that makes nothing)."""
        made = [position[self.index.producer[o]] for o in self.index.outputs if self.index.producer.get(o) in position]
        first = min(made, default=len(order))
        kept = [0] * (len(order) + 1)  # tensors crossing each position that no later stage could compute again
        for i, j in live.values():
            if self.index.nodes[order[i]].op_type not in SHAPE_OPS:
                kept[i] += 1
                kept[j] -= 1
        empty, crossing = set(), 0
        for p in range(min(first, len(order) - 1)):
            crossing += kept[p]
            if crossing == 0 and all(self._recomputed(name, position, live, p) for name in _Crossing(live, p)):
                empty.add(p)
        return empty
