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
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import InputError, StageError
from onnxpipe.runtime._bundle import Bundle
from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._session import make_session
from onnxpipe.runtime._spec import Endpoint, PipelineSpec, StageSpec, StateLink

__all__ = ["CLOSE", "Request", "StagePlan", "StageRunner", "make_runner", "plan_stages"]

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


def make_runner(bundle: Bundle, plan: StagePlan, replica: int, target: str | None = None) -> StageRunner:
    """The runner of one replica of one stage, with its own session: what every engine's workers
    call, wherever they live (a thread here, an actor on another host).

    Args:
        bundle: The checked bundle the stage's module comes from.
        plan: The stage's plan.
        replica: Which replica (its settings may differ, e.g. its cores).
        target: Run on this target instead of the stage's own.

    Raises:
        BundleError: the session could not be created (provider missing, module refused).
    """
    stage = plan.stage
    module, config = bundle.session_source(stage)
    session = make_session(module, dataclasses.replace(stage, settings=stage.settings.for_replica(replica)), target, config)
    return StageRunner(plan, session)
