"""Hostile bundles (issue 11): tensors hidden where the scan did not look, onnxruntime's memory-address
location, and archives or JSON files built to crash the loader. Each is refused with one BundleError."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onnxpipe import BundleError
from onnxpipe.builder import build, export
from onnxpipe.builder._export import _write_archive
from onnxpipe.runtime import SPEC_VERSION, SequentialPipeline, load, read_bundle
from onnxpipe.runtime._protoscan import external_locations
from onnxpipe.runtime._session import maps_archive_data
from onnxpipe.runtime.bundle import MANIFEST_NAME, sha256_file, write_manifest
from tests import models
from tests.cli.helpers import assert_user_error, run
from tests.runtime.test_bundle import _rehash, _zip, _zip_of

LEAK = "../../../../etc/passwd"
MEM = "*/_ORT_MEM_ADDR_/*"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    config = models.head_then_tail(1 << 16)  # 1 MiB of weights in the tail
    return build(config, root / "built").path


@pytest.fixture(scope="module")
def pristine_bundle(built: Path) -> Path:
    """A bundle folder whose tail stage keeps its weights in stages/tail.onnx.data
    (each test tampers with its own copy: ``bundle``, tests/runtime/conftest.py)."""
    return export(built, built.parent / "bundle")


class Archive(bytes):
    """An archive's bytes, shown by size (hypothesis prints its arguments when a property fails)."""

    def __repr__(self) -> str:
        return f"<archive of {len(self)} bytes>"


@pytest.fixture(scope="module")
def good_archive(built: Path) -> Archive:
    """The same bundle as the archive export writes (.data page-aligned, left in place when loaded)."""
    return Archive(export(built, built.parent / "b.onnxpipe").read_bytes())


def _external(location: str) -> onnx.TensorProto:
    t = onnx.TensorProto(name="c", data_type=onnx.TensorProto.FLOAT, dims=[4], data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        t.external_data.add(key=key, value=value)
    return t


def _head_with_default(location: str) -> onnx.ModelProto:
    """The head stage (x -> h, g) with h = x + c, c a Constant whose value is a *default attribute* of
    a local function: a tensor that lives only in FunctionProto.attribute_proto, with external data."""
    constant = onnx.helper.make_node("Constant", [], ["c"])
    constant.attribute.add(name="value", ref_attr_name="value", type=onnx.AttributeProto.TENSOR)
    leak = onnx.helper.make_function(
        "local",
        "Leak",
        ["x"],
        ["h"],
        [constant, onnx.helper.make_node("Add", ["x", "c"], ["h"])],
        [onnx.helper.make_opsetid("", 17)],
        attribute_protos=[onnx.AttributeProto(name="value", type=onnx.AttributeProto.TENSOR, t=_external(location))],
    )
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Leak", ["x"], ["h"], domain="local"), onnx.helper.make_node("Neg", ["x"], ["g"])],
        "head",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["N", 4]) for n in ("h", "g")],
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("local", 1)]
    return onnx.helper.make_model(graph, opset_imports=opsets, functions=[leak])


