"""Human-readable output of the commands, with rich tables.

Every name from a model is printed as :class:`rich.text.Text`, never as markup: tensor names may hold
``[`` and ``]``.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from onnxpipe.runtime import TensorSpec
from onnxpipe.splitter import ModelSummary, SplitPlan, VerifyReport

__all__ = ["human_bytes", "model_summary", "split_plan", "verify_report"]

_SHOWN_NAMES = 3  # boundary tensors listed per table cell before "+N more"
_CANDIDATE_COLUMNS_WIDTH = 50  # the candidate table without its --at column, borders included


def _console() -> Console:
    # Created per call so that it writes to the sys.stdout of the moment (click's test runner swaps it).
    return Console(highlight=False)


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


def _line(console: Console, text: str) -> None:
    """Plain text, never hard-wrapped: paths, names and commands stay whole for copying."""
    console.print(Text(text), soft_wrap=True)


def _notes(console: Console, notes: Iterable[str]) -> None:
    for note in notes:
        _line(console, f"note: {note}")


def split_plan(plan: SplitPlan, folder: Path) -> None:
    """One row per stage, the notes, and the files written."""
    console = _console()
    table = Table(title=f"{len(plan.stages)} stages")
    for column in ("stage", "nodes", "weights", "inputs", "outputs", "bytes in", "bytes out"):
        table.add_column(column, justify="left" if column in ("stage", "inputs", "outputs") else "right", overflow="fold")
    for s in plan.stages:
        table.add_row(
            Text(s.name), str(s.nodes), human_bytes(s.weights_bytes), _names(s.inputs), _names(s.outputs), human_bytes(s.bytes_in), human_bytes(s.bytes_out)
        )
    console.print(table)
    _notes(console, plan.notes)
    files = sorted(p.name for p in folder.iterdir())
    _line(console, f"wrote {folder}: {', '.join(files)}")


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
    console.print(ops)
    if not summary.candidates:
        _line(console, "no cut candidates (too few compute nodes, or --top 0)")
    else:
        ats = [shlex.quote(c.at) for c in summary.candidates]
        # Long --at values go below the table, one per line and never wrapped, so they copy whole.
        inline = max(len(a) for a in ats) + _CANDIDATE_COLUMNS_WIDTH <= console.width
        table = Table(title="cut candidates (fewest bytes crossing, spread over the model)")
        for column in ("#", "position", "before", "crossing", "tensors") + (("--at",) if inline else ()):
            table.add_column(column, justify="left" if column == "--at" else "right", no_wrap=True)
        for k, (c, at) in enumerate(zip(summary.candidates, ats, strict=True), 1):
            cells = [str(k), f"{c.position}/{summary.compute_nodes}", f"{c.fraction:.0%}", human_bytes(c.bytes), str(len(c.tensors))]
            table.add_row(*cells, *([Text(at)] if inline else []))
        console.print(table)
        if not inline:
            for k, at in enumerate(ats, 1):
                _line(console, f"  #{k}: --at {at}")
        middle = min(summary.candidates, key=lambda c: (abs(c.fraction - 0.5), c.bytes))
        example = f"onnxpipe split {shlex.quote(str(model))} -o {shlex.quote(model.stem + '_split')} --at {shlex.quote(middle.at)}"
        _line(console, "e.g. two stages at the candidate nearest the middle:")
        _line(console, f"  {example}")
    _notes(console, summary.notes)


def verify_report(report: VerifyReport) -> None:
    """One row per compared tensor, the notes, and the verdict."""
    console = _console()
    table = Table(title=f"split vs whole model ({report.samples} sample(s), rtol={report.rtol:g}, atol={report.atol:g})")
    for column in ("tensor", "kind", "shape", "max abs err", "max rel err", "ok"):
        table.add_column(column, justify="right" if column.startswith("max") else "left")
    for r in report.rows:
        verdict = Text("ok", style="green") if r.ok else Text("FAIL" + (f": {r.problem}" if r.problem else ""), style="bold red")
        table.add_row(Text(r.tensor), r.kind, str(list(r.shape)), f"{r.max_abs:.3g}", f"{r.max_rel:.3g}", verdict)
    console.print(table)
    _notes(console, report.notes)
    if report.ok:
        _line(console, f"ok: all {len(report.rows)} tensor(s) within tolerance")
