"""The HTTP/REST front door: the KServe v2 (Open Inference Protocol) endpoints with Triton's binary
tensor data, model configuration, statistics and sequence extensions, as an aiohttp application.

Note: the body.
    Before a byte of a request's body is read, its head must be one the server would take: the
    token, a served model, a server serving, a ``Content-Length`` within ``max_body_bytes``, a
    ``Content-Encoding`` it can inflate (:func:`_admissible`; so is ``Expect: 100-continue``
    answered, before the client sends the body). The body is then read chunk by chunk against
    ``max_body_bytes`` (413) and ``body_timeout`` (408); a client that goes away mid-body gets no
    answer and costs nothing more. Memory follows the bytes received, never a declared size: each
    chunk is counted as it arrives against the server's :class:`BodyBudget` (see Note: what a
    request holds), and given back when the request is answered. A large body with a
    ``Content-Length`` is copied once, as it arrives, into an anonymous mapping of that length whose
    pages the system makes only as they are written, so a client announcing 64 MiB and sending
    nothing holds nothing (smaller bodies are joined from their chunks). The mapping is placed so
    that the binary data after the JSON header (``Inference-Header-Content-Length`` bytes) starts on
    a 64-byte boundary: raw tensors are then views that onnxruntime reads in place. The JSON header
    is parsed; binary tensors are then taken, in the order of the inputs that declare
    ``binary_data_size``, as views over the rest.

Note: compressed bodies.
    A ``gzip`` or ``deflate`` body (as ``tritonclient`` sends with ``request_compression_algorithm``)
    is read as it came, then inflated only once the request is admitted (its model's
    ``max_inflight`` place taken), on the server's one inflating thread (zlib lets go of the
    interpreter while it inflates: the event loop keeps answering), 64 KiB of input and at most
    1 MiB of output at a time, into a mapping placed as above: every MiB it makes is counted against
    the budget as it is made and against ``max_body_bytes``, so a 64 KiB body that would inflate to
    64 GiB is refused 413 once it passes the limit, having held at most that. One thread, so that
    bodies inflate one after another: with 4 deflate bombs (64 KiB inflating past 64 MiB) at a time
    on the 2-core VM, a health check's p99 / max was 22-27 / 53-62 ms with them inflating on 4
    threads at once and 8-9 / 15-41 ms one at a time, and the server's RSS grew 250 MB against
    68 MB (the same 20 bombs took as long either way).

Note: what a request holds.
    One budget, ``max_inflight`` x ``max_body_bytes`` bytes (:class:`BodyBudget`), bounds what the
    server holds for the requests in its hands, across every connection, and past it a request is
    refused: 503 when others hold the rest, 413 when this one alone needs more than all of it. Each
    request counts, as it makes them: its body as it arrives, its inflated body (Note: compressed
    bodies), the tensors decoding makes that are not views of the body (JSON values as arrays, a
    misaligned tensor's copy, BYTES elements; a JSON worker says what its arrays will take before
    the server reads them: ``_jsonwork``, Note: what a worker's answer holds), the outputs its model
    made (counted once they are made: a request that then finds the budget spent has held them for
    that long), and its answer, at the most it can take, before it is built (:func:`~onnxpipe.serve._tensors.answer_bytes`:
    a binary output its bytes, a JSON value the longest it can be written: 25 bytes a float). All
    of it is given back when the answer is handed to aiohttp. Not counted: what the model holds
    while it runs (with the models), the Python objects the parser makes of a JSON request parsed
    in the server (under ``JSON_FROM``, or all of them with ``--json-workers 0``), and a JSON
    worker's own process, which holds one request at a time.

Note: JSON.
    JSON answers are written by orjson: 4 M floats in 0.026 s against the standard library's
    0.35 s (measured on the 2-core VM). Requests are parsed by the standard library, 0.27 s for a
    16 MiB JSON tensor against orjson's 0.14 s, because orjson turns an integer past 64 bits into
    a float, silently (``18446744073709551616`` comes back ``1.8446744073709552e+19``), where
    integers must stay exact to be refused or taken as they are. Either parser holds the
    interpreter while it runs, so the event loop both front doors share waits for it: a JSON
    request of :data:`JSON_FROM` bytes or more is parsed in a JSON worker process (``_jsonwork``),
    and other large requests' decoding and large answers' encoding run on a thread
    (:func:`_decoded`, ``ServerState.infer``).

Note: why aiohttp.
    Measured on the 2-core VM, server CPU per request of a bare handler that reads the body
    (benchmarks in docs/serving.md): with 600 KB bodies (a 1x3x224x224 FP32 image) aiohttp's server
    took 385-570 us, uvicorn (httptools, uvloop) 675-830 us, since uvicorn hands the body to the
    application 64 KiB at a time through the event loop; with 64-byte bodies both took 80-125 us.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import re
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple, Protocol

import numpy as np
import orjson
from aiohttp import web

from onnxpipe._errors import OnnxpipeError
from onnxpipe.serve import _logs as logs
from onnxpipe.serve._budget import BodyBudget, Held, time_limit
from onnxpipe.serve._errors import RequestError, bad_request, shown
from onnxpipe.serve._models import Deadline, ModelPorts, Outputs, ServedModel, sequence_of, timeout_of
from onnxpipe.serve._options import ServeOptions
from onnxpipe.serve._state import OFF_LOOP, Decoded, ServerState
from onnxpipe.serve._tensors import answer_bytes, binary_view, check_shape, from_binary, from_json, held_bytes, to_json

__all__ = ["drain", "make_app"]

#: A JSON header of this many bytes or more is decoded by a JSON worker (``_jsonwork``, which imports this module).
JSON_FROM = 1 << 20

HEADER_LENGTH = "Inference-Header-Content-Length"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs", "model_name", "model_version"}  # KServe's client sends the last two
_INPUT_KEYS = {"name", "datatype", "shape", "parameters", "data"}
_OPEN = {"/v2/health/live", "/v2/health/ready"}  # answered without the token
SERVER = "onnxpipe"  # every answer's Server header


class JsonDecoders(Protocol):
    """What decodes large JSON requests off the server's process (``_jsonwork.JsonWorkers``)."""

    @property
    def running(self) -> bool: ...

    async def decode(self, ports: ModelPorts, body: memoryview, header_length: int | None, reserve: Callable[[int], None],
                     deadline: Deadline | None = None) -> Decoded: ...


