"""Per-stage session settings, split by when they may change: :class:`BuildSettings` (target,
provider options, optimization, ...: they make the module, fixed once it is built),
:class:`DeploySettings` (threads, cores, replicas, batching: a host may change them, see
``_overrides.py``), and :class:`StageSettings`, both in one, as ``pipeline.json`` holds them; and how
they become an onnxruntime session.

Note: threads and affinity.
    A stage runs on its own worker thread, which is also onnxruntime's first intra-op thread (it
    runs the op itself while the pool helps). With ``affinity=[c0, c1, ...]`` and ``T`` intra-op
    threads, the worker is pinned to ``c0`` and onnxruntime's intra-op thread ``i`` (``1 <= i < T``)
    to ``c(i)`` through ``session.intra_op_thread_affinities`` (whose processor ids count from 1:
    core ``c`` is written ``c + 1``). With fewer cores than threads, every thread may run on any of
    the listed cores. Spinning is off by default: a spinning pool steals cores from the other stages
    of a pipeline.

Note: what session_config may hold.
    ``session_config`` passes extra ``add_session_config_entry`` keys to onnxruntime, which takes
    the last value given for a key. A key that a typed setting makes (``spinning`` writes
    ``session.intra_op.allow_spinning``, ``affinity`` writes ``session.intra_op_thread_affinities``,
    ...) would let the bundle's text overrule the setting: ``spinning=False`` with
    ``{"session.intra_op.allow_spinning": "1"}`` spun, ``--set spinning=off`` could not stop it while
    the start line said spinning off, and ``{"session.intra_op_thread_affinities": "99999"}``
    pinned threads past the core check. So such keys are refused wherever settings are made
    (:data:`OWNED_SESSION_CONFIG` names the setting to use instead): at build, where
    ``StageSettings`` is made, and at load, where ``pipeline.json`` is read (a ``BundleError``
    naming the stage); the settings onnxpipe checks, shows and lets a host override are then the
    ones the session runs with. Refused too: the keys onnxpipe sets itself (where a session
    records its nodes' providers, where a module read from an archive finds its weights) and any
    key that names a file or folder of the host, or makes onnxruntime write one
    (:func:`host_file_key`): ``session.collect_node_memory_stats_to_file`` overwrites the file it
    names as the session starts, ``session.node_partition_config_file`` reads one. A bundle is
    data; it names no file outside itself. Every other key (``session.set_denormal_as_zero``,
    ``session.use_device_allocator_for_initializers``, ...) is passed as given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

import onnxruntime as ort

from onnxpipe._errors import ConfigError, closest

__all__ = [
    "EP_DEVICES",
    "EP_THREAD_OPTIONS",
    "MAX_BATCH",
    "MAX_CORES",
    "OPTIMIZATION_LEVELS",
    "OWNED_SESSION_CONFIG",
    "PROVIDER_ALIASES",
    "BuildSettings",
    "DeploySettings",
    "StageSettings",
    "host_cores",
    "host_file_key",
    "listed_cores",
    "resolve_provider",
]

#: Short names for execution providers; any full name onnxruntime knows is accepted too.
PROVIDER_ALIASES: dict[str, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dnnl": "DnnlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "directml": "DmlExecutionProvider",
    "dml": "DmlExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "nnapi": "NnapiExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "cann": "CANNExecutionProvider",
    "vitisai": "VitisAIExecutionProvider",
    "acl": "ACLExecutionProvider",
    "armnn": "ArmNNExecutionProvider",
    "azure": "AzureExecutionProvider",
}

OPTIMIZATION_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
#: What a Kubernetes-style label value (and so a Ray node label value) may be.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
#: The largest ``max_batch``: a batch's arrays are allocated per call, so a bundle may not ask for more.
MAX_BATCH = 1024
#: Which streams a stage whose state grows batches (``BuildSettings.batch_lengths``).
BATCH_LENGTHS = ("any", "equal")
#: The longest ``max_delay_ms`` (a minute): longer is a typo, not a policy.
MAX_DELAY_MS = 60_000.0
#: The device kinds a plugin provider's devices may be taken by (``ep_device``).
EP_DEVICES = ("cpu", "gpu", "npu")
#: Providers that run a node on threads of their own, and the option that sizes them: the stage's
#: ``intra_op_threads`` is given to it unless its provider options set it (docs/building.md).
EP_THREAD_OPTIONS: dict[str, str] = {"OpenVINOExecutionProvider": "num_of_threads"}
#: Session config keys a typed setting makes -> (the setting, how the command line gives it): refused in
#: ``session_config`` (see Note: what session_config may hold).
OWNED_SESSION_CONFIG: dict[str, tuple[str, str]] = {
    "session.intra_op.allow_spinning": ("spinning", "spinning=on|off"),
    "session.inter_op.allow_spinning": ("spinning", "spinning=on|off"),
    "session.intra_op_thread_affinities": ("affinity", "affinity=CORES"),
    "session.intra_op_num_threads": ("intra_op_threads", "threads=N"),
    "session.inter_op_num_threads": ("inter_op_threads", "inter-threads=N"),
    "session.execution_mode": ("execution_mode", "mode=sequential|parallel"),
    "session.graph_optimization_level": ("optimization", "opt=LEVEL"),
    "session.disable_cpu_ep_fallback": ("fallback", "fallback=on|off"),
}
#: Session config keys onnxpipe sets itself, and why.
_ONNXPIPE_SESSION_CONFIG = {
    "session.record_ep_graph_assignment_info": "onnxpipe asks every session which provider took each node",
    "session.model_external_initializers_file_folder_path": "onnxpipe points a module read from an archive at its weights",
}
#: The most core numbers a refusal lists (``affinity=0-4095`` on a 2-core host lacks 4,094 of them).
_SHOWN_CORES = 8
#: The largest core number a setting may name, plus one: Linux's most CPUs (``NR_CPUS``, 8192 at most);
#: a number past it is a typo, and ``affinity=0-1000000`` is refused before a million are listed.
MAX_CORES = 8192
#: Words of a session config key that names a file or folder of the host.
_FILE_WORDS = frozenset({"file", "filepath", "path", "dir", "folder", "root"})
_PROVIDERS_WITH_DEVICE = {"CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider",
                          "DmlExecutionProvider", "CANNExecutionProvider"}


def resolve_provider(name: str, plugin: bool = False) -> tuple[str, int | None]:
    """Full provider name and device id of a target such as ``cpu``, ``cuda:1``, ``DnnlExecutionProvider``.

    Args:
        name: The target.
        plugin: The provider comes from a plugin library (``ep_package``): any name is taken, since
            only the library knows its own.

    Raises:
        ConfigError: onnxruntime knows no such provider (the message lists the known ones).
    """
    base, _, device = name.partition(":")
    device_id = None
    if device:
        if not device.isdigit():
            raise ConfigError(f"target '{name}': the device after ':' must be a number, e.g. 'cuda:1'")
        device_id = int(device)
    full = PROVIDER_ALIASES.get(base.lower(), base)
    known = set(ort.get_all_providers()) | set(PROVIDER_ALIASES.values())
    if full not in known and not plugin:
        raise ConfigError(f"unknown execution provider '{base}'; {closest(base, [*PROVIDER_ALIASES, *sorted(known)])}")
    return full, device_id


def host_file_key(key: str) -> bool:
    """Whether a session config key names a file or folder of the host, or makes onnxruntime write one
    (``ep.context_*`` writes a compiled model beside the module, profiling a trace into the working folder)."""
    return bool(_FILE_WORDS & set(re.split(r"[._]", key.lower()))) or key.startswith("ep.context_") or key == "session.enable_profiling"


def _refuse_session_keys(config: Mapping[str, str]) -> None:
    """Refuse the session config keys a bundle may not set (see Note: what session_config may hold)."""
    for key in config:
        if key in OWNED_SESSION_CONFIG:
            setting, given = OWNED_SESSION_CONFIG[key]
            raise ConfigError(f"session_config key '{key}' is what the setting '{setting}' makes: set {setting} instead (StageSettings({setting}=...), "
                              f"or SEL:{given} in --stage / --set), so the session runs as its settings say")
        if key in _ONNXPIPE_SESSION_CONFIG:
            raise ConfigError(f"session_config key '{key}' is onnxpipe's own ({_ONNXPIPE_SESSION_CONFIG[key]}); remove it")
        if host_file_key(key):
            raise ConfigError(f"session_config key '{key}' names a file or folder of the host, or makes onnxruntime write one; a bundle is data "
                              "and names no file outside itself: remove it")


def _integer(value: object) -> bool:
    """Whether ``value`` is an integer (``True`` is not one, though Python says it is)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_kinds(settings: object, kinds: Mapping[str, type]) -> None:
    """Refuse a setting that is not a string or a bool, as ``kinds`` says it must be."""
    for name, kind in kinds.items():
        if not isinstance(getattr(settings, name), kind):
            raise ConfigError(f"{name} must be {'a string' if kind is str else 'true or false'}, got {getattr(settings, name)!r}")


