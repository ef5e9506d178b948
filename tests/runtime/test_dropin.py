"""A loaded pipeline used where an ``onnxruntime.InferenceSession`` is expected: the same session
face as a session of the whole model (field by field), an application's inference wrapper giving
the same results with either, onnxruntime's error kinds, concurrent callers, and ``run()`` without
arguments keeping its TVM meaning."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

from onnxpipe import InputError, OnnxpipeError, StageError
from onnxpipe.runtime import NodeArg, Pipeline, TensorSpec, load
from onnxpipe.splitter import UniformPolicy, split
from tests import models

# Stage modules are optimized on their own, so fusions may differ from the whole model's.
RTOL, ATOL = 1e-4, 1e-5

# name -> (the model or its file, how to split it)
CASES: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    "squeezenet": (lambda: models.light_model_path("squeezenet"), {"policy": UniformPolicy(stages=3)}),
    "inception_v1": (lambda: models.light_model_path("inception_v1"), {"policy": UniformPolicy(stages=2)}),
    "densenet121": (lambda: models.light_model_path("densenet121"), {"policy": UniformPolicy(stages=2)}),
    "symbolic_batch": (models.symbolic_batch, {"cuts": ["a"]}),
    "unknown_dims": (models.unknown_dims, {"cuts": ["a"]}),
    "two_outputs": (models.two_outputs, {"policy": UniformPolicy(stages=2)}),
    "branchy": (models.branchy, {"cuts": ["a", ["b", "c"]]}),
    "ir3_initializer_inputs": (models.ir3_initializer_inputs, {"policy": UniformPolicy(stages=2)}),
}


def _proto(model: Any) -> onnx.ModelProto:
    return model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))


def _whole(model: Any) -> ort.InferenceSession:
    return ort.InferenceSession(_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """Each case's bundle, built once for the module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            model, how = CASES[name]
            built[name] = models.bundle_of(split(model(), **how), tmp_path_factory.mktemp(name))
        return built[name]

    yield get


def _feeds(session: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random inputs read off a session's get_inputs(), as a client would (unknown dims: 2)."""
    feeds = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in arg.shape] if arg.shape else [3]
        dtype = {"tensor(float)": np.float32, "tensor(int64)": np.int64}[arg.type]
        feeds[arg.name] = (rng.standard_normal(shape) * 4).astype(dtype)
    return feeds


def _args(session: Any, method: str) -> list[tuple[str, str, list[Any]]]:
    return [(a.name, a.type, a.shape) for a in getattr(session, method)()]


@pytest.mark.parametrize("name", list(CASES))
def test_session_face_matches_a_whole_model_session(bundles: Callable[[str], Path], name: str) -> None:
    model = CASES[name][0]()
    whole = _whole(model)
    with load(bundles(name)) as pipe:
        for method in ("get_inputs", "get_outputs", "get_overridable_initializers"):
            assert _args(pipe, method) == _args(whole, method), method
        got, want = pipe.get_modelmeta(), whole.get_modelmeta()
        for field in ("producer_name", "graph_name", "domain", "description", "graph_description", "version", "custom_metadata_map"):
            assert getattr(got, field) == getattr(want, field), field
        assert pipe.get_providers() == whole.get_providers() == ["CPUExecutionProvider"]
        assert pipe.get_provider_options() == whole.get_provider_options()
        feeds = _feeds(whole, np.random.default_rng(0))
        for got_out, want_out in zip(pipe.run(None, feeds), whole.run(None, feeds), strict=True):
            np.testing.assert_allclose(got_out, want_out, rtol=RTOL, atol=ATOL)


def test_unknown_dims_read_like_onnxruntime(bundles: Callable[[str], Path]) -> None:
    with load(bundles("unknown_dims")) as pipe:
        # Unnamed and -1 dims are None; onnx's invented "unk__" names for unknown output dims
        # are not reported.
        assert [repr(a) for a in pipe.get_inputs()] == [
            "NodeArg(name='X', type='tensor(float)', shape=['N', None, None, 3])",
            "NodeArg(name='Z', type='tensor(int64)', shape=['M'])",
        ]
        assert pipe.get_outputs()[0].shape == ["N", None, None, 3]
        # A -1 dim takes any size, like an unnamed one.
        y, w = pipe.run(None, {"X": np.ones((2, 5, 7, 3), np.float32), "Z": np.arange(4)})
        assert y.shape == (2, 5, 7, 3) and w.tolist() == [0, 1, 2, 3]
        meta = pipe.get_modelmeta()
        assert (meta.producer_name, meta.domain, meta.version, dict(meta.custom_metadata_map)) == (
            "tests", "ai.onnxpipe.test", 3, {"author": "onnxpipe", "license": "MIT"}
        )  # fmt: skip


