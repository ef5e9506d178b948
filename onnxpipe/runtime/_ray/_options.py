"""What the Ray engine's parts share: its options, the way Ray is imported, the node label."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onnxpipe._errors import ConfigError

__all__ = ["HOST_LABEL", "RayOptions", "brief", "import_ray"]

#: The node label a stage's ``host`` setting selects (``ray start --labels onnxpipe/host=NAME``).
HOST_LABEL = "onnxpipe/host"


@dataclass(frozen=True)
class RayOptions:
    """How the Ray engine places, ships and supervises the stages.

    Attributes:
        shared: The bundle's path is the same on every node (a shared file system): actors read it
            there instead of receiving its bytes through Ray's object store.
        placement_timeout_s: Give up loading when a stage has no actor ready after this long.
        restart_timeout_s: A replica that died and is not back after this long is dead.
        max_restarts: Times Ray restarts each stage actor.
        requests_per_call: The most requests one actor call carries when requests queue up for a
            busy replica (see the data-plane note); None: the pipeline's ``queue_depth``; 1: every
            request in a call of its own.
    """

    shared: bool = False
    placement_timeout_s: float = 60.0
    restart_timeout_s: float = 30.0
    max_restarts: int = 3
    requests_per_call: int | None = None


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ImportError as e:
        raise ConfigError("the Ray engine needs Ray, which is not installed: pip install 'onnxpipe[ray]'") from e
    return ray


def brief(error: BaseException) -> str:
    """The first line of a Ray error (its messages carry whole tracebacks)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
