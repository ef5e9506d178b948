"""Bundle loading on the deployment host: hostile and broken bundles are refused with one clear
error, and nothing is written outside the loader's own temporary folder."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from onnxpipe import BundleError
from onnxpipe.builder import build, export
from onnxpipe.builder._export import _write_archive
from onnxpipe.runtime import Limits, SequentialPipeline, load, read_bundle
from onnxpipe.runtime._protoscan import external_locations
from onnxpipe.runtime._session import maps_archive_data
from onnxpipe.runtime.bundle import MANIFEST_NAME, Manifest, linked_folder, write_manifest
from tests import models

# onnxruntime 1.18-1.20 cannot read weights in place from an archive: there they are unpacked (and
# test_an_onnxruntime_that_cannot_map_archive_data_gets_it_unpacked covers that path on every version).
_MAPS_IN_PLACE = pytest.mark.skipif(not maps_archive_data(), reason="this onnxruntime unpacks archive data instead of mapping it")


@pytest.fixture(scope="module")
def pristine_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-stage bundle folder whose second stage keeps its weights in external data
    (each test tampers with its own copy: ``bundle``, tests/runtime/conftest.py)."""
    root = tmp_path_factory.mktemp("good")
    config = models.head_then_tail(1 << 18)  # 4 MiB of weights in the tail
    x = np.ones((2, 4), np.float32)
    return export(build(config, root / "built").path, root / "bundle", reference_inputs=[{"x": x}])


def _rehash(root: Path) -> None:
    """Rewrite the manifest so that only the tampering under test is wrong."""
    old = json.loads((root / MANIFEST_NAME).read_text())
    m = Manifest.from_dict(old, Limits())
    write_manifest(root, {"versions": m.versions, "opsets": m.opsets, "providers": m.providers, "reference": m.reference, "created": m.created})


def _edit_config(root: Path, change: object) -> None:
    data = json.loads((root / "pipeline.json").read_text())
    change(data)  # type: ignore[operator]
    (root / "pipeline.json").write_text(json.dumps(data))
    _rehash(root)


