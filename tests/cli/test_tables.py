"""Tables never break a name or drop a column: natural width off a terminal, folded rows on a narrow one."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from rich.console import Console

from tests.cli.helpers import run
from tests.models import LONG_NAMES, long_names


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "long.onnx"
    onnx.save(long_names(), path)
    return path


def _candidate_rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(r"^│ \d+ │", line)]


@pytest.mark.parametrize("columns", ["80", "40"])
def test_off_a_terminal_tables_take_their_natural_width(model: Path, columns: str) -> None:
    # A CI log or `make demo > log`: COLUMNS says 80 (or less), yet no name is wrapped and --at stays a column.
    result = run("inspect", model, "--top", "3", env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "position" in line)
    assert "--at" in header
    rows = _candidate_rows(result.output)
    assert len(rows) == 3
    for row in rows:
        assert any(name in row for name in LONG_NAMES), row  # the whole name, on its row


def test_on_a_narrow_terminal_rows_fold_and_names_stay_whole(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxpipe.cli._render as render

    monkeypatch.setattr(render, "_console", lambda: Console(highlight=False, force_terminal=True, color_system=None, width=60))
    result = run("inspect", model, "--top", "2")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    ats = [line.strip().removeprefix("--at: ") for line in lines if line.strip().startswith("--at: ")]
    assert len(ats) == 2 and all(at in LONG_NAMES for at in ats), result.output
    assert "- #: 1" in lines and "    position: 1/7" in lines
    # Tables that fit stay tables.
    assert any(line.startswith("┏") for line in lines)
