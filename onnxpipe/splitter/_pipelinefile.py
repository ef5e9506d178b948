"""The pipeline file: a multi-model pipeline with code stages, written down in TOML.

Format ``onnxpipe.pipeline-file``, version 1 (docs/pipelines.md has the full reference)::

    format = "onnxpipe.pipeline-file"
    version = 1
    name = "demo"
    inputs = ["x"]                 # or a table: x = { dtype = "float32", shape = ["N", 4] }
    outputs = ["y"]                # tensors the pipeline returns (names of the pipeline tensors)

    [[stages]]
    name = "head"
    model = "head.onnx"            # relative to this file; with at = [...] or auto = N: split in place
    # dims = { H = 640 }           # with auto / at: sizes of symbolic input dims for profiling or the sample run
    settings = { intra_op_threads = 1 }
    # runs = "first"               # on a stream's first step only (an encoder: docs/streams.md)
    # states = "auto"              # state links of a stateful model (present.N.* -> past_key_values.N.*),
    #                              # or pairs: states = { "state1N" = "state1" } (docs/streams.md)

    [[stages]]
    name = "combine"
    code = "mypkg.post:combine"    # a code stage: entry point, JSON params, typed ports
    params = { factor = 2.0 }
    inputs = [{ name = "h", dtype = "float32", shape = ["N", 4] }]
    outputs = [{ name = "y", dtype = "float32", shape = ["N", 4] }]
    input_map = { h = "h" }        # stage input -> pipeline tensor (default: the same name)
    output_map = { y = "y" }       # stage output -> pipeline tensor (default: the same name)

Note: wiring by tensor names.
    As in a Triton ensemble, every stage output makes a *pipeline tensor* (its own name, or the
    name ``output_map`` gives it), and every stage input reads the pipeline tensor of its own name
    (or the one ``input_map`` names). A tensor is made by one stage or is a pipeline input; a name
    that is neither is one error naming the stage, the port and the tensors there are. A model
    split in place (``at`` cuts, or ``auto`` with a stage count) becomes stages ``<name>_0``,
    ``<name>_1``, ... wired among themselves as the split says; the file sees the model's own
    inputs and outputs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxpipe._errors import ConfigError, closest
from onnxpipe.builder import PipelineConfig, Stage
from onnxpipe.runtime import StageSettings, TensorSpec
from onnxpipe.runtime._spec import RUNS
from onnxpipe.splitter._auto import POLICIES, make_policy
from onnxpipe.splitter._plan import split
from onnxpipe.splitter._states import pair_states, step_branches

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the floor is 3.10, where tomllib is the tomli package
    import tomli as tomllib

__all__ = ["PIPELINE_FILE_FORMAT", "PIPELINE_FILE_VERSION", "is_pipeline_file", "read_pipeline_file"]

PIPELINE_FILE_FORMAT = "onnxpipe.pipeline-file"
PIPELINE_FILE_VERSION = 1
_TOP_KEYS = ("format", "version", "name", "inputs", "outputs", "stages")
_STAGE_KEYS = ("name", "model", "at", "auto", "policy", "dims", "states", "code", "params", "inputs", "outputs", "input_map", "output_map", "settings", "runs")


def is_pipeline_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a pipeline file (a ``.toml`` file)."""
    return Path(path).suffix == ".toml" and Path(path).is_file()


@dataclass
class _Exposed:
    """A stage port the file wires: which stage and port, and the pipeline tensor it makes or reads."""

    stage: Stage
    port: str
    tensor: str


