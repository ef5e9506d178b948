"""The bytes of requests the server holds at once, across both front doors (:class:`BodyBudget`).

Note: one budget, two doors.
    HTTP counts a body's bytes as they arrive (``_http``, Note: the body); gRPC cannot, since grpc's
    core receives a message before onnxpipe sees a byte of it, and takes all of it (up to
    ``--max-body-size``, the largest message) once a call reads. So a gRPC call *reserves*
    ``--max-body-size`` before it reads its message, and gives back what the message did not use
    once it is in (``_grpc``, Note: a message's bytes). Both draw on one budget of
    ``--max-inflight`` x ``--max-body-size``: what both doors hold at once stays within it. An
    HTTP chunk that does not fit is refused at once (503), as before; a gRPC read that does not fit
    waits for room (within ``--body-timeout`` for a call, the idle timeout for a stream), since a
    call that has not begun to read holds no more than grpc's flow-control window. gRPC reads
    leave one ``--max-body-size`` of the budget free (where it holds two or more): a reservation
    costs a client nothing to make, so without that, 24 calls that announce large messages and
    stall kept every HTTP request out (503) for ``--body-timeout`` at a time, where an HTTP
    client must send the bytes it holds.

Note: memory given back.
    What a request held is freed once it is answered, but freed memory stays the process's: grpc's
    core receives a message in many small pieces, and the C allocator keeps their pages for reuse.
    After 24 partial 16 MiB gRPC messages ended (issue 36), the server's RSS stayed at 318 MB of a
    490 MB peak, against 101 MB before; so once :data:`TRIM_AFTER` bytes or more were given back
    and the budget has held nothing for :data:`QUIET_S` (looked at again each second until it
    does), the allocator is asked to return its free pages (glibc's ``malloc_trim``, on a thread:
    it walks the heap), and RSS went back to 103 MB. Only when quiet: a trim holds the allocator's
    locks while it walks, and every thread that allocates meanwhile waits, the event loop too.
    Trimming as soon as the budget emptied, after every 64 MiB request, took a health check's p99 /
    max from 36-43 / 44-84 ms to 47-63 / 86-99 ms under a stream of 64 MiB requests (two runs
    each); memory that traffic keeps reusing need not go back. Where the C library has no
    ``malloc_trim`` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable

from aiohttp import StreamReader

from onnxpipe.serve._errors import RequestError

__all__ = ["BodyBudget", "Held", "time_limit"]

#: Bytes given back after which an empty budget has the allocator return its free pages, and the
#: seconds it must stay empty first (see Note: memory given back).
TRIM_AFTER = 64 << 20
QUIET_S = 1.0


class BodyBudget:
    """The bytes the server holds for requests at once, across both doors and every connection
    (see Note: one budget, two doors; ``_http``, Note: what a request holds): each request's share
    (:meth:`hold`) counts what it holds as it makes it, or reserves it before a read, and gives it
    all back when its request is answered. Shares may take from any thread (inflating, decoding and
    encoding run on threads); waiting for room (:meth:`reserve`) and giving back happen on the
    event loop. Also the HTTP bodies being read, so that a drain can cut them short (``_http.drain``).

    Args:
        limit: The most bytes held at once (``--max-inflight`` x ``--max-body-size``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.lock = threading.Lock()
        self.reading: set[StreamReader] = set()  # the bodies being read (a web.Request is a mapping: not hashable)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._untrimmed = 0  # bytes given back since the allocator last returned its free pages
        self._trim: asyncio.TimerHandle | None = None  # the allocator's trim, due once the server is quiet

    def hold(self) -> Held:
        """A new request's share: what it takes is given back by :meth:`Held.release`."""
        return Held(self)

    def refusal(self, waited: str | None = None) -> RequestError:
        """The 503 of a request that does not fit, or (``waited``: how long, and its flag) that
        waited for room and got none."""
        if waited is not None:
            return RequestError(503, f"no room to read the request in {waited}: the server buffers at most {self.limit} bytes of requests "
                                     "at once (--max-inflight x --max-body-size), and held them all; retry later")
        return RequestError(503, f"the server holds {self.held} bytes for requests (bodies, their tensors, answers), the most it "
                                 f"buffers at once ({self.limit}: --max-inflight x --max-body-size); retry later")

    async def reserve(self, held: Held, size: int, leave: int = 0) -> None:
        """Take ``size`` bytes for ``held`` while ``leave`` more stay free, waiting for room first
        come, first served (cancel the caller to stop waiting: nothing is taken then)."""
        if not self._waiters and self.held + size + leave <= self.limit:
            held.take(size)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            while self._waiters[0] is not waiter or self.held + size + leave > self.limit:
                await waiter
                waiter = self._renewed(waiter)
            held.take(size)
        finally:
            self._waiters.remove(waiter)
            self._wake()

    def _renewed(self, waiter: asyncio.Future[None]) -> asyncio.Future[None]:
        """A fresh future in ``waiter``'s place in the queue (a future completes once)."""
        fresh = asyncio.get_running_loop().create_future()
        self._waiters[self._waiters.index(waiter)] = fresh
        return fresh

    def _wake(self) -> None:
        """Let the first waiter look again (room was given back, or the queue moved)."""
        if self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)

    def _given_back(self, size: int) -> None:
        """``size`` bytes were given back (on the loop): the first waiter looks again, and the
        allocator may return its free pages once the server is quiet (see Note: memory given back)."""
        self._wake()
        self._untrimmed += size
        if not self.held and self._untrimmed >= TRIM_AFTER and _malloc_trim is not None and self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(QUIET_S, self._trim_if_quiet)

    def _trim_if_quiet(self) -> None:
        """Return the allocator's free pages if nothing is held now; else look again later."""
        loop = asyncio.get_running_loop()
        if self.held:
            self._trim = loop.call_later(QUIET_S, self._trim_if_quiet)
            return
        self._trim, self._untrimmed = None, 0
        if _malloc_trim is not None:
            loop.run_in_executor(None, _malloc_trim, 0)


