"""The splitter: cut an ONNX model into stage models and the wiring between them."""

from onnxpipe.splitter._auto import POLICIES, AutoSplit, MeasuredPolicy, ParamsPolicy, SplitPolicy, UniformPolicy, make_policy
from onnxpipe.splitter._cost import CostProfile, profile_model
from onnxpipe.splitter._cuts import NodeCut, OpCut, TensorCut
from onnxpipe.splitter._graph import load_model
from onnxpipe.splitter._inspect import CutCandidate, ModelSummary, inspect_model
from onnxpipe.splitter._pipelinefile import PIPELINE_FILE_FORMAT, PIPELINE_FILE_VERSION, is_pipeline_file, read_pipeline_file
from onnxpipe.splitter._plan import SplitPlan, SplitStage, split
from onnxpipe.splitter._states import StatePair, pair_states
from onnxpipe.splitter._values import graph_values
from onnxpipe.splitter._verify import Comparison, VerifyReport, verify

__all__ = [
    "PIPELINE_FILE_FORMAT",
    "PIPELINE_FILE_VERSION",
    "POLICIES",
    "AutoSplit",
    "Comparison",
    "CostProfile",
    "CutCandidate",
    "MeasuredPolicy",
    "ModelSummary",
    "NodeCut",
    "OpCut",
    "ParamsPolicy",
    "SplitPlan",
    "SplitPolicy",
    "SplitStage",
    "StatePair",
    "TensorCut",
    "UniformPolicy",
    "VerifyReport",
    "graph_values",
    "inspect_model",
    "is_pipeline_file",
    "load_model",
    "make_policy",
    "pair_states",
    "profile_model",
    "read_pipeline_file",
    "split",
    "verify",
]
