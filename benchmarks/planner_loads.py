"""Does the served planner's choice change with the load? Its choice at N = 1 and N = 16 requests in
flight on a model made for the question, planned again and again in one run.

The model is ``tests.models.matmuls_then_chain``: eight 512 x 512 MatMuls, which intra-op threads
split well, then 200 elementwise ops one after another, which onnxruntime runs on one thread however
many it has. At N = 1 both cores should work on the one request (one session x 2 threads, spinning or
not: the lowest p99); at N = 16 two 1-thread workers (2 replicas, or the 2-stage pipeline cut between
the parts) should each run a request on a core of their own, and beat that session's req/s in every
round. Each run is ``plan_pipeline(cores=2, concurrency=(1, 16))``, as ``onnxpipe split --auto
--cores 2 --concurrency 1,16`` runs it, so each run measures its finalists side by side in
interleaved rounds; the runs follow each other on the same cores. For each run it prints the plan
chosen at each N, and its margin paired by round: at N = 1 the best 1-thread plan's p99 over the
chosen one's, at N = 16 the chosen plan's req/s over one session x 2 threads', and the best 1-thread
plan's (the planner keeps the session unless a plan of another rank beats it in every round). Then
how many runs chose as expected.

This is where the claim lives; ``tests/planner/test_planner_concurrency.py`` checks the rule and
the plans on one such run, not which plan wins (a unit test shares its cores with the rest of the
suite).

    python -m benchmarks.planner_loads [--runs 5] [--rounds 3] [--requests 120] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import onnx

from benchmarks._timing import spread
from onnxpipe.planner import PlanCandidate, PlanResult, plan_pipeline
from tests.models import matmuls_then_chain

SESSION_2T = "1 session x 2t"


def _paired(mine: tuple[float, ...], theirs: tuple[float, ...]) -> list[float]:
    return [a / b for a, b in zip(mine, theirs, strict=True)]


def judge(result: PlanResult) -> dict[str, Any]:
    """One planner run's choices at N = 1 and N = 16, whether each is the expected one, and its margin."""
    at_1, at_16 = result.loads
    one_thread = [c for c in result.candidates if 1 in c.loads and max(c.threads) == 1]
    rival = min(one_thread, key=lambda c: c.loads[1].p99_ms)  # the best 1-thread plan at N = 1
    session = next(c for c in result.candidates if c.label == SESSION_2T)
    chosen_16: PlanCandidate = at_16.chosen
    workers = max((c for c in one_thread if 16 in c.loads), key=lambda c: c.loads[16].throughput)  # the best 1-thread plan at N = 16
    return {
        "n1": {"chosen": at_1.chosen.label, "expected": at_1.chosen.kind == "session" and at_1.chosen.threads == (2,),
               "p99_ms": at_1.chosen.loads[1].p99_ms, "rival": rival.label,
               "rival_p99_over_chosen": spread(_paired(rival.loads[1].p99_rounds, at_1.chosen.loads[1].p99_rounds))},
        "n16": {"chosen": chosen_16.label,
                "expected": chosen_16.kind in ("replicas", "pipeline") and max(chosen_16.threads) == 1,
                "req_s": chosen_16.loads[16].throughput,
                "req_s_over_session_2t": spread(_paired(chosen_16.loads[16].rounds, session.loads[16].rounds)),
                "workers": workers.label, "workers_req_s_over_session_2t": spread(_paired(workers.loads[16].rounds, session.loads[16].rounds))},
    }


def run(runs: int = 5, rounds: int = 3, requests: int = 120, measure: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "matmuls_then_chain.onnx"
        onnx.save(matmuls_then_chain(), path)
        judged = [judge(plan_pipeline(path, cores=2, measure=measure, rounds=rounds, requests=requests, runs=2, concurrency=(1, 16)))
                  for _ in range(runs)]
    return {"runs": judged, "rounds": rounds, "requests": requests, "cores": len(os.sched_getaffinity(0)),
            "load_average": os.getloadavg(),
            "expected": {n: sum(j[n]["expected"] for j in judged) for n in ("n1", "n16")}}


def _fmt(ratios: dict[str, float]) -> str:
    return f"{ratios['median']:.2f}x ({ratios['min']:.2f}-{ratios['max']:.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="planner runs, one after another")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per run")
    parser.add_argument("--requests", type=int, default=120, help="requests per round")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    result = run(args.runs, args.rounds, args.requests)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['cores']} cores, {args.runs} planner runs of {args.rounds} rounds x {args.requests} requests, "
          f"load average {', '.join(f'{x:.1f}' for x in result['load_average'])}")
    print("| run | chosen at N=1 | best 1-thread plan's p99 / chosen's | chosen at N=16 | its req/s / 1 session x 2t's "
          "| best 1-thread plan's req/s / 1 session x 2t's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, j in enumerate(result["runs"], 1):
        print(f"| {k} | {j['n1']['chosen']} ({j['n1']['p99_ms']:.2f} ms) | {j['n1']['rival']}: {_fmt(j['n1']['rival_p99_over_chosen'])} "
              f"| {j['n16']['chosen']} ({j['n16']['req_s']:.1f} req/s) | {_fmt(j['n16']['req_s_over_session_2t'])} "
              f"| {j['n16']['workers']}: {_fmt(j['n16']['workers_req_s_over_session_2t'])} |")
    print(f"N=1: one session x 2 threads chosen in {result['expected']['n1']} of {args.runs} runs; "
          f"N=16: 1-thread workers chosen in {result['expected']['n16']} of {args.runs} runs")


if __name__ == "__main__":
    main()
