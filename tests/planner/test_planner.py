"""The planner: candidates predicted from profiles, the finalists measured in interleaved rounds,
the simpler plan unless a pipeline wins every round, and no symbolic dim planned at 1 unsaid."""

from __future__ import annotations

import statistics
from pathlib import Path

import onnx
import pytest

from onnxpipe import InputError, SplitError
from onnxpipe.builder import PipelineConfig
from onnxpipe.planner import PlanCandidate, PlanChoice, plan_pipeline
from onnxpipe.planner._checks import planning_dims
from onnxpipe.planner._rules import RULE, choose_plan
from onnxpipe.runtime import TensorSpec, resolve_provider
from onnxpipe.splitter import verify
from tests import models


def test_plan_on_two_cores_measures_pipelines_and_baselines(squeezenet: Path, tmp_path: Path) -> None:
    steps: list[tuple[str, int, int]] = []
    result = plan_pipeline(squeezenet, cores=2, measure=1, rounds=2, requests=10, runs=2, progress=lambda *step: steps.append(step))
    kinds = {c.kind for c in result.candidates}
    assert kinds == {"session", "replicas", "pipeline"}
    measured = [c for c in result.candidates if c.measured is not None]
    assert {c.kind for c in measured} == {"session", "replicas", "pipeline"}
    # Every finalist ran in each of the 2 rounds; its number is the median of its rounds.
    assert all(len(c.rounds) == 2 and c.measured == statistics.median(c.rounds) for c in measured)
    assert ("measuring", 2 * len(measured), 2 * len(measured)) in steps and {"profiling", "loading"} <= {s for s, _, _ in steps}
    # The choice follows the rule: the best simple plan, unless a pipeline won every round against it.
    session, replicas = (next(c for c in measured if c.kind == kind) for kind in ("session", "replicas"))
    simple = replicas if all(r > s for r, s in zip(replicas.rounds, session.rounds, strict=True)) else session
    pipeline = next(c for c in measured if not c.simple)
    wins = all(p > s for p, s in zip(pipeline.rounds, simple.rounds, strict=True))
    assert result.chosen is (pipeline if wins else simple)
    assert result.choice.simple == simple.label and result.choice.contender == pipeline.label
    assert result.choice.verdict == ("pipeline" if wins else "tie" if any(p > s for p, s in zip(pipeline.rounds, simple.rounds, strict=True)) else "simple")
    assert result.choice.rounds == 2 and result.choice.requests == 10
    assert all(c.cores <= 2 for c in result.candidates)
    assert str(result.choice) in str(result)
    # Why, step by step: where the rule started, each richer kind against the plan held then, and the rule.
    assert isinstance(result.choice, PlanChoice)
    reasons = result.choice.reasons()
    assert reasons[0].startswith(f"start: {result.choice.first}, ") and reasons[-1] == RULE and len(reasons) == 4
    assert all(f"    {reason}" in str(result) for reason in reasons)
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
    result = plan_pipeline(squeezenet, cores=1, rounds=1, requests=5, runs=2)
    assert [c.label for c in result.candidates] == ["1 session x 1t"]
    assert len(result.plan.stages) == 1 and result.chosen.kind == "session"
    assert result.choice.verdict == "no pipeline"
    assert str(result.choice) == "1 session x 1t: no pipeline was measured (best simple plan over 1 round(s) of 5 requests)"


def test_measuring_needs_rounds_and_requests(squeezenet: Path) -> None:
    with pytest.raises(SplitError, match=r"rounds and requests must be at least 1, got rounds=0, requests=5"):
        plan_pipeline(squeezenet, cores=1, rounds=0, requests=5)


# -- the choice rule, on injected measurements ----------------------------------------------------------


def _measured(label: str, *rounds: float) -> PlanCandidate:
    kind = label.split()[0] if label.startswith("pipeline") else ("replicas" if "replicas" in label else "session")
    return PlanCandidate(label, kind, (1,), (1,), predicted=100.0, stage_predicted_ms=(1.0,), measured=statistics.median(rounds), rounds=rounds)


