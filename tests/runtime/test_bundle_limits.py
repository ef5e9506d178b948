"""Hostile bundles that try to exhaust the host: zip bombs and members bigger than the manifest says,
reference arrays that declare gigabytes, settings that start thousands of threads. Each is refused
with one clear error before anything large is written, allocated or started."""

from __future__ import annotations

import io
import json
import shutil
import struct
import threading
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe import BundleError
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import Limits, load
from onnxpipe.runtime._settings import host_cores
from onnxpipe.runtime.bundle import MANIFEST_NAME, Manifest, write_manifest
from tests import models
from tests.cli.helpers import assert_user_error, run

BIG = 50 << 20  # 50 MiB of zeros: deflates to about 50 KiB


@pytest.fixture(scope="module")
def pristine_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One stage x[N,4] -> h, g with one reference sample (each test tampers with its own copy: ``bundle``, tests/runtime/conftest.py)."""
    root = tmp_path_factory.mktemp("small")
    config = PipelineConfig("one")
    head = config.add_stage(models.stage_head(), "head")
    config.input("x").connect(head.input("x"))
    head.output("h").connect(config.output("h"))
    head.output("g").connect(config.output("g"))
    return export(build(config, root / "built").path, root / "bundle", reference_inputs=[{"x": np.ones((2, 4), np.float32)}])


@pytest.fixture()
def unpacked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The bytes in each temporary folder the loader removes (after a refusal: what it had written)."""
    sizes: list[int] = []
    real = shutil.rmtree

    def measure(path: Any, *args: Any, **kwargs: Any) -> None:
        sizes.append(sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()))
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", measure)
    yield sizes


def _rehash(root: Path) -> None:
    m = Manifest.from_dict(json.loads((root / MANIFEST_NAME).read_text()), Limits())
    write_manifest(root, {"versions": m.versions, "opsets": m.opsets, "providers": m.providers, "reference": m.reference, "created": m.created})


def _archive(folder: Path, out: Path, replace: dict[str, bytes] | None = None, deflate: bool = True) -> Path:
    """The folder as a zip archive, some members' bytes replaced or added."""
    members = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as zf:
        for name, data in {**members, **(replace or {})}.items():
            zf.writestr(name, data)
    return out


def _set_declared_size(archive: Path, member: str, size: int) -> None:
    """Make the zip directory declare ``size`` bytes for a member whose stream holds more (a liar)."""
    data = bytearray(archive.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + name_len] == member.encode():
            struct.pack_into("<I", data, at + 24, size)
        at = data.find(b"PK\x01\x02", at + 1)
    archive.write_bytes(bytes(data))


def _edit_settings(root: Path, **settings: object) -> None:
    config = json.loads((root / "pipeline.json").read_text())
    config["stages"][0]["settings"].update(settings)
    (root / "pipeline.json").write_text(json.dumps(config))
    _rehash(root)


# -- the archive: sizes before bytes ---------------------------------------------------------------


def test_an_unlisted_member_is_refused_before_anything_is_unpacked(bundle: Path, tmp_path: Path, private_tmp: Path, unpacked: list[int]) -> None:
    archive = _archive(bundle, tmp_path / "b.onnxpipe", {"stages/zeros.bin": bytes(BIG)})
    assert archive.stat().st_size < 1 << 20
    trusting = Limits(max_compression_ratio=10_000)  # past the ratio check, to reach the manifest's
    with pytest.raises(BundleError, match=f"archive member 'stages/zeros.bin' \\({BIG} bytes\\) is not listed in the manifest"):
        load(archive, limits=trusting)
    assert unpacked and max(unpacked) < 64 << 10  # the manifest alone


def test_a_member_larger_than_the_manifest_says_is_refused_first(bundle: Path, tmp_path: Path, private_tmp: Path, unpacked: list[int]) -> None:
    size = (bundle / "stages" / "head.onnx").stat().st_size
    archive = _archive(bundle, tmp_path / "b.onnxpipe", {"stages/head.onnx": bytes(BIG)})
    with pytest.raises(BundleError, match=f"archive member 'stages/head.onnx' declares {BIG} bytes; the manifest says {size} \\(truncated or altered\\)"):
        load(archive, limits=Limits(max_compression_ratio=10_000))
    assert unpacked and max(unpacked) < 64 << 10


