"""Does batching streams pay? Tokens/s of greedy decoding with stream batching on and off, beside
one session decoding the same streams in lockstep, side by side in one run.

A GPT-style decoder with a KV cache (tests/stateful_models.py, random weights; 4 layers, hidden
128, 4 heads by default, as issue 20 measured) is split between its middle layers into 2 stages x 1
thread, pinned to a core each where the machine has 2. Batched bundles are built with
``max_batch=16`` and ``max_delay_ms=2`` (a group's batch leaves as soon as every member's step is
in, at most 2 ms after the first: ``onnxpipe.runtime.scheduling``); unbatched ones with
``max_batch=1``. For S = 1, 2, 4, 8, 16 streams:

- **thread per stream**: S threads each decode their own prompt through ``pipe.stream()``,
  started a little apart, so streams join (and leave) while others decode;
- **one driver**: one thread steps all S streams, submitting each stream's next step
  (``Stream.submit``) as soon as its result is in (``concurrent.futures.wait``, first completed):
  a generation loop that keeps every micro-batch in flight;
- **one driver, 1 micro-batch**: the same with ``load(micro_batches=1)``: all streams in one
  group, so one batch is in flight and the stages take turns (the choice the default, one group
  per stage, is measured against);
- **rounds**: one thread steps all S streams in lockstep rounds with ``pipe.submit_steps`` (every
  stream's step at once, then every result);
- **lockstep session, N threads**: the whole model in one session x N threads decoding the S
  streams as one batch of S from start to end (the static batching a user of one session gets:
  streams cannot join or leave; its prompts have equal lengths, the best case for it).

With ``--llama FOLDER`` (one of ``benchmarks.llama_exports``'s: a Llama with random weights exported
by optimum-onnx and by onnxruntime-genai's builder), the decoder is that optimum export (with
``--export genai``: the genai export itself, the very file the peer runs), split between its middle
layers, and one more row runs the peer: onnxruntime-genai's ``og.Generator`` on its genai export, greedy, the S streams as one batch of S (``batch_size``), with
onnxruntime's default threads (both cores).

Every stream gets a prompt of ``--past`` tokens (different tokens) and generates ``--tokens``
more. Each configuration runs ``--rounds`` times, interleaved; medians are reported with their
spread (min-max), with the time to a stream's first token (its prompt's step) and the time per
token after it (p50 / p99 of each stream's decode steps), apart, as serving benchmarks report them. Also reported:
one stream's per-step overhead, the time a step takes end to end beside the time the stages
spend computing it (``stats()``).

Stateless requests (Triton's dynamic batcher), where it pays and where not: an embedding and a
layer (``tests.models.embed_mlp``, 16 ids per request) of width 64 (per-call overhead dominates)
and 1024 (compute dominates), one stage x 1 thread, 2,000 requests through ``pipe.map`` with
``max_batch=8`` against 1.

``--only TEXT[,TEXT...]`` measures only the rows whose name contains one of the texts (and of one
stream's step, a round's breakdown and the stateless requests, those whose name does).

With ``--against REV`` the run is this checkout beside git revision REV (issue 37's "hot path
unchanged or faster"): ``--rounds`` rounds, each side's round a fresh process of this module with
``--rounds 1 --json`` (REV's first, then this checkout's, and again), both running this checkout's
benchmark code on their own ``onnxpipe`` (``benchmarks/_checkout.py``, Note: what each side runs),
of the rows ``--only`` names: by default the one-driver rows and one stream's step. Printed per
figure (tokens/s and p50 ms per token of each row and stream count; one stream's step, end to end
and beyond its stages' compute): each side's median (min-max) over its rounds and new / old paired
by round.

    python -m benchmarks.batching [--layers 4] [--hidden 128] [--past 32] [--tokens 32] [--rounds 3] [--streams 8,16]
        [--only TEXT[,TEXT...]] [--against REV] [--json]
    python -m benchmarks.batching --llama bench-out/llama/tiny --streams 8,16 [--export genai]   # in make bench-decoders' venv
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks._checkout import checkout, compare, interleaved, print_comparison, revision
from benchmarks._timing import timed_threads
from benchmarks.pipeline_efficiency import _stream as map_rate
from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import split
from tests.stateful_models import decoder_feeds, decoder_session, gpt_decoder

ort.set_default_logger_severity(3)

STREAMS = (1, 2, 4, 8, 16)
MAX_BATCH = 16
DELAY_MS = 2.0
#: The rows measured at each stream count: (name, bundle, client, micro_batches).
ROWS = (
    ("unbatched, thread per stream", "unbatched", "threads", None),
    ("batched, thread per stream", "batched", "threads", None),
    ("unbatched, one driver", "unbatched", "driver", None),
    ("batched, one driver", "batched", "driver", None),
    ("batched, one driver, 1 micro-batch", "batched", "driver", 1),
    ("batched, rounds", "batched", "rounds", None),
    ("lockstep session, 1 thread", None, "lockstep", 1),
    ("lockstep session, 2 threads", None, "lockstep", 2),
)
#: What is measured besides the rows, by the names ``--only`` matches.
ONE_STREAM, ROUND, STATELESS = "one stream's step", "a round's breakdown", "stateless requests"
#: The peer's row, with --llama: onnxruntime-genai's Generator on its own export.
GENERATOR = ("onnxruntime-genai og.Generator, batch S", None, "generator", None)
#: The ratios reported: (name, numerator row, denominator row).
RATIOS = (
    ("thread per stream: batched / unbatched", "batched, thread per stream", "unbatched, thread per stream"),
    ("one driver: batched / unbatched", "batched, one driver", "unbatched, one driver"),
    ("one driver: batched / lockstep session, 2 threads", "batched, one driver", "lockstep session, 2 threads"),
    ("one driver: batched / lockstep session, 1 thread", "batched, one driver", "lockstep session, 1 thread"),
    ("one driver: micro-batches per stage / 1 micro-batch", "batched, one driver", "batched, one driver, 1 micro-batch"),
    ("rounds: batched / lockstep session, 2 threads", "batched, rounds", "lockstep session, 2 threads"),
)


def _prompt(k: int, length: int, vocab: int) -> list[int]:
    return [(7 * k + 3 * t + 1) % vocab for t in range(length)]


#: The decoder's inputs beside its caches: without ``position_ids`` for onnxruntime-genai's export.
INPUTS = {"input_ids", "attention_mask", "position_ids"}


class _Feeds:
    """A decode step's inputs as a generation loop that cares builds them: the mask a view of one
    array of ones, the token and position each one small array (``decoder_feeds`` for a prompt)."""

    def __init__(self, longest: int) -> None:
        self.ones = np.ones((1, longest), np.int64)
        self.positions = "position_ids" in INPUTS

    def __call__(self, tokens: list[int], done: int) -> dict[str, np.ndarray]:
        n = len(tokens)
        if n - done != 1:
            return {k: v for k, v in decoder_feeds(tokens, done).items() if k in INPUTS}
        feeds = {"input_ids": np.array([[tokens[-1]]], np.int64), "attention_mask": self.ones[:, :n]}
        if self.positions:
            feeds["position_ids"] = np.array([[n - 1]], np.int64)
        return feeds


def _decode(step: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], prompt: list[int], count: int, first: list[float],
            times: list[float], feeds: _Feeds) -> None:
    """Greedy decoding through ``step``: the prompt's step's seconds (the time to the first token)
    appended to ``first``, each later step's to ``times``."""
    tokens, done = list(prompt), 0
    for n in range(count):
        start = time.perf_counter()
        out = step(feeds(tokens, done))
        (times if n else first).append(time.perf_counter() - start)
        done = len(tokens)
        tokens.append(int(np.argmax(out["logits"][0, -1])))


