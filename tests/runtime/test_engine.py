"""The thread engine with fake stages (no onnxruntime): ordering, isolation and shutdown are
properties of the scheduling, not of the models."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from onnxpipe import StageError
from onnxpipe.runtime import Endpoint, Link, PipelineSpec, StageSettings, StageSpec, TensorSpec
from onnxpipe.runtime._engine import ThreadEngine
from onnxpipe.runtime._stage import Request, StagePlan, StageRunner, plan_stages


class FakeSession:
    """Adds ``add`` to its input after a random short sleep; fails on requests whose value is in ``fail_on``."""

    def __init__(self, add: float, fail_on: set[float], delay: float) -> None:
        self.add, self.fail_on, self.delay = add, fail_on, delay

    def run(self, names: Any, feeds: dict[str, float], options: Any = None) -> list[float]:
        (value,) = feeds.values()
        time.sleep(random.uniform(0, self.delay))
        if value in self.fail_on:
            raise RuntimeError(f"cannot take {value}")
        return [value + self.add]


class HeldSession:
    """Holds every run until its ``RunOptions.terminate`` is set (what onnxruntime honours while it
    runs): a run that can end only by being cancelled. Counts the runs it started."""

    def __init__(self) -> None:
        self.started = 0
        self.lock = threading.Lock()

    def run(self, names: Any, feeds: dict[str, float], options: Any = None) -> list[float]:
        with self.lock:
            self.started += 1
        deadline = time.monotonic() + 30
        while not options.terminate:
            assert time.monotonic() < deadline, "the run was never cancelled"
            time.sleep(0.001)
        raise RuntimeError("run stopped: RunOptions.terminate was set")


def _collect(count: int, key: Any = None) -> tuple[dict[int, Any], Any, threading.Event]:
    """What finished requests leave (``key(request)`` by id), the ``done`` callback that records
    them (once each), and an event set once ``count`` have."""
    done: dict[int, Any] = {}
    lock, all_in = threading.Lock(), threading.Event()

    def finish(r: Request) -> None:
        with lock:
            assert r.id not in done
            done[r.id] = r if key is None else key(r)
            if len(done) == count:
                all_in.set()

    return done, finish, all_in


def _chain_spec(n: int, replicas: int) -> PipelineSpec:
    t = TensorSpec
    stages = tuple(
        StageSpec(f"s{i}", f"s{i}.onnx", (t("v", "float32"),), (t("v", "float32"),), settings=StageSettings(replicas=replicas if i == 1 else 1))
        for i in range(n)
    )
    links = [Link(Endpoint(None, "v"), Endpoint("s0", "v"))]
    links += [Link(Endpoint(f"s{i}", "v"), Endpoint(f"s{i + 1}", "v")) for i in range(n - 1)]
    links += [Link(Endpoint(f"s{n - 1}", "v"), Endpoint(None, "v"))]
    return PipelineSpec((t("v", "float32"),), (t("v", "float32"),), stages, tuple(links))


def _engine(
    n: int = 3, replicas: int = 3, fail_on: set[float] | None = None, delay: float = 0.002, queue_depth: int = 2
) -> tuple[ThreadEngine, Endpoint]:
    plans, finals = plan_stages(_chain_spec(n, replicas))

    def factory(plan: StagePlan, replica: int) -> Any:
        # Stage 1 fails for the listed values (as they arrive there: input + 1).
        return StageRunner(plan, FakeSession(1.0, (fail_on or set()) if plan.stage.name == "s1" else set(), delay))

    return ThreadEngine(plans, factory, queue_depth=queue_depth), finals["v"]


@pytest.mark.parametrize("queue_depth", [1, 2, 4, 7], ids=lambda d: f"depth{d}")
def test_every_request_finishes_once_with_its_own_value(queue_depth: int) -> None:
    # Depths of 4 and more make the workers give slots back in batches, with 3 replicas reading one queue.
    engine, final = _engine(queue_depth=queue_depth)
    done, finish, all_in = _collect(200, lambda r: r.values[final])
    for i in range(200):
        engine.submit(Request(i, {Endpoint(None, "v"): float(i)}, {}, time.perf_counter(), done=finish))
    assert all_in.wait(60), f"{len(done)} of 200 requests finished"
    assert engine.close() == []
    assert done == {i: i + 3.0 for i in range(200)}
    # Bounded queues: nothing ever held more than its capacity.
    assert all(high <= cap for _, high, cap in engine.queues())


def test_a_failure_is_confined_to_its_request_and_later_stages_skip_it() -> None:
    engine, _ = _engine(fail_on={11.0})
    results, finish, all_in = _collect(30)
    for i in range(30):
        engine.submit(Request(i, {Endpoint(None, "v"): float(i)}, {}, time.perf_counter(), done=finish))
    assert all_in.wait(60), f"{len(results)} of 30 requests finished"
    engine.close()
    failed = {i for i, r in results.items() if r.error is not None}
    assert failed == {10}
    assert isinstance(results[10].error, StageError) and "stage 's1' failed on request 10" in str(results[10].error)
    assert sum(r.count for r in engine.recorders()[2]) == 29  # s2 never ran the failed request


def test_close_returns_unfinished_requests_promptly() -> None:
    # Every run is held until it is cancelled: close() returns only by cancelling the runs in
    # progress (not by waiting for them) and starts none of the queued ones.
    plans, _ = plan_stages(_chain_spec(3, 3))
    sessions = {p.stage.name: HeldSession() for p in plans}
    engine = ThreadEngine(plans, lambda p, r: StageRunner(p, sessions[p.stage.name]), queue_depth=2)
    finished: list[Request] = []
    for i in range(3):  # the first stage's worker holds one, its queue the other 2: submit never waits
        engine.submit(Request(i, {Endpoint(None, "v"): float(i)}, {}, time.perf_counter(), done=finished.append))
    deadline = time.monotonic() + 30
    while sessions["s0"].started == 0:  # the first stage's run is in progress
        assert time.monotonic() < deadline, "the first stage never started a run"
        time.sleep(0.001)
    left = engine.close()
    assert sorted(r.id for r in left) == [0, 1, 2] and finished == []
    assert [s.started for s in sessions.values()] == [1, 0, 0]  # the queued ones never ran
    assert not any(t.is_alive() for t in engine.threads)


def test_queue_depth_must_be_positive() -> None:
    plans, _ = plan_stages(_chain_spec(2, 1))
    with pytest.raises(Exception, match="queue_depth must be at least 1"):
        ThreadEngine(plans, lambda p, r: StageRunner(p, FakeSession(0, set(), 0)), queue_depth=0)


class RecordingSession:
    """Returns a new array per run and records the objects it was fed."""

    def __init__(self) -> None:
        self.fed: list[object] = []
        self.made: list[object] = []

    def run(self, names: Any, feeds: dict[str, Any], options: Any = None) -> list[Any]:
        import numpy as np

        (value,) = feeds.values()
        self.fed.append(value)
        out = np.asarray(value) + 1
        self.made.append(out)
        return [out]


def test_stages_hand_over_the_very_arrays_they_make() -> None:
    """Zero copies between stages: stage s+1 is fed the object stage s returned, not a copy."""
    import numpy as np

    plans, final = plan_stages(_chain_spec(3, 1))
    sessions = {p.stage.name: RecordingSession() for p in plans}
    engine = ThreadEngine(plans, lambda p, r: StageRunner(p, sessions[p.stage.name]), queue_depth=2)
    finished, finish, all_in = _collect(20)
    inputs = [np.full(4, float(i)) for i in range(20)]
    for i, x in enumerate(inputs):
        engine.submit(Request(i, {Endpoint(None, "v"): x}, {}, time.perf_counter(), done=finish))
    assert all_in.wait(60), f"{len(finished)} of 20 requests finished"
    engine.close()
    done = list(finished.values())
    assert [id(a) for a in sessions["s0"].fed] == [id(x) for x in inputs]
    assert [id(a) for a in sessions["s1"].fed] == [id(a) for a in sessions["s0"].made]
    assert [id(a) for a in sessions["s2"].fed] == [id(a) for a in sessions["s1"].made]
    assert [id(r.values[final["v"]]) for r in sorted(done, key=lambda r: r.id)] == [id(a) for a in sessions["s2"].made]
