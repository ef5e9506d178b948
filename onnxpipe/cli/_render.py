"""Human-readable output of the commands, with rich tables.

Every name from a model is printed as :class:`rich.text.Text`, never as markup: tensor names may hold
``[`` and ``]``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from onnxpipe.builder import BuildResult
from onnxpipe.cli._stageopts import format_cores
from onnxpipe.planner import PlanChoice, PlanResult
from onnxpipe.runtime import (
    PROVIDER_ALIASES,
    BenchReport,
    Bundle,
    Endpoint,
    PipelineSpec,
    ReferenceCheck,
    StageSettings,
    StageSpec,
    StateLink,
    StreamBench,
    TensorSpec,
    code_entries,
)
from onnxpipe.splitter import ModelSummary, SplitPlan, VerifyReport

if TYPE_CHECKING:
    from onnxpipe.runtime import PipelineStats

__all__ = [
    "bench_report",
    "build_result",
    "bundle_summary",
    "cost_profile",
    "exported",
    "human_bytes",
    "load_plans",
    "model_summary",
    "plan_result",
    "reference_checks",
    "run_summary",
    "split_plan",
    "stage_module_bytes",
    "verify_report",
]

_SHOWN_NAMES = 3  # boundary tensors listed per table cell before "+N more"
_UNBOUNDED = 1 << 20  # wide enough for any table: measuring a table at this width gives its natural width
_SHOWN_NODES = 15  # costliest nodes listed by inspect --profile (--json lists them all)
_SHOWN_UNMEASURED = 5  # plans listed beyond the measured ones, best predicted first
_BASELINE_NAMES = {"session": "one session", "replicas": "replicas of the whole model"}


def _console() -> Console:
    # Created per call so that it writes to the sys.stdout of the moment (click's test runner swaps it).
    console = Console(highlight=False)
    # Not a terminal (a file, a pipe, a CI log): no width to fit, tables take their natural width (Note: tables).
    return console if console.is_terminal else Console(highlight=False, width=_UNBOUNDED)


def human_bytes(n: int | None) -> str:
    """``1536 -> '1.5 KiB'``; ``None`` (a size that depends on an unknown dim) -> ``'?'``."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _names(specs: Iterable[TensorSpec]) -> Text:
    names = [t.name for t in specs]
    more = f" +{len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else ""
    return Text(", ".join(names[:_SHOWN_NAMES]) + more)


def _table(console: Console, table: Table) -> None:
    """Print a table without ever breaking a name or dropping a column (see Note: tables).

    Note: tables.
        Tensor and node names are long (``/model/layers.11/self_attn/Reshape_3_output_0``) and are
        copied from the output into commands, so no cell is ever wrapped, cropped or dropped. Written
        to a file or a pipe (CI logs, ``make demo > log``) a table takes its natural width, however
        wide. On a terminal too narrow for it, each row is folded into lines of ``column: value``.
    """
    if console.measure(table, options=console.options.update(max_width=_UNBOUNDED)).maximum <= console.width:
        console.print(table)
        return
    if table.title:
        _line(console, str(table.title))
    headers = [str(column.header) for column in table.columns]
    for row in zip(*(list(column.cells) for column in table.columns), strict=True):
        first, *rest = (_plain(console, cell) for cell in row)
        _line(console, f"- {headers[0]}: {first}")
        for header, value in zip(headers[1:], rest, strict=True):
            _line(console, f"    {header}: {value}")


def _plain(console: Console, cell: object) -> str:
    return cell.plain if isinstance(cell, Text) else console.render_str(str(cell)).plain


def _line(console: Console, text: str) -> None:
    """Plain text, never hard-wrapped: paths, names and commands stay whole for copying."""
    console.print(Text(text), soft_wrap=True)


def _notes(console: Console, notes: Iterable[str]) -> None:
    for note in notes:
        _line(console, f"note: {note}")


