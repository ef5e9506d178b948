"""The planner for the served workload: finalists measured with exactly N requests in flight (closed
loop), a plan chosen per N -- the lowest p99 at N = 1, the highest req/s above, or the highest req/s
within a p99 bound -- and each N's plan written where ``onnxpipe build`` takes it."""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from onnxpipe import SplitError
from onnxpipe.builder import PipelineConfig, build
from onnxpipe.planner import LoadMeasure, PlanCandidate, PlanResult, plan_pipeline
from onnxpipe.planner._candidates import _spinning_variants
from onnxpipe.planner._rules import choose_load, choose_loads
from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run
from tests.models import matmuls_then_chain, symbolic_batch

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
two_cores = pytest.mark.skipif(CORES < 2, reason=f"the choice changes with N only with 2 cores to share; this process may use {CORES}")
pytestmark = pytest.mark.xdist_group("planner-concurrency")  # one worker: the module's planner run happens once


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> PlanResult:
    if CORES < 2:
        pytest.skip(f"the choice changes with N only with 2 cores to share; this process may use {CORES}")
    path = tmp_path_factory.mktemp("served") / "served.onnx"
    onnx.save(matmuls_then_chain(), path)
    return plan_pipeline(path, cores=2, measure=1, rounds=3, requests=120, runs=2, concurrency=(1, 16))


def _margins(result: PlanResult) -> str:
    """Each finalist's p99 at N=1 and req/s at N=16 over the winner's, paired by round (printed: the test's margins)."""
    lines = []
    for load in result.loads:
        winner = load.chosen.loads[load.concurrency]
        for c in result.candidates:
            if load.concurrency in c.loads and c is not load.chosen:
                mine = c.loads[load.concurrency]
                paired = [a / b for a, b in zip(mine.p99_rounds if load.concurrency == 1 else mine.rounds,
                                                winner.p99_rounds if load.concurrency == 1 else winner.rounds, strict=True)]
                what = "p99" if load.concurrency == 1 else "req/s"
                lines.append(f"N={load.concurrency}: {c.label} {what} / {load.chosen.label}'s: {min(paired):.2f}-{max(paired):.2f}")
    return "\n".join(lines)


@two_cores
def test_each_n_is_chosen_by_its_rule_on_its_measurements(planned: PlanResult) -> None:
    """Which plan wins is a speed claim, measured by ``python -m benchmarks.planner_loads`` (a unit test
    shares its cores with the rest of the suite): here, each N's plan is the one its rule picks from
    the figures measured under that N."""
    print(planned)
    print(_margins(planned))
    assert [load.concurrency for load in planned.loads] == [1, 16]
    at_1, at_16 = planned.loads
    finalists = [c for c in planned.candidates if c.loads]
    for load, metric in ((at_1, "p99"), (at_16, "req/s")):
        chosen, choice = choose_load(finalists, load.concurrency, 120)
        assert load.chosen is chosen and load.choice == choice and choice.metric == metric and choice.chosen == chosen.label
        assert chosen.max_batch == 1 and load.plan.config.stages  # no batching variant here (a fixed dim 0: below)
    assert not at_16.chosen.spinning  # spinning variants are chosen from at N = 1 only
    assert planned.plan is at_1.plan and planned.chosen is at_1.chosen and planned.choice is at_1.choice
    # Every finalist was measured at each N in every round: req/s, p50 <= p99.
    assert {c.kind for c in finalists} == {"session", "replicas", "pipeline"}
    # The one multi-thread plan has a spinning variant, ranked with it and measured at N = 1 only; no 1-thread plan has one.
    spinning = [c for c in finalists if c.spinning]
    assert [(c.label, c.rank, set(c.loads)) for c in spinning] == [("1 session x 2t, spinning", "session", {1})]
    for c in finalists:
        for n in c.loads:
            m = c.loads[n]
            assert len(m.rounds) == len(m.p50_rounds) == len(m.p99_rounds) == 3
            assert m.throughput == statistics.median(m.rounds) > 0
            assert all(0 < p50 <= p99 for p50, p99 in zip(m.p50_rounds, m.p99_rounds, strict=True))
    # A fixed dim 0: no batching variant, and the notes say why.
    assert "no batching variants: 'x' has no symbolic batch dim (dim 0 is 256)" in planned.notes


