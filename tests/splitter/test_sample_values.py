"""What a graph says of its inputs' values (Note: table bounds, splitter/_values.py), kept in the split's
metadata and used where no graph is read: verify, bench; bench's own sizes; formula dims in the planner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe import InputError, SplitError
from onnxpipe.builder import build, export
from onnxpipe.planner._checks import planning_dims
from onnxpipe.runtime import INPUT_VALUES_KEY, InputValues, TensorSpec, benchmark, load, read_bundle, spec_values
from onnxpipe.splitter import graph_values, split, verify

WORDS, TYPES, POSITIONS, OFFSET = 30, 2, 12, 2


def _table(name: str, rows: int, seed: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal((rows, 8)).astype(np.float32), name)


def bert_like() -> onnx.ModelProto:
    """BERT's embeddings: ``input_ids`` index a word table of 30 rows, ``token_type_ids`` (through a
    Cast) one of 2, ``offset_ids`` plus 2 (RoBERTa's padding offset) one of 12; ``attention_mask``
    enters ``(1 - mask) * -10000`` through Unsqueeze and Cast. Everything is summed into ``y [b, s, 8]``."""
    i64 = TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, i64, ["batch", "seq"]) for n in ("input_ids", "token_type_ids", "offset_ids", "attention_mask")]
    nodes = [
        helper.make_node("Gather", ["words", "input_ids"], ["w"], name="word_gather"),
        helper.make_node("Cast", ["token_type_ids"], ["types32"], to=TensorProto.INT32, name="type_cast"),
        helper.make_node("Gather", ["types", "types32"], ["t"], name="type_gather"),
        helper.make_node("Add", ["offset_ids", "two"], ["shifted"], name="offset_add"),
        helper.make_node("Gather", ["positions", "shifted"], ["p"], name="position_gather"),
        helper.make_node("Sum", ["w", "t", "p"], ["emb"], name="sum"),
        helper.make_node("Unsqueeze", ["attention_mask", "axis2"], ["m3"], name="mask_unsqueeze"),
        helper.make_node("Cast", ["m3"], ["mf"], to=TensorProto.FLOAT, name="mask_cast"),
        helper.make_node("Sub", ["one", "mf"], ["inverted"], name="mask_sub"),
        helper.make_node("Mul", ["inverted", "minus"], ["bias"], name="mask_mul"),
        helper.make_node("Add", ["emb", "bias"], ["biased"], name="bias_add"),
        helper.make_node("Tanh", ["biased"], ["y"], name="tanh"),
    ]
    initializers = [
        _table("words", WORDS, 0), _table("types", TYPES, 1), _table("positions", POSITIONS, 2),
        numpy_helper.from_array(np.array(OFFSET, np.int64), "two"), numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"), numpy_helper.from_array(np.array(-10000.0, np.float32), "minus"),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])
    graph = helper.make_graph(nodes, "bert_like", inputs, [out], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv_image() -> onnx.ModelProto:
    """``X [N, 3, H, W]`` -> a 3x3 Conv (no padding: H and W must be 3 or more) -> Relu -> ``Y``."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, "H", "W"])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "K")
    nodes = [helper.make_node("Conv", ["X", "K"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["Y"], name="relu")]
    return helper.make_model(helper.make_graph(nodes, "conv_image", [x], [y], [weight]), opset_imports=[helper.make_opsetid("", 17)])


EXPECTED = {"input_ids": InputValues.range(0, WORDS), "token_type_ids": InputValues.range(0, TYPES),
            "offset_ids": InputValues.range(0, POSITIONS - OFFSET), "attention_mask": InputValues("mask")}


def test_the_graph_bounds_each_index_by_its_table() -> None:
    assert graph_values(bert_like()) == EXPECTED


def test_a_gather_on_a_computed_tensor_or_a_float_path_bounds_nothing() -> None:
    model = bert_like()
    model.graph.node[0].input[0] = "emb_source"  # the word table no longer a constant
    model.graph.node.insert(0, helper.make_node("Relu", ["words"], ["emb_source"], name="relu_words"))
    values = graph_values(model)
    assert "input_ids" not in values and values["token_type_ids"] == InputValues.range(0, TYPES)


def test_a_split_keeps_the_values_and_verify_and_bench_use_them(tmp_path: Path) -> None:
    model = bert_like()
    plan = split(model, cuts=["sum"], dims={"batch": 2, "seq": 5})
    saved = plan.save(tmp_path / "split")
    metadata = json.loads((saved / "pipeline.json").read_text())["metadata"]
    assert {k: InputValues.from_json(v, k) for k, v in json.loads(metadata[INPUT_VALUES_KEY]).items()} == EXPECTED
    report = verify(saved, model, samples=2)  # 0..3 token types failed the whole model's Gather
    assert report.ok, report
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")
    with read_bundle(bundle) as b:
        assert spec_values(b.spec) == EXPECTED
    with load(bundle) as pipe:
        result = benchmark(pipe, 5, warmup=1, standalone_runs=1)
    assert result.requests == 5
    assert any("split for (input_dims: batch=2, seq=5)" in n for n in result.notes), result.notes


def test_an_old_bundle_without_the_key_keeps_the_names_rules(tmp_path: Path) -> None:
    model = bert_like()
    plan = split(model, cuts=["sum"])
    del plan.config.metadata[INPUT_VALUES_KEY]
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")
    with read_bundle(bundle) as b:
        assert spec_values(b.spec) == {}
    with load(bundle) as pipe:  # token types 0 by name, offsets 0..3 within 10 rows, the mask ones
        assert benchmark(pipe, 3, warmup=0, standalone_runs=0).requests == 3
    assert verify(bundle, model).ok  # verify reads the whole model's graph instead


def test_bench_uses_the_bundles_reference_inputs_then_its_split_dims_else_names_the_dims(tmp_path: Path) -> None:
    model = conv_image()
    plain = export(build(split(model, cuts=["conv"]).config, tmp_path / "b1").path, tmp_path / "plain")
    with load(plain) as pipe, pytest.raises(InputError, match=r"dims N, H, W not given, so 1: give their sizes with --dim NAME=N"):
        benchmark(pipe, 2, warmup=1, standalone_runs=0)
    sized = export(build(split(model, cuts=["conv"], dims={"H": 6, "W": 7}).config, tmp_path / "b2").path, tmp_path / "sized")
    with load(sized) as pipe:
        notes = benchmark(pipe, 2, warmup=1, standalone_runs=0).notes
    assert "random inputs sized as the pipeline was split for (input_dims: H=6, W=7)" in notes
    x = np.random.default_rng(0).standard_normal((1, 3, 5, 5)).astype(np.float32)
    referenced = export(build(split(model, cuts=["conv"]).config, tmp_path / "b3").path, tmp_path / "ref", reference_inputs=[{"X": x}])
    with load(referenced) as pipe:
        notes = benchmark(pipe, 2, warmup=1, standalone_runs=1).notes
        assert any("reference input set" in n for n in notes), notes
        with pytest.raises(InputError, match="dims N, H not given"):  # given dims: random inputs, and the others named
            benchmark(pipe, 2, warmup=1, standalone_runs=0, dims={"W": 9})


def test_the_planner_asks_for_the_dims_a_formula_names_never_the_formula() -> None:
    specs = [TensorSpec("input_ids", "int64", ("batch", "seq")), TensorSpec("past", "float32", ("batch", 2, "past_seq", 4)),
             TensorSpec("attention_mask", "int64", ("batch", "past_seq + seq"))]
    assert planning_dims(specs, {"seq": 1, "past_seq": 3}, "gpt.onnx") == [
        "input 'input_ids' dim 0 ('batch') not given: planned at batch size 1; give --dim batch=SIZE (dims={'batch': SIZE}) to plan for larger batches",
        "input 'past' dim 0 ('batch') not given: planned at batch size 1; give --dim batch=SIZE (dims={'batch': SIZE}) to plan for larger batches",
        "input 'attention_mask' dim 0 ('batch') not given: planned at batch size 1; give --dim batch=SIZE (dims={'batch': SIZE}) to plan for larger batches",
    ]
    with pytest.raises(SplitError, match=r"input 'attention_mask' dim 1 \('past_seq \+ seq'\), computed from past_seq\. Give them: --dim past_seq=SIZE \("):
        planning_dims(specs, {"seq": 1}, "gpt.onnx")


def test_t5s_decoder_gives_finite_logits_on_sample_inputs() -> None:
    """optimum's T5 decoder enters ``encoder_attention_mask`` into ``(1 - mask) * min``: a mask of 2 or 3 overflows to NaN."""
    import onnxruntime as ort

    from onnxpipe.builder import io_specs
    from onnxpipe.runtime import random_inputs

    path = Path(__file__).resolve().parents[1] / "data" / "corpus" / "t5" / "decoder_model.onnx"
    model = onnx.load(path)
    values = graph_values(model)
    assert values["encoder_attention_mask"] == InputValues("mask") and values["input_ids"].kind == "range"
    feeds, _ = random_inputs(io_specs(model)[0], {"batch_size": 2, "encoder_sequence_length": 5, "decoder_sequence_length": 3}, values=values)
    logits = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    assert np.isfinite(logits).all() and logits.std() > 0
