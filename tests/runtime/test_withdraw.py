"""Withdrawing a request (``future.cancel()``) before its first stage takes it: no stage runs it, in
the thread engine (a stage alone and a stage that batches) and on Ray; a request already taken, and
a stream's step, cannot be withdrawn and finish."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import Endpoint, Link, Pipeline, PipelineSpec, RayOptions, StageSettings, StageSpec, TensorSpec, load
from onnxpipe.runtime._engine import ThreadEngine
from onnxpipe.runtime._stage import Call, Request, StagePlan, plan_stages
from onnxpipe.splitter import split
from tests import code_stages, models
from tests.stateful_models import recurrent


def _gated(folder: Path, entry: str = "tests.code_stages:gated", params: dict[str, Any] | None = None) -> Path:
    """``x [N, 4] -> y = x`` through one code stage that holds each request until its gate opens."""
    config = PipelineConfig("gated")
    ports = [TensorSpec("x", "float32", ("N", 4))], [TensorSpec("y", "float32", ("N", 4))]
    stage = config.add_python_stage(entry, inputs=ports[0], outputs=ports[1], params=params or {}, name="gate")
    config.input("x").connect(stage.input("x"))
    stage.output("y").connect(config.output("y"))
    return models.bundle_of(config, folder)


def _x(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 4), value, np.float32)}


def _until(what: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@pytest.fixture()
def gate() -> Iterator[threading.Event]:
    code_stages.GATE.clear()
    yield code_stages.GATE
    code_stages.GATE.set()  # whatever happened, nothing stays held


def test_a_queued_request_withdrawn_never_runs_and_a_running_one_finishes(tmp_path: Path, gate: threading.Event) -> None:
    with load(_gated(tmp_path), allow_code=["tests.*"], queue_depth=4) as pipe:
        first = pipe.submit(_x(1))
        _until(first.running)  # the stage took it, and holds it at the gate
        second, third = pipe.submit(_x(2)), pipe.submit(_x(3))
        assert not second.running() and second.cancel() and second.cancelled()
        assert not first.cancel()  # running: it cannot be withdrawn
        gate.set()
        np.testing.assert_array_equal(first.result(10)["y"], _x(1)["x"])
        np.testing.assert_array_equal(third.result(10)["y"], _x(3)["x"])
        with pytest.raises(CancelledError):
            second.result()
        _until(lambda: pipe.num_executing_pipeline == 0)  # the withdrawn one passed the stage, untouched
        stats = pipe.stats()
        assert stats.stages[0].count == 2  # it ran the first and the third only
        assert (stats.completed, stats.failed) == (2, 0)  # a withdrawn request counts as neither


def test_a_streams_step_is_running_from_the_start(tmp_path: Path) -> None:
    with load(models.bundle_of(split(recurrent(), ["state1N"], states="auto"), tmp_path)) as pipe, pipe.stream() as stream:
        step = stream.submit(_x(0.5))
        assert not step.cancel()  # a step left out would leave the state a step behind
        assert step.result(10)["y"].shape == (1, 4)


class _HeldBatcher:
    """A first stage that batches (``max_batch`` 4) and holds its first call until ``release`` is
    set: it records which requests it ran."""

    session = None

    def __init__(self, plan: StagePlan) -> None:
        self.plan, self.name, self.max_batch = plan, plan.stage.name, 4
        self.ran: list[int] = []
        self.busy, self.release = threading.Event(), threading.Event()

    def run_many(self, requests: Sequence[Request]) -> list[Call]:
        self.busy.set()
        assert self.release.wait(10)
        live = [r for r in requests if r.error is None]
        self.ran += [r.id for r in live]
        now = time.perf_counter()
        return [Call(tuple(r.id for r in live), now, now, len(live))] if live else []

    def cancel(self) -> None:
        pass


def test_a_stage_that_batches_passes_over_the_withdrawn_members_of_what_it_took() -> None:
    v = TensorSpec("v", "float32")
    spec = PipelineSpec((v,), (v,), (StageSpec("s0", "s0.onnx", (v,), (v,), settings=StageSettings(max_batch=4)),),
                        (Link(Endpoint(None, "v"), Endpoint("s0", "v")), Link(Endpoint("s0", "v"), Endpoint(None, "v"))))
    plans, _ = plan_stages(spec)
    runners: list[_HeldBatcher] = []

    def factory(plan: StagePlan, replica: int) -> Any:
        runners.append(_HeldBatcher(plan))
        return runners[-1]

    engine = ThreadEngine(plans, factory, queue_depth=4)
    done: dict[int, BaseException | None] = {}
    futures = [Future[Any]() for _ in range(4)]
    try:
        for i, future in enumerate(futures):
            engine.submit(Request(i, {}, {}, time.perf_counter(), done=lambda r: done.__setitem__(r.id, r.error), claim=future.set_running_or_notify_cancel))
            if i == 0:
                _until(runners[0].busy.is_set)  # request 0 is being run; 1-3 wait in the queue
        assert futures[2].cancel()
        runners[0].release.set()
        _until(lambda: len(done) == 4)
    finally:
        runners[0].release.set()
        assert engine.close() == []
    assert runners[0].ran == [0, 1, 3]
    assert done[0] is None and done[1] is None and done[3] is None
    assert isinstance(done[2], CancelledError) and str(done[2]) == "request 2 was withdrawn before it started"


@pytest.mark.xdist_group("ray")
def test_on_ray_a_request_waiting_for_its_first_actor_is_withdrawn(ray_cluster: Any, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    bundle = _gated(tmp_path, "tests.code_stages:matmul_when_file", {"path": str(gate)})
    pipe: Pipeline
    with load(bundle, engine="ray", allow_code=["tests.*"], queue_depth=4, ray_options=RayOptions(requests_per_call=1)) as pipe:
        # Two calls go to the actor at once (both taken); the others wait in the driver for room.
        futures = [pipe.submit(_x(k)) for k in range(4)]
        assert [f.running() for f in futures] == [True, True, False, False]
        assert futures[2].cancel()
        gate.touch()
        for k in (0, 1, 3):
            np.testing.assert_allclose(futures[k].result(60)["y"], _x(k)["x"])
        _until(lambda: pipe.num_executing_pipeline == 0)
        assert pipe.stats().stages[0].count == 3