def split_plan(plan: SplitPlan, folder: Path, threads: int | None = None) -> None:
    """One row per stage (with its predicted time when the policy predicts times), what the
    automatic policy decided, the notes, and the files written. ``threads``: profiled with that many."""
    console = _console()
    timed = any(s.predicted_seconds is not None for s in plan.stages)
    table = Table(title=f"{len(plan.stages)} stages")
    # "pred. ms", not "predicted ms": eight columns must fit 80 characters without folding a word.
    for column in ("stage", "nodes", "weights", "inputs", "outputs", "bytes in", "bytes out") + (("pred. ms",) if timed else ()):
        table.add_column(column, justify="left" if column in ("stage", "inputs", "outputs") else "right", overflow="fold")
    for s in plan.stages:
        predicted = [_ms(1e3 * s.predicted_seconds) if s.predicted_seconds is not None else "-"] if timed else []
        table.add_row(
            Text(s.name),
            str(s.nodes),
            human_bytes(s.weights_bytes),
            _names(s.inputs),
            _names(s.outputs),
            human_bytes(s.bytes_in),
            human_bytes(s.bytes_out),
            *predicted,
        )
    _table(console, table)
    if plan.auto is not None:
        _line(console, _auto_summary(plan, threads))
    kept = {link.input: link.stage for link in plan.config.states}
    for pair in plan.states:
        _line(console, f"state: {pair}, kept in {kept[pair.input]}")
    for flag in plan.spec.step_flags:
        _line(console, f"step flag: {flag}: fed by the runtime, no pipeline input")
    _notes(console, plan.notes)
    files = sorted(p.name for p in folder.iterdir())
    _line(console, f"wrote {folder}: {', '.join(files)}")


def _auto_summary(plan: SplitPlan, threads: int | None) -> str:
    """``policy 'measured', costs measured with 1 thread(s); bottleneck stage1, 2.77 ms predicted; 794 KiB cross ...``."""
    auto = plan.auto
    assert auto is not None
    costs = {
        "measured": f"measured{f' with {threads} thread(s)' if threads else ''}",
        "analytic": "analytic estimates (FLOPs and bytes: good for balancing, not for predicting seconds)",
    }.get(auto.source, auto.source)
    parts = [f"policy '{auto.policy}', costs: {costs}"]
    if auto.predicted_seconds:
        slow = max(range(len(auto.predicted_seconds)), key=auto.predicted_seconds.__getitem__)
        parts.append(f"bottleneck {plan.stages[slow].name}, {_ms(1e3 * auto.predicted_seconds[slow])} ms predicted")
    parts.append(f"{human_bytes(auto.crossing_bytes)} cross the cuts per request")
    return "; ".join(parts)


def plan_result(result: PlanResult, folder: Path) -> None:
    """The plans considered, the chosen one against the baselines, its stages, and the files written."""
    console = _console()
    chosen = result.chosen
    shown = [c for c in result.candidates if c.measured is not None]
    shown += [c for c in result.candidates if c.measured is None][:_SHOWN_UNMEASURED]
    table = Table(title=f"plans for {result.cores} core(s): measured ones first, best first")
    for column in ("plan", "cores", "predicted req/s", "measured req/s", "rounds min-max", ""):
        table.add_column(column, justify="left" if column in ("plan", "") else "right")
    for c in shown:
        mark = Text("chosen", style="bold green") if c is chosen else Text("")
        median = f"{c.measured:.1f}" if c.measured is not None else "-"
        spread = f"{min(c.rounds):.1f}-{max(c.rounds):.1f}" if c.rounds else "-"
        table.add_row(Text(c.label), str(c.cores), f"{c.predicted:.1f}", median, spread, mark)
    _table(console, table)
    if len(result.candidates) > len(shown):
        _line(console, f"  ... and {len(result.candidates) - len(shown)} more plan(s) predicted slower, not measured")
    over = f"median of {result.choice.rounds} round(s)"
    _line(console, f"chosen: {chosen.label}, {chosen.measured or 0:.1f} req/s measured, {over} ({chosen.predicted:.1f} predicted)")
    _line(console, f"certainty: {result.choice}")
    for reason in result.choice.reasons() if isinstance(result.choice, PlanChoice) else ():
        _line(console, f"  {reason}")
    if result.batching:
        _line(console, f"batching: {result.batching}")
    for kind, value in result.baselines().items():
        if value:
            _line(console, f"  {(chosen.measured or 0) / value:.2f}x the best {_BASELINE_NAMES.get(kind, kind)} ({value:.1f} req/s measured)")
    stages = Table(title="chosen plan, stage by stage")
    for column in ("stage", "nodes", "threads", "replicas", "cores", "predicted ms", "measured ms"):
        stages.add_column(column, justify="left" if column in ("stage", "cores") else "right")
    measured = chosen.stage_measured_ms or (None,) * len(chosen.stage_predicted_ms)
    for s, config, predicted, actual in zip(result.plan.stages, result.plan.config.stages, chosen.stage_predicted_ms, measured, strict=True):
        st = config.settings
        cells = [
            str(s.nodes),
            _threads(st.intra_op_threads, 1),
            str(st.replicas),
            format_cores(st.affinity),
            _ms(predicted),
            _ms(actual) if actual is not None else "-",
        ]
        stages.add_row(Text(s.name), *cells)
    _table(console, stages)
    _notes(console, [*result.notes, *result.plan.notes])
    files = sorted(p.name for p in folder.iterdir())
    _line(console, f"wrote {folder}: {', '.join(files)} (stage settings in pipeline.json)")
    _line(console, f"next: onnxpipe build {shlex.quote(str(folder))} -o {shlex.quote(str(folder) + '_built')}")


