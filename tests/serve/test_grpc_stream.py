"""Triton's bidirectional stream (ModelStreamInfer) through tritonclient.grpc, client deadlines and
request timeouts, on one real server: many requests in flight on one stream answered in order and
equal to the pipeline's answers, a bad request answered with its error while the stream goes on,
two sequences interleaved on one stream equal to each stream alone (large steps decoded on threads
included), the token, admission, the message size and idleness; a client's deadline withdraws a
queued request (it never runs) and frees the admission place at once; the ``timeout`` parameter
(HTTP and gRPC) and ``--request-timeout`` bound the wait before a request starts, as Triton's; and
a drain answers a stream's requests, then ends it. The server's last test drains it."""

from __future__ import annotations

import json
import queue
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from onnxpipe import runtime
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import TensorSpec
from tests import models
from tests.serve.conftest import serve_args
from tests.serve.process import ServerProcess

# One server for the whole file, in file order on one worker: its last test drains it.
pytestmark = pytest.mark.xdist_group("grpc_stream")

TOKEN = "stream-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MAX_INFLIGHT = 8
REQUEST_TIMEOUT_S = 2.0
IDLE_S = 2.0
MAX_BODY = 4 << 20
Answer = tuple[Any, InferenceServerException | None]


@dataclass
class Served:
    proc: ServerProcess
    gate: Path  # while it does not exist, model 'gated' holds each request it runs
    entered: Path  # a byte for each run of model 'gated' begun

    def begun(self) -> int:
        """The runs model 'gated' has begun (held at the gate or not)."""
        return self.entered.stat().st_size if self.entered.exists() else 0

    def close(self) -> None:
        self.gate.unlink(missing_ok=True)

    def open(self) -> None:
        self.gate.touch()


@pytest.fixture(scope="module")
def served(bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``mlp`` (batches), ``rnn`` (state per sequence) and ``gated`` (holds requests at a file gate),
    behind a token, with small limits."""
    root = tmp_path_factory.mktemp("stream")
    gate, entered = root / "go", root / "entered"
    config = PipelineConfig("gated")
    ports = [TensorSpec("x", "float32", ("N", 4))], [TensorSpec("y", "float32", ("N", 4))]
    stage = config.add_python_stage("tests.code_stages:matmul_when_file", inputs=ports[0], outputs=ports[1],
                                    params={"path": str(gate), "entered": str(entered)}, name="gate")
    config.input("x").connect(stage.input("x"))
    stage.output("y").connect(config.output("y"))
    gated = models.bundle_of(config, root / "gated")
    (root / "token").write_text(TOKEN)
    with ServerProcess(*serve_args(bundles, "mlp", "rnn"), f"gated={gated}", "--allow-code", "tests.*", "--auth-token-file", root / "token",
                       "--max-inflight", MAX_INFLIGHT, "--request-timeout", REQUEST_TIMEOUT_S, "--idle-timeout", IDLE_S,
                       "--max-body-size", MAX_BODY) as proc:
        proc.start(root / "serve.log")
        yield Served(proc, gate, entered)
        gate.touch()
        if proc.proc is not None and proc.proc.poll() is None:
            assert proc.stop() == 0, proc.log()


class Stream:
    """A tritonclient stream whose answers are collected in the order they come."""

    def __init__(self, url: str, headers: dict[str, str] | None = AUTH, timeout: float | None = None) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.answers: queue.Queue[Answer] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)), headers=headers, stream_timeout=timeout)

    def send(self, model: str, feeds: dict[str, np.ndarray], request_id: str = "", **kwargs: Any) -> None:
        self.client.async_stream_infer(model, _inputs(feeds), request_id=request_id, **kwargs)

    def take(self, count: int, seconds: float = 30) -> list[Answer]:
        return [self.answers.get(timeout=seconds) for _ in range(count)]

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _inputs(feeds: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in feeds.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "INT64" if value.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def _x(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 4), value, np.float32)}


def _metric(served: Served, name: str, **labels: str) -> float:
    """A sample of the server's Prometheus metrics."""
    status, body = served.proc.get("/metrics", headers={"Authorization": AUTH["authorization"]})
    assert status == 200, body
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


def _until(what: Callable[[], bool], seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _inflight(served: Served, model: str = "gated") -> float:
    return _metric(served, "onnxpipe_inflight_requests", model=model)


def _runs(served: Served) -> float:
    return _metric(served, "onnxpipe_stage_runs_total", model="gated", stage="gate")


# -- the stream -----------------------------------------------------------------------------------


def test_many_requests_in_flight_on_one_stream_are_answered_in_order_and_a_bad_one_does_not_end_it(served: Served, bundles: dict[str, Path]) -> None:
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 16, (int(rng.integers(1, 9)), 3)).astype(np.int64) for _ in range(24)]
    with runtime.load(bundles["mlp"]) as pipe:
        want = [pipe.submit({"ids": x}).result(30)["y"] for x in ids]
    stream = Stream(served.proc.grpc)
    try:
        for i, x in enumerate(ids):
            if i == 7:  # a request the server refuses: an input the model does not have
                stream.send("mlp", {"tokens": x}, request_id=str(i))
            elif i == 13:  # one that fails in its stage: an id outside the vocabulary
                stream.send("mlp", {"ids": x + 100}, request_id=str(i))
            else:
                stream.send("mlp", {"ids": x}, request_id=str(i))
        answers = stream.take(len(ids))
    finally:
        stream.close()
    for i, (result, error) in enumerate(answers):
        if i == 7:
            assert result is None and error is not None
            assert error.message() == "model 'mlp' has no input 'tokens'; valid: 'ids'"
        elif i == 13:
            assert result is None and error is not None
            assert error.message().startswith("stage 'mlp' failed on request "), error.message()
        else:
            assert error is None, error
            assert result.get_response().id == str(i)  # in the order sent
            np.testing.assert_allclose(result.as_numpy("y"), want[i], rtol=1e-5, atol=1e-6, err_msg=f"request {i}")


