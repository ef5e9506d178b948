"""optimum's merged decoders at split time (issue 39, item 4): cuts inside their one ``If`` are
refused in one line; ``states="auto"`` finds the states set once and the step flag (Note: merged
decoders, ``splitter/_states``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnxpipe import SplitError
from onnxpipe.runtime import StepFlag
from onnxpipe.splitter import StatePair, UniformPolicy, inspect_model, split
from tests.stateful_models import gpt_decoder, merged_decoder

MERGED = Path(__file__).resolve().parents[1] / "data" / "corpus" / "whisper" / "decoder_model_merged.onnx"
REFUSAL = ("the model is one If node on 'use_cache_branch' (as optimum's merged decoders are): cuts inside its branches are not supported; "
           "run it as one stage (split --auto --stages 1, or a pipeline file stage without at/auto; with states \"auto\": "
           "docs/streams.md#merged-decoders) or split decoder_model.onnx and decoder_with_past_model.onnx instead")


def test_cuts_inside_the_if_are_refused_in_one_line() -> None:
    with pytest.raises(SplitError) as cut:
        split(MERGED, ["logits"], states="auto")
    assert str(cut.value) == REFUSAL
    with pytest.raises(SplitError) as auto:
        split(MERGED, policy=UniformPolicy(stages=2))
    assert str(auto.value) == REFUSAL
    assert REFUSAL in inspect_model(MERGED).notes


@pytest.mark.parametrize("passed", [False, True], ids=["placeholder", "identity"])
def test_states_auto_marks_what_the_cached_branch_only_stubs_or_passes_as_set_once(passed: bool) -> None:
    plan = split(merged_decoder(passed), policy=UniformPolicy(stages=1), states="auto")
    assert plan.states == [StatePair("present.0.key", "past_key_values.0.key", 1),
                           StatePair("present.0.encoder.key", "past_key_values.0.encoder.key", 1, once=True)]
    spec = plan.spec
    assert spec.step_flags == (StepFlag("stage0", "use_cache_branch", first=False),)
    assert [t.name for t in spec.inputs] == ["x", "attention_mask", "encoder_hidden_states"]
    assert "the model is one If node on 'use_cache_branch': it stays whole in one stage (cuts inside an If are not supported)" in plan.notes
    assert json.loads(spec.to_json())["states"][1] == {"stage": "stage0", "output": "present.0.encoder.key", "input": "past_key_values.0.encoder.key",
                                                       "empty_axis": 1, "once": True}


def test_models_without_such_an_if_are_split_as_before() -> None:
    plan = split(gpt_decoder(layers=2), ["layer0.out"], states="auto")
    assert not any(p.once for p in plan.states) and plan.spec.step_flags == ()
    stateless = split(merged_decoder(), policy=UniformPolicy(stages=1))  # no states: the flag is a pipeline input a caller feeds
    assert "use_cache_branch" in [t.name for t in stateless.spec.inputs] and stateless.spec.step_flags == ()
