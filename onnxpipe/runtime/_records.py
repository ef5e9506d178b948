"""The records a stage run reads and writes, apart from what runs it (``_stage``): the request in
flight (:class:`Request`, its bag and its stream's step), a stage's plan (:class:`StagePlan`, from
:func:`plan_stages`), and what a run did (:class:`Call`, with its :class:`Failure` records). See
``_stage``'s Notes: the request's bag, state stays in its stage, a run's record."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxpipe._errors import StageError, StreamError, ort_message
from onnxpipe.runtime._spec import Endpoint, PipelineSpec, StageSpec, StateLink, StepFlag
from onnxpipe.runtime.scheduling import StepBatch, bag_pads

__all__ = ["CLOSE", "Call", "Failure", "Request", "StagePlan", "claimed", "passes", "plan_stages", "stage_failed"]

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
        batch: For a batch of streams' steps travelling as one request (Note: state blocks): its
            members and layout; ``stream`` is then ``None``.
        claim: Asked by the first stage that takes the request, before it runs it: ``False``
            when its owner withdrew it meanwhile (see :func:`claimed`); ``None``: nothing to ask.
        held: ``(stream, stage, bytes)`` for each state a stage with state committed for one of
            the request's steps: the bytes it holds for that stream now (Note: a stream's state
            bytes, ``_stream``).
        length: For a stream's step alone: the positions its state holds after the step (its
            attention mask's length), what a state kept in place counts (``_inplace``); 0: unknown.
        group: For a stream's step alone that its scheduler sent: its group's streams in the
            group's order (``Step.group``), where a stage keeping state in place puts it
            (``_inplace``, Note: state in place); () otherwise.
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
    batch: StepBatch | None = None
    claim: Callable[[], bool] | None = field(default=None, repr=False)
    held: list[tuple[int, str, int]] = field(default_factory=list, repr=False)
    length: int = 0
    group: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.queued_at = self.queued_at or self.submitted

    @property
    def route(self) -> int | None:
        """The stream an engine routes the request by (a batch's members share their replicas)."""
        if self.batch is not None:
            return self.batch.streams[0] if len(self.batch) else None
        return self.stream

    @property
    def size(self) -> int:
        """Steps or requests it carries: a batch's members, else 1."""
        return 1 if self.batch is None else len(self.batch)


def claimed(request: Request) -> bool:
    """Whether a stage may run ``request``: what every engine's first stage asks, once, before
    running a request (``Request.claim``; Note: withdrawn requests, ``_pipeline``). A request its
    owner withdrew is marked failed with ``CancelledError``, so every stage passes it on untouched."""
    claim, request.claim = request.claim, None
    if claim is None or claim():
        return True
    request.error = CancelledError(f"request {request.id} was withdrawn before it started")
    return False


@dataclass(frozen=True)
class StagePlan:
    """Where a stage's inputs come from in the bag, and what it leaves in it."""

    stage: StageSpec
    sources: tuple[tuple[str, Endpoint], ...]  # (input name, bag key)
    outputs: tuple[str, ...]
    drop: tuple[Endpoint, ...]  # bag keys nothing after this stage reads
    states: tuple[StateLink, ...] = ()  # fed by the runner from its streams' state, not from the bag
    streams: bool = False  # the pipeline keeps state: its steps are batched at the entry, never in the stage's queue
    pads: Mapping[Endpoint, tuple[int, float]] = field(default_factory=dict)  # bag values that grow with the past (scheduling.bag_pads)
    flags: tuple[StepFlag, ...] = ()  # fed by the runner by the step's number, not from the bag
    kept: tuple[str, ...] = ()  # inputs kept per stream from its first step (PipelineSpec, Note: first-step stages)

    @property
    def keeps_state(self) -> bool:
        """Whether its runner holds something per stream (state links or kept inputs), so that a
        stream's requests must reach the replica holding it."""
        return bool(self.states or self.kept)

    @property
    def max_batch(self) -> int:
        """Requests a worker takes from the stage's queue to run as one session call: the stage's
        ``max_batch`` for an ONNX stage that batches stateless requests (Note: batched calls), else 1.
        (Streams' steps are batched at the entry instead: Note: state blocks.)"""
        stage = self.stage
        return stage.settings.max_batch if stage.batching is not None and not self.streams and stage.code is None else 1

    @property
    def batches(self) -> bool:
        """Whether the stage's runs are counted by their size (``StageStats.batch_sizes``): it
        batches the requests its worker takes, or the steps of streams batched at the entry."""
        return self.max_batch > 1 or (self.streams and self.stage.batching is not None)


def plan_stages(spec: PipelineSpec) -> tuple[list[StagePlan], dict[str, Endpoint]]:
    """The per-stage plans, and the bag key of each pipeline output."""
    finals = {t.name: spec.source_of(Endpoint(None, t.name)) for t in spec.outputs}
    last_use: dict[Endpoint, int] = {}
    fed_by_state = {Endpoint(s.stage, s.input) for s in spec.states} | {Endpoint(f.stage, f.input) for f in spec.step_flags}
    for i, stage in enumerate(spec.stages):
        for t in stage.inputs:
            if Endpoint(stage.name, t.name) not in fed_by_state:
                last_use[spec.source_of(Endpoint(stage.name, t.name))] = i
    keep = set(finals.values())
    pads = bag_pads(spec)
    plans = []
    for i, stage in enumerate(spec.stages):
        sources = tuple((t.name, spec.source_of(Endpoint(stage.name, t.name))) for t in stage.inputs if Endpoint(stage.name, t.name) not in fed_by_state)
        produced = [Endpoint(stage.name, t.name) for t in stage.outputs]
        drop = [k for k, last in last_use.items() if last == i and k not in keep]
        drop += [k for k in produced if k not in last_use and k not in keep]  # outputs nothing reads
        plans.append(StagePlan(stage, sources, tuple(t.name for t in stage.outputs), tuple(drop), spec.states_of(stage.name), bool(spec.states), pads,
                               spec.flags_of(stage.name), spec.kept_inputs(stage.name)))
    return plans, finals


def passes(plan: StagePlan, request: Request) -> bool:
    """Whether ``request`` passes the stage without a run: a later step of a stream (or a batch of
    later steps) at a stage that runs on the first step only (PipelineSpec, Note: first-step
    stages). Every engine asks it; a runner asked to run such a request does nothing."""
    if not plan.stage.first_step_only:
        return False
    batch = request.batch
    if batch is not None:
        return bool(len(batch)) and batch.steps[0] > 0  # a batch's steps share their kind (the scheduler's key)
    return request.step > 0 or request.step == CLOSE


def stage_failed(stage: str, request: int, cause: object, attempts: int | None = None, detail: str | None = None, held: str = "") -> StageError:
    """The error of a request a stage failed on: the one place its words are made (every engine,
    every batching mode); ``detail``: the whole text of a ``cause`` said short (onnxruntime's);
    ``held``: as ``StageError.held``."""
    after = f" after {attempts} attempts" if attempts is not None else ""
    head = f"stage '{stage}' failed on request {request}{after}: "
    return StageError(f"{head}{cause}", stage=stage, request=request, detail=None if detail is None else f"{head}{detail}", held=held)


@dataclass(frozen=True)
class Failure:
    """A request that failed in a stage run, or a member of a batch of steps that failed there and
    left the batch: made once, where the run happened, as plain data (a Ray actor returns it; each
    engine turns it into the request's error with :meth:`error`).

    Attributes:
        request: The failed request's id (a batch's member: its step's own id).
        stage: The stage it failed in.
        cause: What failed, in words: what the stage raised (or, with ``state_lost``, how the state died).
        member: A member of a batch of steps: it left the batch, and the batch went on without it.
        state_lost: The step's stream lost its state there (its actor died): the stream cannot go on.
        streams: With ``state_lost``: the streams whose state died.
        detail: The whole text of what the stage raised where ``cause`` says it short
            (onnxruntime's: Note: onnxruntime's words, said short, in ``onnxpipe._errors``).
        held: What of the state the stage held does not fit the step it failed (``StageError.held``), or "".
    """

    request: int
    stage: str
    cause: str
    member: bool = False
    state_lost: bool = False
    streams: tuple[int, ...] = ()
    detail: str | None = None
    held: str = ""

    @classmethod
    def of(cls, request: int, stage: str, error: BaseException, member: bool = False) -> Failure:
        """The failure of ``request`` in ``stage`` that raised ``error``: onnxruntime's said short,
        and what of its held state the stage found not to fit (``StageError.held``)."""
        cause, whole = ort_message(error), str(error)
        return cls(request, stage, cause, member, detail=None if cause == whole else whole, held=getattr(error, "held", ""))

    def error(self) -> StageError:
        """The error the request (or member) fails with."""
        if self.state_lost:
            return StreamError.state_lost(self.stage, self.streams, self.cause, request=self.request)
        return stage_failed(self.stage, self.request, self.cause, detail=self.detail, held=self.held)


@dataclass(slots=True)
class Call:
    """What one run of a stage did: the record a runner returns for every run, wherever it ran
    (Polygraphy's ``infer`` around ``infer_impl``; vLLM's ``ModelRunnerOutput``), and the one thing
    an engine records (``StageRecorder.record``). Plain data, so a Ray actor returns it as it is.

    Attributes:
        requests: The ids of the requests it ran: one request (a batch of streams' steps is one),
            or several stateless requests run as one session call (Note: batched calls).
        start, end: ``time.perf_counter()`` around the run, on the host that ran it.
        size: Requests or steps it ran: a batch of steps counts its members as they came in; 0
            when nothing ran (a stream's close, a batch whose members all failed before).
        failures: What failed in it (whole requests, or members that left a batch).
        waited: Seconds the run waited to form before it started: a worker's wait for its group
            to fill, or, in the first stage, a batch of steps' wait at the entry (set by the engine).
        copied: Bytes of streams' state the run copied (Note: state bytes copied).
    """

    requests: tuple[int, ...]
    start: float
    end: float
    size: int
    failures: tuple[Failure, ...] = ()
    waited: float = 0.0
    copied: int = 0
