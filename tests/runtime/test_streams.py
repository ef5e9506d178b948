"""Streams: state that stays in its stage (issue 14).

Models come from tests/stateful_models.py: a two-layer recurrent model (one state per stage once cut
at ``state1N``) and a small GPT decoder with optimum's names, cut between layers. The reference is
always the whole model in one onnxruntime session with the state fed by hand. Tolerances: the
recurrent outputs and decoder logits agree within 1e-5 (stage sessions and the whole model may fuse
ops differently); generated tokens must be equal.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe import ConfigError, InputError, StreamError
from onnxpipe.runtime import Pipeline, load
from onnxpipe.splitter import split
from tests.models import bundle_of
from tests.stateful_models import decoder_feeds, generate, gpt_decoder, growing, recurrent, whole_generate, whole_recurrent
from tests.waiting import skip_if_stalled

PROMPTS = ([1, 2, 3], [5], [7, 8, 9, 10, 11], [40, 41])
DECODER_CUTS = {2: ["layer1.out"], 3: ["layer0.out", "layer2.out"]}


@pytest.fixture(scope="module")
def decoder_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    model = gpt_decoder()
    return {n: bundle_of(split(model, cuts, states="auto"), tmp_path_factory.mktemp(f"dec{n}")) for n, cuts in DECODER_CUTS.items()}


@pytest.fixture()
def rnn(rnn_bundle: Path) -> Iterator[Pipeline]:
    with load(rnn_bundle) as pipe:
        yield pipe


def _held(pipe: Pipeline) -> list[tuple[int, ...] | None]:
    """The streams each replica of each stage holds state of, in pipeline order (``Pipeline.diagnostics``)."""
    return [r.streams for stage in pipe.diagnostics().stages for r in stage.replicas]


def _steps(seed: int, count: int = 6, batch: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, 4)).astype(np.float32) for _ in range(count)]


# -- the recurrent model ---------------------------------------------------------------------------


def test_split_pairs_states_and_keeps_each_in_its_stage() -> None:
    plan = split(recurrent(), ["state1N"], states="auto")
    spec = plan.spec
    assert [(s.stage, s.output, s.input, s.empty_axis) for s in spec.states] == [("stage0", "state1N", "state1", None), ("stage1", "state2N", "state2", None)]
    assert [t.name for t in spec.inputs] == ["x"] and [t.name for t in spec.outputs] == ["y"]
    assert "state: state1N -> state1 (starts as zeros)" in str(plan)


def test_eight_streams_interleaved_equal_each_stream_alone(rnn: Pipeline) -> None:
    """Every step of every stream submitted round-robin without waiting: stage 0 runs one stream's
    step while stage 1 runs another's, and each stream's outputs equal the whole model's, step for step."""
    model = recurrent()
    inputs = [_steps(seed, batch=1 + seed % 3) for seed in range(8)]
    streams = [rnn.stream() for _ in inputs]
    futures: list[list[Any]] = [[] for _ in inputs]
    for t in range(6):
        for s, xs in enumerate(inputs):
            futures[s].append(streams[s].submit({"x": xs[t]}))
    for s, xs in enumerate(inputs):
        got = [f.result()["y"] for f in futures[s]]
        for t, (a, b) in enumerate(zip(got, whole_recurrent(model, xs), strict=True)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"stream {s} step {t}")
    assert sorted(k for held in _held(rnn) for k in held) == sorted(list(range(8)) * 2)
    for stream in streams:
        stream.close()
    assert _held(rnn) == [(), ()]


def test_replicas_pin_each_stream_to_one_replica(tmp_path: Path) -> None:
    plan = split(recurrent(), ["state1N"], states="auto")
    for stage in plan.config.stages:
        stage.configure(replicas=2)
    model = recurrent()
    with load(bundle_of(plan, tmp_path)) as pipe:
        streams = [pipe.stream() for _ in range(5)]
        inputs = [_steps(10 + s) for s in range(5)]
        futures = [[streams[s].submit({"x": x}) for s, x in ((s, inputs[s][t]) for s in range(5))] for t in range(6)]
        for s in range(5):
            got = [futures[t][s].result()["y"] for t in range(6)]
            np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(model, inputs[s])), rtol=1e-5, atol=1e-5)
        assert [[r.streams for r in stage.replicas] for stage in pipe.diagnostics().stages] == [[(0, 2, 4), (1, 3)]] * 2
        for stream in streams:
            stream.close()
        assert _held(pipe) == [()] * 4