def test_external_data_in_a_function_attribute_default_is_refused(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    module = bundle / "stages" / "head.onnx"
    module.write_bytes(_head_with_default(LEAK).SerializeToString())
    _rehash(bundle)
    assert external_locations(module) == [LEAK]
    message = f"external data of stage 'head' '{LEAK}' is not a normalized path inside the bundle"
    with pytest.raises(BundleError, match=message):
        load(bundle)
    with pytest.raises(BundleError, match=message):
        load(_zip_of(bundle, tmp_path / "b.onnxpipe"))


def test_external_data_of_a_function_attribute_default_loads_from_the_archive(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    """The same place holding a tensor inside the bundle: found, relocated into the archive, and run."""
    (bundle / "stages" / "head.onnx").write_bytes(_head_with_default("head.onnx.data").SerializeToString())
    (bundle / "stages" / "head.onnx.data").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    write_manifest(bundle, {})
    archive = tmp_path / "b.onnxpipe"
    _write_archive(bundle, archive)
    x = np.ones((2, 4), np.float32)
    want = (x + np.arange(4, dtype=np.float32)) @ np.full((4, 1 << 16), 0.5, np.float32)
    with load(archive) as pipe:
        # Mapped from the archive, not unpacked -- where onnxruntime can (1.21+); unpacked before that.
        mapped = maps_archive_data()
        assert ("stages/head.onnx.data" in pipe.bundle.in_archive) is mapped
        assert (pipe.bundle.root / "stages" / "head.onnx.data").exists() is not mapped
        np.testing.assert_array_equal(SequentialPipeline(pipe.spec, pipe.bundle).run({"x": x})["y"], want)


def test_onnxruntime_memory_address_location_is_refused(bundle: Path, tmp_path: Path, private_tmp: Path) -> None:
    """onnxruntime reads the offset of a tensor at ``*/_ORT_MEM_ADDR_/*`` as an address (1.18: SIGSEGV)."""
    module = bundle / "stages" / "head.onnx"
    module.write_bytes(_head_with_default(MEM).SerializeToString())
    _rehash(bundle)
    with pytest.raises(BundleError, match=r"external data of stage 'head' '\*/_ORT_MEM_ADDR_/\*' names onnxruntime's reserved location tag"):
        read_bundle(bundle)
    # the bundle holds a file at that very path, so the location would otherwise resolve inside it
    (bundle / "stages" / "*" / "_ORT_MEM_ADDR_").mkdir(parents=True)
    (bundle / "stages" / "*" / "_ORT_MEM_ADDR_" / "*").write_bytes(b"\0" * 16)
    _zip_of(bundle, tmp_path / "b.onnxpipe")
    with pytest.raises(BundleError, match=r"archive member 'stages/\*/_ORT_MEM_ADDR_/\*' names onnxruntime's reserved location tag"):
        read_bundle(tmp_path / "b.onnxpipe")
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    manifest["files"]["stages/*/_ORT_MEM_ADDR_/*"] = {"size": 16, "sha256": "0" * 64}
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"manifest entry 'stages/\*/_ORT_MEM_ADDR_/\*' names onnxruntime's reserved location tag"):
        read_bundle(bundle)
    shutil.rmtree(bundle / "stages" / "*")
    with pytest.raises(BundleError, match="archive member 'stages/_ORT_NEXT_TAG_' names onnxruntime's reserved location tag"):
        read_bundle(_zip_of(bundle, tmp_path / "c.onnxpipe", extra={"stages/_ORT_NEXT_TAG_": b""}))


def _members(archive: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return {m.filename: zf.read(m) for m in zf.infolist()}


def _set_header(path: Path, name: str, field: str, value: int) -> None:
    """Rewrite a 16-bit field (``flags`` or ``method``) of one member in both of its headers."""
    local, central = {"flags": (6, 8), "method": (8, 10)}[field]
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        struct.pack_into("<H", data, zf.getinfo(name).header_offset + local, value)
    at = data.find(b"PK\x01\x02")
    while data[at + 46 : at + 46 + struct.unpack_from("<H", data, at + 28)[0]] != name.encode():
        at = data.find(b"PK\x01\x02", at + 1)
    struct.pack_into("<H", data, at + central, value)
    path.write_bytes(bytes(data))


def test_archive_member_inside_a_file_is_refused(good_archive: Archive, tmp_path: Path, private_tmp: Path) -> None:
    archive = _zip(tmp_path / "b.onnxpipe", {**_members(good_archive), "pipeline.json/x": b"{}"})
    with pytest.raises(BundleError, match="archive member 'pipeline.json' is a file, yet the archive also holds 'pipeline.json/x' inside it"):
        load(archive)
    archive = _zip(tmp_path / "c.onnxpipe", {"stages/tail.onnx.data/x": b"", **_members(good_archive)})
    with pytest.raises(BundleError, match="archive member 'stages/tail.onnx.data' is a file, yet the archive also holds 'stages/tail.onnx.data/x'"):
        load(archive)


def test_a_member_with_an_empty_name_is_refused(good_archive: Archive, tmp_path: Path, private_tmp: Path) -> None:
    # Found by test_damaged_archive_gives_a_bundle_error_or_a_bundle: one byte of the central
    # directory set to 0 left a member named "", on which zipfile's is_dir() raises IndexError.
    archive = _zip(tmp_path / "b.onnxpipe", {**_members(good_archive), "": b"x"})
    with pytest.raises(BundleError, match=r"^archive member \d+ has an empty name: damaged$"):
        read_bundle(archive)


def test_encrypted_and_unsupported_compression_are_refused(good_archive: Archive, tmp_path: Path, private_tmp: Path) -> None:
    path = _zip(tmp_path / "e.onnxpipe", _members(good_archive))
    _set_header(path, "pipeline.json", "flags", 1)  # zipfile then wants a password: RuntimeError
    with pytest.raises(BundleError, match="archive member 'pipeline.json' is encrypted; bundles are not"):
        load(path)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in _members(good_archive).items():
            zf.writestr(name, data, zipfile.ZIP_BZIP2 if name == "pipeline.json" else zipfile.ZIP_STORED)
    with pytest.raises(BundleError, match=r"archive member 'pipeline.json' uses compression method 12; bundles use stored \(0\) or deflate \(8\)"):
        load(path)
    _zip(path, _members(good_archive))
    _set_header(path, "manifest.json", "method", 99)  # zipfile itself raises NotImplementedError for this one
    with pytest.raises(BundleError, match="archive member 'manifest.json' uses compression method 99"):
        load(path)


def test_corrupt_deflate_stream_is_refused(good_archive: Archive, tmp_path: Path, private_tmp: Path) -> None:
    path = tmp_path / "z.onnxpipe"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in _members(good_archive).items():
            zf.writestr(name, data)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        member = zf.getinfo("pipeline.json")
    start = member.header_offset + 30 + len(member.filename) + len(member.extra)
    data[start : start + 8] = b"\xff" * 8  # a deflate block of reserved type 3: zlib.error
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"archive '{path}' is damaged: Error -3 while decompressing data: invalid block type"):
        load(path)


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_the_cli_ends_a_hostile_archive_as_one_line(good_archive: Archive, tmp_path: Path, private_tmp: Path, command: str) -> None:
    members = _members(good_archive)
    cases = {
        "inside.onnxpipe": ({**members, "pipeline.json/x": b"{}"}, "is a file, yet the archive also holds"),
        "deep.onnxpipe": ({**members, "manifest.json": b"[" * 100_000}, "manifest.json is not valid JSON: nested too deeply"),
        "digits.onnxpipe": ({**members, "manifest.json": b'{"format": "onnxpipe.manifest", "version": 1' + b"0" * 5000 + b"}"}, "Exceeds the limit"),
    }
    for name, (content, message) in cases.items():
        assert_user_error(run(command, _zip(tmp_path / name, content)), message)


def _write_manifest_text(bundle: Path, text: str) -> None:
    (bundle / MANIFEST_NAME).write_text(text)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["files"].update({"pipeline.json": [1, 2]}), "manifest entry 'pipeline.json' must be an object with 'size' and 'sha256', got a list"),
        (lambda m: m.update(versions="1.0"), 'manifest \'versions\' must be a table of strings, got "1.0"'),
        (lambda m: m.update(versions={"onnx": 1}), "manifest 'versions' must be a table of strings"),
        (lambda m: m.update(opsets={"": "nine"}), r"manifest 'opsets' must be a table of integers >= 0 \(domain -> opset version\)"),
        (lambda m: m.update(providers="CPUExecutionProvider"), 'manifest \'providers\' must be a list of strings, got "CPUExecutionProvider"'),
        (lambda m: m.update(reference=[{"inputs": 1, "outputs": None}]), "manifest 'reference' entries must be objects with string 'inputs' and 'outputs'"),
        (lambda m: m.update(reference=[{"inputs": "../x.npz", "outputs": "y.npz"}]), "reference file '../x.npz' is not a normalized path"),
        (lambda m: m.update(created=17), "manifest 'created' must be a string, got 17"),
        (lambda m: m.update(version=True), "manifest version true is not supported"),
        (lambda m: m["files"].update({"\ud800": {"size": 1, "sha256": "0" * 64}}), re.escape("manifest entry '\\ud800' is not valid Unicode")),
    ],
)
def test_manifest_fields_of_the_wrong_type_are_refused(bundle: Path, change: Any, message: str) -> None:
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    change(manifest)
    _write_manifest_text(bundle, json.dumps(manifest))
    with pytest.raises(BundleError, match=message):
        read_bundle(bundle)


