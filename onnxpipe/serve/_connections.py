"""The HTTP listener's connections: how many, how long idle, and what a malformed request gets.

Note: connections.
    Every connection costs a file descriptor, and a process has a limit of them (``RLIMIT_NOFILE``,
    1024 on many hosts): once idle sockets hold them all, every new client fails, answered by
    nobody. So the listener takes at most ``max_connections`` at once (by default half the
    descriptors this process may open, less 64 for its models, logs and gRPC): one more is
    answered ``503`` with a JSON error and closed at once, and the refusals are logged (one line,
    then at most one a second with their count). A connection must send a complete request head
    within ``idle_timeout`` seconds of connecting or of its previous answer, or it is closed: the
    deadline a slowloris client (one header line every 10 s) and an idle keep-alive connection
    both meet (aiohttp's keep-alive timer, which partial header lines do not reset). A request
    aiohttp's parser refuses (a header over 8 KiB, a NUL in a header, a bad chunk size, TLS or
    HTTP/2 on the port) is answered ``400`` with the protocol's JSON error and logged as one line,
    no traceback.

Note: the metrics port.
    The metrics port takes few connections (a scraper holds one), so a handful of idle sockets
    would fill it, and Prometheus would be refused until their idle deadline. There, a connection
    over the cap is let in, and the oldest connection is closed instead, an idle one first (one
    with no request in progress: a scrape is answered in milliseconds); the closings are logged as
    the refusals are. A scrape sends its request as it connects, so its connections also have a
    short head deadline (``_server``'s ``_METRICS_HEAD_S``): what holds the port without asking
    is closed within seconds, not ``idle_timeout``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from collections.abc import Collection

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

__all__ = ["Gate", "GatedSite", "default_max_connections"]

log = logging.getLogger("onnxpipe.serve")
_RESERVED_FDS = 64  # for the models' files, the logs, gRPC and the pipelines' own


def default_max_connections() -> int:
    """Half the file descriptors this process may open, less :data:`_RESERVED_FDS` (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, (soft - _RESERVED_FDS) // 2)


class Gate:
    """The protocol factory of the HTTP listener: aiohttp's server's, capped (see Note: connections).

    Args:
        server: The aiohttp ``web.Server`` of the runner (``runner.server``).
        most: The most connections open at once.
        evict: At the cap, close the oldest connection (idle ones first) to let the new one in,
            rather than refuse it (see Note: the metrics port).
    """

    def __init__(self, server: web.Server, most: int, evict: bool = False) -> None:
        self.server = server
        self.most = most
        self.evict = evict
        self._logged_at = 0.0
        self._unlogged = 0

    def _table(self) -> Collection[RequestHandler]:
        """aiohttp's connections, oldest first: a closed one stays until its handler ends."""
        connections = getattr(self.server, "_connections", None)
        return connections if connections is not None else self.server.connections

    def __call__(self) -> asyncio.Protocol:
        table = self._table()
        if len(table) >= self.most:
            if not self.evict:
                self._note("refused %d connection(s): %d are open, the most this server takes (--max-connections)")
                return _Refused(self.most)
            live = [h for h in table if h.transport is not None]  # past the ones closed already, which leave the table soon
            if len(live) >= self.most:
                self._close_oldest(live)
        return _JsonErrors(self.server, loop=self.server._loop, **self.server._kwargs)

    def _close_oldest(self, live: list[RequestHandler]) -> None:
        """Close the oldest of ``live``, an idle one (no request in progress) first (see Note: the metrics port)."""
        idle = [h for h in live if not getattr(h, "_request_in_progress", False)]
        victim = (idle or live)[0]
        transport = victim.transport
        victim.force_close()
        if transport is not None:
            transport.abort()  # at once, its unsent answers dropped: a close would wait for a client that never reads, holding the fd
        self._note("closed %d connection(s) of the metrics port, the oldest idle first, to let new ones in: it holds %d at once")

    def _note(self, what: str) -> None:
        """Log ``what`` (its count and the cap), at most once a second."""
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            log.warning(what, self._unlogged, self.most)
            self._logged_at, self._unlogged = now, 0


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed before it is read."""

    def __init__(self, most: int) -> None:
        body = json.dumps({"error": f"the server holds {most} connections, the most it takes (--max-connections); retry later"}).encode()
        self.answer = (
            b"HTTP/1.1 503 Service Unavailable\r\nServer: onnxpipe\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\nRetry-After: 1\r\n\r\n".encode()
            + body
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.answer)  # type: ignore[attr-defined]  # a TCP transport (uvloop's is no asyncio.WriteTransport subclass)
        transport.close()


class _JsonErrors(RequestHandler):
    """aiohttp's connection handler, answering what its parser refuses with the protocol's JSON
    error and one log line (see Note: connections)."""

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None) -> web.Response:
        what = getattr(exc, "message", None) or message or (str(exc) if exc is not None else "") or "malformed request"
        text = " ".join(str(what).split())[:200]
        if status >= 500:
            log.error("error on an HTTP request from %s: %s: %s", request.remote, type(exc).__name__ if exc else "error", text)
        else:
            log.warning("bad HTTP request from %s: %s", request.remote, text)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has been sent in part: the connection is closed")
        reason = "internal error" if status >= 500 else text
        response = web.Response(status=status, body=json.dumps({"error": reason}).encode(), content_type="application/json", headers={"Server": "onnxpipe"})
        response.force_close()
        return response


class GatedSite(web.SockSite):
    """aiohttp's site on a bound socket, its connections let in by a :class:`Gate` (``evict``: see it)."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, most: int, backlog: int, evict: bool = False) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self.most = most
        self.evict = evict
        self.gate: Gate | None = None

    async def start(self) -> None:
        self._runner._reg_site(self)
        server = self._runner.server
        assert server is not None
        self.gate = Gate(server, self.most, self.evict)
        self._server = await asyncio.get_running_loop().create_server(self.gate, sock=self._sock, backlog=self._backlog)
