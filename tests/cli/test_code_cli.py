"""The CLI with code stages: build and inspect a pipeline file, inspect lists a bundle's code, run
refuses code until --allow-code allows it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onnxpipe.runtime import load_npz, save_npz
from tests import code_stages
from tests.cli.helpers import assert_user_error, ok, run
from tests.splitter.test_pipeline_file import HEAD, write


def test_build_inspect_export_run_a_pipeline_file(tmp_path: Path) -> None:
    path = write(tmp_path, HEAD)
    shown = ok("inspect", path).output
    assert "stage 'combine' (code tests.code_stages:combine" in shown
    assert "in  h: float32[N, 4]  <- head.h" in shown and "out y: float32[N, 4]  -> pipeline.y" in shown
    built = ok("build", path, "-o", tmp_path / "built", "--stage", "head:threads=1").output
    row = next(line for line in built.splitlines() if "combine" in line)
    assert "code, nothing to build" in row and "None" not in row and "offline" not in row
    ok("export", tmp_path / "built", "-o", tmp_path / "b.onnxpipe")
    listed = ok("inspect", tmp_path / "b.onnxpipe").output
    assert "stage 1 'combine': code tests.code_stages:combine" in listed
    assert "stage 'combine': entry point tests.code_stages:combine" in listed
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    save_npz(tmp_path / "in.npz", {"x": x})
    refused = run("run", tmp_path / "b.onnxpipe", "--inputs", tmp_path / "in.npz", "--outputs", tmp_path / "out.npz")
    assert_user_error(refused, "not allowed: 'tests.code_stages:combine' (stage 'combine')", "--allow-code")
    assert not (tmp_path / "out.npz").exists()
    ok("run", tmp_path / "b.onnxpipe", "--inputs", tmp_path / "in.npz", "--outputs", tmp_path / "out.npz", "--allow-code", "tests.*")
    np.testing.assert_allclose(load_npz(tmp_path / "out.npz")["y"], code_stages.expected(x))


def test_wiring_mistake_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, HEAD.replace('outputs = ["y"]', 'outputs = ["yy"]'))
    assert_user_error(run("inspect", path), "pipeline output 'yy' is tensor 'yy', which no stage makes; closest: 'y'")
    assert_user_error(run("build", path, "-o", tmp_path / "built"), "pipeline output 'yy'")


def test_inspect_a_bundle_without_code_says_so(tmp_path: Path) -> None:
    from tests.models import bundle_of, head_then_tail

    bundle = bundle_of(head_then_tail(4), tmp_path)
    assert "code: none (ONNX stages only)" in ok("inspect", bundle).output


def test_inspect_summarises_long_code_params(tmp_path: Path) -> None:
    from onnxpipe.builder import build, export

    table = [chr(0x4E00 + i) for i in range(18708)]  # a character list, as PP-OCR's decoder takes
    config = code_stages.config(params={"factor": 2.0, "character": table, "note": "x" * 200})
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "bundle")
    shown = ok("inspect", bundle).output
    assert 'params {character: list of 18708 (str), ["一", "丁", "丂", ...], factor: 2.0, note: "xxxxx' in shown
    assert "... (202 characters)" in shown and len(shown) < 5000
    import json

    assert len(json.loads(ok("inspect", bundle, "--json").output)["pipeline"]["stages"][1]["code"]["params"]["character"]) == 18708
