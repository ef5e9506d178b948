"""A model with state behind Triton's sequence extension: sequence_id / sequence_start /
sequence_end map onto streams, interleaved sequences over HTTP and gRPC equal in-process streams,
and every misuse is a 400 naming the parameter (or a 503 naming the limit)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from onnxpipe import runtime
from tests.serve.conftest import serve_args
from tests.serve.process import ServerProcess
from tests.serve.sequences import Sequences
from tests.waiting import skip_if_stalled, until


def _steps(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(count)]


def _alone(bundle: Path, xs: list[np.ndarray]) -> list[np.ndarray]:
    with runtime.load(bundle) as pipe, pipe.stream() as s:
        return [s.step({"x": x})["y"] for x in xs]


def _http_step(client: httpclient.InferenceServerClient, sid: int | str, x: np.ndarray, start: bool = False, end: bool = False) -> np.ndarray:
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer("rnn", [tensor], sequence_id=sid, sequence_start=start, sequence_end=end).as_numpy("y")


def _grpc_step(client: grpcclient.InferenceServerClient, sid: int | str, x: np.ndarray, start: bool = False, end: bool = False) -> np.ndarray:
    tensor = grpcclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer("rnn", [tensor], sequence_id=sid, sequence_start=start, sequence_end=end).as_numpy("y")


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpclient.InferenceServerClient]:
    yield httpclient.InferenceServerClient(server.http)


def test_three_interleaved_sequences_equal_each_stream_alone(server: ServerProcess, bundles: dict[str, Path], http: httpclient.InferenceServerClient) -> None:
    grpc = grpcclient.InferenceServerClient(server.grpc)
    ids: list[int | str] = [11, "user-7", 2**64 - 1]
    xs = {sid: _steps(k, 6) for k, sid in enumerate(ids)}
    want = {sid: _alone(bundles["rnn"], xs[sid]) for sid in ids}
    got: dict[int | str, list[np.ndarray]] = {sid: [] for sid in ids}
    for t in range(6):
        for sid in ids:  # round-robin; the string id over gRPC, the others over HTTP
            step = _grpc_step if isinstance(sid, str) else _http_step
            got[sid].append(step(grpc if isinstance(sid, str) else http, sid, xs[sid][t], start=t == 0, end=t == 5))  # type: ignore[arg-type]
    for sid in ids:
        for t, (g, w) in enumerate(zip(got[sid], want[sid], strict=True)):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"sequence {sid!r}, step {t}")


def test_a_sequence_ended_is_gone_and_misuse_is_a_400_naming_the_parameter(server: ServerProcess, http: httpclient.InferenceServerClient) -> None:
    x = _steps(9, 1)[0]
    _http_step(http, 501, x, start=True)
    _http_step(http, 501, x, end=True)
    with pytest.raises(InferenceServerException, match=r"sequence_id 501 names no open sequence of model 'rnn' \(it ended with sequence_end\): "
                       r"the first request of a sequence must set 'sequence_start': true") as e:
        _http_step(http, 501, x)  # ended
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException, match=r"sequence_id 502 names no open sequence"):
        _http_step(http, 502, x)  # never started
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match=r"model 'rnn' keeps state between the steps of a sequence: give the 'sequence_id' parameter") as e:
        http.infer("rnn", [tensor])  # stateless request to a model with state
    assert e.value.status() == "400"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}], "parameters": {"sequence_id": 5, "sequence_start": "yes"}}
    refused = b'{"error":"parameter \'sequence_start\' must be a boolean, got \'yes\'"}'
    assert server.request("POST", "/v2/models/rnn/infer", json.dumps(body).encode()) == (400, refused)
    with pytest.raises(InferenceServerException, match=r"a string id may have at most 128 characters, got 129"):
        _http_step(http, "s" * 129, x, start=True)


def test_a_restarted_sequence_starts_from_a_fresh_state(bundles: dict[str, Path], http: httpclient.InferenceServerClient) -> None:
    xs = _steps(4, 3)
    want = _alone(bundles["rnn"], xs[:1])
    _http_step(http, 77, xs[1], start=True)
    _http_step(http, 77, xs[2])
    np.testing.assert_allclose(_http_step(http, 77, xs[0], start=True), want[0], rtol=1e-6)  # as Triton: the old one ends
    _http_step(http, 77, xs[0], end=True)


def test_idle_sequences_are_freed_and_max_streams_refusals_are_503(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "rnn"), "--max-streams", "2", "--stream-timeout", "0.3") as proc:
        proc.start(tmp_path / "serve.log")
        http = httpclient.InferenceServerClient(proc.http)
        x = _steps(1, 1)[0]
        since = time.monotonic()
        _http_step(http, 1, x, start=True)
        _http_step(http, 2, x, start=True)
        room = r"model 'rnn' cannot start sequence 3: 2 sequences are open, the limit \(--max-streams 2\): sequence_ids 1, 2; "
        with pytest.raises(InferenceServerException, match=room) as e:
            try:
                _http_step(http, 3, x, start=True)
            finally:
                skip_if_stalled(since, 0.3)  # 1 and 2 were still open (tests/waiting.py)
        assert e.value.status() == "503"
        # Idle past the timeout: freed without any request (the server's own timer, every 0.075 s).
        until(lambda: 'onnxpipe_open_streams{model="rnn"} 0.0' in proc.get("/metrics")[1].decode(), "the server's timer freed both sequences")
        idle = r"sequence_id 1 names no open sequence of model 'rnn' \(it was idle for more than --stream-timeout 0.3 s"
        with pytest.raises(InferenceServerException, match=idle):
            _http_step(http, 1, x)
        _http_step(http, 3, x, start=True, end=True)
        assert proc.stop() == 0


def test_decoder_sequences_batch_at_the_entry_and_decode_the_tokens_each_makes_alone(tmp_path: Path) -> None:
    """A KV-cache decoder whose stages batch (max_batch=8, max_delay_ms=20), served: 6 sequences,
    each greedy-decoded by a client thread of its own over HTTP (sequence_id, start, end), with
    prompts of different lengths started apart: their steps meet at the pipeline's entry and travel
    as batches (Triton's statistics: fewer executions than inferences), and every sequence's
    tokens equal the whole model alone."""
    from onnxpipe.splitter import split
    from tests.models import bundle_of
    from tests.stateful_models import decode_in_threads, gpt_decoder, whole_generate

    decoder = gpt_decoder()
    plan = split(decoder, ["layer1.out"], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=8, max_delay_ms=20)
    bundle = bundle_of(plan, tmp_path / "decoder")
    prompts = [[1 + k, 2, 3][: 1 + k % 3] for k in range(6)]
    count = 12
    with ServerProcess(f"decoder={bundle}") as proc:
        proc.start(tmp_path / "serve.log")
        got = decode_in_threads(Sequences(proc.http, count), prompts, [count] * len(prompts), apart=0.003)
        stats = httpclient.InferenceServerClient(proc.http).get_inference_statistics("decoder")["model_stats"][0]
    for k, prompt in enumerate(prompts):
        assert got[k][0] == whole_generate(decoder, prompt, count)[0], f"sequence {k}"
    assert stats["inference_count"] == len(prompts) * count
    assert stats["execution_count"] < stats["inference_count"], stats
