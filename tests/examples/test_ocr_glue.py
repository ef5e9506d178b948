"""The OCR glue of onnxpipe_examples.ocr, chained with plain onnxruntime sessions, reads images as the
rapidocr_onnxruntime wheel's own RapidOCR does: same texts, same boxes (within 1 pixel), same scores
(within 1e-4), same angle decisions.

Images are rendered at test time (Pillow's built-in font), so nothing is downloaded or stored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("rapidocr_onnxruntime", reason="the examples package: pip install -e examples")

from onnxpipe_examples import ocr

BOX_PIXELS = 1.0  # same models, same code; only the sessions' thread counts differ from the wheel's
SCORE_TOL = 1e-4


@pytest.fixture(scope="module")
def wheel() -> Any:
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR()


@pytest.fixture(scope="module")
def glue() -> ocr.SequentialOcr:
    return ocr.SequentialOcr(threads=1)


def assert_reads_alike(ours: dict[str, np.ndarray], theirs: Any, box_pixels: float, score_tol: float) -> None:
    """``ours`` (decode's outputs) against RapidOCR's ``(result, elapsed)``."""
    result = theirs[0] or []
    assert list(ours["texts"]) == [r[1] for r in result]
    assert ours["boxes"].shape == (len(result), 4, 2)
    if result:
        np.testing.assert_allclose(ours["boxes"], np.array([r[0] for r in result], dtype=np.float32), rtol=0, atol=box_pixels)
        np.testing.assert_allclose(ours["scores"], [r[2] for r in result], rtol=0, atol=score_tol)


@pytest.mark.slow
def test_lines_and_an_upside_down_one(wheel: Any, glue: ocr.SequentialOcr) -> None:
    image = ocr.render_lines(["Hello onnxpipe", "upside down 42", "CTC 0.97"], upside_down=[1])
    ours = glue(image)
    assert_reads_alike(ours, wheel(image), BOX_PIXELS, SCORE_TOL)
    assert [t.replace(" ", "") for t in ours["texts"]] == ["Helloonnxpipe", "upsidedown42", "CTC0.97"]
    assert list(ours["angles"]) == [0, 180, 0]  # the classifier turned the middle line


@pytest.mark.slow
def test_short_strip_is_letterboxed(wheel: Any, glue: ocr.SequentialOcr) -> None:
    image = ocr.render_lines(["letterbox 7"], size=(130, 30), font_size=20)  # height <= min_height (30)
    pre = ocr.preprocess({"image": image}, ocr.PREPROCESS_PARAMS)
    assert pre["transform"][2] > 0  # padded top and bottom
    ours = glue(image)
    assert_reads_alike(ours, wheel(image), BOX_PIXELS, SCORE_TOL)
    assert len(ours["texts"]) == 1


def test_image_without_text_gives_empty_results(wheel: Any, glue: ocr.SequentialOcr) -> None:
    image = np.full((64, 96, 3), 255, dtype=np.uint8)
    ours = glue(image)
    assert wheel(image) == (None, None)
    assert ours["texts"].shape == (0,) and ours["boxes"].shape == (0, 4, 2) and ours["scores"].shape == (0,)


def test_dictionary_comes_from_the_rec_model_metadata() -> None:
    chars = ocr.characters()
    assert chars[0] == "blank" and chars[-1] == " "
    assert len(chars) == 6625  # the rec model's last output dim: one probability per entry
    assert {"A", "z", "0", "."} <= set(chars)