def test_a_tensor_of_unknown_rank_has_shape_empty_list_like_onnxruntime() -> None:
    # The checker refuses such a graph input, so no split makes one; a hand-written spec may.
    assert NodeArg(TensorSpec("Z", "int64", None)).shape == []
    assert repr(NodeArg(TensorSpec("S", "string", ()))) == "NodeArg(name='S', type='tensor(string)', shape=[])"
    assert NodeArg(TensorSpec("h", "float16", (-1, "B", None, 2))).shape == [None, "B", None, 2]


def test_a_bundle_without_kept_metadata_reads_the_first_stage(tmp_path: Path) -> None:
    # Wired by hand (like a bundle made before the split kept the model's metadata): the first
    # stage module's metadata, the pipeline's name, none of onnxpipe's own entries.
    with load(models.bundle_of(models.hand_wired(), tmp_path)) as pipe:
        meta = pipe.get_modelmeta()
        assert meta.graph_name == "hand"
        assert not any(k.startswith("onnxpipe.") for k in meta.custom_metadata_map)


class EmbeddingModel:
    """An application's inference wrapper, written the way insightface's ``ArcFaceONNX`` uses its
    session (numpy instead of OpenCV for the blob): it takes a session or makes one, reads the
    input's name and spatial size and the output names off the session, asks for the CPU in
    ``prepare``, and runs ``session.run(output_names, {input_name: blob})[0]``."""

    def __init__(self, model_file: str, session: Any = None) -> None:
        self.model_file = model_file
        self.session = session if session is not None else ort.InferenceSession(model_file, providers=["CPUExecutionProvider"])
        first_nodes = [n.op_type for n in onnx.load(model_file, load_external_data=False).graph.node[:8]]
        # Models that normalize inside the graph take raw pixels.
        self.input_mean, self.input_std = (0.0, 1.0) if "Sub" in first_nodes and "Mul" in first_nodes else (127.5, 127.5)
        input_cfg = self.session.get_inputs()[0]
        self.input_name = input_cfg.name
        self.input_shape = input_cfg.shape
        self.input_size = tuple(input_cfg.shape[2:4][::-1])
        outputs = self.session.get_outputs()
        self.output_names = [o.name for o in outputs]
        assert len(self.output_names) == 1
        self.output_shape = outputs[0].shape

    def prepare(self, ctx_id: int) -> None:
        if ctx_id < 0:
            self.session.set_providers(["CPUExecutionProvider"])

    def get_feat(self, images: list[np.ndarray]) -> np.ndarray:
        """Embeddings of HWC BGR uint8 images of the input size."""
        assert all(img.shape[1::-1] == self.input_size for img in images)
        blob = (np.stack([img[:, :, ::-1] for img in images]).astype(np.float32) - self.input_mean) / self.input_std
        return self.session.run(self.output_names, {self.input_name: blob.transpose(0, 3, 1, 2)})[0]

    def compute_sim(self, feat1: np.ndarray, feat2: np.ndarray) -> float:
        a, b = feat1.ravel(), feat2.ravel()
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_an_application_wrapper_gives_the_same_results(bundles: Callable[[str], Path]) -> None:
    path = str(models.light_model_path("squeezenet"))
    rng = np.random.default_rng(1)
    faces = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(3)]
    with load(bundles("squeezenet")) as pipe:
        reference, piped = EmbeddingModel(path), EmbeddingModel(path, session=pipe)
        for app in (reference, piped):
            app.prepare(ctx_id=-1)
        assert (piped.input_name, piped.input_size, piped.output_shape) == (reference.input_name, (224, 224), reference.output_shape)
        feats = [piped.get_feat([f]) for f in faces]
        for f, got in zip(faces, feats, strict=True):
            np.testing.assert_allclose(got, reference.get_feat([f]), rtol=RTOL, atol=ATOL)
        want = reference.compute_sim(reference.get_feat([faces[0]]), reference.get_feat([faces[1]]))
        assert piped.compute_sim(feats[0], feats[1]) == pytest.approx(want, rel=1e-5)


