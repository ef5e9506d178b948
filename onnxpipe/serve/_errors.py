"""The one error a request can end in, with the status each protocol answers it with, and how a
message shows what the request gave.

Note: a message shows a bounded part of the request.
    A request's names and values reach messages cut to :data:`SHOWN` characters, with their full
    length (``'aaaa…' (1048576 characters)``), and a whole message to :data:`MESSAGE_MOST`: an error
    must not cost more than the mistake, nor outgrow what a client takes (gRPC sends the message in
    a trailer, which clients cap at 8-16 KiB: past it the client sees RESOURCE_EXHAUSTED instead of
    the error). The closest valid names are looked for only for names of at most :data:`NEAR_MOST`
    characters: difflib over a 16 MiB name took seconds and 680 MB (issue 28).
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable

from onnxpipe._errors import OnnxpipeError, closest

__all__ = ["RequestError", "printable"]

#: HTTP status -> the gRPC status code name Triton maps the same error to (grpc_utils.cc).
_GRPC = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    413: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
}
#: The most characters of a request's name or value a message shows (see Note: a message shows a
#: bounded part of the request), of a whole message, and of a name the closest names are looked for.
SHOWN = 100
MESSAGE_MOST = 4096
NEAR_MOST = 256
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHOWN
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = 32  # a shape of the largest rank, whole


class RequestError(OnnxpipeError):
    """A request the server answers with an error: ``{"error": message}`` and ``status`` over HTTP,
    the matching status code over gRPC.

    Attributes:
        status: The HTTP status (400 bad request, 401 no or wrong token, 404 unknown version, 408
            body too slow, 413 body too large, 500 a stage failed, 503 busy or shutting down).
        detail: The whole text the server's log keeps, where the answer says less (a stage's
            failure without onnxruntime's source paths: ``_models``, Note: what a failure
            shows); ``None``: the message is all.
    """

    def __init__(self, status: int, message: str, detail: str | None = None) -> None:
        super().__init__(_cut(message, MESSAGE_MOST))
        self.status = status
        self.detail = detail

    def __reduce__(self) -> tuple[type[RequestError], tuple[int, str, str | None]]:
        return RequestError, (self.status, str(self), self.detail)  # from a JSON worker process (_jsonwork), whole

    @property
    def grpc_code(self) -> str:
        """The name of the ``grpc.StatusCode`` for this error."""
        return _GRPC.get(self.status, "UNKNOWN")


def bad_request(message: str) -> RequestError:
    """A 400: the request does not fit the protocol or the model."""
    return RequestError(400, message)


def shown(value: object, most: int = SHOWN) -> str:
    """A name or value from a request as a message shows it (see Note: a message shows a bounded
    part of the request).

    Returns:
        A string quoted as Python writes it (control characters and lone surrogates escaped), cut to
        ``most`` characters with an ellipsis and its full length; anything else as :mod:`reprlib`
        writes it (which never builds the whole text of a large list), cut the same way, with the
        count of values of a list.
    """
    if not isinstance(value, str):
        text = _REPR.repr(value)
        if len(text) <= most:
            return text
        return f"{text[:most]}…" + (f" ({len(value)} values)" if isinstance(value, (list, tuple, dict)) else "")
    if len(value) <= most:
        return repr(value)
    text = repr(value[:most])
    return f"{text[:-1]}…{text[-1]} ({len(value)} characters)"


def printable(text: str) -> str:
    """``text`` as a log line or an error line shows what a client or the file system chose (a
    path, a name, a message): as it is when every character is printable, else with Python's
    escapes (``\\n``, ``\\x1b``, ``\\xe8``), so that it cannot end its line, begin another, or write a
    terminal's control sequence."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def near(name: str, choices: Iterable[str]) -> str:
    """The valid names for a message about the unknown ``name``: the closest first (as
    :func:`onnxpipe._errors.closest`), or only the valid ones for a name too long to compare."""
    pool = list(choices)
    return closest(name if len(name) <= NEAR_MOST else "", pool, n=max(len(pool), 1))  # "" is close to nothing


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else f"{text[:most]}… ({len(text)} characters)"