def read_pipeline_file(path: str | os.PathLike[str]) -> PipelineConfig:
    """Read a pipeline file into a wired :class:`~onnxpipe.builder.PipelineConfig`, ready to build.

    Args:
        path: The ``.toml`` file; model paths in it are relative to its folder.

    Returns:
        The config (stages in pipeline order once built).

    Raises:
        ConfigError: not a pipeline file, an unknown key, a bad stage entry, or a wiring mistake
            (one message naming the stage, the port and the valid choices).
        SplitError: a model cannot be split as its ``at`` / ``auto`` say.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read pipeline file '{path}': {e.strerror}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"pipeline file '{path}' is not valid TOML: {e}") from None
    where = f"pipeline file '{path.name}'"
    if data.get("format") != PIPELINE_FILE_FORMAT:
        raise ConfigError(f"{where}: expected format = \"{PIPELINE_FILE_FORMAT}\" and version = {PIPELINE_FILE_VERSION} at the top")
    if data.get("version") != PIPELINE_FILE_VERSION:
        raise ConfigError(f"{where}: version {data.get('version')!r} is not supported; this onnxpipe reads version {PIPELINE_FILE_VERSION}")
    _known(data, _TOP_KEYS, where)
    config = PipelineConfig(_kind(data, "name", str, where, "pipeline"))
    entries = _kind(data, "stages", list, where)
    if not entries:
        raise ConfigError(f"{where}: 'stages' is empty; add [[stages]] tables")
    consumers: list[_Exposed] = []
    producers: dict[str, _Exposed] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: stages[{i}] must be a table")
        ins, outs = _add_stage(config, entry, path.parent, f"{where}: stages[{i}]")
        consumers.extend(ins)
        for out in outs:
            if out.tensor in producers:
                first = producers[out.tensor]
                raise ConfigError(
                    f"{where}: tensor '{out.tensor}' is made by stage '{first.stage.name}' (output '{first.port}') and by stage "
                    f"'{out.stage.name}' (output '{out.port}'); give one another name with output_map"
                )
            producers[out.tensor] = out
    inputs = _declared_inputs(data, where)
    made = sorted(producers)
    for c in consumers:
        source = producers.get(c.tensor)
        if source is not None:
            config.connect(source.stage.output(source.port), c.stage.input(c.port))
        elif c.tensor in inputs:
            spec = inputs[c.tensor]
            if spec is not None:
                config.add_input(spec)
            config.connect(config.input(c.tensor), c.stage.input(c.port))
        else:
            choices = closest(c.tensor, [*made, *inputs])
            raise ConfigError(
                f"{where}: stage '{c.stage.name}' input '{c.port}' reads tensor '{c.tensor}', which no stage makes and which is not "
                f"a pipeline input; {choices} (declare pipeline inputs in 'inputs'; rename with input_map)"
            )
    read = {c.tensor for c in consumers}
    unused = [name for name in inputs if name not in read]
    for name, tensor in _declared_outputs(data, where).items():
        source = producers.get(tensor)
        if source is not None:
            config.connect(source.stage.output(source.port), config.output(name))
        elif tensor in inputs and tensor not in unused:
            config.connect(config.input(tensor), config.output(name))
        else:
            raise ConfigError(f"{where}: pipeline output '{name}' is tensor '{tensor}', which no stage makes; {closest(tensor, made)}")
    if unused:
        raise ConfigError(f"{where}: pipeline input '{unused[0]}' feeds no stage; stage inputs read: {', '.join(sorted(read))}")
    config.to_spec()  # the whole wiring, checked now (cycles, dtypes)
    return config


def _add_stage(config: PipelineConfig, entry: dict[str, Any], folder: Path, where: str) -> tuple[list[_Exposed], list[_Exposed]]:
    """Add one stage entry (one stage, or the pieces of a split model); its exposed inputs and outputs."""
    name = _kind(entry, "name", str, where)
    where = f"{where} ('{name}')"
    _known(entry, _STAGE_KEYS, where)
    kinds = [k for k in ("model", "code") if k in entry]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: a stage has exactly one of 'model' (an .onnx file) or 'code' (an entry point), got {kinds or 'neither'}")
    settings = _settings(entry, where)
    runs = _runs(entry, where)
    before = {s.name for s in config.stages}
    if "code" in entry:
        for key in ("at", "auto", "policy", "dims", "states"):
            if key in entry:
                raise ConfigError(f"{where}: '{key}' is for model stages; a code stage takes code, params, inputs, outputs")
        stage = config.add_python_stage(
            _kind(entry, "code", str, where),
            inputs=_ports(entry, "inputs", where),
            outputs=_ports(entry, "outputs", where),
            params=_kind(entry, "params", dict, where, {}),
            name=name,
            settings=settings,
        )
        ins = [(stage, t.name) for t in stage.inputs]
        outs = [(stage, t.name) for t in stage.outputs]
    else:
        for key in ("params", "inputs", "outputs"):
            if key in entry:
                raise ConfigError(f"{where}: '{key}' is for code stages; a model stage's ports come from its model")
        ins, outs = _model_stage(config, entry, folder / _kind(entry, "model", str, where), name, settings, where)
    for stage in config.stages:
        if stage.name not in before:
            stage.runs = runs  # every piece of a model split in place
    return (
        _mapped(ins, _kind(entry, "input_map", dict, where, {}), "input", where),
        _mapped(outs, _kind(entry, "output_map", dict, where, {}), "output", where),
    )


def _model_stage(
    config: PipelineConfig, entry: dict[str, Any], model: Path, name: str, settings: StageSettings | None, where: str
) -> tuple[list[tuple[Stage, str]], list[tuple[Stage, str]]]:
    """A model as one stage, or split in place into ``<name>_<i>`` stages wired as the split says;
    with ``states``, its state links too (their ports are fed by the links, not wired by the file)."""
    states = _states(entry, where)
    dims = _dims(entry, where)
    if "at" not in entry and "auto" not in entry:
        if "policy" in entry:
            raise ConfigError(f"{where}: 'policy' goes with auto = N (the stage count)")
        if dims:
            raise ConfigError(f"{where}: 'dims' sizes the profile of auto = N or the sample run of at = [...]; this stage is not split")
        stage = config.add_stage(model, name, settings=settings)
        pairs = pair_states(stage.inputs, stage.outputs, states) if states is not None else []
        pairs, flags = step_branches(stage.load_model(), pairs) if pairs else (pairs, {})  # optimum's merged decoder (_states, Note: merged decoders)
        for pair in pairs:
            config.add_state(stage.output(pair.output), stage.input(pair.input), pair.empty_axis, pair.once)
        for flag, first in flags.items():
            config.add_step_flag(stage.input(flag), first)
        fed, kept = {p.input for p in pairs} | set(flags), {p.output for p in pairs}
        return [(stage, t.name) for t in stage.inputs if t.name not in fed], [(stage, t.name) for t in stage.outputs if t.name not in kept]
    if "at" in entry and "auto" in entry:
        raise ConfigError(f"{where}: give 'at' (cuts) or 'auto' (a stage count), not both")
    if not model.is_file():
        raise ConfigError(f"{where}: model '{model}' does not exist")
    if "at" in entry:
        plan = split(model, _cuts(entry["at"], where), states=states, dims=dims or None)
    else:
        count = entry["auto"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{where}: auto must be a stage count >= 1, got {count!r}")
        policy = _kind(entry, "policy", str, where, "measured")
        if policy not in POLICIES:
            raise ConfigError(f"{where}: unknown split policy '{policy}'; valid: {', '.join(POLICIES)}")
        takes = {f.name for f in dataclasses.fields(POLICIES[policy])}
        if dims and "dims" not in takes:
            profiling = [name for name, cls in POLICIES.items() if "dims" in {f.name for f in dataclasses.fields(cls)}]
            raise ConfigError(f"{where}: policy '{policy}' measures nothing, so takes no dims; 'dims' is for policy {' or '.join(repr(p) for p in profiling)}")
        plan = split(model, policy=make_policy(policy, stages=count, **({"dims": dims} if dims else {})), states=states)
    pieces = config.add_split(plan, name, settings=settings)
    ins = [(config.stage(port.endpoint.stage or ""), port.endpoint.tensor) for ports in pieces.inputs.values() for port in ports]
    outs = [(config.stage(port.endpoint.stage or ""), port.endpoint.tensor) for port in pieces.outputs.values()]
    # A split keeps tensor names: a piece's input port is named after the model input feeding it.
    return ins, outs


def _runs(entry: dict[str, Any], where: str) -> str:
    """A stage's ``runs``: ``"every"`` (the default) or ``"first"`` (docs/streams.md)."""
    runs: str = _kind(entry, "runs", str, where, "every")
    if runs not in RUNS:
        raise ConfigError(f"{where}: runs must be one of {', '.join(repr(r) for r in RUNS)}, got {runs!r}")
    return runs


