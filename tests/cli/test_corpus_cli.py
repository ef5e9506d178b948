"""The corpus's optimum exports (tests/data/corpus) through every CLI step a user takes: ``split --auto
--stages 2``, ``verify``, ``build``, ``export --reference``, ``verify BUNDLE``, ``bench BUNDLE`` and the
planner (``split --auto --cores 2``), without ``--dim`` wherever the model's own sizes suffice (sample
inputs that respect what an input means, Note: sample values; sizes the graph fixes, Note: dims the
graph fixes). Where dims must be given, the one-line message names exactly those first, then they
are given. The decoders with past run with ``--state auto``; the encoder KV inputs of optimum's
``decoder_with_past_model.onnx`` are plain inputs. Each model is copied into a temporary folder
first, so the profile cache written next to it stays there; one split and one bundle per model are
shared by the tests (module-scoped fixtures, one xdist worker)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from onnxpipe.runtime import INPUT_DIMS_KEY, INPUT_VALUES_KEY
from tests.cli.helpers import assert_usage_error, assert_user_error, ok, run

pytestmark = pytest.mark.xdist_group("corpus-cli")

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
PLAN = ("--auto", "--cores", 2, "--rounds", 1, "--requests", 10, "--measure", 1)  # the planner's cheapest settings


def _dims(**sizes: int) -> tuple[str, ...]:
    return tuple(arg for name, size in sizes.items() for arg in ("--dim", f"{name}={size}"))


@dataclass(frozen=True)
class Case:
    """One corpus model and what it needs.

    Attributes:
        file: Its path under tests/data/corpus.
        state: Split with ``--state auto`` (past/present pairs).
        split_dims: The dims ``split --auto`` must be given, in the order its message asks for them, and their sizes.
        plan_dims: The same for the planner (which plans no dim at 1 but a batch).
    """

    file: str
    state: bool = False
    split_dims: dict[str, int] | None = None
    plan_dims: dict[str, int] | None = None


DECODER_DIMS = {"decoder_sequence_length": 1, "past_decoder_sequence_length": 4, "encoder_sequence_length": 6}  # in the order Whisper asks
T5_DECODER_DIMS = {k: DECODER_DIMS[k] for k in ("encoder_sequence_length", "decoder_sequence_length", "past_decoder_sequence_length")}  # and T5
CASES = {
    "bert": Case("bert/model.onnx", plan_dims={"sequence_length": 8}),
    "vit": Case("vit/model.onnx", split_dims={"height": 32, "width": 32}, plan_dims={"height": 32, "width": 32}),  # num_channels: the Conv's weight
    "wav2vec2": Case("wav2vec2/model.onnx", split_dims={"sequence_length": 400}, plan_dims={"sequence_length": 400}),
    "gpt2": Case("gpt2/model.onnx", state=True, plan_dims={"sequence_length": 1, "past_sequence_length": 4}),
    "t5-encoder": Case("t5/encoder_model.onnx", plan_dims={"encoder_sequence_length": 6}),
    "whisper-encoder": Case("whisper/encoder_model.onnx"),
    "t5-decoder-with-past": Case("t5/decoder_with_past_model.onnx", state=True, plan_dims=T5_DECODER_DIMS),
    "whisper-decoder-with-past": Case("whisper/decoder_with_past_model.onnx", state=True, plan_dims=DECODER_DIMS),
}


@dataclass(frozen=True)
class Split:
    """A corpus model copied into its own folder and split there by ``split --auto --stages 2``."""

    name: str
    case: Case
    model: Path
    out: Path


@dataclass(frozen=True)
class Exported:
    """A split built and exported (with two reference samples where the pipeline has no state)."""

    split: Split
    bundle: Path


def _copy(file: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(CORPUS / file, folder / "model.onnx"))


@pytest.fixture(scope="module", params=list(CASES))
def corpus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Split:
    case = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = _copy(case.file, folder / "model")
    state = ("--state", "auto") if case.state else ()
    ok("split", model, "-o", folder / "split", "--auto", "--stages", 2, *state, *_dims(**(case.split_dims or {})))
    return Split(request.param, case, model, folder / "split")


@pytest.fixture(scope="module")
def exported(corpus: Split) -> Exported:
    folder = corpus.out.parent
    ok("build", corpus.out, "-o", folder / "built")
    bundle = folder / "bundle.onnxpipe"
    reference = ("--reference", 2, "--model", corpus.model)
    if corpus.case.state:  # a reference sample is one request; a stream's steps are no such thing
        assert_user_error(run("export", folder / "built", "-o", bundle, *reference),
                          "reference samples are single requests, but this pipeline keeps state between steps")
        ok("export", folder / "built", "-o", bundle)
    else:
        ok("export", folder / "built", "-o", bundle, *reference)
    return Exported(corpus, bundle)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case.split_dims])
def test_split_asks_only_for_the_dims_the_graph_does_not_fix(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    assert case.split_dims is not None
    result = run("split", _copy(case.file, tmp_path), "-o", tmp_path / "split", "--auto", "--stages", 2)
    asked = ", ".join(case.split_dims)
    assert_user_error(result, f"Symbolic dims not given were sized 1 ({asked}, batch_size)", f"{asked}: 1 is shorter than the kernel of Conv '",
                      "give them: " + " ".join(f"--dim {d}=SIZE" for d in case.split_dims) + " --dim batch_size=SIZE")


def test_the_split_verifies(corpus: Split) -> None:
    text = ok("verify", corpus.out, "--model", corpus.model).stdout  # outputs must be finite to pass (Note: sample values)
    assert "ok: all" in text, text
    assert "--dim" not in text, text


def test_the_bundle_verifies(exported: Exported) -> None:
    split = exported.split
    if split.case.state:  # no reference stored: compared with the whole model over streams
        text = ok("verify", exported.bundle, "--model", split.model).stdout
        assert "ok: all" in text, text
    else:
        assert "ok: all 2 output(s)" in ok("verify", exported.bundle).stdout


def test_the_bundle_benches_at_its_own_sizes(exported: Exported) -> None:
    if exported.split.case.state:  # streams of steps (Note: benchmarking streams), the encoder KV inputs sized by input_dims
        text = ok("bench", exported.bundle, "--streams", 2, "--steps", 3, "--warmup", 1).stdout
        assert "2 stream(s) stepping together, each a prompt of 8 token(s) then 3 one-token step(s)" in text, text
        assert re.search(r"throughput: [\d.]+ tokens/s", text), text
        assert re.search(r"│ stage0 +│", text) and re.search(r"│ stage1 +│", text), text
        assert "--dim" not in text.replace("(--dim NAME=N)", ""), text  # the bundle's own sizes suffice
        report = json.loads(ok("bench", exported.bundle, "--streams", 2, "--steps", 3, "--warmup", 0, "--json").stdout)
        assert report["streams"]["streams"] == 2 and report["streams"]["steps"] == 3 and report["requests"] == 8
        assert [s["calls"] for s in report["stages"]] == [8, 8]  # 2 streams x (a prompt + 3 steps), one call each (no batching)
        return
    result = run("bench", exported.bundle, "--requests", 5, "--standalone-runs", 0)
    assert result.exit_code == 0, result.output
    assert "note: inputs: the bundle's first reference input set" in result.stdout


def test_the_planner_plans_it(corpus: Split) -> None:
    out = corpus.out.parent / "plan"
    asked = corpus.case.plan_dims or {}
    if asked:
        result = run("split", corpus.model, "-o", out, *PLAN)
        assert_user_error(result, "cannot plan 'model.onnx' without the sizes of its symbolic input dims",
                          "Give them: " + " ".join(f"--dim {d}=SIZE" for d in asked) + " (in Python")
    if corpus.name == "gpt2":  # the mask's width is a formula: asked for by the dims it is computed from
        result = run("split", corpus.model, "-o", out, *PLAN, "--dim", "sequence_length=1")
        assert_user_error(result, "input 'attention_mask' dim 1 ('past_sequence_length + sequence_length'), computed from past_sequence_length",
                          "Give them: --dim past_sequence_length=SIZE (")
    result = ok("split", corpus.model, "-o", out, *PLAN, *_dims(**asked))
    assert (out / "pipeline.json").is_file()
    assert "past_sequence_length + sequence_length" not in result.output  # a formula dim is computed, never asked for by its text


@pytest.mark.parametrize("corpus", ["bert"], indirect=True)
def test_bert_inputs_take_the_values_their_graph_allows(corpus: Split, tmp_path: Path) -> None:
    values = json.loads(json.loads((corpus.out / "pipeline.json").read_text())["metadata"][INPUT_VALUES_KEY])
    assert values == {"attention_mask": "mask", "token_type_ids": [0, 2], "input_ids": [0, 128]}  # token types within a table of 2 rows
    ids = np.array([[101, 7, 99, 102]], np.int64)
    np.savez(tmp_path / "one.npz", input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.array([[0, 0, 1, 1]], np.int64))
    text = ok("verify", corpus.out, "--model", corpus.model, "--inputs", tmp_path / "one.npz", "--inputs", tmp_path / "one.npz").stdout
    assert "ok: all" in text and "(2 sample(s)," in text and "[1, 4, 32]" in text, text
    assert_usage_error(run("verify", corpus.out, "--model", corpus.model, "--inputs", tmp_path / "one.npz", "--dim", "batch_size=2"),
                       "--dim: only used for random inputs; the --inputs files fix the values and shapes")
    cut = tmp_path / "cut"  # a cut of its own: the measured one may carry a shape value, which no batch stacks
    ok("split", corpus.model, "-o", cut, "--at", "/encoder/layer.0/output/LayerNorm/LayerNormalization_output_0")
    batched = ok("build", cut, "-o", tmp_path / "batched", "--stage", "*:max_batch=4").stdout  # the batching probe's requests too
    assert batched.count("batched and alone agree") == 2 and "not probed" not in batched, batched


@pytest.mark.parametrize("corpus", ["bert"], indirect=True)
def test_a_dim_given_to_bench_goes_over_the_reference(exported: Exported) -> None:
    assert "throughput:" in ok("bench", exported.bundle, "--requests", 5, "--standalone-runs", 0, "--dim", "sequence_length=9").stdout


@pytest.mark.parametrize("corpus", ["vit", "wav2vec2"], indirect=True)  # the symbolic image and audio dims
def test_a_bundle_without_reference_benches_at_the_sizes_it_was_split_for(corpus: Split) -> None:
    dims = json.loads((corpus.out / "pipeline.json").read_text())["metadata"][INPUT_DIMS_KEY]
    assert dims == ("num_channels=3,height=32,width=32" if corpus.name == "vit" else "sequence_length=400")  # the graph's size, then the given ones
    folder = corpus.out.parent
    ok("build", corpus.out, "-o", folder / "plain-built")
    ok("export", folder / "plain-built", "-o", folder / "plain.onnxpipe")
    text = ok("bench", folder / "plain.onnxpipe", "--requests", 3, "--standalone-runs", 0).stdout
    assert "random inputs sized as the pipeline was split for (input_dims: " in text


def test_a_bundle_without_sizes_says_which_dims_bench_needs(tmp_path: Path) -> None:
    model = _copy("vit/model.onnx", tmp_path / "model")
    out = tmp_path / "split"
    ok("split", model, "-o", out, "--auto", "--stages", 2, "--policy", "uniform")  # no profile, no sizes given: only the graph's
    assert json.loads((out / "pipeline.json").read_text())["metadata"][INPUT_DIMS_KEY] == "num_channels=3"
    ok("build", out, "-o", tmp_path / "built")
    ok("export", tmp_path / "built", "-o", tmp_path / "bundle.onnxpipe")
    bundle = tmp_path / "bundle.onnxpipe"
    assert_user_error(run("bench", bundle, "--requests", 2, "--standalone-runs", 0), "stage 'stage0' failed",
                      "dims batch_size, height, width not given, so 1: give their sizes with --dim NAME=N")
    assert "throughput:" in ok("bench", bundle, "--requests", 2, "--standalone-runs", 0, *_dims(height=32, width=32)).stdout


def test_a_cut_at_a_shape_value_says_why_it_cannot_be_taken(tmp_path: Path) -> None:
    model = _copy("vit/model.onnx", tmp_path)  # '/vit/embeddings/Concat_output_0' is (batch, -1, -1): the cls token's expand shape
    assert_user_error(run("split", model, "-o", tmp_path / "split", "--at", "/vit/embeddings/Concat_output_0"),
                      "stage 0 would output nothing: its 4 node(s) compute only shape values ('/vit/embeddings/Concat_output_0'), which stage(s) 1 "
                      "compute again from the shapes they read; cut after a node that computes data")
