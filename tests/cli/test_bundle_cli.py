"""The onnxpipe command from split to deployment: build, export, run, verify and inspect a bundle.

Squeezenet (the fastest light model) is split once, built once with per-stage options and exported
once as an archive with a reference; the tests share those (module fixtures: do not modify them)
and make their own copies to tamper with.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import Result

from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run
from tests.models import light_model_path

SQUEEZENET = light_model_path("squeezenet")
INPUT, OUTPUT = "data_0", "softmaxout_1"





def whole_model(feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(SQUEEZENET), providers=["CPUExecutionProvider"])
    return session.run([OUTPUT], feeds)[0]


def settings(build_dir: Path) -> dict[str, dict[str, object]]:
    return {s["name"]: s["settings"] for s in json.loads((build_dir / "pipeline.json").read_text())["stages"]}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bundle_cli")


@pytest.fixture(scope="module")
def split_dir(work: Path) -> Path:
    ok("split", SQUEEZENET, "-o", work / "split", "--at", "r20")
    return work / "split"


@pytest.fixture(scope="module")
def built(split_dir: Path, work: Path) -> tuple[Path, Result]:
    out = work / "built"
    return out, ok("build", split_dir, "-o", out, "--stage", "0:threads=1,affinity=0", "--stage", "1:target=cpu,opt=extended")


@pytest.fixture(scope="module")
def archive(built: tuple[Path, Result], work: Path) -> tuple[Path, Result]:
    out = work / "squeezenet.onnxpipe"
    return out, ok("export", built[0], "-o", out, "--reference", "2", "--model", SQUEEZENET)


@pytest.fixture(scope="module")
def requests(work: Path) -> list[Path]:
    """Two input files, keyed by the pipeline input's name."""
    rng = np.random.default_rng(5)
    files = [work / "a.npz", work / "b.npz"]
    for f in files:
        np.savez(f, **{INPUT: rng.standard_normal((1, 3, 224, 224)).astype(np.float32)})
    return files


@pytest.fixture(scope="module")
def folder_bundle(built: tuple[Path, Result], requests: list[Path], work: Path) -> tuple[Path, Result]:
    out = work / "folder-bundle"
    return out, ok("export", built[0], "-o", out, "--reference-inputs", requests[0], "--reference", "1", "--seed", "3")


# -- build ---------------------------------------------------------------------------------------


def test_build_applies_stage_options_and_reports_them(built: tuple[Path, Result]) -> None:
    out, result = built
    for fragment in ("built 2 stage(s)", "stage0", "stage1", "on host", "cores", "offline, extended", "KiB", "MiB", f"wrote {out}", "onnxpipe export"):
        assert fragment in result.stdout, fragment
    stage0, stage1 = settings(out).values()
    assert (stage0["intra_op_threads"], stage0["affinity"], stage0["optimization"]) == (1, [0], "all")
    assert (stage1["target"], stage1["affinity"], stage1["optimization"]) == ("cpu", None, "extended")
    assert sorted(p.name for p in (out / "stages").iterdir()) == ["stage0.onnx", "stage1.onnx", "stage1.onnx.data"]


def test_build_with_no_option_uses_defaults_and_json_is_json_only(split_dir: Path, tmp_path: Path) -> None:
    result = ok("build", split_dir, "-o", tmp_path / "b", "--json")
    data = json.loads(result.stdout)
    assert data["path"] == str(tmp_path / "b")
    assert [(r["stage"], r["provider"], r["available"], r["intra_op_threads"], r["affinity"]) for r in data["stages"]] == [
        ("stage0", "CPUExecutionProvider", True, 1, None),
        ("stage1", "CPUExecutionProvider", True, 1, None),
    ]


def test_settings_file_then_stage_options_later_wins(split_dir: Path, tmp_path: Path) -> None:
    file = tmp_path / "stages.json"
    file.write_text(
        json.dumps(
            {
                "stage1": {"replicas": 2, "session_config": {"session.use_device_allocator_for_initializers": "1"}},
                "*": {"intra_op_threads": 2, "spinning": True},  # applied first wherever it is in the file
                "0": {"affinity": [1]},
            }
        )
    )
    out = tmp_path / "b"
    result = ok("build", split_dir, "-o", out, "--settings", file, "--stage", "1:threads=1,spinning=off", "--stage", "stage0:affinity=0-1", "--ort-format")
    assert "replicas" in result.stdout  # the column appears once a stage has several
    stage0, stage1 = settings(out).values()
    assert (stage0["intra_op_threads"], stage0["spinning"], stage0["affinity"]) == (2, True, [0, 1])
    assert (stage1["intra_op_threads"], stage1["spinning"], stage1["replicas"]) == (1, False, 2)
    assert stage1["session_config"] == {"session.use_device_allocator_for_initializers": "1"}
    assert sorted(p.name for p in (out / "stages").iterdir()) == ["stage0.ort", "stage1.ort"]


