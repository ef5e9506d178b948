"""Bundles: a folder or a single archive holding a pipeline's config, stage modules and manifest.

Layout (the same inside an archive)::

    pipeline.json          the PipelineSpec (stages, settings, wiring, param groups)
    manifest.json          sha256 + size of every other file, versions, opsets, providers
    stages/stage0.onnx     one module per stage (+ stage0.onnx.data when weights are external)
    reference/inputs-0.npz optional reference inputs and outputs for self-checks

Note: loading is checked before anything runs.
    :func:`read_bundle` accepts a bundle only when every one of these holds, and otherwise raises
    one :class:`BundleError` naming the problem: no symbolic or hard links; every path relative,
    normalized and inside the bundle; every file listed in the manifest with the right size and
    sha256, and no file that is not listed; sizes and counts within :class:`Limits`; a known
    schema version; a wiring that validates; stage modules and the external-data files they name
    (found by a wire scan, see ``_protoscan``) listed in the manifest; stage settings within the
    host's thread and replica caps (see ``check_caps``). An archive is unpacked into a private
    temporary folder, member by member, only once its zip directory agrees with its manifest (see
    ``_unpack``), and nothing is ever written outside it. No pickle is
    read anywhere (numpy files are loaded with ``allow_pickle=False``). Every hash is computed in
    chunks of ``_CHUNK`` bytes: no file is ever read whole to check it.

Note: external data left in the archive.
    An archive member ``*.data`` stored uncompressed at a page-aligned offset (what ``export`` writes)
    is not unpacked: it is hashed in place, and the stage modules that use it are handed to
    onnxruntime as bytes whose external-data entries point into the archive (at the member's offset
    plus the tensor's, each tensor checked to lie within the member), with the archive's folder as
    ``session.model_external_initializers_file_folder_path``. onnxruntime then maps the weights
    from the archive itself, as it maps an unpacked ``.data`` file: loading writes no copy of the
    weights to disk, and holds none more in memory. Like a folder bundle, the archive must not be
    changed while it is loaded (it is checked once, then read in place). Any other member, and every
    member of an archive written otherwise, is unpacked as before.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import shutil
import stat
import struct
import tempfile
import weakref
import zipfile
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxpipe._errors import BundleError, ConfigError, InputError
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._overrides import Overrides, StageOverrides, apply_overrides, as_overrides
from onnxpipe.runtime._protoscan import Relocation, external_locations, relocate_external
from onnxpipe.runtime._session import maps_archive_data
from onnxpipe.runtime._settings import host_cores
from onnxpipe.runtime._spec import PipelineSpec, StageSpec, describe_json, parse_json

__all__ = [
    "ARCHIVE_SUFFIX",
    "CONFIG_NAME",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Bundle",
    "FileEntry",
    "Limits",
    "Manifest",
    "check_caps",
    "check_relative",
    "is_bundle",
    "linked_folder",
    "load_npz",
    "npz_layout",
    "read_bundle",
    "save_npz",
    "sha256_file",
    "write_manifest",
]

CONFIG_NAME = "pipeline.json"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "onnxpipe.manifest"
MANIFEST_VERSION = 1
#: A bundle written as one file is a zip archive with this suffix.
ARCHIVE_SUFFIX = ".onnxpipe"
_CHUNK = 1 << 20
#: Offsets of the member data that may stay in an archive (see the note above).
PAGE = 4096
#: The compression methods an archive may use (what export writes, and what zip tools write by default).
_COMPRESSIONS = {zipfile.ZIP_STORED: "stored (0)", zipfile.ZIP_DEFLATED: "deflate (8)"}
#: onnxruntime's external-data location meaning "the offset is a memory address" (refused, see check_relative).
ORT_MEMORY_ADDRESS_TAG = "*/_ORT_MEM_ADDR_/*"
#: onnxruntime's session config key for where a module loaded from bytes finds its external data.
_DATA_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


@dataclass(frozen=True)
class Limits:
    """What a bundle may declare at most; anything larger is refused before it is read.

    Attributes:
        max_files: Files in the bundle.
        max_file_bytes: Size of one file.
        max_total_bytes: Size of all files together.
        max_json_bytes: Size of the config and of the manifest.
        max_compression_ratio: Unpacked size over compressed size of an archive member (members
            of 1 MiB and less unpacked are exempt: they cannot exhaust anything).
        max_reference_bytes: Bytes of all reference arrays together, as their headers declare.
        max_threads: Intra-op and inter-op threads of one stage session (``None``: 4 x the cores
            this process may use).
        max_replicas: Replicas of one stage (``None``: 4 x the cores this process may use).
        max_pipeline_threads: Threads of all stages together, every replica's worker and thread
            pools counted (``None``: 16 x the cores this process may use).

    Only the host sets these (``load(..., limits=Limits(...))``); nothing in a bundle changes them.
    """

    max_files: int = 10_000
    max_file_bytes: int = 64 << 30
    max_total_bytes: int = 256 << 30
    max_json_bytes: int = 16 << 20
    max_compression_ratio: float = 100
    max_reference_bytes: int = 1 << 30
    max_threads: int | None = None
    max_replicas: int | None = None
    max_pipeline_threads: int | None = None


def check_caps(spec: PipelineSpec, limits: Limits, stages: Collection[str] | None = None) -> None:
    """Refuse stage settings that would start more threads or replicas than this host allows.

    Args:
        spec: The pipeline.
        limits: The host's limits.
        stages: The stages whose sessions this host starts (default: all of them). With the Ray
            engine the driver starts none, and each actor checks its own stage against its node.

    Note: thread and replica caps.
        A bundle's settings are the builder's wish, not the host's: ``intra_op_threads: 2000``
        would start thousands of threads. Each of a stage's ``intra_op_threads``,
        ``inter_op_threads`` and ``replicas`` is capped at ``4 x`` the cores this process may use
        (more never runs faster, but a bundle built on a bigger host still loads), and the threads
        of all stages together (:meth:`StageSettings.thread_count` per replica) at ``16 x``. The
        host changes them with :class:`Limits`; nothing in a bundle does. A setting over its cap
        is refused rather than lowered silently, like every other limit.
    """
    cores = host_cores()

    def cap(value: int | None, times: int, knob: str) -> tuple[int, str]:
        if value is not None:
            return value, f"Limits.{knob}"
        return times * cores, f"{times} x the {cores} core(s) this process may use"

    how = ("lower it in the bundle's settings, or raise the cap on this host with load(..., limits=Limits({}=...)); "
           "or lower it at load: load(..., overrides=...), onnxpipe serve/run/bench --set")
    threads, threads_why = cap(limits.max_threads, 4, "max_threads")
    replicas, replicas_why = cap(limits.max_replicas, 4, "max_replicas")
    here = [stage for stage in spec.stages if stages is None or stage.name in stages]
    for stage in here:
        s = stage.settings
        for setting, value, most, why, knob in (
            ("intra_op_threads", s.intra_op_threads, threads, threads_why, "max_threads"),
            ("inter_op_threads", s.inter_op_threads, threads, threads_why, "max_threads"),
            ("replicas", s.replicas, replicas, replicas_why, "max_replicas"),
        ):
            if value > most:
                raise BundleError(f"stage '{stage.name}': {setting} {value} is over this host's cap of {most} ({why}); " + how.format(knob))
    total, total_why = cap(limits.max_pipeline_threads, 16, "max_pipeline_threads")
    count = sum(s.settings.replicas * s.settings.thread_count(cores) for s in here)
    if count > total:
        raise BundleError(f"the stages' settings start {count} threads in all; this host's cap is {total} ({total_why}); " + how.format("max_pipeline_threads"))


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

    @classmethod
    def from_dict(cls, data: Any, limits: Limits) -> Manifest:
        """Read and check the JSON form.

        Raises:
            BundleError: wrong format or version, malformed entries, bad paths, oversize declarations.
        """
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise BundleError(f"{MANIFEST_NAME} is not an onnxpipe manifest (expected \"format\": \"{MANIFEST_FORMAT}\")")
        if data.get("version") != MANIFEST_VERSION or type(data.get("version")) is not int:
            raise BundleError(f"manifest version {describe_json(data.get('version'))} is not supported; this onnxpipe reads version {MANIFEST_VERSION}")
        files = data.get("files")
        if not isinstance(files, dict):
            raise BundleError(f"{MANIFEST_NAME} has no 'files' table")
        if len(files) > limits.max_files:
            raise BundleError(f"manifest lists {len(files)} files; the limit is {limits.max_files}")
        entries: dict[str, FileEntry] = {}
        total = 0
        for path, entry in files.items():
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
            total += size
            entries[path] = FileEntry(size, digest)
        if total > limits.max_total_bytes:
            raise BundleError(f"manifest declares {total} bytes in all; the limit is {limits.max_total_bytes}")
        reference = []
        for pair in _manifest_field(data, "reference", list, "a list"):
            if not isinstance(pair, dict) or not all(isinstance(pair.get(k), str) for k in ("inputs", "outputs")):
                raise BundleError("manifest 'reference' entries must be objects with string 'inputs' and 'outputs'")
            reference.append((check_relative(pair["inputs"], "reference file"), check_relative(pair["outputs"], "reference file")))
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
        return cls(files=entries, versions=dict(versions), opsets=dict(opsets), providers=list(providers), reference=reference, created=created)


def _manifest_field(data: dict[str, Any], key: str, kind: type, what: str) -> Any:
    """An optional manifest field, checked to be of ``kind``; missing: an empty one."""
    value = data.get(key, kind())
    if not isinstance(value, kind):
        raise BundleError(f"manifest '{key}' must be {what}, got {describe_json(value)}")
    return value


def sha256_file(path: str | Path, offset: int = 0, size: int | None = None) -> str:
    """Hex sha256 of a file (or of ``size`` bytes of it from ``offset``), read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        left = f.seek(0, os.SEEK_END) - offset if size is None else size
        f.seek(offset)
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def check_relative(path: str, what: str) -> str:
    """Refuse a bundle path that is absolute, not normalized, leaves the bundle, or uses a reserved name.

    Note: onnxruntime's location tags.
        onnxruntime gives one external-data ``location`` a meaning of its own:
        ``*/_ORT_MEM_ADDR_/*`` (``kTensorProtoMemoryAddressTag`` in its ``tensorprotoutils.h``, the
        only such tag as of 1.32) says that the tensor's ``offset`` is the address of its bytes in
        memory. The tag is a relative, normalized path, so a bundle holding a file there passed every
        other check, and onnxruntime 1.18 then read from the address a hostile module chose (the
        process died with SIGSEGV). Every bundle path (archive members, manifest entries, modules,
        external-data locations) is refused when a component is ``_ORT_MEM_ADDR_``, or any name
        ``_ORT_..._`` that a later onnxruntime could give the same kind of meaning.

    Returns:
        The path, unchanged.

    Raises:
        BundleError: naming the path and why.
    """
    if not isinstance(path, str) or not path:
        raise BundleError(f"{what}: empty or non-string path {path!r}")
    if any("\ud800" <= c <= "\udfff" for c in path):  # a lone surrogate (JSON "\ud800") names no file
        raise BundleError(f"{what} {path!r} is not valid Unicode")
    if "\\" in path or "\0" in path:
        raise BundleError(f"{what} '{path}': backslashes and NUL are not allowed in bundle paths")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise BundleError(f"{what} '{path}' is absolute; bundle paths are relative to the bundle")
    if posixpath.normpath(path) != path or path.split("/")[0] == ".." or "/../" in f"/{path}/":
        raise BundleError(f"{what} '{path}' is not a normalized path inside the bundle")
    if any(part.startswith("_ORT_") and part.endswith("_") for part in path.split("/")):
        # See Note: onnxruntime's location tags.
        raise BundleError(
            f"{what} '{path}' names onnxruntime's reserved location tag '{ORT_MEMORY_ADDRESS_TAG}' (or one like it), "
            "under which onnxruntime reads a tensor's offset as a memory address; bundle paths may not use it"
        )
    return path


