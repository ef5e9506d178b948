"""The CLI's side of issue 39, item 1: verify does not say "ok" when the whole model's output is NaN,
export refuses a NaN reference, and --allow-nonfinite accepts them, each in one line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import onnx
import pytest

from tests import models
from tests.cli.helpers import assert_user_error, ok, run

NOT_FINITE = ("the whole model's output(s) 'Y' (4 of 4 values NaN) are not finite on the random inputs: the check proves nothing; "
              "give --inputs, sizes (--dim) or a --seed on which they are finite, or --allow-nonfinite if the outputs hold inf or NaN by design")


@pytest.fixture
def nan_split(tmp_path: Path) -> tuple[Path, Path]:
    warnings.simplefilter("error", RuntimeWarning)  # no numpy warning out of the comparison (pytest restores the filters)
    model = tmp_path / "nan.onnx"
    onnx.save(models.nan_output(), model)
    ok("split", model, "-o", tmp_path / "split", "--at", "b")
    return model, tmp_path / "split"


def test_verify_of_a_nan_model_fails_in_one_line(nan_split: tuple[Path, Path]) -> None:
    model, folder = nan_split
    result = run("verify", folder, "--model", model)
    assert_user_error(result, NOT_FINITE)
    assert "ok: all" not in result.stdout and "FAIL: the whole model's output is not finite" in result.stdout
    as_json = run("verify", folder, "--model", model, "--json")
    assert as_json.exit_code == 1
    rows = json.loads(as_json.stdout)["tensors"]
    assert [(r["tensor"], r["ok"], r["unproven"], r["nonfinite"]) for r in rows] == [("Y", False, True, "4 of 4 values NaN"), ("b", True, False, "")]
    allowed = ok("verify", folder, "--model", model, "--allow-nonfinite")
    assert "ok: all 2 tensor(s) within tolerance" in allowed.stdout and "allowed (allow_nonfinite)" in allowed.stdout


def test_export_refuses_a_nan_reference_and_verify_bundle_fails_on_one(nan_split: tuple[Path, Path], tmp_path: Path) -> None:
    model, folder = nan_split
    ok("build", folder, "-o", tmp_path / "built")
    for by in (["--model", model], []):
        assert_user_error(run("export", tmp_path / "built", "-o", tmp_path / "b.onnxpipe", "--reference", "1", *by),
                          "reference output 'Y' of input set 0 is not finite (4 of 4 values NaN)", "--allow-nonfinite")
    assert not (tmp_path / "b.onnxpipe").exists()
    ok("export", tmp_path / "built", "-o", tmp_path / "b.onnxpipe", "--reference", "1", "--model", model, "--allow-nonfinite")
    result = run("verify", tmp_path / "b.onnxpipe")
    assert_user_error(result, "1 of 1 reference check(s) differ past rtol=0.0001 atol=1e-05: sample 0 'Y' (the stored reference is not finite "
                              "(4 of 4 values NaN): the check proves nothing)")
    assert "ok: all" not in result.stdout
    assert "ok: all 1 output(s)" in ok("verify", tmp_path / "b.onnxpipe", "--allow-nonfinite").stdout


def test_allow_nonfinite_is_for_reference_samples_only(tmp_path: Path) -> None:
    result = run("export", tmp_path / "built", "-o", tmp_path / "b", "--allow-nonfinite")
    assert result.exit_code == 2 and "--allow-nonfinite: only used for reference samples" in result.stderr
