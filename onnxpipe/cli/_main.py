"""The click group, and the commands that work on models and split folders (split, inspect, verify).

``build``, ``export``, ``run`` and ``bench`` live in ``_deploy``; every command parses options,
calls one library function and prints.

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
from typing import TYPE_CHECKING, Any

import click

from onnxpipe import __version__
from onnxpipe.cli._autosplit import POLICY_NAMES
from onnxpipe.cli._common import (
    ALLOW_CODE,
    ALLOW_NONFINITE,
    DIM,
    PROFILE_THREADS,
    TARGET,
    Group,
    PinType,
    SizeType,
    UserError,
    bundle_size,
    given,
    quiet_onnxruntime,
    read_json,
    read_npz,
    request_files_option,
)
from onnxpipe.cli._deploy import SET, allowing_code, bench, build, export, rebundle, run
from onnxpipe.cli._serve import serve
from onnxpipe.cli._stageopts import StageOption, deploy_overrides

if TYPE_CHECKING:
    from onnxpipe.runtime import Bundle, ReferenceCheck
    from onnxpipe.splitter import VerifyReport

__all__ = ["UserError", "main"]


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


_MODEL_ARG = click.Path(dir_okay=False, path_type=Path)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="onnxpipe")
def main() -> None:
    """Split ONNX models into pipeline stages, build them, bundle them, run them.

    \b
    Typical session:
      onnxpipe inspect model.onnx                        # where is it cheap to cut?
      onnxpipe split model.onnx -o split --at t1 --at t2 # three stages, files in split/
      onnxpipe split model.onnx -o split --auto --stages 3  # or let measured costs choose the cuts
      onnxpipe split model.onnx -o plan --auto --cores 4    # or plan stages, threads, cores for 4 cores
      onnxpipe verify split --model model.onnx           # stages chained == whole model?
      onnxpipe build split -o built --stage 0:threads=2,affinity=0-1 --stage 1:target=cuda
      onnxpipe export built -o model.onnxpipe --reference 2 --model model.onnx
    On the deployment host:
      onnxpipe inspect model.onnxpipe                    # stages, settings, files checked
      onnxpipe verify model.onnxpipe                     # its stored reference still holds?
      onnxpipe bench model.onnxpipe                      # throughput, latency, the bottleneck stage
      onnxpipe run model.onnxpipe --inputs in/ --outputs out/
      onnxpipe serve model.onnxpipe                      # KServe v2 / Triton's protocol on :8000, :8001
      onnxpipe serve model.onnxpipe --set '*:affinity=0-1' --set replicas=2   # this host's cores, not the build's
      onnxpipe rebundle model.onnxpipe -o here.onnxpipe --set '*:affinity=0'  # the same, written into a bundle
    """


main.add_command(build)
main.add_command(export)
main.add_command(rebundle)
main.add_command(run)
main.add_command(bench)
main.add_command(serve)


@main.command(short_help="Split a model into stages at the cuts given, or automatically.")
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
@click.option("--auto", "auto", is_flag=True, help="Choose the cuts automatically; with exactly one of --stages, --max-stages or --cores.")
@click.option("--stages", "stages", type=click.IntRange(min=1), metavar="N", help="With --auto: exactly N stages, the slowest one as fast as possible.")
@click.option("--max-stages", "max_stages", type=click.IntRange(min=1), metavar="K", help="With --auto: the best number of stages up to K.")
@click.option(
    "--cores",
    "cores",
    type=click.IntRange(min=1),
    metavar="C",
    help="With --auto: plan for C cores (pipelines, one session, replicas), measure the best plans, write the fastest with its stage settings.",
)
@click.option(
    "--policy",
    "policy",
    type=click.Choice(POLICY_NAMES),
    default="measured",
    show_default=True,
    help="With --stages/--max-stages: balance measured node times, node counts (uniform) or weight bytes (params).",
)
@click.option(
    "--max-stage-weights",
    "max_stage_weights",
    type=SizeType(),
    metavar="SIZE",
    help="Measured policy: at most SIZE of weights per stage, in bytes or with a unit: 512MiB, 2GiB, 1.5GB.",
)
@click.option(
    "--pin",
    "pins",
    multiple=True,
    type=PinType(),
    help="Measured policy: put this node (or the node making this tensor) in stage STAGE, from 0. Repeatable.",
)
@DIM
@PROFILE_THREADS
@click.option(
    "--rounds",
    "rounds",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="K",
    help="With --cores: measure the finalists in K interleaved rounds; a pipeline is chosen only if it wins every round.",
)
@click.option(
    "--requests",
    "requests",
    default=40,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="N",
    help="With --cores: timed requests per plan and round.",
)
@click.option(
    "--batch",
    "batch",
    default=1,
    show_default=True,
    type=click.IntRange(min=1, max=1024),
    metavar="B",
    help="With --cores: also measure the chosen plan batching up to B requests per call (max_batch), "
    "and keep it only if it wins every round; 1: do not consider batching (docs/batching.md). With --concurrency: the "
    "max_batch of the batching variants measured beside the plans (default: the largest N, at most 8).",
)
@click.option(
    "--memory",
    "memory",
    type=SizeType(),
    metavar="SIZE",
    help="With --cores: a memory budget (1.5GiB); plans whose measured memory is over it are dropped, and the summary says which.",
)
@click.option(
    "--targets",
    "targets",
    default="cpu",
    show_default=True,
    metavar="T1,T2",
    help="With --cores: the targets a stage may run on (cpu,openvino); with more than cpu, every stage and the whole model are "
    "measured on each, and the plan sets each stage's target.",
)
@click.option(
    "--concurrency",
    "concurrency",
    callback=lambda ctx, param, value: _concurrency(value),
    metavar="N[,N...]",
    help="With --cores: plan for a server with N requests in flight: measure the plans (and batching variants) closed loop at "
    "each N, choose one per N (the lowest p99 at N=1, else the highest req/s); several N write OUT/concurrency-N/ each.",
)
@click.option(
    "--p99",
    "p99",
    type=click.FloatRange(min=0, min_open=True),
    metavar="MS",
    help="With --concurrency: the highest req/s among the plans whose p99 latency is at most MS milliseconds.",
)
@click.option(
    "--measure",
    "measure",
    default=3,
    show_default=True,
    type=click.IntRange(min=0),
    metavar="M",
    help="With --cores: measure the M best-predicted pipelines (the best one-session and replicas plans always are).",
)
@click.option(
    "--state",
    "state",
    multiple=True,
    metavar="auto|OUT=IN",
    help="State carried to a stream's next step: 'auto' pairs present.N... -> past_key_values.N..., stateN -> state; "
    "or give OUT=IN. Repeatable. Each pair stays in one stage (docs/streams.md).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.pass_context
def split(
    ctx: click.Context,
    model: Path,
    out: Path,
    at: Sequence[str],
    at_op: Sequence[tuple[str, int]],
    assign: Path | None,
    auto: bool,
    stages: int | None,
    max_stages: int | None,
    cores: int | None,
    policy: str,
    max_stage_weights: int | None,
    pins: Sequence[tuple[str, int]],
    dims: Sequence[tuple[str, int]],
    threads: int,
    rounds: int,
    requests: int,
    batch: int,
    memory: int | None,
    targets: str,
    concurrency: tuple[int, ...] | None,
    p99: float | None,
    measure: int,
    state: Sequence[str],
    overwrite: bool,
) -> None:
    """Split MODEL into stages and write them, with their wiring, to OUT.

    By hand: give the cuts with exactly one of --at, --at-op or --assign (they cannot be mixed,
    since cuts must be given in pipeline order). N cuts make N+1 stages: stage 0 holds everything
    the first cut's tensors depend on, and so on; the last stage holds the rest.

    Automatically (--auto), with exactly one of:

    \b
      --stages N      N stages, cut where the slowest stage is fastest
      --max-stages K  the best number of stages up to K
      --cores C       the planner: one session, replicas of the whole model and
                      pipelines of 2..C stages, each given threads or replicas
                      within C cores, predicted from profiles at 1..C threads;
                      the best are built and measured together in interleaved
                      rounds; a pipeline is chosen only if it beats the best
                      simple plan (one session or replicas) in every round; the
                      plan is written with its stage settings (threads,
                      replicas, cores), which 'onnxpipe build' uses. Every
                      symbolic input dim but a leading batch dim needs --dim.
                      With --targets cpu,openvino, every stage and the whole
                      model are also measured on each target, and the plan
                      sets each stage's target. With --concurrency N[,N...],
                      for a server: the plans and their batching variants
                      are measured with N requests in flight (closed loop)
                      and one is chosen per N: the highest req/s within
                      --p99 MS when given, else the lowest p99 at N=1 and
                      the highest req/s above (docs/planning.md)

    The measured policy profiles every node with --threads intra-op threads and adds the cost of
    handing tensors between stages; where the slowest stage is predicted under 1 ms, the cut and
    its neighbours are then timed together in interleaved rounds and the fastest kept (the profile's
    noise is as large as their differences there). Uniform balances node counts and params weight
    bytes, for comparison. The profile is cached next to the model, or in $ONNXPIPE_CACHE_DIR when set, or in
    ~/.cache/onnxpipe when the model's folder is read-only or an installed package's.

    \b
    Examples:
      onnxpipe split resnet50.onnx -o out --at r88 --at r128
      onnxpipe split model.onnx -o out --at a,b --at c        # 3 stages; a and b cross the first cut
      onnxpipe split model.onnx -o out --at-op Conv:10 --at-op Conv:20
      onnxpipe split model.onnx -o out --assign stages.json --overwrite
      onnxpipe split model.onnx -o out --auto --stages 3 --threads 2
      onnxpipe split model.onnx -o out --auto --max-stages 4 --max-stage-weights 512MiB --pin conv1=0
      onnxpipe split model.onnx -o out --auto --stages 3 --policy params
      onnxpipe split model.onnx -o plan --auto --cores 4 && onnxpipe build plan -o built
      onnxpipe split model.onnx -o plan --auto --cores 2 --targets cpu,openvino
      onnxpipe split model.onnx -o plans --auto --cores 2 --concurrency 1,16 --p99 50
      onnxpipe split decoder.onnx -o out --at layer3.out --state auto   # KV cache stays in its stage

    `onnxpipe inspect MODEL` proposes cuts with the exact --at value to use; `onnxpipe inspect MODEL
    --profile` shows the measured node costs and the best cut for each number of stages.
    """
    by_hand = [flag for flag, value in (("--at", at), ("--at-op", at_op), ("--assign", assign)) if value]
    states = _states(state)
    if auto:
        _split_auto(ctx, model, out, by_hand, overwrite, states)
        return
    auto_only = given(ctx, "stages", "max_stages", "cores", "policy", "max_stage_weights", "pins", "threads", "rounds", "requests", "measure", "batch",
                      "targets", "memory", "concurrency", "p99")
    if auto_only:
        raise click.UsageError(f"{', '.join(auto_only)}: only with --auto; see 'onnxpipe split --help'")
    if len(by_hand) != 1:
        problem = "give the cuts with one of --at, --at-op or --assign, or --auto" if not by_hand else f"{' and '.join(by_hand)} cannot be combined"
        raise click.UsageError(f"{problem}; see 'onnxpipe split --help'")
    from onnxpipe.cli import _render
    from onnxpipe.splitter import split as split_model

    dims_given = dict(dims) or None  # by hand: they size the sample run that finds a boundary's rank
    if assign is not None:
        plan = split_model(model, assignment=_read_assignment(assign), states=states, dims=dims_given)
    else:
        cuts: list[object] = [_tensor_cut(a) for a in at] if at else list(at_op)
        plan = split_model(model, cuts, states=states, dims=dims_given)
    folder = plan.save(out, overwrite=overwrite)
    _render.split_plan(plan, folder)


def _concurrency(value: str | None) -> tuple[int, ...] | None:
    """``--concurrency 1,16``: the Ns, each once, in the order given."""
    if value is None:
        return None
    try:
        values = [int(v) for v in value.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise click.BadParameter(f"{value!r} is not N[,N...] with each N an integer from 1 (requests in flight)", param_hint="'--concurrency'")
    return tuple(dict.fromkeys(values))


def _states(values: Sequence[str]) -> str | list[tuple[str, str]] | None:
    """``--state`` values: ``auto``, or ``OUT=IN`` pairs (not both)."""
    if not values:
        return None
    if "auto" in values:
        if len(values) > 1:
            raise click.BadParameter("give 'auto' alone, or OUT=IN pairs", param_hint="'--state'")
        return "auto"
    pairs = []
    for value in values:
        out, sep, inp = value.partition("=")
        if not sep or not out.strip() or not inp.strip():
            raise click.BadParameter(f"{value!r} is not OUT=IN (e.g. present.0.key=past_key_values.0.key) or 'auto'", param_hint="'--state'")
        pairs.append((out.strip(), inp.strip()))
    return pairs


def _split_auto(
    ctx: click.Context, model: Path, out: Path, by_hand: list[str], overwrite: bool, states: str | list[tuple[str, str]] | None = None
) -> None:
    """``split --auto``: check which options go together, then the policy or the planner."""
    from onnxpipe.cli import _autosplit

    p = ctx.params
    if by_hand:
        raise click.UsageError(f"--auto cannot be combined with {' and '.join(by_hand)}: give the cuts by hand or let --auto choose them")
    counts = given(ctx, "stages", "max_stages", "cores")
    if len(counts) != 1:
        problem = f"not {' and '.join(counts)}" if counts else "none given"
        raise click.UsageError(f"--auto needs exactly one of --stages N, --max-stages K or --cores C ({problem})")
    if p["cores"] is not None:
        not_planner = given(ctx, "policy", "max_stage_weights", "pins", "threads", "state")
        if not_planner:
            raise click.UsageError(f"{', '.join(not_planner)}: not with --cores; the planner profiles 1..C threads itself and cuts with the measured policy")
        if p["p99"] is not None and p["concurrency"] is None:
            raise click.UsageError("--p99: only with --concurrency (the bound holds under N requests in flight)")
        _autosplit.planned_split(
            model, out, cores=p["cores"], rounds=p["rounds"], requests=p["requests"], measure=p["measure"], dims=dict(p["dims"]), overwrite=overwrite,
            batch=p["batch"], targets=[t.strip() for t in p["targets"].split(",")], memory=p["memory"], concurrency=p["concurrency"], p99=p["p99"],
        )
        return
    planner_only = given(ctx, "rounds", "requests", "measure", "batch", "targets", "memory", "concurrency", "p99")
    if planner_only:
        raise click.UsageError(f"{', '.join(planner_only)}: only with --cores (they set how the planner measures its plans)")
    _autosplit.policy_split(
        model,
        out,
        policy=p["policy"],
        count={"stages": p["stages"]} if p["stages"] is not None else {"max_stages": p["max_stages"]},
        threads=p["threads"],
        max_stage_weights=p["max_stage_weights"],
        pins=_pins(p["pins"]),
        dims=dict(p["dims"]),
        asked=given(ctx, "threads", "max_stage_weights", "pins", "dims"),
        overwrite=overwrite,
        states=states,
    )


def _pins(pins: Sequence[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for node, stage in pins:
        if out.get(node, stage) != stage:
            raise click.BadParameter(f"node '{node}' is pinned to stages {out[node]} and {stage}; give one", param_hint="'--pin'")
        out[node] = stage
    return out


def _tensor_cut(value: str) -> str | list[str]:
    """One --at value: a name, or a comma-separated list of tensors crossing one cut."""
    parts = [p.strip() for p in value.split(",")]
    if any(not p for p in parts):
        raise click.BadParameter(f"{value!r} has an empty name; separate tensor names with single commas", param_hint="'--at'")
    return parts if len(parts) > 1 else parts[0]


def _read_assignment(path: Path) -> dict[str, int]:
    data = read_json(path, "assignment file")
    if not isinstance(data, dict):
        raise UserError(f"assignment file '{path}' must hold a JSON object {{\"node name\": stage, ...}}, got {type(data).__name__}")
    return data


@main.command(short_help="Show a model and where to cut it, a pipeline file, or a bundle.")
@click.argument("path", metavar="MODEL_OR_BUNDLE", type=click.Path(path_type=Path))
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=0), help="How many cut candidates to propose (models only).")
@DIM
@click.option("--profile", "profile", is_flag=True, help="Also measure every node's cost, and predict the best cut for 2..K stages (models only).")
@PROFILE_THREADS
@click.option(
    "--max-stages", "max_stages", default=4, show_default=True, type=click.IntRange(min=2), metavar="K", help="With --profile: best cuts for 2..K stages."
)
@click.option("--host", "on_host", is_flag=True, help="Bundles only: make each stage's session on this host and show which provider takes each node.")
@TARGET
@ALLOW_CODE
@SET
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON, nothing else.")
@click.pass_context
def inspect(ctx: click.Context, path: Path, top: int, dims: Sequence[tuple[str, int]], profile: bool, threads: int, max_stages: int, on_host: bool,
            target: str | None, allow_code: Sequence[str], settings: Sequence[StageOption], as_json: bool) -> None:
    """Show a model and where to cut it, or a bundle and how it will run.

    For a MODEL (.onnx): its inputs, outputs, ops and weights, and the cheapest places to cut it.
    A cut candidate is a position in the topological order of compute nodes where few bytes cross
    (per request, symbolic dims sized by --dim, else 1; a dim that is a formula of input dims, such
    as floor(H/2 - 1/2) + 1, is computed from theirs). Candidates are spread over the model; each
    comes with the --at value that makes exactly that cut. The notes name the input dims to give.

    With --profile, the model also runs under onnxruntime's profiler with --threads intra-op
    threads (the profile is cached next to the model, or in $ONNXPIPE_CACHE_DIR): the costliest nodes with their share of one
    run, and for each number of stages 2..K the best cut by measured cost, with each stage's
    predicted time, the bytes crossing, and the speedup a pipeline can reach at most (one run of
    the whole model / the slowest stage). --json lists every node.

    For a BUNDLE (a folder with manifest.json, or a .onnxpipe archive): every file is checked
    against its sha256 first; then the stages in order with their module, settings and build
    record, the wiring (a stream's state too: which output feeds which input on the next step),
    the parameter groups, the versions, opsets and providers it needs, and the code it would run
    (code stages' entry points, custom-op packages: what --allow-code must match; nothing is
    imported). With --host, each ONNX stage's session is also made here, as
    loading the bundle would make it (--target, --allow-code for custom-op packages), and the
    providers that took its nodes are listed with their counts, naming the nodes that fell back
    to the CPU: a stage on an accelerator that ran nothing on the CPU shows one provider. With --set,
    the stages' settings are shown as loading with the same --set would make them (checked the same
    way; with --host, the sessions are made with them too).

    For a PIPELINE FILE (.toml, docs/pipelines.md): the graph of stages in pipeline order, what
    each reads and makes and where it flows.

    \b
    Examples:
      onnxpipe inspect resnet50.onnx
      onnxpipe inspect model.onnx --top 4 --dim batch=8 --json
      onnxpipe inspect model.onnx --profile --threads 2 --max-stages 6
      onnxpipe inspect model.onnxpipe
      onnxpipe inspect model.onnxpipe --host
      onnxpipe inspect model.onnxpipe --host --set '*:affinity=0-1'
      onnxpipe inspect ocr.toml
    """
    from onnxpipe.runtime import is_bundle

    if is_bundle(path):
        model_only = given(ctx, "top", "dims", "profile", "threads", "max_stages")
        if model_only:
            raise click.UsageError(f"{', '.join(model_only)}: only used for a model, not for a bundle")
        host_only = given(ctx, "target", "allow_code")
        if host_only and not on_host:
            raise click.UsageError(f"{', '.join(host_only)}: only with --host")
        _inspect_bundle(path, as_json, on_host, target, allow_code, settings)
        return
    bundle_only = given(ctx, "on_host", "target", "allow_code", "settings")
    if bundle_only:
        raise click.UsageError(f"{', '.join(bundle_only)}: only used for a bundle")
    if path.suffix == ".toml":
        model_only = given(ctx, "top", "dims", "profile", "threads", "max_stages")
        if model_only:
            raise click.UsageError(f"{', '.join(model_only)}: only used for a model, not for a pipeline file")
        _inspect_pipeline_file(path, as_json)
        return
    profile_only = given(ctx, "threads", "max_stages")
    if profile_only and not profile:
        raise click.UsageError(f"{', '.join(profile_only)}: only with --profile")
    if path.is_dir():
        raise UserError(f"'{path}' is a folder but not a bundle (it has no manifest.json); give an .onnx model or a bundle made by 'onnxpipe export'")
    from onnxpipe.cli import _render
    from onnxpipe.cli._autosplit import profile_report
    from onnxpipe.splitter import inspect_model

    summary = inspect_model(path, dict(dims), top=top)
    costs = profile_report(path, threads, max_stages, dict(dims), quiet=as_json) if profile else None
    if as_json:
        click.echo(json.dumps({**summary.to_dict(), **({"profile": costs} if costs is not None else {})}, indent=2))
        return
    _render.model_summary(summary, path)
    if costs is not None:
        _render.cost_profile(costs, path)


def _inspect_pipeline_file(path: Path, as_json: bool) -> None:
    from onnxpipe.splitter import read_pipeline_file

    quiet_onnxruntime()
    config = read_pipeline_file(path)
    if as_json:
        click.echo(json.dumps(config.to_spec().to_dict(), indent=2))
    else:
        click.echo(str(config))


def _inspect_bundle(path: Path, as_json: bool, on_host: bool = False, target: str | None = None, allow_code: Sequence[str] = (),
                    settings: Sequence[StageOption] = ()) -> None:
    from onnxpipe.cli import _render
    from onnxpipe.runtime import host_placement, read_bundle

    overrides = deploy_overrides(settings)
    with allowing_code("inspect --host"), read_bundle(path, allow_code=allow_code, overrides=overrides) as bundle:
        kind, nbytes, files = bundle_size(path)
        where = host_placement(bundle, target) if on_host else None
        if as_json:
            data = _bundle_dict(bundle, path, kind, nbytes, files)
            if where is not None:
                data["placement"] = {stage: None if p is None else {ep: list(nodes) for ep, nodes in p.items()} for stage, p in where.items()}
            if overrides:
                data["deploy_settings"] = [o.origin for o in overrides]
            click.echo(json.dumps(data, indent=2))
            return
        _render.bundle_summary(bundle, path, kind, nbytes, files)
        if overrides:  # the settings above are not the bundle's own
            click.echo(f"settings as loading with {' '.join(o.origin for o in overrides)} makes them (the bundle's own: without --set)")
        if where is not None:
            _render.placement(bundle, where)


def _bundle_dict(bundle: Bundle, path: Path, kind: str, nbytes: int, files: int) -> dict[str, Any]:
    from onnxpipe.cli._render import stage_module_bytes

    pipeline = bundle.spec.to_dict()
    for stage, data in zip(bundle.spec.stages, pipeline["stages"], strict=True):
        data["module_bytes"] = stage_module_bytes(bundle, stage)
    manifest = {k: v for k, v in bundle.manifest.to_dict().items() if k != "files"}
    return {"path": str(path), "kind": kind, "bytes": nbytes, "files": files, "sha256_ok": True, "manifest": manifest, "pipeline": pipeline}


@main.command(short_help="Check a split or a bundle against the model or its reference.")
@click.argument("path", metavar="SPLIT_OR_BUNDLE", type=click.Path(path_type=Path))
@click.option("--model", "model", type=_MODEL_ARG, help="The whole model to compare with (required for a split folder).")
@DIM
@click.option("--samples", default=1, show_default=True, type=click.IntRange(min=1), help="How many random input sets to run (with --model).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the first random input set (with --model).")
@request_files_option("Input sets instead of random ones (with --model): an .npz keyed by pipeline input name is one set, a folder one set per *.npz "
                      "in it, sorted by name; for a split with state, the steps of one stream, in order")
@click.option("--rtol", default=1e-4, show_default=True, type=click.FloatRange(min=0), help="Relative tolerance.")
@click.option("--atol", default=1e-5, show_default=True, type=click.FloatRange(min=0), help="Absolute tolerance.")
@click.option("--no-boundaries", is_flag=True, help="Compare the pipeline outputs only, not the tensors crossing stage boundaries (with --model).")
@TARGET
@ALLOW_CODE
@SET
@ALLOW_NONFINITE
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON, nothing else (infinite errors as null).")
@click.pass_context
def verify(
    ctx: click.Context,
    path: Path,
    model: Path | None,
    dims: Sequence[tuple[str, int]],
    samples: int,
    seed: int,
    input_paths: Sequence[Path],
    rtol: float,
    atol: float,
    no_boundaries: bool,
    target: str | None,
    allow_code: Sequence[str],
    settings: Sequence[StageOption],
    allow_nonfinite: bool,
    as_json: bool,
) -> None:
    """Check a split folder or a bundle against the whole model, or a bundle against its stored reference.

    With --model, the stages of SPLIT_OR_BUNDLE (a split folder, or a bundle: a folder with
    manifest.json or a .onnxpipe archive) run chained, and the whole model runs, on random inputs
    (masks ones, ids within their tables; sized as the split was made for) or the --inputs sets;
    every pipeline output and, unless --no-boundaries, every tensor crossing a stage boundary is
    compared (|split - whole| <= atol + rtol * |whole|). A split with state links (split --state)
    runs --samples streams of 4 steps instead (a prompt, then the greedy token of each step),
    through the pipeline's streams and through the whole model with its state fed back by hand,
    and compares every step's outputs.

    Without --model, a bundle runs the reference inputs stored in it ('onnxpipe export
    --reference') and compares with the stored outputs: one row per output per sample; with --set,
    on the deploy-time settings given (as 'onnxpipe run/serve --set' would load it).

    A NaN or inf on one side only is a mismatch. An output the whole model (or the stored
    reference) gives NaN or inf for fails too, since the check proves nothing there, unless
    --allow-nonfinite says the model's outputs hold them by design (-inf masks).

    Exits 0 when everything is within tolerance and 1, naming the tensors, when something is not.

    \b
    Examples:
      onnxpipe verify split --model resnet50.onnx
      onnxpipe verify split --model model.onnx --dim batch=4 --samples 3 --rtol 1e-3 --json
      onnxpipe verify split --model model.onnx --inputs sample.npz --inputs more/
      onnxpipe verify model.onnxpipe
      onnxpipe verify model.onnxpipe --model model.onnx --target cpu
      onnxpipe verify model.onnxpipe --set '*:affinity=0-1'
    """
    from onnxpipe.runtime import is_bundle

    quiet_onnxruntime()
    if model is None:
        if not path.exists():
            raise UserError(f"'{path}' does not exist; give a split folder with --model, or a bundle")
        if not is_bundle(path):
            raise click.UsageError(f"'{path}' is not a bundle: give --model MODEL.onnx (only a bundle stores its own reference)")
        model_only = given(ctx, "dims", "samples", "seed", "input_paths", "no_boundaries")
        if model_only:
            raise click.UsageError(f"{', '.join(model_only)}: only used with --model; a bundle's stored reference has its own inputs")
        _verify_reference(path, rtol, atol, target, allow_code, as_json, settings, allow_nonfinite)
        return
    if settings:
        raise click.UsageError("--set: only for a bundle's stored reference (without --model); a split folder's stages run with their own settings")
    if input_paths and (random_only := given(ctx, "dims", "samples", "seed")):
        raise click.UsageError(f"{', '.join(random_only)}: only used for random inputs; the --inputs files fix the values and shapes")
    from onnxpipe.cli import _render
    from onnxpipe.runtime import request_files
    from onnxpipe.splitter import verify as verify_split

    sets = [read_npz(file, "inputs file") for file in request_files(input_paths)] if input_paths else None
    report = verify_split(path, model, inputs=sets, dims=dict(dims), samples=samples, seed=seed, rtol=rtol, atol=atol, boundaries=not no_boundaries,
                          target=target, allow_nonfinite=allow_nonfinite)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _render.verify_report(report)
    _fail_unproven(report)
    _fail_past_tolerance([_named(repr(r.tensor), r.problem) for r in report.rows if not r.ok], len(report.rows), "tensor(s)", rtol, atol)


def _fail_unproven(report: VerifyReport) -> None:
    """A verify whose only failures are outputs the whole model gives NaN or inf for: one line saying
    that the check proves nothing (a mismatch is said as one, by :func:`_fail_past_tolerance`)."""
    if not report.unproven or any(not r.ok and not r.unproven for r in report.rows):
        return
    shown = ", ".join(f"'{r.tensor}' ({r.nonfinite})" for r in report.unproven[:5])
    inputs = "the random inputs" if report.steps == 0 else "the stream's steps"
    if report.given:
        inputs, advice = "the given inputs", "give --inputs"
    else:
        advice = "give --inputs, sizes (--dim) or a --seed"
    raise UserError(f"the whole model's output(s) {shown} are not finite on {inputs}: the check proves nothing; {advice} "
                    "on which they are finite, or --allow-nonfinite if the outputs hold inf or NaN by design")


def _named(name: str, problem: str) -> str:
    """A failed check in the error's list: its name, and what is wrong beyond the tolerance."""
    return f"{name} ({problem})" if problem else name


def _verify_reference(path: Path, rtol: float, atol: float, target: str | None, allow_code: Sequence[str], as_json: bool,
                      settings: Sequence[StageOption] = (), allow_nonfinite: bool = False) -> None:
    from onnxpipe.cli import _render
    from onnxpipe.runtime import Pipeline, read_bundle

    overrides = deploy_overrides(settings)
    with allowing_code("verify"), read_bundle(path, allow_code=allow_code, overrides=overrides) as bundle:
        if not bundle.manifest.reference:
            raise UserError(f"bundle '{path}' stores no reference; pass --model MODEL.onnx to compare with the whole model (or export with --reference N)")
        with Pipeline(bundle, target) as pipe:
            rows = pipe.check(rtol=rtol, atol=atol, allow_nonfinite=allow_nonfinite)
    if as_json:
        click.echo(json.dumps(_reference_dict(rows, rtol, atol), indent=2))
    else:
        _render.reference_checks(rows, rtol, atol)
    _fail_past_tolerance([_named(f"sample {r.sample} {r.output!r}", r.problem) for r in rows if not r.ok], len(rows), "reference check(s)", rtol, atol)


def _reference_dict(rows: list[ReferenceCheck], rtol: float, atol: float) -> dict[str, Any]:
    import math

    return {
        "ok": all(r.ok for r in rows),
        "rtol": rtol,
        "atol": atol,
        "samples": len({r.sample for r in rows}),
        "checks": [{**r.__dict__, "max_abs": r.max_abs if math.isfinite(r.max_abs) else None} for r in rows],
    }


def _fail_past_tolerance(failed: list[str], total: int, what: str, rtol: float, atol: float) -> None:
    if failed:
        shown = ", ".join(failed[:5]) + (f" (and {len(failed) - 5} more)" if len(failed) > 5 else "")
        raise UserError(f"{len(failed)} of {total} {what} differ past rtol={rtol:g} atol={atol:g}: {shown}")
