"""The requests in flight: their numbers and futures (:class:`RequestTable`), and the pipeline's
side of the engine boundary (:class:`Dispatcher`).

Note: one table of requests.
    Every request a pipeline hands to its engine (a stateless request, a stream's step, a batch of
    steps, a stream's close) takes its number and registers its future in one
    :class:`RequestTable`, under one lock, and leaves it at the exit; a batch of ``n`` steps takes
    ``n`` consecutive numbers at once, one per member. Once the pipeline is closed the table
    refuses new requests (:data:`CLOSED`, said here only), and what is still in it is what the
    close fails. Who made a request finishes it: the :class:`Dispatcher` its stateless requests,
    the stream registry (``_streams``) its steps, each through the request's own ``done``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any

import numpy as np

from onnxpipe._errors import BusyError, StageError, StreamError
from onnxpipe.runtime._channel import Closed, Full
from onnxpipe.runtime._engine import Engine
from onnxpipe.runtime._handoff import host
from onnxpipe.runtime._inputs import InputCheck
from onnxpipe.runtime._spec import Endpoint, PipelineSpec
from onnxpipe.runtime._stage import Request
from onnxpipe.runtime._stats import RequestRecorder

__all__ = ["CLOSED", "STEP_CLOSED", "Dispatcher", "Outputs", "Params", "RequestTable", "closed_before", "settle"]

Outputs = dict[str, np.ndarray]
#: Parameter overrides by stage (a snapshot: replaced, never mutated).
Params = Mapping[str, Mapping[str, np.ndarray]]
#: What a closed pipeline says to a new request, stream or step.
CLOSED = "the pipeline is closed"
#: What a step that waited at the entry for its batch says when the pipeline closed.
STEP_CLOSED = "the pipeline was closed before this step started"


def closed_before(request: int, what: str = "finished") -> StageError:
    """The error of a request the pipeline's close cut short (before it ``"started"`` or ``"finished"``)."""
    return StageError(f"the pipeline was closed before request {request} {what}", request=request)


def settle(future: Future[Outputs], outputs: Outputs | None, error: BaseException | None) -> None:
    """A request's future, given its outputs or its error (a future its owner cancelled meanwhile stays so)."""
    try:
        if error is None:
            future.set_result(outputs)  # type: ignore[arg-type]
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


