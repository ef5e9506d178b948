"""The concurrent pipeline: many requests in flight, order kept, the TVM protocol, parameters,
bad inputs, failing requests, close() with work in flight, a soak, statistics and timelines."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from onnxpipe import BusyError, ConfigError, InputError, StageError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import TensorSpec, load
from onnxpipe.splitter import split
from tests import code_stages, models
from tests.waiting import until

BRANCHY_CUTS = {2: ["a"], 3: ["a", ["b", "c"]], 4: ["a", ["b", "c"], "e"]}


def _whole_runner(model: object) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])  # type: ignore[attr-defined]


@pytest.fixture()
def no_thread_left() -> object:
    """The test leaves no worker thread of its own behind (other tests' threads are not its business)."""
    before = {t.ident for t in threading.enumerate()}
    yield

    def mine() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("onnxpipe-") and t.ident not in before]

    deadline = time.monotonic() + 2
    while mine() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mine() == []


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_200_requests_in_flight_give_each_its_own_outputs_in_order(tmp_path: Path, stages: int, no_thread_left: object) -> None:
    plan = split(models.branchy(), BRANCHY_CUTS[stages])
    assert len(plan.stages) == stages
    whole = _whole_runner(models.branchy())
    rng = np.random.default_rng(stages)
    inputs = [{"X": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(200)]
    expected = [whole.run(None, x)[0] for x in inputs]
    with load(models.bundle_of(plan, tmp_path), queue_depth=64) as pipe:
        # 4 threads submit at once; every future must hold the outputs of its own input.
        with ThreadPoolExecutor(4) as pool:
            futures = list(pool.map(pipe.submit, inputs))
        for future, want in zip(futures, expected, strict=True):
            np.testing.assert_allclose(future.result()["Y"], want, rtol=1e-6)
        # map() yields in submission order.
        for got, want in zip(pipe.map(inputs), expected, strict=True):
            np.testing.assert_allclose(got["Y"], want, rtol=1e-6)
        assert pipe.stats().completed == 400


def test_replicated_stage_keeps_order(tmp_path: Path, no_thread_left: object) -> None:
    plan = split(models.branchy(), BRANCHY_CUTS[3])
    plan.config.stage("stage1").configure(replicas=3)
    whole = _whole_runner(models.branchy())
    inputs = [{"X": np.full((1, 4), i / 100, np.float32)} for i in range(300)]
    with load(models.bundle_of(plan, tmp_path)) as pipe:
        assert [s.replicas for s in pipe.stats().stages] == [1, 3, 1]
        for i, got in enumerate(pipe.map(inputs)):
            np.testing.assert_allclose(got["Y"], whole.run(None, inputs[i])[0], rtol=1e-6)


def test_set_input_run_get_output_protocol(tmp_path: Path, no_thread_left: object) -> None:
    plan = split(models.branchy(), BRANCHY_CUTS[4])
    whole = _whole_runner(models.branchy())
    with load(models.bundle_of(plan, tmp_path)) as pipe:
        assert pipe.get_output() is None  # nothing was run: no wait
        assert pipe.get_output(block=False) is None
        assert (pipe.num_inputs, pipe.num_outputs) == (1, 1)
        assert pipe.get_input_pipeline_map("X") == [("stage0", "X")]
        with pytest.raises(InputError, match="unknown input 'Z'; valid: 'X'"):
            pipe.get_input_pipeline_map("Z")
        xs = [np.full((1, 4), v, np.float32) for v in (0.5, -1.0, 2.0)]
        ids = []
        for x in xs:
            pipe.set_input("X", x)
            ids.append(pipe.run())
        assert ids == [0, 1, 2]
        for x in xs:
            np.testing.assert_allclose(pipe.get_output(timeout=10)["Y"], whole.run(None, {"X": x})[0], rtol=1e-6)
        assert pipe.get_output(block=False) is None
        assert pipe.num_executing_pipeline == 0
        with pytest.raises(InputError, match="missing input"):
            pipe.run()  # nothing set


def test_get_output_before_ready_returns_none_without_blocking(tmp_path: Path, no_thread_left: object) -> None:
    # The request is held by a code stage until the test lets it go: "not ready" is certain, not a race.
    config = PipelineConfig()
    spec = [TensorSpec("x", "float32", ("N", 4))]
    held = config.add_python_stage("tests.code_stages:gated", inputs=spec, outputs=[TensorSpec("y", "float32", ("N", 4))], name="held")
    config.input("x").connect(held.input("x"))
    held.output("y").connect(config.output("y"))
    code_stages.GATE.clear()
    with load(models.bundle_of(config, tmp_path), allow_code=["tests.code_stages:gated"]) as pipe:
        try:
            pipe.set_input("x", np.ones((3, 4), np.float32))
            pipe.run()
            assert pipe.get_output(block=False) is None
            assert pipe.get_output(timeout=0.0001) is None
            # Both returned while the request was still held: neither waited for it.
            assert not code_stages.GATE.is_set() and pipe.num_executing_pipeline == 1
        finally:
            code_stages.GATE.set()
        np.testing.assert_array_equal(pipe.get_output(timeout=30)["y"], np.ones((3, 4), np.float32))


def _held_bundle(tmp_path: Path) -> Path:
    """``v -> fast (ONNX) -> h`` beside ``x -> slow -> y``, where slow is ``tests.code_stages:gated``:
    held shut while ``code_stages.GATE`` is clear, so requests pile up in front of it for certain."""
    config = PipelineConfig()
    fast = config.add_stage(models.stage_head(), "fast")
    spec = [TensorSpec("x", "float32", ("N", 4))]
    slow = config.add_python_stage("tests.code_stages:gated", inputs=spec, outputs=[TensorSpec("y", "float32", ("N", 4))], name="slow")
    config.add_input(TensorSpec("v", "float32", ("N", 4)))
    config.input("v").connect(fast.input("x"))
    fast.output("h").connect(config.output("h"))
    config.input("x").connect(slow.input("x"))
    slow.output("y").connect(config.output("y"))
    return models.bundle_of(config, tmp_path)


def test_submit_without_blocking_refuses_a_full_pipeline_and_takes_nothing(tmp_path: Path, no_thread_left: object) -> None:
    # An event loop must never wait on the pipeline: block=False says "full" at once instead. The
    # slow stage is held shut while the submits run, so no room can appear: a submit that waited
    # for room would still be waiting.
    request = {"x": np.ones((3, 4), np.float32), "v": np.ones((1, 4), np.float32)}
    code_stages.GATE.clear()
    with load(_held_bundle(tmp_path), queue_depth=1, allow_code=["tests.code_stages:gated"]) as pipe:
        taken: list[Future[Any]] = []
        refused: list[BusyError] = []

        def fill() -> None:
            try:
                for _ in range(50):
                    taken.append(pipe.submit(request, block=False))
            except BusyError as e:
                refused.append(e)

        try:
            filler = threading.Thread(target=fill)
            filler.start()
            filler.join(30)
            assert not filler.is_alive(), "submit(block=False) waited for room"
            assert not code_stages.GATE.is_set() and 1 <= len(taken) < 50
            assert pipe.num_executing_pipeline == len(taken)  # the refused one left no trace
        finally:
            code_stages.GATE.set()
        assert len(refused) == 1
        assert re.fullmatch(r"the pipeline is full \(\d+ request\(s\) in flight\): submit with block=True to wait for room", str(refused[0]))
        for future in taken:
            assert future.result(timeout=30)["y"].shape == (3, 4)
        assert pipe.num_executing_pipeline == 0
        assert pipe.stats().completed == len(taken)
        pipe.submit(request, block=False).result()  # room again


def test_stage_statistics_time_the_queues(tmp_path: Path, no_thread_left: object) -> None:
    # 12 requests at once behind a stage held shut until all are queued: they wait in its queue, not
    # in the fast one's (a held code stage makes the pile-up certain; a merely slow one raced the caller).
    request = {"x": np.ones((3, 4), np.float32), "v": np.ones((1, 4), np.float32)}
    code_stages.GATE.clear()
    with load(_held_bundle(tmp_path), queue_depth=16, allow_code=["tests.code_stages:gated"]) as pipe:
        pipe.reset_stats()
        try:
            futures = [pipe.submit(request) for _ in range(12)]
            # The first one held by the stage, the other 11 queued behind it.
            until(lambda: next(s for s in pipe.stats().stages if s.stage == "slow").queue_depth == 11, "11 requests wait for the held stage")
        finally:
            code_stages.GATE.set()
        for future in futures:
            future.result(timeout=30)
        by_name = {s.stage: s for s in pipe.stats().stages}
    slow_stats, fast_stats = by_name["slow"], by_name["fast"]
    assert slow_stats.count == 12 and slow_stats.queued_s > 0
    # The k-th of the 11 waited from its submission until the held run and the k - 1 runs before
    # it ended; the runs are one held (from the first submission on) and 11 instant: however long
    # each took on a busy machine, the waits sum to more than twice the runs.
    assert slow_stats.queue_mean_ms > 2 * slow_stats.mean_ms
    assert slow_stats.queue_mean_ms == pytest.approx(1e3 * slow_stats.queued_s / 12)
    assert fast_stats.queue_mean_ms < slow_stats.queue_mean_ms


def _hand_pipeline(tmp_path: Path) -> Path:
    return models.bundle_of(models.hand_wired(param_group="scale"), tmp_path)


def test_set_params_applies_to_requests_submitted_after_it(tmp_path: Path, no_thread_left: object) -> None:
    whole = _whole_runner(models.stages_whole())
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    ones, twos = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    with load(_hand_pipeline(tmp_path), queue_depth=8) as pipe:
        before = [pipe.submit({"x": x}) for _ in range(20)]
        pipe.set_params("scale", {"scale": twos})
        after = [pipe.submit({"x": x}) for _ in range(20)]
        for f in before:
            np.testing.assert_allclose(f.result()["y"], whole.run(None, {"x": x, "scale": ones})[0], rtol=1e-6)
        for f in after:
            np.testing.assert_allclose(f.result()["y"], whole.run(None, {"x": x, "scale": twos})[0], rtol=1e-6)
        assert pipe.get_params_group_pipeline_map("scale") == "tail"
        with pytest.raises(InputError, match="unknown param group 'scales'; closest: 'scale'"):
            pipe.get_params_group_pipeline_map("scales")


def test_bad_inputs_are_refused_and_the_pipeline_stays_usable(tmp_path: Path, no_thread_left: object) -> None:
    with load(_hand_pipeline(tmp_path)) as pipe:
        for bad, message in [
            ({"x": np.ones((2, 4))}, "input 'x' has dtype float64; expected float32"),
            ({"x": np.ones((2, 5), np.float32)}, r"input 'x' has shape \[2, 5\]; expected \[N, 4\]"),
            ({"x": np.ones(4, np.float32)}, "expected rank 2"),
            ({"y": np.ones((2, 4), np.float32)}, "unknown input 'y'"),
            ({}, "missing input"),
        ]:
            with pytest.raises(InputError, match=message):
                pipe.submit(bad)
        with pytest.raises(InputError, match="input 'x' has dtype int64"):
            pipe.set_input("x", np.ones((2, 4), np.int64))
        assert pipe({"x": np.ones((3, 4), np.float32)})["y"].shape == (3, 4)


def test_a_failing_request_fails_alone(tmp_path: Path, no_thread_left: object) -> None:
    with load(models.bundle_of(models.failing_config(), tmp_path)) as pipe:
        rows = [2, 2, 3, 2, 2]  # the request with 3 rows cannot be reshaped to [2, 4]
        futures = [pipe.submit({"x": np.full((n, 4), i, np.float32)}) for i, n in enumerate(rows)]
        for i, (n, f) in enumerate(zip(rows, futures, strict=True)):
            if n == 3:
                with pytest.raises(StageError, match=f"stage 'reshape' failed on request {i}"):
                    f.result()
            else:
                np.testing.assert_array_equal(f.result()["y"], np.full((2, 4), i, np.float32))
        stats = pipe.stats()
        assert (stats.completed, stats.failed) == (5, 1)
        assert [s.failed for s in stats.stages] == [0, 1]
        # get_output raises for the failed one and moves on.
        for n in (2, 3, 2):
            pipe.set_input("x", np.zeros((n, 4), np.float32))
            pipe.run()
        assert pipe.get_output() is not None
        with pytest.raises(StageError, match="stage 'reshape' failed"):
            pipe.get_output()
        assert pipe.get_output() is not None


def test_close_with_requests_in_flight_is_prompt_and_leaves_no_thread(tmp_path: Path, no_thread_left: object) -> None:
    # The first stage's run never ends by itself (models.endless_stage): close() can return only by
    # cancelling the run in progress, and must fail the queued requests without running them.
    config = PipelineConfig()
    s0 = config.add_stage(models.endless_stage(), "endless0")
    s1 = config.add_stage(models.endless_stage(), "endless1")
    config.input("x").connect(s0.input("x"))
    s0.output("y").connect(s1.input("x"))
    s1.output("y").connect(config.output("y"))
    pipe = load(models.bundle_of(config, tmp_path), queue_depth=4)
    x = np.ones((2, 4), np.float32)
    futures = [pipe.submit({"x": x}) for _ in range(4)]  # one runs in the first stage, 3 wait for it
    until(lambda: pipe.stats().stages[0].queue_depth == 3, "the first stage runs one request and 3 wait")
    assert pipe.num_executing_pipeline == 4
    workers = [t for t in threading.enumerate() if t.name.startswith("onnxpipe-endless")]
    pipe.close()
    assert workers and not any(t.is_alive() for t in workers)
    for f in futures:
        with pytest.raises(StageError, match="closed before request"):
            f.result(timeout=30)
    with pytest.raises(StageError, match="the pipeline is closed"):
        pipe.submit({"x": x})
    pipe.close()  # twice is fine


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_10000_small_requests_bounded_memory_order_kept(tmp_path: Path, no_thread_left: object) -> None:
    plan = split(models.branchy(), BRANCHY_CUTS[3])
    whole = _whole_runner(models.branchy())
    n = 10_000
    values = np.linspace(-3, 3, n, dtype=np.float32)
    with load(models.bundle_of(plan, tmp_path)) as pipe:
        for _ in pipe.map({"X": np.full((1, 4), v, np.float32)} for v in values[:500]):
            pass
        baseline = _rss_bytes()
        seen = 0
        for i, got in enumerate(pipe.map({"X": np.full((1, 4), v, np.float32)} for v in values)):
            if i % 97 == 0:  # spot-check values; order is checked on every one below
                np.testing.assert_allclose(got["Y"], whole.run(None, {"X": np.full((1, 4), values[i], np.float32)})[0], rtol=1e-6)
            seen += 1
        growth = _rss_bytes() - baseline
        stats = pipe.stats()
    assert seen == n
    assert growth < 32 << 20, f"resident memory grew by {growth / 2**20:.1f} MiB over {n} requests"
    assert all(s.queue_high_water <= s.queue_capacity for s in stats.stages)
    assert stats.in_flight == 0


def test_soak_order_is_exact(tmp_path: Path, no_thread_left: object) -> None:
    """s = relu(x) + relu(x) = 2x for x >= 0, exactly: every output must be twice its own input,
    through a replicated stage whose replicas finish out of order."""
    config = PipelineConfig()
    head, twin = config.add_stage(models.stage_head(), "head"), config.add_stage(models.stage_twin(), "twin")
    twin.configure(replicas=2)
    config.input("x").connect(head.input("x"))
    head.output("h").connect(twin.input("p"))
    head.output("h").connect(twin.input("q"))
    twin.output("s").connect(config.output("s"))
    with load(models.bundle_of(config, tmp_path)) as pipe:
        for i, got in enumerate(pipe.map({"x": np.full((1, 4), float(i), np.float32)} for i in range(3000))):
            assert got["s"][0, 0] == 2.0 * i
        assert pipe.stats().completed == 3000


def test_stats_find_the_bottleneck_and_trace_has_one_track_per_worker(tmp_path: Path, no_thread_left: object) -> None:
    config = PipelineConfig()
    fast = config.add_stage(models.stage_head(), "fast")
    slow = config.add_stage(models.slow_stage(256), "slow")
    slow.configure(replicas=2)
    config.input("x").connect(slow.input("x"))
    slow.output("y").connect(config.output("y"))
    config.add_input(TensorSpec("v", "float32", ("N", 4)))
    config.input("v").connect(fast.input("x"))
    fast.output("h").connect(config.output("h"))
    fast.output("g").connect(config.output("g"))
    with load(models.bundle_of(config, tmp_path), trace=True) as pipe:
        pipe.reset_stats()
        for _ in pipe.map({"x": np.ones((256, 256), np.float32), "v": np.ones((1, 4), np.float32)} for _ in range(40)):
            pass
        stats = pipe.stats()
        assert stats.bottleneck == "slow"
        assert stats.completed == 40 and stats.throughput > 0 and stats.latency_p99_ms >= stats.latency_p50_ms > 0
        by_name = {s.stage: s for s in stats.stages}
        assert by_name["slow"].count == 40 and by_name["slow"].replicas == 2
        assert by_name["slow"].utilization > by_name["fast"].utilization
        assert "bottleneck: slow" in str(stats)
        assert json.loads(json.dumps(stats.to_dict()))["stages"][0]["stage"] in {"fast", "slow"}
        trace = json.loads(pipe.save_trace(tmp_path / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert tracks == {"fast", "slow", "slow #1"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 80 and all(e["dur"] >= 0 for e in slices)


def test_trace_needs_trace_true(tmp_path: Path, no_thread_left: object) -> None:
    with load(_hand_pipeline(tmp_path)) as pipe, pytest.raises(StageError, match="load the pipeline with trace=True"):
        pipe.save_trace(tmp_path / "t.json")


def test_affinity_is_applied_and_refusals_are_clear(tmp_path: Path, no_thread_left: object) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    config = PipelineConfig()
    head = config.add_stage(models.stage_head(), "head")
    head.configure(affinity=[allowed[-1]], intra_op_threads=1)
    config.input("x").connect(head.input("x"))
    head.output("h").connect(config.output("h"))
    bundle = models.bundle_of(config, tmp_path / "ok")
    seen: list[set[int]] = []
    with load(bundle) as pipe:
        worker = next(t for t in threading.enumerate() if t.name.startswith("onnxpipe-head"))
        seen.append(os.sched_getaffinity(worker.native_id))
        pipe({"x": np.ones((1, 4), np.float32)})
    assert seen == [{allowed[-1]}]
    config.stage("head").configure(affinity=[4096])
    with pytest.raises(ConfigError, match=r"affinity names core\(s\) \[4096\] this process may not use; allowed cores: "):
        load(models.bundle_of(config, tmp_path / "bad"))


def test_a_pipeline_dropped_without_close_stops_its_workers(tmp_path: Path, no_thread_left: object) -> None:
    import gc

    pipe = load(_hand_pipeline(tmp_path))
    pipe({"x": np.ones((1, 4), np.float32)})
    workers = [t for t in threading.enumerate() if t.name.startswith("onnxpipe-")]
    del pipe
    gc.collect()
    for t in workers:
        t.join(2)
    assert not any(t.is_alive() for t in workers)


def test_the_caller_owns_its_outputs(tmp_path: Path, no_thread_left: object) -> None:
    """No output buffer is reused under the caller: outputs kept from early requests keep their values."""
    plan = split(models.branchy(), BRANCHY_CUTS[3])
    whole = _whole_runner(models.branchy())
    inputs = [{"X": np.full((1, 4), i / 10, np.float32)} for i in range(100)]
    with load(models.bundle_of(plan, tmp_path)) as pipe:
        kept = list(pipe.map(inputs))
        for _ in pipe.map(inputs[::-1]):  # more traffic after the first outputs were handed out
            pass
    arrays = [k["Y"] for k in kept]
    assert not any(np.shares_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1 :])
    for got, x in zip(arrays, inputs, strict=True):
        np.testing.assert_allclose(got, whole.run(None, x)[0], rtol=1e-6)
