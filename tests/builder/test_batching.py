"""The build's batching probe (issue 20): a stage batches only where it is checked to be safe,
and is refused, by name and with the reason, everywhere else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import ModelProto, TensorProto, helper

from onnxpipe import BuildError, BundleError, ConfigError
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import Batching, StageSettings, load
from onnxpipe.splitter import split
from tests.cli.helpers import assert_user_error, ok, run
from tests.stateful_models import gpt_decoder


def _one_stage(model: ModelProto, settings: StageSettings, name: str = "m") -> PipelineConfig:
    config = PipelineConfig(name)
    stage = config.add_stage(model, name, settings=settings)
    for t in model.graph.input:
        config.input(t.name).connect(stage.input(t.name))
    for t in model.graph.output:
        stage.output(t.name).connect(config.output(t.name))
    return config


def _model(nodes: list, inputs: list, outputs: list) -> ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _relu(batch: int | str) -> ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])])


def test_a_fixed_batch_dim_is_refused_naming_the_port(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"stage 'm' cannot batch: dim 0 of input 'x' \[1, 4\] is fixed at 1.*max_batch=1"):
        build(_one_stage(_relu(1), StageSettings(max_batch=4)), tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_a_model_that_mixes_rows_is_refused_by_the_probe(tmp_path: Path) -> None:
    """``y = x - mean(x over the batch)``: every shape fits, but a request's result depends on the
    others in its batch; the probe sees batched differ from alone and refuses."""
    model = _model([helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1), helper.make_node("Sub", ["x", "m"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    model.opset_import[0].version = 17
    with pytest.raises(BuildError, match=r"stage\(s\) 'm' cannot batch: output 'y' batched differs from alone by"):
        build(_one_stage(model, StageSettings(max_batch=4)), tmp_path / "b")


def test_a_batchable_stage_records_how_it_was_checked(tmp_path: Path) -> None:
    result = build(_one_stage(_relu("batch"), StageSettings(max_batch=4, max_delay_ms=2)), tmp_path / "b")
    stage = result.spec.stages[0]
    assert stage.batching == Batching(probe=stage.batching.probe if stage.batching else "")
    assert stage.batching is not None and stage.batching.probe.startswith("2 requests batched and alone agree")
    data = json.loads((result.path / "pipeline.json").read_text())["stages"][0]
    assert data["settings"]["max_batch"] == 4 and data["settings"]["max_delay_ms"] == 2.0
    assert data["batching"] == {"padded": {}, "stripped": {}, "probe": stage.batching.probe}


def test_a_decoder_without_an_attention_mask_is_refused_for_stream_batching(tmp_path: Path) -> None:
    """Its KV cache grows, and no pipeline input marks padded positions (the mask is renamed here):
    batching streams of different lengths would attend the padding, so the build says why it refuses."""
    model = gpt_decoder(layers=2)
    for node in model.graph.node:
        node.input[:] = ["positions_seen" if i == "attention_mask" else i for i in node.input]
    model.graph.input[1].name = "positions_seen"
    plan = split(model, ["layer0.out"], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=4)
    with pytest.raises(BuildError, match=r"stage 'stage0' keeps state that grows.*no attention mask input.*absolute positions"):
        build(plan.config, tmp_path / "b")


def test_the_decoders_padded_ports_are_found_by_measuring(tmp_path: Path) -> None:
    """The probe finds what grows with the past: the KV caches and the mask, and, in stage 1, the
    additive mask stage 0 makes from it (whose dims have no names), padded with what the batched
    call puts at its padded positions: the model's own blocked value, -1e4 (issue 38: measured, no
    longer guessed as float32's lowest)."""
    plan = split(gpt_decoder(layers=2), ["layer0.out"], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=4)
    spec = build(plan.config, tmp_path / "b").spec
    first, second = (s.batching for s in spec.stages)
    assert first is not None and second is not None
    assert first.padded == {"attention_mask": (1, 0.0), "past_key_values.0.key": (2, 0.0), "past_key_values.0.value": (2, 0.0)}
    assert first.stripped == {"attn_bias": 3, "present.0.key": 2, "present.0.value": 2}
    assert second.padded["attn_bias"] == (3, -1e4)
    assert "batched and alone agree" in second.probe


