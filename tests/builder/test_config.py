"""PipelineConfig by hand: connect checks, pipeline order, save/load, and a sequential run."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from onnxpipe import ConfigError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import SequentialPipeline, StageSettings, TensorSpec
from onnxpipe.runtime._settings import OWNED_SESSION_CONFIG
from tests import models

HEAD = models.stage_head()
TWIN = models.stage_twin()
TAIL = models.stage_tail()


def _three_stage() -> PipelineConfig:
    """Skip edges (x into tail, g from head to tail), one output feeding two inputs of twin, and
    tail added first: to_spec must still order it last."""
    return models.hand_wired(tail_first=True)


def _expected(x: np.ndarray) -> np.ndarray:
    h = np.maximum(x, 0)
    return (h + h) * -x - x


def test_config_orders_stages_and_runs_like_the_math(tmp_path: Path) -> None:
    config = _three_stage()
    spec = config.to_spec()
    assert [s.name for s in spec.stages] == ["head", "twin", "tail"]
    assert spec.inputs == (TensorSpec("x", "float32", ("N", 4)),)  # declared from the stage port
    config.save(tmp_path / "cfg")
    loaded = PipelineConfig.load(tmp_path / "cfg")
    assert loaded.to_spec() == PipelineConfig.load(tmp_path / "cfg" / "pipeline.json").to_spec()
    assert loaded.to_spec().links == spec.links
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    out = SequentialPipeline(loaded.to_spec(), tmp_path / "cfg").run({"x": x})
    np.testing.assert_allclose(out["y"], _expected(x), rtol=1e-6)


def test_str_shows_the_wiring() -> None:
    text = str(_three_stage())
    assert "stage 'twin'" in text
    assert "in  p: float32[N, 4]  <- head.h" in text
    assert "out h: float32[N, 4]  -> twin.p, twin.q" in text


def test_connect_refuses_bad_links() -> None:
    config = PipelineConfig()
    head = config.add_stage(HEAD, "head")
    twin = config.add_stage(TWIN, "twin")
    with pytest.raises(ConfigError, match="a link starts at a pipeline input or a stage output"):
        config.connect(twin.input("p"), head.input("x"))
    with pytest.raises(ConfigError, match="a link ends at a stage input or a pipeline output"):
        head.output("h").connect(twin.output("s"))
    with pytest.raises(ConfigError, match="a stage cannot feed itself"):
        twin.output("s").connect(twin.input("p"))
    with pytest.raises(ConfigError, match="stage 'head' has no output 'hh'; closest: 'h'"):
        head.output("hh")
    head.output("h").connect(twin.input("p"))
    with pytest.raises(ConfigError, match=r"twin\.p is already fed by head\.h"):
        head.output("g").connect(twin.input("p"))
    config.add_input(TensorSpec("i", "int64", ("N", 4)))
    with pytest.raises(ConfigError, match="dtype int64 != float32"):
        config.input("i").connect(head.input("x"))
    config.add_input(TensorSpec("w", "float32", (2, 5)))
    with pytest.raises(ConfigError, match=r"dim 1: 5 != 4"):
        config.input("w").connect(head.input("x"))
    with pytest.raises(ConfigError, match="duplicate stage name 'head'"):
        config.add_stage(HEAD, "head")


def test_incomplete_or_cyclic_wiring_is_refused_on_to_spec() -> None:
    config = PipelineConfig()
    head = config.add_stage(HEAD, "head")
    twin = config.add_stage(TWIN, "twin")
    config.input("x").connect(head.input("x"))
    head.output("h").connect(twin.input("p"))
    with pytest.raises(ConfigError, match="input 'q' of stage 'twin' is not fed by any link"):
        config.to_spec()
    loop = PipelineConfig()
    a = loop.add_stage(TWIN, "a")
    b = loop.add_stage(TWIN, "b")
    a.output("s").connect(b.input("p"))
    b.output("s").connect(a.input("p"))
    loop.input("x").connect(a.input("q"))
    loop.input("x").connect(b.input("q"))
    with pytest.raises(ConfigError, match="stages form a cycle: a -> b -> a"):
        loop.to_spec()


def test_add_stage_from_file_and_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "head.onnx"
    onnx.save(HEAD, path)
    config = PipelineConfig()
    stage = config.add_stage(path)
    assert stage.name == "stage0" and stage.path == path
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="cannot read stage module"):
        config.add_stage(tmp_path / "bad.onnx")
    with pytest.raises(ConfigError, match="is not a split or config folder: it has no pipeline.json"):
        PipelineConfig.load(tmp_path / "nowhere")


def test_add_split_wires_the_pieces_and_leaves_the_models_own_ports(tmp_path: Path) -> None:
    import onnxruntime as ort

    from onnxpipe.builder import build, export
    from onnxpipe.runtime import StageSettings, load
    from onnxpipe.splitter import split
    from tests import code_stages, models

    plan = split(models.chain(), ["a", "b"])  # X -> a -> b -> Y in 3 pieces
    config = code_stages.config()  # x -> head -> combine -> y
    pieces = config.add_split(plan, "chain", settings=StageSettings(intra_op_threads=1))
    assert [s.name for s in pieces.stages] == ["chain_0", "chain_1", "chain_2"] and set(pieces.inputs) == {"X"} and set(pieces.outputs) == {"Y"}
    config.input("X").connect(pieces.input("X"))
    pieces.output("Y").connect(config.output("Y"))
    with pytest.raises(ConfigError, match=r"the split model has no input 'x'; valid: 'X'"):
        pieces.input("x")
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "bundle")
    X = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
    whole = ort.InferenceSession(models.chain().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
    with load(bundle, allow_code=["tests.code_stages:*"]) as pipe:
        out = pipe({"x": np.ones((2, 4), np.float32), "X": X})
    np.testing.assert_allclose(out["Y"], whole, rtol=1e-6)
    assert all(s.settings.intra_op_threads == 1 for s in pieces.stages)


# -- session_config may not overrule the typed settings (issue 36, item 7) ---------------------------


@pytest.mark.parametrize(("key", "setting"), [(key, setting) for key, (setting, _) in OWNED_SESSION_CONFIG.items()])
def test_a_session_config_key_that_a_setting_makes_is_refused_naming_the_setting(key: str, setting: str) -> None:
    message = rf"session_config key '{re.escape(key)}' is what the setting '{setting}' makes: set {setting} instead \(StageSettings\({setting}=\.\.\.\)"
    with pytest.raises(ConfigError, match="^" + message):
        StageSettings(spinning=False, session_config={key: "1"})
    config = models.hand_wired()
    with pytest.raises(ConfigError, match=rf"^stage 'head': {message}"):
        config.stage("head").configure(session_config={key: "1"})


@pytest.mark.parametrize(
    "key",
    [
        "session.collect_node_memory_stats_to_file",  # onnxruntime 1.32 overwrites the file it names as the session starts
        "session.node_partition_config_file",
        "session.optimized_model_filepath",
        "session.moe.offload.derived_cache_dir",
        "ep.context_enable",
        "ep.context_file_path",
        "session.enable_profiling",
    ],
)
def test_a_session_config_key_naming_a_host_file_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^session_config key '{re.escape(key)}' names a file or folder of the host, or makes onnxruntime write one"):
        StageSettings(session_config={key: "/tmp/x"})


def test_onnxpipes_own_session_config_keys_are_refused_and_the_others_pass() -> None:
    with pytest.raises(ConfigError, match=r"^session_config key 'session\.record_ep_graph_assignment_info' is onnxpipe's own"):
        StageSettings(session_config={"session.record_ep_graph_assignment_info": "0"})
    given = {"session.set_denormal_as_zero": "1", "session.use_device_allocator_for_initializers": "1", "session.use_ort_model_bytes_directly": "1"}
    options = StageSettings(session_config=given).session_options()
    assert {key: options.get_session_config_entry(key) for key in given} == given


@pytest.mark.parametrize("spinning", [False, True])
def test_the_typed_spinning_setting_is_what_the_session_gets(spinning: bool) -> None:
    options = StageSettings(spinning=spinning, intra_op_threads=2).session_options()
    expected = "1" if spinning else "0"
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == expected
    assert options.get_session_config_entry("session.inter_op.allow_spinning") == expected
