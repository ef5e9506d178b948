"""onnxpipe: split ONNX models into stages, build them, and run them as a pipeline.

The top-level package stays light (no onnx, onnxruntime or numpy import) so that the CLI's
``--help`` and the runtime's import firewall stay cheap. Use the sub-packages:

- :mod:`onnxpipe.splitter` -- cut a model into stage models,
- :mod:`onnxpipe.planner` -- choose how to run a model on a core budget (pipelines, replicas, one session),
- :mod:`onnxpipe.builder` -- the :class:`~onnxpipe.builder.PipelineConfig` authoring object,
- :mod:`onnxpipe.runtime` -- the bundle spec and the executor (numpy + onnxruntime only),
- :mod:`onnxpipe.serve` -- the network front door (``pip install 'onnxpipe[serve]'``).
"""

from onnxpipe._errors import (
    BuildError,
    BundleError,
    BusyError,
    Closure,
    ConfigError,
    InputError,
    OnnxpipeError,
    Remedy,
    SplitError,
    StageError,
    StateDimError,
    StreamError,
)

__version__ = "0.1.0"

__all__ = [
    "BuildError",
    "BundleError",
    "BusyError",
    "Closure",
    "ConfigError",
    "InputError",
    "OnnxpipeError",
    "Remedy",
    "SplitError",
    "StageError",
    "StateDimError",
    "StreamError",
    "__version__",
]
