"""Archives: a bundle written as one zip file, checked from its zip directory and its manifest before
a byte of it is unpacked (:func:`unpack`, Note: sizes before bytes).

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

import os
import posixpath
import stat
import struct
import zipfile
import zlib
from collections.abc import Collection, Mapping
from pathlib import Path

from onnxpipe._errors import BundleError
from onnxpipe.runtime._protoscan import Relocation
from onnxpipe.runtime._session import maps_archive_data
from onnxpipe.runtime.bundle._files import CHUNK, check_relative, read_json
from onnxpipe.runtime.bundle._limits import Limits, check_ratio
from onnxpipe.runtime.bundle._manifest import MANIFEST_NAME, Manifest

__all__ = ["ARCHIVE_SUFFIX", "PAGE", "unpack"]

#: A bundle written as one file is a zip archive with this suffix.
ARCHIVE_SUFFIX = ".onnxpipe"
#: Offsets of the member data that may stay in an archive (see Note: external data left in the archive).
PAGE = 4096
#: The compression methods an archive may use (what export writes, and what zip tools write by default).
_COMPRESSIONS = {zipfile.ZIP_STORED: "stored (0)", zipfile.ZIP_DEFLATED: "deflate (8)"}


def unpack(archive: Path, dest: Path, limits: Limits) -> dict[str, Relocation]:
    """Unpack the archive into ``dest``, but for the members left in it (returned by bundle path;
    see Note: external data left in the archive).

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
        name = _member_name(k, m)
        _check_member(m, name, size, limits, checked)
        checked[name] = m
    _check_nesting(checked)
    return checked


def _member_name(k: int, member: zipfile.ZipInfo) -> str:
    """The bundle path of the ``k``-th member (a folder's without its trailing ``/``), checked."""
    if not member.filename:  # a damaged directory entry; zipfile's own is_dir() would fail on it (IndexError)
        raise BundleError(f"archive member {k} has an empty name: damaged")
    name = member.filename.rstrip("/") if member.is_dir() else member.filename
    return check_relative(name, "archive member")


def _check_member(m: zipfile.ZipInfo, name: str, size: int, limits: Limits, seen: Collection[str]) -> None:
    """One member of an archive of ``size`` bytes, from its directory entry: where its header is,
    its type, its name unique among the members ``seen``, its size, encryption and compression."""
    if not 0 <= m.header_offset <= size - 30:  # zipfile would seek there (a negative seek: OSError)
        raise BundleError(f"archive member '{name}' has its header at {m.header_offset}, outside the archive ({size} bytes): damaged")
    mode = m.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise BundleError(f"archive member '{m.filename}' is a symbolic link; bundles hold regular files only")
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):  # 0: no Unix type recorded
        raise BundleError(f"archive member '{m.filename}' is not a regular file")
    if name in seen:
        raise BundleError(f"archive member '{name}' appears twice")
    if m.file_size > limits.max_file_bytes:
        raise BundleError(f"archive member '{name}' declares {m.file_size} bytes; the limit for one file is {limits.max_file_bytes}")
    if m.flag_bits & 1:
        raise BundleError(f"archive member '{name}' is encrypted; bundles are not")
    if m.compress_type not in _COMPRESSIONS:
        raise BundleError(f"archive member '{name}' uses compression method {m.compress_type}; bundles use {' or '.join(_COMPRESSIONS.values())}")
    check_ratio(m, name, limits, "archive member")


def _check_nesting(members: Mapping[str, zipfile.ZipInfo]) -> None:
    """Refuse a file member that is also a folder of another member."""
    files = {name for name, m in members.items() if not m.is_dir()}
    for name in members:
        folder = posixpath.dirname(name)
        while folder:
            if folder in files:
                raise BundleError(f"archive member '{folder}' is a file, yet the archive also holds '{name}' inside it")
            folder = posixpath.dirname(folder)


def _archive_manifest(zf: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], dest: Path, limits: Limits, label: str) -> Manifest:
    """Unpack and read the manifest alone (at most ``max_json_bytes``), before any other member."""
    member = members.get(MANIFEST_NAME)
    if member is None or member.is_dir():
        raise BundleError(f"'{label}' is not a bundle: it has no {MANIFEST_NAME}")
    if member.file_size > limits.max_json_bytes:
        raise BundleError(f"{MANIFEST_NAME} is {member.file_size} bytes; the limit is {limits.max_json_bytes}")
    _extract(zf, member, dest / MANIFEST_NAME)
    return Manifest.from_dict(read_json(dest / MANIFEST_NAME, limits, MANIFEST_NAME), limits)


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
    manifest.check_missing(files)


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
            while chunk := src.read(min(CHUNK, left + 1)):
                if len(chunk) > left:
                    raise BundleError(f"archive member '{member.filename}' holds more bytes than the {member.file_size} it declares")
                out.write(chunk)
                left -= len(chunk)
        except EOFError:  # a deflate stream cut short
            pass
    if left:
        raise BundleError(f"archive member '{member.filename}' holds {member.file_size - left} bytes; it declares {member.file_size} (truncated)")
