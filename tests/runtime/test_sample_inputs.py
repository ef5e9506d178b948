"""Sample inputs that a decoder accepts (Note: a decoder's sample inputs, runtime/_inputs.py): the
attention mask all ones and as wide as the past and the new tokens, the positions counted on from
the past, the token ids random but small. Checked on specs written inline, on the inline GPT decoder
of tests/stateful_models.py, on the optimum export tests/data/decoders/optimum-llama, and on the exports of
tests/data/decoders/ (genai, optimum, dynamo) when that folder is there: the whole model must run
on random_inputs for several dims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from onnxpipe._errors import InputError
from onnxpipe.runtime import TensorSpec, dtype_from_ort, random_inputs, sample_shapes
from onnxpipe.runtime._inputs import MASK_NAMES, DecoderInputs, defaulted_dims, dims_hint
from tests.stateful_models import gpt_decoder

DATA = Path(__file__).parents[1] / "data"
LLAMA = DATA / "decoders" / "optimum-llama" / "model.onnx"
DECODERS = sorted((DATA / "decoders").glob("*/model.onnx"))

I64, F = "int64", "float32"


def _optimum(mask: tuple[object, ...] = ("batch", "past + seq")) -> list[TensorSpec]:
    return [
        TensorSpec("input_ids", I64, ("batch", "seq")),
        TensorSpec("attention_mask", I64, mask),
        TensorSpec("position_ids", I64, ("batch", "seq")),
        TensorSpec("past_key_values.0.key", F, ("batch", 2, "past", 16)),
        TensorSpec("past_key_values.0.value", F, ("batch", 2, "past", 16)),
    ]


def _specs(session: ort.InferenceSession) -> list[TensorSpec]:
    return [TensorSpec(i.name, dtype_from_ort(i.type), tuple(i.shape)) for i in session.get_inputs()]


def test_the_mask_is_all_ones_as_wide_as_past_and_new_and_positions_count_on_from_the_past() -> None:
    feeds, notes = random_inputs(_optimum(), {"batch": 3, "past": 5, "seq": 2}, seed=4)
    assert feeds["attention_mask"].shape == (3, 7) and feeds["attention_mask"].dtype == np.int64
    assert (feeds["attention_mask"] == 1).all()
    np.testing.assert_array_equal(feeds["position_ids"], [[5, 6]] * 3)
    assert feeds["input_ids"].shape == (3, 2) and set(np.unique(feeds["input_ids"])) <= {0, 1, 2, 3}
    assert feeds["past_key_values.0.key"].shape == (3, 2, 5, 16)
    assert notes == []  # the mask's width was made, not defaulted


def test_defaults_make_a_first_decode_step_and_the_notes_do_not_count_the_mask_width_as_1() -> None:
    feeds, notes = random_inputs(_optimum())
    assert feeds["attention_mask"].shape == (1, 2)  # a past of 1 and a new token
    np.testing.assert_array_equal(feeds["position_ids"], [[1]])
    mask_note = next(n for n in notes if "'attention_mask'" in n)
    assert "past + seq" not in mask_note and "batch" in mask_note
    assert defaulted_dims(_optimum()) == ["batch", "seq", "past"]
    assert dims_hint(["batch", "seq"]) == "dims batch, seq not given, so 1: give their sizes with --dim NAME=N (--dim seq=N)"
    assert dims_hint([]) == ""


def test_a_genai_mask_with_its_own_width_name_an_unnamed_width_and_a_bool_mask() -> None:
    genai = [
        TensorSpec("input_ids", I64, ("batch_size", "sequence_length")),
        TensorSpec("attention_mask", I64, ("batch_size", "total_sequence_length")),
        TensorSpec("past_key_values.0.key", F, ("batch_size", 2, "past_sequence_length", "kv_cache_dim")),
    ]
    shapes, _ = sample_shapes(genai, {"past_sequence_length": 6, "sequence_length": 3, "kv_cache_dim": 8})
    assert shapes["attention_mask"] == (1, 9)
    unnamed = _optimum(mask=("batch", None))
    feeds, notes = random_inputs(unnamed, {"past": 2, "seq": 4})
    assert feeds["attention_mask"].shape == (1, 6)
    assert any(n.startswith("input 'attention_mask': dim batch not given") for n in notes)
    as_bool = [TensorSpec("input_ids", I64, ("b", "s")), TensorSpec("attn_mask", "bool", ("b", "t")), TensorSpec("key_cache", F, ("b", 1, "p", 4))]
    feeds, _ = random_inputs(as_bool, {"p": 3})
    assert feeds["attn_mask"].dtype == bool and feeds["attn_mask"].all() and feeds["attn_mask"].shape == (1, 4)


def test_a_width_the_dims_give_is_kept_even_when_it_does_not_add_up() -> None:
    feeds, _ = random_inputs(_optimum(), {"past": 5, "seq": 2, "past + seq": 4})
    assert feeds["attention_mask"].shape == (1, 4) and (feeds["attention_mask"] == 1).all()
    fixed = _optimum(mask=("batch", 10))
    assert random_inputs(fixed, {"past": 5})[0]["attention_mask"].shape == (1, 10)


def test_without_a_past_the_mask_is_as_wide_as_the_tokens_and_positions_start_at_0() -> None:
    bert = [TensorSpec("input_ids", I64, ("batch", "seq")), TensorSpec("attention_mask", I64, ("batch", "seq")),
            TensorSpec("position_ids", I64, ("batch", "seq"))]
    feeds, _ = random_inputs(bert, {"batch": 2, "seq": 5})
    assert feeds["attention_mask"].shape == (2, 5) and (feeds["attention_mask"] == 1).all()
    np.testing.assert_array_equal(feeds["position_ids"], [list(range(5))] * 2)


def test_roles_go_by_name_rank_and_dtype_and_a_model_that_is_no_decoder_stays_random() -> None:
    assert MASK_NAMES[0] == "attention_mask"
    float_mask = [TensorSpec("input_ids", I64, ("b", "s")), TensorSpec("mask", F, ("b", "s"))]  # an additive float mask: not ours to fill
    assert DecoderInputs.of(float_mask).mask is None
    image = [TensorSpec("mask", I64, ("N", 3, "H", "W")), TensorSpec("x", I64, ("N", 4))]
    feeds, _ = random_inputs(image, {"N": 2, "H": 4, "W": 4}, seed=1)
    assert DecoderInputs.of(image) == DecoderInputs()
    assert feeds["mask"].shape == (2, 3, 4, 4) and set(np.unique(feeds["mask"])) == {0, 1, 2, 3}
    with pytest.raises(InputError, match="no input has a dim named 'pst'; closest: 'past'"):
        random_inputs(_optimum(), {"pst": 2})


def test_the_inline_gpt_decoder_runs_on_sample_inputs() -> None:
    session = ort.InferenceSession(gpt_decoder(layers=2).SerializeToString(), providers=["CPUExecutionProvider"])
    for dims in ({}, {"batch": 2, "seq": 3}, {"past_seq": 4, "total_seq": 5}):  # the last width adds up: kept
        feeds, _ = random_inputs(_specs(session), dims)
        logits = session.run(["logits"], feeds)[0]
        assert np.isfinite(logits).all()


@pytest.mark.parametrize("dims", [{}, {"batch_size": 2}, {"sequence_length": 4}, {"batch_size": 3, "past_sequence_length": 5, "sequence_length": 2},
                                  {"past_sequence_length": 0, "sequence_length": 6}])
def test_the_optimum_llama_runs_on_sample_inputs(dims: dict[str, int]) -> None:
    session = ort.InferenceSession(str(LLAMA), providers=["CPUExecutionProvider"])
    feeds, _ = random_inputs(_specs(session), dims)
    logits, key = session.run(["logits", "present.0.key"], feeds)
    assert logits.shape[:2] == feeds["input_ids"].shape
    assert key.shape[2] == feeds["attention_mask"].shape[1]


@pytest.mark.skipif(not DECODERS, reason="tests/data/decoders/ is not there (made by tests/data/make_decoders.py)")
@pytest.mark.parametrize("path", DECODERS, ids=[p.parent.name for p in DECODERS])
def test_each_exporters_decoder_runs_on_sample_inputs(path: Path) -> None:
    """genai's GroupQueryAttention refuses random masks (``seqlens_k`` out of range); its head dim
    ``kv_cache_dim`` has no size in the model, so it is given. GroupQueryAttention takes several
    new tokens with a past only in a batch of 1: the dims below stay within what it runs."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    specs = _specs(session)
    names = {d for s in specs for d in s.shape or () if isinstance(d, str)}
    batch = "batch" if "batch" in names else "batch_size"
    head = {"kv_cache_dim": 16} if "kv_cache_dim" in names else {}
    for dims in ({}, {batch: 2}, {"sequence_length": 4}, {batch: 2, "past_sequence_length": 5}, {batch: 2, "past_sequence_length": 0, "sequence_length": 3}):
        feeds, _ = random_inputs(specs, {**dims, **head})
        logits = session.run(["logits"], feeds)[0]
        assert logits.shape[:2] == feeds["input_ids"].shape, dims
