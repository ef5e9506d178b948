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
    done: dict[int, float] = {}
    lock = threading.Lock()

    def finish(r: Request) -> None:
        with lock:
            assert r.id not in done
            done[r.id] = r.values[final]

    for i in range(200):
        engine.submit(Request(i, {Endpoint(None, "v"): float(i)}, {}, time.perf_counter(), done=finish))
    deadline = time.monotonic() + 10
    while len(done) < 200 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.close() == []
    assert done == {i: i + 3.0 for i in range(200)}
    # Bounded queues: nothing ever held more than its capacity.
    assert all(high <= cap for _, high, cap in engine.queues())


def test_a_failure_is_confined_to_its_request_and_later_stages_skip_it() -> None:
    engine, _ = _engine(fail_on={11.0})
    results: dict[int, Request] = {}
    for i in range(30):
        engine.submit(Request(i, {Endpoint(None, "v"): float(i)}, {}, time.perf_counter(), done=lambda r: results.__setitem__(r.id, r)))
    deadline = time.monotonic() + 10
    while len(results) < 30 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.close()
    failed = {i for i, r in results.items() if r.error is not None}
    assert failed == {10}
    assert isinstance(results[10].error, StageError) and "stage 's1' failed on request 10" in str(results[10].error)
    assert sum(r.count for r in engine.recorders()[2]) == 29  # s2 never ran the failed request


def test_close_returns_unfinished_requests_promptly() -> None:
    engine, _ = _engine(delay=0.2)
    for i in range(6):
        engine.submit(Request(i, {Endpoint(None, "v"): float(i)}, {}, time.perf_counter(), done=lambda r: None))
    start = time.perf_counter()
    left = engine.close()
    assert time.perf_counter() - start < 1.0
    assert left and all(isinstance(r, Request) for r in left)
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
    done: list[Request] = []
    inputs = [np.full(4, float(i)) for i in range(20)]
    for i, x in enumerate(inputs):
        engine.submit(Request(i, {Endpoint(None, "v"): x}, {}, time.perf_counter(), done=done.append))
    deadline = time.monotonic() + 5
    while len(done) < 20 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.close()
    assert [id(a) for a in sessions["s0"].fed] == [id(x) for x in inputs]
    assert [id(a) for a in sessions["s1"].fed] == [id(a) for a in sessions["s0"].made]
    assert [id(a) for a in sessions["s2"].fed] == [id(a) for a in sessions["s1"].made]
    assert [id(r.values[final["v"]]) for r in sorted(done, key=lambda r: r.id)] == [id(a) for a in sessions["s2"].made]
