"""Padding wherever a decoder is cut (issue 38): an automatic split's cut comes from measured costs,
so it may fall anywhere in a layer, and the tensors it hands on (the keys and values, the scores,
the softmax's weights, the mask) are padded by the batch like the attention mask. Each export is
cut by hand after 9 nodes of each layer's attention, from the keys and values to the output
projection (an ``assignment``: every node up to it in stage 0, as a measured cut may fall; the
sweep behind issue 38 tried every node of all 7 exports), built with its stages batching; the build's probe
(3 decode steps batched, every other stage replaying its members alone and joining them with the
record's fills) must agree with alone at every cut, each fill being what the batched call itself
puts at the padded positions (0 in the keys, values, scores and weights; the lowest float in the
masked scores). The cut that failed in issue 38 (after layer 0's softmax) is then decoded by 4
streams of mixed prompt lengths as one batch: tokens equal the whole export alone, logits within
1e-4 and finite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe import BuildError
from onnxpipe.builder import build, export
from onnxpipe.runtime import load
from onnxpipe.splitter import split
from tests.decoder_exports import WholeModel, decode_one_driver, model_path, prompts

#: Where a cut falls in each layer's attention: right after these nodes (their names after ``/model/layers.N/self_attn/``).
_AFTER = ("Concat_6", "Transpose_3", "MatMul", "Where_2", "Add_2", "Softmax", "Where_3", "MatMul_1", "o_proj/MatMul")
_EXPORTS = ("optimum-qwen2", "optimum-llama")


def _cut_after(name: str, node: str) -> object:
    """The export split in 2 after ``node``, every node before it in the file in stage 0, its stages batching (max_batch 4)."""
    model = onnx.load(str(model_path(name)), load_external_data=False)
    names = [n.name for n in model.graph.node]
    last = names.index(node)
    plan = split(str(model_path(name)), assignment={n: int(k > last) for k, n in enumerate(names)}, states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=4)
    return plan


@pytest.mark.parametrize("name", _EXPORTS)
def test_a_decoder_cut_anywhere_in_its_attention_batches_with_its_padding_filled_as_the_batched_call_fills_it(name: str, tmp_path: Path) -> None:
    model = onnx.load(str(model_path(name)), load_external_data=False)
    nodes = {n.name for n in model.graph.node}
    cuts = [f"/model/layers.{layer}/self_attn/{after}" for layer in (0, 1) for after in _AFTER]
    assert set(cuts) <= nodes, sorted(set(cuts) - nodes)
    fills = {}
    for k, node in enumerate(cuts):
        try:
            built = build(_cut_after(name, node).config, tmp_path / str(k))  # type: ignore[attr-defined]
        except BuildError as e:
            raise AssertionError(f"cut after {node}: {e}") from None
        probes = [s.batching.probe for s in built.spec.stages]  # type: ignore[union-attr]
        assert all("batched and alone agree" in p for p in probes), (node, probes)
        fills.update({port: fill for port, (_, fill) in built.spec.stages[1].batching.padded.items()})  # type: ignore[union-attr]
    # What the batched call puts at a padded position: 0 in the keys, values, scores and softmax weights, the lowest float
    # in the scores once the mask is added (issue 38: finfo.min everywhere made the replayed weights times values inf, then NaN).
    for layer in (0, 1):
        at = f"/model/layers.{layer}/self_attn/"
        assert fills[f"{at}Softmax_output_0"] == 0.0 and fills[f"{at}Reshape_6_output_0"] == 0.0 and fills[f"{at}MatMul_output_0"] == 0.0
        assert fills[f"{at}Add_2_output_0"] == float(np.finfo(np.float32).min)
        assert fills[f"present.{layer}.key"] == 0.0


@pytest.mark.parametrize("name", _EXPORTS)
def test_four_streams_of_mixed_lengths_cut_after_the_softmax_decode_the_tokens_of_the_whole_export(name: str, tmp_path: Path) -> None:
    """Issue 38's failing cut: the softmax's weights and the values cross it, padded."""
    plan = _cut_after(name, "/model/layers.0/self_attn/Softmax")
    bundle = export(build(plan.config, tmp_path / "built").path, tmp_path / "bundle")  # type: ignore[attr-defined]
    whole = WholeModel(name)
    starts = prompts(4)  # 1 to 4 tokens: every batch is padded
    counts = [6, 8, 7, 8]
    wants = [whole.generate(starts[k], counts[k]) for k in range(4)]
    with load(bundle, max_streams=8, micro_batches=1) as pipe:
        driven = decode_one_driver(pipe, whole.inputs, starts, counts)
        stats = pipe.stats()
    for k, (tokens, logits) in enumerate(driven):
        assert tokens == wants[k][0], f"stream {k}"
        got = np.stack(logits)
        assert np.isfinite(got).all(), f"stream {k}"
        np.testing.assert_allclose(got, np.stack(wants[k][1]), rtol=0, atol=1e-4, err_msg=f"stream {k}")
    assert len({tuple(w[0]) for w in wants}) > 1  # the streams' tokens depend on their prompts
    for stage in stats.stages:
        assert max(stage.batch_sizes) == 4, f"{stage.stage}: {stage.batch_sizes}"
