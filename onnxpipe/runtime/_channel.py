"""A bounded, closable FIFO between pipeline stages.

``queue.Queue`` cannot be closed before Python 3.13, and polling it with timeouts either spins or
delays shutdown. A :class:`Channel` blocks producers while full and consumers while empty on one
condition variable (no spinning), and :meth:`Channel.close` wakes every waiter at once.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

__all__ = ["Channel", "Closed"]

T = TypeVar("T")


class Closed(Exception):
    """The channel was closed."""


class Channel(Generic[T]):
    """A FIFO holding at most ``capacity`` items.

    Args:
        capacity: Items it holds before :meth:`put` blocks (at least 1).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        self.high_water = 0  # the most items it ever held

    def put(self, item: T) -> None:
        """Append, waiting while the channel is full.

        Raises:
            Closed: the channel is closed (before or while waiting).
        """
        with self._not_full:
            while len(self._items) >= self.capacity and not self._closed:
                self._not_full.wait()
            if self._closed:
                raise Closed
            self._items.append(item)
            self.high_water = max(self.high_water, len(self._items))
            self._not_empty.notify()

    def get(self) -> T:
        """Take the oldest item, waiting while the channel is empty.

        Raises:
            Closed: the channel is closed.
        """
        with self._not_empty:
            while not self._items and not self._closed:
                self._not_empty.wait()
            if self._closed:
                raise Closed
            item = self._items.popleft()
            self._not_full.notify()
            return item

    def close(self) -> list[T]:
        """Close the channel, wake every waiter, and return the items it still held."""
        with self._lock:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()
        return left

    def __len__(self) -> int:
        return len(self._items)
