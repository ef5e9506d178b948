"""What a stage does for one request, apart from where its worker lives.

Note: the request's bag.
    A request travels through the stages in pipeline order carrying a *bag*: the values produced so
    far, keyed by their source endpoint (a pipeline input, or a stage's output). A stage takes its
    inputs from the bag by reference (no copy: onnxruntime reads numpy arrays in place), adds its
    outputs, and drops the values no later stage or pipeline output needs, so a tensor is kept
    exactly as long as something downstream will read it. A skip edge is a value that stays in the
    bag across stages that do not read it. The plan below is computed once from the spec; any
    engine (threads here, processes or Ray actors elsewhere) drives the same :class:`StageRunner`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxpipe.runtime._bundle import Bundle
from onnxpipe.runtime._session import make_session
from onnxpipe.runtime._spec import Endpoint, PipelineSpec, StageSpec

__all__ = ["Request", "StagePlan", "StageRunner", "make_runner", "plan_stages"]


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
    """

    id: int
    values: dict[Endpoint, Any]
    params: Mapping[str, Mapping[str, np.ndarray]]
    submitted: float
    error: BaseException | None = None
    done: Callable[[Request], None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StagePlan:
    """Where a stage's inputs come from in the bag, and what it leaves in it."""

    stage: StageSpec
    sources: tuple[tuple[str, Endpoint], ...]  # (input name, bag key)
    outputs: tuple[str, ...]
    drop: tuple[Endpoint, ...]  # bag keys nothing after this stage reads


def plan_stages(spec: PipelineSpec) -> tuple[list[StagePlan], dict[str, Endpoint]]:
    """The per-stage plans, and the bag key of each pipeline output."""
    finals = {t.name: spec.source_of(Endpoint(None, t.name)) for t in spec.outputs}
    last_use: dict[Endpoint, int] = {}
    for i, stage in enumerate(spec.stages):
        for t in stage.inputs:
            last_use[spec.source_of(Endpoint(stage.name, t.name))] = i
    keep = set(finals.values())
    plans = []
    for i, stage in enumerate(spec.stages):
        sources = tuple((t.name, spec.source_of(Endpoint(stage.name, t.name))) for t in stage.inputs)
        produced = [Endpoint(stage.name, t.name) for t in stage.outputs]
        drop = [k for k, last in last_use.items() if last == i and k not in keep]
        drop += [k for k in produced if k not in last_use and k not in keep]  # outputs nothing reads
        plans.append(StagePlan(stage, sources, tuple(t.name for t in stage.outputs), tuple(drop)))
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

    def __call__(self, request: Request) -> None:
        """Read the inputs from the request's bag, run, put the outputs back, drop dead values."""
        values = request.values
        feeds = {name: values[key] for name, key in self.plan.sources}
        own = request.params.get(self.name)
        if own:
            feeds.update(own)
        results = self.session.run(self.plan.outputs, feeds, self.run_options)
        for key, value in zip(self._keys, results, strict=True):
            values[key] = value
        for key in self.plan.drop:
            values.pop(key, None)

    def cancel(self) -> None:
        """Make a run in progress return early (onnxruntime's ``RunOptions.terminate``)."""
        self.run_options.terminate = True


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
