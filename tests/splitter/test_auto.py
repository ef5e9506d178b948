"""Automatic splitting: the cost model, the named policies, and auto splits of real models that
must still equal the whole model."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from onnxpipe import SplitError
from onnxpipe.runtime import StageSettings
from onnxpipe.splitter import MeasuredPolicy, ParamsPolicy, UniformPolicy, make_policy, profile_model, split, verify
from onnxpipe.splitter._graph import GraphIndex
from tests import models


def _sessions_made(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every onnxruntime session made from now on (a profile that is measured makes two)."""
    made: list[object] = []
    real = ort.InferenceSession

    def counting(*args: object, **kwargs: object) -> ort.InferenceSession:
        made.append(args[0] if args else kwargs.get("path_or_bytes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", counting)
    return made


def test_profile_is_measured_cached_and_covers_the_compute_nodes(squeezenet: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _sessions_made(monkeypatch)
    profile = profile_model(squeezenet, runs=3)
    assert len(made) == 2  # measured: a plain session timed, a profiling one attributed
    assert profile.source == "measured" and profile.runs >= 3
    assert list(squeezenet.parent.glob("squeezenet.onnx.*.profile.json")), "the profile is cached next to the model"
    index = GraphIndex(onnx.load(squeezenet))
    compute = set(index.compute_nodes())
    assert set(profile.node_seconds) <= compute
    # Kernel times are scaled to the measured run time; every Conv chain is charged somewhere.
    assert sum(profile.node_seconds.values()) == pytest.approx(profile.total_seconds, rel=1e-6)
    convs = [i for i in compute if index.nodes[i].op_type == "Conv"]
    assert sum(profile.node_seconds.get(i, 0.0) for i in convs) > 0.5 * profile.total_seconds
    again = profile_model(squeezenet, runs=3)
    assert again == profile and len(made) == 2  # read from the cache: nothing run again


def test_absent_provider_falls_back_to_analytic_costs(squeezenet: Path, tmp_path: Path) -> None:
    profile = profile_model(squeezenet, StageSettings(target="cuda"), cache_dir=tmp_path)
    assert profile.source == "analytic" and profile.runs == 0
    assert all(v >= 0 for v in profile.node_seconds.values()) and profile.total_seconds > 0


@pytest.mark.parametrize("name", ["squeezenet", "inception_v1", "resnet50"])
def test_measured_auto_splits_equal_the_whole_model(name: str, tmp_path: Path) -> None:
    path = Path(shutil.copy(models.light_model_path(name), tmp_path / f"{name}.onnx"))
    plan = split(path, policy=MeasuredPolicy(stages=3, runs=2))
    assert len(plan.stages) == 3 and plan.auto is not None and plan.auto.policy == "measured"
    assert all(s.predicted_seconds is not None and s.predicted_seconds > 0 for s in plan.stages)
    report = verify(plan, path, samples=2)
    assert report.ok, [r for r in report.rows if not r.ok]


def test_uniform_policy_balances_node_counts() -> None:
    plan = split(models.light_model_path("resnet50"), policy=UniformPolicy(stages=4))
    counts = [s.nodes for s in plan.stages]
    assert max(counts) - min(counts) <= 1, counts
    assert plan.auto is not None and plan.auto.predicted_seconds is None


def test_params_policy_balances_weights_better_than_uniform() -> None:
    path = models.light_model_path("vgg19")
    params = split(path, policy=ParamsPolicy(stages=2))
    uniform = split(path, policy=UniformPolicy(stages=2))
    assert max(s.weights_bytes for s in params.stages) <= max(s.weights_bytes for s in uniform.stages)


def test_best_k_and_constraints(squeezenet: Path) -> None:
    profile = profile_model(squeezenet, runs=2)
    plan = split(squeezenet, policy=MeasuredPolicy(max_stages=3, profile=profile))
    assert 1 <= len(plan.stages) <= 3
    index = GraphIndex(onnx.load(squeezenet))
    first, last = index.nodes[index.compute_nodes()[0]], index.nodes[index.compute_nodes()[-1]]
    with pytest.raises(SplitError, match="pinned"):
        split(squeezenet, policy=MeasuredPolicy(stages=2, profile=profile, pinned={last.name or last.output[0]: 0}))
    pinned = split(squeezenet, policy=MeasuredPolicy(stages=2, profile=profile, pinned={first.name or first.output[0]: 0}))
    assert len(pinned.stages) == 2
    cap = 2_500_000  # the heaviest node (the last Conv) reads 2.0 MiB
    capped = split(squeezenet, policy=MeasuredPolicy(stages=3, profile=profile, max_stage_weights=cap))
    assert max(s.weights_bytes for s in capped.stages) <= cap
    with pytest.raises(SplitError, match="no partition into 2 stages keeps every stage within 10 B of weights; the heaviest single node"):
        split(squeezenet, policy=MeasuredPolicy(stages=2, profile=profile, max_stage_weights=10))


def test_policy_refusals() -> None:
    model = models.chain()
    with pytest.raises(SplitError, match="give one of cuts, assignment or policy, not cuts and policy"):
        split(model, ["a"], policy=UniformPolicy(stages=2))
    with pytest.raises(SplitError, match="give stages=N .* or max_stages=K"):
        split(model, policy=UniformPolicy())
    with pytest.raises(SplitError, match="unknown split policy 'balanced'; valid: measured, uniform, params"):
        make_policy("balanced", stages=2)
    profile = profile_model(model, runs=1, cache=False)
    with pytest.raises(SplitError, match="pinned node 'nope' is unknown"):
        split(model, policy=MeasuredPolicy(stages=2, pinned={"nope": 0}, profile=profile))


@pytest.mark.parametrize("name", models.LIGHT_MODELS)
def test_auto_splits_of_every_light_model_equal_the_whole_model(name: str) -> None:
    """Every light model, split automatically into 3 stages (by node count: no profiling needed,
    the split machinery is the same for every policy), equals the whole model."""
    path = models.light_model_path(name)
    plan = split(path, policy=UniformPolicy(stages=3))
    assert len(plan.stages) == 3
    report = verify(plan, path)
    assert report.ok, [r for r in report.rows if not r.ok]


def test_a_model_that_cannot_run_at_size_1_is_one_split_error_naming_the_dims(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fpn.onnx"
    onnx.save(models.fpn_net(), str(path))
    message = (r"^profiling cannot run fpn: onnxruntime failed on random inputs of shapes 'x' \[1, 3, 1, 1\]: .*Concat.*\. Symbolic dims not given "
               r"were sized 1 \(H, W, N\), which this model may not take .*; give them: --dim H=SIZE --dim W=SIZE --dim N=SIZE \(in Python: dims=")
    with pytest.raises(SplitError, match=message):
        split(path, policy=MeasuredPolicy(stages=2))
    assert "[E:onnxruntime" not in capfd.readouterr().err
    plan = split(path, policy=MeasuredPolicy(stages=2, dims={"H": 32, "W": 32}))
    assert len(plan.stages) == 2 and verify(plan, path, dims={"H": 32, "W": 32}).ok


def test_split_auto_cli_says_which_dims_to_give_in_one_line(tmp_path: Path) -> None:
    from tests.cli.helpers import assert_user_error, ok, run

    path = tmp_path / "fpn.onnx"
    onnx.save(models.fpn_net(), str(path))
    assert_user_error(run("split", path, "-o", tmp_path / "a", "--auto", "--stages", "2"), "profiling cannot run fpn", "--dim H=SIZE --dim W=SIZE")
    ok("split", path, "-o", tmp_path / "b", "--auto", "--stages", "2", "--dim", "H=32", "--dim", "W=32")


def test_the_profile_cache_goes_where_the_policy_or_the_environment_says(squeezenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = tmp_path / "chosen"
    split(squeezenet, policy=MeasuredPolicy(stages=2, runs=2, cache_dir=str(chosen)))
    assert len(list(chosen.glob("*.profile.json"))) == 1
    env = tmp_path / "env"
    monkeypatch.setenv("ONNXPIPE_CACHE_DIR", str(env))
    profile_model(squeezenet, StageSettings(intra_op_threads=1), runs=3)
    assert len(list(env.glob("*.profile.json"))) == 1


def test_a_sub_millisecond_cut_is_timed_against_its_neighbours(tmp_path: Path) -> None:
    path = tmp_path / "chain.onnx"
    onnx.save(models.chain(), str(path))
    plain = split(path, policy=MeasuredPolicy(stages=2, runs=2))
    assert not any("timed together" in n for n in plain.notes)
    plan = split(path, policy=MeasuredPolicy(stages=2, runs=2, remeasure=True))
    note = next(n for n in plan.notes if "cuts near the predicted one timed together (3 interleaved rounds, stages under 1 ms)" in n)
    assert note.startswith(("4 cuts", "5 cuts", "3 cuts")) and ("kept the predicted cut" in note or "faster in every round" in note), note
    assert len(plan.stages) == 2 and verify(plan, path).ok


def test_moving_a_cut_keeps_every_stage_and_refuses_to_empty_one() -> None:
    from onnxpipe.splitter._remeasure import _moved

    order = [10, 11, 12, 13]
    assignment = {10: 0, 11: 0, 12: 1, 13: 1}
    assert _moved(assignment, order, 0, -1) == {10: 0, 11: 1, 12: 1, 13: 1}
    assert _moved(assignment, order, 0, 1) == {10: 0, 11: 0, 12: 0, 13: 1}
    assert _moved(assignment, order, 0, 2) is None and _moved(assignment, order, 0, -2) is None  # a stage would be empty


def test_split_auto_cli_remeasures_a_tiny_model(tmp_path: Path) -> None:
    from tests.cli.helpers import ok

    path = tmp_path / "chain.onnx"
    onnx.save(models.chain(), str(path))
    out = ok("split", path, "-o", tmp_path / "out", "--auto", "--stages", "2").output
    assert "timed together" in out, out
