"""The OCR notebook (tutorials/ocr.ipynb): stored clean, and run from a fresh kernel it shows what its
text claims (the bundle reads like the wheel, a stream through every stage, a per-stage timeline).

The notebook writes ``ocr-out/summary.json`` and two figures into its working folder; the tests below
check those and the executed cells' outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.notebooks import assert_stored_clean, execute

pytest.importorskip("rapidocr_onnxruntime", reason="the examples package: pip install -e examples")

NOTEBOOK = Path(__file__).resolve().parents[2] / "tutorials" / "ocr.ipynb"
CELL_TIMEOUT = 120  # seconds per cell; the whole notebook takes ~30 s on 2 cores
STAGES = ["preprocess", "det_0", "det_1", "boxes", "cls", "rotate", "rec", "decode"]


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], Path]:
    """The notebook run once from a clean kernel in a temporary folder: (notebook, summary, folder)."""
    return execute(NOTEBOOK, tmp_path_factory, "ocr-out", CELL_TIMEOUT)


def test_stored_notebook_is_clean() -> None:
    assert_stored_clean(NOTEBOOK)


@pytest.mark.slow
def test_notebook_reads_like_the_wheel_and_draws_the_timeline(executed: tuple[Any, dict[str, Any], Path]) -> None:
    nb, summary, folder = executed
    assert Path(summary["prefix"]).resolve() == Path(sys.prefix).resolve()
    assert summary["stages"] == STAGES
    assert len(summary["code_stages"]) == 4
    read = summary["read"]
    assert read["same_as_wheel"] is True and read["box_diff_px"] <= 2.0
    assert read["angles"] == [0, 180, 0]
    stream = summary["stream"]
    assert (stream["images"], stream["failed"]) == (6, 0) and min(stream["boxes"]) >= 1
    assert sorted(summary["trace"]["workers"]) == sorted(STAGES)
    assert summary["trace"]["runs"] == 6 * len(STAGES)  # every image through every stage
    for name, size in summary["figures"].items():
        data = (folder / "ocr-out" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) == size > 1000, name
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(shown) == 2, "the input image and the timeline are displayed"
    assert not Path(summary["work"]).exists()
