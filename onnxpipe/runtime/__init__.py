"""The runtime: the pipeline spec and the executors. Imports only stdlib, numpy and onnxruntime."""

from onnxpipe.runtime._dtypes import DTYPES, dtype_from_onnx, dtype_from_ort, numpy_dtype
from onnxpipe.runtime._sequential import SequentialPipeline
from onnxpipe.runtime._spec import SPEC_VERSION, Endpoint, Link, PipelineSpec, StageSpec, TensorSpec

__all__ = [
    "DTYPES",
    "SPEC_VERSION",
    "Endpoint",
    "Link",
    "PipelineSpec",
    "SequentialPipeline",
    "StageSpec",
    "TensorSpec",
    "dtype_from_onnx",
    "dtype_from_ort",
    "numpy_dtype",
]