class Bundle:
    """A checked bundle on disk: its spec, its manifest, and where its files are.

    Use :func:`read_bundle` to get one. A bundle read from an archive lives in a private temporary
    folder, removed by :meth:`close` (or when the object is collected).
    """

    def __init__(
        self,
        root: Path,
        spec: PipelineSpec,
        manifest: Manifest,
        tmp: Path | None = None,
        in_archive: Mapping[str, Relocation] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.root = root
        self.spec = spec
        self.manifest = manifest
        #: The limits it was read with; they also bound its reference data (see :meth:`reference`).
        self.limits = limits or Limits()
        #: Files left in the archive (see the note "external data left in the archive"), by bundle path.
        self.in_archive = dict(in_archive or {})
        #: The host's allow-list for the Python the bundle names (code stages, custom-op packages):
        #: fnmatch patterns; empty allows nothing. Set by the host (``read_bundle``/``load``), never
        #: by the bundle; ``make_runner`` checks it before importing anything.
        self.allow_code: tuple[str, ...] = ()
        #: The stages checked against this host's thread and replica caps when it was read (None:
        #: all; see ``read_bundle(sessions=...)``); a thread engine checks the rest before it starts.
        self.capped: frozenset[str] | None = None
        #: The host's deploy-time settings, applied to :attr:`spec` when it was read (``read_bundle(overrides=...)``);
        #: kept for the readers of the same files elsewhere (a Ray actor reads the bundle again).
        self.overrides: tuple[StageOverrides, ...] = ()
        self._cleanup = weakref.finalize(self, shutil.rmtree, tmp, True) if tmp else None

    def session_source(self, stage: str | StageSpec) -> tuple[str | bytes, dict[str, str]]:
        """What onnxruntime opens for a stage: its module's path, or, when the module's external data
        stayed in the archive, the module's bytes pointing into the archive and the session config
        entry saying where the archive is.

        Raises:
            BundleError: a tensor of the module does not fit in the external data it names.
        """
        spec = self.spec.stage(stage) if isinstance(stage, str) else stage
        if spec.module is None:
            raise BundleError(f"stage '{spec.name}' is a code stage; it has no module")
        path = self.root / spec.module
        moves = self._moves(spec.module)
        if not spec.module.endswith(".onnx") or not any(moves(loc) for loc in external_locations(path, spec.module)):
            return str(path), {}
        archive = next(iter(self.in_archive.values())).location
        return relocate_external(path, moves, spec.module), {_DATA_FOLDER_KEY: os.path.dirname(archive)}

    def _moves(self, module: str) -> Callable[[str], Relocation | None]:
        folder = posixpath.dirname(module)

        def move(location: str) -> Relocation | None:
            kept = self.in_archive.get(posixpath.normpath(posixpath.join(folder, location)))
            return None if kept is None else Relocation(posixpath.basename(kept.location), kept.offset, kept.size)

        return move

    def reference(self) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
        """The reference (inputs, outputs) pairs stored in the bundle, possibly none.

        Every array's header is checked before any data is read: its dtype and shape against the
        pipeline's inputs (or outputs), its size against its file, and the size of all of them
        against ``limits.max_reference_bytes``.

        Raises:
            BundleError: a reference file is not an .npz of arrays, an array does not match the
                pipeline, or the arrays together are too large.
        """
        total = 0
        for pair in self.manifest.reference:
            for rel, specs, what in zip(pair, (self.spec.inputs, self.spec.outputs), ("input", "output"), strict=True):
                layout = npz_layout(self.root / rel, self.limits)
                try:
                    check_inputs(specs, layout, what=f"reference {what}")
                except InputError as e:
                    raise BundleError(f"reference file '{rel}': {e}") from e
                total += sum(a.nbytes for a in layout.values())
        if total > self.limits.max_reference_bytes:
            raise BundleError(
                f"the reference arrays declare {total} bytes in all; the limit is {self.limits.max_reference_bytes} "
                "(a host that trusts the bundle can raise it with Limits(max_reference_bytes=...))"
            )
        return [(load_npz(self.root / i, self.limits), load_npz(self.root / o, self.limits)) for i, o in self.manifest.reference]

    def copy_files(self, dest: Path, skip: Collection[str] = ()) -> dict[str, FileEntry]:
        """Copy every file the manifest lists (but ``skip``) into the folder ``dest``, byte for
        byte, from the bundle's folder or from its archive where a member stayed there.

        Returns:
            The manifest's entries of the files copied (their size and sha256, checked when the
            bundle was read), by bundle path.
        """
        copied = {}
        for rel, entry in sorted(self.manifest.files.items()):
            if rel in skip:
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if rel in self.in_archive:
                _copy_range(self.in_archive[rel], target)
            else:
                shutil.copyfile(self.root / rel, target)
            copied[rel] = entry
        return copied

    def close(self) -> None:
        """Remove the temporary folder of an unpacked archive (nothing for a folder bundle)."""
        if self._cleanup is not None:
            self._cleanup()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bundle({str(self.root)!r}, stages={[s.name for s in self.spec.stages]})"


def load_npz(path: str | os.PathLike[str], limits: Limits | None = None) -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name, read without pickle.

    Every array's header is read and checked first (see :func:`npz_layout`), so no array is
    allocated bigger than the bytes its file holds.

    Args:
        path: The .npz file.
        limits: Also refuse a member deflated beyond ``limits.max_compression_ratio``.

    Raises:
        BundleError: the file is missing or not an .npz of plain arrays.
    """
    npz_layout(path, limits)
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise BundleError(f"'{Path(path).name}' holds a single array, not an .npz of named arrays")
        with data:
            return {k: _loaded(data[k]) for k in data.files}
    except FileNotFoundError:
        raise BundleError(f"'{path}' does not exist") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise BundleError(f"cannot read '{Path(path).name}' as an .npz of arrays: {e}") from e


def _loaded(array: np.ndarray) -> np.ndarray:
    """A stored array as the pipeline uses it: fixed-width unicode back to an ``object`` array of ``str``."""
    return array.astype(object) if array.dtype.kind == "U" else array


def npz_layout(path: str | os.PathLike[str], limits: Limits | None = None) -> dict[str, np.ndarray]:
    """Stand-ins for the arrays of an .npz file, read from the ``.npy`` headers only: each a
    read-only broadcast view of one zero, of the array's dtype and shape, taking no memory (so
    ``check_inputs`` can check thousands of files, or a hostile one, without reading their data).

    Each header is checked against its zip member: the member holds exactly the header and the
    bytes the header's dtype and shape make (a 16 KiB file cannot declare a 2 GiB array), and no
    array holds Python objects.

    Args:
        path: The .npz file.
        limits: Also refuse a member deflated beyond ``limits.max_compression_ratio``.

    Raises:
        BundleError: the file is missing, not an .npz of arrays, or an array's header lies.
    """
    fmt = np.lib.format
    name = Path(path).name
    layout: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for m in zf.infolist():
                if not m.filename.endswith(".npy"):
                    raise BundleError(f"'{name}' member '{m.filename}' is not an .npy array")
                if limits is not None:
                    _check_ratio(m, m.filename, limits, f"'{name}' member")
                with zf.open(m) as f:
                    major, _ = fmt.read_magic(f)
                    shape, _, dtype = fmt.read_array_header_1_0(f) if major == 1 else fmt.read_array_header_2_0(f)
                    header = f.tell()
                if dtype.hasobject:
                    raise BundleError(f"'{name}' array '{m.filename}' holds Python objects; only plain arrays are read (no pickle)")
                nbytes = math.prod(shape) * dtype.itemsize
                if header + nbytes != m.file_size:
                    held = m.file_size - header
                    raise BundleError(f"'{name}' array '{m.filename}' declares {dtype} {list(shape)} ({nbytes} bytes) but its member holds {held}")
                layout[m.filename.removesuffix(".npy")] = np.broadcast_to(np.zeros((), dtype), shape)
    except FileNotFoundError:
        raise BundleError(f"'{path}' does not exist") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise BundleError(f"cannot read '{name}' as an .npz of arrays: {e}") from e
    return layout


def save_npz(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> Path:
    """Write arrays by name to exactly ``path`` as an .npz, without pickle.

    Unlike ``numpy.savez`` it takes any name (``file``, ``allow_pickle``, names with ``/``) and
    never appends ``.npz``. The file is written whole or not at all. A ``string`` tensor (a numpy
    ``object`` array of ``str``, as onnxruntime returns it) is stored as numpy's fixed-width
    unicode (``<U``, no pickle), which :func:`load_npz` turns back into an ``object`` array of ``str``.

    Raises:
        BundleError: an array holds Python objects other than ``str`` (nothing is written).
    """
    path = Path(path)
    plain = {name: _storable(name, value) for name, value in arrays.items()}  # checked before anything is written
    tmp = path.with_name(f".{path.name}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        for name, value in plain.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, value, allow_pickle=False)
    os.replace(tmp, path)
    return path


def _storable(name: str, value: object) -> np.ndarray:
    """The array as .npy stores it without pickle: strings as fixed-width unicode."""
    array = np.asanyarray(value)
    if array.dtype != object:
        return array
    odd = next((v for v in array.reshape(-1) if not isinstance(v, str)), None)
    if odd is not None:
        raise BundleError(f"array '{name}' holds a {type(odd).__name__}; of Python objects only str (a string tensor) can be saved, without pickle")
    return array.astype(str) if array.size else np.zeros(array.shape, "<U1")


def is_bundle(path: object) -> bool:
    """True for a path that looks like a bundle: a folder with a manifest, or a zip archive."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    p = Path(path)
    return (p.is_dir() and (p / MANIFEST_NAME).is_file()) or (p.is_file() and zipfile.is_zipfile(p))


