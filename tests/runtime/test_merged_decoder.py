"""optimum's merged decoders (one ``If`` on ``use_cache_branch``) run whole as one stage with their
state: the encoder's KV set once by the first step and kept, ``use_cache_branch`` fed by the
runtime (issue 39, item 4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from onnxpipe import BuildError, ConfigError, Remedy, StreamError, runtime
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import PipelineSpec, StateLink, StepFlag
from onnxpipe.splitter import UniformPolicy, read_pipeline_file, split
from tests.stateful_models import merged_decoder

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
FAMILIES = ("t5", "whisper")


def merged_pipeline_file(tmp_path: Path, family: str) -> Path:
    """A pipeline file holding the merged decoder as one stage with ``states = "auto"``."""
    shutil.copy(CORPUS / family / "decoder_model_merged.onnx", tmp_path / "decoder.onnx")
    inputs = '["input_ids", "encoder_hidden_states"' + (', "encoder_attention_mask"]' if family == "t5" else "]")
    (tmp_path / "pipeline.toml").write_text(
        'format = "onnxpipe.pipeline-file"\nversion = 1\nname = "decoder"\n'
        f'inputs = {inputs}\noutputs = ["logits"]\n\n'
        '[[stages]]\nname = "decoder"\nmodel = "decoder.onnx"\nstates = "auto"\n'
    )
    return tmp_path / "pipeline.toml"


def encoded(family: str, request: dict[str, Any]) -> dict[str, np.ndarray]:
    """What every step of one request feeds besides the token: the encoder's output (plain
    onnxruntime) and, for T5, its mask."""
    encoder = ort.InferenceSession(str(CORPUS / family / "encoder_model.onnx"), providers=["CPUExecutionProvider"])
    if family == "t5":
        ids = np.array(request["input_ids"], np.int64)
        mask = np.ones_like(ids)
        return {"encoder_hidden_states": encoder.run(None, {"input_ids": ids, "attention_mask": mask})[0], "encoder_attention_mask": mask}
    return {"encoder_hidden_states": encoder.run(None, {"input_features": np.array(request["input_features"], np.float32)})[0]}


@pytest.fixture(scope="module", params=FAMILIES)
def merged(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict[str, Any]]:
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    config = read_pipeline_file(merged_pipeline_file(folder, family))
    bundle = export(build(config, folder / "built").path, folder / "decoder.onnxpipe")
    return family, bundle, json.loads((CORPUS / family / "expected.json").read_text())


def test_states_auto_finds_the_encoder_kv_set_once_and_the_step_flag(merged: tuple[str, Path, dict[str, Any]]) -> None:
    _, bundle, _ = merged
    spec = runtime.read_bundle(bundle).spec
    once = {s.input for s in spec.states if s.once}
    assert once == {f"past_key_values.{n}.encoder.{p}" for n in range(2) for p in ("key", "value")}
    assert {s.input for s in spec.states} - once == {f"past_key_values.{n}.decoder.{p}" for n in range(2) for p in ("key", "value")}
    assert spec.step_flags == (StepFlag("decoder", "use_cache_branch", first=False),)
    assert "use_cache_branch" not in {t.name for t in spec.inputs}  # a stream's steps feed the tokens only


def test_sixteen_greedy_tokens_equal_transformers(merged: tuple[str, Path, dict[str, Any]]) -> None:
    family, bundle, expected = merged
    with runtime.load(bundle) as pipe:
        for case in expected["requests"]:
            fixed = encoded(family, case["inputs"])
            token, tokens = expected["decoder_start_token_id"], []
            with pipe.stream() as stream:
                for _ in range(expected["new_tokens"]):
                    logits = stream.step({"input_ids": np.array([[token]], np.int64), **fixed})["logits"]
                    token = int(np.argmax(logits[0, -1]))
                    tokens.append(token)
            assert tokens == case["tokens"]
            np.testing.assert_allclose(logits[0, -1], np.array(case["last_logits"], np.float32), atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_build_refuses_to_batch_streams_for_what_is_true(tmp_path: Path, family: str) -> None:
    """Neither export has a mask over the decoder's own past, so streams of different lengths cannot
    batch: refused for that, not for ``use_cache_branch`` (fed once per call by the runtime) nor
    for the encoder's KV (set once, it never grows)."""
    config = read_pipeline_file(merged_pipeline_file(tmp_path, family))
    config.stage("decoder").configure(max_batch=4)
    with pytest.raises(BuildError, match=r"stage 'decoder' keeps state that grows with each step \('past_key_values.0.decoder.key' along axis 2\), "
                       r"and the pipeline has no attention mask input"):
        build(config, tmp_path / "built")