@two_cores
def test_the_benchmark_judges_a_run_by_its_choices(planned: PlanResult) -> None:
    """``benchmarks.planner_loads`` (where which plan wins is measured) reads a run as the planner chose it."""
    from benchmarks.planner_loads import judge

    judged = judge(planned)
    at_1, at_16 = planned.loads
    assert judged["n1"]["chosen"] == at_1.chosen.label and judged["n16"]["chosen"] == at_16.chosen.label
    assert judged["n1"]["expected"] == (at_1.chosen.label in ("1 session x 2t", "1 session x 2t, spinning"))
    assert judged["n16"]["expected"] == (at_16.chosen.label in ("2 replicas x 1t", "pipeline 2 x (1t, 1t)"))
    assert judged["n1"]["p99_ms"] == at_1.chosen.loads[1].p99_ms and judged["n16"]["req_s"] == at_16.chosen.loads[16].throughput
    for spread in (judged["n1"]["rival_p99_over_chosen"], judged["n16"]["req_s_over_session_2t"], judged["n16"]["workers_req_s_over_session_2t"]):
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]


@two_cores
def test_exactly_n_requests_are_in_flight(planned: PlanResult) -> None:
    """Closed loop with N in flight: the requests in flight on average are req/s times the mean
    latency (Little's law, exact for the mean over the timed window; the median is not: a busy
    machine's stalls pull the mean above it), so each round's req/s times its mean latency is about
    N -- not the pipeline's queue capacity, nor 1."""
    for c in planned.candidates:
        for n, m in c.loads.items():
            assert len(m.mean_rounds) == len(m.rounds) == 3, (c.label, n)
            for rate, mean_ms in zip(m.rounds, m.mean_rounds, strict=True):
                in_flight = rate * mean_ms / 1e3
                assert 0.6 * n <= in_flight <= 1.4 * n, (c.label, n, in_flight)


@two_cores
def test_the_summary_lists_every_finalist_at_each_n_and_why(planned: PlanResult) -> None:
    text = str(planned)
    header, rows = planned.load_table()
    assert header == ["plan", "N=1 req/s", "p50 ms", "p99 ms", "N=16 req/s", "p50 ms", "p99 ms", "chosen at"]
    assert sorted(r[0] for r in rows) == sorted(c.label for c in planned.candidates if c.loads)
    chosen_at = {r[0]: r[-1] for r in rows}
    assert next(r for r in rows if r[0] == "1 session x 2t, spinning")[4:7] == ["-", "-", "-"]  # measured at N = 1 only
    # Which plan wins at each N is the run's own outcome (the same plan may win both): the column
    # names, for each plan, exactly the Ns the result chose it at.
    at_1, at_16 = planned.loads[0].chosen.label, planned.loads[1].chosen.label
    expected = {at_1: "N=1", at_16: "N=16"} if at_1 != at_16 else {at_1: "N=1, N=16"}
    assert chosen_at == {label: expected.get(label, "") for label in chosen_at}
    for row in rows:
        assert row[0] in text
    # Each N's line says why its plan won, in the words of the run's own outcome: which plan wins is
    # measured in benchmarks.planner_loads, not asserted here (this suite shares the 2 cores; a CI run
    # kept the 2-thread session at N=16 when 2 replicas measured 0.94-1.95x it).
    for load, metric in zip(planned.loads, ("p99", "req/s"), strict=True):
        why = next(line.strip() for line in text.splitlines() if line.strip().startswith(f"at N={load.concurrency}: "))
        assert why == str(load.choice) and why.startswith(f"at N={load.concurrency}: {load.chosen.label}: "), why
        assert why.endswith("[3 round(s) of 120 requests]") and load.choice.metric == metric, why
        if any(c.won for c in load.choice.contests):
            assert (" in every round (" in why) and ("lower p99 than " if metric == "p99" else "'s req/s in every round (") in why, why
        else:
            best = "the lowest p99" if metric == "p99" else "the highest req/s"
            assert f"{load.chosen.label}: {best} of the " in why and "; no more complex plan was better in every round (the closest, " in why, why


