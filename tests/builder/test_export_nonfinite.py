"""Reference data that proves nothing is refused (issue 39, item 1): export stores no NaN or inf
reference output unless allowed, and a bundle's check fails on one (Pipeline.check, the runtime's
side of 'onnxpipe verify BUNDLE'), and on NaN or inf on one side only."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from onnxpipe import InputError
from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import split
from tests import models

OVERFLOWING = {"hidden": np.zeros((1, 4), np.float32), "encoder_attention_mask": np.array([[3, 2, 1, 0]], np.int64)}
MASK_OF_ONES = {"hidden": np.zeros((1, 4), np.float32), "encoder_attention_mask": np.ones((1, 4), np.int64)}


@pytest.fixture(autouse=True)
def _no_numpy_warnings() -> None:
    warnings.simplefilter("error", RuntimeWarning)  # pytest restores the filters after each test


@pytest.fixture
def built(tmp_path: Path) -> Path:
    return build(split(models.overflowing_mask(), ["scores"]).config, tmp_path / "built").path


@pytest.mark.parametrize("by", ["model", "pipeline"])
def test_export_refuses_a_nan_reference(built: Path, by: str, tmp_path: Path) -> None:
    model = models.overflowing_mask() if by == "model" else None
    with pytest.raises(InputError, match=r"reference output 'logits' of input set 1 is not finite \(4 of 4 values NaN\): a check against it would "
                                         r"prove nothing; .*allow_nonfinite=True, --allow-nonfinite"):
        export(built, tmp_path / "b.onnxpipe", reference_inputs=[MASK_OF_ONES, OVERFLOWING], reference_model=model)
    assert not (tmp_path / "b.onnxpipe").exists()


def test_a_nan_reference_allowed_is_stored_and_checked_only_when_allowed(built: Path, tmp_path: Path) -> None:
    bundle = export(built, tmp_path / "b.onnxpipe", reference_inputs=[OVERFLOWING], reference_model=models.overflowing_mask(), allow_nonfinite=True)
    with load(bundle) as pipe:
        (row,) = pipe.check()
        assert not row.ok and row.problem == "the stored reference is not finite (4 of 4 values NaN): the check proves nothing"
        (row,) = pipe.check(allow_nonfinite=True)
        assert row.ok and not row.problem


@pytest.mark.parametrize("allow", [False, True])
def test_a_bundle_that_gives_nan_where_its_reference_is_finite_fails(built: Path, allow: bool, tmp_path: Path) -> None:
    finite = {"logits": np.zeros((1, 4), np.float32)}
    bundle = export(built, tmp_path / "b", reference_inputs=[OVERFLOWING], reference_outputs=[finite])
    with load(bundle) as pipe:
        (row,) = pipe.check(allow_nonfinite=allow)
    assert not row.ok and row.problem == "not finite on one side: the pipeline has 4 NaN where the stored reference has other values"
