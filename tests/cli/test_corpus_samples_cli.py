"""The corpus's optimum exports (tests/data/corpus) through the CLI with sample inputs that respect
what an input means (Note: sample values), bench at a bundle's own sizes, and formula dims asked for
by the names they are computed from. Each model is copied into a temporary folder first, so the
profile cache written next to it stays there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from onnxpipe.runtime import INPUT_VALUES_KEY
from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
IMAGE = ("--dim", "num_channels=3", "--dim", "height=32", "--dim", "width=32")  # the corpus ViT's config


def _copy(name: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(CORPUS / name / "model.onnx", folder / "model.onnx"))


def _bundle(split: Path, folder: Path, *export: object) -> Path:
    ok("build", split, "-o", folder / "built")
    ok("export", folder / "built", "-o", folder / "bundle.onnxpipe", *export)
    return folder / "bundle.onnxpipe"


def test_bert_splits_verifies_exports_and_benches_without_a_dim(tmp_path: Path) -> None:
    model = _copy("bert", tmp_path / "model")
    out = tmp_path / "split"
    ok("split", model, "-o", out, "--auto", "--stages", 2)  # profiling ran token types 0..3 into a table of 2 rows
    values = json.loads(json.loads((out / "pipeline.json").read_text())["metadata"][INPUT_VALUES_KEY])
    assert values == {"attention_mask": "mask", "token_type_ids": [0, 2], "input_ids": [0, 128]}
    assert "ok: all" in ok("verify", out, "--model", model).stdout
    ids = np.array([[101, 7, 99, 102]], np.int64)
    np.savez(tmp_path / "one.npz", input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.array([[0, 0, 1, 1]], np.int64))
    text = ok("verify", out, "--model", model, "--inputs", tmp_path / "one.npz", "--inputs", tmp_path / "one.npz").stdout
    assert "ok: all" in text and "(2 sample(s)," in text and "[1, 4, 32]" in text, text
    assert_usage_error(run("verify", out, "--model", model, "--inputs", tmp_path / "one.npz", "--dim", "batch_size=2"),
                       "--dim: only used for random inputs; the --inputs files fix the values and shapes")
    cut = tmp_path / "cut"  # a cut of its own: the measured one may carry a shape value, which no batch stacks
    ok("split", model, "-o", cut, "--at", "/encoder/layer.0/output/LayerNorm/LayerNormalization_output_0")
    batched = ok("build", cut, "-o", tmp_path / "batched", "--stage", "*:max_batch=4").stdout  # the batching probe's requests too
    assert batched.count("batched and alone agree") == 2 and "not probed" not in batched, batched
    bundle = _bundle(out, tmp_path, "--reference", 2, "--model", model)
    assert "ok: all 2 output(s)" in ok("verify", bundle).stdout
    text = ok("bench", bundle, "--requests", 5, "--standalone-runs", 1).stdout
    assert "note: inputs: the bundle's first reference input set" in text
    assert "throughput:" in ok("bench", bundle, "--requests", 5, "--standalone-runs", 0, "--dim", "sequence_length=9").stdout


@pytest.mark.parametrize(("name", "dims"), [("vit", IMAGE), ("wav2vec2", ("--dim", "sequence_length=400"))])
def test_a_bundle_with_symbolic_image_or_audio_dims_benches_at_its_own_sizes(tmp_path: Path, name: str, dims: tuple[str, ...]) -> None:
    model = _copy(name, tmp_path / "model")
    out = tmp_path / "split"
    ok("split", model, "-o", out, "--auto", "--stages", 2, *dims)
    bundle = _bundle(out, tmp_path / "plain")  # no reference: the sizes the split was made for
    text = ok("bench", bundle, "--requests", 3, "--standalone-runs", 0).stdout
    assert "random inputs sized as the pipeline was split for (input_dims: " in text
    referenced = _bundle(out, tmp_path / "referenced", "--reference", 1)  # export's random sets take them too
    assert "reference input set" in ok("bench", referenced, "--requests", 3, "--standalone-runs", 0).stdout


def test_a_bundle_without_sizes_says_which_dims_bench_needs(tmp_path: Path) -> None:
    model = _copy("vit", tmp_path / "model")
    out = tmp_path / "split"
    ok("split", model, "-o", out, "--auto", "--stages", 2, "--policy", "uniform")  # no profile, no sizes
    bundle = _bundle(out, tmp_path)
    assert_user_error(run("bench", bundle, "--requests", 2, "--standalone-runs", 0), "stage 'stage0' failed",
                      "dims batch_size, num_channels, height, width not given, so 1: give their sizes with --dim NAME=N")
    assert "throughput:" in ok("bench", bundle, "--requests", 2, "--standalone-runs", 0, *IMAGE).stdout


def test_the_planner_computes_gpt2s_mask_width_from_the_dims_it_names(tmp_path: Path) -> None:
    model = _copy("gpt2", tmp_path / "model")
    sized = ("--dim", "sequence_length=1", "--dim", "past_sequence_length=4")
    result = ok("split", model, "-o", tmp_path / "plan", "--auto", "--cores", 1, "--rounds", 1, "--requests", 5, *sized)
    assert "past_sequence_length + sequence_length" not in result.output
    result = run("split", model, "-o", tmp_path / "plan2", "--auto", "--cores", 1, "--dim", "sequence_length=1")
    assert_user_error(result, "input 'attention_mask' dim 1 ('past_sequence_length + sequence_length'), computed from past_sequence_length",
                      "Give them: --dim past_sequence_length=SIZE (")
