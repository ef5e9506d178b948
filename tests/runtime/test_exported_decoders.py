"""A decoder as users export it: a Llama with random weights exported by optimum-onnx
(tests/data/decoders/optimum-llama, made by tests/data/make_decoders.py: hidden 64, 2 layers, grouped-query
attention of 4 heads over 2 KV heads, rotary positions, a 4-D causal mask made in the model), split
between its layers with its KV caches kept in their stages, its streams batched.

References: the whole export in one onnxruntime session, each stream alone, its KV cache fed by
hand. Tokens are compared exactly (greedy); logits within 1e-4 (a batched GEMM may sum in another
order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe.runtime import load
from onnxpipe.splitter import split
from tests.decoder_exports import LLAMA_CUT
from tests.models import bundle_of
from tests.stateful_models import decode_in_threads, decoder_feeds, session_generate


@pytest.fixture(scope="module")
def bundle(llama: onnx.ModelProto, tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = split(llama, [LLAMA_CUT], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=8, max_delay_ms=20)
    return bundle_of(plan, tmp_path_factory.mktemp("llama"))


def _alone(llama: onnx.ModelProto, prompt: list[int], count: int) -> tuple[list[int], list[np.ndarray]]:
    import onnxruntime as ort

    session = ort.InferenceSession(llama.SerializeToString(), providers=["CPUExecutionProvider"])
    return session_generate(session, prompt, count)


def test_the_optimum_llama_batches_and_its_probe_says_what_grows(bundle: Path) -> None:
    with load(bundle) as pipe:
        stages = pipe.spec.stages
        assert [sorted(s.input for s in pipe.spec.states_of(st.name)) for st in stages] == [
            ["past_key_values.0.key", "past_key_values.0.value"], ["past_key_values.1.key", "past_key_values.1.value"]]
        second = stages[1].batching
        assert second is not None and "agree" in second.probe
        assert second.padded["/model/Expand_output_0"][0] == 3  # the 4-D mask grows along its last axis


def test_eight_llama_streams_joining_and_leaving_give_the_tokens_each_makes_alone(bundle: Path, llama: onnx.ModelProto) -> None:
    """8 streams with prompts of 1 to 6 tokens, each in a thread of its own, started 0.5 ms apart and
    generating 16 to 30 tokens (so they join and leave while others decode): every stream's tokens equal the export alone, logits within 1e-4,
    and every stage ran batches of several streams."""
    prompts = [[(11 * k + 5 * t + 3) % 256 for t in range(1 + k % 6)] for k in range(8)]
    counts = [16 + 2 * k for k in range(8)]
    with load(bundle, max_streams=16) as pipe:
        results = decode_in_threads(pipe, prompts, counts, apart=0.0005)
        stats = pipe.stats()
    for k in range(8):
        want_tokens, want_logits = _alone(llama, prompts[k], counts[k])
        tokens, logits = results[k]
        assert tokens == want_tokens, f"stream {k}"
        np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), rtol=0, atol=1e-4, err_msg=f"stream {k}")
    for stage in stats.stages:
        assert max(stage.batch_sizes) >= 2, f"{stage.stage} never batched: {stage.batch_sizes}"


def test_one_driver_steps_llama_streams_in_batches_with_submit_steps(bundle: Path, llama: onnx.ModelProto) -> None:
    """One thread, 4 streams in one group (micro_batches=1), every round one submit_steps: from the
    second decode step on each round is one request of 4 steps through both stages; tokens equal alone."""
    prompts = [[3, 4, 5], [9], [200, 17], [31, 32, 33, 34]]
    tokens = [list(p) for p in prompts]
    done = [0] * 4
    with load(bundle, micro_batches=1) as pipe:
        streams = [pipe.stream() for _ in prompts]
        for _ in range(7):
            futures = pipe.submit_steps({s: decoder_feeds(tokens[k], done[k]) for k, s in enumerate(streams)})
            for k, s in enumerate(streams):
                done[k] = len(tokens[k])
                tokens[k].append(int(np.argmax(futures[s].result(timeout=60)["logits"][0, -1])))
        sizes = [s.batch_sizes for s in pipe.stats().stages]
        for s in streams:
            s.close()
    assert sizes == [{1: 4, 4: 6}] * 2
    for k, p in enumerate(prompts):
        assert tokens[k][len(p):] == _alone(llama, p, 7)[0], f"stream {k}"