def test_a_hand_wired_merged_decoder_and_its_spec_round_trip(tmp_path: Path) -> None:
    config = PipelineConfig("decoder")
    stage = config.add_stage(CORPUS / "whisper" / "decoder_model_merged.onnx", "decoder")
    for t in stage.inputs:
        if t.name.startswith("past_key_values."):
            config.add_state(stage.output(t.name.replace("past_key_values", "present")), stage.input(t.name), 2, once=".encoder." in t.name)
        elif t.name != "use_cache_branch":
            config.add_input(t).connect(stage.input(t.name))
    logits = next(t for t in stage.outputs if t.name == "logits")
    stage.output("logits").connect(config.add_output(logits))
    config.add_step_flag(stage.input("use_cache_branch"))
    spec = config.to_spec()
    data = json.loads(spec.to_json())
    assert {"stage": "decoder", "output": "present.0.encoder.key", "input": "past_key_values.0.encoder.key", "empty_axis": 2, "once": True} in data["states"]
    assert {"stage": "decoder", "output": "present.0.decoder.key", "input": "past_key_values.0.decoder.key", "empty_axis": 2} in data["states"]
    assert data["step_flags"] == [{"stage": "decoder", "input": "use_cache_branch", "first": False}]
    assert PipelineSpec.from_json(spec.to_json()) == spec
    assert "(every later step, set by the first)" in str(StateLink("decoder", "present.0.encoder.key", "past_key_values.0.encoder.key", once=True))


def test_step_flags_and_once_links_are_checked_and_old_specs_read_as_before(tmp_path: Path) -> None:
    spec = read_pipeline_file(merged_pipeline_file(tmp_path, "whisper")).to_spec()
    data = json.loads(spec.to_json())
    old = {**data, "states": [{k: v for k, v in s.items() if k != "once"} for s in data["states"]]}
    del old["step_flags"]  # what a bundle made before either existed holds
    before = PipelineSpec.from_dict(old)
    assert not any(s.once for s in before.states) and before.step_flags == ()
    with pytest.raises(ConfigError, match=r"input 'use_cache_branch' of stage 'decoder' is not fed by any link"):
        before.validate()

    def changed(**change: object) -> PipelineSpec:
        return PipelineSpec.from_dict({**data, "step_flags": [{**data["step_flags"][0], **change}]})

    with pytest.raises(ConfigError, match=r"step flag decoder.input_ids: .*must be a bool of fixed shape"):
        changed(input="input_ids").validate()
    with pytest.raises(ConfigError, match=r"step flag decoder.use_cach: stage 'decoder' has no input 'use_cach'; closest: 'use_cache_branch'"):
        changed(input="use_cach").validate()
    with pytest.raises(ConfigError, match=r"unknown key\(s\) value; valid: stage, input, first"):
        changed(value=True)
    with pytest.raises(ConfigError, match=r"the pipeline has no state links, so no stream's steps to flag; feed 'use_cache_branch' as a pipeline input"):
        PipelineSpec.from_dict({**data, "states": []}).validate()
    with pytest.raises(ConfigError, match=r"cannot be both once and shared"):
        PipelineSpec.from_dict({**data, "states": [{**data["states"][2], "shared": True}, *data["states"][3:]]}).validate()



def _by_hand(session: ort.InferenceSession, xs: list[np.ndarray], encoder: np.ndarray) -> list[np.ndarray]:
    """A stream of the small merged decoder run by hand, as ``make_corpus.ort_greedy`` runs optimum's."""
    past, kv, outs = np.zeros((1, 0, 4), np.float32), np.zeros((1, 0, 4), np.float32), []
    for step, x in enumerate(xs):
        y, present, made = session.run(None, {"x": x, "attention_mask": np.ones((1, past.shape[1] + x.shape[1]), np.int64),
                                              "encoder_hidden_states": encoder, "use_cache_branch": np.array([step > 0]),
                                              "past_key_values.0.key": past, "past_key_values.0.encoder.key": kv})
        past, kv = present, made if step == 0 else kv
        outs.append(y)
    return outs


