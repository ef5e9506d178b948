"""Deploy-time settings: what the host that loads a bundle may change in its stages' settings
(``load(..., overrides=...)``, ``onnxpipe serve/run/bench/verify --set``, ``onnxpipe rebundle``).

Note: what a deployment may change.
    A bundle's settings are the builder's wish (see Note: thread and replica caps, in runtime/bundle/_limits.py).
    Some of them only say how this host runs a stage: its threads, its cores, its replicas, how
    large a batch it forms and how long it waits for one, and on which Ray node it lives. A host
    with other cores needs other values (a bundle built with ``affinity=6-7`` cannot start on a
    2-core host), as a Triton user sets ``instance_group`` at deploy time; editing
    ``pipeline.json`` breaks the manifest. Those settings may be overridden: they are the fields of
    :class:`DeploySettings` (:data:`OVERRIDABLE` lists them), so a setting a host may change is
    one declared there. The others, the fields of :class:`BuildSettings`, make the module, or are
    what the build proved about it: the target and its provider options and plugin package (a
    module is optimized for its provider, and the build opened it there), the optimization level
    (a CPU module is saved optimized), custom-op libraries, session config entries, fallback (the
    build proved where the nodes go) and batch pads (the probe checked them). They are refused,
    pointing to ``onnxpipe build``; only the target has a switch of its own, ``load(target=...)``,
    which runs every stage elsewhere.

    Each value is checked by :class:`StageSettings` itself, as the build's ``Stage.configure``
    checks it; the resulting spec is then checked as any bundle's is when it is read (the thread
    and replica caps, ``check_caps``) and when its sessions start (a core the process may not
    use, ``check_cores``): one copy of each check.

Note: max_batch at deploy time.
    The build's batching probe (``builder/_batching.py``) stores what it found in the bundle: a
    :class:`Batching` record per stage that batches (padded and stripped ports, where state is
    padded, and the probe's verdict: batched and alone agree for two requests or streams). It
    stores no largest batch it tried; the stage's ``max_batch`` in the bundle is the most the
    build was asked for and accepted. So an override may lower a stage's ``max_batch`` (1: no
    batching) and raise it again up to the bundle's value, never above it, and a stage without a
    record (built with ``max_batch=1``) may not batch at all: those need ``onnxpipe build``.
    In a pipeline with state, every stage batches or none, as the build requires
    (:func:`check_stream_batching`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeAlias

from onnxpipe._errors import ConfigError, closest
from onnxpipe.runtime._settings import DeploySettings, StageSettings
from onnxpipe.runtime._spec import PipelineSpec, StageSpec

__all__ = ["ALL_STAGES", "OVERRIDABLE", "Overrides", "StageOverrides", "apply_overrides", "as_overrides", "check_stream_batching", "describe_settings",
           "select_stages"]

#: The selector of every stage.
ALL_STAGES = "*"
#: The settings a deployment may change: the fields of :class:`DeploySettings` (see Note: what a deployment may change).
OVERRIDABLE = tuple(f.name for f in fields(DeploySettings))
_SETTINGS = tuple(f.name for f in fields(StageSettings))


@dataclass(frozen=True)
class StageOverrides:
    """Deploy-time settings of some stages of a bundle (see Note: what a deployment may change).

    Attributes:
        stage: Which stages: ``"*"`` for all, a stage name, or a position in pipeline order
            (an ``int``, or its digits).
        settings: :class:`DeploySettings` field -> value (``{"intra_op_threads": 2, "affinity":
            [0, 1]}``); any other :class:`StageSettings` field is a :class:`BuildSettings` one,
            refused.
        origin: Where they were given (``"--set 0:threads=2"``), to begin error messages with;
            empty: nothing.

    Raises:
        ConfigError: an unknown setting (naming the closest), or one that changes the stage's
            module (naming ``onnxpipe build``).
    """

    stage: str | int = ALL_STAGES
    settings: Mapping[str, Any] = field(default_factory=dict)
    origin: str = ""

    def __post_init__(self) -> None:
        prefix = f"{self.origin}: " if self.origin else ""
        if isinstance(self.stage, bool) or not isinstance(self.stage, (str, int)) or (isinstance(self.stage, int) and self.stage < 0) or self.stage == "":
            raise ConfigError(f"{prefix}stage must be '*', a stage name or a position (an integer >= 0), got {self.stage!r}")
        if not isinstance(self.settings, Mapping) or not all(isinstance(k, str) for k in self.settings):
            raise ConfigError(f"{prefix}settings must map setting names to values (e.g. {{'intra_op_threads': 2}}), got {self.settings!r}")
        for key in self.settings:
            if key not in _SETTINGS:
                raise ConfigError(f"{prefix}unknown stage setting '{key}'; {closest(key, OVERRIDABLE)}")
            if key not in OVERRIDABLE:
                how = "run every stage elsewhere with load(target=...) (--target), or rebuild" if key == "target" else "rebuild the stage"
                raise ConfigError(f"{prefix}'{key}' cannot change at deploy time: it makes the stage's module, or is what the build checked about it; "
                                  f"{how} with onnxpipe build. Deploy-time settings: {', '.join(OVERRIDABLE)}")
        object.__setattr__(self, "settings", dict(self.settings))


#: What ``overrides=`` takes: :class:`StageOverrides` applied in order (later wins), or a mapping of
#: selector -> settings as a build's settings file holds them (``{"*": {...}, "head": {...}, "1": {...}}``,
#: ``"*"`` applied first).
Overrides: TypeAlias = StageOverrides | Sequence[StageOverrides] | Mapping[str | int, Mapping[str, Any]]


def as_overrides(value: Overrides | None) -> tuple[StageOverrides, ...]:
    """The :class:`StageOverrides` that ``value`` stands for, in the order they apply.

    Raises:
        ConfigError: ``value`` is neither form, or an entry is malformed.
    """
    if value is None:
        return ()
    if isinstance(value, StageOverrides):
        return (value,)
    if isinstance(value, Mapping):
        entries = sorted(value.items(), key=lambda item: item[0] != ALL_STAGES)
        for selector, settings in entries:
            if not isinstance(settings, Mapping):
                raise ConfigError(f"overrides entry {selector!r} must map setting names to values, got {settings!r}")
        return tuple(StageOverrides(selector, settings) for selector, settings in entries)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(isinstance(o, StageOverrides) for o in value):
        raise ConfigError(f"overrides must be StageOverrides, a list of them, or a mapping {{'*': {{...}}, 'STAGE': {{...}}}}; got {value!r}")
    return tuple(value)


def select_stages(names: Sequence[str], selector: str | int) -> list[int]:
    """The positions of the stages a selector names: ``*``, a stage name, or a position in pipeline order.

    Raises:
        ConfigError: no such stage (naming the valid names and positions).
    """
    if selector == ALL_STAGES:
        return list(range(len(names)))
    if isinstance(selector, str) and selector in names:
        return [names.index(selector)]
    if isinstance(selector, int) or selector.isdigit():
        if int(selector) < len(names):
            return [int(selector)]
        raise ConfigError(f"no stage at position {selector}: the pipeline has {len(names)} stage(s), at positions 0..{len(names) - 1}")
    raise ConfigError(f"no stage '{selector}'; {closest(selector, names)} (or a position 0..{len(names) - 1}, or * for all)")


def apply_overrides(spec: PipelineSpec, overrides: Overrides | None) -> PipelineSpec:
    """``spec`` with its stages' deploy-time settings changed (see the notes above).

    Args:
        spec: A bundle's pipeline (read and validated).
        overrides: What to change, applied in order.

    Returns:
        The changed spec (``spec`` itself when there is nothing to change).

    Raises:
        ConfigError: an unknown stage (naming the valid ones), a setting that may not change at
            deploy time or a bad value (naming the stage), a ``max_batch`` above what the build
            allows (naming the stage and its maximum), or stages of a pipeline with state of
            which some batch and some do not.
    """
    items = as_overrides(overrides)
    if not items:
        return spec
    names = [s.name for s in spec.stages]
    settings = [s.settings for s in spec.stages]
    for item in items:
        prefix = f"{item.origin}: " if item.origin else ""
        try:
            chosen = select_stages(names, item.stage)
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}") from None
        for i in chosen:
            try:
                settings[i] = StageSettings.from_dict({**settings[i].to_dict(), **item.settings})  # as the build's Stage.configure
            except ConfigError as e:
                raise ConfigError(f"{prefix}stage '{names[i]}': {e}") from None
    stages = tuple(dataclasses.replace(s, settings=new) for s, new in zip(spec.stages, settings, strict=True))
    for built, stage in zip(spec.stages, stages, strict=True):
        _check_max_batch(built, stage.settings.max_batch)
    changed = dataclasses.replace(spec, stages=stages)
    check_stream_batching(changed)
    return changed


def _check_max_batch(built: StageSpec, wanted: int) -> None:
    """Refuse a ``max_batch`` above what the bundle's build allows (see Note: max_batch at deploy time)."""
    allowed = built.settings.max_batch if built.batching is not None else 1
    if wanted <= allowed:
        return
    rebuild = f"rebuild with onnxpipe build (--stage {built.name}:max_batch={wanted}), whose probe checks that the stage batches"
    if built.batching is None:
        raise ConfigError(f"stage '{built.name}': max_batch {wanted}: the stage was built without batching, so no probe checked that it can batch; "
                          f"the most it allows is 1; {rebuild}")
    raise ConfigError(f"stage '{built.name}': max_batch {wanted} is above the {allowed} its build accepted (the most it allows); "
                      f"give 1 to {allowed}, or {rebuild}")


