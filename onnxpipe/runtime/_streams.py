"""A pipeline's streams (:class:`StreamRegistry`): opening, stepping, closing and expiring them,
and their steps' way into the engine and back out (see docs/streams.md).

The registry keeps each open stream's :class:`~onnxpipe.runtime._stream.StreamRecord` (the
caller's :class:`~onnxpipe.runtime._stream.Stream` is its face), the streams idle in the order
they became idle, and the sum of their state bytes. A step is checked against its stream's record,
numbered in the pipeline's request table (``_requests``) and handed to the engine alone, or, when
every stage batches streams' steps, offered to the step scheduler (``scheduling``), which forms
the batches this registry stacks and submits as one request each. At the exit the registry splits
a batch into its members' outputs, tells each step's record how it ended (Note: a failed step,
``_stream``) and settles its future. :class:`StreamsView` is what a pipeline shows of it
(``Pipeline.streams``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any

import numpy as np

from onnxpipe._errors import Closure, InputError, StageError, StreamError
from onnxpipe.runtime._inputs import DecoderInputs
from onnxpipe.runtime._requests import CLOSED, STEP_CLOSED, Dispatcher, Outputs, settle
from onnxpipe.runtime._spec import Endpoint, PipelineSpec
from onnxpipe.runtime._stage import CLOSE, Request, StagePlan
from onnxpipe.runtime._stream import BY_OWNER, IdleStreams, StepCheck, Stream, StreamRecord, Tally, state_dims
from onnxpipe.runtime.scheduling import Step, StepBatch, StepScheduler, batch_length, member_outputs, stack_steps, step_key

__all__ = ["StreamRegistry", "StreamsView"]

#: What a step that left a batch says: (request id, stream, step, submitted, outputs, error).
_Ended = tuple[int, int, int, float, Outputs | None, BaseException | None]


class StreamRegistry:
    """A pipeline's streams and their steps (see the module's docstring).

    Args:
        dispatch: The pipeline's requests: their table, the engine, parameters, statistics, the input check.
        spec: The pipeline's spec.
        plans: Its stage plans, in pipeline order.
        finals: Each global output and the endpoint that produces it.
        max_streams: Streams that may be open at once.
        stream_timeout: Seconds a stream may stay idle before it is closed (``None``: never).
        micro_batches: Groups the streams are spread over when their steps travel in batches.
    """

    def __init__(self, dispatch: Dispatcher, spec: PipelineSpec, plans: Sequence[StagePlan], finals: Mapping[str, Endpoint], max_streams: int,
                 stream_timeout: float | None, micro_batches: int) -> None:
        self.max_streams = max_streams
        self.stream_timeout = stream_timeout
        self._dispatch = dispatch
        self._table = dispatch.table
        self._check = StepCheck(spec, dispatch.check)  # a first step's inputs and a later step's may differ
        self._recorder = dispatch.recorder
        self._finals = finals
        self._stateful = bool(spec.states)
        self._first_steps = any(s.first_step_only for s in spec.stages)
        dims = state_dims(spec)
        #: Where each state dim is bound: (dim, input, axis), for streams' steps (StreamRecord.accept).
        self._binds = tuple((d, t.name, axis) for t in spec.inputs for axis, d in enumerate(t.shape or ()) if isinstance(d, str) and d in dims)
        self._state_stages = [p.stage.name for p in plans if p.keeps_state]  # in pipeline order
        self._order = {p.stage.name: i for i, p in enumerate(plans)}
        pads = plans[0].pads if plans else {}  # scheduling.bag_pads, worked out once by plan_stages
        self._entry_pads = {key.tensor: pad for key, pad in pads.items() if key.stage is None}
        self._exit_pads = {name: pads[key] for name, key in finals.items() if key in pads}
        mask = DecoderInputs.of(spec.inputs).mask if any(s.shared for s in spec.states) else None
        self._mask = mask.name if mask is not None else None  # a state kept in place counts its positions by it (Request.length)
        self._lock = threading.Lock()  # guards the dicts below and the numbering of streams
        self._open: dict[int, StreamRecord] = {}
        self._closing: dict[int, StreamRecord] = {}  # closed, their close request still in the pipeline: their steps in flight report to them
        self._records: weakref.WeakKeyDictionary[Stream, StreamRecord] = weakref.WeakKeyDictionary()  # each face given out, while its caller holds it
        self._idle = IdleStreams()  # the open streams with no step in flight, longest idle first
        self._held = Tally()  # bytes of the open streams' state (Note: a stream's state bytes, _stream.py)
        self._next = 0
        self._scheduler = _scheduler_for(spec, plans, micro_batches, self._send_batch)
        if self._scheduler is not None:  # batches leave when the first stage frees up (scheduling, Note: continuous batching)
            self._scheduler.told = dispatch.engine.watch_entry(self._left_entry)

    # -- what it looks like (StreamsView) --------------------------------------------------------

    @property
    def open_ids(self) -> list[int]:
        """The ids of the streams open now."""
        with self._lock:
            return sorted(self._open)

    @property
    def idle(self) -> int:
        """Open streams with no step in flight."""
        return len(self._idle)

    @property
    def looked(self) -> int:
        """Streams expiry has looked at since load (Note: expiring idle streams, ``_stream``)."""
        return self._idle.looked

    @property
    def state_bytes(self) -> int:
        """Bytes of the open streams' state (Note: a stream's state bytes, ``_stream``)."""
        return self._held.value

    @property
    def batched(self) -> bool:
        """Whether streams' steps travel in batches (every stage batches them; ``scheduling``)."""
        return self._scheduler is not None

    @property
    def delayed(self) -> int:
        """Batches of steps that left the entry because ``max_delay_ms`` passed (``scheduling``)."""
        return self._scheduler.expired if self._scheduler is not None else 0

    def group_of(self, stream: int) -> list[int]:
        """The members of the stream's group, in row order (``[]`` when steps are not batched or it is closed)."""
        return self._scheduler.group_of(stream) if self._scheduler is not None else []

    # -- opening, stepping, closing --------------------------------------------------------------

    def open(self) -> Stream:
        """Open a stream (see ``Pipeline.stream``).

        Raises:
            StreamError: ``max_streams`` streams are open, or the pipeline is closed.
        """
        self.expire_idle()
        with self._lock:
            self._table.refuse_if_closed(StreamError)  # under this lock: a close after it finds the stream (close_all)
            if len(self._open) >= self.max_streams:
                raise StreamError.too_many(self.max_streams, sorted(self._open))
            record = StreamRecord(self._next, self._idle, self._held)
            self._next += 1
            self._open[record.id] = record
            self._idle.add(record)
            stream = Stream(self, record)
            self._records[stream] = record
        if self._scheduler is not None:
            self._scheduler.join(record.id)
        return stream

    def submit(self, record: StreamRecord, inputs: Mapping[str, Any]) -> Future[Outputs]:
        """Check the stream's next step and submit it (``Stream.submit``)."""
        self.expire_idle()
        with record.order:  # keeps the stream's steps in submission order into the engine
            arrays = record.accept(inputs, self._check, self._binds)
            return self._send(record, arrays, record.advance())

    def submit_many(self, steps: Mapping[Stream, Mapping[str, Any]]) -> dict[Stream, Future[Outputs]]:
        """The next step of many streams, every one checked before any is submitted (``Pipeline.submit_steps``)."""
        streams = sorted(steps, key=lambda s: s.id)
        records = self._records_of(streams)
        self.expire_idle()
        with contextlib.ExitStack() as held:
            for record in records:
                held.enter_context(record.order)
            checked = []
            for stream, record in zip(streams, records, strict=True):
                try:
                    checked.append(record.accept(steps[stream], self._check, self._binds))
                except InputError as e:
                    raise InputError(f"stream {stream.id}: {e}") from None
            numbered = [(record, arrays, record.advance()) for record, arrays in zip(records, checked, strict=True)]
            if self._scheduler is None:
                futures = [self._enqueue(record, arrays, step) for record, arrays, step in numbered]
            else:
                pending = [self._step(record, step, arrays) for record, arrays, step in numbered]
                self._refuse_if_closed([(record, step) for record, _, step in numbered])
                self._scheduler.offer_many(pending, flush=True)
                futures = [waiting.future for waiting in pending]
            return dict(zip(streams, futures, strict=True))

    def _records_of(self, streams: Sequence[Stream]) -> list[StreamRecord]:
        """The records of streams this registry gave out.

        Raises:
            StreamError: a stream belongs to another pipeline.
        """
        with self._lock:
            records = [self._records.get(stream) for stream in streams]
        for stream, record in zip(streams, records, strict=True):
            if record is None:
                raise StreamError(f"stream {stream.id} belongs to another pipeline")
        return [record for record in records if record is not None]  # every one, after the check above

    def close(self, record: StreamRecord, wait: bool = True) -> None:
        """Close the stream (``Stream.close``): nothing if it was closed already."""
        if record.shut(BY_OWNER):
            self._close(record, wait)

    def expire_idle(self) -> list[int]:
        """Close the streams idle for longer than ``stream_timeout``, longest idle first (their next
        step says so); looks only at those and the next one (see Note: expiring idle streams, _stream.py)."""
        timeout = self.stream_timeout
        if timeout is None:
            return []
        closed = []
        for record in self._idle.expired(timeout):
            if record.shut(Closure("idle", timeout)):
                self._close(record)
                closed.append(record.id)
        return closed

    def close_all(self) -> None:
        """The pipeline is closing (its request table closed first): every stream is closed, and the
        steps still waiting for their batch fail."""
        with self._lock:
            records = list(self._open.values())
        closure = Closure("pipeline")
        for record in records:
            record.shut(closure)
        with self._lock:
            self._open.clear()
        self._idle.clear()
        if self._scheduler is not None:
            self._scheduler.close()
            for step in self._scheduler.waiting():
                self._fail_step(step, StageError(STEP_CLOSED))

    def join(self) -> None:
        """Wait for the step scheduler's releaser thread to end (after the engine closed: :meth:`close_all`)."""
        if self._scheduler is not None:
            self._scheduler.wait_stopped()

    def _close(self, record: StreamRecord, wait: bool = True) -> None:
        """Free a closed stream's state in every stage: a close request follows its steps through the
        pipeline; ``wait`` for it to leave the last stage, or let it go."""
        with self._lock:
            self._idle.discard(record)
            if self._open.pop(record.id, None) is None:
                return
            self._closing[record.id] = record  # its steps in flight still report to it

        def closed(_: object = None) -> None:
            with self._lock:
                self._closing.pop(record.id, None)

        if self._scheduler is not None:
            self._scheduler.leave(record.id)  # its steps still waiting at the entry go first
        done = None
        if self._stateful:
            with contextlib.suppress(StageError):  # the pipeline is closed: its runners and states are gone with it
                done = self._enqueue(record, {}, CLOSE)
        if done is not None and not wait:
            done.add_done_callback(closed)
            return
        if done is not None:
            with contextlib.suppress(StageError):  # closed meanwhile: as above
                done.result()
        closed()

    def _find(self, stream: int) -> StreamRecord | None:
        """The record of an open or closing stream (``None``: gone with its pipeline)."""
        with self._lock:
            return self._open.get(stream) or self._closing.get(stream)

    # -- into the engine --------------------------------------------------------------------------

    def _send(self, record: StreamRecord, arrays: Mapping[str, np.ndarray], step: int) -> Future[Outputs]:
        """A numbered step: to the engine alone, or to the scheduler to wait for its batch."""
        if self._scheduler is None:
            return self._enqueue(record, arrays, step)
        self._refuse_if_closed([(record, step)])
        waiting = self._step(record, step, arrays)
        self._scheduler.offer(waiting)
        return waiting.future

    def _refuse_if_closed(self, steps: Sequence[tuple[StreamRecord, int]]) -> None:
        """Refuse steps, numbered already, of a closed pipeline (their streams take their numbers back)."""
        if self._table.closed:
            for record, step in steps:
                record.finished(step, None, ())
            raise StageError(CLOSED)

    def _enqueue(self, record: StreamRecord, arrays: Mapping[str, np.ndarray], step: int, future: Future[Outputs] | None = None,
                 params: Any = None, submitted: float | None = None, group: tuple[int, ...] = ()) -> Future[Outputs]:
        """Hand one step (or the stream's close, ``step`` :data:`CLOSE`) to the engine, alone (``group``: ``Request.group``)."""
        future = future or Future()
        try:
            rid = self._table.add(future)
        except StageError:
            if step != CLOSE:
                record.finished(step, None, ())
            raise
        dispatch = self._dispatch
        request = Request(rid, {Endpoint(None, n): a for n, a in arrays.items()}, dispatch.params if params is None else params,
                          submitted or time.perf_counter(), done=self._done, stream=record.id, step=step, dims=record.dims,
                          length=self._length(arrays), group=group)
        future.set_running_or_notify_cancel()  # a stream's steps are never withdrawn (Note: withdrawn requests, _pipeline)
        if step != CLOSE:
            self._recorder.submitted(request.submitted)
        dispatch.send(request)
        return future

    def _length(self, arrays: Mapping[str, np.ndarray]) -> int:
        """The positions a stream's state holds after a step alone: its attention mask's length (``Request.length``); 0 without one."""
        mask = arrays.get(self._mask) if self._mask is not None else None
        return int(mask.shape[-1]) if mask is not None and mask.ndim == 2 else 0

    def _step(self, record: StreamRecord, number: int, arrays: Mapping[str, np.ndarray]) -> Step:
        """A stream's checked step, for the scheduler (with the parameters as they are now)."""
        params = self._dispatch.params
        key = step_key(arrays, self._entry_pads, params)
        if self._first_steps:
            key += (number == 0,)  # a first step runs the first-step stages, a later one passes them: never one batch
        return Step(record.id, number, dict(arrays), record.dims, params, key, Future())

    def _send_batch(self, steps: list[Step]) -> None:
        """The scheduler's batch, stacked once and submitted as one request (see ``scheduling``);
        one step alone travels as a plain step. Never raises: a step that cannot go fails its future."""
        if len(steps) == 1 or (stacked := stack_steps([s.arrays for s in steps], self._entry_pads)) is None:
            if len(steps) > 1:
                self._scheduler.entered(len(steps) - 1)  # type: ignore[union-attr]  # it counted one request: here are len(steps)
            for s in steps:
                self._send_alone(s)
            return
        values, rows, shifts = stacked
        try:
            first = self._table.add_many([s.future for s in steps])
        except StageError:
            for s in steps:
                self._fail_step(s, StageError(CLOSED))
            return
        submitted = tuple(s.submitted for s in steps)
        batch = StepBatch(tuple(range(first, first + len(steps))), tuple(s.stream for s in steps), tuple(s.number for s in steps),
                          tuple(s.dims for s in steps), submitted, rows, shifts, waited=time.perf_counter() - min(submitted),
                          length=batch_length(values, self._entry_pads), group=steps[0].group)
        request = Request(first, {Endpoint(None, k): v for k, v in values.items()}, steps[0].params, min(submitted), done=self._done, batch=batch)
        for s in steps:
            s.future.set_running_or_notify_cancel()
        self._recorder.submitted(request.submitted)
        self._dispatch.send(request)

    def _send_alone(self, step: Step) -> None:
        record = self._find(step.stream)
        if record is None:  # the pipeline closed, and its streams with it
            self._fail_step(step, StageError(CLOSED))
            return
        try:
            self._enqueue(record, step.arrays, step.number, future=step.future, params=step.params, submitted=step.submitted, group=step.group)
        except StageError as e:  # the pipeline closed meanwhile (_enqueue told the stream)
            self._scheduler.done(step.stream)  # type: ignore[union-attr]
            step.future.set_exception(e)

    def _left_entry(self, request: Request) -> None:
        """The engine's first stage finished a request (``Engine.watch_entry``): one of steps tells
        the scheduler (Note: continuous batching, ``scheduling``); a stream's close does not."""
        if request.batch is not None or (request.stream is not None and request.step != CLOSE):
            self._scheduler.left_entry()  # type: ignore[union-attr]  # watched only with a scheduler

    def _fail_step(self, step: Step, error: BaseException) -> None:
        """A step the scheduler held that will never run (the pipeline closed)."""
        record = self._find(step.stream)
        if record is not None:
            record.finished(step.number, None, ())
        if self._scheduler is not None:
            self._scheduler.done(step.stream)
        with contextlib.suppress(InvalidStateError):
            step.future.set_exception(error)

    # -- out of it ---------------------------------------------------------------------------------

    def _done(self, request: Request) -> None:
        """A step (alone), a batch of steps, or a stream's close left the pipeline."""
        if request.batch is not None:
            self._finish_batch(request)
            return
        error = request.error
        outputs: Outputs | None = {}
        if request.step != CLOSE:
            outputs = {name: request.values[key] for name, key in self._finals.items()} if error is None else None
            if not isinstance(error, CancelledError):
                self._recorder.finished(request.submitted, time.perf_counter(), error is None)
            stream = request.stream
            assert stream is not None
            error = self._ended(self._find(stream), stream, request.step, error, _held_of(request).get(stream))
            if self._scheduler is not None:
                self._scheduler.done(stream)
        future = self._table.take(request.id)
        if future is not None:
            settle(future, outputs if error is None else None, error)

    def _finish_batch(self, request: Request) -> None:
        """A batch of steps left the pipeline: split it, once, into each member's outputs (or error)."""
        batch = request.batch
        assert batch is not None
        now = time.perf_counter()
        members = zip(batch.ids, batch.streams, batch.steps, batch.submitted, strict=True)
        ended: list[_Ended] = []
        if request.error is None:
            outputs = self._dispatch.outputs(request) if len(batch) else {}
            ended.extend((rid, stream, step, sub, member_outputs(outputs, batch, j, self._exit_pads), None)
                         for j, (rid, stream, step, sub) in enumerate(members))
        else:
            ended.extend((rid, stream, step, sub, None, request.error) for rid, stream, step, sub in members)
        ended.extend((f.id, f.stream, f.step, f.submitted, None, f.error) for f in batch.failed)
        self._recorder.finished_many([(submitted, error is None) for _, _, _, submitted, _, error in ended], now)
        with self._lock:
            records = [self._open.get(stream) or self._closing.get(stream) for _, stream, _, _, _, _ in ended]
        reported = _held_of(request)
        errors = [self._ended(record, stream, step, error, reported.get(stream)) for record, (_, stream, step, _, _, error) in zip(records, ended, strict=True)]
        if self._scheduler is not None:
            self._scheduler.done_many([stream for _, stream, _, _, _, _ in ended])
        futures = self._table.take_many([rid for rid, _, _, _, _, _ in ended])
        for future, (_, _, _, _, outs, _), error in zip(futures, ended, errors, strict=True):
            if future is not None:
                settle(future, outs, error)

    def _ended(self, record: StreamRecord | None, stream: int, step: int, error: BaseException | None,
               held: Mapping[str, int] | None = None) -> BaseException | None:
        """Tell the step's stream how it ended, and what its stages now hold of its state; the
        error its future raises (see Notes: a failed step, a stream's state bytes, _stream.py)."""
        if record is None:
            return error
        failed_at = getattr(error, "stage", None)
        last = self._order.get(failed_at, -1) if failed_at else -1
        advanced = [s for s in self._state_stages if self._order[s] < last]
        raised = record.finished(step, error, advanced, held)
        if self._scheduler is not None and isinstance(raised, StreamError) and raised.state_valid is False:
            self._scheduler.retire(stream)  # its group no longer waits for it
        return raised