def _latency(first: list[float], times: list[float]) -> dict[str, float]:
    """The median time to a stream's first token (its prompt's step), and p50 / p99 of the time
    per later token (each decode step's), in ms: the prompt, many tokens at once, is left out of
    the per-token figures, as serving benchmarks report TTFT and time per output token apart."""
    times = sorted(times)
    return {"ttft_ms": 1e3 * statistics.median(first), "p50_ms": 1e3 * times[len(times) // 2],
            "p99_ms": 1e3 * times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]}


def _warm(pipe: Any, past: int, vocab: int, feeds: _Feeds) -> None:
    with pipe.stream() as warm:
        _decode(warm.step, _prompt(99, past, vocab), 4, [], [], feeds)
    pipe.reset_stats()


def _threads(bundle: Path, streams: int, past: int, tokens: int, vocab: int, micro: int | None) -> dict[str, Any]:
    feeds = _Feeds(past + tokens + 1)
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH, micro_batches=micro) as pipe:
        _warm(pipe, past, vocab, feeds)
        times: list[list[float]] = [[] for _ in range(streams)]
        first: list[float] = []

        def run(k: int, start_line: threading.Barrier) -> None:
            start_line.wait()
            time.sleep(0.0005 * k)  # streams join while others decode
            with pipe.stream() as s:
                _decode(s.step, _prompt(k, past, vocab), tokens, first, times[k], feeds)

        elapsed = timed_threads(run, streams)
        stats = pipe.stats()
    return {"tokens_per_s": streams * tokens / elapsed, **_latency(first, [x for ts in times for x in ts]),
            "batch_mean": [round(s.batch_mean, 2) for s in stats.stages], "compute_ms": sum(s.mean_ms for s in stats.stages)}