SESSION = _measured("1 session x 2t", 90, 70, 95, 92, 91)
REPLICAS = _measured("2 replicas x 1t", 100, 80, 100, 105, 100)


def test_a_pipeline_that_wins_every_round_is_chosen() -> None:
    # Round 2 was slow for everyone: paired ratios keep the comparison.
    pipeline = _measured("pipeline 2 x (1t, 1t)", 107, 88, 103, 112, 110)
    chosen, choice = choose_plan([SESSION, REPLICAS, pipeline], requests=40)
    assert chosen is pipeline and choice.verdict == "pipeline"
    assert str(choice) == "pipeline 2 x (1t, 1t) wins by 1.07x 2 replicas x 1t (paired ratios 1.03-1.10 over 5 round(s) of 40 requests)"


def test_a_pipeline_faster_by_median_but_not_every_round_is_a_tie() -> None:
    # Median 115 vs 100: the one-shot planner would have taken it; it lost round 4.
    pipeline = _measured("pipeline 2 x (1t, 1t)", 115, 95, 120, 95, 116)
    chosen, choice = choose_plan([SESSION, REPLICAS, pipeline], requests=40)
    assert chosen is REPLICAS and choice.verdict == "tie"
    assert str(choice) == (
        "no clear winner: pipeline 2 x (1t, 1t) is 1.16x 2 replicas x 1t (paired ratios 0.90-1.20 over 5 round(s) of 40 requests), "
        "within the rounds' spread: kept the simpler plan"
    )


def test_a_pipeline_that_loses_every_round_says_so() -> None:
    pipeline = _measured("pipeline 2 x (1t, 1t)", 80, 64, 80, 84, 85)
    chosen, choice = choose_plan([pipeline, SESSION, REPLICAS], requests=40)
    assert chosen is REPLICAS and choice.verdict == "simple"
    assert str(choice) == "2 replicas x 1t wins: the best pipeline, pipeline 2 x (1t, 1t), is 0.80x it (paired ratios 0.80-0.85 over 5 round(s) of 40 requests)"


def test_replicas_replace_one_session_only_if_they_win_every_round() -> None:
    session = _measured("1 session x 1t", 100, 60, 100, 100, 100)
    replicas = _measured("2 replicas x 1t", 110, 55, 110, 110, 110)  # better median, lost round 2
    chosen, choice = choose_plan([replicas, session], requests=40)
    assert chosen is session and choice.simple == "1 session x 1t" and choice.verdict == "no pipeline"
    assert choose_plan([REPLICAS, SESSION], requests=40)[0] is REPLICAS


def test_the_best_simple_plan_is_the_best_median_and_only_every_round_winners_beat_it() -> None:
    session = _measured("1 session x 2t", 120, 100, 118, 119, 121)  # beats replicas by median
    steady = _measured("pipeline 2 x (1t, 1t)", 125, 105, 124, 125, 125)  # wins every round, by a little
    lucky = _measured("pipeline 3 x (1t, 1t, 1t)", 200, 90, 200, 200, 200)  # higher median, lost round 2
    chosen, choice = choose_plan([REPLICAS, session, lucky, steady], requests=40)
    assert choice.simple == "1 session x 2t"
    assert chosen is steady and choice.contender == steady.label and choice.verdict == "pipeline"
    # Unmeasured candidates take no part.
    unmeasured = PlanCandidate("pipeline 2 x (2t, 1t)", "pipeline", (2, 1), (1, 1), 999.0, (1.0, 1.0))
    assert choose_plan([REPLICAS, unmeasured], requests=40)[1].verdict == "no pipeline"


