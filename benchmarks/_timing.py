"""How long one call takes: the one timing loop the benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