def test_run_takes_onnxruntime_arguments_and_keeps_its_tvm_meaning(bundles: Callable[[str], Path]) -> None:
    whole = _whole(models.two_outputs())
    x = np.random.default_rng(2).standard_normal((1, 4)).astype(np.float32)
    m, y = whole.run(["M", "Y"], {"X": x})
    with load(bundles("two_outputs")) as pipe:
        assert [o.name for o in pipe.get_outputs()] == [o.name for o in whole.get_outputs()]
        declared = whole.run(None, {"X": x})
        for asked in (pipe.run(None, {"X": x}), pipe.run([], {"X": x}), pipe.run(output_names=None, input_feed={"X": x}, run_options=None)):
            for got, want in zip(asked, declared, strict=True):
                np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        got_y, got_m = pipe.run(["Y", "M"], {"X": x}, ort.RunOptions())  # the order asked
        np.testing.assert_allclose(got_y, y, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got_m, m, rtol=RTOL, atol=ATOL)
        assert len(pipe.run(["Y", "Y"], {"X": x})) == 2
        # Like onnxruntime, a list becomes an array of the input's dtype; an OrtValue is read.
        np.testing.assert_allclose(pipe.run(["Y"], {"X": x.tolist()})[0], y, rtol=RTOL, atol=ATOL)
        ort_out = pipe.run_with_ort_values(["Y"], {"X": ort.OrtValue.ortvalue_from_numpy(x)})
        np.testing.assert_allclose(ort_out[0].numpy(), y, rtol=RTOL, atol=ATOL)
        # Without arguments: TVM's run(), a request number, outputs from get_output().
        pipe.set_input("X", x)
        number = pipe.run()
        assert isinstance(number, int)
        outputs = pipe.get_output()
        assert outputs is not None
        np.testing.assert_allclose(outputs["Y"], y, rtol=RTOL, atol=ATOL)
        with pytest.raises(InputError, match="run\\(\\) takes no argument .* or output_names and input_feed") as err:
            pipe.run(None)  # type: ignore[call-overload]
        assert isinstance(err.value, TypeError)
        with pytest.raises(InputError, match="run\\(\\) takes no argument"):
            pipe.run(run_options=ort.RunOptions())  # type: ignore[call-overload]


