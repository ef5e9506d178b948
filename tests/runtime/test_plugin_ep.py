"""A plugin execution provider, named by its Python package: Qualcomm's QNN provider from the
``onnxruntime-qnn`` wheel (the ``qnn`` extra), whose HTP backend runs as a simulator on x86
(``backend_type=htp``), registered into plain onnxruntime (1.23 and later).

Tolerance: the HTP simulator's outputs of the tiny MLP below equal numpy's within 1e-5 (measured
max abs difference 3.8e-6).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxpipe import BundleError, ConfigError
from onnxpipe.builder import build, export
from onnxpipe.cli import main as cli
from onnxpipe.runtime import StageSettings, _session, load
from onnxpipe.splitter import split

QNN, CPU = "QNNExecutionProvider", "CPUExecutionProvider"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime_qnn") is None or not hasattr(ort, "register_execution_provider_library"),
    reason="needs onnxruntime-qnn (pip install 'onnxpipe[qnn]', x86_64 Linux, Python 3.11+) and onnxruntime 1.23 or later",
)
HTP = {"target": "qnn", "ep_package": "onnxruntime_qnn", "ep_device": "cpu", "provider_options": {"backend_type": "htp"}}
_RNG = np.random.default_rng(0)
W1, W2 = _RNG.standard_normal((16, 32)).astype(np.float32), _RNG.standard_normal((32, 8)).astype(np.float32)


def _mlp() -> ModelProto:
    """x [1, 16] -> MatMul 'mm1' -> Relu 'relu' -> r -> MatMul 'mm2' -> y [1, 8]."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              [numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(W2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _bundle(tmp_path: Path, *settings: dict[str, Any]) -> Path:
    plan = split(_mlp(), ["r"])
    for stage, given in zip(plan.config.stages, settings, strict=True):
        stage.configure(**given)
    return export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")


def _expected(x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ W1, 0) @ W2


@pytest.mark.parametrize("engine", ["thread", pytest.param("ray", marks=pytest.mark.xdist_group("ray"))])  # the one cluster's worker
def test_a_stage_on_the_qnn_htp_simulator_beside_a_cpu_stage(tmp_path: Path, engine: str, request: pytest.FixtureRequest) -> None:
    if engine == "ray":
        request.getfixturevalue("ray_cluster")
    bundle = _bundle(tmp_path, HTP, {"target": "cpu"})
    x = _RNG.standard_normal((1, 16)).astype(np.float32)
    with load(bundle, engine=engine, allow_code=["onnxruntime_qnn"]) as pipe:
        outs = [pipe({"x": x})["y"] for _ in range(3)]
        assert pipe.get_providers() == [QNN, CPU]
        where = pipe.placement()
        nodes = {s.stage: s.nodes for s in pipe.stats().stages}
    for y in outs:
        np.testing.assert_allclose(y, _expected(x), rtol=1e-5, atol=1e-5)
    assert where == {"stage0": {QNN: ["MatMul 'mm1'", "Relu 'relu'"]}, "stage1": {CPU: ["MatMul 'mm2'"]}}
    assert nodes == {"stage0": {QNN: 2}, "stage1": {CPU: 1}}


def test_two_stages_on_the_plugin_register_its_library_once(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, HTP, HTP)
    x = _RNG.standard_normal((1, 16)).astype(np.float32)
    with load(bundle, allow_code=["onnxruntime_qnn"]) as pipe:
        np.testing.assert_allclose(pipe({"x": x})["y"], _expected(x), rtol=1e-5, atol=1e-5)
        assert [list(n or {}) for n in pipe.placement().values()] == [[QNN], [QNN]]
    assert _session._REGISTERED["onnxruntime_qnn"] == QNN
    with pytest.raises(Exception, match="already registered|exists"):  # what registering it again would do: hence once per process
        import onnxruntime_qnn

        ort.register_execution_provider_library(QNN, onnxruntime_qnn.get_library_path())


