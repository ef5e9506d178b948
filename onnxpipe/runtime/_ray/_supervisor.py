"""The supervisor: each stage actor's life as the driver sees it (see Note: faults, ``_ray._engine``).

A replica is ``ok`` until a call finds its actor dead; it is then ``suspect`` and probed (Ray
restarts the actor, up to ``max_restarts``) until it answers (``ok`` again, as a new incarnation
that holds no stream's state) or cannot come back (``dead``: no live node can take it, it was not
back within ``restart_timeout_s``, or its restarted actor could not start). Once every replica of a
stage is dead, the stage is lost. Which incarnation of a replica began each stream's state is
kept here too, so a stream whose state died says so.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from onnxpipe._errors import StreamError
from onnxpipe.runtime._ray._options import RayOptions, brief
from onnxpipe.runtime._ray._placement import Placement
from onnxpipe.runtime._stage import Request, StagePlan

__all__ = ["Replica", "Supervisor", "TICK_S"]

#: How often the supervisor looks at the replicas it suspects (and the collector wakes up).
TICK_S = 0.2


@dataclass
class Replica:
    """The driver's view of one stage actor's life."""

    actor: Any
    info: dict[str, Any] = field(default_factory=dict)  # what it said of itself when it last answered a probe (StageActor.ready)
    state: str = "ok"  # ok | suspect (died, being probed) | dead
    since: float = 0.0
    cause: str = ""
    probe: int = 0  # generation of the probe in progress
    incarnation: int = 0  # counts deaths: a stream's state lives in one incarnation


class Supervisor:
    """Owns the replicas' state machine (see the module docstring). Its methods run under the
    engine's lock (Note: one lock, ``_ray._engine``).

    Args:
        placement: Where the actors run (to probe them, and to know whether a node can take them).
        plans: The stage plans, in pipeline order.
        options: The engine's options (``restart_timeout_s``).
        infos: What each started actor said of itself, per stage, per replica.
        events: Where probe results go, for the engine's collector to hand back (``probed``).
        on_dead: Called with ``(stage, replica)`` once a replica is dead: its work goes elsewhere.
    """

    def __init__(self, placement: Placement, plans: Sequence[StagePlan], options: RayOptions, infos: Sequence[Sequence[dict[str, Any]]],
                 events: queue.SimpleQueue[tuple[Any, ...]], on_dead: Callable[[int, int], None]) -> None:
        self._placement = placement
        self._plans = list(plans)
        self._options = options
        self._events = events
        self._on_dead = on_dead
        self._exc = placement.ray.exceptions
        self.replicas = [[Replica(actor, dict(info)) for actor, info in zip(actors, row, strict=True)]
                         for actors, row in zip(placement.actors, infos, strict=True)]
        self.lost: dict[int, str] = {}  # stage index -> why it cannot come back
        self._incarnations: dict[tuple[int, int], int] = {}  # (stage, stream) -> incarnation of the replica holding its state
        self._watched = 0.0

    def alive(self, i: int) -> list[int]:
        """The replicas of stage ``i`` that may take work: those ok, else those not dead (being probed)."""
        row = self.replicas[i]
        return [r for r, rep in enumerate(row) if rep.state == "ok"] or [r for r, rep in enumerate(row) if rep.state != "dead"]

    def live(self) -> list[Replica]:
        """Every replica that is ok now."""
        return [rep for row in self.replicas for rep in row if rep.state == "ok"]

    # -- faults --------------------------------------------------------------------------------

    def suspect(self, i: int, r: int, error: BaseException) -> None:
        """A call found replica ``r`` of stage ``i`` dead: probe it until it is back or dead."""
        rep = self.replicas[i][r]
        if rep.state != "ok":
            return
        rep.state, rep.since, rep.cause = "suspect", time.monotonic(), brief(error)
        rep.incarnation += 1  # the streams whose state it held lost it
        self._probe(i, r)

    def _probe(self, i: int, r: int) -> None:
        rep = self.replicas[i][r]
        rep.probe += 1
        generation = rep.probe
        self._placement.ping(rep.actor).future().add_done_callback(lambda f: self._events.put(("probe", i, r, generation, f)))

    def probed(self, i: int, r: int, generation: int, future: Any) -> None:
        """A probe answered (or failed): the replica is back, dead, or still to be probed."""
        rep = self.replicas[i][r]
        if rep.state != "suspect" or generation != rep.probe:
            return
        error = future.exception()
        if error is None and not future.result()["error"]:
            rep.state, rep.info = "ok", future.result()
        elif error is None:
            self._dead(i, r, f"its restarted actor could not start: {future.result()['error']}")
        elif isinstance(error, self._exc.ActorUnavailableError):
            self._probe(i, r)
        else:
            self._dead(i, r, f"{rep.cause}; it could not be restarted: {brief(error)}")

    def watch(self) -> None:
        """Declare dead the replicas that cannot come back (no node for them, or too long away)."""
        now = time.monotonic()
        suspects = [(i, r) for i, row in enumerate(self.replicas) for r, rep in enumerate(row) if rep.state == "suspect"]
        if not suspects or now - self._watched < TICK_S:
            return
        self._watched = now
        placement = self._placement
        for i, r in suspects:
            rep = self.replicas[i][r]
            if not placement.can_place(self._plans[i]):
                self._dead(i, r, f"{rep.cause}; no live node can take it: it asks for {placement.describe_ask(self._plans[i])}; "
                                 f"the cluster has: {placement.cluster()}")
            elif now - rep.since > self._options.restart_timeout_s:
                self._dead(i, r, f"{rep.cause}; it was not back within {self._options.restart_timeout_s:g} s")

    def _dead(self, i: int, r: int, why: str) -> None:
        rep = self.replicas[i][r]
        rep.state, rep.cause = "dead", why
        if all(x.state == "dead" for x in self.replicas[i]):
            self.lost[i] = f"its actor died ({why})"
        self._on_dead(i, r)

    # -- where streams' state lives --------------------------------------------------------------

    def state_lost(self, i: int, r: int, request: Request) -> StreamError | None:
        """For a stream's step in a stage with state: the error to fail it with when the replica
        holding the stream's state died since the stream began there (its state died with it)."""
        if request.stream is None or not self._plans[i].keeps_state:
            return None
        why = self._lost_why(i, r, request.stream, request.step)
        return None if why is None else StreamError.state_lost(self._plans[i].stage.name, (request.stream,), why, request=request.id)

    def members_lost(self, i: int, r: int, request: Request) -> dict[int, str]:
        """For a batch of steps in a stage with state: the members whose state died, by request id (see :meth:`state_lost`)."""
        batch = request.batch
        if batch is None or not self._plans[i].keeps_state:
            return {}
        lost = {}
        for rid, stream, step in zip(batch.ids, batch.streams, batch.steps, strict=True):
            why = self._lost_why(i, r, stream, step)
            if why is not None:
                lost[rid] = why
        return lost

    def _lost_why(self, i: int, r: int, stream: int, step: int) -> str | None:
        rep = self.replicas[i][r]
        key = (i, stream)
        if step == 0:
            self._incarnations[key] = rep.incarnation
        if rep.state == "dead" or self._incarnations.get(key) != rep.incarnation:
            return f"the actor holding it (replica {r}) died ({rep.cause or 'restarted'})"
        return None

    def holds(self, i: int, r: int, stream: int | None) -> bool:
        """Whether replica ``r`` of stage ``i`` holds a stream's state for its close to free (the
        incarnation that began it, still ok); the stream is forgotten here either way."""
        rep = self.replicas[i][r]
        began = self._incarnations.pop((i, stream), None) if stream is not None else None
        return self._plans[i].keeps_state and began == rep.incarnation and rep.state == "ok"
