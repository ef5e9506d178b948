"""The Triton peer of ``onnxpipe serve``: the whole model as one onnxruntime session behind
PyTriton (``nvidia-pytriton``, whose wheel bundles ``tritonserver``: Triton's core, its HTTP and
gRPC front ends and its dynamic batcher), written as PyTriton's docs write a model. Run by
``benchmarks.serve --vs-triton`` with the Python of a venv that has nvidia-pytriton and
onnxruntime (``make bench-serve`` makes ``.venv-pytriton``); not imported by onnxpipe.

It serves the model twice, as a Triton user would try it:

- ``NAME-plain``: no batching (``max_batch_size`` 0), one request per session call;
- ``NAME-batched``: Triton's dynamic batcher, ``max_batch_size`` 8 (``--max-batch``), waiting up
  to ``--max-delay-us`` for requests to join (0: what is queued when the model is free). Dim 0 of
  every input and output is the batch axis, so the model must have a symbolic one there.

Each is one instance with its own session of ``--threads`` intra-op threads (onnxruntime's other
defaults, spinning included, as a user gets them). Triton listens on 127.0.0.1 only, on the
ports given; its metrics port is off; its statistics API is open to perf_analyzer (PyTriton puts
it behind a token by default).

Usage: python benchmarks/pytriton_peer.py --name NAME --model MODEL.onnx --http-port P --grpc-port Q [--threads 2]

Note: the stub's libpython.
    Triton runs a Python model in ``triton_python_backend_stub``, a binary of the wheel linked
    against ``libpython3.X.so.1.0``, which the loader finds on the system (Debian's 3.11.2 here)
    while the stub reads the standard library of the venv's Python (pyenv's 3.11.7): the two
    disagree (``'_thread.RLock' object has no attribute '_recursion_count'``) and the model fails
    to load. The stub inherits Triton's environment, so the library folder of the Python running
    this script goes first on ``LD_LIBRARY_PATH``: the stub then embeds that same Python.

Note: why two models in one Triton.
    One tritonserver holds both variants, as a user comparing them would deploy them; each has
    its own Python backend stub and session, and only the one being measured is busy (an idle
    onnxruntime session stops spinning within milliseconds of its last run).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import sysconfig
from typing import Any

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig

_DTYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
           "tensor(float16)": np.float16, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def _session(path: str, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _tensors(args: Any, batched: bool) -> tuple[list[Tensor], list[Tensor]]:
    """The model's ports as PyTriton's Tensors: every dim but a fixed one is -1; batched, dim 0
    is Triton's batch axis and not part of the shape."""
    probe = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])

    def tensor(port: Any) -> Tensor:
        dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in port.shape)
        return Tensor(name=port.name, dtype=_DTYPES[port.type], shape=dims[1:] if batched else dims)

    return [tensor(i) for i in probe.get_inputs()], [tensor(o) for o in probe.get_outputs()]


def plain(path: str, threads: int) -> Any:
    """One request per call: Triton hands the model one request at a time without batching."""
    session = _session(path, threads)
    names = [o.name for o in session.get_outputs()]

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        return [dict(zip(names, session.run(names, {k: request[k] for k in request}), strict=True)) for request in requests]

    return infer


def batched(path: str, threads: int) -> Any:
    """The requests Triton's dynamic batcher took together, stacked along dim 0 (PyTriton's
    ``@batch``), in one call."""
    session = _session(path, threads)
    names = [o.name for o in session.get_outputs()]

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, inputs), strict=True))

    return infer


def _own_libpython() -> None:
    """This Python's libpython first on the loader's path, for Triton's Python stub (see Note: the stub's libpython)."""
    folder = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and folder:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (folder, os.environ.get("LD_LIBRARY_PATH")) if p)


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # Triton.serve() stops its server and stubs on it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="models are served as NAME-plain and NAME-batched")
    parser.add_argument("--model", required=True, help="the .onnx file")
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of each session")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-delay-us", type=int, default=0, help="the dynamic batcher's max_queue_delay_microseconds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, _stop)
    _own_libpython()
    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1", grpc_port=args.grpc_port,
                          allow_metrics=False, allow_gpu_metrics=False, allow_cpu_metrics=False, exit_timeout_secs=5)
    # PyTriton guards the statistics API with a token; perf_analyzer reads it after every window (as
    # it does from any Triton), so that one is opened; the others stay behind the token.
    security = TritonSecurityConfig(restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"])
    with Triton(config=config, security_config=security) as triton:
        inputs, outputs = _tensors(args, batched=False)
        triton.bind(f"{args.name}-plain", plain(args.model, args.threads), inputs, outputs, config=ModelConfig(batching=False))
        inputs, outputs = _tensors(args, batched=True)
        triton.bind(f"{args.name}-batched", batched(args.model, args.threads), inputs, outputs,
                    config=ModelConfig(batching=True, max_batch_size=args.max_batch, batcher=DynamicBatcher(max_queue_delay_microseconds=args.max_delay_us)))
        print(f"pytriton peer: serving {args.name}-plain and {args.name}-batched on http {args.http_port}, grpc {args.grpc_port}", file=sys.stderr, flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