class Held:
    """One request's share of a :class:`BodyBudget`."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0
        self.released = False

    def take(self, size: int, what: str = "its body") -> None:
        """Count ``size`` more bytes this request holds (from any thread).

        Args:
            size: The bytes.
            what: What they are, for the refusal (``"its answer"``).

        Raises:
            RequestError: 503, the server holds as many bytes as it may, or the request was
                answered already (a thread still working for it takes nothing more); 413, this
                request alone would need more than that.
        """
        budget = self.budget
        with budget.lock:
            if self.released:
                raise RequestError(503, "the request was answered already")
            if self.bytes + size > budget.limit:
                raise RequestError(413, f"this request would hold {self.bytes + size} bytes of the server's memory ({size} for {what}), "
                                        f"more than it holds for all requests at once ({budget.limit}: --max-inflight x --max-body-size); "
                                        "send it in smaller requests, its tensors as binary data, or ask for binary outputs")
            if budget.held + size > budget.limit:
                raise budget.refusal()
            budget.held += size
            self.bytes += size

    def keep(self, size: int) -> None:
        """Hold ``size`` bytes from now on, less than taken: the rest is given back (on the loop)."""
        with self.budget.lock:
            extra = max(0, self.bytes - size)
            self.bytes -= extra
            self.budget.held -= extra
        if extra:
            self.budget._given_back(extra)

    def release(self) -> None:
        """Give back all this request holds, for good: what takes more after it is refused
        (idempotent; on the loop)."""
        with self.budget.lock:
            self.released = True
        self.keep(0)


def _libc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_trim()

if sys.version_info >= (3, 11):
    time_limit = asyncio.timeout  # a time limit for an await: TimeoutError past it
else:  # pragma: no cover - Python 3.10

    @contextlib.asynccontextmanager
    async def time_limit(seconds: float) -> AsyncIterator[None]:
        task = asyncio.current_task()
        assert task is not None
        handle = asyncio.get_running_loop().call_later(seconds, task.cancel)
        try:
            yield
        except asyncio.CancelledError:
            raise TimeoutError from None
        finally:
            handle.cancel()
