"""Streams: sequences of steps whose state stays in the stages (see docs/streams.md).

A :class:`Stream` is what ``Pipeline.stream()`` returns. Its steps are requests like any other,
tagged with the stream's id and the step's number; the state itself lives in the stage runners
(Note: state stays in its stage, ``_stage.py``), so the pipeline only keeps what the caller's side
must know, in the stream's :class:`StreamRecord`: the next step's number, the sizes its state was
made with, whether the state is still valid after a failure, why it was closed. The stream registry
(``_streams``) owns the records and hands steps to the engine; a :class:`Stream` is the caller's
face of one record, and reaches its registry only through :class:`StreamHost`.

Note: a failed step.
    A stage that fails on a step does not commit its state, and the stages after it never see the
    step. The stream's state is therefore still exactly as before the step when no stage *before*
    the failing one keeps state: the error says so (``StreamError.state_valid``), and the stream
    goes on from there (the failed step's number is used again). Otherwise an earlier stage has
    already moved on and the stages no longer agree: the error says the state is no longer valid,
    and every later step of the stream is refused until it is closed. The errors keep these facts
    as fields (``StreamError.remedy``, ``took``, ``step``; Note: a stream's errors carry facts,
    each layer says them, ``onnxpipe/_errors.py``). Steps already in flight
    behind a failed one fail in the stage that failed (their step number does not match its
    state), never run on the wrong state.

    Unchanged is not always usable: when a step fails in a stage whose own state, as fed, does not
    fit the step (a fixed size, or a named dim the step's other inputs size otherwise: a
    ``[0, 4, 1, 8]`` placeholder kept as an encoder's KV, say), the stage says what
    (``StageError.held``), and every later step would fail on it the same way. The error says
    the stage ran the step on the state it holds, what of it does not fit, and to close the
    stream (``Remedy.CLOSE``, ``state_valid`` false, the fact in ``StreamError.detail``); later
    steps are refused. A step that failed for its own inputs, on a state that fits, can go on as before.

Note: expiring idle streams.
    Every ``pipe.stream()`` and every step first closes the streams idle past the pipeline's
    ``stream_timeout``; looking at every open stream each time made a step cost O(open streams)
    (10,000 open: 9.3 ms to start a served sequence instead of 2.2, issue 28). :class:`IdleStreams`
    holds instead the open streams with no step in flight, in the order they became idle (opened,
    or their last step in flight finished): a stream leaves it when a step is taken and comes back
    at the end when its last step in flight finishes, and ``last_used`` is stamped under its lock,
    so the order is the order of ``last_used``. Expiry pops from the front until it meets a stream
    idle for no longer than the timeout: every stream behind that one was used later. A step then
    looks at one stream, plus the ones it closes (``Pipeline.streams.looked`` counts them). Its lock
    is taken last (inside a stream's lock or the registry's) and never held while taking another. An ``OrderedDict``, not a ``dict``: after
    many deletions at its front, a dict's first item is found by walking over their holes.

Note: a stream's state bytes.
    A state can grow with every step (a KV cache: ``Concat(past, new)``), so what a stream holds
    is a fact its owner needs (a server caps it per sequence and over all of them). Each stage with
    state that commits a step's state tells the step's request how many bytes it now holds for
    that stream (``Request.held``: for a batch of steps, a member's share of the block is its rows'
    share, padding included); the request carries that back, on any engine, and when the step
    leaves the pipeline its stream takes the figures, per stage, before its future is settled:
    whoever waits on a step's outputs reads :attr:`Stream.state_bytes` as of that step. A failed
    step's stages that had committed report too (their state did move on). The registry keeps the
    sum over its open streams (:class:`Tally`, :attr:`Pipeline.state_bytes`) as streams report and
    close: reading it costs nothing, whatever the number of streams. A stream's bytes leave the sum when it is
    closed (its state is then on its way out, behind its steps in flight, which report no more).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from onnxpipe._errors import RUNTIME_TERMS, Closure, InputError, StageError, StateDimError, StreamError
from onnxpipe.runtime._inputs import InputCheck
from onnxpipe.runtime._spec import PipelineSpec, TensorSpec

__all__ = ["IdleStreams", "StepCheck", "Stream", "StreamHost", "StreamRecord", "Tally", "bind_dims", "state_dims"]

Outputs = dict[str, np.ndarray]
#: Where each state dim is bound: ``(dim, input, axis)`` (see ``StreamRegistry``).
Binds = tuple[tuple[str, str, int], ...]
#: A stream closed by its owner.
BY_OWNER = Closure("owner")


def state_dims(spec: PipelineSpec) -> frozenset[str]:
    """The symbolic dims that size some state (its empty axis aside): fixed for a stream's lifetime."""
    names: set[str] = set()
    for link in spec.states:
        shape = spec.stage(link.stage).input(link.input).shape or ()
        names.update(d for axis, d in enumerate(shape) if isinstance(d, str) and axis != link.empty_axis)
    return frozenset(names)


