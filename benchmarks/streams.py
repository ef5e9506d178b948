"""When does a pipeline of decoders pay? Tokens/s of greedy decoding, side by side in one run.

A GPT-style decoder with a KV cache (tests/stateful_models.py, random weights, 8 layers, hidden 384
by default) is split between its middle layers into 2 stages, 1 thread each, pinned to one core each
where the machine has 2; every layer's KV cache stays in its stage. Measured:

- **pipeline, S streams** (S = 1, 2, 4): S threads, each decoding its own prompt through its own
  ``pipe.stream()``; tokens/s over all streams;
- **one session x 1 thread** and **one session x 2 threads**: the whole model, the KV cache fed by
  hand, the S streams decoded one after the other (a session runs one step at a time).

Each configuration runs ``--rounds`` times, interleaved, and the median is reported with its ratio
to one session x 1 thread. One stream cannot keep 2 stages busy (its next step needs this step's
token), so it runs at the speed of one session plus the hops; S >= 2 streams fill the pipeline.

    python -m benchmarks.streams [--layers 8] [--hidden 384] [--tokens 48] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from benchmarks._timing import timed_threads
from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import split
from tests.stateful_models import decoder_session, generate, gpt_decoder, session_generate

ort.set_default_logger_severity(3)

PROMPT = [3, 14, 15, 9, 2, 6, 5, 35]
STREAMS = (1, 2, 4)


def _prompt(k: int) -> list[int]:
    return [(t + 7 * k) % 64 for t in PROMPT]


def _pipeline_tokens_per_s(bundle: Path, streams: int, tokens: int) -> float:
    with load(bundle) as pipe:
        with pipe.stream() as warm:
            generate(warm.step, _prompt(0), 4)

        def decode(k: int, start_line: threading.Barrier) -> None:
            with pipe.stream() as s:
                start_line.wait()
                generate(s.step, _prompt(k), tokens)

        return streams * tokens / timed_threads(decode, streams)


def _session_tokens_per_s(model: Any, threads: int, streams: int, tokens: int) -> float:
    session = decoder_session(model, threads)
    session_generate(session, _prompt(0), 4)  # warm-up
    start = time.perf_counter()
    for k in range(streams):
        session_generate(session, _prompt(k), tokens)
    return streams * tokens / (time.perf_counter() - start)


def run(layers: int, hidden: int, tokens: int, rounds: int) -> dict[str, Any]:
    heads = max(1, hidden // 64)
    model = gpt_decoder(layers=layers, hidden=hidden, heads=heads, vocab=64, positions=tokens + len(PROMPT) + 8)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        plan = split(model, [f"layer{layers // 2 - 1}.out"], states="auto")
        for k, stage in enumerate(plan.config.stages):
            stage.configure(intra_op_threads=1, affinity=[cores[k]] if len(cores) >= 2 else None)
        bundle = export(build(plan.config, Path(tmp) / "built").path, Path(tmp) / "bundle")
        configs: dict[str, Any] = {
            "one session x 1 thread": lambda: _session_tokens_per_s(model, 1, 2, tokens),
            "one session x 2 threads": lambda: _session_tokens_per_s(model, 2, 2, tokens),
        }
        for s in STREAMS:
            configs[f"pipeline 2 stages x 1 thread, {s} stream{'s' if s > 1 else ''}"] = lambda s=s: _pipeline_tokens_per_s(bundle, s, tokens)
        measured: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(rounds):
            for name, fn in configs.items():
                measured[name].append(fn())
    rates = {name: statistics.median(values) for name, values in measured.items()}
    base = rates["one session x 1 thread"]
    return {
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "vocab": 64, "prompt": len(PROMPT), "tokens": tokens},
        "cores": len(cores),
        "rounds": rounds,
        "tokens_per_s": rates,
        "vs_one_session_1_thread": {name: rate / base for name, rate in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()
    result = run(args.layers, args.hidden, args.tokens, args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    m = result["model"]
    print(f"decoder: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads; prompt {m['prompt']} + {m['tokens']} tokens per stream; "
          f"{result['cores']} cores; median of {result['rounds']} interleaved rounds")
    print(f"{'how':<44} {'tokens/s':>9} {'vs 1 session x 1 thread':>24}")
    for name, rate in result["tokens_per_s"].items():
        print(f"{name:<44} {rate:>9.1f} {result['vs_one_session_1_thread'][name]:>23.2f}x")


if __name__ == "__main__":
    main()