def linked_folder(path: str | os.PathLike[str]) -> bool:
    """True for a symbolic link to a folder, which :func:`read_bundle` does not read as a bundle:
    a bundle holds regular files only, its own folder included (a link to an archive file is read)."""
    p = Path(path)
    return p.is_symlink() and p.is_dir()


def read_bundle(
    path: str | os.PathLike[str],
    limits: Limits | None = None,
    *,
    allow_code: Sequence[str] = (),
    sessions: Collection[str] | None = None,
    overrides: Overrides | None = None,
) -> Bundle:
    """Open a bundle folder or archive and check all of it (see the note above).

    Reading imports nothing: a bundle with code stages reads (and ``onnxpipe inspect`` lists its
    code) whatever ``allow_code`` says; its runners are refused unless allowed.

    Args:
        path: A bundle folder, or an archive file (zip, normally named ``*.onnxpipe``).
        limits: Size and count limits (default :class:`Limits`).
        allow_code: fnmatch patterns of the entry points and custom-op packages this host lets
            the bundle's stages import (kept as :attr:`Bundle.allow_code`; see ``_code``).
        sessions: The stages whose sessions this process will start, checked against this host's
            thread and replica caps (see ``check_caps``); default: all. The Ray engine's driver
            passes none, and each actor its own stage, checked against the actor's node.
        overrides: Deploy-time settings of the stages (threads, affinity, replicas, ...; see
            ``_overrides``), applied to the spec before it is checked against the caps: the
            bundle's files stay as they are (:attr:`Bundle.overrides` keeps them).

    Returns:
        The checked :class:`Bundle`.

    Raises:
        BundleError: anything missing, broken, or unsafe; nothing is left behind on failure.
        ConfigError: an override names no stage of the bundle, a setting that may not change at
            deploy time, a bad value, or a ``max_batch`` above what the build allows.
    """
    if isinstance(allow_code, str):
        raise TypeError("allow_code takes a list of patterns, not one string")
    limits = limits or Limits()
    changes = as_overrides(overrides)  # malformed ones are refused before anything is read
    path = Path(path)
    if not path.exists():
        raise BundleError(f"bundle '{path}' does not exist")
    if linked_folder(path):
        raise BundleError(f"bundle '{path}' is a symbolic link to a folder; bundles hold regular files only: give the folder itself")
    if path.is_dir():
        bundle = _check_folder(path, limits, None, str(path), sessions=sessions, overrides=changes)
    elif not path.is_file():
        raise BundleError(f"bundle '{path}' is neither a folder nor an archive file")
    else:
        tmp = Path(tempfile.mkdtemp(prefix="onnxpipe-bundle-"))
        try:
            kept = _unpack(path, tmp, limits)
            bundle = _check_folder(tmp, limits, tmp, str(path), kept, sessions, changes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    bundle.allow_code = tuple(allow_code)
    return bundle


def _unpack(archive: Path, dest: Path, limits: Limits) -> dict[str, Relocation]:
    """Unpack the archive into ``dest``, but for the members left in it (returned by bundle path).

    Note: sizes before bytes.
        Every member of the zip directory is checked (path, type, declared size, compression
        ratio), then the manifest, itself a member of at most ``max_json_bytes``, is unpacked and
        read, and every other member is compared with it (listed, same size) before a byte of any
        of them is written. While unpacking, no more than a member's declared size is copied.
        Unpacking therefore writes at most what the manifest declares, within ``Limits``.
    """
    if not zipfile.is_zipfile(archive):
        with open(archive, "rb") as file:
            begins_as_zip = file.read(4) == b"PK\x03\x04"
        if begins_as_zip:
            raise BundleError(f"archive '{archive}' is damaged or truncated: it begins as a zip archive but has no zip directory at its end; "
                              "copy it again (or export it again)")
        raise BundleError(f"'{archive}' is not a bundle: not a folder and not a zip archive")
    try:
        with zipfile.ZipFile(archive) as zf:
            members = _directory(zf, limits)
            manifest = _archive_manifest(zf, members, dest, limits, str(archive))
            _compare_with_manifest(members, manifest)
            kept: dict[str, Relocation] = {}
            for name, m in members.items():
                target = dest / name
                if m.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if name == MANIFEST_NAME:
                    continue  # unpacked and read first
                target.parent.mkdir(parents=True, exist_ok=True)
                offset = _data_offset(zf, m)
                if offset is not None and name.endswith(".data") and maps_archive_data():
                    kept[name] = Relocation(str(archive.resolve()), offset, m.file_size)
                else:
                    _extract(zf, m, target)
    # What zipfile and its decompressors raise on a damaged archive: a bad header or CRC, a corrupt or
    # truncated deflate stream, a file name that is not the UTF-8 it claims, offsets out of range.
    except (zipfile.BadZipFile, zlib.error, EOFError, UnicodeDecodeError, struct.error, OverflowError) as e:
        raise BundleError(f"archive '{archive}' is damaged: {e}") from e
    except NotImplementedError as e:  # zipfile's word for a zip version or method it cannot read
        raise BundleError(f"archive '{archive}' uses a zip feature onnxpipe cannot read: {e}") from e
    return kept


def _directory(zf: zipfile.ZipFile, limits: Limits) -> dict[str, zipfile.ZipInfo]:
    """The archive's members by bundle path, each checked from the zip directory alone."""
    members = zf.infolist()
    if len(members) > limits.max_files + 1:
        raise BundleError(f"archive has {len(members)} members; the limit is {limits.max_files}")
    total = sum(m.file_size for m in members)
    if total > limits.max_total_bytes:
        raise BundleError(f"archive declares {total} bytes unpacked; the limit is {limits.max_total_bytes}")
    assert zf.fp is not None
    size = zf.fp.seek(0, os.SEEK_END)
    checked: dict[str, zipfile.ZipInfo] = {}
    for k, m in enumerate(members):
        if not m.filename:  # a damaged directory entry; zipfile's own is_dir() would fail on it (IndexError)
            raise BundleError(f"archive member {k} has an empty name: damaged")
        name = m.filename.rstrip("/") if m.is_dir() else m.filename
        check_relative(name, "archive member")
        if not 0 <= m.header_offset <= size - 30:  # zipfile would seek there (a negative seek: OSError)
            raise BundleError(f"archive member '{name}' has its header at {m.header_offset}, outside the archive ({size} bytes): damaged")
        mode = m.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise BundleError(f"archive member '{m.filename}' is a symbolic link; bundles hold regular files only")
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):  # 0: no Unix type recorded
            raise BundleError(f"archive member '{m.filename}' is not a regular file")
        if name in checked:
            raise BundleError(f"archive member '{name}' appears twice")
        if m.file_size > limits.max_file_bytes:
            raise BundleError(f"archive member '{name}' declares {m.file_size} bytes; the limit for one file is {limits.max_file_bytes}")
        if m.flag_bits & 1:
            raise BundleError(f"archive member '{name}' is encrypted; bundles are not")
        if m.compress_type not in _COMPRESSIONS:
            raise BundleError(f"archive member '{name}' uses compression method {m.compress_type}; bundles use {' or '.join(_COMPRESSIONS.values())}")
        _check_ratio(m, name, limits, "archive member")
        checked[name] = m
    files = {name for name, m in checked.items() if not m.is_dir()}
    for name in checked:
        folder = posixpath.dirname(name)
        while folder:
            if folder in files:
                raise BundleError(f"archive member '{folder}' is a file, yet the archive also holds '{name}' inside it")
            folder = posixpath.dirname(folder)
    return checked