def load_plans(result: PlanResult, folder: Path) -> None:
    """``split --auto --cores C --concurrency N[,N...]``: every finalist's req/s, p50 and p99 at each N, the plan
    chosen for each N and why, its stages, and the folders written."""
    console = _console()
    header, rows = result.load_table()
    first = result.loads[0].choice
    title = (f"plans for {result.cores} core(s) under N requests in flight (closed loop): median of {first.rounds} round(s) "
             f"of {first.requests} requests at each N, the rounds' min-max in brackets")
    table = Table(title=title)
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if i in (0, len(header) - 1) else "right")
    for row in rows:
        table.add_row(Text(row[0]), *row[1:-1], Text(row[-1], style="bold green"))
    _table(console, table)
    for load in result.loads:
        _line(console, str(load.choice))
    stages = Table(title="chosen plans, stage by stage")
    for column in ("N", "stage", "nodes", "threads", "spinning", "replicas", "cores", "max_batch"):
        stages.add_column(column, justify="left" if column in ("stage", "spinning", "cores") else "right")
    for load in result.loads:
        for s, config in zip(load.plan.stages, load.plan.config.stages, strict=True):
            st = config.settings
            batch = f"{st.max_batch}" + (f" (waits {st.max_delay_ms:g} ms)" if st.max_delay_ms else "")
            cells = (_threads(st.intra_op_threads, 1), "yes" if st.spinning else "no", str(st.replicas), format_cores(st.affinity), batch)
            stages.add_row(str(load.concurrency), Text(s.name), str(s.nodes), *cells)
    _table(console, stages)
    _notes(console, dict.fromkeys([*result.notes, *(n for load in result.loads for n in load.plan.notes)]))
    folders = result.folders(folder)
    for n, path in folders.items():
        files = sorted(p.name for p in path.iterdir())
        _line(console, f"wrote {path} (the plan for N={n}): {', '.join(files)} (stage settings in pipeline.json)")
    if len(folders) > 1:
        _line(console, f"wrote {folder / 'summary.json'}: every finalist's figures at each N, and each N's choice")
    for path in folders.values():
        _line(console, f"next: onnxpipe build {shlex.quote(str(path))} -o {shlex.quote(str(path) + '_built')}")


def cost_profile(report: Mapping[str, Any], model: Path) -> None:
    """``inspect --profile``: the costliest nodes, then the best cut for each number of stages."""
    console = _console()
    total_ms = report["total_ms"]
    how = f"{report['source']}, {report['threads']} thread(s)" + (f", median of {report['runs']} runs" if report["runs"] else "")
    _line(console, f"node costs ({how}): one run of the whole model takes {_ms(total_ms)} ms")
    nodes = report["nodes"]
    table = Table(title=f"costliest nodes ({min(len(nodes), _SHOWN_NODES)} of the {len(nodes)} with a cost of their own)")
    for column in ("node", "op", "ms", "share"):
        table.add_column(column, justify="left" if column in ("node", "op") else "right", overflow="fold")
    for n in nodes[:_SHOWN_NODES]:
        table.add_row(Text(n["node"]), Text(n["op"]), _ms(n["ms"]), f"{n['share']:.1%}")
    _table(console, table)
    rest = nodes[_SHOWN_NODES:]
    if rest:
        _line(console, f"  ... and {len(rest)} more node(s): {sum(n['share'] for n in rest):.1%} of the time")
    cuts = [c for c in report["splits"] if "error" not in c]
    if cuts:
        table = Table(title="best cut by measured cost, per number of stages")
        for column in ("stages", "predicted ms per stage", "slowest", "crossing", "speedup at most"):
            table.add_column(column, justify="left" if column.startswith("predicted") else "right")
        for c in cuts:
            spread = ", ".join(_ms(ms) for ms in c["stage_ms"])
            bound = f"{c['speedup_bound']:.2f}x" if c["speedup_bound"] is not None else "-"
            table.add_row(str(c["stages"]), spread, c["bottleneck_stage"], human_bytes(c["crossing_bytes"]), bound)
        _table(console, table)
        best = max(cuts, key=lambda c: c["speedup_bound"] or 0.0)
        _line(console, "speedup at most: whole-model run / slowest stage, the throughput a pipeline of that many stages can reach at best")
        _line(console, f"e.g. {best['stages']} stages cut there:")
        command = f"onnxpipe split {shlex.quote(str(model))} -o {shlex.quote(model.stem + '_split')} --auto --stages {best['stages']}"
        _line(console, f"  {command} --threads {report['threads']}")
    _notes(console, report["notes"])
    _notes(console, (f"no {c['stages']}-stage cut: {c['error']}" for c in report["splits"] if "error" in c))


