"""The builder: PipelineConfig (the authoring object) and stage modules as files."""

import onnxpipe.runtime  # noqa: F401  first (its modules import onnxruntime): a missing or broken onnxruntime is one error saying what to install
from onnxpipe.builder._build import BuildResult, StageReport, build
from onnxpipe.builder._config import CONFIG_FILE, PipelineConfig, Port, SplitPieces, Stage
from onnxpipe.builder._export import export, read_build, rebundle
from onnxpipe.builder._modules import io_specs, save_model, tensor_nbytes, tensor_spec, weights_bytes, without_initializers

__all__ = [
    "CONFIG_FILE",
    "BuildResult",
    "PipelineConfig",
    "Port",
    "SplitPieces",
    "Stage",
    "StageReport",
    "build",
    "export",
    "io_specs",
    "read_build",
    "rebundle",
    "save_model",
    "tensor_spec",
    "tensor_nbytes",
    "weights_bytes",
    "without_initializers",
]
