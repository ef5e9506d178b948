"""State pairs: found by name or given, checked, kept inside one stage by the split (issue 14)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from onnxpipe import ConfigError, SplitError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import PipelineSpec, StateLink
from onnxpipe.splitter import StatePair, split
from tests import models
from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run
from tests.stateful_models import gpt_decoder, recurrent


def test_auto_pairs_optimum_kv_names_with_their_growing_axis() -> None:
    plan = split(gpt_decoder(layers=2), ["layer0.out"], states="auto")
    assert plan.states == [StatePair(f"present.{n}.{p}", f"past_key_values.{n}.{p}", 2) for n in range(2) for p in ("key", "value")]
    assert {(s.stage, s.input) for s in plan.spec.states} == {(f"stage{n}", f"past_key_values.{n}.{p}") for n in range(2) for p in ("key", "value")}


def test_explicit_pairs_are_checked_by_name_and_dtype() -> None:
    model = recurrent()
    with pytest.raises(SplitError, match=r"state stat1N=state1: the model has no output 'stat1N'; closest: 'state1N', 'state2N'"):
        split(model, ["state1N"], states={"stat1N": "state1"})
    with pytest.raises(SplitError, match=r"state state1N=stat: the model has no input 'stat'; closest: 'state"):
        split(model, ["state1N"], states=[("state1N", "stat")])
    with pytest.raises(SplitError, match=r"state y=state2: dim 1 is 4 in output 'y' but 8 in input 'state2'"):
        split(model, ["state1N"], states={"y": "state2"})
    typed = onnx.ModelProto()
    typed.CopyFrom(model)
    typed.graph.input[1].type.tensor_type.elem_type = onnx.TensorProto.DOUBLE  # state1 as float64
    with pytest.raises(SplitError, match=r"state state1N=state1: output 'state1N' is float32 but input 'state1' is float64"):
        split(typed, ["state1N"], states={"state1N": "state1"}, check=False)
    with pytest.raises(SplitError, match="state logits=input_ids: output 'logits' is float32 but input 'input_ids' is int64"):
        split(gpt_decoder(layers=1), ["layer0.out"], states={"logits": "input_ids"})
    with pytest.raises(SplitError, match=r"no state pairs found by name .*; give them as OUTPUT=INPUT"):
        split(models.chain(), ["a"], states="auto")
    assert split(model, ["state1N"], states={"state1N": "state1"}).spec.inputs[1].name == "state2"  # unpaired: a pipeline input


def test_a_cut_separating_a_state_pair_is_refused_by_name() -> None:
    with pytest.raises(SplitError, match=r"the cuts separate state 'state1' \(read by stage0\) from 'state1N' \(made by stage1\)"):
        split(recurrent(), ["b1"], states="auto")


def test_state_links_by_hand_and_their_errors(tmp_path: Path) -> None:
    plan = split(recurrent(), ["state1N"])  # no states: the states are pipeline inputs and outputs
    config = PipelineConfig.load(plan.save(tmp_path / "split"))
    s0, s1 = config.stage("stage0"), config.stage("stage1")
    with pytest.raises(ConfigError, match=r"state link stage0.state1N -> stage1.state2 is not within one stage"):
        config.add_state(s0.output("state1N"), s1.input("state2"))
    with pytest.raises(ConfigError, match=r"stage 'stage0' has no output 'stateN'; closest: 'state1N'"):
        config.add_state(s0.output("stateN"), s0.input("state1"))
    with pytest.raises(ConfigError, match=r"state link stage1.state2N -> stage1.state1N \(next step\): stage1.state1N is already fed by stage0.state1N"):
        config.add_state(s1.output("state2N"), s1.input("state1N"))
    with pytest.raises(ConfigError, match="is already fed by pipeline.state1"):
        config.add_state(s0.output("state1N"), s0.input("state1"))


def test_spec_json_carries_state_links_and_refuses_bad_ones() -> None:
    spec = split(gpt_decoder(layers=2), ["layer0.out"], states="auto").spec
    data = json.loads(spec.to_json())
    assert data["states"][0] == {"stage": "stage0", "output": "present.0.key", "input": "past_key_values.0.key", "empty_axis": 2}
    assert PipelineSpec.from_json(spec.to_json()) == spec
    stateless = split(recurrent(), ["state1N"]).spec
    assert "states" not in json.loads(stateless.to_json())  # stateless pipelines write what they always wrote

    def broken(**change: object) -> PipelineSpec:
        d = json.loads(spec.to_json())
        d["states"][0].update(change)
        return PipelineSpec.from_dict(d)

    with pytest.raises(ConfigError, match=r"past_key_values.0.key: stage 'stage0' has no output 'present.0.kee'; closest: 'present.0.key'"):
        broken(output="present.0.kee").validate()
    with pytest.raises(ConfigError, match=r"state link present.0.key -> past_key_values.0.key: no stage 'stage9'; closest: 'stage1', 'stage0'"):
        broken(stage="stage9").validate()
    with pytest.raises(ConfigError, match=r"empty_axis 7 is out of range .* valid: 0..3"):
        broken(empty_axis=7).validate()
    with pytest.raises(ConfigError, match=r"dim 2 \('past_seq'\) of .* has no initial size: no pipeline input names it \(named dims: 'batch', 'seq'"):
        broken(empty_axis=None).validate()
    with pytest.raises(ConfigError, match="unknown key"):
        broken(init="zeros")
    mixed = json.loads(spec.to_json())
    mixed["stages"][0]["outputs"][1]["dtype"] = "float16"  # present.0.key
    with pytest.raises(ConfigError, match=r"state link present.0.key -> past_key_values.0.key: dtype float16 != float32"):
        PipelineSpec.from_dict(mixed).validate()
    assert StateLink("s", "o", "i").empty_axis is None


def test_cli_split_shows_the_pairs_and_refuses_bad_ones(tmp_path: Path) -> None:
    model = tmp_path / "rnn.onnx"
    onnx.save(recurrent(), model)
    result = ok("split", model, "-o", tmp_path / "out", "--at", "state1N", "--state", "auto")
    assert "state: state1N -> state1 (starts as zeros), kept in stage0" in result.output
    assert len(json.loads((tmp_path / "out" / "pipeline.json").read_text())["states"]) == 2
    assert_user_error(run("split", model, "-o", tmp_path / "bad", "--at", "b1", "--state", "auto"), "the cuts separate state 'state1'")
    assert_user_error(run("split", model, "-o", tmp_path / "bad", "--at", "state1N", "--state", "stat1N=state1"), "no output 'stat1N'")
    assert_usage_error(run("split", model, "-o", tmp_path / "bad", "--at", "state1N", "--state", "state1N"), "is not OUT=IN")
    assert_usage_error(run("split", model, "-o", tmp_path / "bad", "--at", "state1N", "--state", "auto", "--state", "a=b"), "give 'auto' alone")


def test_cli_builds_exports_and_shows_a_bundle_with_state(tmp_path: Path) -> None:
    model = tmp_path / "rnn.onnx"
    onnx.save(recurrent(), model)
    ok("split", model, "-o", tmp_path / "split", "--at", "state1N", "--state", "auto")
    ok("build", tmp_path / "split", "-o", tmp_path / "built")
    assert_user_error(
        run("export", tmp_path / "built", "-o", tmp_path / "ref.onnxpipe", "--reference", "1", "--model", model),
        "reference samples are single requests, but this pipeline keeps state between steps",
    )
    ok("export", tmp_path / "built", "-o", tmp_path / "rnn.onnxpipe")
    shown = ok("inspect", tmp_path / "rnn.onnxpipe").output
    assert "in  state1: float32[batch, 8]  <- state state1N (previous step)" in shown