def test_the_plugin_package_is_loaded_only_when_allowed(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, HTP, {"target": "cpu"})
    with pytest.raises(BundleError, match=r"^the pipeline runs Python this host has not allowed: execution provider library of package 'onnxruntime_qnn' "
                                          r"\(stage 'stage0'\); nothing is allowed by default"):
        load(bundle)
    with pytest.raises(BundleError, match="not allowed: execution provider library of package 'onnxruntime_qnn'"):
        load(bundle, allow_code=["onnxruntime_extensions"])


def test_no_matching_device_names_the_devices_there_are(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path / "build", HTP, {"target": "cpu"})
    spec_text = (bundle / "pipeline.json").read_text()
    assert '"ep_package": "onnxruntime_qnn"' in spec_text and '"ep_device": "cpu"' in spec_text
    plan = split(_mlp(), ["r"])
    plan.config.stages[0].configure(**{**HTP, "ep_device": "npu"})
    message = (r"stage 'stage0': no device of QNNExecutionProvider of type npu here \(package 'onnxruntime_qnn', registered as QNNExecutionProvider\); "
               r"get_ep_devices\(\) lists: CPUExecutionProvider \(cpu, .*QNNExecutionProvider \(cpu, ")
    with pytest.raises(Exception, match=message):
        build(plan.config, tmp_path / "npu")


def test_a_plugin_package_this_host_lacks_builds_cross_target_and_fails_at_load_naming_it(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, {**HTP, "ep_package": "onnxruntime_nosuch_ep"}, {"target": "cpu"})
    with pytest.raises(BundleError, match=r"^stage 'stage0' needs the execution provider library of package 'onnxruntime_nosuch_ep', which is not installed "
                                          r"on this host; install it \(pip install onnxruntime-nosuch-ep\)"):
        load(bundle, allow_code=["onnxruntime_nosuch_ep"])
    with load(bundle, target="cpu", allow_code=["onnxruntime_nosuch_ep"]) as pipe:  # every stage on the CPU: the package is not needed
        x = _RNG.standard_normal((1, 16)).astype(np.float32)
        np.testing.assert_allclose(pipe({"x": x})["y"], _expected(x), rtol=1e-5, atol=1e-5)


def test_plugin_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"ep_package must be a Python package name .*never a path; got '/usr/lib/libqnn.so'"):
        StageSettings(target="qnn", ep_package="/usr/lib/libqnn.so")
    with pytest.raises(ConfigError, match="ep_device must be one of cpu, gpu, npu, with ep_package set; got 'npu' without ep_package"):
        StageSettings(target="cpu", ep_device="npu")
    with pytest.raises(ConfigError, match="ep_device must be one of cpu, gpu, npu"):
        StageSettings(target="qnn", ep_package="onnxruntime_qnn", ep_device="tpu")
    assert StageSettings(target="MyVendorEP", ep_package="myvendor_ep").provider == "MyVendorEP"  # only the library knows its name


def test_cli_builds_a_plugin_stage_and_runs_it_when_allowed(tmp_path: Path) -> None:
    split(_mlp(), ["r"]).save(tmp_path / "split")
    runner = CliRunner()
    stage = "0:target=qnn,ep_package=onnxruntime_qnn,ep_device=cpu,ep.backend_type=htp"
    result = runner.invoke(cli, ["build", str(tmp_path / "split"), "-o", str(tmp_path / "built"), "--stage", stage])
    assert result.exit_code == 0, result.output
    assert runner.invoke(cli, ["export", str(tmp_path / "built"), "-o", str(tmp_path / "bundle")]).exit_code == 0
    result = runner.invoke(cli, ["inspect", str(tmp_path / "bundle"), "--host"])
    assert result.exit_code == 1
    assert "error: the pipeline runs Python this host has not allowed: execution provider library of package 'onnxruntime_qnn'" in result.output
    result = runner.invoke(cli, ["inspect", str(tmp_path / "bundle"), "--host", "--allow-code", "onnxruntime_qnn"])
    assert result.exit_code == 0 and "  stage0: QNNExecutionProvider 2" in result.output, result.output
    assert "options backend_type=htp" in result.output
