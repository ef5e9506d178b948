"""The PP-OCR chain (onnxpipe_examples, docs/ocr-example.md): images/s as one onnxpipe pipeline vs the
same glue and models run step after step in one thread, side by side in interleaved rounds.

Contenders, each streaming the same rendered images (3 text lines, 360 x 240 pixels):

- ``sequential 1t``: :class:`onnxpipe_examples.ocr.SequentialOcr`, one thread, sessions of 1 thread
  (the pipeline's stages have 1 thread each: the same work, one step at a time);
- ``sequential 2t``: the same with sessions of 2 intra-op threads (how one would use 2 cores without
  a pipeline);
- ``pipeline``: the bundle of ``build_ocr_bundle`` (7 stages: 4 code, 4 ONNX with det split in 2),
  streamed with ``Pipeline.map`` on the thread engine.

Prints images/s (median over rounds) and each contender's ratio to ``sequential 1t`` (median of
the per-round ratios, with their range), and per-stage busy shares of the pipeline.

    python -m benchmarks.ocr_chain [--images 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnxpipe.runtime import Pipeline, PipelineStats, interleaved_rounds, load

ort.set_default_logger_severity(3)

LINES = [
    ["Hello onnxpipe", "split 2 stages", "CTC 0.97"],
    ["invoice 2026-12", "total 42.50 EUR", "thank you"],
    ["pipeline of models", "code stages too", "one bundle"],
    ["PP-OCR det cls rec", "upside down line", "reads fine"],
]


def images(count: int) -> list[np.ndarray]:
    """``count`` rendered images, cycling over four texts (one line of each upside down)."""
    from onnxpipe_examples.ocr import render_lines

    return [render_lines(LINES[k % len(LINES)], upside_down=[k % 3]) for k in range(count)]


def _rate(run: Callable[[Iterable[np.ndarray]], object], batch: list[np.ndarray]) -> float:
    start = time.perf_counter()
    run(batch)
    return len(batch) / (time.perf_counter() - start)


def _drain(pipe: Pipeline, last: list[PipelineStats]) -> Callable[[Iterable[np.ndarray]], object]:
    """Stream a batch through ``pipe``; its statistics of that batch alone go to ``last``."""

    def run(batch: Iterable[np.ndarray]) -> object:
        pipe.reset_stats()
        outputs = list(pipe.map({"image": img} for img in batch))
        last[:] = [pipe.stats()]
        return outputs

    return run


def main() -> None:
    from onnxpipe_examples.ocr import SequentialOcr
    from onnxpipe_examples.ocr_pipeline import ALLOW_CODE, build_ocr_bundle

    parser = argparse.ArgumentParser(prog="python -m benchmarks.ocr_chain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=12, help="images streamed per contender per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    batch = images(args.images)
    print(
        f"OCR chain, {datetime.date.today().isoformat()}: {len(os.sched_getaffinity(0))} cores ({platform.processor() or platform.machine()}), "
        f"onnxruntime {ort.__version__}, {args.images} images of 360 x 240 per contender per round, {args.rounds} interleaved rounds"
    )
    with tempfile.TemporaryDirectory(prefix="ocr-bench-") as tmp:
        start = time.perf_counter()
        bundle = build_ocr_bundle(Path(tmp) / "ocr.onnxpipe")
        print(f"built and exported the bundle in {time.perf_counter() - start:.1f} s")
        seq1, seq2 = SequentialOcr(threads=1), SequentialOcr(threads=2)
        last: list[PipelineStats] = []
        with load(bundle, allow_code=ALLOW_CODE) as pipe:
            runners: dict[str, Callable[[Iterable[np.ndarray]], object]] = {
                "sequential 1t": lambda b: [seq1(img) for img in b],
                "sequential 2t": lambda b: [seq2(img) for img in b],
                "pipeline": _drain(pipe, last),
            }
            for run in runners.values():
                run(batch[:2])  # warm-up: first runs allocate
            rounds = interleaved_rounds({name: functools.partial(_rate, run, batch) for name, run in runners.items()}, args.rounds)
            stats = last[0]
    base = "sequential 1t"
    print(f"\n{'how':<16} {'images/s':>9} {'vs ' + base:>18}  per-round ratios")
    for name in runners:
        ratios = rounds.ratios(name, base)
        print(f"{name:<16} {rounds.median(name):9.2f} {statistics.median(ratios):17.2f}x  {min(ratios):.2f}-{max(ratios):.2f}")
    print(f"\npipeline stages in its last round (busy share of its wall time, bottleneck {stats.bottleneck}):")
    for s in stats.stages:
        print(f"  {s.stage:<12} {s.utilization:6.1%}  {s.mean_ms:8.2f} ms/request")


if __name__ == "__main__":
    main()