def make_app(state: ServerState, budget: BodyBudget, workers: JsonDecoders | None = None) -> web.Application:
    """The aiohttp application of ``state``'s models, its bodies counted against ``budget`` (shared
    with the gRPC door: ``_budget``, Note: one budget, two doors); large JSON requests are decoded
    by ``workers`` once they run (``_jsonwork``, Note: a JSON worker)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        """The token, and one JSON error for every refusal (the router's 404 and 405 too)."""
        try:
            if request.path not in _OPEN:
                state.authorize(request.headers.getall("Authorization", []))
            return await handler(request)
        except RequestError as e:
            response = error(e.status, str(e), {"WWW-Authenticate": "Bearer"} if e.status == 401 else None)
            if not request.content.is_eof():
                response.force_close()  # a body not read to its end (too large, too slow, cut by a drain) is not read on: the connection closes
            return response
        except web.HTTPException as e:
            return error(e.status, {404: "Not Found", 405: "Method Not Allowed"}.get(e.status, e.reason))
        except OnnxpipeError as e:
            return error(400, str(e))
        except ConnectionError:
            return web.Response(status=499)  # the client went away mid-body: nobody reads this
        except Exception as e:  # a bug: logged with its traceback (its request's line, _logs), answered without it; the server goes on
            response = error(500, f"internal error: {type(e).__name__}: {e}")
            response[logs.BUG] = e
            return response

    # The Open Inference Protocol's REST bodies ({"live": true}, {"ready": true}): KServe's client
    # reads them; Triton's reads the status alone, which stays 200, or 400 when not.
    async def live(request: web.Request) -> web.StreamResponse:
        return _json({"live": state.live}, 200 if state.live else 400)

    async def ready(request: web.Request) -> web.StreamResponse:
        ok = state.serves
        return _json({"ready": ok}, 200 if ok else 400)

    async def server_metadata(request: web.Request) -> web.StreamResponse:
        return _json(state.metadata())

    async def model_metadata(request: web.Request) -> web.StreamResponse:
        return _json(_model(state, request).metadata())

    async def model_ready(request: web.Request) -> web.StreamResponse:
        model = _model(state, request)
        if state.draining:
            return _json({"name": model.name, "ready": False, "error": "Model version not ready: the server is shutting down"}, 400)
        state.serving()  # ready exactly when its inference is admitted: not while the server still loads (see Note: lifecycle, _server)
        return _json({"name": model.name, "ready": True})

    async def model_config(request: web.Request) -> web.StreamResponse:
        return _json(_model(state, request).config(state.options.stream_timeout))

    async def model_stats(request: web.Request) -> web.StreamResponse:
        return _json(state.statistics(request.match_info.get("model", ""), request.match_info.get("version", "")))

    async def infer(request: web.Request) -> web.StreamResponse:
        head = _admissible(state, request)
        held = budget.hold()
        try:
            body = await _body(request, state.options.max_body_bytes, state.options.body_timeout, head, held)
            note = partial(request.__setitem__, logs.REQUEST_ID)  # the protocol's id, for the request's line (_logs)
            decode = partial(_decoded, head, body, held, note, workers, state.options, inflater)
            response = await state.infer(head.model, "http", decode, partial(_encode, head.model, held=held), len(body))
        finally:
            held.release()  # the body's bytes, what decoding made, the answer's (see Note: what a request holds)
        if "Accept-Encoding" in request.headers:
            response.enable_compression()  # gzip or deflate, as the client accepts
        return response

    async def expect(request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: a body the server would refuse is refused before the client
        sends it (see Note: the body; aiohttp calls this outside the middleware: it answers errors
        itself, and logs them)."""
        started = time.perf_counter()
        try:
            if request.headers.get("Expect", "").lower() != "100-continue":
                raise RequestError(417, f"Expect {shown(request.headers.get('Expect', ''))} is not supported; valid: 100-continue")
            state.authorize(request.headers.getall("Authorization", []))
            _admissible(state, request)
        except RequestError as e:
            refused = error(e.status, str(e), {"WWW-Authenticate": "Bearer"} if e.status == 401 else None)
            logs.http_answered(request, refused, started, state.options.access_log)
            return refused
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def metrics(request: web.Request) -> web.StreamResponse:
        return state.metrics.answer()

    inflater = ThreadPoolExecutor(1, thread_name_prefix="onnxpipe-inflate")  # see Note: compressed bodies
    app = web.Application(middlewares=[logs.middleware(state.options.access_log), guard], client_max_size=state.options.max_body_bytes)

    async def stop_inflating(app: web.Application) -> None:
        inflater.shutdown(wait=False, cancel_futures=True)
    app.on_cleanup.append(stop_inflating)

    async def server_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = SERVER  # not aiohttp's "Python/3.11 aiohttp/3.x": what runs here is no client's business
    app.on_response_prepare.append(server_header)
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2", server_metadata)
    app.router.add_get("/v2/models/stats", model_stats)
    if state.options.allow_metrics:  # also on the metrics port, without the token (_server, --metrics-port)
        app.router.add_get("/metrics", metrics)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_get(prefix, model_metadata)
        app.router.add_get(prefix + "/ready", model_ready)
        app.router.add_get(prefix + "/config", model_config)
        app.router.add_get(prefix + "/stats", model_stats)
        app.router.add_post(prefix + "/infer", infer, expect_handler=expect)
    return app


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The protocol's error response: ``{"error": message}``."""
    response = _json({"error": message}, status, headers)
    response[logs.ERROR] = message  # for its request's line (_logs)
    return response


class _Head(NamedTuple):
    """What an inference request's head says, once checked (:func:`_admissible`)."""

    model: ServedModel
    header_length: int | None  # Inference-Header-Content-Length
    length: int | None  # Content-Length
    encoding: str | None  # gzip or deflate; None: as it is


#: zlib's window bits for each Content-Encoding it inflates.
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _admissible(state: ServerState, request: web.Request) -> _Head:
    """The head of an inference request whose body the server would read (see Note: the body); the
    token is the caller's to check.

    Raises:
        RequestError: 404 or 503 for the model (``ServerState.model``), 503 while not serving, 400
            for a malformed length or an encoding not supported, 413 for a ``Content-Length`` over
            ``max_body_bytes``.
    """
    model = _model(state, request)
    state.serving()
    header_length = byte_count(request.headers.get(HEADER_LENGTH), HEADER_LENGTH)
    length = byte_count(request.headers.get("Content-Length"), "Content-Length")
    limit = state.options.max_body_bytes
    if length is not None and length > limit:
        raise RequestError(413, f"the body has {length} bytes; this server takes at most {limit} (--max-body-size)")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity", *_WBITS):
        raise bad_request(f"Content-Encoding {shown(encoding)} is not supported; valid: gzip, deflate, identity")
    return _Head(model, header_length, length, encoding if encoding in _WBITS else None)


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY), status=status, content_type="application/json", headers=headers)