def _check_ratio(member: zipfile.ZipInfo, name: str, limits: Limits, what: str) -> None:
    """Refuse a zip member that inflates more than ``max_compression_ratio`` times (a zip bomb)."""
    # Small members are exempt: legitimate small files (a JSON file, a module of zeros) can deflate
    # beyond any sane ratio, and 1 MiB cannot exhaust anything.
    if member.file_size > _CHUNK and member.file_size > limits.max_compression_ratio * member.compress_size:
        ratio = member.file_size / max(member.compress_size, 1)
        raise BundleError(
            f"{what} '{name}' inflates {member.compress_size} bytes to {member.file_size} (ratio {ratio:.0f}:1); "
            f"the limit is {limits.max_compression_ratio:g}:1 (a host that trusts the bundle can raise it with "
            "Limits(max_compression_ratio=...))"
        )


def _archive_manifest(zf: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], dest: Path, limits: Limits, label: str) -> Manifest:
    """Unpack and read the manifest alone (at most ``max_json_bytes``), before any other member."""
    member = members.get(MANIFEST_NAME)
    if member is None or member.is_dir():
        raise BundleError(f"'{label}' is not a bundle: it has no {MANIFEST_NAME}")
    if member.file_size > limits.max_json_bytes:
        raise BundleError(f"{MANIFEST_NAME} is {member.file_size} bytes; the limit is {limits.max_json_bytes}")
    _extract(zf, member, dest / MANIFEST_NAME)
    return Manifest.from_dict(_read_json(dest / MANIFEST_NAME, limits, MANIFEST_NAME), limits)