def _driver(bundle: Path, streams: int, past: int, tokens: int, vocab: int, micro: int | None) -> dict[str, Any]:
    """One thread steps the S streams, each stream's next step submitted as soon as its result is
    in: no thread per stream, every micro-batch kept in flight."""
    feeds = _Feeds(past + tokens + 1)
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH, micro_batches=micro) as pipe:
        _warm(pipe, past, vocab, feeds)
        opened = [pipe.stream() for _ in range(streams)]
        texts = [_prompt(k, past, vocab) for k in range(streams)]
        left = [tokens] * streams
        times: list[float] = []
        first: list[float] = []
        start = time.perf_counter()
        pending: dict[Future[Any], tuple[int, float]] = {opened[k].submit(feeds(texts[k], 0)): (k, start) for k in range(streams)}
        while pending:
            ready, _ = wait(pending, return_when=FIRST_COMPLETED)
            now = time.perf_counter()
            for future in ready:
                k, began = pending.pop(future)
                (times if left[k] < tokens else first).append(now - began)
                done = len(texts[k])
                texts[k].append(int(np.argmax(future.result()["logits"][0, -1])))
                left[k] -= 1
                if left[k]:
                    pending[opened[k].submit(feeds(texts[k], done))] = (k, time.perf_counter())
        elapsed = time.perf_counter() - start
        stats = pipe.stats()
        for s in opened:
            s.close()
    return {"tokens_per_s": streams * tokens / elapsed, **_latency(first, times), "batch_mean": [round(s.batch_mean, 2) for s in stats.stages]}


def _rounds(bundle: Path, streams: int, past: int, tokens: int, vocab: int, micro: int | None) -> dict[str, Any]:
    """One thread steps the S streams in lockstep rounds with ``submit_steps``."""
    feeds = _Feeds(past + tokens + 1)
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH, micro_batches=micro) as pipe:
        _warm(pipe, past, vocab, feeds)
        opened = [pipe.stream() for _ in range(streams)]
        texts = [_prompt(k, past, vocab) for k in range(streams)]
        done = [0] * streams
        times: list[float] = []
        first: list[float] = []
        start = time.perf_counter()
        for n in range(tokens):
            begin = time.perf_counter()
            futures = pipe.submit_steps({s: feeds(texts[k], done[k]) for k, s in enumerate(opened)})
            for k, s in enumerate(opened):
                logits = futures[s].result()["logits"]
                done[k] = len(texts[k])
                texts[k].append(int(np.argmax(logits[0, -1])))
            (times if n else first).append(time.perf_counter() - begin)
        elapsed = time.perf_counter() - start
        stats = pipe.stats()
        for s in opened:
            s.close()
    return {"tokens_per_s": streams * tokens / elapsed, **_latency(first, times), "batch_mean": [round(s.batch_mean, 2) for s in stats.stages]}


