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
from tests.stateful_models import encoder_decoder_config, encoder_decoder_whole


def _config(max_batch: int = 1, runs: str = "first", states: bool = True) -> PipelineConfig:
    """The pair wired as a user would: encoder first-step-only, decoder with its state."""
    return encoder_decoder_config(max_batch, runs, states)


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


def test_the_pipeline_file_sets_runs_and_refuses_other_values(tmp_path: Path) -> None:
    from onnxpipe.splitter import read_pipeline_file

    config = read_pipeline_file(encdec_pipeline_file(tmp_path, "whisper"))
    assert [s.runs for s in config.stages] == ["first", "every"]
    text = encdec_pipeline_file(tmp_path, "whisper").read_text().replace('runs = "first"', 'runs = "once"')
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"stages\[0\] \('encoder'\): runs must be one of 'every', 'first', got 'once'"):
        read_pipeline_file(tmp_path / "bad.toml")


def test_batch_lengths_is_a_build_setting_with_two_values() -> None:
    from onnxpipe.runtime import StageSettings

    assert StageSettings().batch_lengths == "any" and "batch_lengths" not in StageSettings().to_dict()  # written only when set
    assert StageSettings.from_dict(StageSettings(batch_lengths="equal").to_dict()).batch_lengths == "equal"
    with pytest.raises(ConfigError, match=r"batch_lengths must be one of 'any', 'equal', got 'same'"):
        StageSettings(batch_lengths="same")


def test_a_decoder_without_a_mask_batches_only_with_batch_lengths_equal(tmp_path: Path) -> None:
    from onnxpipe import BuildError
    from onnxpipe.builder import build
    from onnxpipe.splitter import read_pipeline_file

    config = read_pipeline_file(encdec_pipeline_file(tmp_path, "whisper", max_batch=4, lengths="any"))
    with pytest.raises(BuildError, match=r"stage 'decoder' keeps state that grows.*no attention mask input.*set max_batch=1 for it, or "
                                         r"batch_lengths=\"equal\" to batch only streams whose pasts are equally long"):
        build(config, tmp_path / "built")


def test_inspect_shows_the_first_step_stage_and_what_the_decoder_keeps(encdec_bundle: Path) -> None:
    from tests.cli.helpers import ok

    shown = ok("inspect", encdec_bundle).output
    assert "  runs:     on a stream's first step only (the later stages keep what it made)" in shown
    assert "  in  h: float32[batch, n]  <- encoder.h  (kept from the stream's first step)" in shown
    assert "  in  mask: float32[batch, n]  <- pipeline.mask  (kept from the stream's first step)" in shown


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


# -- optimum's T5 and Whisper (tests/data/corpus) ------------------------------------------------------

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
FAMILIES = ("t5", "whisper")


def encdec_pipeline_file(folder: Path, family: str, max_batch: int = 1, lengths: str = "equal") -> Path:
    """The pipeline file docs/streams.md shows: the encoder on the first step only, optimum's
    merged decoder with its states (``states = "auto"``: the KV caches, the encoder's KV set once,
    ``use_cache_branch`` fed by the runtime), the encoder's output kept by the decoder."""
    models = CORPUS / family
    batching = f"\nsettings = {{ max_batch = {max_batch} }}" if max_batch > 1 else ""
    decoder_batching = f'\nsettings = {{ max_batch = {max_batch}, batch_lengths = "{lengths}" }}' if max_batch > 1 else ""
    t5 = family == "t5"
    text = f'''format = "onnxpipe.pipeline-file"
version = 1
name = "{family}"
inputs = {'["input_ids", "attention_mask", "decoder_input_ids"]' if t5 else '["input_features", "input_ids"]'}
outputs = ["logits"]

[[stages]]
name = "encoder"
model = "{(models / "encoder_model.onnx").as_posix()}"
runs = "first"{batching}
output_map = {{ last_hidden_state = "encoder_hidden_states" }}

[[stages]]
name = "decoder"
model = "{(models / "decoder_model_merged.onnx").as_posix()}"
states = "auto"{decoder_batching}
{'input_map = { input_ids = "decoder_input_ids", encoder_attention_mask = "attention_mask" }' if t5 else ""}
'''
    path = folder / f"{family}.toml"
    path.write_text(text)
    return path


