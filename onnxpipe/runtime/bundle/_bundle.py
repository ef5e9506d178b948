"""A checked bundle on disk (:class:`Bundle`): its spec, its manifest, where its files are, and what
onnxruntime opens for each stage. :func:`~onnxpipe.runtime.bundle.read_bundle` makes one."""

from __future__ import annotations

import os
import posixpath
import shutil
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import numpy as np

from onnxpipe._errors import BundleError, InputError
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._overrides import StageOverrides
from onnxpipe.runtime._protoscan import Relocation, external_locations, relocate_external
from onnxpipe.runtime._spec import PipelineSpec, StageSpec
from onnxpipe.runtime.bundle._files import copy_range
from onnxpipe.runtime.bundle._limits import Limits
from onnxpipe.runtime.bundle._manifest import FileEntry, Manifest
from onnxpipe.runtime.bundle._npz import load_npz, npz_layout

__all__ = ["Bundle"]

#: onnxruntime's session config key for where a module loaded from bytes finds its external data.
_DATA_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


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
        #: Files left in the archive (see Note: external data left in the archive, in ``_archive.py``), by bundle path.
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
                copy_range(self.in_archive[rel], target)
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