def test_cross_target_build_succeeds_and_the_bundle_runs_only_with_target_cpu(split_dir: Path, requests: list[Path], tmp_path: Path) -> None:
    result = ok("build", split_dir, "-o", tmp_path / "b", "--stage", "1:target=cuda")
    assert "portable, at load" in result.stdout
    assert "note: stage 'stage1' targets CUDAExecutionProvider, which this host does not have: a cross-target build" in result.stdout
    bundle = tmp_path / "gpu.onnxpipe"
    ok("export", tmp_path / "b", "-o", bundle, "--reference", "1")  # the reference is computed on the CPU
    inspected = ok("inspect", bundle).stdout
    assert "settings: cuda, threads 1" in inspected and "CUDAExecutionProvider optimizes it at load" in inspected
    assert_user_error(run("run", bundle, "--inputs", requests[0], "--outputs", tmp_path / "y.npz"), "stage 'stage1' targets CUDAExecutionProvider")
    assert not (tmp_path / "y.npz").exists()
    ok("run", bundle, "--inputs", requests[0], "--outputs", tmp_path / "y.npz", "--target", "cpu")
    with np.load(tmp_path / "y.npz") as y, np.load(requests[0]) as x:
        np.testing.assert_allclose(y[OUTPUT], whole_model({INPUT: x[INPUT]}), rtol=1e-4, atol=1e-6)
    assert_user_error(run("verify", bundle), "targets CUDAExecutionProvider")
    ok("verify", bundle, "--target", "cpu")


# -- export --------------------------------------------------------------------------------------


def test_export_archive_stores_the_whole_models_reference(archive: tuple[Path, Result]) -> None:
    path, result = archive
    assert f"wrote {path}: archive" in result.stdout and "MiB, 9 files; 2 reference sample(s), outputs from" in result.stdout
    assert f"onnxpipe verify {path}" in result.stdout
    with zipfile.ZipFile(path) as zf:
        assert zf.namelist()[0] == "manifest.json"
        manifest = json.loads(zf.read("manifest.json"))
        assert [r["outputs"] for r in manifest["reference"]] == ["reference/outputs-0.npz", "reference/outputs-1.npz"]
        zf.extractall(path.parent / "unzipped")
    with np.load(path.parent / "unzipped/reference/inputs-1.npz") as x, np.load(path.parent / "unzipped/reference/outputs-1.npz") as y:
        assert list(x.files) == [INPUT] and list(y.files) == [OUTPUT]
        np.testing.assert_array_equal(y[OUTPUT], whole_model({INPUT: x[INPUT]}))


def test_export_folder_from_input_files_then_random_sets(folder_bundle: tuple[Path, Result], requests: list[Path]) -> None:
    path, result = folder_bundle
    assert f"wrote {path}: folder" in result.stdout and "2 reference sample(s), outputs from the pipeline itself" in result.stdout
    with np.load(path / "reference/inputs-0.npz") as stored, np.load(requests[0]) as given:
        np.testing.assert_array_equal(stored[INPUT], given[INPUT])
    with np.load(path / "reference/inputs-1.npz") as random:
        assert random[INPUT].shape == (1, 3, 224, 224) and random[INPUT].dtype == np.float32


def test_export_without_reference_then_verify_asks_for_the_model(built: tuple[Path, Result], tmp_path: Path) -> None:
    result = ok("export", built[0], "-o", tmp_path / "bare.onnxpipe")
    assert "no reference samples" in result.stdout and "onnxpipe verify" not in result.stdout
    assert_user_error(run("verify", tmp_path / "bare.onnxpipe"), "stores no reference", "pass --model")
    assert "reference: none stored" in ok("inspect", tmp_path / "bare.onnxpipe").stdout


# -- run -----------------------------------------------------------------------------------------


