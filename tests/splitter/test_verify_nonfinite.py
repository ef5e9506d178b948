"""verify cannot pass on NaN (issue 39, item 1): an output the whole model gives non-finite values
for fails (the check proves nothing) unless allowed; NaN or inf on one side only fails, naming the
tensor; no numpy warning comes out of the comparison."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe.splitter import split, verify
from tests import models
from tests.stateful_models import recurrent

#: T5's pattern (Note: non-finite values prove nothing): a mask of 3 overflows to +inf, the softmax gives NaN.
OVERFLOWING = {"hidden": np.zeros((1, 4), np.float32), "encoder_attention_mask": np.array([[3, 2, 1, 0]], np.int64)}
MASK_OF_ONES = {"hidden": np.arange(4, dtype=np.float32).reshape(1, 4), "encoder_attention_mask": np.ones((1, 4), np.int64)}


@pytest.fixture(autouse=True)
def _no_numpy_warnings() -> None:
    warnings.simplefilter("error", RuntimeWarning)  # pytest restores the filters after each test


def test_a_model_whose_output_is_nan_does_not_pass() -> None:
    model = models.nan_output()
    report = verify(split(model, ["b"]), model, samples=2)
    assert not report.ok
    (row,) = report.unproven
    assert (row.tensor, row.kind, row.nonfinite) == ("Y", "output", "4 of 4 values NaN")
    assert row.problem == "the whole model's output is not finite on the random inputs (4 of 4 values NaN): the check proves nothing"
    assert report.to_dict()["tensors"][0]["unproven"] is True


def test_t5s_overflowing_mask_gives_nan_logits_that_verify_refuses() -> None:
    model = models.overflowing_mask()
    plan = split(model, ["scores"])
    report = verify(plan, model, inputs=[OVERFLOWING])
    assert not report.ok and [r.tensor for r in report.unproven] == ["logits"]
    assert "on the given inputs (4 of 4 values NaN)" in report.unproven[0].problem
    # the boundary holds +inf on both sides: said, not failed (the outputs are what must be finite)
    scores = next(r for r in report.rows if r.tensor == "scores")
    assert scores.ok and scores.nonfinite == "1 of 4 values inf"
    assert "boundary 'scores' is not finite in the whole model (1 of 4 values inf), and the same in the split" in report.notes
    assert verify(plan, model, inputs=[MASK_OF_ONES]).ok  # a mask of ones: finite logits, a check that proves something


def test_allow_nonfinite_accepts_the_same_nan_on_both_sides() -> None:
    model = models.overflowing_mask()
    report = verify(split(model, ["scores"]), model, inputs=[OVERFLOWING], allow_nonfinite=True)
    assert report.ok and not report.unproven
    assert "output 'logits' is not finite in the whole model (4 of 4 values NaN), and the same in the split: allowed (allow_nonfinite)" in report.notes


def _log_of_negative() -> onnx.ModelProto:
    """A stage 1 of ``chain`` cut at ``a`` and ``c`` that gives NaN where the whole model does not."""
    return onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 17]>
        wrong (float[1,4] a) => (float[1,4] c) <float[1] one = {1.0}> {
            b = Add(a, one)
            nb = Neg(b)
            c = Log(nb)
        }"""
    )


@pytest.mark.parametrize("allow", [False, True])
def test_nan_on_one_side_fails_naming_the_tensor(allow: bool, tmp_path: Path) -> None:
    model = models.chain()
    folder = split(model, ["a", "c"]).save(tmp_path / "split")
    onnx.save(_log_of_negative(), folder / "stage1.onnx")
    report = verify(folder, model, allow_nonfinite=allow)
    assert not report.ok and not report.unproven
    failed = {r.tensor: r.problem for r in report.rows if not r.ok}
    assert failed == {t: "not finite on one side: the split has 4 NaN where the whole model has other values" for t in ("c", "Y")}


def test_the_corpus_t5_decoder_with_a_mask_of_2s_and_3s_gives_nan_logits_that_verify_refuses() -> None:
    """optimum's T5 decoder (tests/data/corpus): ``(1 - mask) * finfo.min`` overflows for a mask of
    2s and 3s (what sample inputs once drew), and every logit is NaN on both sides of any cut."""
    path = Path(__file__).parents[1] / "data" / "corpus" / "t5" / "decoder_model.onnx"
    plan = split(path, ["/decoder/block.1/layer.0/layer_norm/Cast_output_0"])
    feeds = {"encoder_attention_mask": np.array([[2, 3, 1, 0, 2]], np.int64), "input_ids": np.array([[0, 5, 7]], np.int64),
             "encoder_hidden_states": np.random.default_rng(0).standard_normal((1, 5, 32)).astype(np.float32)}
    report = verify(plan, path, inputs=[feeds])
    assert not report.ok
    assert {r.tensor: r.nonfinite for r in report.unproven}["logits"] == "384 of 384 values NaN"
    assert verify(plan, path, inputs=[feeds | {"encoder_attention_mask": np.ones((1, 5), np.int64)}]).ok


def test_a_stream_whose_step_gives_nan_does_not_pass() -> None:
    """A split with state runs streams (Note: verifying a split with state): an input of inf at
    step 1 makes the recurrent model's output NaN there, on both sides."""
    model = recurrent()
    plan = split(model, ["state1N"], states={"state1N": "state1", "state2N": "state2"})
    ones = {"x": np.ones((1, 4), np.float32)}
    report = verify(plan, model, inputs=[ones, {"x": np.full((1, 4), np.inf, np.float32)}, ones])
    assert not report.ok and report.steps == 3
    assert [(r.tensor, r.problem) for r in report.unproven] == [
        ("y", "the whole model's output is not finite on the stream's steps (4 of 4 values NaN): the check proves nothing")]
    assert verify(plan, model, inputs=[ones, ones]).ok
