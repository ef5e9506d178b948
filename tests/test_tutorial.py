"""The notebook tutorial (tutorials/tutorial.ipynb): stored clean, and run from a fresh kernel it shows
what its text claims.

The notebook writes ``tutorial-out/summary.json`` and two figures into its working folder; the tests
below check those and the executed cells' outputs, not only that every cell ran.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.notebooks import assert_stored_clean, execute

NOTEBOOK = Path(__file__).resolve().parents[1] / "tutorials" / "tutorial.ipynb"
CELL_TIMEOUT = 120  # seconds per cell; the whole notebook takes ~20 s on 2 cores
THROUGHPUT_LABELS = {"pipeline 2 stages x 1 thread", "1 session 1 thread", "1 session 2 threads", "2 replicas x 1 thread"}
pytestmark = pytest.mark.xdist_group("tutorial")  # one worker: the notebook (about 15 s) is executed once


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], Path]:
    """The notebook run once from a clean kernel in a temporary folder: (notebook, summary, folder)."""
    return execute(NOTEBOOK, tmp_path_factory, "tutorial-out", CELL_TIMEOUT)


def _stdout(nb: Any, startswith: str) -> str:
    """The printed output of the code cell whose source starts with ``startswith``."""
    cells = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(startswith)]
    assert len(cells) == 1, f"expected one code cell starting with {startswith!r}, found {len(cells)}"
    return "".join(o.get("text", "") for o in cells[0].outputs if o.output_type == "stream")


def test_stored_notebook_is_clean() -> None:
    assert_stored_clean(NOTEBOOK)


@pytest.mark.slow
def test_kernel_ran_in_this_environment(executed: tuple[Any, dict[str, Any], Path]) -> None:
    _, summary, _ = executed
    assert Path(summary["prefix"]).resolve() == Path(sys.prefix).resolve()


@pytest.mark.slow
def test_splits_are_verified(executed: tuple[Any, dict[str, Any], Path]) -> None:
    nb, summary, _ = executed
    assert summary["inspect"]["compute_nodes"] == 176
    assert summary["inspect"]["candidates"] > 0
    assert summary["hand_split"] == {"stages": 3, "verify_ok": True}
    assert summary["auto_split"]["stages"] == 2
    assert summary["auto_split"]["verify_ok"] is True
    assert all(ms > 0 for ms in summary["auto_split"]["predicted_ms"])
    hand = _stdout(nb, "report = verify(hand")
    assert "verify ok: True" in hand
    assert "MISMATCH" not in hand
    assert "boundary r89" in hand and "boundary r90" in hand  # the multi-tensor cut's crossing tensors
    assert "verify ok: True" in _stdout(nb, "auto = split(MODEL")


@pytest.mark.slow
def test_bundle_serves_requests_and_swaps_params(executed: tuple[Any, dict[str, Any], Path]) -> None:
    _, summary, _ = executed
    assert summary["bundle"]["check_ok"] is True
    assert summary["bundle"]["bytes"] > 10 * 2**20  # resnet50's weights are in it
    assert summary["single_request"]["max_abs_diff"] <= 1e-5
    stream = summary["stream"]
    assert (stream["results"], stream["completed"], stream["failed"]) == (8, 8, 0)
    assert stream["bottleneck"] in {"stage0", "stage1"}
    assert summary["params"] == {"before_ok": True, "after_ok": True}


@pytest.mark.slow
def test_measurements_and_figures(executed: tuple[Any, dict[str, Any], Path]) -> None:
    nb, summary, folder = executed
    assert set(summary["throughput"]) == THROUGHPUT_LABELS
    assert all(rps > 0 for rps in summary["throughput"].values()), summary["throughput"]
    assert summary["trace"]["workers"] == ["stage0", "stage1"]
    assert summary["trace"]["runs"] >= 2 * 24  # every measured request through both stages
    for name, size in summary["figures"].items():
        data = (folder / "tutorial-out" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) == size > 1000, name
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(shown) == 2, "the timeline and the throughput chart are displayed in the notebook"


@pytest.mark.slow
def test_temporary_bundles_are_removed(executed: tuple[Any, dict[str, Any], Path]) -> None:
    _, summary, _ = executed
    assert not Path(summary["work"]).exists()


@pytest.mark.slow
def test_decoder_streams_match_one_session(executed: tuple[Any, dict[str, Any], Path]) -> None:
    """Section 8: greedy decoding of 3 interleaved streams on top of stream.step equals one session; all closed."""
    nb, summary, _ = executed
    assert summary["streams"] == {"match": True, "streams": 3, "open_after": []}
    shown = _stdout(nb, "import threading")
    assert shown.count("(one session: same)") == 3
