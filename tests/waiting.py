"""Waiting in tests without timing assertions: poll a condition under a generous deadline, and tell a
machine that stalled from a bug where a test needs a real timeout to elapse.

Note: fresh streams.
    A stream timeout is real time: a test lets it elapse for the streams that must expire (a sleep
    longer than the timeout), and checks that the streams used just before stay open. Those last
    checks hold only if the machine ran on meanwhile: a process descheduled for the whole timeout
    sees every stream expire. :func:`skip_if_stalled` tells the two apart after the fact: it is
    called after the expiry under test (and before asserting on its outcome) with the time the
    streams were last used, and skips the test when at least the timeout has passed since, so a
    check is only ever made when its premise held. Each test uses its streams immediately before the
    expiry, so the margin is the whole timeout, and a skip is a stall of that length.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

_T = TypeVar("_T")


def in_threads(work: Callable[[int], _T], count: int, seconds: float = 120.0) -> list[_T]:
    """``work(k)`` for k in 0..count-1, each on a thread of its own, all started before any is
    joined; the results in order.

    Raises:
        AssertionError: a thread failed (with every thread's error) or was still running after ``seconds``.
    """
    results: dict[int, _T] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = work(k)
        except BaseException as e:  # reported below, with the others
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)
    assert not errors, errors
    assert len(results) == count, f"{count - len(results)} thread(s) still running after {seconds} s"
    return [results[k] for k in range(count)]


def until(condition: Callable[[], object], what: str, seconds: float = 30.0) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` if it is not within ``seconds``
    (a generous deadline: it decides only whether a test fails, never how fast something was)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


def skip_if_stalled(since: float, timeout: float) -> None:
    """Skip the test if ``timeout`` seconds or more passed since ``since`` (``time.monotonic()``): the
    streams used then may have expired because the machine stalled (see Note: fresh streams)."""
    stalled = time.monotonic() - since
    if stalled >= timeout:
        pytest.skip(f"the machine stalled {stalled:.2f} s, past the {timeout:g} s stream timeout under test: the streams used before may have expired")
