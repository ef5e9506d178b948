"""The network front door: ``onnxpipe serve`` speaks the Open Inference Protocol (KServe v2) over
HTTP and gRPC, with Triton's binary tensor data, model configuration, statistics and sequence
extensions, so Triton's own clients (``tritonclient``, ``perf_analyzer``) work unchanged.

Needs ``pip install 'onnxpipe[serve]'`` (aiohttp, grpcio, protobuf, prometheus-client, uvloop)
on top of the runtime; imports the runtime only, never the build side. See docs/serving.md.
"""

from onnxpipe.serve._errors import RequestError
from onnxpipe.serve._options import ModelSource, ModelSources, ServeOptions, model_sources
from onnxpipe.serve._server import serve
from onnxpipe.serve._state import EXTENSIONS

__all__ = ["EXTENSIONS", "ModelSource", "ModelSources", "RequestError", "ServeOptions", "model_sources", "serve"]
