"""Bundles: a folder or a single archive holding a pipeline's config, stage modules and manifest.

Layout (the same inside an archive)::

    pipeline.json          the PipelineSpec (stages, settings, wiring, param groups)
    manifest.json          sha256 + size of every other file, versions, opsets, providers
    stages/stage0.onnx     one module per stage (+ stage0.onnx.data when weights are external)
    reference/inputs-0.npz optional reference inputs and outputs for self-checks

A bundle is untrusted input: :func:`read_bundle` checks all of it before anything runs (Note:
loading is checked before anything runs, in ``_read.py``) and returns a :class:`Bundle`. The
builder writes what this package reads, through the same names: the file names, the
:class:`Manifest` and :func:`write_manifest`, :data:`PAGE` for weights left in an archive, and
:func:`external_locations` (the external-data files a stage module names, found by the wire scan
of ``runtime/_protoscan.py``).

Modules, each one concern (imports run down this list):

- ``_limits``: :class:`Limits`, what a bundle may declare at most; the host's thread and replica
  caps (:func:`check_caps`), a zip member's compression ratio.
- ``_files``: the paths a bundle may use (``check_relative``), hashes read in chunks
  (:func:`sha256_file`), a folder of regular files only, JSON within the limits.
- ``_manifest``: :class:`Manifest` and :class:`FileEntry`, their JSON form read and checked,
  :func:`write_manifest`.
- ``_npz``: arrays by name in .npz files, without pickle (:func:`load_npz`, :func:`npz_layout`,
  :func:`save_npz`).
- ``_bundle``: :class:`Bundle`, a checked bundle on disk and what onnxruntime opens for a stage.
- ``_archive``: an archive checked from its zip directory and manifest, then unpacked (Note:
  sizes before bytes), weights left in place (Note: external data left in the archive).
- ``_folder``: a folder checked against its manifest, then its config and modules.
- ``_read``: :func:`read_bundle`, :func:`is_bundle`, :func:`linked_folder`.
"""

from onnxpipe.runtime._protoscan import external_locations
from onnxpipe.runtime.bundle._archive import ARCHIVE_SUFFIX, PAGE
from onnxpipe.runtime.bundle._bundle import Bundle
from onnxpipe.runtime.bundle._files import sha256_file
from onnxpipe.runtime.bundle._limits import Limits, check_caps
from onnxpipe.runtime.bundle._manifest import CONFIG_NAME, MANIFEST_NAME, FileEntry, Manifest, write_manifest
from onnxpipe.runtime.bundle._npz import load_npz, npz_layout, save_npz
from onnxpipe.runtime.bundle._read import is_bundle, linked_folder, read_bundle

__all__ = [
    "ARCHIVE_SUFFIX",
    "CONFIG_NAME",
    "MANIFEST_NAME",
    "PAGE",
    "Bundle",
    "FileEntry",
    "Limits",
    "Manifest",
    "check_caps",
    "external_locations",
    "is_bundle",
    "linked_folder",
    "load_npz",
    "npz_layout",
    "read_bundle",
    "save_npz",
    "sha256_file",
    "write_manifest",
]