def _model(state: ServerState, request: web.Request) -> ServedModel:
    return state.model(request.match_info["model"], request.match_info.get("version", ""))


class _Drained(TimeoutError):
    """The server began to drain while this request's body was arriving. A ``TimeoutError``:
    after the 503, aiohttp reads on what the client still sends (its lingering close) and stops
    quietly at a timeout, as it would at its own; any other exception it logs as unhandled."""


def drain(budget: BodyBudget) -> None:
    """End every body still arriving: its request is answered 503 (the server is shutting down)
    at once, not after ``--body-timeout``."""
    for content in list(budget.reading):
        content.set_exception(_Drained())


_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only (str.isdigit takes '²' and other scripts' digits), below 10**19


def byte_count(value: str | None, what: str) -> int | None:
    """A header's number of bytes, or ``None`` without the header.

    Raises:
        RequestError: 400, not ASCII digits (or too many of them).
    """
    if value is None:
        return None
    text = value.strip()
    if not _DIGITS.fullmatch(text):
        raise bad_request(f"{what} {shown(value)} is not a number of bytes (ASCII digits, at most 19)")
    return int(text)


async def _body(request: web.Request, limit: int, timeout: float, head: _Head, held: Held) -> memoryview:
    """The whole body as it came (compressed or not), within ``limit`` bytes and ``timeout``
    seconds (see Note: the body).

    Raises:
        RequestError: 413 past the limit, 408 past the timeout, 503 when the server holds all the
            bytes it may (``held`` counts this one's).
        ConnectionError: the client went away.
    """
    length, header_length = head.length, head.header_length
    offset = header_length if header_length is not None and length is not None and header_length <= length else 0
    buffer = _lazy(length, offset) if head.encoding is None and length is not None and length >= _ALIGN_FROM else None

    async def read() -> memoryview:
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            end = size + len(chunk)
            if end > limit:
                raise RequestError(413, f"the body is over {limit} bytes, the most this server takes (--max-body-size)")
            held.take(len(chunk))
            if buffer is not None and end <= len(buffer):
                buffer[size:end] = chunk
            else:
                chunks.append(chunk)
            size = end
        if buffer is not None:
            return buffer[:size]  # the parser stops at Content-Length: nothing went past it
        return memoryview(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    reading = held.budget.reading
    reading.add(request.content)
    try:
        async with time_limit(timeout):
            body = await read()
    except _Drained:
        raise RequestError(503, "the server is shutting down: it takes no new requests") from None
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within {timeout:g} s (--body-timeout)") from None
    finally:
        reading.discard(request.content)
    return body


_ALIGN = 64
#: Smaller bodies are joined as they come: copying a small misaligned tensor costs less than placing it.
_ALIGN_FROM = 64 << 10


def _lazy(size: int, offset: int) -> memoryview:
    """A writable buffer of ``size`` bytes whose byte ``offset`` lies on a 64-byte boundary, in an
    anonymous mapping: its pages exist only once written, so the memory it holds follows the
    bytes received (see Note: the body), and goes back to the system when its last view does."""
    start = -offset % _ALIGN  # a mapping starts on a page
    return memoryview(mmap.mmap(-1, size + start))[start : start + size]


#: What zlib is given at a time (what it leaves unread is copied at each step), and the most it makes at a time.
_INFLATE_IN = 64 << 10
_INFLATE_OUT = 1 << 20


def _inflate(body: memoryview, encoding: str, limit: int, header_length: int | None, held: Held) -> memoryview:
    """A ``gzip`` or ``deflate`` body inflated, within ``limit`` bytes, each MiB counted in ``held``
    as it is made (see Note: compressed bodies; on a thread).

    Raises:
        RequestError: 400 for a body that is not the encoding's (broken, truncated, or with bytes
            after its end), 413 past the limit, 503 or 413 from ``held``.
    """
    buffer = _lazy(limit, header_length if header_length is not None and header_length <= limit else 0)
    try:
        return buffer[: _inflate_into(buffer, body, encoding, held)]
    except BaseException:
        buffer.release()  # unmapped here, on the thread, not where the refusal is answered
        raise


def _inflate_into(buffer: memoryview, body: memoryview, encoding: str, held: Held) -> int:
    """Inflate ``body`` into ``buffer`` (:func:`_inflate`); the bytes made."""
    inflater = zlib.decompressobj(_WBITS[encoding])
    size = 0
    start = 0
    try:
        while start < len(body) and not inflater.eof:
            data: bytes | memoryview = body[start : start + _INFLATE_IN]
            start += len(data)
            while True:
                chunk = inflater.decompress(data, _INFLATE_OUT)
                data = inflater.unconsumed_tail
                if size + len(chunk) > len(buffer):
                    raise RequestError(413, f"the {encoding} body inflates to over {len(buffer)} bytes, the most this server takes (--max-body-size)")
                held.take(len(chunk), f"its inflated {encoding} body")
                buffer[size : size + len(chunk)] = chunk
                size += len(chunk)
                if inflater.eof or (not data and len(chunk) < _INFLATE_OUT):
                    break  # the slice is read and nothing is left to make of it
    except zlib.error as e:
        raise bad_request(f"the {encoding} body cannot be inflated: {e}") from None
    if not inflater.eof:
        raise bad_request(f"the {encoding} body is truncated")
    after = len(inflater.unused_data) + len(body) - start
    if after:
        raise bad_request(f"{after} byte(s) follow the end of the {encoding} stream; send one stream, nothing after it")
    return size


async def _decoded(head: _Head, body: memoryview, held: Held, note: Callable[[str], None], workers: JsonDecoders | None,
                   options: ServeOptions, inflater: Executor) -> Decoded:
    """A request's :class:`Decoded`, once admitted: its body inflated on ``inflater``'s thread (see
    Note: compressed bodies), then decoded by a JSON worker (a JSON header of :data:`JSON_FROM`
    bytes or more), on a thread (a body of ``OFF_LOOP`` bytes or more) or here; what that makes is
    counted in ``held`` (see Note: what a request holds), and ``note`` told the request's ``id``.
    """
    if head.encoding is not None:
        body = await asyncio.get_running_loop().run_in_executor(inflater, _inflate, body, head.encoding, options.max_body_bytes, head.header_length, held)
    ports = head.model.ports
    if workers is not None and workers.running and (head.header_length or len(body)) >= JSON_FROM:
        deadline = Deadline.of(time.perf_counter(), None, options.request_timeout)  # a wait for a free worker is a wait to start
        decoded = await workers.decode(ports, body, head.header_length, partial(held.take, what="its decoded tensors"), deadline)
        note(decoded.id)  # the worker's failures have the line's other id
        return decoded
    if len(body) >= OFF_LOOP:
        decoded = await asyncio.to_thread(_decode, ports, body, head.header_length, note)
    else:
        decoded = _decode(ports, body, head.header_length, note)
    held.take(held_bytes(decoded.arrays), "its decoded tensors")
    return decoded


def _decode(model: ModelPorts, body: memoryview, header_length: int | None, note: Callable[[str], None] | None = None) -> Decoded:
    """A request's JSON header and tensors (see Note: the body); ``note`` is told its ``id`` once known."""
    end = len(body)
    if header_length is not None:
        if header_length == 0:
            raise bad_request("a raw binary request (Inference-Header-Content-Length: 0, the body one input's bytes) is not supported: "
                              "send the JSON header first, its length in Inference-Header-Content-Length")
        if not 0 < header_length <= len(body):
            raise bad_request(f"Inference-Header-Content-Length {header_length} must be a number of bytes from 1 to the body's {len(body)}")
        end = header_length
    try:
        header = json.loads(bytes(body[:end]))  # see Note: JSON (the standard library's: integers exact)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad_request("the request must be a JSON object with 'inputs'")
    unknown = set(header) - _REQUEST_KEYS
    if unknown:
        raise bad_request(f"unknown key(s) {', '.join(repr(k) for k in sorted(unknown))} in the request; valid: {', '.join(sorted(_REQUEST_KEYS))}")
    for key, want in (("model_name", model.name), ("model_version", None)):
        given = header.get(key)
        if given is not None and (not isinstance(given, str) or (want is not None and given != want) or (want is None and given not in ("", model.version))):
            raise bad_request(f"the request's {key} {shown(given)} is not the URL's ({want or model.version}); leave it out or give the same")
    request_id = header.get("id", "")
    parameters = _object(header.get("parameters", {}), "the request's 'parameters'")
    if not isinstance(request_id, str):
        raise bad_request(f"the request's 'id' must be a string, got {request_id!r}")
    if note is not None and request_id:
        note(request_id)  # its line says it, should the rest fail (_logs)
    inputs = header.get("inputs")
    if not isinstance(inputs, list):
        raise bad_request("the request must have an 'inputs' list")
    data = body
    offset = end
    arrays: dict[str, np.ndarray] = {}
    for item in inputs:
        if not isinstance(item, dict):
            raise bad_request(f"each input must be a JSON object, got {item!r:.60}")
        name = item.get("name")
        if not isinstance(name, str):
            raise bad_request(f"each input needs a 'name' string, got {name!r:.60}")
        port = model.input_port(name, arrays)
        unknown = set(item) - _INPUT_KEYS
        if unknown:
            raise bad_request(f"input '{name}': unknown key(s) {', '.join(repr(k) for k in sorted(unknown))}; valid: {', '.join(sorted(_INPUT_KEYS))}")
        shape = check_shape(port, item.get("datatype"), item.get("shape"))
        size = _object(item.get("parameters", {}), f"input '{name}': 'parameters'").get("binary_data_size")
        if size is not None and "data" in item:
            raise bad_request(f"input '{name}' has both 'data' and 'binary_data_size': give one")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise bad_request(f"input '{name}': binary_data_size must be a number of bytes, got {size!r}")
            if offset + size > len(body):
                raise bad_request(f"input '{name}': binary_data_size {size}, but only {len(body) - offset} bytes of binary data are left in the body")
            arrays[name] = from_binary(port, shape, data[offset : offset + size])
            offset += size
        elif "data" in item:
            arrays[name] = from_json(port, shape, item["data"])
        else:
            raise bad_request(f"input '{name}' has neither 'data' nor a 'binary_data_size' parameter")
    if offset != len(body):
        raise bad_request(f"{len(body) - offset} bytes of binary data after the inputs' ({offset - end}) are not claimed by any input's binary_data_size")
    sequence = sequence_of(parameters)
    model.check_complete(arrays, sequence is None or sequence.start)
    binary = parameters.get("binary_data_output", False)
    if not isinstance(binary, bool):
        raise bad_request(f"parameter 'binary_data_output' must be a boolean, got {binary!r}")
    return Decoded(arrays, sequence, request_id, _requested(model, header.get("outputs"), binary), binary, timeout_of(parameters))


def _requested(model: ModelPorts, outputs: object, binary: bool) -> list[tuple[str, bool]]:
    if outputs is None:
        return []
    if not isinstance(outputs, list):
        raise bad_request("the request's 'outputs' must be a list")
    asked: list[tuple[str, bool]] = []
    seen: set[str] = set()
    for item in outputs:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            raise bad_request(f"each requested output needs a 'name' string, got {item!r:.60}")
        params = _object(item.get("parameters", {}), f"output '{name:.100}': 'parameters'")
        model.output_port(name, params)
        if name in seen:
            raise bad_request(f"output '{name}' is asked for twice; ask for each output once")
        seen.add(name)
        as_binary = params.get("binary_data", binary)
        if not isinstance(as_binary, bool):
            raise bad_request(f"output '{name}': binary_data must be a boolean, got {as_binary!r}")
        asked.append((name, as_binary))
    return asked


def _object(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{what} must be a JSON object, got {value!r:.60}")
    return value


def _encode(model: ServedModel, decoded: Decoded, outputs: Outputs, held: Held | None = None) -> web.Response:
    """The response: a JSON header, then the binary outputs in its order; counted in ``held`` at
    the most it can take before it is built (see Note: what a request holds).

    Raises:
        RequestError: 503 or 413 from ``held``; 400 for an output JSON cannot carry (``to_json``).
    """
    asked = decoded.outputs or [(name, decoded.binary) for name in model.outputs]
    if held is not None:
        held.take(held_bytes(outputs, views=True), "its outputs")  # made already: counted as soon as they are here
        held.take(answer_bytes([(model.outputs[name], outputs[name], binary) for name, binary in asked], len(decoded.id)), "its answer")
    tensors = []
    chunks = []
    for name, binary in asked:
        port, array = model.outputs[name], outputs[name]
        tensor: dict[str, Any] = {"name": name, "datatype": port.datatype, "shape": list(array.shape)}
        if binary:
            raw = binary_view(port, array)  # joined below: the one copy of the output
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = to_json(port, array)
        tensors.append(tensor)
    head: dict[str, Any] = {"model_name": model.name, "model_version": model.version, "outputs": tensors}
    if decoded.id:
        head = {"id": decoded.id, **head}
    text = orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return web.Response(body=text, content_type="application/json")
    return web.Response(body=b"".join([text, *chunks]), content_type="application/octet-stream", headers={HEADER_LENGTH: str(len(text))})


