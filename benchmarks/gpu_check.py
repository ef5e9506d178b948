"""A stage on a GPU beside a stage on the CPU: the check to run where a GPU and onnxruntime-gpu are.

    python -m benchmarks.gpu_check [--device 0] [--requests 200]

It builds a convolutional net with random weights (8 Conv+Relu layers, 64 channels, input
[1, 3, 224, 224]) in-process, splits it in 2 at the middle, and runs it three ways:

1. the whole model in one CPU session (the reference);
2. the pipeline with stage 0 on ``cuda:DEVICE`` and stage 1 on the CPU, then the other way round;
3. each of them once per request, one at a time, to time a request end to end beside what its stages
   computed (``stats()``): the difference is the hand-off per hop (device to host copies included).

It checks and prints: outputs equal the whole model's within rtol 1e-3, atol 1e-4 (TF32 off:
``use_tf32=0``); every node of the CUDA stage placed on CUDA (``pipe.placement()``); requests/s of each
pipeline through ``pipe.map``. Exit code 0 when every check passes, 1 when one fails, 2 when this host
has no CUDA provider (nothing was run).

It has not been run by the suite's machines, which have no GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import split

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
LAYERS, CHANNELS = 8, 64


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """``x`` [1, 3, 224, 224] -> ``y`` [1, 64, 224, 224]: Conv 3x3 + Relu, ``LAYERS`` times (He-initialised)."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev, cin = [], [], "x", 3
    for k in range(LAYERS):
        w = (rng.standard_normal((CHANNELS, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(np.zeros(CHANNELS, np.float32), f"b{k}")]
        nodes += [helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}" if k < LAYERS - 1 else "y"], name=f"relu{k}")]
        prev, cin = f"r{k}", CHANNELS
    graph = helper.make_graph(nodes, "conv_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 224, 224])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS, 224, 224])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    if CUDA not in ort.get_available_providers():
        print(f"not run: this onnxruntime ({ort.__version__}) has no {CUDA} (providers: {', '.join(ort.get_available_providers())}); "
              "install onnxruntime-gpu on a host with a GPU")
        return 2
    model = conv_net()
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=[CPU]).run(None, {"x": x})[0]
    ok = True
    print(f"onnxruntime {ort.__version__}; conv net of {LAYERS} Conv+Relu layers, {CHANNELS} channels, [1, 3, 224, 224]")
    with tempfile.TemporaryDirectory() as tmp:
        for order in (("cuda", "cpu"), ("cpu", "cuda")):
            plan = split(model, [f"r{LAYERS // 2 - 1}"])
            for stage, target in zip(plan.config.stages, order, strict=True):
                if target == "cuda":
                    stage.configure(target=f"cuda:{args.device}", provider_options={"use_tf32": "0"}, fallback=False)
                else:
                    stage.configure(target="cpu", intra_op_threads=0)
            name = " -> ".join(order)
            bundle = export(build(plan.config, Path(tmp) / f"built-{order[0]}").path, Path(tmp) / f"bundle-{order[0]}")
            with load(bundle) as pipe:
                out = pipe({"x": x})["y"]
                where = pipe.placement()
                error = float(np.abs(out - reference).max())
                close = bool(np.allclose(out, reference, rtol=1e-3, atol=1e-4))
                gpu_stage = plan.config.stages[order.index("cuda")].name
                placed = where[gpu_stage]
                on_cuda = placed is not None and list(placed) == [CUDA]
                pipe.reset_stats()
                times = []
                for _ in range(30):
                    start = time.perf_counter()
                    pipe({"x": x})
                    times.append(time.perf_counter() - start)
                stats = pipe.stats()
                hop = (statistics.median(times) - sum(s.p50_ms for s in stats.stages) / 1e3) / 2  # two hops: into stage 1, out of the pipeline
                start = time.perf_counter()
                for _ in pipe.map({"x": x} for _ in range(args.requests)):
                    pass
                rate = args.requests / (time.perf_counter() - start)
            ok &= close and on_cuda
            counts = {ep: len(nodes) for ep, nodes in (placed or {}).items()}
            print(f"{name}: max abs error {error:.2e} ({'ok' if close else 'FAIL'}); {gpu_stage} nodes {counts} ({'all on CUDA' if on_cuda else 'FAIL'}); "
                  f"stages p50 {', '.join(f'{s.p50_ms:.2f} ms' for s in stats.stages)}; hand-off per hop {1e3 * hop:.2f} ms; {rate:.1f} req/s")
    print("all checks passed" if ok else "a check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
