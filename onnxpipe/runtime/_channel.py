"""A bounded, closable FIFO between pipeline stages.

Note: why two SimpleQueues.
    ``queue.Queue`` cannot be closed before Python 3.13, and its condition variables are written in
    Python: every blocking hand-over allocates a lock. A :class:`Channel` is two
    ``queue.SimpleQueue`` (implemented in C): one holds the items, the other holds one token per
    free slot. :meth:`Channel.put` takes a slot token (blocking while the channel is full) and a
    :class:`Reader` returns it after taking an item (blocking while it is empty); both block
    in C, without spinning, about 4 us per hand-over faster than a condition variable.
    :meth:`Channel.close` drops a poison token into both queues; whoever takes it puts it back
    and raises :class:`Closed`, so every waiter, however many, wakes up.

Note: fewer wake-ups.
    A stage worker reads through a :class:`Reader`, which gives freed slots back two at a time
    (half the default depth of 4). When the stage before it (or the caller submitting requests)
    is faster and waits on a full channel, it then wakes once per two requests instead of once per
    request. On a machine where every core runs a stage, each wake-up preempts a stage: measured
    on 2 cores with squeezenet in 2 stages, the submitting thread's CPU per request fell from about
    90 to about 58 us.

Note: no timed SimpleQueue.get.
    CPython's ``SimpleQueue.get(timeout=t)`` (3.10-3.12) loops when it wakes and finds the queue
    empty (another reader took the item, or the lock was already free when it started) and
    recomputes the time left; once the deadline has passed, that is negative, and a negative
    timeout makes the lock wait forever (``threading.Lock.acquire`` guards against this; the
    queue does not). A batching stage's worker waiting ``max_delay_ms`` for more requests did
    exactly that, with two replicas on one channel or a thread descheduled past its deadline:
    ``tests/runtime/test_batching.py::test_replicas_share_the_stateless_queue_and_batch_from_it``
    hung a fresh clone's ``make test`` with the worker in ``PyThread_acquire_lock_timed`` and the
    last requests taken, never run, until something else was put. So a timed wait never blocks
    in the queue: :meth:`Reader.get_more` looks, then sleeps and looks again (50 us doubling to
    1 ms) until its deadline. It runs only while a batch waits to fill (at most ``max_delay_ms``
    a batch); a request that comes meanwhile joins at most 1 ms after it came. Untimed gets block
    in C as before.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Generic, TypeVar

__all__ = ["Channel", "Closed", "Full", "Reader"]

T = TypeVar("T")
_POISON: Any = object()
_FIRST_PAUSE, _LONGEST_PAUSE = 5e-5, 1e-3  # seconds between looks while a batch waits for more (Note: no timed SimpleQueue.get)


class Closed(Exception):
    """The channel was closed."""


class Full(Exception):
    """A :meth:`Channel.put` that was not to wait would have had to (no free slot now)."""


class Channel(Generic[T]):
    """A FIFO holding at most ``capacity`` items.

    Args:
        capacity: Items it holds before :meth:`put` blocks (at least 1).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._slots: queue.SimpleQueue[object] = queue.SimpleQueue()
        for _ in range(capacity):
            self._slots.put(None)
        self._closed = False
        self.high_water = 0  # the most items it ever held

    def put(self, item: T, block: bool = True) -> None:
        """Append, waiting while the channel is full (or, when ``block`` is false, refusing).

        Raises:
            Closed: the channel is closed (before or while waiting).
            Full: ``block`` is false and no slot is free now (the channel is full, or its reader
                has not given freed slots back yet).
        """
        if self._closed:
            raise Closed
        try:
            slot = self._slots.get(block)
        except queue.Empty:
            raise Full from None
        if slot is _POISON:
            self._slots.put(_POISON)
            raise Closed
        self._items.put(item)
        held = self._items.qsize()
        if held > self.high_water:
            self.high_water = held

    def reader(self) -> Reader[T]:
        """The way to take items: one reader per consumer thread (see :class:`Reader`)."""
        return Reader(self)

    def close(self) -> list[T]:
        """Close the channel, wake every waiter, and return the items it still held."""
        self._closed = True
        left: list[T] = []
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if item is not _POISON:
                left.append(item)
        self._items.put(_POISON)
        self._slots.put(_POISON)
        return left

    def __len__(self) -> int:
        return max(0, self._items.qsize() - self._closed)


class Reader(Generic[T]):
    """One consumer's end of a :class:`Channel`, for a worker that takes items in a loop.

    It gives freed slots back ``batch`` at a time (half the capacity), so a producer blocked on
    a full channel wakes once per ``batch`` items instead of once per item: on a machine where
    every core runs a stage, each wake-up preempts a stage. It never blocks while holding slots
    back, so a producer can never wait on a slot that a waiting consumer keeps.
    """

    def __init__(self, channel: Channel[T]) -> None:
        self._items = channel._items
        self._slots = channel._slots
        self.batch = max(1, channel.capacity // 2)
        self._owed = 0

    def get(self) -> T:
        """Take the oldest item, waiting while the channel is empty.

        Raises:
            Closed: the channel is closed.
        """
        if not self._owed:
            item = self._items.get()
        elif not self._items.qsize():
            self._give_back()  # about to wait: never wait holding slots
            item = self._items.get()
        else:
            try:
                item = self._items.get_nowait()
            except queue.Empty:  # another replica took it meanwhile
                self._give_back()
                item = self._items.get()
        return self._took(item)

    def get_more(self, timeout: float) -> T | None:
        """Take the oldest item if one comes within ``timeout`` seconds (0: only one already
        queued); ``None`` otherwise. What a stage that batches takes after its first item.

        Raises:
            Closed: the channel is closed.
        """
        try:
            return self._took(self._items.get_nowait())
        except queue.Empty:
            if timeout <= 0:
                return None
        if self._owed:
            self._give_back()  # about to wait: never wait holding slots
        item = self._wait(timeout)
        return None if item is None else self._took(item)

    def _wait(self, timeout: float) -> T | None:
        """The next item if one comes within ``timeout`` seconds, else ``None`` (Note: no timed
        SimpleQueue.get): it looks again after sleeps that double from 50 us to 1 ms."""
        clock = time.monotonic
        deadline = clock() + timeout
        pause = _FIRST_PAUSE
        while True:
            left = deadline - clock()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(2 * pause, _LONGEST_PAUSE)
            try:
                return self._items.get_nowait()
            except queue.Empty:
                continue

    def _took(self, item: T) -> T:
        """Account for an item taken (a slot owed back), or raise :class:`Closed` on the poison."""
        if item is _POISON:
            self._items.put(item)
            raise Closed
        self._owed += 1
        if self._owed >= self.batch:
            self._give_back()
        return item

    def _give_back(self) -> None:
        put = self._slots.put
        for _ in range(self._owed):
            put(None)
        self._owed = 0
