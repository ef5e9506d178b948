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
    request at once; a busy one sends fewer, larger calls (:meth:`RayEngine.calls`). A stage
    reading one request's outputs from such an object receives the whole object (on one node it is
    mapped, not copied). The pipeline's capacity bounds the requests in flight, as in the thread
    engine; replicas of a stage share its work (:meth:`RayEngine._replica`, the one place a replica
    is chosen for a request).

Note: the bundle an actor reads, and Ray's log line about it.
    The driver puts the packed bundle into Ray's object store once (``ray.put``) and hands each
    actor a reference to it as a constructor argument. Ray logs at error level, once per actor,
    that such an actor cannot restart if the argument is lost (ray-project/ray#53727). Here it is
    not lost while the pipeline can use it: the engine holds the reference for as long as it runs
    (``self._payload``), and the object's primary copy lives in the object store of the driver's
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

import dataclasses
import io
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxpipe._errors import BundleError, ConfigError, OnnxpipeError, StageError, StreamError
from onnxpipe.runtime._channel import Closed, Full
from onnxpipe.runtime._ortapi import SessionFacts
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stage import CLOSE, Request, Runner, StagePlan, claimed, make_runner, pinned_replica, plan_stages
from onnxpipe.runtime._stats import StageRecorder
from onnxpipe.runtime.bundle import MANIFEST_NAME, Bundle, Limits, read_bundle, sha256_file
from onnxpipe.runtime.scheduling import StepBatch, take_rows

__all__ = ["HOST_LABEL", "RayEngine", "RayOptions", "import_ray"]

#: The node label a stage's ``host`` setting selects (``ray start --labels onnxpipe/host=NAME``).
HOST_LABEL = "onnxpipe/host"
_GPU_PROVIDERS = {"CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider"}
#: How often one request may be re-run after faults before it fails.
_MAX_ATTEMPTS = 8
#: Calls a replica may have submitted at once: one running, one waiting at the actor so that it
#: never waits for the driver; requests that come while both are out join its next call.
_CALLS_PER_REPLICA = 2
#: How long close() waits for actors to remove their files before killing them.
_SHUTDOWN_WAIT_S = 2.0
_TICK_S = 0.2
_FAILED = RuntimeError("failed")  # what a stage record counts as a failed run
#: The key, among a call's values, of the layout of a batch of streams' steps those values are in
#: (``StepBatch.describe``): see Note: batches of steps. No tensor has it (a tensor name is never empty).
_LAYOUT: tuple[str | None, str] = ("", "")


@dataclass(frozen=True)
class RayOptions:
    """How the Ray engine places, ships and supervises the stages.

    Attributes:
        shared: The bundle's path is the same on every node (a shared file system): actors read it
            there instead of receiving its bytes through Ray's object store.
        placement_timeout_s: Give up loading when a stage has no actor ready after this long.
        restart_timeout_s: A replica that died and is not back after this long is dead.
        max_restarts: Times Ray restarts each stage actor.
        requests_per_call: The most requests one actor call carries when requests queue up for a
            busy replica (see the data-plane note); None: the pipeline's ``queue_depth``; 1: every
            request in a call of its own.
    """

    shared: bool = False
    placement_timeout_s: float = 60.0
    restart_timeout_s: float = 30.0
    max_restarts: int = 3
    requests_per_call: int | None = None


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ImportError as e:
        raise ConfigError("the Ray engine needs Ray, which is not installed: pip install 'onnxpipe[ray]'") from e
    return ray


# -- the actor (runs on a node of the cluster) -----------------------------------------------------


class _StageActor:
    """One replica of one stage: re-reads and re-checks the bundle on its node, makes its runner
    with ``make_runner`` and runs requests' stage with it. Errors are returned as text, never raised:
    a failing request must not become a Ray task error carrying a pickled exception."""

    def __init__(self, payload: Any, path: str | None, manifest_sha: str, limits: Mapping[str, Any], index: int, replica: int,
                 target: str | None, folder: str, returns: Sequence[str], allow_code: Sequence[str], stage: str,
                 overrides: Sequence[Any] = ()) -> None:
        self._error: str | None = None
        self._perf_to_wall = time.perf_counter() - time.time()
        import ray

        # A restarted actor (Ray's max_restarts) starts with no stream's state: see run().
        self._restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self._bundle: Bundle | None = None
        self._runner: Runner | None = None
        self._returns = tuple(returns)
        # A private folder named by the driver: a restarted actor removes what its previous
        # incarnation left, and close() removes it. read_bundle unpacks in there too.
        self._folder = Path(tempfile.gettempdir()) / folder
        try:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder.mkdir(mode=0o700)
            tempfile.tempdir = str(self._folder)
            if path is None:
                archive = self._folder / "bundle.onnxpipe"
                archive.write_bytes(memoryview(payload))
                path = str(archive)
            # The driver's allow-list travels with the bundle: code is imported only if it allows it.
            # Only this actor's stage is checked against the thread caps, and against this node's cores.
            # The driver's deploy-time settings too: the bundle's files hold the build's.
            self._bundle = read_bundle(path, Limits(**limits), allow_code=allow_code, sessions=(stage,), overrides=overrides)
            if sha256_file(self._bundle.root / MANIFEST_NAME) != manifest_sha:
                raise BundleError(f"the bundle at '{path}' is not the one the driver checked (its manifest differs)")
            plan = plan_stages(self._bundle.spec)[0][index]
            settings = plan.stage.settings
            if settings.intra_op_threads == 0:  # onnxruntime's default would use every core of the node
                settings = settings.replace(intra_op_threads=_cpus(settings))
            plan = dataclasses.replace(plan, stage=dataclasses.replace(plan.stage, settings=settings))
            cores = settings.for_replica(replica).worker_cores()
            if cores is not None:
                os.sched_setaffinity(0, cores)
            self._runner = make_runner(self._bundle, plan, replica, target)
        except OnnxpipeError as e:
            self._error = str(e)
        except OSError as e:
            self._error = f"{type(e).__name__}: {e}"

    def ready(self) -> dict[str, Any]:
        """Where this actor runs, its session's facts, or why it could not start."""
        import ray

        info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(), "error": self._error}
        if self._runner is not None and self._runner.session is not None:  # code stages have no session
            info["facts"] = SessionFacts.of(self._runner.session, self._runner.name).to_dict()
        return info

    def run(self, calls: Sequence[tuple[int, int | None, tuple[int, int, dict[str, int]] | None, Sequence[Any], Mapping[int, str] | None]],
            *objects: Any) -> tuple[list[dict[tuple[str | None, str], Any] | None], list[dict[str, Any]]]:
        """Run the stage on each request of one call, in order. A call carries one request, or
        several when they queued up for this replica while it was busy (see the data-plane note);
        a stage that batches runs them as batched session calls (``StageRunner.run_many``).

        ``calls`` holds one ``(request, params, stream, sources, lost)`` per request: ``params`` is the
        position in ``objects`` of its parameter snapshot (or None); ``stream`` is ``(stream, step,
        dims)`` for a stream's step or close (see ``Request``), whose state the runner keeps in this
        actor; ``lost``, for a batch of steps, the members whose state the driver knows died (id ->
        why: Note: batches of steps); ``sources`` are what the stage reads from, one per producer: ``("v", values)`` for the
        request's pipeline inputs sent by value, ``("o", position, index)`` for an object of
        ``objects`` (an earlier call's outputs: its ``index``-th entry; ``index`` None: the object
        itself). Values are keyed by ``(stage, tensor)``.

        Returns the kept outputs of each request (None where it failed here or before) as ONE
        object, then each request's timing record.
        """
        outputs: list[dict[tuple[str | None, str], Any] | None] = []
        timings: list[dict[str, Any]] = []
        runnable: list[tuple[int, Request]] = []
        for request, params, stream, sources, lost in calls:
            produced = [s[1] if s[0] == "v" else _entry(objects[s[1]], s[2]) for s in sources]
            req, timing = self._prepare(request, None if params is None else objects[params], stream, produced, lost)
            outputs.append(None)
            timings.append(timing)
            if req is not None:
                runnable.append((len(timings) - 1, req))
        if runnable and self._runner is not None:
            at = {id(req): j for j, req in runnable}
            name = self._runner.name
            # One batched session call where the stage batches (Note: batched calls, _stage.py).
            for n, call in enumerate(self._runner.run_many([req for _, req in runnable])):
                for member, error in zip(call.members, call.errors, strict=True):
                    j = at[id(member)]
                    if member.step == CLOSE:
                        continue
                    timings[j].update(start=self._wall(call.start), end=self._wall(call.end), call=n)
                    if member.held:  # what this stage now holds of each stream's state (Note: a stream's state bytes, _stream.py)
                        timings[j]["held"] = member.held
                    if error is not None:
                        timings[j]["error"] = str(error)
                    elif member.batch is not None:
                        batch = member.batch
                        timings[j]["failed"] = [(f.id, str(f.error), isinstance(f.error, StreamError)) for f in batch.failed]
                        if len(batch):  # else every member failed: later stages pass it on untouched
                            kept: dict[tuple[str | None, str], Any] = {(name, o): member.values[Endpoint(name, o)] for o in self._returns}
                            kept[_LAYOUT] = batch.describe()
                            outputs[j] = kept
                    else:
                        outputs[j] = {(name, o): member.values[Endpoint(name, o)] for o in self._returns}
        return outputs, timings

    def _wall(self, perf: float) -> float:
        return perf - self._perf_to_wall

    def _prepare(self, request: int, params: Mapping[str, np.ndarray] | None, stream: tuple[int, int, dict[str, int]] | None,
                 produced: Sequence[dict[tuple[str | None, str], Any] | None], lost: Mapping[int, str] | None = None) -> tuple[Request | None, dict[str, Any]]:
        """One request of a call: the :class:`Request` to run (None if it needs no run) and its timing record."""
        now = time.time()
        timing: dict[str, Any] = {"start": now, "end": now, "error": None, "skipped": False}
        if any(v is None for v in produced):  # an earlier stage failed: pass the request on untouched
            timing["skipped"] = True
        elif stream is not None and stream[1] == CLOSE:
            timing["skipped"] = True  # not a stage run: no statistics
            if self._runner is not None:  # drops the stream's state, in order with the call's other requests
                return Request(request, {}, {}, 0.0, stream=stream[0], step=CLOSE), timing
        elif self._runner is None:
            timing["error"] = self._error or "the stage has no session"
        else:
            name = self._runner.name
            merged, layout = _aligned(produced)  # type: ignore[arg-type]
            req = Request(request, {key: merged[(key.stage, key.tensor)] for _, key in self._runner.plan.sources}, {name: params} if params else {}, 0.0)
            if layout is not None:
                req.batch = layout
                self._drop_lost(req, lost or {})
                return req, timing
            if stream is not None:
                req.stream, req.step, req.dims = stream
            states = getattr(self._runner, "states", None)
            if self._restarted and stream is not None and stream[1] > 0 and states is not None and self._runner.plan.states and stream[0] not in states:
                timing["error"] = (f"stage '{name}' lost the state of stream {stream[0]}: the actor holding it died and was restarted "
                                   "without it; close the stream")
                timing["state_lost"] = True
                return None, timing
            return req, timing
        return None, timing

    def _drop_lost(self, request: Request, lost: Mapping[int, str]) -> None:
        """Members of a batch whose state is gone (the driver says so, or this actor restarted
        without it) leave the batch before it runs, failing as a stream alone would."""
        batch = request.batch
        assert batch is not None and self._runner is not None
        states = getattr(self._runner, "states", None)
        name = self._runner.name
        gone: dict[int, BaseException] = {}
        for j, (rid, stream, step) in enumerate(zip(batch.ids, batch.streams, batch.steps, strict=True)):
            why = lost.get(rid)
            if why is None and self._restarted and step > 0 and states is not None and self._runner.plan.states and stream not in states:
                why = f"stage '{name}' lost the state of stream {stream}: the actor holding it died and was restarted without it; close the stream"
            if why is not None:
                gone[j] = StreamError(why, stage=name, request=rid, state_valid=False)
        if gone:
            keep = [j for j in range(len(batch)) if j not in gone]
            request.values = {key: take_rows(value, batch.rows, keep) for key, value in request.values.items()}
            request.batch = batch.without(gone)

    def streams(self) -> list[int]:
        """The streams whose state this replica holds (for diagnostics and tests)."""
        states = getattr(self._runner, "states", None) or {}
        return sorted(states.copy())  # copy(): one step, while a run may add or drop a stream

    def shutdown(self) -> None:
        """Stop a run in progress and remove the actor's files."""
        if self._runner is not None:
            self._runner.cancel()
        if self._bundle is not None:
            self._bundle.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def _cpus(settings: Any) -> int:
    import ray

    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