class StreamsView:
    """What a pipeline's streams look like now (``Pipeline.streams``), for diagnostics and tests.

    Attributes are read live: each read is the value now.
    """

    def __init__(self, registry: StreamRegistry) -> None:
        self._registry = registry

    @property
    def open(self) -> list[int]:
        """The ids of the streams open now (``Pipeline.open_streams``)."""
        return self._registry.open_ids

    @property
    def idle(self) -> int:
        """How many open streams have no step in flight (those expiry looks at, longest idle first)."""
        return self._registry.idle

    @property
    def looked(self) -> int:
        """How many streams expiry has looked at since load: one per ``stream()``, step and
        ``close_idle_streams()`` with a ``stream_timeout``, plus one per stream it closed (Note:
        expiring idle streams, ``_stream``)."""
        return self._registry.looked

    @property
    def state_bytes(self) -> int:
        """Bytes of the open streams' state in the stages (``Pipeline.state_bytes``)."""
        return self._registry.state_bytes

    @property
    def batched(self) -> bool:
        """Whether streams' steps travel the stages in batches: every stage batches them
        (``max_batch`` above 1 and the build's batching record); else each step travels alone."""
        return self._registry.batched

    @property
    def delayed(self) -> int:
        """How many batches of steps left the entry because ``max_delay_ms`` passed while a member
        was still to come (``onnxpipe.runtime.scheduling``, Note: continuous batching): a member
        slower to submit than ``max_delay_ms``, or one that went quiet without closing; with
        ``max_delay_ms`` 0, every batch that left without a member that must come."""
        return self._registry.delayed

    def group_of(self, stream: int) -> list[int]:
        """The streams whose steps share batches with ``stream``'s, in row order, itself included
        (``onnxpipe.runtime.scheduling``); ``[]`` when steps are not batched or it is closed."""
        return self._registry.group_of(stream)

    def __repr__(self) -> str:
        return f"StreamsView(open={len(self.open)}, idle={self.idle}, state_bytes={self.state_bytes}, batched={self.batched})"


def _scheduler_for(spec: PipelineSpec, plans: Sequence[StagePlan], micro_batches: int, send: Callable[[list[Step]], None]) -> StepScheduler | None:
    """The entry's scheduler of streams' steps, for a pipeline whose every stage batches them
    (each has the build's ``Batching`` record and ``max_batch`` above 1); ``None`` otherwise:
    each step then travels alone."""
    stages = [p.stage for p in plans]
    if not spec.states or any(s.batching is None or s.settings.max_batch < 2 for s in stages):
        return None
    limit = min(s.settings.max_batch for s in stages)
    delay = max(s.settings.max_delay_ms for s in stages) / 1e3
    pinned = [p.stage.settings.replicas for p in plans if p.states and p.stage.settings.replicas > 1]
    return StepScheduler(send, limit, micro_batches, delay, lambda stream: tuple(stream % n for n in pinned))


def _held_of(request: Request) -> dict[int, dict[str, int]]:
    """What the stages with state reported holding for each of the request's streams, by stage
    (Note: a stream's state bytes, _stream.py); the last report of a stage counts."""
    held: dict[int, dict[str, int]] = {}
    for stream, stage, size in request.held:
        held.setdefault(stream, {})[stage] = size
    return held
