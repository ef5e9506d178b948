"""Encoder-decoder generation as one pipeline (issue 39, item 5): an encoder stage that runs on a
stream's first step only (``runs = "first"``), its output kept per stream by the decoder stage
(a kept input), the pipeline inputs only the encoder reads given on the first step only.

The mechanics on a tiny in-memory pair (tests/stateful_models.py's :func:`encoder_decoder`, whose
every output says whether the decoder was fed the first step's encoder output and mask); the real
thing on optimum's T5 and Whisper exports of tests/data/corpus (encoder + merged decoder), whose
16 greedy tokens must equal transformers' (expected.json) with the last step's logits within 1e-4.
Encoder calls are counted from ``pipe.stats()``: one per stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe import ConfigError, InputError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import Endpoint, Link, Pipeline, PipelineSpec, StageSpec, TensorSpec, load
from tests.models import bundle_of
from tests.stateful_models import encoder_decoder, encoder_decoder_whole


def _config(max_batch: int = 1, runs: str = "first", states: bool = True) -> PipelineConfig:
    """The pair wired as a user would: encoder first-step-only, decoder with its state."""
    encoder_model, decoder_model = encoder_decoder()
    config = PipelineConfig("encdec")
    encoder = config.add_stage(encoder_model, "encoder", runs=runs)
    decoder = config.add_stage(decoder_model, "decoder")
    for stage in (encoder, decoder):
        stage.configure(max_batch=max_batch)
    config.add_input(TensorSpec("x", "float32", ("batch", "n"))).connect(encoder.input("x"))
    mask = config.add_input(TensorSpec("mask", "float32", ("batch", "n")))
    mask.connect(encoder.input("mask"))
    mask.connect(decoder.input("mask"))
    config.add_input(TensorSpec("tok", "float32", ("batch", 1))).connect(decoder.input("tok"))
    encoder.output("h").connect(decoder.input("h"))
    decoder.output("y").connect(config.add_output(TensorSpec("y", "float32", ("batch", 1))))
    if states:
        config.add_state(decoder.output("stateN"), decoder.input("state"))
    else:
        config.add_input(TensorSpec("state", "float32", ("batch", 1))).connect(decoder.input("state"))
    return config


def _stage_counts(pipe: Pipeline) -> dict[str, int]:
    return {s.stage: s.count for s in pipe.stats().stages}


def _request(seed: int, n: int = 5, steps: int = 4) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, n)).astype(np.float32)
    mask = (rng.random((1, n)) > 0.3).astype(np.float32)
    return x, mask, [rng.standard_normal((1, 1)).astype(np.float32) for _ in range(steps)]


@pytest.fixture(scope="module")
def encdec_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundle_of(_config(), tmp_path_factory.mktemp("encdec"))


# -- the spec ---------------------------------------------------------------------------------------


def test_the_spec_says_which_inputs_are_first_step_only_and_which_the_decoder_keeps() -> None:
    spec = _config().to_spec()
    assert spec.stage("encoder").runs == "first" and spec.stage("encoder").first_step_only
    assert spec.first_step_inputs == ("x", "mask")
    assert spec.kept_inputs("decoder") == ("h", "mask")
    assert spec.kept_inputs("encoder") == ()
    data = spec.to_dict()
    assert data["stages"][0]["runs"] == "first" and "runs" not in data["stages"][1]  # written only when set
    again = PipelineSpec.from_json(spec.to_json())
    assert again.stage("encoder").runs == "first" and again == spec


def test_a_first_step_stage_is_refused_where_it_cannot_work() -> None:
    with pytest.raises(ConfigError, match=r"stage 'encoder' runs on a stream's first step only \(runs \"first\"\), but the pipeline keeps no state"):
        _config(states=False).to_spec()
    with pytest.raises(ConfigError, match=r"stage 'encoder': runs must be one of 'every', 'first', got 'once'"):
        _config(runs="once")
    spec = _config().to_spec()
    fed_out = PipelineSpec(spec.inputs, (*spec.outputs, TensorSpec("h", "float32", ("batch", "n"))), spec.stages,
                           (*spec.links, Link(Endpoint("encoder", "h"), Endpoint(None, "h"))), spec.metadata, states=spec.states)
    with pytest.raises(ConfigError, match=r"yet it feeds pipeline output 'h', which its later steps would lack"):
        fed_out.validate()
    stage = spec.stage("encoder")
    bad = StageSpec(stage.name, stage.module, stage.inputs, stage.outputs, runs="sometimes")
    with pytest.raises(ConfigError, match=r"stage 'encoder': runs must be one of 'every', 'first', got \"sometimes\""):
        bad.check()


# -- a stream ----------------------------------------------------------------------------------------


def test_a_stream_runs_the_encoder_once_and_the_decoder_keeps_its_output(encdec_bundle: Path) -> None:
    with load(encdec_bundle) as pipe:
        for seed in range(3):
            x, mask, toks = _request(seed, n=4 + seed)
            want = encoder_decoder_whole(x, mask, toks)
            with pipe.stream() as s:
                got = [s.step({"x": x, "mask": mask, "tok": toks[0]})["y"]]
                got += [s.step({"tok": tok})["y"] for tok in toks[1:]]
            for t, (a, b) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"stream {seed}, step {t}")
        assert _stage_counts(pipe) == {"encoder": 3, "decoder": 12}  # one encoder call per stream


def test_a_later_step_giving_a_first_step_input_is_refused_and_the_stream_goes_on(encdec_bundle: Path) -> None:
    x, mask, toks = _request(7)
    with load(encdec_bundle) as pipe, pipe.stream() as s:
        with pytest.raises(InputError, match=r"missing input\(s\)|'x'"):
            s.step({"tok": toks[0]})  # the first step needs what the encoder reads
        s.step({"x": x, "mask": mask, "tok": toks[0]})
        with pytest.raises(InputError, match=r"input 'x' is given on a stream's first step only: stage 'encoder' reads it, which runs on the "
                                             r"first step only \(runs \"first\"\), and the stages after it keep what it made; step 1 takes: 'tok'"):
            s.step({"x": x, "tok": toks[1]})
        got = s.step({"tok": toks[1]})["y"]
        np.testing.assert_allclose(got, encoder_decoder_whole(x, mask, toks[:2])[1], rtol=1e-6)


def test_batched_streams_run_their_first_steps_through_the_encoder_together(tmp_path: Path) -> None:
    bundle = bundle_of(_config(max_batch=4), tmp_path)
    requests = [_request(seed) for seed in range(4)]
    with load(bundle, micro_batches=1) as pipe:  # one group: the 4 streams step together
        streams = [pipe.stream() for _ in requests]
        got: list[list[np.ndarray]] = [[] for _ in requests]
        for t in range(4):
            feeds: dict[Any, dict[str, np.ndarray]] = {}
            for s, (x, mask, toks) in zip(streams, requests, strict=True):
                feeds[s] = {"tok": toks[t]} | ({"x": x, "mask": mask} if t == 0 else {})
            for j, future in enumerate(pipe.submit_steps(feeds).values()):
                got[j].append(future.result()["y"])
        for s in streams:
            s.close()
        stats = {st.stage: st for st in pipe.stats().stages}
    for j, (x, mask, toks) in enumerate(requests):
        for t, (a, b) in enumerate(zip(got[j], encoder_decoder_whole(x, mask, toks), strict=True)):
            np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"stream {j}, step {t}")
    assert stats["encoder"].count == 4 and stats["encoder"].batch_sizes == {4: 1}  # the 4 first steps in one call
    assert stats["decoder"].count == 16 and stats["decoder"].batch_sizes == {4: 4}