def test_why_one_session_was_kept_over_replicas_that_measured_twice_its_req_s() -> None:
    # Issue 37, tried on a loaded host: 2 replicas measured 1.5-2.5x one session, and nothing said why the session was kept.
    session = _measured("1 session x 2t", 100, 100, 100, 100, 100)
    replicas = _measured("2 replicas x 1t", 150, 95, 190, 220, 250)
    pipeline = _measured("pipeline 2 x (1t, 1t)", 80, 64, 80, 84, 85)
    chosen, choice = choose_plan([replicas, pipeline, session], requests=40)
    assert chosen is session and choice.verdict == "simple"
    assert choice.reasons() == [
        "start: 1 session x 2t, the only one-session plan measured (100.0 req/s)",
        "1 session x 2t kept over 2 replicas x 1t: 2 replicas x 1t measured 1.90x its req/s, paired ratios 0.95-2.50: faster in 4 of 5 rounds only",
        "1 session x 2t kept over pipeline 2 x (1t, 1t): pipeline 2 x (1t, 1t) measured 0.80x its req/s, paired ratios 0.64-0.85: faster in no round",
        "rule: one session, then replicas, then a pipeline: a more complex plan replaces the plan held only if faster in every round "
        "(its lowest paired ratio above 1.00x; of several such, the highest median ratio); the first kind's best is the highest median req/s",
    ]


def test_why_each_simpler_plan_lost_to_a_pipeline_and_which_of_the_pipelines() -> None:
    steady = _measured("pipeline 2 x (1t, 1t)", 107, 88, 103, 112, 110)
    slower = _measured("pipeline 3 x (1t, 1t, 1t)", 100, 80, 100, 100, 100)  # never faster than the replicas
    wide = _measured("1 session x 1t", 50, 40, 50, 50, 50)
    chosen, choice = choose_plan([SESSION, wide, REPLICAS, slower, steady], requests=40)
    assert chosen is steady
    assert choice.reasons()[:3] == [
        "start: 1 session x 2t, the highest median req/s of the 2 one-session plans (91.0 req/s)",
        "2 replicas x 1t replaced 1 session x 2t: 1.11x its req/s, paired ratios 1.05-1.14: faster in every round",
        "pipeline 2 x (1t, 1t) replaced 2 replicas x 1t: 1.07x its req/s, paired ratios 1.03-1.10: faster in every round; "
        "of the 2 of its kind measured, the highest median ratio of those faster in every round",
    ]
    assert [(c.rival, c.holder, c.won, c.among) for c in choice.contests] == [
        ("2 replicas x 1t", "1 session x 2t", True, 1), ("pipeline 2 x (1t, 1t)", "2 replicas x 1t", True, 2)]


def test_a_tie_says_which_plan_was_kept_and_that_the_rounds_overlap_one() -> None:
    lucky = _measured("pipeline 2 x (1t, 1t)", 115, 95, 120, 95, 116)
    other = _measured("pipeline 3 x (1t, 1t, 1t)", 90, 70, 90, 90, 90)
    chosen, choice = choose_plan([SESSION, REPLICAS, lucky, other], requests=40)
    assert chosen is REPLICAS and choice.verdict == "tie"
    assert choice.reasons()[2] == (
        "2 replicas x 1t kept over pipeline 2 x (1t, 1t): pipeline 2 x (1t, 1t) measured 1.16x its req/s, paired ratios 0.90-1.20: "
        "faster in 4 of 5 rounds only; of the 2 of its kind measured, the highest median ratio (none was faster in every round)")


# -- symbolic dims ----------------------------------------------------------------------------------------


def test_a_model_with_symbolic_dims_is_refused_naming_each(tmp_path: Path) -> None:
    path = tmp_path / "image.onnx"
    onnx.save(models.symbolic_image(), path)
    expected = (
        r"cannot plan 'image\.onnx' without the sizes of its symbolic input dims: .* Not given: input 'X' dim 2 \('H'\); "
        r"input 'X' dim 3 \('W'\); input 'Z' dim 1 \(unnamed\)\. Give them: --dim H=SIZE --dim W=SIZE --dim Z\.1=SIZE"
    )
    with pytest.raises(SplitError, match=expected):
        plan_pipeline(path, cores=1)
    # Giving some is not enough; the batch dim N is never in the list.
    with pytest.raises(SplitError, match=r"Not given: input 'Z' dim 1 \(unnamed\)\. Give them: --dim Z\.1=SIZE \(in Python"):
        plan_pipeline(path, cores=1, dims={"H": 32, "W": 128})


