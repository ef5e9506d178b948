"""A stage's streams' state kept in place: one buffer per state, fed as the past and written as the present.

Note: state in place.
    A state link the build marked ``shared`` (``StateLink.shared``: the past and present of
    onnxruntime's ``GroupQueryAttention``, which writes a step's new positions into the past's own
    buffer when both are bound to it: ``past_present_share_buffer``, as onnxruntime-genai runs its
    exports) is kept by a runner that batches streams' steps in a :class:`Slab`: per state one
    buffer of ``rows`` rows and ``capacity`` positions along the state's growing axis, allocated
    once and bound with IOBinding as both the past and the present of every batched call. Stream
    ``s`` owns one row and holds ``lengths[s]`` positions from its start (right-padded: the op
    reads each row's past up to its own length, from the attention mask's ``seqlens_k``), so a
    decode step writes one position per layer and copies nothing.

    - onnxruntime takes one contiguous block of rows a call. When every member is in the slab
      already, the batch runs where its rows are, in row order, one call per run of consecutive
      rows (at most :data:`MAX_RUNS`), and nothing moves (:func:`place`): the same members as
      the step before (one run), and a batch that some of its group's members missed (a run more
      per gap). Rows that are not in the batch's order cost nothing either: the members' inputs
      from the bag are taken in row order and the outputs a later stage reads put back in the
      batch's (a few rows of small tensors). A call more, or a few rows of inputs reordered,
      costs far less than moving rows: at context 2048 on the 24.7 M Llama a stream's past is
      17 MB per stage, and a batch a member missed used to move its group's rows twice (that
      member after the batch, then back: docs/batching.md).
    - A batch in more runs than that (a group of 16 with a few members late, whose rows are
      scattered) is gathered (:func:`_gather`): the block of its size that holds most members
      already takes the others, each swapping rows with the open stream in its way; nobody else
      moves, and the whole group's next batch runs where its rows are, in row order.
    - Otherwise (a member joins, or its slab is too short) the members are put in consecutive
      rows from their first one's (or from 0): members that left make the rows after them move up
      (only their positions); an open stream not in this batch whose row is taken moves to a free
      row after them (or, with none free, is copied out to arrays of its own); a member that joins
      (its state from a step it ran alone, a prefill, or from another slab) is copied into its
      row (:func:`arrange`).
    - A group's prompts come in pieces (a thread per stream's arrive one by one; a driver's first
      leaves alone while the first stage is free). The scheduler tells each batch and each lone
      step its group's members in order (``StepBatch.group``, ``Request.group``), so a member
      none of whose state is in a slab yet (a prompt) goes in free rows of the slab that holds
      its group's other members, after the rows of those before it in the order and before
      those after it (:func:`_beside`); a lone prompt runs there too, bound in place. The first
      to come makes the group's slab, with ``max_batch`` rows, and takes the row of its place in
      the order. The group's first decode batch then finds every member where it is: nothing is
      copied (before, each prompt that ran apart was copied into the group's slab: 17 MB per
      stream per stage at context 2048 on the 24.7 M Llama).
    - A slab is made with room for a quarter more positions than its longest stream needs (at
      least 256); without a group (an engine that does not tell it), for twice the rows of the
      batch that makes it (at most ``max_batch``), so that the members whose prompts ran apart
      find room in it instead of making it anew (rows never written cost no memory: Note: slab
      memory).
      When the batch's longest stream would outgrow ``capacity``, or more members come than
      ``rows``, the slab is made anew, at least 1.5 times as long (rounded up to 64 positions) or
      with twice the batch's rows (at most ``max_batch``), and every member's positions copied
      once: amortized over the steps that follow, as a growing list is. A new slab's free rows
      are split before and after its members, and a batch arranged in a slab uses the one that
      holds most of its members, where they are: a group whose first prompt ran alone and the
      others' together finds room before the others for the first (its order is the order its
      members joined), one that grows by streams joining later finds it after them.
    - A step that fails after writing leaves every member's positions before its length as they
      were (the op writes only after them), and lengths move only on success: the state is
      unchanged, as a step's commit promises.
    - A step that runs alone (a prefill, a replay, an unbatched stream) runs on its own arrays
      as before: a member's positions are copied out of the slab for it (counted).

    Every move and copy is counted in ``copied`` (``StageStats.bytes_copied``). Memory: a slab
    holds up to 1.5 times its longest stream's positions (or 256 more) in each of its rows
    (``Stream.state_bytes`` counts the rows' share of the buffers, padding included).

Note: slab memory.
    A slab's buffer of 1 MB or more is an anonymous memory map of its own (:func:`_zeros`), not
    ``np.zeros``: the OS hands its pages out zeroed when first written, so rows never written
    cost nothing, and making a slab costs only the pages its members' positions touch. From
    ``np.zeros`` a buffer under glibc's mmap threshold (which rises to 32 MB as large blocks are
    freed) comes from the heap and is zeroed whole at once, and numpy asks for transparent huge
    pages on it, whose faults can stall to compact memory (this VM: ``defrag`` madvise): making
    the 16 buffers of a 16-row slab took 4-455 ms with ``np.zeros``, 12-22 ms over maps, touching
    4 rows. Measured with ``benchmarks.batching --against`` (24.7 M Llama, 2 rounds): TTFT
    0.68-0.94x at contexts 128-2048 for one driver and a thread per stream, decode tokens/s
    1.02x and 1.08x at 2048 x 16 (shorter contexts: within the machine's noise).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

__all__ = ["MAX_RUNS", "InSlab", "Slab", "arrange", "capacity_for", "place"]

_ALIGN = 64  # positions: a slab's capacity is a multiple of this
_ROOM = 256  # positions a new slab has beyond what its longest stream needs, at least
_MAPPED = 1 << 20  # bytes: a slab's buffer this large or larger is a memory map of its own (Note: slab memory)
#: The most calls a batch runs in where its members' rows are (see Note: state in place); more gaps move rows.
MAX_RUNS = 4


def _zeros(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """A zeroed buffer for a slab (see Note: slab memory): over an anonymous memory map of its
    own where it is large, else ``np.zeros``."""
    count, dtype = int(np.prod(shape)), np.dtype(dtype)
    if count * dtype.itemsize < _MAPPED:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype, count).reshape(shape)


def capacity_for(need: int, old: int = 0) -> int:
    """A slab's capacity for ``need`` positions: room for a quarter more (at least 256 positions) so
    that a stream decodes a while before its slab grows, and at least 1.5 times ``old`` (amortized
    growth); rounded up to 64."""
    want = max(need + max(need // 4, _ROOM), old + old // 2)
    return -(-want // _ALIGN) * _ALIGN


class Slab:
    """The buffers of a group of streams' state kept in place (see Note: state in place).

    Args:
        like: Per state input, an array of its dtype and shape but for dims 0 and ``axes[name]``.
        axes: Per state input, its growing axis.
        rows: Rows to allocate.
        capacity: Positions to allocate along each growing axis.
    """

    def __init__(self, like: Mapping[str, np.ndarray], axes: Mapping[str, int], rows: int, capacity: int) -> None:
        self.axes = dict(axes)
        self.buffers: dict[str, np.ndarray] = {}
        for name, value in like.items():
            shape = list(value.shape)
            shape[0], shape[self.axes[name]] = rows, capacity
            self.buffers[name] = _zeros(shape, value.dtype)
        self.row: dict[int, int] = {}  # stream -> its row
        self.lengths: dict[int, int] = {}  # stream -> positions it holds
        #: (first row, rows) -> what the runner keeping this slab binds those rows' states with
        #: (its IOBinding and the views: made once, while the buffers last; ``StateKeeper._run_bound``).
        self.bound: dict[tuple[int, int], Any] = {}

    @property
    def rows(self) -> int:
        return len(next(iter(self.buffers.values())))

    @property
    def capacity(self) -> int:
        name, buffer = next(iter(self.buffers.items()))
        return int(buffer.shape[self.axes[name]])

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def view(self, start: int, k: int) -> dict[str, np.ndarray]:
        """Rows ``start..start+k-1`` of each buffer (contiguous: what a batched call binds)."""
        return {name: buffer[start : start + k] for name, buffer in self.buffers.items()}

    def _at(self, name: str, row: int | slice | list[int], length: int) -> tuple[Any, ...]:
        return (row, *(slice(None),) * (self.axes[name] - 1), slice(0, length))

    def own(self, stream: int) -> dict[str, np.ndarray]:
        """A copy of the stream's positions, as arrays of its own (one row)."""
        row, length = self.row[stream], self.lengths[stream]
        return {name: buffer[self._at(name, slice(row, row + 1), length)].copy() for name, buffer in self.buffers.items()}

    def put(self, stream: int, row: int, arrays: Mapping[str, np.ndarray]) -> int:
        """Copy a stream's own state (one row, exact length) into ``row``; the bytes copied."""
        length = 0
        for name, value in arrays.items():
            length = int(value.shape[self.axes[name]])
            self.buffers[name][self._at(name, slice(row, row + 1), length)] = value
        self.row[stream], self.lengths[stream] = row, length
        return sum(a.nbytes for a in arrays.values())

    def move(self, moves: Sequence[tuple[int, int]]) -> int:
        """Streams to new rows (``(stream, row)``), their positions copied together (a move's
        source is read before any is written); the bytes copied."""
        if not moves:
            return 0
        src = [self.row[s] for s, _ in moves]
        dst = [r for _, r in moves]
        length = max(self.lengths[s] for s, _ in moves)
        copied = 0
        for name, buffer in self.buffers.items():
            moved = buffer[self._at(name, src, length)]  # fancy indexing: a copy, so overlapping rows are safe
            buffer[self._at(name, dst, length)] = moved
            copied += moved.nbytes
        for (stream, _), row in zip(moves, dst, strict=True):
            self.row[stream] = row
        return copied

    def drop(self, stream: int) -> None:
        """The stream no longer keeps its state here."""
        self.row.pop(stream, None)
        self.lengths.pop(stream, None)

    def take(self, stream: int, source: Slab, row: int) -> int:
        """Copy a stream's positions from another slab into ``row`` (it leaves ``source``); the bytes copied."""
        at, length = source.row[stream], source.lengths[stream]
        copied = 0
        for name, buffer in self.buffers.items():
            part = source.buffers[name][self._at(name, slice(at, at + 1), length)]
            buffer[self._at(name, slice(row, row + 1), length)] = part
            copied += part.nbytes
        self.row[stream], self.lengths[stream] = row, length
        source.drop(stream)
        return copied


