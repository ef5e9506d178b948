"""``GET /metrics`` is Prometheus text that prometheus-client's own parser reads, and its counts
match the requests sent: by outcome and protocol, durations, and per stage from the pipeline's
own statistics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import serve_args
from tests.serve.process import ServerProcess


def _samples(proc: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = proc.get("/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_metrics_parse_and_count_what_was_sent(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "twoout", "rnn"), "--allow-code", "tests.*") as proc:
        proc.start(tmp_path / "serve.log")
        x = np.ones((1, 4), np.float32)
        http = httpclient.InferenceServerClient(proc.http)
        for _ in range(5):
            tensor = httpclient.InferInput("X", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            http.infer("twoout", [tensor])
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        for _ in range(2):
            tensor = grpcclient.InferInput("X", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            grpc.infer("twoout", [tensor])
        bad = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1]}]}).encode()
        for _ in range(3):
            assert proc.request("POST", "/v2/models/twoout/infer", bad)[0] == 400
        rnn = httpclient.InferInput("x", [1, 4], "FP32")
        rnn.set_data_from_numpy(x)
        http.infer("rnn", [rnn], sequence_id=9, sequence_start=True)
        got = _samples(proc)
        assert proc.stop() == 0

    def value(name: str, **labels: str) -> float:
        return got.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("onnxpipe_requests_total", model="twoout", protocol="http", outcome="success") == 5
    assert value("onnxpipe_requests_total", model="twoout", protocol="grpc", outcome="success") == 2
    assert value("onnxpipe_requests_total", model="twoout", protocol="http", outcome="bad_request") == 3
    assert value("onnxpipe_request_duration_seconds_count", model="twoout", protocol="http") == 5
    assert value("onnxpipe_request_duration_seconds_bucket", model="twoout", protocol="http", le="+Inf") == 5
    assert value("onnxpipe_request_duration_seconds_sum", model="twoout", protocol="http") > 0
    for stage in ("stage0", "stage1", "stage2"):
        assert value("onnxpipe_stage_runs_total", model="twoout", stage=stage) == 7, stage  # the 400s never reached a stage
        assert value("onnxpipe_stage_failures_total", model="twoout", stage=stage) == 0
        assert value("onnxpipe_stage_compute_seconds_total", model="twoout", stage=stage) > 0
        assert ("onnxpipe_stage_queue_seconds_total", (("model", "twoout"), ("stage", stage))) in got
    assert value("onnxpipe_inflight_requests", model="twoout") == 0
    assert value("onnxpipe_open_streams", model="rnn") == 1
