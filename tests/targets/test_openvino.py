"""Stages on OpenVINO and stages on the CPU in one pipeline, for real: Intel's OpenVINO execution
provider (the `onnxruntime-openvino` wheel) runs on this x86 CPU beside onnxruntime's own.

These run where onnxruntime has OpenVINOExecutionProvider: `make test-openvino` makes a venv whose
onnxruntime is onnxruntime-openvino and runs them there; with plain onnxruntime they skip.

Tolerance: PP-OCRv4 rec's outputs (per-position character probabilities) through a pipeline with
stages on OpenVINO equal the whole model on the CPU EP within rtol 1e-4, atol 1e-5 (measured max
abs difference 1.5e-6 to 3.7e-6 with onnxruntime-openvino 1.24.1: its kernels sum in another order).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from onnxpipe import BuildError, BundleError
from onnxpipe.builder import build, export
from onnxpipe.cli import main as cli
from onnxpipe.runtime import load
from tests.targets.models import INPUT, OUTPUT, recognizer, recognizer_onehot, split_on, squeezenet

pytestmark = pytest.mark.skipif(
    "OpenVINOExecutionProvider" not in ort.get_available_providers(),
    reason=f"this onnxruntime ({ort.__version__}) has no OpenVINOExecutionProvider: `make test-openvino` runs these in a venv with onnxruntime-openvino",
)

REPO = Path(__file__).resolve().parents[2]
OV, CPU = "OpenVINOExecutionProvider", "CPUExecutionProvider"
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _images(n: int = 2, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (1, 3, 48, 320)).astype(np.float32) for _ in range(n)]


def _whole(model: Any, xs: list[np.ndarray]) -> list[list[np.ndarray]]:
    session = ort.InferenceSession(model.SerializeToString(), providers=[CPU])
    return [session.run(None, {INPUT: x}) for x in xs]


@pytest.fixture(scope="module")
def whole() -> list[list[np.ndarray]]:
    return _whole(recognizer(), _images())


@pytest.mark.parametrize("engine", ["thread", "ray"])
@pytest.mark.parametrize("targets", [["openvino", "cpu"], ["cpu", "openvino"], ["openvino", "cpu", "openvino"], ["cpu", "openvino", "cpu"]],
                         ids=lambda t: "-".join(t))
def test_stages_on_openvino_and_on_the_cpu_equal_the_whole_model(targets: list[str], engine: str, whole: list[list[np.ndarray]], tmp_path: Path,
                                                                 request: pytest.FixtureRequest) -> None:
    if engine == "ray":
        request.getfixturevalue("ray_cluster")
    plan = split_on(recognizer(), targets)
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")
    with load(bundle, engine=engine) as pipe:
        outs = list(pipe.map({INPUT: x} for x in _images()))
        where = pipe.placement()
        stats = pipe.stats()
        providers = pipe.get_providers()
    for out, expected in zip(outs, whole, strict=True):
        np.testing.assert_allclose(out[OUTPUT], expected[0], **TOL)
    assert OV in providers and CPU in providers
    for stage, target in zip(plan.config.stages, targets, strict=True):
        ep = OV if target == "openvino" else CPU
        nodes = where[stage.name]
        assert nodes is not None and list(nodes) == [ep], f"stage '{stage.name}' ({target}) ran nodes elsewhere: {nodes}"
        assert next(s for s in stats.stages if s.stage == stage.name).nodes == {ep: len(nodes[ep])}
    assert sum(len(n[OV]) for n in where.values() if n and OV in n) > 0


def test_openvino_takes_every_node_of_squeezenet(tmp_path: Path) -> None:
    plan = split_on(squeezenet(), ["openvino", "openvino"], cuts=["r24"])
    with load(export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")) as pipe:
        where = pipe.placement()
    assert [list(nodes) for nodes in where.values() if nodes] == [[OV], [OV]]
    assert sum(len(nodes[OV]) for nodes in where.values() if nodes) == 65  # all of squeezenet's 65 nodes (basic level), on OpenVINO


def test_a_node_openvino_cannot_take_falls_back_to_the_cpu_and_the_placement_says_so(tmp_path: Path) -> None:
    model = recognizer_onehot()
    plan = split_on(model, ["cpu", "openvino"])
    xs = _images(1)
    with load(export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")) as pipe:
        out = pipe({INPUT: xs[0]})
        where = pipe.placement()
    expected = _whole(model, xs)[0]
    np.testing.assert_allclose(out[OUTPUT], expected[0], **TOL)
    np.testing.assert_array_equal(out["onehot"], expected[1])
    tail = where[plan.config.stages[1].name]
    assert tail is not None and tail[CPU] == ["Hardmax 'onehot'"] and len(tail[OV]) > 100


def test_fallback_off_refuses_at_build_naming_the_stage_the_provider_and_the_node(tmp_path: Path) -> None:
    plan = split_on(recognizer_onehot(), ["cpu", "openvino"], fallback=False)
    tail = plan.config.stages[1].name
    with pytest.raises(BuildError, match=rf"^stage '{tail}': OpenVINOExecutionProvider cannot run every node and fallback is off: "
                                         r"it cannot take 1 of the \d+ nodes: Hardmax 'onehot'; set fallback=on"):
        build(plan.config, tmp_path / "built")


@pytest.fixture(scope="module")
def cross(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bundles built by plain onnxruntime (the main venv), which has no OpenVINO: tests/targets/cross_build.py."""
    plain = REPO / ".venv" / "bin" / "python"
    if not plain.exists():
        pytest.skip(f"no plain-onnxruntime venv at {plain} to build with (make .venv/.installed-dev)")
    out = tmp_path_factory.mktemp("cross")
    done = subprocess.run([str(plain), "-m", "tests.targets.cross_build", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "OpenVINOExecutionProvider optimizes it at load, cross-target build" in done.stdout
    return out


def test_a_bundle_built_where_openvino_is_missing_runs_on_it_here(cross: Path, whole: list[list[np.ndarray]]) -> None:
    bundle = cross / "openvino-cpu"
    record = json.loads((bundle / "pipeline.json").read_text())["stages"][0]["build"]
    assert record["optimized_for"] is None and record["optimization"] == "basic"
    with load(bundle) as pipe:
        outs = list(pipe.map({INPUT: x} for x in _images()))
        where = pipe.placement()
    for out, expected in zip(outs, whole, strict=True):
        np.testing.assert_allclose(out[OUTPUT], expected[0], **TOL)
    first, second = where.values()
    assert first is not None and list(first) == [OV] and second is not None and list(second) == [CPU]


def test_fallback_off_the_build_could_not_check_fails_at_load_naming_the_node(cross: Path) -> None:
    with pytest.raises(BundleError, match=r"^stage 'stage1': OpenVINOExecutionProvider cannot run every node and fallback is off: "
                                          r"it cannot take 1 of the \d+ nodes: Hardmax 'onehot'"):
        load(cross / "onehot-no-fallback")


def test_a_provider_option_it_does_not_know_is_one_error_not_a_silent_cpu_session(tmp_path: Path) -> None:
    plan = split_on(squeezenet(), ["openvino", "cpu"], cuts=["r24"], provider_options={"bogus": "1"})
    with pytest.raises(BuildError, match=r"^stage 'stage0': onnxruntime cannot load it for its target on OpenVINOExecutionProvider with options "
                                         r"\{'bogus': '1'\}: .*Invalid OpenVINO EP option: bogus"):
        build(plan.config, tmp_path / "built")


def test_options_the_provider_refuses_while_making_itself_are_one_error(tmp_path: Path) -> None:
    # onnxruntime drops a provider whose factory fails (here: a precision the CPU cannot run) and
    # makes the session on the CPU alone, logging it; the stage must not load that way.
    plan = split_on(squeezenet(), ["openvino", "cpu"], cuts=["r24"], provider_options={"precision": "FP99"})
    with pytest.raises(BuildError, match=r"^stage 'stage0': onnxruntime made the session without OpenVINOExecutionProvider \(it has CPUExecutionProvider\): "
                                         r"the provider refused its options \{'precision': 'FP99'\}"):
        build(plan.config, tmp_path / "built")


_COUNT_THREADS = """
import os, sys
import numpy as np
import onnx
from onnxpipe.runtime import load
with load(sys.argv[1]) as pipe:
    pipe({"data_0": np.ones((1, 3, 224, 224), np.float32)})
    print(len(os.listdir("/proc/self/task")))
"""


def test_the_stage_threads_size_openvinos_own_pool_unless_its_options_do(tmp_path: Path) -> None:
    # OpenVINO runs a node on its own threads, sized by its num_of_threads option, not by
    # onnxruntime's intra_op_num_threads (which it does not read): the stage's threads set it.
    # onnxruntime does not report OpenVINO's options back, so count the process's threads.
    counts = {}
    for name, settings in (("one", {"intra_op_threads": 1}), ("two", {"intra_op_threads": 2}),
                           ("two, its option says one", {"intra_op_threads": 2, "provider_options": {"num_of_threads": "1"}})):
        plan = split_on(squeezenet(), ["openvino", "openvino"], cuts=["r24"])
        for stage in plan.config.stages:
            stage.configure(**settings)
        bundle = export(build(plan.config, tmp_path / f"built-{len(counts)}").path, tmp_path / f"bundle-{len(counts)}")
        done = subprocess.run([sys.executable, "-c", _COUNT_THREADS, str(bundle)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        counts[name] = int(done.stdout.split()[-1])
    # threads=2 adds one onnxruntime intra-op thread per stage (2); with num_of_threads=1 that is all
    # it adds, while num_of_threads=2 from the stage's threads grows OpenVINO's pool, which its stages share.
    assert counts["two, its option says one"] == counts["one"] + 2, counts
    assert counts["two"] > counts["two, its option says one"], counts


def test_cli_builds_with_provider_options_and_inspect_host_says_where_nodes_run(tmp_path: Path) -> None:
    plan = split_on(recognizer_onehot(), ["cpu", "cpu"])
    plan.save(tmp_path / "split")
    runner = CliRunner()
    result = runner.invoke(cli, ["build", str(tmp_path / "split"), "-o", str(tmp_path / "built"), "--stage", "1:target=openvino,ep.precision=FP32"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["export", str(tmp_path / "built"), "-o", str(tmp_path / "bundle")])
    assert result.exit_code == 0, result.output
    spec = json.loads((tmp_path / "bundle" / "pipeline.json").read_text())
    assert spec["stages"][1]["settings"]["provider_options"] == {"precision": "FP32"}
    result = runner.invoke(cli, ["inspect", str(tmp_path / "bundle"), "--host"])
    assert result.exit_code == 0, result.output
    assert "stage1: OpenVINOExecutionProvider" in result.output and "CPUExecutionProvider 1 (fell back: Hardmax 'onehot')" in result.output, result.output
    result = runner.invoke(cli, ["inspect", str(tmp_path / "bundle"), "--host", "--json"])
    where = json.loads(result.output)["placement"]
    assert where["stage1"]["CPUExecutionProvider"] == ["Hardmax 'onehot'"]


def test_the_targets_benchmark_runs_and_reports_every_row() -> None:
    from benchmarks.targets import run

    result = run(requests=8, rounds=1)
    assert [row["stage"] for row in result["stages"]] == ["stage0", "stage1"]
    assert all(row[t]["ms"] > 0 and sum(row[t]["nodes"].values()) > 100 for row in result["stages"] for t in ("cpu", "openvino"))
    assert set(result["rates"]) == {"one session, cpu", "one session, openvino", "pipeline cpu -> cpu", "pipeline openvino -> openvino",
                                    "pipeline cpu -> openvino", "pipeline openvino -> cpu"}
    assert all(r["median"] > 0 for r in result["rates"].values())


def test_the_planner_measures_every_stage_on_every_target_and_sets_each_stages_target(tmp_path: Path) -> None:
    from onnxpipe.planner import plan_pipeline

    model = tmp_path / "rec.onnx"
    onnx.save(recognizer(), str(model))
    steps: list[str] = []
    result = plan_pipeline(model, 2, targets=("cpu", "openvino"), rounds=2, requests=8, measure=2, dims={"p2o.DynamicDimension.1": 320, "x.2": 48},
                           progress=lambda step, done, total: steps.append(step))
    assert "targets" in steps
    labels = {c.label for c in result.candidates}
    for label in ("1 session x 1t cpu", "1 session x 1t openvino", "pipeline 2 x (1t cpu, 1t openvino)", "pipeline 2 x (1t openvino, 1t cpu)"):
        assert label in labels, sorted(labels)
    assert all(len(c.targets) == len(c.threads) and set(c.targets) <= {"cpu", "openvino"} for c in result.candidates)
    measured = [c for c in result.candidates if c.measured is not None]
    assert len(measured) >= 3 and any(c.kind == "pipeline" for c in measured)
    # On this CPU OpenVINO runs the recognizer about twice as fast as the CPU provider (benchmarks.targets),
    # so the best-predicted plans use it.
    assert "openvino" in result.candidates[0].targets
    stages = result.plan.config.stages
    assert tuple(s.settings.target for s in stages) == result.chosen.targets
    assert any("share this host's cores" in n for n in result.notes)


def test_the_served_workload_planner_measures_plans_on_every_target_under_each_n(tmp_path: Path) -> None:
    """``--concurrency`` with ``--targets``: finalists on either target (and mixed pipelines) measured
    under N in flight, and each N's plan sets each stage's target."""
    from onnxpipe.planner import plan_pipeline

    model = tmp_path / "rec.onnx"
    onnx.save(recognizer(), str(model))
    result = plan_pipeline(model, 2, targets=("cpu", "openvino"), rounds=1, requests=8, measure=2, concurrency=(1, 4),
                           dims={"p2o.DynamicDimension.1": 320, "x.2": 48})
    finalists = [c for c in result.candidates if c.loads]
    assert {t for c in finalists for t in c.targets} == {"cpu", "openvino"}, [c.label for c in finalists]
    assert all(set(c.loads) == ({1} if c.spinning else {1, 4}) and c.loads[1].throughput > 0 for c in finalists)
    for planned in result.loads:
        assert tuple(s.settings.target for s in planned.plan.config.stages) == planned.chosen.targets
        assert all(s.settings.spinning == planned.chosen.spinning for s in planned.plan.config.stages)
    folder = result.save(tmp_path / "plans")
    summary = json.loads((folder / "summary.json").read_text())
    assert {tuple(f["targets"]) for f in summary["finalists"]} >= {tuple(c.targets) for c in finalists}
