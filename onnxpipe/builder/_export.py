"""export(): a built pipeline as a relocatable bundle, a folder or a single archive; rebundle(): a
bundle again with other deploy-time settings.

The bundle layout and the checks the runtime makes when it loads one are in
``onnxpipe/runtime/bundle/`` and docs/bundle-format.md; this module writes exactly that, through
the runtime's own :class:`~onnxpipe.runtime.Manifest`, in one place (``_write_bundle``).
"""

from __future__ import annotations

import datetime
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import onnxpipe
from onnxpipe._errors import BuildError, ConfigError, InputError, ort_message
from onnxpipe.builder._config import CONFIG_FILE
from onnxpipe.builder._modules import move_into_place
from onnxpipe.runtime import PipelineSpec, SequentialPipeline, check_allowed
from onnxpipe.runtime._code import CodeNotAllowedError
from onnxpipe.runtime._compare import nonfinite_count
from onnxpipe.runtime._inputs import feed_shapes
from onnxpipe.runtime._overrides import Overrides, apply_overrides
from onnxpipe.runtime.bundle import (
    ARCHIVE_SUFFIX,
    CONFIG_NAME,
    MANIFEST_NAME,
    PAGE,
    Bundle,
    FileEntry,
    Limits,
    external_locations,
    read_bundle,
    save_npz,
    write_manifest,
)

__all__ = ["export", "read_build", "rebundle"]

_STORED = (".onnx", ".data", ".ort", ".npz")  # already dense: not worth compressing


def export(
    build_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    reference_inputs: Sequence[Mapping[str, np.ndarray]] = (),
    reference_outputs: Sequence[Mapping[str, np.ndarray]] | None = None,
    reference_model: str | os.PathLike[str] | onnx.ModelProto | None = None,
    overwrite: bool = False,
    allow_code: Sequence[str] = (),
    allow_nonfinite: bool = False,
) -> Path:
    """Write the bundle of a built pipeline.

    Args:
        build_dir: A folder written by :func:`~onnxpipe.builder.build`.
        out: The bundle: a folder, or a single archive when the name ends with ``.onnxpipe``.
        reference_inputs: Inputs to store in the bundle for self-checks on the deployment host.
        reference_outputs: Their expected outputs; by default computed by ``reference_model``, or
            by the pipeline itself on this host.
        reference_model: The whole model, run in onnxruntime to compute the expected outputs (the
            strongest check: the deployment host must reproduce the original model).
        overwrite: Replace ``out`` if it exists.
        allow_code: fnmatch patterns of the Python (code stages, custom-op packages) this host may
            run to compute reference outputs with the pipeline itself; only needed then.
        allow_nonfinite: Store reference outputs that hold NaN or inf (a model whose outputs hold
            ``-inf`` by design); by default they are refused: a check against them proves nothing.

    Returns:
        The bundle's path.

    Raises:
        BuildError: ``build_dir`` is not a build folder, ``out`` exists, or reference samples are
            given for a pipeline with state links.
        CodeNotAllowedError: computing the reference outputs needs code ``allow_code`` does not
            allow (a :class:`BundleError`; nothing is imported).
        InputError: ``reference_model`` fails on a reference input set (the sizes of its symbolic
            dims, most often); computing the outputs with the pipeline, a stage fails on one
            (:class:`StageError`); a reference output holds NaN or inf and ``allow_nonfinite`` is off.
    """
    src = Path(build_dir)
    out = Path(out)
    spec = read_build(src)
    if spec.states and reference_inputs:
        # A reference sample is one stateless request; a pipeline with state runs streams of steps.
        raise BuildError(f"reference samples are single requests, but this pipeline keeps state between steps ({spec.states[0]}, ...); export it without them")
    if reference_outputs is None and reference_model is not None and reference_inputs:
        reference_outputs = _model_outputs(reference_model, spec, reference_inputs)

    def fill(staging: Path) -> tuple[Mapping[str, object], None]:
        _copy_files(src, staging, spec)
        reference = _write_reference(staging, spec, reference_inputs, reference_outputs, allow_code, allow_nonfinite)
        return _manifest_fields(staging, spec, reference), None

    return _write_bundle(out, overwrite, fill)


