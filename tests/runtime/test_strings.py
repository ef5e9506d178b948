"""String tensors (numpy ``object`` arrays of ``str``, as onnxruntime returns them) in reference
data and .npz files, stored without pickle; numpy's own ``<U`` arrays accepted as string inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from onnxpipe import BundleError, InputError
from onnxpipe.builder import build, export
from onnxpipe.runtime import load, load_npz, npz_layout, read_bundle, save_npz
from tests import code_stages
from tests.cli.helpers import ok

ALLOW = ["tests.code_stages:*"]


def _requests() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((3, 4)).astype(np.float32), "prefix": np.array(["café", "日本語", ""], dtype=object)},
            {"x": rng.standard_normal((1, 4)).astype(np.float32), "prefix": np.array(["a" * 300], dtype=object)}]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """code_stages.labelled() exported with 2 reference samples computed by the pipeline itself."""
    folder = tmp_path_factory.mktemp("labelled")
    built = build(code_stages.labelled(), folder / "built")
    return export(built.path, folder / "bundle", reference_inputs=_requests(), allow_code=ALLOW)


def test_a_pipeline_with_a_string_output_stores_its_reference_and_checks_it(labelled: Path) -> None:
    bundle = read_bundle(labelled, allow_code=ALLOW)
    (inputs, outputs), (_, second) = bundle.reference()
    assert outputs["label"].dtype == object and all(type(v) is str for v in outputs["label"])
    assert [v.split(":")[0] for v in outputs["label"]] == ["café", "日本語", ""]
    assert inputs["prefix"].dtype == object and list(inputs["prefix"]) == ["café", "日本語", ""]
    assert second["label"][0].startswith("a" * 300 + ":")
    with load(labelled, allow_code=ALLOW) as pipe:
        rows = pipe.check()
        fresh = pipe(_requests()[0])
    assert {r.output for r in rows} == {"label", "score"} and all(r.ok for r in rows)
    np.testing.assert_array_equal(fresh["label"], outputs["label"])


def test_a_changed_string_fails_the_check(labelled: Path, tmp_path: Path) -> None:
    # The same bundle with one stored label changed (and the manifest's hash of it updated): the
    # check compares strings exactly.
    folder = tmp_path / "bundle"
    import shutil

    from onnxpipe.runtime.bundle import MANIFEST_NAME, sha256_file

    shutil.copytree(labelled, folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    out = manifest["reference"][0]["outputs"]
    stored = load_npz(folder / out)
    stored["label"] = stored["label"].copy()
    stored["label"][1] = "changed"
    save_npz(folder / out, stored)
    manifest["files"][out]["sha256"] = sha256_file(folder / out)
    manifest["files"][out]["size"] = (folder / out).stat().st_size
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with load(folder, allow_code=ALLOW) as pipe:
        rows = {(r.sample, r.output): r for r in pipe.check()}
    assert not rows[(0, "label")].ok and rows[(0, "label")].max_abs == float("inf")
    assert rows[(0, "score")].ok and rows[(1, "label")].ok


def test_string_arrays_round_trip_an_npz_without_pickle(tmp_path: Path) -> None:
    arrays = {"text": np.array([["ab", "日本"], ["", "x" * 50]], dtype=object), "empty": np.array([], dtype=object).reshape(0, 2),
              "n": np.arange(3, dtype=np.int64)}
    path = save_npz(tmp_path / "a.npz", arrays)
    with np.load(path, allow_pickle=False) as raw:  # plain numpy reads it: no pickle anywhere
        assert raw["text"].dtype.kind == "U"
    back = load_npz(path)
    assert back["text"].dtype == object and back["text"].tolist() == arrays["text"].tolist() and all(type(v) is str for v in back["text"].ravel())
    assert back["empty"].dtype == object and back["empty"].shape == (0, 2)
    np.testing.assert_array_equal(back["n"], arrays["n"])
    assert npz_layout(path)["text"].shape == (2, 2)


def test_objects_other_than_str_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"^array 'bad' holds a bytes; of Python objects only str \(a string tensor\) can be saved, without pickle"):
        save_npz(tmp_path / "a.npz", {"ok": np.ones(2), "bad": np.array(["a", b"b"], dtype=object)})
    assert not list(tmp_path.iterdir())


def test_numpy_str_arrays_are_taken_as_string_inputs_and_other_dtypes_refused(labelled: Path) -> None:
    request = _requests()[0]
    with load(labelled, allow_code=ALLOW) as pipe:
        want = pipe(request)["label"]
        got = pipe({**request, "prefix": np.array(["café", "日本語", ""])})["label"]  # dtype <U3
        np.testing.assert_array_equal(got, want)
        refused = r"input 'prefix' has dtype \|S1; expected string \(a numpy object array of str, np\.array\(\[\.\.\.\], dtype=object\), or numpy's own str"
        with pytest.raises(InputError, match=refused):
            pipe({**request, "prefix": np.array([b"a", b"b", b"c"])})


def test_cli_run_writes_string_outputs(labelled: Path, tmp_path: Path) -> None:
    request = tmp_path / "in.npz"
    np.savez(request, x=_requests()[0]["x"], prefix=np.array(["café", "日本語", ""]))  # what a user writes: numpy's own str array
    ok("run", labelled, "--inputs", request, "--outputs", tmp_path / "out.npz", "--allow-code", "tests.code_stages:*")
    out = load_npz(tmp_path / "out.npz")
    with load(labelled, allow_code=ALLOW) as pipe:
        np.testing.assert_array_equal(out["label"], pipe(_requests()[0])["label"])