def bind_dims(specs: Sequence[TensorSpec], arrays: Mapping[str, np.ndarray], names: frozenset[str]) -> dict[str, tuple[int, str]]:
    """The size each of ``names`` has in the (checked) arrays, with the input that gave it."""
    sizes: dict[str, tuple[int, str]] = {}
    for spec in specs:
        if spec.name not in arrays:
            continue  # a first-step input, on a later step (PipelineSpec, Note: first-step stages)
        for d, size in zip(spec.shape or (), arrays[spec.name].shape, strict=False):
            if isinstance(d, str) and d in names:
                sizes.setdefault(d, (size, spec.name))
    return sizes


class StepCheck:
    """What a stream's step must give (PipelineSpec, Note: first-step stages): every pipeline input
    on the stream's first step; on a later step every one but the first-step inputs, which are
    refused there (the stages that read them ran on the first step, and the stream would not use
    them). Without first-step stages, one check for every step.

    Args:
        spec: The pipeline's spec.
        check: The pipeline's check of all its inputs (``InputCheck(spec.inputs)``).
    """

    def __init__(self, spec: PipelineSpec, check: Callable[[Mapping[str, Any]], dict[str, np.ndarray]]) -> None:
        self._first = check
        self._once = frozenset(spec.first_step_inputs)
        self._later_inputs = ", ".join(repr(t.name) for t in spec.inputs if t.name not in self._once) or "none"
        self._later = InputCheck([t for t in spec.inputs if t.name not in self._once]) if self._once else check
        self._readers = {lk.src.tensor: lk.dst.stage for lk in spec.links if lk.src.stage is None and lk.dst.stage is not None
                         and spec.stage(lk.dst.stage).first_step_only}

    def __call__(self, inputs: Mapping[str, Any], step: int) -> dict[str, np.ndarray]:
        """The step's inputs, checked.

        Raises:
            InputError: as ``InputCheck``; or a later step gives a first-step input.
        """
        if step == 0 or not self._once:
            return self._first(inputs)
        given = [name for name in inputs if name in self._once]
        if given:
            name = given[0]
            raise InputError(
                f"input '{name}' is given on a stream's first step only: stage '{self._readers[name]}' reads it, which runs on the first "
                f"step only (runs \"first\"), and the stages after it keep what it made; step {step} takes: {self._later_inputs}"
            )
        return self._later(inputs)


class Tally:
    """A sum many threads add to (the bytes of the open streams' state); reading it takes no lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self.value += delta


class IdleStreams:
    """A pipeline's open streams with no step in flight, longest idle first (see Note: expiring idle streams).

    Attributes:
        looked: How many streams :meth:`expired` has looked at so far (one per call, plus each
            one it returns): ``Pipeline.streams.looked``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: OrderedDict[int, StreamRecord] = OrderedDict()
        self.looked = 0

    def add(self, stream: StreamRecord) -> None:
        """``stream`` is idle from now: stamp its ``last_used`` and put it last."""
        with self._lock:
            stream.last_used = time.monotonic()
            self._streams[stream.id] = stream
            self._streams.move_to_end(stream.id)

    def discard(self, stream: StreamRecord) -> None:
        """``stream`` took a step, or was closed: it is not idle (nothing if it was not there)."""
        with self._lock:
            self._streams.pop(stream.id, None)

    def expired(self, timeout: float) -> list[StreamRecord]:
        """Take out and return the streams idle for longer than ``timeout`` seconds now, longest idle first."""
        taken = []
        with self._lock:
            now = time.monotonic()
            while self._streams:
                self.looked += 1
                stream = next(iter(self._streams.values()))
                if now - stream.last_used <= timeout:
                    break
                del self._streams[stream.id]
                taken.append(stream)
        return taken

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()

    def __len__(self) -> int:
        return len(self._streams)


