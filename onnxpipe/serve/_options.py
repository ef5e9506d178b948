"""What ``onnxpipe serve`` is told: the models to serve and how (:class:`ServeOptions`)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from onnxpipe._errors import ConfigError
from onnxpipe.runtime import ARCHIVE_SUFFIX, DEFAULT_MAX_STREAMS, ENGINES, is_bundle

__all__ = ["ModelSource", "ServeOptions", "model_sources"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class ModelSource:
    """A bundle to serve, and the name clients call it by."""

    name: str
    path: Path


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens, what it admits, and how it runs its pipelines.

    Attributes:
        host: The address to bind (loopback unless told otherwise).
        http_port: The HTTP/REST port (``GET /metrics`` too).
        grpc_port: The gRPC port; 0 for no gRPC.
        auth_token: A bearer token every request but the health checks must carry; ``None``: none.
        allow_code: fnmatch patterns of the Python the bundles may make this host import.
        engine: ``"thread"`` or ``"ray"``.
        address: The Ray cluster (engine ``"ray"``).
        target: Run every stage on this target instead of its own.
        queue_depth: Requests that may wait in front of each stage; ``None``: ``max_inflight``, so
            that every admitted request can wait in the pipeline's own queues (a full first queue
            sends submissions through a thread of the server's, measured 6-8% slower on squeezenet
            at concurrency 16 with the runtime's default of 4).
        max_inflight: Requests admitted at once per model; more are refused with 503.
        max_body_bytes: Largest request body (also the largest gRPC message), compressed or not.
        body_timeout: Seconds a request's body may take to arrive; slower ones get 408.
        max_streams: Sequences open at once per model (a stateful model's streams).
        stream_timeout: Seconds a sequence may stay idle before it is closed (``None``: never).
        drain_timeout: Seconds to wait, on SIGTERM, for admitted requests to finish.
        allow_partial: Serve the models that load even when some do not.
        verify: Run each bundle's reference samples at load; a mismatch fails the model.
        access_log: Log every HTTP request (aiohttp's access log, to stderr).
        idle_timeout: Seconds a connection may take to send a request's head, from connecting or
            from its previous answer; then it is closed (``_connections``, Note: connections).
        max_connections: HTTP connections open at once; more are answered 503 and closed.
            ``None``: half the file descriptors the process may open, less 64.
        json_workers: Processes that decode JSON requests of 1 MiB or more, off the event loop
            (``_jsonwork``, Note: a JSON worker); 0: decode them on a thread of the server.
    """

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    auth_token: str | None = None
    allow_code: tuple[str, ...] = ()
    engine: str = "thread"
    address: str | None = None
    target: str | None = None
    queue_depth: int | None = None
    max_inflight: int = 64
    max_body_bytes: int = 64 << 20
    body_timeout: float = 30.0
    max_streams: int = DEFAULT_MAX_STREAMS
    stream_timeout: float | None = 60.0
    drain_timeout: float = 30.0
    allow_partial: bool = False
    verify: bool = True
    access_log: bool = False
    idle_timeout: float = 30.0
    max_connections: int | None = None
    json_workers: int = 1

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; valid: {', '.join(ENGINES)}")
        if self.address is not None and self.engine != "ray":
            raise ConfigError("address is for engine 'ray'; the thread engine runs in the server's process")
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535 or (name == "http_port" and port == 0):
                raise ConfigError(f"{name} must be from {1 if name == 'http_port' else 0} to 65535, got {port}")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ConfigError(f"http_port and grpc_port are both {self.http_port}; give them different ports")
        for name in ("max_inflight", "max_body_bytes", "max_streams", "queue_depth", "max_connections"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("body_timeout", "drain_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.json_workers < 0:
            raise ConfigError(f"json_workers must be 0 or more, got {self.json_workers}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ConfigError("the auth token is empty")


def model_sources(bundles: Sequence[str | os.PathLike[str]] = (), repository: str | os.PathLike[str] | None = None) -> list[ModelSource]:
    """The models to serve: each bundle given (``PATH`` or ``NAME=PATH``), then every bundle in
    ``repository`` (a folder of bundle folders and ``.onnxpipe`` archives), sorted by name.

    A model's name is its bundle's file or folder name without the ``.onnxpipe`` suffix.

    Raises:
        ConfigError: no model at all, a path that is no bundle, a name clients could not use,
            or two models of one name.
    """
    sources = [_source(str(item)) for item in bundles]
    if repository is not None:
        root = Path(repository)
        if not root.is_dir():
            raise ConfigError(f"model repository '{root}' is not a folder")
        found = sorted(p for p in root.iterdir() if is_bundle(p) and (p.is_dir() or p.name.endswith(ARCHIVE_SUFFIX)))
        if not found:
            raise ConfigError(f"model repository '{root}' holds no bundle (folders with a manifest.json, or {ARCHIVE_SUFFIX} archives)")
        sources += [ModelSource(_name(p), p) for p in found]
    if not sources:
        raise ConfigError("no model to serve: give bundles (PATH or NAME=PATH) or a model repository folder")
    seen: dict[str, Path] = {}
    for s in sources:
        if s.name in seen:
            raise ConfigError(f"two models are named '{s.name}': '{seen[s.name]}' and '{s.path}'; name one with NAME=PATH")
        seen[s.name] = s.path
    return sources


def _source(item: str) -> ModelSource:
    name, sep, path_text = item.partition("=")
    if sep and not Path(item).exists():
        path = Path(path_text)
        _check_name(name, item)
    else:
        path, name = Path(item), _name(Path(item))
    if not path.exists():
        raise ConfigError(f"bundle '{path}' does not exist")
    if not is_bundle(path):
        raise ConfigError(f"'{path}' is not a bundle (a folder with a manifest.json, or a {ARCHIVE_SUFFIX} archive); make one with onnxpipe export")
    return ModelSource(name, path)


def _name(path: Path) -> str:
    name = path.name[: -len(ARCHIVE_SUFFIX)] if path.name.endswith(ARCHIVE_SUFFIX) else path.name
    _check_name(name, str(path))
    return name


def _check_name(name: str, where: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"model name {name!r} (from '{where}') cannot be used in URLs: a name is letters, digits, '_', '.' and '-', "
            "starting with a letter or digit; name it with NAME=PATH"
        )