def model_summary(summary: ModelSummary, model: Path) -> None:
    """The model's interface, nodes, weights and ops, then the cut candidates."""
    console = _console()
    opsets = ", ".join(f"{domain} {version}" for domain, version in summary.opsets.items())
    _line(console, f"model '{summary.name}' ({model}): IR version {summary.ir_version}, opsets {opsets}")
    for kind, specs in (("input ", summary.inputs), ("output", summary.outputs)):
        for t in specs:
            _line(console, f"  {kind}  {t}")
    _line(console, f"nodes: {summary.nodes} ({summary.compute_nodes} compute, {summary.weight_nodes} weight, {summary.dead_nodes} dead)")
    _line(
        console,
        f"weights: {human_bytes(summary.weights_bytes)} read by compute nodes, {human_bytes(summary.computed_weight_bytes)} of them "
        f"computed by weight nodes; the file stores {human_bytes(summary.initializer_bytes)} of initializers",
    )
    ops = Table(title="ops")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in summary.ops.items():
        ops.add_row(Text(op), str(count))
    _table(console, ops)
    if not summary.candidates:
        _line(console, "no cut candidates (too few compute nodes, or --top 0)")
    else:
        table = Table(title="cut candidates (fewest bytes crossing, spread over the model)")
        for column in ("#", "position", "before", "crossing", "tensors", "--at"):
            table.add_column(column, justify="left" if column == "--at" else "right", no_wrap=True)
        for k, c in enumerate(summary.candidates, 1):
            cells = [str(k), f"{c.position}/{summary.compute_nodes}", f"{c.fraction:.0%}", human_bytes(c.bytes), str(len(c.tensors))]
            table.add_row(*cells, Text(shlex.quote(c.at)))
        _table(console, table)
        middle = min(summary.candidates, key=lambda c: (abs(c.fraction - 0.5), c.bytes))
        example = f"onnxpipe split {shlex.quote(str(model))} -o {shlex.quote(model.stem + '_split')} --at {shlex.quote(middle.at)}"
        _line(console, "e.g. two stages at the candidate nearest the middle:")
        _line(console, f"  {example}")
    _notes(console, summary.notes)


def verify_report(report: VerifyReport) -> None:
    """One row per compared tensor, the notes, and the verdict."""
    console = _console()
    ran = f"{report.samples} stream(s) of {report.steps} step(s)" if report.steps else f"{report.samples} sample(s)"
    table = Table(title=f"split vs whole model ({ran}, rtol={report.rtol:g}, atol={report.atol:g})")
    for column in ("tensor", "kind", "shape", "max abs err", "max rel err", "ok"):
        table.add_column(column, justify="right" if column.startswith("max") else "left")
    for r in report.rows:
        verdict = Text("ok", style="green") if r.ok else Text("FAIL" + (f": {r.problem}" if r.problem else ""), style="bold red")
        table.add_row(Text(r.tensor), r.kind, str(list(r.shape)), f"{r.max_abs:.3g}", f"{r.max_rel:.3g}", verdict)
    _table(console, table)
    _notes(console, report.notes)
    if report.ok:
        _line(console, f"ok: all {len(report.rows)} tensor(s) within tolerance")


def _threads(intra: int, inter: int) -> str:
    """``1``; ``2 +4 inter`` (inter-op threads); 0 is onnxruntime's default (all physical cores)."""
    text = "auto" if intra == 0 else str(intra)
    return text if inter == 1 else f"{text} +{'auto' if inter == 0 else inter} inter"


