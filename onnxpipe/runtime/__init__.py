"""The runtime: the pipeline spec, bundles and the executors. Imports only stdlib, numpy and onnxruntime."""

import onnxpipe.runtime._guard  # noqa: F401  first: a missing or broken onnxruntime is one error saying what to install
from onnxpipe.runtime._bench import BenchReport, StageBench, StreamBench, benchmark
from onnxpipe.runtime._code import check_allowed, code_entries
from onnxpipe.runtime._diagnostics import Diagnostics, ReplicaDiagnostics, StageDiagnostics
from onnxpipe.runtime._dtypes import DTYPES, dtype_from_onnx, dtype_from_ort, numpy_dtype
from onnxpipe.runtime._engine import DEFAULT_QUEUE_DEPTH
from onnxpipe.runtime._files import check_request_files, map_files, request_files
from onnxpipe.runtime._inputs import UNKNOWN_DIM_NAMES, check_dims, check_inputs, random_inputs, sample_shapes
from onnxpipe.runtime._ortapi import ModelMetadata, NodeArg
from onnxpipe.runtime._overrides import StageOverrides
from onnxpipe.runtime._pipeline import DEFAULT_MAX_STREAMS, ENGINES, Pipeline, ReferenceCheck, load
from onnxpipe.runtime._ray import RayOptions
from onnxpipe.runtime._rounds import Rounds, interleaved_rounds
from onnxpipe.runtime._sequential import SequentialPipeline
from onnxpipe.runtime._settings import PROVIDER_ALIASES, BuildSettings, DeploySettings, StageSettings, resolve_provider
from onnxpipe.runtime._spec import SPEC_VERSION, Batching, CodeSpec, Endpoint, Link, ParamGroup, PipelineSpec, StageSpec, StateLink, StepFlag, TensorSpec
from onnxpipe.runtime._stage import host_placement
from onnxpipe.runtime._stats import PipelineStats, StageStats
from onnxpipe.runtime._stream import Stream
from onnxpipe.runtime._streams import StreamsView
from onnxpipe.runtime._values import INPUT_DIMS_KEY, INPUT_VALUES_KEY, InputValues, spec_values
from onnxpipe.runtime.bundle import ARCHIVE_SUFFIX, Bundle, FileEntry, Limits, Manifest, is_bundle, load_npz, npz_layout, read_bundle, save_npz

__all__ = [
    "UNKNOWN_DIM_NAMES",
    "ARCHIVE_SUFFIX",
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_QUEUE_DEPTH",
    "DTYPES",
    "INPUT_DIMS_KEY",
    "INPUT_VALUES_KEY",
    "ENGINES",
    "PROVIDER_ALIASES",
    "SPEC_VERSION",
    "Batching",
    "BenchReport",
    "BuildSettings",
    "Bundle",
    "CodeSpec",
    "DeploySettings",
    "Diagnostics",
    "Endpoint",
    "FileEntry",
    "InputValues",
    "Limits",
    "Link",
    "Manifest",
    "ModelMetadata",
    "NodeArg",
    "ParamGroup",
    "Pipeline",
    "PipelineSpec",
    "PipelineStats",
    "RayOptions",
    "ReferenceCheck",
    "ReplicaDiagnostics",
    "Rounds",
    "SequentialPipeline",
    "StageBench",
    "StreamBench",
    "StageDiagnostics",
    "StageOverrides",
    "StageSettings",
    "StageSpec",
    "StageStats",
    "StateLink",
    "StepFlag",
    "Stream",
    "StreamsView",
    "TensorSpec",
    "benchmark",
    "check_allowed",
    "check_dims",
    "check_inputs",
    "check_request_files",
    "code_entries",
    "dtype_from_onnx",
    "dtype_from_ort",
    "host_placement",
    "interleaved_rounds",
    "is_bundle",
    "load",
    "load_npz",
    "map_files",
    "npz_layout",
    "numpy_dtype",
    "random_inputs",
    "read_bundle",
    "request_files",
    "resolve_provider",
    "sample_shapes",
    "save_npz",
    "spec_values",
]
