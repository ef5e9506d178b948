"""Encoder-decoder generation served as Triton sequences (issue 39, item 5): optimum's T5 and Whisper
(tests/data/corpus), each one bundle of its encoder (on a sequence's first request only) and its
merged decoder, behind one ``onnxpipe serve``. A sequence's first request carries the encoder's
inputs (the ids and their mask, the audio features) with the decoder's first token; every later one
only the next token. 4 client threads per model over HTTP; each sequence's 16 greedy tokens equal
transformers' (the last logits within 1e-4). A later request that sends the audio again, and a first
one without it, are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from onnxpipe.splitter import read_pipeline_file
from tests.models import bundle_of
from tests.runtime.test_encoder_decoder import FAMILIES, check_generated, encdec_pipeline_file, expected, first_inputs, token_feed
from tests.serve.process import ServerProcess
from tests.waiting import in_threads

_TYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}


def _infer(client: httpclient.InferenceServerClient, model: str, feeds: dict[str, np.ndarray], sid: int, start: bool, end: bool) -> np.ndarray:
    inputs = []
    for name, value in feeds.items():
        tensor = httpclient.InferInput(name, list(value.shape), _TYPES[value.dtype])
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return client.infer(model, inputs, sequence_id=sid, sequence_start=start, sequence_end=end).as_numpy("logits")


def _generate(url: str, family: str, case: dict[str, Any], sid: int) -> tuple[list[int], np.ndarray]:
    """One sequence: the encoder's inputs and the start token first, then one token a request."""
    exp = expected(family)
    client = httpclient.InferenceServerClient(url)
    count = exp["new_tokens"]
    logits = _infer(client, family, first_inputs(family, case) | token_feed(family, exp["decoder_start_token_id"]), sid, True, count == 1)
    tokens = [int(np.argmax(logits[0, -1]))]
    while len(tokens) < count:
        logits = _infer(client, family, token_feed(family, tokens[-1]), sid, False, len(tokens) + 1 == count)
        tokens.append(int(np.argmax(logits[0, -1])))
    return tokens, logits[0, -1]


def _in_threads(url: str, family: str, first_id: int) -> list[tuple[list[int], np.ndarray]]:
    """Each of the family's requests a sequence of its own, in a client thread of its own."""
    cases = expected(family)["requests"]
    return in_threads(lambda j: _generate(url, family, cases[j], first_id + j), len(cases))


def test_t5_and_whisper_served_as_sequences_generate_transformers_tokens(tmp_path: Path) -> None:
    bundles = []
    for family in FAMILIES:
        folder = tmp_path / family
        folder.mkdir()
        bundles.append(f"{family}={bundle_of(read_pipeline_file(encdec_pipeline_file(folder, family, max_batch=4)), folder)}")
    with ServerProcess(*bundles) as proc:
        proc.start(tmp_path / "serve.log")
        for k, family in enumerate(FAMILIES):
            check_generated(family, _in_threads(proc.http, family, 100 * (k + 1)))
        client = httpclient.InferenceServerClient(proc.http)
        case = expected("whisper")["requests"][0]
        with pytest.raises(InferenceServerException, match=r"missing input\(s\) 'input_features'"):
            _infer(client, "whisper", token_feed("whisper", 3), 900, True, False)
        _infer(client, "whisper", first_inputs("whisper", case) | token_feed("whisper", 3), 901, True, False)
        with pytest.raises(InferenceServerException, match=r"input 'input_features' is given on a stream's first step only"):
            _infer(client, "whisper", first_inputs("whisper", case) | token_feed("whisper", 8), 901, False, False)
        _infer(client, "whisper", token_feed("whisper", 8), 901, False, True)  # the sequence goes on