class RequestTable:
    """The requests in flight: each one's number and future (see Note: one table of requests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._futures: dict[int, Future[Outputs]] = {}
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Requests (batch members each) handed to the engine and not finished."""
        return len(self._futures)

    @property
    def closed(self) -> bool:
        """Whether the pipeline was closed (the table takes no more requests)."""
        return self._closed

    def refuse_if_closed(self, kind: type[StageError] = StageError) -> None:
        """Raise ``kind`` (:data:`CLOSED`) once the pipeline is closed."""
        if self._closed:
            raise kind(CLOSED)

    def add(self, future: Future[Outputs]) -> int:
        """Number a new request whose outputs go to ``future``.

        Raises:
            StageError: the pipeline is closed.
        """
        with self._lock:
            if self._closed:
                raise StageError(CLOSED)
            rid = self._next
            self._next += 1
            self._futures[rid] = future
        return rid

    def add_many(self, futures: Sequence[Future[Outputs]]) -> int:
        """Number the members of a batch, consecutively; the first number.

        Raises:
            StageError: the pipeline is closed.
        """
        with self._lock:
            if self._closed:
                raise StageError(CLOSED)
            first = self._next
            self._next += len(futures)
            for k, future in enumerate(futures):
                self._futures[first + k] = future
        return first

    def take(self, rid: int) -> Future[Outputs] | None:
        """The request left (or never entered) the pipeline: its future, out of the table."""
        with self._lock:
            return self._futures.pop(rid, None)

    def take_many(self, rids: Sequence[int]) -> list[Future[Outputs] | None]:
        """:meth:`take`, for the members of a batch at once."""
        with self._lock:
            return [self._futures.pop(rid, None) for rid in rids]

    def close(self) -> bool:
        """Take no more requests; ``False`` if the table was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def stranded(self) -> list[tuple[int, Future[Outputs]]]:
        """The requests still in the table (after a close: those no one will finish)."""
        with self._lock:
            return list(self._futures.items())


class Dispatcher:
    """The pipeline's side of the engine boundary: checks and numbers requests (its
    :class:`RequestTable`), hands them to the engine, and finishes its stateless requests at the
    exit, with the parameter snapshot and the request statistics every request shares (Note: the
    engine boundary, ``_engine``). The pipeline's faces (``submit``, TVM's ``run``, onnxruntime's
    ``run``) all submit through :meth:`submit`.

    Args:
        engine: The pipeline's engine.
        spec: The pipeline's spec.
        finals: Each global output and the endpoint that produces it.
    """

    def __init__(self, engine: Engine, spec: PipelineSpec, finals: Mapping[str, Endpoint]) -> None:
        self.table = RequestTable()
        self.engine = engine
        self.recorder = RequestRecorder()
        #: Checks a request's (or a step's) inputs against the pipeline's.
        self.check = InputCheck(spec.inputs)
        #: The parameter snapshot a request submitted now runs with (see :meth:`use_params`).
        self.params: Params = {}
        self._states = spec.states
        self._finals = finals
        self._lock = threading.Lock()

    def use_params(self, stage: str, values: Mapping[str, np.ndarray]) -> None:
        """Requests submitted from now on run ``stage`` with ``values`` (checked) over its earlier
        ones; those submitted before keep their snapshot."""
        with self._lock:
            self.params = {**self.params, stage: {**self.params.get(stage, {}), **values}}

    def submit(self, inputs: Mapping[str, Any], block: bool = True) -> tuple[int, Future[Outputs]]:
        """Check a stateless request and hand it to the engine: its number and future. It is
        withdrawable until its first stage takes it (Note: withdrawn requests, ``_pipeline``).

        Raises:
            StreamError: the pipeline keeps state between steps: it runs streams only.
            InputError: an input is unknown, missing, or of the wrong dtype or shape.
            StageError: the pipeline is closed.
            BusyError: ``block`` is false and the pipeline is full; nothing was submitted.
        """
        if self._states:
            raise StreamError(
                f"this pipeline keeps state between steps ({len(self._states)} state link(s), e.g. {self._states[0]}): "
                "run it through a stream, `with pipe.stream() as s: s.step(inputs)`"
            )
        arrays = self.check(inputs)
        future: Future[Outputs] = Future()
        rid = self.table.add(future)
        request = Request(rid, {Endpoint(None, n): a for n, a in arrays.items()}, self.params, time.perf_counter(), done=self._finish)
        request.claim = future.set_running_or_notify_cancel
        self.recorder.submitted(request.submitted)
        self.send(request, block)
        return rid, future

    def send(self, request: Request, block: bool = True) -> None:
        """Hand a numbered request to the engine; one the engine refuses as closed fails.

        Raises:
            BusyError: ``block`` is false and the pipeline is full; the request left the table.
        """
        try:
            self.engine.submit(request, block)
        except Closed:
            self.fail(request, closed_before(request.id, "started"))
        except Full:
            self.table.take(request.id)
            raise BusyError(f"the pipeline is full ({self.table.in_flight} request(s) in flight): submit with block=True to wait for room") from None

    def fail(self, request: Request, error: BaseException) -> None:
        """Finish a request that will not run (on), with ``error`` unless it failed already."""
        request.error = request.error or error
        assert request.done is not None
        request.done(request)

    def outputs(self, request: Request) -> Outputs:
        """A finished request's global outputs by name, numpy (an ``OrtValue`` a stage left on its
        device comes to the host here: ``_handoff``, Note: hand-offs as OrtValues)."""
        return {name: host(request.values[key]) for name, key in self._finals.items()}

    def _finish(self, request: Request) -> None:
        """A stateless request left the pipeline: record it and settle its future."""
        error = request.error
        outputs = self.outputs(request) if error is None else None
        if not isinstance(error, CancelledError):  # a withdrawn request neither completed nor failed
            self.recorder.finished(request.submitted, time.perf_counter(), error is None)
        future = self.table.take(request.id)
        if future is not None:
            settle(future, outputs, error)
