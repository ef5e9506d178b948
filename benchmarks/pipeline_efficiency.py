"""Is the pipeline runtime as fast as its slowest stage allows, and what does a hop cost?

Measured side by side in one run, on onnx light models split in two stages x 1 thread:

- **stage times**: each stage alone in its own session, 1 thread, median of many runs;
- **pipeline**: requests streamed through the loaded bundle (``Pipeline.map``); its efficiency is
  ``throughput / (1 / slowest stage time)`` (goal >= 0.95), measured twice: with the calling thread
  left to the OS, and with it pinned to the core of the stage with the most slack (on 2 cores it
  otherwise preempts the bottleneck stage half the time);
- **baselines** a user would pick instead: the whole model in one session with 1 and 2 threads, and
  2 replicas x 1 thread (a one-stage onnxpipe bundle with ``replicas=2``).

And the **per-hop overhead**: what one more stage adds to a request's latency beyond the stage's own
work, fitted over chains of 1, 2, 4 and 8 identity stages on a small tensor, one request at a time,
for three placements of the stages, each beside the cheapest blocking hand-off CPython has on the
same placement (goal <= 30 us; see :func:`bench_hop`); measured with the host's idle as it is, and
again with idle cores polling instead of halting (where ``/dev/cpu_dma_latency`` is writable),
which shows how much of a hop is the machine waking a core rather than the runtime.

The cut of each model is the most balanced of a few low-traffic candidates (from ``inspect_model``),
chosen by timing their two stages here.

With ``--against REV`` the run is this checkout beside git revision REV (issue 37's "hot path
unchanged or faster"): ``--rounds`` rounds, each side's round a fresh process of this module with
``--rounds 1 --json`` (REV's first, then this checkout's, and again), both running this checkout's
benchmark code on their own ``onnxpipe`` (``benchmarks/_checkout.py``, Note: what each side runs).
Printed per figure: each side's median (min-max) over its rounds and new / old paired by round. The
figures: per model, efficiency (caller unpinned and pinned) and the pipeline's req/s, each model cut
where the first round cut it, on both sides; per placement, the per-hop overhead and the latency of
the shortest and longest chain, and the streaming cost per request (again with idle cores polling
where that is measured).

    python -m benchmarks.pipeline_efficiency [--models shufflenet squeezenet resnet50] [--requests 200]
        [--rounds 3] [--hop-requests 2000] [--cut MODEL=TENSOR[,TENSOR...]] [--against REV] [--json]
        (--models with no name: only the hop; --cut: split MODEL there instead of timing candidates)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from benchmarks._checkout import checkout, compare, interleaved, report
from benchmarks._timing import median_seconds
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import Pipeline, load
from onnxpipe.splitter import inspect_model, split

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
ort.set_default_logger_severity(3)


def _session(path: str | bytes, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def _throughput(fn: Callable[[], object], requests: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(requests):
        fn()
    return requests / (time.perf_counter() - start)


def _stage_jobs(folder: Path, feeds: dict[str, np.ndarray]) -> list[Callable[[], object]]:
    """One call per stage of a split folder: its own session (1 thread) on the real boundary tensors."""
    spec = json.loads((folder / "pipeline.json").read_text())
    values = dict(feeds)
    jobs: list[Callable[[], object]] = []
    for stage in spec["stages"]:
        session = _session(str(folder / stage["module"]), 1)
        stage_feeds = {t["name"]: values[t["name"]] for t in stage["inputs"]}
        out_names = [t["name"] for t in stage["outputs"]]
        values.update(zip(out_names, session.run(out_names, stage_feeds), strict=True))
        jobs.append(functools.partial(session.run, out_names, stage_feeds))
    return jobs


def _stage_times(folder: Path, feeds: dict[str, np.ndarray], runs: int) -> list[float]:
    """Each stage of a split folder alone (one after the other), 1 thread, median of ``runs``."""
    return [median_seconds(job, runs, warmup=3) for job in _stage_jobs(folder, feeds)]


def _concurrent_stage_times(folder: Path, feeds: dict[str, np.ndarray], cores: list[int], runs: int) -> list[float]:
    """Every stage at once, each on a thread pinned to its core, no runtime between them: what the
    hardware gives two busy cores (shared caches, memory bandwidth, the host's other guests)."""
    jobs = _stage_jobs(folder, feeds)
    times = [0.0] * len(jobs)
    start = threading.Barrier(len(jobs))

    def loop(k: int) -> None:
        os.sched_setaffinity(0, {cores[k % len(cores)]})
        start.wait()
        times[k] = median_seconds(jobs[k], runs, warmup=3)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times


def _best_cut(path: Path, feeds: dict[str, np.ndarray], work: Path, candidates: int = 6) -> tuple[list[str], list[float]]:
    summary = inspect_model(path, top=candidates)
    best: tuple[float, list[str], list[float]] | None = None
    for k, cand in enumerate(summary.candidates):
        cut = cand.at.split(",")
        folder = split(path, [cut]).save(work / f"cand{k}")
        times = _stage_times(folder, feeds, runs=20)
        if best is None or max(times) < best[0]:
            best = (max(times), cut, times)
    assert best is not None
    return best[1], best[2]


def _bundle(config: PipelineConfig, work: Path, name: str) -> Path:
    return export(build(config, work / f"{name}-built").path, work / name)


def _stream(pipe: Pipeline, feeds: dict[str, np.ndarray], requests: int) -> float:
    """Requests per second of ``pipe.map`` over ``requests`` copies of ``feeds`` (after a warm-up)."""
    for _ in pipe.map(feeds for _ in range(10)):
        pass
    start = time.perf_counter()
    for _ in pipe.map(feeds for _ in range(requests)):
        pass
    return requests / (time.perf_counter() - start)


def bench_model(name: str, requests: int, rounds: int, work: Path, cut: list[str] | None = None) -> dict[str, Any]:
    """All contenders of one model, measured in ``rounds`` interleaved rounds; medians reported
    (the machine is shared: interleaving spreads its noise over every contender alike). The model
    is split at ``cut``, or at the most balanced of a few candidates timed here."""
    path = LIGHT / f"light_{name}.onnx"
    whole1, whole2 = _session(str(path), 1), _session(str(path), 2)
    inp = whole1.get_inputs()[0]
    feeds = {inp.name: np.random.default_rng(0).standard_normal(inp.shape).astype(np.float32)}
    if cut is None:
        cut, _ = _best_cut(path, feeds, work / name)
    plan = split(path, [cut])
    cores = sorted(os.sched_getaffinity(0))
    for k, s in enumerate(plan.config.stages):
        s.configure(intra_op_threads=1, affinity=[cores[k % len(cores)]] if len(cores) >= 2 else None)
    bundle = _bundle(plan.config, work, f"{name}-2stage")
    single = PipelineConfig(name)
    whole = single.add_stage(path, "whole")
    whole.configure(intra_op_threads=1, replicas=2)
    single.input(inp.name).connect(whole.input(inp.name))
    for out in whole.outputs:
        whole.output(out.name).connect(single.output(out.name))
    # Pipeline contenders: the calling thread left to the OS; pinned to the core of the stage with
    # the most slack (this round's: it then takes no time from the bottleneck, docs/runtime.md);
    # pinned, with idle cores polling instead of halting (where the host lets us ask for it).
    contenders = ["pipeline", "pinned", "polling"]
    samples: dict[str, list[float]] = {k: [] for k in [*contenders, "one_1t", "one_2t", "replicas", "slowest_s", "slowest_together_s"]}
    stage_ms: list[list[float]] = []
    callers: list[int] = []
    runs = max(20, requests // 5)
    with load(bundle) as pipe, load(_bundle(single, work, f"{name}-replicas")) as replicas:
        for _ in range(rounds):
            times = _stage_times(bundle, feeds, runs)
            stage_ms.append([t * 1e3 for t in times])
            samples["slowest_s"].append(max(times))
            samples["slowest_together_s"].append(max(_concurrent_stage_times(bundle, feeds, cores, runs)))
            samples["pipeline"].append(_stream(pipe, feeds, requests))
            callers.append(cores[min(range(len(times)), key=times.__getitem__) % len(cores)])
            os.sched_setaffinity(0, {callers[-1]})
            try:
                samples["pinned"].append(_stream(pipe, feeds, requests))
                with _idle_polling() as polling:
                    if polling:
                        samples["polling"].append(_stream(pipe, feeds, requests))
            finally:
                os.sched_setaffinity(0, cores)
            samples["replicas"].append(_stream(replicas, feeds, requests))
            samples["one_1t"].append(_throughput(functools.partial(whole1.run, None, feeds), requests))
            samples["one_2t"].append(_throughput(functools.partial(whole2.run, None, feeds), requests))
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    # Each round's throughput against that round's stage times (the machine's load drifts over
    # the minutes a run takes): medians of the per-round ratios.
    slowest, together = samples["slowest_s"], samples["slowest_together_s"]
    efficiency = {k: [tp * t for tp, t in zip(samples[k], slowest, strict=False)] for k in contenders}
    ceiling = [t / c for t, c in zip(slowest, together, strict=True)]
    return {
        "model": name,
        "cut": cut,
        "rounds": rounds,
        "stage_ms": [round(statistics.median(col), 3) for col in zip(*stage_ms, strict=True)],
        "ideal_req_s": 1.0 / med["slowest_s"],
        "req_s": {k: med.get(k) for k in [*contenders, "one_1t", "one_2t", "replicas"]},
        "efficiency": {k: statistics.median(v) if v else None for k, v in efficiency.items()},
        "efficiency_rounds": {k: [round(x, 3) for x in v] for k, v in efficiency.items()},
        "caller_cores_rounds": callers,
        "hardware_ceiling": statistics.median(ceiling),
        "runtime_share": statistics.median(e / c for e, c in zip(efficiency["pinned"], ceiling, strict=True)),
    }


def _identity(i: int) -> onnx.ModelProto:
    """t<i>[1, 16] -> t<i+1>: two Identity nodes (a stage doing next to nothing)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", [f"t{i}"], [f"u{i}"]), helper.make_node("Identity", [f"u{i}"], [f"t{i + 1}"])],
        f"id{i}",
        [helper.make_tensor_value_info(f"t{i}", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info(f"t{i + 1}", TensorProto.FLOAT, [1, 16])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _identity_bundle(stages: int, work: Path, cores: list[int] | None = None) -> Path:
    """A chain of ``stages`` identity stages; stage i pinned to ``cores[i % len(cores)]`` if given."""
    name = f"hops{stages}-{'-'.join(map(str, cores)) if cores else 'any'}"
    if (work / name).exists():
        return work / name
    config = PipelineConfig(f"hops{stages}")
    chain = [config.add_stage(_identity(i), f"id{i}") for i in range(stages)]
    for i, stage in enumerate(chain):
        if cores:
            stage.configure(affinity=[cores[i % len(cores)]])
    config.input("t0").connect(chain[0].input("t0"))
    for i in range(1, stages):
        chain[i - 1].output(f"t{i}").connect(chain[i].input(f"t{i}"))
    chain[-1].output(f"t{stages}").connect(config.output(f"t{stages}"))
    return _bundle(config, work, name)


class _Relay:
    """The cheapest blocking hand-off CPython has: a chain of threads passing an item through C
    SimpleQueues, each thread doing nothing else (pinned like the stages it stands for)."""

    def __init__(self, stages: int, cores: list[int] | None) -> None:
        self.queues: list[queue.SimpleQueue[object]] = [queue.SimpleQueue() for _ in range(stages + 1)]
        self.workers = [threading.Thread(target=self._relay, args=(i, cores[i % len(cores)] if cores else None)) for i in range(stages)]
        for w in self.workers:
            w.start()

    def _relay(self, i: int, core: int | None) -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})
        take, give = self.queues[i].get, self.queues[i + 1].put
        while (item := take()) is not None:
            give(item)
        give(None)

    def __call__(self) -> object:
        self.queues[0].put(1)
        return self.queues[-1].get()

    def close(self) -> None:
        self.queues[0].put(None)
        self.queues[-1].get()
        for w in self.workers:
            w.join()


def _slope(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares line through the points: (slope, intercept)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


#: Where the identity stages (and the thread calling the pipeline) run, as a function of the cores.
PLACEMENTS: dict[str, Callable[[list[int]], tuple[list[int] | None, set[int] | None]]] = {
    "default": lambda cores: (None, None),  # nothing pinned: what load() gives by default
    "one core": lambda cores: ([cores[0]], {cores[0]}),  # every stage and the caller on one core
    "two cores": lambda cores: (cores[:2], {cores[0]}),  # consecutive stages on different cores
}


@contextlib.contextmanager
def _idle_polling() -> Iterator[bool]:
    """Keep idle cores polling instead of halting while inside (Linux PM QoS: ``/dev/cpu_dma_latency``
    held at 0 us, what tuned's latency-performance profile does); yields False when not permitted.

    On a VM whose idle vCPUs halt at once, waking a thread on an idle core is a trip through the
    hypervisor; a polling core takes the wake-up at once. Polling runs only while a core has
    nothing else to run, so unlike a spinning thread it takes no time from stages."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        yield False
        return
    try:
        os.write(fd, struct.pack("i", 0))
        yield True
    finally:
        os.close(fd)


def bench_hop(requests: int, rounds: int, work: Path, lengths: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, Any]:
    """What one more stage adds to a request's latency, beyond the stage's own work.

    Chains of 1, 2, 4 and 8 identity stages on a [1, 16] tensor, one request at a time (``pipe(x)``),
    for each placement of :data:`PLACEMENTS`; medians of ``rounds`` interleaved rounds. A line is
    fitted to latency against the number of stages: its slope is the cost of one stage, and
    **per-hop overhead = slope - the identity stage's standalone run time**; its intercept is the
    fixed cost of a request (input checks, the future, entering and leaving the pipeline).

    Beside each, the same fit on the cheapest blocking hand-off CPython has (:class:`_Relay`,
    pinned alike): the floor set by the OS waking a sleeping thread, which depends on the
    placement (a wake-up across cores costs more, above all on a VM whose idle cores halt).

    Also the runtime's Python cost per request when streaming through 2 identity stages
    (``1 / throughput - the slower stage alone``; GIL-serialized): the ceiling on requests per
    second for stages that do nothing.
    """
    x = np.ones((1, 16), np.float32)
    cores = sorted(os.sched_getaffinity(0))
    longest = _identity_bundle(max(lengths), work)
    alone = statistics.median(_stage_times(longest, {f"t{i}": x for i in range(max(lengths) + 1)}, runs=2000))
    placements = {k: f(cores) for k, f in PLACEMENTS.items() if len(cores) >= 2 or k != "two cores"}
    rows = {}
    for name, (stage_cores, caller) in placements.items():
        pipes = {n: load(_identity_bundle(n, work, stage_cores)) for n in lengths}
        relays = {n: _Relay(n, stage_cores) for n in lengths}
        latency: dict[int, list[float]] = {n: [] for n in lengths}
        floor: dict[int, list[float]] = {n: [] for n in lengths}
        if caller is not None:
            os.sched_setaffinity(0, caller)
        try:
            for _ in range(rounds):
                for n in lengths:
                    pipe = pipes[n]
                    latency[n].append(median_seconds(lambda pipe=pipe: pipe({"t0": x}), requests, warmup=50))  # type: ignore[misc]
                    floor[n].append(median_seconds(relays[n], requests, warmup=50))
        finally:
            os.sched_setaffinity(0, cores)
            for p in pipes.values():
                p.close()
            for r in relays.values():
                r.close()
        med = [statistics.median(latency[n]) for n in lengths]
        slope, fixed = _slope(list(lengths), med)
        floor_slope, floor_fixed = _slope(list(lengths), [statistics.median(floor[n]) for n in lengths])
        rows[name] = {
            "stage_cores": stage_cores,
            "latency_us": {n: round(v * 1e6, 1) for n, v in zip(lengths, med, strict=True)},
            "per_hop_us": (slope - alone) * 1e6,
            "fixed_us": fixed * 1e6,
            "floor_per_hop_us": floor_slope * 1e6,
            "floor_fixed_us": floor_fixed * 1e6,
        }
    pair = _identity_bundle(2, work)
    slower = max(_stage_times(pair, {f"t{i}": x for i in range(3)}, runs=2000))
    with load(pair) as pipe:
        throughput = _stream(pipe, {"t0": x}, requests)
    return {
        "lengths": list(lengths),
        "stage_alone_us": alone * 1e6,
        "placements": rows,
        "streaming_cost_per_request_us": (1 / throughput - slower) * 1e6,
    }


def _print_models(rows: list[dict[str, Any]], rounds: int, requests: int) -> None:
    def eff(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(f"2 stages x 1 thread, one core each; medians of {rounds} interleaved rounds of {requests} requests")
    head = f"{'efficiency: caller unpinned':>27} {'pinned':>7} {'+ polling':>9}"
    print(f"{'model':<11} {'stage ms':>15} {'ideal':>7}   {head}   {'hw ceiling':>10} {'runtime':>7}")
    for r in rows:
        e = r["efficiency"]
        print(
            f"{r['model']:<11} {' / '.join(f'{t:.2f}' for t in r['stage_ms']):>15} {r['ideal_req_s']:>7.1f}   {eff(e['pipeline']):>27} "
            f"{eff(e['pinned']):>7} {eff(e['polling']):>9}   {r['hardware_ceiling']:>10.3f} {r['runtime_share']:>7.3f}"
        )
    print(
        "(ideal = 1 / slowest stage alone, req/s; efficiency = pipeline throughput / ideal, goal >= 0.95, median of per-round\n"
        " ratios; caller: the thread feeding the pipeline, unpinned or pinned to the core of the stage with the most slack;\n"
        " + polling: pinned, with idle cores polling instead of halting (/dev/cpu_dma_latency at 0); hw ceiling: both stages\n"
        " running at once on their cores with no runtime, over ideal -- what the hardware allows; runtime: pinned / hw ceiling)"
    )
    for r in rows:
        rounds_text = ", ".join(f"{k} {v}" for k, v in r["efficiency_rounds"].items() if v)
        print(f"  {r['model']}: cut at {r['cut']}; per round: {rounds_text}; caller pinned to cores {r['caller_cores_rounds']}")
    print(f"\n{'model':<11} {'pipeline':>9} {'1 sess 1t':>9} {'1 sess 2t':>9} {'2 repl':>7}   pipeline / (1t, 2t, 2 replicas)   (req/s, caller unpinned)")
    for r in rows:
        t = r["req_s"]
        ratios = ", ".join(f"{t['pipeline'] / t[k]:.2f}" for k in ("one_1t", "one_2t", "replicas"))
        print(f"{r['model']:<11} {t['pipeline']:>9.1f} {t['one_1t']:>9.1f} {t['one_2t']:>9.1f} {t['replicas']:>7.1f}   {ratios}")


def _print_hop(hop: dict[str, Any], rounds: int, idle: str) -> None:
    lengths = hop["lengths"]
    print(
        f"\nper-hop overhead, {idle}: chains of {', '.join(map(str, lengths))} identity stages, one request at a time, medians of {rounds} "
        f"interleaved rounds; a line fitted to latency vs stages: per hop = slope - the stage alone ({hop['stage_alone_us']:.1f} us)"
    )
    print(f"{'placement':<10} {'latency us by stages':>28} {'per hop':>8} {'fixed':>7} {'floor hop':>10} {'floor fixed':>12}")
    for name, row in hop["placements"].items():
        lat = " / ".join(f"{row['latency_us'][n]:.0f}" for n in lengths)
        print(f"{name:<10} {lat:>28} {row['per_hop_us']:>8.1f} {row['fixed_us']:>7.1f} {row['floor_per_hop_us']:>10.1f} {row['floor_fixed_us']:>12.1f}")
    print(
        "(us; per hop: goal <= 30 us; fixed: a request's own cost (input checks, future, in and out); floor: the same fit on a chain\n"
        " of threads passing an item through C SimpleQueues, pinned alike -- the OS's wake-up cost, which no runtime goes below;\n"
        " default: nothing pinned; one core: stages and caller on one core; two cores: consecutive stages on different cores)"
    )
    cost = hop["streaming_cost_per_request_us"]
    print(
        f"runtime cost per request when streaming through 2 identity stages (submit, 2 hand-overs, future; GIL-serialized): "
        f"{cost:.1f} us, a ceiling of {1e6 / cost:.0f} req/s for stages that do nothing"
    )


def _figures(result: dict[str, Any]) -> dict[str, float | None]:
    """The figures ``--against`` compares, from one round's JSON result."""
    out: dict[str, float | None] = {}
    for r in result["models"]:
        out[f"{r['model']}: efficiency, caller unpinned"] = r["efficiency"]["pipeline"]
        out[f"{r['model']}: efficiency, caller pinned"] = r["efficiency"]["pinned"]
        out[f"{r['model']}: pipeline req/s, caller unpinned"] = r["req_s"]["pipeline"]
    for idle, hop in (("", result["hop"]), ("idle polling, ", result["hop_idle_polling"])):
        for name, row in (hop["placements"].items() if hop else ()):
            out[f"{idle}hop, {name}: per hop us"] = row["per_hop_us"]
            for n in (hop["lengths"][0], hop["lengths"][-1]):  # the fit's ends, each a measured latency (its intercept is too noisy to pair)
                out[f"{idle}hop, {name}: latency {n} stage{'s' if n > 1 else ''} us"] = row["latency_us"][str(n)]
        if hop:
            out[f"{idle}streaming cost per request us"] = hop["streaming_cost_per_request_us"]
    return out


def against(rev: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """This checkout beside ``rev``, ``args.rounds`` interleaved rounds of one process each
    (``benchmarks._checkout``); each model is cut where the first round cut it, on both sides."""
    child = ["--models", *args.models, "--requests", str(args.requests), "--hop-requests", str(args.hop_requests)]
    child += [a for c in args.cut for a in ("--cut", c)]

    def cuts(result: dict[str, Any]) -> list[str]:
        return [a for r in result["models"] for a in ("--cut", f"{r['model']}={','.join(r['cut'])}")]

    with checkout(rev) as old:
        samples = interleaved("benchmarks.pipeline_efficiency", child, old, rev, args.rounds, _figures, cuts)
    return compare(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["shufflenet", "squeezenet", "resnet50"])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--hop-requests", type=int, default=2000, help="requests per chain and round for the per-hop overhead")
    parser.add_argument("--cut", action="append", default=[], metavar="MODEL=TENSOR[,TENSOR...]",
                        help="split MODEL at these tensors instead of the most balanced candidate timed here (repeatable)")
    parser.add_argument("--against", metavar="REV", help="measure this checkout beside git revision REV, rounds interleaved, and print new / old")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cuts = dict(c.split("=", 1) for c in args.cut)
    if args.against:
        compared = against(args.against, args)
        report(compared, args.against, args.rounds, args.json, "(us: lower is faster; efficiency and req/s: higher is better)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = [bench_model(m, args.requests, args.rounds, work, cuts[m].split(",") if m in cuts else None) for m in args.models]
        hop = bench_hop(args.hop_requests, args.rounds, work)
        with _idle_polling() as polling:
            hop_polling = bench_hop(args.hop_requests, args.rounds, work) if polling else None
    if args.json:
        cores = len(os.sched_getaffinity(0))
        print(json.dumps({"models": rows, "hop": hop, "hop_idle_polling": hop_polling, "cores": cores, "threads": threading.active_count()}, indent=2))
        return
    print(f"cores: {len(os.sched_getaffinity(0))}; onnxruntime {ort.__version__}")
    if rows:
        _print_models(rows, args.rounds, args.requests)
    _print_hop(hop, args.rounds, "the host's idle as it is")
    if hop_polling is None:
        print("(idle cores polling: not measured, /dev/cpu_dma_latency is not writable here)")
    else:
        _print_hop(hop_polling, args.rounds, "idle cores polling instead of halting (/dev/cpu_dma_latency held at 0)")


if __name__ == "__main__":
    main()