def test_a_member_inflating_past_its_declared_size_stops_there(bundle: Path, tmp_path: Path, private_tmp: Path, unpacked: list[int]) -> None:
    size = (bundle / "stages" / "head.onnx").stat().st_size
    archive = _archive(bundle, tmp_path / "b.onnxpipe", {"stages/head.onnx": bytes(BIG)})
    _set_declared_size(archive, "stages/head.onnx", size)  # the directory agrees with the manifest; the stream does not
    with pytest.raises(BundleError, match="archive member 'stages/head.onnx' holds more bytes than|is damaged: Bad CRC-32 for file 'stages/head.onnx'"):
        load(archive)
    assert unpacked and max(unpacked) < 64 << 10


def test_a_member_holding_fewer_bytes_than_declared_is_refused(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    size = (bundle / "stages" / "head.onnx").stat().st_size
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    manifest["files"]["stages/head.onnx"]["size"] = size + 1000
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
    for deflate in (True, False):
        archive = _archive(bundle, tmp_path / "b.onnxpipe", deflate=deflate)
        _set_declared_size(archive, "stages/head.onnx", size + 1000)
        with pytest.raises(BundleError, match=f"archive member 'stages/head.onnx' holds {size} bytes; it declares {size + 1000} \\(truncated\\)"):
            load(archive)


def test_a_zip_bomb_member_is_refused_by_its_compression_ratio(bundle: Path, tmp_path: Path, private_tmp: Path, unpacked: list[int]) -> None:
    archive = _archive(bundle, tmp_path / "b.onnxpipe", {"stages/zeros.bin": bytes(BIG)})
    with pytest.raises(
        BundleError,
        match=f"archive member 'stages/zeros.bin' inflates \\d+ bytes to {BIG} \\(ratio \\d+:1\\); the limit is 100:1 "
        ".*Limits\\(max_compression_ratio=\\.\\.\\.\\)",
    ):
        load(archive)
    assert unpacked == [0]  # refused from the zip directory: not even the manifest was unpacked


def test_deflated_archives_of_real_bundles_load(bundle: Path, tmp_path: Path) -> None:
    """JSON and small modules deflate well past 100:1 only when they are tiny, which is exempt."""
    with load(_archive(bundle, tmp_path / "b.onnxpipe")) as pipe:
        assert all(r.ok for r in pipe.check())


# -- reference arrays: headers before data ---------------------------------------------------------


def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": dtype, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _write_npz(path: Path, members: dict[str, bytes], deflate: bool = False) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def test_a_reference_array_declaring_gigabytes_is_refused_without_allocating_them(bundle: Path) -> None:
    # 2 GiB declared (x: float32 [2**27, 4], which the spec's [N, 4] allows), 64 bytes stored.
    _write_npz(bundle / "reference" / "inputs-0.npz", {"x.npy": _npy_header("<f4", (1 << 27, 4)) + bytes(64)})
    _rehash(bundle)
    tracemalloc.start()
    lie = r"'inputs-0.npz' array 'x.npy' declares float32 \[134217728, 4\] \(2147483648 bytes\) but its member holds 64"
    with load(bundle) as pipe, pytest.raises(BundleError, match=lie):
        pipe.check()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 32 << 20, peak
    assert_user_error(run("verify", bundle), "'inputs-0.npz' array 'x.npy' declares float32 [134217728, 4]")


def test_reference_arrays_are_checked_against_the_spec_and_the_size_limit(bundle: Path) -> None:
    rel = bundle / "reference" / "inputs-0.npz"
    good = rel.read_bytes()
    arrays = {"x.npy": np.ones((2, 5), np.float32)}
    with zipfile.ZipFile(rel, "w") as zf:
        for name, value in arrays.items():
            with zf.open(name, "w") as f:
                np.lib.format.write_array(f, value)
    _rehash(bundle)
    mismatch = r"reference file 'reference/inputs-0.npz': reference input 'x' has shape \[2, 5\]; expected \[N, 4\]"
    with load(bundle) as pipe, pytest.raises(BundleError, match=mismatch):
        pipe.check()
    rel.write_bytes(good)
    _rehash(bundle)
    # 2 x 4 float32 in, and out twice: 96 bytes of arrays.
    with load(bundle, limits=Limits(max_reference_bytes=95)) as pipe, pytest.raises(
        BundleError, match=r"the reference arrays declare 96 bytes in all; the limit is 95 .*Limits\(max_reference_bytes=\.\.\.\)"
    ):
        pipe.check()
    with load(bundle, limits=Limits(max_reference_bytes=96)) as pipe:
        assert all(r.ok for r in pipe.check())


def test_a_deflated_reference_bomb_is_refused_by_its_compression_ratio(bundle: Path) -> None:
    rows = BIG // 16
    _write_npz(bundle / "reference" / "inputs-0.npz", {"x.npy": _npy_header("<f4", (rows, 4)) + bytes(BIG)}, deflate=True)
    _rehash(bundle)
    with load(bundle) as pipe, pytest.raises(BundleError, match=r"'inputs-0.npz' member 'x.npy' inflates \d+ bytes to \d+ \(ratio \d+:1\); the limit is 100:1"):
        pipe.check()


def test_an_npz_of_pickled_objects_is_refused_from_its_header(bundle: Path) -> None:
    _write_npz(bundle / "reference" / "inputs-0.npz", {"x.npy": _npy_header("|O", (2, 4)) + bytes(64)})
    _rehash(bundle)
    with load(bundle) as pipe, pytest.raises(BundleError, match="array 'x.npy' holds Python objects; only plain arrays are read"):
        pipe.check()


# -- settings: threads and replicas ----------------------------------------------------------------


def _threads() -> int:
    """Threads of this process, onnxruntime's native ones included."""
    task = Path("/proc/self/task")
    return len(list(task.iterdir())) if task.is_dir() else threading.active_count()


@pytest.mark.parametrize(("setting", "knob"), [("intra_op_threads", "max_threads"), ("inter_op_threads", "max_threads"), ("replicas", "max_replicas")])
def test_thread_and_replica_settings_past_the_host_cap_are_refused(bundle: Path, setting: str, knob: str) -> None:
    _edit_settings(bundle, **{setting: 2000})
    cores = host_cores()
    before = _threads()
    with pytest.raises(
        BundleError,
        match=(
            f"stage 'head': {setting} 2000 is over this host's cap of {4 * cores} \\(4 x the {cores} core\\(s\\) this process may use\\); "
            f"lower it in the bundle's settings, or raise the cap on this host with load\\(\\.\\.\\., limits=Limits\\({knob}=\\.\\.\\.\\)\\)"
        ),
    ):
        load(bundle)
    assert _threads() < before + 10  # refused before any session or worker exists


def test_the_host_sets_the_caps(bundle: Path) -> None:
    over = 4 * host_cores() + 1
    _edit_settings(bundle, intra_op_threads=over)
    with load(bundle, limits=Limits(max_threads=over)) as pipe:
        assert pipe.check()[0].ok
    with pytest.raises(BundleError, match=f"stage 'head': intra_op_threads {over} is over this host's cap of 2 \\(Limits.max_threads\\)"):
        load(bundle, limits=Limits(max_threads=2))
    _edit_settings(bundle, intra_op_threads=2, replicas=2)
    with pytest.raises(BundleError, match="the stages' settings start 4 threads in all; this host's cap is 3 \\(Limits.max_pipeline_threads\\)"):
        load(bundle, limits=Limits(max_pipeline_threads=3))
    _edit_settings(bundle, intra_op_threads=1, replicas=1, execution_mode="parallel", inter_op_threads=0)
    with pytest.raises(BundleError, match=f"start {1 + host_cores()} threads in all"):
        load(bundle, limits=Limits(max_pipeline_threads=1))


def test_caps_follow_the_stages_whose_sessions_start_here(bundle: Path) -> None:
    """read_bundle(sessions=...) checks only the stages this process will start (the Ray driver:
    none; an actor: its own); a thread engine given such a bundle checks the rest before any session."""
    from onnxpipe.runtime import Pipeline, read_bundle

    over = 4 * host_cores() + 1
    _edit_settings(bundle, intra_op_threads=over)
    with read_bundle(bundle, sessions=()) as checked:
        assert checked.capped == frozenset()
        with pytest.raises(BundleError, match=f"stage 'head': intra_op_threads {over} is over this host's cap"):
            Pipeline(checked)
    with read_bundle(bundle, sessions=("tail",)) as checked:
        assert checked.capped == frozenset({"tail"})
    with pytest.raises(BundleError, match=f"stage 'head': intra_op_threads {over} is over this host's cap"):
        read_bundle(bundle, sessions=("head",))
