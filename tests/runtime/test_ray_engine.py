"""The Ray engine on a real multi-node Ray cluster on loopback (the ``ray_cluster`` fixture): stages
pinned to nodes by label, outputs equal the whole model, order under load, skip edges and fan-out,
parameters, a stage failing alone, an actor killed mid-stream, a node removed, impossible placement,
and no process left behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from onnxpipe import ConfigError, StageError
from onnxpipe.builder import build, export
from onnxpipe.runtime import Pipeline, RayOptions, load
from onnxpipe.splitter import split
from tests import models
from tests.conftest import _alive

# One cluster per test session: every test of this file goes to the same xdist worker.
pytestmark = pytest.mark.xdist_group("ray")

SQUEEZENET = models.light_model_path("squeezenet")
CUTS = {2: [("Concat", 2)], 3: [("Concat", 2), ("Concat", 5)]}


def _bundle(config: Any, folder: Path, hosts: list[str | None], **settings: Any) -> Path:
    config = getattr(config, "config", config)
    for stage, host in zip(config.stages, hosts, strict=True):
        stage.configure(host=host, **settings)
    return export(build(config, folder / "built").path, folder / "model.onnxpipe")


def _labels(pipe: Pipeline) -> list[str | None]:
    """The host label of the node each stage's first replica runs on."""
    return [stage.replicas[0].labels.get("onnxpipe/host") for stage in pipe.diagnostics().stages]


def _held(pipe: Pipeline) -> list[list[tuple[int, ...] | None]]:
    """Per stage, per replica: the streams whose state the replica's actor holds."""
    return [[r.streams for r in stage.replicas] for stage in pipe.diagnostics().stages]


@pytest.fixture()
def ray_pids(ray_cluster: Any) -> Iterator[set[int]]:
    """Actor process ids seen by a test; afterwards every one of them must be gone."""
    pids: set[int] = set()
    yield pids
    deadline = time.monotonic() + 10
    while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []


def _actor_pids(pipe: Pipeline) -> list[int]:
    return [r.pid for stage in pipe.diagnostics().stages for r in stage.replicas]


