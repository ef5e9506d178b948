"""A served model: one bundle's :class:`~onnxpipe.runtime.Pipeline` behind the protocol.

Both front doors (HTTP and gRPC) decode a request into arrays, call :meth:`ServedModel.infer`,
and encode what it returns; everything between — admission, sequences, the pipeline's futures,
statistics for the protocol's views — is here, once.

Note: the event loop never waits.
    A stateless request is submitted from the event loop with ``block=False``; when the
    pipeline's first queue is full (``BusyError``), the submission moves to the model's own
    worker thread, which may wait for room, and later ones queue behind it (first come, first
    submitted). Sequence steps always go through that one thread:
    opening a stream, closing an idle one and submitting a step may each wait, and one thread
    keeps a sequence's steps in the order they arrived. The loop then awaits the request's future.
    What is waiting is bounded: at most ``max_inflight`` requests per model are admitted, the rest
    are refused at once with 503 (Triton's ``max_queue_size``), never queued without bound.

Note: sequences are streams.
    Triton's sequence extension (``sequence_id``, ``sequence_start``, ``sequence_end``) maps onto
    ``Pipeline.stream()``: a start opens a stream for the id (closing the id's earlier stream, as
    Triton ends an active sequence that starts again), later steps go to it, an end closes it once
    the step is on its way. An end always ends the sequence: when its step is refused (its inputs
    do not fit, or an earlier step's failure left the state invalid), the sequence is ended all
    the same and its state freed, and the 400 says so. A refused stream (``max_streams``) is a 503
    with the reason, a step of an unknown, ended or expired sequence a 400 naming ``sequence_id``.
    A sequence id is a name any client may use: there is no owner (see Note: sequence state).

Note: sequence state.
    A sequence's state lives as long as the sequence, and may grow with every step (a KV cache),
    so it is bounded twice, after each step: a sequence may hold ``--max-sequence-state`` bytes,
    and the server's sequences together ``--sequence-state-budget`` (what each holds is the
    runtime's ``Stream.state_bytes``, kept per step: runtime ``_stream``, Note: a stream's state
    bytes). A step that leaves its sequence over its own limit is answered 400 (the sequence's
    own doing: the same steps again would fail again; gRPC's INVALID_ARGUMENT), one that leaves
    the server over its budget 503 (room may come as other sequences end: retry later; gRPC's
    UNAVAILABLE); either way the step's outputs are dropped and its sequence is ended and its
    state freed. The verdict is made as the step leaves the pipeline (on the pipeline's thread,
    before the request's future is settled: :meth:`ServedModel._stepped`), whether or not its
    client still waits, and the end goes to the model's worker thread, behind what is queued
    there. Sequences are shared names, as in Triton: any client that may infer (holds the token)
    can start, step or end any ``sequence_id``, and a start on an id in use ends the sequence
    there; clients that must not meet choose random 64-bit or long string ids (docs/serving.md,
    security).

Note: a client's terms.
    A client knows its ``sequence_id``s and the server's flags, not the pipeline's stream numbers
    or ``load()``'s arguments. So every refusal of a sequence names ``sequence_id``s, and the
    runtime's stream errors are said in the protocol's terms: they keep their facts as fields
    (the stream, the step, why it was closed, the remedy; Note: a stream's errors carry facts,
    each layer says them, ``onnxpipe/_errors.py``), and the server renders those fields with its
    own words (:class:`_SequenceTerms`): the stream is the request's ``sequence_id``, the idle
    timeout the flag ``--stream-timeout``, and the runtime's remedies (open a new stream, close it)
    the protocol's (``sequence_start``, ``sequence_end``). A refusal for lack of room lists the
    open sequences and ``--max-streams``.

Note: executions.
    Triton counts a model's *inferences* (rows: a request of 8 rows is 8) and its *executions*
    (runs of the model: requests the dynamic batcher put together run once), and reports
    ``batch_stats`` per batch size executed. A pipeline runs several stages, each its own calls:
    its executions are the session calls of its *executing stage*, the first stage that batches
    (``max_batch`` above 1; in a pipeline with state, the first whose steps travel as batches),
    else its first stage: one call per request that reached it. ``execution_count`` is that
    stage's calls, failed ones included as Triton's are; ``batch_stats`` has, per batch size, its
    calls and their time as ``compute_infer`` (the other stages' time is in ``inference_stats``
    only). A batch size here is the requests (or sequence steps) a call ran together, where
    Triton's is their rows; a client sending one row a request (``perf_analyzer``'s default) sees
    the same. ``compute_input`` and ``compute_output`` of a batch are 0 ns: the protocol layer
    decodes and encodes each request on its own, before and after the pipeline (their time is
    ``inference_stats``'s). Counting costs the runtime one dict update per batched call
    (``StageRecorder.batch_busy``).

Note: what a failure shows.
    A stage that fails inside onnxruntime fails with onnxruntime's text, which names its C++
    source (``/onnxruntime_src/.../reshape_helper.h:91``), the function
    (``onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, ...)``) and the
    check that failed (``input_shape_size == requested_shape_size was false.``) before what
    went wrong. A client is answered without them (:func:`client_text`: what is left names the
    stage, the node and the shapes); the server's log keeps the whole text, on the request's one
    line (``RequestError.detail``; ``_logs``, Note: a failure's whole text).

Note: request timeouts.
    As Triton's queue policy does, a timeout bounds a request's wait until its model starts it,
    not its run: a request whose ``timeout`` parameter (microseconds, Triton's) or the server's
    ``--request-timeout``, the shorter, runs out while it still waits (on the worker thread for
    room, or in front of the pipeline's first stage) is withdrawn, and answered 503 "Request
    timeout expired" (Triton's UNAVAILABLE); one its first stage has taken runs to its end and is
    answered. A request whose client went away (a gRPC deadline or cancellation: grpcio cancels
    the call's task) is no longer waited for: withdrawn if no stage has taken it, otherwise left
    to finish unread; either way its admission place is free at once. Withdrawing is the
    runtime's ``future.cancel()`` (Note: withdrawn requests, runtime ``_pipeline``). A sequence's
    step that the worker thread has begun to hand to its stream is not withdrawn (the stream's
    state would lack the step): it runs, and a client past its time gets the 503 all the same.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from onnxpipe import __version__
from onnxpipe._errors import BusyError, InputError, Remedy, StageError, StreamError, StreamTerms, ort_message, said, without_source
from onnxpipe.runtime import UNKNOWN_DIM_NAMES, Pipeline, PipelineStats, StageStats, Stream
from onnxpipe.serve._errors import MESSAGE_MOST, RequestError, bad_request, near, shown
from onnxpipe.serve._options import MAX_SEQUENCE_STATE, SEQUENCE_STATE_BUDGET
from onnxpipe.serve._tensors import Port, port_of

__all__ = ["PLATFORM", "Deadline", "Sequence", "SequenceState", "ServedModel", "SequenceId", "client_text", "timeout_of"]

#: What metadata and config call the platform (Triton's ``onnxruntime_onnx`` for one ONNX model).
PLATFORM = "onnxpipe"
#: The version of a model served from a bundle of its own; one from a model repository in Triton's layout has the number of
#: the version folder it was found in (``_options``, Note: a model repository).
VERSION = "1"
#: Longest string sequence id (Triton's limit).
_MAX_SEQUENCE_ID = 128
#: Sequences whose end is remembered, to say why a later step of one is refused.
_ENDED = 4096
#: Open sequences a refusal for lack of room names (the rest are counted).
_SHOWN = 8


class _SequenceTerms(StreamTerms):
    """A stream's facts in a client's words (see Note: a client's terms): the stream a sequence is
    held in is its ``sequence_id``, settings are the server's flags, remedies the protocol's."""

    state = "the sequence's state"
    remedies: ClassVar[Mapping[Remedy, str]] = {
        Remedy.GO_ON: "the sequence can go on",
        Remedy.CLOSE: "start the sequence again with 'sequence_start': true",
        Remedy.RESTART: "start it again with 'sequence_start': true",
        Remedy.REOPEN: "start it again with 'sequence_start': true",
        Remedy.NEW_STREAM: "start a new sequence ('sequence_start': true) for another",
        Remedy.MAKE_ROOM: "end one ('sequence_end': true), or restart the server with a larger --max-streams",
    }

    def __init__(self, stream: Stream | None = None, sid: SequenceId | None = None) -> None:
        self._stream = None if stream is None else stream.id
        self._sid = sid

    def stream(self, stream: int) -> str:
        return f"sequence_id {self._sid!r}" if stream == self._stream else super().stream(stream)

    def timeout(self, seconds: float) -> str:
        return f"--stream-timeout {seconds:g}"


#: A client's words, where no sequence is named.
_SEQUENCE_TERMS = _SequenceTerms()

#: No more than this many characters of a stage's failure are cleaned of onnxruntime's source (a
#: code stage's message may hold what a request sent; the answer shows at most ``MESSAGE_MOST`` of
#: them anyway); the patterns are ``onnxpipe._errors``' (Note: onnxruntime's words, said short).
_CLEANED = 4 * MESSAGE_MOST

SequenceId = int | str
Outputs = dict[str, np.ndarray]


@dataclass(frozen=True)
class Sequence:
    """A request's sequence parameters (Triton's sequence extension)."""

    id: SequenceId
    start: bool = False
    end: bool = False


def sequence_of(parameters: Mapping[str, Any]) -> Sequence | None:
    """The sequence a request belongs to, from its parameters (values already plain Python).

    Returns:
        ``None`` for a request without a sequence id (or with 0 or ``""``, as Triton reads them).

    Raises:
        RequestError: 400 for a malformed ``sequence_id``, ``sequence_start`` or ``sequence_end``.
    """
    sid = parameters.get("sequence_id")
    for flag in ("sequence_start", "sequence_end"):
        if not isinstance(parameters.get(flag, False), bool):
            raise bad_request(f"parameter '{flag}' must be a boolean, got {shown(parameters[flag])}")
    if sid is None or sid == 0 or sid == "":
        if parameters.get("sequence_start") or parameters.get("sequence_end"):
            raise bad_request("parameters 'sequence_start' and 'sequence_end' need a 'sequence_id' (a non-zero integer or a non-empty string)")
        return None
    if isinstance(sid, bool) or not isinstance(sid, (int, str)):
        raise bad_request(f"parameter 'sequence_id' must be an unsigned integer or a string, got {shown(sid)}")
    if isinstance(sid, int) and not 0 < sid < 2**64:
        raise bad_request(f"parameter 'sequence_id' must be an unsigned 64-bit integer, got {shown(sid)}")
    if isinstance(sid, str) and len(sid) > _MAX_SEQUENCE_ID:
        raise bad_request(f"parameter 'sequence_id': a string id may have at most {_MAX_SEQUENCE_ID} characters, got {len(sid)}")
    return Sequence(sid, bool(parameters.get("sequence_start", False)), bool(parameters.get("sequence_end", False)))


def timeout_of(parameters: Mapping[str, Any]) -> float | None:
    """A request's own timeout, in seconds, from its ``timeout`` parameter (Triton's: microseconds;
    see Note: request timeouts).

    Returns:
        ``None`` without the parameter, or for 0 (as Triton: no timeout of its own).

    Raises:
        RequestError: 400 for a value that is not a whole number of microseconds, 0 or more.
    """
    value = parameters.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"parameter 'timeout' must be a whole number of microseconds, 0 or more (0: none), got {shown(value)}")
    return value / 1e6 if value else None


@dataclass(frozen=True)
class Deadline:
    """When a request must have been started by its model's pipeline (see Note: request timeouts).

    Attributes:
        at: That moment, as ``time.perf_counter()``.
        seconds: The timeout it was set from.
        source: What set it, as a refusal names it.
    """

    at: float
    seconds: float
    source: str

    @classmethod
    def of(cls, started: float, requested: float | None, server: float | None) -> Deadline | None:
        """The deadline of a request in since ``started``: the shorter of its own timeout and the
        server's (``--request-timeout``); ``None`` when it has neither."""
        if requested is not None and (server is None or requested <= server):
            return cls(started + requested, requested, f"its 'timeout' parameter, {round(requested * 1e6)} us")
        if server is not None:
            return cls(started + server, server, "--request-timeout")
        return None

    def left(self) -> float:
        """Seconds until then (0 once past)."""
        return max(0.0, self.at - time.perf_counter())

    def expired(self, model: str) -> RequestError:
        """The refusal of a request still waiting at its deadline: Triton's UNAVAILABLE, its words first."""
        return RequestError(503, f"Request timeout expired: model '{model}' had not started the request {self.seconds:g} s after it came in "
                                 f"({self.source}); retry later, or give it more time")