def test_run_writes_one_output_file_per_inputs_file(archive: tuple[Path, Result], requests: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = ok("run", archive[0], "--inputs", requests[1], "--inputs", requests[0], "--outputs", out)
    assert sorted(p.name for p in out.iterdir()) == ["a.npz", "b.npz"]
    assert f"wrote 2 output file(s) in {out}" in result.stdout and f"{OUTPUT}: float32[1, 1000, 1, 1]" in result.stdout
    for inputs in requests:
        with np.load(inputs) as x, np.load(out / inputs.name) as y:
            assert list(y.files) == [OUTPUT]
            np.testing.assert_allclose(y[OUTPUT], whole_model({INPUT: x[INPUT]}), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        ({"data": np.zeros((1, 3, 224, 224), np.float32)}, "unknown input 'data'; closest: 'data_0'"),
        ({INPUT: np.zeros((1, 3, 224, 224))}, "input 'data_0' has dtype float64; expected float32"),
        ({INPUT: np.zeros((1, 3, 22, 22), np.float32)}, "input 'data_0' has shape [1, 3, 22, 22]; expected [1, 3, 224, 224]"),
    ],
)
def test_run_refuses_bad_inputs_in_one_line_and_writes_nothing(
    archive: tuple[Path, Result], requests: list[Path], tmp_path: Path, arrays: dict[str, np.ndarray], fragment: str
) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    assert_user_error(run("run", archive[0], "--inputs", requests[0], "--inputs", bad, "--outputs", tmp_path / "y"), f"inputs file '{bad}'", fragment)
    assert not (tmp_path / "y").exists()


def test_run_input_file_problems(archive: tuple[Path, Result], requests: list[Path], tmp_path: Path) -> None:
    assert_user_error(run("run", archive[0], "--inputs", tmp_path / "none.npz", "--outputs", tmp_path / "y.npz"), "inputs file", "does not exist")
    (tmp_path / "text.npz").write_text("not numpy")
    assert_user_error(run("run", archive[0], "--inputs", tmp_path / "text.npz", "--outputs", tmp_path / "y.npz"), "inputs file", "as an .npz of arrays")
    assert_user_error(run("run", archive[0], "--inputs", requests[0], "--outputs", requests[0]), "is also an --inputs file")


# -- verify and inspect --------------------------------------------------------------------------


def test_verify_bundle_against_its_stored_reference(archive: tuple[Path, Result]) -> None:
    result = ok("verify", archive[0])
    assert "stored reference, 2 sample(s)" in result.stdout and "ok: all 2 output(s) within rtol=0.0001 atol=1e-05" in result.stdout
    data = json.loads(ok("verify", archive[0], "--json").stdout)
    assert data["ok"] is True and data["samples"] == 2
    assert [(c["sample"], c["output"], c["ok"]) for c in data["checks"]] == [(0, OUTPUT, True), (1, OUTPUT, True)]


def test_verify_bundle_against_the_whole_model(archive: tuple[Path, Result]) -> None:
    data = json.loads(ok("verify", archive[0], "--model", SQUEEZENET, "--samples", "2", "--json").stdout)
    assert data["ok"] is True and {t["tensor"]: t["kind"] for t in data["tensors"]} == {OUTPUT: "output", "r19": "boundary", "r20": "boundary"}


def test_verify_bundle_past_tolerance_exits_1(folder_bundle: tuple[Path, Result], tmp_path: Path) -> None:
    # A bundle whose stored outputs are wrong, re-manifested so that it is intact as a bundle.
    from onnxpipe.runtime.bundle import write_manifest

    bundle = tmp_path / "wrong"
    shutil.copytree(folder_bundle[0], bundle)
    np.savez(bundle / "reference/outputs-1.npz", **{OUTPUT: np.zeros((1, 1000, 1, 1), np.float32)})
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / "manifest.json").unlink()
    write_manifest(
        bundle, {k: manifest[k] for k in ("versions", "opsets", "providers", "created")} | {"reference": [tuple(r.values()) for r in manifest["reference"]]}
    )
    result = run("verify", bundle)
    assert_user_error(result, "1 of 2 reference check(s) differ past rtol=0.0001 atol=1e-05: sample 1 'softmaxout_1'")
    assert "FAIL" in result.stdout