def check_stream_batching(spec: PipelineSpec) -> None:
    """In a pipeline with state, every stage batches streams' steps or none does (the build's rule,
    checked again for deploy-time settings).

    Raises:
        ConfigError: naming the stages that do not batch.
    """
    batching = [s for s in spec.stages if s.settings.max_batch > 1]
    alone = [s for s in spec.stages if s.settings.max_batch <= 1]
    if spec.states and batching and alone:
        names = ", ".join(f"'{s.name}'" for s in alone)
        raise ConfigError(
            f"stage(s) {names} of this pipeline with state have max_batch=1: streams' steps are batched once, at the pipeline's entry, "
            "and travel every stage as one batch, so every stage must batch them; set max_batch on every stage (or on none)"
        )


def describe_settings(stage: StageSpec) -> str:
    """A stage's deploy-time settings in one phrase: ``replicas 2, intra_op_threads 1, affinity 0,1, spinning off``."""
    s = stage.settings
    parts = [f"replicas {s.replicas}", f"intra_op_threads {s.intra_op_threads}"]
    if s.execution_mode == "parallel":
        parts.append(f"inter_op_threads {s.inter_op_threads}")
    parts.append("affinity " + (",".join(map(str, s.affinity)) if s.affinity is not None else "none"))
    if s.max_batch > 1:
        parts.append(f"max_batch {s.max_batch}, max_delay_ms {s.max_delay_ms:g}")
    parts.append("spinning " + ("on" if s.spinning else "off"))  # what the sessions run: no session_config key overrules it
    return ", ".join(parts)
