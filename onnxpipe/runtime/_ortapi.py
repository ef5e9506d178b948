"""A pipeline where code written against ``onnxruntime.InferenceSession`` expects a session.

:class:`InferenceSessionAPI` gives :class:`~onnxpipe.runtime.Pipeline` onnxruntime's session face:
``get_inputs`` / ``get_outputs`` (:class:`NodeArg`), ``get_modelmeta`` (:class:`ModelMetadata`),
``get_providers``, ``run(output_names, input_feed, run_options)``, ``run_async``,
``run_with_ort_values`` and ``io_binding`` / ``run_with_iobinding`` (:class:`PipelineIOBinding`).
Everything is answered from the bundle's spec and the stages' sessions; nothing here knows how the
stages run.

Note: matching onnxruntime where a client can notice.
    Checked against onnxruntime 1.32 (tests/runtime/test_dropin.py compares field by field with a
    session of the whole model). ``NodeArg.shape`` holds an int for a fixed dim, the name for a
    symbolic one and ``None`` for an unnamed or negative (``-1``) one; a tensor of unknown rank has
    shape ``[]``. Errors are onnxpipe's, with onnxpipe's messages, but each also subclasses the type
    onnxruntime raises in the same case, so ``except InputError`` and ``except InvalidArgument``
    both catch them:

    ================================================  =====================  ==========================
    case                                              onnxruntime raises     onnxpipe raises
    ================================================  =====================  ==========================
    a required input is missing                       ``ValueError``         ``InputError`` + ValueError
    unknown input or output name, wrong dtype, shape  ``InvalidArgument``    ``InputError`` + InvalidArgument
    ``output_names`` a string, feed not a mapping,    ``TypeError``          ``InputError`` + TypeError
    ``run_options`` not a ``RunOptions``
    a stage fails, ``RunOptions.terminate`` is set    ``Fail``               ``StageError`` + Fail
    a session method a pipeline cannot honour         (n/a)                  ``OnnxpipeError`` + NotImplementedError
    ================================================  =====================  ==========================
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

from onnxpipe._errors import InputError, OnnxpipeError, StageError, closest, ort_message
from onnxpipe.runtime._dtypes import numpy_dtype, ort_type
from onnxpipe.runtime._handoff import Device
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._session import placement
from onnxpipe.runtime._spec import PipelineSpec, TensorSpec
from onnxpipe.runtime.bundle import Bundle

__all__ = [
    "METADATA_PREFIX",
    "NO_VERSION",
    "ArgumentTypeError",
    "FeedError",
    "InferenceSessionAPI",
    "MissingInputError",
    "ModelMetadata",
    "NodeArg",
    "PipelineIOBinding",
    "RunFailedError",
    "SessionFacts",
    "UnsupportedError",
]

#: Keys of ``pipeline.json`` ``metadata`` that hold the source model's :class:`ModelMetadata`.
METADATA_PREFIX = "model."
#: onnxruntime's ``version`` of a model that sets no ``model_version`` (INT64_MAX).
NO_VERSION = 2**63 - 1
#: How often a waiting :meth:`InferenceSessionAPI.run` looks at ``RunOptions.terminate``.
_TERMINATE_POLL_S = 0.02


class FeedError(InputError, InvalidArgument):
    """An unknown input or output name, or an input of the wrong dtype or shape (onnxruntime: InvalidArgument)."""


class MissingInputError(InputError, ValueError):
    """A required input is not in the feed (onnxruntime: ValueError)."""


class ArgumentTypeError(InputError, TypeError):
    """An argument of ``run`` of the wrong type (onnxruntime: TypeError)."""


class RunFailedError(StageError, Fail):
    """A stage failed on the request, or ``RunOptions.terminate`` stopped the wait (onnxruntime: Fail)."""


class UnsupportedError(OnnxpipeError, NotImplementedError):
    """A session method a pipeline cannot honour; the message names what to use instead."""


class NodeArg:
    """An input or output as onnxruntime's ``NodeArg`` describes it: ``name``, ``type``, ``shape``.

    Args:
        spec: The pipeline's tensor.
    """

    __slots__ = ("_shape", "name", "type")

    def __init__(self, spec: TensorSpec) -> None:
        self.name = spec.name
        self.type = ort_type(spec.dtype)
        self._shape = tuple(_ort_dim(d) for d in spec.shape or ())

    @property
    def shape(self) -> list[int | str | None]:
        """One entry per dim: a size, a symbolic name, or ``None``; ``[]`` when the rank is unknown."""
        return list(self._shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeArg) and (self.name, self.type, self._shape) == (other.name, other.type, other._shape)

    def __hash__(self) -> int:
        return hash((self.name, self.type, self._shape))

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"


def _ort_dim(dim: int | str | None) -> int | str | None:
    # onnxruntime reports a negative size (-1, a common "unknown") like an unnamed dim.
    return None if isinstance(dim, int) and dim < 0 else dim


@dataclass(frozen=True)
class ModelMetadata:
    """The source model's metadata, with the fields of onnxruntime's ``ModelMetadata``.

    ``description`` is the model's ``doc_string``, ``graph_description`` its graph's, ``version``
    its ``model_version`` (``2**63 - 1`` when unset, as onnxruntime reports it) and
    ``custom_metadata_map`` its ``metadata_props``.
    """

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = NO_VERSION
    custom_metadata_map: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: Any) -> ModelMetadata:
        """A copy of an ``onnxruntime.ModelMetadata`` (or anything with the same fields)."""
        return cls(
            meta.producer_name, meta.graph_name, meta.domain, meta.description, meta.graph_description, int(meta.version), dict(meta.custom_metadata_map)
        )

    def to_metadata(self) -> dict[str, str]:
        """The ``pipeline.json`` metadata entries holding this (see docs/bundle-format.md)."""
        p = METADATA_PREFIX
        fixed = {f"{p}{k}": str(getattr(self, k)) for k in ("producer_name", "graph_name", "domain", "description", "graph_description", "version")}
        return fixed | {f"{p}custom.{k}": v for k, v in self.custom_metadata_map.items()}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> ModelMetadata | None:
        """Read what :meth:`to_metadata` wrote; ``None`` for a bundle made before it was kept."""
        p = METADATA_PREFIX
        if f"{p}graph_name" not in metadata:
            return None
        custom = {k[len(p) + 7 :]: v for k, v in metadata.items() if k.startswith(f"{p}custom.")}
        get = metadata.get
        try:
            version = int(get(f"{p}version", NO_VERSION))
        except ValueError:
            version = NO_VERSION  # hand-edited metadata: the rest is still worth giving
        text = {k: get(f"{p}{k}", "") for k in ("producer_name", "graph_name", "domain", "description", "graph_description")}
        return cls(**text, version=version, custom_metadata_map=custom)


@dataclass(frozen=True)
class SessionFacts:
    """What the session API needs from one stage replica's onnxruntime session."""

    providers: tuple[str, ...]
    provider_options: Mapping[str, Mapping[str, str]]
    meta: ModelMetadata
    #: The stage whose session it is.
    stage: str = ""
    #: Provider -> the nodes it took (``_session.placement``); ``None`` where onnxruntime cannot tell.
    placement: Mapping[str, tuple[str, ...]] | None = None

    @classmethod
    def of(cls, session: ort.InferenceSession, stage: str = "") -> SessionFacts:
        """Read them from a session."""
        return cls(tuple(session.get_providers()), dict(session.get_provider_options()), ModelMetadata.of(session.get_modelmeta()), stage, placement(session))

    def to_dict(self) -> dict[str, Any]:
        """A plain form (what a Ray actor sends back); :meth:`from_dict` reads it."""
        return {"providers": list(self.providers), "provider_options": {k: dict(v) for k, v in self.provider_options.items()},
                "meta": dataclasses.asdict(self.meta), "stage": self.stage,
                "placement": None if self.placement is None else {ep: list(nodes) for ep, nodes in self.placement.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SessionFacts:
        where = data.get("placement")
        return cls(tuple(data["providers"]), data["provider_options"], ModelMetadata(**data["meta"]), data.get("stage", ""),
                   None if where is None else {ep: tuple(nodes) for ep, nodes in where.items()})


Outputs = dict[str, np.ndarray]
Callback = Callable[[list[np.ndarray], Any, str], None]


class InferenceSessionAPI:
    """onnxruntime's ``InferenceSession`` methods, for a class that has a ``bundle``, records its
    sessions' facts in ``_session_facts`` (pipeline order) and can ``submit`` a request."""

    bundle: Bundle
    _session_facts: list[SessionFacts]

    def submit(self, inputs: Mapping[str, Any]) -> Future[Outputs]:
        """Submit one request; a future of its outputs by name."""
        raise NotImplementedError

    # -- what the session looks like --------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        """The inputs, as onnxruntime's ``InferenceSession.get_inputs()`` gives them."""
        return [NodeArg(t) for t in self._spec.inputs]

    def get_outputs(self) -> list[NodeArg]:
        """The outputs, as onnxruntime's ``InferenceSession.get_outputs()`` gives them."""
        return [NodeArg(t) for t in self._spec.outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Always ``[]``: no weight can be fed through :meth:`run`; swap weights with ``set_params``."""
        return []

    def get_modelmeta(self) -> ModelMetadata:
        """The source model's metadata, kept in the bundle at split time.

        A bundle made before that (or wired by hand) gives the first stage module's metadata, with
        the pipeline's name as ``graph_name`` and without onnxpipe's own ``onnxpipe.*`` entries.
        """
        kept = ModelMetadata.from_metadata(self._spec.metadata)
        if kept is not None:
            return kept
        if not self._session_facts:  # only code stages: no module to take metadata from
            return ModelMetadata(graph_name=self._spec.metadata.get("name", "pipeline"))
        first = self._session_facts[0].meta
        custom = {k: v for k, v in first.custom_metadata_map.items() if not k.startswith("onnxpipe.")}
        name = first.custom_metadata_map.get("onnxpipe.source") or self._spec.metadata.get("name") or first.graph_name
        return ModelMetadata(first.producer_name, name, first.domain, first.description, first.graph_description, first.version, custom)

    def get_providers(self) -> list[str]:
        """The execution providers the stages' sessions registered, each once, in the order of
        the first stage that has it (a stage's own list is in priority order)."""
        return list(dict.fromkeys(p for facts in self._session_facts for p in facts.providers))

    def placement(self) -> dict[str, dict[str, list[str]] | None]:
        """Where each stage's nodes run: stage -> provider -> the nodes of its optimized graph that
        provider took (``"OpType 'name'"``), from the stage's first replica; ``None`` for a stage
        whose onnxruntime cannot tell (before 1.24) and for code stages, which have no nodes.

        A stage whose target is an accelerator and whose nodes all sit under that provider ran
        nothing on the CPU; a node listed under ``CPUExecutionProvider`` fell back
        (``fallback=on``, the default; with ``fallback=off`` such a stage does not load).
        """
        where: dict[str, dict[str, list[str]] | None] = {stage.name: None for stage in self._spec.stages}
        for facts in self._session_facts:
            if facts.stage in where and where[facts.stage] is None and facts.placement is not None:
                where[facts.stage] = {ep: list(nodes) for ep, nodes in facts.placement.items()}
        return where

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Each provider's options, from the first stage session that registered it."""
        options: dict[str, dict[str, str]] = {}
        for facts in self._session_facts:
            for name, values in facts.provider_options.items():
                options.setdefault(name, dict(values))
        return options

    def get_session_options(self) -> ort.SessionOptions:
        """Not available: each stage has its own session options.

        Raises:
            UnsupportedError: always; read ``pipeline.spec.stages[i].settings`` instead.
        """
        raise UnsupportedError("a pipeline has one set of session options per stage, not one; read pipeline.spec.stages[i].settings instead")

    def io_binding(self) -> PipelineIOBinding:
        """``InferenceSession.io_binding``: a :class:`PipelineIOBinding` for :meth:`run_with_iobinding`."""
        return PipelineIOBinding(self)

    def run_with_iobinding(self, iobinding: PipelineIOBinding, run_options: ort.RunOptions | None = None) -> None:
        """``InferenceSession.run_with_iobinding``: one request with the binding's inputs; its
        outputs go where the binding put them (:meth:`PipelineIOBinding.get_outputs`).

        Raises:
            UnsupportedError: ``iobinding`` is not one this pipeline's :meth:`io_binding` made (an
                onnxruntime ``IOBinding`` belongs to its own session), or an output is bound to a
                raw device pointer.
            InputError, RunFailedError: as :meth:`run`.
        """
        if not isinstance(iobinding, PipelineIOBinding) or iobinding.pipeline is not self:
            raise UnsupportedError(f"run_with_iobinding takes the IOBinding this pipeline's io_binding() made, not {type(iobinding).__name__}")
        iobinding.run(run_options)

    def end_profiling(self) -> str:
        """Not available. Raises :class:`UnsupportedError` naming ``load(trace=True)`` and ``save_trace``."""
        raise UnsupportedError("a pipeline is profiled as a whole: load it with trace=True and call save_trace(path)")

    def set_providers(self, providers: Sequence[Any] | None = None, provider_options: Any = None) -> None:
        """Accepted when nothing would change: ``providers`` (names or ``(name, options)`` pairs)
        are the ones the stages use, e.g. ``["CPUExecutionProvider"]`` on a CPU pipeline, as
        applications call it to make sure they run on the CPU.

        Raises:
            UnsupportedError: any other change; load the bundle again with ``load(path, target=...)``.
        """
        asked = [p if isinstance(p, str) else p[0] for p in providers or ()]
        if asked != self.get_providers():
            raise UnsupportedError(
                f"a pipeline cannot switch to providers {asked}: its stages use {self.get_providers()}; load it again with load(path, target=...)"
            )

    # -- running -----------------------------------------------------------------------------------

    def _ort_run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: ort.RunOptions | None) -> list[np.ndarray]:
        """``InferenceSession.run``: the outputs asked for (all, in declared order, for ``None`` or
        ``[]``), as a list in that order. Thread-safe: each call is its own request."""
        names, future = self._ort_submit(output_names, input_feed, run_options)
        if run_options is not None:
            # Honour RunOptions.terminate set by another thread while this one waits; the request
            # itself finishes in the background and its outputs are dropped.
            while not concurrent.futures.wait([future], _TERMINATE_POLL_S).done:
                if run_options.terminate:
                    raise RunFailedError("run stopped: RunOptions.terminate was set")
        try:
            outputs = future.result()
        except StageError as e:
            raise RunFailedError(str(e), stage=e.stage, request=e.request) from e
        return [outputs[n] for n in names]

    def run_async(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], callback: Callback, user_data: Any, run_options: ort.RunOptions | None = None
    ) -> None:
        """``InferenceSession.run_async``: returns at once; ``callback(results, user_data, err)``
        is called when the request is done, with ``err == ""`` on success and ``results == []``
        on failure, as onnxruntime does. It runs on the last stage's worker: keep it short.

        Raises:
            InputError: as :meth:`run`, at once.
        """
        names, future = self._ort_submit(output_names, input_feed, run_options)

        def done(f: Future[Outputs]) -> None:
            error = f.exception()
            if error is None:
                outputs = f.result()
                callback([outputs[n] for n in names], user_data, "")
            else:
                callback([], user_data, str(error))

        future.add_done_callback(done)

    def run_with_ort_values(
        self, output_names: Sequence[str] | None, input_dict_ort_values: Mapping[str, Any], run_options: ort.RunOptions | None = None
    ) -> list[ort.OrtValue]:
        """``InferenceSession.run_with_ort_values``: like :meth:`run` with ``OrtValue`` inputs and
        outputs, in host memory as onnxruntime gives them. An ``OrtValue`` in host memory is fed to
        the first stages in place (its ``numpy()`` is a view) and each output is an ``OrtValue``
        over the pipeline's own array (no copy); an input on a device is read to the host once
        (Note: hand-offs as OrtValues, ``_handoff``)."""
        outputs = self._ort_run(output_names, input_dict_ort_values, run_options)
        return [ort.OrtValue.ortvalue_from_numpy(a) for a in outputs]

    def _ort_submit(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: ort.RunOptions | None
    ) -> tuple[list[str], Future[Outputs]]:
        spec = self._spec
        if run_options is not None and not isinstance(run_options, ort.RunOptions):
            raise ArgumentTypeError(f"run_options must be an onnxruntime.RunOptions or None, got {type(run_options).__name__}")
        if not isinstance(input_feed, Mapping):
            raise ArgumentTypeError(f"input_feed must be a mapping of input name to value, got {type(input_feed).__name__}")
        names = _output_names(spec, output_names)
        missing = [t.name for t in spec.inputs if t.name not in input_feed]
        if missing:
            raise MissingInputError(f"missing input(s) {', '.join(repr(n) for n in missing)}; expected {', '.join(repr(t.name) for t in spec.inputs)}")
        if run_options is not None and run_options.terminate:
            raise RunFailedError("run not started: RunOptions.terminate is set")
        try:
            feeds = check_inputs(spec.inputs, _as_arrays(spec, input_feed))
        except InputError as e:
            raise FeedError(str(e)) from None
        try:
            return names, self.submit(feeds)
        except StageError as e:  # the pipeline is closed
            raise RunFailedError(str(e), stage=e.stage, request=e.request) from e

    @property
    def _spec(self) -> PipelineSpec:
        return self.bundle.spec


def _output_names(spec: PipelineSpec, output_names: Sequence[str] | None) -> list[str]:
    declared = [t.name for t in spec.outputs]
    if not output_names:
        return declared
    if isinstance(output_names, str):
        raise ArgumentTypeError(f"output_names must be a list of names or None, got the string {output_names!r}; write [{output_names!r}]")
    for name in output_names:
        if name not in declared:
            raise FeedError(f"unknown output '{name}'; {closest(str(name), declared)}")
    return list(output_names)


def _as_arrays(spec: PipelineSpec, feed: Mapping[str, Any]) -> dict[str, Any]:
    # Like onnxruntime: an OrtValue is read through numpy, a list or scalar becomes an array of the
    # input's declared dtype; an ndarray is taken as it is (a wrong dtype stays an error).
    dtypes = {t.name: t.dtype for t in spec.inputs}
    feeds: dict[str, Any] = {}
    for name, value in feed.items():
        if isinstance(value, ort.OrtValue):
            value = value.numpy()
        elif not isinstance(value, np.ndarray) and name in dtypes:
            try:
                value = np.asarray(value, dtype=numpy_dtype(dtypes[name]))
            except (TypeError, ValueError) as e:
                raise FeedError(f"input '{name}': cannot make a {dtypes[name]} array of {type(value).__name__}: {e}") from None
        feeds[name] = value
    return feeds


class PipelineIOBinding:
    """onnxruntime's ``IOBinding`` for a pipeline (:meth:`InferenceSessionAPI.io_binding`): the
    same methods, for code written against a session's binding.

    Inputs bound in host memory (``bind_cpu_input``, ``bind_input`` on ``"cpu"``, a host
    ``OrtValue``) are fed to the pipeline in place; an ``OrtValue`` on a device is read to the host
    once. Outputs go where they are bound: a device by name (``bind_output(name, "cuda", 0)``: the
    output is copied there once, as a new ``OrtValue``), a caller's host buffer
    (``bind_output(..., buffer_ptr=...)`` on ``"cpu"``) or ``OrtValue`` (``bind_ortvalue_output``,
    host or device): written into it. :meth:`get_outputs` gives them as ``OrtValue`` in the order
    they were bound. The run is synchronous, so the ``synchronize_*`` methods have nothing to wait
    for. A raw device pointer (``bind_input``/``bind_output`` with ``buffer_ptr`` on a device) is
    refused: the pipeline cannot read or write device memory it was not given as an ``OrtValue``.

    Args:
        pipeline: The pipeline that runs it.
    """

    def __init__(self, pipeline: InferenceSessionAPI) -> None:
        self.pipeline = pipeline
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, Device | np.ndarray | ort.OrtValue] = {}
        self._results: list[ort.OrtValue] = []

    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        """Bind an input to an array in host memory (read in place; kept until unbound)."""
        self._inputs[name] = arr_on_cpu

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: Sequence[int], buffer_ptr: int) -> None:
        """Bind an input to memory at ``buffer_ptr`` (host memory only).

        Raises:
            UnsupportedError: ``device_type`` is not ``"cpu"``.
        """
        self._inputs[name] = _host_buffer(f"input '{name}'", device_type, element_type, shape, buffer_ptr, "bind_ortvalue_input")

    def bind_ortvalue_input(self, name: str, ortvalue: ort.OrtValue) -> None:
        """Bind an input to an ``OrtValue``."""
        self._inputs[name] = ortvalue

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: inputs are read when the pipeline runs."""

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type: Any = None, shape: Sequence[int] | None = None,
                    buffer_ptr: int | None = None) -> None:
        """Bind an output to a device (a new ``OrtValue`` there each run) or to host memory at ``buffer_ptr``.

        Raises:
            ValueError: ``buffer_ptr`` without ``element_type`` and ``shape`` (as onnxruntime).
            UnsupportedError: ``buffer_ptr`` on a device.
        """
        if buffer_ptr is None:
            self._outputs[name] = Device(device_type, device_id)
            return
        if element_type is None or shape is None:
            raise ValueError("`element_type` and `shape` are to be provided if pre-allocated memory is provided")
        self._outputs[name] = _host_buffer(f"output '{name}'", device_type, element_type, shape, buffer_ptr, "bind_ortvalue_output")

    def bind_ortvalue_output(self, name: str, ortvalue: ort.OrtValue) -> None:
        """Bind an output to an ``OrtValue``: each run writes into it (host or device)."""
        self._outputs[name] = ortvalue

    def synchronize_outputs(self) -> None:
        """Nothing to wait for: outputs are in place when :meth:`run_with_iobinding` returns."""

    def get_outputs(self) -> list[ort.OrtValue]:
        """The outputs of the last run, as ``OrtValue``, in the order they were bound."""
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """The outputs of the last run as numpy arrays of their own."""
        return [np.array(v.numpy()) for v in self._results]

    def clear_binding_inputs(self) -> None:
        """Unbind every input."""
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        """Unbind every output."""
        self._outputs.clear()

    def run(self, run_options: ort.RunOptions | None = None) -> None:
        """Run the pipeline once on the bound inputs and put each output where it is bound.

        Raises:
            FeedError: no output is bound, or a value does not fit the buffer it is bound to.
        """
        if not self._outputs:
            raise FeedError("no output is bound: bind at least one with bind_output or bind_ortvalue_output (onnxruntime asks for one too)")
        names = list(self._outputs)
        arrays = self.pipeline._ort_run(names, self._inputs, run_options)
        self._results = [_put(name, array, self._outputs[name]) for name, array in zip(names, arrays, strict=True)]


#: onnx ``TensorProto`` element types -> numpy, for ``element_type`` given as a number.
_ONNX_TYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16,
               11: np.float64, 12: np.uint32, 13: np.uint64}


def _host_buffer(what: str, device_type: str, element_type: Any, shape: Sequence[int], buffer_ptr: int, instead: str) -> np.ndarray:
    """A numpy view over a caller's host memory; a device pointer is refused."""
    if device_type != "cpu":
        raise UnsupportedError(f"{what}: a pipeline cannot read or write a raw {device_type} pointer; bind an OrtValue with {instead} instead")
    try:
        dtype = np.dtype(_ONNX_TYPES[element_type] if isinstance(element_type, int) else element_type)
    except (KeyError, TypeError) as e:
        raise FeedError(f"{what}: unknown element_type {element_type!r}") from e
    size = math.prod(shape) * dtype.itemsize
    return np.frombuffer(memoryview((ctypes.c_char * size).from_address(buffer_ptr)).cast("B"), dtype=dtype).reshape(tuple(shape))


def _put(name: str, array: np.ndarray, where: Device | np.ndarray | ort.OrtValue) -> ort.OrtValue:
    """An output put where it is bound: a new ``OrtValue`` on a device (host: over the array), or written into a caller's buffer."""
    if isinstance(where, Device):
        try:
            return ort.OrtValue.ortvalue_from_numpy(array, where.type, where.id)
        except Exception as e:  # onnxruntime's own types: no such device here
            raise UnsupportedError(f"output '{name}': cannot put it on device {where}: {ort_message(e)}") from e
    shape = tuple(where.shape) if isinstance(where, np.ndarray) else tuple(where.shape())
    if shape != array.shape:
        raise FeedError(f"output '{name}' has shape {list(array.shape)}; the buffer bound to it has shape {list(shape)}")
    if isinstance(where, np.ndarray):
        np.copyto(where, array, casting="no")
        return ort.OrtValue.ortvalue_from_numpy(where)
    where.update_inplace(np.ascontiguousarray(array))
    return where