class InSlab:
    """A stream's state held in a slab (its row and length are the slab's)."""

    __slots__ = ("slab",)

    def __init__(self, slab: Slab) -> None:
        self.slab = slab


def place(streams: Sequence[int], helds: Sequence[Any], need: int, max_rows: int, axes: Mapping[str, int],
          group: Sequence[int] = (), kin: Mapping[int, InSlab] | None = None
          ) -> tuple[Slab, list[tuple[int, int]], list[int] | None, int, dict[int, dict[str, np.ndarray]]]:
    """Where a batch runs (see Note: state in place): its slab, its runs of consecutive rows
    (first row, members) in row order, and the order its members run in: ``None`` for the
    batch's own, else the batch's indices of its members by row (their inputs are taken in that
    order and their outputs put back in the batch's). When the members are all in the first
    one's slab, long enough, they run where they are, in at most :data:`MAX_RUNS` runs (nothing
    copied), or gathered into one (:func:`_gather`); else in :func:`arrange`'s slab, in one run
    (``group``, ``kin``: as there). Returns the slab, the runs, the order, the bytes copied and
    the streams copied out (as :func:`arrange`)."""
    first = helds[0]
    slab = first.slab if isinstance(first, InSlab) else None
    if slab is not None and slab.capacity >= need and all(isinstance(h, InSlab) and h.slab is slab for h in helds):
        order, ascending = _by_row([slab.row[s] for s in streams])
        runs, copied = _runs(ascending), 0
        if len(runs) > MAX_RUNS:
            copied = _gather(slab, streams)
            order, ascending = _by_row([slab.row[s] for s in streams])
            runs = _runs(ascending)
        return slab, runs, order, copied, {}
    slab, start, copied, evicted = arrange(streams, helds, need, max_rows, axes, group, kin)
    return slab, [(start, len(streams))], None, copied, evicted


