"""Making a stage's onnxruntime session from its module, settings and build record."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from pathlib import Path

import onnxruntime as ort

from onnxpipe._errors import BundleError
from onnxpipe.runtime._code import custom_ops_library
from onnxpipe.runtime._settings import StageSettings
from onnxpipe.runtime._spec import StageSpec

__all__ = ["load_optimization", "make_session", "maps_archive_data"]


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

    Raises:
        BundleError: the target's provider is not available on this host, or onnxruntime refuses
            the module.
        config: More session config entries (where a module given as bytes finds its external data).
    """
    settings = stage.settings if target is None else stage.settings.replace(target=target, provider_options={})
    available = ort.get_available_providers()
    if settings.provider not in available:
        raise BundleError(
            f"stage '{stage.name}' targets {settings.provider}, which this host's onnxruntime does not have; "
            f"available: {', '.join(available)} (use target 'cpu' to run every stage on the CPU instead)"
        )
    options = settings.session_options(load_optimization(stage, settings))
    for package in settings.custom_ops:  # allowed by the caller (see _code.check_allowed)
        options.register_custom_ops_library(custom_ops_library(stage.name, package))
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    try:
        return ort.InferenceSession(module if isinstance(module, bytes) else str(module), sess_options=options, providers=settings.providers())
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/RuntimeException types
        raise BundleError(f"stage '{stage.name}': onnxruntime cannot load module '{posixpath.basename(stage.module or '')}': {e}") from e
