"""benchmarks._checkout: the sides of ``--against`` and how their rounds are compared (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._checkout import NEW, ROOT, Side, checkout, compare


def test_rounds_are_paired_in_order_and_figures_below_zero_stay_out_of_the_ratio() -> None:
    rows = compare({"per hop us": {"v1": [10.0, 20.0, 30.0], NEW: [5.0, 30.0, 30.0]},
                    "fixed us": {"v1": [-1.0, 4.0, None], NEW: [2.0, 2.0, 3.0]}})
    hop = rows["per hop us"]
    assert hop["old"] == "v1"
    assert hop["v1"] == {"median": 20.0, "min": 10.0, "max": 30.0} and hop[NEW] == {"median": 30.0, "min": 5.0, "max": 30.0}
    assert hop["new_over_old"] == {"median": 1.0, "min": 0.5, "max": 1.5}  # 5/10, 30/20, 30/30: by round, not medians
    assert rows["fixed us"]["new_over_old"] == {"median": 0.5, "min": 0.5, "max": 0.5}  # only the round where both are > 0
    assert rows["fixed us"]["v1"] == {"median": 1.5, "min": -1.0, "max": 4.0}


def test_each_side_imports_its_own_onnxpipe_and_this_checkouts_benchmarks(tmp_path: Path) -> None:
    side = Side("old side", ROOT, tmp_path)
    assert (side.overlay / "onnxpipe").resolve() == (ROOT / "onnxpipe").resolve()
    out = subprocess.run([sys.executable, "-P", "-c", "import benchmarks, onnxpipe; print(benchmarks.__file__); print(onnxpipe.__file__)"],
                         env=side.env, capture_output=True, text=True, check=True).stdout.split()
    assert Path(out[0]).parent == ROOT / "benchmarks" and Path(out[1]).parent == side.overlay / "onnxpipe"


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_a_checkout_is_a_worktree_removed_after() -> None:
    with checkout("HEAD") as where:
        assert (where / "onnxpipe" / "__init__.py").is_file()
    assert not where.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True).stdout
    assert str(where) not in listed


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_an_unknown_revision_is_refused() -> None:
    with pytest.raises(subprocess.CalledProcessError), checkout("no-such-revision-here"):
        pass