@pytest.mark.parametrize("lengths", [(3, 3, 3, 3), (2, 3, 2, 5)], ids=["same-encoder-lengths", "other-encoder-lengths"])
def test_streams_of_a_merged_decoder_with_a_mask_batch_and_keep_their_encoder_kv(tmp_path: Path, lengths: tuple[int, ...]) -> None:
    """A small merged decoder with an attention mask batches its streams (the build's probe passes):
    4 streams with prompts of 3, 1, 2 and 4 positions, each step's outputs equal to the stream run
    by hand; with the same encoder length their later steps run as one call, with other lengths
    each member's encoder KV is its own and the batch runs member by member."""
    plan = split(merged_decoder(), policy=UniformPolicy(stages=1), states="auto")
    plan.config.stage("stage0").configure(max_batch=4)
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "merged.onnxpipe")
    assert runtime.read_bundle(bundle).spec.stages[0].batching is not None
    rng = np.random.default_rng(0)
    prompts, steps = (3, 1, 2, 4), 4
    xs = [[rng.standard_normal((1, p if k == 0 else 1, 4)).astype(np.float32) for k in range(steps)] for p in prompts]
    encoders = [rng.standard_normal((1, n, 4)).astype(np.float32) for n in lengths]
    session = ort.InferenceSession(merged_decoder().SerializeToString(), providers=["CPUExecutionProvider"])
    want = [_by_hand(session, x, e) for x, e in zip(xs, encoders, strict=True)]
    got: list[list[np.ndarray]] = [[] for _ in prompts]
    with runtime.load(bundle, micro_batches=1) as pipe:
        streams = [pipe.stream() for _ in prompts]
        for k in range(steps):
            done = [sum(x.shape[1] for x in xs[j][:k]) for j in range(len(prompts))]
            futures = pipe.submit_steps({s: {"x": xs[j][k], "attention_mask": np.ones((1, done[j] + xs[j][k].shape[1]), np.int64),
                                             "encoder_hidden_states": encoders[j]} for j, s in enumerate(streams)})
            for j, s in enumerate(streams):
                got[j].append(futures[s].result(timeout=60)["y"])
        sizes = pipe.stats().stages[0].batch_sizes
    for mine, theirs in zip(got, want, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    assert (sizes.get(4, 0) == steps - 1) == (len(set(lengths)) == 1), sizes


def test_a_step_that_fails_on_the_stages_own_state_says_so_and_the_stream_stops(tmp_path: Path) -> None:
    """Without ``once`` (as before issue 39), the cached branch's ``[0, 4, 1, 8]`` placeholders
    become the encoder's KV and the third step fails on them: the error says the stage ran the
    step on the state it holds and what of it does not fit, and to close the stream, not that
    the stream can go on; a later step is refused."""
    config = PipelineConfig("decoder")
    stage = config.add_stage(CORPUS / "t5" / "decoder_model_merged.onnx", "decoder")
    for t in stage.inputs:
        if t.name.startswith("past_key_values."):
            config.add_state(stage.output(t.name.replace("past_key_values", "present")), stage.input(t.name), 2)
        elif t.name != "use_cache_branch":
            config.add_input(t).connect(stage.input(t.name))
    stage.output("logits").connect(config.add_output(next(t for t in stage.outputs if t.name == "logits")))
    config.add_step_flag(stage.input("use_cache_branch"))
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "decoder.onnxpipe")
    expected = json.loads((CORPUS / "t5" / "expected.json").read_text())
    fixed = encoded("t5", expected["requests"][0]["inputs"])
    with runtime.load(bundle) as pipe, pipe.stream() as stream:
        feeds = {"input_ids": np.array([[0]], np.int64), **fixed}
        stream.step(feeds)
        stream.step(feeds)
        with pytest.raises(StreamError) as failed:
            stream.step(feeds)
        error = failed.value
        assert error.remedy is Remedy.CLOSE and error.state_valid is False and error.step == 2
        assert str(error).endswith(
            "; stage 'decoder' ran the step on the state it holds (as after step 1), and that state does not fit it: its state "
            "'past_key_values.0.encoder.key' is [0, 4, 1, 8], where the step's other inputs size dim 0 ('batch_size') 1; "
            "every later step would fail on it too: close the stream")
        assert "can go on" not in str(error)
        with pytest.raises(StreamError, match=r"^stream \d+ cannot take more steps: step 2 failed in stage 'decoder' on the state it holds \(its state "
                           r"'past_key_values.0.encoder.key' is \[0, 4, 1, 8\], .*\); close it and open a new one$"):
            stream.step(feeds)
