"""The HTTP/REST front door: the KServe v2 (Open Inference Protocol) endpoints with Triton's binary
tensor data, model configuration, statistics and sequence extensions, as a Starlette application.

Note: the body.
    A request's body is read chunk by chunk against ``max_body_bytes`` (a ``Content-Length`` over
    it is refused before anything is read: 413) and ``body_timeout`` (408); a client that goes away
    mid-body gets no answer and costs nothing more. A compressed body (``Content-Encoding: gzip`` or
    ``deflate``, as ``tritonclient`` sends with ``request_compression_algorithm``) is inflated
    against the same limit. The JSON header (the whole body, or its first
    ``Inference-Header-Content-Length`` bytes) is parsed; binary tensors are then taken, in the
    order of the inputs that declare ``binary_data_size``, as views over the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gzip
import json
import logging
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onnxpipe._errors import OnnxpipeError
from onnxpipe.serve._errors import RequestError, bad_request
from onnxpipe.serve._models import VERSION, Outputs, ServedModel, sequence_of
from onnxpipe.serve._state import Decoded, ServerState
from onnxpipe.serve._tensors import check_shape, from_binary, from_json, to_binary, to_json

__all__ = ["make_app"]

log = logging.getLogger("onnxpipe.serve")
HEADER_LENGTH = "inference-header-content-length"
Endpoint = Callable[[Request], Awaitable[Response]]
_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "datatype", "shape", "parameters", "data"}


def make_app(state: ServerState) -> Starlette:
    """The ASGI application of ``state``'s models."""

    def endpoint(fn: Callable[[Request], Awaitable[Response]], open_to_all: bool = False) -> Endpoint:
        async def handle(request: Request) -> Response:
            try:
                if not open_to_all:
                    state.authorize(request.headers.get("authorization"))
                return await fn(request)
            except RequestError as e:
                return error(e.status, str(e), {"WWW-Authenticate": "Bearer"} if e.status == 401 else None)
            except ClientDisconnect:
                return Response(status_code=499)  # nobody is there to read it
            except OnnxpipeError as e:
                return error(400, str(e))
            except Exception as e:  # a bug: logged with its traceback, answered without it; the server goes on
                log.exception("internal error on %s %s", request.method, request.url.path)
                return error(500, f"internal error: {type(e).__name__}: {e}")

        return handle

    async def live(request: Request) -> Response:
        return Response(status_code=200 if state.live else 400)

    async def ready(request: Request) -> Response:
        return Response(status_code=200 if state.ready and not state.draining else 400)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse(state.metadata())

    async def model_metadata(request: Request) -> Response:
        return JSONResponse(_model(state, request).metadata())

    async def model_ready(request: Request) -> Response:
        _model(state, request)
        if state.draining:
            return error(400, "Model version not ready: the server is shutting down")
        return Response(status_code=200)

    async def model_config(request: Request) -> Response:
        return JSONResponse(_model(state, request).config(state.options.stream_timeout))

    async def model_stats(request: Request) -> Response:
        model = request.path_params.get("model", "")
        return JSONResponse(state.statistics(model, request.path_params.get("version", "")))

    async def infer(request: Request) -> Response:
        model = _model(state, request)
        state.serving()
        header_length = request.headers.get(HEADER_LENGTH)
        body = await _body(request, state.options.max_body_bytes, state.options.body_timeout, header_length)
        response = await state.infer(model, "http", lambda: _decode(state, model, body, header_length), lambda d, o: _encode(model, d, o))
        return _compressed(request, response)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    routes = [
        Route("/v2/health/live", endpoint(live, open_to_all=True), methods=["GET"]),
        Route("/v2/health/ready", endpoint(ready, open_to_all=True), methods=["GET"]),
        Route("/v2", endpoint(server_metadata), methods=["GET"]),
        Route("/v2/models/stats", endpoint(model_stats), methods=["GET"]),
        Route("/metrics", endpoint(metrics), methods=["GET"]),
    ]
    for prefix in (model, versioned):
        routes += [
            Route(prefix, endpoint(model_metadata), methods=["GET"]),
            Route(prefix + "/ready", endpoint(model_ready), methods=["GET"]),
            Route(prefix + "/config", endpoint(model_config), methods=["GET"]),
            Route(prefix + "/stats", endpoint(model_stats), methods=["GET"]),
            Route(prefix + "/infer", endpoint(infer), methods=["POST"]),
        ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return error(status, "Not Found" if status == 404 else "Method Not Allowed" if status == 405 else str(exc))

    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """The protocol's error response: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _model(state: ServerState, request: Request) -> ServedModel:
    return state.model(request.path_params["model"], request.path_params.get("version", ""))


async def _body(request: Request, limit: int, timeout: float, header_length: str | None) -> memoryview:
    """The whole body, within ``limit`` bytes and ``timeout`` seconds (see Note: the body).

    With a ``Content-Length``, the body is copied once, as it arrives, into a buffer placed so that
    the binary data after the JSON header starts on a 64-byte boundary: raw tensors are then
    views that onnxruntime reads in place (no second copy to align them).

    Raises:
        RequestError: 400 for a malformed length, 413 past the limit, 408 past the timeout.
        ClientDisconnect: the client went away.
    """
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request(f"Content-Length {length!r} is not a number of bytes")
        if int(length) > limit:
            raise RequestError(413, f"the body has {int(length)} bytes; this server takes at most {limit} (--max-body-size)")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    offset = int(header_length) if header_length is not None and header_length.isdigit() else 0
    buffer = _aligned(int(length), offset) if length is not None and int(length) >= _ALIGN_FROM and encoding in ("", "identity") else None

    async def read() -> memoryview:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            end = size + len(chunk)
            if end > limit:
                raise RequestError(413, f"the body is over {limit} bytes, the most this server takes (--max-body-size)")
            if buffer is None:
                chunks.append(chunk)
            elif end > len(buffer):
                raise bad_request(f"the body is longer than its Content-Length, {len(buffer)} bytes")
            else:
                buffer[size:end] = chunk
            size = end
        return buffer[:size] if buffer is not None else memoryview(b"".join(chunks))

    try:
        async with _deadline(timeout):
            body = await read()
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within {timeout:g} s (--body-timeout)") from None
    return _inflate(body, encoding, limit)


_ALIGN = 64
#: Smaller bodies are joined as they come: copying a small misaligned tensor costs less than placing it.
_ALIGN_FROM = 64 << 10


def _aligned(size: int, offset: int) -> memoryview:
    """A writable buffer of ``size`` bytes whose byte ``offset`` lies on a 64-byte boundary."""
    raw = bytearray(size + _ALIGN)
    start = -(ctypes.addressof(ctypes.c_char.from_buffer(raw)) + offset) % _ALIGN
    return memoryview(raw)[start : start + size]


if sys.version_info >= (3, 11):
    _deadline = asyncio.timeout
else:  # pragma: no cover - Python 3.10

    @contextlib.asynccontextmanager
    async def _deadline(seconds: float) -> AsyncIterator[None]:
        task = asyncio.current_task()
        assert task is not None
        handle = asyncio.get_running_loop().call_later(seconds, task.cancel)
        try:
            yield
        except asyncio.CancelledError:
            raise TimeoutError from None
        finally:
            handle.cancel()


def _inflate(body: memoryview, encoding: str, limit: int) -> memoryview:
    """A ``gzip`` or ``deflate`` body, inflated to at most ``limit`` bytes."""
    if encoding in ("", "identity"):
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)
    if wbits is None:
        raise RequestError(400, f"Content-Encoding {encoding!r} is not supported; valid: gzip, deflate, identity")
    inflater = zlib.decompressobj(wbits)
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise bad_request(f"the {encoding} body cannot be inflated: {e}") from None
    if len(plain) > limit or inflater.unconsumed_tail:
        raise RequestError(413, f"the {encoding} body inflates to over {limit} bytes, the most this server takes (--max-body-size)")
    if not inflater.eof:
        raise bad_request(f"the {encoding} body is truncated")
    return memoryview(plain)


def _decode(state: ServerState, model: ServedModel, body: memoryview, header_length: str | None) -> Decoded:
    """A request's JSON header and tensors (see Note: the body)."""
    end = len(body)
    if header_length is not None:
        if not header_length.strip().isdigit() or not 0 < int(header_length) <= len(body):
            raise bad_request(f"Inference-Header-Content-Length {header_length!r} must be a number of bytes from 1 to the body's {len(body)}")
        end = int(header_length)
    try:
        header = json.loads(bytes(body[:end]))
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad_request("the request must be a JSON object with 'inputs'")
    unknown = set(header) - _REQUEST_KEYS
    if unknown:
        raise bad_request(f"unknown key(s) {', '.join(repr(k) for k in sorted(unknown))} in the request; valid: {', '.join(sorted(_REQUEST_KEYS))}")
    request_id = header.get("id", "")
    parameters = _object(header.get("parameters", {}), "the request's 'parameters'")
    if not isinstance(request_id, str):
        raise bad_request(f"the request's 'id' must be a string, got {request_id!r}")
    inputs = header.get("inputs")
    if not isinstance(inputs, list):
        raise bad_request("the request must have an 'inputs' list")
    data = body
    offset = end
    arrays = {}
    for item in inputs:
        if not isinstance(item, dict):
            raise bad_request(f"each input must be a JSON object, got {item!r:.60}")
        name = item.get("name")
        if not isinstance(name, str):
            raise bad_request(f"each input needs a 'name' string, got {name!r:.60}")
        port = model.inputs.get(name)
        if port is None:
            raise state.unknown_input(model, name)
        if name in arrays:
            raise bad_request(f"input '{name}' is given twice")
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
    state.missing_inputs(model, set(arrays))
    binary = parameters.get("binary_data_output", False)
    if not isinstance(binary, bool):
        raise bad_request(f"parameter 'binary_data_output' must be a boolean, got {binary!r}")
    return Decoded(arrays, sequence_of(parameters), request_id, _requested(state, model, header.get("outputs"), binary), binary)


def _requested(state: ServerState, model: ServedModel, outputs: object, binary: bool) -> list[tuple[str, bool]]:
    if outputs is None:
        return []
    if not isinstance(outputs, list):
        raise bad_request("the request's 'outputs' must be a list")
    asked: list[tuple[str, bool]] = []
    for item in outputs:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            raise bad_request(f"each requested output needs a 'name' string, got {item!r:.60}")
        if name not in model.outputs:
            raise state.unknown_output(model, name)
        params = _object(item.get("parameters", {}), f"output '{name}': 'parameters'")
        if "classification" in params:
            raise bad_request(f"output '{name}': the classification extension is not implemented; ask for the tensor itself")
        as_binary = params.get("binary_data", binary)
        if not isinstance(as_binary, bool):
            raise bad_request(f"output '{name}': binary_data must be a boolean, got {as_binary!r}")
        asked.append((name, as_binary))
    return asked


def _object(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{what} must be a JSON object, got {value!r:.60}")
    return value


def _encode(model: ServedModel, decoded: Decoded, outputs: Outputs) -> Response:
    """The response: a JSON header, then the binary outputs in its order."""
    asked = decoded.outputs or [(name, decoded.binary) for name in model.outputs]
    tensors = []
    chunks = []
    for name, binary in asked:
        port, array = model.outputs[name], outputs[name]
        tensor: dict[str, Any] = {"name": name, "datatype": port.datatype, "shape": list(array.shape)}
        if binary:
            raw = to_binary(port, array)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = to_json(port, array)
        tensors.append(tensor)
    head: dict[str, Any] = {"model_name": model.name, "model_version": VERSION, "outputs": tensors}
    if decoded.id:
        head = {"id": decoded.id, **head}
    text = json.dumps(head, separators=(",", ":")).encode()
    if not chunks:
        return Response(text, media_type="application/json")
    return Response(b"".join([text, *chunks]), media_type="application/octet-stream", headers={"Inference-Header-Content-Length": str(len(text))})


def _compressed(request: Request, response: Response) -> Response:
    """The response compressed as the client accepts (``Accept-Encoding: gzip`` or ``deflate``)."""
    accepted = {part.split(";")[0].strip().lower() for part in request.headers.get("accept-encoding", "").split(",")}
    for name, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        if name in accepted:
            response.body = compress(bytes(response.body))
            response.headers["content-encoding"] = name
            response.headers["content-length"] = str(len(response.body))
            break
    return response
