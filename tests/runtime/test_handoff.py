"""Stage hand-offs as OrtValues (onnxpipe/runtime/_handoff.py), run for real on the CPU provider.

No device here: the CPU provider is put in ``DEVICE_TYPES`` (the one table that says which
providers hand on ``OrtValue``) so that the very path a CUDA stage takes runs, with ``"cpu"`` as
the device; ``benchmarks/gpu_check.py`` runs it on a GPU the day one is lent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxpipe.runtime import load, read_bundle
from onnxpipe.runtime._handoff import DEVICE_TYPES, Device, Handoff, handoff_for, host, session_device
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stage import Request, StageRunner, make_runner, plan_stages
from onnxpipe.splitter import UniformPolicy, split
from tests import models
from tests.stateful_models import gpt_decoder, whole_generate

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture()
def cpu_hands_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CPU provider keeps its tensors 'on a device' of type cpu: every ONNX stage hands on OrtValues."""
    monkeypatch.setitem(DEVICE_TYPES, "CPUExecutionProvider", "cpu")
    yield


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_handoff_leaves_outputs_where_it_is_told_and_reads_ortvalues() -> None:
    session = _session(models.two_outputs())
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    names = [o.name for o in session.get_outputs()]
    want = session.run(names, {"X": x})
    call = Handoff(session, names, [Device("cpu"), None])
    first = call({"X": x})
    assert isinstance(first[0], ort.OrtValue) and first[0].device_name() == "cpu"
    assert isinstance(first[1], np.ndarray)
    assert call.on_device() == (names[0],)
    np.testing.assert_allclose(first[0].numpy(), want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(first[1], want[1], rtol=RTOL, atol=ATOL)
    # An OrtValue input is bound as it is; a later run leaves the earlier outputs as they were
    # (a binding reused as it was would write the new ones into them).
    kept = first[0].numpy().copy()
    again = call({"X": ort.OrtValue.ortvalue_from_numpy(x * 2)})
    np.testing.assert_allclose(again[0].numpy(), session.run(names, {"X": x * 2})[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(first[0].numpy(), kept)
    assert host(first[0]) is not first[0] and host(x) is x


def test_a_cpu_stage_keeps_session_run_and_numpy(tmp_path: Path) -> None:
    session = _session(models.two_outputs())
    assert session_device(session) is None
    bundle = read_bundle(models.bundle_of(split(models.two_outputs(), policy=UniformPolicy(stages=2)), tmp_path))
    plans, _ = plan_stages(bundle.spec)
    assert all(getattr(make_runner(bundle, p, 0), "handoff", None) is None for p in plans)


def test_ortvalues_reach_the_next_stage_and_numpy_leaves_the_pipeline(cpu_hands_on: None, tmp_path: Path) -> None:
    model = models.branchy()
    path = models.bundle_of(split(model, cuts=["a", ["b", "c"]]), tmp_path)
    bundle = read_bundle(path)
    plans, finals = plan_stages(bundle.spec)
    runners = [make_runner(bundle, p, 0) for p in plans]
    read = {link.src for link in bundle.spec.links if link.src.stage is not None and link.dst.stage is not None}
    for runner, plan in zip(runners, plans, strict=True):  # on the device: what a later stage reads, not what only the caller does
        assert isinstance(runner, StageRunner) and runner.handoff is not None
        assert set(runner.handoff.on_device()) == {o for o in plan.outputs if Endpoint(plan.stage.name, o) in read}
    whole = _session(model)
    feeds = {i.name: np.random.default_rng(1).standard_normal([d if isinstance(d, int) else 2 for d in i.shape]).astype(np.float32)
             for i in whole.get_inputs()}
    request = Request(0, {Endpoint(None, n): a for n, a in feeds.items()}, {}, 0.0)
    handed = 0
    for runner, plan in zip(runners, plans, strict=True):
        assert isinstance(runner, StageRunner)
        read = [request.values[key] for _, key in plan.sources if key.stage is not None]
        assert all(isinstance(v, ort.OrtValue) for v in read)  # what an earlier stage left for this one
        handed += len(read)
        runner(request)
    assert handed > 0
    # Outputs no later stage reads (the pipeline's) are numpy already.
    assert all(isinstance(request.values[key], np.ndarray) for key in finals.values())
    with load(path) as pipe:
        got = pipe.run(None, feeds)
    for value, want in zip(got, whole.run(None, feeds), strict=True):
        assert isinstance(value, np.ndarray)
        np.testing.assert_allclose(value, want, rtol=RTOL, atol=ATOL)


def test_a_pipeline_through_ortvalues_equals_the_whole_model(cpu_hands_on: None, tmp_path: Path) -> None:
    model = onnx.load(str(models.light_model_path("squeezenet")))
    path = models.bundle_of(split(model, policy=UniformPolicy(stages=3)), tmp_path)
    whole = _session(model)
    rng = np.random.default_rng(2)
    inputs = [{i.name: rng.standard_normal(i.shape).astype(np.float32) for i in whole.get_inputs()} for _ in range(6)]
    with load(path) as pipe:
        futures = [pipe.submit(x) for x in inputs]  # several in flight at once
        for x, future in zip(inputs, futures, strict=True):
            for name, want in zip([o.name for o in whole.get_outputs()], whole.run(None, x), strict=True):
                np.testing.assert_allclose(future.result(timeout=60)[name], want, rtol=RTOL, atol=ATOL)


def test_streams_keep_their_state_as_numpy_and_decode_the_whole_models_tokens(cpu_hands_on: None, tmp_path: Path) -> None:
    model = gpt_decoder()
    path = models.bundle_of(split(model, ["layer0.out", "layer2.out"], states="auto"), tmp_path)
    bundle = read_bundle(path)
    plans, _ = plan_stages(bundle.spec)
    for plan in plans:
        runner = make_runner(bundle, plan, 0)
        assert isinstance(runner, StageRunner) and runner.handoff is not None
        states = {s.output for s in plan.states}
        assert states and not states & set(runner.handoff.on_device())  # state stays in its runner, in host memory
    from tests.stateful_models import generate

    with load(path) as pipe, pipe.stream() as stream:
        tokens, _ = generate(stream.step, [3, 4, 5], 12)
    assert tokens == whole_generate(model, [3, 4, 5], 12)[0]


def test_outputs_a_batching_or_host_stage_reads_go_on_as_numpy(cpu_hands_on: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = read_bundle(models.bundle_of(split(models.branchy(), cuts=["a", ["b", "c"]]), tmp_path))
    spec = bundle.spec
    first = spec.stages[0]
    session = _session(models.branchy())  # any session on the CPU provider: only its provider is read
    outputs = tuple(t.name for t in first.outputs)
    assert handoff_for(spec, first, outputs, session, None, batches=True) is None  # its rows are sliced and stacked as numpy
    made = handoff_for(spec, first, outputs, session, None, batches=False)
    assert made is not None and set(made.on_device()) == set(outputs)
    assert made.moved.calls == 0 and made.moved.to_device == made.moved.to_host == 0
    # The same stage read by a stage on the host: nothing to hand on as OrtValue.
    monkeypatch.delitem(DEVICE_TYPES, "CPUExecutionProvider")  # the provider keeps its tensors in host memory: session.run and numpy
    assert handoff_for(spec, first, outputs, session, None, batches=False) is None


def test_a_call_that_overrides_an_initializer_runs_through_session_run() -> None:
    # IOBinding binds graph inputs only; a parameter override feeds an initializer by name.
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "w"], ["y"])], "add",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in ("x", "w")],  # w: an input with a default, overridable
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])], initializer=[onnx.numpy_helper.from_array(np.ones(2, np.float32), "w")])
    session = _session(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))
    call = Handoff(session, ["y"], [Device("cpu")])
    x = np.array([1.0, 2.0], np.float32)
    assert call({"x": x})[0].numpy().tolist() == [2.0, 3.0]  # bound: an OrtValue
    overridden = call({"x": x, "w": np.array([10.0, 20.0], np.float32)})[0]
    assert isinstance(overridden, np.ndarray) and overridden.tolist() == [11.0, 22.0]
    assert call.moved.calls == 2


def test_what_a_code_stage_reads_goes_on_as_numpy(cpu_hands_on: None, tmp_path: Path) -> None:
    from tests import code_stages

    path = models.bundle_of(code_stages.config(), tmp_path)
    bundle = read_bundle(path, allow_code=["tests.*"])
    plans, _ = plan_stages(bundle.spec)
    head = make_runner(bundle, plans[0], 0)
    assert isinstance(head, StageRunner) and head.handoff is not None and head.handoff.on_device() == ()  # its reader takes numpy
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    with load(path, allow_code=["tests.*"]) as pipe:
        np.testing.assert_allclose(pipe.run(None, {"x": x})[0], code_stages.expected(x), rtol=RTOL, atol=ATOL)
