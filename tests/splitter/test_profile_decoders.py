"""Profiling a decoder (issue 27): the profiler feeds random_inputs, whose attention mask is all
ones and as wide as the past and the new tokens (Note: a decoder's sample inputs), so onnxruntime
runs it: optimum's causal-mask Gather and genai's GroupQueryAttention (which refused random masks:
``seqlens_k[0] = 54 is out of range``) alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnxpipe.splitter import MeasuredPolicy, profile_model, split, verify

DATA = Path(__file__).parents[1] / "data"
LLAMA = DATA / "decoders" / "optimum-llama" / "model.onnx"
GENAI = DATA / "decoders" / "genai-llama" / "model.onnx"
DIMS = {"batch_size": 2, "sequence_length": 4, "past_sequence_length": 6}


def test_the_optimum_llama_is_profiled_and_split_by_measured_costs(tmp_path: Path) -> None:
    """What ``split --auto`` does (MeasuredPolicy profiles with profile_model, cached in ``cache_dir``)."""
    plan = split(LLAMA, policy=MeasuredPolicy(stages=2, runs=2, dims=DIMS, cache_dir=str(tmp_path)))
    profile = profile_model(LLAMA, runs=2, dims=DIMS, cache_dir=tmp_path)  # the cached profile it was split by
    assert profile.source == "measured" and profile.total_seconds > 0 and profile.node_seconds
    assert not any("attention_mask" in n for n in profile.notes)  # its width was made, not defaulted
    assert len(plan.config.stages) == 2
    assert verify(plan, LLAMA, dims=DIMS).ok


@pytest.mark.skipif(not GENAI.is_file(), reason="tests/data/decoders/ is not there (made by tests/data/make_decoders.py)")
def test_the_genai_llama_with_group_query_attention_is_profiled() -> None:
    profile = profile_model(GENAI, runs=2, dims={"kv_cache_dim": 16, "sequence_length": 3, "past_sequence_length": 5}, cache=False)
    assert profile.source == "measured" and profile.node_seconds