def test_code_stages_do_not_batch() -> None:
    from onnxpipe.runtime import TensorSpec

    config = PipelineConfig("code")
    port = ("batch", 4)
    stage = config.add_python_stage("tests.code_stages:positive_rows", inputs=[TensorSpec("x", "float32", port)], outputs=[TensorSpec("y", "float32", port)],
                                    name="c", settings=StageSettings(max_batch=2))
    config.input("x").connect(stage.input("x"))
    stage.output("y").connect(config.output("y"))
    with pytest.raises(ConfigError, match="code stage 'c': max_batch 2: code stages run one request at a time"):
        config.to_spec()


@pytest.mark.parametrize("value", [0, -1, 2000, 2.5, True])
def test_bad_max_batch_is_one_clear_error(value: object) -> None:
    with pytest.raises(ConfigError, match="max_batch must be an integer from 1"):
        StageSettings(max_batch=value)  # type: ignore[arg-type]


def test_bad_max_delay_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="max_delay_ms must be a number of milliseconds"):
        StageSettings(max_delay_ms=-1)


def test_a_bundle_asking_to_batch_without_a_record_is_refused(tmp_path: Path) -> None:
    """max_batch written into pipeline.json by hand, without the build's check: the loader refuses."""
    built = build(_one_stage(_relu("batch"), StageSettings()), tmp_path / "b").path
    data = json.loads((built / "pipeline.json").read_text())
    data["stages"][0]["settings"]["max_batch"] = 8
    (built / "pipeline.json").write_text(json.dumps(data))
    bundle = export(built, tmp_path / "bundle")
    with pytest.raises(BundleError, match="stage 'm' has max_batch 8 but no batching record: build it with onnxpipe build"):
        load(bundle)
    data["stages"][0]["batching"] = {"padded": {"x": {"axis": 0, "value": 0}}}
    shutil.rmtree(tmp_path / "bundle")
    (built / "pipeline.json").write_text(json.dumps(data))
    with pytest.raises(BuildError, match=r"batching: padded 'x' must be \{\"axis\": int >= 1, \"value\": number\}, got \{\"axis\": 0, \"value\": 0\}"):
        export(built, tmp_path / "bundle")


def test_cli_build_takes_max_batch(tmp_path: Path) -> None:
    plan = split(gpt_decoder(layers=2), ["layer0.out"], states="auto")
    plan.save(tmp_path / "split")
    ok("build", tmp_path / "split", "-o", tmp_path / "built", "--stage", "*:threads=1,max_batch=8,max_delay_ms=1")
    data = json.loads((tmp_path / "built" / "pipeline.json").read_text())
    assert [s["settings"]["max_batch"] for s in data["stages"]] == [8, 8]
    out = ok("build", tmp_path / "split", "-o", tmp_path / "built", "--overwrite", "--stage", "*:max_batch=8").output
    assert "stage 'stage0' batches up to 8: pads attention_mask (axis 1, 0), past_key_values.0.key (axis 2, 0)" in out
    assert "strips attn_bias (axis 3), present.0.key (axis 2)" in out and "batched and alone agree" in out
    assert all("agree" in s["batching"]["probe"] for s in data["stages"])
    result = run("build", tmp_path / "split", "-o", tmp_path / "b2", "--stage", "0:max_batch=0")
    assert_user_error(result, "max_batch must be an integer from 1 (no batching) to 1024, got 0")


def test_a_pipeline_file_takes_max_batch(tmp_path: Path) -> None:
    import onnx

    from onnxpipe.splitter import read_pipeline_file

    onnx.save(_relu("batch"), tmp_path / "relu.onnx")
    (tmp_path / "p.toml").write_text(
        'format = "onnxpipe.pipeline-file"\nversion = 1\nname = "p"\ninputs = ["x"]\noutputs = ["y"]\n\n'
        '[[stages]]\nname = "relu"\nmodel = "relu.onnx"\nsettings = { max_batch = 8, max_delay_ms = 1.5 }\n'
    )
    spec = build(read_pipeline_file(tmp_path / "p.toml"), tmp_path / "built").spec
    assert spec.stages[0].settings.max_batch == 8 and spec.stages[0].settings.max_delay_ms == 1.5
    assert spec.stages[0].batching is not None


def test_inspect_shows_how_a_stage_batches(tmp_path: Path) -> None:
    built = build(_one_stage(_relu("batch"), StageSettings(max_batch=4, max_delay_ms=2)), tmp_path / "b").path
    bundle = export(built, tmp_path / "bundle")
    out = ok("inspect", bundle).output
    assert "max_batch 4, max_delay_ms 2" in out
    assert "batching: requests stacked along dim 0, nothing padded; 2 requests batched and alone agree" in out


