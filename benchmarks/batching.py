"""Does batching streams pay? Tokens/s of greedy decoding with stream batching on and off, beside
one session decoding the same streams in lockstep, side by side in one run.

A GPT-style decoder with a KV cache (tests/stateful_models.py, random weights; 4 layers, hidden
128, 4 heads by default, as issue 20 measured) is split between its middle layers into 2 stages x 1
thread, pinned to a core each where the machine has 2. Batched bundles are built with
``max_batch=16`` and ``max_delay_ms=2`` (a group's batch leaves as soon as every member's step is
in, at most 2 ms after the first: ``onnxpipe.runtime.scheduling``); unbatched ones with
``max_batch=1``. For S = 1, 2, 4, 8, 16 streams:

- **thread per stream**: S threads each decode their own prompt through ``pipe.stream()``,
  started a little apart, so streams join while others step their prompts; each waits for every
  prompt's step (the statistics start there), then decodes on its own;
- **one driver**: one thread steps all S streams, submitting each stream's next step
  (``Stream.submit``) as soon as its result is in (``concurrent.futures.wait``, first completed):
  a generation loop that keeps every micro-batch in flight; every prompt's step first, then the
  decode steps;
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

With ``--llama FOLDER --contexts 128,512,2048`` (issue 38) the rows are others, at each context
(each stream's prompt that many tokens, then ``--tokens``, default 64, greedy tokens) and stream
count, in one interleaved run (:data:`CONTEXT_ROWS`): onnxpipe batched (2 stages x 1 thread, as
above) by one driver and by a thread per stream; ``og.Generator`` at batch S (``--export genai``
only; ``max_length`` the context + ``--tokens``); and the whole export in one plain onnxruntime
session x 2 threads with onnxruntime's defaults (its idle threads spin; before 2026-12-04 they did
not, which made it 1.09-1.22x slower on the 24.7 M Llama) stepping the S streams as one batch, its
KV bound with IOBinding (``benchmarks._kv_sessions``: on the genai export one preallocated buffer of context + tokens
positions bound as past and present, ``GroupQueryAttention``'s shared buffer; on optimum's, presents
bound as outputs and bound as the next step's pasts) or fed numpy in and out; and, where the Llama
has its openvino export (``benchmarks.llama_exports --only openvino``, fp32) and
``--ovgenai-python`` (default ``.venv-ovgenai``, which ``make bench-decoders`` makes) is there,
OpenVINO GenAI's ``ContinuousBatchingPipeline`` (paged attention) stepping the S streams as requests
added at once, the machine's cores as threads, in a process of that venv per round
(``benchmarks.ovgenai_peer``; left out with a line that says why otherwise). Reported: decode
tokens/s (the steps after every prompt's), p50 / p99 ms per token, TTFT; each row's p50 added from
the shortest context to the longest; onnxpipe / og, onnxpipe / the bound session, thread per
stream / one driver and onnxpipe / OpenVINO GenAI, paired per round; for onnxpipe's rows, per stage, the bytes of streams' state
copied per decode step (``StageStats.bytes_copied`` over the stage's calls) beside one stream's KV
per stage. Every row's tokens must equal the first's, and its last step's logits be within
:data:`LOGITS_ATOL` (OpenVINO GenAI exposes none: its tokens alone), or the run fails.

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
    python -m benchmarks.batching --llama bench-out/llama/24m --export genai --contexts 128,512,2048 --streams 8,16 [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
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

from benchmarks._checkout import checkout, compare, interleaved, report
from benchmarks._kv_sessions import PAST, FedBackKV, NumpyKV, SharedKV, Step
from benchmarks._kv_sessions import lockstep as kv_lockstep
from benchmarks._timing import spread, timed_threads
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


def _decode(step: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], tokens: list[int], count: int, times: list[float],
            feeds: _Feeds, done: int = 0) -> np.ndarray:
    """``count`` greedy steps through ``step``, feeding ``tokens[done:]`` first (``tokens`` grows in
    place): each step's seconds appended to ``times``; the last step's logits."""
    logits = np.empty(0)
    for _ in range(count):
        start = time.perf_counter()
        logits = step(feeds(tokens, done))["logits"][0, -1]
        times.append(time.perf_counter() - start)
        done = len(tokens)
        tokens.append(int(np.argmax(logits)))
    return logits


def _latency(first: list[float], times: list[float]) -> dict[str, float]:
    """The median time to a stream's first token (its prompt's step), and p50 / p99 of the time
    per later token (each decode step's), in ms: the prompt, many tokens at once, is left out of
    the per-token figures, as serving benchmarks report TTFT and time per output token apart."""
    times = sorted(times) or [0.0]
    return {"ttft_ms": 1e3 * statistics.median(first), "p50_ms": 1e3 * times[len(times) // 2],
            "p99_ms": 1e3 * times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]}


def _rates(streams: int, tokens: int, elapsed: float, decoding: float, first: list[float], times: list[float]) -> dict[str, float]:
    """Tokens/s over the whole run (prompts included) and over the decode steps alone (the
    ``tokens - 1`` steps per stream after every prompt's), with :func:`_latency`."""
    return {"tokens_per_s": streams * tokens / elapsed, "decode_per_s": streams * (tokens - 1) / max(decoding, 1e-9), **_latency(first, times)}


def _generated(texts: list[list[int]], past: int, logits: list[np.ndarray]) -> dict[str, Any]:
    """What every row's tokens are checked by: each stream's new tokens and its last step's logits."""
    return {"tokens": [t[past:] for t in texts], "logits": np.stack(logits)}


def _stage_figures(stats: Any) -> dict[str, Any]:
    """Per stage, over the decode steps: requests per call and bytes of streams' state copied per
    call (``StageStats.bytes_copied`` over its calls)."""
    calls = [sum(s.batch_sizes.values()) or s.count for s in stats.stages]
    return {"batch_mean": [round(s.batch_mean, 2) for s in stats.stages],
            "copied": [s.bytes_copied / max(n, 1) for s, n in zip(stats.stages, calls, strict=True)]}


def _warm(pipe: Any, past: int, vocab: int, feeds: _Feeds) -> None:
    with pipe.stream() as warm:
        _decode(warm.step, _prompt(99, past, vocab), 4, [], feeds)
    pipe.reset_stats()


def _threads(bundle: Path, streams: int, past: int, tokens: int, vocab: int, micro: int | None) -> dict[str, Any]:
    """A thread per stream: started a little apart, each steps its prompt, waits for every
    stream's (the statistics start there: the decode steps' alone), then decodes on its own."""
    feeds = _Feeds(past + tokens + 1)
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH, micro_batches=micro) as pipe:
        _warm(pipe, past, vocab, feeds)
        times: list[list[float]] = [[] for _ in range(streams)]
        first: list[float] = []
        texts = [_prompt(k, past, vocab) for k in range(streams)]
        logits: list[np.ndarray] = [np.empty(0)] * streams
        decoding: list[float] = []

        def decode_from_here() -> None:  # run once, by the last stream to finish its prompt
            pipe.reset_stats()
            decoding.append(time.perf_counter())

        prompted = threading.Barrier(streams, action=decode_from_here)

        def run(k: int, start_line: threading.Barrier) -> None:
            start_line.wait()
            time.sleep(0.0005 * k)  # streams join while others step their prompts
            with pipe.stream() as s:
                logits[k] = _decode(s.step, texts[k], 1, first, feeds)
                prompted.wait()
                logits[k] = _decode(s.step, texts[k], tokens - 1, times[k], feeds, done=past)

        elapsed = timed_threads(run, streams)
        end = time.perf_counter()
        stats = pipe.stats()
    return {**_rates(streams, tokens, elapsed, end - decoding[0], first, [x for ts in times for x in ts]), **_stage_figures(stats),
            **_generated(texts, past, logits), "compute_ms": sum(s.mean_ms for s in stats.stages)}


def _drive(opened: list[Any], texts: list[list[int]], fed: list[int], steps: int, times: list[float], logits: list[np.ndarray],
           feeds: _Feeds) -> None:
    """Each stream's next ``steps`` greedy steps, each submitted as soon as the stream's step
    before is in (every micro-batch kept in flight): ``texts`` grow in place, each step's seconds
    go to ``times``, each stream's last logits to ``logits``."""
    left = [steps] * len(opened)

    def submit(k: int) -> Future[Any]:
        return opened[k].submit(feeds(texts[k], fed[k]))

    pending: dict[Future[Any], tuple[int, float]] = {submit(k): (k, time.perf_counter()) for k in range(len(opened)) if steps}
    while pending:
        ready, _ = wait(pending, return_when=FIRST_COMPLETED)
        now = time.perf_counter()
        for future in ready:
            k, began = pending.pop(future)
            times.append(now - began)
            logits[k] = future.result()["logits"][0, -1]
            fed[k] = len(texts[k])
            texts[k].append(int(np.argmax(logits[k])))
            left[k] -= 1
            if left[k]:
                pending[submit(k)] = (k, time.perf_counter())


def _driver(bundle: Path, streams: int, past: int, tokens: int, vocab: int, micro: int | None) -> dict[str, Any]:
    """One thread steps the S streams, each stream's next step submitted as soon as its result is
    in: no thread per stream, every micro-batch kept in flight; the prompts' steps first (the
    statistics start after them: the decode steps' alone)."""
    feeds = _Feeds(past + tokens + 1)
    with load(bundle, max_streams=streams + 1, queue_depth=MAX_BATCH, micro_batches=micro) as pipe:
        _warm(pipe, past, vocab, feeds)
        opened = [pipe.stream() for _ in range(streams)]
        texts = [_prompt(k, past, vocab) for k in range(streams)]
        fed = [0] * streams
        logits: list[np.ndarray] = [np.empty(0)] * streams
        times: list[float] = []
        first: list[float] = []
        start = time.perf_counter()
        _drive(opened, texts, fed, 1, first, logits, feeds)
        pipe.reset_stats()
        decoding = time.perf_counter()
        _drive(opened, texts, fed, tokens - 1, times, logits, feeds)
        end = time.perf_counter()
        stats = pipe.stats()
        for s in opened:
            s.close()
    return {**_rates(streams, tokens, end - start, end - decoding, first, times), **_stage_figures(stats), **_generated(texts, past, logits)}


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
    """onnxruntime-genai's Generator on its own export: the S prompts as one batch, greedy, ``tokens`` new tokens each
    (``max_length`` the prompt + ``tokens``: its shared KV buffer's capacity). A stream that picks
    the export's end-of-sequence token ends there (``stops_at``); the batch goes on: a ``min_length``
    would keep it going by masking that token, and so pick other tokens than the whole model's."""
    import onnxruntime_genai as og

    model = _og_model(folder)

    def generator(length: int) -> Any:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length + tokens, batch_size=streams, do_sample=False)
        made = og.Generator(model, params)
        made.append_tokens(np.array([_prompt(k, length, vocab) for k in range(streams)], np.int32))
        return made

    generator(min(past, 8)).generate_next_token()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    made = generator(past)
    made.generate_next_token()  # the prompt's logits were computed by append_tokens: this picks the first token
    first = [time.perf_counter() - start]
    logits = np.empty(0)
    for n in range(tokens - 1):
        if made.is_done():  # every stream ended
            break
        began = time.perf_counter()
        if n == tokens - 2:
            logits = made.get_logits()[:, -1]  # the last step's (asking runs it; asking after the last token would run one more)
        made.generate_next_token()
        times.append(time.perf_counter() - began)
    elapsed = time.perf_counter() - start
    texts = [[int(t) for t in made.get_sequence(k)] for k in range(streams)]
    eos = json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    return {**_rates(streams, tokens, elapsed, elapsed - first[0], first, times), "tokens": [t[past:] for t in texts],
            "logits": logits if tokens > 1 else np.empty(0), "stops_at": set(eos if isinstance(eos, list) else [eos])}


