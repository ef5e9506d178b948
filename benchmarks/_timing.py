"""How long things take: the timing loops the benchmarks share."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence


def spread(values: Sequence[float]) -> dict[str, float]:
    """The median of ``values`` (ratios paired by round, say) with their min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_seconds(fn: Callable[[], object], runs: int, warmup: int = 1, min_seconds: float = 0.0) -> float:
    """Median seconds of one call of ``fn``: ``warmup`` untimed calls, then at least ``runs`` timed
    ones, more (up to 500) until ``min_seconds`` of running, so that fast calls are timed often."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    while len(samples) < runs or (sum(samples) < min_seconds and len(samples) < 500):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed_threads(work: Callable[[int, threading.Barrier], None], count: int) -> float:
    """Seconds for ``count`` threads running ``work(k, start_line)`` to finish, timed from the
    moment all of them (and this thread) pass ``start_line.wait()``: each thread's own set-up
    before that line is not timed."""
    start_line = threading.Barrier(count + 1)
    threads = [threading.Thread(target=work, args=(k, start_line)) for k in range(count)]
    for t in threads:
        t.start()
    start_line.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start
