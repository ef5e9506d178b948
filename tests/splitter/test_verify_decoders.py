"""verify() of decoder splits (issue 27): a split with state links runs streams through the
pipeline's own streams and through the whole model with its KV cache fed back by hand (Note:
verifying a split with state); a stateless decoder split runs on sample inputs that a decoder
accepts, and where the whole model still fails on them, the error names the dims left at 1.

On tests/data/decoders/optimum-llama (optimum) split by hand between its layers, the inline recurrent
model of tests/stateful_models.py, and the exports of tests/data/decoders/ when that folder is there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxpipe._errors import InputError
from onnxpipe.splitter import ParamsPolicy, split, verify
from tests.decoder_exports import LLAMA, LLAMA_CUT
from tests.models import bundle_of
from tests.stateful_models import decoder_feeds, recurrent

DATA = Path(__file__).parents[1] / "data"
DECODERS = sorted((DATA / "decoders").glob("*/model.onnx"))


def _past_scaled(model: onnx.ModelProto, name: str, factor: float) -> onnx.ModelProto:
    """``model`` reading its input ``name`` times ``factor``: the same as ``model`` while that past
    is empty (a stream's first step), different after."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    for node in changed.graph.node:
        node.input[:] = [f"{name}.scaled" if i == name else i for i in node.input]
    changed.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), "scale.factor"))
    changed.graph.node.insert(0, helper.make_node("Mul", [name, "scale.factor"], [f"{name}.scaled"]))
    return changed


def test_a_split_with_state_is_verified_by_a_stream_of_decode_steps(llama: onnx.ModelProto) -> None:
    plan = split(llama, [LLAMA_CUT], states="auto")
    report = verify(plan, llama)
    assert report.ok and report.steps == 4 and report.samples == 1
    assert [r.tensor for r in report.rows] == ["logits"]
    assert report.notes[0].startswith("ran 1 stream(s) of 4 step(s) (a prompt of 3 token(s), then one token a step: the greedy token of 'logits'")
    assert any("not compared in a stream" in n for n in report.notes)
    assert report.to_dict()["steps"] == 4
    wider = verify(plan, llama, dims={"batch_size": 2, "sequence_length": 5}, samples=2, steps=3, boundaries=False)
    assert wider.ok and wider.samples == 2 and wider.steps == 3
    assert "a prompt of 5 token(s)" in wider.notes[0] and not any("batch_size" in n for n in wider.notes)
    assert wider.rows[0].shape == (2, 5, 256)


def test_the_stream_feeds_the_whole_model_its_state_and_compares_every_step(llama: onnx.ModelProto) -> None:
    """A 'whole model' that reads its layer-1 past scaled by 1.5 equals the split on the first step
    (an empty past) and differs from the second on: one step passes, two do not."""
    plan = split(llama, [LLAMA_CUT], states="auto")
    other = _past_scaled(llama, "past_key_values.1.value", 1.5)
    assert verify(plan, other, steps=1).ok
    report = verify(plan, other, steps=2)
    assert not report.ok and report.rows[0].max_abs > 1e-3


def test_a_stream_can_run_given_steps(llama: onnx.ModelProto) -> None:
    plan = split(llama, [LLAMA_CUT], states="auto")
    tokens = [5, 6, 7, 8, 9]
    steps = [decoder_feeds(tokens[:3], 0), decoder_feeds(tokens[:4], 3), decoder_feeds(tokens, 4)]
    report = verify(plan, llama, inputs=steps)
    assert report.ok and report.steps == 3 and report.samples == 1 and "the given inputs" in report.notes[0]
    del steps[1]["position_ids"]
    with pytest.raises(InputError, match="missing input.*'position_ids'"):
        verify(plan, llama, inputs=steps)


def test_a_recurrent_split_is_verified_by_a_stream_of_random_steps() -> None:
    model = recurrent()
    report = verify(split(model, ["state1N"], states="auto"), model, dims={"batch": 3})
    assert report.ok and report.steps == 4 and "random inputs" in report.notes[0]
    assert [r.tensor for r in report.rows] == ["y"] and report.rows[0].shape == (3, 4)


def test_a_bundle_with_state_is_verified_by_a_stream(llama: onnx.ModelProto, tmp_path: Path) -> None:
    bundle = bundle_of(split(llama, [LLAMA_CUT], states="auto"), tmp_path)
    report = verify(bundle, LLAMA, steps=2)
    assert report.ok and report.steps == 2


def test_a_stateless_decoder_split_verifies_without_dims(llama: onnx.ModelProto) -> None:
    report = verify(split(llama, [LLAMA_CUT]), llama)
    assert report.ok and report.steps == 0
    assert {r.tensor for r in report.rows} >= {"logits", "present.1.key", *LLAMA_CUT}


def test_a_model_that_fails_on_the_sample_inputs_names_the_dims_left_at_1(llama: onnx.ModelProto) -> None:
    """A mask width given in dims (kept as given) narrower than the past and the new token together
    fails in the model's Gather: the error is the user's, and names the dims that were 1."""
    plan = split(llama, [LLAMA_CUT])
    with pytest.raises(InputError, match=r"the whole model fails on input set 0 \(input_ids\[1, 1\], attention_mask\[1, 1\].*indices element out of data bounds"
                       r".*; dims batch_size, sequence_length, past_sequence_length not given, so 1: give their sizes with --dim NAME=N"):
        verify(plan, llama, dims={"past_sequence_length + sequence_length": 1})


@pytest.mark.skipif(not DECODERS, reason="tests/data/decoders/ is not there (made by tests/data/make_decoders.py)")
@pytest.mark.parametrize("path", DECODERS, ids=[p.parent.name for p in DECODERS])
def test_each_exporters_decoder_split_verifies_as_a_stream_and_stateless(path: Path) -> None:
    stream = verify(split(path, policy=ParamsPolicy(stages=2), states="auto"), path, steps=3)
    assert stream.ok and stream.steps == 3
    stateless = split(path, policy=ParamsPolicy(stages=2))
    head = {"kv_cache_dim": 16} if "genai" in path.parent.name else {}
    assert verify(stateless, path, dims=head).ok
    if head:  # genai's head dim has no size in the model: the error says to give it
        with pytest.raises(InputError, match=r"dims batch_size, sequence_length, past_sequence_length, kv_cache_dim not given, so 1: .*--dim NAME=N"):
            verify(stateless, path)