def test_batch_pad_states_a_pad_value_by_hand_and_the_probe_still_checks_it(tmp_path: Path) -> None:
    """Stage 1's float mask padded with the model's own blocked value (-1e4) batches; padded with 0
    (unblocked: the padding would be attended) the probe sees batched differ from alone and refuses."""
    def plan(pad: float) -> PipelineConfig:
        p = split(gpt_decoder(layers=2), ["layer0.out"], states="auto")
        for stage in p.config.stages:
            stage.configure(max_batch=4)
        p.config.stage("stage1").configure(batch_pad={"attn_bias": pad})
        return p.config

    spec = build(plan(-1e4), tmp_path / "a").spec
    assert spec.stages[1].batching is not None and spec.stages[1].batching.padded["attn_bias"] == (3, -1e4)
    assert json.loads((tmp_path / "a" / "pipeline.json").read_text())["stages"][1]["settings"]["batch_pad"] == {"attn_bias": -1e4}
    with pytest.raises(BuildError, match=r"cannot batch: output 'logits' batched differs from alone by"):
        build(plan(0.0), tmp_path / "b")
    config = plan(0.0)
    config.stage("stage1").configure(batch_pad={"layer0.out": 0.0})
    with pytest.raises(BuildError, match=r"batch_pad names 'layer0.out', which is not an input that grows with a stream's past; those are: 'attn_bias'"):
        build(config, tmp_path / "c")
    with pytest.raises(ConfigError, match="batch_pad must map input names to finite numbers"):
        StageSettings(batch_pad={"x": float("nan")})


def test_a_stateless_stage_the_probe_cannot_run_batches_on_its_batch_axes_and_says_so(tmp_path: Path) -> None:
    """An embedding of 2 ids: the probe's random ids (0..3) fall outside it, so it cannot run the
    stage at all; the batch axes are fine, so the stage batches, and its record says why unprobed."""
    from tests.models import embed_mlp

    model = embed_mlp(vocab=2)
    spec = build(_one_stage(model, StageSettings(max_batch=4)), tmp_path / "b").spec
    batching = spec.stages[0].batching
    assert batching is not None and batching.probe.startswith("not probed: stage 'm' failed on the probe's request: ")


def _valid_conv() -> ModelProto:
    """``x[N, 1, H, W]`` through a 3 x 3 convolution without padding: it cannot run on fewer than 3 x 3 pixels."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [2, 1, 3, 3], np.random.default_rng(0).standard_normal(18).astype(np.float32).tolist())
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv")], "valid_conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, None, None])], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_probe_runs_at_the_sizes_the_split_was_made_for(tmp_path: Path) -> None:
    """The probe sizes a stateless request's free dims as the split's ``dims`` (kept in the pipeline's
    ``input_dims`` metadata, through the pipeline file), else 2: a 3 x 3 convolution cannot run on 2 x 2."""
    model = _valid_conv()
    plan = split(model, assignment={"conv": 0}, dims={"H": 8, "x.3": 6})
    assert plan.config.metadata["input_dims"] == "H=8,x.3=6"
    plan.save(tmp_path / "plan")
    config = PipelineConfig.load(tmp_path / "plan")
    assert config.metadata["input_dims"] == "H=8,x.3=6"
    config.stages[0].configure(max_batch=4)
    spec = build(config, tmp_path / "b").spec
    batching = spec.stages[0].batching
    assert batching is not None and batching.probe.startswith("2 requests batched and alone agree: max abs diff "), batching.probe
    assert spec.metadata["input_dims"] == "H=8,x.3=6"
    # Without the sizes the probe's 2 x 2 pixels cannot run, and the record says so.
    plain = split(model, assignment={"conv": 0})
    assert "input_dims" not in plain.config.metadata
    plain.config.stages[0].configure(max_batch=4)
    unprobed = build(plain.config, tmp_path / "b2").spec.stages[0].batching
    assert unprobed is not None and unprobed.probe.startswith("not probed: "), unprobed.probe


def test_bad_input_dims_metadata_is_one_clear_error(tmp_path: Path) -> None:
    config = split(_valid_conv(), assignment={"conv": 0}, dims={"H": 8}).config
    config.metadata["input_dims"] = "H=8,W=zero"
    config.stages[0].configure(max_batch=4)
    with pytest.raises(ConfigError, match=r"^pipeline metadata 'input_dims': 'W=zero' is not NAME=SIZE with a size from 1 \(as --dim gives it\)$"):
        build(config, tmp_path / "b")
