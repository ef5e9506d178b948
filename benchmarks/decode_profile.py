"""A decode workload to profile: one of ``benchmarks.llama_exports``'s Llamas split between its
middle layers into 2 stages x 1 thread (pinned to a core each), batching (``max_batch=16``), and
``--streams`` streams stepped by one driver in lockstep rounds (``submit_steps``) after prompts of
``--context`` tokens, for ``--seconds`` seconds of decoding (prompts not counted). What
docs/batching.md's profile ran under py-spy (issue 38: where a decode step's time goes):

    py-spy record --native --rate 200 --format raw -o out.txt -- python -m benchmarks.decode_profile --llama bench-out/llama/24m
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from benchmarks.batching import between_layers
from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama", type=Path, required=True, help="a folder of benchmarks.llama_exports")
    parser.add_argument("--export", choices=("genai", "optimum"), default="genai")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--context", type=int, default=2000, help="prompt tokens per stream")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of decoding")
    args = parser.parse_args()
    about = json.loads((args.llama / "about.json").read_text())
    model = onnx.load(args.llama / args.export / "model.onnx")
    dims, inputs = None, {"input_ids", "attention_mask", "position_ids"}
    if args.export == "genai":
        inputs.discard("position_ids")
        dims = {"kv_cache_dim": json.loads((args.llama / "genai" / "genai_config.json").read_text())["model"]["decoder"]["head_size"]}
    plan = split(model, [between_layers(model, about["layers"] // 2 - 1)], states="auto", dims=dims)
    cores = sorted(os.sched_getaffinity(0))
    for c, stage in enumerate(plan.config.stages):
        stage.configure(intra_op_threads=1, affinity=[cores[c]] if len(cores) >= 2 else None, max_batch=16, max_delay_ms=2.0)
    with tempfile.TemporaryDirectory() as tmp, load(export(build(plan.config, Path(tmp) / "built").path, Path(tmp) / "bundle")) as pipe:
        streams = [pipe.stream() for _ in range(args.streams)]
        texts = [[(7 * k + 3 * t + 1) % about["vocab"] for t in range(args.context)] for k in range(args.streams)]
        done = [0] * args.streams

        def feeds(k: int) -> dict[str, np.ndarray]:
            new = texts[k][done[k]:]
            out = {"input_ids": np.array([new], np.int64), "attention_mask": np.ones((1, len(texts[k])), np.int64)}
            if "position_ids" in inputs:
                out["position_ids"] = np.arange(done[k], len(texts[k]), dtype=np.int64)[None]
            return out

        steps, start = 0, None
        while start is None or time.perf_counter() - start < args.seconds:
            futures = pipe.submit_steps({s: feeds(k) for k, s in enumerate(streams)})
            for k, s in enumerate(streams):
                done[k] = len(texts[k])
                texts[k].append(int(np.argmax(futures[s].result()["logits"][0, -1])))
            if start is None:
                start = time.perf_counter()  # the prompts are in: decoding from here
                pipe.reset_stats()
            else:
                steps += 1
        elapsed = time.perf_counter() - start
        stats = pipe.stats()
        print(f"{steps} decode steps of {args.streams} streams in {elapsed:.1f} s: {steps * args.streams / elapsed:.1f} tokens/s; "
              + "; ".join(f"{s.stage} {s.mean_ms:.1f} ms a call, {getattr(s, 'bytes_copied', float('nan')) / max(steps, 1) / 1e6:.2f} MB copied a round"
                          for s in stats.stages))  # bytes_copied: new in issue 38 (nan on an onnxpipe before it)


if __name__ == "__main__":
    main()