def test_stateless_api_is_refused_for_a_pipeline_with_state(rnn: Pipeline) -> None:
    with pytest.raises(StreamError, match=r"keeps state between steps .*pipe\.stream\(\)"):
        rnn({"x": _steps(0)[0]})
    with pytest.raises(StreamError, match="pipe.stream"):
        rnn.submit({"x": _steps(0)[0]})
    with rnn.stream() as s:  # nothing disturbed
        np.testing.assert_allclose(s.step({"x": _steps(0)[0]})["y"], whole_recurrent(recurrent(), _steps(0)[:1])[0], rtol=1e-5, atol=1e-5)


# -- the decoder -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3])
def test_greedy_generation_of_interleaved_streams_equals_the_whole_model(decoder_bundles: dict[int, Path], stages: int) -> None:
    """4 prompts, 32 tokens each, one thread per stream stepping at once; each stream's tokens equal
    greedy generation with the whole model in one session."""
    model = gpt_decoder()
    expected = [whole_generate(model, p, 32) for p in PROMPTS]
    results: dict[int, tuple[list[int], list[np.ndarray]]] = {}
    with load(decoder_bundles[stages]) as pipe:
        assert len(pipe.spec.stages) == stages
        assert [t.name for t in pipe.spec.inputs] == ["input_ids", "attention_mask", "position_ids"]
        assert [t.name for t in pipe.spec.outputs] == ["logits"]

        def run(i: int) -> None:
            with pipe.stream() as s:
                results[i] = generate(s.step, PROMPTS[i], 32)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(held == () for held in _held(pipe))
    for i, (tokens, logits) in enumerate(expected):
        assert results[i][0] == tokens, f"prompt {i}"
        np.testing.assert_allclose(np.stack(results[i][1]), np.stack(logits), rtol=1e-5, atol=1e-5)


def test_streams_do_not_see_each_others_state(decoder_bundles: dict[int, Path]) -> None:
    """Two streams with one prompt, stepped alternately with a third stream between them, stay equal."""
    with load(decoder_bundles[2]) as pipe, pipe.stream() as a, pipe.stream() as other, pipe.stream() as b:
        tokens = {id(s): list(p) for s, p in ((a, [3, 4]), (other, [9, 9, 9]), (b, [3, 4]))}
        done = dict.fromkeys(tokens, 0)
        for _ in range(8):
            for s in (a, other, b):
                out = s.step(decoder_feeds(tokens[id(s)], done[id(s)]))
                done[id(s)] = len(tokens[id(s)])
                tokens[id(s)].append(int(np.argmax(out["logits"][0, -1])))
        assert tokens[id(a)] == tokens[id(b)] == [3, 4, *whole_generate(gpt_decoder(), [3, 4], 8)[0]]


def test_closing_a_stream_frees_its_state_in_every_stage(decoder_bundles: dict[int, Path]) -> None:
    with load(decoder_bundles[3]) as pipe:
        s = pipe.stream()
        generate(s.step, [1, 2, 3], 4)
        replicas = [r for stage in pipe.diagnostics().stages for r in stage.replicas]
        assert len(replicas) == 3 and all(r.streams == (s.id,) for r in replicas)
        held = [weakref.ref(a) for r in pipe.idle_runners() for a in r.states[s.id][1].values()]
        # layers, k/v, heads, 6 positions fed (3 + 3), head dim, float32
        assert len(held) == 8 and sum(r.state_bytes for r in replicas) == 4 * 2 * 2 * 6 * 16 * 4 == s.state_bytes == pipe.state_bytes
        s.close()
        gc.collect()
        replicas = [r for stage in pipe.diagnostics().stages for r in stage.replicas]
        assert all(r.streams == () for r in replicas) and sum(r.state_bytes for r in replicas) == 0 == s.state_bytes == pipe.state_bytes
        assert all(ref() is None for ref in held), "state arrays still referenced after close"
        assert pipe.open_streams == []