def rebundle(
    bundle: str | os.PathLike[str] | Bundle,
    out: str | os.PathLike[str],
    overrides: Overrides | None = None,
    *,
    overwrite: bool = False,
    limits: Limits | None = None,
) -> Path:
    """Write a bundle again with other deploy-time settings (threads, affinity, replicas, ...).

    The bundle is read and checked in full first; its ``pipeline.json`` is written with the
    overrides applied, checked as ``load(..., overrides=...)`` checks them (the same code), and
    every other file (modules, external data, reference samples) is copied byte for byte, its
    manifest entry kept: only the config is hashed again. The versions, opsets and providers of
    the manifest stay the build's (the modules are the build's).

    What only the loading host can judge (a core its process may not use, its thread caps) is
    left to it: the bundle may be meant for another host than this one.

    Args:
        bundle: The bundle (folder or ``.onnxpipe`` archive), or one read already
            (``read_bundle(path, sessions=(), overrides=...)``: its spec, with the overrides it was
            read with, is what is written).
        out: The new bundle: a folder, or a single archive when the name ends with ``.onnxpipe``.
        overrides: The deploy-time settings (see ``onnxpipe.runtime.load``), applied on top of
            the bundle's.
        overwrite: Replace ``out`` if it exists (it may be ``bundle`` itself).
        limits: Limits to read a ``bundle`` path with (default: the runtime's).

    Returns:
        The new bundle's path.

    Raises:
        BundleError: ``bundle`` is missing, broken or refused as unsafe.
        ConfigError: an override names no stage, a setting that may not change at deploy time, a
            bad value, or a ``max_batch`` above what the build allows.
        BuildError: ``out`` exists.
    """
    if isinstance(bundle, Bundle):
        return _rebundle(bundle, apply_overrides(bundle.spec, overrides), Path(out), overwrite)
    # sessions=(): no stage is checked against this host's caps (see above); everything else is.
    with read_bundle(bundle, limits, sessions=(), overrides=overrides) as source:
        return _rebundle(source, source.spec, Path(out), overwrite)


def _rebundle(source: Bundle, spec: PipelineSpec, out: Path, overwrite: bool) -> Path:
    def fill(staging: Path) -> tuple[Mapping[str, object], dict[str, FileEntry]]:
        known = source.copy_files(staging, skip={CONFIG_NAME})
        (staging / CONFIG_NAME).write_text(spec.to_json())
        m = source.manifest
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return {"versions": m.versions, "opsets": m.opsets, "providers": m.providers, "reference": m.reference, "created": created}, known

    return _write_bundle(out, overwrite, fill)


