"""Statistics can be read at any time, from any thread, while requests flow."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from onnxpipe.runtime import load
from onnxpipe.runtime._stage import Call, Request
from onnxpipe.runtime._stats import RequestRecorder, StageRecorder, summarize, write_trace
from tests import models


@pytest.fixture()
def frequent_thread_switches() -> Iterator[None]:
    # Switch threads as often as the interpreter can, so that a reader's loop over a deque its writer
    # appends to is interrupted mid-way on nearly every call (the race shows in seconds, not hours).
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_summaries_and_traces_read_while_a_worker_records(tmp_path: Path, frequent_thread_switches: None) -> None:
    recorder = StageRecorder("s", 0, trace=True, window=2_000)
    requests = RequestRecorder()
    stop = threading.Event()

    def worker() -> None:
        n = 0
        while not stop.is_set():
            recorder.record(Call((n,), 0.0, 1e-3, 1), (Request(n, {}, {}, 0.0),))
            requests.finished(0.0, 1e-3, True)
            n += 1
            if n % 5_000 == 0:  # as reset_stats() would; also keeps each trace small
                recorder.reset()

    writer = threading.Thread(target=worker)
    writer.start()
    try:
        for _ in range(100):  # the worker records all the while
            assert summarize([("s", [recorder], 0, 0, 4)], requests, in_flight=0).stages[0].count >= 0
            write_trace(tmp_path / "t.json", [recorder], origin=0.0)
    finally:
        stop.set()
        writer.join()
    assert requests.completed > 0


def test_stats_polled_while_eight_threads_submit(tmp_path: Path, frequent_thread_switches: None) -> None:
    errors: list[BaseException] = []
    done = threading.Event()
    inputs = {"x": np.ones((1, 4), np.float32)}
    with load(models.bundle_of(models.hand_wired(), tmp_path), trace=True) as pipe:

        def poll() -> None:
            while not done.is_set():
                try:
                    pipe.stats()
                    pipe.save_trace(tmp_path / "trace.json")
                except BaseException as e:  # any exception here is the bug under test
                    errors.append(e)
                    return

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda _: pipe(inputs), range(800)))
        finally:
            done.set()
            poller.join()
        assert errors == []
        assert len(results) == 800 and pipe.stats().completed == 800
