"""A model repository says what it does not serve: every entry not taken is one line at start with
why (a raw .onnx, a build folder, a stray file, a folder with nothing servable, a name clients
cannot use, a link to a bundle folder, two entries of one name); what it lists, the loader
accepts, so no odd entry stops the server; a damaged archive is a load failure naming it (exit
1, or not served with --allow-partial); Triton's ``NAME/VERSION/`` layout is read, its highest
version served as the version it is. ``model_sources`` on small folders first (no server), then
a real server over a repository of real bundles."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

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
LINKED = ("a symbolic link to a folder, which onnxpipe does not load as a bundle (a bundle holds regular files only): "
          "put the folder itself here, or link a .onnxpipe archive of it")
BAD_NAME = "named so that clients cannot call it: a model's name is letters, digits, '_', '.' and '-', starting with a letter or digit; rename it"


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


def test_odd_entries_are_skipped_with_why_and_the_rest_is_served(tmp_path: Path) -> None:
    """Issue 36 item 10: a link to a bundle folder (which the loader refuses), names clients cannot
    use, two entries of one name and a dangling link are each skipped with why, not an error for
    the whole repository; links the loader follows (to an archive, to a model folder) are served."""
    elsewhere = tmp_path / "elsewhere"
    _bundle(elsewhere / "pair")
    _file(elsewhere / "squeeze.onnxpipe")
    _bundle(elsewhere / "resnet" / "1")
    repo = tmp_path / "repo"
    _bundle(repo / "good")
    _bundle(repo / "folder.onnxpipe")  # a bundle folder named as an archive: named without the suffix
    (repo / "linked").symlink_to(elsewhere / "pair")  # a bundle folder through a link: the loader refuses it
    (repo / "squeeze.onnxpipe").symlink_to(elsewhere / "squeeze.onnxpipe")  # an archive through a link: read
    (repo / "resnet").symlink_to(elsewhere / "resnet")  # a model folder through a link: its bundle is no link, read
    (repo / "gone").symlink_to(tmp_path / "nothing")
    _bundle(repo / "modèle")
    _bundle(repo / "bad name")
    _file(repo / "bad name.onnxpipe")
    _bundle(repo / "twin")
    _file(repo / "twin.onnxpipe")
    _bundle(repo / "ocr" / "1")
    (repo / "ocr" / "2").symlink_to(elsewhere / "pair")  # a version folder that links to a bundle folder
    _bundle(elsewhere / "det")
    (repo / "det" / "3").mkdir(parents=True)
    (repo / "det" / "3" / "model.onnxpipe").symlink_to(elsewhere / "det")  # a version's model.onnxpipe linking to a folder
    found = model_sources(repository=repo)
    assert list(found) == [
        ModelSource("folder", repo / "folder.onnxpipe"),
        ModelSource("good", repo / "good"),
        ModelSource("ocr", repo / "ocr" / "1", ("1",)),
        ModelSource("resnet", repo / "resnet" / "1", ("1",)),
        ModelSource("squeeze", repo / "squeeze.onnxpipe"),
    ]
    assert found.skipped == [
        (repo / "bad name", BAD_NAME),
        (repo / "bad name.onnxpipe", BAD_NAME),
        (repo / "det" / "3", f"a version folder whose model.onnxpipe is {LINKED}"),
        (repo / "gone", f"a symbolic link to nothing ('{tmp_path / 'nothing'}' does not exist)"),
        (repo / "linked", LINKED),
        (repo / "modèle", BAD_NAME),
        (repo / "ocr" / "2", LINKED),
        (repo / "twin", "one of 2 entries that would be model 'twin' (also 'twin.onnxpipe'): rename or remove all but one"),
        (repo / "twin.onnxpipe", "one of 2 entries that would be model 'twin' (also 'twin'): rename or remove all but one"),
    ]
    # What is listed, the loader takes as a bundle path: no link to a folder among them.
    assert not any(s.path.is_symlink() and s.path.is_dir() for s in found)


def test_a_bundle_given_by_its_path_is_the_users_choice_a_bad_name_or_a_linked_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model name 'modèle' \(from '.*modèle'\) cannot be used in URLs: a name is letters, digits"):
        model_sources([_bundle(tmp_path / "modèle")])
    with pytest.raises(ConfigError, match=r"^model name 'bad name' \(from 'bad name=.*'\) cannot be used in URLs"):
        model_sources([f"bad name={_bundle(tmp_path / 'pair')}"])
    (tmp_path / "linked").symlink_to(tmp_path / "pair")
    with pytest.raises(ConfigError, match=f"^'{re.escape(str(tmp_path / 'linked'))}' is {re.escape(LINKED)}$"):
        model_sources([tmp_path / "linked"])
    repo = _bundle(tmp_path / "repo" / "pair").parent
    with pytest.raises(ConfigError, match=r"^two models are named 'pair': .* name one with NAME=PATH$"):  # a bundle given and one of the repository
        model_sources([tmp_path / "pair"], repository=repo)


def test_versions_are_numbers_as_triton_reads_them(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _file(repo / "resnet" / "007" / "model.onnxpipe")
    _file(repo / "resnet" / "3" / "model.onnxpipe")
    found = model_sources(repository=repo)
    assert list(found) == [ModelSource("resnet", repo / "resnet" / "007" / "model.onnxpipe", ("3", "7"))] and found.skipped == []


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


# -- odd entries and versions, on a real server (issue 36 items 10 and 19) ----------------------------------------------------


@pytest.fixture(scope="module")
def odd_repository(bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    """A server over a repository of good bundles (``pair``; ``sq.onnxpipe``, a link to squeezenet's
    archive; ``resnet/2/model.onnxpipe`` in Triton's layout, version 2 only) and odd entries: a link
    to a bundle folder, a folder named ``modèle``, one named ``bad name`` (all real bundles), and
    two entries of the name ``twin``. Started without --allow-partial: an odd entry must not stop it."""
    root = tmp_path_factory.mktemp("odd")
    shutil.copytree(bundles["twoout"], root / "elsewhere")
    repo = root / "repo"
    repo.mkdir()
    shutil.copytree(bundles["twoout"], repo / "pair")
    (repo / "sq.onnxpipe").symlink_to(bundles["squeeze"])
    (repo / "linked").symlink_to(root / "elsewhere")
    shutil.copytree(bundles["twoout"], repo / "modèle")
    shutil.copytree(bundles["twoout"], repo / "bad name")
    shutil.copytree(bundles["twoout"], repo / "twin")
    shutil.copy(bundles["squeeze"], repo / "twin.onnxpipe")
    shutil.copytree(bundles["twoout"], repo / "resnet" / "2" / "model.onnxpipe")
    proc = ServerProcess("--model-repository", repo)
    with proc:
        proc.start(root / "serve.log")
        yield repo, proc
        assert proc.stop() == 0, proc.log()


def test_odd_entries_of_a_real_repository_are_skipped_and_every_model_listed_loads(odd_repository: tuple[Path, ServerProcess]) -> None:
    repo, proc = odd_repository
    log = proc.log()
    twin = "one of 2 entries that would be model 'twin' (also {}): rename or remove all but one"
    assert _skipped_lines(log) == [
        f"onnxpipe serve: skipped {repo / 'bad name'}: {BAD_NAME}",
        f"onnxpipe serve: skipped {repo / 'linked'}: {LINKED}",
        f"onnxpipe serve: skipped {repo / 'modèle'}: {BAD_NAME}",
        f"onnxpipe serve: skipped {repo / 'twin'}: {twin.format(repr('twin.onnxpipe'))}",
        f"onnxpipe serve: skipped {repo / 'twin.onnxpipe'}: {twin.format(repr('twin'))}",
    ], log
    stats = json.loads(proc.get("/v2/models/stats")[1])
    assert sorted(s["name"] for s in stats["model_stats"]) == ["pair", "resnet", "sq"]
    assert "not serving" not in log and "verified against 1 reference sample(s)" in log, log  # sq, squeezenet's archive through a link, loaded


def _infer_body(version: str | None = None) -> bytes:
    body: dict[str, object] = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [0.5, -1.0, 2.0, 3.5]}]}
    return json.dumps(body | ({"model_version": version} if version is not None else {})).encode()


def test_a_version_is_served_as_the_number_found_on_both_protocols(odd_repository: tuple[Path, ServerProcess]) -> None:
    """Issue 36 item 19: ``resnet/2/model.onnxpipe`` is version 2 (metadata, ready, config, stats,
    infer, metrics; gRPC's ModelReady, ModelMetadata, ModelInfer), version 1 an unknown version
    (404, NOT_FOUND); a bundle of its own stays version 1."""
    _, proc = odd_repository
    no_1 = b'{"error":"model \'resnet\' has no version \'1\'; versions: 2"}'
    assert json.loads(proc.get("/v2/models/resnet")[1])["versions"] == ["2"]
    assert json.loads(proc.get("/v2/models/pair")[1])["versions"] == ["1"]
    assert proc.get("/v2/models/resnet/versions/2/ready") == (200, b'{"name":"resnet","ready":true}')
    assert proc.get("/v2/models/resnet/versions/1/ready") == (404, no_1)
    assert proc.get("/v2/models/resnet/versions/1") == (404, no_1)
    assert proc.get("/v2/models/resnet/versions/2/config")[0] == 200
    status, answer = proc.request("POST", "/v2/models/resnet/versions/2/infer", _infer_body("2"))
    assert status == 200 and json.loads(answer)["model_version"] == "2", answer
    big = json.loads(_infer_body("2")) | {"id": "i" * (1 << 20)}  # 1 MiB of JSON: decoded by the JSON worker, which checks the version too
    status, answer = proc.request("POST", "/v2/models/resnet/versions/2/infer", json.dumps(big).encode())
    assert status == 200 and json.loads(answer)["model_version"] == "2", answer[:200]
    assert proc.request("POST", "/v2/models/resnet/versions/1/infer", _infer_body()) == (404, no_1)
    assert proc.request("POST", "/v2/models/resnet/infer", _infer_body("1")) == (
        400, b'{"error":"the request\'s model_version \'1\' is not the URL\'s (2); leave it out or give the same"}')
    stats = json.loads(proc.get("/v2/models/resnet/versions/2/stats")[1])["model_stats"]
    assert [(s["version"], s["inference_stats"]["success"]["count"]) for s in stats] == [("2", 2)]
    assert proc.get("/v2/models/resnet/versions/1/stats") == (404, no_1)
    metrics = proc.get("/metrics")[1].decode()
    assert re.search(r'^nv_inference_count\{model="resnet",version="2"\} 2$', metrics, re.M), metrics

    client = grpcclient.InferenceServerClient(proc.grpc)
    assert client.is_model_ready("resnet", "2") is True and client.is_model_ready("resnet") is True
    assert client.is_model_ready("resnet", "1") is False
    assert client.is_model_ready("pair", "1") is True and client.is_model_ready("pair", "2") is False
    assert client.get_model_metadata("resnet", "2").versions == ["2"]
    tensor = grpcclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.array([[0.5, -1.0, 2.0, 3.5]], np.float32))
    assert client.infer("resnet", [tensor], model_version="2").get_response().model_version == "2"
    with pytest.raises(InferenceServerException, match=r"model 'resnet' has no version '1'; versions: 2") as e:
        client.infer("resnet", [tensor], model_version="1")
    assert e.value.status() == str(grpc.StatusCode.NOT_FOUND)
    with pytest.raises(InferenceServerException, match=r"model 'resnet' has no version '1'; versions: 2"):
        client.get_model_metadata("resnet", "1")
    assert client.get_model_config("resnet", "2").config.name == "resnet"