def _dims(entry: dict[str, Any], where: str) -> dict[str, int]:
    """A split stage's ``dims``: symbolic input dim -> size (``{ H = 640, "x.0" = 1 }``)."""
    value = entry.get("dims", {})
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1 for k, v in value.items()):
        raise ConfigError(f"{where}: dims must be a table of symbolic dim names and sizes >= 1, e.g. dims = {{ H = 640, W = 640 }}; got {value!r}")
    return dict(value)


def _states(entry: dict[str, Any], where: str) -> str | dict[str, str] | None:
    """A model stage's ``states``: ``"auto"``, a table output -> input, or None when absent."""
    value = entry.get("states")
    if value is None or value == "auto":
        return value
    if isinstance(value, dict) and value and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ConfigError(f"{where}: states must be \"auto\" or a table of state pairs {{ OUTPUT = \"INPUT\" }}, got {value!r}")


def _mapped(ports: list[tuple[Stage, str]], mapping: Mapping[str, Any], kind: str, where: str) -> list[_Exposed]:
    names = [port for _, port in ports]
    for port, tensor in mapping.items():
        if port not in names:
            raise ConfigError(f"{where}: {kind}_map names {kind} '{port}', which the stage does not have; {closest(port, names)}")
        if not isinstance(tensor, str) or not tensor:
            raise ConfigError(f"{where}: {kind}_map['{port}'] must be the name of a pipeline tensor, got {tensor!r}")
    return [_Exposed(stage, port, mapping.get(port, port)) for stage, port in ports]


