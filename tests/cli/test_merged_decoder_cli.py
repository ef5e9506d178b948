"""The CLI on optimum's merged decoders (issue 39, item 4): cuts refused in one line, ``inspect``
says why, and a one-stage split with ``--state auto`` builds, shows its states set once and its
step flag, and verifies."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx

from tests.cli.helpers import assert_user_error, ok, run
from tests.splitter.test_merged_decoder import MERGED, REFUSAL


def test_cli_refuses_cuts_says_so_in_inspect_and_splits_it_as_one_stage(tmp_path: Path) -> None:
    model = tmp_path / MERGED.name  # split --auto keeps its profile beside the model: here, not in the repository
    shutil.copy(MERGED, model)
    assert_user_error(run("split", model, "-o", tmp_path / "cut", "--at", "logits"), REFUSAL)
    assert_user_error(run("split", model, "-o", tmp_path / "auto", "--auto", "--stages", "2"), REFUSAL)
    assert f"note: {REFUSAL}" in ok("inspect", model).output.replace("\n", " ")
    out = ok("split", model, "-o", tmp_path / "one", "--auto", "--stages", "1", "--state", "auto").output
    assert ("state: present.0.encoder.key -> past_key_values.0.encoder.key (starts as zeros; set once, by the first step), kept in stage0" in out)
    assert "step flag: stage0.use_cache_branch (False on a stream's first step, True after): fed by the runtime, no pipeline input" in out
    ok("build", tmp_path / "one", "-o", tmp_path / "built")
    ok("export", tmp_path / "built", "-o", tmp_path / "merged.onnxpipe")
    shown = ok("inspect", tmp_path / "merged.onnxpipe").output
    assert "<- state present.0.encoder.key (set once, by the first step)" in shown
    assert "-> state of past_key_values.0.encoder.key (first step only)" in shown
    assert "use_cache_branch: bool[1]  <- step flag (False on a stream's first step, True after)" in shown
    verified = ok("verify", tmp_path / "one", "--model", model, "--dim", "encoder_sequence_length=6").output
    assert "ok: all 1 tensor(s) within tolerance" in verified
    assert onnx.load(tmp_path / "one" / "stage0.onnx").graph.node[0].op_type == "If"
