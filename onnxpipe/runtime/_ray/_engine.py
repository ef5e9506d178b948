"""The Ray engine: each stage replica is a Ray actor, on a node its settings ask for.

Ray is imported only when this engine is started (``load(..., engine="ray")``), so importing the
runtime never pulls it in; without it, starting the engine is one error naming the extra to install.

Note: placement.
    One actor per stage replica, asking Ray for ``num_cpus`` = the stage's intra-op threads (its
    onnxruntime pool is sized to the same number: Ray does not size it), ``num_gpus=1`` for a GPU
    target, and, when the stage's settings name a ``host``, a label selector
    ``{"onnxpipe/host": host}``: only nodes started with ``ray start --labels onnxpipe/host=NAME``
    take it. Before any actor is made, every stage is checked against the nodes the cluster has
    (``ray.nodes()``): a stage no live node can take fails ``load`` at once, naming the stage, what
    it asks for, and each node's labels and resources; a stage that is feasible but not placed
    within ``RayOptions.placement_timeout_s`` (the resources are taken) fails the same way.

Note: the data plane.
    The driver never fetches an intermediate tensor: it submits a request's stages in pipeline
    order, each actor call taking the object references of what it reads: the request's pipeline
    inputs (sent with the call, or put once when several stages read them), and the outputs of any
    earlier stage it reads (skip edges and fan-out are references handed to several calls). Ray
    moves the objects from the producing node to the consuming one (objects up to Ray's inline
    limit, 100 KiB by default, travel in the call messages through the driver's process); only the
    timing records and the pipeline outputs are fetched.

    Each object and each call costs Ray bookkeeping through the driver, which owns them, and on one
    host that CPU is taken from the stages. So a stage returns the outputs that a later stage or
    the pipeline reads as ONE object, not one per tensor, and calls are coalesced: a replica has at
    most two calls out (one running, one waiting at the actor, so it never waits for the driver);
    requests that come for it meanwhile wait in the driver and go together in its next call (at
    most ``RayOptions.requests_per_call``, by default ``queue_depth``, of them), which runs them
    one after the other and returns their outputs as one object. An idle pipeline sends each
    request at once; a busy one sends fewer, larger calls (``StageDiagnostics.calls``). A stage
    reading one request's outputs from such an object receives the whole object (on one node it is
    mapped, not copied). The pipeline's capacity bounds the requests in flight, as in the thread
    engine; replicas of a stage share its work (``Dispatch._replica``, the one place a replica
    is chosen for a request). Only each run's record (the runner's ``Call``, as the thread engine
    records it) comes back with the outputs.

Note: the bundle an actor reads, and Ray's log line about it.
    The driver puts the packed bundle into Ray's object store once (``ray.put``) and hands each
    actor a reference to it as a constructor argument. Ray logs at error level, once per actor,
    that such an actor cannot restart if the argument is lost (ray-project/ray#53727). Here it is
    not lost while the pipeline can use it: the engine holds the reference for as long as it runs
    (``Placement._payload``), and the object's primary copy lives in the object store of the driver's
    node, so it goes only with the driver, and the pipeline with it. A node that dies takes only
    its own copy: an actor restarted elsewhere fetches the object again from the driver's node
    (tests/runtime/test_ray_engine.py kills the node holding a stage and its copy; the stage's actor
    restarts on another node and the requests complete). Passing the reference inside a tuple
    logs the same line (measured with Ray 2.60), and the alternatives (a method call after
    construction that every restart must repeat, a helper actor holding the reference) add a step
    to the restart path to hide a log line, so the line stays (docs/limitations.md).

Note: batches of steps.
    A batch of streams' steps (``Request.batch``) is one request here too: one actor call per
    stage, one session call in it. Its layout (members, rows, padding) travels WITH its values,
    under ``_LAYOUT`` in the inputs and in each stage's outputs, because members may leave the
    batch in any stage (they failed there: ``StageRunner``, Note: state blocks) after the driver
    has submitted the next stages' calls. An actor brings every value it reads to the newest
    layout among them (the one with the fewest members: members only leave) by taking the rows of
    the members still in it (:func:`_aligned`), runs, and returns its outputs with the batch's
    layout after its run and the members that failed there, which the driver removes from its own
    copy of the batch for the exit. A member whose state died with an actor fails alone, as a
    stream stepping alone does.

Note: faults.
    A call that fails because its actor died (process killed, node gone) or because a value it read
    was lost re-runs the request: from the stage that failed, or, when a value was lost with its
    node, from the stage that made it (``ObjectLostError`` names the object). Actors restart
    (``max_restarts``), each re-reading and re-checking the bundle; a request completes once, in
    order. A replica that died is probed; one that is not back within ``restart_timeout_s``, or for
    which no live node has the labels and resources it needs, is dead, and once every replica of a
    stage is dead, the requests still needing it fail with :class:`StageError` naming the stage and
    the cause. An error raised by the stage itself (a bad input) fails that request only, as in the
    thread engine.
"""


