"""The PP-OCR chain as ONE onnxpipe bundle (4 code stages, det split in 2 by the splitter, cls, rec),
run on the thread engine, reads rendered images as the rapidocr_onnxruntime wheel's own RapidOCR does.

Tolerances: texts equal; boxes within 2 pixels and scores within 1e-3 of RapidOCR's. The bundle's
modules are offline-optimized and the detector runs as two sessions, so float sums differ from the
wheel's in the last bits; a pixel on the DB threshold may flip, moving a box corner by one pixel
(measured: every corner equal on these images).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("rapidocr_onnxruntime", reason="the examples package: pip install -e examples")

from onnxpipe_examples import ocr
from onnxpipe_examples.ocr_pipeline import ALLOW_CODE, DET_CUT, build_ocr_bundle, pipeline_file, split_detector

from onnxpipe import BundleError
from onnxpipe.builder import build, export
from onnxpipe.runtime import Pipeline, load
from onnxpipe.splitter import read_pipeline_file, verify
from tests.examples.test_ocr_glue import assert_reads_alike

BOX_PIXELS = 2.0
SCORE_TOL = 1e-3
IMAGES = [
    (["Hello onnxpipe", "upside down 42", "CTC 0.97"], [1]),
    (["invoice 2026-12", "total 42.50 EUR"], []),
    (["one bundle"], [0]),
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    det = split_detector()
    # The split detector on a real preprocessed image: chained stages == the whole model.
    pre = ocr.preprocess({"image": ocr.render_lines(*IMAGES[0][:1])}, ocr.PREPROCESS_PARAMS)
    report = verify(det, ocr.model_paths()["det"], inputs=[{"x": pre["det_input"]}])
    assert report.ok, report
    assert len(det.stages) == 2
    return build_ocr_bundle(tmp_path_factory.mktemp("ocr") / "ocr.onnxpipe", det)


@pytest.fixture(scope="module")
def pipe(bundle: Path) -> Iterator[Pipeline]:
    with load(bundle, allow_code=ALLOW_CODE) as p:
        yield p


@pytest.fixture(scope="module")
def wheel() -> Any:
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR()


def test_bundle_stages(pipe: Pipeline) -> None:
    stages = [(s.name, s.code.entry if s.code else None) for s in pipe.spec.stages]
    assert stages == [
        ("preprocess", "onnxpipe_examples.ocr:preprocess"),
        ("det_0", None),
        ("det_1", None),
        ("boxes", "onnxpipe_examples.ocr:boxes"),
        ("cls", None),
        ("rotate", "onnxpipe_examples.ocr:rotate"),
        ("rec", None),
        ("decode", "onnxpipe_examples.ocr:decode"),
    ]


@pytest.mark.slow
def test_reads_like_the_wheel_with_requests_in_flight(pipe: Pipeline, wheel: Any) -> None:
    images = [ocr.render_lines(lines, upside_down=turned) for lines, turned in IMAGES]
    results = list(pipe.map({"image": img} for img in images))  # all in flight at once, results in order
    for image, ours, (lines, turned) in zip(images, results, IMAGES, strict=True):
        assert_reads_alike(ours, wheel(image), BOX_PIXELS, SCORE_TOL)
        assert [t.replace(" ", "") for t in ours["texts"]] == [t.replace(" ", "") for t in lines]
        assert [k for k, a in enumerate(ours["angles"]) if a == 180] == turned
    stats = pipe.stats()
    assert stats.failed == 0 and {s.stage for s in stats.stages if s.count >= len(IMAGES)} == {s.name for s in pipe.spec.stages}


def test_no_text_then_text(pipe: Pipeline) -> None:
    # A request whose box count is 0 flows through every stage (N varies per request), and the next one reads.
    empty = pipe({"image": np.full((64, 96, 3), 255, dtype=np.uint8)})
    assert empty["texts"].shape == (0,) and empty["boxes"].shape == (0, 4, 2)
    texts = pipe({"image": ocr.render_lines(["one bundle"], size=(240, 160))})["texts"]
    assert "".join(texts).replace(" ", "") == "onebundle"


def test_code_must_be_allowed(bundle: Path) -> None:
    with pytest.raises(BundleError, match=r"onnxpipe_examples\.ocr:preprocess.*onnxpipe_examples\.ocr:decode"):
        load(bundle)


@pytest.mark.slow
def test_pipeline_file_builds_the_same_chain(tmp_path: Path, pipe: Pipeline, wheel: Any) -> None:
    config = read_pipeline_file(pipeline_file(tmp_path / "ocr.toml"))
    spec = config.to_spec()
    assert [(s.name, s.code.entry if s.code else None) for s in spec.stages] == [(s.name, s.code.entry if s.code else None) for s in pipe.spec.stages]
    assert [s.code.params for s in spec.stages if s.code] == [s.code.params for s in pipe.spec.stages if s.code]
    assert [t.name for t in spec.stages[2].inputs] == DET_CUT  # split in place at the named cut
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "ocr.onnxpipe")
    image = ocr.render_lines(*IMAGES[1][:1])
    with load(bundle, allow_code=ALLOW_CODE) as from_file:
        ours = from_file({"image": image})
    assert_reads_alike(ours, wheel(image), BOX_PIXELS, SCORE_TOL)