@dataclass
class _Durations:
    """Cumulative counts and nanoseconds, as Triton's statistics extension reports them."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _Counters:
    """What the protocol layer measures itself: whole requests, decoding and encoding."""

    success: _Durations = field(default_factory=_Durations)
    fail: _Durations = field(default_factory=_Durations)
    decode: _Durations = field(default_factory=_Durations)
    encode: _Durations = field(default_factory=_Durations)
    last_inference_ms: int = 0
    #: Rows (dim 0 of a model that batches, else 1 a request) of the requests the pipeline answered: Triton's inference count.
    inferences: int = 0
    #: Failed requests by Triton's failure reason, but OTHER (the rest of ``fail``: see :meth:`ServedModel.failures`).
    rejected: int = 0
    canceled: int = 0
    backend: int = 0


@dataclass(frozen=True)
class ModelPorts:
    """A model's inputs and outputs as requests name them: all that decoding a request needs, so
    that a JSON worker process can decode one too (``_jsonwork``).

    Attributes:
        name: The model's name.
        inputs: Its input ports by name, in order.
        outputs: Its output ports by name, in order.
        max_batch_size: The ``max_batch_size`` its config reports (``ServedModel.batching``): a
            request holds at most that many rows (dim 0), as Triton refuses more; 0: any.
        version: The version served (a request's ``model_version``, if given, must be it).
        first_step: The inputs a sequence gives in its first request only (the pipeline's
            first-step inputs: an encoder's audio or ids, docs/streams.md); its later requests
            may leave them out.
    """

    name: str
    inputs: dict[str, Port]
    outputs: dict[str, Port]
    max_batch_size: int = 0
    version: str = VERSION
    first_step: tuple[str, ...] = ()

    def input_port(self, name: str, given: Mapping[str, object]) -> Port:
        """The port of a request's input ``name``, not given before (``given``: the inputs so far).

        Raises:
            RequestError: 400 for an unknown input or one given twice.
        """
        port = self.inputs.get(name)
        if port is None:
            raise bad_request(f"model '{self.name}' has no input {shown(name)}; {near(name, self.inputs)}")
        if name in given:
            raise bad_request(f"input '{name}' is given twice")
        return port

    def output_port(self, name: str, parameters: Mapping[str, object]) -> Port:
        """The port of a requested output, with its parameters.

        Raises:
            RequestError: 400 for an unknown output or an extension not implemented.
        """
        port = self.outputs.get(name)
        if port is None:
            raise bad_request(f"model '{self.name}' has no output {shown(name)}; {near(name, self.outputs)}")
        if "classification" in parameters:
            raise bad_request(f"output '{name}': the classification extension is not implemented; ask for the tensor itself")
        return port

    def check_complete(self, given: Mapping[str, np.ndarray], start: bool = True) -> None:
        """Every input given (but the first-step inputs in a sequence's later request: ``start``
        false), and every dim the model names in several inputs one size in them
        (``x [N, 4]`` and ``prefix [N]``: a request giving ``N`` two sizes would fail inside a
        stage, as the server's failure, where it is the request's).

        Raises:
            RequestError: 400 naming the inputs the request lacks, or the dim given two sizes.
        """
        missing = [n for n in self.inputs if n not in given and (start or n not in self.first_step)]
        if missing:
            names = ", ".join(repr(n) for n in missing)
            raise bad_request(f"model '{self.name}': missing input(s) {names}; it takes {', '.join(repr(n) for n in self.inputs)}")
        if self.max_batch_size:
            for name, array in given.items():
                if array.ndim and array.shape[0] > self.max_batch_size:
                    raise bad_request(f"input '{name}' has {array.shape[0]} rows (dim 0); model '{self.name}' takes at most {self.max_batch_size} "
                                      "(its config's max_batch_size): send them in requests of that many")
        sizes: dict[str, tuple[int, str]] = {}
        for name, port in self.inputs.items():
            for axis, d in enumerate(port.shape or ()):
                if name not in given or not isinstance(d, str) or d in UNKNOWN_DIM_NAMES or axis >= given[name].ndim:
                    continue
                size = given[name].shape[axis]
                first = sizes.setdefault(d, (size, name))
                if first[0] != size:
                    raise bad_request(f"inputs '{first[1]}' and '{name}' give dim '{d}' the sizes {first[0]} and {size}; "
                                      "the model names that dim in both, so they must agree")


class SequenceState:
    """The bounds of the server's sequence state, and what its models' sequences hold (see Note:
    sequence state): one for the server, shared by its models with state.

    Args:
        per_sequence: The bytes one sequence's state may hold (``--max-sequence-state``).
        budget: The bytes the sequences of every model may hold together (``--sequence-state-budget``).
    """

    def __init__(self, per_sequence: int = MAX_SEQUENCE_STATE, budget: int = SEQUENCE_STATE_BUDGET) -> None:
        self.per_sequence = per_sequence
        self.budget = budget
        self._pipes: list[Pipeline] = []

    def join(self, pipe: Pipeline) -> None:
        """Count ``pipe``'s streams in :meth:`held`."""
        self._pipes.append(pipe)

    def held(self) -> int:
        """Bytes the sequences of every model hold now (each pipeline keeps its sum: a few reads)."""
        return sum(p.state_bytes for p in self._pipes)

    def refusal(self, model: str, sid: SequenceId, stream: Stream) -> RequestError | None:
        """The answer to a step that left its sequence (``stream``), or the server, over its bound;
        ``None``: within both."""
        held = stream.state_bytes
        if held > self.per_sequence:
            return bad_request(
                f"sequence_id {sid!r} of model '{model}' holds {_size(held)} of state after this step, over the {_size(self.per_sequence)} "
                "a sequence may hold (--max-sequence-state): the sequence was ended and its state freed; start it again ('sequence_start': true) "
                "and end it sooner, send less in each step, or restart the server with a larger --max-sequence-state"
            )
        total = self.held()
        if total > self.budget:
            return RequestError(
                503,
                f"the server's sequences hold {_size(total)} of state after this step, over its {_size(self.budget)} (--sequence-state-budget): "
                f"sequence_id {sid!r} of model '{model}' ({_size(held)} of it) was ended and its state freed; end the sequences you no longer "
                "need ('sequence_end': true) and start it again ('sequence_start': true), or restart the server with a larger --sequence-state-budget",
            )
        return None


class ServedModel:
    """One bundle behind the protocol: its pipeline, ports, admission and sequences.

    Args:
        name: The model's name in URLs and requests.
        path: The bundle it was loaded from.
        pipe: The started pipeline.
        max_inflight: Requests admitted at once; more are refused with 503.
        version: The version it is served as: :data:`VERSION`, or in Triton's layout the number
            of its version folder. It is the only one: a request naming another gets 404.
        sequence_state: The server's bounds of sequence state (see Note: sequence state);
            ``None``: the defaults, for this model alone.
    """

    def __init__(self, name: str, path: os.PathLike[str] | str, pipe: Pipeline, max_inflight: int, version: str = VERSION,
                 sequence_state: SequenceState | None = None) -> None:
        self.name = name
        self.path = str(path)
        self.version = version
        self.pipe = pipe
        self.max_inflight = max_inflight
        self.inflight = 0
        spec = pipe.spec
        self.inputs = {t.name: port_of(t, f"model '{name}': input") for t in spec.inputs}
        self.outputs = {t.name: port_of(t, f"model '{name}': output") for t in spec.outputs}
        self.stateful = bool(spec.states)
        #: What decoding a request checks it against; max_batch_size the config's, enforced as Triton does.
        self.ports = ModelPorts(name, self.inputs, self.outputs, self.batching()[0], version, spec.first_step_inputs)
        self.counters = _Counters()
        #: The stage whose calls are the model's executions (see Note: executions).
        self.executing = next((i for i, s in enumerate(spec.stages) if s.batching is not None and s.settings.max_batch > 1), 0)
        self.sequences: dict[SequenceId, Stream] = {}
        self.sequence_state = sequence_state or SequenceState()
        if self.stateful:
            self.sequence_state.join(pipe)
        self._ended: collections.OrderedDict[SequenceId, str] = collections.OrderedDict()  # the last _ENDED, and why
        # Submissions that may wait, and every stream operation, in arrival order (see Note: the event loop never waits).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"onnxpipe-serve-{name}")
        self._waiting = 0  # stateless submissions on the worker: while any wait, later ones queue behind them

    # -- requests ------------------------------------------------------------------------------

    def admit(self) -> None:
        """Take one of the ``max_inflight`` places, or refuse at once.

        Raises:
            RequestError: 503, every place is taken.
        """
        if self.inflight >= self.max_inflight:
            raise RequestError(503, f"model '{self.name}' has {self.inflight} requests in flight, its limit (--max-inflight); retry later")
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1

    async def infer(self, arrays: Mapping[str, np.ndarray], sequence: Sequence | None, deadline: Deadline | None = None) -> Outputs:
        """Run one admitted request (see :meth:`admit`) and return all its outputs. The request
        is handed to the worker thread or the pipeline before this first waits (see Note: one
        stream, one order, ``_grpc``). Cancelled (its client went away), it is withdrawn if no
        stage has taken it yet (see Note: request timeouts).

        Args:
            arrays: Its inputs.
            sequence: Its sequence parameters, if any.
            deadline: When the pipeline must have started it, if ever (see Note: request timeouts).

        Raises:
            RequestError: 400 for inputs or sequence parameters that do not fit the model, or a
                step that leaves its sequence's state past ``--max-sequence-state``; 503 when a
                stream cannot be opened, a step leaves the server's sequences past
                ``--sequence-state-budget``, or the request's time ran out before it started; 500
                when a stage fails on the request (see Notes: sequence state, what a failure shows).
        """
        future: Future[Outputs] | None
        try:
            if self.stateful:
                future = await self._handed(deadline, self._step, arrays, sequence)
            else:
                future = self._submit_now(arrays) if not self._waiting else None
                if future is None:  # the first queue is full: wait for room on the worker, after those waiting already
                    self._waiting += 1
                    try:
                        future = await self._handed(deadline, self.pipe.submit, arrays)
                    finally:
                        self._waiting -= 1
            outputs = await self._outcome(future, deadline)
        except (InputError, StageError) as e:
            error = _request_error(e, said(e, _SEQUENCE_TERMS) if self.stateful else str(e))
            self._failed(error.status)
            raise error from None
        except RequestError as e:
            self._failed(e.status)
            raise
        except asyncio.CancelledError:  # its client went away (ServerState.infer counts it failed)
            self.counters.canceled += 1
            raise
        # Triton counts a request's rows when its backend answers: here, when the pipeline does.
        self.counters.inferences += _rows(arrays) if self.ports.max_batch_size else 1
        return outputs

    def _failed(self, status: int) -> None:
        """A request the pipeline refused or failed, by Triton's failure reason (see :meth:`failures`)."""
        if status == 503:
            self.counters.rejected += 1
        elif status >= 500:
            self.counters.backend += 1

    async def _handed(self, deadline: Deadline | None, submit: Callable[..., Future[Outputs]], *args: Any) -> Future[Outputs]:
        """``submit(*args)`` (a submission that may wait) on the worker thread, queued there at
        once: the future it returns. Past ``deadline``, or cancelled, the submission is withdrawn:
        taken back from the worker's queue, or, made meanwhile, cancelled (see Note: request timeouts)."""
        job = self._worker.submit(submit, *args)
        try:
            if deadline is None:
                return await asyncio.wrap_future(job)
            return await asyncio.wait_for(asyncio.wrap_future(job), deadline.left())
        except asyncio.TimeoutError:
            job.add_done_callback(_withdraw)
            assert deadline is not None
            raise deadline.expired(self.name) from None
        except asyncio.CancelledError:
            job.add_done_callback(_withdraw)
            raise

    async def _outcome(self, future: Future[Outputs], deadline: Deadline | None) -> Outputs:
        """The outputs of a submitted request. Past ``deadline`` a request no stage has taken yet is
        withdrawn (a 503); one running is waited for, as Triton lets a request that left its queue
        finish. Cancelled, it is withdrawn if it can be (see Note: request timeouts)."""
        waiting = asyncio.wrap_future(future)
        try:
            if deadline is not None and not waiting.done():
                await asyncio.wait([waiting], timeout=deadline.left())
                if not waiting.done() and future.cancel():
                    raise deadline.expired(self.name)
            return await waiting
        except asyncio.CancelledError:
            future.cancel()  # not waited for any longer: no stage starts it now (one running finishes unread)
            raise

    def _submit_now(self, arrays: Mapping[str, np.ndarray]) -> Future[Outputs] | None:
        try:
            return self.pipe.submit(arrays, block=False)
        except BusyError:
            return None

    def _step(self, arrays: Mapping[str, np.ndarray], sequence: Sequence | None) -> Future[Outputs]:
        """Submit one step of a sequence (on the model's worker thread: see Note: sequences are streams)."""
        if sequence is None:
            raise bad_request(
                f"model '{self.name}' keeps state between the steps of a sequence: give the 'sequence_id' parameter "
                "(a non-zero integer or a non-empty string), with 'sequence_start': true on its first request"
            )
        stream = self.sequences.get(sequence.id)
        if sequence.start:
            if stream is not None:
                stream.close(wait=False)  # Triton ends an active sequence that starts again
            try:
                stream = self.pipe.stream()
            except StreamError as e:
                raise RequestError(503, f"model '{self.name}' cannot start sequence {sequence.id!r}: {self._no_room(e)}") from None
            self.sequences[sequence.id] = stream
        elif stream is None or stream.closed:
            raise self._not_open(sequence.id, stream)
        try:
            future = stream.submit(arrays)
        except (StreamError, InputError) as e:
            if stream.closed:  # it expired since the look above
                raise self._not_open(sequence.id, stream) from None
            text = said(e, _SequenceTerms(stream, sequence.id))
            if sequence.end:  # an end always ends the sequence (see Note: sequences are streams)
                self._end(sequence.id, stream, "it ended with sequence_end")
                text += "; the step did not run, and the sequence was ended ('sequence_end': true) and its state freed"
            raise bad_request(text) from None
        if sequence.end:
            self._end(sequence.id, stream, "it ended with sequence_end")  # the close follows the step; frees the state behind it
        answer: Future[Outputs] = Future()
        answer.set_running_or_notify_cancel()  # never withdrawn, as the step's own future (Note: request timeouts)
        future.add_done_callback(lambda done: self._stepped(done, answer, sequence.id, stream))
        return answer

    def _stepped(self, done: Future[Outputs], answer: Future[Outputs], sid: SequenceId, stream: Stream) -> None:
        """A step left the pipeline (on the pipeline's thread, before its client is told): its
        answer, or, when it left its sequence or the server over its bound of state, the refusal,
        and the sequence's end on the worker thread (see Note: sequence state)."""
        try:
            error = done.exception()
            refusal = None if error is not None or stream.closed else self.sequence_state.refusal(self.name, sid, stream)  # closed: its state is on its way out
            if refusal is not None:
                why = f"its state passed {'--max-sequence-state' if refusal.status == 400 else '--sequence-state-budget'}, and was freed"
                with contextlib.suppress(RuntimeError):  # the server is closing: the pipeline frees every state
                    self._worker.submit(self._end, sid, stream, why)
            if error is not None or refusal is not None:
                answer.set_exception(error or refusal)
            else:
                answer.set_result(done.result())
        except Exception as e:  # a bug: the request fails with it (a future's callback that raises is only logged), never hangs
            if not answer.done():
                answer.set_exception(e)

    def _end(self, sid: SequenceId, stream: Stream, why: str) -> None:
        """End the sequence ``sid`` held in ``stream`` (on the worker thread): forget it, unless the
        id was started again meanwhile, and free its state behind its steps in flight."""
        if self.sequences.get(sid) is stream:
            self._forget(sid, why)
        stream.close(wait=False)

    def _not_open(self, sid: SequenceId, stream: Stream | None) -> RequestError:
        """The 400 for a step of a sequence that is not open (never started, ended, or expired)."""
        if stream is not None:
            self._forget(sid, _closed_because(stream))
        why = self._ended.get(sid)
        why = f" ({why})" if why else ""
        return bad_request(
            f"sequence_id {sid!r} names no open sequence of model '{self.name}'{why}: "
            "the first request of a sequence must set 'sequence_start': true"
        )

    def _no_room(self, error: StreamError) -> str:
        """Why a sequence cannot start, in a client's terms (see Note: a client's terms): the
        sequences open, by ``sequence_id``, and the flags that free or make room."""
        if error.remedy is not Remedy.MAKE_ROOM:
            return said(error, _SEQUENCE_TERMS)  # not for lack of room: the pipeline is closing
        pipe = self.pipe
        open_ids = [sid for sid, stream in self.sequences.items() if not stream.closed]
        shown = ", ".join(repr(sid) for sid in open_ids[:_SHOWN]) + (f" and {len(open_ids) - _SHOWN} more" if len(open_ids) > _SHOWN else "")
        idle = f", let one stay idle for --stream-timeout ({pipe.stream_timeout:g} s)" if pipe.stream_timeout else ""
        return (f"{error.limit} sequences are open, the limit (--max-streams {error.limit}): sequence_ids {shown}; "
                f"end one ('sequence_end': true){idle}, or restart the server with a larger --max-streams")

    def _forget(self, sid: SequenceId, why: str) -> None:
        self.sequences.pop(sid, None)
        self._ended[sid] = why
        self._ended.move_to_end(sid)
        while len(self._ended) > _ENDED:
            self._ended.popitem(last=False)

    def close_idle(self) -> None:
        """Close sequences idle past the stream timeout, and forget the ones closed (on the worker thread)."""
        self.pipe.close_idle_streams()
        for sid, stream in [(s, stream) for s, stream in self.sequences.items() if stream.closed]:
            self._forget(sid, _closed_because(stream))

    async def on_worker(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the model's worker thread, after what is queued there."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def close(self) -> None:
        """Stop the pipeline (failing what is still in flight, which frees a submission waiting for
        room), then the worker thread."""
        self.pipe.close()
        self._worker.shutdown(wait=True, cancel_futures=True)

    # -- a request's tensors against the ports (both front doors) ------------------------------

    # -- what the protocol shows of it ---------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """Model metadata (``GET /v2/models/{name}``), in the protocol's JSON form."""
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": PLATFORM,
            "inputs": [_tensor_metadata(p) for p in self.inputs.values()],
            "outputs": [_tensor_metadata(p) for p in self.outputs.values()],
        }

    def batching(self) -> tuple[int, float]:
        """``(max_batch_size, delay in microseconds)`` as Triton's config reports them: the largest
        batch a stage forms (``max_batch``; for streams, whose batches go through every stage, the
        smallest stage's) when some stage batches and every input and output has
        a batch dim (a dim 0 of any size); ``(0, 0)`` otherwise (every dim is the request's own)."""
        stages = [s.settings for s in self.pipe.spec.stages if s.settings.max_batch > 1]
        ports = [*self.inputs.values(), *self.outputs.values()]
        if not stages or any(p.shape is None or not p.shape or isinstance(p.shape[0], int) for p in ports):
            return 0, 0.0
        # Streams' steps travel every stage as one batch (runtime.scheduling): the smallest max_batch bounds it.
        largest = min if self.stateful else max
        return largest(s.max_batch for s in stages), 1e3 * max(s.max_delay_ms for s in stages)

    def config(self, stream_timeout: float | None) -> dict[str, Any]:
        """Triton's model configuration (``GET .../config``). ``max_batch_size`` is 0 (every dim
        is the request's own) unless the model batches (:meth:`batching`): then dims leave out the
        batch dim, as Triton's do, and ``dynamic_batching`` (or, for a model with state, the
        sequence batcher's ``oldest`` strategy) says how. A model with state has the sequence
        batcher, which tells clients (``perf_analyzer``) to send sequence parameters."""
        batch, delay_us = self.batching()

        def dims(p: Port) -> list[int]:
            return p.dims[1:] if batch else p.dims

        config: dict[str, Any] = {
            "name": self.name,
            "platform": PLATFORM,
            "backend": PLATFORM,
            "version_policy": {"latest": {"num_versions": 1}},
            "max_batch_size": batch,
            "input": [{"name": p.name, "data_type": _config_type(p), "format": "FORMAT_NONE", "dims": dims(p), "optional": False}
                      for p in self.inputs.values()],
            "output": [{"name": p.name, "data_type": _config_type(p), "dims": dims(p)} for p in self.outputs.values()],
            "model_transaction_policy": {"decoupled": False},
            "parameters": {"onnxpipe_version": {"string_value": __version__}, "stages": {"string_value": str(len(self.pipe.spec.stages))}},
        }
        if self.stateful:
            idle = 0 if stream_timeout is None else round(stream_timeout * 1e6)
            config["sequence_batching"] = {"max_sequence_idle_microseconds": idle}
            if batch:
                config["sequence_batching"]["oldest"] = {"max_candidate_sequences": batch, "max_queue_delay_microseconds": round(delay_us)}
        elif batch:
            config["dynamic_batching"] = {"max_queue_delay_microseconds": round(delay_us)}
        return config

    def statistics(self, stats: PipelineStats | None = None) -> dict[str, Any]:
        """Triton's statistics extension (``GET .../stats``): the protocol layer's own counts and
        times, and the pipeline's queue and compute time over its stages (its :meth:`stats`, or
        ``stats`` when given: a scrape of the metrics reads them once for both views).

        Every duration counts the successful requests, as Triton's do (``perf_analyzer`` checks that
        the compute counts agree): ``queue`` and ``compute_infer`` sum the stages' waits and runs.
        ``inference_count`` counts rows, ``execution_count`` and ``batch_stats`` the calls of the
        model's executing stage (see Note: executions)."""
        c = self.counters
        stages = (stats or self.pipe.stats(memory=False)).stages
        done = c.success.count
        executing = stages[self.executing] if stages else None

        def total(seconds: float) -> dict[str, int]:
            return {"count": done, "ns": int(seconds * 1e9)}

        return {
            "name": self.name,
            "version": self.version,
            "last_inference": c.last_inference_ms,
            "inference_count": c.inferences,
            "execution_count": _executions(executing),
            "inference_stats": {
                "success": c.success.to_dict(),
                "fail": c.fail.to_dict(),
                "queue": total(sum(s.queued_s for s in stages)),
                "compute_input": {"count": done, "ns": c.decode.ns},
                "compute_infer": total(sum(s.busy_s for s in stages)),
                "compute_output": {"count": done, "ns": c.encode.ns},
                "cache_hit": {"count": 0, "ns": 0},
                "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": _batch_stats(executing),
        }

    def failures(self) -> dict[str, int]:
        """The failed requests of :meth:`statistics` (``fail``) by Triton's failure reasons:
        ``REJECTED`` (a 503: its timeout ran out before it started, a sequence that cannot start,
        the pipeline closing), ``CANCELED`` (its client went away while the model had it: a gRPC
        deadline or cancellation), ``BACKEND`` (a stage failed: a 500), ``OTHER`` (the rest: the
        request's own fault, a 400, or a client gone while its request was decoded)."""
        c = self.counters
        return {"REJECTED": c.rejected, "CANCELED": c.canceled, "BACKEND": c.backend, "OTHER": c.fail.count - c.rejected - c.canceled - c.backend}

    def pending(self, stats: PipelineStats | None = None) -> int:
        """Requests admitted that wait to run (Triton's pending request count): in some stage's
        queue (each request waits in one at a time), or for room in the first."""
        return self._waiting + sum(s.queue_depth for s in (stats or self.pipe.stats(memory=False)).stages)

    def record(self, ok: bool, started: float, decode_s: float, encode_s: float) -> None:
        """One answered request (``started``: ``time.perf_counter()`` when its body was in)."""
        c = self.counters
        (c.success if ok else c.fail).add(time.perf_counter() - started)
        if ok:
            c.decode.ns += int(decode_s * 1e9)
            c.encode.ns += int(encode_s * 1e9)
            c.last_inference_ms = int(time.time() * 1e3)


def _rows(arrays: Mapping[str, np.ndarray]) -> int:
    """A request's rows (dim 0) in a model that batches: every input has the batch dim, one size."""
    first = next(iter(arrays.values()), None)
    return first.shape[0] if first is not None and first.ndim else 1


def _executions(stage: StageStats | None) -> int:
    """Triton's execution count: the executing stage's calls (a batch of requests is one)."""
    if stage is None:
        return 0
    return sum(stage.batch_sizes.values()) if stage.batch_sizes else stage.count


def _batch_stats(stage: StageStats | None) -> list[dict[str, Any]]:
    """Triton's ``batch_stats``: per batch size the executing stage ran, its calls and their time
    (see Note: executions)."""
    if stage is None or not stage.count:
        return []
    ran = stage.batch_busy_s if stage.batch_sizes else {1: stage.busy_s}
    calls = stage.batch_sizes or {1: stage.count}
    return [
        {
            "batch_size": size,
            "compute_input": {"count": n, "ns": 0},
            "compute_infer": {"count": n, "ns": int(ran.get(size, 0.0) * 1e9)},
            "compute_output": {"count": n, "ns": 0},
        }
        for size, n in sorted(calls.items())
    ]


def _withdraw(job: Future[Future[Outputs]]) -> None:
    """A submission that left the worker after its request stopped waiting: the request it made
    is withdrawn, if no stage has taken it yet (see Note: request timeouts)."""
    if not job.cancelled() and job.exception() is None:
        job.result().cancel()


def _tensor_metadata(port: Port) -> dict[str, Any]:
    return {"name": port.name, "datatype": port.datatype, "shape": port.dims}


def _config_type(port: Port) -> str:
    return "TYPE_STRING" if port.is_bytes else f"TYPE_{port.datatype}"


def _request_error(error: InputError | StageError, text: str) -> RequestError:
    """The status of a runtime error: the request's fault (400) or a stage's failure (500);
    ``text`` says it (a stage's failure without onnxruntime's source: see Note: what a failure
    shows)."""
    if isinstance(error, InputError):
        return bad_request(text)
    if isinstance(error, StreamError) and error.stage is None:
        return bad_request(f"{text} (parameter 'sequence_id')")
    if error.stage is None:  # the pipeline closed under the request: the server is stopping
        return RequestError(503, text)
    shown = client_text(text)
    whole = _whole_text(error, text)
    return RequestError(500, shown, None if shown == whole else whole)


def _whole_text(error: StageError, text: str) -> str:
    """``text`` with onnxruntime's whole words where the runtime said them short (``StageError.detail``;
    Note: onnxruntime's words, said short, in ``onnxpipe._errors``), for the server's log."""
    failed = error.cause if isinstance(error, StreamError) and isinstance(error.cause, StageError) else error
    if failed.detail is None:
        return text
    return text.replace(str(failed), failed.detail, 1) if failed is not error else failed.detail


def client_text(text: str) -> str:
    """A stage's failure as a client is answered (see Note: what a failure shows): without
    onnxruntime's source files, functions and failed checks, on one line."""
    more = f"… ({len(text)} characters)" if len(text) > _CLEANED else ""
    text = ort_message(without_source(text[:_CLEANED]))
    return text.replace(" ; ", "; ") + more  # onnxruntime's text ends in a line break: the runtime's words after it follow a space


def _size(n: int) -> str:
    """Bytes as a message gives them (``24.0 MiB``), exact below a KiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def _closed_because(stream: Stream) -> str:
    """Why a sequence's stream was closed, in a client's terms (see Note: a client's terms)."""
    closure = stream.closure
    return "closed" if closure is None else _SEQUENCE_TERMS.closure(closure)
