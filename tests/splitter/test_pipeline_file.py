"""The pipeline file (TOML): models, a model split in place, code stages, wiring by tensor names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxpipe import runtime
from onnxpipe._errors import ConfigError
from onnxpipe.builder import build, export
from onnxpipe.splitter import read_pipeline_file
from tests import code_stages
from tests.models import chain, stage_head

HEAD = """
format = "onnxpipe.pipeline-file"
version = 1
name = "coded"
inputs = ["x"]
outputs = ["y"]

[[stages]]
name = "head"
model = "head.onnx"
settings = { intra_op_threads = 1 }

[[stages]]
name = "combine"
code = "tests.code_stages:combine"
params = { factor = 2.0 }
inputs = [{ name = "h", dtype = "float32", shape = ["N", 4] }, { name = "g", dtype = "float32", shape = ["N", 4] }]
outputs = [{ name = "y", dtype = "float32", shape = ["N", 4] }]
"""


def write(folder: Path, text: str) -> Path:
    onnx.save(stage_head(), folder / "head.onnx")
    onnx.save(chain(), folder / "chain.onnx")
    path = folder / "pipeline.toml"
    path.write_text(text)
    return path


def test_file_builds_exports_loads_and_runs(tmp_path: Path) -> None:
    config = read_pipeline_file(write(tmp_path, HEAD))
    assert [s.name for s in config.to_spec().stages] == ["head", "combine"]
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "b.onnxpipe")
    with runtime.load(bundle, allow_code=["tests.*"]) as pipe:
        x = np.linspace(-3, 3, 20, dtype=np.float32).reshape(5, 4)
        np.testing.assert_allclose(pipe({"x": x})["y"], code_stages.expected(x))


def test_file_and_api_author_the_same_spec(tmp_path: Path) -> None:
    from_file = read_pipeline_file(write(tmp_path, HEAD)).to_spec()
    from_api = code_stages.config().to_spec()
    assert [(s.name, s.inputs, s.outputs, s.code) for s in from_file.stages] == [(s.name, s.inputs, s.outputs, s.code) for s in from_api.stages]
    assert set(from_file.links) == set(from_api.links)


SPLIT = """
format = "onnxpipe.pipeline-file"
version = 1
inputs = {{ X = {{ dtype = "float32", shape = [1, 4] }} }}
outputs = {{ out = "Z" }}

[[stages]]
name = "chain"
model = "chain.onnx"
{how}

[[stages]]
name = "twice"
code = "tests.code_stages:Holder.double"
inputs = [{{ name = "h", dtype = "float32", shape = [1, 4] }}, {{ name = "g", dtype = "float32", shape = [1, 4] }}]
outputs = [{{ name = "y", dtype = "float32", shape = [1, 4] }}]
input_map = {{ h = "Y", g = "X" }}
output_map = {{ y = "Z" }}
"""


@pytest.mark.parametrize("how", ['at = ["b"]', 'at = [["b"], "sig2"]', 'auto = 2\npolicy = "uniform"'])
def test_a_model_split_in_place(tmp_path: Path, how: str) -> None:
    config = read_pipeline_file(write(tmp_path, SPLIT.format(how=how)))
    names = [s.name for s in config.to_spec().stages]
    assert names[:-1] == [f"chain_{i}" for i in range(len(names) - 1)] and names[-1] == "twice" and len(names) >= 3
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "bundle")
    x = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
    whole = ort.InferenceSession(chain().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    with runtime.load(bundle, allow_code=["tests.code_stages:*"]) as pipe:
        np.testing.assert_allclose(pipe({"X": x})["out"], (whole + x) * 2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('"g", dtype', '"gg", dtype'), r"stage 'combine' input 'gg' reads tensor 'gg', which no stage makes and which is not a pipeline input; closest: 'g'"),
        (('outputs = ["y"]', 'outputs = ["why"]'), r"pipeline output 'why' is tensor 'why', which no stage makes"),
        (('params = {', 'input_map = { hh = "h" }\nparams = {'), r"stages\[1\] \('combine'\): input_map names input 'hh', which the stage does not have"),
        (('params = {', 'output_map = { y = "h" }\nparams = {'), r"tensor 'h' is made by stage 'head' \(output 'h'\) and by stage 'combine' \(output 'y'\)"),
        (('inputs = ["x"]', 'inputs = ["x", "z"]'), r"pipeline input 'z' feeds no stage"),
        (('code = "tests.code_stages:combine"', 'code = "tests.code_stages"'), r"stage 'combine': entry point \"tests\.code_stages\" is malformed"),
        (('model = "head.onnx"', 'model = "head.onnx"\ncode = "a:b"'), r"a stage has exactly one of 'model' .* or 'code'"),
        (('settings = { intra_op_threads = 1 }', 'settings = { threads = 1 }'), r"\('head'\): settings: unknown stage setting 'threads'"),
        (('version = 1', 'version = 7'), r"version 7 is not supported; this onnxpipe reads version 1"),
        (('name = "coded"', 'nmae = "coded"'), r"unknown key 'nmae'; closest: 'name'"),
        (('outputs = ["y"]', 'outputs = ["y"'), r"is not valid TOML"),
    ],
)
def test_mistakes_are_one_error_naming_stage_port_and_choices(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    assert change[0] in HEAD
    path = write(tmp_path, HEAD.replace(change[0], change[1], 1))
    with pytest.raises(ConfigError, match=message):
        read_pipeline_file(path)


STATEFUL = """
format = "onnxpipe.pipeline-file"
version = 1
inputs = ["x"]
outputs = ["y"]

