"""The splitter: cut an ONNX model into stage models and the wiring between them."""

from onnxpipe.splitter._cuts import NodeCut, OpCut, TensorCut
from onnxpipe.splitter._inspect import CutCandidate, ModelSummary, inspect_model
from onnxpipe.splitter._plan import SplitPlan, SplitStage, load_model, split
from onnxpipe.splitter._verify import Comparison, VerifyReport, verify

__all__ = [
    "Comparison",
    "CutCandidate",
    "ModelSummary",
    "NodeCut",
    "OpCut",
    "SplitPlan",
    "SplitStage",
    "TensorCut",
    "VerifyReport",
    "inspect_model",
    "load_model",
    "split",
    "verify",
]
