"""The decoder exports of tests/data/decoders (made by tests/data/make_decoders.py: a Llama, a Qwen2
and a Phi-3 with random weights, each exported by optimum-onnx and by onnxruntime-genai's model
builder, the Llama also by torch's dynamo exporter), what a hand split cuts them at, and the
reference every test compares with: the whole export in one plain onnxruntime session, its KV
cache fed back by hand, greedy tokens."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tests.stateful_models import decoder_feeds, generate

DECODERS = Path(__file__).parent / "data" / "decoders"

#: Export folder -> the tensor a hand split cuts after: layer 0's output (the residual stream; the
#: genai builder fuses the residual add into the next layer's norm, so its MLP's last MatMul).
HAND_CUTS = {
    "optimum-llama": "/model/layers.0/Add_1_output_0",
    "optimum-qwen2": "/model/layers.0/Add_1_output_0",
    "optimum-phi3": "/model/layers.0/Add_1_output_0",
    "genai-llama": "/model/layers.0/mlp/down_proj/MatMul/output_0",
    "genai-qwen2": "/model/layers.0/mlp/down_proj/MatMul/output_0",
    "genai-phi3": "/model/layers.0/mlp/down_proj/MatMul/output_0",
    "dynamo-llama": "add_434",
}
EXPORTS = tuple(HAND_CUTS)


def model_path(name: str) -> Path:
    return DECODERS / name / "model.onnx"


#: optimum's Llama export: the decoder the unit tests cut by hand (the ``llama`` fixture, tests/conftest.py).
LLAMA = model_path("optimum-llama")
#: Between its layers 0 and 1: the residual stream, the causal mask and the rotary cos / sin the model
#: makes once and every layer reads.
LLAMA_CUT = ["/model/layers.0/Add_1_output_0", "/model/Expand_output_0", "/model/layers.0/self_attn/Unsqueeze_6_output_0",
             "/model/layers.0/self_attn/Unsqueeze_7_output_0"]


def profile_dims(name: str) -> dict[str, int]:
    """Sizes for profiling an export: batch 1, one new token over a past of 8 (the names its inputs use)."""
    session = ort.InferenceSession(str(model_path(name)), providers=["CPUExecutionProvider"])
    named = {d for i in session.get_inputs() for d in i.shape if isinstance(d, str)}
    wanted = {"batch_size": 1, "batch": 1, "sequence_length": 1, "past_sequence_length": 8}
    return {k: v for k, v in wanted.items() if k in named}


def step_feeds(inputs: set[str], tokens: list[int], done: int) -> dict[str, np.ndarray]:
    """A decode step's inputs (:func:`tests.stateful_models.decoder_feeds`) that the export has (the
    genai builder's take no ``position_ids``: its attention computes them from the mask)."""
    return {k: v for k, v in decoder_feeds(tokens, done).items() if k in inputs}


def decode_one_driver(pipe: Any, inputs: set[str], starts: list[list[int]], counts: list[int]) -> list[tuple[list[int], list[np.ndarray]]]:
    """Greedy decoding of ``len(starts)`` streams from one thread: every round one
    ``submit_steps`` of the streams still going, each closed once its ``counts[k]`` tokens are
    made (so streams leave the batch as they end). Each stream's new tokens and last-position
    logits, step by step."""
    texts, done = [list(p) for p in starts], [0] * len(starts)
    logits: list[list[np.ndarray]] = [[] for _ in starts]
    streams = [pipe.stream() for _ in starts]
    for n in range(max(counts)):
        going = [k for k in range(len(starts)) if n < counts[k]]
        futures = pipe.submit_steps({streams[k]: step_feeds(inputs, texts[k], done[k]) for k in going})
        for k in going:
            last = futures[streams[k]].result(timeout=60)["logits"][0, -1]
            done[k] = len(texts[k])
            texts[k].append(int(np.argmax(last)))
            logits[k].append(last)
            if n + 1 == counts[k]:
                streams[k].close()
    return [(texts[k][len(starts[k]):], logits[k]) for k in range(len(starts))]


class WholeModel:
    """The whole export in one onnxruntime session, its KV cache fed back by hand (an empty past on
    the first step; the genai builder's symbolic head dim sized from its ``genai_config.json``)."""

    def __init__(self, name: str) -> None:
        path = model_path(name)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        config = path.with_name("genai_config.json")
        head = json.loads(config.read_text())["model"]["decoder"]["head_size"] if config.exists() else None
        self.pasts = {i.name: (i.shape[1], i.shape[3] if isinstance(i.shape[3], int) else head) for i in self.session.get_inputs()
                      if i.name.startswith("past_key_values.")}

    def empty_past(self) -> dict[str, np.ndarray]:
        return {n: np.zeros((1, heads, 0, dim), np.float32) for n, (heads, dim) in self.pasts.items()}

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.outputs, self.session.run(self.outputs, dict(feeds)), strict=True))

    def generate(self, prompt: list[int], count: int) -> tuple[list[int], list[np.ndarray]]:
        """Greedy: ``count`` new tokens after ``prompt``, and each step's last logits."""
        cache = self.empty_past()

        def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            results = self.run({**feeds, **cache})
            for n in cache:
                cache[n] = results[n.replace("past_key_values.", "present.")]
            return results

        return generate(lambda f: step({k: v for k, v in f.items() if k in self.inputs}), prompt, count)


def prompts(count: int = 8) -> list[list[int]]:
    """``count`` prompts of 1 to 6 tokens (mixed lengths, so batched streams are padded)."""
    return [[(11 * k + 5 * t + 3) % 256 for t in range(1 + k % 6)] for k in range(count)]


class Filtered:
    """A pipeline (or anything with ``stream()``) whose streams' steps take only the inputs in
    ``inputs``: what :func:`tests.stateful_models.decode_in_threads` steps, for an export without
    ``position_ids``."""

    def __init__(self, pipe: object, inputs: set[str]) -> None:
        self.pipe, self.inputs = pipe, inputs

    def stream(self) -> _FilteredStream:
        return _FilteredStream(self.pipe.stream(), self.inputs)  # type: ignore[attr-defined]


class _FilteredStream:
    def __init__(self, stream: object, inputs: set[str]) -> None:
        self.inner, self.inputs = stream, inputs

    def step(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.inner.step({k: v for k, v in feeds.items() if k in self.inputs})  # type: ignore[attr-defined, no-any-return]

    def __enter__(self) -> _FilteredStream:
        self.inner.__enter__()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)  # type: ignore[attr-defined]