def _breakdown(bundle: Path, streams: int, past: int, tokens: int, vocab: int) -> dict[str, float]:
    """Where one round's time goes: one driver, all S streams in one batch (``micro_batches=1``,
    ``submit_steps``), so the round is one request's trip; ms per round, from the driver's clock
    and the stages' statistics (each stage's queue: from the batch's first step's submission, or
    the stage before's end, to the stage's start)."""
    feeds = _Feeds(past + tokens + 1)
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH, micro_batches=1) as pipe:
        _warm(pipe, past, vocab, feeds)
        opened = [pipe.stream() for _ in range(streams)]
        texts = [_prompt(k, past, vocab) for k in range(streams)]
        done = [0] * streams
        first = pipe.submit_steps({s: feeds(texts[k], 0) for k, s in enumerate(opened)})  # the prompts: not timed
        for k, s in enumerate(opened):
            done[k] = len(texts[k])
            texts[k].append(int(np.argmax(first[s].result()["logits"][0, -1])))
        pipe.reset_stats()
        user = submit = 0.0
        start = time.perf_counter()
        for _ in range(tokens - 1):
            a = time.perf_counter()
            steps = {s: feeds(texts[k], done[k]) for k, s in enumerate(opened)}
            b = time.perf_counter()
            futures = pipe.submit_steps(steps)
            c = time.perf_counter()
            results = [futures[s].result() for s in opened]
            d = time.perf_counter()
            for k, out in enumerate(results):
                done[k] = len(texts[k])
                texts[k].append(int(np.argmax(out["logits"][0, -1])))
            user += (b - a) + (time.perf_counter() - d)
            submit += c - b
        rounds = tokens - 1
        total = (time.perf_counter() - start) / rounds
        stages = pipe.stats().stages
        for s in opened:
            s.close()
    user, submit = user / rounds, submit / rounds
    q0, q1 = stages[0].queue_mean_ms / 1e3, stages[1].queue_mean_ms / 1e3
    r0, r1 = stages[0].mean_ms / 1e3, stages[1].mean_ms / 1e3
    rest = total - user - submit - max(0.0, q0 - submit) - r0 - q1 - r1
    parts = {"round": total, "generation loop (feeds, argmax)": user, "submit_steps (checks, scheduler, stacking)": submit,
             "hand-off to stage 0": max(0.0, q0 - submit), "stage 0 session call": r0, "hand-off to stage 1": q1,
             "stage 1 session call": r1, "exit (split, futures) and wake-up": rest}
    return {k: 1e3 * v for k, v in parts.items()}


def between_layers(model: Any, k: int) -> list[str]:
    """The cut after decoder layer ``k`` of an optimum Llama export: every tensor made by a node of
    layers 0..k (or before them) and read by a later layer or the head; what is computed from
    constants alone goes with the stages that read it (the splitter's rule), so it is not part of it."""
    def later(name: str) -> bool:
        layer = re.match(r"/model/layers\.(\d+)/", name)
        return int(layer.group(1)) > k if layer else name.startswith(("/model/norm", "/lm_head"))

    graph = model.graph
    constant = {i.name for i in graph.initializer}
    for n in graph.node:  # in graph order: what is computed from constants alone (weights the exporter passes through Identity)
        if all(i in constant for i in n.input if i):
            constant.update(n.output)
    made = {o for n in graph.node if not later(n.name) for o in n.output if o and o not in constant}
    return sorted({i for n in graph.node if later(n.name) for i in n.input if i in made})


def _generator(folder: Path, streams: int, past: int, tokens: int, vocab: int) -> dict[str, Any]:
    """onnxruntime-genai's Generator on its own export: the S prompts as one batch, greedy, ``tokens`` new tokens each."""
    import onnxruntime_genai as og

    model = _og_model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=past + tokens, min_length=past + tokens, batch_size=streams, do_sample=False)
    generator = og.Generator(model, params)
    ids = np.array([_prompt(k, past, vocab) for k in range(streams)], np.int32)
    times: list[float] = []
    start = time.perf_counter()
    generator.append_tokens(ids)
    first = [time.perf_counter() - start]
    while not generator.is_done():
        began = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - began)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": streams * tokens / elapsed, **_latency(first, times)}


_OG_MODELS: dict[Path, Any] = {}


def _og_model(folder: Path) -> Any:
    """The genai model, loaded once per process (as a server would)."""
    import onnxruntime_genai as og

    if folder not in _OG_MODELS:
        _OG_MODELS[folder] = og.Model(str(folder))
    return _OG_MODELS[folder]


