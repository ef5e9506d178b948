"""The manifest: every file's size and sha256, and what the bundle needs to run; its JSON form,
read and checked in one place (:meth:`Manifest.from_dict`) and written by :func:`write_manifest`."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxpipe._errors import BundleError
from onnxpipe.runtime._spec import describe_json
from onnxpipe.runtime.bundle._files import check_relative, sha256_file, walk_files
from onnxpipe.runtime.bundle._limits import Limits

__all__ = ["CONFIG_NAME", "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_VERSION", "FileEntry", "Manifest", "write_manifest"]

CONFIG_NAME = "pipeline.json"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "onnxpipe.manifest"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    """One file of a bundle as the manifest records it."""

    size: int
    sha256: str


@dataclass
class Manifest:
    """The manifest: every file's size and hash, and what the bundle needs to run.

    Attributes:
        files: Relative path (``/``-separated) -> size and sha256, for every file but the manifest.
        versions: Versions of the tools that built the bundle (``onnx``, ``onnxruntime``, ``onnxpipe``).
        opsets: Opset domain -> highest version any stage imports (``""`` is the default domain).
        providers: Execution providers the stages target.
        reference: Pairs of reference input / output files (relative paths), possibly empty.
        created: ISO 8601 time of export.
    """

    files: dict[str, FileEntry]
    versions: dict[str, str] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=dict)
    providers: list[str] = field(default_factory=list)
    reference: list[tuple[str, str]] = field(default_factory=list)
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "created": self.created,
            "versions": dict(self.versions),
            "opsets": dict(self.opsets),
            "providers": list(self.providers),
            "reference": [{"inputs": i, "outputs": o} for i, o in self.reference],
            "files": {p: {"size": e.size, "sha256": e.sha256} for p, e in sorted(self.files.items())},
        }

    def check_missing(self, present: Collection[str]) -> None:
        """Refuse a bundle missing a file this manifest lists (``present``: the files it holds)."""
        missing = sorted(set(self.files) - set(present))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise BundleError(f"bundle file '{missing[0]}' is listed in the manifest but missing{more}")

    @classmethod
    def from_dict(cls, data: Any, limits: Limits) -> Manifest:
        """Read and check the JSON form.

        Checked in this order, the first problem raised: the format and version, the files table
        (each entry's path, size and hash, then the sizes against ``limits``), the reference
        pairs, then the optional fields.

        Raises:
            BundleError: wrong format or version, malformed entries, bad paths, oversize declarations.
        """
        _check_format(data)
        files = _file_entries(data.get("files"), limits)
        reference = _reference_pairs(data)
        versions, opsets, providers, created = _described(data)
        return cls(files=files, versions=versions, opsets=opsets, providers=providers, reference=reference, created=created)


def _check_format(data: Any) -> None:
    """Refuse JSON that is not an onnxpipe manifest of the version this onnxpipe reads."""
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise BundleError(f"{MANIFEST_NAME} is not an onnxpipe manifest (expected \"format\": \"{MANIFEST_FORMAT}\")")
    if data.get("version") != MANIFEST_VERSION or type(data.get("version")) is not int:
        raise BundleError(f"manifest version {describe_json(data.get('version'))} is not supported; this onnxpipe reads version {MANIFEST_VERSION}")


def _file_entries(files: Any, limits: Limits) -> dict[str, FileEntry]:
    """The manifest's ``files`` table, each entry checked, their count and sizes within ``limits``."""
    if not isinstance(files, dict):
        raise BundleError(f"{MANIFEST_NAME} has no 'files' table")
    if len(files) > limits.max_files:
        raise BundleError(f"manifest lists {len(files)} files; the limit is {limits.max_files}")
    entries = {path: _file_entry(path, entry, limits) for path, entry in files.items()}
    total = sum(e.size for e in entries.values())
    if total > limits.max_total_bytes:
        raise BundleError(f"manifest declares {total} bytes in all; the limit is {limits.max_total_bytes}")
    return entries


def _file_entry(path: str, entry: Any, limits: Limits) -> FileEntry:
    """One entry of the ``files`` table: a bundle path other than the manifest's, a size within
    ``max_file_bytes`` and a sha256 in lowercase hex."""
    check_relative(path, "manifest entry")
    if path == MANIFEST_NAME:
        raise BundleError(f"manifest lists itself ('{path}')")
    if not isinstance(entry, dict):
        raise BundleError(f"manifest entry '{path}' must be an object with 'size' and 'sha256', got {describe_json(entry)}")
    size, digest = entry.get("size"), entry.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise BundleError(f"manifest entry '{path}': size must be an integer >= 0, got {describe_json(size)}")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise BundleError(f"manifest entry '{path}': sha256 must be 64 lowercase hex digits")
    if size > limits.max_file_bytes:
        raise BundleError(f"manifest entry '{path}' declares {size} bytes; the limit for one file is {limits.max_file_bytes}")
    return FileEntry(size, digest)


def _reference_pairs(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The manifest's ``reference`` list: pairs of bundle paths (inputs, outputs)."""
    reference = []
    for pair in _manifest_field(data, "reference", list, "a list"):
        if not isinstance(pair, dict) or not all(isinstance(pair.get(k), str) for k in ("inputs", "outputs")):
            raise BundleError("manifest 'reference' entries must be objects with string 'inputs' and 'outputs'")
        reference.append((check_relative(pair["inputs"], "reference file"), check_relative(pair["outputs"], "reference file")))
    return reference


def _described(data: dict[str, Any]) -> tuple[dict[str, str], dict[str, int], list[str], str]:
    """The fields that describe the bundle (versions, opsets, providers, created): each field's
    kind checked first, then what they hold."""
    versions = _manifest_field(data, "versions", dict, "a table of strings")
    opsets = _manifest_field(data, "opsets", dict, "a table of integers")
    providers = _manifest_field(data, "providers", list, "a list of strings")
    created = _manifest_field(data, "created", str, "a string")
    if not all(isinstance(v, str) for v in versions.values()):
        raise BundleError("manifest 'versions' must be a table of strings")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in opsets.values()):
        raise BundleError("manifest 'opsets' must be a table of integers >= 0 (domain -> opset version)")
    if not all(isinstance(p, str) for p in providers):
        raise BundleError("manifest 'providers' must be a list of strings")
    return dict(versions), dict(opsets), list(providers), created


def _manifest_field(data: dict[str, Any], key: str, kind: type, what: str) -> Any:
    """An optional manifest field, checked to be of ``kind``; missing: an empty one."""
    value = data.get(key, kind())
    if not isinstance(value, kind):
        raise BundleError(f"manifest '{key}' must be {what}, got {describe_json(value)}")
    return value


def write_manifest(root: Path, manifest_fields: Mapping[str, Any], known: Mapping[str, FileEntry] | None = None) -> Manifest:
    """Hash every file under ``root`` and write ``manifest.json``; used by the builder's export.

    Args:
        root: The bundle's folder, every file in place.
        manifest_fields: The manifest's other fields (versions, opsets, providers, reference, created).
        known: Entries of files copied byte for byte from a checked bundle (:meth:`Bundle.copy_files`):
            kept as they are, not hashed again (a rebundle hashes only its new config).
    """
    known = known or {}

    def entry(rel: str) -> FileEntry:
        size = (root / rel).stat().st_size
        if rel in known and known[rel].size == size:
            return known[rel]
        return FileEntry(size, sha256_file(root / rel))

    files = {rel: entry(rel) for rel in sorted(walk_files(root, Limits())) if rel != MANIFEST_NAME}
    manifest = Manifest(files=files, **manifest_fields)
    (root / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return manifest
