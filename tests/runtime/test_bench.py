"""runtime.benchmark(): its report, and where it runs the thread feeding the pipeline (no timing is
asserted)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe import ConfigError, StageError
from onnxpipe.runtime import benchmark, load
from tests import models

CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hand-wired bundle with head, twin and tail pinned to cores 0, 1, 0 (of this process's)."""
    config = models.hand_wired()
    for k, stage in enumerate(config.stages):
        stage.configure(affinity=[CORES[k % 2 % len(CORES)]])
    return models.bundle_of(config, tmp_path_factory.mktemp("bench") / "pinned")


@pytest.fixture(scope="module")
def unpinned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.bundle_of(models.hand_wired(), tmp_path_factory.mktemp("bench") / "unpinned")


def test_the_report_covers_every_stage(unpinned: Path) -> None:
    with load(unpinned) as pipe:
        report = benchmark(pipe, 20, warmup=2, standalone_runs=3, dims={"N": 2})
    assert report.requests == 20 and report.throughput > 0 and report.efficiency is not None and report.efficiency > 0
    assert [s.stage for s in report.stages] == ["head", "twin", "tail"]
    assert all(s.standalone_ms > 0 and s.pipeline_mean_ms > 0 for s in report.stages)
    assert report.caller_cores is None and report.notes == ()


def test_auto_puts_the_caller_on_the_cores_of_the_stage_with_the_most_slack(pinned: Path) -> None:
    before = os.sched_getaffinity(0)
    with load(pinned) as pipe:
        report = benchmark(pipe, 20, warmup=2, standalone_runs=3, dims={"N": 2}, caller_cores="auto")
        slack = min(report.stages, key=lambda s: s.standalone_ms / s.replicas)
        assert report.caller_cores == tuple(pipe.spec.stage(slack.stage).settings.affinity or ())
    assert os.sched_getaffinity(0) == before, "the caller's affinity is restored"


def test_given_cores_are_used_and_restored(unpinned: Path) -> None:
    before = os.sched_getaffinity(0)
    with load(unpinned) as pipe:
        report = benchmark(pipe, 5, warmup=0, standalone_runs=0, dims={"N": 2}, caller_cores=[CORES[-1]])
    assert report.caller_cores == (CORES[-1],)
    assert os.sched_getaffinity(0) == before


def test_auto_leaves_the_caller_alone_when_it_cannot_choose(pinned: Path, unpinned: Path) -> None:
    with load(unpinned) as pipe:
        report = benchmark(pipe, 5, warmup=0, standalone_runs=3, dims={"N": 2}, caller_cores="auto")
    assert report.caller_cores is None
    assert report.notes == ("the calling thread was left unpinned: no stage is pinned to cores",)
    with load(pinned) as pipe:
        report = benchmark(pipe, 5, warmup=0, standalone_runs=0, dims={"N": 2}, caller_cores="auto")
    assert report.caller_cores is None
    assert report.notes == ("the calling thread was left unpinned: choosing its cores needs the stages' standalone times (standalone runs were 0)",)


def test_cores_the_process_may_not_use_are_refused_before_any_request(unpinned: Path) -> None:
    before = os.sched_getaffinity(0)
    with load(unpinned) as pipe:
        refused = f"cannot pin the calling thread to cores [4096]: Invalid argument; this process may use cores {CORES}"
        with pytest.raises(ConfigError, match=re.escape(refused)):
            benchmark(pipe, 5, warmup=0, standalone_runs=0, dims={"N": 2}, caller_cores=[4096])
        assert pipe.stats().completed == 0
    assert os.sched_getaffinity(0) == before


def test_stages_are_timed_alone_on_the_pipelines_own_sessions(unpinned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No stage ever has two sessions (two copies of its weights): benchmark() creates none, and
    times each stage on the session its pipeline worker runs, fed values those sessions computed."""
    import onnxruntime as ort

    from onnxpipe.runtime import _bench

    with load(unpinned) as pipe:
        own = [r.session for r in pipe.idle_runners()]
        created: list[object] = []
        timed: list[object] = []
        real_session, real_time = ort.InferenceSession, _bench._time_runs
        monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: created.append(a) or real_session(*a, **k))
        monkeypatch.setattr(_bench, "_time_runs", lambda session, *a: timed.append(session) or real_time(session, *a))
        report = benchmark(pipe, 5, warmup=1, standalone_runs=2, dims={"N": 2})
    assert created == []
    assert [id(s) for s in timed] == [id(s) for s in own]
    assert all(s.standalone_ms > 0 for s in report.stages)


class _Held:
    """A session whose runs wait for ``release``: keeps a request in flight."""

    def __init__(self, session: Any, release: threading.Event) -> None:
        self.session, self.release = session, release

    def run(self, *args: Any) -> Any:
        self.release.wait(5)
        return self.session.run(*args)


def test_stages_run_alone_only_while_the_pipeline_is_idle(unpinned: Path) -> None:
    with load(unpinned) as pipe:
        first = pipe.idle_runners()[0]
        release = threading.Event()
        first.session = _Held(first.session, release)
        future = pipe.submit({"x": np.ones((2, 4), np.float32)})
        with pytest.raises(StageError, match=r"1 request\(s\) are in flight; stages run alone only while the pipeline is idle"):
            pipe.idle_runners()
        release.set()
        future.result()
        assert [r.name for r in pipe.idle_runners()] == ["head", "twin", "tail"]
