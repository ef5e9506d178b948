"""The checks of a bundle folder (one given, or an archive unpacked): what it holds against its
manifest, byte for byte, then its config, its stage modules and the files they name.
:func:`check_folder` makes the checked :class:`Bundle` (see Note: loading is checked before
anything runs, in ``_read.py``)."""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from onnxpipe._errors import BundleError, ConfigError
from onnxpipe.runtime._overrides import StageOverrides, apply_overrides
from onnxpipe.runtime._protoscan import Relocation, external_locations
from onnxpipe.runtime._spec import PipelineSpec, StageSpec
from onnxpipe.runtime.bundle._bundle import Bundle
from onnxpipe.runtime.bundle._files import check_relative, copy_range, read_json, sha256_file, walk_files
from onnxpipe.runtime.bundle._limits import Limits, check_caps
from onnxpipe.runtime.bundle._manifest import CONFIG_NAME, MANIFEST_NAME, Manifest

__all__ = ["check_folder"]


def check_folder(
    root: Path,
    limits: Limits,
    tmp: Path | None,
    label: str,
    kept: Mapping[str, Relocation] | None = None,
    sessions: Collection[str] | None = None,
    overrides: Sequence[StageOverrides] = (),
) -> Bundle:
    """Check the bundle in the folder ``root`` and return it.

    Args:
        root: The folder.
        limits: The host's limits.
        tmp: The private folder an archive was unpacked into (removed with the bundle), or None.
        label: What messages call the bundle (the path the caller gave).
        kept: Members left in the archive (see Note: external data left in the archive), by bundle path.
        sessions: The stages checked against the host's caps (see ``read_bundle``).
        overrides: The host's deploy-time settings, applied to the spec.
    """
    kept = dict(kept or {})
    manifest = _listed_manifest(root, limits, label, kept)
    _check_contents(root, manifest, kept)
    spec = _checked_spec(root, limits, sessions, overrides)
    used = {target for stage in spec.stages for target in _module_files(root, stage, manifest, kept)}
    _check_reference(manifest)
    for rel in sorted(set(kept) - used):  # not a stage's external data after all: unpack it
        copy_range(kept.pop(rel), root / rel)
    bundle = Bundle(root, spec, manifest, tmp, kept, limits)
    bundle.capped = None if sessions is None else frozenset(sessions)
    bundle.overrides = tuple(overrides)
    for stage in spec.stages:
        if stage.module is not None:
            bundle.session_source(stage)  # every tensor that points into the archive fits in its member
    return bundle


def _listed_manifest(root: Path, limits: Limits, label: str, kept: Mapping[str, Relocation]) -> Manifest:
    """The manifest, read once the folder holds only regular files, checked to list exactly the
    files the bundle holds (``kept`` ones included), the config among them."""
    present = set(walk_files(root, limits)) | set(kept)
    if MANIFEST_NAME not in present:
        raise BundleError(f"'{label}' is not a bundle: it has no {MANIFEST_NAME}")
    manifest = Manifest.from_dict(read_json(root / MANIFEST_NAME, limits, MANIFEST_NAME), limits)
    present.discard(MANIFEST_NAME)
    manifest.check_missing(present)
    extra = sorted(present - set(manifest.files))
    if extra:
        raise BundleError(f"bundle file '{extra[0]}' is not listed in the manifest; a bundle holds exactly what its manifest lists")
    if CONFIG_NAME not in manifest.files:
        raise BundleError(f"manifest does not list the config '{CONFIG_NAME}'")
    return manifest


def _check_contents(root: Path, manifest: Manifest, kept: Mapping[str, Relocation]) -> None:
    """Every file of the size the manifest says, then (all sizes right) of its sha256."""
    for rel, entry in sorted(manifest.files.items()):
        size = kept[rel].size if rel in kept else (root / rel).stat().st_size
        if size != entry.size:
            raise BundleError(f"bundle file '{rel}' is {size} bytes; the manifest says {entry.size} (truncated or altered)")
    for rel, entry in sorted(manifest.files.items()):
        where = kept.get(rel)
        digest = sha256_file(where.location, where.offset, where.size) if where else sha256_file(root / rel)
        if digest != entry.sha256:
            raise BundleError(f"bundle file '{rel}' does not match its sha256 in the manifest (altered or corrupted)")


def _checked_spec(root: Path, limits: Limits, sessions: Collection[str] | None, overrides: Sequence[StageOverrides]) -> PipelineSpec:
    """The config, validated, with the host's overrides applied and within its caps."""
    try:
        spec = PipelineSpec.from_dict(read_json(root / CONFIG_NAME, limits, CONFIG_NAME))
        spec.validate()
    except ConfigError as e:
        raise BundleError(f"{CONFIG_NAME}: {e}") from e
    for stage in spec.stages:
        if stage.settings.max_batch > 1 and stage.batching is None:
            raise BundleError(f"{CONFIG_NAME}: stage '{stage.name}' has max_batch {stage.settings.max_batch} but no batching record: "
                              "build it with onnxpipe build (which checks that the stage can batch), or set max_batch to 1")
    spec = apply_overrides(spec, overrides)  # the host's settings, checked as the bundle's own are (caps below, cores at session start)
    check_caps(spec, limits, sessions)
    return spec


def _module_files(root: Path, stage: StageSpec, manifest: Manifest, kept: Mapping[str, Relocation]) -> set[str]:
    """The external-data files of a stage's module, each held by the bundle (none for a code
    stage or an ORT-format module); refuses a module the bundle does not hold."""
    if stage.module is None:
        return set()  # a code stage: no file; what it names is checked against the host's allow-list at load
    module = check_relative(stage.module, f"module of stage '{stage.name}'")
    if module not in manifest.files or module in kept:
        raise BundleError(f"stage '{stage.name}' names module '{module}', which the bundle does not hold")
    if module.endswith(".ort"):
        return set()  # onnxruntime's ORT format holds its weights inline: nothing outside to check
    if not module.endswith(".onnx"):
        raise BundleError(f"stage '{stage.name}' module '{module}' is neither an .onnx nor an .ort file")
    folder = posixpath.dirname(module)
    used = set()
    for location in external_locations(root / module, module):
        target = posixpath.normpath(posixpath.join(folder, location))
        check_relative(location, f"external data of stage '{stage.name}'")
        if target not in manifest.files:
            raise BundleError(f"stage '{stage.name}' module refers to external data '{location}', which the bundle does not hold")
        used.add(target)
    return used


def _check_reference(manifest: Manifest) -> None:
    """Every reference file a path inside the bundle, held by it."""
    for i, o in manifest.reference:
        for rel in (i, o):
            check_relative(rel, "reference file")
            if rel not in manifest.files:
                raise BundleError(f"reference file '{rel}' is not in the bundle")