class StreamRecord:
    """What a pipeline keeps of one stream (see the module's docstring); its registry's to use.

    Args:
        stream_id: The stream's number in its pipeline.
        idle: The registry's idle streams, which the record joins and leaves as its steps go and
            come (under its lock: Note: expiring idle streams).
        held: The registry's sum of the open streams' state bytes (Note: a stream's state bytes).

    Attributes:
        id: The stream's number.
        order: Held from checking a step until it is submitted, so that a stream's steps enter the
            engine in the order they were numbered (the registry takes it).
        steps: Steps submitted and not failed so far (the next step's number).
        last_used: ``time.monotonic()`` when its last step was submitted or finished.
        closure: Why it was closed, once closed.
    """

    def __init__(self, stream_id: int, idle: IdleStreams, held: Tally) -> None:
        self.id = stream_id
        self.order = threading.Lock()
        self.steps = 0
        self.last_used = time.monotonic()
        self.closure: Closure | None = None
        self._lock = threading.Lock()  # guards the counters; never held while waiting on the pipeline (its last stage takes it)
        self._idle = idle
        self._tally = held
        self._dims: dict[str, int] = {}
        self._pending = 0
        self._failure: tuple[int, StreamError] | None = None  # the step whose failure left the state invalid, and its error
        self._held: dict[str, int] = {}  # stage -> bytes of the stream's state there

    @property
    def dims(self) -> dict[str, int]:
        """The sizes of the symbolic dims of the stream's state, as its first step bound them."""
        return dict(self._dims)

    @property
    def state_bytes(self) -> int:
        """Bytes of the stream's state in its stages, as its last finished step left them."""
        with self._lock:
            return sum(self._held.values())

    def idle_for(self, now: float) -> float:
        """Seconds since its last step was submitted or finished; 0 while a step is in flight."""
        return 0.0 if self._pending else now - self.last_used

    def accept(self, inputs: Mapping[str, Any], check: Callable[[Mapping[str, Any], int], dict[str, np.ndarray]], binds: Binds) -> dict[str, np.ndarray]:
        """The next step's inputs, checked (``order`` held); nothing is taken yet.

        Raises:
            StreamError: the stream is closed, or its state is no longer valid after a failed step.
            InputError: an input does not fit (``check``), or sizes a state dim differently than
                the stream's first step (:class:`StateDimError`).
        """
        with self._lock:
            if self.closure is not None:
                raise StreamError.closed(self.id, self.closure)
            if self._failure is not None:
                raise StreamError.refused(self.id, *self._failure)
            arrays = check(inputs, self.steps)
            self._check_dims(arrays, binds)
            return arrays

    def _check_dims(self, arrays: Mapping[str, np.ndarray], binds: Binds) -> None:
        if not binds:
            return
        if self.steps == 0:
            self._dims = {}
            for d, name, axis in binds:
                self._dims.setdefault(d, arrays[name].shape[axis])
            return
        dims = self._dims
        for d, name, axis in binds:
            if name not in arrays:
                continue  # a first-step input, given on the first step only
            size = arrays[name].shape[axis]
            if dims.get(d, size) != size:
                raise StateDimError(stream=self.id, step=self.steps, name=name, dim=d, size=size, bound=dims[d])

    def advance(self) -> int:
        """Take the next step's number (``order`` held, after :meth:`accept`): the step is in flight."""
        with self._lock:
            step = self.steps
            self.steps += 1
            self._pending += 1
            if self._pending == 1:
                self._idle.discard(self)
            return step

    def finished(self, step: int, error: BaseException | None, advanced: Sequence[str], held: Mapping[str, int] | None = None) -> BaseException | None:
        """A step left the pipeline; returns the error its future should raise.

        Args:
            step: The step's number.
            error: Its error, if it failed.
            advanced: For a failed step: the stages with state that took the step before the
                failing one (see Note: a failed step).
            held: The bytes of the stream's state in each stage that committed the step (Note: a
                stream's state bytes).
        """
        with self._lock:
            if held and self.closure is None:
                before = sum(self._held.values())
                self._held.update(held)
                self._tally.add(sum(self._held.values()) - before)
            self._pending -= 1
            if self._pending == 0 and self.closure is None:
                self._idle.add(self)  # stamps last_used (Note: expiring idle streams)
            else:
                self.last_used = time.monotonic()
            if error is None:
                return None
            if self.closure is not None and (error.stage if isinstance(error, StageError) else None) is None:
                return error  # the pipeline was closed under it
            if isinstance(error, StreamError) and error.state_valid is False:
                # The engine knows the state is gone (e.g. the Ray actor holding it died).
                self._failure = self._failure or (step, error)
                return error
            failed = StreamError.step_failed(error, step, advanced)
            if advanced or failed.detail:  # stages disagree, or a stage's own state does not fit a step (see Note: a failed step)
                self._failure = self._failure or (step, failed)
            else:
                self.steps = min(self.steps, step)
            return failed

    def shut(self, closure: Closure) -> bool:
        """Mark the stream closed, its state bytes out of the registry's sum (Note: a stream's
        state bytes); ``False`` if it was closed already."""
        with self._lock:
            if self.closure is not None:
                return False
            self.closure = closure
            held, self._held = sum(self._held.values()), {}
            if held:
                self._tally.add(-held)
        return True

    @property
    def refusing(self) -> bool:
        """Whether the stream refuses steps: a failed step left its state invalid."""
        return self._failure is not None