@pytest.mark.parametrize("stages", [2, 3])
def test_squeezenet_stages_on_labelled_nodes_equal_the_whole_model(tmp_path: Path, stages: int, ray_pids: set[int]) -> None:
    hosts = ["a", "b", "a"][:stages]
    bundle = _bundle(split(SQUEEZENET, CUTS[stages]), tmp_path, hosts)
    whole = ort.InferenceSession(str(SQUEEZENET), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(stages)
    inputs = [{"data_0": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(6)]
    with load(bundle, engine="ray", trace=True) as pipe:
        ray_pids.update(_actor_pids(pipe))
        assert _labels(pipe) == hosts
        for got, x in zip(pipe.map(inputs), inputs, strict=True):
            np.testing.assert_allclose(got["softmaxout_1"], whole.run(None, x)[0], rtol=1e-4, atol=1e-5)
        stats = pipe.stats()
        assert stats.completed == 6 and [s.count for s in stats.stages] == [6] * stages
        assert pipe.get_providers() == ["CPUExecutionProvider"]
        trace = pipe.save_trace(tmp_path / "trace.json")
        assert trace.stat().st_size > 0
        with pytest.raises(StageError, match="the stages run on ray actors"):
            pipe.idle_runners()


def test_200_requests_in_flight_with_skip_edges_and_fan_out_keep_order(tmp_path: Path, ray_pids: set[int]) -> None:
    # branchy in 4 stages: 'a' fans out to stages 1 and 3 (a skip edge over two stages), 'b' and 'c' cross one cut.
    bundle = _bundle(split(models.branchy(), ["a", ["b", "c"], "e"]), tmp_path, ["a", "b", "a", "b"])
    whole = ort.InferenceSession(models.branchy().SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    inputs = [{"X": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(200)]
    with load(bundle, engine="ray", queue_depth=64) as pipe:
        ray_pids.update(_actor_pids(pipe))
        assert _labels(pipe) == ["a", "b", "a", "b"]
        futures = [pipe.submit(x) for x in inputs]
        for future, x in zip(futures, inputs, strict=True):
            np.testing.assert_allclose(future.result(timeout=60)["Y"], whole.run(None, x)[0], rtol=1e-6)
        assert pipe.stats().completed == 200


def test_replicas_share_work_and_params_reach_every_replica_in_order(tmp_path: Path, ray_pids: set[int]) -> None:
    config = models.hand_wired(param_group="scale")
    bundle = _bundle(config, tmp_path, [None, None, None])
    config.stages[2].configure(replicas=2)
    bundle = export(build(config, tmp_path / "built2").path, tmp_path / "replicas.onnxpipe")
    whole = ort.InferenceSession(models.stages_whole().SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    ones, twos = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    with load(bundle, engine="ray") as pipe:
        ray_pids.update(_actor_pids(pipe))
        before = [pipe.submit({"x": x}) for _ in range(20)]
        pipe.set_params("scale", {"scale": twos})
        after = [pipe.submit({"x": x}) for _ in range(20)]
        for f in before:
            np.testing.assert_allclose(f.result(timeout=60)["y"], whole.run(None, {"x": x, "scale": ones})[0], rtol=1e-6)
        for f in after:
            np.testing.assert_allclose(f.result(timeout=60)["y"], whole.run(None, {"x": x, "scale": twos})[0], rtol=1e-6)
        tail = pipe.diagnostics().stages[2].replicas
        assert len(tail) == 2 and all(r.runs > 0 for r in tail), "both replicas of 'tail' ran requests"


def test_a_failing_request_fails_alone(tmp_path: Path, ray_pids: set[int]) -> None:
    with load(_bundle(models.failing_config(), tmp_path, ["a", "b"]), engine="ray") as pipe:
        ray_pids.update(_actor_pids(pipe))
        rows = [2, 3, 2]  # the request with 3 rows cannot be reshaped to [2, 4]
        futures = [pipe.submit({"x": np.full((n, 4), i, np.float32)}) for i, n in enumerate(rows)]
        with pytest.raises(StageError, match="stage 'reshape' failed on request 1: .*"):
            futures[1].result(timeout=60)
        for i in (0, 2):
            np.testing.assert_array_equal(futures[i].result(timeout=60)["y"], np.full((2, 4), i, np.float32))
        assert [s.failed for s in pipe.stats().stages] == [0, 1]


@pytest.mark.parametrize("per_call", [None, 1])
def test_requests_that_queue_up_share_calls_and_still_fail_alone(tmp_path: Path, per_call: int | None, ray_pids: set[int]) -> None:
    """30 requests submitted at once queue up behind the actors' first calls and go in fewer, larger
    calls (``RayOptions.requests_per_call`` None: up to queue_depth per call), or one call each
    (``requests_per_call=1``); either way each request comes back once, in order, and the one bad
    request among them fails alone."""
    bundle = _bundle(models.failing_config(), tmp_path, ["a", "b"])
    rows = [3 if i == 13 else 2 for i in range(30)]  # request 13 cannot be reshaped to [2, 4]
    with load(bundle, engine="ray", queue_depth=32, ray_options=RayOptions(requests_per_call=per_call)) as pipe:
        ray_pids.update(_actor_pids(pipe))
        np.testing.assert_array_equal(pipe({"x": np.full((2, 4), 7, np.float32)})["y"], np.full((2, 4), 7, np.float32))
        assert [s.calls for s in pipe.diagnostics().stages] == [1, 1], "an idle pipeline sends a request at once, in a call of its own"
        futures = [pipe.submit({"x": np.full((n, 4), i, np.float32)}) for i, n in enumerate(rows)]
        for i, future in enumerate(futures):
            if i == 13:
                with pytest.raises(StageError, match=r"stage 'reshape' failed on request 14: "):
                    future.result(timeout=60)
            else:
                np.testing.assert_array_equal(future.result(timeout=60)["y"], np.full((2, 4), i, np.float32))
        calls = [s.calls - 1 for s in pipe.diagnostics().stages]
        if per_call == 1:
            assert calls == [30, 30]
        else:
            assert all(30 / 32 <= c < 30 for c in calls), f"calls per stage for 30 queued requests: {calls}"
        stats = pipe.stats()
        assert [(s.count, s.failed) for s in stats.stages] == [(31, 0), (31, 1)]
        assert (stats.completed, stats.failed) == (31, 1)  # failed ones included


@pytest.mark.parametrize("shared", [False, True])
def test_the_bundle_reaches_each_actor_through_the_object_store_or_a_shared_path(tmp_path: Path, shared: bool, ray_pids: set[int]) -> None:
    """By default every actor writes the bytes the driver shipped into its private folder; with
    ``RayOptions(shared=True)`` it reads the bundle at the driver's path (a file system every node
    sees: here, the one machine's), and writes no copy. Either way the folders go on close."""
    bundle = _bundle(models.head_then_tail(4), tmp_path, ["a", "b"])
    folders = Path(os.environ["TMPDIR"])  # the nodes' temporary folder (see the ray_cluster fixture)
    x = np.ones((2, 4), np.float32)
    with load(bundle, engine="ray", ray_options=RayOptions(shared=shared)) as pipe:
        ray_pids.update(_actor_pids(pipe))
        reported = sorted(folders / r.folder for stage in pipe.diagnostics().stages for r in stage.replicas)
        run = reported[0].name.rsplit("-", 2)[0]  # onnxpipe-ray-RUN, then -STAGE-REPLICA
        ours = sorted(folders.glob(f"{run}-*"))
        assert len(ours) == 2 and ours == reported, "one private folder per actor"
        copies = [f for f in ours if (f / "bundle.onnxpipe").exists()]
        assert copies == ([] if shared else ours)
        assert pipe({"x": x})["y"].shape == (2, 4)
    assert [f for f in ours if f.exists()] == []


def test_a_code_stage_runs_on_its_actor_once_the_host_allows_it(tmp_path: Path, ray_pids: set[int]) -> None:
    """An ONNX stage on node a, a code stage on node b: the actor imports the entry point only
    because the driver's allow-list, which travels with the bundle, allows it."""
    from onnxpipe import BundleError
    from tests import code_stages

    bundle = _bundle(code_stages.config(), tmp_path, ["a", "b"])
    with pytest.raises(BundleError, match=r"not allowed: 'tests\.code_stages:combine' \(stage 'combine'\)"):
        load(bundle, engine="ray")
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    with load(bundle, engine="ray", allow_code=["tests.code_stages:*"]) as pipe:
        ray_pids.update(_actor_pids(pipe))
        assert _labels(pipe) == ["a", "b"]
        assert pipe.get_providers() == ["CPUExecutionProvider"]  # the ONNX stage's; the code stage has none
        for n in (1, 3, 5):  # N changes from request to request, within the declared symbolic dim
            np.testing.assert_allclose(pipe({"x": np.resize(x, (n, 4))})["y"], code_stages.expected(np.resize(x, (n, 4))), rtol=1e-6)


# -- streams: state stays on the actor holding its stage ---------------------------------------------


def _stateful(model: Any, cuts: list[str], folder: Path, hosts: list[str | None]) -> Path:
    return _bundle(split(model, cuts, states="auto"), folder, hosts)


def test_interleaved_streams_keep_their_state_on_their_actors(tmp_path: Path, ray_pids: set[int]) -> None:
    """A recurrent model in 2 stages on nodes a and b, 2 replicas each: 5 streams stepped round-robin
    without waiting each equal the whole model alone, step for step (rtol/atol 1e-5); each stream's
    state sits on replica stream % 2 of each stage, its bytes are told back to the driver
    (``Stream.state_bytes``), and closing frees it on every actor."""
    from tests.stateful_models import recurrent, whole_recurrent

    plan = split(recurrent(), ["state1N"], states="auto")
    for stage in plan.config.stages:
        stage.configure(replicas=2)
    bundle = _bundle(plan, tmp_path, ["a", "b"])
    rng = np.random.default_rng(3)
    inputs = [[rng.standard_normal((1, 4)).astype(np.float32) for _ in range(6)] for _ in range(5)]
    with load(bundle, engine="ray") as pipe:
        ray_pids.update(_actor_pids(pipe))
        assert _labels(pipe) == ["a", "b"]
        streams = [pipe.stream() for _ in inputs]
        futures = [[s.submit({"x": xs[t]}) for s, xs in zip(streams, inputs, strict=True)] for t in range(6)]
        for k, xs in enumerate(inputs):
            got = np.stack([futures[t][k].result(timeout=60)["y"] for t in range(6)])
            np.testing.assert_allclose(got, np.stack(whole_recurrent(recurrent(), xs)), rtol=1e-5, atol=1e-5, err_msg=f"stream {k}")
        assert _held(pipe) == [[(0, 2, 4), (1, 3)]] * 2
        # what each stream holds came back from the actors: state1 and state2, [1, 8] float32 each
        assert [s.state_bytes for s in streams] == [2 * 8 * 4] * 5 and pipe.state_bytes == 5 * 2 * 8 * 4
        for s in streams:
            s.close()
        assert _held(pipe) == [[(), ()]] * 2
        assert pipe.state_bytes == 0


def test_greedy_decoding_through_ray_equals_the_whole_decoder(tmp_path: Path, ray_pids: set[int]) -> None:
    """The GPT-style decoder split between layers, its KV cache per layer on nodes a and b: greedy
    tokens of two interleaved streams equal the whole model's in one session."""
    import threading

    from tests.stateful_models import generate, gpt_decoder, whole_generate

    model = gpt_decoder()
    bundle = _stateful(model, ["layer1.out"], tmp_path, ["a", "b"])
    prompts = ([1, 2, 3], [40, 41])
    results: dict[int, list[int]] = {}
    with load(bundle, engine="ray") as pipe:
        ray_pids.update(_actor_pids(pipe))

        def run(i: int) -> None:
            with pipe.stream() as s:
                results[i] = generate(s.step, prompts[i], 12)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert _held(pipe) == [[()], [()]]
    for i, prompt in enumerate(prompts):
        assert results[i] == whole_generate(model, prompt, 12)[0], f"prompt {i}"


def whole_generate_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """The whole model's logits for ``tokens`` fed one step at a time (the last step's)."""
    from tests.stateful_models import decoder_session

    session = decoder_session(model)
    names = [o.name for o in session.get_outputs()]
    shapes = {i.name: i.shape for i in session.get_inputs()}
    cache = {n: np.zeros((1, shapes[n][1], 0, shapes[n][3]), np.float32) for n in shapes if n.startswith("past_key_values.")}
    out: dict[str, np.ndarray] = {}
    for k, t in enumerate(tokens):
        feeds = {"input_ids": np.array([[t]]), "attention_mask": np.ones((1, k + 1), np.int64), "position_ids": np.array([[k]]), **cache}
        out = dict(zip(names, session.run(names, feeds), strict=True))
        cache = {n: out[n.replace("past_key_values.", "present.")] for n in cache}
    return out["logits"]


def test_batched_stream_steps_run_as_one_call_on_each_actor(tmp_path: Path, ray_pids: set[int]) -> None:
    """The decoder with max_batch=8 on nodes a and b: the steps of 6 streams, started apart with
    prompts of different lengths and generating 6 to 11 tokens (so they join and leave), meet at
    the entry and travel as batches, one actor call and one session call per stage (the driver's
    statistics show batches above 1), and every stream's tokens equal the whole model alone."""
    import threading

    from tests.stateful_models import generate, gpt_decoder, whole_generate

    model = gpt_decoder()
    plan = split(model, ["layer1.out"], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=8, max_delay_ms=5)
    bundle = _bundle(plan, tmp_path, ["a", "b"])
    prompts = ([1, 2, 3], [40, 41], [5], [7, 8, 9, 10], [11, 12], [30])
    results: dict[int, list[int]] = {}
    with load(bundle, engine="ray") as pipe:
        ray_pids.update(_actor_pids(pipe))

        def run(i: int) -> None:
            time.sleep(0.003 * i)
            with pipe.stream() as s:
                results[i] = generate(s.step, prompts[i], 6 + i)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = pipe.stats()
        # Steps submitted without waiting and the close behind them may reach an actor in one call:
        # the close runs after them there, never before.
        s = pipe.stream()
        tokens = [1, 2, 3, 4]
        futures = [s.submit({"input_ids": np.array([[t]]), "attention_mask": np.ones((1, k + 1), np.int64),
                             "position_ids": np.array([[k]])}) for k, t in enumerate(tokens)]
        s.close()
        last = futures[-1].result(timeout=60)["logits"]
        assert _held(pipe) == [[()], [()]]
    np.testing.assert_allclose(last, whole_generate_logits(model, tokens), rtol=0, atol=1e-4)
    for i, prompt in enumerate(prompts):
        assert results[i] == whole_generate(model, prompt, 6 + i)[0], f"prompt {i}"
    for stage in stats.stages:
        assert stage.count == sum(6 + i for i in range(len(prompts)))
        assert sum(k * v for k, v in stage.batch_sizes.items()) == stage.count
        assert max(stage.batch_sizes) >= 2, f"{stage.stage}: {stage.batch_sizes}"


def test_a_failing_step_inside_a_batch_fails_alone_on_the_actors(tmp_path: Path, ray_pids: set[int]) -> None:
    """4 streams stepped as one batch (submit_steps, one micro-batch) over nodes a and b, one of
    them with a token outside the vocabulary: stage 0's actor replays the batch member by member,
    the bad member leaves it there (after the driver has already sent stage 1's call) and fails
    alone with its state still valid; stage 1 runs the other three, their tokens equal the whole
    model alone, and the failed stream goes on."""
    from onnxpipe import StreamError
    from tests.stateful_models import decoder_feeds, gpt_decoder, whole_generate

    model = gpt_decoder()
    plan = split(model, ["layer1.out"], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=8)
    bundle = _bundle(plan, tmp_path, ["a", "b"])
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    tokens = [list(p) for p in prompts]
    done = [0] * 4
    with load(bundle, engine="ray", micro_batches=1) as pipe:
        ray_pids.update(_actor_pids(pipe))
        streams = [pipe.stream() for _ in prompts]
        for step in range(4):
            feeds = {s: decoder_feeds(tokens[k], done[k]) for k, s in enumerate(streams)}
            if step == 2:
                feeds[streams[1]] = {**feeds[streams[1]], "input_ids": np.array([[10_000]])}  # no such token: stage 0's Gather fails
            futures = pipe.submit_steps(feeds)
            for k, s in enumerate(streams):
                if step == 2 and k == 1:
                    with pytest.raises(StreamError) as info:
                        futures[s].result(timeout=60)
                    assert info.value.state_valid is True and info.value.stage == "stage0"
                    continue
                logits = futures[s].result(timeout=60)["logits"]
                done[k] = len(tokens[k])
                tokens[k].append(int(np.argmax(logits[0, -1])))
        stats = pipe.stats()
        for s in streams:
            s.close()
    assert [st.failed for st in stats.stages] == [1, 0]
    assert max(stats.stages[1].batch_sizes) == 4 and 3 in stats.stages[1].batch_sizes  # the batch went on without the bad member
    for k, p in enumerate(prompts):
        assert tokens[k][len(p):] == whole_generate(model, p, 3 if k == 1 else 4)[0], f"stream {k}"


def test_a_killed_actor_holding_a_streams_state_fails_its_next_step_by_name(tmp_path: Path, ray_pids: set[int]) -> None:
    """The state died with the actor: the stream's next step says so (state_valid False) and the
    stream refuses further steps; a new stream runs on the restarted actor."""
    from onnxpipe import StreamError
    from tests.stateful_models import recurrent, whole_recurrent

    bundle = _stateful(recurrent(), ["state1N"], tmp_path, ["a", "b"])
    x = np.ones((1, 4), np.float32)
    with load(bundle, engine="ray") as pipe:
        ray_pids.update(_actor_pids(pipe))
        stream = pipe.stream()
        stream.step({"x": x})
        victim = pipe.diagnostics().stages[1].replicas[0].pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(StreamError, match=r"stage 'stage1' lost the state of stream 0: the actor holding it (\(replica 0\) )?died") as caught:
            stream.step({"x": x})
        assert caught.value.state_valid is False
        with pytest.raises(StreamError, match="cannot take more steps"):
            stream.step({"x": x})
        stream.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the restarted actor answers again
            try:
                with pipe.stream() as fresh:
                    got = [fresh.step({"x": x})["y"] for _ in range(3)]
                break
            except StreamError:
                time.sleep(0.5)
        np.testing.assert_allclose(np.stack(got), np.stack(whole_recurrent(recurrent(), [x] * 3)), rtol=1e-5, atol=1e-5)
        ray_pids.update(_actor_pids(pipe))


def test_a_killed_stage_actor_loses_no_request(tmp_path: Path, ray_pids: set[int]) -> None:
    bundle = _bundle(split(models.branchy(), ["a", ["b", "c"]]), tmp_path, ["a", "b", "a"])
    whole = ort.InferenceSession(models.branchy().SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    inputs = [{"X": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(120)]
    with load(bundle, engine="ray", queue_depth=16) as pipe:
        victim = pipe.diagnostics().stages[1].replicas[0].pid
        assert victim is not None
        ray_pids.update(_actor_pids(pipe))
        got = []
        for n, out in enumerate(pipe.map(inputs)):
            got.append(out["Y"])
            if n == 20:
                os.kill(victim, signal.SIGKILL)
        for y, x in zip(got, inputs, strict=True):
            np.testing.assert_allclose(y, whole.run(None, x)[0], rtol=1e-6)
        stats = pipe.stats()
        assert (stats.completed, stats.failed) == (120, 0)
        after = pipe.diagnostics().stages[1].replicas[0]
        assert after.pid != victim and after.labels == {"onnxpipe/host": "b"}
        ray_pids.update(_actor_pids(pipe))


def test_a_stage_whose_only_node_is_removed_fails_its_requests_by_name(tmp_path: Path, ray_cluster: Any, ray_pids: set[int]) -> None:
    node = ray_cluster.add_node(num_cpus=1, labels={"onnxpipe/host": "c"}, **ray_cluster.common_node_args)
    bundle = _bundle(models.head_then_tail(4), tmp_path, ["a", "c"])
    pipe = load(bundle, engine="ray", ray_options=RayOptions(restart_timeout_s=20))
    try:
        ray_pids.update(_actor_pids(pipe))
        assert _labels(pipe) == ["a", "c"]
        assert pipe({"x": np.ones((1, 4), np.float32)})["y"].shape == (1, 4)
        ray_cluster.remove_node(node)
        futures = [pipe.submit({"x": np.ones((1, 4), np.float32)}) for _ in range(5)]
        for f in futures:
            with pytest.raises(StageError, match=r"stage 'tail' cannot run request \d+: its actor died .*no live node can take it: .*onnxpipe/host=c"):
                f.result(timeout=30)
    finally:
        # close() does not wait for the dead stage to come back (restart_timeout_s=20): it returns
        # before that could have, or the thread is still in it.
        closing = threading.Thread(target=pipe.close)
        closing.start()
        closing.join(15)
        assert not closing.is_alive(), "close() waited for the stage whose node was removed"


def _relu(size: int) -> Any:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, size])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_values_lost_with_their_node_are_made_again_from_the_stage_that_made_them(tmp_path: Path, ray_cluster: Any,
                                                                                   ray_pids: set[int]) -> None:
    """first (node a) -> middle (node c) -> slow (node b): while 'slow' is held (a code stage
    waiting for a file), the middle's outputs (768 KiB each, so in node c's object store, not inline)
    wait on c. Node c goes; a node labelled c comes: the middle actor restarts there, the lost outputs
    are made again by it, and 'first' runs each request exactly once."""
    from onnxpipe.builder import PipelineConfig
    from onnxpipe.runtime import TensorSpec

    size = 768
    gate = tmp_path / "go"
    config = PipelineConfig("three")
    first, middle = (config.add_stage(_relu(size), n) for n in ("first", "middle"))
    ports = [TensorSpec("x", "float32", (256, size))], [TensorSpec("y", "float32", (256, size))]
    slow = config.add_python_stage("tests.code_stages:matmul_when_file", inputs=ports[0], outputs=ports[1], params={"path": str(gate)}, name="slow")
    config.input("x").connect(first.input("x"))
    first.output("y").connect(middle.input("x"))
    middle.output("y").connect(slow.input("x"))
    slow.output("y").connect(config.output("y"))
    node = ray_cluster.add_node(num_cpus=1, labels={"onnxpipe/host": "c"}, **ray_cluster.common_node_args)
    spare = None
    rng = np.random.default_rng(5)
    inputs = [{"x": rng.standard_normal((256, size)).astype(np.float32)} for _ in range(32)]
    whole = [np.maximum(x["x"], 0) @ np.full((size, size), 1.0 / size, np.float32) @ np.full((size, size), 1.0 / size, np.float32) for x in inputs]
    try:
        with load(_bundle(config, tmp_path, ["a", "c", "b"]), engine="ray", queue_depth=16, allow_code=["tests.code_stages:*"]) as pipe:
            ray_pids.update(_actor_pids(pipe))
            spare = ray_cluster.add_node(num_cpus=1, labels={"onnxpipe/host": "c"}, **ray_cluster.common_node_args)
            futures = [pipe.submit(x) for x in inputs]
            deadline = time.monotonic() + 60
            while pipe.stats().stages[1].count < len(inputs) and time.monotonic() < deadline:  # every middle output made, on c
                time.sleep(0.005)
            done_before = sum(f.done() for f in futures)
            assert pipe.stats().stages[1].count == len(inputs), "the middle did not make every output while 'slow' was held"
            ray_cluster.remove_node(node, allow_graceful=False)  # a crash: its object store goes at once
            node = None
            gate.touch()
            for future, expected in zip(futures, whole, strict=True):
                np.testing.assert_allclose(future.result(timeout=120)["y"], expected, rtol=1e-4, atol=1e-5)
            stats = pipe.stats()
            counts = {s.stage: s.count for s in stats.stages}
            assert done_before == 0, "node c went while requests still needed its values"
            assert counts["first"] == len(inputs), f"'first' ran a request again: {counts}"
            assert counts["middle"] > len(inputs), f"no value was lost with node c: {counts}"
            assert (stats.completed, stats.failed) == (len(inputs), 0)
            assert _labels(pipe)[1] == "c" and pipe.diagnostics().stages[1].replicas[0].node_id == spare.node_id
            ray_pids.update(_actor_pids(pipe))
    finally:
        for n in (node, spare):
            if n is not None:
                ray_cluster.remove_node(n)


def test_a_stage_no_node_can_take_fails_load_naming_it(tmp_path: Path, ray_pids: set[int]) -> None:
    # Both are refused by the check made before any actor is (Note: placement, onnxpipe/runtime/_ray.py),
    # which names the cluster's nodes: not after a wait to be placed, which says "not placed within".
    bundle = _bundle(models.head_then_tail(4), tmp_path, ["a", "nowhere"])
    with pytest.raises(ConfigError, match=r"stage 'tail' asks for CPU 1 on a node labelled onnxpipe/host=nowhere; no node .* labels \{'onnxpipe/host': 'a'\}"):
        load(bundle, engine="ray")
    bundle = _bundle(models.head_then_tail(4), tmp_path / "big", ["a", "b"], intra_op_threads=3)
    with pytest.raises(ConfigError, match=r"stage 'head' asks for CPU 3 on a node labelled onnxpipe/host=a; no node"):
        load(bundle, engine="ray")


def test_cli_run_and_bench_on_ray(tmp_path: Path, ray_cluster: Any, ray_pids: set[int]) -> None:
    from click.testing import CliRunner

    from onnxpipe.cli import main
    from onnxpipe.runtime import save_npz

    bundle = _bundle(models.head_then_tail(4), tmp_path, ["a", "b"])
    save_npz(tmp_path / "in.npz", {"x": np.ones((1, 4), np.float32)})
    runner = CliRunner()
    out = runner.invoke(main, ["run", str(bundle), "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"), "--engine", "ray"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "out.npz").is_file()
    out = runner.invoke(main, ["bench", str(bundle), "--engine", "ray", "--requests", "10", "--warmup", "2", "--json"])
    assert out.exit_code == 0, out.output
    assert "no standalone stage times: the stages run on ray actors" in out.output
    out = runner.invoke(main, ["bench", str(bundle), "--address", "auto"])
    assert out.exit_code == 2 and "--address: only used with --engine ray" in out.output


@pytest.mark.slow
def test_the_ocr_chain_reads_alike_on_ray(tmp_path: Path, ray_cluster: Any, ray_pids: set[int]) -> None:
    """The PP-OCR chain of onnxpipe_examples (4 code stages, det split in 2, cls, rec) with the
    detector's halves on nodes a and b and the rest on a third node: it reads rendered images as
    the rapidocr_onnxruntime wheel does (texts equal, boxes within 2 px, scores within 1e-3)."""
    pytest.importorskip("rapidocr_onnxruntime", reason="the examples package: pip install -e examples")
    from onnxpipe_examples import ocr
    from onnxpipe_examples.ocr_pipeline import ALLOW_CODE, ocr_config
    from rapidocr_onnxruntime import RapidOCR

    from tests.examples.test_ocr_glue import assert_reads_alike

    config = ocr_config()
    hosts = {"det_0": "a", "det_1": "b"}
    for stage in config.stages:
        stage.configure(host=hosts.get(stage.name, "ocr"))
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "ocr.onnxpipe")
    node = ray_cluster.add_node(num_cpus=6, labels={"onnxpipe/host": "ocr"}, **ray_cluster.common_node_args)
    try:
        images = [ocr.render_lines(["Hello onnxpipe", "upside down 42"], upside_down=[1]), ocr.render_lines(["one bundle"])]
        with load(bundle, engine="ray", allow_code=ALLOW_CODE) as pipe:
            ray_pids.update(_actor_pids(pipe))
            assert _labels(pipe) == [hosts.get(s.name, "ocr") for s in pipe.spec.stages]
            wheel = RapidOCR()
            for image, ours in zip(images, pipe.map({"image": img} for img in images), strict=True):
                assert_reads_alike(ours, wheel(image), 2.0, 1e-3)
    finally:
        ray_cluster.remove_node(node)


def test_thread_caps_are_checked_on_the_node_that_runs_the_stage(tmp_path: Path, ray_cluster: Any, ray_pids: set[int]) -> None:
    """A stage with more threads than the driver's host may start (4 x its cores) is not refused by
    the driver, which starts no session on Ray: the actor checks it against its own node's cores,
    with the limits the host gave load()."""
    from onnxpipe import BundleError
    from onnxpipe.runtime import Limits
    from onnxpipe.runtime._settings import host_cores

    threads = 4 * host_cores() + 1
    config = models.head_then_tail(4)
    config.stages[0].configure(host="a")
    config.stages[1].configure(host="big", intra_op_threads=threads)
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "big.onnxpipe")
    with pytest.raises(BundleError, match=rf"stage 'tail': intra_op_threads {threads} is over this host's cap of {threads - 1}"):
        load(bundle)  # the thread engine would start them all here
    node = ray_cluster.add_node(num_cpus=threads, labels={"onnxpipe/host": "big"}, **ray_cluster.common_node_args)
    try:
        # This machine's node has this machine's cores: the actor refuses, naming the stage and its node.
        with pytest.raises(BundleError, match=rf"stage 'tail' replica 0 on .*: stage 'tail': intra_op_threads {threads} is over this host's cap"):
            load(bundle, engine="ray")
        with load(bundle, engine="ray", limits=Limits(max_threads=threads)) as pipe:
            ray_pids.update(_actor_pids(pipe))
            assert _labels(pipe) == ["a", "big"]
            assert pipe({"x": np.ones((1, 4), np.float32)})["y"].shape == (1, 4)
    finally:
        ray_cluster.remove_node(node)


def test_streams_on_ray_batch_continuously(tmp_path: Path, ray_pids: set[int]) -> None:
    """Continuous batching on Ray (``scheduling``, Note: continuous batching: the data plane tells
    the scheduler when the first stage's actor call returns). Two streams in one group, max_delay_ms
    200: b steps once and goes quiet without closing; a's next step waits for b once (one batch
    left delayed), then steps alone without waiting again (under the old rule every one of a's
    steps waited the 200 ms: 4 delayed). Then 4 threads, each stepping a stream of its own with
    max_delay_ms a minute: every batch a whole group, none waited for the minute. Tokens equal the
    whole model alone."""
    from tests.stateful_models import decode_in_threads, gpt_decoder, quiet_member, whole_generate

    model = gpt_decoder()
    for delay_ms in (200, 60_000):
        plan = split(model, ["layer1.out"], states="auto")
        for stage in plan.config.stages:
            stage.configure(max_batch=8, max_delay_ms=delay_ms)
        bundle = _bundle(plan, tmp_path / str(delay_ms), ["a", "b"])
        with load(bundle, engine="ray", micro_batches=1) as pipe:
            ray_pids.update(_actor_pids(pipe))
            if delay_ms == 200:
                prompt, tokens = quiet_member(pipe)
                assert pipe.streams.delayed == 1
                assert [s.batch_sizes for s in pipe.stats().stages] == [{1: 6}] * 2
                assert tokens == whole_generate(model, prompt, 5)[0]
            else:
                prompts = [[3 + k, 5, 7] for k in range(4)]  # equal lengths: the prompts batch too
                results = decode_in_threads(pipe, prompts, [6] * 4, 0.0, opened=True)
                assert [s.batch_sizes for s in pipe.stats().stages] == [{4: 6}] * 2 and pipe.streams.delayed == 0
                for k, p in enumerate(prompts):
                    assert results[k][0] == whole_generate(model, p, 6)[0], f"stream {k}"
