"""Large JSON requests decoded in a worker process, so that parsing them never stalls the event loop.

Note: a JSON worker.
    A thread frees the loop from pure-Python work but not from one C call that holds the
    interpreter throughout: ``json.loads`` of a 16 MiB JSON tensor takes 0.27 s, and numpy's
    conversion of the list it makes 0.05 s more, during which no health check is answered (the
    issue measured 0.8-1.6 s of stall for every client, HTTP and gRPC alike). So a request whose
    JSON header is :data:`FROM` bytes or more is decoded (parsed, checked, its tensors made) by
    ``_http._decode`` in a worker process of the server's own, started (with ``spawn``, as the
    server runs threads) when the server becomes ready. The request's bytes go to it through a
    pipe and its arrays come back the same way: copies the loop's process makes without holding
    the interpreter for more than a memcpy. The worker runs only onnxpipe's own decoding on the
    request's bytes; what it sends back is built by it from them (arrays, strings, numbers), never
    anything a client wrote as code. A worker that dies (killed for memory) is replaced, and the
    request it held is answered 503. ``--json-workers 0`` decodes on a thread instead.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from onnxpipe.serve._errors import RequestError
from onnxpipe.serve._models import ModelPorts
from onnxpipe.serve._state import Decoded

__all__ = ["JsonWorkers"]

log = logging.getLogger("onnxpipe.serve")


class JsonWorkers:
    """The server's JSON worker processes (see Note: a JSON worker).

    Args:
        count: How many; 0 for none (every request is decoded in the server's process).
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the workers and wait until each has imported what decoding needs."""
        if self.count and self._pool is None:
            self._pool = self._new()
            for future in [self._pool.submit(_ready) for _ in range(self.count)]:
                future.result(timeout=120)

    def _new(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("spawn"), initializer=_ready)

    @property
    def running(self) -> bool:
        return self._pool is not None

    def decode(self, ports: ModelPorts, body: memoryview, header_length: int | None) -> Decoded:
        """``_http._decode`` of a request, in a worker (called on a thread: it waits for the worker).

        Raises:
            RequestError: as ``_decode``; 503 when the worker died on it.
        """
        pool = self._pool
        assert pool is not None
        try:
            return pool.submit(_decode, ports, bytes(body), header_length).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    log.error("a JSON worker process ended while decoding a request; starting another")
                    self._pool = self._new()
            pool.shutdown(wait=False)
            raise RequestError(503, "the server's JSON worker ended while decoding this request; retry it, or send large tensors as binary data") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _ready() -> None:
    """What a worker runs first: the imports decoding needs."""
    import onnxpipe.serve._http  # noqa: F401


def _decode(ports: ModelPorts, body: bytes, header_length: int | None) -> Decoded:
    from onnxpipe.serve._http import _decode as decode

    return decode(ports, memoryview(body), header_length)