class StreamHost(Protocol):
    """What a :class:`Stream` asks of its pipeline's stream registry (``_streams.StreamRegistry``;
    the protocol keeps the import one-way)."""

    def submit(self, record: StreamRecord, inputs: Mapping[str, Any]) -> Future[Outputs]:
        """Check and submit the stream's next step (see :meth:`Stream.submit`)."""
        ...

    def close(self, record: StreamRecord, wait: bool = True) -> None:
        """Close the stream and free its state (see :meth:`Stream.close`)."""
        ...


class Stream:
    """A sequence of steps through a pipeline whose stages keep the stream's state.

    Made by :meth:`Pipeline.stream`. Steps run in the order they are submitted; steps of different
    streams overlap in the pipeline (stage 0 runs stream B's step while stage 1 runs stream A's).
    Closing the stream (or leaving its ``with`` block) frees its state in every stage.

    Attributes:
        id: The stream's number in its pipeline (from 0); also what engines route it by.
    """

    def __init__(self, host: StreamHost, record: StreamRecord) -> None:
        self.id = record.id
        self._host = host
        self._record = record

    @property
    def steps(self) -> int:
        """Steps submitted and not failed so far (the next step's number)."""
        return self._record.steps

    @property
    def closed(self) -> bool:
        """Whether the stream was closed (by :meth:`close`, its pipeline, or its idle timeout)."""
        return self._record.closure is not None

    @property
    def closure(self) -> Closure | None:
        """Why the stream was closed, as facts (:class:`~onnxpipe.Closure`), or ``None`` while open."""
        return self._record.closure

    @property
    def closed_because(self) -> str | None:
        """Why the stream was closed (``"closed by its owner"``, its idle timeout, ...), or ``None`` while open."""
        closure = self._record.closure
        return None if closure is None else RUNTIME_TERMS.closure(closure)

    @property
    def state_bytes(self) -> int:
        """Bytes of the stream's state in its stages, as its last finished step left them (0
        before its first step, and once closed). See Note: a stream's state bytes."""
        return self._record.state_bytes

    @property
    def dims(self) -> dict[str, int]:
        """The sizes of the symbolic dims of the stream's state, as its first step bound them."""
        return self._record.dims

    @property
    def last_used(self) -> float:
        """``time.monotonic()`` when its last step was submitted or finished."""
        return self._record.last_used

    def idle_for(self, now: float) -> float:
        """Seconds since its last step was submitted or finished; 0 while a step is in flight."""
        return self._record.idle_for(now)

    def submit(self, inputs: Mapping[str, Any]) -> Future[Outputs]:
        """Submit the stream's next step; returns a future of its outputs by name.

        Args:
            inputs: The pipeline inputs of the step (state inputs are fed by the stages).

        Raises:
            StreamError: the stream is closed, or its state is no longer valid after a failed step.
            InputError: an input is unknown, missing, of the wrong dtype or shape, or sizes a
                state differently than the stream's first step did (:class:`~onnxpipe.StateDimError`;
                nothing is submitted: the stream stays usable).
        """
        return self._host.submit(self._record, inputs)

    def step(self, inputs: Mapping[str, Any]) -> Outputs:
        """Run the stream's next step and wait for its outputs (see :meth:`submit`).

        Raises:
            StreamError: as :meth:`submit`, or the step failed (its ``state_valid`` says whether the
                stream can go on).
        """
        return self.submit(inputs).result()

    def close(self, wait: bool = True) -> None:
        """Free the stream's state in every stage; later steps raise :class:`StreamError`.

        Steps already submitted finish first (the close follows them through each stage). Closing
        twice does nothing.

        Args:
            wait: Return once the state is freed everywhere; when false, return once the close is
                on its way (a server ending a sequence does not wait for it).
        """
        self._host.close(self._record, wait)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        record = self._record
        state = "closed" if record.closure else "invalid" if record.refusing else "open"
        return f"Stream(id={self.id}, steps={record.steps}, {state})"