def expected(family: str) -> dict[str, Any]:
    return json.loads((CORPUS / family / "expected.json").read_text())


def first_inputs(family: str, request: dict[str, Any]) -> dict[str, np.ndarray]:
    """What a stream's first step gives besides the decoder's token: the encoder's inputs."""
    if family == "t5":
        ids = np.array(request["inputs"]["input_ids"], np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    return {"input_features": np.array(request["inputs"]["input_features"], np.float32)}


def token_feed(family: str, token: int) -> dict[str, np.ndarray]:
    return {"decoder_input_ids" if family == "t5" else "input_ids": np.array([[token]], np.int64)}


def generate_together(pipe: Any, family: str, firsts: list[dict[str, np.ndarray]]) -> list[tuple[list[int], np.ndarray]]:
    """A stream per request, stepped together by one driver (``submit_steps``): the first step
    gives the request's encoder inputs ``firsts[j]`` and the start token, later steps the stream's
    greedy token; each stream's tokens and last logits."""
    exp = expected(family)
    streams = [pipe.stream() for _ in firsts]
    tokens: list[list[int]] = [[] for _ in streams]
    logits: list[np.ndarray] = [np.zeros(0)] * len(streams)
    for step in range(exp["new_tokens"]):
        feeds = {s: token_feed(family, tokens[j][-1] if step else exp["decoder_start_token_id"]) | (firsts[j] if step == 0 else {})
                 for j, s in enumerate(streams)}
        for j, future in enumerate(pipe.submit_steps(feeds).values()):
            logits[j] = future.result()["logits"][0, -1]
            tokens[j].append(int(np.argmax(logits[j])))
    for s in streams:
        s.close()
    return list(zip(tokens, logits, strict=True))


def check_generated(family: str, got: list[tuple[list[int], np.ndarray]]) -> None:
    """Each request's 16 greedy tokens equal transformers', its last step's logits within 1e-4."""
    cases = expected(family)["requests"]
    assert len(got) == len(cases)
    for j, ((tokens, logits), case) in enumerate(zip(got, cases, strict=True)):
        assert tokens == case["tokens"], f"{family}: request {j}"
        np.testing.assert_allclose(logits, np.array(case["last_logits"], np.float32), atol=1e-4, err_msg=f"{family}: request {j}")


@pytest.fixture(scope="module")
def corpus_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    from onnxpipe.splitter import read_pipeline_file

    out = {}
    for family in FAMILIES:
        for max_batch in (1, 4):
            folder = tmp_path_factory.mktemp(f"{family}{max_batch}")
            out[family, max_batch] = bundle_of(read_pipeline_file(encdec_pipeline_file(folder, family, max_batch)), folder)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_optimums_encoder_and_merged_decoder_generate_transformers_tokens_with_one_encoder_call_per_stream(
        corpus_bundles: dict[tuple[str, int], Path], family: str) -> None:
    exp = expected(family)
    got = []
    with load(corpus_bundles[family, 1]) as pipe:
        for case in exp["requests"]:
            with pipe.stream() as s:
                out = s.step(first_inputs(family, case) | token_feed(family, exp["decoder_start_token_id"]))
                tokens = [int(np.argmax(out["logits"][0, -1]))]
                while len(tokens) < exp["new_tokens"]:
                    out = s.step(token_feed(family, tokens[-1]))
                    tokens.append(int(np.argmax(out["logits"][0, -1])))
            got.append((tokens, out["logits"][0, -1]))
        counts = _stage_counts(pipe)
    check_generated(family, got)
    assert counts == {"encoder": 4, "decoder": 4 * exp["new_tokens"]}  # the encoder once per stream


@pytest.mark.parametrize("family", FAMILIES)
def test_four_streams_batched_generate_the_same_tokens(corpus_bundles: dict[tuple[str, int], Path], family: str) -> None:
    """Every stage batching (max_batch 4; the decoder, which has no mask over its own past, batches
    streams at equal lengths: ``batch_lengths = "equal"``): the 4 streams' first steps go through the
    encoder together where their inputs have one shape (Whisper's), T5's of 4 lengths one by one;
    each stream's tokens are its own."""
    exp = expected(family)
    with load(corpus_bundles[family, 4], micro_batches=1) as pipe:
        generated = generate_together(pipe, family, [first_inputs(family, case) for case in exp["requests"]])
        stats = {st.stage: st for st in pipe.stats().stages}
    check_generated(family, generated)
    assert stats["encoder"].count == 4
    assert stats["encoder"].batch_sizes == ({4: 1} if family == "whisper" else {1: 4})
    assert stats["decoder"].count == 4 * exp["new_tokens"] and max(stats["decoder"].batch_sizes) == 4


@pytest.mark.xdist_group("ray")  # the session's Ray cluster (tests/conftest.py), on the worker the Ray engine's tests use
def test_the_encoder_and_the_decoder_on_two_ray_nodes_generate_whispers_tokens(tmp_path: Path, ray_cluster: Any) -> None:
    """The encoder on node ``a``, the decoder on ``b`` (a speech encoder on one host, the decoder on
    another): the later steps never reach the encoder's actor, and the decoder's actor keeps the
    encoder's output; tokens equal transformers'."""
    from onnxpipe.splitter import read_pipeline_file

    config = read_pipeline_file(encdec_pipeline_file(tmp_path, "whisper"))
    config.stage("encoder").configure(host="a")
    config.stage("decoder").configure(host="b")
    exp = expected("whisper")
    cases = exp["requests"][:2]
    got = []
    with load(bundle_of(config, tmp_path), engine="ray") as pipe:
        for case in cases:
            with pipe.stream() as s:
                out = s.step(first_inputs("whisper", case) | token_feed("whisper", exp["decoder_start_token_id"]))
                tokens = [int(np.argmax(out["logits"][0, -1]))]
                while len(tokens) < exp["new_tokens"]:
                    out = s.step(token_feed("whisper", tokens[-1]))
                    tokens.append(int(np.argmax(out["logits"][0, -1])))
            got.append((tokens, out["logits"][0, -1]))
        counts = _stage_counts(pipe)
        hosts = [stage.replicas[0].labels.get("onnxpipe/host") for stage in pipe.diagnostics().stages]
    for (tokens, logits), case in zip(got, cases, strict=True):
        assert tokens == case["tokens"]
        np.testing.assert_allclose(logits, np.array(case["last_logits"], np.float32), atol=1e-4)
    assert hosts == ["a", "b"]
    assert counts == {"encoder": 2, "decoder": 2 * exp["new_tokens"]}


def test_t5_requests_padded_to_one_length_batch_in_the_encoder_and_the_decoder(corpus_bundles: dict[tuple[str, int], Path]) -> None:
    """T5's 4 requests (5 to 8 tokens) right-padded to 8 with a mask of 0s over the padding, as a
    batch of T5 requests is given: one encoder call for the 4 first steps, the decoder's steps in
    batches of 4, each stream's tokens those of its request alone (the padding masked in the
    encoder and in the decoder's cross-attention)."""
    exp = expected("t5")
    width = max(len(case["inputs"]["input_ids"][0]) for case in exp["requests"])
    padded = []
    for case in exp["requests"]:
        ids = case["inputs"]["input_ids"][0]
        pad = width - len(ids)
        padded.append({"input_ids": np.array([ids + [0] * pad], np.int64), "attention_mask": np.array([[1] * len(ids) + [0] * pad], np.int64)})
    with load(corpus_bundles["t5", 4], micro_batches=1) as pipe:
        generated = generate_together(pipe, "t5", padded)
        stats = {st.stage: st for st in pipe.stats().stages}
    check_generated("t5", generated)
    assert stats["encoder"].batch_sizes == {4: 1}
    assert stats["decoder"].batch_sizes == {4: exp["new_tokens"]}