def _check_strings(settings: object, name: str) -> None:
    """Refuse provider options or session config that do not map strings to strings."""
    value = getattr(settings, name)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must map strings to strings, got {value!r}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise ConfigError(f"provider options and session config take string keys and values, got {key!r}: {item!r}")


def _package_name(value: object) -> bool:
    """Whether ``value`` is a Python package name (``onnxruntime_extensions``, ``a.b``): never a path."""
    return isinstance(value, str) and bool(value) and all(part.isidentifier() for part in value.split("."))


_D = TypeVar("_D", bound="DeploySettings")


@dataclass(frozen=True)
class BuildSettings:
    """The settings a stage is built with: they make its module, or are what its build checked
    about it. A bundle keeps them as built; changing one is a rebuild (see Note: what a deployment
    may change, in ``_overrides.py``). :class:`StageSettings` holds them with the
    :class:`DeploySettings`.

    Attributes:
        target: Execution provider, short (``cpu``, ``cuda:1``, ``tensorrt``, ``openvino``, ``dnnl``, ...)
            or full (``CUDAExecutionProvider``); ``:N`` selects a device.
        provider_options: Options passed to the provider (strings).
        fallback: Allow nodes the provider cannot run to fall back to the CPU provider; when false
            the session fails instead (``session.disable_cpu_ep_fallback``).
        optimization: Graph optimization level: ``disable``, ``basic``, ``extended``, ``all``.
        session_config: Extra ``add_session_config_entry`` keys and values; never a key a typed
            setting makes, onnxpipe's own, or one naming a host file (see Note: what
            session_config may hold).
        custom_ops: Custom-op libraries the session registers, each named by the Python package
            that ships it (e.g. ``onnxruntime_extensions``); the host resolves the library by
            importing the package and calling its ``get_library_path()``, and only when its
            allow-list permits the package (see ``onnxpipe.runtime._code``). Never a path.
        batch_pad: Input name -> the value a batch pads it with, instead of the value the
            build's probe would choose (0 for states and int masks, a float mask's lowest value):
            for a mask the model applies other than as an additive bias. The probe still checks
            that batched equals alone. Written to ``pipeline.json`` only when set.
        ep_package: For a plugin execution provider (onnxruntime 1.23 and later), the Python
            package that ships its library (e.g. ``onnxruntime_qnn``), never a path: the host
            imports it only when its allow-list permits (like ``custom_ops``), registers the
            library from its ``get_library_path()`` once per process, and adds the devices the
            provider offers (``get_ep_devices()``) with the stage's provider options. ``target``
            names the provider (``qnn`` or its full name). Written to ``pipeline.json`` only when set.
        ep_device: With ``ep_package``: the kind of device to take, ``cpu``, ``gpu`` or ``npu``;
            None: every device the provider offers.
        batch_lengths: Which streams' steps a stage whose state grows may run as one call
            (:data:`BATCH_LENGTHS`): ``"any"``, padded to the longest (the pipeline needs an
            attention mask input to hide the padding), or ``"equal"``, only streams whose pasts
            are equally long, so nothing is padded (a decoder without a mask over its own past:
            optimum's T5 and Whisper decoders); the others run alone. Written to
            ``pipeline.json`` only when set.

    Raises:
        ConfigError: a bad value, named with the valid choices.
    """

    target: str = "cpu"
    provider_options: Mapping[str, str] = field(default_factory=dict)
    fallback: bool = True
    optimization: str = "all"
    session_config: Mapping[str, str] = field(default_factory=dict)
    custom_ops: tuple[str, ...] = ()
    batch_pad: Mapping[str, float] = field(default_factory=dict)
    ep_package: str | None = None
    ep_device: str | None = None
    batch_lengths: str = "any"

    def __post_init__(self) -> None:
        self._check_provider()
        self._check_batch_pad()
        if self.batch_lengths not in BATCH_LENGTHS:
            raise ConfigError(f"batch_lengths must be one of {', '.join(repr(b) for b in BATCH_LENGTHS)}, got {self.batch_lengths!r}")
        self._check_optimization()
        self._check_custom_ops()
        self._check_session_config()

    def _check_provider(self) -> None:
        """target, provider_options, fallback, ep_package, ep_device."""
        _check_kinds(self, {"target": str, "fallback": bool})
        _check_strings(self, "provider_options")
        if self.ep_package is not None and not _package_name(self.ep_package):
            raise ConfigError(f"ep_package must be a Python package name (e.g. 'onnxruntime_qnn'), never a path; got {self.ep_package!r}")
        if self.ep_device is not None and (self.ep_package is None or self.ep_device not in EP_DEVICES):
            raise ConfigError(f"ep_device must be one of {', '.join(EP_DEVICES)}, with ep_package set; got {self.ep_device!r}"
                              + ("" if self.ep_package else " without ep_package"))
        resolve_provider(self.target, plugin=self.ep_package is not None)
        if self.ep_package is not None and self.provider == "CPUExecutionProvider":
            raise ConfigError(f"ep_package '{self.ep_package}' names a plugin provider's package, but target is onnxruntime's own CPU provider; "
                              "set target to the plugin's provider (e.g. qnn), or drop ep_package")

    def _check_optimization(self) -> None:
        _check_kinds(self, {"optimization": str})
        if self.optimization not in OPTIMIZATION_LEVELS:
            raise ConfigError(f"unknown optimization level {self.optimization!r}; valid: {', '.join(OPTIMIZATION_LEVELS)}")

    def _check_session_config(self) -> None:
        _check_strings(self, "session_config")
        _refuse_session_keys(self.session_config)

    def _check_custom_ops(self) -> None:
        if isinstance(self.custom_ops, str) or not isinstance(self.custom_ops, (list, tuple)) or not all(map(_package_name, self.custom_ops)):
            raise ConfigError(f"custom_ops must be a list of Python package names (e.g. ['onnxruntime_extensions']), never paths; got {self.custom_ops!r}")
        object.__setattr__(self, "custom_ops", tuple(self.custom_ops))

    def _check_batch_pad(self) -> None:
        pads = self.batch_pad
        if not isinstance(pads, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for k, v in pads.items()
        ):
            raise ConfigError(f"batch_pad must map input names to finite numbers (e.g. {{'attn_bias': 0.0}}), got {pads!r}")
        object.__setattr__(self, "batch_pad", {k: float(v) for k, v in pads.items()})

    @property
    def provider(self) -> str:
        """The full execution provider name."""
        return resolve_provider(self.target, plugin=self.ep_package is not None)[0]

    @property
    def device_id(self) -> int | None:
        """The device number given with ``:N``, if any."""
        return resolve_provider(self.target, plugin=self.ep_package is not None)[1]


