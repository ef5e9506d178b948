"""The builder: PipelineConfig (the authoring object) and stage modules as files."""

from onnxpipe.builder._config import CONFIG_FILE, PipelineConfig, Port, Stage
from onnxpipe.builder._modules import io_specs, save_model, tensor_nbytes, tensor_spec, weights_bytes, without_initializers

__all__ = [
    "CONFIG_FILE",
    "PipelineConfig",
    "Port",
    "Stage",
    "io_specs",
    "save_model",
    "tensor_spec",
    "tensor_nbytes",
    "weights_bytes",
    "without_initializers",
]