def _cuts(value: Any, where: str) -> list[object]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: at must be a non-empty list of cuts: tensor or node names, or lists of tensor names crossing one cut")
    cuts: list[object] = []
    for cut in value:
        if isinstance(cut, str) and cut:
            parts = [p.strip() for p in cut.split(",")]
            cuts.append(parts if len(parts) > 1 else parts[0])
        elif isinstance(cut, list) and cut and all(isinstance(p, str) and p for p in cut):
            cuts.append(list(cut))
        else:
            raise ConfigError(f"{where}: at: {cut!r} is not a cut (a tensor or node name, or a list of tensor names)")
    return cuts


def _ports(entry: dict[str, Any], key: str, where: str) -> list[TensorSpec]:
    ports = []
    for i, item in enumerate(_kind(entry, key, list, where)):
        at = f"{where}: {key}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{at} must be a table {{ name = ..., dtype = ..., shape = [...] }}")
        _known(item, ("name", "dtype", "shape"), at)
        ports.append(TensorSpec(_kind(item, "name", str, at), _kind(item, "dtype", str, at), _shape(_kind(item, "shape", list, at), at)))
    return ports


def _shape(shape: list[Any], where: str) -> tuple[int | str | None, ...]:
    # TOML has no null: a dynamic dim without a name is written "?" (or any name).
    dims: list[int | str | None] = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, str)):
            raise ConfigError(f"{where}: shape entries are sizes or names (\"N\", or \"?\" for any size), got {d!r}")
        dims.append(None if d == "?" else d)
    return tuple(dims)


def _declared_inputs(data: dict[str, Any], where: str) -> dict[str, TensorSpec | None]:
    raw = data.get("inputs")
    if isinstance(raw, list) and all(isinstance(n, str) for n in raw):
        return dict.fromkeys(raw)
    if isinstance(raw, dict):
        out: dict[str, TensorSpec | None] = {}
        for name, spec in raw.items():
            at = f"{where}: inputs.{name}"
            if not isinstance(spec, dict):
                raise ConfigError(f"{at} must be a table {{ dtype = ..., shape = [...] }}")
            _known(spec, ("dtype", "shape"), at)
            out[name] = TensorSpec(name, _kind(spec, "dtype", str, at), _shape(_kind(spec, "shape", list, at), at))
        return out
    raise ConfigError(f"{where}: 'inputs' must list the pipeline inputs: a list of tensor names, or a table name = {{ dtype, shape }}")


def _declared_outputs(data: dict[str, Any], where: str) -> dict[str, str]:
    raw = data.get("outputs")
    if isinstance(raw, list) and raw and all(isinstance(n, str) for n in raw):
        return {n: n for n in raw}
    if isinstance(raw, dict) and raw and all(isinstance(v, str) for v in raw.values()):
        return dict(raw)
    raise ConfigError(f"{where}: 'outputs' must name what the pipeline returns: a list of tensor names, or a table output = \"tensor\"")


def _settings(entry: dict[str, Any], where: str) -> StageSettings | None:
    values = _kind(entry, "settings", dict, where, None)
    if values is None:
        return None
    try:
        return StageSettings.from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"{where}: settings: {e}") from None


def _known(table: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in keys:
            raise ConfigError(f"{where}: unknown key '{key}'; {closest(key, keys)}")


_TOML_NAMES = {str: "a string", list: "a list", dict: "a table", int: "an integer"}


def _kind(table: Mapping[str, Any], key: str, kind: type, where: str, default: Any = ...) -> Any:
    if key not in table:
        if default is ...:
            raise ConfigError(f"{where}: '{key}' is missing")
        return default
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{where}: '{key}' must be {_TOML_NAMES.get(kind, kind.__name__)}, got {value!r}")
    return value

