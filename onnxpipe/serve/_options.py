"""What ``onnxpipe serve`` is told: the models to serve and how (:class:`ServeOptions`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from onnxpipe._errors import ConfigError
from onnxpipe.runtime import ARCHIVE_SUFFIX, DEFAULT_MAX_STREAMS, ENGINES, StageOverrides, is_bundle
from onnxpipe.runtime.bundle import CONFIG_NAME, MANIFEST_NAME, linked_folder
from onnxpipe.serve._errors import printable

__all__ = ["ModelSource", "ModelSources", "ServeOptions", "model_sources"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_VERSION = re.compile(r"[0-9]+")
#: The bundle a version folder holds, unless it is a bundle folder itself (Triton's ``model.onnx``).
_VERSION_BUNDLE = f"model{ARCHIVE_SUFFIX}"
#: What ``log_format`` takes.
LOG_FORMATS = ("text", "json")
#: Skipped entries an error lists (a repository may hold many).
_SHOWN = 5
#: What a name clients can use is (:data:`_NAME`), said where one is not.
_NAME_RULE = "letters, digits, '_', '.' and '-', starting with a letter or digit"
#: Why a symbolic link to a folder is not served (``runtime.read_bundle`` does not read one: see ``linked_folder``), worded as :func:`_not_servable`.
_LINKED = ("a symbolic link to a folder, which onnxpipe does not load as a bundle (a bundle holds regular files only): "
           f"put the folder itself here, or link a {ARCHIVE_SUFFIX} archive of it")
#: The bytes a sequence's state may hold, and the sequences of every model together, unless told
#: (``--max-sequence-state``, ``--sequence-state-budget``; ``_models``, Note: sequence state).
MAX_SEQUENCE_STATE = 256 << 20
SEQUENCE_STATE_BUDGET = 2 << 30


@dataclass(frozen=True)
class ModelSource:
    """A bundle to serve, and the name clients call it by.

    Attributes:
        name: The model's name.
        path: Its bundle (folder or archive).
        versions: The versions found in Triton's ``NAME/VERSION/`` layout, by number (``007``
            is ``7``), lowest first; the last is the one served, as that version (see Note: a
            model repository). Empty: a bundle of its own, served as version 1.
    """

    name: str
    path: Path
    versions: tuple[str, ...] = ()

    @property
    def version(self) -> str | None:
        """The version served, from Triton's layout (``None``: a bundle of its own)."""
        return self.versions[-1] if self.versions else None


