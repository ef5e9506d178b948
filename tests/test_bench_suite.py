"""The benchmark suite runs end to end and writes its three artifacts (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_suite_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--models", "squeezenet", "--requests", "8", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["models"][0]["req_s"]
    assert {"1 session x 1t", "hand split, 2 stages"} <= set(rows) and any(k.startswith("planner (") for k in rows)
    assert all(v > 0 for v in rows.values())
    assert "| how | req/s | vs 1 session x 1 thread |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