from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from onnxpipe._errors import ConfigError
from onnxpipe.runtime._diagnostics import ReplicaDiagnostics, StageDiagnostics
from onnxpipe.runtime._ortapi import SessionFacts
from onnxpipe.runtime._ray._dispatch import Dispatch, kept_outputs
from onnxpipe.runtime._ray._options import RayOptions, import_ray
from onnxpipe.runtime._ray._placement import Placement
from onnxpipe.runtime._ray._supervisor import TICK_S, Replica, Supervisor
from onnxpipe.runtime._stage import Request, Runner, StagePlan, plan_stages
from onnxpipe.runtime._stats import StageRecorder
from onnxpipe.runtime.bundle import Bundle

__all__ = ["RayEngine"]


class RayEngine:
    """Stage replicas as Ray actors (see the notes above); the pipeline's engine boundary.

    Args:
        bundle: The checked bundle (checked on the driver before anything ships).
        plans: The stage plans, in pipeline order.
        target: Run every stage on this target instead of its own.
        queue_depth: Requests that may wait in front of each stage (bounds the requests in flight).
        trace: Record every stage run for a timeline.
        address: The cluster's address (``"auto"``, ``"HOST:PORT"``); None: the Ray this process is
            connected to, or ``"auto"``.
        options: Placement, shipping and supervision (:class:`RayOptions`).
        source: The bundle's path (read by the actors when ``options.shared``).

    Raises:
        ConfigError: Ray is missing, the cluster cannot be reached, or a stage cannot be placed.
        BundleError: an actor refused the bundle or could not make its session.
    """

    name: ClassVar[str] = "ray"
    #: Its sessions are made in the actors' processes (see ``_engine.EngineClass``).
    in_process: ClassVar[bool] = False
    takes_address: ClassVar[bool] = True

    @classmethod
    def start(cls, bundle: Bundle, plans: Sequence[StagePlan], *, target: str | None, queue_depth: int, trace: bool, address: str | None = None,
              ray_options: RayOptions | None = None, source: str | os.PathLike[str] | None = None) -> RayEngine:
        """Start the stages of ``bundle`` as Ray actors (the engine registry's way in); see the class."""
        return cls(bundle, plans, target, queue_depth, trace, address, ray_options or RayOptions(), source)

    def __init__(self, bundle: Bundle, plans: Sequence[StagePlan], target: str | None, queue_depth: int, trace: bool,
                 address: str | None, options: RayOptions, source: str | os.PathLike[str] | None = None) -> None:
        if queue_depth < 1:
            raise ConfigError(f"queue_depth must be at least 1, got {queue_depth}")
        ray = self._ray = import_ray()
        self._plans = list(plans)
        self._recorders = [[StageRecorder(p.stage.name, r, trace, batches=p.batches) for r in range(p.stage.settings.replicas)] for p in self._plans]
        self._queue_depth = queue_depth
        if options.requests_per_call is not None and options.requests_per_call < 1:
            raise ConfigError(f"RayOptions.requests_per_call must be at least 1, got {options.requests_per_call}")
        finals = list(plan_stages(bundle.spec)[1].values())
        self._lock = threading.RLock()
        self._events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=address or "auto", logging_level="warning")
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"cannot connect to the Ray cluster at '{address or 'auto'}': {e}") from e
        self._placement = Placement(ray, self._plans, options)
        try:
            self._placement.check_feasible()
            infos = self._placement.start(bundle, target, source, kept_outputs(self._plans, finals))
        except BaseException:
            self._placement.kill_all()
            self._disconnect()
            raise
        self._session_facts = Placement.session_facts(infos)
        self._supervisor = Supervisor(self._placement, self._plans, options, infos, self._events, self._replica_dead)
        self._dispatch = Dispatch(ray, self._plans, finals, self._supervisor, self._recorders, threading.Condition(self._lock), self._events,
                                  capacity=sum(queue_depth + p.stage.settings.replicas for p in self._plans), per_call=options.requests_per_call or queue_depth)
        self._thread = threading.Thread(target=self._collect, name="onnxpipe-ray-collector", daemon=True)
        self._thread.start()

    def _replica_dead(self, i: int, r: int) -> None:
        self._dispatch.replica_dead(i, r)

    def _collect(self) -> None:
        """The collector thread: hands call results to the data plane and probe results to the
        supervisor, and lets the supervisor watch its suspects, under the engine's lock."""
        while True:
            try:
                event = self._events.get(timeout=TICK_S)
            except queue.Empty:
                event = None
            if event is not None and event[0] == "stop":
                return
            with self._lock:
                if event is not None and event[0] == "run":
                    self._dispatch.ran(*event[1:])
                elif event is not None and event[0] == "probe":
                    self._supervisor.probed(*event[1:])
                self._supervisor.watch()

    # -- the engine boundary --------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Requests in flight before :meth:`submit` waits: per stage, ``queue_depth`` waiting and one per replica."""
        return self._dispatch.capacity

    def submit(self, request: Request, block: bool = True) -> None:
        """Start a request; blocks while the pipeline holds its capacity of requests (raises
        ``Full`` instead when ``block`` is false)."""
        self._dispatch.submit(request, block)

    def watch_entry(self, callback: Callable[[Request], None]) -> bool:
        """Have the data plane call ``callback(request)`` once per request when the first stage is
        done with it (see ``Engine.watch_entry``): on the collector thread when the first stage's
        actor call returns, under the engine's lock, which the scheduler's hook never waits on;
        told: ``True``."""
        self._dispatch.entry_hook = callback
        return True

    def close(self) -> list[Request]:
        """Remove the actors' files, kill the actors, return the requests that did not finish."""
        if not self._dispatch.stop():
            return []
        self._events.put(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        self._placement.shut_down([rep.actor for rep in self._supervisor.live()])
        left = self._dispatch.left()
        self._disconnect()
        return left

    def _disconnect(self) -> None:
        if self._owns_ray:
            self._ray.shutdown()

    def recorders(self) -> list[list[StageRecorder]]:
        """Each stage's replicas' recorders, filled from the records the actors return."""
        return self._recorders

    def queues(self) -> list[tuple[int, int, int]]:
        """Each stage's calls waiting for a replica: now, high water, capacity."""
        return [(max(0, self._dispatch.waiting(i)), self._dispatch.high_water[i], self._queue_depth) for i in range(len(self._plans))]

    def runners(self) -> list[list[Runner]]:
        """No local runners: the sessions live in the actors."""
        return [[] for _ in self._plans]

    def session_facts(self) -> list[SessionFacts]:
        """The first replica's session facts of each ONNX stage, in pipeline order (as its actor said when it started)."""
        return self._session_facts

    def resident_bytes(self) -> int | None:
        """None: the sessions run in the actors' processes."""
        return None

    def diagnostics(self) -> list[StageDiagnostics]:
        """Each stage's replicas: where each runs (each live actor is asked: Ray may have restarted
        one elsewhere without a call failing), what it holds, and the calls made to the stage."""
        with self._lock:
            rows = [list(row) for row in self._supervisor.replicas]
            calls = list(self._dispatch.calls)
        live = [rep for row in rows for rep in row if rep.state == "ok"]
        answers = dict(zip(map(id, live), self._placement.diagnose([rep.actor for rep in live]), strict=True))
        nodes = self._placement.node_facts()
        return [StageDiagnostics(plan.stage.name, tuple(self._replica_facts(i, r, rep, answers.get(id(rep)), nodes) for r, rep in enumerate(row)), calls[i])
                for i, (plan, row) in enumerate(zip(self._plans, rows, strict=True))]

    def _replica_facts(self, i: int, r: int, rep: Replica, answer: dict[str, Any] | None,
                       nodes: dict[str, tuple[str | None, dict[str, str]]]) -> ReplicaDiagnostics:
        """One replica's diagnostics: from its actor's answer, or, when it gave none, from what it last said."""
        node_id = (answer or rep.info).get("node_id")
        address, labels = nodes.get(node_id, (None, {}))  # type: ignore[arg-type]
        return ReplicaDiagnostics(
            r, self._recorders[i][r].count, None if answer is None else tuple(answer["streams"]), None if answer is None else answer["reused"],
            None if answer is None else answer["state_bytes"], (answer or rep.info).get("pid"), rep.state, node_id, address, labels,
            self._placement.folder(i, r))
