"""build(): every stage made into a module ready for its target, and a report of what was done.

Note: offline optimization and cross-target builds.
    For a CPU target, the builder opens the stage in onnxruntime with the stage's own settings and
    saves the module onnxruntime optimized (``optimized_model_filepath``) up to the ``extended``
    level, so the deployment host does not redo that work; level ``all`` only adds layout rewrites
    tuned to the CPU's vector width, which the deployment host applies to its own CPU at load.
    Optimized modules are specific to the provider they were made for, so for any other target the builder keeps a
    *portable* module -- only the basic, provider-independent rewrites applied -- which the target
    optimizes when it loads it. When the target's provider is available on the build host, the
    builder still opens the stage with it, to prove the module loads there. When it is not
    available (a cross-target build, like TVM compiling for a device it did not have), the build
    still succeeds and the report says the target optimizes at load.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnx import ModelProto

from onnxpipe._errors import BuildError, BundleError, SplitError, ort_message
from onnxpipe.builder._batching import check_batching, mark_shared_states
from onnxpipe.builder._config import CONFIG_FILE, PipelineConfig, Stage
from onnxpipe.builder._modules import move_into_place, save_model
from onnxpipe.runtime import ParamGroup, PipelineSpec, StageSettings
from onnxpipe.runtime._code import custom_ops_library
from onnxpipe.runtime._session import open_session

__all__ = ["BuildResult", "StageReport", "build"]

STAGE_DIR = "stages"
_EXTERNAL_MIN_BYTES = 1 << 20  # optimized modules keep weights of 1 MiB and more in a .data file
# Level "all" adds layout rewrites (NCHWc) tuned to the build host's vector width; a bundle must run on
# other hosts, so modules are saved at "extended" and the deployment host adds the layout at load.
_PORTABLE = {"all": "extended"}


@dataclass(frozen=True)
class StageReport:
    """What the builder did for one stage."""

    stage: str
    provider: str
    available: bool
    intra_op_threads: int
    inter_op_threads: int
    affinity: tuple[int, ...] | None
    replicas: int
    module_bytes: int
    optimization: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**self.__dict__, "affinity": list(self.affinity) if self.affinity else None}


@dataclass(frozen=True)
class BuildResult:
    """A built pipeline: a folder holding ``pipeline.json`` and ``stages/``, and the report."""

    path: Path
    spec: PipelineSpec
    report: tuple[StageReport, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the folder and one report row per stage."""
        return {"path": str(self.path), "stages": [r.to_dict() for r in self.report]}

    def __str__(self) -> str:
        lines = [f"built {len(self.report)} stage(s) into {self.path}"]
        for r in self.report:
            threads = f"{r.intra_op_threads}x{r.inter_op_threads} threads"
            cores = f", cores {','.join(map(str, r.affinity))}" if r.affinity else ""
            lines.append(f"  {r.stage}: {r.provider}{'' if r.available else ' (not on this host)'}, {threads}{cores}, "
                         f"{r.module_bytes / 2**20:.1f} MiB, {r.optimization}")
        return "\n".join(lines)


