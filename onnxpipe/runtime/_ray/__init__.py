"""The Ray engine (``load(..., engine="ray")``): each stage replica a Ray actor. Ray itself is
imported only when the engine starts; see ``_engine`` for how it places, ships and supervises."""

from onnxpipe.runtime._ray._engine import RayEngine
from onnxpipe.runtime._ray._options import HOST_LABEL, RayOptions, import_ray

__all__ = ["HOST_LABEL", "RayEngine", "RayOptions", "import_ray"]
