"""Does batching streams pay? Tokens/s of greedy decoding with stream batching on and off, beside
one session decoding the same streams in lockstep, side by side in one run.

A GPT-style decoder with a KV cache (tests/stateful_models.py, random weights; 4 layers, hidden
128, 4 heads by default, as issue 20 measured) is split between its middle layers into 2 stages x 1
thread, pinned to a core each where the machine has 2. For S = 1, 2, 4, 8, 16 streams:

- **batched, delay 0**: the stages built with ``max_batch=16`` and ``max_delay_ms=0`` (a stage
  takes what is queued, never waits); S threads each decode their own prompt through
  ``pipe.stream()``, started a little apart, so streams join (and leave) while others decode;
- **batched, delay 2 ms**: the same with ``max_delay_ms=2``: a stage waits for the streams it
  holds (or that last batched together) to come back, at most 2 ms, so batches fill and stay
  together (their KV caches then feed the next call without a copy);
- **unbatched**: the same bundle built without batching;
- **one driver**: the unbatched and batched (delay 0) bundles with the S streams stepped by one
  thread instead of S: every stream's step submitted (``Stream.submit``), then every result read;
  no thread and no wake-up per stream and token (the per-token latency is then a whole round's);
- **lockstep session**: the whole model in one session x 1 thread decoding the S streams as one
  batch of S from start to end (the static batching a user of one session, or of
  onnxruntime-genai's Generator, gets: streams cannot join or leave; its prompts have equal lengths,
  the best case for it).

Every stream gets a prompt of ``--past`` tokens (different tokens) and generates ``--tokens``
more. Each configuration runs ``--rounds`` times, interleaved; medians are reported with their
spread (min-max), with per-token latency (p50 / p99 of each stream's step times). Also reported:
one stream's per-step overhead, the time a step takes end to end beside the time the stages
spend computing it (``stats()``).

Stateless requests (Triton's dynamic batcher), where it pays and where not: an embedding and a
layer (``tests.models.embed_mlp``, 16 ids per request) of width 64 (per-call overhead dominates)
and 1024 (compute dominates), one stage x 1 thread, 2,000 requests through ``pipe.map`` with
``max_batch=8`` against 1.

    python -m benchmarks.batching [--layers 4] [--hidden 128] [--past 32] [--tokens 32] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks._timing import timed_threads
from benchmarks.pipeline_efficiency import _stream as map_rate
from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import split
from tests.stateful_models import decoder_feeds, decoder_session, gpt_decoder

ort.set_default_logger_severity(3)

STREAMS = (1, 2, 4, 8, 16)
MAX_BATCH = 16
#: (name, max_batch, max_delay_ms) of the pipelines measured.
BATCHINGS = (("unbatched", 1, 0.0), ("batched, delay 0", MAX_BATCH, 0.0), ("batched, delay 2 ms", MAX_BATCH, 2.0))


def _prompt(k: int, length: int, vocab: int) -> list[int]:
    return [(7 * k + 3 * t + 1) % vocab for t in range(length)]


def _decode(step: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], prompt: list[int], count: int, times: list[float]) -> None:
    """Greedy decoding through ``step``, appending each decode step's seconds to ``times``."""
    tokens, done = list(prompt), 0
    for _ in range(count):
        start = time.perf_counter()
        out = step(decoder_feeds(tokens, done))
        times.append(time.perf_counter() - start)
        done = len(tokens)
        tokens.append(int(np.argmax(out["logits"][0, -1])))