def _write_bundle(out: Path, overwrite: bool, fill: Callable[[Path], tuple[Mapping[str, object], Mapping[str, FileEntry] | None]]) -> Path:
    """The one writer of bundles: ``fill`` puts the files in a private staging folder next to
    ``out`` and says the manifest's fields (and the entries of files copied from a checked bundle);
    the manifest is written, then the folder is moved into place or packed as an archive. Nothing
    is left behind on failure, and ``out`` is replaced only once the new bundle is whole.

    Raises:
        BuildError: ``out`` exists and ``overwrite`` is false.
    """
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise BuildError(f"'{out}' exists; choose another name or overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fields, known = fill(staging)
        write_manifest(staging, fields, known)
        staging.chmod(0o777 & ~_umask())  # mkdtemp made it private; a bundle is an ordinary folder
        if out.name.endswith(ARCHIVE_SUFFIX):
            _write_archive(staging, out)
        else:
            move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def read_build(build_dir: str | os.PathLike[str]) -> PipelineSpec:
    """The spec of a build folder written by :func:`~onnxpipe.builder.build`.

    Raises:
        BuildError: the folder has no readable ``pipeline.json``, or its pipeline was not built.
    """
    src = Path(build_dir)
    try:
        spec = PipelineSpec.from_json((src / CONFIG_FILE).read_text())
    except OSError as e:
        raise BuildError(f"'{src}' is not a build folder: cannot read {CONFIG_FILE} ({e.strerror})") from e
    except ConfigError as e:
        raise BuildError(f"'{src}' is not a build folder: {e}") from e
    if any(not s.build for s in spec.stages):
        raise BuildError(f"'{src}' holds a pipeline that was not built; run build first (onnxpipe build)")
    return spec


def _model_outputs(
    model: str | os.PathLike[str] | onnx.ModelProto, spec: PipelineSpec, inputs: Sequence[Mapping[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """The whole model's outputs for each input set, named as the pipeline's outputs."""
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    options = ort.SessionOptions()
    options.log_severity_level = 4  # its failure on the inputs is the InputError below, not a log line on the user's terminal
    try:
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own types
        raise BuildError(f"cannot load the reference model: {ort_message(e)}") from e
    names = [t.name for t in spec.outputs]
    missing = [n for n in names if n not in {o.name for o in session.get_outputs()}]
    if missing:
        raise BuildError(f"the reference model has no output {', '.join(repr(n) for n in missing)}; is it the model this pipeline was split from?")
    outputs = []
    for k, feeds in enumerate(inputs):
        try:
            outputs.append(dict(zip(names, session.run(names, dict(feeds)), strict=True)))
        except Exception as e:  # onnxruntime's own types: the model cannot run these inputs
            raise InputError(f"the reference model fails on reference input set {k} ({feed_shapes(feeds)}): {ort_message(e)}") from e
    return outputs


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _copy_files(src: Path, dest: Path, spec: PipelineSpec) -> None:
    shutil.copyfile(src / CONFIG_FILE, dest / CONFIG_FILE)
    for stage in spec.stages:
        if stage.module is None:
            continue  # a code stage: no file
        files = [stage.module]
        if stage.module.endswith(".onnx"):
            folder = os.path.dirname(stage.module)
            files += [os.path.normpath(os.path.join(folder, loc)) for loc in external_locations(src / stage.module)]
        for rel in dict.fromkeys(files):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            if not (src / rel).is_file():
                raise BuildError(f"build folder '{src}' lacks '{rel}' of stage '{stage.name}'")
            shutil.copyfile(src / rel, dest / rel)


def _write_reference(
    root: Path,
    spec: PipelineSpec,
    inputs: Sequence[Mapping[str, np.ndarray]],
    outputs: Sequence[Mapping[str, np.ndarray]] | None,
    allow_code: Sequence[str],
    allow_nonfinite: bool = False,
) -> list[tuple[str, str]]:
    if not inputs:
        return []
    if outputs is None:
        # On a build host without a stage's provider, the CPU computes the reference instead.
        missing = any(s.settings.provider not in ort.get_available_providers() for s in spec.stages if not s.is_code)
        try:
            check_allowed(spec, allow_code)
        except CodeNotAllowedError as e:
            raise e.for_call("export", "computing the reference outputs runs the pipeline here: ") from None
        runner = SequentialPipeline(spec, root, target="cpu" if missing else None, allow_code=allow_code)
        outputs = [runner.run(feeds) for feeds in inputs]
    if len(outputs) != len(inputs):
        raise BuildError(f"{len(inputs)} reference input set(s) but {len(outputs)} output set(s)")
    if not allow_nonfinite:
        _check_finite(outputs)
    (root / "reference").mkdir()
    pairs = []
    for i, (feeds, expected) in enumerate(zip(inputs, outputs, strict=True)):
        pair = (f"reference/inputs-{i}.npz", f"reference/outputs-{i}.npz")
        save_npz(root / pair[0], feeds)
        save_npz(root / pair[1], expected)
        pairs.append(pair)
    return pairs


def _check_finite(outputs: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Refuse reference outputs that hold NaN or inf (Note: non-finite values prove nothing, in
    ``runtime/_compare.py``): a bundle checked against them would pass whatever it computes there."""
    for k, values in enumerate(outputs):
        for name, value in values.items():
            array = np.asarray(value)
            if array.dtype.kind in "fc" and not (finite := np.isfinite(array)).all():
                raise InputError(
                    f"reference output '{name}' of input set {k} is not finite ({nonfinite_count(array[~finite], array.size)}): a check against it "
                    "would prove nothing; store inputs on which the outputs are finite, or allow non-finite references "
                    "(allow_nonfinite=True, --allow-nonfinite) when the outputs hold inf or NaN by design"
                )


def _used_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """Opset versions of the domains the model's nodes use (in subgraphs and functions too)."""
    imported = {op.domain: op.version for op in model.opset_import}
    used: set[str] = set()
    stack = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    while stack:
        node = stack.pop()
        used.add(node.domain)
        for attr in node.attribute:
            stack.extend(n for g in [attr.g, *attr.graphs] for n in g.node)
    return {d: imported[d] for d in used if d in imported}


def _manifest_fields(root: Path, spec: PipelineSpec, reference: list[tuple[str, str]]) -> dict[str, object]:
    opsets: dict[str, int] = {}
    for stage in spec.stages:
        if stage.module is not None and stage.module.endswith(".onnx"):
            for domain, version in _used_opsets(onnx.load(root / stage.module, load_external_data=False)).items():
                opsets[domain] = max(opsets.get(domain, 0), version)
    return {
        "versions": {"onnxpipe": onnxpipe.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "opsets": opsets,
        "providers": sorted({s.settings.provider for s in spec.stages if not s.is_code}),
        "reference": reference,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _write_archive(staging: Path, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        zf.write(staging / MANIFEST_NAME, MANIFEST_NAME, compress_type=zipfile.ZIP_DEFLATED)
        for path in sorted(p for p in staging.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
            rel = path.relative_to(staging).as_posix()
            if rel.endswith(_STORED):
                _write_aligned(zf, path, rel)
            else:
                zf.write(path, rel, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, out)


_ALIGNMENT_EXTRA = 0xD935  # the extra-field id Android's zipalign pads with; readers skip unknown ids


def _write_aligned(zf: zipfile.ZipFile, path: Path, rel: str) -> None:
    """Store ``path`` uncompressed with its bytes starting at a page boundary of the archive, padded
    by an extra field, so the runtime can leave external data in the archive (docs/bundle-format.md)."""
    info = zipfile.ZipInfo.from_file(path, rel)
    info.compress_type = zipfile.ZIP_STORED
    assert zf.fp is not None
    zip64 = info.file_size * 1.05 > zipfile.ZIP64_LIMIT  # as zipfile decides for its local header
    header = 30 + len(rel.encode()) + (20 if zip64 else 0)
    pad = -(zf.fp.tell() + header + 4) % PAGE  # 4: the extra field's own id and length
    info.extra = struct.pack("<HH", _ALIGNMENT_EXTRA, pad) + b"\0" * pad
    with open(path, "rb") as src, zf.open(info, "w") as dest:
        assert (info.header_offset + header + len(info.extra)) % PAGE == 0
        shutil.copyfileobj(src, dest, 1 << 20)
