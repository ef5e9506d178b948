"""Reading a bundle: :func:`read_bundle`, the one way in, and what a path looks like before it is read.

Note: loading is checked before anything runs.
    :func:`read_bundle` accepts a bundle only when every one of these holds, and otherwise raises
    one :class:`BundleError` naming the problem: no symbolic or hard links; every path relative,
    normalized and inside the bundle; every file listed in the manifest with the right size and
    sha256, and no file that is not listed; sizes and counts within :class:`Limits`; a known
    schema version; a wiring that validates; stage modules and the external-data files they name
    (found by a wire scan, see ``_protoscan``) listed in the manifest; stage settings within the
    host's thread and replica caps (see ``check_caps``). An archive is unpacked into a private
    temporary folder, member by member, only once its zip directory agrees with its manifest (see
    ``unpack``, Note: sizes before bytes), and nothing is ever written outside it. No pickle is
    read anywhere (numpy files are loaded with ``allow_pickle=False``). Every hash is computed in
    chunks of ``CHUNK`` bytes: no file is ever read whole to check it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from collections.abc import Collection, Sequence
from pathlib import Path

from onnxpipe._errors import BundleError
from onnxpipe.runtime._overrides import Overrides, as_overrides
from onnxpipe.runtime.bundle._archive import unpack
from onnxpipe.runtime.bundle._bundle import Bundle
from onnxpipe.runtime.bundle._folder import check_folder
from onnxpipe.runtime.bundle._limits import Limits
from onnxpipe.runtime.bundle._manifest import MANIFEST_NAME

__all__ = ["is_bundle", "linked_folder", "read_bundle"]


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
    """Open a bundle folder or archive and check all of it (see Note: loading is checked before anything runs).

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
        bundle = check_folder(path, limits, None, str(path), sessions=sessions, overrides=changes)
    elif not path.is_file():
        raise BundleError(f"bundle '{path}' is neither a folder nor an archive file")
    else:
        tmp = Path(tempfile.mkdtemp(prefix="onnxpipe-bundle-"))
        try:
            kept = unpack(path, tmp, limits)
            bundle = check_folder(tmp, limits, tmp, str(path), kept, sessions, changes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    bundle.allow_code = tuple(allow_code)
    return bundle
