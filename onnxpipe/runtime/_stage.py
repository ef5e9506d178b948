"""What a stage does for one request, apart from where its worker lives.

Note: the request's bag.
    A request travels through the stages in pipeline order carrying a *bag*: the values produced so
    far, keyed by their source endpoint (a pipeline input, or a stage's output). A stage takes its
    inputs from the bag by reference (no copy: onnxruntime reads numpy arrays in place), adds its
    outputs, and drops the values no later stage or pipeline output needs, so a tensor is kept
    exactly as long as something downstream will read it. A skip edge is a value that stays in the
    bag across stages that do not read it. The plan below is computed once from the spec; any
    engine (threads here, processes or Ray actors elsewhere) drives the same :class:`StageRunner`.

Note: state stays in its stage.
    A stage with state links (``PipelineSpec.states``) keeps, in its runner, one set of state
    arrays per stream: ``{stream id: (steps done, {state input: array})}``. A request of a stream
    (``Request.stream``) feeds the stage its stream's state and, once the session has returned,
    replaces it with the state outputs (the commit: a step that fails leaves the state as it was).
    Only activations travel in the bag; the state never leaves the runner, wherever the runner
    lives. Each request carries its step number, and a runner runs step ``n`` of a stream only
    when its state has exactly ``n`` steps in it, so a step that failed earlier (here or in an
    earlier stage) can never be followed by a step on the wrong state. A close request (``step ==
    CLOSE``) drops the stream's state; an engine delivers it like any request, so it reaches each
    stage after that stream's earlier steps (see docs/streams.md, what an engine must do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import InputError, StageError
from onnxpipe.runtime._bundle import Bundle
from onnxpipe.runtime._code import CodeFunction, check_allowed, copy_params, resolve_entry
from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._session import make_session
from onnxpipe.runtime._spec import Endpoint, PipelineSpec, StageSpec, StateLink

__all__ = ["CLOSE", "CodeRunner", "Request", "Runner", "StagePlan", "StageRunner", "make_runner", "pinned_replica", "plan_stages"]

#: ``Request.step`` of a control request that closes its stream: each stateful runner drops the
#: stream's state; stateless ones pass it on.
CLOSE = -1


@dataclass(eq=False)
class Request:
    """One request in flight.

    Attributes:
        id: Sequence number, from 0, in submission order.
        values: The bag (see the note above).
        params: Parameter overrides per stage, as they were when the request was submitted.
        submitted: ``time.perf_counter()`` at submission.
        error: Set by the first stage that fails; later stages pass the request on untouched.
        done: Called once when the request leaves the last stage (set by the pipeline).
        stream: The stream the request is a step of, or ``None`` for a stateless request. An engine
            sends every request of one stream to the same replica of each stage.
        step: The step's number in its stream (from 0), or :data:`CLOSE`.
        dims: Sizes of the symbolic dims of the stream's state, for its initial value (see
            ``StateLink``); bound on the stream's first step.
        queued_at: ``time.perf_counter()`` when it entered the queue of the stage it waits for
            (its submission, then the end of each stage's run): what stage statistics time
            queues by.
    """

    id: int
    values: dict[Endpoint, Any]
    params: Mapping[str, Mapping[str, np.ndarray]]
    submitted: float
    error: BaseException | None = None
    done: Callable[[Request], None] | None = field(default=None, repr=False)
    stream: int | None = None
    step: int = 0
    dims: Mapping[str, int] = field(default_factory=dict)
    queued_at: float = 0.0

    def __post_init__(self) -> None:
        self.queued_at = self.queued_at or self.submitted


@dataclass(frozen=True)
class StagePlan:
    """Where a stage's inputs come from in the bag, and what it leaves in it."""

    stage: StageSpec
    sources: tuple[tuple[str, Endpoint], ...]  # (input name, bag key)
    outputs: tuple[str, ...]
    drop: tuple[Endpoint, ...]  # bag keys nothing after this stage reads
    states: tuple[StateLink, ...] = ()  # fed by the runner from its streams' state, not from the bag


def plan_stages(spec: PipelineSpec) -> tuple[list[StagePlan], dict[str, Endpoint]]:
    """The per-stage plans, and the bag key of each pipeline output."""
    finals = {t.name: spec.source_of(Endpoint(None, t.name)) for t in spec.outputs}
    last_use: dict[Endpoint, int] = {}
    fed_by_state = {Endpoint(s.stage, s.input) for s in spec.states}
    for i, stage in enumerate(spec.stages):
        for t in stage.inputs:
            if Endpoint(stage.name, t.name) not in fed_by_state:
                last_use[spec.source_of(Endpoint(stage.name, t.name))] = i
    keep = set(finals.values())
    plans = []
    for i, stage in enumerate(spec.stages):
        sources = tuple((t.name, spec.source_of(Endpoint(stage.name, t.name))) for t in stage.inputs if Endpoint(stage.name, t.name) not in fed_by_state)
        produced = [Endpoint(stage.name, t.name) for t in stage.outputs]
        drop = [k for k, last in last_use.items() if last == i and k not in keep]
        drop += [k for k in produced if k not in last_use and k not in keep]  # outputs nothing reads
        plans.append(StagePlan(stage, sources, tuple(t.name for t in stage.outputs), tuple(drop), spec.states_of(stage.name)))
    return plans, finals


class Runner(Protocol):
    """What any engine drives for one replica of one stage: a :class:`StageRunner` (an ONNX stage)
    or a :class:`~onnxpipe.runtime._code.CodeRunner` (a code stage, whose ``session`` is ``None``)."""

    name: str
    plan: StagePlan

    @property
    def session(self) -> ort.InferenceSession | None:
        """The stage's onnxruntime session, or ``None`` for a code stage."""

    def __call__(self, request: Request) -> None:
        """Run the stage for one request (see the note on the request's bag)."""

    def cancel(self) -> None:
        """Make a run in progress return early, where that is possible."""


class StageRunner:
    """Runs one stage of a request with one onnxruntime session.

    Args:
        plan: The stage's plan.
        session: Its session (one per runner: a replica has its own).
    """

    def __init__(self, plan: StagePlan, session: ort.InferenceSession) -> None:
        self.plan = plan
        self.name = plan.stage.name
        self.session = session
        self.run_options = ort.RunOptions()
        self._keys = tuple(Endpoint(self.name, o) for o in plan.outputs)
        #: Per stream: (steps in the state, state input name -> array). See Note: state stays in its stage.
        self.states: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self._state_at = tuple((s.input, plan.outputs.index(s.output)) for s in plan.states)

    def __call__(self, request: Request) -> None:
        """Read the inputs from the request's bag, run, put the outputs back, drop dead values.

        For a stage with state, also feed the request's stream its state and commit the new one.
        """
        if request.step == CLOSE:
            self.states.pop(request.stream, None)  # type: ignore[arg-type]
            return
        values = request.values
        feeds = {name: values[key] for name, key in self.plan.sources}
        own = request.params.get(self.name)
        if own:
            feeds.update(own)
        if self._state_at:
            feeds.update(self._state(request))
        results = self.session.run(self.plan.outputs, feeds, self.run_options)
        if self._state_at:
            assert request.stream is not None
            self.states[request.stream] = (request.step + 1, {name: results[at] for name, at in self._state_at})
        for key, value in zip(self._keys, results, strict=True):
            values[key] = value
        for key in self.plan.drop:
            values.pop(key, None)

    def _state(self, request: Request) -> dict[str, np.ndarray]:
        """The state this step of its stream runs on: the stream's, or the initial one at step 0."""
        if request.stream is None:
            raise StageError(f"stage '{self.name}' keeps state per stream ({self.plan.states[0]}): run the pipeline through pipe.stream()", stage=self.name)
        if request.step == 0:
            if request.stream in self.states:
                raise AssertionError(f"stream {request.stream} started twice in stage '{self.name}'")
            return initial_state(self.plan, request.dims)
        entry = self.states.get(request.stream)
        if entry is None or entry[0] != request.step:
            held = "no state of it" if entry is None else f"its state after step {entry[0] - 1}"
            raise StageError(
                f"stage '{self.name}' holds {held}, not after step {request.step - 1}: "
                f"an earlier step of stream {request.stream} failed, so step {request.step} cannot run on its state",
                stage=self.name,
            )
        return entry[1]

    def state_bytes(self) -> int:
        """Bytes of the state arrays this runner holds, over all its streams."""
        return sum(a.nbytes for _, state in self.states.values() for a in state.values())

    def cancel(self) -> None:
        """Make a run in progress return early (onnxruntime's ``RunOptions.terminate``)."""
        self.run_options.terminate = True


def initial_state(plan: StagePlan, dims: Mapping[str, int]) -> dict[str, np.ndarray]:
    """A stream's first state in one stage: zeros, sized as in ``StateLink``'s Note: initial values.

    Raises:
        InputError: a symbolic dim of a state has no size in ``dims`` (a bug once the spec is valid,
            but named for the user all the same).
    """
    state = {}
    for link in plan.states:
        spec = plan.stage.input(link.input)
        assert spec.shape is not None  # PipelineSpec.validate
        shape = []
        for axis, d in enumerate(spec.shape):
            if axis == link.empty_axis:
                shape.append(0)
            elif isinstance(d, int):
                shape.append(d)
            elif isinstance(d, str) and d in dims:
                shape.append(dims[d])
            else:
                raise InputError(f"state '{link.input}' of stage '{plan.stage.name}': no size for dim {axis} ({d}); known: {dict(dims)}")
        state[link.input] = np.zeros(shape, numpy_dtype(spec.dtype))
    return state


class CodeRunner:
    """Runs one code stage of a request: calls its function, checks what it returns.

    Same face as :class:`StageRunner` (``name``, ``plan``, ``__call__``, ``cancel``); ``session``
    is ``None``. Made by :func:`make_runner` for a code stage, so every engine runs code stages.

    Note: checked outputs.
        The function must return a mapping holding exactly the stage's declared outputs, each a
        numpy array (anything ``np.asarray`` takes is converted) of the declared dtype and rank,
        with the declared size on every fixed dim; symbolic dims may take any size, but the same
        size in every output naming them, so shapes may change from request to request. Anything
        else fails that request with a :class:`StageError` naming the stage and the tensor; the
        stage goes on with the next request. Values are never cast (as for pipeline inputs).

    Args:
        plan: The stage's plan (``plan.stage.code`` set).
        function: The resolved callable.
    """

    session = None

    def __init__(self, plan: StagePlan, function: CodeFunction) -> None:
        assert plan.stage.code is not None
        self.plan = plan
        self.name: str = plan.stage.name
        self.function = function
        # One private copy per runner: a function that changes its params affects only this replica.
        self.params: dict[str, Any] = copy_params(plan.stage.code.params)
        self._keys = tuple((o, Endpoint(self.name, o)) for o in plan.outputs)

    def compute(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Call the function on one request's inputs; its outputs, checked (see the note above).

        Raises:
            StageError: the function's result is not the declared outputs.
        """
        result = self.function(feeds, self.params)
        if not isinstance(result, Mapping):
            raise StageError(f"code stage '{self.name}' returned {type(result).__name__}; it must return a dict of arrays by output name")
        declared = self.plan.stage.outputs
        extra = [k for k in result if k not in {t.name for t in declared}]
        if extra:
            names = ", ".join(repr(str(k)) for k in extra)
            raise StageError(f"code stage '{self.name}' returned output(s) {names} it does not declare; declared: {', '.join(repr(t.name) for t in declared)}")
        try:
            return check_inputs(declared, result, what=f"stage '{self.name}' output")
        except InputError as e:
            raise StageError(f"code stage '{self.name}': {e}") from None

    def __call__(self, request: Request) -> None:
        """Read the inputs from the request's bag, call the function, put the outputs back, drop dead values."""
        if request.step == CLOSE:  # a code stage keeps no state of a stream
            return
        values = request.values
        outputs = self.compute({name: values[key] for name, key in self.plan.sources})
        for name, key in self._keys:
            values[key] = outputs[name]
        for key in self.plan.drop:
            values.pop(key, None)

    def cancel(self) -> None:
        """Nothing to do: a Python call cannot be interrupted; the engine stops after it returns."""


def pinned_replica(plan: StagePlan, request: Request, replicas: int) -> int | None:
    """The replica of a stage that must run ``request``, or None when any replica may.

    A stream's request in a stage with state goes to replica ``stream % replicas``, whose runner
    holds the stream's state (streams are numbered in order, so they spread evenly). Every engine
    routes by this (see the streams note of ``_engine.py``).
    """
    if request.stream is None or not plan.states:
        return None
    return request.stream % replicas


def make_runner(bundle: Bundle, plan: StagePlan, replica: int, target: str | None = None) -> Runner:
    """The runner of one replica of one stage, with its own session (or, for a code stage, its
    callable): what every engine's workers call, wherever they live (a thread here, an actor on
    another host).

    A code stage, or an ONNX stage with custom-op libraries, is made only when the bundle's
    ``allow_code`` patterns allow what it names (checked before anything is imported).

    Args:
        bundle: The checked bundle the stage's module comes from.
        plan: The stage's plan.
        replica: Which replica (its settings may differ, e.g. its cores).
        target: Run on this target instead of the stage's own.

    Raises:
        BundleError: the session could not be created (provider missing, module refused), the
            stage names Python the bundle's ``allow_code`` does not allow, or its entry point or
            custom-op package cannot be found on this host.
    """
    stage = plan.stage
    check_allowed([stage], bundle.allow_code)
    if stage.code is not None:
        return CodeRunner(plan, resolve_entry(stage))
    module, config = bundle.session_source(stage)
    session = make_session(module, dataclasses.replace(stage, settings=stage.settings.for_replica(replica)), target, config)
    return StageRunner(plan, session)