def test_a_streams_state_bytes_follow_its_steps_and_its_pipeline_sums_the_open_ones(tmp_path: Path) -> None:
    """``growing`` (stage0: state = Concat(state, x); stage1 reshapes its sum to the step's
    ``shape``): each step adds x's bytes, told as the step's outputs are; a step failing in stage1
    counts stage0's state, which took it; the pipeline's sum follows its open streams."""
    x = np.ones((1, 4), np.float32)
    with load(bundle_of(split(growing(reshaped=True), ["sum"], states="auto"), tmp_path)) as pipe:
        a, b = pipe.stream(), pipe.stream()
        assert (a.state_bytes, pipe.state_bytes) == (0, 0)
        for k in range(1, 4):
            a.step({"x": x, "shape": np.array([1, 1])})
            assert a.state_bytes == 16 * k
        b.step({"x": np.ones((1, 100), np.float32), "shape": np.array([1, 1])})
        assert (b.state_bytes, pipe.state_bytes) == (400, 448)
        with pytest.raises(StreamError, match="state is no longer valid"):
            a.step({"x": x, "shape": np.array([2, 2])})
        assert (a.state_bytes, pipe.state_bytes) == (64, 464)  # stage0 took the step
        a.close()
        assert (a.state_bytes, pipe.state_bytes) == (0, 400)
    assert (b.state_bytes, pipe.state_bytes) == (0, 0)  # closed with its pipeline


def test_a_close_that_does_not_wait_frees_the_state_behind_the_steps_in_flight(rnn: Pipeline) -> None:
    xs = _steps(5)
    s = rnn.stream()
    futures = [s.submit({"x": x}) for x in xs]
    s.close(wait=False)  # returns at once; the close follows the steps through every stage
    assert s.closed and rnn.open_streams == []
    with pytest.raises(StreamError, match="is closed"):
        s.step({"x": xs[0]})
    assert [f.result()["y"].shape for f in futures] == [(1, 4)] * len(xs)  # the steps before it all ran
    deadline = time.monotonic() + 5
    while any(_held(rnn)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _held(rnn) == [(), ()]


def test_max_streams_is_enforced_never_evicting(decoder_bundles: dict[int, Path]) -> None:
    with load(decoder_bundles[2], max_streams=2) as pipe:
        a, b = pipe.stream(), pipe.stream()
        generate(a.step, [1], 2)
        with pytest.raises(StreamError, match=r"max_streams=2 streams are open already \(ids 0, 1\); close one first"):
            pipe.stream()
        b.close()
        c = pipe.stream()
        assert pipe.open_streams == [0, 2]
        a.close()
        c.close()


def test_idle_streams_are_closed_with_a_clear_error(rnn_bundle: Path) -> None:
    with load(rnn_bundle, stream_timeout=0.2) as pipe:
        idle = pipe.stream()
        idle.step({"x": _steps(0)[0]})
        time.sleep(0.3)
        opened = time.monotonic()
        busy = pipe.stream()  # opening a stream closes the idle ones
        assert pipe.open_streams == [busy.id]
        assert all(idle.id not in held for held in _held(pipe))
        with pytest.raises(StreamError, match=r"stream 0 is closed \(it was idle for more than stream_timeout=0.2 s, and its state was freed\)"):
            idle.step({"x": _steps(0)[0]})
        try:
            busy.step({"x": _steps(0)[0]})
        except StreamError:
            skip_if_stalled(opened, 0.2)  # busy itself idle past the timeout: the machine stalled (tests/waiting.py)
            raise
        busy.close()


def test_idle_streams_can_be_closed_without_new_traffic(rnn_bundle: Path) -> None:
    with load(rnn_bundle, stream_timeout=0.2) as pipe:
        idle = pipe.stream()
        used = time.monotonic()
        idle.step({"x": _steps(0)[0]})
        closed = pipe.close_idle_streams()
        skip_if_stalled(used, 0.2)  # (tests/waiting.py)
        assert closed == []  # not idle for long enough yet
        time.sleep(0.3)
        assert pipe.close_idle_streams() == [idle.id]  # nothing else called meanwhile
        assert pipe.open_streams == [] and idle.closed
        assert _held(pipe) == [(), ()]
    with load(rnn_bundle) as pipe:
        pipe.stream().step({"x": _steps(0)[0]})
        assert pipe.close_idle_streams() == []  # no stream_timeout: nothing ever expires


# -- bad use -----------------------------------------------------------------------------------------


def test_step_on_a_closed_stream_is_refused_and_others_go_on(rnn: Pipeline) -> None:
    xs = _steps(3)
    other = rnn.stream()
    other.step({"x": xs[0]})
    s = rnn.stream()
    s.step({"x": xs[0]})
    s.close()
    s.close()  # twice: nothing
    with pytest.raises(StreamError, match=r"stream 1 is closed \(closed by its owner\); open a new one with pipe.stream\(\)"):
        s.step({"x": xs[1]})
    got = [other.step({"x": x})["y"] for x in xs[1:]]
    np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(recurrent(), xs)[1:]), rtol=1e-5, atol=1e-5)
    other.close()