@two_cores
def test_each_n_plan_is_written_and_builds(planned: PlanResult, tmp_path: Path) -> None:
    folder = planned.save(tmp_path / "plans")
    assert sorted(p.name for p in folder.iterdir()) == ["concurrency-1", "concurrency-16", "summary.json"]
    for load in planned.loads:
        config = PipelineConfig.load(folder / f"concurrency-{load.concurrency}")
        settings = [(s.settings.intra_op_threads, s.settings.replicas, s.settings.max_batch, s.settings.spinning) for s in config.stages]
        assert settings == [(t, r, 1, load.chosen.spinning) for t, r in zip(load.chosen.threads, load.chosen.replicas, strict=True)]
        assert build(config, tmp_path / f"built-{load.concurrency}").path.is_dir()
    # Each plan is its own: the one for N=16 did not overwrite N=1's settings.
    for load in planned.loads:
        stages = load.plan.config.stages
        assert [(s.settings.intra_op_threads, s.settings.spinning) for s in stages] == [(t, load.chosen.spinning) for t in load.chosen.threads]
    assert planned.loads[0].plan is not planned.loads[1].plan
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["concurrency"] == [1, 16] and summary["chosen"]["1"]["plan"] == planned.loads[0].chosen.label
    assert [f["plan"] for f in summary["finalists"] if f["spinning"]] == ["1 session x 2t, spinning"]
    assert {f["plan"] for f in summary["finalists"]} == {c.label for c in planned.candidates if c.loads}
    assert all(set(f["loads"]) == {"1", "16"} and f["loads"]["16"]["req_s"] > 0 for f in summary["finalists"] if not f["spinning"])
    assert all(set(f["loads"]) == {"1"} for f in summary["finalists"] if f["spinning"])


@two_cores
def test_a_p99_bound_drops_the_plans_over_it(planned: PlanResult) -> None:
    pool = [c for c in planned.candidates if c.loads]
    p99s = sorted(c.loads[16].p99_ms for c in pool if 16 in c.loads)
    bound = (p99s[0] + p99s[-1]) / 2  # between the fastest tail and the slowest: some meet it, some do not
    notes: list[str] = []
    (_, at_1), (winner, at_16) = choose_loads(pool, (1, 16), 40, bound, notes)
    over = [c for c in pool if 16 in c.loads and c.loads[16].p99_ms > bound]
    assert over and winner.loads[16].p99_ms <= bound
    dropped = next(n for n in notes if n.startswith(f"at N=16, over --p99 {bound:g} ms: "))
    for c in over:
        assert f"{c.label} (p99 {c.loads[16].p99_ms:.2f} ms)" in dropped
    assert f"--p99 {bound:g} ms dropped " in str(at_16) and f"at N=16 within --p99 {bound:g} ms: " in str(at_16)
    # Under a bound the choice is the highest throughput, at N = 1 too.
    assert at_1.metric == "req/s"


@two_cores
def test_a_p99_bound_no_plan_meets_lists_every_p99(planned: PlanResult) -> None:
    pool = [c for c in planned.candidates if c.loads]
    every = ", ".join(rf"{re.escape(c.label)} \d+\.\d\d ms" for c in pool) + "$"  # every finalist's p99
    with pytest.raises(SplitError, match=r"^no plan meets --p99 0\.001 ms at N=1: measured p99 \(median of the rounds\) " + every):
        choose_load(pool, 1, 40, 0.001)


# -- the rule, on injected figures --------------------------------------------------------------------


def _plan(label: str, kind: str, rounds: dict[int, tuple[float, ...]], p99: dict[int, tuple[float, ...]], max_batch: int = 1) -> PlanCandidate:
    c = PlanCandidate(label, kind, (1,), (1,), 1.0, (1.0,), max_batch=max_batch)
    c.loads = {n: LoadMeasure(n, rounds[n], tuple(p / 2 for p in p99[n]), p99[n]) for n in rounds}
    return c


def test_at_one_a_more_complex_plan_needs_a_lower_p99_in_every_round() -> None:
    session = _plan("1 session x 2t", "session", {1: (100.0, 100.0, 100.0)}, {1: (10.0, 10.0, 10.0)})
    lucky = _plan("2 replicas x 1t", "replicas", {1: (200.0, 200.0, 200.0)}, {1: (5.0, 11.0, 5.0)})  # lower by median, not every round
    chosen, choice = choose_load([session, lucky], 1, 20)
    assert chosen is session and choice.metric == "p99"  # throughput does not count at N=1 without a bound
    assert str(choice) == (
        "at N=1: 1 session x 2t: the lowest p99 of the one-session plans (10.00 ms); no more complex plan was better in every "
        "round (the closest, 2 replicas x 1t, 0.50x its p99, 0.50-1.10: within the spread, kept the simpler plan) [3 round(s) of 20 requests]"
    )
    steady = _plan("pipeline 2 x (1t, 1t)", "pipeline", {1: (90.0, 90.0, 90.0)}, {1: (9.0, 9.5, 9.8)})
    chosen, choice = choose_load([session, lucky, steady], 1, 20)
    assert chosen is steady
    assert str(choice).startswith("at N=1: pipeline 2 x (1t, 1t): lower p99 than 1 session x 2t in every round, 0.95x its p99 (0.90-0.98)")


