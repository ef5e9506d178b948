"""An automatic split of a decoder cuts only where its stages can batch (issue 38; ``_batchcuts``,
Note: cuts that batch). Costs are made up, never measured: a profile that makes a cut handing on a
value with no batch axis (optimum's ``Gather(Shape(present.0.value))`` and the 5-int
``ConstantOfShape`` of its attention's value expansion) the best one; with states the policy cuts
elsewhere and the split builds with its stages batching (max_batch 8), while the same position cut by
hand is still refused by the build with its message. The positions on both sides of every run of
refused ones in layer 0 of the file's order build with batching too."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from onnxpipe import BuildError
from onnxpipe.builder import build, tensor_spec
from onnxpipe.splitter import MeasuredPolicy, UniformPolicy, split
from onnxpipe.splitter._batchcuts import UnbatchedCuts
from onnxpipe.splitter._cost import CostProfile
from onnxpipe.splitter._extract import infer_types
from onnxpipe.splitter._graph import GraphIndex
from onnxpipe.splitter._live import Sizer, live_sweep
from onnxpipe.splitter._states import pair_states
from tests.decoder_exports import model_path

_EXPORTS = ("optimum-qwen2", "optimum-llama")


def _refusal(name: str) -> tuple[onnx.ModelProto, list[int], UnbatchedCuts]:
    """The export, its file order of compute nodes and what a policy is given with states."""
    model = onnx.load(str(model_path(name)), load_external_data=False)
    index = GraphIndex(model)
    types, _ = infer_types(model)
    pairs = pair_states([tensor_spec(types[n]) for n in index.inputs], [tensor_spec(types[n]) for n in index.outputs], "auto")
    order = index.compute_nodes()
    return model, order, UnbatchedCuts(index, types, pairs)


def _refused(name: str) -> tuple[onnx.ModelProto, list[int], set[int]]:
    """The export, its file order of compute nodes and the positions of that order the policies leave out."""
    model, order, refusal = _refusal(name)
    return model, order, refusal(order, live_sweep(refusal.index, order, Sizer(dict(refusal.types), {})).live)


def _batching(plan: object, folder: Path) -> list[str]:
    """Build ``plan`` with every stage batching 8; each stage's probe line."""
    for stage in plan.config.stages:  # type: ignore[attr-defined]
        stage.configure(max_batch=8)
    built = build(plan.config, folder)  # type: ignore[attr-defined]
    return [s.batching.probe for s in built.spec.stages]  # type: ignore[union-attr]


def _by_hand(name: str, model: onnx.ModelProto, order: list[int], p: int) -> object:
    nodes = model.graph.node
    return split(str(model_path(name)), assignment={nodes[i].name: int(k > p) for k, i in enumerate(order)}, states="auto")


@pytest.mark.parametrize("name", _EXPORTS)
def test_a_policy_with_states_never_cuts_where_a_value_with_no_batch_axis_would_cross(name: str, tmp_path: Path) -> None:
    model, order, refusal = _refusal(name)
    refused = refusal(order, live_sweep(refusal.index, order, Sizer(dict(refusal.types), {})).live)
    at = {model.graph.node[i].name: p for p, i in enumerate(order)}
    expand = at["/model/layers.0/self_attn/Unsqueeze_21"]  # present.0.value's batch, heads... as scalars cross here
    assert {at["/model/layers.0/self_attn/ConstantOfShape"], expand} <= refused
    # Made-up costs: the nodes up to the refused position share a cost of 1, the rest another 1, so that cut alone (in any
    # order) gives a bottleneck of 1. Without states the policy takes it, and the build refuses to batch it; with states
    # the policy takes a worse one, which batches.
    before, after = order[: expand + 1], order[expand + 1 :]
    costs = {**{i: 1 / len(before) for i in before}, **{i: 1 / len(after) for i in after}}
    profile = CostProfile("", {}, "measured", costs, 2.0, 0.0, 0.0, 1)
    stateless = split(str(model_path(name)), policy=MeasuredPolicy(stages=2, profile=profile))
    assert stateless.auto is not None and stateless.auto.predicted_seconds is not None
    assert max(stateless.auto.predicted_seconds) == pytest.approx(1.0) and stateless.auto.assignment == {i: int(k > expand) for k, i in enumerate(order)}
    hand = _by_hand(name, model, order, expand)  # a hand split may still cut there
    with pytest.raises(BuildError, match="is a scalar, with no batch axis"):
        _batching(hand, tmp_path / "hand")
    plan = split(str(model_path(name)), policy=MeasuredPolicy(stages=2, profile=profile), states="auto")
    assert plan.auto is not None and plan.auto.predicted_seconds is not None and max(plan.auto.predicted_seconds) > 1.0 + 1e-6
    assert all("batched and alone agree" in p for p in _batching(plan, tmp_path / "auto"))
    # What a re-measured cut may move to (``_remeasure``): the policy's cut, not the refused one.
    assert refusal.batches(plan.auto.assignment) and not refusal.batches(stateless.auto.assignment)
    for stages in (3,):
        uniform = split(str(model_path(name)), policy=UniformPolicy(stages=stages), states="auto")
        assert all("batched and alone agree" in p for p in _batching(uniform, tmp_path / f"uniform{stages}"))


@pytest.mark.parametrize("name", _EXPORTS)
def test_the_cuts_next_to_every_refused_run_in_the_first_layer_batch(name: str, tmp_path: Path) -> None:
    model, order, refused = _refused(name)
    layer1 = next(p for p, i in enumerate(order) if model.graph.node[i].name.startswith("/model/layers.1/"))
    edges = sorted({p for r in refused if r < layer1 for p in (r - 1, r + 1) if p not in refused and 0 <= p < len(order) - 1})
    assert edges
    for p in edges:
        try:
            plan = _by_hand(name, model, order, p)
        except Exception:  # a cut separating a state pair: no stage to batch (the policies do not choose it either)
            continue
        try:
            probes = _batching(plan, tmp_path / str(p))
        except BuildError as e:
            raise AssertionError(f"cut after position {p} ({model.graph.node[order[p]].name}): {e}") from None
        assert all("batched and alone agree" in probe for probe in probes), (p, probes)
