"""Large JSON requests decoded in worker processes, so that parsing them never stalls the event loop.

Note: a JSON worker.
    A thread frees the loop from pure-Python work but not from one C call that holds the
    interpreter throughout: ``json.loads`` of a 16 MiB JSON tensor takes 0.27 s, and numpy's
    conversion of the list it makes 0.05 s more, during which no health check is answered (the
    issue measured 0.8-1.6 s of stall for every client, HTTP and gRPC alike). So a request whose
    JSON header is ``_http.JSON_FROM`` bytes or more is decoded (parsed, checked, its tensors made)
    by ``_http._decode`` in a worker process of the server's own, started (with ``spawn``, as the
    server runs threads) before the server becomes ready. The request's bytes go to it over a
    socket pair, written from the body's own buffer (no copy in the server); its arrays come back
    the same way, read into arrays made for them. The worker runs only onnxpipe's own decoding on
    the request's bytes; what it sends back is built by it from them (arrays, strings, numbers),
    never anything a client wrote as code. ``--json-workers 0`` decodes on a thread instead.

Note: a worker's deadline.
    A worker can stop answering (swapped out, stopped, a pathological input: 52 MiB of
    ``parameters`` keys took one 10.7 s). A request waits at most ``--json-timeout`` seconds for a
    free worker (and, as it has not started, no longer than ``--request-timeout``), and holds one at
    most ``--json-timeout`` seconds more; past either it is answered 503 naming the flag, and a
    worker that took too long is killed and another started (a request that only waited kills
    nothing: the worker it waited for is someone else's). A request whose ``--request-timeout``
    ends while a worker decodes it is answered, and leaves the worker to finish (or to be killed at
    its ``--json-timeout``). What waits for a worker's answer is a thread of the workers' own (one
    a worker, more to start replacements), never one of asyncio's default executor, which the
    large binary requests' decoding and large answers' encoding use: a stuck worker holds its own
    thread and nothing else (it held every default thread, and with them every request of 1 MiB
    or more, for as long as it was stuck). A worker found ended when a request takes it
    (killed, or dead of its own while idle), or that ends before it has read the whole request, is
    replaced, and the request waits for another (once); one that ends after it had the request is
    replaced, and that request answered 503, not sent again: it may be what ended it.

Note: what a worker's answer holds.
    Before it sends a request's arrays, a worker says how many bytes they will take in the server
    (the arrays, BYTES elements, the rest of the request), and the server counts them against its
    request budget (``_http``, Note: what a request holds) first: a refusal (503, 413) reads nothing
    more, and the worker drops what it made. The worker's own memory is its process's: it holds one
    request at a time (the body, the parser's objects, the arrays), at most ``--max-body-size``
    times what a JSON byte takes as Python objects and arrays (``0,``, 2 bytes, is a list's 8-byte
    reference and an int64's 8 bytes before it is a float32's 4: 800-900 MB at its peak for 60 MiB
    of zeros).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import pickle
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

import numpy as np

from onnxpipe.serve._errors import RequestError
from onnxpipe.serve._models import Deadline, ModelPorts
from onnxpipe.serve._state import Decoded

__all__ = ["JsonWorkers"]

log = logging.getLogger("onnxpipe.serve")

#: Seconds a worker may take to start (its imports) before the server gives up on it.
_START_S = 120.0
_LENGTH = struct.Struct("<Q")


class JsonWorkers:
    """The server's JSON worker processes (see Note: a JSON worker).

    Args:
        count: How many; 0 for none (every request is decoded in the server's process).
        timeout: The most seconds a request may wait for a free worker, and then hold one
            (``--json-timeout``; see Note: a worker's deadline).
    """

    def __init__(self, count: int, timeout: float = 30.0) -> None:
        self.count = count
        self.timeout = timeout
        self._context = multiprocessing.get_context("spawn")
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._starting: set[asyncio.Task[None]] = set()
        self._settling: set[asyncio.Task[None]] = set()
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False

    def start(self) -> None:
        """Start the workers and wait until each has imported what decoding needs (on a thread)."""
        if not self.count or self._threads is not None:
            return
        self._threads = ThreadPoolExecutor(2 * self.count + 1, thread_name_prefix="onnxpipe-json")
        for worker in list(self._threads.map(lambda _: self._spawn(), range(self.count))):
            self._idle.put_nowait(worker)  # nothing waits on the queue yet: no loop to wake

    @property
    def running(self) -> bool:
        return self._threads is not None and not self._closed

    async def decode(self, ports: ModelPorts, body: memoryview, header_length: int | None, reserve: Callable[[int], None],
                     deadline: Deadline | None = None) -> Decoded:
        """``_http._decode`` of a request, in a worker (see Note: a worker's deadline).

        Args:
            ports: The model's.
            body: The request's body (inflated).
            header_length: Its ``Inference-Header-Content-Length``.
            reserve: Counts the bytes the worker's answer will take, before it is read; raises
                :class:`RequestError` to refuse it (see Note: what a worker's answer holds).
            deadline: The request's ``--request-timeout``: it waits for a worker, and for its
                answer, no longer (a worker it leaves finishes, within ``--json-timeout``).

        Raises:
            RequestError: as ``_decode`` and ``reserve``; 503 when no worker was free within
                ``--json-timeout`` (or by the ``deadline``), when the worker took longer than that
                on it, or when the worker ended on it.
        """
        assert self._threads is not None
        waits = asyncio.get_running_loop().time() + self.timeout
        for retry in (False, True):
            worker = await self._take(waits, deadline, ports.name)
            try:
                return await self._held(worker, ports, body, header_length, reserve, deadline)
            except _Ended as e:
                if e.taken or retry:
                    raise RequestError(503, "the server's JSON worker ended while decoding this request; retry it, or send large tensors "
                                            "as binary data") from None
        raise AssertionError("unreachable: the second try returns or raises")

    async def _held(self, worker: _Worker, ports: ModelPorts, body: memoryview, header_length: int | None, reserve: Callable[[int], None],
                    deadline: Deadline | None) -> Decoded:
        """The request decoded by ``worker``, which it holds until then, at most ``--json-timeout``
        (and its ``deadline``); the worker goes back to the free ones, or is replaced (see Note: a
        worker's deadline)."""
        assert self._threads is not None
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.timeout
        run = loop.run_in_executor(self._threads, worker.decode, ports, body, header_length, reserve)
        until = ends if deadline is None else min(ends, loop.time() + deadline.left())
        try:
            decoded = await asyncio.wait_for(asyncio.shield(run), until - loop.time())
        except asyncio.TimeoutError:
            if deadline is not None and until < ends:  # the request's time is up, not the worker's: it goes on
                self._settle(worker, run, ends)
                raise deadline.expired(ports.name) from None
            run.cancel()  # its thread's wait ends as the worker is killed: nobody reads it
            self._replace(worker, f"took over {self.timeout:g} s (--json-timeout) on a request: killed")
            raise RequestError(503, f"the request's JSON was not decoded within {self.timeout:g} s (--json-timeout); retry later, or "
                                    "send large tensors as binary data") from None
        except asyncio.CancelledError:  # the client went away, or the server stops
            self._settle(worker, run, ends)
            raise
        except _Ended as e:
            self._replace(worker, "ended while decoding a request" if e.taken else "had ended while idle")
            raise
        except Exception:  # the request's mistake, its refusal, or a bug in decoding: the worker is well
            self._idle.put_nowait(worker)
            raise
        self._idle.put_nowait(worker)
        return decoded

    def _settle(self, worker: _Worker, run: asyncio.Future[Decoded], ends: float) -> None:
        """Let ``worker`` finish a request nobody waits for any more, until ``ends``; then free it, or replace it."""
        task = asyncio.get_running_loop().create_task(self._settled(worker, run, ends))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settled(self, worker: _Worker, run: asyncio.Future[Decoded], ends: float) -> None:
        try:
            await asyncio.wait_for(run, max(0.0, ends - asyncio.get_running_loop().time()))
        except asyncio.TimeoutError:
            self._replace(worker, f"took over {self.timeout:g} s (--json-timeout) on a request: killed")
            return
        except _Ended:
            self._replace(worker, "ended while decoding a request")
            return
        except Exception:  # the request's own failure (answered already): the worker is well
            pass
        self._idle.put_nowait(worker)

    async def _take(self, ends: float, deadline: Deadline | None, model: str) -> _Worker:
        """A free worker, alive (one found ended is replaced: see Note: a worker's deadline), by ``ends`` (the loop's time).

        Raises:
            RequestError: 503, none was free by ``ends`` (or the ``deadline``).
        """
        loop = asyncio.get_running_loop()
        while True:
            self._fill()
            left = ends - loop.time()
            waiting = deadline is not None and deadline.left() < left
            if deadline is not None and waiting:
                left = deadline.left()
            try:
                worker = await asyncio.wait_for(self._idle.get(), left) if left > 0 else self._idle.get_nowait()
            except (asyncio.TimeoutError, asyncio.QueueEmpty):
                if deadline is not None and waiting:
                    raise deadline.expired(model) from None
                raise RequestError(503, f"no JSON worker was free to decode the request within {self.timeout:g} s (--json-timeout; "
                                        f"--json-workers {self.count}); retry later, or send large tensors as binary data") from None
            if worker.alive:
                return worker
            worker.sock.close()
            self._replace(worker, "had ended while idle")

    def _replace(self, worker: _Worker, why: str | None) -> None:
        """Kill ``worker`` (the wait of a thread on it ends with it, and closes its socket) and start another in its place."""
        if why is not None:
            log.error(f"a JSON worker process {why}; starting another")
        worker.kill()
        self._all.discard(worker)
        self._fill()

    def _fill(self) -> None:
        """Start workers until there are ``count`` (running or starting)."""
        while not self._closed and len(self._all) + len(self._starting) < self.count:
            task = asyncio.get_running_loop().create_task(self._respawn())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _respawn(self) -> None:
        assert self._threads is not None
        try:
            worker = await asyncio.get_running_loop().run_in_executor(self._threads, self._spawn)
        except (OSError, EOFError, TimeoutError) as e:
            log.error(f"a JSON worker process could not be started ({type(e).__name__}: {e}); {len(self._all)} running")
            return
        if self._closed:
            worker.stop()
        else:
            self._idle.put_nowait(worker)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._context)
        try:
            worker.wait_ready(_START_S)
        except BaseException:
            worker.kill()
            raise
        self._all.add(worker)
        return worker

    def close(self) -> None:
        """Stop every worker (on a thread, as the server stops)."""
        self._closed = True
        workers = list(self._all)
        self._all.clear()
        for worker in workers:
            worker.sock.close()  # each ends as its socket does
        for worker in workers:
            worker.stop()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)


class _Ended(Exception):
    """The worker's process ended: before it had read the whole request (``taken`` false) or after."""

    def __init__(self, taken: bool) -> None:
        super().__init__("the JSON worker ended")
        self.taken = taken


class _WorkerTrace(Exception):
    """A bug's traceback in the worker, as the cause of the server's exception: the log shows it, the client never does."""

    def __str__(self) -> str:
        return f"\n\nin the JSON worker:\n{self.args[0]}"


class _Worker:
    """One worker process and the server's end of its socket pair."""

    def __init__(self, context: SpawnContext) -> None:
        ours, theirs = socket.socketpair()
        self.process: SpawnProcess = context.Process(target=_main, args=(theirs,), daemon=True, name="onnxpipe-json")
        try:
            self.process.start()
        finally:
            theirs.close()  # the worker's end is the worker's alone: its exit closes the pair
        self.sock = ours

    def wait_ready(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            if _receive(self.sock) != "ready":
                raise EOFError("the JSON worker did not start")
        finally:
            self.sock.settimeout(None)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def decode(self, ports: ModelPorts, body: memoryview, header_length: int | None, reserve: Callable[[int], None]) -> Decoded:
        """The request decoded by the worker (on a thread of the workers': it waits for it).

        Raises:
            _Ended: the worker ended (``taken``: after it had the whole request).
            RequestError: the request's mistake, or ``reserve``'s refusal.
        """
        try:
            _send(self.sock, (ports, header_length, len(body)))
            self.sock.sendall(body)
        except OSError:  # a process killed is alive, its socket open, until its last thread ends
            self.sock.close()
            raise _Ended(taken=False) from None
        try:
            kind, value = _receive(self.sock)
            if kind == "cost":
                try:
                    reserve(value)
                except RequestError:
                    _send(self.sock, False)  # the worker drops what it made
                    raise
                _send(self.sock, True)
                value = self._arrays()
        except (OSError, EOFError):
            self.sock.close()  # here, where it was in use (its process is ended: see JsonWorkers._replace)
            raise _Ended(taken=True) from None
        if kind == "error":
            raise value  # the request's RequestError
        if kind == "bug":
            line, trace = value
            raise RuntimeError(f"in the JSON worker: {line}") from _WorkerTrace(trace)
        return value

    def _arrays(self) -> Decoded:
        decoded, raw, order = _receive(self.sock)
        arrays = decoded.arrays
        for name, dtype, shape in raw:
            arrays[name] = np.empty(shape, dtype)
            _receive_into(self.sock, _bytes_of(arrays[name]))
        decoded.arrays = {name: arrays[name] for name in order}  # the request's order
        return decoded

    def kill(self) -> None:
        """End the process now (a stopped one too); reaped by :meth:`stop` or the next look at :attr:`alive`."""
        if self.process.exitcode is None:
            self.process.kill()

    def stop(self) -> None:
        """End the process (as its socket closes, else killed) and reap it."""
        self.sock.close()
        self.process.join(2.0)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def _send(sock: socket.socket, value: object) -> None:
    data = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    header = bytearray(_LENGTH.size)
    _receive_into(sock, memoryview(header))
    data = bytearray(_LENGTH.unpack(header)[0])
    _receive_into(sock, memoryview(data))
    return pickle.loads(data)  # from the server's own worker (see Note: a JSON worker)


def _receive_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise EOFError("the other end closed")
        view = view[n:]


def _bytes_of(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes."""
    return array.reshape(-1).view(np.uint8).data


def _main(sock: socket.socket) -> None:
    """A worker: decode each request the server sends, until its socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server drains, then closes us
    from onnxpipe.serve._http import _decode as decode  # what decoding needs, imported once

    _send(sock, "ready")
    while True:
        try:
            ports, header_length, size = _receive(sock)
        except EOFError:
            return
        body = bytearray(size)
        _receive_into(sock, memoryview(body))
        try:
            decoded = decode(ports, memoryview(body), header_length)
        except RequestError as e:
            _send(sock, ("error", e))
            continue
        except Exception as e:  # a bug: the server logs it as one, with this traceback
            _send(sock, ("bug", (f"{type(e).__name__}: {e}", traceback.format_exc())))
            continue
        _answer(sock, decoded)


def _answer(sock: socket.socket, decoded: Decoded) -> None:
    """Send ``decoded``: its cost first, then, if the server takes it, the rest and each array's bytes
    (see Note: what a worker's answer holds)."""
    raw = {name: a if a.flags.c_contiguous else a.copy() for name, a in decoded.arrays.items() if a.dtype.kind != "O"}
    kept = {name: a for name, a in decoded.arrays.items() if a.dtype.kind == "O"}  # BYTES elements travel pickled
    specs = [(name, a.dtype.str, a.shape) for name, a in raw.items()]
    head = pickle.dumps((dataclasses.replace(decoded, arrays=kept), specs, list(decoded.arrays)), pickle.HIGHEST_PROTOCOL)
    cost = len(head) + sum(a.nbytes for a in decoded.arrays.values()) + sum(sum(map(sys.getsizeof, a.flat)) for a in kept.values())
    _send(sock, ("cost", cost))
    if not _receive(sock):
        return
    sock.sendall(_LENGTH.pack(len(head)) + head)
    for array in raw.values():
        sock.sendall(_bytes_of(array))
