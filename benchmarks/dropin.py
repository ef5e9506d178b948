"""What the InferenceSession drop-in costs, and what concurrent callers get from it.

1. Per call on a tiny model (MatMul, Relu, Add; split in 2): ``pipe.run(None, feed)`` (the
   drop-in) next to ``pipe(feed)`` (submit and wait) and a whole-model session's ``run``, rounds
   interleaved so machine noise hits all three alike.
2. Throughput of squeezenet (split in 2 stages) when 1 or 4 threads call ``pipe.run(None, feed)``,
   next to 1 thread calling a whole-model session (intra-op threads 1 everywhere).

    python -m benchmarks.dropin [--calls 2000] [--requests 60]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort

from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import SplitPlan, UniformPolicy, split

SQUEEZENET = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_squeezenet.onnx"
TINY = """<ir_version: 8, opset_import: ["" : 17]>
tiny (float[N,4] X) => (float[N,3] Y) <float[4,3] W = {1, 0, -1, 0.5, 2, 1, -1, 0, 0.25, 1, 1, 1}, float[3] B = {0.1, -0.2, 0.3}> {
    a = MatMul(X, W)
    b = Relu(a)
    Y = Add(b, B)
}"""


def _bundle(plan: SplitPlan, folder: Path) -> Path:
    for stage in plan.config.stages:
        stage.configure(intra_op_threads=1)
    return export(build(plan.config, folder / "built").path, folder / "bundle")


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def per_call(folder: Path, calls: int, rounds: int = 5) -> dict[str, float]:
    model = onnx.parser.parse_model(TINY)
    whole = _session(model)
    feed = {"X": np.ones((1, 4), np.float32)}
    times: dict[str, list[float]] = {"whole session run": [], "pipe(feed)": [], "pipe.run(None, feed)": []}
    with load(_bundle(split(model, cuts=["a"]), folder / "tiny")) as pipe:
        fns = {"whole session run": lambda: whole.run(None, feed), "pipe(feed)": lambda: pipe(feed), "pipe.run(None, feed)": lambda: pipe.run(None, feed)}
        for fn in fns.values():
            _per_call_us(fn, calls // 10)  # warm-up
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(_per_call_us(fn, calls))
    return {name: statistics.median(v) for name, v in times.items()}


def concurrent(folder: Path, requests: int) -> dict[str, float]:
    whole = _session(onnx.load(str(SQUEEZENET)))
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    rates: dict[str, float] = {}
    with load(_bundle(split(SQUEEZENET, policy=UniformPolicy(stages=2)), folder / "squeezenet")) as pipe:
        name = pipe.get_inputs()[0].name
        pipe.run(None, {name: x})
        whole.run(None, {name: x})
        start = time.perf_counter()
        for _ in range(requests):
            whole.run(None, {name: x})
        rates["whole session, 1 caller"] = requests / (time.perf_counter() - start)
        for callers in (1, 4):
            with ThreadPoolExecutor(callers) as pool:
                start = time.perf_counter()
                list(pool.map(lambda _: pipe.run(None, {name: x}), range(requests)))
                rates[f"pipeline drop-in, {callers} caller(s)"] = requests / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    ort.set_default_logger_severity(3)
    with tempfile.TemporaryDirectory() as tmp:
        for name, us in per_call(Path(tmp), args.calls).items():
            print(f"{name:28s} {us:8.1f} us per call (median of 5 rounds)")
        for name, rate in concurrent(Path(tmp), args.requests).items():
            print(f"{name:36s} {rate:7.1f} requests/s")


if __name__ == "__main__":
    main()