def _raises(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except Exception as e:
        return e
    raise AssertionError("no error")


def test_errors_are_of_the_kinds_onnxruntime_raises(bundles: Callable[[str], Path]) -> None:
    whole = _whole(models.symbolic_batch())
    x = np.ones((2, 4), np.float32)
    cases: list[tuple[str, Callable[[Any], object], str]] = [
        ("missing input", lambda s: s.run(None, {}), r"missing input\(s\) 'X'; expected 'X'"),
        ("unknown input", lambda s: s.run(None, {"X": x, "x2": x}), "unknown input 'x2'; valid: 'X'"),
        ("unknown output", lambda s: s.run(["y"], {"X": x}), "unknown output 'y'; valid: 'Y'"),
        ("wrong dtype", lambda s: s.run(None, {"X": x.astype(np.float64)}), "input 'X' has dtype float64; expected float32"),
        ("wrong shape", lambda s: s.run(None, {"X": np.ones((2, 5), np.float32)}), r"expected \[N, 4\] \(dim 1 must be 4\)"),
        ("wrong rank", lambda s: s.run(None, {"X": np.ones(4, np.float32)}), "expected rank 2"),
        ("run_options", lambda s: s.run(None, {"X": x}, {"terminate": True}), "run_options must be an onnxruntime.RunOptions or None, got dict"),
        ("output_names", lambda s: s.run("Y", {"X": x}), r"output_names must be a list of names or None, got the string 'Y'; write \['Y'\]"),
    ]
    with load(bundles("symbolic_batch")) as pipe:
        for what, call, message in cases:
            want, got = _raises(lambda: call(whole)), _raises(lambda: call(pipe))  # noqa: B023 (called at once)
            # A client's `except <what onnxruntime raised>` catches it, and so does `except InputError`.
            assert isinstance(got, type(want)), (what, type(want), type(got))
            assert isinstance(got, InputError), what
            with pytest.raises(InputError, match=message):
                call(pipe)
        assert isinstance(_raises(lambda: pipe.run(["y"], {"X": x})), InvalidArgument)
        stop = ort.RunOptions()
        stop.terminate = True
        assert isinstance(_raises(lambda: whole.run(None, {"X": x}, stop)), Fail)
        with pytest.raises(StageError, match="run not started: RunOptions.terminate is set") as err:
            pipe.run(None, {"X": x}, stop)
        assert isinstance(err.value, Fail)
        # The pipeline stays usable.
        np.testing.assert_allclose(pipe.run(None, {"X": x})[0], whole.run(None, {"X": x})[0], rtol=RTOL, atol=ATOL)


def _failing_pipeline(tmp_path: Path) -> Pipeline:
    return load(models.bundle_of(models.failing_config(), tmp_path))


def test_a_failing_stage_raises_what_onnxruntime_raises_and_run_async_reports_it(tmp_path: Path) -> None:
    with _failing_pipeline(tmp_path) as pipe:
        with pytest.raises(StageError, match="stage 'reshape' failed on request 0") as err:
            pipe.run(None, {"x": np.ones((3, 4), np.float32)})  # 3 rows cannot be reshaped to [2, 4]
        assert isinstance(err.value, Fail)  # what a whole-model session raises for a failing node
        done = threading.Event()
        calls: list[tuple[list[np.ndarray], Any, str]] = []

        def callback(results: list[np.ndarray], user_data: Any, error: str) -> None:
            calls.append((results, user_data, error))
            if len(calls) == 2:
                done.set()

        pipe.run_async(None, {"x": np.full((2, 4), 5, np.float32)}, callback, "ok")
        pipe.run_async(["y"], {"x": np.ones((3, 4), np.float32)}, callback, "bad")
        assert done.wait(30)
        by_data = {c[1]: c for c in calls}
        np.testing.assert_array_equal(by_data["ok"][0][0], np.full((2, 4), 5, np.float32))
        assert by_data["ok"][2] == ""
        assert by_data["bad"][0] == [] and "stage 'reshape' failed" in by_data["bad"][2]
        with pytest.raises(InputError, match="missing input"):
            pipe.run_async(None, {}, callback, None)  # refused at once, like onnxruntime


def test_terminate_set_while_waiting_stops_the_wait(bundles: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with load(bundles("symbolic_batch")) as pipe:
        never: Future[dict[str, np.ndarray]] = Future()
        monkeypatch.setattr(pipe, "submit", lambda feeds: never)  # a request that never finishes
        options = ort.RunOptions()
        threading.Timer(0.05, lambda: setattr(options, "terminate", True)).start()
        with pytest.raises(StageError, match="run stopped: RunOptions.terminate was set") as err:
            pipe.run(None, {"X": np.ones((1, 4), np.float32)}, options)
        assert isinstance(err.value, Fail)


def test_concurrent_callers_each_get_their_own_outputs(bundles: Callable[[str], Path]) -> None:
    whole = _whole(models.branchy())
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(400)]
    with load(bundles("branchy")) as pipe:

        def call(x: np.ndarray) -> np.ndarray:
            return pipe.run(["Y"], {"X": x})[0]

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, inputs))
        for x, got in zip(inputs, results, strict=True):
            np.testing.assert_allclose(got, whole.run(["Y"], {"X": x})[0], rtol=RTOL, atol=ATOL)
        assert pipe.stats().completed == len(inputs)


def test_what_a_pipeline_cannot_do_names_the_alternative(bundles: Callable[[str], Path]) -> None:
    with load(bundles("symbolic_batch")) as pipe:
        for call, message in [
            (lambda: pipe.run_with_iobinding(None), "takes the IOBinding this pipeline's io_binding\\(\\) made, not NoneType"),
            (pipe.get_session_options, "read pipeline.spec.stages\\[i\\].settings"),
            (pipe.end_profiling, "load it with trace=True and call save_trace"),
            (lambda: pipe.set_providers(["CUDAExecutionProvider"]), r"stages use \['CPUExecutionProvider'\]; load it again with load\(path, target=...\)"),
        ]:
            with pytest.raises(OnnxpipeError, match=message) as err:
                call()
            assert isinstance(err.value, NotImplementedError)
        pipe.set_providers(["CPUExecutionProvider"])  # nothing to change: accepted, as applications call it
        pipe.set_providers([("CPUExecutionProvider", {})])


def test_run_with_ort_values_gives_host_ortvalues_like_onnxruntime(bundles: Callable[[str], Path]) -> None:
    whole = _whole(models.two_outputs())
    x = np.random.default_rng(3).standard_normal((1, 4)).astype(np.float32)
    want = whole.run_with_ort_values(None, {"X": ort.OrtValue.ortvalue_from_numpy(x)})
    with load(bundles("two_outputs")) as pipe:
        got = pipe.run_with_ort_values(None, {"X": ort.OrtValue.ortvalue_from_numpy(x)})
    assert [type(v) for v in got] == [type(v) for v in want]
    assert [v.device_name() for v in got] == [v.device_name() for v in want] == ["cpu", "cpu"]
    for g, w in zip(got, want, strict=True):
        assert g.shape() == w.shape() and g.data_type() == w.data_type()
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=RTOL, atol=ATOL)


