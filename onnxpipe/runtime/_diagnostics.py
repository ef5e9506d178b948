"""What a running pipeline's engine says about its workers now (:meth:`Pipeline.diagnostics`).

Statistics (``_stats``) say how the stages performed; diagnostics say where each replica runs and
what it holds: its process (and, on Ray, its node and private folder), the streams whose state it
keeps, and how its batches of steps reused their state. For tests, benchmarks and operators; the
engines fill it in (each in its own way: a thread engine reads its runners, the Ray engine asks its
actors), so nobody needs to reach into an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Diagnostics", "ReplicaDiagnostics", "StageDiagnostics"]


@dataclass(frozen=True)
class ReplicaDiagnostics:
    """One replica of one stage, now.

    Attributes:
        replica: Its number in its stage (from 0).
        runs: Requests (or streams' steps) it ran since load or ``reset_stats`` (failed ones included).
        streams: The streams whose state it holds, in order; ``None`` when its Ray actor did not
            answer (it died, or is being restarted).
        reused: Batched steps it fed the block of state the step before left, as it was (no copy;
            see docs/batching.md); ``None`` when its actor did not answer.
        state_bytes: Bytes of the state arrays it holds, over all its streams (a block of
            batched steps counted once); ``None`` when its actor did not answer.
        pid: The process it runs in (this one, for the thread engine).
        state: ``"ok"``; on Ray also ``"suspect"`` (its actor died and is being probed) or
            ``"dead"`` (it will not come back).
        node_id, address, labels: On Ray, its node's id, address and labels (Ray's own
            ``ray.io/`` labels left out); ``None``, ``None`` and ``{}`` for the thread engine.
        folder: On Ray, its actor's private folder in its node's temporary folder
            (``onnxpipe-ray-RUN-STAGE-REPLICA``, removed on close); ``None`` for the thread engine.
    """

    replica: int
    runs: int
    streams: tuple[int, ...] | None
    reused: int | None
    state_bytes: int | None
    pid: int | None
    state: str = "ok"
    node_id: str | None = None
    address: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    folder: str | None = None


@dataclass(frozen=True)
class StageDiagnostics:
    """One stage, now.

    Attributes:
        stage: Its name.
        replicas: Each replica, in order.
        calls: On Ray, the actor calls made to its replicas since load: fewer than its requests
            when requests queued up for a busy replica and went in one call
            (``RayOptions.requests_per_call``); ``None`` for the thread engine, which hands each
            request over alone.
    """

    stage: str
    replicas: tuple[ReplicaDiagnostics, ...]
    calls: int | None = None


@dataclass(frozen=True)
class Diagnostics:
    """A running pipeline's workers, now (:meth:`Pipeline.diagnostics`).

    Attributes:
        engine: Where the stages run (``"thread"``, ``"ray"``).
        in_process: The stages' sessions are in this process (the thread engine): stages can run
            alone here (``Pipeline.idle_runners``), and ``stats()`` reads this process's memory.
        capacity: The requests the engine holds in flight before ``submit`` waits (its queues and
            workers): what ``Pipeline.map`` keeps in flight by default.
        stages: Each stage, in pipeline order.
    """

    engine: str
    in_process: bool
    capacity: int
    stages: tuple[StageDiagnostics, ...]
