"""``verify SPLIT --model M --inputs`` (issue 39): the caller's input sets instead of random ones, checked
as requests are, on the corpus T5 decoder whose logits are NaN for a mask of 2s and 3s."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run

T5_DECODER = Path(__file__).parents[1] / "data" / "corpus" / "t5" / "decoder_model.onnx"


@pytest.fixture(scope="module")
def t5_split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("t5") / "split"
    ok("split", T5_DECODER, "-o", folder, "--at", "/decoder/block.1/layer.0/layer_norm/Cast_output_0")
    return folder


def _feeds(mask: list[int]) -> dict[str, np.ndarray]:
    return {"encoder_attention_mask": np.array([mask], np.int64), "input_ids": np.array([[0, 5, 7]], np.int64),
            "encoder_hidden_states": np.random.default_rng(0).standard_normal((1, len(mask), 32)).astype(np.float32)}


def test_verify_runs_the_given_input_sets_and_says_when_they_prove_nothing(t5_split: Path, tmp_path: Path) -> None:
    sets = tmp_path / "sets"
    sets.mkdir()
    np.savez(sets / "a.npz", **_feeds([1, 1, 1, 1, 1]))
    np.savez(sets / "b.npz", **_feeds([1, 1, 1, 0, 0]))
    report = json.loads(ok("verify", t5_split, "--model", T5_DECODER, "--inputs", sets, "--json").stdout)
    assert report["ok"] and report["samples"] == 2 and report["given"]
    np.savez(tmp_path / "nan.npz", **_feeds([2, 3, 1, 0, 2]))
    result = run("verify", t5_split, "--model", T5_DECODER, "--inputs", sets / "a.npz", "--inputs", tmp_path / "nan.npz")
    assert_user_error(result, "the whole model's output(s) 'logits' (384 of 384 values NaN), ",
                      "are not finite on the given inputs: the check proves nothing; give --inputs on which they are finite")


def test_an_input_set_that_is_not_a_request_is_one_line(t5_split: Path, tmp_path: Path) -> None:
    feeds = _feeds([1, 1, 1])
    np.savez(tmp_path / "bad.npz", **{**feeds, "input_ids": feeds["input_ids"].astype(np.int32)})
    assert_user_error(run("verify", t5_split, "--model", T5_DECODER, "--inputs", tmp_path / "bad.npz"),
                      "input set 0: input 'input_ids' has dtype int32; expected int64")
    assert_user_error(run("verify", t5_split, "--model", T5_DECODER, "--inputs", tmp_path / "none"), "none")
    assert_usage_error(run("verify", t5_split, "--model", T5_DECODER, "--inputs", tmp_path / "bad.npz", "--seed", "3"),
                       "--seed: only used for random inputs")