_OG_MODELS: dict[Path, Any] = {}


def _og_model(folder: Path) -> Any:
    """The genai model, loaded once per process (as a server would)."""
    import onnxruntime_genai as og

    if folder not in _OG_MODELS:
        _OG_MODELS[folder] = og.Model(str(folder))
    return _OG_MODELS[folder]


#: What a plain session's KV cache is, by ``--llama`` row: :mod:`benchmarks._kv_sessions`.
CACHES = {"numpy": NumpyKV, "shared": SharedKV, "fed back": FedBackKV}


def _lockstep(model: Any, streams: int, past: int, tokens: int, vocab: int, threads: int = 1, kv: str = "numpy",
              spinning: bool = False) -> dict[str, Any]:
    """The whole model in one session x ``threads`` stepping the S streams as one batch, its KV
    cache kept as ``kv`` says (:data:`CACHES`), its idle threads spinning with ``spinning``."""
    session = decoder_session(model, threads, spinning)
    head = next(i.shape[3] for i in session.get_inputs() if i.name.startswith(PAST))
    head = head if isinstance(head, int) else HEAD_SIZE[0]

    def caches(length: int) -> Step:
        extra = {"capacity": length + tokens} if kv == "shared" else {}
        made: Step = CACHES[kv](session, streams, head, **extra)
        return made

    prompts = np.array([_prompt(k, past, vocab) for k in range(streams)], np.int64)
    kv_lockstep(caches(min(past, 8)), prompts[:, :8], 2)  # warm-up
    out = kv_lockstep(caches(past), prompts, tokens)
    decoding = sum(out["times"])
    return {**_rates(streams, tokens, out["first"][0] + decoding, decoding, out["first"], out["times"]),
            "tokens": out["tokens"], "logits": out["logits"]}


