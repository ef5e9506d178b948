"""build() and export(): a hand-wired 3-stage pipeline and split light models, built, exported to a
folder and to an archive, moved, loaded with the runtime and run against the whole model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxpipe import BuildError, BundleError, ConfigError, InputError
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import load, read_bundle
from onnxpipe.splitter import split
from tests import models


def _hand_config() -> PipelineConfig:
    """The hand-wired pipeline of tests/models.py with tail's 'scale' in param group 'tail_scale'."""
    return models.hand_wired(param_group="tail_scale")


def _whole(x: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    session = ort.InferenceSession(models.stages_whole().SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x} if scale is None else {"x": x, "scale": scale}
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("bundle_name", ["bundle", "bundle.onnxpipe"])
def test_hand_wired_pipeline_built_exported_moved_loaded_equals_whole_model(tmp_path: Path, bundle_name: str) -> None:
    config = _hand_config()
    result = build(config, tmp_path / "built")
    assert [r.stage for r in result.report] == ["head", "twin", "tail"]
    assert all(r.available and "offline for CPUExecutionProvider" in r.optimization for r in result.report)
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    bundle = export(result.path, tmp_path / "out" / bundle_name, reference_inputs=[{"x": x}])
    moved = tmp_path / "elsewhere" / bundle_name
    moved.parent.mkdir()
    shutil.move(str(bundle), moved)
    shutil.rmtree(tmp_path / "built")  # the bundle needs nothing from the build folder
    with load(moved) as pipe:
        np.testing.assert_allclose(pipe({"x": x})["y"], _whole(x), rtol=1e-5, atol=1e-6)
        assert all(row.ok for row in pipe.check())
        # Swapping the parameter group changes the output as the whole model says it should.
        scale = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
        pipe.set_params("tail_scale", {"scale": scale})
        np.testing.assert_allclose(pipe({"x": x})["y"], _whole(x, scale), rtol=1e-5, atol=1e-6)
        assert not np.allclose(_whole(x, scale), _whole(x))


def test_set_params_refuses_unknown_groups_names_and_shapes(tmp_path: Path) -> None:
    bundle = export(build(_hand_config(), tmp_path / "b").path, tmp_path / "bundle")
    with load(bundle) as pipe:
        with pytest.raises(InputError, match="unknown param group 'tail'; closest: 'tail_scale'"):
            pipe.set_params("tail", {"scale": np.ones(4, np.float32)})
        with pytest.raises(InputError, match="param group 'tail_scale' has no parameter 'scal'; closest: 'scale'"):
            pipe.set_params("tail_scale", {"scal": np.ones(4, np.float32)})
        with pytest.raises(InputError, match=r"parameter 'scale' has shape \[3\]; expected \[4\]"):
            pipe.set_params("tail_scale", {"scale": np.ones(3, np.float32)})
        with pytest.raises(InputError, match="parameter 'scale' has dtype float64; expected float32"):
            pipe.set_params("tail_scale", {"scale": np.ones(4)})
        x = np.ones((2, 4), np.float32)
        np.testing.assert_allclose(pipe({"x": x})["y"], _whole(x), rtol=1e-6)  # still usable, unchanged


def test_inputs_are_checked_at_the_door(tmp_path: Path) -> None:
    with load(export(build(_hand_config(), tmp_path / "b").path, tmp_path / "bundle")) as pipe:
        with pytest.raises(InputError, match="unknown input 'z'; valid: 'x'"):
            pipe({"z": np.ones((1, 4), np.float32)})
        with pytest.raises(InputError, match="missing input"):
            pipe({})
        with pytest.raises(InputError, match="input 'x' has dtype float64; expected float32"):
            pipe({"x": np.ones((1, 4))})
        with pytest.raises(InputError, match=r"input 'x' has shape \[1, 5\]; expected \[N, 4\] \(dim 1 must be 4\)"):
            pipe({"x": np.ones((1, 5), np.float32)})
        with pytest.raises(InputError, match="expected rank 2"):
            pipe({"x": np.ones((4,), np.float32)})


def test_cross_target_build_keeps_a_portable_module_and_says_so(tmp_path: Path) -> None:
    config = _hand_config()
    config.stage("twin").configure(target="cuda:1", provider_options={"cudnn_conv_algo_search": "HEURISTIC"})
    result = build(config, tmp_path / "built")
    twin = next(r for r in result.report if r.stage == "twin")
    assert not twin.available and "CUDAExecutionProvider optimizes it at load, cross-target build" in twin.optimization
    assert "not on this host" in str(result)
    spec = result.spec.stage("twin")
    assert spec.build["optimize_at_load"] is True and spec.settings.device_id == 1
    bundle = export(result.path, tmp_path / "bundle.onnxpipe")
    assert read_bundle(bundle).manifest.providers == ["CPUExecutionProvider", "CUDAExecutionProvider"]
    # The available list is the host's, in its order: a plugin EP registered earlier in this worker (test_plugin_ep) may follow CPU.
    message = (r"^stage 'twin' targets CUDAExecutionProvider, which this host's onnxruntime \(1\.\d+\.\d+\) does not have; "
               r"available: [^;]*\bCPUExecutionProvider\b[^;]*; "
               r"install onnxruntime-gpu \(it replaces onnxruntime; needs CUDA and cuDNN\) to get it, or use target 'cpu'")
    with pytest.raises(BundleError, match=message):
        load(bundle)
    x = np.ones((2, 4), np.float32)
    with load(bundle, target="cpu") as pipe:
        np.testing.assert_allclose(pipe({"x": x})["y"], _whole(x), rtol=1e-6)


def test_settings_reach_the_spec_and_bad_settings_are_refused(tmp_path: Path) -> None:
    config = _hand_config()
    config.stage("head").configure(intra_op_threads=2, affinity=[0], spinning=False, optimization="extended",
                                   session_config={"session.use_device_allocator_for_initializers": "1"})
    with pytest.raises(ConfigError, match="unknown execution provider 'gpu'"):
        config.stage("tail").configure(target="gpu")
    with pytest.raises(ConfigError, match="unknown stage setting 'threads'; closest: 'intra_op_threads'"):
        config.stage("tail").configure(threads=2)
    with pytest.raises(ConfigError, match="affinity must be a non-empty list"):
        config.stage("tail").configure(affinity=[])
    result = build(config, tmp_path / "built")
    data = json.loads((result.path / "pipeline.json").read_text())
    head = next(s for s in data["stages"] if s["name"] == "head")
    assert head["settings"]["intra_op_threads"] == 2 and head["settings"]["affinity"] == [0]
    assert head["build"]["optimization"] == "extended"
    assert "head" in str(config) and "cores 0" in str(config)


def test_ort_format_modules(tmp_path: Path) -> None:
    result = build(_hand_config(), tmp_path / "built", ort_format=True)
    assert all(s.module.endswith(".ort") for s in result.spec.stages)
    x = np.ones((2, 4), np.float32)
    with load(export(result.path, tmp_path / "bundle")) as pipe:
        np.testing.assert_allclose(pipe({"x": x})["y"], _whole(x), rtol=1e-6)


def test_build_and_export_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(BuildError, match="exists and is not empty"):
        build(_hand_config(), tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(BuildError, match="is not a build folder"):
        export(tmp_path / "full", tmp_path / "bundle")
    unbuilt = tmp_path / "unbuilt"
    _hand_config().save(unbuilt)
    with pytest.raises(BuildError, match="was not built; run build first"):
        export(unbuilt, tmp_path / "bundle")
    incomplete = PipelineConfig()
    incomplete.add_stage(models.stage_twin(), "twin")
    with pytest.raises(ConfigError, match="input 'p' of stage 'twin' is not fed"):
        build(incomplete, tmp_path / "never")
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("name", ["resnet50", "squeezenet", "inception_v1"])
def test_split_build_export_load_equals_whole_light_model(tmp_path: Path, name: str) -> None:
    path = models.light_model_path(name)
    from onnxpipe.splitter._graph import GraphIndex

    index = GraphIndex(onnx.load(path))
    compute = index.compute_nodes()
    cuts = [index.nodes[compute[len(compute) // 3]].output[0], index.nodes[compute[2 * len(compute) // 3]].output[0]]
    plan = split(path, cuts)
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / f"{name}.onnxpipe")
    whole = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name_in = whole.get_inputs()[0].name
    rng = np.random.default_rng(0)
    with load(bundle) as pipe:
        for _ in range(2):
            x = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
            got = pipe({name_in: x})
            want = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, {name_in: x}), strict=True))
            for out, value in want.items():
                np.testing.assert_allclose(got[out], value, rtol=1e-4, atol=1e-5)


def test_verify_compares_a_bundles_boundaries_with_the_whole_model(tmp_path: Path) -> None:
    from onnxpipe.splitter import verify

    path = models.light_model_path("squeezenet")
    plan = split(path, [("Concat", 2), ("Concat", 5)])
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "sq.onnxpipe")
    report = verify(bundle, path, samples=2)
    assert report.ok and {r.kind for r in report.rows} == {"output", "boundary"}
