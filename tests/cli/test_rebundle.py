"""Deploy-time settings on the command line (issue 29, item 4): ``--set`` on run, bench, verify and
inspect, and ``onnxpipe rebundle``, which writes them into a new bundle whose module files are the
old ones byte for byte. The bundle here is pinned to a core this host lacks: it cannot run as built."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe.builder import build, export
from onnxpipe.runtime import load, read_bundle
from tests import code_stages, models
from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run

LACKING = max(os.sched_getaffinity(0)) + 1  # a CPU this process may not run on
CORE = min(os.sched_getaffinity(0))
X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hand_wired's three stages pinned to LACKING (the build allows it: pinning is for run time),
    as an archive with a reference sample computed by the whole model."""
    root = tmp_path_factory.mktemp("pinned")
    config = models.hand_wired()
    for stage in config.stages:
        stage.configure(affinity=[LACKING])
    built = build(config, root / "built").path
    return export(built, root / "pinned.onnxpipe", reference_inputs=[{"x": X}], reference_model=models.stages_whole())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("in") / "x.npz"
    np.savez(path, x=X)
    return path


def _manifest(bundle: Path) -> dict[str, Any]:
    if bundle.is_dir():
        return json.loads((bundle / "manifest.json").read_text())
    with zipfile.ZipFile(bundle) as zf:
        return json.loads(zf.read("manifest.json"))


def _config(bundle: Path) -> dict[str, Any]:
    with read_bundle(bundle, sessions=()) as b:
        return b.spec.to_dict()


def test_a_bundle_pinned_to_cores_this_host_lacks_runs_once_rebundled(pinned: Path, inputs: Path, tmp_path: Path) -> None:
    assert_user_error(run("run", pinned, "--inputs", inputs, "--outputs", tmp_path / "y.npz"), f"affinity names core(s) [{LACKING}] this process may not use")
    out = tmp_path / "here.onnxpipe"
    result = ok("rebundle", pinned, "-o", out, "--set", f"*:affinity={CORE}")
    assert f"stage 'twin': replicas 1, intra_op_threads 1, affinity {CORE}" in result.stdout
    assert f"check it: onnxpipe verify {out}" in result.stdout
    old, new = _manifest(pinned), _manifest(out)
    assert set(old["files"]) == set(new["files"])
    assert old["files"]["pipeline.json"] != new["files"]["pipeline.json"]
    modules = [f for f in old["files"] if f.startswith("stages/")]
    assert len(modules) == 3 and all(new["files"][f] == old["files"][f] for f in old["files"] if f != "pipeline.json")  # modules, reference: byte for byte
    assert (new["versions"], new["opsets"], new["providers"], new["reference"]) == (old["versions"], old["opsets"], old["providers"], old["reference"])
    before, after = _config(pinned), _config(out)
    assert [s["settings"]["affinity"] for s in after["stages"]] == [[CORE]] * 3
    for s in before["stages"]:
        s["settings"]["affinity"] = [CORE]
    assert after == before  # nothing else changed
    assert "ok: all 1 output(s)" in ok("verify", out).stdout
    with load(out) as pipe:
        assert pipe({"x": X})["y"].shape == (2, 4)


def test_rebundle_writes_a_folder_and_rewrites_one_in_place(pinned: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bundle"
    ok("rebundle", pinned, "-o", folder, "--set", f"affinity={CORE}")
    assert_user_error(run("rebundle", folder, "-o", folder, "--set", "twin:replicas=2"), f"'{folder}' exists; choose another name or overwrite it")
    ok("rebundle", folder, "-o", folder, "--overwrite", "--set", "twin:replicas=2,threads=2")
    with read_bundle(folder) as b:
        twin = b.spec.stage("twin").settings
        assert (twin.replicas, twin.intra_op_threads, twin.affinity) == (2, 2, (CORE,))
    assert {f: e for f, e in _manifest(folder)["files"].items() if f != "pipeline.json"} == {
        f: e for f, e in _manifest(pinned)["files"].items() if f != "pipeline.json"
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no staging folder left


def test_weights_left_in_the_archive_are_copied_byte_for_byte(tmp_path: Path) -> None:
    # 1 MiB of weights: export stores them as stages/tail.onnx.data, which loading maps in place from the archive.
    source = export(build(models.head_then_tail(1 << 16), tmp_path / "built").path, tmp_path / "big.onnxpipe")
    with read_bundle(source) as b:
        assert "stages/tail.onnx.data" in b.in_archive
    ok("rebundle", source, "-o", tmp_path / "again.onnxpipe", "--set", "tail:replicas=2")
    old, new = _manifest(source)["files"], _manifest(tmp_path / "again.onnxpipe")["files"]
    assert new["stages/tail.onnx.data"] == old["stages/tail.onnx.data"] and new["stages/tail.onnx.data"]["size"] == 1 << 20  # 4 x 65536 float32
    with load(tmp_path / "again.onnxpipe") as pipe, load(source) as before:
        assert [s.replicas for s in pipe.stats().stages] == [1, 2]
        np.testing.assert_array_equal(pipe({"x": X})["y"], before({"x": X})["y"])


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("opt=basic", "--set opt=basic: 'optimization' cannot change at deploy time: it makes the stage's module"),
        ("head:target=cuda", "--set head:target=cuda: 'target' cannot change at deploy time"),
        ("nope:threads=2", "--set nope:threads=2: no stage 'nope'; valid: 'head', 'tail', 'twin' (or a position 0..2, or * for all)"),
        ("threads=-1", "--set threads=-1: stage 'head': intra_op_threads must be an integer >= 0, got -1"),
        ("twin:max_batch=2", "stage 'twin': max_batch 2: the stage was built without batching"),
    ],
)
def test_rebundle_refuses_what_load_refuses(pinned: Path, inputs: Path, tmp_path: Path, setting: str, message: str) -> None:
    out = tmp_path / "out.onnxpipe"
    refused = run("rebundle", pinned, "-o", out, "--set", setting)
    assert_user_error(refused, message)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    by_run = run("run", pinned, "--inputs", inputs, "--outputs", tmp_path / "y.npz", "--set", setting)
    assert by_run.stderr == refused.stderr  # the same check, the same line


