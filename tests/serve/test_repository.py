"""A model repository says what it does not serve: every entry not taken is one line at start with
why (a raw .onnx, a build folder, a stray file, a folder with nothing servable); a damaged
archive is a load failure naming it (exit 1, or not served with --allow-partial); Triton's
``NAME/VERSION/`` layout is read, its highest version served. ``model_sources`` on small folders
first (no server), then a real server over a repository of real bundles."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from onnxpipe import runtime
from onnxpipe._errors import ConfigError
from onnxpipe.serve import ModelSource, model_sources
from onnxpipe.serve._options import ModelSources
from tests import models
from tests.serve.process import ROOT, ServerProcess, free_ports

ONNX = "an ONNX model, not a bundle: make one with onnxpipe split/build/export"
BUILD = "a build folder: export it with onnxpipe export"
STRAY = "not a bundle (a folder with a manifest.json, or a .onnxpipe archive)"
EMPTY = "not a bundle: a folder with nothing servable (no manifest.json, and no version folder 1/, 2/, ... in it holds a bundle)"
NO_BUNDLE = "a version folder without a bundle (model.onnxpipe, or a manifest.json of its own)"


# -- model_sources on small folders: a bundle folder is one with a manifest.json, an archive is named so ----------------------


def _bundle(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder


def _build(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "pipeline.json").write_text("{}")
    return folder


def _file(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_every_entry_not_taken_is_listed_with_why_and_hidden_ones_are_not(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _bundle(repo / "pair")
    _file(repo / "squeeze.onnxpipe")
    _file(repo / "model.onnx")
    _build(repo / "built")
    _file(repo / "notes.txt")
    (repo / "empty").mkdir()
    _file(repo / ".DS_Store")
    _bundle(repo / ".git")  # hidden, even when it looks like a bundle
    with zipfile.ZipFile(repo / "old.zip", "w") as zf:
        zf.writestr("manifest.json", "{}")
    found = model_sources(repository=repo)
    assert isinstance(found, ModelSources)
    assert list(found) == [ModelSource("pair", repo / "pair"), ModelSource("squeeze", repo / "squeeze.onnxpipe")]
    assert found.skipped == [
        (repo / "built", BUILD),
        (repo / "empty", EMPTY),
        (repo / "model.onnx", ONNX),
        (repo / "notes.txt", STRAY),
        (repo / "old.zip", "a zip archive not named NAME.onnxpipe: rename it to serve it"),
    ]


def test_tritons_layout_serves_the_highest_version_holding_a_bundle(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _bundle(repo / "resnet" / "1")  # a version folder that is a bundle folder
    _file(repo / "resnet" / "3" / "model.onnxpipe")
    (repo / "resnet" / "2").mkdir()
    _file(repo / "resnet" / "10" / "model.onnx")
    _file(repo / "resnet" / "config.pbtxt")
    _file(repo / "resnet" / "labels.txt")
    _file(repo / "resnet" / ".config.pbtxt.swp")
    _bundle(repo / "ocr" / "7" / "model.onnxpipe")  # model.onnxpipe a bundle folder
    _build(repo / "ocr" / "8")
    found = model_sources(repository=repo)
    assert list(found) == [
        ModelSource("ocr", repo / "ocr" / "7" / "model.onnxpipe", ("7",)),
        ModelSource("resnet", repo / "resnet" / "3" / "model.onnxpipe", ("1", "3")),
    ]
    assert [s.version for s in found] == ["7", "3"]
    assert found.skipped == [
        (repo / "ocr" / "8", BUILD),
        (repo / "resnet" / "10", "a version folder holding an ONNX model, not a bundle: make one with onnxpipe split/build/export"),
        (repo / "resnet" / "2", NO_BUNDLE),
        (repo / "resnet" / "config.pbtxt", "Triton's model configuration, not read: a bundle carries its own settings"),
        (repo / "resnet" / "labels.txt", "not a version folder (Triton's layout: NAME/VERSION/model.onnxpipe, VERSION a number)"),
    ]


def test_a_model_folder_whose_versions_hold_no_bundle_says_why_for_each_version(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _bundle(repo / "pair")
    _file(repo / "triton" / "1" / "model.onnx")  # a Triton repository copied in as it is
    found = model_sources(repository=repo)
    assert [s.name for s in found] == ["pair"]
    assert found.skipped == [(repo / "triton" / "1", "a version folder holding an ONNX model, not a bundle: make one with onnxpipe split/build/export")]


def test_a_damaged_archive_is_taken_by_its_name_to_fail_as_it_loads(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    broken = _file(repo / "broken.onnxpipe", "PK half an archive")
    assert list(model_sources(repository=repo)) == [ModelSource("broken", broken)]
    assert list(model_sources([broken])) == [ModelSource("broken", broken)]
    assert list(model_sources([f"b={broken}"])) == [ModelSource("b", broken)]


def test_a_path_given_that_is_no_bundle_says_what_it_is(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^'{re.escape(str(tmp_path / 'm.onnx'))}' is {re.escape(ONNX)}$"):
        model_sources([_file(tmp_path / "m.onnx")])
    with pytest.raises(ConfigError, match=f"^'{re.escape(str(tmp_path / 'built'))}' is {re.escape(BUILD)}$"):
        model_sources([_build(tmp_path / "built")])
    with pytest.raises(ConfigError, match=f"is {re.escape(STRAY)}$"):
        model_sources([f"x={_file(tmp_path / 'notes.txt')}"])
    _bundle(tmp_path / "bundles" / "pair")
    with pytest.raises(ConfigError, match=r"is not a bundle: a folder of bundles \(a model repository: serve it with --model-repository\)$"):
        model_sources([tmp_path / "bundles"])
    _file(tmp_path / "resnet" / "2" / "model.onnxpipe")
    given = model_sources([tmp_path / "resnet"])  # a model folder in Triton's layout, given by itself
    assert list(given) == [ModelSource("resnet", tmp_path / "resnet" / "2" / "model.onnxpipe", ("2",))] and given.skipped == []


def test_a_repository_with_no_model_lists_what_it_holds(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _file(repo / "model.onnx")
    _build(repo / "built")
    listed = r" .*: 'built' is a build folder: .*; 'model.onnx' is an ONNX model"
    with pytest.raises(ConfigError, match=re.escape(f"model repository '{repo}' holds no bundle") + listed):
        model_sources(repository=repo)
    for k in range(7):
        _file(repo / f"notes{k}.txt")
    with pytest.raises(ConfigError, match=r"'notes2.txt' is not a bundle \(.*\); and 4 more$"):
        model_sources(repository=repo)


# -- a real server over a repository of real bundles ------------------------------------------------------------------------


@pytest.fixture
def repository(bundles: dict[str, Path], tmp_path: Path) -> Path:
    """A good bundle folder, a truncated archive, a model in Triton's layout (version 1 squeezenet's
    archive, version 3 another model's folder: one whose outputs follow its input), a build folder,
    a raw .onnx, a text file and a hidden file."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(bundles["twoout"], repo / "pair")
    whole = bundles["squeeze"].read_bytes()
    (repo / "broken.onnxpipe").write_bytes(whole[: len(whole) // 2])
    (repo / "resnet" / "1").mkdir(parents=True)
    shutil.copy(bundles["squeeze"], repo / "resnet" / "1" / "model.onnxpipe")
    shutil.copytree(bundles["twoout"], repo / "resnet" / "3")
    shutil.copytree(bundles["squeeze"].parent / "squeeze-built", repo / "built")
    shutil.copy(models.light_model_path("squeezenet"), repo / "squeezenet.onnx")
    (repo / "notes.txt").write_text("not a bundle")
    (repo / ".notes.txt.swp").write_text("an editor's")
    return repo


def _skipped_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("onnxpipe serve: skipped ")]


def _assert_skipped(log: str, repo: Path) -> None:
    assert _skipped_lines(log) == [
        f"onnxpipe serve: skipped {repo / 'built'}: {BUILD}",
        f"onnxpipe serve: skipped {repo / 'notes.txt'}: {STRAY}",
        f"onnxpipe serve: skipped {repo / 'squeezenet.onnx'}: {ONNX}",
    ], log
    assert ".swp" not in log


def test_a_truncated_archive_in_the_repository_stops_the_server_naming_it(repository: Path) -> None:
    http = free_ports(1)[0]
    done = subprocess.run([sys.executable, "-m", "onnxpipe.cli", "serve", "--model-repository", repository, "--http-port", str(http), "--grpc-port", "0",
                           "--metrics-port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    _assert_skipped(done.stderr, repository)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    broken = repository / "broken.onnxpipe"
    assert errors == [f"error: model 'broken' ({broken}): archive '{broken}' is damaged or truncated: it begins as a zip archive but has no zip "
                      "directory at its end; copy it again (or export it again)"], done.stderr


def test_with_allow_partial_it_serves_the_rest_and_the_triton_layout_model_answers(repository: Path, tmp_path: Path) -> None:
    broken = repository / "broken.onnxpipe"
    with ServerProcess("--model-repository", repository, "--allow-partial", grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        log = proc.log()
        _assert_skipped(log, repository)
        assert f"onnxpipe serve: not serving model 'broken' ({broken}): archive '{broken}' is damaged or truncated" in log, log
        assert re.search(r"^onnxpipe serve: model 'resnet' version 3 \(of 1, 3\): 3 stage\(s\), ", log, re.M), log  # twoout's 3 stages, not squeezenet's 2
        assert re.search(r"^onnxpipe serve: model 'pair': ", log, re.M), log
        status, body = proc.get("/v2/models/broken/ready")
        assert status == 503 and f"model 'broken' is not available: it failed to load: archive '{broken}' is damaged or truncated".encode() in body, body

        client = httpclient.InferenceServerClient(proc.http)
        assert [i["name"] for i in client.get_model_metadata("resnet")["inputs"]] == ["X"]  # version 3's model, not version 1's
        x = np.array([[0.5, -1.0, 2.0, 3.5]], np.float32)
        with runtime.load(repository / "pair") as pipe:
            want = pipe({"X": x})
        for name in ("resnet", "pair"):
            tensor = httpclient.InferInput("X", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            answer = client.infer(name, [tensor])
            for output, value in want.items():
                np.testing.assert_allclose(answer.as_numpy(output), value, rtol=1e-6, err_msg=f"{name}: {output}")
        assert proc.stop() == 0, proc.log()
