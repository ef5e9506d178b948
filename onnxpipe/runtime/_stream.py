"""Streams: sequences of steps whose state stays in the stages (see docs/streams.md).

A :class:`Stream` is what ``Pipeline.stream()`` returns. Its steps are requests like any other,
tagged with the stream's id and the step's number; the state itself lives in the stage runners
(Note: state stays in its stage, ``_stage.py``), so the stream object only keeps what the caller's
side must know: the next step's number, the sizes its state was made with, and whether the state
is still valid after a failure.

Note: a failed step.
    A stage that fails on a step does not commit its state, and the stages after it never see the
    step. The stream's state is therefore still exactly as before the step when no stage *before*
    the failing one keeps state: the error says so (``StreamError.state_valid``), and the stream
    goes on from there (the failed step's number is used again). Otherwise an earlier stage has
    already moved on and the stages no longer agree: the error says the state is no longer valid,
    and every later step of the stream is refused until it is closed. Steps already in flight
    behind a failed one fail in the stage that failed (their step number does not match its
    state), never run on the wrong state.

Note: expiring idle streams.
    Every ``pipe.stream()`` and every step first closes the streams idle past the pipeline's
    ``stream_timeout``; looking at every open stream each time made a step cost O(open streams)
    (10,000 open: 9.3 ms to start a served sequence instead of 2.2, issue 28). :class:`IdleStreams`
    holds instead the open streams with no step in flight, in the order they became idle (opened,
    or their last step in flight finished): a stream leaves it when a step is taken and comes back
    at the end when its last step in flight finishes, and ``last_used`` is stamped under its lock,
    so the order is the order of ``last_used``. Expiry pops from the front until it meets a stream
    idle for no longer than the timeout: every stream behind that one was used later. A step then
    looks at one stream, plus the ones it closes. Its lock is taken last (inside a stream's lock or
    the pipeline's) and never held while taking another. An ``OrderedDict``, not a ``dict``: after
    many deletions at its front, a dict's first item is found by walking over their holes.

Note: a stream's state bytes.
    A state can grow with every step (a KV cache: ``Concat(past, new)``), so what a stream holds
    is a fact its owner needs (a server caps it per sequence and over all of them). Each stage with
    state that commits a step's state tells the step's request how many bytes it now holds for
    that stream (``Request.held``: for a batch of steps, a member's share of the block is its rows'
    share, padding included); the request carries that back, on any engine, and when the step
    leaves the pipeline its stream takes the figures, per stage, before its future is settled:
    whoever waits on a step's outputs reads :attr:`Stream.state_bytes` as of that step. A failed
    step's stages that had committed report too (their state did move on). The pipeline keeps the
    sum over its open streams (:attr:`Pipeline.state_bytes`) as streams report and close: reading
    it costs nothing, whatever the number of streams. A stream's bytes leave the sum when it is
    closed (its state is then on its way out, behind its steps in flight, which report no more).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from onnxpipe._errors import InputError, StageError, StreamError
from onnxpipe.runtime._spec import PipelineSpec, TensorSpec

__all__ = ["IdleStreams", "Stream", "StreamHost", "bind_dims", "state_dims"]

Outputs = dict[str, np.ndarray]


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
        for d, size in zip(spec.shape or (), arrays[spec.name].shape, strict=False):
            if isinstance(d, str) and d in names:
                sizes.setdefault(d, (size, spec.name))
    return sizes


class StreamHost(Protocol):
    """What a stream needs from its pipeline (``Pipeline`` is one; the protocol keeps the import one-way)."""

    @property
    def spec(self) -> PipelineSpec: ...

    _state_dims: frozenset[str]
    _state_binds: tuple[tuple[str, str, int], ...]
    _idle: IdleStreams

    def _check(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]: ...

    def _submit_step(self, arrays: Mapping[str, np.ndarray], stream: Stream, step: int) -> Future[Outputs]: ...

    def _close_stream(self, stream: Stream, wait: bool = True) -> None: ...

    def _expire_idle(self) -> list[int]: ...

    def _state_changed(self, delta: int) -> None: ...


class IdleStreams:
    """A pipeline's open streams with no step in flight, longest idle first (see Note: expiring idle streams).

    Attributes:
        looked: How many streams :meth:`expired` has looked at so far (one per call, plus each
            one it returns).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: OrderedDict[int, Stream] = OrderedDict()
        self.looked = 0

    def add(self, stream: Stream) -> None:
        """``stream`` is idle from now: stamp its ``last_used`` and put it last."""
        with self._lock:
            stream.last_used = time.monotonic()
            self._streams[stream.id] = stream
            self._streams.move_to_end(stream.id)

    def discard(self, stream: Stream) -> None:
        """``stream`` took a step, or was closed: it is not idle (nothing if it was not there)."""
        with self._lock:
            self._streams.pop(stream.id, None)

    def expired(self, timeout: float) -> list[Stream]:
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