def test_inspect_bundle(archive: tuple[Path, Result]) -> None:
    path = archive[0]
    out = ok("inspect", path).stdout
    for fragment in (
        f"bundle 'squeezenet_old' ({path}): archive",
        "9 files; all 8 files match their sha256",
        "onnxruntime " + ort.__version__,
        "opsets: ai.onnx 9",
        "providers: CPUExecutionProvider",
        "input   data_0: float32[1, 3, 224, 224]",
        "stage 0 'stage0': stages/stage0.onnx, ",
        "settings: cpu, threads 1, cores 0, 1 replica(s), opt all",
        "settings: cpu, threads 1, cores any, 1 replica(s), opt extended",
        "build:    optimized offline for CPUExecutionProvider (extended)",
        "in  data_0: float32[1, 3, 224, 224]  <- pipeline.data_0",
        "out r20: float32[1, 128, 27, 27]  -> stage1.r20",
        "out softmaxout_1: float32[1, 1000, 1, 1]  -> pipeline.softmaxout_1",
        "param groups: none",
        "reference: 2 sample(s) stored",
    ):
        assert fragment in out, fragment
    data = json.loads(ok("inspect", path, "--json").stdout)
    assert (data["kind"], data["files"], data["sha256_ok"]) == ("archive", 9, True)
    assert data["manifest"]["providers"] == ["CPUExecutionProvider"] and len(data["manifest"]["reference"]) == 2
    stages = data["pipeline"]["stages"]
    assert [s["settings"]["affinity"] for s in stages] == [[0], None]
    assert all(s["module_bytes"] > 0 for s in stages) and stages[1]["build"]["optimized_for"] == "CPUExecutionProvider"


def test_tampered_bundles_are_refused_in_one_line(
    folder_bundle: tuple[Path, Result], archive: tuple[Path, Result], requests: list[Path], tmp_path: Path
) -> None:
    altered = tmp_path / "altered"
    shutil.copytree(folder_bundle[0], altered)
    module = bytearray((altered / "stages/stage0.onnx").read_bytes())
    module[-8] ^= 1
    (altered / "stages/stage0.onnx").write_bytes(bytes(module))
    message = "bundle file 'stages/stage0.onnx' does not match its sha256 in the manifest"
    assert_user_error(run("inspect", altered), message)
    assert_user_error(run("inspect", altered, "--json"), message)
    assert_user_error(run("verify", altered), message)
    assert_user_error(run("verify", altered, "--model", SQUEEZENET), message)
    assert_user_error(run("run", altered, "--inputs", requests[0], "--outputs", tmp_path / "y.npz"), message)
    damaged = tmp_path / "damaged.onnxpipe"
    data = bytearray(archive[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert_user_error(run("run", damaged, "--inputs", requests[0], "--outputs", tmp_path / "y.npz"), f"archive '{damaged}' is damaged")
    assert not (tmp_path / "y.npz").exists()


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "fragments"),
    [
        ("head:threads=2", ["--stage head:threads=2: no stage 'head'", "'stage0', 'stage1'", "or a position 0..1, or * for all"]),
        ("stage3:threads=2", ["no stage 'stage3'; closest: 'stage", "or a position 0..1"]),
        ("2:threads=2", ["no stage at position 2: the pipeline has 2 stage(s), at positions 0..1"]),
        ("0:target=gpu", ["--stage 0:target=gpu: stage 'stage0': unknown execution provider 'gpu'"]),
        ("*:opt=fast", ["stage 'stage0': unknown optimization level 'fast'; valid: disable, basic, extended, all"]),
        ("1:mode=fast", ["execution_mode must be 'sequential' or 'parallel'"]),
        ("1:replicas=0", ["replicas must be an integer >= 1"]),
    ],
)
def test_build_user_errors(split_dir: Path, tmp_path: Path, stage: str, fragments: list[str]) -> None:
    assert_user_error(run("build", split_dir, "-o", tmp_path / "b", "--stage", stage), *fragments)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (None, ["settings file", "does not exist"]),
        ("{oops", ["cannot read settings file"]),
        ("[1]", ["must hold a JSON object", "got list"]),
        ('{"*": 2}', ["entry '*' must be an object of stage settings"]),
        ('{"*": {"threads": 2}}', ["entry '*': stage 'stage0': unknown stage setting 'threads'"]),
        ('{"9": {"replicas": 2}}', ["entry '9': no stage at position 9"]),
    ],
)
def test_bad_settings_files(split_dir: Path, tmp_path: Path, content: str | None, fragments: list[str]) -> None:
    file = tmp_path / "s.json"
    if content is not None:
        file.write_text(content)
    assert_user_error(run("build", split_dir, "-o", tmp_path / "b", "--settings", file), *fragments)


