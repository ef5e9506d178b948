"""Expiring idle streams (issue 28, item 13): longest idle first, and at a cost that does not grow
with the streams open (see Note: expiring idle streams, onnxpipe/runtime/_stream.py).

The model is tests/stateful_models.py ``recurrent()`` cut at ``state1N`` (``rnn_bundle``, tests/runtime/conftest.py): one state in each of its
2 stages. Timeouts are real seconds: a stream that must expire idles longer than the timeout; one
that must stay was used just before the expiry, and a machine that stalled the whole timeout since
skips the check (Note: fresh streams, tests/waiting.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe import StreamError
from onnxpipe.runtime import Pipeline, load
from tests.waiting import skip_if_stalled

X = {"x": np.ones((1, 4), np.float32)}


def _held_in(pipe: Pipeline, stream_id: int) -> list[str]:
    """The stages whose runners hold a state for the stream."""
    return [stage.stage for stage in pipe.diagnostics().stages for r in stage.replicas if stream_id in r.streams]


def _sleep_until(moment: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``moment`` (a timeout that must elapse)."""
    time.sleep(max(0.0, moment - time.monotonic()))


def _idle_error(stream_id: int, timeout: float) -> str:
    return rf"stream {stream_id} is closed \(it was idle for more than stream_timeout={timeout:g} s, and its state was freed\)"


class _Held:
    """Wraps a runner's session: every ``run`` waits until ``release`` is set (a step held in flight)."""

    def __init__(self, session: Any) -> None:
        self.session, self.release = session, threading.Event()

    def run(self, *args: Any) -> Any:
        assert self.release.wait(30), "the test never released the held step"
        return self.session.run(*args)


def test_the_longest_idle_streams_close_first_and_the_active_ones_stay(rnn_bundle: Path) -> None:
    # A step closes the longest idle stream too: 3 and 1 step while 2 and 0 are idle for half the
    # timeout only, then the expiry comes once 2 and 0 are idle past it and 3 and 1 are not.
    timeout = 0.6
    with load(rnn_bundle, stream_timeout=timeout) as pipe:
        streams = [pipe.stream() for _ in range(4)]
        first = time.monotonic()
        for k in (2, 0):
            streams[k].step(X)
        stepped = time.monotonic()
        time.sleep(timeout / 2)
        used = time.monotonic()
        for k in (3, 1):
            streams[k].step(X)
        stepped_again = time.monotonic()
        skip_if_stalled(first, timeout)  # their steps came before 2 and 0 were idle past the timeout (tests/waiting.py)
        _sleep_until(stepped + timeout + 0.05)  # 2 and 0 idle past the timeout, 3 and 1 for about half of it
        closed = pipe.close_idle_streams()
        skip_if_stalled(used, timeout)
        assert closed == [2, 0]  # by last use, not by id
        assert pipe.open_streams == [1, 3]
        assert _held_in(pipe, 2) == _held_in(pipe, 0) == []
        assert _held_in(pipe, 1) == _held_in(pipe, 3) == ["stage0", "stage1"]
        with pytest.raises(StreamError, match=_idle_error(2, timeout)):
            streams[2].step(X)
        again = time.monotonic()
        streams[1].step(X)  # active again: idle from now
        skip_if_stalled(used, timeout)  # before 3 was idle past the timeout
        _sleep_until(stepped_again + timeout + 0.05)  # 3 idle past the timeout, 1 for about half of it
        closed = pipe.close_idle_streams()
        skip_if_stalled(again, timeout)
        assert closed == [3]
        assert pipe.open_streams == [1] and _held_in(pipe, 3) == []
        streams[1].close()
        assert pipe.streams.idle == 0


def test_a_stream_idle_too_long_refuses_its_own_next_step(rnn_bundle: Path) -> None:
    timeout = 0.2
    with load(rnn_bundle, stream_timeout=timeout) as pipe:
        late, other = pipe.stream(), pipe.stream()
        late.step(X)
        time.sleep(0.4)  # nothing else called meanwhile: its own step finds it idle (and the other one)
        with pytest.raises(StreamError, match=_idle_error(late.id, timeout)):
            late.step(X)
        assert late.closed and other.closed and pipe.open_streams == []
        assert _held_in(pipe, late.id) == []


def test_a_stream_with_a_step_in_flight_is_not_idle(rnn_bundle: Path) -> None:
    timeout = 0.2
    with load(rnn_bundle, stream_timeout=timeout) as pipe:
        busy, idle = pipe.stream(), pipe.stream()
        busy.step(X)
        idle.step(X)
        stage0 = pipe.idle_runners()[0]
        held = stage0.session = _Held(stage0.session)
        future = busy.submit(X)
        time.sleep(0.4)  # both last finished a step 0.4 s ago; busy's next one is in flight
        assert pipe.streams.idle == 1  # busy is not in it while its step is in flight
        # The close of the idle stream follows the held step through stage0: let the step go soon.
        release = threading.Timer(0.3, held.release.set)
        released = time.monotonic() + 0.3  # the step cannot finish before: its idle time starts after
        release.start()
        assert pipe.close_idle_streams() == [idle.id]
        assert not busy.closed
        future.result(timeout=30)
        stage0.session = held.session
        closed = pipe.close_idle_streams()
        skip_if_stalled(released, timeout)
        assert closed == []  # its idle time starts again when the step finishes
        assert pipe.streams.idle == 1
        busy.step(X)
        busy.close()


def test_closed_streams_leave_no_trace_without_a_timeout(rnn_bundle: Path) -> None:
    with load(rnn_bundle) as pipe:
        streams = [pipe.stream() for _ in range(50)]
        for s in streams:
            s.step(X)
        for s in streams[:30]:
            s.close()
        assert pipe.streams.idle == 20
    assert pipe.streams.idle == 0  # closing the pipeline closes them all


def _looked(bundle: Path, open_count: int) -> int:
    """How many streams expiry looks at over 10 steps of an open stream and 5 new streams' first
    steps, with ``open_count`` streams open (each stepped once, none idle long enough)."""
    with load(bundle, max_streams=2 * open_count, stream_timeout=600) as pipe:
        streams = [pipe.stream() for _ in range(open_count)]
        for s in streams:
            s.step(X)
        before = pipe.streams.looked
        for _ in range(10):
            streams[open_count // 2].step(X)
        for _ in range(5):
            with pipe.stream() as s:
                s.step(X)
        return pipe.streams.looked - before


def test_a_step_looks_at_one_stream_however_many_are_open(rnn_bundle: Path) -> None:
    # One look per expiry: each step has one, a new stream two (opening it, then its first step).
    assert _looked(rnn_bundle, 10) == _looked(rnn_bundle, 1000) == 10 + 5 * 2
