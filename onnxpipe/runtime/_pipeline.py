"""load() and Pipeline: a bundle on the deployment host, its stages working concurrently.

Each stage (each replica) runs on its own worker; a request moves from stage to stage through
bounded queues, so stage 0 works on request n+1 while stage 1 works on request n. The API is TVM's
pipeline executor's (``set_input`` / ``set_params`` / ``run`` / ``get_output``) plus what Python
users expect (``submit`` -> Future, ``map``, calling the pipeline, a context manager).

Note: ordering and failures.
    Every request gets a future when it is submitted. Results are delivered through the futures,
    so ``get_output`` and ``map`` return them in submission order even when replicas finish out of
    order. A stage that raises fails only that request: its future raises :class:`StageError`
    naming the stage and the request, later stages let it pass untouched, and other requests go on.

Note: withdrawn requests.
    A stateless request's future stays pending while the request waits in front of the first
    stage, and turns running only when that stage takes it: until then ``future.cancel()``
    withdraws it, and no stage runs it (it still passes through the queues, marked failed, so the
    engines' bookkeeping stays one path; it counts neither as completed nor as failed). The stage
    asks through ``Request.claim`` (``_stage.claimed``), once, so an engine knows nothing of
    futures (Note: the engine boundary, ``_engine``). Once running, ``cancel()`` returns False and
    the request finishes; whoever cancelled it simply does not read it. A stream's steps are
    never withdrawn (a step left out would leave the stream's state a step behind what its client
    sent): their futures are running from the start.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import BusyError, ConfigError, InputError, StageError, StreamError, closest
from onnxpipe.runtime._bundle import Bundle, Limits, read_bundle
from onnxpipe.runtime._channel import Closed, Full
from onnxpipe.runtime._code import check_allowed
from onnxpipe.runtime._diagnostics import Diagnostics
from onnxpipe.runtime._engine import DEFAULT_QUEUE_DEPTH, ENGINES, Engine, engine_class
from onnxpipe.runtime._inputs import InputCheck, check_inputs
from onnxpipe.runtime._ortapi import ArgumentTypeError, InferenceSessionAPI, SessionFacts
from onnxpipe.runtime._overrides import Overrides
from onnxpipe.runtime._ray import RayOptions  # ray itself is imported only when a RayEngine starts
from onnxpipe.runtime._spec import Endpoint, PipelineSpec
from onnxpipe.runtime._stage import CLOSE, Request, Runner, StagePlan, plan_stages
from onnxpipe.runtime._stats import PipelineStats, RequestRecorder, summarize, write_trace
from onnxpipe.runtime._stream import IdleStreams, Stream, state_dims
from onnxpipe.runtime.scheduling import Step, StepBatch, StepScheduler, member_outputs, stack_steps, step_key

__all__ = ["ENGINES", "Pipeline", "ReferenceCheck", "load"]

Outputs = dict[str, np.ndarray]
_TVM: Any = object()  # run() called without arguments: the TVM protocol
#: Streams that may be open at once, by default: each holds its state in every stage with state.
DEFAULT_MAX_STREAMS = 64


@dataclass(frozen=True)
class ReferenceCheck:
    """One output of one reference sample, compared (see :meth:`Pipeline.check`)."""

    sample: int
    output: str
    max_abs: float
    ok: bool


class Pipeline(InferenceSessionAPI):
    """A loaded bundle, its stages running concurrently.

    It is also a drop-in for an ``onnxruntime.InferenceSession`` (``get_inputs``, ``get_outputs``,
    ``get_modelmeta``, ``get_providers``, ``run(output_names, input_feed)``; see
    :class:`~onnxpipe.runtime._ortapi.InferenceSessionAPI`).

    Args:
        bundle: A checked bundle (see :func:`read_bundle`).
        target: Run every stage on this target instead of its own (e.g. ``"cpu"``).
        queue_depth: Requests that may wait in front of each stage; a full queue blocks the
            stage before it, and a full first queue blocks :meth:`submit` (backpressure).
        trace: Record every stage run, for :meth:`save_trace`.
        engine: Where the stage workers live: ``"thread"`` (threads of this process) or ``"ray"``
            (Ray actors on a Ray cluster, see ``docs/distributed.md``).
        address: The Ray cluster (``"auto"`` or ``"HOST:PORT"``; engine ``"ray"`` only).
        ray_options: Placement, shipping and supervision on Ray (engine ``"ray"`` only).
        source: The bundle's path, for ``RayOptions(shared=True)``.
        max_streams: Streams that may be open at once (see :meth:`stream`).
        stream_timeout: Close a stream idle for longer than this many seconds (``None``: never);
            its next step then raises :class:`StreamError` saying so.
        micro_batches: For streams whose stages batch: how many groups the streams are spread
            over, each stepping as one batch (``None``: one per stage, so every stage has a batch
            to work on). See ``onnxpipe.runtime.scheduling``.

    Raises:
        BundleError: the bundle names Python (code stages, custom-op libraries) that
            ``bundle.allow_code`` does not allow (nothing is imported then), or that is not on
            this host.
        ConfigError: ``max_streams``, ``stream_timeout`` or ``micro_batches`` is not positive.
    """

    def __init__(
        self,
        bundle: Bundle,
        target: str | None = None,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        trace: bool = False,
        engine: str = "thread",
        address: str | None = None,
        ray_options: RayOptions | None = None,
        source: str | os.PathLike[str] | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
        stream_timeout: float | None = None,
        micro_batches: int | None = None,
    ) -> None:
        if micro_batches is not None and micro_batches < 1:
            raise ConfigError(f"micro_batches must be at least 1, got {micro_batches}")
        if max_streams < 1:
            raise ConfigError(f"max_streams must be at least 1, got {max_streams}")
        if stream_timeout is not None and not stream_timeout > 0:
            raise ConfigError(f"stream_timeout must be a positive number of seconds or None, got {stream_timeout}")
        check_allowed(bundle.spec, bundle.allow_code)  # every refusal in one message, before any import
        self.bundle = bundle
        self.max_streams = max_streams
        self.stream_timeout = stream_timeout
        self._streams: dict[int, Stream] = {}
        self._closing_streams: dict[int, Stream] = {}
        self._idle = IdleStreams()  # the open streams with no step in flight, longest idle first
        self._state_held = 0  # bytes of the open streams' state (Note: a stream's state bytes, _stream.py)
        self._held_lock = threading.Lock()  # taken last (inside a stream's lock), never while taking another
        self._next_stream = 0
        self._state_dims = state_dims(bundle.spec)
        self._checker = InputCheck(bundle.spec.inputs)
        #: Where each state dim is bound: (dim, input, axis), for streams' steps (Stream._check_dims).
        self._state_binds = tuple((d, t.name, axis) for t in bundle.spec.inputs for axis, d in enumerate(t.shape or ())
                                  if isinstance(d, str) and d in self._state_dims)
        self._target = target
        plans, self._finals = plan_stages(bundle.spec)
        self._state_stages = [p.stage.name for p in plans if p.states]  # in pipeline order
        self._order = {p.stage.name: i for i, p in enumerate(plans)}
        self._lock = threading.Lock()
        self._next_id = 0
        self._in_flight = 0
        self._futures: dict[int, Future[Outputs]] = {}
        self._params: dict[str, dict[str, np.ndarray]] = {}  # replaced, never mutated: see set_params
        self._staged: dict[str, Any] = {}
        self._run_queue: collections.deque[Future[Outputs]] = collections.deque()
        self._requests = RequestRecorder()
        self._origin = time.perf_counter()
        self._closed = False
        pads = plans[0].pads if plans else {}  # scheduling.bag_pads, worked out once by plan_stages
        self._entry_pads = {key.tensor: pad for key, pad in pads.items() if key.stage is None}
        self._exit_pads = {name: pads[key] for name, key in self._finals.items() if key in pads}
        self.micro_batches = micro_batches or len(plans)
        self._scheduler = self._step_scheduler(plans)
        self._node_counts: dict[str, dict[str, int]] | None = None
        self._engine: Engine = engine_class(engine).start(bundle, plans, target=target, queue_depth=queue_depth, trace=trace, address=address,
                                                          ray_options=ray_options, source=source)
        self._session_facts: list[SessionFacts] = self._engine.session_facts()
        self.engine = engine
        # A pipeline dropped without close() must not leave its workers running.
        self._finalizer = weakref.finalize(self, self._engine.close)
        #: Requests the engine holds in flight (its queues and workers) before submit waits: what map() keeps in flight.
        self.capacity = self._engine.capacity

    def _step_scheduler(self, plans: Sequence[StagePlan]) -> StepScheduler | None:
        """The entry's scheduler of streams' steps, for a pipeline whose every stage batches them
        (each has the build's ``Batching`` record and ``max_batch`` above 1); ``None`` otherwise:
        each step then travels alone."""
        stages = [p.stage for p in plans]
        if not self.spec.states or any(s.batching is None or s.settings.max_batch < 2 for s in stages):
            return None
        limit = min(s.settings.max_batch for s in stages)
        delay = max(s.settings.max_delay_ms for s in stages) / 1e3
        pinned = [p.stage.settings.replicas for p in plans if p.states and p.stage.settings.replicas > 1]
        return StepScheduler(self._send_steps, limit, self.micro_batches, delay, lambda stream: tuple(stream % n for n in pinned))

    # -- what the pipeline looks like ------------------------------------------------------------

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline's wiring and settings."""
        return self.bundle.spec

    @property
    def target(self) -> str | None:
        """The target every stage runs on instead of its own, if one was given at load."""
        return self._target

    @property
    def num_inputs(self) -> int:
        """How many global inputs a request has."""
        return len(self.spec.inputs)

    @property
    def num_outputs(self) -> int:
        """How many global outputs a request gives."""
        return len(self.spec.outputs)

    @property
    def num_executing_pipeline(self) -> int:
        """Requests submitted and not finished yet."""
        return self._in_flight

    def get_input_pipeline_map(self, name: str) -> list[tuple[str, str]]:
        """The (stage, input) pairs a global input feeds.

        Raises:
            InputError: no such input.
        """
        if name not in {t.name for t in self.spec.inputs}:
            raise InputError(f"unknown input '{name}'; {closest(name, (t.name for t in self.spec.inputs))}")
        return [(lk.dst.stage, lk.dst.tensor) for lk in self.spec.links if lk.src == Endpoint(None, name) and lk.dst.stage is not None]

    def get_params_group_pipeline_map(self, group: str) -> str:
        """The stage a parameter group belongs to.

        Raises:
            InputError: no such group.
        """
        return self._group(group).stage

    # -- TVM-style protocol -----------------------------------------------------------------------

    def set_input(self, name: str, value: Any) -> None:
        """Stage one input of the next :meth:`run`.

        Raises:
            InputError: no such input, or a value of the wrong dtype or shape.
        """
        spec = next((t for t in self.spec.inputs if t.name == name), None)
        if spec is None:
            raise InputError(f"unknown input '{name}'; {closest(name, (t.name for t in self.spec.inputs))}")
        self._staged[name] = check_inputs([spec], {name: value})[name]

    @overload
    def run(self) -> int: ...

    @overload
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: ort.RunOptions | None = None) -> list[np.ndarray]: ...

    def run(self, output_names: Any = _TVM, input_feed: Any = _TVM, run_options: ort.RunOptions | None = None) -> int | list[np.ndarray]:
        """Without arguments (TVM): submit the inputs given with :meth:`set_input` as one request;
        its outputs come from :meth:`get_output`, in order. Returns at once unless the pipeline is
        full (backpressure).

        With arguments (onnxruntime's ``InferenceSession.run``): run one request and wait; return
        the outputs named in ``output_names`` (all, in declared order, for ``None`` or ``[]``) as a
        list in that order. Thread-safe. ``run_options.terminate`` stops the wait.

        Returns:
            The request's number (TVM), or the outputs (onnxruntime).

        Raises:
            InputError: an input was not set (TVM); an input is missing, unknown or of the wrong
                dtype or shape, or an output name is unknown (onnxruntime: these also subclass the
                type onnxruntime raises, see :mod:`onnxpipe.runtime._ortapi`).
            StageError: a stage failed on the request (onnxruntime).
        """
        if input_feed is not _TVM:
            return self._ort_run(None if output_names is _TVM else output_names, input_feed, run_options)
        if output_names is not _TVM or run_options is not None:
            raise ArgumentTypeError("run() takes no argument (TVM: run what set_input staged) or output_names and input_feed (onnxruntime)")
        staged, self._staged = self._staged, {}
        rid, future = self._submit(staged)
        self._run_queue.append(future)
        return rid

    def get_output(self, block: bool = True, timeout: float | None = None) -> Outputs | None:
        """The outputs of the oldest request submitted with :meth:`run` and not collected yet.

        Args:
            block: Wait for it; when false, return ``None`` if it is not finished.
            timeout: Wait at most this many seconds, then return ``None``.

        Returns:
            Its outputs by name, or ``None`` when nothing is ready (or nothing was run).

        Raises:
            StageError: that request failed; it is consumed, the next call moves on.
        """
        if not self._run_queue:
            return None
        future = self._run_queue[0]
        if not block and not future.done():
            return None
        try:
            result = future.result(timeout=timeout if block else 0)
        except TimeoutError:
            return None
        except BaseException:
            self._run_queue.popleft()
            raise
        self._run_queue.popleft()
        return result

    def set_params(self, group: str, values: Mapping[str, Any]) -> None:
        """Use new values for some of a parameter group's weights in every request submitted after
        this call; requests already submitted finish with the values they started with.

        Raises:
            InputError: unknown group or parameter, or a value of the wrong dtype or shape.
        """
        spec = self._group(group)
        names = {t.name for t in spec.params}
        for name in values:
            if name not in names:
                raise InputError(f"param group '{group}' has no parameter '{name}'; {closest(name, names)}")
        checked = check_inputs([t for t in spec.params if t.name in values], values, what="parameter")
        with self._lock:
            stage = {**self._params.get(spec.stage, {}), **checked}
            self._params = {**self._params, spec.stage: stage}

    def _group(self, group: str) -> Any:
        spec = next((g for g in self.spec.param_groups if g.name == group), None)
        if spec is None:
            raise InputError(f"unknown param group '{group}'; {closest(group, (g.name for g in self.spec.param_groups))}")
        return spec

    # -- Pythonic API -----------------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, Any], block: bool = True) -> Future[Outputs]:
        """Submit one request; returns a future of its outputs by name.

        Blocks only while the first stage's queue is full; with ``block=False`` it never waits
        (for an event loop, say) and raises :class:`BusyError` instead. Until the first stage
        takes the request, ``future.cancel()`` withdraws it: no stage runs it (see Note:
        withdrawn requests).

        Raises:
            InputError: an input is unknown, missing, or of the wrong dtype or shape (the pipeline
                stays usable).
            BusyError: ``block`` is false and the first stage's queue is full; nothing was submitted.
            StageError: the pipeline is closed.
        """
        return self._submit(inputs, block)[1]

    def _submit(self, inputs: Mapping[str, Any], block: bool = True) -> tuple[int, Future[Outputs]]:
        if self.spec.states:
            raise StreamError(
                f"this pipeline keeps state between steps ({len(self.spec.states)} state link(s), e.g. {self.spec.states[0]}): "
                "run it through a stream, `with pipe.stream() as s: s.step(inputs)`"
            )
        return self._enqueue(self._check(inputs), block=block)

    def _check(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return self._checker(inputs)

    def _enqueue(self, arrays: Mapping[str, np.ndarray], stream: Stream | None = None, step: int = 0, block: bool = True,
                 future: Future[Outputs] | None = None, params: Any = None, submitted: float | None = None) -> tuple[int, Future[Outputs]]:
        """Hand one request (a stateless one, a stream's step, or a stream's close) to the engine."""
        future = future or Future()
        with self._lock:
            if self._closed:
                if stream is not None and step != CLOSE:
                    stream._finished(step, None, ())
                raise StageError("the pipeline is closed")
            request = Request(self._next_id, {Endpoint(None, n): a for n, a in arrays.items()}, self._params if params is None else params,
                              submitted or time.perf_counter(), done=self._finish)
            if stream is not None:
                request.stream, request.step, request.dims = stream.id, step, stream.dims
            self._next_id += 1
            self._in_flight += 1
            self._futures[request.id] = future
        if stream is None:  # withdrawable until its first stage takes it (see Note: withdrawn requests)
            request.claim = future.set_running_or_notify_cancel
        else:
            future.set_running_or_notify_cancel()
        if step != CLOSE:
            self._requests.submitted(request.submitted)
        try:
            self._engine.submit(request, block)
        except Closed:
            self._fail(request, StageError(f"the pipeline was closed before request {request.id} started", request=request.id))
        except Full:
            with self._lock:
                self._futures.pop(request.id, None)
                self._in_flight -= 1
            raise BusyError(f"the pipeline is full ({self._in_flight} request(s) in flight): submit with block=True to wait for room") from None
        return request.id, future

    def _submit_step(self, arrays: Mapping[str, np.ndarray], stream: Stream, step: int) -> Future[Outputs]:
        if self._scheduler is None:
            return self._enqueue(arrays, stream, step)[1]
        with self._lock:
            if self._closed:
                stream._finished(step, None, ())
                raise StageError("the pipeline is closed")
        waiting = self._step(stream, step, arrays)
        self._scheduler.offer(waiting)
        return waiting.future

    def _step(self, stream: Stream, number: int, arrays: Mapping[str, np.ndarray]) -> Step:
        """A stream's checked step, for the scheduler (with the parameters as they are now)."""
        params = self._params
        return Step(stream.id, number, dict(arrays), stream.dims, params, step_key(arrays, self._entry_pads, params), Future())

    def submit_steps(self, steps: Mapping[Stream, Mapping[str, Any]]) -> dict[Stream, Future[Outputs]]:
        """Submit the next step of many streams at once; a future of each stream's outputs.

        What one thread stepping many streams (a generation loop, a server's batch) calls instead
        of ``Stream.submit`` per stream: every step is checked first, and nothing is submitted
        when one is refused; the steps then leave for the pipeline at once, as few batches as the
        streams' groups allow (``onnxpipe.runtime.scheduling``), without waiting for any other
        step. Each stream's step runs after its earlier ones, as with ``Stream.submit``.

        Raises:
            StreamError: a stream is closed, belongs to another pipeline, or its state is no longer valid.
            InputError: a step's inputs do not fit (as ``Stream.submit``); the message names the stream.
            StageError: the pipeline is closed.
        """
        streams = sorted(steps, key=lambda s: s.id)
        for stream in streams:
            if stream._pipeline is not self:
                raise StreamError(f"stream {stream.id} belongs to another pipeline")
        self._expire_idle()
        held = []
        try:
            for stream in streams:
                stream._order.acquire()
                held.append(stream._order)
            checked = []
            for stream in streams:
                try:
                    checked.append(stream._accept(steps[stream]))
                except InputError as e:
                    raise InputError(f"stream {stream.id}: {e}") from None
            numbered = [(stream, arrays, stream._advance()) for stream, arrays in zip(streams, checked, strict=True)]
            if self._scheduler is None:
                return {stream: self._enqueue(arrays, stream, step)[1] for stream, arrays, step in numbered}
            pending = [self._step(stream, step, arrays) for stream, arrays, step in numbered]
            with self._lock:
                if self._closed:
                    for stream, _, step in numbered:
                        stream._finished(step, None, ())
                    raise StageError("the pipeline is closed")
            self._scheduler.offer_many(pending, flush=True)
            return {stream: waiting.future for (stream, _, _), waiting in zip(numbered, pending, strict=True)}
        finally:
            for lock in held:
                lock.release()

    def _send_steps(self, steps: list[Step]) -> None:
        """The scheduler's batch, stacked once and submitted as one request (see ``scheduling``);
        one step alone travels as a plain step. Never raises: a step that cannot go fails its future."""
        if len(steps) == 1 or (stacked := stack_steps([s.arrays for s in steps], self._entry_pads)) is None:
            for s in steps:
                with self._lock:
                    stream = self._streams.get(s.stream) or self._closing_streams.get(s.stream)
                if stream is None:  # the pipeline closed, and its streams with it
                    self._fail_step(s, StageError("the pipeline is closed"))
                    continue
                try:
                    self._enqueue(s.arrays, stream, s.number, future=s.future, params=s.params, submitted=s.submitted)
                except StageError as e:  # the pipeline closed meanwhile (_enqueue told the stream)
                    self._scheduler.done(s.stream)  # type: ignore[union-attr]
                    s.future.set_exception(e)
            return
        values, rows, shifts = stacked
        n = len(steps)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                first = self._next_id
                self._next_id += n
                self._in_flight += n
                for k, s in enumerate(steps):
                    self._futures[first + k] = s.future
        if closed:
            for s in steps:
                self._fail_step(s, StageError("the pipeline is closed"))
            return
        submitted = tuple(s.submitted for s in steps)
        batch = StepBatch(tuple(range(first, first + n)), tuple(s.stream for s in steps), tuple(s.number for s in steps),
                          tuple(s.dims for s in steps), submitted, rows, shifts, waited=time.perf_counter() - min(submitted))
        request = Request(first, {Endpoint(None, k): v for k, v in values.items()}, steps[0].params, min(batch.submitted), done=self._finish, batch=batch)
        for s in steps:
            s.future.set_running_or_notify_cancel()
        self._requests.submitted(request.submitted)
        try:
            self._engine.submit(request, True)
        except Closed:
            self._fail(request, StageError(f"the pipeline was closed before request {request.id} started", request=request.id))

    def _fail_step(self, step: Step, error: BaseException) -> None:
        """A step the scheduler held that will never run (the pipeline closed)."""
        with self._lock:
            stream = self._streams.get(step.stream) or self._closing_streams.get(step.stream)
        if stream is not None:
            stream._finished(step.number, None, ())
        if self._scheduler is not None:
            self._scheduler.done(step.stream)
        with contextlib.suppress(InvalidStateError):
            step.future.set_exception(error)

    def _finish(self, request: Request) -> None:
        if request.batch is not None:
            self._finish_steps(request)
            return
        error = request.error
        if request.step == CLOSE:
            outputs: Outputs = {}
        else:
            if error is None:
                outputs = {name: request.values[key] for name, key in self._finals.items()}
            if not isinstance(error, CancelledError):  # a withdrawn request neither completed nor failed
                self._requests.finished(request.submitted, time.perf_counter(), error is None)
            if request.stream is not None:
                error = self._stream_finished(request.stream, request.step, request.error, _held_of(request).get(request.stream))
                if self._scheduler is not None:
                    self._scheduler.done(request.stream)
        with self._lock:
            future = self._futures.pop(request.id, None)
            self._in_flight -= 1
        if future is not None:
            _settle(future, outputs if error is None else None, error)

    def _finish_steps(self, request: Request) -> None:
        """A batch of steps left the pipeline: split it, once, into each member's outputs (or error)."""
        batch = request.batch
        assert batch is not None
        now = time.perf_counter()
        ended: list[tuple[int, int, int, float, Outputs | None, BaseException | None]] = []
        if request.error is None:
            outputs = {name: request.values[key] for name, key in self._finals.items()} if len(batch) else {}
            for j, (rid, stream, step, submitted) in enumerate(zip(batch.ids, batch.streams, batch.steps, batch.submitted, strict=True)):
                ended.append((rid, stream, step, submitted, member_outputs(outputs, batch, j, self._exit_pads), None))
        else:
            ended.extend((rid, stream, step, sub, None, request.error)
                         for rid, stream, step, sub in zip(batch.ids, batch.streams, batch.steps, batch.submitted, strict=True))
        ended.extend((f.id, f.stream, f.step, f.submitted, None, f.error) for f in batch.failed)
        self._requests.finished_many([(submitted, error is None) for _, _, _, submitted, _, error in ended], now)
        with self._lock:
            streams = [self._streams.get(stream) or self._closing_streams.get(stream) for _, stream, _, _, _, _ in ended]
        reported = _held_of(request)
        results = [(rid, outs, self._stream_ended(held, stream, step, error, reported.get(stream)))
                   for held, (rid, stream, step, _, outs, error) in zip(streams, ended, strict=True)]
        if self._scheduler is not None:
            self._scheduler.done_many([stream for _, stream, _, _, _, _ in ended])
        with self._lock:
            futures = [self._futures.pop(rid, None) for rid, _, _ in results]
            self._in_flight -= len(results)
        for future, (_, outs, error) in zip(futures, results, strict=True):
            if future is not None:
                _settle(future, outs, error)

    def _stream_finished(self, stream_id: int, step: int, error: BaseException | None, held: Mapping[str, int] | None = None) -> BaseException | None:
        """Tell the step's stream how it ended, and what its stages now hold of its state; the
        error its future raises (see Notes: a failed step, a stream's state bytes, _stream.py)."""
        with self._lock:
            stream = self._streams.get(stream_id) or self._closing_streams.get(stream_id)
        return self._stream_ended(stream, stream_id, step, error, held)

    def _stream_ended(self, stream: Stream | None, stream_id: int, step: int, error: BaseException | None,
                      held: Mapping[str, int] | None = None) -> BaseException | None:
        if stream is None:
            return error
        failed_at = getattr(error, "stage", None)
        last = self._order.get(failed_at, -1) if failed_at else -1
        advanced = [s for s in self._state_stages if self._order[s] < last]
        raised = stream._finished(step, error, advanced, held)
        if self._scheduler is not None and isinstance(raised, StreamError) and raised.state_valid is False:
            self._scheduler.retire(stream_id)  # its group no longer waits for it
        return raised

    def _fail(self, request: Request, error: BaseException) -> None:
        request.error = request.error or error
        self._finish(request)

    def map(self, inputs: Iterable[Mapping[str, Any]], max_in_flight: int | None = None) -> Iterator[Outputs]:
        """Stream requests through the pipeline; yield their outputs in order.

        At most ``max_in_flight`` requests (default: what the queues and workers hold) are in
        the pipeline at once, so an endless iterable runs in bounded memory.

        Raises:
            StageError: when the failed request's turn comes; the requests after it still run.
        """
        limit = max_in_flight or self.capacity
        window: collections.deque[Future[Outputs]] = collections.deque()
        for item in inputs:
            window.append(self.submit(item))
            if len(window) >= limit:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()

    def __call__(self, inputs: Mapping[str, Any]) -> Outputs:
        """Run one request and wait for its outputs."""
        return self.submit(inputs).result()

    # -- streams ----------------------------------------------------------------------------------

    def stream(self) -> Stream:
        """Open a stream: a sequence of steps whose state (``PipelineSpec.states``) stays in the stages.

        Each stage with state keeps the stream's state in the runner of one of its replicas, which
        takes all of the stream's steps; steps of one stream run in order, steps of different
        streams overlap. Close the stream (or use it as a context manager) to free its state.

        Returns:
            The new :class:`Stream`.

        Raises:
            StreamError: ``max_streams`` streams are open already (none is ever evicted to make
                room), or the pipeline is closed.
        """
        self._expire_idle()
        with self._lock:
            if self._closed:
                raise StreamError("the pipeline is closed")
            if len(self._streams) >= self.max_streams:
                ids = ", ".join(str(i) for i in sorted(self._streams))
                raise StreamError(
                    f"max_streams={self.max_streams} streams are open already (ids {ids}); close one first, "
                    "or load the pipeline with a larger max_streams"
                )
            stream = Stream(self, self._next_stream)
            self._next_stream += 1
            self._streams[stream.id] = stream
            self._idle.add(stream)
        if self._scheduler is not None:
            self._scheduler.join(stream.id)
        return stream

    @property
    def open_streams(self) -> list[int]:
        """The ids of the streams open now."""
        with self._lock:
            return sorted(self._streams)

    @property
    def state_bytes(self) -> int:
        """Bytes of the open streams' state in the stages, each as its last finished step left it
        (the sum of their :attr:`Stream.state_bytes`, kept as they change: reading it costs
        nothing). See Note: a stream's state bytes, ``_stream.py``."""
        return self._state_held

    def _state_changed(self, delta: int) -> None:
        with self._held_lock:
            self._state_held += delta

    def _close_stream(self, stream: Stream, wait: bool = True) -> None:
        """Free a stream's state in every stage: a close request follows its steps through the
        pipeline; ``wait`` for it to leave the last stage, or let it go."""
        with self._lock:
            self._idle.discard(stream)
            if self._streams.pop(stream.id, None) is None:
                return
            self._closing_streams[stream.id] = stream  # its steps in flight still report to it

        def closed(_: object = None) -> None:
            with self._lock:
                self._closing_streams.pop(stream.id, None)

        if self._scheduler is not None:
            self._scheduler.leave(stream.id)  # its steps still waiting at the entry go first
        done = None
        if self.spec.states:
            with contextlib.suppress(StageError):  # the pipeline is closed: its runners and states are gone with it
                done = self._enqueue({}, stream, CLOSE)[1]
        if done is not None and not wait:
            done.add_done_callback(closed)
            return
        if done is not None:
            with contextlib.suppress(StageError):  # closed meanwhile: as above
                done.result()
        closed()

    def close_idle_streams(self) -> list[int]:
        """Close the streams idle for longer than ``stream_timeout`` now, instead of at the next
        :meth:`stream` or step (which do it too); a server calls this on a timer, so that idle
        state is freed without new traffic. Waits until their state is freed.

        Returns:
            The ids of the streams closed (none when ``stream_timeout`` is ``None``).
        """
        return self._expire_idle()

    def _expire_idle(self) -> list[int]:
        """Close the streams idle for longer than ``stream_timeout``, longest idle first (their next
        step says so); looks only at those and the next one (see Note: expiring idle streams, _stream.py)."""
        if self.stream_timeout is None:
            return []
        closed = []
        for stream in self._idle.expired(self.stream_timeout):
            if stream._expire(f"it was idle for more than stream_timeout={self.stream_timeout:g} s, and its state was freed"):
                self._close_stream(stream)
                closed.append(stream.id)
        return closed

    def check(self, rtol: float = 1e-4, atol: float = 1e-5) -> list[ReferenceCheck]:
        """Run the bundle's reference inputs and compare with its reference outputs.

        Values match when ``|got - want| <= atol + rtol * |want|`` everywhere (NaN equals NaN);
        integer, boolean and string outputs when they are equal.
        """
        rows = []
        samples = self.bundle.reference()
        for i, ((_, expected), got) in enumerate(zip(samples, self.map(s[0] for s in samples), strict=True)):
            for name, want in expected.items():
                value = got.get(name)
                if value is None or value.shape != want.shape or value.dtype != want.dtype:
                    rows.append(ReferenceCheck(i, name, float("inf"), False))
                    continue
                if want.dtype.kind not in "fc":  # integers, bools, strings: equal or not
                    equal = bool(np.array_equal(value, want))
                    rows.append(ReferenceCheck(i, name, 0.0 if equal else float("inf"), equal))
                    continue
                diff = float(np.nanmax(np.abs(value.astype(np.float64) - want.astype(np.float64)))) if want.size else 0.0
                rows.append(ReferenceCheck(i, name, diff, bool(np.allclose(value, want, rtol=rtol, atol=atol, equal_nan=True))))
        return rows

    def idle_runners(self) -> list[Runner]:
        """The first replica's runner of each stage, in pipeline order, for running stages alone
        with the pipeline's own sessions while it is idle (see :func:`benchmark`), so that no stage
        ever needs a second session (a second copy of its weights).

        Raises:
            StageError: requests are in flight, so a stage would not run alone, or the stages run
                on Ray actors (no session is in this process).
        """
        if not engine_class(self.engine).in_process:
            raise StageError(f"the stages run on {self.engine} actors, not in this process: running a stage alone needs engine='thread'")
        if self._in_flight:
            raise StageError(f"{self._in_flight} request(s) are in flight; stages run alone only while the pipeline is idle")
        return [runners[0] for runners in self._engine.runners()]

    # -- observability ----------------------------------------------------------------------------

    def stats(self, memory: bool = True) -> PipelineStats:
        """Throughput, latency, and per-stage utilization and queues since load or :meth:`reset_stats`.

        Args:
            memory: Also read the process's physical memory (``resident_bytes``): a walk of its
                mappings, 2 ms here and 8-20 ms in a server holding several models; a poller that
                does not show it (the server's statistics and metrics, on its event loop) skips it.
        """
        rows = [(p[0].stage, p, q[0], q[1], q[2]) for p, q in zip(self._engine.recorders(), self._engine.queues(), strict=True)]
        stats = summarize(rows, self._requests, self._in_flight)
        if self._node_counts is None:  # the sessions do not change: counted once, not on every poll
            self._node_counts = {stage: {ep: len(nodes) for ep, nodes in (where or {}).items()} for stage, where in self.placement().items()}
        settings = {s.name: s.settings for s in self.spec.stages}  # those in effect: the bundle's, with the host's overrides
        stages = tuple(
            dataclasses.replace(
                s, nodes=dict(self._node_counts.get(s.stage, {})), intra_op_threads=settings[s.stage].intra_op_threads,
                inter_op_threads=settings[s.stage].inter_op_threads, affinity=settings[s.stage].affinity, max_batch=settings[s.stage].max_batch,
            )
            for s in stats.stages
        )
        held = self._engine.resident_bytes() if memory else None  # None where the sessions live in other processes (Ray)
        return dataclasses.replace(stats, stages=stages, resident_bytes=held)

    def diagnostics(self) -> Diagnostics:
        """Where each stage replica runs and what it holds now: its process (on Ray: its node, its
        labels, its private folder, whether it is alive), the requests it ran, the streams whose
        state it keeps and their bytes, its reuse of state blocks; the engine's capacity. For
        tests, benchmarks and operators (docs/runtime.md, Diagnostics). On Ray each live actor is
        asked, beside any run in progress (a few milliseconds; an actor that does not answer
        within 10 s is reported with ``streams=None``).
        """
        return Diagnostics(self.engine, engine_class(self.engine).in_process, self._engine.capacity, tuple(self._engine.diagnostics()))

    def reset_stats(self) -> None:
        """Start a new measurement window (e.g. after warm-up)."""
        for recorders in self._engine.recorders():
            for r in recorders:
                r.reset()
        self._requests.reset()

    def save_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write a Chrome-trace / Perfetto JSON timeline, one track per stage worker.

        Raises:
            StageError: the pipeline was loaded without ``trace=True``.
        """
        recorders = [r for rs in self._engine.recorders() for r in rs]
        if any(r.events is None for r in recorders):
            raise StageError("no timeline was recorded: load the pipeline with trace=True")
        return write_trace(path, recorders, self._origin)

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers promptly, fail the requests still in flight, remove temporary files.

        Requests that did not finish raise :class:`StageError` from their futures.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        for stream in list(self._streams.values()):
            stream._expire("its pipeline was closed")
        self._streams.clear()
        self._idle.clear()
        if self._scheduler is not None:
            self._scheduler.close()
            for step in self._scheduler.waiting():
                self._fail_step(step, StageError("the pipeline was closed before this step started"))
        for request in self._engine.close():
            self._fail(request, StageError(f"the pipeline was closed before request {request.id} finished", request=request.id))
        if self._scheduler is not None:
            self._scheduler.wait_stopped()
        with self._lock:
            stranded = list(self._futures.items())
        for rid, future in stranded:
            if not future.done():
                future.set_exception(StageError(f"the pipeline was closed before request {rid} finished", request=rid))
        self.bundle.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pipeline(stages={[s.name for s in self.spec.stages]}, inputs={[t.name for t in self.spec.inputs]})"


def _held_of(request: Request) -> dict[int, dict[str, int]]:
    """What the stages with state reported holding for each of the request's streams, by stage
    (Note: a stream's state bytes, _stream.py); the last report of a stage counts."""
    held: dict[int, dict[str, int]] = {}
    for stream, stage, size in request.held:
        held.setdefault(stream, {})[stage] = size
    return held


def _settle(future: Future[Outputs], outputs: Outputs | None, error: BaseException | None) -> None:
    """A request's future, given its outputs or its error (a future its owner cancelled meanwhile stays so)."""
    try:
        if error is None:
            future.set_result(outputs)  # type: ignore[arg-type]
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


def load(
    path: str | os.PathLike[str],
    *,
    target: str | None = None,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    trace: bool = False,
    limits: Limits | None = None,
    allow_code: Sequence[str] = (),
    engine: str = "thread",
    address: str | None = None,
    ray_options: RayOptions | None = None,
    max_streams: int = DEFAULT_MAX_STREAMS,
    stream_timeout: float | None = None,
    micro_batches: int | None = None,
    overrides: Overrides | None = None,
) -> Pipeline:
    """Load a bundle (folder or ``.onnxpipe`` archive) with only numpy and onnxruntime, and start it.

    Every file is checked (see ``read_bundle``) before any session is created.

    Args:
        path: The bundle.
        target: Run every stage on this target instead of its own (e.g. ``"cpu"``).
        queue_depth: Requests that may wait in front of each stage.
        trace: Record a timeline of every stage run (see :meth:`Pipeline.save_trace`).
        limits: Size and count limits for the bundle.
        allow_code: fnmatch patterns of the Python the bundle may make this host import: code
            stages' entry points (``"mypkg.*"`` allows ``"mypkg.ocr:decode"``) and custom-op
            packages (``"onnxruntime_extensions"``). Default: none; a bundle naming any is refused,
            naming each, before anything is imported (docs/pipelines.md).
        engine: ``"thread"`` (default: every stage in this process) or ``"ray"`` (each stage
            replica a Ray actor on a Ray cluster; needs ``pip install 'onnxpipe[ray]'``).
        address: The Ray cluster's address, ``"auto"`` or ``"HOST:PORT"`` (engine ``"ray"``).
        ray_options: Placement, shipping and supervision on Ray (:class:`RayOptions`).
        max_streams: Streams that may be open at once (see :meth:`Pipeline.stream`).
        stream_timeout: Close streams idle for longer than this many seconds (``None``: never).
        micro_batches: Groups the streams of a pipeline whose stages batch them are spread over,
            each stepping as one batch (``None``: one per stage; see :class:`Pipeline`).
        overrides: Deploy-time settings of some or all stages, instead of the bundle's:
            ``intra_op_threads``, ``inter_op_threads``, ``execution_mode``, ``spinning``,
            ``affinity``, ``replicas``, ``max_batch`` (up to the bundle's), ``max_delay_ms``,
            ``host``; as :class:`StageOverrides` (applied in order) or a mapping
            ``{"*": {...}, "STAGE": {...}, "1": {...}}``. Checked as the bundle's own settings
            are; the bundle's files are not changed (``onnxpipe rebundle`` writes a new bundle).

    Raises:
        BundleError: the bundle is missing, broken or refused as unsafe, a stage's provider is
            not available here (or, on Ray, on the node its actor landed on), or it names Python
            ``allow_code`` does not allow or this host does not have.
        ConfigError: the OS refused a stage's CPU affinity; an unknown engine; on Ray: Ray is not
            installed, the cluster cannot be reached, or a stage cannot be placed; ``max_streams``,
            ``stream_timeout`` or ``micro_batches`` is not positive; an override names no stage,
            a setting that may not change at deploy time, a bad value, or a ``max_batch`` above
            what the build allows (naming the stage and its maximum).
    """
    # A hostile bundle, or code the host does not allow, is refused here, before anything ships. On
    # Ray no session starts here: each actor checks its stage's threads against its own node.
    kind = ENGINES.get(engine)  # an unknown one is refused by Pipeline, once the bundle is read
    bundle = read_bundle(path, limits, allow_code=allow_code, sessions=None if kind is None or kind.in_process else (), overrides=overrides)
    try:
        return Pipeline(bundle, target, queue_depth, trace, engine, address, ray_options, path, max_streams=max_streams, stream_timeout=stream_timeout,
                        micro_batches=micro_batches)
    except BaseException:
        bundle.close()
        raise