def _short_provider(provider: str) -> str:
    """``CPUExecutionProvider`` -> ``cpu``: the target alias, or the full name when there is none."""
    return next((alias for alias, full in PROVIDER_ALIASES.items() if full == provider), provider)


def _build_record(record: Mapping[str, object]) -> str:
    """``offline, extended``: optimized here for its provider; ``portable, at load``: its target optimizes it."""
    if not record:
        return "not built"
    if record.get("kind") == "code":
        return "code, nothing to build"
    if record.get("optimize_at_load"):
        return "portable, at load"
    return f"offline, {record.get('optimization')}" + (", ORT format" if record.get("format") == "ort" else "")


def build_result(result: BuildResult, notes: Iterable[str], next_step: str) -> None:
    """One row per stage, the notes, where the build went, and the command to run next."""
    console = _console()
    replicas = any(r.replicas != 1 for r in result.report)
    table = Table(title=f"built {len(result.report)} stage(s)")
    for column in ("stage", "target", "on host", "threads", "cores", *(("replicas",) if replicas else ()), "module", "optimized"):
        table.add_column(column, justify="right" if column in ("threads", "replicas", "module") else "left")
    for r in result.report:
        here = Text("yes", style="green") if r.available else Text("no", style="bold yellow")
        cells: list[Text | str] = [Text(r.stage), _short_provider(r.provider), here, _threads(r.intra_op_threads, r.inter_op_threads), format_cores(r.affinity)]
        cells += [str(r.replicas)] if replicas else []
        table.add_row(*cells, human_bytes(r.module_bytes), _build_record(result.spec.stage(r.stage).build))
    _table(console, table)
    for stage in result.spec.stages:
        if stage.batching is not None:
            delay = f", waiting up to {stage.settings.max_delay_ms:g} ms" if stage.settings.max_delay_ms else ""
            _line(console, f"stage '{stage.name}' batches up to {stage.settings.max_batch}{delay}: {stage.batching.describe()}")
    _notes(console, notes)
    _line(console, f"wrote {result.path}: pipeline.json and {len(result.report)} module(s) in stages/")
    _line(console, f"next: {next_step}")


def exported(path: Path, kind: str, nbytes: int, files: int, samples: int, source: str | None, notes: Iterable[str], flags: str = "") -> None:
    """Where the bundle is, what it is, and how to use it (``flags``: the ``--allow-code`` its code needs)."""
    console = _console()
    _notes(console, notes)
    if samples:
        reference = f"{samples} reference sample(s), outputs from {source or 'the pipeline itself'}"
    else:
        reference = "no reference samples"
    _line(console, f"wrote {path}: {kind}, {human_bytes(nbytes)}, {files} files; {reference}")
    _next_commands(console, path, samples, flags)


def rebundled(path: Path, kind: str, nbytes: int, files: int, samples: int, stages: Iterable[str], notes: Iterable[str], flags: str = "") -> None:
    """The new bundle, the settings of each stage in it, and how to use it."""
    console = _console()
    _notes(console, notes)
    _line(console, f"wrote {path}: {kind}, {human_bytes(nbytes)}, {files} files; pipeline.json rewritten, every other file copied as it was")
    for line in stages:
        _line(console, f"  {line}")
    _next_commands(console, path, samples, flags)


def _next_commands(console: Console, path: Path, samples: int, flags: str) -> None:
    quoted = shlex.quote(str(path)) + (f" {flags}" if flags else "")  # a bundle with code loads only with its --allow-code
    _line(console, f"run it:   onnxpipe run {quoted} --inputs INPUTS.npz --outputs OUTPUTS.npz")
    _line(console, f"time it:  onnxpipe bench {quoted}")
    if samples:
        _line(console, f"check it: onnxpipe verify {quoted}")


def run_summary(stats: PipelineStats, stages: int, outputs: Mapping[str, Any], written: str, trace: Path | None) -> None:
    """The run's numbers, what one request gives, and where the files went."""
    console = _console()
    _line(
        console,
        f"ran {stats.completed} request(s) through {stages} stage(s): {stats.throughput:.1f} req/s, "
        f"latency p50 {stats.latency_p50_ms:.2f} ms, p99 {stats.latency_p99_ms:.2f} ms; bottleneck: stage '{stats.bottleneck}'",
    )
    tensors = ", ".join(f"{name}: {getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', ()))}" for name, v in outputs.items())
    _line(console, f"outputs{' (first request)' if stats.completed > 1 else ''}: {tensors}")
    _line(console, f"wrote {written}")
    _timeline(console, trace)


