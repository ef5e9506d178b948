"""What a stage runner does with its streams' state: hold it, feed it, commit it (Note: state
stays in its stage and Note: state blocks, ``_stage``), and keep it in place where the export
allows it (``_inplace``, Note: state in place). :class:`StateKeeper` is the part of
``StageRunner`` that does it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import InputError, StageError, ort_message
from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._handoff import host, session_device
from onnxpipe.runtime._inplace import InSlab, Slab, arrange, place
from onnxpipe.runtime._session import bound_outputs
from onnxpipe.runtime._spec import Dim, Endpoint, StateLink
from onnxpipe.runtime.scheduling import StepBatch, member_rows, pad_stack, take_rows

if TYPE_CHECKING:
    from onnxpipe.runtime._records import Failure, Request, StagePlan

__all__ = ["Block", "Held", "InBlock", "StateKeeper", "in_place_axes", "initial_state"]

#: The most bindings of a slab's rows kept (``Slab.bound``); more, and they are made anew.
_BINDINGS = 32


@dataclass(frozen=True, eq=False)
class Block:
    """The state outputs of one batched call, whole: the streams it ran and its layout (as in
    ``StepBatch``)."""

    streams: tuple[int, ...]
    rows: tuple[int, ...]
    shifts: tuple[int, ...]
    arrays: dict[str, np.ndarray]


@dataclass(frozen=True)
class InBlock:
    """A stream's state held as member ``index`` of a block."""

    block: Block
    index: int


#: A stream's state as a runner holds it: arrays of its own, its rows of a block, or its row of a slab.
Held = dict[str, np.ndarray] | InBlock | InSlab


def initial_state(plan: StagePlan, dims: Mapping[str, int]) -> dict[str, np.ndarray]:
    """A stream's first state in one stage: zeros, sized as in ``StateLink``'s Note: initial values.

    Raises:
        InputError: a symbolic dim of a state has no size in ``dims`` (a bug once the spec is valid,
            but named for the user all the same).
    """
    state = {}
    for link in plan.states:
        spec = plan.stage.input(link.input)
        assert spec.shape is not None  # PipelineSpec.validate
        shape = []
        for axis, d in enumerate(spec.shape):
            if axis == link.empty_axis:
                shape.append(0)
            elif isinstance(d, int):
                shape.append(d)
            elif isinstance(d, str) and d in dims:
                shape.append(dims[d])
            else:
                raise InputError(f"state '{link.input}' of stage '{plan.stage.name}': no size for dim {axis} ({d}); known: {dict(dims)}")
        state[link.input] = np.zeros(shape, numpy_dtype(spec.dtype))
    return state


def in_place_axes(plan: StagePlan, session: ort.InferenceSession, right: bool) -> tuple[dict[str, str], dict[str, int], dict[str, int]]:
    """What a runner keeps in place (``_inplace``, Note: state in place), where every state of the
    stage is ``shared`` and its session keeps its tensors in host memory (a slab on a device, moved
    by device copies, is not built: docs/limitations.md): each state input's present; each one's
    growing axis for a step alone; the same for a batch, where the stage batches streams' steps
    with its states right-padded (as the build's probe found). Empty, empty, empty otherwise."""
    links = plan.states
    if not links or plan.kept or not all(s.shared and s.empty_axis is not None for s in links) or session_device(session) is not None:
        return {}, {}, {}
    axes = {s.input: s.empty_axis for s in links if s.empty_axis is not None}
    return {s.input: s.output for s in links}, axes, axes if plan.batches and right else {}


def _misfit_dims(link: StateLink, declared: tuple[Dim, ...], held: tuple[int, ...], sizes: Mapping[str, int]) -> str:
    """Why a state of shape ``held`` does not fit its input (declared ``declared``) in a step whose
    other inputs size named dims as ``sizes`` (a growing state's empty axis aside), or ""."""
    if len(held) != len(declared):
        return f"the input has rank {len(declared)}"
    for axis, (d, n) in enumerate(zip(declared, held, strict=True)):
        want = d if isinstance(d, int) else sizes.get(d) if isinstance(d, str) else None
        if want is not None and want != n and (axis != link.empty_axis or link.once):
            return f"the input's dim {axis} is {want}" if isinstance(d, int) else f"the step's other inputs size dim {axis} ('{d}') {want}"
    return ""


