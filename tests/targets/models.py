"""The real models the target tests split, and the splits they use.

PP-OCRv4's text recognizer (the ``rapidocr_onnxruntime`` wheel's, a PaddlePaddle export with real
weights and ``-1`` dims) is the model whose outputs are compared: the onnx wheel's "light" models
carry constant weights, which make their outputs hang on rounding (squeezenet's softmax is flat
0.001 on the CPU and not on OpenVINO). squeezenet still serves where only the nodes matter.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import onnx
from onnx import ModelProto, helper

from tests.models import light_model_path

#: Where the target tests cut the recognizer: for 2 stages near its middle, for 3 also at a fifth.
CUTS = {2: ["p2o.Mul.127"], 3: ["p2o.Mul.59", "p2o.Mul.127"]}
#: The recognizer's input and output.
INPUT, OUTPUT = "x", "softmax_11.tmp_0"


def recognizer() -> ModelProto:
    """PP-OCRv4 rec: ``x`` [N, 3, 48, W] -> ``softmax_11.tmp_0`` [N, T, 6625] (860 nodes).

    Raises:
        FileNotFoundError: the ``rapidocr_onnxruntime`` wheel is not installed (its models are
            read from its folder; nothing of it is imported).
    """
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the rapidocr_onnxruntime wheel is not installed: pip install --no-deps rapidocr_onnxruntime==1.4.4")
    return onnx.load(str(Path(spec.submodule_search_locations[0]) / "models" / "ch_PP-OCRv4_rec_infer.onnx"))


def recognizer_onehot() -> ModelProto:
    """The recognizer with a ``Hardmax`` node named ``onehot`` after its softmax (output
    ``onehot``): an op the OpenVINO EP does not take, so it falls back to the CPU (1.24.1)."""
    model = recognizer()
    graph = model.graph
    graph.node.append(helper.make_node("Hardmax", [OUTPUT], ["onehot"], name="onehot", axis=2))
    graph.output.append(helper.make_tensor_value_info("onehot", onnx.TensorProto.FLOAT, None))
    return model


def squeezenet() -> ModelProto:
    """The onnx wheel's squeezenet (65 nodes at the basic level; constant weights)."""
    return onnx.load(str(light_model_path("squeezenet")))


def split_on(model: ModelProto, targets: list[str], cuts: list[str] | None = None, **settings: Any) -> Any:
    """``model`` split in ``len(targets)`` stages (at :data:`CUTS` unless ``cuts`` says), stage ``i``
    on ``targets[i]`` with one thread: a SplitPlan whose config is ready to build."""
    from onnxpipe.splitter import split

    plan = split(model, cuts or CUTS[len(targets)])
    for stage, target in zip(plan.config.stages, targets, strict=True):
        stage.configure(target=target, intra_op_threads=1, **settings)
    return plan