def bench_report(report: BenchReport, warmup: int, notes: Iterable[str], trace: Path | None) -> None:
    """Throughput and latency against the ideal, then one row per stage: alone and in the pipeline."""
    console = _console()
    measured = report.ideal_throughput is not None and report.efficiency is not None
    if report.streams is not None:
        _stream_lines(console, report.streams, report.seconds, warmup)
    else:
        _line(console, f"{report.requests} request(s) in {report.seconds:.2f} s after {warmup} warm-up request(s)")
        ideal = f" (ideal {report.ideal_throughput:.1f} req/s: efficiency {report.efficiency:.0%})" if measured else ""
        _line(console, f"throughput: {report.throughput:.1f} req/s{ideal}")
        _line(console, f"latency:    mean {report.latency_mean_ms:.2f} ms, p50 {report.latency_p50_ms:.2f} ms, p99 {report.latency_p99_ms:.2f} ms")
    if report.caller_cores is not None:
        _line(console, f"the thread feeding the pipeline ran on core(s) {', '.join(map(str, report.caller_cores))}")
    if report.resident_bytes is not None:
        _line(console, f"memory:     {human_bytes(report.resident_bytes)} resident in this process (the pipeline and all else it holds)")
    table = Table(title="stages")
    batching = any(s.batch_sizes for s in report.stages)
    streams = report.streams is not None
    timing = ("calls",) if streams else ("alone ms",)  # stages with state are not timed alone
    for column in ("stage", "replicas", "threads", "cores", *timing, "in pipeline ms", *(("batch mean", "max") if batching else ()), "utilization", ""):
        table.add_column(column, justify="left" if column in ("stage", "") else "right")
    for s in report.stages:
        mark = Text("bottleneck", style="bold yellow") if s.stage == report.bottleneck else Text("")
        batch = (f"{s.batch_mean:.2f}", str(max(s.batch_sizes, default=1))) if batching else ()
        cores = ",".join(map(str, s.affinity)) if s.affinity is not None else "any"
        alone = str(s.calls) if streams else _ms(s.standalone_ms) if measured else "-"
        table.add_row(Text(s.stage), str(s.replicas), str(s.intra_op_threads), cores, alone, _ms(s.pipeline_mean_ms),
                      *batch, f"{s.utilization:.0%}", mark)
    _table(console, table)
    _notes(console, notes)
    _timeline(console, trace)


def _stream_lines(console: Console, streams: StreamBench, seconds: float, warmup: int) -> None:
    """The head of ``bench``'s report on a pipeline with state: its streams' steps."""
    tokens = "tokens/s" if streams.prompt else "steps/s"
    each = f"a prompt of {streams.prompt} token(s) then {streams.steps} one-token step(s)" if streams.prompt else f"{streams.steps + 1} step(s)"
    warm = f"after a warm-up round of {min(warmup, streams.steps)} step(s)" if warmup else "without warm-up"
    _line(console, f"{streams.streams} stream(s) stepping together, each {each}, in {seconds:.2f} s {warm}")
    _line(console, f"throughput: {streams.steps_per_s:.1f} {tokens} (steps of all streams per second)")
    _line(console, f"first step: p50 {streams.first_step_p50_ms:.2f} ms, p99 {streams.first_step_p99_ms:.2f} ms")
    _line(console, f"per step:   mean {streams.step_mean_ms:.2f} ms, p50 {streams.step_p50_ms:.2f} ms, p99 {streams.step_p99_ms:.2f} ms (after the first)")


def _timeline(console: Console, trace: Path | None) -> None:
    if trace is not None:
        _line(console, f"wrote timeline {trace} (open it in https://ui.perfetto.dev or chrome://tracing)")