def test_dims_given_or_batch_like() -> None:
    image = TensorSpec("X", "float32", ("N", 1, "H", "W"))
    unnamed = TensorSpec("Z", "float32", (None, None))
    # Given by name, or an unnamed one by INPUT.AXIS: nothing to say.
    assert planning_dims([image, unnamed], {"N": 4, "H": 32, "W": 100, "Z.0": 4, "Z.1": 7}, "m.onnx") == []
    # A leading batch dim, named or not, is planned at 1 with a note.
    notes = planning_dims([image, unnamed], {"H": 32, "W": 100, "Z.1": 7}, "m.onnx")
    assert notes == [
        "input 'X' dim 0 ('N') not given: planned at batch size 1; give --dim N=SIZE (dims={'N': SIZE}) to plan for larger batches",
        "input 'Z' dim 0 (unnamed) not given: planned at batch size 1; give --dim Z.0=SIZE (dims={'Z.0': SIZE}) to plan for larger batches",
    ]
    # A leading dim whose name also sizes another axis is not batch-like; a rank-1 input has no batch.
    with pytest.raises(SplitError, match=r"Not given: input 'M' dim 0 \('T'\); input 'M' dim 1 \('T'\)\. Give them: --dim T=SIZE \("):
        planning_dims([TensorSpec("M", "float32", ("T", "T"))], {}, "m.onnx")
    with pytest.raises(SplitError, match=r"Not given: input 'L' dim 0 \('S'\)"):
        planning_dims([TensorSpec("L", "int64", ("S",))], {}, "m.onnx")


def test_a_batch_dim_planned_at_one_is_noted(tmp_path: Path) -> None:
    path = tmp_path / "batch.onnx"
    onnx.save(models.symbolic_batch(), path)
    result = plan_pipeline(path, cores=1, rounds=1, requests=3, runs=1)
    assert "input 'X' dim 0 ('N') not given: planned at batch size 1" in "\n".join(result.notes)
    assert "planned at batch size 1" in str(result)
    assert not plan_pipeline(path, cores=1, rounds=1, requests=3, runs=1, dims={"N": 2}).notes
    # A dim name the model does not have is refused before any profiling.
    with pytest.raises(InputError, match=r"no input has a dim named 'M'; .*'N'"):
        plan_pipeline(path, cores=1, dims={"M": 2})


def test_core_budget_is_checked(squeezenet: Path) -> None:
    with pytest.raises(SplitError, match=r"core budget 4096 is outside 1\.\.\d+ \(the cores this process may use"):
        plan_pipeline(squeezenet, cores=4096)


def test_the_planner_measures_batching_and_keeps_it_only_if_it_wins(tmp_path: Path) -> None:
    """batch=8: the chosen plan is measured again with max_batch 8 in the same interleaved rounds;
    the plan written keeps it only if it won every round, and says which way it went."""
    path = tmp_path / "batch.onnx"
    onnx.save(models.symbolic_batch(), path)
    result = plan_pipeline(path, cores=1, rounds=2, requests=16, runs=1, batch=8)
    assert result.batching is not None and f"batching: {result.batching}" in str(result)
    kept = result.batching.startswith("max_batch 8 kept: ")
    assert kept or result.batching.startswith("max_batch 8 does not pay here: "), result.batching
    assert "paired ratios" in result.batching and "over 2 round(s) of 16 requests" in result.batching
    assert [s.settings.max_batch for s in result.plan.config.stages] == [8 if kept else 1]
    assert plan_pipeline(path, cores=1, rounds=1, requests=3, runs=1).batching is None


def test_the_planner_does_not_batch_a_fixed_batch_dim(squeezenet: Path) -> None:
    result = plan_pipeline(squeezenet, cores=1, rounds=1, requests=3, runs=1, batch=4)
    assert result.batching == "not considered: 'data_0' has no symbolic batch dim (dim 0 is 1)"
    assert all(s.settings.max_batch == 1 for s in result.plan.config.stages)


