"""``build``, ``export``, ``rebundle``, ``run`` and ``bench``: from a split folder to a bundle, and the bundle at work.

Each command parses its options, calls the library (``onnxpipe.builder.build``,
``onnxpipe.builder.export``, ``onnxpipe.builder.rebundle``, ``onnxpipe.runtime.load`` and
``onnxpipe.runtime.map_files``, ``onnxpipe.runtime.benchmark``) and prints; heavy modules are imported inside
the commands. ``--set`` (:data:`SET`) gives deploy-time settings in ``build --stage``'s keys.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click

from onnxpipe.cli._common import (
    ALLOW_CODE,
    ALLOW_NONFINITE,
    DIM,
    TARGET,
    UserError,
    bundle_size,
    given,
    quiet_onnxruntime,
    read_npz,
    request_files_option,
)
from onnxpipe.cli._progress import progress
from onnxpipe.cli._stageopts import StageOption, StageOptionType, apply, deploy_overrides, parse_cores, read_settings_file

if TYPE_CHECKING:
    import numpy as np

    from onnxpipe.runtime import BenchReport, Pipeline, PipelineSpec

__all__ = ["SET", "allowing_code", "bench", "build", "code_flags", "export", "rebundle", "run"]


@click.command(short_help="Build the stages of a split folder or a pipeline file, each for its target.")
@click.argument("splitdir", metavar="SPLITDIR|PIPELINE.toml", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder to write pipeline.json and stages/ to.")
@click.option(
    "--stage",
    "stage_options",
    multiple=True,
    type=StageOptionType(),
    help="Settings of some stages, e.g. 0:threads=2,affinity=0-1 or '*:opt=extended' (repeatable; keys above).",
)
@click.option(
    "--settings",
    "settings_file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.json",
    help='Stage settings from a JSON file: {"*": {...}, "stage0": {...}, "1": {...}}, applied before --stage.',
)
@click.option("--ort-format", is_flag=True, help="Save CPU-optimized modules in onnxruntime's ORT format (.ort) instead of .onnx.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.option("--json", "as_json", is_flag=True, help="Print the build report as JSON, nothing else.")
def build(
    splitdir: Path, out: Path, stage_options: Sequence[StageOption], settings_file: Path | None, ort_format: bool, overwrite: bool, as_json: bool
) -> None:
    """Build every stage of SPLITDIR (a split folder) or of a pipeline file (PIPELINE.toml: models,
    models split in place, code stages; docs/pipelines.md) for its target, into OUT.

    Stages run on the CPU with 1 thread and no pinning unless told otherwise. A CPU stage is
    optimized here and saved optimized; a stage for another target keeps a portable module that the
    target optimizes when it loads it, so a bundle can be built for a provider this host does not
    have (a cross-target build: the report says so).

    \b
    --stage SEL:key=value[,key=value...]
      SEL: a stage name, a position in pipeline order (0 = first), or * for all stages.
      target=cpu|cuda|cuda:1|tensorrt|...  execution provider (alias: provider)
      threads=N                  intra-op threads (0: onnxruntime's default, all cores)
      inter-threads=N            inter-op threads, used with mode=parallel
      mode=sequential|parallel   execution mode
      spinning=on|off            let idle threads spin (off by default)
      affinity=0|0-3|0+2+5|none  cores to pin the stage to, 0 to 8191; '+' joins
                                 cores since ',' separates keys; where the stage
                                 loads, every core must be one it may use
      opt=disable|basic|extended|all   graph optimization level
      ep.OPTION=VALUE            one option of the provider (ep.precision=FP32,
                                 ep.device_type=CPU for openvino); added to the
                                 stage's others
      ep_package=PKG             a plugin provider's Python package (onnxruntime_qnn);
                                 loading it needs --allow-code PKG on the host
      ep_device=cpu|gpu|npu      with ep_package: the kind of device to take
      fallback=on|off            let nodes the provider cannot run fall back to CPU
                                 (off: a stage it cannot place whole fails to load,
                                 naming the nodes)
      replicas=N                 workers running this stage
      max_batch=N                run up to N requests, or steps of N streams,
                                 as one session call (docs/batching.md)
      max_delay_ms=T             how long a request may wait for others to
                                 join its batch (0: take what is queued)

    \b
    The --settings file is keyed by *, a stage name or a position; its values use the
    StageSettings field names (target, provider_options, fallback, intra_op_threads,
    inter_op_threads, execution_mode, spinning, affinity, optimization,
    session_config, replicas, max_batch, max_delay_ms, batch_pad, ep_package, ep_device). Order of application, later wins: the file's "*"
    entry, its other entries in file order, then each --stage in command-line order.
    session_config takes no key a setting makes (session.intra_op.allow_spinning: use
    spinning), none of onnxpipe's own and none naming a host file (docs/bundle-format.md).

    \b
    Examples:
      onnxpipe build split -o built
      onnxpipe build split -o built --stage 0:threads=2,affinity=0-1 --stage 1:threads=2,affinity=2-3
      onnxpipe build split -o built --stage '*:opt=extended' --stage head:target=cuda:1
      onnxpipe build split -o built --stage 0:target=openvino,ep.precision=FP32,fallback=off
      onnxpipe build split -o built --stage '*:threads=1,max_batch=8'
      onnxpipe build split -o built --settings stages.json --ort-format --overwrite --json
      onnxpipe build ocr.toml -o built --stage det_0:threads=2
    """
    from onnxpipe.builder import PipelineConfig
    from onnxpipe.builder import build as build_pipeline

    quiet_onnxruntime()
    if splitdir.suffix == ".toml":
        from onnxpipe.splitter import read_pipeline_file

        config = read_pipeline_file(splitdir)
    elif splitdir.is_file():
        raise UserError(f"'{splitdir}' is a file; give a split folder, or a pipeline file ending in .toml (docs/pipelines.md)")
    else:
        config = PipelineConfig.load(splitdir)
    if settings_file is not None:
        for selector, values in read_settings_file(settings_file):
            apply(config, selector, values, f"settings file '{settings_file}', entry '{selector}'")
    for option in stage_options:
        apply(config, option.selector, option.changes, f"--stage {option.text}")
    result = build_pipeline(config, out, ort_format=ort_format, overwrite=overwrite)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    from onnxpipe.cli import _render

    notes = [
        f"stage '{r.stage}' targets {r.provider}, which this host does not have: a cross-target build; its module stays portable "
        f"and {r.provider} optimizes it at load (onnxpipe run BUNDLE --target cpu runs it here)"
        for r in result.report
        if not r.available
    ]
    _render.build_result(result, notes, _next_export(result.spec, result.path))


def _next_export(spec: PipelineSpec, built: Path) -> str:
    """The export command that works for this build: reference samples where they can be made
    (single requests; random values unless an input's dtype has none), with ``--allow-code`` for
    the Python that computing them runs."""
    from onnxpipe._errors import InputError
    from onnxpipe.runtime import random_inputs, spec_values

    command = f"onnxpipe export {shlex.quote(str(built))} -o BUNDLE.onnxpipe"
    if spec.states:
        return f"{command}   (no --reference: a reference sample is one request, and this pipeline keeps state between steps)"
    why = ""
    try:
        random_inputs(spec.inputs, {}, 0, spec_values(spec))
        samples = " --reference 2"
    except InputError as e:
        samples, why = " --reference-inputs INPUTS.npz", f"   (INPUTS.npz: one request's inputs by name; no random ones: {e})"
    code = code_flags(spec)  # computing the samples runs it
    return command + samples + (f" {code}" if code else "") + why


def code_flags(spec: PipelineSpec) -> str:
    """The ``--allow-code`` options a pipeline's Python needs to load (empty: it names none)."""
    from onnxpipe.runtime import code_entries
    from onnxpipe.runtime._code import as_flags

    return as_flags(dict.fromkeys(name for _, _, name in code_entries(spec)), "--allow-code")


@contextlib.contextmanager
def allowing_code(command: str) -> Iterator[None]:
    """Say a refusal of Python the host did not allow in ``onnxpipe COMMAND``'s terms: its own
    ``--allow-code`` flags (see Note: saying how to allow code, in runtime/_code.py)."""
    from onnxpipe.runtime._code import CodeNotAllowedError

    try:
        yield
    except CodeNotAllowedError as e:
        raise e.for_command(f"onnxpipe {command}", "--allow-code") from None


@click.command(short_help="Write a build folder as a bundle (folder or archive).")
@click.argument("builddir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="The bundle: one archive file if the name ends with .onnxpipe, else a folder."
)
@click.option("--reference", "random_sets", default=0, show_default=True, type=click.IntRange(min=0), metavar="N", help="Store N random reference input sets.")
@click.option(
    "--reference-inputs",
    "input_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.npz",
    help="Store this reference input set, an .npz keyed by pipeline input name (repeatable; stored before the random sets).",
)
@click.option(
    "--model",
    "model",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Compute the reference outputs with this whole model in onnxruntime (default: with the pipeline itself).",
)
@DIM
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the first random reference set.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@ALLOW_CODE
@ALLOW_NONFINITE
@click.pass_context
def export(
    ctx: click.Context,
    builddir: Path,
    out: Path,
    random_sets: int,
    input_files: Sequence[Path],
    model: Path | None,
    dims: Sequence[tuple[str, int]],
    seed: int,
    overwrite: bool,
    allow_code: Sequence[str],
    allow_nonfinite: bool,
) -> None:
    """Write the bundle of BUILDDIR (a build folder) to OUT: what a deployment host loads.

    The bundle holds the config, the stage modules, and a manifest with every file's size and
    sha256, checked whenever the bundle is read. With reference input sets (--reference N random
    ones, --reference-inputs files) it also stores their expected outputs, which 'onnxpipe verify
    BUNDLE' checks on the deployment host: computed by the whole --model if given (the strongest
    check), else by the pipeline on this host. Reference outputs that hold NaN or inf are refused
    (a check against them proves nothing) unless --allow-nonfinite.

    \b
    Examples:
      onnxpipe export built -o resnet50.onnxpipe --reference 2 --model resnet50.onnx
      onnxpipe export built -o bundle/ --reference-inputs cat.npz --reference-inputs dog.npz
      onnxpipe export built -o model.onnxpipe --reference 4 --dim batch=8 --seed 7 --overwrite
    """
    loose = given(ctx, "model", "dims", "seed", "allow_nonfinite")
    if loose and not random_sets and not input_files:
        raise click.UsageError(f"{', '.join(loose)}: only used for reference samples; give --reference N or --reference-inputs FILE.npz too")
    from onnxpipe._errors import InputError, StageError
    from onnxpipe.builder import export as export_bundle
    from onnxpipe.builder import read_build
    from onnxpipe.cli import _render
    from onnxpipe.runtime._inputs import defaulted_dims, dims_hint
    from onnxpipe.runtime._values import split_sizes

    quiet_onnxruntime()
    inputs: list[Mapping[str, np.ndarray]] = []
    notes: list[str] = []
    hint = ""  # which dims the random sets took as 1, for a model or stage that fails on them
    if random_sets or input_files:
        spec = read_build(builddir)
        sizes, notes = split_sizes(spec, dict(dims)) if random_sets else ({}, [])
        inputs, dim_notes = _reference_inputs(spec, input_files, random_sets, sizes, seed)
        notes += dim_notes
        hint = dims_hint(defaulted_dims(spec.inputs, sizes)) if random_sets else ""
        if model is not None and not model.is_file():
            raise UserError(f"model file '{model}' does not exist")
    try:
        with allowing_code("export"):
            path = export_bundle(builddir, out, reference_inputs=inputs, reference_model=model, overwrite=overwrite, allow_code=allow_code,
                                 allow_nonfinite=allow_nonfinite)
    except (InputError, StageError) as e:  # computing the reference outputs failed
        if not hint:
            raise
        raise UserError(f"{e}; {hint}") from e
    kind, nbytes, files = bundle_size(path)
    _render.exported(path, kind, nbytes, files, len(inputs), str(model) if model else None, notes, code_flags(read_build(builddir)))


def _reference_inputs(
    spec: PipelineSpec, files: Sequence[Path], random_sets: int, dims: Mapping[str, int], seed: int
) -> tuple[list[Mapping[str, np.ndarray]], list[str]]:
    from onnxpipe._errors import InputError
    from onnxpipe.runtime import check_inputs, random_inputs, spec_values

    sets: list[Mapping[str, np.ndarray]] = []
    for file in files:
        try:
            sets.append(check_inputs(spec.inputs, read_npz(file, "reference inputs file")))
        except InputError as e:
            raise UserError(f"reference inputs file '{file}': {e}") from e
    notes: list[str] = []
    for k in range(random_sets):
        feeds, dim_notes = random_inputs(spec.inputs, dims, seed + k, spec_values(spec))
        sets.append(feeds)
        notes.extend(n for n in dim_notes if n not in notes)
    return sets, notes


#: The runtime's own default (``onnxpipe.runtime.DEFAULT_QUEUE_DEPTH``, not imported here to keep
#: ``--help`` fast; a test checks they agree).
_QUEUE_DEPTH_DEFAULT = 4
QUEUE_DEPTH = click.option(
    "--queue-depth",
    "queue_depth",
    default=_QUEUE_DEPTH_DEFAULT,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="Q",
    help="Requests that may wait in front of each stage; more smooths out uneven stages, at the cost of memory.",
)
ENGINE = click.option(
    "--engine",
    "engine",
    type=click.Choice(["thread", "ray"]),
    default="thread",
    show_default=True,
    help="Where the stages run: threads of this process, or Ray actors on a Ray cluster (pip install 'onnxpipe[ray]'; "
    "a stage with host=NAME goes to nodes started with --labels onnxpipe/host=NAME; see docs/distributed.md).",
)
ADDRESS = click.option(
    "--address",
    "address",
    metavar="auto|HOST:PORT",
    help="The Ray cluster for --engine ray (default: auto, the cluster this host is part of).",
)


def _engine_args(engine: str, address: str | None) -> dict[str, Any]:
    """The load() arguments of --engine and --address."""
    from onnxpipe.runtime import ENGINES

    if address is not None and not ENGINES[engine].takes_address:
        raise click.UsageError(f"--address: only used with --engine {' or '.join(name for name, e in ENGINES.items() if e.takes_address)}")
    return {"engine": engine, "address": address}


TRACE = click.option(
    "--trace",
    "trace",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.json",
    help="Write a timeline of every stage run (Chrome trace: open it in https://ui.perfetto.dev or chrome://tracing).",
)


SET = click.option(
    "--set",
    "settings",
    multiple=True,
    type=StageOptionType(selector_optional=True),
    metavar="[SEL:]KEY=VALUE",
    help="Deploy-time settings instead of the bundle's, in build --stage's keys (KEY=VALUE,KEY=VALUE...): threads, inter-threads, mode, "
    "spinning, affinity, replicas, max_batch (up to the bundle's), max_delay_ms, host. SEL (default *): a stage name, a position or *. "
    "E.g. --set replicas=2 --set 'enc:threads=2,affinity=0-1'. Repeatable; later wins (docs/runtime.md).",
)


def _host_notes(spec: PipelineSpec) -> list[str]:
    """What this host would refuse of a bundle's settings (its cores, its thread caps): said, not refused,
    since a bundle written here may be meant for another host."""
    import os

    from onnxpipe._errors import BundleError
    from onnxpipe.runtime import Limits
    from onnxpipe.runtime.bundle import check_caps

    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    notes = [
        f"stage '{s.name}' is pinned to core(s) {sorted(set(s.settings.affinity) - allowed)} this process may not use (allowed: {sorted(allowed)}): "
        "the bundle loads only on a host where it may"
        for s in spec.stages
        if s.settings.affinity is not None and not set(s.settings.affinity) <= allowed
    ]
    try:
        check_caps(spec, Limits())
    except BundleError as e:
        notes.append(f"this host would refuse it: {e}")
    return notes


@click.command(short_help="Write a bundle again with other deploy-time settings (threads, cores, replicas).")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "-o", "--out", "out", required=True, type=click.Path(path_type=Path),
    help="The new bundle: one archive file if the name ends with .onnxpipe, else a folder.",
)
@SET
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (it may be BUNDLE itself).")
def rebundle(bundle: Path, out: Path, settings: Sequence[StageOption], overwrite: bool) -> None:
    """Write BUNDLE (folder or .onnxpipe archive) to OUT with the deploy-time settings of --set in its pipeline.json.

    For a host the bundle was not built for: a bundle pinned to cores 6-7 does not start on a 2-core
    host, and editing its pipeline.json breaks its manifest. BUNDLE is checked in full first; the
    settings are checked as 'onnxpipe run/serve --set' checks them (a setting that makes the stage's
    module -- target, opt, ep.*, ... -- needs 'onnxpipe build'; max_batch goes up to the bundle's);
    every other file (modules, weights, reference samples) is copied byte for byte with its manifest
    entry, and only the config is hashed again. What only the loading host can judge (its cores, its
    thread caps) is said here, not refused: the new bundle may be meant for another host.

    \b
    Examples:
      onnxpipe rebundle model.onnxpipe -o small-host.onnxpipe --set '*:affinity=0-1' --set threads=1
      onnxpipe rebundle bundle/ -o bundle/ --overwrite --set enc:replicas=2
      onnxpipe rebundle model.onnxpipe -o lowlat.onnxpipe --set max_batch=1
    """
    if not settings:
        raise click.UsageError("give the settings to change with --set [SEL:]KEY=VALUE (e.g. --set '*:affinity=0')")
    from onnxpipe.builder import rebundle as rebundle_bundle
    from onnxpipe.cli import _render
    from onnxpipe.runtime import read_bundle
    from onnxpipe.runtime._overrides import describe_settings

    overrides = deploy_overrides(settings)
    # Read once, with the settings (checked here, before anything is written); no stage against this host's caps: see above.
    with read_bundle(bundle, sessions=(), overrides=overrides) as source:
        path = rebundle_bundle(source, out, overwrite=overwrite)
        spec, samples = source.spec, len(source.manifest.reference)
    kind, nbytes, files = bundle_size(path)
    _render.rebundled(path, kind, nbytes, files, samples, [f"stage '{s.name}': {describe_settings(s)}" for s in spec.stages], _host_notes(spec),
                      code_flags(spec))


def _destinations(out: Path, files: Sequence[Path]) -> list[Path]:
    """Where each request's outputs go: OUT.npz for a single request, else FOLDER/<inputs stem>.npz."""
    if out.suffix == ".npz":
        if len(files) != 1:
            raise click.UsageError(
                f"--outputs {out} names one file, but there are {len(files)} requests; "
                "give a folder (a name not ending in .npz) to get FOLDER/<inputs file stem>.npz for each"
            )
        if out.is_dir():
            raise UserError(f"--outputs '{out}' is a folder; give a file name ending in .npz, or a name without .npz for a folder of outputs")
        destinations = [out]
    elif out.exists() and not out.is_dir():
        raise UserError(f"--outputs '{out}' is a file, not a folder; give a name ending in .npz to write one file")
    else:
        first: dict[str, int] = {}
        for k, file in enumerate(files):
            j = first.setdefault(file.stem, k)
            if j != k:
                both = out / f"{file.stem}.npz"
                raise click.UsageError(f"inputs files '{files[j]}' and '{file}' would both write {both}; rename one or run them separately")
        destinations = [out / f"{file.stem}.npz" for file in files]
    clash = {p.resolve() for p in files} & {p.resolve() for p in destinations}
    if clash:
        raise UserError(f"output file '{sorted(clash)[0]}' is also an --inputs file; choose another --outputs name")
    return destinations


def _save_trace(pipe: Pipeline, trace: Path | None) -> None:
    if trace is None:
        return
    try:
        pipe.save_trace(trace)
    except OSError as e:
        raise UserError(f"cannot write trace '{trace}': {e.strerror or e}") from e


def _stream(pipe: Pipeline, files: Sequence[Path], destinations: Sequence[Path], quiet: bool) -> Mapping[str, np.ndarray]:
    """:func:`onnxpipe.runtime.map_files` with a progress bar; the first request's outputs."""
    from onnxpipe.runtime import map_files

    first: Mapping[str, np.ndarray] = {}
    with progress(len(files), "requests", quiet) as advance:
        for done, outputs in enumerate(map_files(pipe, files, destinations), 1):
            first = first or outputs
            advance(done, len(files))
    return first


@click.command(short_help="Run .npz inputs (files or folders) through a bundle.")
@click.argument("bundle", type=click.Path(path_type=Path))
@request_files_option("Requests: an .npz keyed by pipeline input name is one request; a folder is one request per *.npz in it, sorted by name",
                      required=True)
@click.option(
    "--outputs",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    metavar="OUT.npz|FOLDER",
    help="Where the outputs go, keyed by pipeline output name: OUT.npz for a single request, else FOLDER/<inputs file stem>.npz for each.",
)
@TARGET
@QUEUE_DEPTH
@ENGINE
@ADDRESS
@TRACE
@ALLOW_CODE
@SET
@click.option("--json", "as_json", is_flag=True, help="Print the files written and the run's statistics as JSON, nothing else.")
def run(
    bundle: Path,
    input_paths: Sequence[Path],
    out: Path,
    target: str | None,
    queue_depth: int,
    engine: str,
    address: str | None,
    trace: Path | None,
    allow_code: Sequence[str],
    settings: Sequence[StageOption],
    as_json: bool,
) -> None:
    """Stream every --inputs request through BUNDLE (folder or .onnxpipe archive); write the outputs as they come.

    Before anything runs, the bundle is checked in full (every file against its sha256) and every
    inputs file against the pipeline's input names, dtypes and shapes (from the file headers, so
    this is quick even for thousands of files). Then the requests stream through the stages, which
    work concurrently; files are read as the pipeline takes them and each request's outputs are
    written as soon as they are ready, in request order, so memory stays bounded however many
    files there are. At the end: requests, throughput, latency p50/p99, and the bottleneck stage.

    \b
    Where the outputs go (files of the same name are replaced):
      --outputs OUT.npz   one request only: its outputs go to OUT.npz
      --outputs FOLDER    any name not ending in .npz: each request's outputs go to
                          FOLDER/<stem of its inputs file>.npz (in/cat.npz -> FOLDER/cat.npz);
                          two inputs files with the same stem are refused before anything runs

    A request that fails in a stage stops the run with one error line naming its inputs file;
    the output files written before it are complete and stay, and no partial file is left
    (--trace is written all the same, up to the failure).

    \b
    Examples:
      onnxpipe run model.onnxpipe --inputs image.npz --outputs scores.npz
      onnxpipe run model.onnxpipe --inputs images/ --outputs scores/          # images/a.npz -> scores/a.npz
      onnxpipe run model.onnxpipe --inputs a.npz --inputs more/ --outputs out/ --trace run.json
      onnxpipe run gpu-bundle/ --inputs x.npz --outputs y.npz --target cpu
      onnxpipe run ocr.onnxpipe --inputs page.npz --outputs text.npz --allow-code 'mypkg.*'
      onnxpipe run model.onnxpipe --inputs images/ --outputs scores/ --engine ray --address HEAD:6379
      onnxpipe run model.onnxpipe --inputs images/ --outputs scores/ --set '*:affinity=0-1' --set replicas=2
    """
    from onnxpipe.runtime import check_request_files, load, request_files

    where_run = _engine_args(engine, address)
    overrides = deploy_overrides(settings)
    files = request_files(input_paths)
    destinations = _destinations(out, files)
    quiet_onnxruntime()
    with allowing_code("run"), load(bundle, target=target, queue_depth=queue_depth, trace=trace is not None, allow_code=allow_code, overrides=overrides,
                                    before_start=lambda spec: check_request_files(spec.inputs, files), **where_run) as pipe:
        pipe.reset_stats()  # from the first request, not from load
        try:
            first = _stream(pipe, files, destinations, as_json)
        finally:
            _save_trace(pipe, trace)  # a failed run's timeline shows what happened up to the failure
        stats = pipe.stats()
    if as_json:
        pairs = [{"inputs": str(f), "outputs": str(d)} for f, d in zip(files, destinations, strict=True)]
        click.echo(json.dumps({"requests": len(files), "files": pairs, "trace": str(trace) if trace else None, "stats": stats.to_dict()}, indent=2))
        return
    from onnxpipe.cli import _render

    where = str(destinations[0]) if out.suffix == ".npz" else f"{len(destinations)} output file(s) in {out}"
    _render.run_summary(stats, len(pipe.spec.stages), first, where, trace)


@click.command(short_help="Measure a bundle's throughput and latency, stage by stage.")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--requests", "requests", default=200, show_default=True, type=click.IntRange(min=1), metavar="N", help="Requests to time.")
@click.option(
    "--warmup", "warmup", default=10, show_default=True, type=click.IntRange(min=0), metavar="W",
    help="Requests run first and not timed (with state: steps of one untimed round of the streams).",
)
@click.option(
    "--streams", "streams", type=click.IntRange(min=1), metavar="S",
    help="With state links (a decoder): streams stepping together [default: the largest max_batch of its stages, else 4].",
)
@click.option(
    "--steps", "steps", type=click.IntRange(min=0), metavar="T", help="With state: one-token steps of each stream after its prompt [default: 16]."
)
@click.option("--prompt", "prompt", type=click.IntRange(min=1), metavar="P", help="With state: tokens of each stream's first step [default: 8].")
@DIM
@click.option(
    "--inputs",
    "input_file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.npz",
    help="The inputs of every request, an .npz keyed by pipeline input name (default: the bundle's first reference input set without "
    "--dim, else random values of the declared shapes).",
)
@TARGET
@QUEUE_DEPTH
@ENGINE
@ADDRESS
@click.option(
    "--standalone-runs",
    "standalone_runs",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    metavar="R",
    help="Runs of each stage alone for its standalone time, median taken (0 skips them: no ideal throughput).",
)
@click.option(
    "--caller-cores",
    "caller_cores",
    metavar="auto|CORES",
    help="Pin the thread feeding the pipeline to these cores (written as a stage's affinity: 0, 0-3, 0+2+5) while timed; "
    "auto: the cores of the pinned stage with the most slack (where it slows no bottleneck; worth it when every core runs a stage).",
)
@TRACE
@ALLOW_CODE
@SET
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON, nothing else.")
@click.pass_context
def bench(
    ctx: click.Context,
    bundle: Path,
    requests: int,
    warmup: int,
    streams: int | None,
    steps: int | None,
    prompt: int | None,
    dims: Sequence[tuple[str, int]],
    input_file: Path | None,
    target: str | None,
    queue_depth: int,
    engine: str,
    address: str | None,
    standalone_runs: int,
    caller_cores: str | None,
    trace: Path | None,
    allow_code: Sequence[str],
    settings: Sequence[StageOption],
    as_json: bool,
) -> None:
    """Stream N identical requests through BUNDLE and put its numbers next to what its stages do alone.

    After W warm-up requests, N requests are timed: throughput, and latency (submission to result)
    mean, p50 and p99. Then each stage runs alone, on the pipeline's own session of it while the
    pipeline is idle (no second copy of its weights), pinned like its worker and fed the tensors it
    gets in the pipeline: its standalone time (median of R runs). The
    slowest stage bounds the pipeline: ideal throughput = min over stages of replicas / standalone
    time, and efficiency = throughput / ideal. Per stage: standalone time, mean time of a run
    inside the pipeline, and utilization (share of the time its workers were busy); the most
    utilized stage is the bottleneck.

    The requests are the bundle's own: its first reference input set (export --reference), unless
    --inputs or --dim is given; else random inputs that respect what each input means (masks all
    ones, positions counting, ids within the tables they index: docs/splitting.md), sized by the dims
    the split was made for (its input_dims) with --dim over them. A stage that fails on dims no one
    gave (counted as 1) says which --dim to give.

    A pipeline with state links (a decoder split with --state auto, an encoder + decoder bundle)
    times streams instead: S streams stepping together, each a prompt of P tokens then T
    one-token steps (the greedy token of its logits), after one untimed round: steps (tokens) per
    second, first-step and per-token latency p50/p99, and per stage its calls, batch sizes, mean
    time and utilization; no standalone times (a stage with state runs on its stream's past).
    --requests and --inputs do not apply there; --streams, --steps and --prompt only there.

    \b
    Examples:
      onnxpipe bench model.onnxpipe
      onnxpipe bench model.onnxpipe --requests 1000 --dim batch=8 --queue-depth 4
      onnxpipe bench model.onnxpipe --inputs image.npz --trace bench.json --json
      onnxpipe bench gpu-bundle/ --target cpu --standalone-runs 0
      onnxpipe bench model.onnxpipe --caller-cores auto
      onnxpipe bench model.onnxpipe --engine ray --address auto   # stages on Ray actors: no standalone times
      onnxpipe bench model.onnxpipe --set 1:replicas=2 --set '*:affinity=none'   # try settings without rebuilding
      onnxpipe bench decoder.onnxpipe --streams 8 --steps 32 --prompt 16   # a pipeline with state: streams of steps
    """
    where_run = _engine_args(engine, address)
    overrides = deploy_overrides(settings)
    cores = _parse_caller_cores(caller_cores)
    if input_file is not None and dims:
        raise click.UsageError("--dim: only used for random inputs; the --inputs file fixes the shapes")
    from onnxpipe._errors import InputError
    from onnxpipe.runtime import benchmark, check_inputs, load

    quiet_onnxruntime()
    inputs = read_npz(input_file, "inputs file") if input_file is not None else None
    with allowing_code("bench"), load(bundle, target=target, queue_depth=queue_depth, trace=trace is not None, allow_code=allow_code, overrides=overrides,
                                      **where_run) as pipe:
        if pipe.spec.states:
            report = _bench_streams(ctx, pipe, streams, steps, prompt, warmup, dict(dims), cores, as_json)
        else:
            _refuse_stream_options(ctx)
            if inputs is not None:
                try:
                    inputs = check_inputs(pipe.spec.inputs, inputs)
                except InputError as e:
                    raise UserError(f"inputs file '{input_file}': {e}") from e
            with progress(requests, "requests", as_json, then="timing each stage alone") as advance:
                report = benchmark(
                    pipe, requests, warmup=warmup, inputs=inputs, dims=dict(dims), standalone_runs=standalone_runs, progress=advance, caller_cores=cores
                )
        _save_trace(pipe, trace)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    from onnxpipe.cli import _render

    _render.bench_report(report, warmup, [*report.notes, *_bench_notes(report, standalone_runs)], trace)


def _bench_streams(
    ctx: click.Context,
    pipe: Pipeline,
    streams: int | None,
    steps: int | None,
    prompt: int | None,
    warmup: int,
    dims: dict[str, int],
    cores: tuple[int, ...] | Literal["auto"] | None,
    as_json: bool,
) -> BenchReport:
    """``bench`` of a pipeline with state: its streams (Note: benchmarking streams, ``runtime/_bench.py``)."""
    from onnxpipe.cli._progress import step_progress
    from onnxpipe.runtime import benchmark

    wrong = given(ctx, "requests", "input_file")
    if wrong:
        raise click.UsageError(f"{wrong[0]}: this pipeline keeps state between steps ({len(pipe.spec.states)} state link(s)), so bench times streams of "
                               "steps, not single requests: give --streams S, --steps T, --prompt P")
    if streams is not None and streams > pipe.max_streams:
        raise click.UsageError(f"--streams: at most {pipe.max_streams} (the pipeline's max_streams), got {streams}")
    with step_progress(as_json) as advance:
        return benchmark(pipe, warmup=warmup, dims=dims, caller_cores=cores, streams=streams, steps=steps, prompt=prompt,
                         progress=lambda done, total: advance("steps", done, total))


def _refuse_stream_options(ctx: click.Context) -> None:
    """``--streams``, ``--steps``, ``--prompt`` on a pipeline without state: a usage error."""
    wrong = given(ctx, "streams", "steps", "prompt")
    if wrong:
        raise click.UsageError(f"{wrong[0]}: only for a pipeline with state links (bench times streams there); this one keeps no state: "
                               "--requests N sets the requests timed")


def _parse_caller_cores(value: str | None) -> tuple[int, ...] | Literal["auto"] | None:
    """``auto``, or a core list written as a stage's affinity is (``0``, ``0-3``, ``0+2+5``, ``none``)."""
    if value is None:
        return None
    if value == "auto":
        return "auto"
    try:
        return parse_cores(value)
    except ValueError as e:
        raise click.BadParameter(f"{e}; or auto", param_hint="--caller-cores") from None


_SLOWDOWN = 1.5  # a stage this many times slower in the pipeline than alone gets a note
_TINY_MS = 1.0  # below this a stage's time is mostly the pipeline's own per-request cost


def _bench_notes(report: BenchReport, standalone_runs: int) -> list[str]:
    """What the numbers suggest: stages slowed down by sharing cores, or stages too small to judge
    (nothing for streams: their stages are not timed alone)."""
    if report.streams is not None:
        return []
    if not standalone_runs:
        return ["stages were not timed alone (--standalone-runs 0): no ideal throughput or efficiency"]
    if max(s.standalone_ms for s in report.stages) < _TINY_MS:
        return [f"every stage runs in under {_TINY_MS:g} ms alone: the pipeline's own per-request cost dominates, so efficiency says little"]
    return [
        f"stage '{s.stage}' takes {s.pipeline_mean_ms / s.standalone_ms:.1f}x as long in the pipeline as alone: it may share cores "
        "with other stages (pin stages apart: --set N:affinity=..., or onnxpipe build --stage N:affinity=...)"
        for s in report.stages
        if s.standalone_ms >= _TINY_MS and s.pipeline_mean_ms > _SLOWDOWN * s.standalone_ms
    ]