def _ms(value: float) -> str:
    """Milliseconds with two decimals, or three significant digits below 0.1 ms."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3g}"


def reference_checks(rows: list[ReferenceCheck], rtol: float, atol: float) -> None:
    """One row per output per stored reference sample, and the verdict."""
    console = _console()
    samples = len({r.sample for r in rows})
    table = Table(title=f"stored reference, {samples} sample(s)")
    for column in ("sample", "output", "max abs err", "ok"):
        table.add_column(column, justify="right" if column in ("sample", "max abs err") else "left")
    for r in rows:
        verdict = Text("ok", style="green") if r.ok else Text("FAIL" + (f": {r.problem}" if r.problem else ""), style="bold red")
        table.add_row(str(r.sample), Text(r.output), f"{r.max_abs:.3g}", verdict)
    _table(console, table)
    if all(r.ok for r in rows):
        _line(console, f"ok: all {len(rows)} output(s) within rtol={rtol:g} atol={atol:g}")


#: A code stage's param shown in full up to this many characters of JSON; longer ones are summarised.
PARAM_CHARS = 80


def summarize_params(params: Mapping[str, Any]) -> str:
    """A code stage's params for a person: each value as JSON when short, else what it is and how
    big (``character: list of 18708 (str), ["　", "一", ...]``); ``inspect --json`` gives them whole."""
    parts = []
    for key in sorted(params):
        value = params[key]
        text = json.dumps(value, ensure_ascii=False)
        if len(text) > PARAM_CHARS:
            if isinstance(value, list):
                kinds = sorted({type(v).__name__ for v in value})
                head = json.dumps(value[:3], ensure_ascii=False)[:-1]
                text = f"list of {len(value)} ({', '.join(kinds)}), {head}, ...]"
            elif isinstance(value, dict):
                text = f"table of {len(value)} keys ({', '.join(repr(k) for k in list(value)[:3])}{', ...' if len(value) > 3 else ''})"
            else:
                text = f"{text[:PARAM_CHARS]}... ({len(text)} characters)"
        parts.append(f"{key}: {text}")
    return "{" + ", ".join(parts) + "}"


def placement(bundle: Bundle, where: Mapping[str, Mapping[str, Sequence[str]] | None]) -> None:
    """Which provider takes each stage's nodes on this host (``inspect BUNDLE --host``)."""
    import onnxruntime as ort

    from onnxpipe.runtime._distributions import conflict

    console = _console()
    _line(console, f"on this host (onnxruntime {ort.__version__}, providers {', '.join(ort.get_available_providers())}):")
    two = conflict()  # asked for: the host's own onnxruntime, so say when two builds lie over each other
    if two:
        _line(console, f"  warning: {two}")
    for stage in bundle.spec.stages:
        nodes = where.get(stage.name)
        if stage.is_code:
            _line(console, f"  {stage.name}: code, no nodes")
        elif nodes is None:
            _line(console, f"  {stage.name}: this onnxruntime cannot say which provider takes which node")
        else:
            parts = []
            for ep, names in nodes.items():
                fell = ep == "CPUExecutionProvider" and stage.settings.provider != ep
                parts.append(f"{ep} {len(names)}" + (f" (fell back: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if fell else ""))
            _line(console, f"  {stage.name}: {', '.join(parts)}")


def _settings(st: StageSettings) -> str:
    parallel = st.execution_mode == "parallel"
    parts = [st.target, f"threads {_threads(st.intra_op_threads, st.inter_op_threads if parallel else 1)}", f"cores {format_cores(st.affinity)}"]
    parts += [f"{st.replicas} replica(s)", f"opt {st.optimization}"]
    if st.max_batch > 1:
        parts.append(f"max_batch {st.max_batch}" + (f", max_delay_ms {st.max_delay_ms:g}" if st.max_delay_ms else ""))
    parts += ["parallel"] * parallel + ["spinning"] * st.spinning + ["no cpu fallback"] * (not st.fallback)
    if st.provider_options:
        parts.append("options " + " ".join(f"{k}={v}" for k, v in sorted(st.provider_options.items())))
    return ", ".join(parts)


def _build_detail(stage: StageSpec) -> str:
    record = stage.build
    if not record:
        return "not built"
    if record.get("kind") == "code":
        return "code, nothing to build"
    if record.get("optimize_at_load"):
        return f"portable ({record.get('optimization')}); {stage.settings.provider} optimizes it at load"
    fmt = ", ORT format" if record.get("format") == "ort" else ""
    return f"optimized offline for {record.get('optimized_for')} ({record.get('optimization')}{fmt})"


def stage_module_bytes(bundle: Bundle, stage: StageSpec) -> int:
    """The stage's module file and its external-data files (``<module>.*``), as the manifest lists them."""
    module = stage.module
    if module is None:
        return 0  # a code stage has no file
    return sum(e.size for p, e in bundle.manifest.files.items() if p == module or p.startswith(module + "."))


def _state_source(link: StateLink) -> str:
    start = "" if link.empty_axis is None else f"; starts empty along axis {link.empty_axis}"
    return f"state {link.output} ({'set once, by the first step' if link.once else 'previous step'}{start})"


def _source(spec: PipelineSpec, stage: str, port: str, state_in: Mapping[str, StateLink]) -> str:
    """What feeds a stage's input, as ``inspect`` shows it: its state, a step flag, or a link's source."""
    if port in state_in:
        return _state_source(state_in[port])
    flag = next((f for f in spec.flags_of(stage) if f.input == port), None)
    if flag is not None:
        return f"step flag ({flag.first} on a stream's first step, {not flag.first} after)"
    return str(spec.source_of(Endpoint(stage, port)))


def bundle_summary(bundle: Bundle, path: Path, kind: str, nbytes: int, files: int) -> None:
    """The manifest, the stages and their settings, the wiring, param groups and reference."""
    console = _console()
    spec, manifest = bundle.spec, bundle.manifest
    name = spec.metadata.get("name", "pipeline")
    _line(console, f"bundle '{name}' ({path}): {kind}, {human_bytes(nbytes)}, {files} files; all {len(manifest.files)} files match their sha256")
    versions = ", ".join(f"{k} {v}" for k, v in manifest.versions.items())
    opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in manifest.opsets.items())
    _line(console, f"made {manifest.created or '(no date)'} with {versions or '(no versions recorded)'}")
    _line(console, f"opsets: {opsets or '-'}; providers: {', '.join(manifest.providers) or '-'}")
    for kind_, specs in (("input ", spec.inputs), ("output", spec.outputs)):
        for t in specs:
            _line(console, f"  {kind_}  {t}")
    by_src: dict[Endpoint, list[Endpoint]] = {}
    for link in spec.links:
        by_src.setdefault(link.src, []).append(link.dst)
    for k, s in enumerate(spec.stages):
        if s.code is not None:
            _line(console, f"stage {k} '{s.name}': code {s.code.entry}, params {summarize_params(s.code.params)}")
        else:
            _line(console, f"stage {k} '{s.name}': {s.module}, {human_bytes(stage_module_bytes(bundle, s))}")
            _line(console, f"  settings: {_settings(s.settings)}")
            _line(console, f"  build:    {_build_detail(s)}")
            if s.batching is not None and s.settings.max_batch > 1:
                _line(console, f"  batching: {s.batching.describe()}")
        if s.first_step_only:
            _line(console, "  runs:     on a stream's first step only (the later stages keep what it made)")
        states, kept = spec.states_of(s.name), spec.kept_inputs(s.name)
        state_in, state_out = {st.input: st for st in states}, {st.output: st for st in states}
        for t in s.inputs:
            note = "  (kept from the stream's first step)" if t.name in kept else ""
            _line(console, f"  in  {t}  <- {_source(spec, s.name, t.name, state_in)}{note}")
        for t in s.outputs:
            targets = [str(d) for d in by_src.get(Endpoint(s.name, t.name), [])]
            if t.name in state_out:  # kept in the stage for the stream's next step, which no link shows
                targets.append(f"state of {state_out[t.name].input} ({'first step only' if state_out[t.name].once else 'next step'})")
            _line(console, f"  out {t}  -> {', '.join(targets) or 'unused'}")
    for link in spec.links:
        if link.src.stage is None and link.dst.stage is None:
            _line(console, f"direct: {link}")
    if spec.param_groups:
        for g in spec.param_groups:
            _line(console, f"param group '{g.name}' -> stage '{g.stage}': {', '.join(t.name for t in g.params)}")
    else:
        _line(console, "param groups: none")
    _notes(console, (f"stage '{s.name}': {s.build['note']}" for s in spec.stages if s.build.get("note")))
    code = code_entries(spec)
    if code:
        _line(console, "code this bundle would run (loading needs --allow-code / allow_code matching each; the code must be installed here):")
        for stage, kind, name in code:
            _line(console, f"  stage '{stage}': {'custom-op library of package ' if kind == 'custom_ops' else 'entry point '}{name}")
    else:
        _line(console, "code: none (ONNX stages only)")
    if manifest.reference:
        _line(console, f"reference: {len(manifest.reference)} sample(s) stored; onnxpipe verify {shlex.quote(str(path))} checks them")
    else:
        _line(console, "reference: none stored (onnxpipe verify needs --model for this bundle)")
