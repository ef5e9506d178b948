"""Per-stage settings on the command line: ``build``'s ``--stage SEL:key=value,...`` and ``--settings
FILE.json``, and the deploy-time ``--set [SEL:]key=value,...`` of ``serve``, ``run``, ``bench``,
``verify``, ``inspect`` and ``rebundle``: one syntax and one vocabulary of keys for both.

Parsing is plain Python, so that ``onnxpipe --help`` imports nothing heavy; the values themselves are
checked by :class:`~onnxpipe.runtime.StageSettings` when they are applied to a stage (at build time
by ``Stage.configure``, at deploy time by ``onnxpipe.runtime`` as it reads the bundle), and any
:class:`ConfigError` is re-raised with the option or file entry that caused it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from onnxpipe._errors import ConfigError
from onnxpipe.cli._common import read_json

if TYPE_CHECKING:
    from onnxpipe.builder import PipelineConfig, Stage
    from onnxpipe.runtime import StageOverrides

__all__ = ["STAGE_KEYS", "StageOption", "StageOptionType", "apply", "deploy_overrides", "format_cores", "parse_cores", "read_settings_file"]

ALL = "*"
_SWITCHES = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def _text(value: str) -> str:
    if not value:
        raise ValueError("needs a value")
    return value


def _count(value: str) -> int:
    try:
        if not value.isascii():  # int() reads '٣' as 3
            raise ValueError
        return int(value)
    except ValueError:
        raise ValueError(f"must be an integer, got {value!r}") from None


def _millis(value: str) -> float:
    try:
        return float(value.removesuffix("ms"))
    except ValueError:
        raise ValueError(f"must be a number of milliseconds, got {value!r}") from None


def _host(value: str) -> str | None:
    return None if value.lower() in ("", "any", "none") else value


def _switch(value: str) -> bool:
    try:
        return _SWITCHES[value.lower()]
    except KeyError:
        raise ValueError(f"must be on or off (or true/false, 1/0), got {value!r}") from None


def parse_cores(value: str) -> tuple[int, ...] | None:
    """``0`` -> (0,); ``0-3`` -> (0, 1, 2, 3); ``0+2+5`` -> (0, 2, 5); ``1-2+6``; ``none`` -> None.

    Every number is checked against the largest core number (``MAX_CORES``) before a range is
    expanded, and repeats are found in one pass: ``0-1000000`` is refused at once.

    Raises:
        ValueError: a malformed list (digits are ASCII 0-9), a core past the largest, a range going
            down, or a core given twice.
    """
    from onnxpipe.runtime._settings import MAX_CORES, listed_cores  # the runtime's bound, for build's --stage and deploy's --set alike

    if value.lower() == "none":
        return None
    cores: list[int] = []
    seen: set[int] = set()
    repeated: set[int] = set()
    for item in value.split("+"):
        first, dash, last = item.partition("-")
        if not _ascii_digits(first) or (dash and not _ascii_digits(last)):
            raise ValueError(f"{value!r} is not a core list: give cores as 0, 0-3 or 0+2+5 (or none), in the digits 0-9")
        low, high = int(first), int(last) if dash else int(first)
        if high >= MAX_CORES:
            raise ValueError(f"core {high} in {value!r} is past the largest core number, {MAX_CORES - 1} (Linux's most CPUs)")
        if high < low:
            raise ValueError(f"range {item!r} goes down; write {high}-{low}")
        for core in range(low, high + 1):
            (repeated if core in seen else seen).add(core)
            cores.append(core)
    if repeated:
        raise ValueError(f"{value!r} names core(s) {listed_cores(sorted(repeated))} more than once")
    return tuple(cores)


def _ascii_digits(text: str) -> bool:
    """Digits as a core number is written: ``str.isdigit`` takes '²' and '٣' too, which ``int`` refuses or misreads."""
    return text.isascii() and text.isdigit()


def format_cores(cores: Iterable[int] | None) -> str:
    """The inverse of :func:`parse_cores`: (0, 1, 2, 5) -> ``0-2+5``; None -> ``any``."""
    if cores is None:
        return "any"
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return "+".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


#: Key on the command line -> (StageSettings field, parser of the value).
STAGE_KEYS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "target": ("target", _text),
    "provider": ("target", _text),
    "threads": ("intra_op_threads", _count),
    "inter-threads": ("inter_op_threads", _count),
    "mode": ("execution_mode", _text),
    "spinning": ("spinning", _switch),
    "affinity": ("affinity", parse_cores),
    "opt": ("optimization", _text),
    "fallback": ("fallback", _switch),
    "replicas": ("replicas", _count),
    "host": ("host", _host),
    "max_batch": ("max_batch", _count),
    "max_delay_ms": ("max_delay_ms", _millis),
    "ep_package": ("ep_package", _text),
    "ep_device": ("ep_device", _text),
}
#: ``--stage 0:ep.precision=FP32``: a key with this prefix sets one of the provider's options.
EP_PREFIX = "ep."


def _valid_keys() -> str:
    """The keys for a message, each setting once with its other names: ``target (or provider), threads, ...``."""
    names: dict[str, list[str]] = {}
    for key, (name, _) in STAGE_KEYS.items():
        names.setdefault(name, []).append(key)
    listed = [first + "".join(f" (or {other})" for other in others) for first, *others in names.values()]
    return f"{', '.join(listed)}, and {EP_PREFIX}OPTION for a provider option ({EP_PREFIX}precision=FP32)"


_VALID_KEYS = _valid_keys()


@dataclass(frozen=True)
class StageOption:
    """One ``--stage`` value: which stages, and the StageSettings fields to change."""

    selector: str
    changes: Mapping[str, Any]
    text: str


class StageOptionType(click.ParamType):
    """``SEL:key=value[,key=value...]``; a malformed value is a usage error naming the valid keys.

    Args:
        selector_optional: ``SEL:`` may be left out, meaning every stage (``--set replicas=2``).
    """

    name = "SEL:KEY=VALUE[,...]"

    def __init__(self, selector_optional: bool = False) -> None:
        self.selector_optional = selector_optional
        if selector_optional:
            self.name = "[SEL:]KEY=VALUE[,...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> StageOption:
        if isinstance(value, StageOption):
            return value
        text = str(value)
        # The selector ends at the last ':' before the first '=': targets such as cuda:1 hold a ':' too.
        head = text.partition("=")[0]
        selector, colon, _ = head.rpartition(":")
        body = text[len(selector) + 1 :]
        if not colon and self.selector_optional and "=" in text:
            selector, colon, body = ALL, ":", text
        if not colon or not selector or "=" not in text:
            sel = "[SEL:]" if self.selector_optional else "SEL:"
            self.fail(f"{text!r} is not {sel}key=value[,key=value...] (SEL: stage position, name or *; e.g. 0:threads=2,affinity=0-1)", param, ctx)
        changes: dict[str, Any] = {}
        previous = ""
        for item in body.split(","):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq:
                hint = "; ',' separates keys, so join cores with '+' (affinity=0+1)" if previous == "affinity" else ""
                self.fail(f"{item!r} in {text!r} is not key=value{hint}", param, ctx)
            if key.startswith(EP_PREFIX):  # one provider option: ep.precision=FP32
                option = key[len(EP_PREFIX) :]
                options = changes.setdefault("provider_options", {})
                if not option or option in options:
                    self.fail(f"{key!r} in {text!r}: " + ("name the provider option after 'ep.' (e.g. ep.precision=FP32)" if not option else "given twice"),
                              param, ctx)
                options[option] = raw.strip()
                previous = key
                continue
            if key not in STAGE_KEYS:
                self.fail(f"unknown key {key!r} in {text!r}; valid keys: {_VALID_KEYS}", param, ctx)
            field, parse = STAGE_KEYS[key]
            if field in changes:
                self.fail(f"{key!r} is given twice in {text!r}", param, ctx)
            try:
                changes[field] = parse(raw.strip())
            except ValueError as e:
                self.fail(f"{key}={raw.strip()} in {text!r}: {e}", param, ctx)
            previous = key
        return StageOption(selector, changes, text)


def select(config: PipelineConfig, selector: str) -> list[Stage]:
    """The stages a selector names: ``*``, a stage name, or a position in pipeline order.

    Raises:
        ConfigError: no such stage (naming the valid names and positions).
    """
    from onnxpipe.runtime._overrides import select_stages  # what a selector means, at build and deploy time alike

    stages = list(config.stages)
    return [stages[i] for i in select_stages([s.name for s in stages], selector)]


def apply(config: PipelineConfig, selector: str, changes: Mapping[str, Any], origin: str) -> None:
    """Change the settings of the selected stages; errors name ``origin`` (the option or file entry).

    Raises:
        ConfigError: an unknown selector, an unknown setting or a bad value.
    """
    try:
        stages = select(config, selector)
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from e
    for stage in stages:
        given = changes
        if "provider_options" in changes:  # ep.KEY=VALUE adds to the stage's options, it does not replace them
            given = {**changes, "provider_options": {**stage.settings.provider_options, **changes["provider_options"]}}
        try:
            stage.configure(**given)
        except ConfigError as e:
            raise ConfigError(f"{origin}: {e}") from e


def deploy_overrides(options: Iterable[StageOption], flag: str = "--set") -> tuple[StageOverrides, ...]:
    """The runtime's deploy-time settings for ``--set`` values, each naming its option in errors.

    Raises:
        ConfigError: a key that cannot change at deploy time (it makes the stage's module), naming
            the option; values and stage names are checked as the bundle is read.
    """
    from onnxpipe.runtime import StageOverrides

    return tuple(StageOverrides(o.selector, o.changes, origin=f"{flag} {o.text}") for o in options)


def read_settings_file(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The ``(selector, StageSettings fields)`` entries of a settings file, ``*`` first.

    Raises:
        ConfigError: the file is missing, not JSON, or not an object of objects.
    """
    data = read_json(path, "settings file")
    shape = 'a JSON object {"*": {...}, "stage0": {...}, "1": {...}} of stage settings'
    if not isinstance(data, dict):
        raise ConfigError(f"settings file '{path}' must hold {shape}, got {type(data).__name__}")
    for selector, settings in data.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"settings file '{path}': entry '{selector}' must be an object of stage settings, got {type(settings).__name__}")
    return sorted(data.items(), key=lambda item: item[0] != ALL)
