"""PipelineConfig: the one authoring object for pipelines.

Stages come from .onnx files or in-memory models, or are Python code named by entry point
(:meth:`PipelineConfig.add_python_stage`); ports are connected TVM-style::

    config = PipelineConfig()
    s0 = config.add_stage("stage0.onnx")
    s1 = config.add_stage(model1, name="head")
    config.input("data").connect(s0.input("data"))
    s0.output("features").connect(s1.input("features"))
    s1.output("prob").connect(config.output("prob"))

A stage output that feeds the same stage's input on a stream's next step (a recurrent state, a KV
cache) is a *state link*, stated with :meth:`PipelineConfig.add_state`; the pipeline feeds such
inputs itself, so they are not pipeline inputs (docs/streams.md).

A global input or output that is connected before it was declared takes the dtype and shape of the
stage port it is connected to. Every connect is checked at once (direction, self-links, dtype and
shape); :meth:`PipelineConfig.to_spec` checks the whole (every input fed once, acyclic) and lists the
stages in pipeline order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto

from onnxpipe._errors import ConfigError, closest
from onnxpipe.builder._modules import io_specs, save_model, weight_specs
from onnxpipe.builder._wiring import Wiring
from onnxpipe.runtime import CodeSpec, Endpoint, Link, ParamGroup, PipelineSpec, StageSettings, StageSpec, StateLink, StepFlag, TensorSpec
from onnxpipe.runtime._spec import RUNS, check_entry_point, check_state_ends, find_tensor

__all__ = ["CONFIG_FILE", "PipelineConfig", "Port", "SplitPieces", "Stage"]

#: Name of the wiring file inside a split or config folder.
CONFIG_FILE = "pipeline.json"


@dataclass
class Stage:
    """A stage of a :class:`PipelineConfig`: its module and its boundary.

    Attributes:
        name: Unique name in the config.
        model: The module in memory, or ``None`` when it is only a file.
        path: The module file, or ``None`` until an in-memory module is saved.
        source_dir: Folder that the in-memory model's external-data references are relative to.
        inputs: Inputs the stage must be fed.
        outputs: Outputs the stage produces.
        weights: The module's initializers (name -> spec): what a parameter group may name.
        settings: How the stage's session is made (see :class:`StageSettings`).
        build: What the builder did to the module (empty until built).
        code: For a code stage, its entry point and parameters (then ``model`` and ``path`` are ``None``).
        runs: When it runs in a stream: ``"every"`` step, or the ``"first"`` only (an encoder; see
            ``PipelineSpec``'s Note: first-step stages, docs/streams.md).
    """

    config: PipelineConfig
    name: str
    model: ModelProto | None
    path: Path | None
    source_dir: Path | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights: dict[str, TensorSpec] = field(default_factory=dict)
    settings: StageSettings = field(default_factory=StageSettings)
    build: dict[str, Any] = field(default_factory=dict)
    code: CodeSpec | None = None
    runs: str = "every"

    @property
    def is_code(self) -> bool:
        """Whether the stage runs a Python callable rather than an ONNX module (as
        :attr:`StageSpec.is_code`; code that goes on to read ``code`` tests ``code is not None``)."""
        return self.code is not None

    def configure(self, **changes: Any) -> Stage:
        """Change some settings (``target``, ``intra_op_threads``, ``affinity``, ...); returns the stage.

        Raises:
            ConfigError: an unknown setting or a bad value, named.
        """
        try:
            self.settings = StageSettings.from_dict({**self.settings.to_dict(), **changes})
        except ConfigError as e:
            raise ConfigError(f"stage '{self.name}': {e}") from None
        return self

    def load_model(self) -> ModelProto:
        """The module (weights left in external files, if any)."""
        if self.code is not None:
            raise ConfigError(f"stage '{self.name}' is a code stage ('{self.code.entry}'); it has no module")
        if self.model is not None:
            return self.model
        assert self.path is not None
        return onnx.load(self.path, load_external_data=False)

    def input(self, name: str) -> Port:
        """The port of the stage input ``name``."""
        find_tensor(self.inputs, name, f"stage '{self.name}' has no input")
        return Port(self.config, Endpoint(self.name, name), is_source=False)

    def output(self, name: str) -> Port:
        """The port of the stage output ``name``."""
        find_tensor(self.outputs, name, f"stage '{self.name}' has no output")
        return Port(self.config, Endpoint(self.name, name), is_source=True)


@dataclass(frozen=True)
class Port:
    """A connectable end: a global input, a stage output (sources), a stage input or a global output."""

    config: PipelineConfig
    endpoint: Endpoint
    is_source: bool

    def connect(self, other: Port) -> Port:
        """Connect this source to ``other`` (a destination); returns ``other`` for chaining."""
        self.config.connect(self, other)
        return other

    def __str__(self) -> str:
        return str(self.endpoint)


@dataclass(frozen=True)
class SplitPieces:
    """The stages :meth:`PipelineConfig.add_split` added, and the ports of the split model's own
    inputs and outputs (a split keeps tensor names: they are the model's).

    Attributes:
        stages: The pieces, in pipeline order.
        inputs: Model input -> the pieces' input ports that read it (several where more than one
            piece reads it).
        outputs: Model output -> the piece's output port that makes it.
    """

    stages: tuple[Stage, ...]
    inputs: Mapping[str, tuple[Port, ...]]
    outputs: Mapping[str, Port]

    def input(self, name: str) -> Port:
        """The one piece input that reads model input ``name`` (use :meth:`feed` when several do).

        Raises:
            ConfigError: no piece reads it, or several do.
        """
        ports = self.inputs.get(name)
        if not ports:
            raise ConfigError(f"the split model has no input '{name}'; {closest(name, self.inputs)}")
        if len(ports) > 1:
            readers = ", ".join(str(p) for p in ports)
            raise ConfigError(f"model input '{name}' is read by {len(ports)} pieces ({readers}): connect it with pieces.feed('{name}', source)")
        return ports[0]

    def output(self, name: str) -> Port:
        """The piece output that makes model output ``name``.

        Raises:
            ConfigError: the model has no such output.
        """
        if name not in self.outputs:
            raise ConfigError(f"the split model has no output '{name}'; {closest(name, self.outputs)}")
        return self.outputs[name]

    def feed(self, name: str, source: Port) -> None:
        """Connect ``source`` (a pipeline input or a stage output) to every piece that reads model input ``name``."""
        ports = self.inputs.get(name)
        if not ports:
            raise ConfigError(f"the split model has no input '{name}'; {closest(name, self.inputs)}")
        for port in ports:
            source.connect(port)


class PipelineConfig:
    """Stages, global inputs and outputs, and the links between them.

    Args:
        name: A name for the pipeline, kept in the spec's metadata.
    """

    def __init__(self, name: str = "pipeline") -> None:
        self.name = name
        self.metadata: dict[str, str] = {}
        self._stages: dict[str, Stage] = {}
        self._inputs: dict[str, TensorSpec] = {}
        self._outputs: dict[str, TensorSpec] = {}
        self._groups: dict[str, ParamGroup] = {}
        self._wiring = Wiring()

    # -- building up -------------------------------------------------------------------------------

    def add_stage(
        self,
        model: ModelProto | str | os.PathLike[str],
        name: str | None = None,
        *,
        settings: StageSettings | None = None,
        source_dir: str | os.PathLike[str] | None = None, runs: str = "every",
    ) -> Stage:
        """Add a stage from a ModelProto or an .onnx file.

        Args:
            model: The stage module, in memory or as a path.
            name: Unique stage name (default ``stage<N>``).
            settings: Session settings (default :class:`StageSettings`: CPU, 1 thread, no spinning).
            source_dir: For an in-memory model with external-data references: their folder.
            runs: ``"every"`` step of a stream, or ``"first"`` only (an encoder: docs/streams.md).

        Returns:
            The stage, whose :meth:`Stage.input` / :meth:`Stage.output` give connectable ports.

        Raises:
            ConfigError: duplicate name, unreadable file, or a boundary value that is not a tensor.
        """
        name = self._new_name(name)
        stage = self._stages[name] = _module_stage(self, name, model, settings, source_dir, _runs(runs, name))
        return stage

    def add_python_stage(
        self,
        entry: str,
        *,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        params: Mapping[str, Any] | None = None,
        name: str | None = None,
        settings: StageSettings | None = None,
    ) -> Stage:
        """Add a code stage: a Python callable named by import path, with typed ports.

        The callable is ``fn(inputs: dict[str, np.ndarray], params: dict[str, Any]) ->
        Mapping[str, np.ndarray]``, called once per request with the stage's inputs by name and
        ``params``; it must return exactly ``outputs``, each of the declared dtype and rank (fixed
        dims exact, symbolic dims any size, the same in every tensor naming them). Nothing is
        imported here, and the bundle stores only the entry point and the params: the code must be
        installed on the deployment host, which runs it only if allowed
        (``runtime.load(..., allow_code=["mypkg.*"])``, docs/pipelines.md).

        Args:
            entry: ``"pkg.module:qualname"``.
            inputs: The stage's inputs, each with a dtype and a shape (ints, symbolic names, ``None``).
            outputs: The stage's outputs, likewise.
            params: Plain JSON values given to every call (default ``{}``).
            name: Unique stage name (default ``stage<N>``).
            settings: Stage settings; for a code stage only ``replicas`` (and ``affinity`` of its
                worker thread) matter.

        Returns:
            The stage, whose :meth:`Stage.input` / :meth:`Stage.output` give connectable ports.

        Raises:
            ConfigError: malformed entry point, duplicate name, ports without shapes or with
                unknown dtypes, or params that are not plain JSON.
        """
        name = self._new_name(name)
        stage = self._stages[name] = _code_stage(self, name, entry, inputs, outputs, params, settings)
        return stage

    def add_input(self, spec: TensorSpec) -> Port:
        """Declare a global input; returns its port."""
        return self._declare(self._inputs, spec, "pipeline input", is_source=True)

    def add_output(self, spec: TensorSpec) -> Port:
        """Declare a global output; returns its port."""
        return self._declare(self._outputs, spec, "pipeline output", is_source=False)

    def add_param_group(self, name: str, stage: Stage | str, params: list[str] | None = None) -> ParamGroup:
        """Name some of a stage's initializers as weights a user may swap at run time (``set_params``).

        The builder lists them as graph inputs of the module, which makes them onnxruntime
        *overridable initializers*: their stored values are the defaults, and a request may feed
        others. onnxruntime does not constant-fold overridable initializers, so a group costs the
        optimizations that would have folded them (Conv + BatchNormalization fusion, say).

        Args:
            name: The group's name.
            stage: The stage (or its name) whose initializers these are.
            params: Initializer names (default: all of the stage's initializers).

        Raises:
            ConfigError: duplicate group, unknown initializer (with the closest names), a stage with
                no initializers.
        """
        target = stage if isinstance(stage, Stage) else self.stage(stage)
        if name in self._groups:
            raise ConfigError(f"duplicate param group '{name}'")
        names = list(target.weights) if params is None else list(params)
        if not names:
            raise ConfigError(f"stage '{target.name}' has no initializers to put in param group '{name}'")
        specs = tuple(find_tensor(target.weights.values(), n, f"stage '{target.name}' has no initializer") for n in names)
        group = self._groups[name] = ParamGroup(name, target.name, specs)
        return group

    def add_split(self, split: Any, name: str, *, settings: StageSettings | None = None) -> SplitPieces:
        """Add a model split into stages (a ``SplitPlan``, or any object whose ``config`` is a
        :class:`PipelineConfig` of model stages): its stages become ``<name>_0``, ``<name>_1``, ...,
        wired among themselves as the split says, with its state links; what the whole model reads
        and makes is left for the caller to wire through the returned :class:`SplitPieces`.

        Args:
            split: The split (``onnxpipe.splitter.split(model, cuts)``).
            name: The prefix of the pieces' names.
            settings: Session settings for every piece (default: each piece's own).

        Returns:
            The pieces: ``pieces.input("x")`` / ``pieces.output("y")`` are the ports of the model's
            own input and output, ``pieces.feed("x", source)`` connects a source to every piece
            that reads ``x``.

        Raises:
            ConfigError: a piece's name is taken, or the split holds code stages.
        """
        inner: PipelineConfig = getattr(split, "config", split)
        if not isinstance(inner, PipelineConfig):
            raise ConfigError(f"add_split takes a SplitPlan (onnxpipe.splitter.split) or a PipelineConfig, not {type(split).__name__}")
        return _add_pieces(self, inner, name, settings)

    def add_state(self, output: Port, input: Port, empty_axis: int | None = None, once: bool = False) -> StateLink:
        """State that a stage output feeds the same stage's input on the stream's next step.

        On a stream's first step the input is fed zeros (see ``StateLink``'s Note: initial values),
        empty along ``empty_axis`` if given (as a decoder's first step feeds an empty past).

        Args:
            output: The stage output holding the new state (``stage.output("present.0.key")``).
            input: The same stage's input it feeds (``stage.input("past_key_values.0.key")``).
            empty_axis: The axis along which the initial state is empty.
            once: The first step's output is kept and fed on every later step (``StateLink``'s
                Note: a state set once: an encoder's KV in optimum's merged decoder).

        Returns:
            The state link.

        Raises:
            ConfigError: the ports are not an output and an input of one stage, the input is
                already fed, or dtypes, ranks or the initial value's sizes do not fit (named).
        """
        _check_state_ports(output, input)
        stage = self.stage(output.endpoint.stage or "")
        link = StateLink(stage.name, output.endpoint.tensor, input.endpoint.tensor, empty_axis, once=once)
        self._wiring.check_free(input.endpoint, f"state link {link}: {input}")
        check_state_ends(link, stage.inputs, stage.outputs)
        self._wiring.add_state(link)
        return link

    def add_step_flag(self, input: Port, first: bool = False) -> StepFlag:
        """A stage input the runtime feeds by a stream's step: ``first`` on its first step, ``not
        first`` after (``StepFlag``: optimum's ``use_cache_branch``); the spec checks the rest.

        Raises:
            ConfigError: the port is not a stage input, or it is already fed.
        """
        return _add_flag(self._wiring, input, first)

    @property
    def states(self) -> tuple[StateLink, ...]:
        """The state links, in the order they were added."""
        return tuple(self._wiring.states.values())

    @property
    def param_groups(self) -> tuple[ParamGroup, ...]:
        """The parameter groups, in the order they were added."""
        return tuple(self._groups.values())

    def _declare(self, table: dict[str, TensorSpec], spec: TensorSpec, what: str, is_source: bool) -> Port:
        if spec.name in table and table[spec.name] != spec:
            raise ConfigError(f"{what} '{spec.name}' is already declared as {table[spec.name]}")
        table[spec.name] = spec
        return Port(self, Endpoint(None, spec.name), is_source)

    def _new_name(self, name: str | None) -> str:
        """``name``, or the next ``stage<N>``; refused when a stage has it."""
        name = name if name is not None else f"stage{len(self._stages)}"
        if name in self._stages:
            raise ConfigError(f"duplicate stage name '{name}'; taken: {', '.join(self._stages)}")
        return name

    def stage(self, name: str) -> Stage:
        """The stage named ``name``."""
        try:
            return self._stages[name]
        except KeyError:
            raise ConfigError(f"no stage '{name}'; {closest(name, self._stages)}") from None

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Stages in the order they were added."""
        return tuple(self._stages.values())

    def input(self, name: str) -> Port:
        """The port of global input ``name`` (declared on first connect if new)."""
        return Port(self, Endpoint(None, name), is_source=True)

    def output(self, name: str) -> Port:
        """The port of global output ``name`` (declared on first connect if new)."""
        return Port(self, Endpoint(None, name), is_source=False)

    def connect(self, src: Port, dst: Port) -> None:
        """Link a source (global input or stage output) to a destination (stage input or global output).

        Raises:
            ConfigError: wrong direction, self-link, incompatible dtype or shape, or the destination
                is already fed.
        """
        if not src.is_source:
            raise ConfigError(f"cannot connect from {src}: a link starts at a pipeline input or a stage output")
        if dst.is_source:
            raise ConfigError(f"cannot connect to {dst}: a link ends at a stage input or a pipeline output")
        if src.endpoint.stage is None and dst.endpoint.stage is None:
            pass  # a pipeline input handed straight back as an output: allowed
        elif src.endpoint.stage is not None and src.endpoint.stage == dst.endpoint.stage:
            raise ConfigError(f"cannot connect {src} to {dst}: a stage cannot feed itself")
        self._wiring.check_free(dst.endpoint, str(dst))
        src_spec = self._spec_of(src)
        dst_spec = self._spec_of(dst)
        if src_spec is None and dst_spec is None:
            raise ConfigError(f"cannot connect {src} to {dst}: declare one of them with add_input/add_output first")
        if src_spec is None:
            assert dst_spec is not None
            src_spec = self._inputs[src.endpoint.tensor] = TensorSpec(src.endpoint.tensor, dst_spec.dtype, dst_spec.shape)
        if dst_spec is None:
            dst_spec = self._outputs[dst.endpoint.tensor] = TensorSpec(dst.endpoint.tensor, src_spec.dtype, src_spec.shape)
        reason = src_spec.mismatch(dst_spec)
        if reason:
            raise ConfigError(f"cannot connect {src} to {dst}: {reason}")
        self._wiring.add_link(Link(src.endpoint, dst.endpoint))

    def _spec_of(self, port: Port) -> TensorSpec | None:
        ep = port.endpoint
        if ep.stage is None:
            return (self._inputs if port.is_source else self._outputs).get(ep.tensor)
        stage = self.stage(ep.stage)
        if port.is_source:
            return find_tensor(stage.outputs, ep.tensor, f"stage '{stage.name}' has no output")
        return find_tensor(stage.inputs, ep.tensor, f"stage '{stage.name}' has no input")

    # -- the spec and files ------------------------------------------------------------------------

    def to_spec(self, modules: dict[str, str] | None = None) -> PipelineSpec:
        """The validated :class:`PipelineSpec`, stages in pipeline (topological) order.

        Args:
            modules: Module path per stage name, relative to where the spec will live (default: the
                stage's file path, or ``<name>.onnx`` for in-memory stages).

        Raises:
            ConfigError: the wiring is incomplete or cyclic (the message says where).
        """
        modules = modules or {}
        order = self._ordered()
        stages = tuple(
            StageSpec(
                name=s.name,
                module=None if s.is_code else modules.get(s.name) or (s.path.as_posix() if s.path else f"{s.name}.onnx"),
                inputs=s.inputs,
                outputs=s.outputs,
                settings=s.settings,
                build=dict(s.build),
                code=s.code, runs=s.runs,
            )
            for s in order
        )
        spec = PipelineSpec(
            inputs=tuple(self._inputs.values()),
            outputs=tuple(self._outputs.values()),
            stages=stages,
            links=tuple(self._wiring.links.values()),
            metadata={"name": self.name, **self.metadata},
            param_groups=tuple(self._groups.values()),
            states=tuple(self._wiring.states.values()),
            step_flags=tuple(self._wiring.flags.values()),
        )
        spec.validate()
        return spec

    def _ordered(self) -> list[Stage]:
        """The stages in pipeline order (stable: ties keep the order they were added in)."""
        return [self._stages[n] for n in self._wiring.order(list(self._stages))]

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the wiring (``pipeline.json``) and every in-memory stage module into ``directory``.

        File stages are referred to by a path relative to ``directory``.

        Returns:
            The path of the wiring file.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        modules: dict[str, str] = {}
        for s in self._stages.values():
            if s.is_code:
                continue  # nothing to write: the entry point and params are in the spec
            if s.model is not None:
                save_model(s.model, directory / f"{s.name}.onnx", s.source_dir)
                modules[s.name] = f"{s.name}.onnx"
            else:
                assert s.path is not None
                modules[s.name] = Path(os.path.relpath(s.path.resolve(), directory.resolve())).as_posix()
        spec = self.to_spec(modules)
        out = directory / CONFIG_FILE
        out.write_text(spec.to_json())
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PipelineConfig:
        """Read a config folder (or its ``pipeline.json``) written by :meth:`save` or the splitter."""
        path = Path(path)
        file = path / CONFIG_FILE if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"'{path}' is not a split or config folder: it has no {CONFIG_FILE}")
        try:
            text = file.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read pipeline config '{file}': {e.strerror}") from e
        return cls.from_spec(PipelineSpec.from_json(text), file.parent)

    @classmethod
    def from_spec(cls, spec: PipelineSpec, base_dir: str | os.PathLike[str]) -> PipelineConfig:
        """A config with the spec's stages (as files under ``base_dir``) and links."""
        spec.validate()
        config = cls(spec.metadata.get("name", "pipeline"))
        config.metadata = {k: v for k, v in spec.metadata.items() if k != "name"}
        for t in spec.inputs:
            config.add_input(t)
        for t in spec.outputs:
            config.add_output(t)
        for s in spec.stages:
            if s.code is not None:
                stage = config.add_python_stage(s.code.entry, inputs=s.inputs, outputs=s.outputs, params=s.code.params, name=s.name, settings=s.settings)
                stage.build, stage.runs = dict(s.build), s.runs
                continue
            assert s.module is not None
            stage = config.add_stage(Path(base_dir) / s.module, s.name, settings=s.settings, runs=s.runs)
            stage.build = dict(s.build)
            if (stage.inputs, stage.outputs) != (s.inputs, s.outputs):
                raise ConfigError(f"stage '{s.name}': module '{s.module}' does not match the boundary in the config")
        for link in spec.links:
            config._wiring.add_link(link)
        for group in spec.param_groups:
            config.add_param_group(group.name, group.stage, [t.name for t in group.params])
        for state in spec.states:
            config._wiring.add_state(state)
        config._wiring.flags = {Endpoint(f.stage, f.input): f for f in spec.step_flags}
        return config

    # -- display -----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Stage]:
        return iter(self._stages.values())

    def __repr__(self) -> str:
        return f"PipelineConfig({self.name!r}, stages={list(self._stages)}, links={len(self._wiring.links)})"

    def __str__(self) -> str:
        lines = [f"pipeline '{self.name}'"]
        lines.append("  inputs:  " + ", ".join(str(t) for t in self._inputs.values()))
        lines.append("  outputs: " + ", ".join(str(t) for t in self._outputs.values()))
        targets = self._wiring.targets()
        for s in self._ordered():
            what = f"code {s.code.entry}" if s.code else s.path.name if s.path else "in memory"
            lines.append(f"  stage '{s.name}' ({what}; {_describe(s.settings)}{'; runs on the first step only' if s.runs == 'first' else ''})")
            lines.extend(f"    in  {t}  <- {self._wiring.feed(Endpoint(s.name, t.name))}" for t in s.inputs)
            for t in s.outputs:
                lines.append(f"    out {t}  -> {', '.join(str(d) for d in targets.get(Endpoint(s.name, t.name), [])) or 'unused'}")
        lines.extend(f"  {lk}" for lk in self._wiring.direct())
        lines.extend(f"  param group '{g.name}' -> stage '{g.stage}': {', '.join(t.name for t in g.params)}" for g in self._groups.values())
        return "\n".join(lines)

    def to_json(self) -> str:
        """The wiring as JSON (module paths as :meth:`to_spec` gives them)."""
        return json.dumps(self.to_spec().to_dict(), indent=2)


def _runs(runs: object, name: str) -> str:
    """A stage's ``runs``, checked where it is given."""
    if runs not in RUNS:
        raise ConfigError(f"stage '{name}': runs must be one of {', '.join(repr(r) for r in RUNS)}, got {runs!r}")
    return str(runs)


def _describe(settings: StageSettings) -> str:
    parts = [settings.target, f"{settings.intra_op_threads} thread{'s' if settings.intra_op_threads != 1 else ''}"]
    if settings.affinity is not None:
        parts.append(f"cores {','.join(map(str, settings.affinity))}")
    if settings.replicas > 1:
        parts.append(f"x{settings.replicas}")
    if settings.max_batch > 1:
        parts.append(f"batches up to {settings.max_batch}" + (f" (waits {settings.max_delay_ms:g} ms)" if settings.max_delay_ms else ""))
    return ", ".join(parts)


def _module_stage(
    config: PipelineConfig, name: str, model: ModelProto | str | os.PathLike[str], settings: StageSettings | None, source_dir: str | os.PathLike[str] | None,
    runs: str = "every",
) -> Stage:
    """A stage of ``config`` running ``model``, in memory or read from its file (weights left in their files).

    Raises:
        ConfigError: an unreadable file, or a boundary value that is not a tensor.
    """
    path = None
    if not isinstance(model, ModelProto):
        path = Path(model)
        try:
            model = onnx.load(path, load_external_data=False)
        except (OSError, DecodeError) as e:
            raise ConfigError(f"cannot read stage module '{path}': {e}") from e
        source_dir = path.parent
    inputs, outputs = io_specs(model)
    return Stage(config, name, model if path is None else None, path, Path(source_dir) if source_dir else None, inputs, outputs,
                 weights=weight_specs(model), settings=settings or StageSettings(), runs=runs)


def _code_stage(
    config: PipelineConfig,
    name: str,
    entry: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    params: Mapping[str, Any] | None,
    settings: StageSettings | None,
) -> Stage:
    """A code stage of ``config``, checked where it is added (not at ``to_spec``).

    Raises:
        ConfigError: a malformed entry point, ports without shapes or with unknown dtypes, or params
            that are not plain JSON.
    """
    check_entry_point(entry, f"stage '{name}'")
    try:
        code = CodeSpec(entry, dict(params or {}))
    except ConfigError as e:
        raise ConfigError(f"stage '{name}': {e}") from None
    ports = (tuple(inputs), tuple(outputs))
    for kind, specs in zip(("input", "output"), ports, strict=True):
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                raise ConfigError(f"stage '{name}': each {kind} must be a TensorSpec(name, dtype, shape), got {spec!r}")
    StageSpec(name, None, *ports, code=code).check()
    return Stage(config, name, None, None, None, *ports, settings=settings or StageSettings(), code=code)


def _add_pieces(config: PipelineConfig, split: PipelineConfig, name: str, settings: StageSettings | None) -> SplitPieces:
    """Add the stages of a split's config to ``config`` as ``<name>_<i>``, wired as the split wires them
    (see :meth:`PipelineConfig.add_split`).

    Raises:
        ConfigError: a piece's name is taken, or the split holds code stages.
    """
    sub = split.to_spec()
    renamed: dict[str, Stage] = {}
    for i, piece in enumerate(split.stages):
        if piece.is_code:
            raise ConfigError(f"add_split takes a model's split; its stage '{piece.name}' is a code stage")
        model = piece.model if piece.model is not None else piece.path
        assert model is not None
        renamed[piece.name] = config.add_stage(model, f"{name}_{i}", settings=settings or piece.settings, source_dir=piece.source_dir)
    inputs: dict[str, list[Port]] = {}
    outputs: dict[str, Port] = {}
    for link in sub.links:
        if link.src.stage is not None and link.dst.stage is not None:
            renamed[link.src.stage].output(link.src.tensor).connect(renamed[link.dst.stage].input(link.dst.tensor))
        elif link.src.stage is None and link.dst.stage is not None:
            inputs.setdefault(link.src.tensor, []).append(renamed[link.dst.stage].input(link.dst.tensor))
        elif link.src.stage is not None and link.dst.stage is None:
            outputs[link.dst.tensor] = renamed[link.src.stage].output(link.src.tensor)
    for st in sub.states:
        config.add_state(renamed[st.stage].output(st.output), renamed[st.stage].input(st.input), st.empty_axis, st.once)
    for flag in sub.step_flags:
        config.add_step_flag(renamed[flag.stage].input(flag.input), flag.first)
    return SplitPieces(tuple(renamed.values()), {k: tuple(v) for k, v in inputs.items()}, outputs)


def _check_state_ports(output: Port, input: Port) -> None:
    """A state link's ends: an output and an input of one stage (see :meth:`PipelineConfig.add_state`)."""
    if not output.is_source or output.endpoint.stage is None:
        raise ConfigError(f"a state link starts at a stage output, not {output}")
    if input.is_source or input.endpoint.stage is None:
        raise ConfigError(f"a state link ends at a stage input, not {input}")
    if output.endpoint.stage != input.endpoint.stage:
        raise ConfigError(
            f"state link {output} -> {input} is not within one stage: a state stays in the stage that makes it; "
            f"link {output} to an input of stage '{output.endpoint.stage}', or split so that both are in one stage"
        )


def _add_flag(wiring: Wiring, input: Port, first: bool) -> StepFlag:
    """A step flag on ``input`` (see :meth:`PipelineConfig.add_step_flag`)."""
    if input.is_source or input.endpoint.stage is None:
        raise ConfigError(f"a step flag is a stage input, not {input}")
    flag = StepFlag(input.endpoint.stage, input.endpoint.tensor, first)
    wiring.check_free(input.endpoint, f"step flag {flag}: {input}")
    wiring.add_flag(flag)
    return flag
