"""A step of many streams as one request: its layout, made once at the entry and split once at the exit.

Note: one batch, one request.
    When the steps of several streams travel together (:class:`~onnxpipe.runtime.scheduling.StepScheduler`
    decides which), the pipeline stacks their inputs once, at the entry (:func:`stack_steps`), and
    submits ONE request carrying a :class:`StepBatch`: one bag, one hand-off and one session call
    per stage, one future per stream only at the exit (:func:`member_outputs`). Every tensor in
    the bag keeps the batch's layout from stage to stage: member ``j`` owns rows ``rows[j]:rows[j+1]``
    of dim 0, and a value that grows with a stream's past (an attention mask, a mask a stage makes
    from it: :func:`bag_pads`) is padded on the left of its growing axis by ``shifts[j]`` positions,
    so every member's sequence ends in the same column and a padded position is never attended
    (left padding, as TGI and transformers do). Each stage keeps the batch's state in that layout
    as one block (``StageRunner``, Note: state blocks), so a batch whose members do not change
    feeds a stage's KV cache back as it came out: no padding, copying or splitting per step.

    A member that fails in a stage (its step cannot run on its stream's state, or the batched call
    fails and the member fails alone) leaves the batch there (:meth:`StepBatch.without`); the
    others go on as a smaller batch, and the exit reports each member's own outcome.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from onnxpipe.runtime._spec import Endpoint, PipelineSpec

__all__ = ["Failed", "StepBatch", "bag_pads", "batch_length", "member_outputs", "member_rows", "pad_stack", "stack_steps", "take_rows"]


@dataclass(frozen=True)
class Failed:
    """A member that left its batch because it failed: which request, stream and step, when it was submitted, and why."""

    id: int
    stream: int
    step: int
    submitted: float
    error: BaseException


@dataclass(frozen=True, eq=False)
class StepBatch:
    """The members of one batched request, in row order (see Note: one batch, one request).

    Attributes:
        ids: Each member's request number (its step's own, as if it ran alone).
        streams: Each member's stream.
        steps: Each member's step number in its stream.
        dims: Each member's state dims (``Request.dims``), for a first step's initial state.
        submitted: Each member's submission time (``time.perf_counter()``).
        rows: Member ``j`` owns rows ``rows[j]:rows[j+1]`` of every tensor in the bag.
        shifts: Member ``j``'s left padding on every padded axis.
        failed: Members that failed on the way and left the batch, with their errors.
        waited: Seconds its oldest member waited at the entry for the batch to leave.
        length: The batch's length along the padded axes of its growing inputs (its attention
            mask's): member ``j``'s stream holds ``length - shifts[j]`` positions after the step
            (what a state kept in place counts, ``_stage``, Note: state in place); 0 when no
            input grows.
        group: The members' group's streams in its order when the batch left (``Step.group``):
            where a stage keeping state in place puts members that join (``_inplace``); () unknown.
    """

    ids: tuple[int, ...]
    streams: tuple[int, ...]
    steps: tuple[int, ...]
    dims: tuple[Mapping[str, int], ...]
    submitted: tuple[float, ...]
    rows: tuple[int, ...]
    shifts: tuple[int, ...]
    failed: tuple[Failed, ...] = field(default=())
    waited: float = 0.0
    length: int = 0
    group: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.streams)

    def without(self, gone: Mapping[int, BaseException]) -> StepBatch:
        """The batch without the members at positions ``gone`` (each with its error), which join ``failed``."""
        keep = [j for j in range(len(self)) if j not in gone]
        rows = [0]
        for j in keep:
            rows.append(rows[-1] + self.rows[j + 1] - self.rows[j])
        failed = tuple(Failed(self.ids[j], self.streams[j], self.steps[j], self.submitted[j], e) for j, e in sorted(gone.items()))
        return replace(
            self,
            ids=tuple(self.ids[j] for j in keep),
            streams=tuple(self.streams[j] for j in keep),
            steps=tuple(self.steps[j] for j in keep),
            dims=tuple(self.dims[j] for j in keep),
            submitted=tuple(self.submitted[j] for j in keep),
            rows=tuple(rows),
            shifts=tuple(self.shifts[j] for j in keep),
            failed=self.failed + failed,
        )

    def describe(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[dict[str, int], ...], tuple[int, ...], tuple[int, ...], int,
                                tuple[int, ...]]:
        """The layout as plain tuples (what another process needs to run the batch): ids, streams,
        steps, dims, rows, shifts, length, group."""
        return self.ids, self.streams, self.steps, tuple(dict(d) for d in self.dims), self.rows, self.shifts, self.length, self.group

    @classmethod
    def from_description(cls, described: Sequence[Any]) -> StepBatch:
        """The batch :meth:`describe` described (submission times and failures are the driver's)."""
        ids, streams, steps, dims, rows, shifts, length, group = described
        return cls(tuple(ids), tuple(streams), tuple(steps), tuple(dims), (0.0,) * len(streams), tuple(rows), tuple(shifts), length=length,
                   group=tuple(group))


def bag_pads(spec: PipelineSpec) -> dict[Endpoint, tuple[int, float]]:
    """The bag values that grow with a stream's past, by bag key: ``(axis, fill)``, from the
    stages' ``Batching`` records. A value a stage reads padded takes that stage's fill (what the
    build's probe measured a batched call puts at padded positions: 0 in an int mask, keys or
    softmax weights, an additive mask's blocked value); a stage output that only grows (read by the
    pipeline, or by nobody padded) takes 0. State ports are not in the bag and not listed."""
    pads: dict[Endpoint, tuple[int, float]] = {}
    state_inputs = {(s.stage, s.input) for s in spec.states}
    state_outputs = {(s.stage, s.output) for s in spec.states}
    for stage in spec.stages:
        for name, (axis, fill) in (stage.batching.padded if stage.batching else {}).items():
            if (stage.name, name) not in state_inputs:
                pads.setdefault(spec.source_of(Endpoint(stage.name, name)), (axis, fill))
    for stage in spec.stages:
        for name, axis in (stage.batching.stripped if stage.batching else {}).items():
            if (stage.name, name) not in state_outputs:
                pads.setdefault(Endpoint(stage.name, name), (axis, 0.0))
    return pads


def pad_stack(parts: Sequence[np.ndarray], axis: int, fill: float, shifts: Sequence[int], right: bool = False) -> np.ndarray:
    """``parts`` joined along dim 0, part ``j`` placed ``shifts[j]`` positions from the left of
    ``axis`` and the positions before it filled with ``fill``. The caller makes every
    ``len + shift`` along ``axis`` equal. ``right``: part ``j`` starts at position 0 instead and
    its ``shifts[j]`` padded positions come after it (a state kept right-padded: see
    ``Batching.state_padding``)."""
    first = parts[0]
    shape = list(first.shape)
    shape[0] = sum(len(p) for p in parts)
    shape[axis] = first.shape[axis] + shifts[0]
    out = np.full(shape, fill, first.dtype) if fill else np.zeros(shape, first.dtype)
    lead = (slice(None),) * (axis - 1)
    row = 0
    for part, shift in zip(parts, shifts, strict=True):
        at = (slice(row, row + len(part)), *lead, slice(0, part.shape[axis]) if right else slice(shift, None))
        out[at] = part
        row += len(part)
    return out


def stack_steps(steps: Sequence[Mapping[str, np.ndarray]], padded: Mapping[str, tuple[int, float]]
                ) -> tuple[dict[str, np.ndarray], tuple[int, ...], tuple[int, ...]] | None:
    """The entry's stacking: each input's members joined along dim 0, padded inputs padded on the
    left to the longest; with the rows and the shifts of the batch. ``None`` when the padded
    inputs of the members do not grow alike (their steps then run alone), or a member's inputs
    disagree on its batch size.

    Args:
        steps: Each member's checked pipeline inputs; equal shapes but for dim 0 and the padded axes
            (the scheduler's key).
        padded: Pipeline input name -> (axis, fill), for the inputs that grow (see :func:`bag_pads`).
    """
    first = steps[0]
    names = list(first)
    rows = [0]
    for step in steps:
        sizes = {step[n].shape[0] if step[n].ndim else -1 for n in names}  # checked arrays: .ndim and .shape are theirs
        if len(sizes) != 1 or -1 in sizes:
            return None
        rows.append(rows[-1] + sizes.pop())
    grows = [n for n in names if n in padded]
    shifts = [0] * len(steps)
    if grows:
        lengths = {n: [s[n].shape[padded[n][0]] for s in steps] for n in grows}
        longest = max(lengths[grows[0]])
        shifts = [longest - n for n in lengths[grows[0]]]
        for n in grows[1:]:
            ends = {length + shift for length, shift in zip(lengths[n], shifts, strict=True)}
            if len(ends) > 1:
                return None
    values: dict[str, np.ndarray] = {}
    for n in names:
        parts = [s[n] for s in steps]
        if n in padded and any(shifts):
            axis, fill = padded[n]
            values[n] = pad_stack(parts, axis, fill, shifts)
        else:
            values[n] = np.concatenate(parts)
    return values, tuple(rows), tuple(shifts)


def batch_length(values: Mapping[str, np.ndarray], padded: Mapping[str, tuple[int, float]]) -> int:
    """A stacked batch's length along its first growing input's padded axis (``StepBatch.length``);
    0 when none of ``values`` grows."""
    for name, (axis, _) in padded.items():
        value = values.get(name)
        if value is not None:
            return int(value.shape[axis])
    return 0


def member_rows(value: np.ndarray, lo: int, hi: int, pad: tuple[int, float] | None, shift: int, right: bool = False) -> np.ndarray:
    """One member's part of a batched value: its rows, without its padding (contiguous when
    padding was cut off; a view of the batch's rows otherwise). ``right``: the padding is after
    the member's positions, not before (see :func:`pad_stack`)."""
    part = value[lo:hi]
    if pad is None or not shift:
        return part
    axis = pad[0]
    return np.ascontiguousarray(part[(slice(None),) * axis + (slice(0, part.shape[axis] - shift) if right else slice(shift, None),)])


def take_rows(value: np.ndarray, rows: Sequence[int], keep: Sequence[int]) -> np.ndarray:
    """The rows of the members at positions ``keep`` (``rows`` as in :class:`StepBatch`), joined."""
    index = np.concatenate([np.arange(rows[j], rows[j + 1]) for j in keep]) if keep else np.zeros(0, np.int64)
    return value[index]


def member_outputs(values: Mapping[str, np.ndarray], batch: StepBatch, j: int, pads: Mapping[str, tuple[int, float]]) -> dict[str, np.ndarray]:
    """The exit's split: member ``j``'s outputs, by name, from the batch's (``pads``: output
    name -> pad, for outputs that grow with the past)."""
    lo, hi, shift = batch.rows[j], batch.rows[j + 1], batch.shifts[j]
    return {name: member_rows(value, lo, hi, pads.get(name), shift) for name, value in values.items()}
