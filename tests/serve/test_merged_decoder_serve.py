"""optimum's Whisper merged decoder, run whole as one stage with ``states = "auto"``, served as Triton
sequences (issue 39, item 4): a client's steps feed the token and the encoder's output only; the
server's stream feeds ``use_cache_branch`` and keeps the encoder's KV; the tokens equal transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from onnxpipe.builder import build, export
from onnxpipe.splitter import read_pipeline_file
from tests.runtime.test_merged_decoder import CORPUS, encoded, merged_pipeline_file
from tests.serve.process import ServerProcess


def test_a_merged_decoder_served_as_a_sequence_gives_transformers_tokens(tmp_path: Path) -> None:
    bundle = export(build(read_pipeline_file(merged_pipeline_file(tmp_path, "whisper")), tmp_path / "built").path, tmp_path / "decoder.onnxpipe")
    expected = json.loads((CORPUS / "whisper" / "expected.json").read_text())
    case = expected["requests"][0]
    hidden = encoded("whisper", case["inputs"])["encoder_hidden_states"]
    count = expected["new_tokens"]
    with ServerProcess(f"decoder={bundle}") as proc:
        proc.start(tmp_path / "serve.log")
        client = httpclient.InferenceServerClient(proc.http)
        config = client.get_model_metadata("decoder")
        assert sorted(t["name"] for t in config["inputs"]) == ["encoder_hidden_states", "input_ids"]  # no use_cache_branch
        token, tokens = expected["decoder_start_token_id"], []
        for step in range(count):
            ids = httpclient.InferInput("input_ids", [1, 1], "INT64")
            ids.set_data_from_numpy(np.array([[token]], np.int64))
            states = httpclient.InferInput("encoder_hidden_states", list(hidden.shape), "FP32")
            states.set_data_from_numpy(hidden)
            result = client.infer("decoder", [ids, states], sequence_id=7, sequence_start=step == 0, sequence_end=step == count - 1)
            token = int(np.argmax(result.as_numpy("logits")[0, -1]))
            tokens.append(token)
        assert tokens == case["tokens"]
        assert proc.stop() == 0
