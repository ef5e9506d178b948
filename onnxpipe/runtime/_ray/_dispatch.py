"""The data plane: requests in flight, the object references of their values, the calls to the
actors and what comes back (see Note: the data plane, Note: batches of steps and Note: faults,
``_ray._engine``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxpipe._errors import StageError, StreamError
from onnxpipe.runtime._channel import Closed, Full
from onnxpipe.runtime._ray._actor import Values, aligned, entry, inputs_of
from onnxpipe.runtime._ray._options import brief
from onnxpipe.runtime._ray._supervisor import Supervisor
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stage import CLOSE, Call, Request, StagePlan, claimed, passes, pinned_replica, stage_failed
from onnxpipe.runtime._stats import StageRecorder

__all__ = ["Dispatch", "kept_outputs"]

#: How often one request may be re-run after faults before it fails.
_MAX_ATTEMPTS = 8
#: Calls a replica may have submitted at once: one running, one waiting at the actor so that it
#: never waits for the driver; requests that come while both are out join its next call.
_CALLS_PER_REPLICA = 2


@dataclass
class _Flight:
    """A request in flight: the references of its values, which stages finished, which attempt."""

    request: Request
    # producer (None: the inputs) -> its values: the inputs by value (a dict), or (reference, index):
    # the index-th entry of the outputs of the call that ran it, or the whole object (index None:
    # the inputs, put once for several readers)
    bag: dict[str | None, Any] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    attempt: int = 0
    cursor: int = 0  # the next stage to submit (stages are submitted in pipeline order)
    done: bool = False
    left_entry: bool = False  # the first stage is done with it, and the entry hook was told


@dataclass
class _Lane:
    """The calls of one replica: those out, and the requests waiting for its next one."""

    calls: int = 0  # calls submitted and not yet returned
    outstanding: int = 0  # requests in those calls
    pending: list[tuple[_Flight, int]] = field(default_factory=list)  # (request, attempt) waiting for the next call

    @property
    def load(self) -> int:
        """Requests given to this replica and not yet returned: in its calls or waiting for one."""
        return self.outstanding + len(self.pending)


def kept_outputs(plans: Sequence[StagePlan], finals: Sequence[Endpoint]) -> list[tuple[str, ...]]:
    """Per stage, the outputs a later stage or the pipeline reads: what its actors return."""
    kept = []
    for i, plan in enumerate(plans):
        read = {key for p in plans[i + 1 :] for _, key in p.sources} | set(finals)
        kept.append(tuple(o for o in plan.outputs if Endpoint(plan.stage.name, o) in read))
    return kept


class Dispatch:
    """Moves requests through the stage actors. Its methods run under the engine's lock (Note:
    one lock, ``_ray._engine``); ``room`` is that lock's condition, which :meth:`submit` waits on.

    Args:
        ray: The ``ray`` module (connected).
        plans: The stage plans, in pipeline order.
        finals: The bag key of each pipeline output.
        supervisor: The replicas' life (which may take work, whose state died).
        recorders: Each stage's replicas' recorders (filled from what the actors return).
        room: The engine's lock's condition.
        events: Where call results go, for the engine's collector to hand back (:meth:`ran`).
        capacity: Requests in flight before :meth:`submit` waits.
        per_call: The most requests one call carries (``RayOptions.requests_per_call``).
    """

    def __init__(self, ray: Any, plans: Sequence[StagePlan], finals: Sequence[Endpoint], supervisor: Supervisor, recorders: list[list[StageRecorder]],
                 room: threading.Condition, events: Any, capacity: int, per_call: int) -> None:
        self._ray = ray
        self._exc = ray.exceptions
        self._plans = list(plans)
        self._finals = list(finals)
        self._supervisor = supervisor
        self._recorders = recorders
        self._room = room
        self._events = events
        self.capacity = capacity
        # Requests one call may carry: at least a batch, for a stage that batches.
        self._per_call = [max(per_call, p.stage.settings.max_batch) for p in self._plans]
        self._lanes = [[_Lane() for _ in range(p.stage.settings.replicas)] for p in self._plans]
        # What each stage reads from: the producers (None: the pipeline inputs; a stage's name) of its inputs.
        self._producers = [list(dict.fromkeys(key.stage for _, key in p.sources)) for p in self._plans]
        self._input_readers = sum(None in producers for producers in self._producers)
        self._final_producers = list(dict.fromkeys(key.stage for key in self._finals))  # what _finish fetches
        self._flights: dict[int, _Flight] = {}
        self._params: dict[int, tuple[Mapping[str, np.ndarray], Any]] = {}
        self.calls = [0] * len(self._plans)  # calls made, per stage
        self.high_water = [0] * len(self._plans)
        self._wall_to_perf = time.time() - time.perf_counter()
        self.closing = False
        #: Told once per request when the first stage is done with it (``Engine.watch_entry``), or None.
        self.entry_hook: Callable[[Request], None] | None = None

    # -- requests in ----------------------------------------------------------------------------

    def submit(self, request: Request, block: bool = True) -> None:
        """Start a request; blocks while the pipeline holds its capacity of requests (raises
        ``Full`` instead when ``block`` is false)."""
        with self._room:
            if not block and len(self._flights) >= self.capacity and not self.closing:
                raise Full
            while len(self._flights) >= self.capacity and not self.closing:
                self._room.wait()
            if self.closing:
                raise Closed
            flight = _Flight(request)
            self._flights[request.id] = flight
            # Read by several stages: put once, not sent with each call.
            flight.bag[None] = (self._ray.put(inputs_of(request)), None) if self._input_readers > 1 else inputs_of(request)
            self._dispatch(flight, 0)

    def _replica(self, i: int, request: Request) -> int:
        """The replica of stage ``i`` that runs ``request``: the live one with the fewest requests
        submitted or waiting (ties go round-robin by request id), or, for a stream in a stage with
        state, the replica holding the stream's state (``pinned_replica``, as in the thread engine).
        The one place a replica is chosen."""
        lanes = self._lanes[i]
        pinned = pinned_replica(self._plans[i], request, len(lanes))
        if pinned is not None:
            return pinned
        return min(self._supervisor.alive(i), key=lambda r: (lanes[r].load, (r - request.id) % len(lanes)))

    def _dispatch(self, flight: _Flight, start: int) -> None:
        """Run stages ``start`` onwards of a request (again, after a fault: a new attempt)."""
        flight.attempt += 1
        for i in range(start, len(self._plans)):
            flight.finished.discard(i)
        flight.cursor = start
        self._advance(flight)

    def _advance(self, flight: _Flight) -> None:
        """Queue the request for the replica of its next stage and submit what that replica can take.
        Stages are submitted in pipeline order, so what a stage reads is in the bag by then."""
        request = flight.request
        supervisor = self._supervisor
        while not flight.done and flight.cursor < len(self._plans):
            i = flight.cursor
            if i in supervisor.lost:
                name = self._plans[i].stage.name
                self._fail(flight, StageError(f"stage '{name}' cannot run request {request.id}: {supervisor.lost[i]}", stage=name, request=request.id))
                return
            if passes(self._plans[i], request):  # a later step at a first-step stage: no call (PipelineSpec, Note: first-step stages)
                flight.finished.add(i)
                flight.cursor += 1
                if i == 0:
                    self._left_entry(flight)
                continue
            r = self._replica(i, request)
            if request.step == CLOSE and not supervisor.holds(i, r, request.stream):
                flight.finished.add(i)  # nothing to free there: a stage without state, or a replica that died since
                flight.cursor += 1
                continue
            lost = supervisor.state_lost(i, r, request) if request.step != CLOSE else None
            if lost is not None:
                self._fail(flight, lost)
                return
            self._lanes[i][r].pending.append((flight, flight.attempt))
            self.high_water[i] = max(self.high_water[i], self.waiting(i))
            self._flush(i, r)
            return
        if not flight.done and len(flight.finished) == len(self._plans):  # a close with nothing left to free
            self._finish(flight)

    def _flush(self, i: int, r: int) -> None:
        """Submit the requests waiting for replica ``r`` of stage ``i`` as one call, if it has room."""
        lane = self._lanes[i][r]
        rep = self._supervisor.replicas[i][r]
        while lane.pending and lane.calls < _CALLS_PER_REPLICA and rep.state != "dead":
            members = [(f, a) for f, a in lane.pending[: self._per_call[i]] if not f.done and a == f.attempt and self._claimed(f)]
            del lane.pending[: self._per_call[i]]
            if not members:
                continue
            self._call(i, r, members)
            for flight, _ in members:
                flight.cursor = i + 1
                self._advance(flight)

    def _claimed(self, flight: _Flight) -> bool:
        """Whether its first stage may run the request (``claimed``); one withdrawn meanwhile is
        finished here, having run nowhere (Note: withdrawn requests, ``_pipeline``)."""
        if flight.request.claim is None or claimed(flight.request):
            return True
        self._complete(flight)
        return False

    def _call(self, i: int, r: int, members: list[tuple[_Flight, int]]) -> None:
        """One actor call running stage ``i`` on ``members``: each reads object references from its
        bag (Ray resolves those given as arguments of the call, so each object is given once)."""
        plan, lane = self._plans[i], self._lanes[i][r]
        objects: list[Any] = []
        positions: dict[Any, int] = {}

        def position(ref: Any) -> int:
            if ref not in positions:
                positions[ref] = len(objects)
                objects.append(ref)
            return positions[ref]

        calls = []
        for flight, _ in members:
            request = flight.request
            sources: list[tuple[Any, ...]] = []
            if request.step != CLOSE:
                for producer in self._producers[i]:
                    held = flight.bag.get(producer)
                    if held is None:
                        continue  # a first-step stage a later step passed: what the stage kept stands for it
                    sources.append(("v", held) if isinstance(held, dict) else ("o", position(held[0]), held[1]))
            params = self._params_ref(request, plan)
            stream = None if request.stream is None else (request.stream, request.step, dict(request.dims), request.length, request.group)
            lost = self._supervisor.members_lost(i, r, request) if request.batch is not None else None
            calls.append((request.id, None if params is None else position(params), stream, sources, lost))
        refs = self._supervisor.replicas[i][r].actor.run.options(num_returns=2).remote(calls, *objects)
        for j, (flight, _) in enumerate(members):
            flight.bag[plan.stage.name] = (refs[0], j)
        lane.calls += 1
        lane.outstanding += len(members)
        self.calls[i] += 1
        refs[1].future().add_done_callback(lambda f, m=members, i=i, r=r, o=refs[0]: self._events.put(("run", m, i, r, f, o)))

    def _params_ref(self, request: Request, plan: StagePlan) -> Any:
        """The stage's parameter snapshot as one object, put once per ``set_params`` (see Request.params)."""
        own = request.params.get(plan.stage.name)
        if not own:
            return None
        hit = self._params.get(id(own))
        if hit is None or hit[0] is not own:
            if len(self._params) > 64:
                self._params.clear()  # calls already submitted hold their own references
            hit = self._params[id(own)] = (own, self._ray.put(dict(own)))
        return hit[1]

    # -- what comes back ------------------------------------------------------------------------

    def ran(self, members: list[tuple[_Flight, int]], i: int, r: int, future: Any, outputs: Any) -> None:
        """An actor call returned (or failed): record its runs, move its requests on."""
        lane = self._lanes[i][r]
        lane.calls -= 1
        lane.outstanding -= len(members)
        error = future.exception()
        if error is not None:  # the outputs object holds the same error: read it, or Ray logs it as unhandled
            try:
                self._ray.get(outputs, timeout=0)
            except self._exc.RayError:
                pass
        current = {flight.request.id: flight for flight, attempt in members if not flight.done and attempt == flight.attempt}
        if error is None:
            records, held = future.result()
            for record in records:
                self._apply(record, i, r, current)
        for j, (flight, attempt) in enumerate(members):
            if flight.done or attempt != flight.attempt:
                continue  # an earlier attempt of a request that was re-run
            if i == 0:
                self._left_entry(flight)
            if error is None:
                flight.request.held.extend(held[j])
                flight.finished.add(i)
                if len(flight.finished) == len(self._plans):
                    self._finish(flight)
            elif not self._is_fault(error):
                self._fail(flight, stage_failed(self._plans[i].stage.name, flight.request.id, error))
            else:
                self._fault(flight, i, r, error)
        self._flush(i, r)

    def _apply(self, call: Call, i: int, r: int, current: Mapping[int, _Flight]) -> None:
        """One run an actor reported: its failures given to the driver's requests (a batch's
        members that left it leave the driver's copy too: Note: batches of steps), and its
        statistics recorded as the thread engine records them."""
        requests = [current[rid].request for rid in call.requests if rid in current]
        if not requests:
            return  # earlier attempts only
        batch = requests[0].batch  # a batch of steps runs alone: its members' failures are its own
        at = {rid: j for j, rid in enumerate(batch.ids)} if batch is not None else {}
        gone: dict[int, BaseException] = {}
        for failure in call.failures:
            if failure.member and failure.request in at:
                gone[at[failure.request]] = failure.error()
            elif not failure.member and failure.request in current:
                request = current[failure.request].request
                request.error = request.error or failure.error()
        if gone:
            requests[0].batch = batch.without(gone)  # type: ignore[union-attr]
        if len(requests) < len(call.requests):  # some were earlier attempts: not this run's to count
            call.requests, call.size = tuple(request.id for request in requests), len(requests)
            call.failures = tuple(f for f in call.failures if f.request in call.requests)
        call.start, call.end = call.start - self._wall_to_perf, call.end - self._wall_to_perf  # Clocks of other hosts may put a start before the last end.
        if i == 0 and batch is not None:
            call.waited = batch.waited
        self._recorders[i][r].record(call, requests)

    def _is_fault(self, error: BaseException) -> bool:
        """Whether a failed call is Ray's doing (an actor, a node, a value lost), not the stage's."""
        faults = (self._exc.RayActorError, self._exc.ObjectLostError, self._exc.NodeDiedError, self._exc.WorkerCrashedError,
                  self._exc.LocalRayletDiedError)
        if any(isinstance(e, faults) for e in (error, getattr(error, "cause", None))):
            return True
        return not isinstance(error, self._exc.RayTaskError)

    def _fault(self, flight: _Flight, i: int, r: int, error: BaseException) -> None:
        """A call failed because of Ray (an actor died, a value was lost): re-run the request."""
        if isinstance(error, self._exc.RayActorError):
            self._supervisor.suspect(i, r, error)
        if flight.attempt >= _MAX_ATTEMPTS:
            self._fail(flight, stage_failed(self._plans[i].stage.name, flight.request.id, brief(error), attempts=flight.attempt))
            return
        if flight.request.step == CLOSE:  # the state it was to free died with the actor
            flight.finished.add(i)
            if len(flight.finished) == len(self._plans):
                self._finish(flight)
            return
        lost = next((e for e in (error, getattr(error, "cause", None)) if isinstance(e, self._exc.ObjectLostError)), None)
        first = self._lost_stage(flight, lost) if lost is not None else min(set(range(len(self._plans))) - flight.finished)
        steps = flight.request.stream is not None or flight.request.batch is not None
        if steps and any(self._plans[k].keeps_state for k in range(first, len(self._plans)) if k in flight.finished or k == i):
            self._fail_applied(flight, i, r, error)
            return
        self._dispatch(flight, first)

    def _fail_applied(self, flight: _Flight, i: int, r: int, error: BaseException) -> None:
        """A step a stage with state ran (or was running) when the fault came: running it again
        would apply the step twice, or run it on a restarted actor that holds no state. The stream
        learns which (see _stream.py)."""
        request = flight.request
        name = self._plans[i].stage.name
        if self._plans[i].states and isinstance(error, self._exc.RayActorError):
            batch = request.batch
            streams = tuple(batch.streams) if batch is not None else () if request.stream is None else (request.stream,)
            self._fail(flight, self._supervisor.state_lost(i, r, request) or StreamError.state_lost(
                name, streams, f"its actor died ({brief(error)})", request=request.id))
        else:
            self._fail(flight, stage_failed(name, request.id, brief(error)))

    def _lost_stage(self, flight: _Flight, lost: Any) -> int:
        """The stage to run a request again from when a value it needed was lost (with its node):
        the stage whose outputs were lost, or the first stage when the lost value was the request's
        inputs (put again from the driver's copy) or cannot be told."""
        lost_hex = getattr(lost, "object_ref_hex", None)
        for k, plan in enumerate(self._plans):
            held = flight.bag.get(plan.stage.name)
            if held is not None and held[0].hex() == lost_hex:
                return k
        held = flight.bag.get(None)
        if isinstance(held, tuple) and held[0].hex() == lost_hex:
            flight.bag[None] = (self._ray.put(inputs_of(flight.request)), None)
        return 0

    def replica_dead(self, i: int, r: int) -> None:
        """Replica ``r`` of stage ``i`` will not come back: what waited for it, and every request
        that still needs stage ``i``, goes again to the live replicas (or fails: the stage is lost)."""
        self._lanes[i][r].pending.clear()
        for flight in list(self._flights.values()):
            if i not in flight.finished and not flight.done:
                self._dispatch(flight, min(set(range(len(self._plans))) - flight.finished))

    def _finish(self, flight: _Flight) -> None:
        request = flight.request
        if request.error is None and request.step != CLOSE and request.size:
            held = [flight.bag[p] for p in self._final_producers]
            try:
                # The pipeline inputs may be held by value (an output that is an input passed through).
                got = iter(self._ray.get([h[0] for h in held if not isinstance(h, dict)]))
                fetched: list[Values] = [h if isinstance(h, dict) else entry(next(got), h[1]) for h in held]
            except self._exc.RayError as e:  # an output was lost with its node: run the request again
                self._fault(flight, len(self._plans) - 1, 0, e)
                return
            merged, _ = aligned(fetched)
            request.values = {key: merged[(key.stage, key.tensor)] for key in self._finals}
        self._complete(flight)

    def _fail(self, flight: _Flight, error: StageError) -> None:
        flight.request.error = flight.request.error or error
        self._complete(flight)

    def _left_entry(self, flight: _Flight) -> None:
        """The first stage is done with the request (ran it, failed it, passed it or never will):
        the entry hook is told, once (Note: continuous batching, ``scheduling``; under the engine's
        lock, which the hook never waits on: it takes the scheduler's own lock alone)."""
        if not flight.left_entry and self.entry_hook is not None:
            flight.left_entry = True
            self.entry_hook(flight.request)

    def _complete(self, flight: _Flight) -> None:
        self._left_entry(flight)  # one that ended before its first stage was done with it (lost, withdrawn, failed)
        flight.done = True
        flight.bag.clear()
        with self._room:
            self._flights.pop(flight.request.id, None)
            self._room.notify()
        done = flight.request.done
        assert done is not None
        done(flight.request)

    # -- what it holds --------------------------------------------------------------------------

    def waiting(self, i: int) -> int:
        """Requests given to stage ``i`` beyond one running per replica."""
        return sum(lane.load for lane in self._lanes[i]) - len(self._lanes[i])

    def stop(self) -> bool:
        """Take no more requests, and wake those waiting for room; False if stopped already."""
        with self._room:
            if self.closing:
                return False
            self.closing = True
            self._room.notify_all()
        return True

    def left(self) -> list[Request]:
        """The requests that did not finish (once nothing comes back any more), forgotten here."""
        with self._room:
            left = [f.request for f in self._flights.values() if not f.done]
            self._flights.clear()
        return left