def _by_row(rows: Sequence[int]) -> tuple[list[int] | None, Sequence[int]]:
    """The order of ``rows`` (``None`` when they ascend; else their indices in ascending order of
    row) and the rows in that order."""
    if all(a < b for a, b in pairwise(rows)):
        return None, rows
    order = sorted(range(len(rows)), key=rows.__getitem__)
    return order, [rows[j] for j in order]


def _gather(slab: Slab, streams: Sequence[int]) -> int:
    """Move the members into one block of consecutive rows, the one of ``len(streams)`` rows
    that holds most of them already: each member outside it takes a row inside it that no member
    holds, and the open stream there (if any) takes the member's row, both copied at once
    (:meth:`Slab.move`); the bytes copied. The members' order in the block is any (the batch
    runs in row order: :func:`place`). A thread per stream's batch that some members missed in
    more than :data:`MAX_RUNS` runs (16 streams in one group, a few late) moved every member after
    the first gap, then again to restore the order at the next whole batch: 2 x 221 MB per stage
    at context 2048 on the 24.7 M Llama; gathered, 3 rows (52 MB), and the whole batch after runs
    where they are."""
    k, mine = len(streams), {slab.row[s] for s in streams}
    start = max(range(slab.rows - k + 1), key=lambda a: sum(a <= r < a + k for r in mine))
    holes = [r for r in range(start, start + k) if r not in mine]
    outside = [s for s in streams if not start <= slab.row[s] < start + k]
    occupant = {row: s for s, row in slab.row.items()}
    moves = []
    for member, hole in zip(outside, holes, strict=True):
        moves.append((member, hole))
        if hole in occupant:
            moves.append((occupant[hole], slab.row[member]))
    return slab.move(moves)


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``rows`` (ascending) as runs of consecutive rows: (first row, count)."""
    runs = [(rows[0], 1)]
    for row in rows[1:]:
        first, count = runs[-1]
        if row == first + count:
            runs[-1] = (first, count + 1)
        else:
            runs.append((row, 1))
    return runs


def arrange(streams: Sequence[int], helds: Sequence[Any], need: int, max_rows: int, axes: Mapping[str, int],
            group: Sequence[int] = (), kin: Mapping[int, InSlab] | None = None) -> tuple[Slab, int, int, dict[int, dict[str, np.ndarray]]]:
    """One slab whose rows ``start..start+k-1`` hold the batch's members in order, at least
    ``need`` positions long (see Note: state in place): the one that holds most of them (the
    first member's of those that hold as many), as it is when the members' rows are already
    those (the same members as the step before, or some of them in a row), else with rows moved
    and joiners copied in, from where its first member there stays put; or a new one. Returns
    it, ``start``, the bytes copied, and the streams copied out of it to arrays of their own
    (open streams not in the batch whose rows the members took).

    Args:
        streams: The members, in row order.
        helds: Each member's state as held: an :class:`InSlab`, or arrays of its own (one row, exact length).
        need: The positions the longest member holds after the step.
        max_rows: The most rows a slab gets (the stage's ``max_batch``).
        axes: Per state input, its growing axis.
        group: The members' group's streams in its order, where the scheduler tells it
            (``StepBatch.group``, ``Request.group``): members none of whose state is in a slab yet
            (a group's prompts, which come in pieces) go in free rows of the slab that holds its
            other members, between the rows of those before and after them (:func:`_beside`); a
            new slab gets ``max_rows`` rows, the members at their place in the group's order.
        kin: The group's other streams whose state is in a slab, by stream.
    """
    k = len(streams)
    slab = _home(helds)
    if slab is None and kin:
        beside = _beside(streams, group, kin, need)
        if beside is not None:
            slab, start = beside
            copied = sum(slab.put(s, start + j, h) for j, (s, h) in enumerate(zip(streams, helds, strict=True)))
            return slab, start, copied, {}
    if slab is None or slab.capacity < need or slab.rows < k:
        return _anew(streams, helds, need, max_rows, axes, slab, group)
    at = next(j for j, h in enumerate(helds) if isinstance(h, InSlab) and h.slab is slab)
    start = min(max(slab.row[streams[at]] - at, 0), slab.rows - k)
    targets = {s: start + j for j, s in enumerate(streams)}
    ours = [s for s, h in zip(streams, helds, strict=True) if isinstance(h, InSlab) and h.slab is slab]
    if len(ours) == k and all(slab.row[s] == targets[s] for s in ours):
        return slab, start, 0, {}
    copied, evicted = _rearrange(slab, targets, ours, dict(zip(streams, helds, strict=True)))
    return slab, start, copied, evicted


def _beside(streams: Sequence[int], group: Sequence[int], kin: Mapping[int, InSlab], need: int) -> tuple[Slab, int] | None:
    """Free consecutive rows for ``streams`` (none of them in a slab) in the slab that holds most
    of their group's other members (``kin``), after the rows of the members before them in the
    group's order and before those after them, next to the ones before where it can (else next
    to those after): ``(slab, first row)``, or ``None`` when that slab is too short or has no such rows."""
    if streams[0] not in group or streams[-1] not in group:
        return None
    slab = _home(list(kin.values()))
    if slab is None or slab.capacity < need:
        return None
    first, last = group.index(streams[0]), group.index(streams[-1])
    before = [slab.row[m] for m in group[:first] if m in kin and kin[m].slab is slab]
    after = [slab.row[m] for m in group[last + 1 :] if m in kin and kin[m].slab is slab]
    lo, hi, k = max(before, default=-1) + 1, min(after, default=slab.rows), len(streams)
    taken = set(slab.row.values())
    starts = range(lo, hi - k + 1) if before or not after else range(hi - k, lo - 1, -1)
    return next(((slab, r) for r in starts if taken.isdisjoint(range(r, r + k))), None)


def _home(helds: Sequence[Any]) -> Slab | None:
    """The slab that holds most of the members (the first met of those that hold as many), or ``None``."""
    held: dict[int, tuple[int, Slab]] = {}
    for h in helds:
        if isinstance(h, InSlab):
            held[id(h.slab)] = (held.get(id(h.slab), (0, h.slab))[0] + 1, h.slab)
    return max(held.values(), key=lambda n: n[0])[1] if held else None


def _rearrange(slab: Slab, targets: Mapping[int, int], ours: Sequence[int], helds: Mapping[int, Any]) -> tuple[int, dict[int, dict[str, np.ndarray]]]:
    """The members into their ``targets`` rows of ``slab`` (``ours``: those already in it): open
    streams in the way copied out, members moved, joiners copied in (see :func:`arrange`)."""
    taken = set(targets.values())
    others = {s: row for s, row in slab.row.items() if s not in targets}
    free = [r for r in range(slab.rows) if r not in taken and r not in others.values()]
    moves = [(s, targets[s]) for s in ours if slab.row[s] != targets[s]]
    evicted = {}
    for s, row in others.items():  # open streams in the way move to a free row, or out to arrays of their own
        if row in taken:
            if free:
                moves.append((s, free.pop(0)))
            else:
                evicted[s] = slab.own(s)
    copied = 0
    for s, arrays in evicted.items():
        copied += sum(a.nbytes for a in arrays.values())
        slab.drop(s)
    copied += slab.move(moves)
    mine = set(ours)
    for s, h in helds.items():
        if s not in mine:
            copied += slab.take(s, h.slab, targets[s]) if isinstance(h, InSlab) else slab.put(s, targets[s], h)
    return copied, evicted


def _anew(streams: Sequence[int], helds: Sequence[Any], need: int, max_rows: int, axes: Mapping[str, int], old: Slab | None,
          group: Sequence[int] = ()) -> tuple[Slab, int, int, dict[int, dict[str, np.ndarray]]]:
    """A new slab for the batch, every member's positions copied in: where the group is known
    (see :func:`arrange`), ``max_rows`` rows (at least the old slab's), the members at their place
    in its order; else its free rows split before and after them (joiners may come on either side
    of a group's order)."""
    k = len(streams)
    if old is not None and old.rows >= k:
        rows = old.rows
    else:
        rows = max(k, max_rows if group else min(max_rows, 2 * max(k, old.rows if old is not None else 0)))
    capacity = capacity_for(need, old.capacity if old is not None and old.capacity < need else 0)
    like = next(h for h in helds if not isinstance(h, InSlab)) if any(not isinstance(h, InSlab) for h in helds) else helds[0].slab.buffers
    slab = Slab(like, axes, rows, capacity)
    start = min(group.index(streams[0]), rows - k) if streams[0] in group else (rows - k) // 2
    copied = 0
    for j, (s, h) in enumerate(zip(streams, helds, strict=True)):
        copied += slab.take(s, h.slab, start + j) if isinstance(h, InSlab) else slab.put(s, start + j, h)
    return slab, start, copied, {}