def test_json_that_python_cannot_read_safely_is_refused(bundle: Path) -> None:
    good = (bundle / MANIFEST_NAME).read_text()
    _write_manifest_text(bundle, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(BundleError, match="manifest.json is not valid JSON: nested too deeply"):
        read_bundle(bundle)
    _write_manifest_text(bundle, good.replace('"version": 1', '"version": 1' + "0" * 5000))
    with pytest.raises(BundleError, match="manifest.json is not valid JSON: Exceeds the limit"):
        read_bundle(bundle)
    _write_manifest_text(bundle, good.replace('"version": 1', '"version": 1, "version": 1'))
    with pytest.raises(BundleError, match="manifest.json: key 'version' appears twice in one object"):
        read_bundle(bundle)
    _write_manifest_text(bundle, good)
    read_bundle(bundle).close()
    config = bundle / "pipeline.json"
    text = config.read_text()
    for bad, message in [
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, "pipeline.json is not valid JSON: nested too deeply"),
        (text.replace('"links":', '"links": [], "links":'), "pipeline.json: key 'links' appears twice in one object"),
        (text.replace(f'"version": {SPEC_VERSION}', '"version": ' + "9" * 5000), "pipeline.json is not valid JSON: Exceeds the limit"),
    ]:
        config.write_text(bad)
        _rehash(bundle)
        with pytest.raises(BundleError, match=message):
            read_bundle(bundle)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("stages"), "pipeline.json: pipeline spec: 'stages' is missing"),
        (lambda d: d.update(stages={"head": {}}), "pipeline.json: pipeline spec: 'stages' must be a list, got an object"),
        (lambda d: d["stages"].append([]), r"pipeline.json: pipeline spec: stages\[2\] must be an object, got a list"),
        (lambda d: d["stages"][0].pop("module"), r"pipeline.json: pipeline spec: stages\[0\] \('head'\): 'module' is missing"),
        (lambda d: d["stages"][1]["inputs"][0].update(dtype=7), r"stages\[1\] \('tail'\): inputs\[0\] \('h'\): 'dtype' must be a string, got 7"),
        (lambda d: d["stages"][0].update(settings=[]), r"stages\[0\] \('head'\): 'settings' must be an object, got a list"),
        (lambda d: d["stages"][0]["settings"].update(affinity=3), r"stages\[0\] \('head'\): settings: affinity must be a non-empty list"),
        (lambda d: d["stages"][0]["settings"].update(optimization=["all"]), r"settings: optimization must be a string, got \['all'\]"),
        (lambda d: d["stages"][0]["settings"].update(provider_options=[]), "settings: provider_options must map strings to strings"),
        (lambda d: d["links"][0].update({"from": {"input": 3}}), r"links\[0\]: a link end must be"),
        (lambda d: d["links"][0].pop("to"), r"links\[0\]: 'to' is missing"),
        (lambda d: d["metadata"].update(name=["x"]), r"metadata\['name'\] must be a string, got a list"),
        (lambda d: d.update(version=True), "pipeline spec version true is not supported"),
    ],
)
def test_pipeline_json_fields_of_the_wrong_type_are_refused(bundle: Path, change: Any, message: str) -> None:
    data = json.loads((bundle / "pipeline.json").read_text())
    change(data)
    (bundle / "pipeline.json").write_text(json.dumps(data))
    _rehash(bundle)
    with pytest.raises(BundleError, match=message):
        read_bundle(bundle)


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("session.intra_op.allow_spinning", "1", "is what the setting 'spinning' makes: set spinning instead"),
        ("session.intra_op_thread_affinities", "99999", "is what the setting 'affinity' makes: set affinity instead"),
        ("session.collect_node_memory_stats_to_file", "{victim}", "names a file or folder of the host, or makes onnxruntime write one"),
    ],
)
def test_a_session_config_that_overrules_the_settings_or_names_a_host_file_is_refused(bundle: Path, tmp_path: Path, key: str, value: str,
                                                                                      why: str) -> None:
    # Issue 36, item 7: spinning=false with allow_spinning=1 spun, --set spinning=off could not stop it, an
    # affinity in session_config skipped the core check, and onnxruntime overwrote the file a bundle named.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    data = json.loads((bundle / "pipeline.json").read_text())
    data["stages"][0]["settings"].update(spinning=False, session_config={key: value.format(victim=victim)})
    (bundle / "pipeline.json").write_text(json.dumps(data))
    _rehash(bundle)
    message = rf"^pipeline.json: pipeline spec: stages\[0\] \('head'\): settings: session_config key '{re.escape(key)}' {why}"
    with pytest.raises(BundleError, match=message):
        load(bundle, overrides={"*": {"spinning": False}})
    with pytest.raises(BundleError, match=message):
        read_bundle(bundle)
    assert victim.read_text() == "precious"


