"""The OpenVINO GenAI row of ``benchmarks.batching --contexts``: S greedy streams as continuous
batching requests of OpenVINO GenAI's ``ContinuousBatchingPipeline`` (paged attention) on the
openvino export of the same Llama (``benchmarks.llama_exports --only openvino``).

Run by ``benchmarks.batching`` as a subprocess per round in a venv of its own (``make
bench-decoders`` makes ``.venv-ovgenai``: openvino-genai and optimum-intel want other transformers
than the decoders' venv): reads a JSON request on stdin, ``{"model": FOLDER, "prompts": [[id, ...],
...], "tokens": N, "threads": T}``, and prints one JSON line: each stream's ``tokens`` (its new
ones), ``first`` (seconds until every stream has its first token), ``times`` (seconds of each
later step) and ``elapsed``. The parent turns them into tokens/s and p50 / p99 as it does every
row's (``benchmarks.batching._rates``).

How it runs, Note: as og.Generator's row runs. Every request is added at once (token ids, no
tokenizer), then the pipeline is stepped (``step()``) until none is left, each step timed. The
scheduler takes every prompt in its first step (``max_num_batched_tokens`` S x context,
``dynamic_split_fuse`` off, as ``og.Generator`` appends a batch's prompts at once) and holds S
sequences of context + tokens positions (:func:`scheduler_sizes`); every later step gives each
stream one token, so a decode step is a token per stream, the figure the other rows time. fp32
throughout: ``INFERENCE_PRECISION_HINT`` f32 and ``KV_CACHE_PRECISION`` f32 (on a CPU OpenVINO
otherwise keeps the KV cache in u8), ``ignore_eos`` (the other rows do not stop at the end token
either), threads as given (the machine's cores). A warm-up of S short requests compiles the
kernels before the timed requests. Logits are not exposed by the pipeline: the parent compares
this row's tokens alone.

    echo '{"model": "bench-out/llama/24m/openvino", "prompts": [[1, 2, 3]], "tokens": 8, "threads": 2}' | \\
        .venv-ovgenai/bin/python -m benchmarks.ovgenai_peer
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

#: Positions a KV block holds, at most, of the CPU plugin's paged cache (32 on CPUs, 16 on GPUs):
#: the blocks are counted with the smaller, so S sequences always fit.
BLOCK = 16


class Handle(Protocol):
    """What :func:`drain` reads of a request's ``GenerationHandle``."""

    def can_read(self) -> bool: ...

    def read(self) -> dict[int, Any]: ...


class Stepped(Protocol):
    """What :func:`drain` drives of a ``ContinuousBatchingPipeline``."""

    def step(self) -> None: ...

    def has_non_finished_requests(self) -> bool: ...


def scheduler_sizes(streams: int, context: int, tokens: int) -> dict[str, Any]:
    """The ``SchedulerConfig`` fields for ``streams`` requests of a ``context``-token prompt and
    ``tokens`` new tokens each: every prompt in the first step, every stream scheduled at once, KV
    blocks for all their positions (one block spare each); the rest left at the defaults."""
    per_stream = -(-(context + tokens) // BLOCK) + 1
    return {"max_num_seqs": streams, "max_num_batched_tokens": max(streams * context, 256), "dynamic_split_fuse": False,
            "num_kv_blocks": streams * per_stream, "enable_prefix_caching": False}


def drain(pipe: Stepped, handles: Sequence[Handle], clock: Callable[[], float] = time.perf_counter,
          start: float | None = None) -> dict[str, Any]:
    """Steps ``pipe`` until its requests are done, reading each handle's new tokens after each
    step: ``tokens`` per handle, ``first`` (from ``start``, by default now, until every handle has
    a token), ``times`` (each later step, its reads included) and ``elapsed`` (from ``start``)."""
    start = clock() if start is None else start
    tokens: list[list[int]] = [[] for _ in handles]
    first: list[float] = []
    times: list[float] = []
    while pipe.has_non_finished_requests():
        began = clock()
        pipe.step()
        for k, handle in enumerate(handles):
            if handle.can_read():
                for output in handle.read().values():  # one sequence per greedy request
                    tokens[k].extend(int(t) for t in output.generated_ids)
        now = clock()
        if first:
            times.append(now - began)
        elif all(tokens):
            first.append(now - start)
    return {"tokens": tokens, "first": first, "times": times, "elapsed": clock() - start}


def _pipeline(folder: str, streams: int, context: int, tokens: int, threads: int) -> Any:
    import openvino_genai as og

    scheduler = og.SchedulerConfig()
    for name, value in scheduler_sizes(streams, context, tokens).items():
        setattr(scheduler, name, value)
    properties = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": threads}
    return og.ContinuousBatchingPipeline(folder, scheduler, "CPU", properties)


def _requests(pipe: Any, prompts: Sequence[Sequence[int]], tokens: int, ids: int = 0) -> list[Any]:
    """A greedy request per prompt, ``tokens`` new tokens each, numbered from ``ids``."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    config = og.GenerationConfig()
    config.max_new_tokens, config.do_sample, config.ignore_eos = tokens, False, True
    return [pipe.add_request(ids + k, ov.Tensor(np.array([p], np.int64)), config) for k, p in enumerate(prompts)]


def decode(folder: str, prompts: Sequence[Sequence[int]], tokens: int, threads: int) -> dict[str, Any]:
    """The prompts as continuous batching requests, greedy, ``tokens`` new tokens each, after a
    warm-up (how it runs: the module's Note); :func:`drain`'s figures."""
    streams, context = len(prompts), max(map(len, prompts))
    pipe = _pipeline(folder, streams, context, tokens, threads)
    drain(pipe, _requests(pipe, [p[:8] for p in prompts], 4))  # warm-up: the kernels compiled, not timed
    start = time.perf_counter()
    return drain(pipe, _requests(pipe, prompts, tokens, ids=streams), start=start)


def main() -> None:
    request = json.load(sys.stdin)
    print(json.dumps(decode(request["model"], request["prompts"], request["tokens"], request["threads"])))


if __name__ == "__main__":
    main()