# -- the driver side ----------------------------------------------------------------------------


@dataclass
class _Replica:
    """The driver's view of one stage actor."""

    actor: Any
    info: dict[str, Any] = field(default_factory=dict)
    calls: int = 0  # calls submitted and not yet returned
    outstanding: int = 0  # requests in those calls
    pending: list[tuple[_Flight, int]] = field(default_factory=list)  # (request, attempt) waiting for the next call

    @property
    def load(self) -> int:
        """Requests given to this replica and not yet returned: in its calls or waiting for one."""
        return self.outstanding + len(self.pending)
    state: str = "ok"  # ok | suspect (died, being probed) | dead
    since: float = 0.0
    cause: str = ""
    probe: int = 0  # generation of the probe in progress
    incarnation: int = 0  # counts deaths: a stream's state lives in one incarnation


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

    def __init__(self, bundle: Bundle, plans: Sequence[StagePlan], target: str | None, queue_depth: int, trace: bool,
                 address: str | None, options: RayOptions, source: str | os.PathLike[str] | None = None) -> None:
        if queue_depth < 1:
            raise ConfigError(f"queue_depth must be at least 1, got {queue_depth}")
        ray = self._ray = import_ray()
        self._exc = ray.exceptions
        self._options = options
        self._plans = list(plans)
        self._recorders = [[StageRecorder(p.stage.name, r, trace) for r in range(p.stage.settings.replicas)] for p in self._plans]
        self._capacity = sum(queue_depth + p.stage.settings.replicas for p in self._plans)
        self._queue_depth = queue_depth
        self._high_water = [0] * len(self._plans)
        if options.requests_per_call is not None and options.requests_per_call < 1:
            raise ConfigError(f"RayOptions.requests_per_call must be at least 1, got {options.requests_per_call}")
        per_call = options.requests_per_call or queue_depth
        # Requests one call may carry: at least a batch, for a stage that batches.
        self._per_call = [max(per_call, p.stage.settings.max_batch) for p in self._plans]
        self._calls = [0] * len(self._plans)  # calls made, per stage
        self._wall_to_perf = time.time() - time.perf_counter()
        _, finals = plan_stages(bundle.spec)
        self._finals = set(finals.values())
        self._returns = [self._kept(i) for i in range(len(self._plans))]
        # What each stage reads from: the producers (None: the pipeline inputs; a stage's name) of its inputs.
        self._producers = [list(dict.fromkeys(key.stage for _, key in p.sources)) for p in self._plans]
        self._input_readers = sum(None in producers for producers in self._producers)
        self._final_producers = list(dict.fromkeys(key.stage for key in self._finals))  # what _finish fetches
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)
        self._flights: dict[int, _Flight] = {}
        self._params: dict[int, tuple[Mapping[str, np.ndarray], Any]] = {}
        self._incarnations: dict[tuple[int, int], int] = {}  # (stage, stream) -> incarnation of the replica holding its state
        self._events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._closing = False
        self._lost: dict[int, str] = {}  # stage index -> why it cannot come back
        self._watched = 0.0
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=address or "auto", logging_level="warning")
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"cannot connect to the Ray cluster at '{address or 'auto'}': {e}") from e
        self._replicas: list[list[_Replica]] = []
        try:
            self._check_feasible()
            self._start(bundle, target, source)
        except BaseException:
            self._kill_all()
            self._disconnect()
            raise
        self._thread = threading.Thread(target=self._collect, name="onnxpipe-ray-collector", daemon=True)
        self._thread.start()

    # -- placement ----------------------------------------------------------------------------

    def _kept(self, i: int) -> tuple[str, ...]:
        """The outputs of stage ``i`` that a later stage or the pipeline reads."""
        read = {key for p in self._plans[i + 1 :] for _, key in p.sources} | self._finals
        return tuple(o for o in self._plans[i].outputs if Endpoint(self._plans[i].stage.name, o) in read)

    def _asks(self, plan: StagePlan) -> tuple[dict[str, float], dict[str, str]]:
        """The resources and labels one replica of a stage asks Ray for."""
        s = plan.stage.settings
        resources = {"CPU": float(max(s.intra_op_threads, 1))}
        if s.provider in _GPU_PROVIDERS:
            resources["GPU"] = 1.0
        return resources, ({HOST_LABEL: s.host} if s.host else {})

    def _nodes(self) -> list[dict[str, Any]]:
        return [n for n in self._ray.nodes() if n.get("Alive")]

    def _cluster(self) -> str:
        """Each live node's address, labels and resources, for error messages."""
        rows = []
        for n in self._nodes():
            labels = {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}
            res = {k: v for k, v in n.get("Resources", {}).items() if k in ("CPU", "GPU")}
            rows.append(f"{n.get('NodeManagerAddress')} labels {labels or '{}'} resources {res or '{}'}")
        return "; ".join(rows) or "no live node"

    def _can_place(self, plan: StagePlan) -> bool:
        resources, labels = self._asks(plan)
        for n in self._nodes():
            have = n.get("Resources", {})
            node_labels = n.get("Labels") or {}
            if all(node_labels.get(k) == v for k, v in labels.items()) and all(have.get(k, 0) >= v for k, v in resources.items()):
                return True
        return False

    def _describe_ask(self, plan: StagePlan) -> str:
        resources, labels = self._asks(plan)
        ask = ", ".join(f"{k} {v:g}" for k, v in resources.items())
        return ask + (f" on a node labelled {HOST_LABEL}={labels[HOST_LABEL]}" if labels else "")

    def _check_feasible(self) -> None:
        for plan in self._plans:
            if not self._can_place(plan):
                raise ConfigError(f"stage '{plan.stage.name}' asks for {self._describe_ask(plan)}; no node of the cluster can take it. "
                                  f"The cluster has: {self._cluster()}")

    def _start(self, bundle: Bundle, target: str | None, source: str | os.PathLike[str] | None) -> None:
        ray = self._ray
        manifest_sha = sha256_file(bundle.root / MANIFEST_NAME)
        if self._options.shared:
            if source is None:
                raise ConfigError("RayOptions(shared=True) needs the bundle's path: load it with runtime.load(path, ...)")
            payload, path = None, os.path.abspath(source)
        else:
            # One object for every node: Ray copies it to a node once, however many actors read it there.
            payload, path = ray.put(np.frombuffer(_pack(bundle), np.uint8)), None
        self._payload = payload  # kept for as long as the engine runs: a restarting actor reads it again
        remote = ray.remote(concurrency_groups={"control": 1})(_StageActor)  # ready/shutdown answer while a run is in progress
        limits = dataclasses.asdict(bundle.limits)
        run_id = self._run_id = uuid.uuid4().hex  # names the actors' private folders: onnxpipe-ray-{run_id}-{stage}-{replica}
        for i, plan in enumerate(self._plans):
            resources, labels = self._asks(plan)
            options: dict[str, Any] = {"num_cpus": resources["CPU"], "num_gpus": resources.get("GPU", 0), "max_restarts": self._options.max_restarts,
                                       "max_task_retries": 0}
            if labels:
                options["label_selector"] = labels
            row = []
            for r in range(plan.stage.settings.replicas):
                folder = f"onnxpipe-ray-{run_id}-{i}-{r}"
                row.append(_Replica(remote.options(**options).remote(payload, path, manifest_sha, limits, i, r, target, folder, self._returns[i],
                                                                     list(bundle.allow_code), plan.stage.name, list(bundle.overrides))))
            self._replicas.append(row)
        calls = {self._ping(rep): (i, r) for i, row in enumerate(self._replicas) for r, rep in enumerate(row)}
        ready, pending = ray.wait(list(calls), num_returns=len(calls), timeout=self._options.placement_timeout_s)
        if pending:
            late = sorted({calls[ref][0] for ref in pending})
            names = ", ".join(f"'{self._plans[i].stage.name}' (asks for {self._describe_ask(self._plans[i])})" for i in late)
            raise ConfigError(f"stage(s) {names} not placed within {self._options.placement_timeout_s:g} s "
                              f"(the nodes that could take them are busy). The cluster has: {self._cluster()}")
        for ref in ready:
            i, r = calls[ref]
            try:
                info = ray.get(ref)
            except self._exc.RayError as e:
                raise BundleError(f"stage '{self._plans[i].stage.name}' replica {r}: its actor failed to start: {e}") from None
            if info["error"]:
                raise BundleError(f"stage '{self._plans[i].stage.name}' replica {r} on {info['host']}: {info['error']}")
            self._replicas[i][r].info = info

    def _ping(self, replica: _Replica) -> Any:
        return replica.actor.ready.options(concurrency_group="control").remote()

    @property
    def session_facts(self) -> list[SessionFacts]:
        """The first replica's session facts of each stage, in pipeline order."""
        facts = []
        for row in self._replicas:
            f = row[0].info.get("facts")
            if f is None:  # a code stage
                continue
            facts.append(SessionFacts.from_dict(f))
        return facts

    def held_streams(self) -> list[list[list[int]]]:
        """Per stage, per replica: the streams whose state the replica's actor holds."""
        calls = [[rep.actor.streams.options(concurrency_group="control").remote() for rep in row] for row in self._replicas]
        return [self._ray.get(row) for row in calls]

    def placements(self) -> list[list[dict[str, Any]]]:
        """Where each replica of each stage runs: its node's id, address and labels, and its process id.
        Each live replica is asked (Ray may have restarted an actor elsewhere without a call failing)."""
        with self._lock:
            live = [rep for row in self._replicas for rep in row if rep.state == "ok"]
        calls = {self._ping(rep): rep for rep in live}
        ready, _ = self._ray.wait(list(calls), num_returns=len(calls), timeout=_SHUTDOWN_WAIT_S * 5)
        for ref in ready:
            try:
                calls[ref].info = self._ray.get(ref)
            except self._exc.RayError:
                pass  # died meanwhile: the next call to it finds out
        nodes = {n["NodeID"]: n for n in self._ray.nodes()}
        rows = []
        for row in self._replicas:
            out = []
            for rep in row:
                node = nodes.get(rep.info.get("node_id"), {})
                labels = {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
                out.append({"node_id": rep.info.get("node_id"), "address": node.get("NodeManagerAddress"), "labels": labels,
                            "pid": rep.info.get("pid"), "state": rep.state})
            rows.append(out)
        return rows

    # -- requests -----------------------------------------------------------------------------

    def submit(self, request: Request, block: bool = True) -> None:
        """Start a request; blocks while the pipeline holds its capacity of requests (raises
        ``Full`` instead when ``block`` is false)."""
        with self._room:
            if not block and len(self._flights) >= self._capacity and not self._closing:
                raise Full
            while len(self._flights) >= self._capacity and not self._closing:
                self._room.wait()
            if self._closing:
                raise Closed
            flight = _Flight(request)
            self._flights[request.id] = flight
            # Read by several stages: put once, not sent with each call.
            flight.bag[None] = (self._ray.put(_inputs(request)), None) if self._input_readers > 1 else _inputs(request)
            self._dispatch(flight, 0)

    def _replica(self, i: int, request: Request) -> int:
        """The replica of stage ``i`` that runs ``request``: the live one with the fewest requests
        submitted or waiting (ties go round-robin by request id), or, for a stream in a stage with
        state, the replica holding the stream's state (``pinned_replica``, as in the thread engine).
        The one place a replica is chosen."""
        row = self._replicas[i]
        pinned = pinned_replica(self._plans[i], request, len(row))
        if pinned is not None:
            return pinned
        alive = [r for r, rep in enumerate(row) if rep.state == "ok"] or [r for r, rep in enumerate(row) if rep.state != "dead"]
        return min(alive, key=lambda r: (row[r].load, (r - request.id) % len(row)))

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
        while not flight.done and flight.cursor < len(self._plans):
            i = flight.cursor
            if i in self._lost:
                self._fail(flight, StageError(f"stage '{self._plans[i].stage.name}' cannot run request {request.id}: {self._lost[i]}",
                                              stage=self._plans[i].stage.name, request=request.id))
                return
            r = self._replica(i, request)
            rep = self._replicas[i][r]
            if request.step == CLOSE:
                began = self._incarnations.pop((i, request.stream), None) if request.stream is not None else None
                if not self._plans[i].states or began != rep.incarnation or rep.state != "ok":
                    flight.finished.add(i)  # nothing to free there: a stage without state, or a replica that died since
                    flight.cursor += 1
                    continue
            else:
                lost = self._state_lost(i, r, request)
                if lost is not None:
                    self._fail(flight, lost)
                    return
            rep.pending.append((flight, flight.attempt))
            self._high_water[i] = max(self._high_water[i], self._waiting(i))
            self._flush(i, r)
            return
        if not flight.done and len(flight.finished) == len(self._plans):  # a close with nothing left to free
            self._finish(flight)

    def _flush(self, i: int, r: int) -> None:
        """Submit the requests waiting for replica ``r`` of stage ``i`` as one call, if it has room."""
        rep = self._replicas[i][r]
        while rep.pending and rep.calls < _CALLS_PER_REPLICA and rep.state != "dead":
            members = [(f, a) for f, a in rep.pending[: self._per_call[i]] if not f.done and a == f.attempt and self._claimed(f)]
            del rep.pending[: self._per_call[i]]
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
        plan, rep = self._plans[i], self._replicas[i][r]
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
                    held = flight.bag[producer]
                    sources.append(("v", held) if isinstance(held, dict) else ("o", position(held[0]), held[1]))
            params = self._params_ref(request, plan)
            stream = None if request.stream is None else (request.stream, request.step, dict(request.dims))
            lost = self._members_lost(i, r, request) if request.batch is not None else None
            calls.append((request.id, None if params is None else position(params), stream, sources, lost))
        refs = rep.actor.run.options(num_returns=2).remote(calls, *objects)
        for j, (flight, _) in enumerate(members):
            flight.bag[plan.stage.name] = (refs[0], j)
        rep.calls += 1
        rep.outstanding += len(members)
        self._calls[i] += 1
        refs[1].future().add_done_callback(lambda f, m=members, i=i, r=r, o=refs[0]: self._events.put(("run", m, i, r, f, o)))

    def _state_lost(self, i: int, r: int, request: Request) -> StreamError | None:
        """For a stream's step in a stage with state: the error to fail it with when the replica
        holding the stream's state died since the stream began there (its state died with it)."""
        if request.stream is None or not self._plans[i].states:
            return None
        why = self._lost_why(i, r, request.stream, request.step)
        return None if why is None else StreamError(why, stage=self._plans[i].stage.name, request=request.id, state_valid=False)

    def _members_lost(self, i: int, r: int, request: Request) -> dict[int, str]:
        """For a batch of steps in a stage with state: the members whose state died, by request id (see ``_state_lost``)."""
        batch = request.batch
        if batch is None or not self._plans[i].states:
            return {}
        lost = {}
        for rid, stream, step in zip(batch.ids, batch.streams, batch.steps, strict=True):
            why = self._lost_why(i, r, stream, step)
            if why is not None:
                lost[rid] = why
        return lost

    def _lost_why(self, i: int, r: int, stream: int, step: int) -> str | None:
        rep = self._replicas[i][r]
        key = (i, stream)
        if step == 0:
            self._incarnations[key] = rep.incarnation
        if rep.state == "dead" or self._incarnations.get(key) != rep.incarnation:
            return (f"stage '{self._plans[i].stage.name}' lost the state of stream {stream}: the actor holding it (replica {r}) died "
                    f"({rep.cause or 'restarted'}); close the stream")
        return None

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

    # -- results, faults ----------------------------------------------------------------------

    def _collect(self) -> None:
        while True:
            try:
                event = self._events.get(timeout=_TICK_S)
            except queue.Empty:
                event = None
            if event is not None and event[0] == "stop":
                return
            with self._lock:
                if event is not None and event[0] == "run":
                    self._ran(*event[1:])
                elif event is not None and event[0] == "probe":
                    self._probed(*event[1:])
                self._watch()

    def _ran(self, members: list[tuple[_Flight, int]], i: int, r: int, future: Any, outputs: Any) -> None:
        rep = self._replicas[i][r]
        rep.calls -= 1
        rep.outstanding -= len(members)
        error = future.exception()
        if error is not None:  # the outputs object holds the same error: read it, or Ray logs it as unhandled
            try:
                self._ray.get(outputs, timeout=0)
            except self._exc.RayError:
                pass
        timings = future.result() if error is None else None
        if timings is not None:
            self._record_calls(members, i, r, timings)
        for j, (flight, attempt) in enumerate(members):
            if flight.done or attempt != flight.attempt:
                continue  # an earlier attempt of a request that was re-run
            if timings is not None:
                self._record(flight, i, r, timings[j])
            elif not self._is_fault(error):
                self._fail(flight, StageError(f"stage '{self._plans[i].stage.name}' failed on request {flight.request.id}: {error}",
                                              stage=self._plans[i].stage.name, request=flight.request.id))
            else:
                self._fault(flight, i, r, error)
        self._flush(i, r)

    def _is_fault(self, error: BaseException) -> bool:
        """Whether a failed call is Ray's doing (an actor, a node, a value lost), not the stage's."""
        faults = (self._exc.RayActorError, self._exc.ObjectLostError, self._exc.NodeDiedError, self._exc.WorkerCrashedError,
                  self._exc.LocalRayletDiedError)
        if any(isinstance(e, faults) for e in (error, getattr(error, "cause", None))):
            return True
        return not isinstance(error, self._exc.RayTaskError)

    def _record_calls(self, members: list[tuple[_Flight, int]], i: int, r: int, timings: Sequence[Mapping[str, Any]]) -> None:
        """Stage statistics of one actor call: one record per session call it made (a batch's
        members share theirs)."""
        calls: dict[int, list[tuple[Request, bool]]] = {}
        spans: dict[int, tuple[float, float]] = {}
        recorder = self._recorders[i][r]
        for (flight, attempt), timing in zip(members, timings, strict=True):
            if flight.done or attempt != flight.attempt or timing["skipped"]:
                continue
            request = flight.request
            if self._plans[i].streams and self._plans[i].stage.batching is not None and "call" in timing:
                size = request.size  # a batch of steps, or one step: its own session call (Note: batches of steps)
                failed = len(timing.get("failed", ())) if request.batch is not None else int(timing["error"] is not None)
                start, end = (t - self._wall_to_perf for t in (timing["start"], timing["end"]))
                recorder.record_steps(request.id, start, end, size, failed, 0.0, request.batch.waited if i == 0 and request.batch is not None else 0.0)
                continue
            n = timing.get("call", -1 - len(spans))  # a request that never reached the runner: a record of its own
            calls.setdefault(n, []).append((flight.request, timing["error"] is None))
            spans[n] = (timing["start"], timing["end"])
        for n, runs in calls.items():
            start, end = (t - self._wall_to_perf for t in spans[n])
            # Clocks of other hosts, and calls finishing out of order, can put a start before the last end.
            requests = [request for request, _ in runs]
            self._recorders[i][r].record_call(requests, start, end, [None if ok else _FAILED for _, ok in runs])

    def _record(self, flight: _Flight, i: int, r: int, timing: Mapping[str, Any]) -> None:
        request = flight.request
        name = self._plans[i].stage.name
        if request.batch is not None and timing.get("failed"):
            at = {rid: j for j, rid in enumerate(request.batch.ids)}
            gone: dict[int, BaseException] = {}
            for rid, why, lost in timing["failed"]:
                if rid in at:
                    gone[at[rid]] = (StreamError(why, stage=name, request=rid, state_valid=False) if lost
                                     else StageError(why, stage=name, request=rid))
            request.batch = request.batch.without(gone)
        request.held.extend(timing.get("held", ()))
        if timing.get("state_lost") and request.error is None:
            request.error = StreamError(timing["error"], stage=name, request=request.id, state_valid=False)
        if timing["error"] is not None and request.error is None:
            request.error = StageError(f"stage '{name}' failed on request {request.id}: {timing['error']}", stage=name, request=request.id)
        flight.finished.add(i)
        if len(flight.finished) == len(self._plans):
            self._finish(flight)

    def _fault(self, flight: _Flight, i: int, r: int, error: BaseException) -> None:
        """A call failed because of Ray (an actor died, a value was lost): re-run the request."""
        if isinstance(error, self._exc.RayActorError):
            self._suspect(i, r, error)
        if flight.attempt >= _MAX_ATTEMPTS:
            name = self._plans[i].stage.name
            self._fail(flight, StageError(f"stage '{name}' failed on request {flight.request.id} after {flight.attempt} attempts: {_brief(error)}",
                                          stage=name, request=flight.request.id))
            return
        if flight.request.step == CLOSE:  # the state it was to free died with the actor
            flight.finished.add(i)
            if len(flight.finished) == len(self._plans):
                self._finish(flight)
            return
        lost = next((e for e in (error, getattr(error, "cause", None)) if isinstance(e, self._exc.ObjectLostError)), None)
        first = self._lost_stage(flight, lost) if lost is not None else min(set(range(len(self._plans))) - flight.finished)
        steps = flight.request.stream is not None or flight.request.batch is not None
        if steps and any(self._plans[k].states for k in range(first, len(self._plans)) if k in flight.finished or k == i):
            # A stage with state ran (or was running) this step: running it again would apply the step twice,
            # or run it on a restarted actor that holds no state. The stream learns which (see _stream.py).
            name = self._plans[i].stage.name
            if self._plans[i].states and isinstance(error, self._exc.RayActorError):
                batch = flight.request.batch
                which = f"stream {flight.request.stream}" if batch is None else "streams " + ", ".join(map(str, batch.streams))
                self._fail(flight, self._state_lost(i, r, flight.request) or StreamError(
                    f"stage '{name}' lost the state of {which}: its actor died ({_brief(error)}); close the stream",
                    stage=name, request=flight.request.id, state_valid=False))
            else:
                self._fail(flight, StageError(f"stage '{name}' failed on request {flight.request.id}: {_brief(error)}", stage=name,
                                              request=flight.request.id))
            return
        self._dispatch(flight, first)

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
            flight.bag[None] = (self._ray.put(_inputs(flight.request)), None)
        return 0

    def _suspect(self, i: int, r: int, error: BaseException) -> None:
        rep = self._replicas[i][r]
        if rep.state != "ok":
            return
        rep.state, rep.since, rep.cause, rep.probe = "suspect", time.monotonic(), _brief(error), rep.probe + 1
        rep.incarnation += 1  # the streams whose state it held lost it
        generation = rep.probe
        self._ping(rep).future().add_done_callback(lambda f: self._events.put(("probe", i, r, generation, f)))

    def _probed(self, i: int, r: int, generation: int, future: Any) -> None:
        rep = self._replicas[i][r]
        if rep.state != "suspect" or generation != rep.probe:
            return
        error = future.exception()
        if error is None and not future.result()["error"]:
            rep.state, rep.info = "ok", future.result()
        elif error is None:
            self._dead(i, r, f"its restarted actor could not start: {future.result()['error']}")
        elif isinstance(error, self._exc.ActorUnavailableError):
            self._suspect_again(i, r)
        else:
            self._dead(i, r, f"{rep.cause}; it could not be restarted: {_brief(error)}")

    def _suspect_again(self, i: int, r: int) -> None:
        rep = self._replicas[i][r]
        rep.probe += 1
        generation = rep.probe
        self._ping(rep).future().add_done_callback(lambda f: self._events.put(("probe", i, r, generation, f)))

    def _watch(self) -> None:
        """Declare dead the replicas that cannot come back (no node for them, or too long away)."""
        now = time.monotonic()
        suspects = [(i, r) for i, row in enumerate(self._replicas) for r, rep in enumerate(row) if rep.state == "suspect"]
        if not suspects or now - self._watched < _TICK_S:
            return
        self._watched = now
        for i, r in suspects:
            rep = self._replicas[i][r]
            if not self._can_place(self._plans[i]):
                self._dead(i, r, f"{rep.cause}; no live node can take it: it asks for {self._describe_ask(self._plans[i])}; "
                                 f"the cluster has: {self._cluster()}")
            elif now - rep.since > self._options.restart_timeout_s:
                self._dead(i, r, f"{rep.cause}; it was not back within {self._options.restart_timeout_s:g} s")

    def _dead(self, i: int, r: int, why: str) -> None:
        rep = self._replicas[i][r]
        rep.state, rep.cause = "dead", why
        rep.pending.clear()  # re-dispatched below, to the live replicas
        if all(x.state == "dead" for x in self._replicas[i]):
            self._lost[i] = f"its actor died ({why})"
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
                fetched = [h if isinstance(h, dict) else _entry(next(got), h[1]) for h in held]
            except self._exc.RayError as e:  # an output was lost with its node: run the request again
                self._fault(flight, len(self._plans) - 1, 0, e)
                return
            merged, _ = _aligned(fetched)
            request.values = {key: merged[(key.stage, key.tensor)] for key in self._finals}
        self._complete(flight)

    def _fail(self, flight: _Flight, error: StageError) -> None:
        flight.request.error = flight.request.error or error
        self._complete(flight)

    def _complete(self, flight: _Flight) -> None:
        flight.done = True
        flight.bag.clear()
        with self._room:
            self._flights.pop(flight.request.id, None)
            self._room.notify()
        done = flight.request.done
        assert done is not None
        done(flight.request)

    # -- lifetime, observability -----------------------------------------------------------------

    def close(self) -> list[Request]:
        """Remove the actors' files, kill the actors, return the requests that did not finish."""
        with self._room:
            if self._closing:
                return []
            self._closing = True
            self._room.notify_all()
        self._events.put(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        live = [rep for row in self._replicas for rep in row if rep.state == "ok"]
        if live:
            self._ray.wait([rep.actor.shutdown.options(concurrency_group="control").remote() for rep in live], num_returns=len(live),
                           timeout=_SHUTDOWN_WAIT_S)
        self._kill_all()
        with self._lock:
            left = [f.request for f in self._flights.values() if not f.done]
            self._flights.clear()
        self._disconnect()
        return left

    def _kill_all(self) -> None:
        for row in self._replicas:
            for rep in row:
                self._ray.kill(rep.actor, no_restart=True)

    def _disconnect(self) -> None:
        if self._owns_ray:
            self._ray.shutdown()

    def recorders(self) -> list[list[StageRecorder]]:
        """Each stage's replicas' recorders, filled from the timings the actors return."""
        return self._recorders

    def queues(self) -> list[tuple[int, int, int]]:
        """Each stage's calls waiting for a replica: now, high water, capacity."""
        return [(max(0, self._waiting(i)), self._high_water[i], self._queue_depth) for i in range(len(self._replicas))]

    def _waiting(self, i: int) -> int:
        """Requests given to stage ``i`` beyond one running per replica."""
        return sum(rep.load for rep in self._replicas[i]) - len(self._replicas[i])

    def calls(self) -> list[int]:
        """Each stage's actor calls so far: fewer than its requests when requests queued up for a
        busy replica and went in one call."""
        with self._lock:
            return list(self._calls)

    def runners(self) -> list[list[Runner]]:
        """No local runners: the sessions live in the actors."""
        return [[] for _ in self._plans]


def _inputs(request: Request) -> dict[tuple[str | None, str], Any]:
    """A request's pipeline inputs as the actors read them, keyed by ``(None, tensor)``; with its
    layout, for a batch of steps (Note: batches of steps)."""
    inputs: dict[tuple[str | None, str], Any] = {(key.stage, key.tensor): value for key, value in request.values.items()}
    if request.batch is not None:
        inputs[_LAYOUT] = request.batch.describe()
    return inputs


def _aligned(produced: Sequence[Mapping[tuple[str | None, str], Any]]) -> tuple[dict[tuple[str | None, str], Any], StepBatch | None]:
    """The values of several producers merged, each brought to the newest batch layout among them
    (the one with the fewest members: members only leave a batch), and that layout (None: not a
    batch of steps). See Note: batches of steps."""
    layouts = [p[_LAYOUT] for p in produced if p is not None and _LAYOUT in p]
    if not layouts:
        return {k: v for p in produced if p is not None for k, v in p.items()}, None
    newest = min(layouts, key=lambda layout: len(layout[0]))
    ids = newest[0]
    merged: dict[tuple[str | None, str], Any] = {}
    for p in produced:
        if p is None:
            continue
        layout = p.get(_LAYOUT, newest)
        if tuple(layout[0]) == tuple(ids):
            merged.update(p)
            continue
        at = {rid: j for j, rid in enumerate(layout[0])}
        keep = [at[rid] for rid in ids]
        merged.update({k: v if k == _LAYOUT else take_rows(v, layout[4], keep) for k, v in p.items()})
    merged.pop(_LAYOUT, None)
    return merged, StepBatch.from_description(newest)


def _entry(outputs: Any, index: int | None) -> Any:
    """Entry ``index`` of a call's outputs, or the whole object when ``index`` is None."""
    return outputs if index is None else outputs[index]


def _brief(error: BaseException) -> str:
    """The first line of a Ray error (its messages carry whole tracebacks)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _pack(bundle: Bundle) -> bytes:
    """The checked bundle as one archive, for the object store: exactly the files its manifest lists."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zf:
        zf.write(bundle.root / MANIFEST_NAME, MANIFEST_NAME)
        for rel in sorted(bundle.manifest.files):
            kept = bundle.in_archive.get(rel)
            if kept is None:
                zf.write(bundle.root / rel, rel)
                continue
            with open(kept.location, "rb") as src, zf.open(zipfile.ZipInfo(rel), "w", force_zip64=True) as dst:
                src.seek(kept.offset)
                left = kept.size
                while left:
                    chunk = src.read(min(left, 1 << 20))
                    if not chunk:
                        raise BundleError(f"bundle file '{rel}' ended early while it was packed for the cluster")
                    dst.write(chunk)
                    left -= len(chunk)
    return buffer.getvalue()
