"""``onnxpipe verify`` and ``onnxpipe export --reference --model`` of decoder splits (issue 27): a split
with state links is verified by a stream; a stateless one runs on sample inputs a decoder accepts,
without --dim; a model that still fails on them is one line naming the dims left at 1 and --dim,
never a traceback. On tests/data/decoders/optimum-llama (optimum), and on genai's export in
tests/data/decoders/ when that folder is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.helpers import assert_user_error, ok, run

DATA = Path(__file__).parents[1] / "data"
LLAMA = DATA / "decoders" / "optimum-llama" / "model.onnx"
GENAI = DATA / "decoders" / "genai-llama" / "model.onnx"
CUT = ",".join(["/model/layers.0/Add_1_output_0", "/model/Expand_output_0", "/model/layers.0/self_attn/Unsqueeze_6_output_0",
                "/model/layers.0/self_attn/Unsqueeze_7_output_0"])
NARROW_MASK = "past_sequence_length + sequence_length=1"  # narrower than a past of 1 and a new token: the model's Gather fails


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-tiny split between its layers without state, and built."""
    folder = tmp_path_factory.mktemp("llama")
    ok("split", LLAMA, "-o", folder / "split", "--at", CUT)
    ok("build", folder / "split", "-o", folder / "built")
    return folder


def test_verify_of_a_split_with_state_runs_a_stream(tmp_path: Path) -> None:
    ok("split", LLAMA, "-o", tmp_path / "split", "--at", CUT, "--state", "auto")
    result = ok("verify", tmp_path / "split", "--model", LLAMA)
    assert "split vs whole model (1 stream(s) of 4 step(s)" in result.output
    assert "ran 1 stream(s) of 4 step(s) (a prompt of 3 token(s)" in result.output
    assert "ok: all 1 tensor(s) within tolerance" in result.output
    result = ok("verify", tmp_path / "split", "--model", LLAMA, "--dim", "sequence_length=2", "--samples", "2", "--json")
    assert '"steps": 4' in result.output and '"samples": 2' in result.output


def test_verify_and_export_of_a_stateless_decoder_split_need_no_dim(built: Path, tmp_path: Path) -> None:
    assert "ok: all 9 tensor(s) within tolerance" in ok("verify", built / "split", "--model", LLAMA).output
    result = ok("export", built / "built", "-o", tmp_path / "llama.onnxpipe", "--reference", 2, "--model", LLAMA)
    assert "2 reference sample(s)" in result.output
    ok("verify", tmp_path / "llama.onnxpipe")


def test_a_model_that_fails_on_the_sample_inputs_is_one_line_naming_the_dims_to_give(built: Path, tmp_path: Path) -> None:
    hint = "dims batch_size, sequence_length, past_sequence_length not given, so 1: give their sizes with --dim NAME=N"
    result = run("verify", built / "split", "--model", LLAMA, "--dim", NARROW_MASK)
    assert_user_error(result, "the whole model fails on input set 0", "indices element out of data bounds", hint)
    result = run("export", built / "built", "-o", tmp_path / "b.onnxpipe", "--reference", 1, "--model", LLAMA, "--dim", NARROW_MASK)
    assert_user_error(result, "the reference model fails on reference input set 0", "indices element out of data bounds", hint)
    result = run("export", built / "built", "-o", tmp_path / "c.onnxpipe", "--reference", 1, "--dim", NARROW_MASK)  # the pipeline computes it
    assert_user_error(result, "stage 'stage0' failed", hint)
    assert not (tmp_path / "b.onnxpipe").exists() and not (tmp_path / "c.onnxpipe").exists()


@pytest.mark.skipif(not GENAI.is_file(), reason="tests/data/decoders/ is not there (made by tests/data/make_decoders.py)")
def test_genai_without_its_head_dim_is_one_line_naming_kv_cache_dim(tmp_path: Path) -> None:
    ok("split", GENAI, "-o", tmp_path / "split", "--auto", "--policy", "params", "--stages", 2)
    ok("build", tmp_path / "split", "-o", tmp_path / "built")
    assert_user_error(run("verify", tmp_path / "split", "--model", GENAI), "GroupQueryAttention", "kv_cache_dim not given", "--dim NAME=N")
    result = run("export", tmp_path / "built", "-o", tmp_path / "b", "--reference", 1, "--model", GENAI)
    assert_user_error(result, "the reference model fails", "kv_cache_dim not given", "--dim NAME=N")
    ok("verify", tmp_path / "split", "--model", GENAI, "--dim", "kv_cache_dim=16")
    ok("export", tmp_path / "built", "-o", tmp_path / "b", "--reference", 1, "--model", GENAI, "--dim", "kv_cache_dim=16")
    ok("verify", tmp_path / "b")


def test_a_genai_split_sizes_kv_cache_dim_from_dim_or_its_config_and_says_so_when_neither(tmp_path: Path) -> None:
    """The genai builder's cache head dim ``kv_cache_dim`` is named by no other input: split fixes it
    from ``--dim`` (by hand and with --auto, whose --dim sizes profiling too) or from the
    genai_config.json beside the model; a copy of the model without it and no --dim is one line."""
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "model.onnx").write_bytes(GENAI.read_bytes())  # no genai_config.json beside it
    cut = "/model/layers.0/mlp/down_proj/MatMul/output_0"
    assert_user_error(run("split", alone / "model.onnx", "-o", tmp_path / "a", "--at", cut, "--state", "auto"),
                      "dim 3 ('kv_cache_dim') is named by no other input", "--dim kv_cache_dim=N")
    assert "fixed at 16 in every stage (given)" in ok("split", alone / "model.onnx", "-o", tmp_path / "b", "--at", cut, "--state", "auto",
                                                      "--dim", "kv_cache_dim=16").output
    assert "fixed at 16 in every stage (given)" in ok("split", alone / "model.onnx", "-o", tmp_path / "c", "--auto", "--stages", "2", "--state",
                                                      "auto", "--dim", "kv_cache_dim=16", "--dim", "batch_size=1").output
    assert "(head_size of genai_config.json)" in ok("split", GENAI, "-o", tmp_path / "d", "--at", cut, "--state", "auto").output
