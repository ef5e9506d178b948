"""Channels between stages: FIFO, bounded, closable, and readers that give slots back in batches
without ever waiting while they hold one back."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest

from onnxpipe.runtime._channel import Channel, Closed


def _eventually(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.001)
    return condition()


def _inside_channel(thread: threading.Thread) -> bool:
    """The thread is in a call of the channel (``put`` or ``get``: about to wait or waiting there)."""
    frame = sys._current_frames().get(thread.ident or 0)
    return frame is not None and frame.f_code.co_name in {"put", "get"} and frame.f_code.co_filename.endswith("_channel.py")


def _start(target: Callable[[], object]) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_items_come_out_in_order_and_capacity_is_checked() -> None:
    c: Channel[int] = Channel(3)
    for i in range(3):
        c.put(i)
    assert len(c) == 3 and c.high_water == 3
    reader = c.reader()
    assert [reader.get() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="capacity must be at least 1, got 0"):
        Channel(0)


def test_a_full_channel_blocks_the_producer_until_a_batch_of_slots_is_free() -> None:
    c: Channel[int] = Channel(4)
    reader = c.reader()
    assert reader.batch == 2
    for i in range(4):
        c.put(i)
    producer = _start(lambda: c.put(4))
    assert reader.get() == 0
    producer.join(0.05)
    assert producer.is_alive(), "one free slot: the producer waits for the batch"
    assert reader.get() == 1
    producer.join(5)
    assert not producer.is_alive()
    assert [reader.get() for _ in range(3)] == [2, 3, 4]


def test_a_reader_never_waits_holding_slots_back() -> None:
    c: Channel[int] = Channel(4)
    reader = c.reader()
    c.put(0)
    assert reader.get() == 0  # one slot held back
    got: list[int] = []
    waiter = _start(lambda: got.append(reader.get()))
    assert _eventually(lambda: c._slots.qsize() == 4), "the waiting reader gave its slot back"
    for i in range(1, 5):  # the whole capacity is usable again
        c.put(i)
    waiter.join(5)
    assert got == [1]


def test_several_readers_and_a_fast_producer_deliver_everything_once_without_deadlock() -> None:
    c: Channel[int] = Channel(4)
    seen: list[list[int]] = [[], [], []]

    def consume(k: int) -> None:
        reader = c.reader()
        try:
            while True:
                seen[k].append(reader.get())
        except Closed:
            return

    consumers = [_start(lambda k=k: consume(k)) for k in range(3)]
    for i in range(20_000):
        c.put(i)
    assert _eventually(lambda: sum(map(len, seen)) == 20_000)
    c.close()
    for t in consumers:
        t.join(5)
        assert not t.is_alive()
    assert sorted(x for s in seen for x in s) == list(range(20_000))
    for s in seen:
        assert s == sorted(s), "each reader sees items in channel order"


def test_close_wakes_every_waiter_and_returns_what_was_left() -> None:
    full: Channel[int] = Channel(1)
    full.put(7)
    empty: Channel[int] = Channel(2)
    errors: list[str] = []

    def expect_closed(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Closed:
            errors.append("closed")

    waiters = [_start(lambda: expect_closed(lambda: full.put(8)))] + [_start(lambda: expect_closed(empty.reader().get)) for _ in range(2)]
    assert _eventually(lambda: all(_inside_channel(t) for t in waiters)), "a waiter never reached the channel"
    assert full.close() == [7]
    assert empty.close() == []
    for t in waiters:
        t.join(5)
        assert not t.is_alive()
    assert errors == ["closed"] * 3
    with pytest.raises(Closed):
        full.put(9)
    assert len(full) == 0


def test_timed_waits_of_two_readers_on_one_channel_end_at_their_deadline_or_with_an_item() -> None:
    """Note: no timed SimpleQueue.get: two readers waiting for more with short deadlines while a
    producer puts now and then (one reader's wake-up finds the item taken by the other) take
    every item, and every wait ends: none blocks until the next put."""
    channel: Channel[int] = Channel(4)
    taken: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def read() -> None:
        reader = channel.reader()
        while not done.is_set() or len(channel):
            item = reader.get_more(0.0005)
            if item is not None:
                with lock:
                    taken.append(item)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for k in range(400):
        channel.put(k)
        if k % 7 == 0:
            time.sleep(0.001)  # past the readers' deadlines: they wait again with the queue empty
    done.set()
    for t in readers:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in readers)
    assert sorted(taken) == list(range(400))
    assert channel.reader().get_more(0.001) is None  # an empty channel: None at the deadline