def _lockstep(model: Any, streams: int, past: int, tokens: int, vocab: int, threads: int = 1) -> dict[str, Any]:
    session = decoder_session(model, threads)
    shapes = {i.name: i.shape for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    pasts = [n for n in shapes if n.startswith("past_key_values.")]

    def generate(count: int, first: list[float], times: list[float]) -> None:
        cache = {n: np.zeros((streams, shapes[n][1], 0, shapes[n][3] if isinstance(shapes[n][3], int) else HEAD_SIZE[0]), np.float32) for n in pasts}
        ids = np.array([_prompt(k, past, vocab) for k in range(streams)], np.int64)
        total = 0
        for _ in range(count):
            seq = ids.shape[1]
            start = time.perf_counter()
            feeds = {"input_ids": ids, "attention_mask": np.ones((streams, total + seq), np.int64),
                     "position_ids": np.broadcast_to(np.arange(total, total + seq), (streams, seq)).astype(np.int64), **cache}
            feeds = {k: v for k, v in feeds.items() if k in shapes}
            out = dict(zip(names, session.run(names, feeds), strict=True))
            total += seq
            cache = {n: out[n.replace("past_key_values.", "present.")] for n in pasts}
            ids = np.argmax(out["logits"][:, -1], axis=-1)[:, None].astype(np.int64)
            (times if total > seq else first).append(time.perf_counter() - start)

    generate(2, [], [])  # warm-up
    times: list[float] = []
    first: list[float] = []
    start = time.perf_counter()
    generate(tokens, first, times)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": streams * tokens / elapsed, **_latency(first, times)}


def _overhead(bundle: Path, past: int, tokens: int, vocab: int) -> dict[str, float]:
    """One stream alone: a step end to end, beside what its stages computed (``stats()``)."""
    feeds = _Feeds(past + tokens + 1)
    with load(bundle) as pipe:
        _warm(pipe, past, vocab, feeds)
        times: list[float] = []
        with pipe.stream() as s:
            _decode(s.step, _prompt(97, past, vocab), tokens, [], times, feeds)
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


#: The head size of a genai export's caches (its ``kv_cache_dim``), from its genai_config.json.
HEAD_SIZE = [0]


def run(layers: int, hidden: int, heads: int, past: int, tokens: int, rounds: int, streams: tuple[int, ...] = STREAMS,
        llama: Path | None = None, exporter: str = "optimum", only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every row at every stream count, and the rest (:data:`ONE_STREAM`, :data:`ROUND`,
    :data:`STATELESS`), in ``rounds`` interleaved rounds; with ``only``, just what has one of its
    texts in its name."""

    def wanted(name: str) -> bool:
        return not only or any(text in name for text in only)

    rows_measured = list(ROWS)
    if llama is None:
        vocab = 64
        model = gpt_decoder(layers=layers, hidden=hidden, heads=heads, vocab=vocab, positions=past + tokens + 8)
        cut: list[str] = [f"layer{layers // 2 - 1}.out"]
        described = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab}
    else:
        import onnx

        described = json.loads((llama / "about.json").read_text())
        described["export"] = exporter
        vocab, layers = described["vocab"], described["layers"]
        model = onnx.load(llama / exporter / "model.onnx")  # the genai export's external data loaded too: split and the lockstep rows read it
        if exporter == "genai":
            INPUTS.discard("position_ids")
            HEAD_SIZE[0] = json.loads((llama / "genai" / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
        cut = between_layers(model, layers // 2 - 1)
        rows_measured.append(GENERATOR)
    rows_measured = [r for r in rows_measured if wanted(r[0])]
    cores = sorted(os.sched_getaffinity(0))
    clients = {"threads": _threads, "driver": _driver, "rounds": _rounds}
    with tempfile.TemporaryDirectory() as tmp:
        bundles = {}
        for how, batch in (("unbatched", 1), ("batched", MAX_BATCH)):
            plan = split(model, [cut], states="auto", dims={"kv_cache_dim": HEAD_SIZE[0]} if HEAD_SIZE[0] else None)
            for c, stage in enumerate(plan.config.stages):
                stage.configure(intra_op_threads=1, affinity=[cores[c]] if len(cores) >= 2 else None, max_batch=batch,
                                max_delay_ms=DELAY_MS if batch > 1 else 0.0)
            bundles[how] = export(build(plan.config, Path(tmp) / f"built-{how}").path, Path(tmp) / f"bundle-{how}")
        configs: dict[tuple[str, int], Callable[[], dict[str, Any]]] = {}
        for s in streams:
            for name, bundle, client, micro in rows_measured:
                if client == "generator":
                    assert llama is not None
                    configs[(name, s)] = partial(_generator, llama / "genai", s, past, tokens, vocab)
                elif client == "lockstep":
                    configs[(name, s)] = partial(_lockstep, model, s, past, tokens, vocab, micro or 1)
                else:
                    configs[(name, s)] = partial(clients[client], bundles[bundle or "batched"], s, past, tokens, vocab, micro)
        measured: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in configs}
        overheads = []
        breakdowns: list[dict[str, float]] = []
        stateless: dict[tuple[int, int], list[float]] = {(w, b): [] for w in (64, 1024) for b in (1, 8)}
        for _ in range(rounds):
            for key, fn in configs.items():
                measured[key].append(fn())
            if wanted(ONE_STREAM):
                overheads.append(_overhead(bundles["unbatched"], past, tokens, vocab))
            if wanted(ROUND):
                breakdowns.append(_breakdown(bundles["batched"], max(streams), past, tokens, vocab))
            for (width, batch), rates in (stateless.items() if llama is None and wanted(STATELESS) else ()):
                rates.append(_stateless(width, batch))
    rows = []
    for (how, s), runs in measured.items():
        rates = [r["tokens_per_s"] for r in runs]
        row = {"how": how, "streams": s, "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
               "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
               "p50_ms": statistics.median(r["p50_ms"] for r in runs), "p99_ms": statistics.median(r["p99_ms"] for r in runs)}
        if "batch_mean" in runs[0]:
            row["batch_mean"] = runs[len(runs) // 2]["batch_mean"]
        rows.append(row)
    by = {(r["how"], r["streams"]): r for r in rows}
    ratios: dict[int, dict[str, float]] = {}
    og_ratios = [(f"{how} / og.Generator", how, GENERATOR[0]) for how in ("batched, one driver", "batched, rounds")] if llama is not None else []
    for s in streams:
        # Each ratio whose two rows were measured (all of them without --only), in this order.
        quotients = [(name, a, b, "tokens_per_s") for name, a, b in (*RATIOS, *og_ratios)] + [
            ("one driver: p99 per token, batched / unbatched", "batched, one driver", "unbatched, one driver", "p99_ms"),
            ("one driver: time to first token, batched / unbatched", "batched, one driver", "unbatched, one driver", "ttft_ms"),
            ("thread per stream: p99 per token, batched / unbatched", "batched, thread per stream", "unbatched, thread per stream", "p99_ms")]
        ratios[s] = {name: by[(a, s)][key] / by[(b, s)][key] for name, a, b, key in quotients if (a, s) in by and (b, s) in by}
    overhead = {k: statistics.median(o[k] for o in overheads) for k in overheads[0]} if overheads else None
    breakdown = {"streams": max(streams), **{k: statistics.median(b[k] for b in breakdowns) for k in breakdowns[0]}} if breakdowns else None
    return {
        "model": {**described, "past": past, "tokens": tokens, "cut": cut},
        "cores": len(cores),
        "rounds": rounds,
        "rows": rows,
        "ratios": ratios,
        "one_stream_step": overhead,
        "round_ms": breakdown,
        "stateless": [{"width": w, "max_batch": b, "requests_per_s": statistics.median(r), "min": min(r), "max": max(r)}
                      for (w, b), r in stateless.items() if r],
    }


#: What ``--against`` compares unless ``--only`` says otherwise: the one-driver rows and one stream's step.
AGAINST = f"one driver,{ONE_STREAM}"


def _figures(result: dict[str, Any]) -> dict[str, float | None]:
    """The figures ``--against`` compares, from one round's JSON result."""
    out: dict[str, float | None] = {}
    for r in sorted(result["rows"], key=lambda r: (r["streams"], r["how"])):
        out[f"{r['how']}, {r['streams']} streams: tokens/s"] = r["tokens_per_s"]
        out[f"{r['how']}, {r['streams']} streams: p50 ms per token"] = r["p50_ms"]
    if (o := result["one_stream_step"]) is not None:
        out["one stream, unbatched: step ms"] = o["step_ms"]
        out["one stream, unbatched: step ms beyond its stages' compute"] = o["overhead_ms"]
    return out


def against(rev: str, args: argparse.Namespace, only: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """This checkout beside ``rev``: ``args.rounds`` interleaved rounds of one process each
    (``benchmarks._checkout``), measuring what ``only`` names."""
    child = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads), "--past", str(args.past),
             "--tokens", str(args.tokens), "--streams", args.streams, "--export", args.export, "--only", ",".join(only)]
    if args.llama is not None:
        child += ["--llama", str(args.llama.resolve())]
    with checkout(rev) as old:
        samples = interleaved("benchmarks.batching", child, old, rev, args.rounds, _figures)
    return compare(samples)


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
    parser.add_argument("--llama", type=Path, help="a folder of benchmarks.llama_exports: its optimum export, and og.Generator on its genai export")
    parser.add_argument("--export", choices=("optimum", "genai"), default="optimum",
                        help="with --llama: which export onnxpipe splits (genai: the very file og.Generator runs)")
    parser.add_argument("--only", metavar="TEXT[,TEXT...]",
                        help=f"measure only the rows (and of {ONE_STREAM!r}, {ROUND!r}, {STATELESS!r}) whose name contains one of the TEXTs")
    parser.add_argument("--against", metavar="REV", help="measure this checkout beside git revision REV, rounds interleaved, and print new / old "
                        f"(of --only's rows, by default {AGAINST!r})")
    args = parser.parse_args()
    only = tuple(t.strip() for t in args.only.split(",")) if args.only else ()
    if args.against:
        compared = against(args.against, args, only or tuple(AGAINST.split(",")))
        if args.json:
            print(json.dumps(compared, indent=2))
            return
        print_comparison(compared, revision(args.against), args.rounds)
        print("(tokens/s: higher is better; ms: lower is faster)")
        return
    result = run(args.layers, args.hidden, args.heads, args.past, args.tokens, args.rounds, tuple(int(s) for s in args.streams.split(",")),
                 args.llama, args.export, only)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    m = result["model"]
    exporter = "onnxruntime-genai builder" if m.get("export") == "genai" else "optimum-onnx"
    size = f", {m['parameters'] / 1e6:.1f} M parameters ({exporter} export, random weights)" if "parameters" in m else ""
    print(f"decoder: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads{size}; prompt {m['past']} + {m['tokens']} tokens per stream; "
          f"{result['cores']} cores; 2 stages x 1 thread, max_batch {MAX_BATCH}, max_delay_ms {DELAY_MS:g}; "
          f"median (min-max) of {result['rounds']} interleaved rounds")
    print(f"{'how':<36} {'streams':>7} {'tokens/s':>9} {'(min-max)':>15} {'TTFT ms':>8} {'p50 ms':>7} {'p99 ms':>7}  batch mean per stage"
          "  (p50 / p99: per token after the first)")
    for r in sorted(result["rows"], key=lambda r: (r["streams"], r["how"])):
        spread = f"({r['min']:.0f}-{r['max']:.0f})"
        print(f"{r['how']:<36} {r['streams']:>7} {r['tokens_per_s']:>9.0f} {spread:>15} {r['ttft_ms']:>8.2f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}  "
              f"{r.get('batch_mean', '')}")
    for name in next(iter(result["ratios"].values())):
        print(f"{name:<56} " + "  ".join(f"{s} streams {q[name]:.2f}x" for s, q in result["ratios"].items()))
    if (o := result["one_stream_step"]) is not None:
        print(f"one stream, unbatched: a step takes {o['step_ms']:.3f} ms end to end, its stages compute {o['stages_compute_ms']:.3f} ms (p50 each, summed): "
              f"{o['overhead_ms']:.3f} ms of hand-offs, futures and checks per token")
    if (b := result["round_ms"]) is not None:
        print(f"one round of {b['streams']} streams as one batch (1 micro-batch, submit_steps), ms, median of the rounds:")
        for name, ms in b.items():
            if name != "streams":
                print(f"  {name:<44} {ms:7.3f}")
    if not result["stateless"]:
        return
    print("stateless requests, one stage x 1 thread (embed_mlp, 16 ids per request):")
    rates = {(r["width"], r["max_batch"]): r for r in result["stateless"]}
    for width in (64, 1024):
        one, eight = rates[(width, 1)], rates[(width, 8)]
        print(f"  width {width:>4}: max_batch=1 {one['requests_per_s']:.0f} req/s ({one['min']:.0f}-{one['max']:.0f}), "
              f"max_batch=8 {eight['requests_per_s']:.0f} req/s ({eight['min']:.0f}-{eight['max']:.0f}): "
              f"{eight['requests_per_s'] / one['requests_per_s']:.2f}x")


if __name__ == "__main__":
    main()