[[stages]]
name = "rnn"
model = "rnn.onnx"
{how}
"""


@pytest.mark.parametrize(
    ("how", "stages"),
    [('at = ["state1N"]\nstates = "auto"', ["rnn_0", "rnn_1"]), ('states = { state1N = "state1", state2N = "state2" }', ["rnn"])],
    ids=["split-auto", "whole-pairs"],
)
def test_state_links_in_the_file(tmp_path: Path, how: str, stages: list[str]) -> None:
    """A recurrent model's state pairs, found by name in a split in place or given by hand for the
    whole model: streams through the built bundle equal the whole model step for step (1e-5)."""
    from tests.stateful_models import recurrent, whole_recurrent

    onnx.save(recurrent(), tmp_path / "rnn.onnx")
    (tmp_path / "p.toml").write_text(STATEFUL.format(how=how))
    spec = read_pipeline_file(tmp_path / "p.toml").to_spec()
    assert [s.name for s in spec.stages] == stages
    assert sorted((s.output, s.input) for s in spec.states) == [("state1N", "state1"), ("state2N", "state2")]
    assert [t.name for t in spec.inputs] == ["x"] and [t.name for t in spec.outputs] == ["y"]
    bundle = export(build(read_pipeline_file(tmp_path / "p.toml"), tmp_path / "built").path, tmp_path / "bundle")
    xs = [np.random.default_rng(t).standard_normal((1, 4)).astype(np.float32) for t in range(4)]
    with runtime.load(bundle) as pipe, pipe.stream() as s:
        got = [s.step({"x": x})["y"] for x in xs]
    np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(recurrent(), xs)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("states = 3", r"\('rnn'\): states must be \"auto\" or a table of state pairs"),
        ('states = { nothere = "state1" }', r"nothere"),
    ],
)
def test_bad_state_links_in_the_file_are_one_error(tmp_path: Path, how: str, message: str) -> None:
    from onnxpipe import OnnxpipeError
    from tests.stateful_models import recurrent

    onnx.save(recurrent(), tmp_path / "rnn.onnx")
    (tmp_path / "p.toml").write_text(STATEFUL.format(how=how))
    with pytest.raises(OnnxpipeError, match=message):
        read_pipeline_file(tmp_path / "p.toml")


FPN = """
format = "onnxpipe.pipeline-file"
version = 1
name = "pyramid"
inputs = ["x"]
outputs = ["y"]

[[stages]]
name = "fpn"
model = "fpn.onnx"
auto = 2
{dims}
"""


def test_an_auto_stage_takes_the_dims_its_profile_needs(tmp_path: Path) -> None:
    from onnxpipe import SplitError
    from tests.models import fpn_net

    onnx.save(fpn_net(), tmp_path / "fpn.onnx")
    path = tmp_path / "p.toml"
    path.write_text(FPN.format(dims=""))
    with pytest.raises(SplitError, match=r"^profiling cannot run fpn: .* give them: --dim H=SIZE --dim W=SIZE --dim N=SIZE"):
        read_pipeline_file(path)
    path.write_text(FPN.format(dims="dims = { H = 32, W = 32 }"))
    config = read_pipeline_file(path)
    assert [s.name for s in config.stages] == ["fpn_0", "fpn_1"]
    for bad, message in (("dims = { H = 0 }", r"dims must be a table of symbolic dim names and sizes >= 1"),
                         ('dims = { H = 32 }\npolicy = "uniform"', r"policy 'uniform' measures nothing, so takes no dims; 'dims' is for policy 'measured'")):
        path.write_text(FPN.format(dims=bad))
        with pytest.raises(ConfigError, match=message):
            read_pipeline_file(path)
    path.write_text(FPN.format(dims="").replace("auto = 2\n", "dims = { H = 32 }\n"))
    with pytest.raises(ConfigError, match=r"'dims' sizes the profile of auto = N or the sample run of at = \[\.\.\.\]; this stage is not split"):
        read_pipeline_file(path)


def test_an_unknown_stage_key_lists_every_valid_one(tmp_path: Path) -> None:
    path = write(tmp_path, HEAD.replace('settings = { intra_op_threads = 1 }', 'settings = { intra_op_threads = 1 }\nsizes = { H = 3 }'))
    every = r"'at', 'auto', 'code', 'dims', 'input_map', 'inputs', 'model', 'name', 'output_map', 'outputs', 'params', 'policy', 'runs', 'settings', 'states'"
    with pytest.raises(ConfigError, match=rf"unknown key 'sizes'; closest: 'states'; valid: {every}$"):
        read_pipeline_file(path)


def test_inspect_of_a_file_whose_auto_stage_cannot_be_profiled_is_one_line(tmp_path: Path) -> None:
    from tests.cli.helpers import assert_user_error, ok, run
    from tests.models import fpn_net

    onnx.save(fpn_net(), tmp_path / "fpn.onnx")
    path = tmp_path / "p.toml"
    path.write_text(FPN.format(dims=""))
    assert_user_error(run("inspect", path), "profiling cannot run fpn", "--dim H=SIZE")
    path.write_text(FPN.format(dims="dims = { H = 32, W = 32 }"))
    ok("inspect", path)