class Stream:
    """A sequence of steps through a pipeline whose stages keep the stream's state.

    Made by :meth:`Pipeline.stream`. Steps run in the order they are submitted; steps of different
    streams overlap in the pipeline (stage 0 runs stream B's step while stage 1 runs stream A's).
    Closing the stream (or leaving its ``with`` block) frees its state in every stage.

    Attributes:
        id: The stream's number in its pipeline (from 0); also what engines route it by.
    """

    def __init__(self, pipeline: StreamHost, stream_id: int) -> None:
        self.id = stream_id
        self._pipeline = pipeline
        self._lock = threading.Lock()
        self._order = threading.Lock()
        self._next = 0
        self._dims: dict[str, int] = {}
        self._pending = 0
        self.last_used = time.monotonic()
        self._closed: str | None = None  # why, once closed
        self._invalid: str | None = None  # why its state is no longer valid
        self._held: dict[str, int] = {}  # stage -> bytes of the stream's state there (Note: a stream's state bytes)

    @property
    def steps(self) -> int:
        """Steps submitted and not failed so far (the next step's number)."""
        return self._next

    @property
    def closed(self) -> bool:
        """Whether the stream was closed (by :meth:`close`, its pipeline, or its idle timeout)."""
        return self._closed is not None

    @property
    def closed_because(self) -> str | None:
        """Why the stream was closed (``"closed by its owner"``, its idle timeout, ...), or ``None`` while open."""
        return self._closed

    @property
    def state_bytes(self) -> int:
        """Bytes of the stream's state in its stages, as its last finished step left them (0
        before its first step, and once closed). See Note: a stream's state bytes."""
        with self._lock:
            return sum(self._held.values())

    def idle_for(self, now: float) -> float:
        """Seconds since its last step was submitted or finished; 0 while a step is in flight."""
        return 0.0 if self._pending else now - self.last_used

    def submit(self, inputs: Mapping[str, Any]) -> Future[Outputs]:
        """Submit the stream's next step; returns a future of its outputs by name.

        Args:
            inputs: The pipeline inputs of the step (state inputs are fed by the stages).

        Raises:
            StreamError: the stream is closed, or its state is no longer valid after a failed step.
            InputError: an input is unknown, missing, of the wrong dtype or shape, or sizes a
                state differently than the stream's first step did (nothing is submitted: the
                stream stays usable).
        """
        self._pipeline._expire_idle()
        # _order keeps the steps of one stream in submission order into the engine; _lock guards the
        # counters and is never held while waiting on the pipeline (its last stage takes it).
        with self._order:
            arrays = self._accept(inputs)
            return self._pipeline._submit_step(arrays, self, self._advance())

    def _accept(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The next step's inputs, checked (``_order`` held); nothing is taken yet.

        Raises:
            StreamError, InputError: as :meth:`submit`.
        """
        with self._lock:
            if self._closed is not None:
                raise StreamError(f"stream {self.id} is closed ({self._closed}); open a new one with pipe.stream()")
            if self._invalid is not None:
                raise StreamError(f"stream {self.id} cannot take more steps: {self._invalid}; close it and open a new one", state_valid=False)
            arrays = self._pipeline._check(inputs)
            self._check_dims(arrays)
            return arrays

    def _advance(self) -> int:
        """Take the next step's number (``_order`` held, after :meth:`_accept`): the step is in flight."""
        with self._lock:
            step = self._next
            self._next += 1
            self._pending += 1
            if self._pending == 1:
                self._pipeline._idle.discard(self)
            return step

    def step(self, inputs: Mapping[str, Any]) -> Outputs:
        """Run the stream's next step and wait for its outputs (see :meth:`submit`).

        Raises:
            StreamError: as :meth:`submit`, or the step failed (its ``state_valid`` says whether the
                stream can go on).
        """
        return self.submit(inputs).result()

    def _check_dims(self, arrays: Mapping[str, np.ndarray]) -> None:
        binds = self._pipeline._state_binds
        if not binds:
            return
        if self._next == 0:
            self._dims = {}
            for d, name, axis in binds:
                self._dims.setdefault(d, arrays[name].shape[axis])
            return
        dims = self._dims
        for d, name, axis in binds:
            size = arrays[name].shape[axis]
            if dims.get(d, size) != size:
                raise InputError(
                    f"stream {self.id}, step {self._next}: input '{name}' has {d}={size}, but the stream's state was made "
                    f"with {d}={self._dims[d]} on its first step; open a new stream for another {d}"
                )

    @property
    def dims(self) -> dict[str, int]:
        """The sizes of the symbolic dims of the stream's state, as its first step bound them."""
        return dict(self._dims)

    def _finished(self, step: int, error: BaseException | None, advanced: Sequence[str], held: Mapping[str, int] | None = None) -> BaseException | None:
        """Called when a step leaves the pipeline; returns the error its future should raise.

        Args:
            step: The step's number.
            error: Its error, if it failed.
            advanced: For a failed step: the stages with state that took the step before the
                failing one (see Note: a failed step).
            held: The bytes of the stream's state in each stage that committed the step (Note: a
                stream's state bytes).
        """
        with self._lock:
            if held and self._closed is None:
                before = sum(self._held.values())
                self._held.update(held)
                self._pipeline._state_changed(sum(self._held.values()) - before)
            self._pending -= 1
            if self._pending == 0 and self._closed is None:
                self._pipeline._idle.add(self)  # stamps last_used (Note: expiring idle streams)
            else:
                self.last_used = time.monotonic()
            if error is None:
                return None
            stage = error.stage if isinstance(error, StageError) else None
            if self._closed is not None and stage is None:
                return error  # the pipeline was closed under it
            if isinstance(error, StreamError) and error.state_valid is False:
                # The engine knows the state is gone (e.g. the Ray actor holding it died).
                self._invalid = self._invalid or f"step {step} failed: {error}"
                return error
            if not advanced:
                self._next = min(self._next, step)
                return StreamError(
                    f"{error}; the stream's state is unchanged (as after step {step - 1}): the stream can go on",
                    stage=stage,
                    request=getattr(error, "request", None),
                    state_valid=True,
                )
            took = ", ".join(f"'{s}'" for s in advanced)
            self._invalid = self._invalid or f"step {step} failed in stage '{stage}' after stage(s) {took} had updated their state"
            return StreamError(
                f"{error}; the stream's state is no longer valid: stage(s) {took} took step {step} and stage '{stage}' did not; close the stream",
                stage=stage,
                request=getattr(error, "request", None),
                state_valid=False,
            )

    def close(self, wait: bool = True) -> None:
        """Free the stream's state in every stage; later steps raise :class:`StreamError`.

        Steps already submitted finish first (the close follows them through each stage). Closing
        twice does nothing.

        Args:
            wait: Return once the state is freed everywhere; when false, return once the close is
                on its way (a server ending a sequence does not wait for it).
        """
        if self._shut("closed by its owner"):
            self._pipeline._close_stream(self, wait)

    def _expire(self, reason: str) -> bool:
        """Close on behalf of the pipeline (idle timeout); ``False`` if it was already closed."""
        return self._shut(reason)

    def _shut(self, reason: str) -> bool:
        """Mark the stream closed for ``reason``, its state bytes out of its pipeline's sum (Note: a
        stream's state bytes); ``False`` if it was closed already."""
        with self._lock:
            if self._closed is not None:
                return False
            self._closed = reason
            held, self._held = sum(self._held.values()), {}
            if held:
                self._pipeline._state_changed(-held)
        return True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "invalid" if self._invalid else "open"
        return f"Stream(id={self.id}, steps={self._next}, {state})"