class StateKeeper:
    """The state-keeping part of ``StageRunner`` (a mixin: the runner sets the attributes below)."""

    name: str
    plan: StagePlan
    session: ort.InferenceSession
    run_options: ort.RunOptions
    states: dict[int, tuple[int, Held]]
    copied: int
    reused: int
    unbatched: str | None
    _state_at: tuple[tuple[str, int], ...]
    _empty: dict[str, int]
    _once: frozenset[str]
    _right: bool
    _presents: dict[str, str]
    _lone_axes: dict[str, int]
    _axes: dict[str, int]
    _made_apart: tuple[str, ...]
    _stacked: tuple[str, ...]
    _kept_in: tuple[str, ...]
    _holds: bool
    _later_sources: tuple[tuple[str, Endpoint], ...]
    _kept: tuple[tuple[int, Endpoint], ...]
    _dropped: tuple[Endpoint, ...]

    def _inputs(self, request: Request, feeds: dict[str, np.ndarray], step: int | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _run_alone(self, request: Request) -> tuple[Failure, ...]:
        raise NotImplementedError

    def _replay(self, request: Request) -> tuple[Failure, ...]:
        raise NotImplementedError


    def _keep_inputs(self, plan: StagePlan) -> None:
        """What the runner keeps besides its states' outputs (``_stage``, Note: kept inputs): the
        kept inputs, whether it holds anything per stream, and the bag keys a later step reads (not
        the kept inputs, which its bag lacks)."""
        self._kept_in = plan.kept
        self._holds = bool(self._state_at or plan.kept)
        self._later_sources = tuple((name, key) for name, key in plan.sources if name not in plan.kept)

    def _run(self, feeds: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    def _run_stepping(self, feeds: dict[str, Any], step: int) -> list[Any]:
        """One session call for a stream's step alone; a failure on a state this stage held that
        does not fit the step is a :class:`StageError` saying so (``held``: ``_stream``, Note: a
        failed step), since stepping again would fail the same way."""
        try:
            return self._run(feeds)
        except Exception as e:
            held = self._misfit(feeds) if self._state_at and step > 0 else ""
            if not held:
                raise
            raise StageError(str(e), stage=self.name, held=held) from e

    def _misfit(self, feeds: Mapping[str, Any]) -> str:
        """What of the state fed to a step does not fit the stage's input or the step's other
        inputs (a fixed size, or a named dim the other inputs size otherwise; a growing state's
        empty axis aside), in words; "" when all fits."""
        stage, states = self.plan.stage, {s.input: s for s in self.plan.states}
        sizes: dict[str, int] = {}
        for t in stage.inputs:  # the named dims' sizes in the step's other inputs
            if t.name not in states and t.name in feeds:
                sizes.update((d, n) for d, n in zip(t.shape or (), np.shape(feeds[t.name]), strict=False) if isinstance(d, str) and d not in sizes)
        for name, link in states.items():
            why = _misfit_dims(link, stage.input(name).shape or (), tuple(np.shape(feeds[name])), sizes)
            if why:
                return f"its state '{name}' is {list(np.shape(feeds[name]))}, where {why}"
        return ""

    def _made_state(self, fed: Mapping[str, Any], results: Sequence[Any], first: bool) -> dict[str, np.ndarray]:
        """The state outputs of a call, by state input (``first``: the call ran streams' first
        steps), and the kept inputs as they were fed (Note: kept inputs, ``_stage``); the past the
        session copied into each present it made apart from it is counted (Note: state bytes
        copied). A state set once keeps what it was fed after the first step (``StateLink``'s
        Note: a state set once): what a later step outputs for it is no update."""
        state = {}
        for name, at in self._state_at:
            made, past = results[at], fed[name]
            if not first and name in self._once:
                state[name] = past
                continue
            if not np.may_share_memory(made, past):
                self.copied += past.nbytes
            state[name] = made
        for name in self._kept_in:
            state[name] = host(fed[name])  # an encoder's output handed on a device is kept in host memory (docs/limitations.md)
        return state

    def _commit(self, request: Request, stream: int, step: int, state: dict[str, np.ndarray]) -> None:
        """A stream's state after ``step``, its own arrays, and its bytes told to the request (Note: a stream's state bytes, ``_stream``)."""
        before = self.states.get(stream)
        if before is not None and isinstance(before[1], InSlab):
            before[1].slab.drop(stream)  # its state is its own arrays now
        self.states[stream] = (step + 1, state)
        request.held.append((stream, self.name, sum(a.nbytes for a in state.values())))

    def _held(self, stream: int | None, step: int, dims: Mapping[str, int], fed: Mapping[str, Any] | None = None) -> dict[str, np.ndarray] | InBlock | InSlab:
        """The state this step of its stream runs on (the initial one at step 0, sized by ``dims``
        and by the kept inputs ``fed`` on it: Note: initial values, ``StateLink``), as held.

        Raises:
            StageError: the state does not hold exactly ``step`` steps (an earlier step failed).
        """
        if stream is None:
            what = self.plan.states[0] if self.plan.states else f"input '{self.plan.kept[0]}' kept from a stream's first step"
            raise StageError(f"stage '{self.name}' keeps state per stream ({what}): run the pipeline through pipe.stream()", stage=self.name)
        if step == 0:
            if stream in self.states:
                raise AssertionError(f"stream {stream} started twice in stage '{self.name}'")
            if fed is not None and self._kept_in:  # an encoder's output names dims no pipeline input does (Whisper's length)
                dims = {**{d: fed[name].shape[axis] for name in self._kept_in
                           for axis, d in enumerate(self.plan.stage.input(name).shape or ()) if axis and isinstance(d, str)}, **dims}
            return initial_state(self.plan, dims)
        entry = self.states.get(stream)
        if entry is None or entry[0] != step:
            held = "no state of it" if entry is None else f"its state after step {entry[0] - 1}"
            raise StageError(
                f"stage '{self.name}' holds {held}, not after step {step - 1}: "
                f"an earlier step of stream {stream} failed, so step {step} cannot run on its state",
                stage=self.name,
            )
        return entry[1]

    def _own(self, held: dict[str, np.ndarray] | InBlock | InSlab, stream: int | None = None) -> dict[str, np.ndarray]:
        """A stream's state arrays alone: its own, or its rows of a block without its padding, or
        a copy of its positions in a slab (``stream``: whose)."""
        if isinstance(held, InSlab):
            own = held.slab.own(stream)  # type: ignore[arg-type]
            self.copied += sum(a.nbytes for a in own.values())
            return own
        if not isinstance(held, InBlock):
            return held
        block, j = held.block, held.index
        lo, hi, shift = block.rows[j], block.rows[j + 1], block.shifts[j]
        own = {name: member_rows(value, lo, hi, None if name not in self._empty else (self._empty[name], 0.0), shift, self._right)
               for name, value in block.arrays.items()}
        if shift:
            self.copied += sum(a.nbytes for name, a in own.items() if name in self._empty)  # cut out without its padding
        return own

    def _block_for(self, batch: StepBatch, fed: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        """The state a batch of steps runs on, as one block in the batch's layout (Note: state
        blocks); ``None`` when the members' states do not line up with the batch's padding.

        Raises:
            StageError: a member's state does not hold its step's number of steps.
        """
        helds = [self._held(s, n, d, fed) for s, n, d in zip(batch.streams, batch.steps, batch.dims, strict=True)]
        kept = self._kept_block(batch, helds)
        return kept if kept is not None else self._joined_block(batch, helds)

    def _kept_block(self, batch: StepBatch, helds: Sequence[dict[str, np.ndarray] | InBlock | InSlab]) -> dict[str, np.ndarray] | None:
        """The block the step before left, when every member's state is rows of it in the batch's
        rows and padding: as it is (the same members in the same rows), or compacted once (members
        left); ``None`` otherwise."""
        first = helds[0]
        block = first.block if isinstance(first, InBlock) else None
        if block is None or not all(isinstance(h, InBlock) and h.block is block for h in helds):
            return None
        if block.streams == batch.streams and block.shifts == batch.shifts and block.rows == batch.rows:
            self.reused += 1
            return block.arrays  # the same members as the step before, in the same rows
        at = [h.index for h in helds]  # type: ignore[union-attr]
        if all(block.shifts[k] == s and block.rows[k + 1] - block.rows[k] == batch.rows[j + 1] - batch.rows[j]
               for j, (k, s) in enumerate(zip(at, batch.shifts, strict=True))):
            compacted = {name: take_rows(value, block.rows, at) for name, value in block.arrays.items()}  # members left: one compaction
            self.copied += sum(a.nbytes for a in compacted.values())
            return compacted
        return None

    def _joined_block(self, batch: StepBatch, helds: Sequence[dict[str, np.ndarray] | InBlock | InSlab]) -> dict[str, np.ndarray] | None:
        """A new block made of each member's own state, padded to the batch's layout; ``None``
        when a member's state does not fit its rows or its padding."""
        owns = [self._own(h, s) for h, s in zip(helds, batch.streams, strict=True)]
        out: dict[str, np.ndarray] = {}
        for name in owns[0]:  # the states, and at a later step the kept inputs
            parts = [own[name] for own in owns]
            if any(len(p) != batch.rows[j + 1] - batch.rows[j] for j, p in enumerate(parts)):
                return None
            axis = self._empty.get(name)
            if axis is not None and len({p.shape[axis] + s for p, s in zip(parts, batch.shifts, strict=True)}) != 1:
                return None
            if axis is None and len({p.shape[1:] for p in parts}) != 1:
                return None  # of other sizes: an encoder's KV set once, or a kept encoder output (T5's lengths differ): such members run apart
            out[name] = pad_stack(parts, axis, 0.0, batch.shifts, self._right) if axis is not None and any(batch.shifts) else np.concatenate(parts)
        self.copied += sum(a.nbytes for a in out.values())
        return out

    def _run_in_place(self, request: Request, feeds: dict[str, Any]) -> tuple[Failure, ...]:
        """A batch of steps (one row each) on its members' rows of a slab, bound as both past and
        present, one call per run of consecutive rows (``_inplace``, Note: state in place); as
        :meth:`_run_steps` otherwise."""
        batch = request.batch
        assert batch is not None
        try:
            helds = [self._held(s, n, d) for s, n, d in zip(batch.streams, batch.steps, batch.dims, strict=True)]
            joining = not any(isinstance(h, InSlab) for h in helds)  # only then does placing look at the group's other members
            slab, runs, order, copied, evicted = place(batch.streams, helds, batch.length, max(self.plan.stage.settings.max_batch, 1),
                                                       self._axes, batch.group, self._kin(batch.group, batch.streams) if joining else None)
            self._place(slab, batch.streams, copied, evicted)
            results = self._run_runs(feeds, slab, runs, order)
        except Exception as e:  # which member was bad is found by running each alone (nothing was committed)
            self.unbatched = f"the batched call failed: {ort_message(e)}"
            return self._replay(request)
        share = slab.nbytes() // slab.rows
        for j, (stream, step) in enumerate(zip(batch.streams, batch.steps, strict=True)):
            slab.lengths[stream] = batch.length - batch.shifts[j]
            self.states[stream] = (step + 1, InSlab(slab))
            request.held.append((stream, self.name, share))
        self._hand_on(request.values, results)
        return ()

    def _run_runs(self, feeds: dict[str, Any], slab: Slab, runs: Sequence[tuple[int, int]], order: Sequence[int] | None = None) -> list[Any]:
        """A batch's call(s) on its runs of slab rows (first row, members; in row order): one call
        for one run; else each run's rows of the batch's inputs from the bag (the step flags as
        they are) in a call of its own, and the outputs a later stage or the pipeline reads joined
        again (the others, the states, are in the slab). ``order`` (:func:`place`): the batch's
        members by row, where that is not the batch's order; their inputs from the bag are taken
        in it and those outputs put back in the batch's (a few rows of small tensors, where moving
        the members' rows would copy their whole past)."""
        if order is None and len(runs) == 1:
            return self._run_bound(feeds, slab, *runs[0])
        stacked = self._stacked
        if order is not None:
            feeds = {name: value[order] if name in stacked else value for name, value in feeds.items()}
        parts, at = [], 0
        for start, k in runs:
            part = feeds if len(runs) == 1 else {name: value[at : at + k] if name in stacked else value for name, value in feeds.items()}
            parts.append(self._run_bound(part, slab, start, k))
            at += k
        handed = {i for i, _ in self._kept}
        outputs = range(len(self.plan.outputs))
        joined: list[Any] = parts[0] if len(parts) == 1 else [np.concatenate([p[i] for p in parts]) if i in handed else None for i in outputs]
        back = np.argsort(order) if order is not None else slice(None)
        return [joined[i][back] if i in handed else None for i in outputs]

    def _run_alone_in_place(self, request: Request) -> tuple[Failure, ...]:
        """A stream's step alone on its row of a slab (one of its own, or its group's: where the
        scheduler tells the group, a stream's first step, its prompt, runs in the row its group's
        batches will find it in), bound as both past and present (``_inplace``, Note: state in
        place); its own arrays as before when they hold more than one row."""
        stream = request.stream
        assert stream is not None
        held = self._held(stream, request.step, request.dims)
        if isinstance(held, InBlock) or (isinstance(held, dict) and any(len(a) != 1 for a in held.values())):
            return self._run_alone(request)  # a block of a batch kept as it came (never, with every state shared), or rows of its own
        if request.group and self._axes:  # its group's batches run in place: the step runs in its row of their slab (Note: state in place)
            kin = None if isinstance(held, InSlab) else self._kin(request.group, (stream,))  # a stream in a slab stays where it is
            slab, start, copied, evicted = arrange([stream], [held], request.length, max(self.plan.stage.settings.max_batch, 1), self._axes,
                                                   request.group, kin)
        else:
            slab, start, copied, evicted = arrange([stream], [held], request.length, 1, self._lone_axes)
        self._place(slab, (stream,), copied, evicted)
        feeds = self._inputs(request, {name: request.values[key] for name, key in self.plan.sources})
        results = self._run_bound(feeds, slab, start, 1)
        slab.lengths[stream] = request.length
        self.states[stream] = (request.step + 1, InSlab(slab))
        request.held.append((stream, self.name, slab.nbytes() // slab.rows))
        self._hand_on(request.values, results)
        return ()

    def _kin(self, group: Sequence[int], streams: Sequence[int]) -> dict[int, InSlab]:
        """The streams of ``group`` but ``streams`` whose state this runner holds in a slab (where
        ``arrange`` puts members that join their group)."""
        kin = {}
        for member in group:
            entry = self.states.get(member)
            if entry is not None and isinstance(entry[1], InSlab) and member not in streams:
                kin[member] = entry[1]
        return kin

    def _place(self, slab: Slab, streams: Sequence[int], copied: int, evicted: Mapping[int, dict[str, np.ndarray]]) -> None:
        """After :func:`~onnxpipe.runtime._inplace.arrange`: the copies counted, the streams copied
        out hold arrays of their own, the members' states are in ``slab`` (their steps unchanged,
        should the call fail)."""
        self.copied += copied
        for stream, own in evicted.items():
            if stream in self.states:
                self.states[stream] = (self.states[stream][0], own)
        for stream in streams:
            if stream in self.states:
                self.states[stream] = (self.states[stream][0], InSlab(slab))

    def _hand_on(self, values: dict[Endpoint, Any], results: Sequence[Any]) -> None:
        """The outputs a later stage or the pipeline reads into the bag; the values nothing reads any more out of it."""
        for at, key in self._kept:
            values[key] = results[at]
        for key in self._dropped:
            values.pop(key, None)

    def _run_bound(self, feeds: dict[str, Any], slab: Slab, start: int, k: int) -> list[Any]:
        """One session call with IOBinding on rows ``start..start+k-1`` of ``slab``: each state
        bound as its input and as its present output (one buffer), the other inputs read in place,
        the other outputs made by onnxruntime (numpy views of them, no copy); the outputs in
        ``plan.outputs`` order. Never with a parameter override: an initializer, which IOBinding
        cannot bind (the caller runs such a call through ``session.run``, its state copied as
        before).

        The binding of those rows' states is made once and kept on the slab (``Slab.bound``: a
        slab is its runner's), so a decode step on the same rows as the step before binds only
        its other inputs and outputs: binding the 16 caches of a stage of the 24.7 M Llama anew
        took 57 us a call (an ``OrtValue`` over each view, each bound twice)."""
        kept = slab.bound.get((start, k))
        if kept is None:
            if len(slab.bound) >= _BINDINGS:
                slab.bound.clear()
            binding = self.session.io_binding()
            states: dict[str, Any] = {}
            for name, view in slab.view(start, k).items():
                value = ort.OrtValue.ortvalue_from_numpy(view)  # over the view's memory (it keeps the view)
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(self._presents[name], value)
                states[self._presents[name]] = view
            kept = slab.bound[(start, k)] = (binding, states)
        binding, states = kept
        for name, value in feeds.items():
            if name not in self._presents:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        rest = self._made_apart
        for name in rest:
            binding.bind_output(name, "cpu")  # bound again each call: a new output (the last one's is handed on); it keeps its place
        self.session.run_with_iobinding(binding, self.run_options)
        made = dict(states)
        made.update(zip(rest, bound_outputs(binding, len(states)), strict=True))
        return [made[o] for o in self.plan.outputs]