def _bind_all(binding: Any, x: np.ndarray, m_out: ort.OrtValue, y_out: np.ndarray) -> None:
    """The same bindings on a session's IOBinding and a pipeline's: X by pointer, M into an
    OrtValue, Y into a caller's buffer, then X again as an OrtValue (the last binding counts)."""
    binding.bind_input("X", "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
    binding.bind_ortvalue_output("M", m_out)
    binding.bind_output("Y", "cpu", 0, np.float32, list(y_out.shape), y_out.ctypes.data)
    binding.bind_ortvalue_input("X", ort.OrtValue.ortvalue_from_numpy(x))
    binding.synchronize_inputs()


def test_io_binding_behaves_as_onnxruntimes(bundles: Callable[[str], Path]) -> None:
    whole = _whole(models.two_outputs())
    x = np.random.default_rng(4).standard_normal((1, 4)).astype(np.float32)
    m, y = whole.run(["M", "Y"], {"X": x})
    with load(bundles("two_outputs")) as pipe:
        for session in (whole, pipe):  # each checked against the same expectations
            binding = session.io_binding()
            binding.bind_cpu_input("X", x)
            binding.bind_output("Y")  # a device by name: a new OrtValue each run
            binding.bind_output("M", "cpu", 0)
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            outs = binding.get_outputs()
            assert [o.device_name() for o in outs] == ["cpu", "cpu"]  # in the order bound
            np.testing.assert_allclose(outs[0].numpy(), y, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(outs[1].numpy(), m, rtol=RTOL, atol=ATOL)
            copied = binding.copy_outputs_to_cpu()
            assert all(isinstance(c, np.ndarray) for c in copied)
            np.testing.assert_allclose(copied[0], y, rtol=RTOL, atol=ATOL)
            # Into the caller's memory: an OrtValue and a raw host buffer, written in place.
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            m_out = ort.OrtValue.ortvalue_from_numpy(np.zeros_like(m))
            y_out = np.zeros_like(y)
            _bind_all(binding, x, m_out, y_out)
            session.run_with_iobinding(binding, ort.RunOptions())
            np.testing.assert_allclose(m_out.numpy(), m, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(y_out, y, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(binding.get_outputs()[1].numpy(), y, rtol=RTOL, atol=ATOL)


def test_io_binding_refuses_what_a_pipeline_cannot_serve_by_name(bundles: Callable[[str], Path]) -> None:
    whole = _whole(models.two_outputs())
    x = np.zeros((1, 4), np.float32)
    with load(bundles("two_outputs")) as pipe:
        binding = pipe.io_binding()
        refused = "input 'X': a pipeline cannot read or write a raw cuda pointer; bind an OrtValue with bind_ortvalue_input"
        with pytest.raises(OnnxpipeError, match=refused) as err:
            binding.bind_input("X", "cuda", 0, np.float32, [1, 4], 1234)
        assert isinstance(err.value, NotImplementedError)
        with pytest.raises(OnnxpipeError, match="output 'Y': a pipeline cannot read or write a raw cuda pointer; bind an OrtValue with bind_ortvalue_output"):
            binding.bind_output("Y", "cuda", 0, np.float32, [1, 4], 1234)
        with pytest.raises(ValueError, match="`element_type` and `shape` are to be provided"):
            binding.bind_output("Y", "cpu", 0, None, None, x.ctypes.data)
        binding.bind_cpu_input("X", x)
        with pytest.raises(InputError, match="no output is bound"):
            pipe.run_with_iobinding(binding)
        binding.bind_ortvalue_output("Y", ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 4), np.float32)))
        with pytest.raises(InputError, match="output 'Y' has shape \\[1, 4\\]; the buffer bound to it has shape \\[2, 4\\]"):
            pipe.run_with_iobinding(binding)
        binding.clear_binding_inputs()
        binding.bind_output("Y")
        with pytest.raises(InputError, match="missing input"):
            pipe.run_with_iobinding(binding)
        with pytest.raises(OnnxpipeError, match="takes the IOBinding this pipeline's io_binding\\(\\) made, not IOBinding"):
            pipe.run_with_iobinding(whole.io_binding())
