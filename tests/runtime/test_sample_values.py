"""Sample inputs that respect what an input means (Note: sample values, runtime/_values.py): masks
are ones, positions count, ranges bound indices, and formula dims are computed from the dims they name."""

from __future__ import annotations

import numpy as np
import pytest

from onnxpipe import ConfigError, InputError
from onnxpipe.runtime import INPUT_VALUES_KEY, InputValues, PipelineSpec, TensorSpec, random_inputs, sample_shapes, spec_values
from onnxpipe.runtime._inputs import MASK_NAMES, defaulted_dims, dims_hint
from onnxpipe.runtime._values import format_values, is_mask_name, named_values, parse_dims, parse_values, split_sizes

I64 = "int64"


def test_mask_names_are_ones_whatever_their_prefix() -> None:
    assert all(is_mask_name(n) for n in (*MASK_NAMES, "encoder_attention_mask", "decoder_attention_mask", "padding_mask", "Attention_Mask"))
    assert not any(is_mask_name(n) for n in ("masked_lm", "input_ids", "mask_token"))
    t5 = [TensorSpec("encoder_attention_mask", I64, ("b", "enc")), TensorSpec("input_ids", I64, ("b", "dec")),
          TensorSpec("decoder_attention_mask", "bool", ("b", "dec"))]
    feeds, _ = random_inputs(t5, {"b": 2, "enc": 5, "dec": 3}, seed=3)
    assert (feeds["encoder_attention_mask"] == 1).all() and feeds["encoder_attention_mask"].shape == (2, 5)
    assert feeds["decoder_attention_mask"].dtype == bool and feeds["decoder_attention_mask"].all()


def test_token_types_are_zero_and_positions_count_without_a_graph() -> None:
    bert = [TensorSpec("input_ids", I64, ("b", "s")), TensorSpec("token_type_ids", I64, ("b", "s")), TensorSpec("position_ids", "int32", ("s",))]
    assert named_values(bert) == {"token_type_ids": InputValues.range(0, 1), "position_ids": InputValues("positions")}
    feeds, _ = random_inputs(bert, {"b": 2, "s": 6})
    assert (feeds["token_type_ids"] == 0).all()
    np.testing.assert_array_equal(feeds["position_ids"], np.arange(6, dtype=np.int32))
    assert feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() <= 3  # no bound known: small indices, as before


def test_values_given_bound_the_draw_and_outrank_the_names() -> None:
    specs = [TensorSpec("input_ids", I64, (4, 50)), TensorSpec("token_type_ids", "int32", (4, 50)), TensorSpec("x", "float32", (2,))]
    values = {"input_ids": InputValues.range(100, 130), "token_type_ids": InputValues.range(0, 2), "x": InputValues.range(0, 2)}
    feeds, _ = random_inputs(specs, values=values)
    assert feeds["input_ids"].min() >= 100 and feeds["input_ids"].max() < 130 and len(np.unique(feeds["input_ids"])) > 10
    assert set(np.unique(feeds["token_type_ids"])) == {0, 1}
    assert feeds["x"].dtype == np.float32  # a float's range is no index: normal values
    narrow = [TensorSpec("u", "uint8", (64,))]
    feeds, _ = random_inputs(narrow, values={"u": InputValues.range(-5, 1000)})  # clipped to the dtype
    assert feeds["u"].dtype == np.uint8 and feeds["u"].max() > 3


def test_a_rank_4_or_float_mask_is_no_padding_mask() -> None:
    specs = [TensorSpec("mask", I64, ("N", 3, 4, 4)), TensorSpec("attn_mask", "float32", ("N", 4))]
    assert named_values(specs) == {}


def test_the_metadata_text_round_trips_and_refuses_what_it_cannot_read() -> None:
    values = {"input_ids": InputValues.range(0, 30522), "attention_mask": InputValues("mask"), "position_ids": InputValues("positions")}
    text = format_values(values)
    assert parse_values(text) == values
    spec = PipelineSpec(inputs=(), outputs=(), stages=(), links=(), metadata={INPUT_VALUES_KEY: text})
    assert spec_values(spec) == values
    assert spec_values(PipelineSpec(inputs=(), outputs=(), stages=(), links=())) == {}  # an old bundle: the names' rules
    with pytest.raises(ConfigError, match="input 'x' has \\[3, 1\\]; expected \\[LOW, HIGH\\]"):
        parse_values('{"x": [3, 1]}')
    with pytest.raises(ConfigError, match="no JSON object"):
        parse_values("[1, 2]")


def test_split_sizes_take_the_splits_dims_under_those_given() -> None:
    spec = PipelineSpec(inputs=(), outputs=(), stages=(), links=(), metadata={"input_dims": "H=32,W=48"})
    assert split_sizes(spec, {"W": 64}) == ({"H": 32, "W": 64}, ["random inputs sized as the pipeline was split for (input_dims: H=32)"])
    assert split_sizes(spec, {"H": 1, "W": 2})[1] == []
    assert parse_dims("H=32,W=48") == {"H": 32, "W": 48}


def test_a_formula_dim_is_computed_from_the_dims_it_names() -> None:
    specs = [TensorSpec("x", "float32", ("batch", "seq")), TensorSpec("past", "float32", ("batch", "past_seq")),
             TensorSpec("both", "float32", ("batch", "past_seq + seq")), TensorSpec("conv", "float32", ("floor(H/2 - 1/2) + 1",))]
    shapes, notes = sample_shapes(specs, {"batch": 2, "seq": 3, "past_seq": 4, "H": 9})
    assert shapes["both"] == (2, 7) and shapes["conv"] == (5,) and notes == []
    # Not given: the names are asked for (``--dim`` takes names), never the formula's text.
    assert defaulted_dims(specs, {"batch": 2}) == ["seq", "past_seq", "H"]
    assert "--dim H=N" in dims_hint(defaulted_dims(specs, {"batch": 2}))
    assert sample_shapes(specs, {"batch": 1})[0]["both"] == (1, 2)  # each name not given is 1
    with pytest.raises(InputError, match="no input has a dim named 'h'"):
        sample_shapes(specs, {"h": 2})
