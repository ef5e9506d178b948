"""Triton's own Python clients against a real ``onnxpipe serve``: HTTP (binary and JSON tensors)
and gRPC results equal the same bundles run in process, for a 2-stage light model, a model with
two outputs, and a code stage with BYTES in and out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from onnxpipe import runtime
from tests.serve.conftest import assert_mlp_in_flight, squeeze_input
from tests.serve.process import ServerProcess


@pytest.fixture(scope="module")
def local(bundles: dict[str, Path]) -> Iterator[dict[str, runtime.Pipeline]]:
    pipes = {name: runtime.load(bundles[name], allow_code=["tests.*"]) for name in ("squeeze", "twoout", "labelled")}
    yield pipes
    for pipe in pipes.values():
        pipe.close()


def _cases() -> list[tuple[str, dict[str, np.ndarray]]]:
    rng = np.random.default_rng(3)
    return [
        ("squeeze", {"data_0": squeeze_input(1)}),
        ("twoout", {"X": rng.standard_normal((1, 4)).astype(np.float32)}),
        ("labelled", {"x": rng.standard_normal((3, 4)).astype(np.float32), "prefix": np.array(["café", "日本語", ""], dtype=object)}),
    ]


def _http_inputs(feeds: dict[str, np.ndarray], binary: bool) -> list[Any]:
    inputs = []
    for name, value in feeds.items():
        datatype = "BYTES" if value.dtype == object else {"float32": "FP32"}[str(value.dtype)]
        tensor = httpclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value, binary_data=binary)
        inputs.append(tensor)
    return inputs


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        if value.dtype == object:  # the clients give BYTES back as bytes
            assert [v.decode() if isinstance(v, bytes) else v for v in got[name].reshape(-1)] == list(value.reshape(-1)), name
        else:
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
            np.testing.assert_array_equal(got[name], value, err_msg=name)  # the same sessions: bit for bit


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("model", "feeds"), _cases(), ids=[c[0] for c in _cases()])
def test_http_results_equal_the_pipeline_in_process(server: ServerProcess, local: dict[str, runtime.Pipeline], model: str,
                                                    feeds: dict[str, np.ndarray], binary: bool) -> None:
    want = local[model](feeds)
    client = httpclient.InferenceServerClient(server.http)
    # All outputs (binary_data_output), then each asked for by name in the same encoding as the inputs.
    everything = client.infer(model, _http_inputs(feeds, binary))
    _same({n: everything.as_numpy(n) for n in want}, want)
    asked = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in reversed(list(want))]
    named = client.infer(model, _http_inputs(feeds, binary), outputs=asked, request_id="req-7")
    assert named.get_response()["id"] == "req-7"
    assert [o["name"] for o in named.get_response()["outputs"]] == list(reversed(list(want)))
    _same({n: named.as_numpy(n) for n in want}, want)


@pytest.mark.parametrize(("model", "feeds"), _cases(), ids=[c[0] for c in _cases()])
def test_grpc_results_equal_the_pipeline_in_process(server: ServerProcess, local: dict[str, runtime.Pipeline], model: str,
                                                    feeds: dict[str, np.ndarray]) -> None:
    want = local[model](feeds)
    client = grpcclient.InferenceServerClient(server.grpc)
    inputs = []
    for name, value in feeds.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer(model, inputs, request_id="g-1")
    assert result.get_response().id == "g-1"
    _same({n: result.as_numpy(n) for n in want}, want)
    first = next(iter(want))
    only = client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(first)])
    assert [o.name for o in only.get_response().outputs] == [first]


def test_metadata_and_config_describe_the_bundle_to_both_clients(server: ServerProcess, local: dict[str, runtime.Pipeline]) -> None:
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    assert http.is_server_live() and http.is_server_ready() and grpc.is_server_live() and grpc.is_server_ready()
    assert http.is_model_ready("squeeze") and grpc.is_model_ready("squeeze") and http.is_model_ready("squeeze", "1")
    server_meta = http.get_server_metadata()
    assert server_meta["name"] == "onnxpipe" and set(server_meta["extensions"]) == {"binary_tensor_data", "model_configuration", "statistics", "sequence"}
    assert list(grpc.get_server_metadata().extensions) == server_meta["extensions"]
    meta = http.get_model_metadata("labelled")
    assert meta["versions"] == ["1"] and meta["platform"] == "onnxpipe"
    assert meta["inputs"] == [{"name": "prefix", "datatype": "BYTES", "shape": [-1]}, {"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert grpc.get_model_metadata("labelled", as_json=True)["outputs"] == [
        {"name": "label", "datatype": "BYTES", "shape": ["-1"]},  # int64 in proto JSON: strings
        {"name": "score", "datatype": "FP32", "shape": ["-1"]},
    ]
    config = http.get_model_config("squeeze")
    assert config["max_batch_size"] == 0 and config["platform"] == "onnxpipe"
    assert config["input"] == [{"name": "data_0", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [1, 3, 224, 224], "optional": False}]
    assert "sequence_batching" not in config
    assert grpc.get_model_config("rnn").config.sequence_batching.max_sequence_idle_microseconds == 5_000_000
    assert http.get_model_config("labelled")["output"][0] == {"name": "label", "data_type": "TYPE_STRING", "dims": [-1]}


def test_a_model_that_batches_says_so_and_batches_concurrent_requests(server: ServerProcess) -> None:
    """A stage with max_batch=8: the config reports max_batch_size 8 with dims past the batch dim
    and Triton's dynamic batcher; 8 requests sent at once by the HTTP client (Triton's async
    infer) come back each equal to the model alone."""
    http, grpc = httpclient.InferenceServerClient(server.http, concurrency=8), grpcclient.InferenceServerClient(server.grpc)
    config = http.get_model_config("mlp")
    assert config["max_batch_size"] == 8 and config["dynamic_batching"] == {"max_queue_delay_microseconds": 2000}
    assert config["input"][0]["dims"] == [-1] and config["output"][0]["dims"] == [-1, 8]
    assert grpc.get_model_config("mlp").config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert "oldest" not in http.get_model_config("rnn")["sequence_batching"]
    rng = np.random.default_rng(5)
    assert_mlp_in_flight(http, [rng.integers(0, 16, (1, 4)).astype(np.int64) for _ in range(8)])


def test_statistics_count_the_requests_each_client_sent(server: ServerProcess) -> None:
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    before = http.get_inference_statistics("twoout")["model_stats"][0]
    x = np.ones((1, 4), np.float32)
    for _ in range(3):
        http.infer("twoout", _http_inputs({"X": x}, True))
    tensor = grpcclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    grpc.infer("twoout", [tensor])
    after = http.get_inference_statistics("twoout")["model_stats"][0]
    stats = after["inference_stats"]
    assert after["inference_count"] - before["inference_count"] == 4
    assert stats["success"]["count"] - before["inference_stats"]["success"]["count"] == 4
    assert stats["compute_input"]["count"] == stats["compute_infer"]["count"] == stats["compute_output"]["count"] == stats["queue"]["count"]
    # Every part of a request lies within it: what perf_analyzer subtracts to find the overhead.
    parts = sum(stats[k]["ns"] for k in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert 0 < parts <= stats["success"]["ns"]
    grpc_stats = grpc.get_inference_statistics("twoout", as_json=True)["model_stats"][0]
    assert int(grpc_stats["inference_count"]) >= after["inference_count"]
    everything = http.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in everything} == {"squeeze", "twoout", "labelled", "rnn", "mlp"}