def test_the_choice_changes_with_concurrency() -> None:
    """The same finalists, measured at N = 1 and N = 16 as matmuls_then_chain measures on 2 cores
    (``python -m benchmarks.planner_loads``): the 2-thread session has the lowest p99 alone, the
    1-thread replicas the most req/s in every round under 16."""
    session = _plan("1 session x 2t", "session", {1: (160.0, 150.0, 155.0), 16: (170.0, 165.0, 172.0)},
                    {1: (7.0, 7.4, 7.2), 16: (110.0, 112.0, 108.0)})
    replicas = _plan("2 replicas x 1t", "replicas", {1: (120.0, 118.0, 121.0), 16: (230.0, 226.0, 229.0)},
                     {1: (9.0, 9.3, 9.1), 16: (75.0, 80.0, 77.0)})
    (at_1, why_1), (at_16, why_16) = choose_loads([session, replicas], (1, 16), 120, None, [])
    assert (at_1, why_1.metric) == (session, "p99") and (at_16, why_16.metric) == (replicas, "req/s")
    assert str(why_16).startswith("at N=16: 2 replicas x 1t: 1.35x 1 session x 2t's req/s in every round (1.33-1.37)"), str(why_16)


def test_above_one_the_highest_req_s_and_batching_must_win_every_round() -> None:
    session = _plan("1 session x 2t", "session", {8: (100.0, 100.0)}, {8: (80.0, 80.0)})
    replicas = _plan("2 replicas x 1t", "replicas", {8: (130.0, 120.0)}, {8: (60.0, 60.0)})
    batched = _plan("1 session x 2t, max_batch 8", "session", {8: (140.0, 120.0)}, {8: (50.0, 50.0)}, max_batch=8)  # loses round 2 to replicas
    chosen, choice = choose_load([session, replicas, batched], 8, 20)
    assert chosen is replicas and choice.metric == "req/s" and batched.rank == "session, batching"
    assert str(choice).startswith("at N=8: 2 replicas x 1t: 1.25x 1 session x 2t's req/s in every round (1.20-1.30); no more complex plan")
    # Within a p99 bound the replicas (60 ms) are dropped, not the batching variant (50 ms): it then only needs to beat the session.
    chosen, choice = choose_load([session, replicas, batched], 8, 20, p99_ms=55.0)
    assert chosen is batched and choice.dropped == (("1 session x 2t", 80.0), ("2 replicas x 1t", 60.0))


def test_a_spinning_variant_competes_with_the_plan_it_varies_by_median() -> None:
    """The same plan with one setting changed, as a thread count: no every-round test against it (Note: spinning)."""
    session = _plan("1 session x 2t", "session", {1: (90.0, 90.0, 90.0)}, {1: (12.0, 12.0, 12.0)})
    spins = replace(session, label="1 session x 2t, spinning", spinning=True, loads={})
    spins.loads = {1: LoadMeasure(1, (130.0, 80.0, 130.0), (7.0, 13.0, 7.0), (8.0, 13.0, 8.0))}  # lower by median, higher in round 2
    assert spins.rank == session.rank == "session"
    chosen, choice = choose_load([session, spins], 1, 20)
    assert chosen is spins and str(choice).startswith("at N=1: 1 session x 2t, spinning: the lowest p99 of the one-session plans (8.00 ms)")
    # The same figures on a more complex plan do not replace the session: it must be better in every round.
    replicas = _plan("2 replicas x 1t", "replicas", {1: (130.0, 80.0, 130.0)}, {1: (8.0, 13.0, 8.0)})
    chosen, choice = choose_load([session, replicas], 1, 20)
    assert chosen is session and "(the closest, 2 replicas x 1t, 0.67x its p99, 0.67-1.08: within the spread, kept the simpler plan)" in str(choice)