def _pipeline(bundle: Path, streams: int, past: int, tokens: int, vocab: int) -> dict[str, Any]:
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH) as pipe:
        with pipe.stream() as warm:
            _decode(warm.step, _prompt(99, past, vocab), 4, [])
        pipe.reset_stats()
        times: list[list[float]] = [[] for _ in range(streams)]

        def run(k: int, start_line: threading.Barrier) -> None:
            start_line.wait()
            time.sleep(0.0005 * k)  # streams join while others decode
            with pipe.stream() as s:
                _decode(s.step, _prompt(k, past, vocab), tokens, times[k])

        elapsed = timed_threads(run, streams)
        stats = pipe.stats()
    steps = sorted(x for ts in times for x in ts)
    return {
        "tokens_per_s": streams * tokens / elapsed,
        "p50_ms": 1e3 * steps[len(steps) // 2],
        "p99_ms": 1e3 * steps[min(len(steps) - 1, round(0.99 * (len(steps) - 1)))],
        "batch_mean": [round(s.batch_mean, 2) for s in stats.stages],
        "compute_ms": sum(s.mean_ms for s in stats.stages),
    }


def _driven(bundle: Path, streams: int, past: int, tokens: int, vocab: int) -> dict[str, Any]:
    """The S streams stepped by one driver thread: each step of every stream submitted, then every
    result read (``Stream.submit`` futures): no thread per stream, no wake-up per token."""
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH) as pipe:
        with pipe.stream() as warm:
            _decode(warm.step, _prompt(99, past, vocab), 4, [])
        pipe.reset_stats()
        opened = [pipe.stream() for _ in range(streams)]
        texts = [_prompt(k, past, vocab) for k in range(streams)]
        done = [0] * streams
        times: list[float] = []
        start = time.perf_counter()
        for _ in range(tokens):
            begin = time.perf_counter()
            futures = [s.submit(decoder_feeds(texts[k], done[k])) for k, s in enumerate(opened)]
            for k, future in enumerate(futures):
                logits = future.result()["logits"]
                done[k] = len(texts[k])
                texts[k].append(int(np.argmax(logits[0, -1])))
            times.append(time.perf_counter() - begin)
        elapsed = time.perf_counter() - start
        stats = pipe.stats()
        for s in opened:
            s.close()
    times.sort()
    return {
        "tokens_per_s": streams * tokens / elapsed,
        "p50_ms": 1e3 * times[len(times) // 2],
        "p99_ms": 1e3 * times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
        "batch_mean": [round(s.batch_mean, 2) for s in stats.stages],
    }


def _lockstep(model: Any, streams: int, past: int, tokens: int, vocab: int) -> dict[str, Any]:
    session = decoder_session(model, 1)
    shapes = {i.name: i.shape for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    pasts = [n for n in shapes if n.startswith("past_key_values.")]

    def generate(count: int, times: list[float]) -> None:
        cache = {n: np.zeros((streams, shapes[n][1], 0, shapes[n][3]), np.float32) for n in pasts}
        ids = np.array([_prompt(k, past, vocab) for k in range(streams)], np.int64)
        total = 0
        for _ in range(count + 1):
            seq = ids.shape[1]
            feeds = {"input_ids": ids, "attention_mask": np.ones((streams, total + seq), np.int64),
                     "position_ids": np.broadcast_to(np.arange(total, total + seq), (streams, seq)).astype(np.int64), **cache}
            start = time.perf_counter()
            out = dict(zip(names, session.run(names, feeds), strict=True))
            if total:
                times.append(time.perf_counter() - start)
            total += seq
            cache = {n: out[n.replace("past_key_values.", "present.")] for n in pasts}
            ids = np.argmax(out["logits"][:, -1], axis=-1)[:, None].astype(np.int64)

    generate(2, [])  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    generate(tokens, times)
    elapsed = time.perf_counter() - start
    times.sort()
    return {"tokens_per_s": streams * tokens / elapsed, "p50_ms": 1e3 * times[len(times) // 2],
            "p99_ms": 1e3 * times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]}


def _overhead(bundle: Path, past: int, tokens: int, vocab: int) -> dict[str, float]:
    """One stream alone: a step end to end, beside what its stages computed (``stats()``)."""
    with load(bundle) as pipe:
        with pipe.stream() as s:
            _decode(s.step, _prompt(98, past, vocab), 4, [])
        pipe.reset_stats()
        times: list[float] = []
        with pipe.stream() as s:
            _decode(s.step, _prompt(97, past, vocab), tokens, times)
        stats = pipe.stats()
    step = 1e3 * statistics.median(times)
    compute = sum(st.p50_ms for st in stats.stages)
    return {"step_ms": step, "stages_compute_ms": compute, "overhead_ms": step - compute}


def _stateless(width: int, max_batch: int, requests: int = 2000) -> float:
    from onnxpipe.builder import PipelineConfig
    from onnxpipe.runtime import StageSettings
    from tests.models import embed_mlp

    with tempfile.TemporaryDirectory() as tmp:
        config = PipelineConfig("mlp")
        stage = config.add_stage(embed_mlp(vocab=4096, width=width), "mlp", settings=StageSettings(max_batch=max_batch))
        config.input("ids").connect(stage.input("ids"))
        stage.output("y").connect(config.output("y"))
        bundle = export(build(config, Path(tmp) / "built").path, Path(tmp) / "bundle")
        ids = {"ids": np.arange(16, dtype=np.int64)[None, :]}
        with load(bundle, queue_depth=16) as pipe:
            return map_rate(pipe, ids, requests)


def run(layers: int, hidden: int, heads: int, past: int, tokens: int, rounds: int, streams: tuple[int, ...] = STREAMS) -> dict[str, Any]:
    vocab = 64
    model = gpt_decoder(layers=layers, hidden=hidden, heads=heads, vocab=vocab, positions=past + tokens + 8)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        bundles = {}
        for k, (how, batch, delay) in enumerate(BATCHINGS):
            plan = split(model, [f"layer{layers // 2 - 1}.out"], states="auto")
            for c, stage in enumerate(plan.config.stages):
                stage.configure(intra_op_threads=1, affinity=[cores[c]] if len(cores) >= 2 else None, max_batch=batch, max_delay_ms=delay)
            bundles[how] = export(build(plan.config, Path(tmp) / f"built-{k}").path, Path(tmp) / f"bundle-{k}")
        configs: dict[tuple[str, int], Callable[[], dict[str, Any]]] = {}
        for s in streams:
            for how, _, _ in BATCHINGS:
                configs[(how, s)] = partial(_pipeline, bundles[how], s, past, tokens, vocab)
            for how in ("unbatched", "batched, delay 0"):
                configs[(f"{how}, one driver", s)] = partial(_driven, bundles[how], s, past, tokens, vocab)
            configs[("lockstep session", s)] = partial(_lockstep, model, s, past, tokens, vocab)
        measured: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in configs}
        overheads = []
        stateless: dict[tuple[int, int], list[float]] = {(w, b): [] for w in (64, 1024) for b in (1, 8)}
        for _ in range(rounds):
            for key, fn in configs.items():
                measured[key].append(fn())
            overheads.append(_overhead(bundles["unbatched"], past, tokens, vocab))
            for (width, batch), rates in stateless.items():
                rates.append(_stateless(width, batch))
    rows = []
    for (how, s), runs in measured.items():
        rates = [r["tokens_per_s"] for r in runs]
        row = {"how": how, "streams": s, "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
               "p50_ms": statistics.median(r["p50_ms"] for r in runs), "p99_ms": statistics.median(r["p99_ms"] for r in runs)}
        if "batch_mean" in runs[0]:
            row["batch_mean"] = runs[len(runs) // 2]["batch_mean"]
        rows.append(row)
    rate = {(r["how"], r["streams"]): r["tokens_per_s"] for r in rows}
    ratios = {s: {f"{how} / {base}": rate[(how, s)] / rate[(base, s)]
                  for how in ("batched, delay 0", "batched, delay 2 ms") for base in ("unbatched", "lockstep session")} for s in streams}
    for s in streams:
        ratios[s]["one driver: batched / unbatched"] = rate[("batched, delay 0, one driver", s)] / rate[("unbatched, one driver", s)]
        ratios[s]["one driver: batched / lockstep session"] = rate[("batched, delay 0, one driver", s)] / rate[("lockstep session", s)]
    overhead = {k: statistics.median(o[k] for o in overheads) for k in overheads[0]}
    return {
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "past": past, "tokens": tokens},
        "cores": len(cores),
        "rounds": rounds,
        "rows": rows,
        "ratios": ratios,
        "one_stream_step": overhead,
        "stateless": [{"width": w, "max_batch": b, "requests_per_s": statistics.median(r), "min": min(r), "max": max(r)}
                      for (w, b), r in stateless.items()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--past", type=int, default=32, help="prompt tokens per stream")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default=",".join(map(str, STREAMS)), help="stream counts, comma-separated")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()
    result = run(args.layers, args.hidden, args.heads, args.past, args.tokens, args.rounds, tuple(int(s) for s in args.streams.split(",")))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    m = result["model"]
    print(f"decoder: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads; prompt {m['past']} + {m['tokens']} tokens per stream; "
          f"{result['cores']} cores; 2 stages x 1 thread; median (min-max) of {result['rounds']} interleaved rounds")
    print(f"{'how':<30} {'streams':>7} {'tokens/s':>9} {'(min-max)':>15} {'p50 ms':>7} {'p99 ms':>7}  batch mean per stage")
    for r in sorted(result["rows"], key=lambda r: (r["streams"], r["how"])):
        spread = f"({r['min']:.0f}-{r['max']:.0f})"
        print(f"{r['how']:<30} {r['streams']:>7} {r['tokens_per_s']:>9.0f} {spread:>15} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}  {r.get('batch_mean', '')}")
    for name in next(iter(result["ratios"].values())):
        print(f"{name:<40} " + "  ".join(f"{s} streams {q[name]:.2f}x" for s, q in result["ratios"].items()))
    o = result["one_stream_step"]
    print(f"one stream, unbatched: a step takes {o['step_ms']:.3f} ms end to end, its stages compute {o['stages_compute_ms']:.3f} ms (p50 each, summed): "
          f"{o['overhead_ms']:.3f} ms of hand-offs, futures and checks per token")
    print("stateless requests, one stage x 1 thread (embed_mlp, 16 ids per request):")
    rates = {(r["width"], r["max_batch"]): r for r in result["stateless"]}
    for width in (64, 1024):
        one, eight = rates[(width, 1)], rates[(width, 8)]
        print(f"  width {width:>4}: max_batch=1 {one['requests_per_s']:.0f} req/s ({one['min']:.0f}-{one['max']:.0f}), "
              f"max_batch=8 {eight['requests_per_s']:.0f} req/s ({eight['min']:.0f}-{eight['max']:.0f}): "
              f"{eight['requests_per_s'] / one['requests_per_s']:.2f}x")


if __name__ == "__main__":
    main()
