"""``split --auto`` (policies and the planner) and ``inspect --profile``, driven for real on light squeezenet.

The model is copied into a temporary folder first: profiles are cached next to the model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from onnxpipe.cli import main
from onnxpipe.cli._autosplit import POLICY_NAMES
from onnxpipe.cli._common import SizeType
from onnxpipe.splitter import POLICIES
from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run
from tests.models import light_model_path


def stages_of(folder: Path) -> list[dict[str, object]]:
    return json.loads((folder / "pipeline.json").read_text())["stages"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of light squeezenet (66 compute nodes named n0..n65) in a folder of its own."""
    path = tmp_path_factory.mktemp("auto") / "squeezenet.onnx"
    shutil.copy(light_model_path("squeezenet"), path)
    return path


# -- split --auto --stages / --max-stages ----------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_auto_split_with_each_policy_verifies(model: Path, tmp_path: Path, policy: str) -> None:
    out = tmp_path / "split"
    result = ok("split", model, "-o", out, "--auto", "--stages", 3, "--policy", policy)
    assert len(stages_of(out)) == 3
    assert sorted(p.name for p in out.iterdir()) == ["pipeline.json", "stage0.onnx", "stage1.onnx", "stage2.onnx"]
    source = {"measured": "measured with 1 thread(s)", "uniform": "node count", "params": "weights"}[policy]
    assert f"policy '{policy}', costs: {source}" in result.stdout and "cross the cuts per request" in result.stdout
    # Only the measured policy predicts times.
    assert ("pred. ms" in result.stdout) == (policy == "measured") and ("bottleneck stage" in result.stdout) == (policy == "measured")
    verified = ok("verify", out, "--model", model)
    assert "ok: all" in verified.stdout


def test_auto_split_best_count_with_a_memory_cap_and_a_pin(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    result = ok("split", model, "-o", out, "--auto", "--max-stages", 4, "--max-stage-weights", "3MiB", "--pin", "n3=0", "--threads", 2)
    assert "costs: measured with 2 thread(s)" in result.stdout
    stages = stages_of(out)
    assert 2 <= len(stages) <= 4  # the weights (4.7 MiB) do not fit one stage
    assert "n3" in {n.name for n in onnx.load(out / "stage0.onnx", load_external_data=False).graph.node}
    ok("verify", out, "--model", model)


def test_auto_split_user_errors_are_one_line(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    assert_user_error(run("split", model, "-o", out, "--auto", "--stages", 2, "--max-stage-weights", "1KB"), "within 1000 B of weights")
    assert_user_error(run("split", model, "-o", out, "--auto", "--stages", 2, "--pin", "nope=1"), "pinned node 'nope' is unknown")
    assert_user_error(run("split", model, "-o", out, "--auto", "--stages", 2, "--pin", "n3=5"), "only 2 stages were asked for")
    assert not out.exists()
    assert_user_error(run("split", tmp_path / "missing.onnx", "-o", out, "--auto", "--cores", 1), "model file", "does not exist")
    (tmp_path / "bad.onnx").write_text("not a model")
    assert_user_error(run("split", tmp_path / "bad.onnx", "-o", out, "--auto", "--cores", 1), "cannot read", "as an ONNX model")
    assert_user_error(run("split", model, "-o", out, "--auto", "--cores", 4096), "core budget 4096 is outside")
    out.mkdir()
    (out / "keep").write_text("")
    # Refused before any profiling or measuring, not after.
    assert_user_error(run("split", model, "-o", out, "--auto", "--cores", 1), f"output folder '{out}' exists and is not empty")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "2"], "--stages: only with --auto"),
        (["--at", "r10", "--pin", "n1=0"], "--pin: only with --auto"),
        (["--auto", "--at", "r10", "--stages", "2"], "--auto cannot be combined with --at"),
        (["--auto"], "exactly one of --stages N, --max-stages K or --cores C (none given)"),
        (["--auto", "--stages", "2", "--cores", "2"], "(not --stages and --cores)"),
        (["--auto", "--stages", "2", "--max-stages", "3"], "(not --stages and --max-stages)"),
        (["--auto", "--cores", "2", "--threads", "2"], "--threads: not with --cores"),
        (["--auto", "--stages", "2", "--requests", "5"], "--requests: only with --cores"),
        (["--auto", "--max-stages", "2", "--rounds", "3"], "--rounds: only with --cores"),
        (["--auto", "--stages", "2", "--batch", "8"], "--batch: only with --cores"),
        (["--batch", "8"], "--batch: only with --auto"),
        (["--auto", "--cores", "1", "--batch", "0"], "--batch"),
        (["--rounds", "3"], "--rounds: only with --auto"),
        (["--auto", "--cores", "1", "--rounds", "0"], "--rounds"),
        (["--auto", "--stages", "2", "--policy", "uniform", "--pin", "n1=0"], "policy 'uniform' does not take --pin (--pin is for policy measured)"),
        (["--auto", "--stages", "2", "--policy", "params", "--max-stage-weights", "1GB"], "policy 'params' does not take --max-stage-weights"),
        (["--auto", "--stages", "2", "--policy", "nope"], "'nope' is not one of 'measured', 'uniform', 'params'"),
        (["--auto", "--stages", "2", "--max-stage-weights", "12XB"], "unknown unit 'XB'"),
        (["--auto", "--stages", "2", "--pin", "n1"], "'n1' is not NODE=STAGE"),
        (["--auto", "--stages", "2", "--pin", "n1=0", "--pin", "n1=1"], "node 'n1' is pinned to stages 0 and 1"),
        (["--auto", "--stages", "0"], "--stages"),
    ],
)
def test_split_usage_errors(model: Path, tmp_path: Path, args: list[str], message: str) -> None:
    assert_usage_error(run("split", model, "-o", tmp_path / "out", *args), message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "size"),
    [("1048576", 1048576), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("1.5 kb", 1500), (".5KiB", 512), ("3B", 3)],
)
def test_sizes(text: str, size: int) -> None:
    assert SizeType().convert(text, None, None) == size