def test_two_sequences_interleaved_on_one_stream_equal_each_alone(served: Served, bundles: dict[str, Path]) -> None:
    """Every step sent at once, without waiting for answers: one sequence's steps are 1 MiB (each
    decoded on a thread), the other's a row; each sequence's steps still run in the order sent."""
    rng = np.random.default_rng(5)
    steps = {11: [rng.standard_normal((1 << 16, 4)).astype(np.float32) for _ in range(4)],
             "b": [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(4)]}
    with runtime.load(bundles["rnn"]) as pipe:
        want = {}
        for sid, xs in steps.items():
            with pipe.stream() as s:
                want[sid] = [s.step({"x": x})["y"] for x in xs]
    stream = Stream(served.proc.grpc)
    try:
        for t in range(4):
            for sid, xs in steps.items():
                stream.send("rnn", {"x": xs[t]}, request_id=f"{sid}-{t}", sequence_id=sid, sequence_start=t == 0, sequence_end=t == 3)
        answers = stream.take(8)
    finally:
        stream.close()
    got: dict[str, np.ndarray] = {}
    for result, error in answers:
        assert error is None, error
        got[result.get_response().id] = result.as_numpy("y")
    assert list(got) == [f"{sid}-{t}" for t in range(4) for sid in steps]  # answered in the order sent
    for sid, ys in want.items():
        for t, y in enumerate(ys):
            np.testing.assert_allclose(got[f"{sid}-{t}"], y, rtol=1e-5, atol=1e-6, err_msg=f"sequence {sid!r}, step {t}")


def test_a_stream_without_the_token_ends_unauthenticated(served: Served) -> None:
    stream = Stream(served.proc.grpc, headers=None)
    try:
        result, error = stream.take(1)[0]
    finally:
        stream.close()
    assert result is None and error is not None
    assert error.status() == "StatusCode.UNAUTHENTICATED"
    assert error.message() == "this server needs a bearer token: send the metadata 'authorization: Bearer <token>'"


