"""PipelineConfig by hand: connect checks, pipeline order, save/load, and a sequential run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from onnxpipe import ConfigError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import SequentialPipeline, TensorSpec
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