def test_set_values_are_parsed_as_builds_stage_values(pinned: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_usage_error(run("rebundle", pinned, "-o", out), "give the settings to change with --set [SEL:]KEY=VALUE")
    assert_usage_error(run("rebundle", pinned, "-o", out, "--set", "threads"), "'threads' is not [SEL:]key=value")
    assert_usage_error(run("rebundle", pinned, "-o", out, "--set", "0:thread=2"), "unknown key 'thread' in '0:thread=2'; valid keys: target")
    assert_usage_error(run("rebundle", pinned, "-o", out, "--set", "affinity=0,1"), "join cores with '+' (affinity=0+1)")
    assert not out.exists()


def test_rebundle_says_what_this_host_would_refuse(pinned: Path, tmp_path: Path) -> None:
    result = ok("rebundle", pinned, "-o", tmp_path / "out.onnxpipe", "--set", "replicas=1")
    assert f"stage 'head' is pinned to core(s) [{LACKING}] this process may not use" in result.stdout


def test_run_bench_inspect_and_verify_take_the_settings(pinned: Path, inputs: Path, tmp_path: Path) -> None:
    here = ("--set", f"*:affinity={CORE}")
    ran = json.loads(ok("run", pinned, "--inputs", inputs, "--outputs", tmp_path / "y.npz", *here, "--set", "1:replicas=2", "--json").stdout)
    assert [(s["stage"], s["replicas"], s["affinity"]) for s in ran["stats"]["stages"]] == [("head", 1, [CORE]), ("twin", 2, [CORE]), ("tail", 1, [CORE])]
    timed = json.loads(ok("bench", pinned, "--requests", 4, "--warmup", 0, "--standalone-runs", 1, *here, "--set", "tail:threads=2", "--json").stdout)
    assert [(s["stage"], s["intra_op_threads"], s["affinity"]) for s in timed["stages"]] == [("head", 1, [CORE]), ("twin", 1, [CORE]), ("tail", 2, [CORE])]
    table = ok("bench", pinned, "--requests", 4, "--warmup", 0, "--standalone-runs", 0, *here, "--set", "tail:threads=2").stdout
    assert "threads" in table and "cores" in table
    shown = json.loads(ok("inspect", pinned, "--set", "twin:replicas=2", "--json").stdout)
    assert [s["settings"]["replicas"] for s in shown["pipeline"]["stages"]] == [1, 2, 1]
    assert shown["deploy_settings"] == ["--set twin:replicas=2"]
    assert "settings as loading with --set twin:replicas=2 makes them" in ok("inspect", pinned, "--set", "twin:replicas=2").stdout
    assert "ok: all 1 output(s)" in ok("verify", pinned, *here).stdout
    assert_usage_error(run("verify", pinned, "--model", tmp_path / "m.onnx", *here), "--set: only for a bundle's stored reference")
    assert_usage_error(run("inspect", tmp_path / "m.onnx", *here), "--set: only used for a bundle")


def test_export_and_rebundle_hints_carry_the_allow_code_a_bundle_needs(tmp_path: Path) -> None:
    built = build(code_stages.labelled(), tmp_path / "built").path
    exported = ok("export", built, "-o", tmp_path / "code.onnxpipe").stdout
    assert f"run it:   onnxpipe run {tmp_path / 'code.onnxpipe'} --allow-code 'tests.code_stages:label' --inputs" in exported
    again = ok("rebundle", tmp_path / "code.onnxpipe", "-o", tmp_path / "again.onnxpipe", "--set", "head:threads=2").stdout
    assert f"time it:  onnxpipe bench {tmp_path / 'again.onnxpipe'} --allow-code 'tests.code_stages:label'" in again