def test_targets_are_checked_before_any_profiling(squeezenet: Path) -> None:
    import onnxruntime as ort

    missing = [t for t in ("openvino", "dnnl") if resolve_provider(t)[0] not in ort.get_available_providers()]
    for target in missing:
        with pytest.raises(SplitError, match=rf"^cannot plan for target '{target}': this host's onnxruntime \(.*\) does not have "):
            plan_pipeline(squeezenet, 1, targets=("cpu", target))
    with pytest.raises(SplitError, match=r"^--targets: unknown execution provider 'nosuch'"):
        plan_pipeline(squeezenet, 1, targets=("cpu", "nosuch"))
    if "AzureExecutionProvider" in ort.get_available_providers():
        with pytest.raises(SplitError, match=r"^cannot plan for target .azure.: the planner counts no device copies"):
            plan_pipeline(squeezenet, 1, targets=("cpu", "azure"))


def test_split_targets_needs_the_planner(squeezenet: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from onnxpipe.cli import main as cli

    runner = CliRunner()
    result = runner.invoke(cli, ["split", str(squeezenet), "-o", str(tmp_path / "a"), "--auto", "--stages", "2", "--targets", "cpu,openvino"])
    assert result.exit_code == 2 and "--targets: only with --cores" in result.output, result.output
    result = runner.invoke(cli, ["split", str(squeezenet), "-o", str(tmp_path / "b"), "--at", "r24", "--targets", "cpu"])
    assert result.exit_code == 2 and "--targets: only with --auto" in result.output, result.output


def test_a_memory_budget_drops_the_plans_that_measure_over_it(tmp_path: Path) -> None:
    path = tmp_path / "mlp.onnx"
    onnx.save(models.wide_mlp(width=1024), str(path))  # 16 MiB of weights
    budget = 32 << 20  # one copy of the weights fits, two do not
    result = plan_pipeline(path, cores=2, rounds=2, requests=10, runs=2, memory=budget)
    measured = {c.label: c.memory_bytes for c in result.candidates if c.memory_bytes is not None}
    assert len(measured) >= 3 and "1 session x 1t" in measured
    assert all(m > 16 << 20 for m in measured.values()), measured  # each holds the weights: measured, not 0
    over = [label for label, m in measured.items() if m > budget]
    assert "2 replicas x 1t" in over, measured  # two copies of the weights
    assert result.chosen.memory_bytes is not None and result.chosen.memory_bytes <= budget and result.chosen.label not in over
    dropped = next(n for n in result.notes if n.startswith("dropped over the 32.0 MiB memory budget: "))
    assert "2 replicas x 1t (" in dropped and " MiB measured)" in dropped
    plain = plan_pipeline(path, cores=2, rounds=1, requests=5, runs=2)
    assert all(c.memory_bytes is None for c in plain.candidates) and not any("memory" in n for n in plain.notes)


def test_a_budget_nothing_fits_names_what_each_plan_measured(squeezenet: Path) -> None:
    with pytest.raises(SplitError, match=r"^no plan fits the 0\.0 MiB memory budget: measured 1 session x 1t \d+\.\d MiB"):
        plan_pipeline(squeezenet, cores=1, rounds=1, requests=5, runs=2, memory=1)


def test_with_no_simple_plan_left_the_fastest_pipeline_is_chosen() -> None:
    a = PlanCandidate("pipeline 2 x (1t, 1t)", "pipeline", (1, 1), (1, 1), 10.0, (1.0, 1.0), rounds=(9.0, 10.0))
    b = PlanCandidate("pipeline 2 x (2t, 1t)", "pipeline", (2, 1), (1, 1), 12.0, (1.0, 1.0), rounds=(11.0, 12.0))
    chosen, choice = choose_plan([a, b, PlanCandidate("2 replicas x 1t", "replicas", (1,), (2,), 20.0, (1.0,))], 10)
    assert chosen is b and choice.verdict == "only pipelines" and "since no one-session or replicas plan fits" in str(choice)
    assert choice.reasons() == ["start: pipeline 2 x (2t, 1t), the highest median req/s of the 2 pipelines (11.5 req/s)", RULE]


def test_split_memory_needs_the_planner(squeezenet: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from onnxpipe.cli import main as cli

    result = CliRunner().invoke(cli, ["split", str(squeezenet), "-o", str(tmp_path / "a"), "--auto", "--stages", "2", "--memory", "1GiB"])
    assert result.exit_code == 2 and "--memory: only with --cores" in result.output, result.output
