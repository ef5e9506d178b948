"""Making a stage's onnxruntime session from its module, settings and build record.

Note: a session on the provider asked for, or an error.
    onnxruntime's Python ``InferenceSession`` retries a session whose provider fails to start on
    the CPU provider alone, printing the error and going on (its ``enable_fallback``); a provider
    whose factory refuses its options (OpenVINO with ``precision=FP99``, or a device it cannot
    find) is dropped in C++ with a log line. Either way a stage meant for an accelerator would run
    on the CPU without a word. :func:`open_session` turns the retry off and checks that the
    session it got has the stage's provider, so a stage runs where its settings say or fails to
    load naming the stage, the provider and why.

Note: where each node ran.
    onnxruntime 1.24 and later record which provider took each node of the optimized graph when
    asked (``session.record_ep_graph_assignment_info``; ``get_provider_graph_assignment_info``);
    every session onnxpipe makes asks, and :func:`placement` reads it: provider -> the nodes it
    took. An older onnxruntime cannot tell, and the placement is then ``None``. With
    ``fallback=off`` a provider that cannot take every node fails the session; the error names
    the nodes, found by making the session again with fallback on and reading its placement.

Note: a run's failure is said once.
    A run that fails raises onnxruntime's error, which the stage's ``StageError`` carries to the
    caller (``onnxpipe run`` prints it, the server answers and logs it with the request's model
    and id); onnxruntime also writes it to stderr itself, in its own format and ANSI colour
    (``[E:onnxruntime:, sequential_executor.cc:...]``). :func:`run_options` turns that line off
    for a stage's runs (``RunOptions.log_severity_level``, which a run's log takes instead of its
    session's): the session's own log, while it is made, stays as it was, since there it can be
    the one place saying why a provider refused its options.

    The options also say ``gpu_graph_id`` ``0``, the value onnxruntime takes where it is unset
    (the graph a CUDA or WebGPU graph capture records by default; the CPU provider reads none).
    onnxruntime 1.32's ``run_with_iobinding`` reads that entry from the run options it is given
    on every call, and an entry that is unset raises a C++ error that its Python catches: 33 us
    a call (``RunOptions.get_run_config_entry``, timed on this 2-core VM), against 0.2 us set.
    A decode step of a stage keeping its state in place (``_inplace``) is such a call; with the
    entry set, the tiny Llama decoded 1.20-1.30x faster (docs/batching.md: where a decode step's
    time goes beside the bound session).
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import BundleError, ConfigError, ort_message
from onnxpipe.runtime._code import custom_ops_library, package_library
from onnxpipe.runtime._distributions import conflict
from onnxpipe.runtime._settings import StageSettings
from onnxpipe.runtime._spec import StageSpec

__all__ = [
    "RECORDS_PLACEMENT",
    "Placement",
    "bound_outputs",
    "check_available",
    "load_optimization",
    "make_session",
    "maps_archive_data",
    "open_session",
    "placement",
    "plugin_devices",
    "run_options",
]

#: Whether this onnxruntime can say which provider took each node (see Note: where each node ran).
RECORDS_PLACEMENT = hasattr(ort.InferenceSession, "get_provider_graph_assignment_info")
#: Provider -> the nodes of the optimized graph it runs, each ``"OpType 'name'"``, in graph order.
Placement = dict[str, tuple[str, ...]]
#: The package that brings a provider to a Python host, for the error naming a missing one.
PROVIDER_PACKAGES: dict[str, str] = {
    "OpenVINOExecutionProvider": "onnxruntime-openvino (it replaces onnxruntime)",
    "CUDAExecutionProvider": "onnxruntime-gpu (it replaces onnxruntime; needs CUDA and cuDNN)",
    "TensorrtExecutionProvider": "onnxruntime-gpu (it replaces onnxruntime; needs TensorRT)",
    "DmlExecutionProvider": "onnxruntime-directml (Windows; it replaces onnxruntime)",
    "ROCMExecutionProvider": "onnxruntime-rocm (it replaces onnxruntime)",
    "MIGraphXExecutionProvider": "onnxruntime-migraphx (it replaces onnxruntime)",
    "QNNExecutionProvider": "onnxruntime-qnn (2.x is a plugin for plain onnxruntime: also set ep_package=onnxruntime_qnn)",
    "DnnlExecutionProvider": "an onnxruntime built with oneDNN (--use_dnnl)",
    "CoreMLExecutionProvider": "onnxruntime on macOS",
}
_FALLBACK_REFUSED = "fallback to CPU EP has been explicitly disabled"
#: onnxruntime's log severity for what only a crash would say (0 verbose ... 3 error, 4 fatal).
_FATAL_ONLY = 4
#: Run option ``gpu_graph_id`` at onnxruntime's default, said outright (Note: a run's failure is said once).
_GRAPH_ID = ("gpu_graph_id", "0")


def maps_archive_data() -> bool:
    """Whether this onnxruntime can read a stage's weights in place from a bundle archive.

    That needs a module given as bytes to find its external data through the session config entry
    ``session.model_external_initializers_file_folder_path``. onnxruntime 1.18-1.20 have the entry
    but their optimizers still want a model path ("model_path must not be empty", measured with
    1.18.0, 1.19.2, 1.20.1; 1.21.1 and later work), so there such weights are unpacked instead.
    """
    try:
        major, minor = (int(part) for part in ort.__version__.split(".")[:2])
    except ValueError:  # a development build: assume it is recent
        return True
    return (major, minor) >= (1, 21)


def load_optimization(stage: StageSpec, settings: StageSettings) -> str:
    """The optimization level to load a module with.

    A module the builder already optimized offline for this very provider at the settings' level is
    loaded without optimizing it again (that would only cost start-up time); any other module (a
    portable one from a cross-target build, or one whose target changed) is optimized at load.
    """
    done_for = stage.build.get("optimized_for")
    if done_for == settings.provider and stage.build.get("optimization") == settings.optimization:
        return "disable"
    return settings.optimization


def make_session(module: Path | str | bytes, stage: StageSpec, target: str | None = None, config: Mapping[str, str] | None = None) -> ort.InferenceSession:
    """The session of one stage.

    Args:
        module: The stage module file, or its bytes (see ``Bundle.session_source``).
        stage: The stage's spec (settings and build record).
        target: Run on this target instead of the stage's own (e.g. ``"cpu"`` to check a bundle
            built for a GPU on a host without one).
        config: More session config entries (where a module given as bytes finds its external data).

    Raises:
        BundleError: the target's provider is not available on this host, onnxruntime refuses the
            module or the provider's options, or the provider cannot take the stage (see :func:`open_session`).
    """
    settings = stage.settings if target is None else stage.settings.replace(target=target, provider_options={}, ep_package=None, ep_device=None)
    check_available(stage.name, settings)
    level = load_optimization(stage, settings)

    def options_for(chosen: StageSettings) -> ort.SessionOptions:
        try:
            options = chosen.session_options(level)
        except ConfigError as e:  # a core this process may not use: say whose
            raise ConfigError(f"stage '{stage.name}': {e}") from None
        for package in chosen.custom_ops:  # allowed by the caller (see _code.check_allowed)
            options.register_custom_ops_library(custom_ops_library(stage.name, package))
        for key, value in (config or {}).items():
            options.add_session_config_entry(key, value)
        return options

    source = module if isinstance(module, bytes) else str(module)
    return open_session(source, stage.name, settings, options_for, f"load module '{posixpath.basename(stage.module or '')}'")


def check_available(stage: str, settings: StageSettings) -> None:
    """Refuse a stage whose provider this host's onnxruntime lacks, naming what it has and what brings it
    (a plugin provider's package and devices are checked when its session is made: :func:`plugin_devices`).

    Raises:
        BundleError: the provider is not available.
    """
    if settings.ep_package is not None:
        return
    available = ort.get_available_providers()
    if settings.provider in available:
        return
    package = PROVIDER_PACKAGES.get(settings.provider)
    two = conflict(settings.provider)  # two onnxruntime builds over each other: installing one more is the wrong advice
    get = f"{two}; or " if two else f"install {package} to get it, or " if package else ""
    raise BundleError(
        f"stage '{stage}' targets {settings.provider}, which this host's onnxruntime ({ort.__version__}) does not have; "
        f"available: {', '.join(available)}; {get}use target 'cpu' to run every stage on the CPU instead"
    )


def open_session(module: str | bytes, stage: str, settings: StageSettings, options_for: Callable[[StageSettings], ort.SessionOptions],
                 what: str = "load it") -> ort.InferenceSession:
    """A session on ``settings``' provider, or one error saying why not (see the module's notes).

    Args:
        module: A module's path, or its bytes.
        stage: The stage's name, for errors.
        settings: Its settings (provider, options, fallback).
        options_for: Session options for given settings (called again, with fallback on, to find
            the nodes a provider could not take).
        what: What the session is for, in errors (``"load module 'stage0.onnx'"``).

    Raises:
        BundleError: onnxruntime refused the module or the provider's options, the provider
            cannot take every node while fallback is off, or the session came without the provider.
    """
    provider = settings.provider
    if settings.ep_package is not None:  # a plugin provider: its devices go into the options, not a provider list
        devices = plugin_devices(stage, settings)
        given = options_for

        def options_for(chosen: StageSettings) -> ort.SessionOptions:
            options = given(chosen)
            options.add_provider_for_devices(devices, dict(chosen.provider_options))
            return options

    options = options_for(settings)
    if RECORDS_PLACEMENT:
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    try:
        session = _new_session(module, options, settings)
    except Exception as e:  # onnxruntime raises its own Fail/InvalidArgument/InvalidGraph types
        if not settings.fallback and _FALLBACK_REFUSED in str(e):
            raise BundleError(_not_placed(module, stage, settings, options_for)) from e
        options_given = f" with options {dict(settings.provider_options)}" if settings.provider_options else ""
        raise BundleError(f"stage '{stage}': onnxruntime cannot {what} on {provider}{options_given}: {ort_message(e)}") from e
    if provider not in session.get_providers():
        raise BundleError(
            f"stage '{stage}': onnxruntime made the session without {provider} (it has {', '.join(session.get_providers())}): "
            f"the provider refused its options {dict(settings.provider_options)} or found no device for them; onnxruntime's log says which"
        )
    return session


def _not_placed(module: str | bytes, stage: str, settings: StageSettings, options_for: Callable[[StageSettings], ort.SessionOptions]) -> str:
    """The error for a provider that cannot take every node while fallback is off, naming the nodes."""
    head = f"stage '{stage}': {settings.provider} cannot run every node and fallback is off"
    advice = "; set fallback=on to run them on the CPU, or cut them into a stage of their own with target cpu"
    if not RECORDS_PLACEMENT:
        return f"{head} (this onnxruntime, {ort.__version__}, cannot say which nodes){advice}"
    allowed = settings.replace(fallback=True)
    options = options_for(allowed)
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    try:
        where = placement(_new_session(module, options, allowed)) or {}
    except Exception:  # it cannot be made even so: say what is known
        return f"{head}{advice}"
    left = [node for ep, nodes in where.items() if ep != settings.provider for node in nodes]
    total = sum(len(nodes) for nodes in where.values())
    shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
    return f"{head}: it cannot take {len(left)} of the {total} nodes: {shown}{advice}"


def _new_session(module: str | bytes, options: ort.SessionOptions, settings: StageSettings) -> ort.InferenceSession:
    if settings.ep_package is not None:  # the providers are in the options (add_provider_for_devices)
        return ort.InferenceSession(module, sess_options=options, enable_fallback=0)
    return ort.InferenceSession(module, sess_options=options, providers=settings.providers(), enable_fallback=0)


#: Plugin provider libraries registered in this process: package -> the name it was registered under.
_REGISTERED: dict[str, str] = {}
_REGISTERING = threading.Lock()


def plugin_devices(stage: str, settings: StageSettings) -> list[Any]:
    """The devices a stage's plugin provider offers here (``ep_package``; call only after
    ``check_allowed``): its package imported and its library registered, once per process,
    under the provider's name, and ``get_ep_devices()`` filtered by that name and ``ep_device``.

    Raises:
        BundleError: this onnxruntime cannot load plugin providers (before 1.23), the package is
            not installed or ships no library, onnxruntime refuses the library, or no device
            matches (naming the devices there are).
    """
    package, provider = settings.ep_package, settings.provider
    assert package is not None
    if not hasattr(ort, "register_execution_provider_library"):
        raise BundleError(f"stage '{stage}' runs on the plugin execution provider of package '{package}', which needs onnxruntime 1.23 or later; "
                          f"this host has {ort.__version__}")
    with _REGISTERING:
        if package not in _REGISTERED:
            path = package_library(stage, package, "execution provider library", "onnxruntime_qnn")
            try:
                ort.register_execution_provider_library(provider, path)
            except Exception as e:  # onnxruntime's own types
                why = ort_message(e)
                raise BundleError(f"stage '{stage}': onnxruntime cannot register the execution provider library of package '{package}': {why}") from e
            _REGISTERED[package] = provider
    devices = ort.get_ep_devices()
    kind = None if settings.ep_device is None else getattr(ort.OrtHardwareDeviceType, settings.ep_device.upper())
    chosen = [d for d in devices if d.ep_name == provider and (kind is None or d.device.type == kind)]
    if not chosen:
        listed = ", ".join(f"{d.ep_name} ({d.device.type.name.lower()}, {d.device.vendor})" for d in devices)
        wanted = f"{provider}" + (f" of type {settings.ep_device}" if settings.ep_device else "")
        raise BundleError(f"stage '{stage}': no device of {wanted} here (package '{package}', registered as {_REGISTERED[package]}); "
                          f"get_ep_devices() lists: {listed}")
    return chosen


def placement(session: ort.InferenceSession) -> Placement | None:
    """Provider -> the nodes it took (``"OpType 'name'"``), or ``None`` where onnxruntime cannot tell."""
    if not RECORDS_PLACEMENT:
        return None
    try:
        assigned = session.get_provider_graph_assignment_info()
    except Exception:  # recording was not asked for (a session made elsewhere)
        return None
    nodes: dict[str, list[str]] = {}
    for subgraph in assigned:
        nodes.setdefault(subgraph.ep_name, []).extend(f"{n.op_type} '{n.name}'" if n.name else n.op_type for n in subgraph.get_nodes())
    return {ep: tuple(names) for ep, names in nodes.items()}


def run_options() -> ort.RunOptions:
    """Options for a stage's runs: onnxruntime's own log of a failed run is off (see Note: a run's
    failure is said once), ``gpu_graph_id`` at its default said outright (a run with IOBinding
    reads it: unset, reading it costs 33 us)."""
    options = ort.RunOptions()
    options.log_severity_level = _FATAL_ONLY
    options.add_run_config_entry(*_GRAPH_ID)
    return options


def bound_outputs(binding: ort.IOBinding, first: int) -> list[np.ndarray]:
    """The outputs of the run ``binding`` was bound for, from the ``first`` on, as numpy (on the
    host: views of onnxruntime's buffers, no copy).

    Read from the binding's own vector of values (``IOBinding._iobinding``, onnxruntime's since
    1.4; the public ``get_outputs`` where a version lacks it): ``get_outputs`` wraps every output in
    a Python ``OrtValue`` first, the outputs bound in place too, 98 us a call in a stage of the
    24.7 M Llama (17 outputs, the 16 caches bound in place among them) against 2 us for the vector.
    """
    vector = getattr(binding, "_iobinding", None)
    if vector is None:
        return [v.numpy() for v in binding.get_outputs()[first:]]
    values = vector.get_outputs()
    return [values[i].numpy() for i in range(first, len(values))]
