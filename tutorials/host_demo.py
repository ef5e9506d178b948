"""The deployment host's side of ``make demo``: only numpy and onnxruntime, plus ``onnxpipe.runtime``.

Loads a bundle, streams requests through it as a pipeline, checks the outputs against the whole
model, and compares throughput and latency with what a user would run instead: the whole model in
one session with 1 and 2 threads, and 2 replicas of it. Writes a Chrome-trace timeline.

    python tutorials/host_demo.py BUNDLE MODEL.onnx [--requests 60] [--trace trace.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

import onnxpipe.runtime as rt

ort.set_default_logger_severity(3)


def _session(model: str, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])


def _timed(run: Callable[[], object], requests: int) -> tuple[float, float]:
    """(requests per second, median latency ms) of ``requests`` runs one after another."""
    run()
    latencies = []
    start = time.perf_counter()
    for _ in range(requests):
        t = time.perf_counter()
        run()
        latencies.append(time.perf_counter() - t)
    return requests / (time.perf_counter() - start), 1e3 * statistics.median(latencies)


def _replicas(model: str, feeds: dict[str, np.ndarray], requests: int) -> float:
    """Requests per second of 2 sessions x 1 thread working side by side."""
    sessions = [_session(model, 1) for _ in range(2)]
    for s in sessions:
        s.run(None, feeds)
    share = [requests // 2, requests - requests // 2]

    def work(k: int) -> None:
        for _ in range(share[k]):
            sessions[k].run(None, feeds)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return requests / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--trace", default="trace.json")
    args = parser.parse_args()
    heavy = [m for m in ("onnx", "networkx", "click", "rich", "onnxpipe.splitter", "onnxpipe.builder") if m in sys.modules]
    print(f"deployment host: imported onnxpipe.runtime, numpy and onnxruntime only ({'also: ' + ', '.join(heavy) if heavy else 'no onnx, networkx, click'})")

    with rt.load(args.bundle, trace=True) as pipe:
        spec = pipe.spec.inputs[0]
        shape = [d if isinstance(d, int) else 1 for d in spec.shape or ()]
        rng = np.random.default_rng(0)
        frames = [{spec.name: rng.standard_normal(shape).astype(rt.numpy_dtype(spec.dtype))} for _ in range(args.requests)]
        checks = pipe.check()
        print(f"bundle '{args.bundle}': {len(pipe.spec.stages)} stages; reference outputs reproduced: {all(c.ok for c in checks)} ({len(checks)} checked)")
        for _ in pipe.map(frames[:5]):
            pass
        pipe.reset_stats()
        start = time.perf_counter()
        outputs = list(pipe.map(frames))
        pipeline_tp = len(frames) / (time.perf_counter() - start)
        stats = pipe.stats()
        trace = pipe.save_trace(args.trace)

    whole = _session(args.model, 1)
    worst, agree = 0.0, True
    for frame, got in zip(frames[:10], outputs[:10], strict=True):
        want = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, frame), strict=True))
        worst = max(worst, max(float(np.max(np.abs(got[k] - want[k]))) for k in want))
        agree = agree and all(np.allclose(got[k], want[k], rtol=1e-4, atol=1e-5) for k in want)
    print(f"pipeline outputs vs the whole model on 10 streamed requests: {'equal' if agree else 'DIFFERENT'} "
          f"(rtol 1e-4, atol 1e-5; max abs difference {worst:.2e})")

    one_1t = _timed(lambda: whole.run(None, frames[0]), args.requests)
    two = _session(args.model, 2)
    one_2t = _timed(lambda: two.run(None, frames[0]), args.requests)
    replicas = _replicas(args.model, frames[0], args.requests)
    print()
    print(f"{'how':<28} {'req/s':>8} {'latency ms':>11}   (pipeline / this; the pipeline's latency is p50 while streaming, queueing included)")
    print(f"{'onnxpipe pipeline':<28} {pipeline_tp:>8.1f} {stats.latency_p50_ms:>11.1f}")
    for label, (tp, lat) in (("one session, 1 thread", one_1t), ("one session, 2 threads", one_2t)):
        print(f"{label:<28} {tp:>8.1f} {lat:>11.1f}   {pipeline_tp / tp:.2f}x")
    print(f"{'2 replicas x 1 thread':<28} {replicas:>8.1f} {'-':>11}   {pipeline_tp / replicas:.2f}x")
    print()
    print("per stage: " + ", ".join(f"{s.stage} {s.utilization:.0%} busy, {s.mean_ms:.1f} ms/run" for s in stats.stages) + f"; bottleneck: {stats.bottleneck}")
    print(f"timeline: {Path(trace).resolve()} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0 if all(c.ok for c in checks) and agree else 1


if __name__ == "__main__":
    sys.exit(main())
