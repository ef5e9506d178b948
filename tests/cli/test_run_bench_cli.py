"""``onnxpipe run`` streaming folders of requests through a bundle, and ``onnxpipe bench``.

Two tiny hand-wired bundles are built once per module (do not modify them): ``hand`` (head -> twin
-> tail, x[N,4] -> y[N,4]) and ``failing`` (head -> reshape, which fails for any N but 2). Inputs
vary N from file to file, so an output that went to the wrong file would have the wrong shape.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from onnxpipe.runtime import load
from tests import models
from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run

REQUESTS = 30







@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run_bench_cli")


@pytest.fixture(scope="module")
def requests(work: Path) -> list[Path]:
    """30 requests of 1 to 3 rows."""
    return models.write_requests(work / "requests", [1 + k % 3 for k in range(REQUESTS)])


# -- run -----------------------------------------------------------------------------------------


def test_run_a_folder_writes_each_requests_outputs_to_its_own_file(hand: Path, requests: list[Path], tmp_path: Path) -> None:
    out, trace = tmp_path / "out", tmp_path / "trace.json"
    result = ok("run", hand, "--inputs", requests[0].parent, "--outputs", out, "--trace", trace)
    assert sorted(p.name for p in out.iterdir()) == [f.name for f in requests]
    with load(hand) as pipe:
        for file in requests:
            with np.load(file) as x, np.load(out / file.name) as y:
                assert list(y.files) == ["y"]
                np.testing.assert_array_equal(y["y"], pipe({"x": x["x"]})["y"])
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"ran {REQUESTS} request(s) through 3 stage(s): ") and "req/s, latency p50 " in lines[0]
    assert " ms, p99 " in lines[0] and lines[0].split("; ")[-1] in {f"bottleneck: stage '{s}'" for s in ("head", "twin", "tail")}
    assert lines[1] == "outputs (first request): y: float32[1, 4]"
    assert f"wrote {REQUESTS} output file(s) in {out}" in lines
    assert f"wrote timeline {trace}" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"head", "twin", "tail"}
    assert sorted(e["args"]["request"] for e in events if e["ph"] == "X" and e["cat"] == "tail") == list(range(REQUESTS))
    assert result.stderr == ""  # not a terminal: no progress bar


def test_run_files_and_folders_in_order_with_json(hand: Path, requests: list[Path], tmp_path: Path) -> None:
    extra = models.write_requests(tmp_path / "extra", [2], seed=9)[0].rename(tmp_path / "extra" / "zz.npz")
    result = ok("run", hand, "--inputs", extra, "--inputs", requests[0].parent, "--outputs", tmp_path / "out", "--json")
    data = json.loads(result.stdout)
    assert [Path(f["inputs"]) for f in data["files"]] == [extra, *requests]
    assert [Path(f["outputs"]).name for f in data["files"]] == ["zz.npz"] + [f.name for f in requests]
    assert data["requests"] == REQUESTS + 1 and data["trace"] is None
    assert data["stats"]["completed"] == REQUESTS + 1 and data["stats"]["failed"] == 0 and data["stats"]["throughput"] > 0
    assert [s["stage"] for s in data["stats"]["stages"]] == ["head", "twin", "tail"]


def test_run_one_request_to_one_file(hand: Path, requests: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "deep" / "y.npz"
    result = ok("run", hand, "--inputs", requests[4], "--outputs", out)
    assert f"wrote {out}" in result.stdout and "outputs: y: float32[2, 4]" in result.stdout
    with np.load(out) as y:
        assert y["y"].shape == (2, 4)


def test_progress_bar_only_on_a_terminal_and_never_with_json(hand: Path, requests: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxpipe.cli._progress

    monkeypatch.setattr(onnxpipe.cli._progress, "stderr_is_terminal", lambda: True)
    shown = run("run", hand, "--inputs", requests[0].parent, "--outputs", tmp_path / "a", env={"FORCE_COLOR": "1"})
    assert shown.exit_code == 0 and f"{REQUESTS}/{REQUESTS}" in shown.stderr
    assert shown.stdout.startswith(f"ran {REQUESTS} request(s)")
    quiet = run("run", hand, "--inputs", requests[0].parent, "--outputs", tmp_path / "b", "--json", env={"FORCE_COLOR": "1"})
    assert quiet.exit_code == 0 and quiet.stderr == ""
    few = run("run", hand, "--inputs", requests[0], "--outputs", tmp_path / "c", env={"FORCE_COLOR": "1"})
    assert few.exit_code == 0 and few.stderr == ""  # one request: nothing to watch
    bench = run("bench", hand, "--requests", 25, "--standalone-runs", 1, env={"FORCE_COLOR": "1"})
    assert bench.exit_code == 0 and "25/25" in bench.stderr and "timing each stage alone" in bench.stderr


def test_run_refuses_output_names_it_cannot_keep_apart(hand: Path, requests: list[Path], tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(requests[3], other / "r03.npz")
    out = tmp_path / "out"
    assert_usage_error(
        run("run", hand, "--inputs", requests[0].parent, "--inputs", other, "--outputs", out),
        f"inputs files '{requests[3]}' and '{other / 'r03.npz'}' would both write {out / 'r03.npz'}",
    )
    assert_usage_error(run("run", hand, "--inputs", requests[0].parent, "--outputs", tmp_path / "y.npz"), f"names one file, but there are {REQUESTS}")
    assert not out.exists() and not (tmp_path / "y.npz").exists()
    assert_user_error(run("run", hand, "--inputs", requests[0].parent, "--outputs", requests[0].parent), "is also an --inputs file")
    assert_user_error(run("run", hand, "--inputs", other, "--outputs", other / "r03.npz"), "is also an --inputs file")
    assert_user_error(run("run", hand, "--inputs", tmp_path / "empty", "--outputs", out), f"inputs file '{tmp_path / 'empty'}' does not exist")
    (tmp_path / "empty").mkdir()
    assert_user_error(run("run", hand, "--inputs", tmp_path / "empty", "--outputs", out), f"inputs folder '{tmp_path / 'empty'}' holds no .npz file")


def test_run_checks_every_file_before_anything_runs(hand: Path, tmp_path: Path) -> None:
    files = models.write_requests(tmp_path / "in", [2] * 25)
    np.savez(files[17], x=np.zeros((2, 4)))  # float64
    out = tmp_path / "out"
    args = ("run", hand, "--inputs", tmp_path / "in", "--outputs", out)
    assert_user_error(run(*args), f"inputs file '{files[17]}': input 'x' has dtype float64; expected float32")
    np.savez(files[17], x=np.zeros((2, 5), np.float32))
    assert_user_error(run(*args), f"inputs file '{files[17]}': input 'x' has shape [2, 5]")
    np.savez(files[17], y=np.zeros((2, 4), np.float32))
    assert_user_error(run(*args), f"inputs file '{files[17]}': unknown input 'y'")
    files[17].write_text("not numpy")
    assert_user_error(run(*args), f"inputs file '{files[17]}': cannot read '{files[17].name}' as an .npz of arrays")
    assert not out.exists()


def test_a_request_failing_in_a_stage_stops_the_run_and_keeps_the_files_before_it(failing: Path, tmp_path: Path) -> None:
    rows = [2] * 25
    rows[12] = 3  # valid for the pipeline's inputs, refused by the reshape stage
    files = models.write_requests(tmp_path / "in", rows)
    out = tmp_path / "out"
    result = run("run", failing, "--inputs", tmp_path / "in", "--outputs", out, "--trace", tmp_path / "t.json")
    assert_user_error(
        result, f"inputs file '{files[12]}': stage 'reshape' failed on request 12", "the 12 output file(s) written before it are complete and stay"
    )
    assert sorted(p.name for p in out.iterdir()) == [f.name for f in files[:12]]  # complete files only, no temporary one
    for file in files[:12]:
        with np.load(file) as x, np.load(out / file.name) as y:
            np.testing.assert_array_equal(y["y"], np.maximum(x["x"], 0))
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_a_first_request_failing_writes_nothing(failing: Path, tmp_path: Path) -> None:
    file = models.write_requests(tmp_path / "in", [3])[0]
    result = run("run", failing, "--inputs", file, "--outputs", tmp_path / "y.npz")
    assert_user_error(result, f"inputs file '{file}': stage 'reshape' failed on request 0", "; no output file was written")
    assert not (tmp_path / "y.npz").exists()


# -- bench ---------------------------------------------------------------------------------------


def test_bench_prints_the_numbers_and_a_row_per_stage(hand: Path, tmp_path: Path) -> None:
    result = ok("bench", hand, "--requests", REQUESTS, "--standalone-runs", 3, "--warmup", 2, "--trace", tmp_path / "t.json")
    out = result.stdout
    assert out.startswith(f"{REQUESTS} request(s) in ") and "after 2 warm-up request(s)" in out
    for fragment in ("throughput: ", " req/s (ideal ", "efficiency ", "latency:    mean ", "p50 ", "p99 ", "alone ms", "in pipeline ms", "utilization"):
        assert fragment in out, fragment
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["head", "twin", "tail"]
    assert sum("bottleneck" in r for r in rows) == 1
    assert "note: input 'x': dim N not given, using 1" in out and "note: every stage runs in under 1 ms alone" in out
    slices = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 3 * REQUESTS  # the timed requests only, not the warm-up


def test_bench_json(hand: Path, requests: list[Path]) -> None:
    data = json.loads(ok("bench", hand, "--requests", REQUESTS, "--standalone-runs", 3, "--inputs", requests[2], "--queue-depth", 4, "--json").stdout)
    assert data["requests"] == REQUESTS and data["throughput"] > 0 and data["ideal_throughput"] > 0 and data["efficiency"] > 0
    assert data["latency_p99_ms"] >= data["latency_p50_ms"] > 0
    assert [s["stage"] for s in data["stages"]] == ["head", "twin", "tail"] and data["bottleneck"] in {"head", "twin", "tail"}
    assert all(s["standalone_ms"] > 0 and s["pipeline_mean_ms"] > 0 and s["replicas"] == 1 for s in data["stages"])
    assert data["notes"] == []  # the inputs file gives every dim


def test_bench_without_standalone_runs(hand: Path) -> None:
    result = ok("bench", hand, "--requests", 5, "--standalone-runs", 0, "--dim", "N=3")
    assert "(ideal" not in result.stdout and "note: stages were not timed alone (--standalone-runs 0)" in result.stdout
    assert "dim N not given" not in result.stdout


def test_run_and_bench_default_to_the_runtime_queue_depth() -> None:
    from onnxpipe.cli._deploy import _QUEUE_DEPTH_DEFAULT
    from onnxpipe.runtime import DEFAULT_QUEUE_DEPTH

    assert _QUEUE_DEPTH_DEFAULT == DEFAULT_QUEUE_DEPTH


def test_bench_caller_cores(hand: Path) -> None:
    core = max(os.sched_getaffinity(0))
    result = ok("bench", hand, "--requests", 5, "--standalone-runs", 0, "--dim", "N=2", "--caller-cores", core)
    assert f"the thread feeding the pipeline ran on core(s) {core}\n" in result.stdout
    data = json.loads(ok("bench", hand, "--requests", 5, "--standalone-runs", 2, "--dim", "N=2", "--caller-cores", "auto", "--json").stdout)
    assert data["caller_cores"] is None and data["notes"] == ["the calling thread was left unpinned: no stage is pinned to cores"]
    for bad in ("x", "-1", "0,1"):
        assert_usage_error(run("bench", hand, "--caller-cores", bad),
                           f"'{bad}' is not a core list: give cores as 0, 0-3 or 0+2+5 (or none), in the digits 0-9; or auto")
    assert_usage_error(run("bench", hand, "--caller-cores", "1-0"), "range '1-0' goes down; write 0-1; or auto")
    refused = "cannot pin the calling thread to cores [4096]: Invalid argument; this process may use cores"
    assert_user_error(run("bench", hand, "--caller-cores", "4096"), refused)


def test_bench_errors(hand: Path, requests: list[Path], tmp_path: Path) -> None:
    tampered = tmp_path / "tampered"
    shutil.copytree(hand, tampered)
    module = bytearray((tampered / "stages/head.onnx").read_bytes())
    module[-8] ^= 1
    (tampered / "stages/head.onnx").write_bytes(bytes(module))
    assert_user_error(run("bench", tampered, "--requests", 5), "bundle file 'stages/head.onnx' does not match its sha256 in the manifest")
    assert_user_error(run("bench", tmp_path / "nothing"), "does not exist")
    assert_user_error(run("bench", hand, "--dim", "batch=2"), "no input has a dim named 'batch'; valid: 'N'")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((2, 4)))
    assert_user_error(run("bench", hand, "--inputs", bad), f"inputs file '{bad}': input 'x' has dtype float64; expected float32")
    assert_usage_error(run("bench", hand, "--inputs", requests[0], "--dim", "N=2"), "--dim: only used for random inputs")
    assert_usage_error(run("bench", hand, "--requests", 0), "--requests")
