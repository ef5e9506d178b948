"""A stream's errors carry their facts as fields, and their text is rendered from them (Note: a
stream's errors carry facts, each layer says them, onnxpipe/_errors.py): what each constructor says
in the runtime's words, the fields a live pipeline's refusals and failures carry, and that both
survive pickling (an engine in another process sends them back whole).

Models: tests/stateful_models.py ``recurrent()`` cut at ``state1N`` (a state in each of 2 stages), and
``growing(reshaped=True)``, whose Reshape fails for any ``shape`` but ``[1, 1]``: as one stage
(it fails before committing: the state is unchanged), or cut at ``sum`` (its first stage has taken
the step when its second fails: the state is no longer valid).
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import numpy as np
import pytest

from onnxpipe import Closure, InputError, Remedy, StageError, StateDimError, StreamError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import load
from onnxpipe.splitter import split
from tests.models import bundle_of
from tests.stateful_models import growing, recurrent

X = {"x": np.ones((1, 4), np.float32)}
ONE = {"x": np.ones((1, 1), np.float32), "shape": np.array([1, 1])}
BAD = {"x": np.ones((1, 1), np.float32), "shape": np.array([2, 2])}


@pytest.fixture(scope="module")
def rnn_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundle_of(split(recurrent(), ["state1N"], states="auto"), tmp_path_factory.mktemp("rnn"))


def _one_stage() -> PipelineConfig:
    """``growing(reshaped=True)`` as one stage, its state fed back within it."""
    config = PipelineConfig("grow")
    stage = config.add_stage(growing(reshaped=True), "only")
    for name in ("x", "shape"):
        config.input(name).connect(stage.input(name))
    stage.output("y").connect(config.output("y"))
    config.add_state(stage.output("stateN"), stage.input("state"), empty_axis=1)
    return config


def _failure() -> StageError:
    return StageError("stage 'stage1' failed on request 7: boom", stage="stage1", request=7)


def test_each_constructor_renders_the_runtime_words_from_its_fields() -> None:
    lost = StreamError.state_lost("stage1", [3], "the actor holding it (replica 0) died (killed)", request=7)
    bad = StreamError.step_failed(_failure(), 2, ["stage0"])
    held = StreamError.step_failed(StageError("stage 'stage1' failed on request 7: boom", stage="stage1", request=7, held="its state 'h' is [0, 4]"), 2, [])
    said = {
        StreamError.closed(3, Closure("owner")): "stream 3 is closed (closed by its owner); open a new one with pipe.stream()",
        StreamError.closed(3, Closure("idle", 0.3)):
            "stream 3 is closed (it was idle for more than stream_timeout=0.3 s, and its state was freed); open a new one with pipe.stream()",
        StreamError.closed(3, Closure("pipeline")): "stream 3 is closed (its pipeline was closed); open a new one with pipe.stream()",
        StreamError.step_failed(_failure(), 2, []):
            "stage 'stage1' failed on request 7: boom; the stream's state is unchanged (as after step 1): the stream can go on",
        bad: "stage 'stage1' failed on request 7: boom; the stream's state is no longer valid: stage(s) 'stage0' took step 2 and stage 'stage1' did not; "
             "close the stream",
        StreamError.refused(3, 2, bad):
            "stream 3 cannot take more steps: step 2 failed in stage 'stage1' after stage(s) 'stage0' had updated their state; close it and open a new one",
        lost: "stage 'stage1' lost the state of stream 3: the actor holding it (replica 0) died (killed); close the stream",
        StreamError.state_lost("stage1", [3, 4], "its actor died (x)"): "stage 'stage1' lost the state of streams 3, 4: its actor died (x); close the stream",
        StreamError.refused(3, 2, lost): f"stream 3 cannot take more steps: step 2 failed: {lost}; close it and open a new one",
        held: "stage 'stage1' failed on request 7: boom; stage 'stage1' ran the step on the state it holds (as after step 1), and that state "
              "does not fit it: its state 'h' is [0, 4]; every later step would fail on it too: close the stream",
        StreamError.refused(3, 2, held): "stream 3 cannot take more steps: step 2 failed in stage 'stage1' on the state it holds (its state 'h' is [0, 4]); "
                                         "close it and open a new one",
        StreamError.too_many(2, [0, 1]): "max_streams=2 streams are open already (ids 0, 1); close one first, or load the pipeline with a larger max_streams",
        StateDimError(stream=3, step=1, name="x", dim="batch", size=2, bound=1):
            "stream 3, step 1: input 'x' has batch=2, but the stream's state was made with batch=1 on its first step; open a new stream for another batch",
    }
    for error, text in said.items():
        assert str(error) == text
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == text
        assert {k: v for k, v in vars(again).items() if k != "cause"} == {k: v for k, v in vars(error).items() if k != "cause"}
        assert str(getattr(again, "cause", None)) == str(getattr(error, "cause", None))
    assert (lost.remedy, lost.state_valid, lost.stage, lost.request, lost.streams) == (Remedy.CLOSE, False, "stage1", 7, (3,))
    assert (bad.remedy, bad.state_valid, bad.step, bad.took, bad.stage, bad.request) == (Remedy.CLOSE, False, 2, ("stage0",), "stage1", 7)
    assert (held.remedy, held.state_valid, held.detail) == (Remedy.CLOSE, False, "its state 'h' is [0, 4]")
    assert str(StreamError("the pipeline is closed")) == "the pipeline is closed" and StreamError("x").remedy is None


def test_a_closed_stream_says_why_as_facts(rnn_bundle: Path) -> None:
    with load(rnn_bundle, stream_timeout=0.2) as pipe:
        owned, idle = pipe.stream(), pipe.stream()
        owned.step(X)
        owned.close()
        with pytest.raises(StreamError) as refused:
            owned.step(X)
        e = refused.value
        assert (e.remedy, e.stream, e.closure, e.state_valid, e.stage) == (Remedy.REOPEN, owned.id, Closure("owner"), None, None)
        assert owned.closure == Closure("owner") and owned.closed_because == "closed by its owner"
        deadline = time.monotonic() + 30
        while not pipe.close_idle_streams() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert idle.closure == Closure("idle", 0.2)
        with pytest.raises(StreamError) as refused:
            idle.step(X)
        assert (refused.value.remedy, refused.value.closure) == (Remedy.REOPEN, Closure("idle", 0.2))
        still = pipe.stream()
    assert still.closure == Closure("pipeline") and still.closed_because == "its pipeline was closed"


def test_refusals_to_open_and_to_size_a_state_again_carry_their_facts(rnn_bundle: Path) -> None:
    with load(rnn_bundle, max_streams=2) as pipe:
        a, b = pipe.stream(), pipe.stream()
        with pytest.raises(StreamError) as refused:
            pipe.stream()
        assert (refused.value.remedy, refused.value.limit, refused.value.open_ids) == (Remedy.MAKE_ROOM, 2, (a.id, b.id))
        a.step(X)
        with pytest.raises(StateDimError) as resized:
            a.step({"x": np.ones((2, 4), np.float32)})
        e = resized.value
        assert isinstance(e, InputError) and (e.remedy, e.stream, e.step, e.name, e.dim, e.size, e.bound) == (Remedy.NEW_STREAM, a.id, 1, "x", "batch", 2, 1)
        a.step(X)  # the stream goes on


def test_a_failed_step_says_whether_the_stream_can_go_on(tmp_path: Path) -> None:
    with load(bundle_of(_one_stage(), tmp_path / "one")) as pipe, pipe.stream() as s:
        s.step(ONE)
        with pytest.raises(StreamError) as failed:
            s.step(BAD)
        e = failed.value
        assert (e.remedy, e.state_valid, e.step, e.took) == (Remedy.GO_ON, True, 1, ())
        assert isinstance(e.cause, StageError) and e.stage == e.cause.stage and str(e).startswith(str(e.cause))
        s.step(ONE)  # as after step 0
    with load(bundle_of(split(growing(reshaped=True), ["sum"], states="auto"), tmp_path / "two")) as pipe, pipe.stream() as s:
        s.step(ONE)
        with pytest.raises(StreamError) as failed:
            s.step(BAD)
        e = failed.value
        first, second = (st.name for st in pipe.spec.stages)
        assert (e.remedy, e.state_valid, e.step, e.took, e.stage) == (Remedy.CLOSE, False, 1, (first,), second)
        with pytest.raises(StreamError) as refused:
            s.step(ONE)
        r = refused.value
        assert (r.remedy, r.state_valid, r.stream, r.step) == (Remedy.RESTART, False, s.id, 1) and r.cause is e
