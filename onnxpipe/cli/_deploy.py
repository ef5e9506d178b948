"""``build``, ``export`` and ``run``: from a split folder to a bundle, and the bundle at work.

Each command parses its options, calls the library (``onnxpipe.builder.build``,
``onnxpipe.builder.export``, ``onnxpipe.runtime.load``) and prints; heavy modules are imported
inside the commands.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from onnxpipe.cli._common import DIM, UserError, bundle_size, given, quiet_onnxruntime, read_npz, write_npz
from onnxpipe.cli._stageopts import StageOption, StageOptionType, apply, read_settings_file

if TYPE_CHECKING:
    import numpy as np

    from onnxpipe.runtime import PipelineSpec

__all__ = ["build", "export", "output_paths", "run"]


@click.command(short_help="Build the stages of a split folder, each for its target.")
@click.argument("splitdir", type=click.Path(file_okay=False, path_type=Path))
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
    """Build every stage of SPLITDIR (a split folder) for its target, into OUT.

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
      affinity=0|0-3|0+2+5|none  cores to pin the stage to; '+' joins cores
                                 since ',' separates keys
      opt=disable|basic|extended|all   graph optimization level
      fallback=on|off            let nodes the provider cannot run fall back to CPU
      replicas=N                 workers running this stage

    \b
    The --settings file is keyed by *, a stage name or a position; its values use the
    StageSettings field names (target, provider_options, fallback, intra_op_threads,
    inter_op_threads, execution_mode, spinning, affinity, optimization,
    session_config, replicas). Order of application, later wins: the file's "*"
    entry, its other entries in file order, then each --stage in command-line order.

    \b
    Examples:
      onnxpipe build split -o built
      onnxpipe build split -o built --stage 0:threads=2,affinity=0-1 --stage 1:threads=2,affinity=2-3
      onnxpipe build split -o built --stage '*:opt=extended' --stage head:target=cuda:1
      onnxpipe build split -o built --settings stages.json --ort-format --overwrite --json
    """
    from onnxpipe.builder import PipelineConfig
    from onnxpipe.builder import build as build_pipeline

    quiet_onnxruntime()
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
    _render.build_result(result, notes)


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
) -> None:
    """Write the bundle of BUILDDIR (a build folder) to OUT: what a deployment host loads.

    The bundle holds the config, the stage modules, and a manifest with every file's size and
    sha256, checked whenever the bundle is read. With reference input sets (--reference N random
    ones, --reference-inputs files) it also stores their expected outputs, which 'onnxpipe verify
    BUNDLE' checks on the deployment host: computed by the whole --model if given (the strongest
    check), else by the pipeline on this host.

    \b
    Examples:
      onnxpipe export built -o resnet50.onnxpipe --reference 2 --model resnet50.onnx
      onnxpipe export built -o bundle/ --reference-inputs cat.npz --reference-inputs dog.npz
      onnxpipe export built -o model.onnxpipe --reference 4 --dim batch=8 --seed 7 --overwrite
    """
    loose = given(ctx, "model", "dims", "seed")
    if loose and not random_sets and not input_files:
        raise click.UsageError(f"{', '.join(loose)}: only used for reference samples; give --reference N or --reference-inputs FILE.npz too")
    from onnxpipe.builder import export as export_bundle
    from onnxpipe.builder import read_build
    from onnxpipe.cli import _render

    quiet_onnxruntime()
    inputs: list[Mapping[str, np.ndarray]] = []
    notes: list[str] = []
    if random_sets or input_files:
        spec = read_build(builddir)
        inputs, notes = _reference_inputs(spec, input_files, random_sets, dict(dims), seed)
        if model is not None and not model.is_file():
            raise UserError(f"model file '{model}' does not exist")
    path = export_bundle(builddir, out, reference_inputs=inputs, reference_model=model, overwrite=overwrite)
    kind, nbytes, files = bundle_size(path)
    _render.exported(path, kind, nbytes, files, len(inputs), str(model) if model else None, notes)


def _reference_inputs(
    spec: PipelineSpec, files: Sequence[Path], random_sets: int, dims: Mapping[str, int], seed: int
) -> tuple[list[Mapping[str, np.ndarray]], list[str]]:
    from onnxpipe._errors import InputError
    from onnxpipe.runtime import check_inputs, random_inputs

    sets: list[Mapping[str, np.ndarray]] = []
    for file in files:
        try:
            sets.append(check_inputs(spec.inputs, read_npz(file, "reference inputs file")))
        except InputError as e:
            raise UserError(f"reference inputs file '{file}': {e}") from e
    notes: list[str] = []
    for k in range(random_sets):
        feeds, dim_notes = random_inputs(spec.inputs, dims, seed + k)
        sets.append(feeds)
        notes.extend(n for n in dim_notes if n not in notes)
    return sets, notes


def output_paths(out: Path, count: int) -> list[Path]:
    """``out.npz`` for the first input set, ``out-1.npz``, ``out-2.npz``, ... for the others."""
    return [out] + [out.with_name(f"{out.stem}-{k}{out.suffix}") for k in range(1, count)]


@click.command(short_help="Run .npz inputs through a bundle.")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--inputs",
    "input_files",
    multiple=True,
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.npz",
    help="One request: an .npz keyed by pipeline input name (repeatable: one request per file).",
)
@click.option(
    "--outputs",
    "out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="OUT.npz",
    help="Where the outputs go, keyed by pipeline output name; further requests write OUT-1.npz, OUT-2.npz, ...",
)
@click.option(
    "--target", "target", metavar="TARGET", help="Run every stage on this target instead of its own, e.g. cpu for a bundle built for a GPU this host lacks."
)
def run(bundle: Path, input_files: Sequence[Path], out: Path, target: str | None) -> None:
    """Load BUNDLE (folder or .onnxpipe archive), run each --inputs file through it, write the outputs.

    The bundle is checked in full (every file against its sha256) before anything runs, and every
    input against the declared names, dtypes and shapes; nothing is written unless every request
    succeeds. The outputs of the first --inputs file go to OUT.npz, those of the k-th further one
    to OUT-k.npz (files are replaced).

    \b
    Examples:
      onnxpipe run model.onnxpipe --inputs image.npz --outputs scores.npz
      onnxpipe run model.onnxpipe --inputs a.npz --inputs b.npz --outputs out.npz   # out.npz, out-1.npz
      onnxpipe run gpu-bundle/ --inputs x.npz --outputs y.npz --target cpu
    """
    from onnxpipe._errors import InputError
    from onnxpipe.cli import _render
    from onnxpipe.runtime import load

    destinations = output_paths(out, len(input_files))
    clash = {p.resolve() for p in input_files} & {p.resolve() for p in destinations}
    if clash:
        raise UserError(f"output file '{sorted(clash)[0]}' is also an --inputs file; choose another --outputs name")
    requests = [read_npz(file, "inputs file") for file in input_files]
    quiet_onnxruntime()
    with load(bundle, target=target) as pipe:
        results = []
        for file, feeds in zip(input_files, requests, strict=True):
            try:
                results.append(pipe(feeds))
            except InputError as e:
                raise UserError(f"inputs file '{file}': {e}") from e
        stages = len(pipe.spec.stages)
    for path, values in zip(destinations, results, strict=True):
        write_npz(path, values)
    _render.run_summary(zip(input_files, destinations, results, strict=True), stages)
