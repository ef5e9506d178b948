"""Where each stage's nodes run, and stages whose provider cannot take them, with plain onnxruntime.

The CPU provider and the Azure provider (which plain onnxruntime ships and which takes no node of
an ordinary model, so every node falls back) are the real providers here; the OpenVINO tests
(tests/targets, `make test-openvino`) do the same with a provider that takes nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from onnxpipe import BuildError, BundleError, ConfigError
from onnxpipe.builder import build, export
from onnxpipe.cli import main as cli
from onnxpipe.runtime import StageSettings, host_placement, load, read_bundle
from onnxpipe.splitter import split
from tests import models

CPU, AZURE = "CPUExecutionProvider", "AzureExecutionProvider"
needs_azure = pytest.mark.skipif(AZURE not in ort.get_available_providers(), reason=f"this onnxruntime ({ort.__version__}) has no {AZURE}")
records = pytest.mark.skipif(not hasattr(ort.InferenceSession, "get_provider_graph_assignment_info"),
                             reason=f"onnxruntime {ort.__version__} does not record which provider took each node")


def _squeezenet(tmp_path: Path, *targets: str, **settings: object) -> Path:
    plan = split(onnx.load(str(models.light_model_path("squeezenet"))), ["r24"])
    for stage, target in zip(plan.config.stages, targets, strict=True):
        stage.configure(target=target, **settings)
    return export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")


@records
@pytest.mark.parametrize("engine", ["thread", pytest.param("ray", marks=pytest.mark.xdist_group("ray"))])  # the one cluster's worker
def test_every_node_of_a_cpu_pipeline_is_placed_on_the_cpu_and_stats_count_them(tmp_path: Path, engine: str, request: pytest.FixtureRequest) -> None:
    if engine == "ray":
        request.getfixturevalue("ray_cluster")
    bundle = _squeezenet(tmp_path, "cpu", "cpu")
    with load(bundle, engine=engine) as pipe:
        pipe({"data_0": np.ones((1, 3, 224, 224), np.float32)})
        where = pipe.placement()
        stats = pipe.stats()
    assert list(where) == ["stage0", "stage1"]
    for stage in stats.stages:
        nodes = where[stage.stage]
        assert nodes is not None and list(nodes) == [CPU]
        assert stage.nodes == {CPU: len(nodes[CPU])} and len(nodes[CPU]) > 5
    # The names are the optimized graph's: stage 0 was saved at the extended level, its Conv+Relu fused.
    assert any(n.startswith("FusedConv ") for n in where["stage0"][CPU])  # type: ignore[index]
    assert host_placement(read_bundle(bundle)) == {k: {ep: tuple(n) for ep, n in v.items()} for k, v in where.items() if v is not None}


@records
def test_code_stages_have_no_placement(tmp_path: Path) -> None:
    from tests import code_stages

    with load(models.bundle_of(code_stages.config(), tmp_path), allow_code=["tests.code_stages:*"]) as pipe:
        where = pipe.placement()
        pipe({"x": np.ones((2, 4), np.float32)})
        stats = {s.stage: s.nodes for s in pipe.stats().stages}
    assert where["combine"] is None and where["head"] is not None and list(where["head"]) == [CPU]
    assert stats["combine"] == {}


@records
@needs_azure
def test_a_provider_that_takes_no_node_falls_back_whole_or_with_fallback_off_fails_naming_the_nodes(tmp_path: Path) -> None:
    bundle = _squeezenet(tmp_path / "on", "cpu", "azure")
    with load(bundle) as pipe:
        assert pipe.get_providers() == [CPU, AZURE]
        tail = pipe.placement()["stage1"]
    assert tail is not None and list(tail) == [CPU]  # Azure took nothing: every node fell back
    # fallback=off: the build host has the provider, so the build proves it and refuses.
    message = r"^stage 'stage1': AzureExecutionProvider cannot run every node and fallback is off: it cannot take (\d+) of the \1 nodes: Conv '[^']+', "
    with pytest.raises(BuildError, match=message + r".* and \d+ more; set fallback=on to run them on the CPU, or cut them into a stage of their own"):
        _squeezenet(tmp_path / "off", "cpu", "azure", fallback=False)


def test_fallback_off_on_a_cpu_stage_builds_and_loads(tmp_path: Path) -> None:
    # The CPU provider has nothing to fall back from: onnxruntime refuses the switch beside it
    # ("Conflicting session configuration"), so it is not given.
    bundle = _squeezenet(tmp_path, "cpu", "cpu", fallback=False)
    with load(bundle) as pipe:
        out = pipe({"data_0": np.ones((1, 3, 224, 224), np.float32)})
    assert out["softmaxout_1"].shape == (1, 1000, 1, 1)
    with pytest.raises(RuntimeError, match="does not have configuration with key"):
        StageSettings(fallback=False).session_options().get_session_config_entry("session.disable_cpu_ep_fallback")


def test_a_cross_target_build_with_fallback_off_keeps_a_portable_module_of_standard_ops(tmp_path: Path) -> None:
    # Before: the portable save inherited fallback=off and onnxruntime refused it on the CPU alone.
    bundle = _squeezenet(tmp_path, "openvino", "cpu", fallback=False)
    spec = read_bundle(bundle).spec
    assert spec.stages[0].build["optimize_at_load"] is True and spec.stages[0].build["optimization"] == "basic"
    portable = onnx.load(str(bundle / spec.stages[0].module))
    offline = onnx.load(str(bundle / spec.stages[1].module))
    # basic: only ai.onnx ops, which any provider may take; extended (the CPU stage's) fuses
    # Conv+Relu into com.microsoft's FusedConv, which only the CPU and CUDA providers run.
    assert {n.domain for n in portable.graph.node} == {""}
    assert "com.microsoft" in {n.domain for n in offline.graph.node}
    missing = r"^stage 'stage0' targets OpenVINOExecutionProvider, .* install onnxruntime-openvino \(it replaces onnxruntime\) to get it"
    with pytest.raises(BundleError, match=missing):
        load(bundle)
    with load(bundle, target="cpu") as pipe:
        assert pipe.get_providers() == [CPU]


def test_the_stage_threads_size_a_providers_own_pool_unless_its_options_do() -> None:
    ov = "OpenVINOExecutionProvider"
    assert StageSettings(target="openvino", intra_op_threads=2).providers() == [(ov, {"num_of_threads": "2"}), (CPU, {})]
    assert StageSettings(target="openvino", intra_op_threads=2, provider_options={"num_of_threads": "4"}).providers()[0] == (ov, {"num_of_threads": "4"})
    assert StageSettings(target="openvino", intra_op_threads=0).providers()[0] == (ov, {})  # 0: the provider's own default
    assert StageSettings(target="openvino", fallback=False).providers() == [(ov, {"num_of_threads": "1"})]
    assert StageSettings(target="cpu", intra_op_threads=2).providers() == [(CPU, {})]


@records
def test_inspect_host_lists_where_the_nodes_run(tmp_path: Path) -> None:
    bundle = _squeezenet(tmp_path, "cpu", "cpu")
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", str(bundle), "--host"])
    assert result.exit_code == 0, result.output
    assert f"on this host (onnxruntime {ort.__version__}, providers " in result.output
    assert "  stage0: CPUExecutionProvider " in result.output and "  stage1: CPUExecutionProvider " in result.output
    data = json.loads(runner.invoke(cli, ["inspect", str(bundle), "--host", "--json"]).output)
    assert list(data["placement"]["stage1"]) == [CPU]
    assert "placement" not in json.loads(runner.invoke(cli, ["inspect", str(bundle), "--json"]).output)
    for args, message in ((["--target", "cpu"], "--target: only with --host"), (["--allow-code", "x.*"], "--allow-code: only with --host")):
        result = runner.invoke(cli, ["inspect", str(bundle), *args])
        assert result.exit_code == 2 and message in result.output, result.output
    result = runner.invoke(cli, ["inspect", str(models.light_model_path("squeezenet")), "--host"])
    assert result.exit_code == 2 and "--host: only used for a bundle" in result.output


@records
def test_inspect_host_of_a_bundle_for_a_missing_provider_is_one_line(tmp_path: Path) -> None:
    bundle = _squeezenet(tmp_path, "openvino", "cpu")
    result = CliRunner().invoke(cli, ["inspect", str(bundle), "--host"])
    assert result.exit_code == 1
    assert "error: stage 'stage0' targets OpenVINOExecutionProvider, which this host's onnxruntime" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["inspect", str(bundle), "--host", "--target", "cpu"])
    assert result.exit_code == 0 and "  stage0: CPUExecutionProvider " in result.output, result.output


def test_a_plugin_package_missing_on_the_build_host_makes_a_cross_target_build(tmp_path: Path) -> None:
    # A dotted package whose parent is missing too: find_spec raises there, which must read as "not installed".
    plan = split(onnx.load(str(models.light_model_path("squeezenet"))), ["r24"])
    plan.config.stages[0].configure(target="qnn", ep_package="onnxpipe_nosuch.ep")
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")
    spec = read_bundle(bundle).spec
    assert spec.stages[0].build["optimize_at_load"] is True and spec.stages[0].settings.ep_package == "onnxpipe_nosuch.ep"
    with pytest.raises(ConfigError, match=r"ep_package 'x' names a plugin provider's package, but target is onnxruntime's own CPU provider"):
        StageSettings(target="cpu", ep_package="x")
    with pytest.raises(BundleError, match=r"not allowed: execution provider library of package 'onnxpipe_nosuch\.ep' \(stage 'stage0'\)"):
        load(bundle)
    if hasattr(ort, "register_execution_provider_library"):
        with pytest.raises(BundleError, match=r"^stage 'stage0' needs the execution provider library of package 'onnxpipe_nosuch\.ep', which is not installed"):
            load(bundle, allow_code=["onnxpipe_nosuch.*"])
