"""What both front doors share: the served models, readiness, auth, and one way to run an inference.

Note: work off the loop.
    Both front doors share one event loop, and every client's health check waits for whatever
    runs on it. Decoding a request of :data:`OFF_LOOP` bytes or more (parsing its JSON, checking
    and converting its values) and encoding an answer whose outputs hold as many (writing JSON,
    joining binary data) run on a thread instead: the loop goes on answering between the
    thread's steps. What a thread cannot free the loop from is one call that holds the
    interpreter throughout (the JSON parser's, numpy's conversion of a large list): a limit of
    the interpreter, measured in ``benchmarks.serve_faults``; binary tensors avoid it, and the HTTP
    door sends a large JSON request to a worker process (``_jsonwork``). Smaller requests stay on
    the loop, where a thread's hand-over (about 50 us) would cost more than the work. A door that
    arranges its decoding itself (the HTTP door's: inflating, a JSON worker) gives a coroutine
    function, awaited once the request is admitted.

Note: one inference path.
    HTTP and gRPC differ in how a request's tensors are laid out and how the answer is written;
    :meth:`ServerState.infer` is everything else, once: refusal while not serving, admission,
    timing the decode and the encode (Triton's ``compute_input`` / ``compute_output``), the
    request's deadline (``_models``, Note: request timeouts), the pipeline run, the statistics and
    the metrics of the outcome. A request of a gRPC stream is one more of the same, given its
    :class:`Turn` (``_grpc``, Note: one stream, one order).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from onnxpipe import __version__
from onnxpipe.serve import _logs as logs
from onnxpipe.serve._errors import RequestError, bad_request, near, shown
from onnxpipe.serve._metrics import Metrics
from onnxpipe.serve._models import Deadline, Outputs, Sequence, SequenceState, ServedModel
from onnxpipe.serve._options import ServeOptions

__all__ = ["EXTENSIONS", "Decoded", "ServerState", "Turn"]

#: The protocol extensions implemented (``GET /v2``), Triton's names: only ones implemented in full.
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics", "sequence")
SERVER_NAME = "onnxpipe"
#: Requests of this many bytes or more are decoded off the loop, and answers as large encoded so (see Note: work off the loop).
OFF_LOOP = 1 << 20

T = TypeVar("T")


@dataclass
class Decoded:
    """A request's tensors and parameters, as either front door decodes them.

    Attributes:
        arrays: The inputs by name, checked against the model's ports.
        sequence: Its sequence parameters, if any.
        id: The request's ``id``, echoed in the response.
        outputs: The outputs asked for, with whether each goes back as binary (HTTP); empty: all.
        binary: HTTP: whether outputs not asked for by name go back as binary (``binary_data_output``).
        timeout: Its ``timeout`` parameter in seconds, if any (``_models``, Note: request timeouts).
    """

    arrays: dict[str, np.ndarray]
    sequence: Sequence | None = None
    id: str = ""
    outputs: list[tuple[str, bool]] = field(default_factory=list)
    binary: bool = False
    timeout: float | None = None


class Turn:
    """A request's place among those of one gRPC stream: it is handed to its model after the
    stream's previous request was (or was refused), whatever their decoding took (see Note: one
    stream, one order, ``_grpc``).

    Args:
        previous: The turn of the stream's previous request (``None`` for its first).
    """

    def __init__(self, previous: Turn | None) -> None:
        self._previous = previous
        self._passed = asyncio.Event()

    async def wait(self) -> None:
        """Until the previous request has been handed on (at once when it has)."""
        if self._previous is not None:
            await self._previous._passed.wait()
            self._previous = None  # a stream's turns hold no more than its requests in flight

    def passed(self) -> None:
        """This request has been handed on, or will never be: the next may go (idempotent)."""
        self._passed.set()


class ServerState:
    """The models, whether the server serves, and its token.

    Args:
        options: The server's options.
        names: Every model that will be served (loading or loaded), in order.
    """

    def __init__(self, options: ServeOptions, names: list[str]) -> None:
        self.options = options
        self.names = names
        self.models: dict[str, ServedModel] = {}
        self.failed: dict[str, str] = {}  # models that did not load (--allow-partial), and why
        self.ready = False
        self._draining = asyncio.Event()  # streams wait on it to end (_grpc); asyncio binds it to the loop on first use
        self.metrics = Metrics(lambda: dict(self.models))
        #: The bounds of sequence state, shared by the models with state (``_models``, Note: sequence state).
        self.sequence_state = SequenceState(options.max_sequence_state_bytes, options.sequence_state_budget_bytes)
        self._token = options.auth_token.strip().encode() if options.auth_token else None

    # -- what may be asked --------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """Whether the server is shutting down (see Note: lifecycle, ``_server``); once set, for good."""
        return self._draining.is_set()

    @draining.setter
    def draining(self, value: bool) -> None:
        if value:
            self._draining.set()

    async def drained(self) -> None:
        """Until the server begins to drain."""
        await self._draining.wait()

    @property
    def live(self) -> bool:
        return not self.draining

    @property
    def serves(self) -> bool:
        """Whether the server answers ready: every model loaded (or, with ``allow_partial``, those
        that could), not draining, and with ``strict_readiness`` no model that failed to load."""
        return self.ready and not self.draining and not (self.options.strict_readiness and self.failed)

    def authorize(self, values: str | list[str] | tuple[str, ...] | None, protocol: str = "http") -> None:
        """Check a request's ``Authorization`` header (gRPC: ``authorization`` metadata), in constant time.

        Args:
            values: Every value the request gave for it (a single one, or ``None``, is taken too).
            protocol: ``"http"`` or ``"grpc"``: how the refusal spells what to send (gRPC metadata
                keys are lowercase; a client sending ``Authorization`` fails before it is sent).

        Raises:
            RequestError: 401, no token or the wrong one (bytes that are not UTF-8 included);
                400 for more than one value (HTTP would read the first, gRPC the last).
        """
        if self._token is None:
            return
        given = [values] if isinstance(values, str) else list(values or ())
        grpc = protocol == "grpc"
        line = "'authorization: Bearer <token>'" if grpc else "'Authorization: Bearer <token>'"
        if len(given) > 1:
            what = "'authorization' metadata values" if grpc else "Authorization headers"
            raise bad_request(f"the request has {len(given)} {what}; send one: {line}")
        scheme, _, token = (given[0] if given else "").strip().partition(" ")
        if scheme.lower() != "bearer":
            raise RequestError(401, f"this server needs a bearer token: send the {'metadata' if grpc else 'header'} {line}")
        try:  # aiohttp decodes a header as UTF-8 with surrogateescape: this gives back the bytes sent
            raw = token.strip().encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that no byte decodes to: not a token of this server
            raw = b""
        if not hmac.compare_digest(raw, self._token):
            raise RequestError(401, "the bearer token is not valid")

    def model(self, name: str, version: str = "") -> ServedModel:
        """The served model ``name`` at ``version`` ("": the one it has; ``ServedModel.version``).

        Raises:
            RequestError: 404 for an unknown model (as Triton 2.51 and KServe), 503 for one loading or failed to
                load, 404 for a version it is not served as (as Triton's for a version not loaded).
        """
        model = self.models.get(name)
        if model is None:
            if name in self.failed:
                raise RequestError(503, f"model '{name}' is not available: it failed to load: {self.failed[name]}")
            if name in self.names:
                raise RequestError(503, f"model '{name}' is not ready yet: it is loading")
            raise RequestError(404, f"unknown model {shown(name)}; {near(name, self.names)}")  # as Triton 2.51 and KServe answer
        if version not in ("", model.version):
            raise RequestError(404, f"model '{name}' has no version {shown(version)}; versions: {model.version}")
        return model

    def takes(self, name: str, version: str = "") -> bool:
        """Whether model ``name`` is ready (at ``version``; "": the one it has): whether an inference
        request for it would be admitted now, by the same checks (:meth:`model`, :meth:`serving`).
        A model loaded while the server is not ready yet (other models loading, its JSON workers
        starting) is not (see Note: lifecycle, ``_server``)."""
        try:
            self.model(name, version)
            self.serving()
        except RequestError:
            return False
        return True

    def serving(self) -> None:
        """Raises:
            RequestError: 503 while the server is shutting down or still loading models."""
        if self.draining:
            raise RequestError(503, "the server is shutting down: it takes no new requests")
        if not self.ready:
            raise RequestError(503, "the server is not ready: its models are loading")

    def metadata(self) -> dict[str, Any]:
        """Server metadata (``GET /v2``)."""
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's statistics of one model, or of every loaded one (``name`` empty)."""
        models = [self.model(name, version)] if name else list(self.models.values())
        return {"model_stats": [m.statistics() for m in models]}

    # -- inference ----------------------------------------------------------------------------

    async def infer(self, model: ServedModel, protocol: str, decode: Callable[[], Decoded] | Callable[[], Awaitable[Decoded]],
                    encode: Callable[[Decoded, Outputs], T], size: int = 0, turn: Turn | None = None) -> T:
        """Run one request through ``model`` (see Note: one inference path).

        Args:
            model: The model asked for.
            protocol: ``"http"`` or ``"grpc"``, for the metrics.
            decode: Makes the request's :class:`Decoded` (timed as its compute input), once the
                request is admitted: a coroutine function is awaited (it takes its work off the
                loop itself), a plain function is called (on a thread from ``size``).
            encode: Makes the response from it and the outputs (timed as its compute output).
            size: The request's bytes: from :data:`OFF_LOOP` on, a plain ``decode`` runs on a
                thread; an answer whose outputs hold that many is encoded on one (see Note: work
                off the loop).
            turn: For a request of a gRPC stream, its place in the stream: it is handed to the
                model in that order (``_grpc``, Note: one stream, one order).

        Raises:
            RequestError: for every refusal and failure, with its status (503 too for a request
                whose timeout ran out before its model started it).
            asyncio.CancelledError: the call was cancelled (its client went away): the request is
                withdrawn if no stage has taken it, its admission place freed.
        """
        started = time.perf_counter()
        status = 500  # anything but a RequestError is a bug: counted as an error
        try:
            self.serving()
            model.admit()
            try:
                decoded = await _decoded(decode, size)
                decoded_at = time.perf_counter()
                deadline = Deadline.of(started, decoded.timeout, self.options.request_timeout)
                if turn is not None:
                    await turn.wait()
                    turn.passed()  # the next request goes only once this one is with the model: it is, before infer first waits
                outputs = await model.infer(decoded.arrays, decoded.sequence, deadline)
                encode_at = time.perf_counter()
                large = sum(getattr(a, "nbytes", 0) for a in outputs.values()) >= OFF_LOOP
                response = await asyncio.to_thread(encode, decoded, outputs) if large else encode(decoded, outputs)
                model.record(True, started, decoded_at - started, time.perf_counter() - encode_at)
                status = 200
                return response
            except RequestError:
                model.record(False, started, 0.0, 0.0)
                raise
            except asyncio.CancelledError:
                model.record(False, started, 0.0, 0.0)
                status = 499  # the client closed the request (nginx's word): not answered
                raise
            finally:
                model.release()
        except RequestError as e:
            status = e.status
            if e.detail is not None:
                logs.keep_detail(e.detail)  # the request's line keeps the whole text (_logs, Note: a failure's whole text)
            raise
        finally:
            if turn is not None:
                turn.passed()  # refused or failed before it was handed on: the stream's next request goes
            self.metrics.answered(model.name, protocol, status, time.perf_counter() - started)


async def _decoded(decode: Callable[[], Decoded] | Callable[[], Awaitable[Decoded]], size: int) -> Decoded:
    """What ``decode`` makes (see :meth:`ServerState.infer`)."""
    if inspect.iscoroutinefunction(decode):
        return await decode()
    plain = cast(Callable[[], Decoded], decode)
    return await asyncio.to_thread(plain) if size >= OFF_LOOP else plain()