def _overhead(bundle: Path, past: int, tokens: int, vocab: int) -> dict[str, float]:
    """One stream alone: a step end to end, beside what its stages computed (``stats()``)."""
    feeds = _Feeds(past + tokens + 1)
    with load(bundle) as pipe:
        _warm(pipe, past, vocab, feeds)
        times: list[float] = []
        with pipe.stream() as s:
            prompt = _prompt(97, past, vocab)
            _decode(s.step, prompt, 1, [], feeds)
            _decode(s.step, prompt, tokens - 1, times, feeds, done=past)
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


def _llama(llama: Path, exporter: str) -> tuple[Any, dict[str, Any], list[str]]:
    """The export ``exporter`` of the Llama in ``llama`` (``benchmarks.llama_exports``), what
    about.json says of it, and the cut between its middle layers."""
    import onnx

    described = json.loads((llama / "about.json").read_text())
    described["export"] = exporter
    model = onnx.load(llama / exporter / "model.onnx")  # the genai export's external data loaded too: split and the lockstep rows read it
    if exporter == "genai":
        INPUTS.discard("position_ids")
        decoder = json.loads((llama / "genai" / "genai_config.json").read_text())["model"]
        HEAD_SIZE[0] = decoder["decoder"]["head_size"]
        described["context_length"] = decoder["context_length"]
    return model, described, between_layers(model, described["layers"] // 2 - 1)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How onnxpipe's pipeline of a ``--llama`` is laid out on the cores: ``stages`` (1: the whole
    export in one stage; 2: split between its middle layers) x ``threads`` each, and
    ``micro_batches`` (None: one per stage), and whether the stages' thread pools spin.
    Written ``STAGESxTHREADS[:MICRO][+spin]``, as ``2x1``, ``2x2:1`` or ``1x2+spin``. One thread per
    stage is pinned to a core of its own where there are enough; more threads are not pinned (the
    stages then share the cores, each using all of them when the other waits). Spinning is off
    unless ``+spin`` (onnxpipe's default: a spinning pool steals the other stage's core; a pool that
    does not spin wakes its threads through the OS at every parallel section)."""

    stages: int = 2
    threads: int = 1
    micro_batches: int | None = None
    spinning: bool = False

    def __str__(self) -> str:
        return f"{self.stages}x{self.threads}" + (f":{self.micro_batches}" if self.micro_batches else "") + ("+spin" if self.spinning else "")

    @classmethod
    def parse(cls, text: str) -> Layout:
        found = re.fullmatch(r"([12])x([1-9][0-9]*)(?::([1-9][0-9]*))?(\+spin)?", text.strip())
        if not found:
            raise ValueError(f"layout {text!r}: write STAGESxTHREADS[:MICRO_BATCHES][+spin], stages 1 or 2, as 2x1, 2x2:1 or 1x2+spin")
        micro = found.group(3)
        return cls(int(found.group(1)), int(found.group(2)), int(micro) if micro else None, bool(found.group(4)))


#: onnxpipe's layout in every row but ``--layouts``' others: 2 stages x 1 thread, one micro-batch per stage.
PIPELINE = Layout()


def _bundle(model: Any, cut: list[str], batch: int, where: Path, layout: Layout = PIPELINE) -> Path:
    """``model`` split at ``cut`` into ``layout``'s stages x threads (1 thread pinned to a core
    of its own where there are enough), batching up to ``batch`` steps a call: the bundle."""
    cores = sorted(os.sched_getaffinity(0))
    how: dict[str, Any] = {"cuts": [cut]} if layout.stages == 2 else {"assignment": {n.name: 0 for n in model.graph.node}}
    plan = split(model, **how, states="auto", dims={"kv_cache_dim": HEAD_SIZE[0]} if HEAD_SIZE[0] else None)
    pin = layout.threads == 1 and len(cores) >= layout.stages
    for c, stage in enumerate(plan.config.stages):
        stage.configure(intra_op_threads=layout.threads, affinity=[cores[c]] if pin else None, max_batch=batch,
                        max_delay_ms=DELAY_MS if batch > 1 else 0.0, spinning=layout.spinning)
    return export(build(plan.config, where / "built").path, where / "bundle")


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
        model, described, cut = _llama(llama, exporter)
        vocab = described["vocab"]
        rows_measured.append(GENERATOR)
    rows_measured = [r for r in rows_measured if wanted(r[0])]
    cores = sorted(os.sched_getaffinity(0))
    clients = {"threads": _threads, "driver": _driver, "rounds": _rounds}
    with tempfile.TemporaryDirectory() as tmp:
        bundles = {how: _bundle(model, cut, batch, Path(tmp) / how) for how, batch in (("unbatched", 1), ("batched", MAX_BATCH))}
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


#: The rows of ``--contexts`` (issue 38), in the order each round runs them: (name, runner).
CONTEXT_ROWS = (
    ("onnxpipe batched, one driver", "driver"),
    ("onnxpipe batched, thread per stream", "threads"),
    ("og.Generator, batch S", "generator"),
    ("onnxruntime session x 2 threads, KV bound (IOBinding)", "bound"),
    ("onnxruntime session x 2 threads, numpy in / out", "numpy"),
    ("OpenVINO GenAI, continuous batching", "ovgenai"),
)
#: The ratios of ``--contexts``, decode tokens/s paired per round: (name, numerator row, denominator row).
CONTEXT_RATIOS = (
    ("onnxpipe one driver / og.Generator", CONTEXT_ROWS[0][0], CONTEXT_ROWS[2][0]),
    ("onnxpipe one driver / bound session", CONTEXT_ROWS[0][0], CONTEXT_ROWS[3][0]),
    ("thread per stream / one driver", CONTEXT_ROWS[1][0], CONTEXT_ROWS[0][0]),
    ("onnxpipe one driver / OpenVINO GenAI", CONTEXT_ROWS[0][0], CONTEXT_ROWS[5][0]),
)
#: The most two rows' last-step logits may differ by (their tokens must be equal).
LOGITS_ATOL = 1e-3


#: The Python of the venv OpenVINO GenAI's row runs in (``make bench-decoders`` makes it), unless ``--ovgenai-python`` says.
OVGENAI_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ovgenai" / "bin" / "python"


def _ovgenai(folder: Path, python: Path, streams: int, past: int, tokens: int, vocab: int) -> dict[str, Any]:
    """OpenVINO GenAI's continuous batching on the openvino export ``folder``: the S prompts as
    requests added at once, stepped until done, greedy, in a process of ``python``
    (:mod:`benchmarks.ovgenai_peer`, the machine's cores as threads); its step times reduced as every
    row's. It exposes no logits: :func:`_check` compares its tokens alone."""
    request = {"model": str(folder), "prompts": [_prompt(k, past, vocab) for k in range(streams)], "tokens": tokens,
               "threads": len(os.sched_getaffinity(0))}
    done = subprocess.run([str(python), "-m", "benchmarks.ovgenai_peer"], input=json.dumps(request), capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if done.returncode:
        raise RuntimeError(f"benchmarks.ovgenai_peer ({python}) failed:\n{done.stderr[-4000:]}")
    out = json.loads(done.stdout.splitlines()[-1])
    decoding = sum(out["times"])
    return {**_rates(streams, tokens, out["elapsed"], decoding, out["first"], out["times"]), "tokens": out["tokens"], "logits": np.empty(0)}


def ovgenai_missing(llama: Path, python: Path) -> str | None:
    """Why OpenVINO GenAI's row cannot run on ``llama`` with ``python``, or None."""
    if not (llama / "openvino" / "openvino_model.xml").exists():
        return (f"no OpenVINO export {llama / 'openvino'} (make it: python -m benchmarks.llama_exports --which {llama.name} --only openvino "
                "--openvino-python .venv-ovgenai/bin/python, or make bench-decoders)")
    if not python.exists():
        return f"no {python} (make it: make .venv-ovgenai/.installed, or make bench-decoders)"
    return None


def _runnable(rows: list[tuple[str, str, Layout]], llama: Path, exporter: str, ovgenai_python: Path) -> list[tuple[str, str, Layout]]:
    """``rows`` less the peers that cannot run: ``og.Generator`` but on the genai export, OpenVINO
    GenAI without its export or venv (with a line on stderr that says why)."""
    rows = [r for r in rows if exporter == "genai" or r[1] != "generator"]
    if any(r[1] == "ovgenai" for r in rows) and (missing := ovgenai_missing(llama, ovgenai_python)):
        print(f"skipped {CONTEXT_ROWS[5][0]!r}: {missing}", file=sys.stderr)
        return [r for r in rows if r[1] != "ovgenai"]
    return rows


def _runners(llama: Path, exporter: str, model: Any, bundle: Path, micro: int | None = None,
             ovgenai_python: Path = OVGENAI_PYTHON) -> dict[str, Callable[..., dict[str, Any]]]:
    """Each ``--contexts`` row's runner, called as ``runner(streams, context, tokens, vocab)``
    (onnxpipe's on ``bundle`` in ``micro`` micro-batches; None: one per stage); the bound session's
    KV is the export's: one shared buffer (genai) or presents fed back (optimum); the plain
    sessions run with onnxruntime's defaults, their idle threads spinning (see the module's docstring)."""
    return {"driver": partial(_driver, bundle, micro=micro), "threads": partial(_threads, bundle, micro=micro),
            "generator": partial(_generator, llama / "genai"), "ovgenai": partial(_ovgenai, llama / "openvino", ovgenai_python),
            "bound": partial(_lockstep, model, threads=2, kv="shared" if exporter == "genai" else "fed back", spinning=True),
            "numpy": partial(_lockstep, model, threads=2, spinning=True)}


def layout_rows(layouts: tuple[Layout, ...]) -> tuple[list[tuple[str, str, Layout]], list[tuple[str, str, str]]]:
    """The ``--contexts`` rows and ratios with ``layouts``: :data:`CONTEXT_ROWS` (onnxpipe's in the
    first layout) as (name, runner, layout), then each other layout's onnxpipe rows (one driver, a
    thread per stream), named with it; the ratios, :data:`CONTEXT_RATIOS` and the same of each other layout."""
    first, *others = layouts
    rows = [(name, how, first) for name, how in CONTEXT_ROWS]
    ratios = list(CONTEXT_RATIOS)
    for layout in others:
        driver, threads = f"onnxpipe batched {layout}, one driver", f"onnxpipe batched {layout}, thread per stream"
        rows += [(driver, "driver", layout), (threads, "threads", layout)]
        ratios += [(f"onnxpipe {layout} one driver / og.Generator", driver, CONTEXT_ROWS[2][0]),
                   (f"onnxpipe {layout} one driver / bound session", driver, CONTEXT_ROWS[3][0]),
                   (f"{layout}: thread per stream / one driver", threads, driver),
                   (f"onnxpipe {layout} one driver / OpenVINO GenAI", driver, CONTEXT_ROWS[5][0])]
    return rows, ratios


def _until(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to the first of ``stops``, that one included."""
    return next((tokens[: k + 1] for k, t in enumerate(tokens) if t in stops), tokens)


def _check(results: Mapping[str, Mapping[str, Any]], context: int, streams: int) -> float:
    """Every row's tokens equal the first row's and its last step's logits are within
    :data:`LOGITS_ATOL` of them; the largest difference. Raises RuntimeError naming the rows otherwise.
    A row that ends a stream at one of its ``stops_at`` tokens (``og.Generator``) is compared up to
    it, and its last logits only on the streams that did not end; a row that exposes no logits
    (OpenVINO GenAI's pipeline: empty ``logits``) by its tokens alone."""
    (first, ref), *others = results.items()
    worst = 0.0
    for name, r in others:
        where = f"context {context}, {streams} streams: {name!r} against {first!r}"
        stops = r.get("stops_at", set())
        want = [_until(t, stops) for t in ref["tokens"]]
        got = [t[: len(w)] for t, w in zip(r["tokens"], want, strict=True)]
        if got != want:
            k = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            raise RuntimeError(f"{where}: stream {k}'s tokens differ: {got[k]} against {want[k]}")
        going = [k for k, t in enumerate(ref["tokens"]) if not stops & set(t)]
        diff = float(np.abs(np.asarray(r["logits"])[going] - ref["logits"][going]).max()) if len(r["logits"]) and going else 0.0
        if diff > LOGITS_ATOL:
            raise RuntimeError(f"{where}: the last step's logits differ by {diff:.2e}, more than {LOGITS_ATOL:g}")
        worst = max(worst, diff)
    return worst


def _context_row(how: str, streams: int, context: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's medians over its rounds: decode tokens/s (min-max), p50 / p99 ms per token, TTFT;
    for onnxpipe's, per stage the bytes copied per decode step and the batch mean."""
    rates = [r["decode_per_s"] for r in runs]
    row = {"how": how, "streams": streams, "context": context, "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
           **{k: statistics.median(r[k] for r in runs) for k in ("ttft_ms", "p50_ms", "p99_ms")}}
    if "copied" in runs[0]:
        row["copied"] = [statistics.median(r["copied"][i] for r in runs) for i in range(len(runs[0]["copied"]))]
        row["batch_mean"] = runs[len(runs) // 2]["batch_mean"]
    return row


def _paired(measured: Mapping[tuple[int, int, str], list[dict[str, Any]]], contexts: tuple[int, ...],
            streams: tuple[int, ...], ratios: tuple[tuple[str, str, str], ...] | list[tuple[str, str, str]] = CONTEXT_RATIOS) -> list[dict[str, Any]]:
    """``ratios`` (:data:`CONTEXT_RATIOS`) of decode tokens/s, round k over round k, with their spread."""
    out = []
    for name, a, b in ratios:
        for c in contexts:
            for s in streams:
                if (c, s, a) in measured and (c, s, b) in measured:
                    pairs = zip(measured[(c, s, a)], measured[(c, s, b)], strict=True)
                    out.append({"ratio": name, "context": c, "streams": s, **spread([x["decode_per_s"] / y["decode_per_s"] for x, y in pairs])})
    return out


def _step_added(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row and stream count, the p50 ms per token at the longest context less that at the shortest."""
    by = {(r["how"], r["streams"], r["context"]): r["p50_ms"] for r in rows}
    contexts = sorted({r["context"] for r in rows})
    return [{"how": how, "streams": s, "ms": by[(how, s, contexts[-1])] - by[(how, s, contexts[0])]}
            for how, s in dict.fromkeys((r["how"], r["streams"]) for r in rows)]


def _measure_contexts(rows: Mapping[str, Callable[[int, int], dict[str, Any]]], contexts: tuple[int, ...], streams: tuple[int, ...],
                      rounds: int) -> tuple[dict[tuple[int, int, str], list[dict[str, Any]]], float]:
    """Each round, at each context and stream count, every row (``row(streams, context)``) in
    turn, checked by :func:`_check`: (context, streams, row) -> each round's figures, and the largest
    difference of last logits."""
    measured: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    worst = 0.0
    for _ in range(rounds):
        for c in contexts:
            for s in streams:
                results = {name: row(s, c) for name, row in rows.items()}
                worst = max(worst, _check(results, c, s))
                for name, r in results.items():
                    measured.setdefault((c, s, name), []).append({k: v for k, v in r.items() if k not in ("tokens", "logits", "stops_at")})
    return measured, worst


def run_contexts(llama: Path, exporter: str, contexts: tuple[int, ...], streams: tuple[int, ...], tokens: int, rounds: int,
                 only: tuple[str, ...] = (), ovgenai_python: Path = OVGENAI_PYTHON, layouts: tuple[Layout, ...] = (PIPELINE,)) -> dict[str, Any]:
    """Issue 38's decoder rows (:data:`CONTEXT_ROWS`; ``og.Generator`` on the genai export only,
    OpenVINO GenAI where the Llama has its openvino export and ``ovgenai_python`` is there, else
    left out with a line on stderr; onnxpipe's in each of ``layouts``, :func:`layout_rows`) at each
    context and stream count, ``rounds`` interleaved rounds, every row's tokens and last logits
    checked against the first's in each (:func:`_check`)."""
    model, described, cut = _llama(llama, exporter)
    if exporter == "genai" and max(contexts) + tokens > described["context_length"]:
        raise SystemExit(f"{llama / 'genai'} holds {described['context_length']} positions (its cos_cache), fewer than context "
                         f"{max(contexts)} + {tokens} tokens: remake the Llamas (benchmarks.llama_exports) or give shorter --contexts")
    every, ratios = layout_rows(layouts)
    rows = _runnable([r for r in every if not only or any(t in r[0] for t in only)], llama, exporter, ovgenai_python)
    with tempfile.TemporaryDirectory() as tmp:
        piped = dict.fromkeys(layout for _, how, layout in rows if how in ("driver", "threads"))
        bundles = {layout: _bundle(model, cut, MAX_BATCH, Path(tmp) / str(layout).replace(":", "-"), layout) for layout in piped}
        runs = {name: partial(_runners(llama, exporter, model, bundles.get(layout, Path(tmp)), layout.micro_batches, ovgenai_python)[how],
                              tokens=tokens, vocab=described["vocab"])
                for name, how, layout in rows}
        measured, worst = _measure_contexts(runs, contexts, streams, rounds)
    table = [_context_row(how, s, c, runs) for (c, s, how), runs in measured.items()]
    layers, head = described["layers"], described["hidden"] // described["heads"]
    state = [[n * 2 * described["kv_heads"] * head * 4 * (c + tokens) for n in (layers // 2, layers - layers // 2)] for c in contexts]
    return {"model": {**described, "contexts": list(contexts), "tokens": tokens, "cut": cut, "layouts": [str(x) for x in layouts]},
            "cores": len(os.sched_getaffinity(0)), "rounds": rounds, "rows": table, "order": [r[0] for r in rows],
            "ratios": _paired(measured, contexts, streams, ratios), "step_added_ms": _step_added(table),
            "logits_max_diff": worst, "state_bytes_per_stream": dict(zip(map(str, contexts), state, strict=True))}


def _described(layout: str) -> str:
    """``layout`` (as :class:`Layout` writes it) in words."""
    got = Layout.parse(layout)
    micro = f", {got.micro_batches} micro-batch{'es' if got.micro_batches > 1 else ''}" if got.micro_batches else ""
    spin = ", spinning" if got.spinning else ""
    return f"{got.stages} stage{'s' if got.stages > 1 else ''} x {got.threads} thread{'s' if got.threads > 1 else ''}{micro}{spin}"


def print_contexts(result: dict[str, Any]) -> None:
    """:func:`run_contexts`' result as tables."""
    m = result["model"]
    print(f"{m['name']} Llama, {m['parameters'] / 1e6:.1f} M parameters, {m['export']} export (random weights); each stream a prompt of the "
          f"context's tokens then {m['tokens']} greedy tokens; {result['cores']} cores; onnxpipe: {_described(m['layouts'][0])}, max_batch {MAX_BATCH}, "
          f"max_delay_ms {DELAY_MS:g}; plain sessions: onnxruntime's defaults (idle threads spin); "
          f"median (min-max) of {result['rounds']} interleaved rounds")
    for other in m["layouts"][1:]:
        print(f"onnxpipe batched {other}: {_described(other)}")
    print(f"{'how':<54} {'streams':>7} {'context':>7} {'decode tok/s':>12} {'(min-max)':>13} {'p50 ms':>7} {'p99 ms':>7} {'TTFT ms':>8}"
          "  bytes copied per decode step, per stage (batch mean)")
    order = result["order"]
    for r in sorted(result["rows"], key=lambda r: (r["streams"], order.index(r["how"]), r["context"])):
        copied = ", ".join(f"{b / 1e6:.2f} MB ({n})" for b, n in zip(r["copied"], r["batch_mean"], strict=True)) if "copied" in r else ""
        between = f"({r['min']:.0f}-{r['max']:.0f})"
        print(f"{r['how']:<54} {r['streams']:>7} {r['context']:>7} {r['tokens_per_s']:>12.0f} {between:>13} "
              f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['ttft_ms']:>8.1f}  {copied}")
    state = "; ".join(f"context {c}: " + ", ".join(f"{b / 1e6:.2f} MB" for b in per) for c, per in result["state_bytes_per_stream"].items())
    print(f"one stream's KV per stage at the context's end (context + {m['tokens']} tokens): {state}")
    first, last = m["contexts"][0], m["contexts"][-1]
    print(f"p50 ms per token added from context {first} to {last}:")
    for a in result["step_added_ms"]:
        print(f"  {a['how']:<54} {a['streams']:>2} streams  {a['ms']:+.2f} ms")
    print("decode tokens/s ratios, paired per round: median (min-max)")
    for q in result["ratios"]:
        print(f"  {q['ratio']:<44} context {q['context']:>5}, {q['streams']:>2} streams  {q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})")
    print(f"tokens equal across every row; last step's logits within {result['logits_max_diff']:.1e} (allowed {LOGITS_ATOL:g})")


#: What ``--against`` compares unless ``--only`` says otherwise: the one-driver rows and one stream's step.
AGAINST = f"one driver,{ONE_STREAM}"


def _figures(result: dict[str, Any]) -> dict[str, float | None]:
    """The figures ``--against`` compares, from one round's JSON result."""
    out: dict[str, float | None] = {}
    for r in sorted(result["rows"], key=lambda r: (r["streams"], r["how"], r.get("context", 0))):
        where = f"{r['how']}, {r['streams']} streams" + (f", context {r['context']}" if "context" in r else "")
        out[f"{where}: tokens/s"] = r["tokens_per_s"]
        out[f"{where}: p50 ms per token"] = r["p50_ms"]
        if "context" in r:
            out[f"{where}: p99 ms per token"] = r["p99_ms"]
            out[f"{where}: TTFT ms"] = r["ttft_ms"]
            out[f"{where}: MB copied per decode step, stages summed"] = sum(r.get("copied", ())) / 1e6
    if (o := result.get("one_stream_step")) is not None:
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
    if args.contexts:
        child += ["--contexts", args.contexts, "--layouts", args.layouts]
    with checkout(rev) as old:
        samples = interleaved("benchmarks.batching", child, old, rev, args.rounds, _figures)
    return compare(samples)


def print_rows(result: dict[str, Any]) -> None:
    """:func:`run`'s result as tables."""
    m = result["model"]
    exporter = "onnxruntime-genai builder" if m.get("export") == "genai" else "optimum-onnx"
    size = f", {m['parameters'] / 1e6:.1f} M parameters ({exporter} export, random weights)" if "parameters" in m else ""
    print(f"decoder: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads{size}; prompt {m['past']} + {m['tokens']} tokens per stream; "
          f"{result['cores']} cores; 2 stages x 1 thread, max_batch {MAX_BATCH}, max_delay_ms {DELAY_MS:g}; "
          f"median (min-max) of {result['rounds']} interleaved rounds")
    print(f"{'how':<36} {'streams':>7} {'tokens/s':>9} {'(min-max)':>15} {'TTFT ms':>8} {'p50 ms':>7} {'p99 ms':>7}  batch mean per stage"
          "  (p50 / p99: per token after the first)")
    for r in sorted(result["rows"], key=lambda r: (r["streams"], r["how"])):
        between = f"({r['min']:.0f}-{r['max']:.0f})"
        print(f"{r['how']:<36} {r['streams']:>7} {r['tokens_per_s']:>9.0f} {between:>15} {r['ttft_ms']:>8.2f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}  "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--past", type=int, default=32, help="prompt tokens per stream")
    parser.add_argument("--tokens", type=int, help="tokens generated per stream (default 32, with --contexts 64)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default=",".join(map(str, STREAMS)), help="stream counts, comma-separated")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    parser.add_argument("--llama", type=Path, help="a folder of benchmarks.llama_exports: its optimum export, and og.Generator on its genai export")
    parser.add_argument("--export", choices=("optimum", "genai"), default="optimum",
                        help="with --llama: which export onnxpipe splits (genai: the very file og.Generator runs)")
    parser.add_argument("--contexts", metavar="N[,N...]", help="with --llama: issue 38's rows (onnxpipe batched by one driver and by a "
                        "thread per stream, og.Generator, a bound and a numpy-fed session) with prompts of each N tokens, decode tokens/s")
    parser.add_argument("--ovgenai-python", type=Path, default=OVGENAI_PYTHON,
                        help="with --contexts: the Python OpenVINO GenAI's row runs in (default: this checkout's .venv-ovgenai)")
    parser.add_argument("--layouts", metavar="SxT[:M][,...]", default=str(PIPELINE),
                        help="with --contexts: onnxpipe's layouts, STAGESxTHREADS[:MICRO_BATCHES] (stages 1 or 2), the first in the "
                        f"rows' own names, the others in rows of their own (default {PIPELINE})")
    parser.add_argument("--only", metavar="TEXT[,TEXT...]",
                        help=f"measure only the rows (and of {ONE_STREAM!r}, {ROUND!r}, {STATELESS!r}) whose name contains one of the TEXTs")
    parser.add_argument("--against", metavar="REV", help="measure this checkout beside git revision REV, rounds interleaved, and print new / old "
                        f"(of --only's rows, by default {AGAINST!r})")
    args = parser.parse_args()
    args.tokens = args.tokens or (64 if args.contexts else 32)
    only = tuple(t.strip() for t in args.only.split(",")) if args.only else ()
    if args.against:
        compared = against(args.against, args, only or tuple(AGAINST.split(",")))
        report(compared, args.against, args.rounds, args.json, "(tokens/s: higher is better; ms: lower is faster)")
        return
    if args.contexts and args.llama is None:
        parser.error("--contexts needs --llama")
    streams = tuple(int(s) for s in args.streams.split(","))
    if args.contexts:
        try:
            layouts = tuple(Layout.parse(t) for t in args.layouts.split(","))
        except ValueError as e:
            parser.error(str(e))
        result = run_contexts(args.llama, args.export, tuple(int(c) for c in args.contexts.split(",")), streams, args.tokens, args.rounds, only,
                              args.ovgenai_python, layouts)
    else:
        result = run(args.layers, args.hidden, args.heads, args.past, args.tokens, args.rounds, streams, args.llama, args.export, only)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        (print_contexts if args.contexts else print_rows)(result)


if __name__ == "__main__":
    main()