def test_a_step_whose_shapes_do_not_match_the_state_is_refused(rnn: Pipeline) -> None:
    xs = _steps(4)
    with rnn.stream() as s:
        s.step({"x": xs[0]})
        with pytest.raises(InputError, match=r"stream 0, step 1: input 'x' has batch=2, but the stream's state was made with batch=1 on its first step"):
            s.step({"x": np.zeros((2, 4), np.float32)})
        with pytest.raises(InputError, match="has dtype float64; expected float32"):
            s.step({"x": np.zeros((1, 4))})
        got = [s.step({"x": x})["y"] for x in xs[1:]]  # the stream goes on as if nothing happened
    np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(recurrent(), xs)[1:]), rtol=1e-5, atol=1e-5)


class _FailOnce:
    """Wraps a runner's session: the next ``run`` raises (a stage failure on one step)."""

    def __init__(self, session: Any) -> None:
        self.session, self.armed = session, True

    def run(self, *args: Any) -> Any:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected failure")
        return self.session.run(*args)


def test_a_failure_before_any_commit_leaves_the_state_valid(rnn: Pipeline) -> None:
    xs = _steps(5)
    with rnn.stream() as s:
        s.step({"x": xs[0]})
        stage0 = rnn.idle_runners()[0]
        stage0.session = _FailOnce(stage0.session)
        with pytest.raises(StreamError, match=r"stage 'stage0' failed .*injected failure; the stream's state is unchanged \(as after step 0\)") as e:
            s.step({"x": np.full((1, 4), 9, np.float32)})
        assert e.value.state_valid is True and e.value.stage == "stage0"
        got = [s.step({"x": x})["y"] for x in xs[1:]]
    np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(recurrent(), xs)[1:]), rtol=1e-5, atol=1e-5)


def test_a_failure_after_an_earlier_stage_committed_invalidates_the_stream(rnn: Pipeline) -> None:
    xs = _steps(6)
    other = rnn.stream()
    with rnn.stream() as s:
        s.step({"x": xs[0]})
        other.step({"x": xs[0]})
        stage1 = rnn.idle_runners()[1]
        stage1.session = _FailOnce(stage1.session)
        with pytest.raises(StreamError, match=r"state is no longer valid: stage\(s\) 'stage0' took step 1 and stage 'stage1' did not; close the stream") as e:
            s.step({"x": xs[1]})
        assert e.value.state_valid is False
        with pytest.raises(StreamError, match=r"cannot take more steps: step 1 failed in stage 'stage1' after stage\(s\) 'stage0' had updated"):
            s.step({"x": xs[2]})
    assert all(s.id not in held for held in _held(rnn))  # closing still frees it
    got = [other.step({"x": x})["y"] for x in xs[1:]]
    np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(recurrent(), xs)[1:]), rtol=1e-5, atol=1e-5)
    other.close()


def test_steps_in_flight_behind_a_failed_one_never_run_on_the_wrong_state(rnn: Pipeline) -> None:
    xs = _steps(7)
    with rnn.stream() as s:
        stage0 = rnn.idle_runners()[0]
        stage0.session = _FailOnce(stage0.session)
        futures = [s.submit({"x": x}) for x in xs[:3]]
        errors = [f.exception() for f in futures]
        assert all(isinstance(e, StreamError) and e.state_valid for e in errors)
        assert "an earlier step of stream 0 failed, so step 1 cannot run on its state" in str(errors[1])
        assert s.steps == 0
        got = [s.step({"x": x})["y"] for x in xs]
    np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(recurrent(), xs)), rtol=1e-5, atol=1e-5)


def test_load_options_are_checked(rnn_bundle: Path) -> None:
    with pytest.raises(ConfigError, match="max_streams must be at least 1, got 0"):
        load(rnn_bundle, max_streams=0)
    with pytest.raises(ConfigError, match="stream_timeout must be a positive number of seconds or None, got -1"):
        load(rnn_bundle, stream_timeout=-1)
