"""What ServedModel tells Triton's clients about a model that batches (docs/batching.md), checked
on the config itself and through the gRPC message it must parse into."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format

from onnxpipe.runtime import load
from onnxpipe.serve._models import ServedModel
from onnxpipe.serve._proto import oip_pb2 as pb
from onnxpipe.splitter import split
from tests.models import bundle_of
from tests.stateful_models import recurrent


def test_streams_that_batch_report_the_sequence_batchers_oldest_strategy(tmp_path: Path) -> None:
    plan = split(recurrent(), ["state1N"], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=4, max_delay_ms=1.5)
    bundle = bundle_of(plan, tmp_path)
    with load(bundle) as pipe:
        config = ServedModel("rnn", bundle, pipe, 8).config(5.0)
    assert config["max_batch_size"] == 4
    assert config["input"][0]["dims"] == [4] and config["output"][0]["dims"] == [4]  # x [batch, 4] -> dims past the batch dim
    assert config["sequence_batching"] == {"max_sequence_idle_microseconds": 5_000_000,
                                           "oldest": {"max_candidate_sequences": 4, "max_queue_delay_microseconds": 1500}}
    assert "dynamic_batching" not in config
    message = json_format.ParseDict(config, pb.ModelConfig())
    assert message.sequence_batching.oldest.max_candidate_sequences == 4 and message.max_batch_size == 4