def _compare_with_manifest(members: Mapping[str, zipfile.ZipInfo], manifest: Manifest) -> None:
    """Every file member is listed in the manifest with the size the zip directory declares, and
    every listed file is a member."""
    files = {name: m for name, m in members.items() if not m.is_dir() and name != MANIFEST_NAME}
    for name, m in files.items():
        entry = manifest.files.get(name)
        if entry is None:
            raise BundleError(f"archive member '{name}' ({m.file_size} bytes) is not listed in the manifest; a bundle holds exactly what its manifest lists")
        if m.file_size != entry.size:
            raise BundleError(f"archive member '{name}' declares {m.file_size} bytes; the manifest says {entry.size} (truncated or altered)")
    missing = sorted(set(manifest.files) - set(files))
    if missing:
        raise BundleError(f"bundle file '{missing[0]}' is listed in the manifest but missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def _data_offset(zf: zipfile.ZipFile, member: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed, unencrypted member's bytes start in the archive, when that is page-aligned."""
    if member.compress_type != zipfile.ZIP_STORED or member.flag_bits & 1 or member.compress_size != member.file_size or not member.file_size:
        return None
    assert zf.fp is not None
    zf.fp.seek(member.header_offset)
    header = zf.fp.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise BundleError(f"archive member '{member.filename}' has no valid local header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    offset = member.header_offset + 30 + name_len + extra_len
    return offset if offset % PAGE == 0 else None


def _extract(zf: zipfile.ZipFile, member: zipfile.ZipInfo, target: Path) -> None:
    """Copy one member, never more than its declared size (one byte more is read to see a liar)."""
    left = member.file_size
    # O_EXCL: never follow or overwrite anything; the folder is ours and fresh.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out, zf.open(member) as src:
        try:
            while chunk := src.read(min(_CHUNK, left + 1)):
                if len(chunk) > left:
                    raise BundleError(f"archive member '{member.filename}' holds more bytes than the {member.file_size} it declares")
                out.write(chunk)
                left -= len(chunk)
        except EOFError:  # a deflate stream cut short
            pass
    if left:
        raise BundleError(f"archive member '{member.filename}' holds {member.file_size - left} bytes; it declares {member.file_size} (truncated)")


def _copy_range(source: Relocation, target: Path) -> None:
    """Unpack a member left in the archive after all (its hash was checked in place)."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out, open(source.location, "rb") as src:
        src.seek(source.offset)
        left = source.size
        while left and (chunk := src.read(min(_CHUNK, left))):
            out.write(chunk)
            left -= len(chunk)


def _walk_files(root: Path, limits: Limits) -> Iterator[str]:
    """Relative paths of the regular files under root; refuses links and special files."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise BundleError(f"bundle entry '{rel}' is a symbolic link; bundles hold regular files only")
            if name in filenames:
                if not stat.S_ISREG(st.st_mode):
                    raise BundleError(f"bundle entry '{rel}' is not a regular file")
                if st.st_nlink > 1:
                    raise BundleError(f"bundle entry '{rel}' is a hard link ({st.st_nlink} links); bundles hold independent files only")
                count += 1
                if count > limits.max_files + 1:
                    raise BundleError(f"bundle has more than {limits.max_files} files")
                yield rel


def _read_json(path: Path, limits: Limits, what: str) -> Any:
    if path.stat().st_size > limits.max_json_bytes:
        raise BundleError(f"{what} is {path.stat().st_size} bytes; the limit is {limits.max_json_bytes}")
    return parse_json(path.read_bytes(), what, BundleError)


def _check_folder(
    root: Path,
    limits: Limits,
    tmp: Path | None,
    label: str,
    kept: Mapping[str, Relocation] | None = None,
    sessions: Collection[str] | None = None,
    overrides: Sequence[StageOverrides] = (),
) -> Bundle:
    kept = dict(kept or {})
    present = set(_walk_files(root, limits)) | set(kept)
    if MANIFEST_NAME not in present:
        raise BundleError(f"'{label}' is not a bundle: it has no {MANIFEST_NAME}")
    manifest = Manifest.from_dict(_read_json(root / MANIFEST_NAME, limits, MANIFEST_NAME), limits)
    present.discard(MANIFEST_NAME)
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise BundleError(f"bundle file '{missing[0]}' is listed in the manifest but missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(present - set(manifest.files))
    if extra:
        raise BundleError(f"bundle file '{extra[0]}' is not listed in the manifest; a bundle holds exactly what its manifest lists")
    if CONFIG_NAME not in manifest.files:
        raise BundleError(f"manifest does not list the config '{CONFIG_NAME}'")
    for rel, entry in sorted(manifest.files.items()):
        size = kept[rel].size if rel in kept else (root / rel).stat().st_size
        if size != entry.size:
            raise BundleError(f"bundle file '{rel}' is {size} bytes; the manifest says {entry.size} (truncated or altered)")
    for rel, entry in sorted(manifest.files.items()):
        where = kept.get(rel)
        digest = sha256_file(where.location, where.offset, where.size) if where else sha256_file(root / rel)
        if digest != entry.sha256:
            raise BundleError(f"bundle file '{rel}' does not match its sha256 in the manifest (altered or corrupted)")
    try:
        spec = PipelineSpec.from_dict(_read_json(root / CONFIG_NAME, limits, CONFIG_NAME))
        spec.validate()
    except ConfigError as e:
        raise BundleError(f"{CONFIG_NAME}: {e}") from e
    for stage in spec.stages:
        if stage.settings.max_batch > 1 and stage.batching is None:
            raise BundleError(f"{CONFIG_NAME}: stage '{stage.name}' has max_batch {stage.settings.max_batch} but no batching record: "
                              "build it with onnxpipe build (which checks that the stage can batch), or set max_batch to 1")
    spec = apply_overrides(spec, overrides)  # the host's settings, checked as the bundle's own are (caps below, cores at session start)
    check_caps(spec, limits, sessions)
    used: set[str] = set()
    for stage in spec.stages:
        if stage.module is None:
            continue  # a code stage: no file; what it names is checked against the host's allow-list at load
        module = check_relative(stage.module, f"module of stage '{stage.name}'")
        if module not in manifest.files or module in kept:
            raise BundleError(f"stage '{stage.name}' names module '{module}', which the bundle does not hold")
        if module.endswith(".ort"):
            continue  # onnxruntime's ORT format holds its weights inline: nothing outside to check
        if not module.endswith(".onnx"):
            raise BundleError(f"stage '{stage.name}' module '{module}' is neither an .onnx nor an .ort file")
        folder = posixpath.dirname(module)
        for location in external_locations(root / module, module):
            target = posixpath.normpath(posixpath.join(folder, location))
            check_relative(location, f"external data of stage '{stage.name}'")
            if target not in manifest.files:
                raise BundleError(f"stage '{stage.name}' module refers to external data '{location}', which the bundle does not hold")
            used.add(target)
    for i, o in manifest.reference:
        for rel in (i, o):
            check_relative(rel, "reference file")
            if rel not in manifest.files:
                raise BundleError(f"reference file '{rel}' is not in the bundle")
    for rel in sorted(set(kept) - used):  # not a stage's external data after all: unpack it
        _copy_range(kept.pop(rel), root / rel)
    bundle = Bundle(root, spec, manifest, tmp, kept, limits)
    bundle.capped = None if sessions is None else frozenset(sessions)
    bundle.overrides = tuple(overrides)
    for stage in spec.stages:
        if stage.module is not None:
            bundle.session_source(stage)  # every tensor that points into the archive fits in its member
    return bundle


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

    files = {rel: entry(rel) for rel in sorted(_walk_files(root, Limits())) if rel != MANIFEST_NAME}
    manifest = Manifest(files=files, **manifest_fields)
    (root / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return manifest
