"""The one error a request can end in, with the status each protocol answers it with."""

from __future__ import annotations

from onnxpipe._errors import OnnxpipeError

__all__ = ["RequestError"]

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


class RequestError(OnnxpipeError):
    """A request the server answers with an error: ``{"error": message}`` and ``status`` over HTTP,
    the matching status code over gRPC.

    Attributes:
        status: The HTTP status (400 bad request, 401 no or wrong token, 404 unknown version, 408
            body too slow, 413 body too large, 500 a stage failed, 503 busy or shutting down).
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def grpc_code(self) -> str:
        """The name of the ``grpc.StatusCode`` for this error."""
        return _GRPC.get(self.status, "UNKNOWN")


def bad_request(message: str) -> RequestError:
    """A 400: the request does not fit the protocol or the model."""
    return RequestError(400, message)