class ModelSources(list[ModelSource]):
    """The models to serve (:func:`model_sources`), and what was found but not taken. A list, so
    that :func:`serve` given it says what was skipped and code that takes a list still does.

    Attributes:
        skipped: Each entry of the model repository (or of a model folder given) not served, with
            why: one line a user can act on, worded to follow "'PATH' is". Hidden entries (dot
            files) are not listed.
    """

    def __init__(self, sources: Iterable[ModelSource] = (), skipped: Iterable[tuple[Path, str]] = ()) -> None:
        super().__init__(sources)
        self.skipped = list(skipped)


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens, what it admits, and how it runs its pipelines.

    Attributes:
        host: The address to bind (loopback unless told otherwise).
        http_port: The HTTP/REST port (``GET /metrics`` too, behind the token).
        grpc_port: The gRPC port; 0 for no gRPC.
        metrics_port: The port of ``GET /metrics`` alone, without the token (Triton's
            ``--metrics-port``, 8002); 0 for none.
        metrics_host: The address the metrics port binds; ``None``: ``host`` (Triton's
            ``--metrics-address``).
        allow_metrics: Serve metrics at all (Triton's ``--allow-metrics``): ``False`` leaves out
            the metrics port and ``GET /metrics`` on the HTTP port.
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
        max_sequence_state_bytes: Bytes one sequence's state may hold; a step that leaves it
            larger is answered 400 and its sequence ended (``_models``, Note: sequence state).
        sequence_state_budget_bytes: Bytes the sequences of every model may hold together; a
            step that leaves them larger is answered 503 and its sequence ended.
        drain_timeout: Seconds to wait, on SIGTERM, for admitted requests to finish.
        request_timeout: Seconds every inference request may wait for its model to start it
            (Triton's queue policy ``default_timeout_microseconds``); past it, one still waiting
            is answered 503 (a request's ``timeout`` parameter may ask for less; ``_models``,
            Note: request timeouts). ``None``: no limit.
        allow_partial: Serve the models that load even when some do not.
        verify: Run each bundle's reference samples at load; a mismatch fails the model.
        access_log: Log every request, HTTP and gRPC, one line each (failures are logged either
            way: ``_logs``, Note: one line per request).
        log_format: ``"text"`` (``onnxpipe serve: ...`` lines) or ``"json"`` (one JSON object a
            line, for log shippers), for every line of the run (``_logs``, Note: one format per run).
        idle_timeout: Seconds a connection may take to send a request's head, from connecting or
            from its previous answer; then it is closed (``_connections``, Note: connections).
        max_connections: HTTP connections open at once; more are answered 503 and closed.
            ``None``: half the file descriptors the process may open, less 64.
        json_workers: Processes that decode JSON requests of 1 MiB or more, off the event loop
            (``_jsonwork``, Note: a JSON worker); 0: decode them on a thread of the server.
        json_timeout: Seconds a request may wait for a free JSON worker, and then hold one; past
            either it is answered 503, and a worker that took too long is killed and replaced
            (``_jsonwork``, Note: a worker's deadline).
        strict_readiness: With ``allow_partial``, answer not ready while a model failed to load
            (Triton's ``--strict-readiness``): the server serves what loaded, and an orchestrator
            sees that something is wrong.
        overrides: Deploy-time settings of the models' stages (threads, affinity, replicas, ...;
            ``onnxpipe.runtime.load(..., overrides=...)``), for every model served.
    """

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    metrics_host: str | None = None
    allow_metrics: bool = True
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
    max_sequence_state_bytes: int = MAX_SEQUENCE_STATE
    sequence_state_budget_bytes: int = SEQUENCE_STATE_BUDGET
    drain_timeout: float = 30.0
    request_timeout: float | None = None
    allow_partial: bool = False
    verify: bool = True
    access_log: bool = False
    log_format: str = "text"
    idle_timeout: float = 30.0
    max_connections: int | None = None
    json_workers: int = 1
    json_timeout: float = 30.0
    strict_readiness: bool = False
    overrides: tuple[StageOverrides, ...] = ()

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; valid: {', '.join(ENGINES)}")
        if self.address is not None and not ENGINES[self.engine].takes_address:
            takes = " or ".join(f"'{name}'" for name, engine in ENGINES.items() if engine.takes_address)
            raise ConfigError(f"address is for engine {takes}; the {self.engine} engine runs in the server's process")
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535 or (name == "http_port" and port == 0):
                raise ConfigError(f"{name} must be from {1 if name == 'http_port' else 0} to 65535, got {port}")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ConfigError(f"http_port and grpc_port are both {self.http_port}; give them different ports")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be from 0 to 65535, got {self.metrics_port}")
        for name in ("http_port", "grpc_port"):
            if self.allow_metrics and self.metrics_port and self.metrics_port == getattr(self, name):
                raise ConfigError(f"{name} and metrics_port are both {self.metrics_port}; give them different ports, or 0 for no metrics port")
        for name in ("max_inflight", "max_body_bytes", "max_streams", "queue_depth", "max_connections", "max_sequence_state_bytes",
                     "sequence_state_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.sequence_state_budget_bytes < self.max_sequence_state_bytes:
            raise ConfigError(f"sequence_state_budget_bytes (--sequence-state-budget) is {self.sequence_state_budget_bytes}, less than "
                              f"max_sequence_state_bytes (--max-sequence-state), {self.max_sequence_state_bytes}: one sequence would pass the "
                              "budget alone; give a budget at least as large")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ConfigError(f"request_timeout must be a positive number of seconds or None, got {self.request_timeout}")
        for name in ("body_timeout", "drain_timeout", "idle_timeout", "json_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"unknown log format {self.log_format!r}; valid: {', '.join(LOG_FORMATS)}")
        if self.json_workers < 0:
            raise ConfigError(f"json_workers must be 0 or more, got {self.json_workers}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ConfigError("the auth token is empty")


def model_sources(bundles: Sequence[str | os.PathLike[str]] = (), repository: str | os.PathLike[str] | None = None) -> ModelSources:
    """The models to serve: each bundle given (``PATH`` or ``NAME=PATH``), then every model in
    ``repository`` (see Note: a model repository), sorted by name.

    A model's name is its bundle's file or folder name without the ``.onnxpipe`` suffix (in
    Triton's layout, the model folder's name).

    Note: a model repository.
        Each entry of the folder is a bundle folder (a ``manifest.json``), a ``NAME.onnxpipe``
        archive, or a model folder in Triton's layout, ``NAME/VERSION/`` (VERSION a number), each
        version a bundle folder itself or holding ``model.onnxpipe``. Of a model's versions the
        highest is served, under its number (the others are listed in
        :attr:`ModelSource.versions`). Every other entry, and every entry of a model folder that
        is not a version holding a bundle, is listed in :attr:`ModelSources.skipped` with why
        (the server says each at start); hidden entries (dot files) are passed over. So is every
        entry the server could not serve after all, up front: one whose name clients cannot use
        in a URL, two of one name (both), one that cannot be read, and a bundle folder reached by
        a symbolic link (the repository's entry, a version folder, or its ``model.onnxpipe``),
        which the loader refuses (``runtime.read_bundle``: a bundle holds regular files only; a
        link to an archive, or to a model folder, is followed). What is listed, the loader
        accepts; what is wrong inside a bundle is found as it loads: a ``NAME.onnxpipe`` file is
        taken by its name, so that one damaged or truncated fails as it loads, naming the file
        (and ``allow_partial`` applies). A model folder in Triton's layout may be given by itself
        too. A bundle given by its path is the user's choice: a name that cannot be used, or a
        link to a folder, is an error instead.

    Returns:
        The models, with :attr:`ModelSources.skipped`.

    Raises:
        ConfigError: no model at all, a path given that is no bundle (saying what it is) or a
            link to a folder, a name given clients could not use, a repository that is no
            folder or holds no model, or two models of one name (a bundle given and one of the
            repository; two in the repository are skipped).
    """
    skipped: list[tuple[Path, str]] = []
    sources = [_source(str(item), skipped) for item in bundles]
    if repository is not None:
        found, passed = _repository(Path(repository))
        sources += found
        skipped += passed
    if not sources:
        raise ConfigError("no model to serve: give bundles (PATH or NAME=PATH) or a model repository folder")
    seen: dict[str, Path] = {}
    for s in sources:
        if s.name in seen:
            raise ConfigError(f"two models are named '{s.name}': '{printable(str(seen[s.name]))}' and '{printable(str(s.path))}'; name one with NAME=PATH")
        seen[s.name] = s.path
    return ModelSources(sources, skipped)


def _source(item: str, skipped: list[tuple[Path, str]]) -> ModelSource:
    name, sep, path_text = item.partition("=")
    if sep and not Path(item).exists():
        path = Path(path_text)
        _check_name(name, item)
    else:
        path, name = Path(item), _name(Path(item))
    if not path.exists():
        raise ConfigError(f"bundle '{printable(str(path))}' does not exist")
    if linked_folder(path) and (path / MANIFEST_NAME).is_file():
        raise ConfigError(f"'{printable(str(path))}' is {_LINKED}")
    # A file named as an archive is taken as one: damaged, it fails as it loads, naming what is wrong.
    if is_bundle(path) or (path.is_file() and path.name.endswith(ARCHIVE_SUFFIX)):
        return ModelSource(name, path)
    held = _model_folder(path, skipped) if path.is_dir() else None
    if held is None:
        raise ConfigError(f"'{printable(str(path))}' is {_not_servable(path)}")
    return ModelSource(name, *held)


def _repository(root: Path) -> tuple[list[ModelSource], list[tuple[Path, str]]]:
    """The models in the repository folder ``root`` (see Note: a model repository), and its entries not taken, with why."""
    if not root.is_dir():
        raise ConfigError(f"model repository '{printable(str(root))}' is not a folder")
    found: list[tuple[Path, ModelSource]] = []
    skipped: list[tuple[Path, str]] = []
    try:
        entries = _entries(root)
    except OSError as e:
        raise ConfigError(f"model repository '{printable(str(root))}' cannot be read: {e.strerror or e}") from None
    for entry in entries:
        inner: list[tuple[Path, str]] = []  # a model folder's entries not taken: said unless the folder itself is skipped
        try:
            source = _repository_entry(entry, inner)
        except OSError as e:  # a folder without the permission to list it, a file system error
            skipped.append((entry, f"not readable: {e.strerror or e}"))
            continue
        if isinstance(source, str):
            skipped.append((entry, source))
        else:
            skipped += inner
            if source is not None:
                found.append((entry, source))
    served = _one_each(found, skipped)
    if not served:
        listed = "; ".join(f"'{printable(str(p.relative_to(root)))}' is {why}" for p, why in skipped[:_SHOWN])
        more = f"; and {len(skipped) - _SHOWN} more" if len(skipped) > _SHOWN else ""
        raise ConfigError(
            f"model repository '{printable(str(root))}' holds no bundle (folders with a manifest.json, {ARCHIVE_SUFFIX} archives, or "
            f"NAME/VERSION/ folders holding one){': ' + listed + more if listed else ''}"
        )
    skipped.sort(key=lambda s: s[0])
    return served, skipped


def _repository_entry(entry: Path, inner: list[tuple[Path, str]]) -> ModelSource | str | None:
    """What one entry of a model repository is (see Note: a model repository): a model to serve,
    why it is not one (worded to follow "'PATH' is"), or ``None`` for a model folder whose
    versions all said why in ``inner``.

    Raises:
        OSError: the entry cannot be read.
    """
    if entry.is_file() and entry.name.endswith(ARCHIVE_SUFFIX):
        source = ModelSource(_model_name(entry), entry)
    elif linked_folder(entry) and (entry / MANIFEST_NAME).is_file():
        return _LINKED
    elif entry.is_dir() and (held := _model_folder(entry, inner)) is not None:
        source = ModelSource(_model_name(entry), *held)
    elif _versions(entry):
        return None
    else:
        return _not_servable(entry)
    if not _NAME.fullmatch(source.name):
        return f"named so that clients cannot call it: a model's name is {_NAME_RULE}; rename it"
    return source


def _one_each(found: list[tuple[Path, ModelSource]], skipped: list[tuple[Path, str]]) -> list[ModelSource]:
    """The models of ``found`` (each with its repository entry) whose name no other has; the
    entries of a name that several have go to ``skipped``, each naming the others (which one a
    client means, the server cannot know)."""
    by_name: dict[str, list[Path]] = {}
    for entry, source in found:
        by_name.setdefault(source.name, []).append(entry)
    for name, entries in by_name.items():
        if len(entries) > 1:
            for entry in entries:
                others = ", ".join(f"'{o.name}'" for o in entries if o != entry)
                skipped.append((entry, f"one of {len(entries)} entries that would be model '{name}' (also {others}): rename or remove all but one"))
    return [source for _, source in found if len(by_name[source.name]) == 1]


def _model_folder(folder: Path, skipped: list[tuple[Path, str]]) -> tuple[Path, tuple[str, ...]] | None:
    """The bundle a model folder holds, and its versions: the folder itself (a bundle folder: no
    versions), or in Triton's ``NAME/VERSION/`` layout the highest version holding a bundle, with
    every version holding one; ``None``: none. A model folder's entries not taken go to ``skipped``."""
    if (folder / MANIFEST_NAME).is_file():
        return folder, ()
    versions = _versions(folder)
    if not versions:
        return None
    # By number, lowest first: the version clients name is the folder's number (Triton reads 007 as 7).
    held = {str(int(v.name)): bundle for v in versions if (bundle := _version_bundle(v)) is not None and not linked_folder(bundle)}
    taken = set(held.values())
    skipped += [(p, _not_a_version(p)) for p in _entries(folder) if p not in taken and p / _VERSION_BUNDLE not in taken]
    if not held:
        return None
    return list(held.values())[-1], tuple(held)


def _versions(folder: Path) -> list[Path]:
    """The version folders (named by a number) of a model folder in Triton's layout, lowest first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in _entries(folder) if p.is_dir() and _VERSION.fullmatch(p.name)), key=lambda p: (int(p.name), p.name))


def _version_bundle(version: Path) -> Path | None:
    """The bundle a version folder holds: the folder itself, or its ``model.onnxpipe`` (taken by its name, as in the repository)."""
    if (version / MANIFEST_NAME).is_file():
        return version
    bundle = version / _VERSION_BUNDLE
    return bundle if bundle.is_file() or (bundle / MANIFEST_NAME).is_file() else None


def _entries(folder: Path) -> list[Path]:
    """A folder's entries but the hidden ones (an editor's, version control's), sorted."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def _not_servable(path: Path) -> str:
    """Why ``path``, neither a bundle nor an archive, is not served: what it is and what to do,
    worded to follow "'PATH' is"."""
    if path.is_dir():
        if (path / CONFIG_NAME).is_file():
            return "a build folder: export it with onnxpipe export"
        if any(is_bundle(p) or p.name.endswith(ARCHIVE_SUFFIX) for p in _entries(path)):
            return "not a bundle: a folder of bundles (a model repository: serve it with --model-repository)"
        return f"not a bundle: a folder with nothing servable (no {MANIFEST_NAME}, and no version folder 1/, 2/, ... in it holds a bundle)"
    if path.suffix == ".onnx":
        return "an ONNX model, not a bundle: make one with onnxpipe split/build/export"
    if is_bundle(path):
        return f"a zip archive not named NAME{ARCHIVE_SUFFIX}: rename it to serve it"
    if path.is_file():
        return f"not a bundle (a folder with a {MANIFEST_NAME}, or a {ARCHIVE_SUFFIX} archive)"
    if path.is_symlink():
        return f"a symbolic link to nothing ('{printable(os.readlink(path))}' does not exist)"
    return "neither a file nor a folder"


def _not_a_version(path: Path) -> str:
    """Why an entry of a model folder in Triton's layout is not served, worded as :func:`_not_servable`."""
    if path.name == "config.pbtxt":
        return "Triton's model configuration, not read: a bundle carries its own settings"
    if not (path.is_dir() and _VERSION.fullmatch(path.name)):
        return f"not a version folder (Triton's layout: NAME/VERSION/{_VERSION_BUNDLE}, VERSION a number)"
    bundle = _version_bundle(path)
    if bundle is not None and linked_folder(bundle):
        return _LINKED if bundle == path else f"a version folder whose {_VERSION_BUNDLE} is {_LINKED}"
    if any(p.suffix == ".onnx" for p in _entries(path)):
        return "a version folder holding an ONNX model, not a bundle: make one with onnxpipe split/build/export"
    if (path / CONFIG_NAME).is_file():
        return "a build folder: export it with onnxpipe export"
    return f"a version folder without a bundle ({_VERSION_BUNDLE}, or a {MANIFEST_NAME} of its own)"


def _name(path: Path) -> str:
    name = _model_name(path)
    _check_name(name, str(path))
    return name


def _model_name(path: Path) -> str:
    """The name of the model ``path`` holds: its file or folder name without ``.onnxpipe``."""
    return path.name[: -len(ARCHIVE_SUFFIX)] if path.name.endswith(ARCHIVE_SUFFIX) else path.name


def _check_name(name: str, where: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(f"model name {name!r} (from '{printable(where)}') cannot be used in URLs: a name is {_NAME_RULE}; name it with NAME=PATH")