def build(config: PipelineConfig, out_dir: str | os.PathLike[str], *, ort_format: bool = False, overwrite: bool = False) -> BuildResult:
    """Build every stage of ``config`` into ``out_dir``.

    Args:
        config: The pipeline, fully wired.
        out_dir: Folder to create; it receives ``pipeline.json`` and ``stages/<name>.onnx``
            (+ ``.data`` for large weights).
        ort_format: Save CPU-optimized modules in onnxruntime's ORT format (``.ort``) instead.
        overwrite: Replace ``out_dir`` if it exists and is not empty.

    Returns:
        The :class:`BuildResult`.

    Raises:
        ConfigError: the wiring or a setting is invalid.
        BuildError: onnxruntime cannot load a stage for its target, or the folder is not empty.
    """
    config.to_spec()  # validates the wiring before any work
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise BuildError(f"output folder '{out}' exists and is not empty; choose another or overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / STAGE_DIR).mkdir()
        groups: dict[str, list[ParamGroup]] = {}
        for g in config.param_groups:
            groups.setdefault(g.stage, []).append(g)
        modules: dict[str, str] = {}
        records: dict[str, dict[str, Any]] = {}
        reports = []
        for stage in config.stages:
            report, modules[stage.name], records[stage.name] = _build_stage(stage, groups.get(stage.name, []), staging, ort_format)
            reports.append(report)
        unbuilt = config.to_spec(modules)
        built = dataclasses.replace(unbuilt, stages=tuple(dataclasses.replace(s, build=records[s.name]) for s in unbuilt.stages))
        built = check_batching(mark_shared_states(built, staging), staging)
        (staging / CONFIG_FILE).write_text(built.to_json())
        move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    by_name = {r.stage: r for r in reports}
    return BuildResult(out, built, tuple(by_name[s.name] for s in built.stages))


def _prepare(model: ModelProto, groups: list[ParamGroup]) -> tuple[ModelProto, str]:
    """The module with exactly the groups' initializers listed as graph inputs (overridable).

    IR < 4 requires every initializer to be listed as an input, which makes all of them
    overridable: onnxruntime then folds none of them, and its optimized copy may drop an
    initializer yet keep it as a required input. Such modules are raised to IR 4 here.

    Returns:
        The module (the same object when nothing changes) and a note on what changed, or "".
    """
    wanted = {t.name for g in groups for t in g.params}
    stored = {t.name: t for t in model.graph.initializer}
    listed = [v.name for v in model.graph.input]
    drop = {n for n in listed if n in stored and n not in wanted}
    add = [n for n in wanted if n not in listed]
    note = ""
    if model.ir_version >= 4 and not add:
        return model, note
    out = ModelProto()
    out.CopyFrom(model)
    if out.ir_version < 4:
        note = f"IR version {out.ir_version} -> 4: initializers are no longer graph inputs, so onnxruntime can fold them"
        out.ir_version = 4
        kept = [v for v in out.graph.input if v.name not in drop]
        del out.graph.input[:]
        out.graph.input.extend(kept)
    for name in add:
        t = stored[name]
        out.graph.input.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    return out, note


def _code_stage(stage: Stage) -> tuple[StageReport, str, dict[str, Any]]:
    """A code stage: nothing to build (and nothing imported); the spec keeps its entry point and params."""
    assert stage.code is not None
    s = stage.settings
    report = StageReport(stage.name, "python", True, s.intra_op_threads, s.inter_op_threads, s.affinity, s.replicas, 0, f"code {stage.code.entry}", 0.0)
    return report, "", {"kind": "code"}


def _register_custom_ops(stage: Stage, options: ort.SessionOptions) -> None:
    # The build host is the author's: it resolves the libraries its own config names (no allow-list).
    for package in stage.settings.custom_ops:
        try:
            options.register_custom_ops_library(custom_ops_library(stage.name, package))
        except BundleError as e:
            raise BuildError(str(e)) from e


def _build_stage(stage: Stage, groups: list[ParamGroup], staging: Path, ort_format: bool) -> tuple[StageReport, str, dict[str, Any]]:
    if stage.is_code:
        return _code_stage(stage)
    start = time.perf_counter()
    settings = stage.settings
    provider = settings.provider
    # A plugin provider's package is imported only to build for it: the build host is the author's.
    available = provider in ort.get_available_providers() if settings.ep_package is None else _installed(settings.ep_package)
    source_dir = stage.source_dir or (stage.path.parent if stage.path else None)
    try:
        model, note = _prepare(stage.load_model(), groups)
    except (OSError, DecodeError) as e:
        raise BuildError(f"stage '{stage.name}': cannot read its module: {e}") from e
    with tempfile.TemporaryDirectory(dir=staging) as tmp:
        source = Path(tmp) / f"{stage.name}.onnx"
        try:
            save_model(model, source, source_dir)
        except SplitError as e:
            raise BuildError(f"stage '{stage.name}': {e}") from e
        offline = provider == "CPUExecutionProvider"
        suffix = ".ort" if ort_format and offline else ".onnx"
        module = f"{STAGE_DIR}/{stage.name}{suffix}"
        level = _PORTABLE.get(settings.optimization, settings.optimization) if offline else "basic"
        if available and not offline:  # prove it loads on its target: options, devices, and every node placed where fallback is off
            def options_for(chosen: StageSettings) -> ort.SessionOptions:
                options = chosen.replace(affinity=None).session_options()
                _register_custom_ops(stage, options)
                return options

            try:
                open_session(str(source), stage.name, settings, options_for, "load it for its target")
            except BundleError as e:
                raise BuildError(str(e)) from e
        # The module saved runs on any provider: made on the CPU provider alone, so fallback does not apply.
        options = settings.replace(affinity=None, fallback=True).session_options(level)  # pinning is for run time, not build time
        _register_custom_ops(stage, options)
        options.optimized_model_filepath = str(staging / module)
        if suffix == ".ort":
            options.add_session_config_entry("session.save_model_format", "ORT")
        else:
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{stage.name}.onnx.data")
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", str(_EXTERNAL_MIN_BYTES))
        _open(source, stage, options, [("CPUExecutionProvider", {})], "optimize it")
    if offline:
        record: dict[str, Any] = {"optimized_for": provider, "optimization": level, "optimize_at_load": False, "format": suffix[1:]}
        described = f"{level}, offline for {provider}" + (" (ORT format)" if suffix == ".ort" else "")
    else:
        record = {"optimized_for": None, "optimization": "basic", "optimize_at_load": True, "format": "onnx"}
        described = f"basic (portable); {provider} optimizes it at load" + ("" if available else ", cross-target build")
    if note:
        record["note"] = note
    size = sum(f.stat().st_size for f in (staging / STAGE_DIR).glob(f"{stage.name}.*"))
    report = StageReport(
        stage=stage.name,
        provider=provider,
        available=available,
        intra_op_threads=settings.intra_op_threads,
        inter_op_threads=settings.inter_op_threads,
        affinity=settings.affinity,
        replicas=settings.replicas,
        module_bytes=size,
        optimization=described,
        seconds=time.perf_counter() - start,
    )
    return report, module, record


def _installed(package: str) -> bool:
    """Whether a package can be imported here (a dotted name whose parent is missing counts as not)."""
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        return False


def _open(path: Path, stage: Stage, options: ort.SessionOptions, providers: list[Any], why: str) -> None:
    try:
        ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types
        raise BuildError(f"stage '{stage.name}': onnxruntime cannot {why} ({providers[0][0]}): {ort_message(e)}") from e
