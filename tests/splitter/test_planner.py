"""The planner: candidates predicted from profiles, the best measured for real, honest baselines."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from onnxpipe import SplitError
from onnxpipe.builder import PipelineConfig
from onnxpipe.splitter import plan_pipeline, verify
from tests import models


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plan")
    return Path(shutil.copy(models.light_model_path("squeezenet"), folder / "squeezenet.onnx"))


def test_plan_on_two_cores_measures_pipelines_and_baselines(squeezenet: Path, tmp_path: Path) -> None:
    steps: list[str] = []
    result = plan_pipeline(squeezenet, cores=2, measure=1, requests=20, runs=2, progress=lambda step, done, total: steps.append(step))
    kinds = {c.kind for c in result.candidates}
    assert kinds == {"session", "replicas", "pipeline"}
    measured = [c for c in result.candidates if c.measured is not None]
    assert {c.kind for c in measured} == {"session", "replicas", "pipeline"}
    # The chosen plan is the best measured one: never worse than a measured baseline.
    assert result.chosen.measured == max(c.measured or 0 for c in measured)
    assert all(result.chosen.measured >= v for v in result.baselines().values())
    assert all(c.cores <= 2 for c in result.candidates)
    assert {"profiling", "measuring"} <= set(steps)
    # The plan carries its settings into the saved folder, and stays equivalent to the model.
    folder = result.plan.save(tmp_path / "planned")
    config = PipelineConfig.load(folder)
    for stage, threads, replicas in zip(config.stages, result.chosen.threads, result.chosen.replicas, strict=True):
        assert (stage.settings.intra_op_threads, stage.settings.replicas) == (threads, replicas)
    assert verify(folder, squeezenet).ok
    assert result.chosen.label in str(result)
    # ... and builds into a bundle that runs.
    import numpy as np

    from onnxpipe.builder import build, export
    from onnxpipe.runtime import load

    bundle = export(build(config, tmp_path / "built").path, tmp_path / "plan.onnxpipe")
    with load(bundle) as pipe:
        out = pipe({"data_0": np.zeros((1, 3, 224, 224), np.float32)})
    assert out["softmaxout_1"].shape == (1, 1000, 1, 1)


def test_one_core_can_only_be_one_session(squeezenet: Path) -> None:
    result = plan_pipeline(squeezenet, cores=1, requests=10, runs=2)
    assert [c.label for c in result.candidates] == ["1 session x 1t"]
    assert len(result.plan.stages) == 1 and result.chosen.kind == "session"


def test_core_budget_is_checked(squeezenet: Path) -> None:
    with pytest.raises(SplitError, match=r"core budget 4096 is outside 1\.\.\d+ \(the cores this process may use"):
        plan_pipeline(squeezenet, cores=4096)