@pytest.mark.parametrize(("text", "message"), [("big", "is not a size"), ("-1", "is not a size"), ("0", "less than one byte"), ("2M", "unknown unit 'M'")])
def test_bad_sizes(text: str, message: str) -> None:
    import click

    with pytest.raises(click.BadParameter, match=message):
        SizeType().convert(text, None, None)


def test_policy_choices_are_the_librarys() -> None:
    assert POLICY_NAMES == tuple(POLICIES)


# -- split --auto --cores (the planner) --------------------------------------------------------------


def test_planner_writes_its_settings_and_build_uses_them(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    result = ok("split", model, "-o", out, "--auto", "--cores", 2, "--rounds", 2, "--requests", 10, "--measure", 1)
    text = result.stdout
    fragments = ("plans for 2 core(s)", "predicted req/s", "measured req/s", "rounds min-max", "chosen:", "median of 2 round(s)")
    for fragment in (*fragments, "the best one session", "stage by stage", "next: onnxpipe build"):
        assert fragment in text, fragment
    # How sure the choice is, in one of the rule's three verdicts, with the paired ratios of the 2 rounds of 10 requests.
    certainty = re.search(r"^certainty: (.*)$", text, re.MULTILINE)
    assert certainty is not None, text
    verdict = r"(wins by|no clear winner:|wins: the best pipeline)"
    assert re.search(verdict + r".*\(paired ratios \d\.\d\d-\d\.\d\d over 2 round\(s\) of 10 requests\)", certainty[1]), certainty[1]
    # ... and, on the lines after it, why: where the rule started, each richer kind against the plan held, the rule.
    why = re.search(r"^certainty: .*\n  start: .*\n(  .* (replaced|kept over) .*\n){2}  rule: one session, then replicas", text, re.MULTILINE)
    assert why is not None, text
    assert result.stderr == ""  # not a terminal: no progress bar
    stages = stages_of(out)
    settings = [s["settings"] for s in stages]
    assert sum(s["intra_op_threads"] * s["replicas"] for s in settings) <= 2
    assert all(s["affinity"] for s in settings)
    chosen = text.split("chosen: ")[1].split(",")[0]
    assert (len(stages) > 1) == chosen.startswith("pipeline")
    built = tmp_path / "built"
    ok("build", out, "-o", built)
    assert [s["settings"] for s in stages_of(built)] == settings


def test_planner_refuses_symbolic_dims_it_would_plan_at_one(tmp_path: Path) -> None:
    from tests.models import symbolic_image

    path = tmp_path / "image.onnx"
    onnx.save(symbolic_image(), path)
    out = tmp_path / "plan"
    result = run("split", path, "-o", out, "--auto", "--cores", 1)
    dims = "input 'X' dim 2 ('H'); input 'X' dim 3 ('W'); input 'Z' dim 1 (unnamed)"
    assert_user_error(result, "cannot plan 'image.onnx'", dims, "--dim H=SIZE --dim W=SIZE --dim Z.1=SIZE")
    assert not out.exists()


def test_planner_progress_bar_only_on_a_terminal(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxpipe.cli._progress

    monkeypatch.setattr(onnxpipe.cli._progress, "stderr_is_terminal", lambda: True)
    args = ["split", str(model), "-o", str(tmp_path / "p"), "--auto", "--cores", "1", "--rounds", "1", "--requests", "5"]
    result = CliRunner(env={"FORCE_COLOR": "1"}).invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "measuring" in result.stderr  # the last step; "profiling" may pass between two refreshes
    assert "plans for 1 core(s)" in result.stdout and "measuring" not in result.stdout


# -- inspect --profile ---------------------------------------------------------------------------------


def test_inspect_profile_text_and_json(model: Path) -> None:
    text = ok("inspect", model, "--profile", "--max-stages", 3).stdout
    for fragment in ("node costs (measured, 1 thread(s), median of ", "costliest nodes (15 of", "Conv", "share", "speedup at most", "--auto --stages"):
        assert fragment in text, fragment
    assert "cut candidates" in text  # the plain inspection comes first
    result = ok("inspect", model, "--profile", "--max-stages", 3, "--json")
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["compute_nodes"] == 66 and data["candidates"]
    profile = data["profile"]
    assert profile["source"] == "measured" and profile["threads"] == 1 and profile["total_ms"] > 0
    ms = [n["ms"] for n in profile["nodes"]]
    assert ms == sorted(ms, reverse=True) and sum(n["share"] for n in profile["nodes"]) == pytest.approx(1.0)
    assert all(n["node"].startswith("n") for n in profile["nodes"])
    assert [c["stages"] for c in profile["splits"]] == [2, 3]
    for c in profile["splits"]:
        assert len(c["stage_ms"]) == c["stages"] == len(c["nodes"]) and sum(c["nodes"]) == 66
        assert c["bottleneck_ms"] == max(c["stage_ms"])
        assert c["speedup_bound"] == pytest.approx(profile["total_ms"] / c["bottleneck_ms"])
        assert c["crossing_bytes"] > 0
    assert list(model.parent.glob(f"{model.name}.*.profile.json")), "the profile is cached next to the model"


def test_inspect_profile_usage_errors(model: Path) -> None:
    assert_usage_error(run("inspect", model, "--threads", 2), "--threads: only with --profile")
    assert_usage_error(run("inspect", model, "--max-stages", 3), "--max-stages: only with --profile")
    assert_usage_error(run("inspect", model, "--profile", "--max-stages", 1), "--max-stages")


def test_the_planner_on_the_command_line_says_whether_batching_paid(tmp_path: Path) -> None:
    from tests.models import symbolic_batch

    onnx.save(symbolic_batch(), tmp_path / "m.onnx")
    out = ok("split", tmp_path / "m.onnx", "-o", tmp_path / "plan", "--auto", "--cores", 1, "--rounds", 2, "--requests", 10, "--batch", 4).output
    line = next(line for line in out.splitlines() if line.startswith("batching: "))
    assert "max_batch 4 kept" in line or "max_batch 4 does not pay here" in line
    settings = json.loads((tmp_path / "plan" / "pipeline.json").read_text())["stages"][0]["settings"]
    assert settings.get("max_batch", 1) == (4 if line.startswith("batching: max_batch 4 kept") else 1)
