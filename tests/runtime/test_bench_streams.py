"""runtime.benchmark() on pipelines with state: streams stepping together (Note: benchmarking
streams, runtime/_bench.py). What is counted, never how long it took: calls per stage, batch sizes,
steps, the encoder's one call per stream; the refusals of what does not apply."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe import ConfigError, InputError
from onnxpipe.runtime import BenchReport, benchmark, load
from onnxpipe.runtime._feeds import StreamFeeds
from onnxpipe.splitter import split
from tests.cli.helpers import assert_usage_error, ok, run
from tests.models import bundle_of, hand_wired
from tests.stateful_models import encoder_decoder_config, gpt_decoder, whole_generate

CUT = ["layer1.out"]  # gpt_decoder() in 2 stages, as tests/runtime/test_batching.py cuts it


@pytest.fixture(scope="module")
def decoder_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundle_of(split(gpt_decoder(), CUT, states="auto"), tmp_path_factory.mktemp("decoder"))


@pytest.fixture(scope="module")
def batching_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = split(gpt_decoder(), CUT, states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=4, max_delay_ms=0)
    return bundle_of(plan, tmp_path_factory.mktemp("batching"))


def _calls(report: BenchReport) -> list[int]:
    return [s.calls for s in report.stages]


def test_a_decoder_is_timed_as_streams_of_a_prompt_then_one_token_steps(decoder_bundle: Path) -> None:
    with load(decoder_bundle) as pipe:
        report = benchmark(pipe, streams=3, steps=5, prompt=4, warmup=2)
    assert report.streams is not None
    assert (report.streams.streams, report.streams.steps, report.streams.prompt) == (3, 5, 4)
    assert report.requests == 3 * 6 and _calls(report) == [18, 18]  # the warm-up round not counted
    assert report.ideal_throughput is None and all(s.standalone_ms == 0 for s in report.stages)
    assert report.streams.steps_per_s == report.throughput > 0
    assert 0 < report.streams.first_step_p50_ms <= report.streams.first_step_p99_ms
    assert 0 < report.streams.step_p50_ms <= report.streams.step_p99_ms
    assert "3 stream(s) stepping together, each a prompt of 4 token(s), then 5 step(s) of one token: the greedy token of 'logits'" in report.notes[0]
    assert any("no standalone stage times" in n for n in report.notes)
    assert json.loads(json.dumps(report.to_dict()))["streams"]["steps"] == 5


def test_the_steps_are_a_greedy_generation(decoder_bundle: Path) -> None:
    """StreamFeeds (shared with verify) makes each later step's token the greedy one of the step
    before, its mask as wide as the past and positions counting on from it: the stream's tokens
    equal the whole model's greedy generation from the same prompt."""
    with load(decoder_bundle) as pipe, pipe.stream() as stream:
        feeder = StreamFeeds(pipe.spec, {}, prompt=4)
        outputs: Mapping[str, np.ndarray] = {}
        tokens: list[int] = []
        for step in range(4):
            feeds, _ = feeder.pipeline_step(step, outputs, seed=7)
            if step == 0:
                prompt = [int(t) for t in feeds["input_ids"][0]]
            else:
                tokens.append(int(feeds["input_ids"][0, 0]))
                assert feeds["attention_mask"].shape == (1, 4 + step) and feeds["position_ids"].tolist() == [[3 + step]]
            outputs = stream.step(feeds)
    assert tokens == whole_generate(gpt_decoder(), prompt, 3)[0]


def test_streams_whose_stages_batch_step_together_in_batches(batching_bundle: Path) -> None:
    with load(batching_bundle, micro_batches=1) as pipe:
        report = benchmark(pipe, steps=3, warmup=0)  # streams: the stages' max_batch
    assert report.streams is not None and report.streams.streams == 4
    assert [s.batch_sizes for s in report.stages] == [{4: 4}, {4: 4}]  # every round one batch of the 4 streams
    assert _calls(report) == [4, 4]


def test_a_first_step_stage_runs_once_per_stream_fed_its_inputs_on_the_first_step_only(tmp_path: Path) -> None:
    with load(bundle_of(encoder_decoder_config(), tmp_path)) as pipe:
        report = benchmark(pipe, streams=3, steps=4, dims={"n": 5})
    assert report.streams is not None and report.streams.prompt == 0  # no token ids: sample values at every step
    assert {s.stage: s.calls for s in report.stages} == {"encoder": 3, "decoder": 15}
    assert "3 stream(s) stepping together, each 5 step(s) of sample values" in report.notes[0]


def test_what_does_not_apply_is_refused(decoder_bundle: Path, tmp_path: Path) -> None:
    with load(decoder_bundle, max_streams=2) as pipe:
        with pytest.raises(ConfigError, match=r"benchmark: requests does not apply, the pipeline keeps state between steps: it times streams"):
            benchmark(pipe, 10)
        with pytest.raises(ConfigError, match="benchmark: inputs does not apply"):
            benchmark(pipe, inputs={"input_ids": np.zeros((1, 1), np.int64)})
        with pytest.raises(ConfigError, match=r"streams must be 1\.\.2 \(the pipeline's max_streams\), got 3"):
            benchmark(pipe, streams=3)
        with pytest.raises(InputError, match="no input has a dim named 'nope'"):
            benchmark(pipe, dims={"nope": 2})
    with load(bundle_of(hand_wired(), tmp_path / "plain")) as pipe:
        with pytest.raises(ConfigError, match="benchmark: steps does not apply, the pipeline keeps no state: it times single requests"):
            benchmark(pipe, steps=3)


def test_bench_prints_tokens_per_second_and_a_row_per_stage(decoder_bundle: Path) -> None:
    text = ok("bench", decoder_bundle, "--streams", 2, "--steps", 2, "--prompt", 3).stdout
    assert "2 stream(s) stepping together, each a prompt of 3 token(s) then 2 one-token step(s)" in text, text
    assert "tokens/s" in text and "first step: p50" in text and "per step:   mean" in text, text
    for stage in ("stage0", "stage1"):
        assert f"│ {stage} " in text, text
    report: dict[str, Any] = json.loads(ok("bench", decoder_bundle, "--streams", 2, "--steps", 2, "--json").stdout)
    assert report["streams"]["streams"] == 2 and [s["calls"] for s in report["stages"]] == [6, 6]


def test_bench_options_that_do_not_apply_are_usage_errors(decoder_bundle: Path, tmp_path: Path) -> None:
    inputs = tmp_path / "in.npz"
    np.savez(inputs, input_ids=np.zeros((1, 1), np.int64))
    assert_usage_error(run("bench", decoder_bundle, "--requests", 5), "--requests: this pipeline keeps state between steps")
    assert_usage_error(run("bench", decoder_bundle, "--inputs", inputs), "--inputs: this pipeline keeps state between steps", "--streams S")
    assert_usage_error(run("bench", decoder_bundle, "--streams", 100_000), "--streams: at most")
    plain = bundle_of(hand_wired(), tmp_path / "plain")
    assert_usage_error(run("bench", plain, "--steps", 3), "--steps: only for a pipeline with state links")