@pytest.mark.parametrize(
    ("stage", "fragment"),
    [
        ("0:thread=2", "unknown key 'thread' in '0:thread=2'; valid keys: target (or provider), threads, inter-threads, mode, spinning, affinity"),
        ("0:affinity=0,1", "',' separates keys, so join cores with '+' (affinity=0+1)"),
        ("0:affinity=0-x", "'0-x' is not a core list: give cores as 0, 0-3 or 0+2+5"),
        ("0:affinity=3-1", "range '3-1' goes down"),
        ("0:affinity=1+0-2", "names core(s) [1] more than once"),
        ("0:affinity=0-1000000", "core 1000000 in '0-1000000' is past the largest core number, 8191 (Linux's most CPUs)"),  # issue 36, item 12
        ("0:affinity=0-8191+0-8191", "names core(s) [0, 1, 2, 3, 4, 5, 6, 7, ...] (8192 in all) more than once"),
        ("0:affinity=²", "'²' is not a core list: give cores as 0, 0-3 or 0+2+5 (or none), in the digits 0-9"),
        ("0:affinity=0-٣", "'0-٣' is not a core list"),
        ("0:threads=٣", "threads=٣ in '0:threads=٣': must be an integer"),
        ("threads=2", "is not SEL:key=value"),
        ("0:threads=two", "threads=two in '0:threads=two': must be an integer"),
        ("0:spinning=maybe", "must be on or off"),
        ("0:target=cpu,provider=cpu", "'provider' is given twice"),
    ],
)
def test_malformed_stage_options_are_usage_errors(split_dir: Path, tmp_path: Path, stage: str, fragment: str) -> None:
    assert_usage_error(run("build", split_dir, "-o", tmp_path / "b", "--stage", stage), fragment)


def test_other_usage_errors(split_dir: Path, built: tuple[Path, Result], archive: tuple[Path, Result], requests: list[Path], tmp_path: Path) -> None:
    assert_usage_error(run("export", built[0], "-o", tmp_path / "x", "--model", SQUEEZENET), "--model: only used for reference samples")
    assert_usage_error(run("verify", split_dir), "is not a bundle: give --model MODEL.onnx")
    assert_usage_error(run("verify", archive[0], "--samples", "3", "--dim", "b=2"), "--dim, --samples: only used with --model")
    assert_usage_error(run("inspect", archive[0], "--top", "3"), "--top: only used for a model")
    assert_usage_error(run("run", archive[0], "--inputs", requests[0]), "Missing option '--outputs'")


def test_other_user_errors(split_dir: Path, built: tuple[Path, Result], tmp_path: Path) -> None:
    assert_user_error(run("export", split_dir, "-o", tmp_path / "x"), "holds a pipeline that was not built; run build first")
    assert_user_error(run("export", tmp_path / "nothing", "-o", tmp_path / "x", "--reference", "1"), "is not a build folder")
    assert_user_error(run("export", built[0], "-o", tmp_path / "x", "--reference", "1", "--model", tmp_path / "m.onnx"), "model file", "does not exist")
    assert_user_error(run("verify", tmp_path / "nothing"), "does not exist")
    assert_user_error(run("inspect", split_dir), "is a folder but not a bundle")
    assert_user_error(run("build", split_dir, "-o", built[0]), "exists and is not empty")


# -- the real entry point ------------------------------------------------------------------------


def test_deployment_host_session_in_a_subprocess(archive: tuple[Path, Result], requests: list[Path], tmp_path: Path) -> None:
    """python -m onnxpipe.cli: inspect, verify and run the archive, as a deployment host would."""
    code = "import sys\nfrom onnxpipe.cli import main\nfor args in sys.argv[1:]:\n    main(args.split('|'), standalone_mode=False)\n"
    out = tmp_path / "y.npz"
    commands = [f"inspect|{archive[0]}", f"verify|{archive[0]}", f"run|{archive[0]}|--inputs|{requests[1]}|--outputs|{out}"]
    done = subprocess.run([sys.executable, "-c", code, *commands], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # onnxruntime's own warnings stay quiet
    assert "all 8 files match their sha256" in done.stdout and "ok: all 2 output(s)" in done.stdout and f"wrote {out}" in done.stdout
    with np.load(requests[1]) as x, np.load(out) as y:
        np.testing.assert_allclose(y[OUTPUT], whole_model({INPUT: x[INPUT]}), rtol=1e-4, atol=1e-6)
    failed = subprocess.run(
        [sys.executable, "-m", "onnxpipe.cli", "run", archive[0], "--inputs", "missing.npz", "--outputs", out], capture_output=True, text=True
    )
    assert failed.returncode == 1 and failed.stderr == "error: inputs file 'missing.npz' does not exist\n"
