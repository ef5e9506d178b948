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

Note: state blocks.
    A batch of streams' steps (``request.batch``, a :class:`~onnxpipe.runtime.scheduling.StepBatch`
    formed at the pipeline's entry) is one request: the runner feeds the session the bag's values
    as they are (already stacked and padded in the batch's layout) and the batch's state as ONE
    block, runs once, and commits the call's state outputs as the new block, each member's state
    being its rows of it (``InBlock``: no copy, no split). When the next step holds the same
    members in the same rows, that block is fed back as it is; when members joined or left, the
    block is made anew once (one compaction, or one pad of each member's rows to the new layout).
    A step that runs alone (a prefill, an unbatched stream) runs on its stream's rows without
    their padding and commits arrays of its own. A stage whose states are all ``shared``
    (GroupQueryAttention's past and present) keeps its batches' state in place instead
    (``_inplace``, Note: state in place): a slab bound as both past and present, so a decode step
    copies nothing (:meth:`StageRunner._run_in_place`). Should a batched call fail, or a member's state
    not hold its step, each member runs alone (nothing was committed): a member that fails leaves
    the batch with its error, and the others go on to the next stage as a smaller batch.

Note: kept inputs.
    A stage's inputs fed by a first-step stage (an encoder's output, or a pipeline input the
    encoder reads: ``PipelineSpec``, Note: first-step stages) are in the bag on a stream's first
    step only. The runner keeps them with the stream's state: ``_made_state`` puts each kept
    input's value as it was fed beside the state outputs, so a later step is fed it from the
    stream's state as a state is (``_feeds``, which reads the bag without them:
    ``_later_sources``), a batch's block holds them in its rows, and a close drops them. Nothing
    is copied: the value kept is the array the first step was fed (an ``OrtValue`` a stage handed on a
    device is copied to host memory once). Members whose kept values
    differ in shape (T5's encoder outputs of different lengths) cannot share a block and run
    apart (``_joined_block``). A stage with kept inputs keeps its state as arrays, never in place
    (``in_place_axes``).

Note: state bytes copied.
    A runner counts the bytes of streams' state that are copied for its runs (``copied``, each
    run's share in its ``Call``, summed in ``StageStats.bytes_copied``): its own copies (a block
    made anew from its members' states when members joined, compacted when they left, a member's
    rows cut out of a block to run alone) and the past a session copied into a present it made
    apart from it (a KV cache fed as an input and returned as a new array: GroupQueryAttention
    without a shared buffer and ``Concat`` both copy the whole past, every step). A state kept in
    place costs neither: what a step writes is its new rows.

Note: batched calls.
    A stage whose ``max_batch`` is above 1 in a stateless pipeline (Triton's dynamic batcher) is
    given what its worker took from the queue, and :meth:`StageRunner.run_many` runs it in as few
    session calls as it can: requests with equal shapes but for dim 0 and the same parameters go
    together, stacked along dim 0; after the call each request gets its rows. A failed call, or
    one whose outputs cannot be split back, runs its members again one by one, so only a bad
    request fails. (Streams' steps are batched at the entry instead: Note: state blocks.)

Note: a run's record.
    Every run of a stage ends in one :class:`Call`, made by the runner where the run happened (a
    thread here, an actor on another host): which requests it ran, when, how many requests or
    steps, and what failed, as :class:`Failure` records (plain data: they cross processes as
    they are). ``Runner.run`` and ``Runner.run_many`` never raise. An engine turns a failure into
    the request's error with :meth:`Failure.error` (its words made in one place,
    :func:`stage_failed`) and records the run with ``StageRecorder.record``; so a new batching
    mode or stage kind is taught to the runner, not to each engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import ConfigError, InputError, StageError, ort_message
from onnxpipe.runtime._code import CodeFunction, check_allowed, copy_params, resolve_entry
from onnxpipe.runtime._handoff import Handoff, handoff_for
from onnxpipe.runtime._inplace import InSlab
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._records import CLOSE, Call, Failure, Request, StagePlan, claimed, passes, plan_stages, stage_failed
from onnxpipe.runtime._session import Placement, make_session, placement, run_options
from onnxpipe.runtime._settings import check_cores
from onnxpipe.runtime._spec import Endpoint, StageSpec
from onnxpipe.runtime._states import Block, Held, InBlock, StateKeeper, in_place_axes
from onnxpipe.runtime.bundle import Bundle
from onnxpipe.runtime.scheduling import StepBatch, member_rows, pad_stack, take_rows

__all__ = [
    "CLOSE", "Call", "CodeRunner", "Failure", "Request", "Runner", "RunnerBase", "StagePlan", "StageRunner", "claimed", "host_placement",
    "make_runner", "passes", "pinned_replica", "plan_stages", "stage_failed",
]

_clock = time.perf_counter
class Runner(Protocol):
    """What any engine drives for one replica of one stage: a :class:`StageRunner` (an ONNX stage)
    or a :class:`CodeRunner` (a code stage, whose ``session`` is ``None``).

    Attributes:
        name: The stage's name.
        plan: The stage's plan.
        max_batch: Requests a worker may take from the stage's queue to run together
            (:meth:`run_many`); 1: one at a time (:meth:`run`).
        reused: Batched steps fed the block of state the step before left, as it was (Note: state blocks).
    """

    name: str
    plan: StagePlan
    max_batch: int
    reused: int

    @property
    def session(self) -> ort.InferenceSession | None:
        """The stage's onnxruntime session, or ``None`` for a code stage."""

    def run(self, request: Request) -> Call:
        """Run the stage for one request (a batch of streams' steps is one) and say what happened;
        never raises: a failure is in the :class:`Call`."""

    def run_many(self, requests: Sequence[Request]) -> list[Call]:
        """Run the stage for several requests taken together (batched where the stage batches):
        one :class:`Call` per run, in order. Requests that failed earlier are passed over."""

    def __call__(self, request: Request) -> None:
        """Run the stage for one request, raising what the stage raised (for callers outside an engine)."""

    def cancel(self) -> None:
        """Make a run in progress return early, where that is possible."""

    def streams(self) -> list[int]:
        """The streams whose state this runner holds, in order."""

    def state_bytes(self) -> int:
        """Bytes of the state arrays this runner holds, over all its streams."""


class RunnerBase:
    """What every runner shares (Polygraphy's ``infer`` around ``infer_impl``): :meth:`run` times
    the stage's own :meth:`_compute` and makes the run's :class:`Call`; :meth:`__call__` runs it
    for a caller outside an engine."""

    name: str
    plan: StagePlan
    #: Bytes of streams' state copied so far (Note: state bytes copied); each run's share is its ``Call.copied``.
    copied = 0
    #: The stage runs on a stream's first step only (``StageSpec.runs``): set with ``plan``, read on every request's path.
    _first_only = False

    def _compute(self, request: Request) -> tuple[Failure, ...]:
        """Run the stage for one request (see the note on the request's bag); the members of a
        batch of steps that failed and left it. Raises what the stage raised."""
        raise NotImplementedError

    def run(self, request: Request) -> Call:
        """Run the stage for one request (a batch of streams' steps is one) and say what happened;
        never raises: what :meth:`_compute` raised fails the request, in the :class:`Call`."""
        batch = request.batch  # its size, inlined: run() is on every request's path through every stage
        size = 0 if request.step == CLOSE else 1 if batch is None else len(batch)
        start, copied = _clock(), self.copied
        if self._first_only and passes(self.plan, request):
            return Call((request.id,), start, start, 0)  # a later step at a first-step stage: no run, not counted
        try:
            failures = self._compute(request)
        except Exception as e:  # onnxruntime raises its own types; the request fails, the stage goes on
            failures = (Failure.of(request.id, self.name, e),)
        return Call((request.id,), start, _clock(), size, failures, copied=self.copied - copied)

    def __call__(self, request: Request) -> None:
        """Run the stage for one request, raising what the stage raised (for callers outside an
        engine); the members of a batch of steps that fail leave it (``request.batch.failed``)."""
        if not passes(self.plan, request):
            self._compute(request)


def _by_step(plan: StagePlan) -> tuple[frozenset[str], frozenset[int], tuple[dict[str, np.ndarray], ...]]:
    """What a stage's runner does by a stream's step (``StateLink``'s Note: a state set once,
    ``StepFlag``): its states set once; the outputs a later step makes for them (no update, often
    a placeholder with no rows, never split back); its step flags' feeds on a stream's first step
    and on a later one (empty: none)."""
    once = frozenset(s.input for s in plan.states if s.once)
    placeholders = frozenset(plan.outputs.index(s.output) for s in plan.states if s.once)
    shapes = {f.input: tuple(d for d in plan.stage.input(f.input).shape or () if isinstance(d, int)) for f in plan.flags}  # all fixed (validated)
    flags = tuple({f.input: np.full(shapes[f.input], later != f.first, np.bool_) for f in plan.flags} for later in (False, True))
    return once, placeholders, flags if plan.flags else ()


def run_alone(runner: Runner, requests: Sequence[Request]) -> list[Call]:
    """Each request of a group on its own (a runner that does not batch), in order."""
    return [runner.run(request) for request in requests if request.error is None]


class StageRunner(StateKeeper, RunnerBase):
    """Runs one stage of a request with one onnxruntime session.

    Args:
        plan: The stage's plan.
        session: Its session (one per runner: a replica has its own).
    """

    def __init__(self, plan: StagePlan, session: ort.InferenceSession) -> None:
        self.plan = plan
        self._first_only = plan.stage.first_step_only
        self.name = plan.stage.name
        self.session = session
        self.run_options = run_options()  # onnxruntime's own line of a failed run is off: the StageError says it (_session, Note: a run's failure is said once)
        self._keys = tuple(Endpoint(self.name, o) for o in plan.outputs)
        #: Per stream: (steps in the state, the state: its own arrays, or its rows of a block). See Note: state blocks.
        self.states: dict[int, tuple[int, Held]] = {}
        self._state_at = tuple((s.input, plan.outputs.index(s.output)) for s in plan.states)
        #: Requests taken from the stage's queue that may run as one call (stateless requests: Note: batched calls).
        self.max_batch = plan.max_batch
        #: The feeds stacked along dim 0; the others (parameter overrides) are the batch's own, as one.
        self._stacked = tuple(name for name, _ in plan.sources)
        # Outputs put in the bag (those some later stage or pipeline output reads), and the
        # earlier values this stage is the last to read: the plan's drops, without putting in
        # what would be dropped at once.
        dropped = set(plan.drop)
        self._kept = tuple((at, key) for at, key in enumerate(self._keys) if key not in dropped)
        self._dropped = tuple(key for key in plan.drop if key not in self._keys)
        self._made = frozenset(self._keys)
        # The growing axis of each state that grows (a state set once never does: StateLink's Note: a state set once).
        self._empty = {s.input: s.empty_axis for s in plan.states if s.empty_axis is not None and not s.once}
        self._once, self._placeholders, self._flags = _by_step(plan)
        self._keep_inputs(plan)
        # Where a member's padding of the state block goes (Batching.state_padding): before its past, or after it.
        self._right = plan.stage.batching is not None and plan.stage.batching.state_padding == "right"
        #: Why the last batch that was tried ran its members alone instead (for diagnostics and the build's probe).
        self.unbatched: str | None = None
        #: Batched steps fed the block of state the step before left, as it was (no copy; Note:
        #: state blocks): a diagnostic (:meth:`Pipeline.diagnostics`).
        self.reused = 0
        # States kept in place (``_inplace``, Note: state in place): each shared state input's
        # present, and its growing axis for a step alone and for a batch (empty: not in place).
        self._presents, self._lone_axes, self._axes = in_place_axes(plan, session, self._right)
        self._made_apart = tuple(o for o in plan.outputs if o not in set(self._presents.values()))  # outputs a call in place does not bind to a state
        #: Runs the session call through IOBinding, leaving outputs on the stage's device (``_handoff``,
        #: Note: hand-offs as OrtValues); ``None``: ``session.run`` and numpy. Set by :func:`make_runner`.
        self.handoff: Handoff | None = None

    def _compute(self, request: Request) -> tuple[Failure, ...]:
        """Read the inputs from the request's bag, run, put the outputs back, drop dead values.

        For a stage with state, also feed the request's stream its state and commit the new one;
        a batch of streams' steps (``request.batch``) runs as one call (Note: state blocks), and
        its members that fail leave it: they are returned.
        """
        if request.step == CLOSE:
            gone = self.states.pop(request.stream, None)  # type: ignore[arg-type]
            if gone is not None and isinstance(gone[1], InSlab):
                gone[1].slab.drop(request.stream)  # type: ignore[arg-type]
            return ()
        if request.batch is not None:
            return self._run_steps(request)
        if self._lone_axes and request.length and request.stream is not None and not request.params.get(self.name):
            return self._run_alone_in_place(request)  # (parameter overrides are initializers, which IOBinding cannot bind: not in place)
        return self._run_alone(request)

    def _run_alone(self, request: Request) -> tuple[Failure, ...]:
        """One request alone: its feeds (its stream's state as arrays), one call, its state committed as the outputs came."""
        feeds = self._feeds(request)
        results = self._run_stepping(feeds, request.step)
        if self._holds:
            assert request.stream is not None
            self._commit(request, request.stream, request.step, self._made_state(feeds, results, request.step == 0))
        self._hand_on(request.values, results)
        return ()

    def _run(self, feeds: dict[str, Any]) -> list[Any]:
        """One session call: the stage's outputs, in ``plan.outputs`` order (``OrtValue`` where the hand-off leaves them on a device)."""
        if self.handoff is not None:
            return self.handoff(feeds)
        return self.session.run(self.plan.outputs, feeds, self.run_options)

    def _feeds(self, request: Request) -> dict[str, np.ndarray]:
        """What the session is fed for one request alone: its inputs from the bag, its parameters,
        its stream's state."""
        # On every request's path: a loop (no comprehension's frame before Python 3.12), _inputs inlined.
        values, feeds = request.values, {}
        for name, key in self._later_sources if self._kept_in and request.step > 0 else self.plan.sources:
            feeds[name] = values[key]
        own = request.params.get(self.name)
        if own:
            feeds.update(own)
        if self._flags:
            feeds.update(self._flags[request.step != 0])
        if self._holds:
            feeds.update(self._own(self._held(request.stream, request.step, request.dims, feeds), request.stream))
        return feeds

    def _sources(self, later: bool) -> tuple[tuple[str, Endpoint], ...]:
        """The (input, bag key) pairs a step reads from the bag: a later step's lack the kept inputs."""
        return self._later_sources if later else self.plan.sources

    def _inputs(self, request: Request, feeds: dict[str, np.ndarray], step: int | None = None) -> dict[str, np.ndarray]:
        """``feeds`` (the stage's inputs from the bag) with the request's parameter overrides for
        this stage and its step flags for ``step`` (default: the request's step, or a batch's
        first member's: its members are all first steps or all later ones, see :meth:`_mixed`)."""
        own = request.params.get(self.name)
        if own:
            feeds.update(own)
        if self._flags:
            if step is None:
                step = request.batch.steps[0] if request.batch is not None else request.step
            feeds.update(self._flags[step != 0])
        return feeds

    def _mixed(self, batch: StepBatch) -> str | None:
        """Why a batch of steps cannot run as one call for this stage's step flags or states set
        once: it mixes streams' first steps with later ones (a flag takes one value for the whole
        call; a state set once is the output of a first step, the input of a later one)."""
        if not (self._flags or self._once) or len({n == 0 for n in batch.steps}) < 2:
            return None
        what = f"step flag '{self.plan.flags[0].input}'" if self._flags else f"state '{next(iter(self._once))}' (set once)"
        return f"the batch mixes streams' first steps with later ones, and {what} differs between them"

    # -- a batch of streams' steps ----------------------------------------------------------

    def _run_steps(self, request: Request) -> tuple[Failure, ...]:
        """One session call for a batch of steps (Note: state blocks); should it fail, or its
        members' states not line up, each member runs alone so that only a bad one fails (the
        members that failed, which left the batch)."""
        batch = request.batch
        assert batch is not None
        if not len(batch):
            return ()  # every member failed in an earlier stage
        mixed = self._mixed(batch)
        if mixed is not None:
            self.unbatched = mixed
            return self._replay(request)
        values = request.values
        feeds = self._inputs(request, {name: values[key] for name, key in self._sources(batch.steps[0] > 0)})
        if self._axes and batch.length and batch.rows[-1] == len(batch) and not request.params.get(self.name):
            return self._run_in_place(request, feeds)
        try:
            if self._holds:
                block = self._block_for(batch, feeds)
                if block is None:
                    self.unbatched = "the members' states do not line up with the batch's padding"
                    return self._replay(request)
                feeds.update(block)
            results = self._run(feeds)
        except Exception as e:  # which member was bad is found by running each alone
            self.unbatched = f"the batched call failed: {ort_message(e)}"
            return self._replay(request)
        first = batch.steps[0] == 0
        if not self._splits_back(results, batch.rows[-1], first):
            return self._replay(request)
        if self._holds:  # its state and kept inputs (Note: kept inputs)
            made = Block(batch.streams, batch.rows, batch.shifts, self._made_state(feeds, results, first))
            states = self.states
            size, rows = sum(a.nbytes for a in made.arrays.values()), max(batch.rows[-1], 1)
            for j, (stream, step) in enumerate(zip(batch.streams, batch.steps, strict=True)):
                states[stream] = (step + 1, InBlock(made, j))
                request.held.append((stream, self.name, size * (batch.rows[j + 1] - batch.rows[j]) // rows))  # its rows' share, padding in
        for at, key in self._kept:
            values[key] = results[at]
        for key in self._dropped:
            values.pop(key, None)
        return ()

    def _splits_back(self, results: Sequence[Any], total: int, first: bool) -> bool:
        """Whether every output of a batched call has the batch's ``total`` rows (but what a later
        step outputs for a state set once, which is not kept); says why not in ``unbatched``."""
        if any((first or at not in self._placeholders) and (np.ndim(r) == 0 or len(r) != total) for at, r in enumerate(results)):
            self.unbatched = f"an output's dim 0 is not the batch's {total} rows, so it cannot be split back"
            return False
        return True

    def _replay(self, request: Request) -> tuple[Failure, ...]:
        """Each member of the batch alone (nothing was committed); members that fail leave the
        batch with their error, the others go on as a smaller batch in the same layout. The
        members that failed."""
        batch = request.batch
        assert batch is not None
        values = request.values
        pads = self.plan.pads
        gone: dict[int, Failure] = {}
        done: list[tuple[int, list[Any]]] = []
        for j, (stream, step, dims) in enumerate(zip(batch.streams, batch.steps, batch.dims, strict=True)):
            lo, hi, shift = batch.rows[j], batch.rows[j + 1], batch.shifts[j]
            feeds = self._inputs(request, {name: member_rows(values[key], lo, hi, pads.get(key), shift) for name, key in self._sources(step > 0)}, step)
            try:
                if self._holds:
                    feeds.update(self._own(self._held(stream, step, dims, feeds), stream))
                results = self._run_stepping(feeds, step)
            except Exception as e:  # onnxruntime raises its own types; the member fails, the batch goes on
                gone[j] = Failure.of(batch.ids[j], self.name, e, member=True)
                continue
            if self._holds:
                self._commit(request, stream, step, self._made_state(feeds, results, step == 0))
            done.append((j, results))
        self._rejoin(values, batch, done)
        request.batch = batch.without({j: failure.error() for j, failure in gone.items()})
        return tuple(gone.values())

    def _rejoin(self, values: dict[Endpoint, Any], batch: StepBatch, done: Sequence[tuple[int, list[Any]]]) -> None:
        """The bag after members ran alone: the outputs of those that ran (``done``: member,
        results) joined again in the batch's layout, without the rows of those that failed."""
        pads = self.plan.pads
        for key in self._dropped:
            values.pop(key, None)
        keep = [j for j, _ in done]
        if len(keep) < len(batch):
            for key in [k for k in values if k not in self._made]:
                values[key] = take_rows(values[key], batch.rows, keep)
        shifts = [batch.shifts[j] for j in keep]
        for at, key in self._kept:
            if not done:
                values.pop(key, None)
                continue
            parts = [results[at] for _, results in done]
            pad = pads.get(key)
            values[key] = pad_stack(parts, pad[0], pad[1], shifts) if pad is not None and any(shifts) else np.concatenate(parts)

    # -- stateless requests taken together ----------------------------------------------------

    def run_many(self, requests: Sequence[Request]) -> list[Call]:
        """Run a group of requests taken from the stage's queue, in as few session calls as the
        stage's batching allows (stateless requests: see Note: batched calls); each request's
        outputs go to its bag exactly as :meth:`__call__` puts them.

        Requests that failed earlier are passed over. Never raises: each member's failure is in its :class:`Call`.
        """
        if self.max_batch <= 1:
            return run_alone(self, requests)
        calls: list[Call] = []
        pending = [r for r in requests if r.error is None]
        while pending:
            batch, rest = self._take_batch(pending)
            pending = rest
            if len(batch) == 1:
                calls.extend(run_alone(self, batch))
            else:
                calls.extend(self._run_batch(batch))
        return calls

    def _take_batch(self, pending: list[Request]) -> tuple[list[Request], list[Request]]:
        """The next batch: the first pending request and, after it in order, those with its key,
        up to ``max_batch``; the rest stay pending."""
        key = self._key(pending[0])
        batch, rest = [pending[0]], []
        for request in pending[1:]:
            if len(batch) < self.max_batch and self._key(request) == key:
                batch.append(request)
            else:
                rest.append(request)
        return batch, rest

    def _key(self, request: Request) -> tuple[Any, ...]:
        """Requests batch together only with the same key: the same parameters, and the same
        shapes but the batch axis. Dtypes need no place in it: a pipeline input's is checked at
        submission, and a stage's is its module's."""
        own = request.params.get(self.name)
        values = request.values
        return (id(own) if own else None, *(np.shape(values[key])[1:] for _, key in self.plan.sources))

    def _run_batch(self, batch: list[Request]) -> list[Call]:
        """One session call for the batch, stacked along dim 0; should it fail, or its outputs not
        split back, each member runs again alone so only a bad one fails."""
        clock = time.perf_counter
        start = clock()
        feeds = [self._feeds(r) for r in batch]
        stacked = self._stacked
        rows = [0]
        for feed in feeds:
            sizes = {len(feed[name]) if np.ndim(feed[name]) else -1 for name in stacked}
            if len(sizes) != 1 or -1 in sizes:
                self.unbatched = "an input is a scalar, or the inputs of one request disagree on its batch size"
                return run_alone(self, batch)
            rows.append(rows[-1] + sizes.pop())
        joined = {name: np.concatenate([f[name] for f in feeds]) if name in stacked else value for name, value in feeds[0].items()}
        try:
            results = self._run(joined)
        except Exception as e:  # which member was bad is found by running each alone
            self.unbatched = f"the batched call failed: {ort_message(e)}"
            return run_alone(self, batch)
        total = rows[-1]
        if any(np.ndim(r) == 0 or len(r) != total for r in results):
            self.unbatched = f"an output's dim 0 is not the batch's {total} rows, so it cannot be split back"
            return run_alone(self, batch)
        kept = [(key, results[at]) for at, key in self._kept]
        for j, request in enumerate(batch):
            lo, hi = rows[j], rows[j + 1]
            values = request.values
            for key, result in kept:
                values[key] = result[lo:hi]
            for key in self._dropped:
                values.pop(key, None)
        return [Call(tuple(r.id for r in batch), start, clock(), len(batch))]

    def streams(self) -> list[int]:
        """The streams whose state this runner holds, in order (safe while it runs: a copy is taken in one step)."""
        return sorted(self.states.copy())

    def state_bytes(self) -> int:
        """Bytes of the state arrays this runner holds, over all its streams (a block counted once)."""
        seen: set[int] = set()
        total = 0
        for _, held in self.states.copy().values():  # copy(): one step, while a run may add or drop a stream
            arrays = held.block.arrays if isinstance(held, InBlock) else held.slab.buffers if isinstance(held, InSlab) else held
            if id(arrays) not in seen:
                seen.add(id(arrays))
                total += sum(a.nbytes for a in arrays.values())
        return total

    def cancel(self) -> None:
        """Make a run in progress return early (onnxruntime's ``RunOptions.terminate``)."""
        self.run_options.terminate = True


class CodeRunner(RunnerBase):
    """Runs one code stage of a request: calls its function, checks what it returns.

    Same face as :class:`StageRunner` (:class:`Runner`); ``session`` is ``None``, and it neither
    batches nor keeps state. Made by :func:`make_runner` for a code stage, so every engine runs code stages.

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
    max_batch = 1
    reused = 0

    def __init__(self, plan: StagePlan, function: CodeFunction) -> None:
        assert plan.stage.code is not None
        self.plan = plan
        self._first_only = plan.stage.first_step_only
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

    def _compute(self, request: Request) -> tuple[Failure, ...]:
        """Read the inputs from the request's bag, call the function, put the outputs back, drop dead values."""
        if request.step == CLOSE:  # a code stage keeps no state of a stream
            return ()
        values = request.values
        outputs = self.compute({name: values[key] for name, key in self.plan.sources})
        for name, key in self._keys:
            values[key] = outputs[name]
        for key in self.plan.drop:
            values.pop(key, None)
        return ()

    def cancel(self) -> None:
        """Nothing to do: a Python call cannot be interrupted; the engine stops after it returns."""

    def run_many(self, requests: Sequence[Request]) -> list[Call]:
        """Each request alone, in order: code stages do not batch."""
        return run_alone(self, requests)

    def streams(self) -> list[int]:
        """None: a code stage keeps no stream's state."""
        return []

    def state_bytes(self) -> int:
        """0: a code stage keeps no state."""
        return 0


def pinned_replica(plan: StagePlan, request: Request, replicas: int) -> int | None:
    """The replica of a stage that must run ``request``, or None when any replica may.

    A stream's request in a stage with state (or kept inputs) goes to replica ``stream % replicas``, whose runner
    holds the stream's state (streams are numbered in order, so they spread evenly). Every engine
    routes by this (see Note: streams, ``_thread.py``).
    """
    route = request.route
    if route is None or not plan.keeps_state:
        return None
    return route % replicas


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
            custom-op package cannot be found on this host (or is not what its module defines).
        ConfigError: the stage's affinity names a core this process may not use (every core
            listed, not only the replica's).
    """
    stage = plan.stage
    check_allowed([stage], bundle.allow_code)
    try:  # every core the stage names, though a replica with one thread uses only the first of its slice
        check_cores(stage.settings.affinity or ())
    except ConfigError as e:
        raise ConfigError(f"stage '{stage.name}': {e}") from None
    if stage.is_code:
        return CodeRunner(plan, resolve_entry(stage))
    runner = StageRunner(plan, _stage_session(bundle, stage, replica, target))
    runner.handoff = handoff_for(bundle.spec, stage, plan.outputs, runner.session, runner.run_options, plan.batches, target)
    return runner


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
    onnx_stages = [s for s in bundle.spec.stages if not s.is_code]
    check_allowed(onnx_stages, bundle.allow_code)
    where: dict[str, Placement | None] = {s.name: None for s in bundle.spec.stages}
    for stage in onnx_stages:
        where[stage.name] = placement(_stage_session(bundle, stage, 0, target))
    return where