def _zip(path: Path, members: dict[str, bytes], modes: dict[str, int] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (modes or {}).get(name, stat.S_IFREG | 0o644) << 16
            zf.writestr(info, data)
    return path


def _zip_of(folder: Path, out: Path, extra: dict[str, bytes] | None = None, modes: dict[str, int] | None = None) -> Path:
    members = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return _zip(out, {**members, **(extra or {})}, modes)


def test_good_bundle_loads_as_folder_and_archive(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    assert "stages/tail.onnx.data" in read_bundle(bundle).manifest.files
    archive = _zip_of(bundle, tmp_path / "b.onnxpipe")
    with load(archive) as pipe:
        assert all(r.ok for r in pipe.check())
        unpacked = pipe.bundle.root
        assert unpacked.parent == private_tmp
    assert not unpacked.exists()  # close() removed the unpacked copy


def test_protoscan_finds_the_same_locations_as_onnx(bundle: Path) -> None:
    module = bundle / "stages" / "tail.onnx"
    proto = onnx.load(module, load_external_data=False)
    want = [e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"]
    assert external_locations(module) == want == ["tail.onnx.data"]


@pytest.mark.parametrize(
    ("member", "message"),
    [
        ("../evil.txt", "archive member '../evil.txt' is not a normalized path inside the bundle"),
        ("stages/../../evil.txt", "is not a normalized path inside the bundle"),
        ("/tmp/onnxpipe-evil.txt", "archive member '/tmp/onnxpipe-evil.txt' is absolute"),
        ("C:/evil.txt", "is absolute"),
        ("stages\\..\\evil.txt", "backslashes"),
    ],
)
def test_archive_members_outside_the_bundle_are_refused(bundle: Path, tmp_path: Path, private_tmp: Path, member: str, message: str) -> None:
    archive = _zip_of(bundle, tmp_path / "b.onnxpipe", extra={member: b"owned"})
    with pytest.raises(BundleError, match=message.replace("\\", "\\\\")):
        load(archive)
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/onnxpipe-evil.txt").exists()


def test_archive_symlink_and_duplicate_members_are_refused(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    link = _zip_of(bundle, tmp_path / "l.onnxpipe", extra={"stages/link": b"/etc/passwd"}, modes={"stages/link": stat.S_IFLNK | 0o777})
    with pytest.raises(BundleError, match="archive member 'stages/link' is a symbolic link"):
        load(link)
    members = {p.relative_to(bundle).as_posix(): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    dup = tmp_path / "d.onnxpipe"
    with zipfile.ZipFile(dup, "w") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr("pipeline.json", b"{}")
    with pytest.raises(BundleError, match="archive member 'pipeline.json' appears twice"):
        load(dup)


def test_folder_links_are_refused(bundle: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 10)
    os.symlink(secret, bundle / "stages" / "evil")
    with pytest.raises(BundleError, match="bundle entry 'stages/evil' is a symbolic link"):
        load(bundle)
    (bundle / "stages" / "evil").unlink()
    os.link(bundle / "stages" / "head.onnx", tmp_path / "hard")
    with pytest.raises(BundleError, match="bundle entry 'stages/head.onnx' is a hard link"):
        load(bundle)


def test_a_link_to_a_bundle_folder_is_refused_and_a_link_to_an_archive_is_read(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    """A bundle holds regular files only, its own folder included (a model repository skips such a link up front: ``linked_folder``)."""
    os.symlink(bundle, tmp_path / "linked")
    assert linked_folder(tmp_path / "linked") and not linked_folder(bundle)
    refused = f"bundle '{tmp_path / 'linked'}' is a symbolic link to a folder; bundles hold regular files only: give the folder itself"
    with pytest.raises(BundleError, match=f"^{re.escape(refused)}$"):
        load(tmp_path / "linked")
    archive = _zip_of(bundle, tmp_path / "b.onnxpipe")
    os.symlink(archive, tmp_path / "a.onnxpipe")
    assert not linked_folder(tmp_path / "a.onnxpipe")
    load(tmp_path / "a.onnxpipe").close()


def test_config_naming_a_module_outside_is_refused(bundle: Path, tmp_path: Path) -> None:
    shutil.copy(bundle / "stages" / "head.onnx", tmp_path / "outside.onnx")
    _edit_config(bundle, lambda d: d["stages"][0].update(module="../outside.onnx"))
    with pytest.raises(BundleError, match="module of stage 'head' '../outside.onnx' is not a normalized path inside the bundle"):
        load(bundle)


def test_external_data_outside_the_bundle_is_refused(bundle: Path, tmp_path: Path) -> None:
    module = bundle / "stages" / "tail.onnx"
    proto = onnx.load(module, load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../secret.bin"
    onnx.save(proto, module)
    _rehash(bundle)
    with pytest.raises(BundleError, match="external data of stage 'tail' '../../secret.bin' is not a normalized path inside the bundle"):
        load(bundle)


def test_hash_mismatch_truncation_missing_and_extra_files(bundle: Path) -> None:
    module = bundle / "stages" / "head.onnx"
    data = bytearray(module.read_bytes())
    data[-1] ^= 0xFF
    module.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="bundle file 'stages/head.onnx' does not match its sha256"):
        load(bundle)
    module.write_bytes(bytes(data[:-10]))
    with pytest.raises(BundleError, match="bundle file 'stages/head.onnx' is .* bytes; the manifest says .* \\(truncated or altered\\)"):
        load(bundle)
    module.unlink()
    with pytest.raises(BundleError, match="bundle file 'stages/head.onnx' is listed in the manifest but missing"):
        load(bundle)
    (bundle / "stages" / "head.onnx").write_bytes(bytes(data))
    (bundle / "stages" / "extra.onnx").write_bytes(b"x")
    with pytest.raises(BundleError, match="bundle file 'stages/extra.onnx' is not listed in the manifest"):
        load(bundle)


def test_unknown_versions_are_refused(bundle: Path) -> None:
    _edit_config(bundle, lambda d: d.update(version=99))
    with pytest.raises(BundleError, match="pipeline spec version 99 is not supported; this onnxpipe reads versions 1 and 2"):
        load(bundle)
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    manifest["version"] = 7
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="manifest version 7 is not supported"):
        load(bundle)


def test_cyclic_and_dangling_wiring_are_refused(bundle: Path) -> None:
    def cycle(d: dict) -> None:  # type: ignore[type-arg]
        d["stages"][0]["inputs"].append({"name": "y", "dtype": "float32", "shape": None})
        d["links"].append({"from": {"stage": "tail", "tensor": "y"}, "to": {"stage": "head", "tensor": "y"}})

    _edit_config(bundle, cycle)
    with pytest.raises(BundleError, match="stages form a cycle: head -> tail -> head"):
        load(bundle)


def test_dangling_link_is_refused(bundle: Path) -> None:
    _edit_config(bundle, lambda d: d["links"].append({"from": {"stage": "ghost", "tensor": "h"}, "to": {"output": "y"}}))
    with pytest.raises(BundleError, match="link endpoint ghost.h: no stage 'ghost'"):
        load(bundle)


def test_oversize_declarations_are_refused_before_reading(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    manifest["files"]["stages/head.onnx"]["size"] = 1 << 50
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="manifest entry 'stages/head.onnx' declares 1125899906842624 bytes; the limit for one file is"):
        load(bundle)
    archive = _zip(tmp_path / "big.onnxpipe", {"a.bin": b"\0" * 5000})
    with pytest.raises(BundleError, match="archive declares 5000 bytes unpacked; the limit is 1000"):
        load(archive, limits=Limits(max_total_bytes=1000))
    with pytest.raises(BundleError, match="archive member 'a.bin' declares 5000 bytes; the limit for one file is 100"):
        load(archive, limits=Limits(max_file_bytes=100))


def test_not_a_bundle(tmp_path: Path, private_tmp: Path) -> None:
    (tmp_path / "junk.onnxpipe").write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="is not a bundle: not a folder and not a zip archive"):
        load(tmp_path / "junk.onnxpipe")
    with pytest.raises(BundleError, match="does not exist"):
        load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="it has no manifest.json"):
        load(tmp_path / "empty")


def test_loading_needs_only_numpy_and_onnxruntime(pristine_bundle: Path, tmp_path: Path) -> None:
    archive = _zip_of(pristine_bundle, tmp_path / "b.onnxpipe")
    code = (
        "import sys\n"
        "import onnxpipe.runtime as rt\n"
        f"pipe = rt.load({str(archive)!r})\n"
        "assert all(r.ok for r in pipe.check())\n"
        "pipe.close()\n"
        "print(','.join(m for m in ('onnx', 'networkx', 'click', 'rich', 'onnxpipe.builder', 'onnxpipe.splitter') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@_MAPS_IN_PLACE
def test_exported_archive_leaves_external_data_in_place(pristine_bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    """export stores .data page-aligned; loading maps it from the archive: nothing of it is unpacked."""
    archive = export(pristine_bundle.parent / "built", tmp_path / "b.onnxpipe", reference_inputs=[{"x": np.ones((2, 4), np.float32)}])
    with zipfile.ZipFile(archive) as zf:
        member = zf.getinfo("stages/tail.onnx.data")
        assert member.compress_type == zipfile.ZIP_STORED
    with load(archive) as pipe:
        kept = pipe.bundle.in_archive["stages/tail.onnx.data"]
        assert kept.offset % 4096 == 0 and kept.size == member.file_size
        assert not (pipe.bundle.root / "stages" / "tail.onnx.data").exists()
        assert all(r.ok for r in pipe.check())
        ((inputs, outputs),) = pipe.bundle.reference()
        np.testing.assert_array_equal(SequentialPipeline(pipe.spec, pipe.bundle).run(inputs)["y"], outputs["y"])


def test_an_onnxruntime_that_cannot_map_archive_data_gets_it_unpacked(
    pristine_bundle: Path, tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from onnxpipe.runtime.bundle import _archive

    monkeypatch.setattr(_archive, "maps_archive_data", lambda: False)  # onnxruntime 1.18-1.20
    archive = export(pristine_bundle.parent / "built", tmp_path / "b.onnxpipe", reference_inputs=[{"x": np.ones((2, 4), np.float32)}])
    with load(archive) as pipe:
        assert pipe.bundle.in_archive == {}
        assert (pipe.bundle.root / "stages" / "tail.onnx.data").is_file()
        assert all(r.ok for r in pipe.check())


@_MAPS_IN_PLACE
def test_a_tensor_pointing_past_its_member_is_refused(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    module = bundle / "stages" / "tail.onnx"
    proto = onnx.load(module, load_external_data=False)
    for e in proto.graph.initializer[0].external_data:
        if e.key == "offset":
            e.value = str(int(e.value) + 4096)
    onnx.save(proto, module)
    write_manifest(bundle, {})
    archive = tmp_path / "b.onnxpipe"
    _write_archive(bundle, archive)
    with pytest.raises(BundleError, match=r"module 'stages/tail.onnx': a tensor at 4096\+4194304 runs past the end of 'tail.onnx.data' \(4194304 bytes\)"):
        load(archive)


def test_the_hash_check_reads_one_chunk_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxpipe.runtime.bundle import _files

    data = np.random.default_rng(0).bytes(10_000)
    (tmp_path / "f").write_bytes(data)
    reads: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def seek(self, *args: int) -> int:
            return self.f.seek(*args)

        def read(self, n: int = -1) -> bytes:
            reads.append(n)
            return self.f.read(n)

    monkeypatch.setattr(_files, "CHUNK", 1024)
    monkeypatch.setattr(_files, "open", lambda *a, **k: Counting(real_open(*a, **k)), raising=False)
    assert _files.sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert _files.sha256_file(tmp_path / "f", 1000, 5000) == hashlib.sha256(data[1000:6000]).hexdigest()
    assert reads and all(0 < n <= 1024 for n in reads)


def test_a_truncated_archive_is_named_damaged_not_unknown(tmp_path: Path) -> None:
    archive = _zip(tmp_path / "whole.onnxpipe", {"a.bin": b"\0" * 5000})
    cut = tmp_path / "cut.onnxpipe"
    cut.write_bytes(archive.read_bytes()[: len(archive.read_bytes()) // 2])
    with pytest.raises(BundleError, match=r"archive '.*cut.onnxpipe' is damaged or truncated: it begins as a zip archive but has no zip directory"):
        load(cut)
