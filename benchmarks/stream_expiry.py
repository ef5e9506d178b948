"""What expiring idle streams costs a step with many streams open (issue 28, item 13), side by side.

Every ``pipe.stream()`` and every step first closes the streams idle past ``stream_timeout``. With N
streams open (each stepped once, none idle long enough: ``stream_timeout=600``,
``max_streams=20000``) on a small recurrent model split into 2 stages with a state in each
(tests/stateful_models.py ``recurrent()``), it times, median of ``--runs`` x ``--rounds``:

- **new stream + 1st step**: ``pipe.stream()`` and its first step (the stream is closed after,
  untimed, so that N stays N);
- **step of an open stream**: one more step of one of the N;
- **close_idle_streams**: ``pipe.close_idle_streams()`` alone;
- **server timer tick**: ``ServedModel.close_idle`` over N open sequences (``onnxpipe serve``
  calls it every ``min(stream_timeout / 4, 5)`` s on the model's worker thread): the call above,
  then a look at every sequence for the ones closed meanwhile (still O(N), once per tick).

Two columns per row: **scan**, the expiry the runtime had before (every open stream looked at, on
every step), patched into the same pipeline; **ordered**, the pipeline's own (only the longest-idle
streams looked at: Note: expiring idle streams, ``onnxpipe/runtime/_stream.py``).

    python -m benchmarks.stream_expiry [--open 10 1000 10000] [--runs 100] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks._timing import median_seconds
from onnxpipe import Closure
from onnxpipe.runtime import Pipeline, load
from onnxpipe.serve._models import Sequence, ServedModel
from onnxpipe.splitter import split
from tests.models import bundle_of
from tests.stateful_models import recurrent

ort.set_default_logger_severity(3)

OPEN = (10, 1000, 10_000)
X = {"x": np.ones((1, 4), np.float32)}


def scan_expiry(pipe: Pipeline) -> Callable[..., list[int]]:
    """The expiry as it was: every open stream's idleness computed under the registry's lock
    (patched into the pipeline's stream registry, whose internals it reads)."""
    registry = pipe._streams

    def expire_idle(*_: object) -> list[int]:
        now = time.monotonic()
        timeout = pipe.stream_timeout
        assert timeout is not None
        with registry._lock:
            idle = [s for s in registry._open.values() if s.idle_for(now) > timeout]
        closed = []
        for stream in idle:
            if stream.shut(Closure("idle", timeout)):
                registry._close(stream)
                closed.append(stream.id)
        return closed

    return expire_idle


@contextmanager
def served(bundle: Path, count: int) -> Iterator[tuple[Pipeline, ServedModel]]:
    """A pipeline with ``count`` sequences opened (and stepped once) as the server opens them."""
    with load(bundle, max_streams=20_000, stream_timeout=600) as pipe:
        model = ServedModel("rnn", bundle, pipe, max_inflight=1)
        try:
            for k in range(count):
                model._step(X, Sequence(k + 1, start=True)).result()
            yield pipe, model
        finally:
            model._worker.shutdown()


def new_stream_seconds(pipe: Pipeline, runs: int) -> float:
    """Median seconds of ``pipe.stream()`` and its first step; the close after is not timed."""
    samples = []
    for _ in range(runs + 1):  # the first one warms up
        start = time.perf_counter()
        stream = pipe.stream()
        stream.step(X)
        samples.append(time.perf_counter() - start)
        stream.close()
    return statistics.median(samples[1:])


def measure(pipe: Pipeline, model: ServedModel, runs: int) -> dict[str, float]:
    existing = model.sequences[1]
    return {
        "new stream + 1st step": new_stream_seconds(pipe, runs),
        "step of an open stream": median_seconds(lambda: existing.step(X), runs),
        "close_idle_streams": median_seconds(pipe.close_idle_streams, runs),
        "server timer tick": median_seconds(model.close_idle, runs),
    }


def run(counts: tuple[int, ...], runs: int, rounds: int) -> dict[str, dict[int, dict[str, float]]]:
    """Seconds per row, column and count: the medians of ``rounds`` interleaved rounds, so that
    both columns see the same machine (the same open streams, garbage, clock speed)."""
    samples: dict[str, dict[int, list[dict[str, float]]]] = {"scan": {}, "ordered": {}}
    with tempfile.TemporaryDirectory() as tmp:
        bundle = bundle_of(split(recurrent(), ["state1N"], states="auto"), tmp)
        for count in counts:
            with served(bundle, count) as (pipe, model):
                scan = scan_expiry(pipe)
                for _ in range(rounds):
                    samples["ordered"].setdefault(count, []).append(measure(pipe, model, runs))
                    pipe._streams.expire_idle = scan  # type: ignore[method-assign]
                    samples["scan"].setdefault(count, []).append(measure(pipe, model, runs))
                    del pipe._streams.expire_idle
    return {column: {count: {what: statistics.median(r[what] for r in rs) for what in rs[0]} for count, rs in by_count.items()}
            for column, by_count in samples.items()}


def table(results: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [f"{'open streams':>12}  {'what':<24} {'scan ms':>9} {'ordered ms':>11} {'ratio':>7}"]
    for count, rows in results["ordered"].items():
        for what, new in rows.items():
            old = results["scan"][count][what]
            lines.append(f"{count:>12,}  {what:<24} {old * 1e3:>9.3f} {new * 1e3:>11.3f} {old / new:>6.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--open", type=int, nargs="+", default=list(OPEN), help="how many streams are open (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=100, help="timed runs per row and round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the two columns interleaved; medians reported (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the seconds as JSON instead of the table")
    args = parser.parse_args(argv)
    results = run(tuple(args.open), args.runs, args.rounds)
    print(json.dumps(results, indent=2) if args.json else table(results))


if __name__ == "__main__":
    main()