@dataclass(frozen=True)
class DeploySettings:
    """The settings that say how a host runs a stage: its threads, its cores, its replicas, how
    large a batch it forms and how long it waits for one, and on which Ray node it lives. A
    deployment may change them (``load(..., overrides=...)``, ``--set`` on ``onnxpipe
    serve/run/bench/verify/inspect/rebundle``): they are the settings it may change, and no
    others (see Note: what a deployment may change, in ``_overrides.py``).
    :class:`StageSettings` holds them with the :class:`BuildSettings`.

    Attributes:
        intra_op_threads: Threads for one op (onnxruntime's ``intra_op_num_threads``; 0 = its default,
            all physical cores, rarely right in a pipeline).
        inter_op_threads: Threads across ops, used with ``execution_mode="parallel"``.
        execution_mode: ``sequential`` or ``parallel``.
        spinning: Let idle onnxruntime threads spin (off: they would steal the other stages' cores).
        affinity: Cores (0-based) to pin the stage's worker and intra-op threads to; see Note:
            threads and affinity.
        replicas: Workers running this stage, each with its own session.
        max_batch: The most requests (or steps of different streams) the stage runs as one
            session call; 1 (the default): each alone. Above 1 the build checks the stage can
            batch and records how (``StageSpec.batching``; docs/batching.md), and a deployment
            may not go above the built value (see Note: max_batch at deploy time, in
            ``_overrides.py``). Written to ``pipeline.json`` only when above 1.
        max_delay_ms: How long a request the stage has taken may wait for others to join its
            batch; 0 (the default, Triton's advice): take what is queued, never wait. For streams,
            whose steps are batched at the pipeline's entry, the largest over the stages is how
            long a step may wait there for the other members of its group
            (``onnxpipe.runtime.scheduling``).
        host: With the Ray engine, run the stage on nodes labelled ``onnxpipe/host=HOST``
            (``ray start --labels onnxpipe/host=HOST``); None: any node. The thread engine ignores it.
            Written to ``pipeline.json`` only when set.

    Raises:
        ConfigError: a bad value, named with the valid choices.
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    execution_mode: str = "sequential"
    spinning: bool = False
    affinity: tuple[int, ...] | None = None
    replicas: int = 1
    max_batch: int = 1
    max_delay_ms: float = 0.0
    host: str | None = None

    def __post_init__(self) -> None:
        self._check_workers()
        self._check_batching()
        self._check_affinity()
        self._check_host()

    def _check_workers(self) -> None:
        """intra_op_threads, inter_op_threads, execution_mode, spinning, replicas."""
        _check_kinds(self, {"execution_mode": str, "spinning": bool})
        for name in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if not _integer(value) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not _integer(self.replicas) or self.replicas < 1:
            raise ConfigError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if self.execution_mode not in ("sequential", "parallel"):
            raise ConfigError(f"execution_mode must be 'sequential' or 'parallel', got {self.execution_mode!r}")

    def _check_batching(self) -> None:
        """max_batch and max_delay_ms."""
        if not _integer(self.max_batch) or not 1 <= self.max_batch <= MAX_BATCH:
            raise ConfigError(f"max_batch must be an integer from 1 (no batching) to {MAX_BATCH}, got {self.max_batch!r}")
        delay = self.max_delay_ms
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= MAX_DELAY_MS:
            raise ConfigError(f"max_delay_ms must be a number of milliseconds from 0 to {MAX_DELAY_MS:g}, got {delay!r}")
        object.__setattr__(self, "max_delay_ms", float(delay))

    def _check_affinity(self) -> None:
        if self.affinity is None:
            return
        if not isinstance(self.affinity, (list, tuple)) or not self.affinity or not all(_integer(c) and c >= 0 for c in self.affinity):
            raise ConfigError(f"affinity must be a non-empty list of core numbers >= 0, got {self.affinity!r}")
        cores = tuple(self.affinity)
        if max(cores) >= MAX_CORES:
            raise ConfigError(f"affinity names core {max(cores)}; core numbers go from 0 to {MAX_CORES - 1} (Linux's most CPUs)")
        object.__setattr__(self, "affinity", cores)

    def _check_host(self) -> None:
        if self.host is not None and (not isinstance(self.host, str) or not _LABEL_VALUE.fullmatch(self.host)):
            raise ConfigError(f"host must be a node label value (up to 63 letters, digits, '-', '_', '.', "
                              f"starting and ending with a letter or digit), got {self.host!r}")

    def for_replica(self: _D, replica: int) -> _D:
        """The settings of one replica: with enough cores, each replica gets its own slice of
        ``affinity`` (``intra_op_threads`` cores each, in order); otherwise all share the list."""
        cores = self.affinity
        threads = max(self.intra_op_threads, 1)
        if cores is None or len(cores) < self.replicas * threads:
            return self
        return dataclasses.replace(self, affinity=cores[replica * threads : (replica + 1) * threads])

    def thread_count(self, cores: int) -> int:
        """Threads one replica runs: its worker (also intra-op thread 0) and the intra-op pool, and
        the inter-op pool in parallel mode; a count of 0 (onnxruntime's default) counts as ``cores``."""
        threads = self.intra_op_threads or cores
        if self.execution_mode == "parallel":
            threads += self.inter_op_threads or cores
        return threads

    def worker_cores(self) -> set[int] | None:
        """Cores for the stage's worker thread (which is also onnxruntime's first intra-op thread)."""
        if self.affinity is None:
            return None
        if len(self.affinity) >= max(self.intra_op_threads, 1):
            return {self.affinity[0]}
        return set(self.affinity)

    def thread_affinities(self) -> str | None:
        """The ``session.intra_op_thread_affinities`` value for the pool threads, or None."""
        if self.affinity is None or self.intra_op_threads <= 1:
            return None
        cores = self.affinity
        if len(cores) >= self.intra_op_threads:
            groups = [str(c + 1) for c in cores[1 : self.intra_op_threads]]
        else:
            groups = [",".join(str(c + 1) for c in cores)] * (self.intra_op_threads - 1)
        return ";".join(groups)


#: A stage's settings in ``pipeline.json``, in the order it has always listed them (that of the one
#: class they were before they were split by when they may change): a bundle built again is the same
#: bytes.
_JSON_ORDER = ("target", "provider_options", "fallback", "intra_op_threads", "inter_op_threads", "execution_mode", "spinning", "affinity",
               "optimization", "session_config", "replicas", "custom_ops", "host", "max_batch", "max_delay_ms", "batch_pad", "ep_package",
               "ep_device", "batch_lengths")
#: Settings newer than the format: absent when they have their default, so that a bundle that does not
#: use them reads, and is written, as before.
_WRITTEN_WHEN_SET = ("custom_ops", "host", "max_batch", "max_delay_ms", "batch_pad", "ep_package", "ep_device", "batch_lengths")
_DEFAULTS = {f.name: f.default_factory() if callable(f.default_factory) else f.default for f in (*fields(BuildSettings), *fields(DeploySettings))}


@dataclass(frozen=True)
class StageSettings(DeploySettings, BuildSettings):
    """How one stage's session is made: the :class:`BuildSettings` its bundle was built with and
    the :class:`DeploySettings` a host runs it with, in one object (what ``pipeline.json`` holds per
    stage). It takes the fields of both as keyword arguments (``StageSettings(target="cuda",
    intra_op_threads=2, max_batch=8)``) and has them as attributes; each part checks its own.

    Raises:
        ConfigError: a bad value, named with the valid choices.
    """

    def __post_init__(self) -> None:
        BuildSettings.__post_init__(self)
        DeploySettings.__post_init__(self)

    def replace(self, **changes: Any) -> StageSettings:
        """A copy with some fields changed (checked again)."""
        return StageSettings(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = {key: getattr(self, key) for key in _JSON_ORDER}
        for key in ("provider_options", "session_config", "batch_pad"):
            data[key] = dict(data[key])
        data["affinity"] = list(self.affinity) if self.affinity is not None else None
        data["custom_ops"] = list(self.custom_ops)
        for key in _WRITTEN_WHEN_SET:
            if getattr(self, key) == _DEFAULTS[key]:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageSettings:
        """Read the JSON form; unknown keys are a :class:`ConfigError` naming the valid ones."""
        names = {f.name for f in fields(cls)}
        for key in data:
            if key not in names:
                raise ConfigError(f"unknown stage setting '{key}'; {closest(key, names)}")
        values = dict(data)
        for key in ("affinity", "custom_ops"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        return cls(**values)

    def session_options(self, optimization: str | None = None) -> ort.SessionOptions:
        """onnxruntime session options for these settings.

        Args:
            optimization: Override the graph optimization level (the builder saves optimized modules
                and loads them with less optimization).

        Raises:
            ConfigError: an affinity names a core this process may not use.
        """
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = self.inter_op_threads
        opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL if self.execution_mode == "parallel" else ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = OPTIMIZATION_LEVELS[optimization or self.optimization]
        spin = "1" if self.spinning else "0"
        opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
        opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
        if not self.fallback and self.provider != "CPUExecutionProvider":  # the CPU provider has nothing to fall back from
            opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        if self.affinity is not None:
            check_cores(self.affinity)
            value = self.thread_affinities()
            if value:
                opts.add_session_config_entry("session.intra_op_thread_affinities", value)
        for key, value in self.session_config.items():
            opts.add_session_config_entry(key, value)
        return opts

    def providers(self) -> list[tuple[str, dict[str, str]]]:
        """The provider list for ``InferenceSession`` (with CPU after it when fallback is allowed)."""
        name, device = self.provider, self.device_id
        options = dict(self.provider_options)
        if device is not None and name in _PROVIDERS_WITH_DEVICE:
            options.setdefault("device_id", str(device))
        thread_option = EP_THREAD_OPTIONS.get(name)
        if thread_option and self.intra_op_threads and thread_option not in options:
            options[thread_option] = str(self.intra_op_threads)  # the provider's own pool, sized like the stage's
        chain = [(name, options)]
        if name != "CPUExecutionProvider" and self.fallback:
            chain.append(("CPUExecutionProvider", {}))
        return chain


def host_cores() -> int:
    """How many cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_cores(cores: Sequence[int]) -> None:
    """Refuse cores this process may not run on, naming the ones it may (each core given is checked,
    in one pass over the list).

    Raises:
        ConfigError: a core is outside the process's allowed set.
    """
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    bad = [c for c in cores if c not in allowed]
    if bad:
        raise ConfigError(f"affinity names core(s) {listed_cores(bad)} this process may not use; allowed cores: {sorted(allowed)}; "
                          "choose others at load: load(..., overrides=...), or --set SEL:affinity=CORES (onnxpipe serve/run/bench)")


def listed_cores(cores: Sequence[int]) -> str:
    """Cores for a message, the first few of a long list and its length: ``[2, 3, ..., 9, ...] (4094 in all)``."""
    if len(cores) <= _SHOWN_CORES:
        return str(list(cores))
    return f"[{', '.join(map(str, cores[:_SHOWN_CORES]))}, ...] ({len(cores)} in all)"
