"""What the GIL costs a pipeline with a code stage.

A two-stage pipeline: an ONNX stage (two MatMuls, 1 intra-op thread) then a code stage of about
the same time per request, of one of three kinds:

* ``python``: a pure-Python loop (holds the GIL the whole time);
* ``numpy``: a few large numpy operations (numpy releases the GIL inside them);
* ``sleep``: ``time.sleep`` (releases the GIL: what an ideal code stage costs the pipeline).

For each, the pipeline's throughput (requests streamed with ``Pipeline.map``) over running the
same two stages one after another in one thread (``SequentialPipeline``), with each stage's time
alone. Two stages of equal time overlap perfectly at 2x; a code stage holding the GIL can only
overlap with the part of the ONNX stage that runs inside onnxruntime (which releases the GIL).
Rounds are interleaved, medians reported.

With ``--ray``, the same bundles also run on the Ray engine (a local Ray instance of 2 CPUs that the
benchmark starts and stops), where each stage is an actor process of its own: the code stage no
longer shares a GIL with anything, at the price of Ray's hops (see docs/distributed.md).

    python -m benchmarks.code_stages [--requests 60] [--rounds 3] [--ray] [--rows 128]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from benchmarks._timing import median_seconds
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import SequentialPipeline, TensorSpec, load, read_bundle

ROWS, SIZE = 128, 512  # default rows per request (--rows), columns


def python_stage(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """A pure-Python loop of ``params["loops"]`` iterations (holds the GIL), then the input passed on."""
    total = 0
    for i in range(params["loops"]):
        total += i * i % 7
    return {"z": inputs["y"][:, :1] + np.float32(total % 2)}


def numpy_stage(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """``params["loops"]`` passes of elementwise numpy work over the input (mostly without the GIL)."""
    y = inputs["y"]
    acc = np.zeros_like(y)
    for _ in range(params["loops"]):
        np.multiply(y, np.float32(0.5), out=acc)
        np.tanh(acc, out=acc)
    return {"z": acc[:, :1].copy()}


def sleep_stage(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Sleeps ``params["seconds"]`` (no GIL held), then passes the input on."""
    time.sleep(params["seconds"])
    return {"z": inputs["y"][:, :1].copy()}


def _onnx_stage(rows: int) -> Any:
    w = numpy_helper.from_array(np.full((SIZE, SIZE), 1.0 / SIZE, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, SIZE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, SIZE])],
        initializer=[w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _bundle(folder: Path, kind: str, params: dict[str, Any], rows: int) -> Path:
    config = PipelineConfig(kind)
    mm = config.add_stage(_onnx_stage(rows), "onnx")
    code = config.add_python_stage(
        f"benchmarks.code_stages:{kind}_stage",
        inputs=[TensorSpec("y", "float32", (rows, SIZE))],
        outputs=[TensorSpec("z", "float32", (rows, 1))],
        params=params,
        name="code",
    )
    config.input("x").connect(mm.input("x"))
    mm.output("y").connect(code.input("y"))
    code.output("z").connect(config.output("z"))
    return export(build(config, folder / f"built-{kind}").path, folder / f"{kind}.onnxpipe")


def _alone_ms(fn: Any, runs: int = 20) -> float:
    return 1e3 * median_seconds(fn, runs)


def _calibrate(folder: Path, x: np.ndarray) -> tuple[float, dict[str, dict[str, Any]]]:
    """The ONNX stage's time, and params that make each code stage take about as long."""
    (folder / "calibrate").mkdir()
    bundle = read_bundle(_bundle(folder / "calibrate", "sleep", {"seconds": 0.0}, len(x)), allow_code=["benchmarks.code_stages:*"])
    seq = SequentialPipeline(bundle.spec, bundle, allow_code=bundle.allow_code)
    onnx_ms = _alone_ms(lambda: seq._sessions["onnx"].run(None, {"x": x}))  # type: ignore[call-arg, arg-type]
    y = {"y": np.ones((len(x), SIZE), np.float32)}
    params: dict[str, dict[str, Any]] = {"sleep": {"seconds": onnx_ms / 1e3}}
    for kind, fn in (("python", python_stage), ("numpy", numpy_stage)):
        per = _alone_ms(lambda fn=fn: fn(y, {"loops": 1000}), 5) / 1000
        params[kind] = {"loops": max(1, round(onnx_ms / per))}
    return onnx_ms, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="also run each bundle on the Ray engine (needs onnxpipe[ray])")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows per request: the stages' time grows with it")
    args = parser.parse_args()
    if args.ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, SIZE)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        onnx_ms, params = _calibrate(folder, x)
        bundles = {kind: _bundle(folder, kind, params[kind], args.rows) for kind in ("python", "numpy", "sleep")}
        allow = ["benchmarks.code_stages:*"]
        ratios: dict[str, list[float]] = {k: [] for k in bundles}
        on_ray: dict[str, list[float]] = {k: [] for k in bundles}
        alone: dict[str, float] = {}
        for _ in range(args.rounds):
            for kind, path in bundles.items():
                checked = read_bundle(path, allow_code=allow)
                seq = SequentialPipeline(checked.spec, checked, allow_code=allow)
                code_runner = seq._sessions["code"]
                alone[kind] = _alone_ms(lambda r=code_runner: r.compute({"y": x}), 5)
                seq.run({"x": x})
                start = time.perf_counter()
                for _ in range(args.requests):
                    seq.run({"x": x})
                sequential = args.requests / (time.perf_counter() - start)
                pipelined = _streamed(path, allow, x, args.requests)
                ratios[kind].append(pipelined / sequential)
                if args.ray:
                    on_ray[kind].append(_streamed(path, allow, x, args.requests, engine="ray") / sequential)
                checked.close()
    print(f"ONNX stage alone: {onnx_ms:.2f} ms ({args.rows}x{SIZE} @ {SIZE}x{SIZE} twice, 1 thread); {args.requests} requests x {args.rounds} rounds")
    head = "| code stage | code stage alone ms | pipeline / sequential (median) | rounds |"
    print(head + (" Ray engine / sequential (median) | rounds |" if args.ray else ""))
    print("| --- | --- | --- | --- |" + (" --- | --- |" if args.ray else ""))
    for kind, values in ratios.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        row = f"| {kind} | {alone[kind]:.2f} | {statistics.median(values):.2f}x | {shown} |"
        if args.ray:
            row += f" {statistics.median(on_ray[kind]):.2f}x | {', '.join(f'{v:.2f}' for v in on_ray[kind])} |"
        print(row)
    if args.ray:
        import ray

        ray.shutdown()


def _streamed(path: Path, allow: list[str], x: np.ndarray, requests: int, engine: str = "thread") -> float:
    """Requests per second streaming ``requests`` of ``x`` through the bundle with ``Pipeline.map``."""
    with load(path, allow_code=allow, engine=engine) as pipe:
        list(pipe.map({"x": x} for _ in range(5)))
        start = time.perf_counter()
        for _ in pipe.map({"x": x} for _ in range(requests)):
            pass
        return requests / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