def test_spinning_variants_only_where_a_stage_has_a_pool() -> None:
    """One per rank, of its best-predicted plan with a stage of two threads or more; never of a plan of one-thread stages."""
    plans = [PlanCandidate("1 session x 1t", "session", (1,), (1,), 120.0, (8.0,)),
             PlanCandidate("1 session x 2t", "session", (2,), (1,), 100.0, (10.0,)),
             PlanCandidate("2 replicas x 1t", "replicas", (1,), (2,), 150.0, (8.0,)),
             PlanCandidate("pipeline 2 x (1t, 1t)", "pipeline", (1, 1), (1, 1), 140.0, (4.0, 4.0)),
             PlanCandidate("pipeline 2 x (2t, 1t)", "pipeline", (2, 1), (1, 1), 130.0, (3.0, 4.0)),
             PlanCandidate("pipeline 2 x (1t, 2t)", "pipeline", (1, 2), (1, 1), 135.0, (4.0, 3.0)),
             PlanCandidate("1 session x 2t, max_batch 8", "session", (2,), (1,), 100.0, (10.0,), max_batch=8)]
    variants = _spinning_variants(plans)
    assert [(v.label, v.rank) for v in variants] == [
        ("1 session x 2t, spinning", "session"),
        ("pipeline 2 x (1t, 2t), spinning", "pipeline"),
        ("1 session x 2t, max_batch 8, spinning", "session, batching"),
    ]
    assert all(v.spinning and not v.loads for v in variants) and not any(p.spinning for p in plans)


def test_concurrency_and_the_bound_are_checked_before_any_profiling(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(symbolic_batch(), path)
    with pytest.raises(SplitError, match=r"^concurrency must be one or more integers from 1 \(requests in flight\), got \[1, 0\]$"):
        plan_pipeline(path, cores=1, concurrency=(1, 0))
    with pytest.raises(SplitError, match=r"^a p99 bound needs the load it holds under: give concurrency"):
        plan_pipeline(path, cores=1, p99_ms=10.0)
    with pytest.raises(SplitError, match=r"^the p99 bound must be above 0 ms, got -1\.0$"):
        plan_pipeline(path, cores=1, concurrency=4, p99_ms=-1.0)


# -- the CLI ------------------------------------------------------------------------------------------


def test_split_concurrency_writes_a_plan_per_n_with_batching_variants(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(symbolic_batch(), path)
    out = tmp_path / "plans"
    text = ok("split", path, "-o", out, "--auto", "--cores", 1, "--concurrency", "1,4", "--rounds", 1, "--requests", 4).stdout
    for fragment in ("under N requests in flight (closed loop)", "N=1 req/s", "N=4 req/s", "p99 ms", "chosen at", "1 session x 1t, max_batch 4",
                     "\nat N=1: 1 session x 1t", "\nat N=4: ", "stage by stage", f"wrote {out / 'summary.json'}", "next: onnxpipe build"):
        assert fragment in text, (fragment, text)
    assert sorted(p.name for p in out.iterdir()) == ["concurrency-1", "concurrency-4", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    variant = next(f for f in summary["finalists"] if f["max_batch"] == 4)
    assert set(variant["loads"]) == {"1", "4"}
    ok("build", out / "concurrency-4", "-o", tmp_path / "built")
    # One N: the plan goes to OUT itself, as without --concurrency.
    ok("split", path, "-o", tmp_path / "one", "--auto", "--cores", 1, "--concurrency", "4", "--rounds", 1, "--requests", 4)
    assert (tmp_path / "one" / "pipeline.json").is_file() and not (tmp_path / "one" / "summary.json").exists()
    result = run("split", path, "-o", tmp_path / "none", "--auto", "--cores", 1, "--concurrency", "2", "--p99", "0.0001", "--rounds", 1, "--requests", 4)
    assert_user_error(result, "no plan meets --p99 0.0001 ms at N=2: measured p99 (median of the rounds) 1 session x 1t ")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--auto", "--cores", "1", "--p99", "20"], "--p99: only with --concurrency"),
        (["--auto", "--cores", "1", "--concurrency", "0"], "'0' is not N[,N...] with each N an integer from 1"),
        (["--auto", "--cores", "1", "--concurrency", "1,x"], "'1,x' is not N[,N...]"),
        (["--auto", "--stages", "2", "--concurrency", "4"], "--concurrency: only with --cores"),
        (["--concurrency", "4"], "--concurrency: only with --auto"),
        (["--auto", "--cores", "1", "--concurrency", "4", "--p99", "0"], "--p99"),
    ],
)
def test_split_concurrency_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(symbolic_batch(), path)
    assert_usage_error(run("split", path, "-o", tmp_path / "out", *args), message)
    assert not (tmp_path / "out").exists()
