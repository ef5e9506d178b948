"""The click group and its commands: parse options, call one library function, print.

Note: exit codes.
    0 on success; 1 for a user error (any :class:`~onnxpipe.OnnxpipeError`, printed as one line
    ``error: <message>`` on stderr) and for a ``verify`` past its tolerance; 2 for a usage error
    (click's own: unknown option, malformed value, conflicting options). Any other exception is a
    bug and keeps its traceback.

Heavy modules (onnx, onnxruntime, numpy, rich) are imported inside the command functions so that
``onnxpipe --help`` imports none of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import click

from onnxpipe import __version__
from onnxpipe._errors import OnnxpipeError

__all__ = ["UserError", "main"]


class UserError(click.ClickException):
    """A user error: one line ``error: <message>`` on stderr, exit code 1."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split("\n")))

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True, file=file)


class _Group(click.Group):
    """Turns every :class:`OnnxpipeError` a command raises into a :class:`UserError`."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OnnxpipeError as e:
            raise UserError(str(e)) from e


class _DimType(click.ParamType):
    name = "NAME=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        name, sep, size = str(value).partition("=")
        if not sep or not name.strip():
            self.fail(f"{value!r} is not NAME=VALUE (e.g. batch=8)", param, ctx)
        try:
            number = int(size)
        except ValueError:
            self.fail(f"{value!r}: the size must be an integer, got {size!r}", param, ctx)
        if number < 1:
            self.fail(f"{value!r}: the size must be at least 1", param, ctx)
        return name.strip(), number


class _OpIndexType(click.ParamType):
    name = "OP:INDEX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        op, sep, index = str(value).rpartition(":")
        if not sep or not op:
            self.fail(f"{value!r} is not OP:INDEX (e.g. Conv:3, the 4th Conv node)", param, ctx)
        try:
            return op, int(index)
        except ValueError:
            self.fail(f"{value!r}: the index must be an integer, got {index!r}", param, ctx)


_DIM = click.option(
    "--dim",
    "dims",
    type=_DimType(),
    multiple=True,
    help="Size of a symbolic dim, e.g. --dim batch=8 (repeatable; dims not given count as 1).",
)
_MODEL_ARG = click.Path(dir_okay=False, path_type=Path)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="onnxpipe")
def main() -> None:
    """Split ONNX models into pipeline stages, inspect where to cut, verify the split.

    \b
    Typical session:
      onnxpipe inspect model.onnx                      # where is it cheap to cut?
      onnxpipe split model.onnx -o out --at t1 --at t2 # three stages, files in out/
      onnxpipe verify out --model model.onnx           # stages chained == whole model?
    """


@main.command()
@click.argument("model", type=_MODEL_ARG)
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder to write the stages and pipeline.json to.")
@click.option(
    "--at",
    "at",
    multiple=True,
    metavar="NAME[,NAME...]",
    help="Cut after this tensor or node; commas make one cut crossed by several tensors. Repeat for more cuts, in pipeline order.",
)
@click.option(
    "--at-op",
    "at_op",
    multiple=True,
    type=_OpIndexType(),
    help="Cut after the INDEX-th (from 0) node of op type OP in topological order, e.g. Conv:3. Repeatable.",
)
@click.option(
    "--assign",
    "assign",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.json",
    help='Explicit stage per node: a JSON object {"node name": stage, ...}.',
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists and is not empty.")
def split(model: Path, out: Path, at: Sequence[str], at_op: Sequence[tuple[str, int]], assign: Path | None, overwrite: bool) -> None:
    """Split MODEL into stages and write them, with their wiring, to OUT.

    Give the cuts with exactly one of --at, --at-op or --assign (they cannot be mixed, since cuts
    must be given in pipeline order). N cuts make N+1 stages: stage 0 holds everything the first
    cut's tensors depend on, and so on; the last stage holds the rest.

    \b
    Examples:
      onnxpipe split resnet50.onnx -o out --at r88 --at r128
      onnxpipe split model.onnx -o out --at a,b --at c        # 3 stages; a and b cross the first cut
      onnxpipe split model.onnx -o out --at-op Conv:10 --at-op Conv:20
      onnxpipe split model.onnx -o out --assign stages.json --overwrite

    `onnxpipe inspect MODEL` proposes cuts with the exact --at value to use.
    """
    given = [flag for flag, value in (("--at", at), ("--at-op", at_op), ("--assign", assign)) if value]
    if len(given) != 1:
        problem = "give the cuts with one of --at, --at-op or --assign" if not given else f"{' and '.join(given)} cannot be combined"
        raise click.UsageError(f"{problem}; see 'onnxpipe split --help'")
    from onnxpipe.cli import _render
    from onnxpipe.splitter import split as split_model

    if assign is not None:
        plan = split_model(model, assignment=_read_assignment(assign))
    else:
        cuts: list[object] = [_tensor_cut(a) for a in at] if at else list(at_op)
        plan = split_model(model, cuts)
    folder = plan.save(out, overwrite=overwrite)
    _render.split_plan(plan, folder)


def _tensor_cut(value: str) -> str | list[str]:
    """One --at value: a name, or a comma-separated list of tensors crossing one cut."""
    parts = [p.strip() for p in value.split(",")]
    if any(not p for p in parts):
        raise click.BadParameter(f"{value!r} has an empty name; separate tensor names with single commas", param_hint="'--at'")
    return parts if len(parts) > 1 else parts[0]


def _read_assignment(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"assignment file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read assignment file '{path}': {e}") from e
    if not isinstance(data, dict):
        raise UserError(f"assignment file '{path}' must hold a JSON object {{\"node name\": stage, ...}}, got {type(data).__name__}")
    return data


@main.command()
@click.argument("model", type=_MODEL_ARG)
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=0), help="How many cut candidates to propose.")
@_DIM
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON, nothing else.")
def inspect(model: Path, top: int, dims: Sequence[tuple[str, int]], as_json: bool) -> None:
    """Show MODEL's inputs, outputs, ops and weights, and the cheapest places to cut it.

    A cut candidate is a position in the topological order of compute nodes where few bytes cross
    (per request, symbolic dims sized by --dim, else 1). Candidates are spread over the model; each
    comes with the --at value that makes exactly that cut.

    \b
    Examples:
      onnxpipe inspect resnet50.onnx
      onnxpipe inspect model.onnx --top 4 --dim batch=8 --json
    """
    from onnxpipe.cli import _render
    from onnxpipe.splitter import inspect_model

    summary = inspect_model(model, dict(dims), top=top)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
        return
    _render.model_summary(summary, model)


@main.command()
@click.argument("splitdir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", "model", required=True, type=_MODEL_ARG, help="The whole model SPLITDIR was split from.")
@_DIM
@click.option("--samples", default=1, show_default=True, type=click.IntRange(min=1), help="How many random input sets to run.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the first random input set.")
@click.option("--rtol", default=1e-4, show_default=True, type=click.FloatRange(min=0), help="Relative tolerance.")
@click.option("--atol", default=1e-5, show_default=True, type=click.FloatRange(min=0), help="Absolute tolerance.")
@click.option("--no-boundaries", is_flag=True, help="Compare the pipeline outputs only, not the tensors crossing stage boundaries.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON, nothing else (infinite errors as null).")
def verify(
    splitdir: Path,
    model: Path,
    dims: Sequence[tuple[str, int]],
    samples: int,
    seed: int,
    rtol: float,
    atol: float,
    no_boundaries: bool,
    as_json: bool,
) -> None:
    """Run the stages in SPLITDIR chained and the whole model on random inputs, and compare.

    Every pipeline output and, unless --no-boundaries, every tensor crossing a stage boundary is
    compared (|split - whole| <= atol + rtol * |whole|). Exits 0 when all are within tolerance and 1,
    naming the tensors, when some are not.

    \b
    Examples:
      onnxpipe verify out --model resnet50.onnx
      onnxpipe verify out --model model.onnx --dim batch=4 --samples 3 --rtol 1e-3 --json
    """
    import onnxruntime

    from onnxpipe.cli import _render
    from onnxpipe.splitter import verify as verify_split

    onnxruntime.set_default_logger_severity(3)  # errors only: its warnings about unused initializers are noise here
    report = verify_split(splitdir, model, dims=dict(dims), samples=samples, seed=seed, rtol=rtol, atol=atol, boundaries=not no_boundaries)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _render.verify_report(report)
    failed = [r.tensor for r in report.rows if not r.ok]
    if failed:
        shown = ", ".join(repr(t) for t in failed[:5]) + (f" (and {len(failed) - 5} more)" if len(failed) > 5 else "")
        raise UserError(f"{len(failed)} of {len(report.rows)} tensor(s) differ past rtol={rtol:g} atol={atol:g}: {shown}")