def test_a_request_past_the_admission_limit_gets_an_error_answer_and_its_stream_goes_on(served: Served) -> None:
    served.close()
    held, other = Stream(served.proc.grpc), Stream(served.proc.grpc)
    try:
        for k in range(MAX_INFLIGHT):
            held.send("gated", _x(k), request_id=str(k))
        _until(lambda: _inflight(served) == MAX_INFLIGHT)
        other.send("gated", _x(100))
        result, error = other.take(1)[0]
        assert result is None and error is not None
        assert error.message() == f"model 'gated' has {MAX_INFLIGHT} requests in flight, its limit (--max-inflight); retry later"
        served.open()
        answers = held.take(MAX_INFLIGHT)
        assert [(e, r.get_response().id) for r, e in answers] == [(None, str(k)) for k in range(MAX_INFLIGHT)]
        other.send("gated", _x(101))
        result, error = other.take(1)[0]
        assert error is None, error
        np.testing.assert_allclose(result.as_numpy("y"), _x(101)["x"])
    finally:
        served.open()
        held.close()
        other.close()


def test_a_message_over_the_size_limit_ends_its_stream_and_the_next_stream_works(served: Served) -> None:
    stream = Stream(served.proc.grpc)
    try:
        stream.send("gated", _x(1.0, rows=(MAX_BODY // 16) + 1024))  # a little over --max-body-size
        result, error = stream.take(1)[0]
        assert result is None and error is not None
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED", error
    finally:
        stream.close()
    served.open()
    stream = Stream(served.proc.grpc)
    try:
        stream.send("gated", _x(2.0))
        result, error = stream.take(1)[0]
        assert error is None, error
    finally:
        stream.close()


def test_a_stream_idle_with_nothing_in_flight_ends_after_the_idle_timeout(served: Served) -> None:
    served.open()
    stream = Stream(served.proc.grpc)
    try:
        stream.send("mlp", {"ids": np.zeros((1, 2), np.int64)})
        assert stream.take(1)[0][1] is None
        result, error = stream.take(1, seconds=IDLE_S + 10)[0]
    finally:
        stream.close()
    assert result is None and error is not None
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert error.message() == f"the stream sent no request for {IDLE_S:g} s with none in flight (--idle-timeout); start a new stream"


# -- deadlines and timeouts -----------------------------------------------------------------------


def test_a_client_deadline_frees_the_admission_place_and_a_queued_request_never_runs(served: Served) -> None:
    served.close()
    client = grpcclient.InferenceServerClient(served.proc.grpc)
    answers: queue.Queue[Answer] = queue.Queue()
    before = _runs(served)
    failed = client.get_inference_statistics("gated", headers=AUTH).model_stats[0].inference_stats.fail.count
    try:
        for k in range(2):  # the first is held in the stage, the second waits in front of it
            client.async_infer("gated", _inputs(_x(k)), lambda result, error: answers.put((result, error)), client_timeout=1.0, headers=AUTH)
        errors = [answers.get(timeout=30)[1] for _ in range(2)]
        assert [e.status() if e is not None else None for e in errors] == ["StatusCode.DEADLINE_EXCEEDED"] * 2
        _until(lambda: _inflight(served) == 0)  # at once, though the first still runs
        served.open()
        later = client.infer("gated", _inputs(_x(7)), headers=AUTH)  # runs after the first, where the second would have
        np.testing.assert_allclose(later.as_numpy("y"), _x(7)["x"])
        assert _runs(served) == before + 2  # the first and this one: the second was withdrawn
        stats = client.get_inference_statistics("gated", headers=AUTH).model_stats[0].inference_stats
        assert stats.fail.count == failed + 2
    finally:
        served.open()
        client.close()


def test_a_streams_deadline_ends_it_and_withdraws_its_queued_requests(served: Served) -> None:
    served.close()
    before = _runs(served)
    stream = Stream(served.proc.grpc, timeout=1.0)
    try:
        for k in range(3):  # one held in the stage, two waiting in front of it
            stream.send("gated", _x(k))
        result, error = stream.take(1)[0]
        assert result is None and error is not None and error.status() == "StatusCode.DEADLINE_EXCEEDED"
        _until(lambda: _inflight(served) == 0)
        served.open()
        client = grpcclient.InferenceServerClient(served.proc.grpc)
        client.infer("gated", _inputs(_x(7)), headers=AUTH)  # after the held one, where the others would have run
        client.close()
        assert _runs(served) == before + 2
    finally:
        served.open()
        stream.close()


def test_the_timeout_parameter_and_request_timeout_bound_the_wait_not_the_run(served: Served) -> None:
    """Triton's queue policy: a request still waiting for its model when its time is up is answered
    503 / UNAVAILABLE "Request timeout expired"; one that its model started is answered."""
    served.close()
    http = httpclient.InferenceServerClient(served.proc.http)
    grpc = grpcclient.InferenceServerClient(served.proc.grpc)
    headers = {"Authorization": AUTH["authorization"]}
    before = _runs(served)
    try:
        def inputs(value: float) -> list[httpclient.InferInput]:
            tensor = httpclient.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(_x(value)["x"])
            return [tensor]

        running: queue.Queue[Answer] = queue.Queue()
        # Held at the gate past its own 1 s and --request-timeout, once its stage has taken it. A
        # machine stalled past that 1 s before the stage could take it withdraws it (the policy
        # under test, too early): then it is sent again.
        for _ in range(3):
            began = served.begun()
            grpc.async_infer("gated", _inputs(_x(1)), lambda result, error: running.put((result, error)), headers=AUTH, timeout=1_000_000)
            _until(lambda began=began: served.begun() == began + 1 or not running.empty())
            if served.begun() == began + 1:
                break  # it is the stage's
            _, withdrawn = running.get()
            assert withdrawn is not None and "had not started the request" in withdrawn.message(), withdrawn
        else:
            pytest.skip("the machine stalled past the request's 1 s before its stage could take it, three times")
        own = "Request timeout expired: model 'gated' had not started the request 0.2 s after it came in (its 'timeout' parameter, 200000 us); " \
              "retry later, or give it more time"
        with pytest.raises(InferenceServerException) as e:
            http.infer("gated", inputs(2), headers=headers, timeout=200_000)
        assert (e.value.status(), e.value.message()) == ("503", own)
        with pytest.raises(InferenceServerException) as e:
            grpc.infer("gated", _inputs(_x(3)), headers=AUTH, timeout=200_000)
        assert (e.value.status(), e.value.message()) == ("StatusCode.UNAVAILABLE", own)
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as e:
            grpc.infer("gated", _inputs(_x(4)), headers=AUTH)  # no timeout of its own: the server's
        assert e.value.message() == (f"Request timeout expired: model 'gated' had not started the request {REQUEST_TIMEOUT_S:g} s after it came in "
                                     "(--request-timeout); retry later, or give it more time")
        assert time.monotonic() - started >= REQUEST_TIMEOUT_S - 0.1
        served.open()
        result, error = running.get(timeout=30)
        assert error is None, error  # started in time: answered
        np.testing.assert_allclose(result.as_numpy("y"), _x(1)["x"])
        _until(lambda: _inflight(served) == 0)
        assert _runs(served) == before + 1  # none of the three refused ran
    finally:
        served.open()
        http.close()
        grpc.close()


def test_a_timeout_parameter_that_is_not_microseconds_is_a_400(served: Served) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}], "parameters": {"timeout": "soon"}}
    status, answer = served.proc.request("POST", "/v2/models/gated/infer", json.dumps(body).encode(), {"Authorization": AUTH["authorization"]})
    assert (status, json.loads(answer)["error"]) == (400, "parameter 'timeout' must be a whole number of microseconds, 0 or more (0: none), got 'soon'")


# -- the drain (last: it stops the server) --------------------------------------------------------


def test_a_drain_answers_the_streams_requests_then_ends_it(served: Served) -> None:
    served.close()
    stream = Stream(served.proc.grpc)
    try:
        for k in range(2):
            stream.send("gated", _x(k), request_id=str(k))
        _until(lambda: _inflight(served) == 2)
        assert served.proc.proc is not None
        served.proc.proc.send_signal(signal.SIGTERM)
        _until(lambda: "draining: " in served.proc.log())  # the drain began with both in flight
        served.open()
        answers = stream.take(3)
    finally:
        served.open()
        stream.close()
    assert [(e, r.get_response().id) for r, e in answers[:2]] == [(None, "0"), (None, "1")]
    result, error = answers[2]
    assert result is None and error is not None and error.status() == "StatusCode.UNAVAILABLE"
    assert error.message() == "the server is shutting down: the stream's requests were answered, and it takes no more; send the rest to another server"
    assert served.proc.proc.wait(60) == 0, served.proc.log()