# -- property: random damage gives a BundleError or a bundle, never another exception ---------------
#
# read_bundle raises only BundleError (a ConfigError from pipeline.json is wrapped into one); what it
# accepts is a bundle whose checked files are intact (a byte changed in a zip header the loader does
# not use, a manifest field such as "created" rewritten). load() can raise ConfigError/StageError
# beyond this, when a session is made; the property covers the checks before any session exists.

# ONNXPIPE_FUZZ_EXAMPLES=5000 runs a longer search by hand.
PROPERTY = settings(
    max_examples=int(os.environ.get("ONNXPIPE_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _outcome(path: Path) -> None:
    """Load the bundle: any exception but BundleError fails the property (--hypothesis-show-statistics counts)."""
    try:
        read_bundle(path).close()
        event("accepted")
    except BundleError as e:
        event(f"refused: {str(e).split(':')[0][:40]}")


def _structure(archive: bytes) -> list[int]:
    """Offsets where the archive's structure is (headers, JSON members, central directory, end record)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        spots = [m.header_offset for m in zf.infolist()]
        spots += [m.header_offset + 30 + len(m.filename) + len(m.extra) for m in zf.infolist() if m.filename.endswith(".json")]
    return [*spots, archive.rindex(b"PK\x01\x02"), archive.index(b"PK\x01\x02"), archive.rindex(b"PK\x05\x06"), len(archive) - 22]


@PROPERTY
@given(data=st.data())
def test_damaged_archive_gives_a_bundle_error_or_a_bundle(good_archive: Archive, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    damaged = bytearray(good_archive)
    spots = _structure(good_archive)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.one_of(st.integers(0, len(damaged) - 1), st.sampled_from(spots).flatmap(lambda s: st.integers(s, s + 64))), label="at")
        at = min(at, len(damaged) - 1)
        kind = data.draw(st.sampled_from(["set", "flip", "cut", "insert"]), label="kind")
        if kind == "set":
            damaged[at] = data.draw(st.integers(0, 255))
        elif kind == "flip":
            damaged[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del damaged[at : at + data.draw(st.integers(1, 64))]
        else:
            damaged[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    path = tmp_path_factory.mktemp("damaged") / "b.onnxpipe"
    path.write_bytes(bytes(damaged))
    _outcome(path)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False) | st.text(max_size=8), _containers, max_leaves=6)


def _mutate(value: Any, data: st.DataObject) -> Any:
    """``value`` with one node somewhere in it replaced, removed or given a new key."""
    children = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) if isinstance(value, list) else []
    if not children or data.draw(st.integers(0, 3), label="stop") == 0:
        return data.draw(_JSON, label="new value")
    key, child = data.draw(st.sampled_from(children), label="into")
    action = data.draw(st.sampled_from(["descend", "descend", "descend", "drop", "add"]), label="action")
    if action == "drop":
        return {k: v for k, v in value.items() if k != key} if isinstance(value, dict) else [v for i, v in enumerate(value) if i != key]
    if action == "add":
        return {**value, data.draw(st.text(max_size=8), label="key"): data.draw(_JSON)} if isinstance(value, dict) else [*value, data.draw(_JSON)]
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[key] = _mutate(child, data)  # type: ignore[index]
    return copy


@PROPERTY
@given(data=st.data())
def test_mutated_json_gives_a_bundle_error_or_a_bundle(pristine_bundle: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    root = tmp_path_factory.mktemp("mutated") / "bundle"
    shutil.copytree(pristine_bundle, root)
    which = data.draw(st.sampled_from([MANIFEST_NAME, "pipeline.json"]), label="file")
    (root / which).write_text(json.dumps(_mutate(json.loads((root / which).read_text()), data)))
    if which == "pipeline.json":
        manifest = json.loads((root / MANIFEST_NAME).read_text())
        manifest["files"]["pipeline.json"] = {"size": (root / which).stat().st_size, "sha256": sha256_file(root / which)}
        (root / MANIFEST_NAME).write_text(json.dumps(manifest))
    _outcome(root)
