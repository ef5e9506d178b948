"""What a stage does for one request, apart from where its worker lives.

Note: the request's bag.
    A request travels through the stages in pipeline order carrying a *bag*: the values produced so
    far, keyed by their source endpoint (a pipeline input, or a stage's output). A stage takes its
    inputs from the bag by reference (no copy: onnxruntime reads numpy arrays in place), adds its
    outputs, and drops the values no later stage or pipeline output needs, so a tensor is kept
    exactly as long as something downstream will read it. A skip edge is a value that stays in the
    bag across stages that do not read it. The plan below is computed once from the spec; any
    engine (threads here, processes or Ray actors elsewhere) drives the same :class:`StageRunner`.

Note: state stays in its stage.
    A stage with state links (``PipelineSpec.states``) keeps, in its runner, one set of state
    arrays per stream: ``{stream id: (steps done, {state input: array})}``. A request of a stream
    (``Request.stream``) feeds the stage its stream's state and, once the session has returned,
    replaces it with the state outputs (the commit: a step that fails leaves the state as it was).
    Only activations travel in the bag; the state never leaves the runner, wherever the runner
    lives. Each request carries its step number, and a runner runs step ``n`` of a stream only
    when its state has exactly ``n`` steps in it, so a step that failed earlier (here or in an
    earlier stage) can never be followed by a step on the wrong state. A close request (``step ==
    CLOSE``) drops the stream's state; an engine delivers it like any request, so it reaches each
    stage after that stream's earlier steps (see docs/streams.md, what an engine must do).

Note: batched calls.
    A stage whose ``max_batch`` is above 1 (and whose spec carries the build's ``Batching``
    record) is given what its worker took from the queue, and :meth:`StageRunner.run_many` runs it
    in as few session calls as it can: requests with equal shapes but for dim 0 (and, for padded
    inputs, the padded axis) and the same parameters go together, one step per stream per call, a
    stream's steps in order. Inputs are joined along dim 0; padded inputs (a KV cache, the mask)
    are padded on the left of their growing axis to the longest member, so member i is shifted by
    ``longest - its length``. After the call each request gets its rows; stripped outputs lose the
    shift again. A stream's committed state is its rows of the call's state outputs *with* the
    shift (no copy), and ``_layout`` remembers where: when the same streams next run together, the
    call's state outputs are fed as they are; otherwise each held state's shift is dropped while
    the new batch is padded. A failed call, or one whose outputs cannot be split back, runs its
    members again one by one (nothing was committed), so only a bad request fails.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import InputError, StageError
from onnxpipe.runtime._bundle import Bundle
from onnxpipe.runtime._code import CodeFunction, check_allowed, copy_params, resolve_entry
from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._session import Placement, make_session, placement
from onnxpipe.runtime._spec import Batching, Endpoint, PipelineSpec, StageSpec, StateLink

__all__ = ["CLOSE", "Call", "CodeRunner", "Request", "Runner", "StagePlan", "StageRunner", "host_placement", "make_runner", "pinned_replica", "plan_stages"]

#: ``Request.step`` of a control request that closes its stream: each stateful runner drops the
#: stream's state; stateless ones pass it on.
CLOSE = -1


@dataclass(eq=False)
class Request:
    """One request in flight.

    Attributes:
        id: Sequence number, from 0, in submission order.
        values: The bag (see the note above).
        params: Parameter overrides per stage, as they were when the request was submitted.
        submitted: ``time.perf_counter()`` at submission.
        error: Set by the first stage that fails; later stages pass the request on untouched.
        done: Called once when the request leaves the last stage (set by the pipeline).
        stream: The stream the request is a step of, or ``None`` for a stateless request. An engine
            sends every request of one stream to the same replica of each stage.
        step: The step's number in its stream (from 0), or :data:`CLOSE`.
        dims: Sizes of the symbolic dims of the stream's state, for its initial value (see
            ``StateLink``); bound on the stream's first step.
        queued_at: ``time.perf_counter()`` when it entered the queue of the stage it waits for
            (its submission, then the end of each stage's run): what stage statistics time
            queues by.
    """

    id: int
    values: dict[Endpoint, Any]
    params: Mapping[str, Mapping[str, np.ndarray]]
    submitted: float
    error: BaseException | None = None
    done: Callable[[Request], None] | None = field(default=None, repr=False)
    stream: int | None = None
    step: int = 0
    dims: Mapping[str, int] = field(default_factory=dict)
    queued_at: float = 0.0

    def __post_init__(self) -> None:
        self.queued_at = self.queued_at or self.submitted


@dataclass(frozen=True)
class StagePlan:
    """Where a stage's inputs come from in the bag, and what it leaves in it."""

    stage: StageSpec
    sources: tuple[tuple[str, Endpoint], ...]  # (input name, bag key)
    outputs: tuple[str, ...]
    drop: tuple[Endpoint, ...]  # bag keys nothing after this stage reads
    states: tuple[StateLink, ...] = ()  # fed by the runner from its streams' state, not from the bag


def plan_stages(spec: PipelineSpec) -> tuple[list[StagePlan], dict[str, Endpoint]]:
    """The per-stage plans, and the bag key of each pipeline output."""
    finals = {t.name: spec.source_of(Endpoint(None, t.name)) for t in spec.outputs}
    last_use: dict[Endpoint, int] = {}
    fed_by_state = {Endpoint(s.stage, s.input) for s in spec.states}
    for i, stage in enumerate(spec.stages):
        for t in stage.inputs:
            if Endpoint(stage.name, t.name) not in fed_by_state:
                last_use[spec.source_of(Endpoint(stage.name, t.name))] = i
    keep = set(finals.values())
    plans = []
    for i, stage in enumerate(spec.stages):
        sources = tuple((t.name, spec.source_of(Endpoint(stage.name, t.name))) for t in stage.inputs if Endpoint(stage.name, t.name) not in fed_by_state)
        produced = [Endpoint(stage.name, t.name) for t in stage.outputs]
        drop = [k for k, last in last_use.items() if last == i and k not in keep]
        drop += [k for k in produced if k not in last_use and k not in keep]  # outputs nothing reads
        plans.append(StagePlan(stage, sources, tuple(t.name for t in stage.outputs), tuple(drop), spec.states_of(stage.name)))
    return plans, finals


class Runner(Protocol):
    """What any engine drives for one replica of one stage: a :class:`StageRunner` (an ONNX stage)
    or a :class:`~onnxpipe.runtime._code.CodeRunner` (a code stage, whose ``session`` is ``None``)."""

    name: str
    plan: StagePlan

    @property
    def session(self) -> ort.InferenceSession | None:
        """The stage's onnxruntime session, or ``None`` for a code stage."""

    def __call__(self, request: Request) -> None:
        """Run the stage for one request (see the note on the request's bag)."""

    def cancel(self) -> None:
        """Make a run in progress return early, where that is possible."""

    def run_many(self, requests: Sequence[Request]) -> list[Call]:
        """Run the stage for several requests taken together (batched where the stage batches);
        what each session call did (see :class:`Call`)."""


@dataclass
class Call:
    """One run of a stage over some requests: one session call for a batch, or one request alone.

    Attributes:
        members: The requests it ran (a close request: alone, with no session call).
        start, end: ``time.perf_counter()`` around the run.
        errors: Per member, what it raised, or ``None``.
    """

    members: list[Request]
    start: float
    end: float
    errors: list[Exception | None]


def run_alone(runner: Runner, requests: Sequence[Request]) -> list[Call]:
    """Each request of a group on its own (a runner that does not batch), in order."""
    calls = []
    clock = time.perf_counter
    for request in requests:
        if request.error is not None:
            continue
        start = clock()
        try:
            runner(request)
            error = None
        except Exception as e:  # onnxruntime raises its own types; the request fails, the stage goes on
            error = e
        calls.append(Call([request], start, clock(), [error]))
    return calls


class StageRunner:
    """Runs one stage of a request with one onnxruntime session.

    Args:
        plan: The stage's plan.
        session: Its session (one per runner: a replica has its own).
    """

    def __init__(self, plan: StagePlan, session: ort.InferenceSession) -> None:
        self.plan = plan
        self.name = plan.stage.name
        self.session = session
        self.run_options = ort.RunOptions()
        self._keys = tuple(Endpoint(self.name, o) for o in plan.outputs)
        #: Per stream: (steps in the state, state input name -> array). See Note: state stays in its stage.
        self.states: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self._state_at = tuple((s.input, plan.outputs.index(s.output)) for s in plan.states)
        self.max_batch = plan.stage.settings.max_batch if plan.stage.batching is not None else 1
        batching = plan.stage.batching or Batching()
        self._padded = dict(batching.padded)
        # Outputs stripped of a batch's padding: those but the state (which keeps it, see _Rows).
        states_out = {link.output for link in plan.states}
        self._stripped = tuple(None if o in states_out else batching.stripped.get(o) for o in plan.outputs)
        #: The feeds stacked along dim 0; the others (parameter overrides) are the batch's own, as one.
        self._stacked = frozenset(name for name, _ in plan.sources) | {s.input for s in plan.states}
        # Outputs put in the bag (those some later stage or pipeline output reads), and the
        # earlier values this stage is the last to read: the plan's drops, without putting in
        # what would be dropped at once.
        dropped = set(plan.drop)
        self._kept = tuple((at, key) for at, key in enumerate(self._keys) if key not in dropped)
        self._dropped = tuple(key for key in plan.drop if key not in self._keys)
        self._stacked_order = tuple(name for name, _ in plan.sources) + tuple(s.input for s in plan.states)
        #: Why the last batch that was tried ran its members alone instead (for diagnostics and the build's probe).
        self.unbatched: str | None = None
        #: Batched calls fed the state outputs of the batched call before them as they were (no copy).
        self.reused = 0
        #: Per stream whose state a batched call committed: where its rows are in that call's state (Note: batched calls).
        self._layout: dict[int, _Rows] = {}
        self._empty = {s.input: s.empty_axis for s in plan.states if s.empty_axis is not None}

    def __call__(self, request: Request) -> None:
        """Read the inputs from the request's bag, run, put the outputs back, drop dead values.

        For a stage with state, also feed the request's stream its state and commit the new one.
        """
        if request.step == CLOSE:
            self.states.pop(request.stream, None)  # type: ignore[arg-type]
            self._layout.pop(request.stream, None)  # type: ignore[arg-type]
            return
        values = request.values
        results = self.session.run(self.plan.outputs, self._feeds(request, held=False), self.run_options)
        if self._state_at:
            assert request.stream is not None
            self.states[request.stream] = (request.step + 1, {name: results[at] for name, at in self._state_at})
            if self._layout:
                self._layout.pop(request.stream, None)
        for at, key in self._kept:
            values[key] = results[at]
        for key in self._dropped:
            values.pop(key, None)

    def _state(self, request: Request) -> dict[str, np.ndarray]:
        """The state this step of its stream runs on: the stream's, or the initial one at step 0;
        without the padding a batched step left in it (see Note: batched calls)."""
        state = self._held_state(request)
        layout = self._layout.get(request.stream) if self._layout and request.step else None  # type: ignore[arg-type]
        if layout is None or not layout.pad:
            return state
        return {name: np.ascontiguousarray(self._unpad(name, value, layout.pad)) for name, value in state.items()}

    def _unpad(self, name: str, value: np.ndarray, pad: int) -> np.ndarray:
        axis = self._empty.get(name)
        return value if axis is None else value[(slice(None),) * axis + (slice(pad, None),)]

    def _held_state(self, request: Request) -> dict[str, np.ndarray]:
        """The state arrays the runner holds for this step's stream (or the initial ones at step 0)."""
        if request.stream is None:
            raise StageError(f"stage '{self.name}' keeps state per stream ({self.plan.states[0]}): run the pipeline through pipe.stream()", stage=self.name)
        if request.step == 0:
            if request.stream in self.states:
                raise AssertionError(f"stream {request.stream} started twice in stage '{self.name}'")
            return initial_state(self.plan, request.dims)
        entry = self.states.get(request.stream)
        if entry is None or entry[0] != request.step:
            held = "no state of it" if entry is None else f"its state after step {entry[0] - 1}"
            raise StageError(
                f"stage '{self.name}' holds {held}, not after step {request.step - 1}: "
                f"an earlier step of stream {request.stream} failed, so step {request.step} cannot run on its state",
                stage=self.name,
            )
        return entry[1]

    def run_many(self, requests: Sequence[Request]) -> list[Call]:
        """Run a group of requests taken from the stage's queue, in as few session calls as the
        stage's batching allows (see Note: batched calls); each request's outputs go to its bag
        and each stream's state is committed exactly as :meth:`__call__` does.

        Requests that failed earlier are passed over; a close request runs alone, after the
        stream's earlier steps. Never raises: each member's error is in its :class:`Call`.
        """
        if self.max_batch <= 1:
            return run_alone(self, requests)
        calls: list[Call] = []
        pending = [r for r in requests if r.error is None]
        while pending:
            batch, feeds, rest = self._take_batch(pending, calls)
            pending = rest
            if len(batch) == 1:
                calls.extend(run_alone(self, batch))
            elif batch:
                calls.extend(self._run_batch(batch, feeds))
        return calls

    def _take_batch(self, pending: list[Request], calls: list[Call]) -> tuple[list[Request], list[dict[str, np.ndarray]], list[Request]]:
        """The next batch: the first pending request and, after it in order, those that fit with
        it (the same key, another stream); the rest stay pending. A stream one of whose requests
        stays pending keeps all its later ones pending too, so its steps keep their order."""
        batch: list[Request] = []
        feeds: list[dict[str, np.ndarray]] = []
        rest: list[Request] = []
        streams: set[int] = set()
        held: set[int] = set()
        key: tuple[Any, ...] | None = None
        for request in pending:
            stream = request.stream
            if (stream is not None and (stream in held or stream in streams)) or len(batch) >= self.max_batch or (request.step == CLOSE and batch):
                rest.append(request)
                if stream is not None:
                    held.add(stream)
                continue
            if request.step == CLOSE:
                return [request], [], [r for r in pending if r is not request]
            try:
                feed = self._feeds(request)
            except Exception as e:  # its state does not match its step: it fails alone, now
                calls.append(Call([request], time.perf_counter(), time.perf_counter(), [e]))
                continue
            mine = self._key(request, feed)
            if key is None:
                key = mine
            elif mine != key:
                rest.append(request)
                if stream is not None:
                    held.add(stream)
                continue
            batch.append(request)
            feeds.append(feed)
            if stream is not None:
                streams.add(stream)
        return batch, feeds, rest

    def _feeds(self, request: Request, held: bool = True) -> dict[str, np.ndarray]:
        """What the session is fed for one request: its inputs from the bag, its parameters, its
        state: as held (``held``: a batched step's padding in it, which ``_stack`` deals with), or
        as the request alone runs on."""
        values = request.values
        feeds = {name: values[key] for name, key in self.plan.sources}
        own = request.params.get(self.name)
        if own:
            feeds.update(own)
        if self._state_at:
            feeds.update(self._held_state(request) if held else self._state(request))
        return feeds

    def _key(self, request: Request, feeds: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
        """Requests batch together only with the same key: the same parameters, and the same
        shapes but the batch axis (and, for padded inputs, the padded axis). Dtypes need no place
        in it: a pipeline input's is checked at submission, and a stage's or a state's is its module's."""
        own = request.params.get(self.name)
        key: list[Any] = [id(own) if own else None]
        padded = self._padded
        for name in self._stacked_order:
            shape = feeds[name].shape
            pad = padded.get(name)
            if pad is None:
                key.append(shape[1:])
            else:
                axis = pad[0]
                key.append(shape[1:axis] + shape[axis + 1 :])
        return tuple(key)

    def _run_batch(self, batch: list[Request], feeds: list[dict[str, np.ndarray]]) -> list[Call]:
        """One session call for the batch (see Note: batched calls); should it fail, or its
        outputs not split back, each member runs again alone so only a bad one fails."""
        clock = time.perf_counter
        start = clock()
        layouts: list[_Rows | None] = [self._layout.get(r.stream) if r.step else None for r in batch] if self._layout else [None] * len(batch)  # type: ignore[arg-type]
        batch, feeds, layouts, whole = self._in_held_order(batch, feeds, layouts)
        stacked = self._stack(batch, feeds, layouts, whole)
        if stacked is None:
            self.unbatched = "their padded inputs do not grow alike, or their inputs disagree on a request's batch size"
            return run_alone(self, batch)
        joined, rows, shifts = stacked
        try:
            results = self.session.run(self.plan.outputs, joined, self.run_options)
        except Exception as e:  # which member was bad is found by running each alone
            self.unbatched = f"the batched call failed: {e}"
            return run_alone(self, batch)
        total = rows[-1]
        if any(np.ndim(r) == 0 or len(r) != total for r in results):
            self.unbatched = f"an output's dim 0 is not the batch's {total} rows, so it cannot be split back"
            return run_alone(self, batch)
        # Each stream's new state is its rows of the batch's, padding and all (no copy); the batch
        # keeps the whole, which its next step feeds as it is when the same streams come back together.
        made = _Batch(tuple(r.stream for r in batch), {name: results[at] for name, at in self._state_at})
        kept = [(key, results[at], self._stripped[at]) for at, key in self._kept]
        states = [(name, results[at]) for name, at in self._state_at]
        for j, request in enumerate(batch):
            lo, hi, shift = rows[j], rows[j + 1], shifts[j]
            values = request.values
            for key, result, axis in kept:
                part = result[lo:hi]
                if axis is not None and shift:
                    part = np.ascontiguousarray(part[(slice(None),) * axis + (slice(shift, None),)])
                values[key] = part
            for key in self._dropped:
                values.pop(key, None)
            if states:
                assert request.stream is not None
                self.states[request.stream] = (request.step + 1, {name: result[lo:hi] for name, result in states})
                self._layout[request.stream] = _Rows(made, j, shift)
        return [Call(list(batch), start, clock(), [None] * len(batch))]

    def _in_held_order(self, batch: list[Request], feeds: list[dict[str, np.ndarray]], layouts: list[_Rows | None]
                       ) -> tuple[list[Request], list[dict[str, np.ndarray]], list[_Rows | None], bool]:
        """The batch, its feeds and its members' layouts in the rows of the batched call that made
        all their states, when it holds exactly that call's streams (then ``True``: that call's state
        outputs may feed this one as they are); otherwise as given, and ``False``."""
        first = layouts[0]
        if first is None or len(first.batch.streams) != len(batch) or any(lay is None or lay.batch is not first.batch for lay in layouts):
            return batch, feeds, layouts, False
        order = sorted(range(len(batch)), key=lambda j: layouts[j].index)  # type: ignore[union-attr]
        return [batch[j] for j in order], [feeds[j] for j in order], [layouts[j] for j in order], True

    def complete(self, group: Sequence[Request]) -> bool:
        """Whether a stage waiting for a batch (``max_delay_ms``) may stop waiting: ``group`` holds
        a step of every stream whose state this stage holds (no other step can come to join it
        but a new stream's), or of every stream of the batch its first stream last ran in (the
        streams that batch together keep doing so: their state then feeds the next call as it
        is), or a close (which never waits). Always false for a stage without state (any request
        may still come)."""
        if any(r.step == CLOSE for r in group):
            return True
        if not self._state_at or not self.states:
            return False
        present = {r.stream for r in group}
        last = self._layout.get(group[0].stream) if self._layout else None  # type: ignore[arg-type]
        if last is not None and all(stream in present for stream in last.batch.streams):
            return True
        return all(stream in present for stream in self.states)

    def _stack(self, batch: list[Request], feeds: list[dict[str, np.ndarray]], layouts: Sequence[_Rows | None], whole: bool
               ) -> tuple[dict[str, np.ndarray], list[int], list[int]] | None:
        """The batch's feeds: each input's members joined along dim 0, padded inputs padded on
        the left of their axis to the longest; with each member's first row (and the total) and
        its padding. ``None`` when the padded inputs do not grow alike (they then run alone)."""
        stacked = [name for name in feeds[0] if name in self._stacked]
        if not stacked or any(np.ndim(feeds[0][name]) == 0 for name in stacked):
            return None
        rows = [0]
        for feed in feeds:
            rows.append(rows[-1] + len(feed[stacked[0]]))
        if any(len(f[name]) != rows[j + 1] - rows[j] for j, f in enumerate(feeds) for name in stacked):
            return None  # inputs of one request disagree on its batch size: each runs alone, and says so
        # The padding each member's held state carries already (from the batched step that made it).
        held = [0 if lay is None else lay.pad for lay in layouts]
        shifts = [0] * len(feeds)
        padded = [name for name in feeds[0] if name in self._padded]
        lengths: dict[str, list[int]] = {}
        if padded:
            for name in padded:
                axis = self._padded[name][0]
                own = [f[name].shape[axis] for f in feeds]
                lengths[name] = [n - h for n, h in zip(own, held, strict=True)] if name in self._empty else own
            first_lengths = lengths[padded[0]]
            longest = max(first_lengths)
            shifts = [longest - n for n in first_lengths]
            for name in padded[1:]:
                grown = lengths[name]
                if any(grown[j] + shifts[j] != grown[0] + shifts[0] for j in range(1, len(feeds))):
                    return None
        # The same streams as the batch that made their states, in its rows, padded alike:
        # that batch's state outputs are this call's state inputs, as they are.
        first = layouts[0]
        reuse = whole and shifts == held
        self.reused += reuse
        joined: dict[str, np.ndarray] = {}
        for name, value in feeds[0].items():
            if name not in self._stacked:
                joined[name] = value
                continue
            if reuse and first is not None and name in first.batch.state:
                joined[name] = first.batch.state[name]
                continue
            pad = self._padded.get(name)
            if pad is None or (not any(shifts) and not any(held)):
                joined[name] = np.concatenate([f[name] for f in feeds]) if len(feeds) > 1 else value
                continue
            axis, fill = pad
            shape = list(value.shape)
            shape[0] = rows[-1]
            shape[axis] = lengths[name][0] + shifts[0]
            out = np.full(shape, fill, value.dtype) if fill else np.zeros(shape, value.dtype)
            lead = (slice(None),) * (axis - 1)
            for j, feed in enumerate(feeds):
                part = feed[name]
                if held[j] and name in self._empty:
                    unpadded = (slice(None), *lead, slice(held[j], None))
                    part = part[unpadded]
                at = (slice(rows[j], rows[j + 1]), *lead, slice(shifts[j], None))
                out[at] = part
            joined[name] = out
        return joined, rows, shifts

    def state_bytes(self) -> int:
        """Bytes of the state arrays this runner holds, over all its streams."""
        return sum(a.nbytes for _, state in self.states.values() for a in state.values())

    def cancel(self) -> None:
        """Make a run in progress return early (onnxruntime's ``RunOptions.terminate``)."""
        self.run_options.terminate = True


@dataclass(frozen=True, eq=False)
class _Batch:
    """The state outputs of one batched call, whole, and the streams it ran, in their rows."""

    streams: tuple[int | None, ...]
    state: dict[str, np.ndarray]


@dataclass(frozen=True)
class _Rows:
    """Where a stream's state lies in the batched call that committed it: its member ``index``,
    and the ``pad`` positions its held state arrays carry on the left of their empty axis."""

    batch: _Batch
    index: int
    pad: int


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


class CodeRunner:
    """Runs one code stage of a request: calls its function, checks what it returns.

    Same face as :class:`StageRunner` (``name``, ``plan``, ``__call__``, ``cancel``); ``session``
    is ``None``. Made by :func:`make_runner` for a code stage, so every engine runs code stages.

    Note: checked outputs.
        The function must return a mapping holding exactly the stage's declared outputs, each a
        numpy array (anything ``np.asarray`` takes is converted) of the declared dtype and rank,
        with the declared size on every fixed dim; symbolic dims may take any size, but the same
        size in every output naming them, so shapes may change from request to request. Anything
        else fails that request with a :class:`StageError` naming the stage and the tensor; the
        stage goes on with the next request. Values are never cast (as for pipeline inputs).

    Args:
        plan: The stage's plan (``plan.stage.code`` set).
        function: The resolved callable.
    """

    session = None

    def __init__(self, plan: StagePlan, function: CodeFunction) -> None:
        assert plan.stage.code is not None
        self.plan = plan
        self.name: str = plan.stage.name
        self.function = function
        # The stage's params as the bundle gives them; each call gets a fresh copy of its own (below).
        self.params: dict[str, Any] = copy_params(plan.stage.code.params)
        self._keys = tuple((o, Endpoint(self.name, o)) for o in plan.outputs)

    def compute(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Call the function on one request's inputs; its outputs, checked (see the note above).

        Raises:
            StageError: the function's result is not the declared outputs.
        """
        # A fresh copy per call: a function (or a library it hands them to) that changes its params
        # changes nothing for the next request. Measured: 0.4 us for a few numbers, 1.25 ms for
        # an 18,708-entry list of strings (docs/pipelines.md).
        result = self.function(feeds, copy_params(self.params))
        if not isinstance(result, Mapping):
            raise StageError(f"code stage '{self.name}' returned {type(result).__name__}; it must return a dict of arrays by output name")
        declared = self.plan.stage.outputs
        extra = [k for k in result if k not in {t.name for t in declared}]
        if extra:
            names = ", ".join(repr(str(k)) for k in extra)
            raise StageError(f"code stage '{self.name}' returned output(s) {names} it does not declare; declared: {', '.join(repr(t.name) for t in declared)}")
        try:
            return check_inputs(declared, result, what=f"stage '{self.name}' output", same_dims=True)
        except InputError as e:
            raise StageError(f"code stage '{self.name}': {e}") from None

    def __call__(self, request: Request) -> None:
        """Read the inputs from the request's bag, call the function, put the outputs back, drop dead values."""
        if request.step == CLOSE:  # a code stage keeps no state of a stream
            return
        values = request.values
        outputs = self.compute({name: values[key] for name, key in self.plan.sources})
        for name, key in self._keys:
            values[key] = outputs[name]
        for key in self.plan.drop:
            values.pop(key, None)

    def cancel(self) -> None:
        """Nothing to do: a Python call cannot be interrupted; the engine stops after it returns."""

    def run_many(self, requests: Sequence[Request]) -> list[Call]:
        """Each request alone, in order: code stages do not batch."""
        return run_alone(self, requests)


def pinned_replica(plan: StagePlan, request: Request, replicas: int) -> int | None:
    """The replica of a stage that must run ``request``, or None when any replica may.

    A stream's request in a stage with state goes to replica ``stream % replicas``, whose runner
    holds the stream's state (streams are numbered in order, so they spread evenly). Every engine
    routes by this (see the streams note of ``_engine.py``).
    """
    if request.stream is None or not plan.states:
        return None
    return request.stream % replicas


def make_runner(bundle: Bundle, plan: StagePlan, replica: int, target: str | None = None) -> Runner:
    """The runner of one replica of one stage, with its own session (or, for a code stage, its
    callable): what every engine's workers call, wherever they live (a thread here, an actor on
    another host).

    A code stage, or an ONNX stage with custom-op libraries, is made only when the bundle's
    ``allow_code`` patterns allow what it names (checked before anything is imported).

    Args:
        bundle: The checked bundle the stage's module comes from.
        plan: The stage's plan.
        replica: Which replica (its settings may differ, e.g. its cores).
        target: Run on this target instead of the stage's own.

    Raises:
        BundleError: the session could not be created (provider missing, module refused), the
            stage names Python the bundle's ``allow_code`` does not allow, or its entry point or
            custom-op package cannot be found on this host.
    """
    stage = plan.stage
    check_allowed([stage], bundle.allow_code)
    if stage.code is not None:
        return CodeRunner(plan, resolve_entry(stage))
    return StageRunner(plan, _stage_session(bundle, stage, replica, target))


def _stage_session(bundle: Bundle, stage: StageSpec, replica: int, target: str | None) -> ort.InferenceSession:
    module, config = bundle.session_source(stage)
    return make_session(module, dataclasses.replace(stage, settings=stage.settings.for_replica(replica)), target, config)


def host_placement(bundle: Bundle, target: str | None = None) -> dict[str, Placement | None]:
    """Where each stage's nodes would run on this host: each ONNX stage's session made as a
    pipeline loading the bundle makes its first replica's, and which provider took each node of it
    (``_session.placement``); ``None`` for a code stage (nothing is imported) and where this
    onnxruntime cannot tell. What ``onnxpipe inspect BUNDLE --host`` prints.

    Raises:
        BundleError: a stage would not load here, as :func:`~onnxpipe.runtime.load` would say
            (its provider missing, nodes it cannot take with fallback off, custom-op packages
            ``allow_code`` does not allow).
    """
    onnx_stages = [s for s in bundle.spec.stages if s.code is None]
    check_allowed(onnx_stages, bundle.allow_code)
    where: dict[str, Placement | None] = {s.name: None for s in bundle.spec.stages}
    for stage in onnx_stages:
        where[stage.name] = placement(_stage_session(bundle, stage, 0, target))
    return where
