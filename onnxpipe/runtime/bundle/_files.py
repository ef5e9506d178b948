"""The files of a bundle: which paths it may use (:func:`check_relative`), their hashes, read in
chunks (:func:`sha256_file`), walking a folder of regular files, reading its JSON within the limits."""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onnxpipe._errors import BundleError
from onnxpipe.runtime._protoscan import Relocation
from onnxpipe.runtime._spec import parse_json
from onnxpipe.runtime.bundle._limits import Limits

__all__ = ["CHUNK", "ORT_MEMORY_ADDRESS_TAG", "check_relative", "copy_range", "read_json", "sha256_file", "walk_files"]

#: Every hash and copy reads this many bytes at a time: no file is ever read whole to check it.
CHUNK = 1 << 20
#: onnxruntime's external-data location meaning "the offset is a memory address" (refused, see check_relative).
ORT_MEMORY_ADDRESS_TAG = "*/_ORT_MEM_ADDR_/*"


def sha256_file(path: str | Path, offset: int = 0, size: int | None = None) -> str:
    """Hex sha256 of a file (or of ``size`` bytes of it from ``offset``), read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        left = f.seek(0, os.SEEK_END) - offset if size is None else size
        f.seek(offset)
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
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
    _check_unreserved(path, what)
    return path


def _check_unreserved(path: str, what: str) -> None:
    """Refuse a path with a component named as onnxruntime's location tags (Note: onnxruntime's location tags)."""
    if any(part.startswith("_ORT_") and part.endswith("_") for part in path.split("/")):
        raise BundleError(
            f"{what} '{path}' names onnxruntime's reserved location tag '{ORT_MEMORY_ADDRESS_TAG}' (or one like it), "
            "under which onnxruntime reads a tensor's offset as a memory address; bundle paths may not use it"
        )


def walk_files(root: Path, limits: Limits) -> Iterator[str]:
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


def read_json(path: Path, limits: Limits, what: str) -> Any:
    """The JSON file of a bundle (its config or manifest), refused past ``max_json_bytes``."""
    if path.stat().st_size > limits.max_json_bytes:
        raise BundleError(f"{what} is {path.stat().st_size} bytes; the limit is {limits.max_json_bytes}")
    return parse_json(path.read_bytes(), what, BundleError)


def copy_range(source: Relocation, target: Path) -> None:
    """Unpack a member left in the archive after all (its hash was checked in place)."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out, open(source.location, "rb") as src:
        src.seek(source.offset)
        left = source.size
        while left and (chunk := src.read(min(CHUNK, left))):
            out.write(chunk)
            left -= len(chunk)
