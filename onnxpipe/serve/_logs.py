"""The server's log: one line per request (``--access-log``), every failed request whether or not,
and the server's progress, as text or as JSON lines (``--log-format``).

Note: one line per request.
    A request ends in one line, written by the front door that answered it: method (gRPC: the
    method's name), path, model, version asked, status, duration, request id and peer, and for a
    failure the message the client got. With ``--access-log`` every request has its line (health
    checks and ``/metrics`` too: they are requests); without it, only failures have one. The
    failure's line *is* its access line, at WARNING for the client's mistakes and the server's
    refusals (4xx, 503, gRPC's codes for them) and at ERROR for the server's failures (other 5xx:
    a stage failed, a bug, whose line carries the traceback), so a failure is never logged twice.
    A failure is an answer carrying the protocol's error (``{"error": ...}``, a gRPC code but OK);
    an answer that is none stays INFO, without a line unless ``--access-log`` (``/v2/health/ready``
    answering 400 while the models load: an orchestrator's probe is no failure).
    The request id is the protocol's ``id`` where the request gave one, else the ``X-Request-Id``
    header (gRPC: ``x-request-id`` metadata), else one the server makes; an HTTP answer echoes the
    header the client sent, and an error answer carries the id its line has (so a client can
    quote it). Requests grpc's core refuses before onnxpipe sees them (a message over
    ``--max-body-size``, an unknown method) and connections refused at ``--max-connections`` have no
    request line (the latter one line a second with their count, as ``_connections`` says).

Note: one format per run.
    :func:`configured` installs one handler, on the root logger, so that what the libraries under
    the server log (aiohttp, asyncio, grpc, Python's warnings) comes out in the run's format too;
    it does so only where the root logger has no handler yet (the rule of ``logging.basicConfig``):
    an application that configured logging itself keeps its handlers, and the server's records
    reach them. Text lines are ``onnxpipe serve: ...`` (progress lines exactly as they were
    printed; a request, ``POST /v2/models/m/infer 400 0.52 ms model=m id=... peer=...: message``;
    anything else with its level); JSON lines are one object each, with the keys of
    :data:`KEYS` (and :data:`REQUEST_KEYS` for a request, ``null`` where one does not apply). A
    JSON ``status`` is always the HTTP status (for gRPC, the one Triton maps its code from), so a
    typed store (Elasticsearch, BigQuery) keeps one type per key; gRPC's code name is
    ``grpc_status``.

Note: a failure's whole text.
    A stage's failure inside onnxruntime carries onnxruntime's source paths and C++ symbols; its
    answer leaves them out (``_models``, Note: what a failure shows) and the server's log keeps
    them, on the request's one line: the answer's ``RequestError.detail``. The front door that
    writes the line knows the answer's message, not the error, so the one inference path
    (``ServerState.infer``) hands the detail to :func:`keep_detail`, which binds it to the
    request's context (a ``ContextVar``: each HTTP request, gRPC call and request of a gRPC stream
    runs in a task of its own, and its line is written in that task); :func:`log_request` writes
    it in the line's ``error`` instead of the answer's message.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import json
import logging
import os
import re
import sys
import time
import traceback
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import grpc
import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from onnxpipe.serve._errors import _GRPC, printable
from onnxpipe.serve._options import LOG_FORMATS

__all__ = [
    "BUG",
    "ERROR",
    "FORMATS",
    "KEYS",
    "REQUEST_HEADER",
    "REQUEST_ID",
    "REQUEST_KEYS",
    "Request",
    "configured",
    "grpc_answered",
    "grpc_status_of",
    "http_answered",
    "keep_detail",
    "log_request",
    "middleware",
    "new_id",
    "progress",
]

#: The formats ``--log-format`` takes.
FORMATS = LOG_FORMATS
#: The logger of the server's progress and of the rest of its records, and the one of request lines.
log = logging.getLogger("onnxpipe.serve")
access = logging.getLogger("onnxpipe.serve.access")
#: The header a request id travels in (gRPC: its lowercase metadata key), and where an HTTP
#: request keeps the protocol's ``id`` once decoded (``aiohttp``'s request is a mapping).
REQUEST_HEADER = "X-Request-Id"
REQUEST_ID = "onnxpipe.request_id"
#: Where an HTTP error answer keeps the message it carries, and a bug's answer the exception.
ERROR = "onnxpipe.error"
BUG = "onnxpipe.bug"
#: The gRPC service's name (``_grpc.SERVICE``, which imports this module).
SERVICE = "inference.GRPCInferenceService"
#: The keys of every JSON line, and those a request's line adds.
KEYS = ("time", "level", "logger", "event", "message")
REQUEST_KEYS = ("protocol", "method", "path", "model", "version", "status", "grpc_status", "duration_ms", "request_id", "peer", "error")
_PREFIX = "onnxpipe serve: "
#: The most characters of a request id a line shows.
_ID_MOST = 128
#: What the ids the server makes begin with (this process's), and their count.
_RUN = os.urandom(4).hex()
_COUNT = itertools.count(1)
#: The whole text of the running request's failure, where its answer says less (see Note: a failure's whole text).
_DETAIL: contextvars.ContextVar[str | None] = contextvars.ContextVar("onnxpipe_serve_failure_detail", default=None)
#: A 499's message: the client went away before its request was read (no answer is sent).
_GONE = "the client went away before its request was read"
#: gRPC status code name -> the HTTP status Triton answers the same error with (grpc_utils.cc), and
#: what grpc's own codes for a call that ended early mean in HTTP's terms.
_HTTP_OF = {code: status for status, code in _GRPC.items()} | {"OK": 200, "CANCELLED": 499, "UNKNOWN": 500}
#: The server's progress lines (``_server``'s ``say``) by how they begin: (event, level). Others are
#: ``progress`` at INFO.
_PROGRESS = (
    (re.compile(r"ready: "), "ready", logging.INFO),
    (re.compile(r"loading "), "loading", logging.INFO),
    (re.compile(r"skipped "), "skipped", logging.WARNING),
    (re.compile(r"model '"), "loaded", logging.INFO),
    (re.compile(r"not serving "), "not_serving", logging.ERROR),
    (re.compile(r"draining: "), "draining", logging.INFO),
    (re.compile(r"\d+ request\(s\) still in flight"), "cut_off", logging.WARNING),
    (re.compile(r"stopped$"), "stopped", logging.INFO),
)


@dataclass(slots=True)
class Request:
    """What a request's line says (see Note: one line per request).

    Attributes:
        protocol: ``"http"`` or ``"grpc"``.
        method: The HTTP method, or the gRPC method's name (``ModelInfer``).
        path: The URL's path, or the gRPC method's full path.
        model: The model asked for, if any.
        version: The version asked for, if any.
        status: The HTTP status (for gRPC, the one its code stands for).
        grpc_status: gRPC's status code name (gRPC only).
        duration_ms: From the request's head (gRPC: its message) to its answer.
        request_id: See Note: one line per request.
        peer: The client's address.
        error: The message the client got, for a failure.
    """

    protocol: str
    method: str
    path: str
    model: str | None
    version: str | None
    status: int
    grpc_status: str | None
    duration_ms: float
    request_id: str
    peer: str | None
    error: str | None

    def text(self) -> str:
        """The line's text, without the ``onnxpipe serve:`` prefix: on one line (a message's line
        breaks and runs of spaces are one space), what the client chose (path, model, id, message)
        with its control characters escaped, so that no request can write a line of its own."""
        head = f"gRPC {self.method} {self.grpc_status}" if self.protocol == "grpc" else f"{self.method} {printable(self.path)} {self.status}"
        model = f" model={printable(self.model)}" + (f" version={printable(self.version)}" if self.version else "") if self.model else ""
        line = f"{head} {self.duration_ms:.2f} ms{model} id={printable(self.request_id)} peer={self.peer or '-'}"
        return f"{line}: {printable(' '.join(self.error.split()))}" if self.error else line

    __str__ = text  # what another handler's formatter shows (an application's own logging)


def _bounded(request_id: str) -> str:
    """A request id as its line gives it: at most :data:`_ID_MOST` characters (a body's ``id`` may be megabytes)."""
    return request_id if len(request_id) <= _ID_MOST else f"{request_id[:_ID_MOST]}… ({len(request_id)} characters)"


def level_of(status: int) -> int:
    """A failed request's level: WARNING refused (4xx, 503), ERROR failed (other 5xx); INFO below 400."""
    if status < 400:
        return logging.INFO
    return logging.WARNING if status < 500 or status == 503 else logging.ERROR


def grpc_status_of(code: str) -> int:
    """The HTTP status a gRPC status code name stands for (``INVALID_ARGUMENT``: 400)."""
    return _HTTP_OF.get(code, 500)


def new_id() -> str:
    """A request id made by the server: 16 hexadecimal digits, this process's 8 random ones and a
    count (``os.urandom`` for each took 11 us on the 2-core VM, a system call)."""
    return f"{_RUN}{next(_COUNT) & 0xFFFFFFFF:08x}"


def keep_detail(text: str | None) -> None:
    """The running request's failure, whole, for its line (see Note: a failure's whole text);
    ``None``: its answer says it all."""
    _DETAIL.set(text)


def log_request(line: Request, exc: BaseException | None = None) -> None:
    """Log one request's line (call it for every failure, and for every request with ``--access-log``)."""
    level = logging.INFO if line.error is None else level_of(line.status)  # an answer, even a 400 (not ready), is no failure
    detail = _DETAIL.get()
    if detail is not None and line.error is not None:
        line = dataclasses.replace(line, error=detail)
    access.log(level, "%s", line, exc_info=exc, extra={"event": "request", "request": line})


def http_answered(request: web.Request, response: web.StreamResponse, started: float, everything: bool) -> None:
    """An HTTP request's line, where one is due (a failure; every request with ``everything``,
    ``--access-log``), and its ``X-Request-Id``: the client's echoed, and on an error answer the
    line's id (see Note: one line per request).

    Args:
        request: The request (the protocol's ``id`` at :data:`REQUEST_ID` once decoded).
        response: Its answer, not yet sent (an error's message at :data:`ERROR`, a bug's
            exception at :data:`BUG`).
        started: ``time.perf_counter()`` when its head was in.
        everything: ``--access-log``.
    """
    status = response.status
    given = request.headers.get(REQUEST_HEADER)
    if given is not None:
        response.headers[REQUEST_HEADER] = given
    error = response.get(ERROR) if status >= 400 else None  # an answer that is no failure (not ready: 400) has none
    if error is None and (status == 499 or (isinstance(response, web.HTTPException) and status >= 400)):
        error = _GONE if status == 499 else response.reason
    if error is None and not everything:
        return
    request_id = _bounded(request.get(REQUEST_ID) or given or new_id())
    if error is not None and given is None and request_id.isascii() and request_id.isprintable():  # what a header can carry
        response.headers[REQUEST_HEADER] = request_id
    info = request.match_info
    line = Request("http", request.method, request.path, info.get("model"), info.get("version"), status, None,
                   (time.perf_counter() - started) * 1000, request_id, _http_peer(request), error)
    log_request(line, response.get(BUG))


def middleware(everything: bool) -> Middleware:
    """An aiohttp middleware writing each request's line where one is due (:func:`http_answered`);
    put it first, so that it sees the answer the others made (a refusal's JSON error included).

    Args:
        everything: ``--access-log``.
    """

    @web.middleware
    async def logged(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            response = await handler(request)
        except web.HTTPException as e:  # an application without onnxpipe's guard (the metrics port's): aiohttp answers it
            http_answered(request, e, started, everything)
            raise
        http_answered(request, response, started, everything)
        return response

    return logged


def grpc_answered(rpc: str, message: Any, context: grpc.aio.ServicerContext, started: float, everything: bool,
                  code: grpc.StatusCode = grpc.StatusCode.OK, error: str | None = None, exc: BaseException | None = None) -> None:
    """A gRPC call's line, where one is due (a failure; every call with ``everything``).

    Args:
        rpc: The method's name (``ModelInfer``).
        message: The request message (its ``id``, model and version where it has them).
        context: The call's context (its peer and metadata).
        started: ``time.perf_counter()`` when its message was in.
        everything: ``--access-log``.
        code: How it ended.
        error: The message the client got, for a failure.
        exc: A bug's exception (its traceback goes in the line).
    """
    if code is grpc.StatusCode.OK and not everything:
        return
    name = code.name
    request_id = _bounded(getattr(message, "id", "") or _metadata(context, REQUEST_HEADER.lower()) or new_id())
    model = getattr(message, "model_name", None) or getattr(message, "name", None) or None
    version = getattr(message, "model_version", None) or getattr(message, "version", None) or None
    line = Request("grpc", rpc, f"/{SERVICE}/{rpc}", model, version, grpc_status_of(name), name,
                   (time.perf_counter() - started) * 1000, request_id, _grpc_peer(context), error)
    log_request(line, exc)


def _http_peer(request: web.Request) -> str | None:
    """``host:port`` (``[host]:port`` for IPv6) of an HTTP client."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return request.remote


def _grpc_peer(context: grpc.aio.ServicerContext) -> str:
    """A gRPC client as an HTTP one is written: grpc's ``ipv4:127.0.0.1:5000`` is ``127.0.0.1:5000``."""
    peer = urllib.parse.unquote(context.peer() or "")
    return peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, value in context.invocation_metadata() or ():
        if k == key and isinstance(value, str):
            return value
    return None


def progress(line: str) -> None:
    """Log one of the server's progress lines (the default ``say`` of :func:`~onnxpipe.serve.serve`)."""
    event, level = next(((event, level) for pattern, event, level in _PROGRESS if pattern.match(line)), ("progress", logging.INFO))
    log.log(level, "%s", line, extra={"event": event})


class TextFormatter(logging.Formatter):
    """``onnxpipe serve: ...`` lines (see Note: one format per run)."""

    def format(self, record: logging.LogRecord) -> str:
        line: Request | None = getattr(record, "request", None)
        event = getattr(record, "event", None)
        if line is not None:
            text = line.text()
        elif event is not None:
            text = record.getMessage()
        else:
            name = "" if record.name.startswith("onnxpipe") else f"{record.name}: "
            text = f"{record.levelname.lower()}: {name}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return _PREFIX + text


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see Note: one format per run)."""

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""  # the time of self._second, to the second (a handler formats under its lock: one at a time)

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        line: Request | None = getattr(record, "request", None)
        value: dict[str, Any] = {
            "time": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": _LEVELS.get(record.levelno) or record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None) or "log",
            "message": line.text() if line is not None else record.getMessage(),
        }
        if line is not None:
            value |= {
                "protocol": line.protocol, "method": line.method, "path": line.path, "model": line.model, "version": line.version,
                "status": line.status, "grpc_status": line.grpc_status, "duration_ms": round(line.duration_ms, 3),
                "request_id": line.request_id, "peer": line.peer, "error": line.error,
            }  # REQUEST_KEYS, in order
        if record.exc_info:
            value["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        try:
            return orjson.dumps(value).decode()
        except TypeError:  # a lone surrogate orjson refuses (UTF-8 cannot carry it): escaped, as the standard library writes it
            return json.dumps(value, default=str)


_LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error", logging.CRITICAL: "critical"}
_FORMATTERS: dict[str, type[logging.Formatter]] = {"text": TextFormatter, "json": JsonFormatter}


@contextlib.contextmanager
def configured(log_format: str = "text", stream: IO[str] | None = None) -> Iterator[None]:
    """The server's logging while the block runs (see Note: one format per run): its records at
    INFO and above, and, where the root logger has no handler yet, one handler writing them (and
    what other libraries log at WARNING and above, Python's warnings included) to ``stream``
    (stderr) in ``log_format``; it is taken away after.

    Raises:
        ValueError: an unknown format (``ServeOptions`` checks it first).
    """
    if log_format not in _FORMATTERS:
        raise ValueError(f"unknown log format {log_format!r}; valid: {', '.join(FORMATS)}")
    formatter = _FORMATTERS[log_format]()
    root = logging.getLogger()
    handler: logging.Handler | None = None
    kept = logging.logThreads, logging.logProcesses, logging.logMultiprocessing, logging._srcfile
    if not root.handlers:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(formatter)
        root.addHandler(handler)
        logging.captureWarnings(True)
        # Neither format writes a record's thread, process or caller: not looking them up (the logging HOWTO's
        # "Optimization") takes 3 of a record's 6.5 us.
        logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
        logging._srcfile = None
    level = log.level
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.setLevel(level)
        if handler is not None:
            logging.logThreads, logging.logProcesses, logging.logMultiprocessing, logging._srcfile = kept
            logging.captureWarnings(False)
            root.removeHandler(handler)
