"""The thread engine: each stage replica runs on a thread of this process (onnxruntime releases
the GIL while it runs, so stages compute at the same time); bounded channels join consecutive stages.

Note: streams.
    A request of a stream (``request.stream``) must reach the same replica of each stage as the
    stream's other requests, since that replica's runner holds the stream's state; and it must
    reach it after them (first in, first out). A stage with state and several replicas therefore
    has one channel per replica, and :meth:`ThreadEngine._channel` is the one place a request's
    replica is chosen. Stateless stages keep one channel that all their replicas take from.

Note: a worker's loop.
    Take a request, run it (``Runner.run``: the runner says what happened in a
    :class:`~onnxpipe.runtime._stage.Call`), record it (``StageRecorder.record``), hand it on. A
    request that failed earlier, or that its owner withdrew, is handed on without running. A stage
    that batches stateless requests takes a group instead and runs it with ``Runner.run_many``
    (:meth:`ThreadEngine._work_batched`); the rest is the same.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

from onnxpipe._errors import ConfigError, StageError
from onnxpipe.runtime._channel import Channel, Closed, Reader
from onnxpipe.runtime._diagnostics import ReplicaDiagnostics, StageDiagnostics
from onnxpipe.runtime._ortapi import SessionFacts
from onnxpipe.runtime._stage import Call, Request, Runner, StagePlan, claimed, make_runner, pinned_replica
from onnxpipe.runtime._stats import StageRecorder, resident_bytes
from onnxpipe.runtime.bundle import Bundle, check_caps

__all__ = ["DEFAULT_QUEUE_DEPTH", "RunnerFactory", "ThreadEngine"]

#: Makes the runner (and so the session) of one replica of one stage: see ``make_runner``.
RunnerFactory = Callable[[StagePlan, int], Runner]

_JOIN_TIMEOUT_S = 5.0
#: Requests that may wait in front of each stage. Deep enough to absorb a stage's jitter (a queue
#: of 2 left the next stage idle after hiccups on a shared 2-core machine), shallow enough that
#: a few large activations per stage stay in memory.
DEFAULT_QUEUE_DEPTH = 4


class ThreadEngine:
    """One thread per stage replica, bounded channels between consecutive stages.

    Args:
        plans: The stage plans, in pipeline order.
        factory: Makes each replica's runner.
        queue_depth: Requests that may wait in front of each stage.
        trace: Record every stage run for a timeline.

    Raises:
        ConfigError: the OS refused a stage's CPU affinity.
        BundleError: a session could not be created.
    """

    name: ClassVar[str] = "thread"
    #: Its sessions are made in this process (see :class:`~onnxpipe.runtime._engine.EngineClass`).
    in_process: ClassVar[bool] = True
    takes_address: ClassVar[bool] = False

    @classmethod
    def start(cls, bundle: Bundle, plans: Sequence[StagePlan], *, target: str | None, queue_depth: int, trace: bool, address: str | None = None,
              ray_options: object = None, source: object = None) -> ThreadEngine:
        """Start the stages of ``bundle`` on threads of this process (the engine registry's way in).

        Raises:
            ConfigError: an address or Ray options were given, or see the class.
            BundleError: a stage's settings are over this host's caps (a bundle read for another
                engine), or a session could not be created.
        """
        if address is not None or ray_options is not None:
            raise ConfigError("address and ray_options are for engine='ray'; the thread engine runs in this process")
        if bundle.capped is not None:  # read for another engine: every session starts here
            check_caps(bundle.spec, bundle.limits)
        return cls(plans, lambda plan, replica: make_runner(bundle, plan, replica, target), queue_depth, trace)

    def __init__(self, plans: Sequence[StagePlan], factory: RunnerFactory, queue_depth: int = DEFAULT_QUEUE_DEPTH, trace: bool = False) -> None:
        if queue_depth < 1:
            raise ConfigError(f"queue_depth must be at least 1, got {queue_depth}")
        self._plans = list(plans)
        self._runners = [[factory(p, r) for r in range(p.stage.settings.replicas)] for p in self._plans]
        self._recorders = [[StageRecorder(p.stage.name, r, trace, batches=p.batches) for r in range(p.stage.settings.replicas)] for p in self._plans]
        # One channel per stage, or per replica of a stage with state (see Note: streams).
        self._channels: list[list[Channel[Request]]] = [
            [Channel(max(queue_depth, p.stage.settings.max_batch)) for _ in range(p.stage.settings.replicas if p.keeps_state else 1)] for p in self._plans
        ]
        self._orphans: list[Request] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._entry_hook: Callable[[Request], None] = _ignore  # watch_entry's callback
        self._start()

    def _start(self) -> None:
        ready = threading.Barrier(sum(len(rs) for rs in self._runners) + 1)
        errors: list[BaseException] = []
        for i, runners in enumerate(self._runners):
            for r, runner in enumerate(runners):
                t = threading.Thread(target=self._work, args=(i, r, runner, ready, errors), name=f"onnxpipe-{runner.name}-{r}", daemon=True)
                self._threads.append(t)
                t.start()
        ready.wait()
        if errors:
            self.close()
            raise errors[0]

    def _pin(self, i: int, r: int, errors: list[BaseException]) -> None:
        """Pin this worker thread to its replica's cores, if it has some; a refusal stops the engine (``errors``)."""
        cores = self._plans[i].stage.settings.for_replica(r).worker_cores()
        try:
            if cores is not None:
                os.sched_setaffinity(0, cores)  # 0: this thread, on Linux
        except OSError as e:
            errors.append(ConfigError(f"stage '{self._plans[i].stage.name}': the OS refused CPU affinity {sorted(cores or ())}: {e.strerror}"))
            for channel in self._channels[i]:
                channel.close()

    def _work(self, i: int, r: int, runner: Runner, ready: threading.Barrier, errors: list[BaseException]) -> None:
        """A worker: take a request, run it, record it, hand it on (Note: a worker's loop)."""
        self._pin(i, r, errors)
        ready.wait()
        own = self._channels[i]
        reader = own[r if len(own) > 1 else 0].reader()
        hand_on = self._hand_on(i + 1) if i + 1 < len(self._channels) else None
        if runner.max_batch > 1:
            self._work_batched(runner, reader, self._recorders[i][r], hand_on)
            return
        # Hot loop: bound methods looked up once, the hand-on inlined (see _pass_on).
        take, run, record = reader.get, runner.run, self._recorders[i][r].record
        entry = i == 0  # records the wait of batches of steps at the entry, and tells watch_entry's callback
        while True:
            try:
                request = take()
            except Closed:
                return
            if request.error is None and (request.claim is None or claimed(request)):
                call = run(request)
                if call.failures:
                    self._failed(call, (request,))
                if entry and request.batch is not None:
                    call.waited = request.batch.waited
                record(call, (request,))
            try:
                if hand_on is None:
                    request.done(request)  # type: ignore[misc]  # set by the pipeline
                else:
                    hand_on(request)
            except Closed:
                self._orphan([request])
                return
            if entry:
                self._entry_hook(request)
            # Let go before waiting: a finished request refers to its pipeline (request.done).
            del request

    def _work_batched(self, runner: Runner, reader: Reader[Request], recorder: StageRecorder, hand_on: Callable[[Request], None] | None) -> None:
        """The worker of a stage that batches stateless requests (Triton's dynamic batcher): it
        takes a request, then what else is queued (up to ``max_batch``, waiting up to
        ``max_delay_ms`` for more), and runs them together. (Streams' steps are batched at the
        entry: ``onnxpipe.runtime.scheduling``.)"""
        settings = runner.plan.stage.settings
        most, delay = runner.max_batch, settings.max_delay_ms / 1e3
        while True:
            group: list[Request] = []
            try:
                waited = self._take_group(reader, group, most, delay)
            except Closed:
                self._orphan(group)  # taken, never run: the pipeline fails them
                return
            self._run_group(runner, recorder, group, waited)
            for n, request in enumerate(group):
                if not self._pass_on(request, hand_on):
                    self._orphan(group[n:])
                    return
            del group, request  # let go before waiting (see _work)

    def _run_group(self, runner: Runner, recorder: StageRecorder, group: list[Request], waited: float) -> None:
        """Run a group taken from the queue (withdrawn members are passed over) and record each run."""
        for member in group:
            if member.claim is not None:
                claimed(member)  # a withdrawn one is marked failed: run_many passes it over
        by_id = {request.id: request for request in group}
        for call in runner.run_many(group):
            members = [by_id[rid] for rid in call.requests]
            if call.failures:
                self._failed(call, members)
            call.waited, waited = waited, 0.0  # the group's wait to fill counts once, for its first call
            recorder.record(call, members)

    @staticmethod
    def _take_group(reader: Reader[Request], group: list[Request], most: int, delay: float) -> float:
        """Fill ``group`` with a request and what else comes within ``delay`` seconds (up to
        ``most``); the seconds it waited for more after the first.

        Raises:
            Closed: the channel closed (``group`` holds what was taken).
        """
        clock = time.perf_counter
        group.append(reader.get())
        taken = clock()
        deadline = taken + delay
        while len(group) < most:
            more = reader.get_more(max(0.0, deadline - clock()) if delay else 0.0)
            if more is None:
                break
            group.append(more)
        return clock() - taken

    def _failed(self, call: Call, requests: Sequence[Request]) -> None:
        """Fail the requests a run failed (its members that left a batch of steps have left it already)."""
        by_id = {request.id: request for request in requests}
        for failure in call.failures:
            request = by_id.get(failure.request)
            if request is None or failure.member:
                continue
            if self._closing:  # the run was cancelled by close()
                request.error = StageError(f"the pipeline was closed before request {request.id} finished", request=request.id)
            else:
                request.error = failure.error()

    @staticmethod
    def _pass_on(request: Request, hand_on: Callable[[Request], None] | None) -> bool:
        """Hand a request to the next stage (or, after the last, to the pipeline); ``False`` once the
        engine is closing."""
        try:
            if hand_on is None:
                assert request.done is not None
                request.done(request)
            else:
                hand_on(request)
        except Closed:
            return False
        return True

    def _orphan(self, requests: Sequence[Request]) -> None:
        """Keep requests a closing engine could not hand on: ``close()`` returns them to be failed."""
        with self._lock:
            self._orphans.extend(requests)

    def _channel(self, i: int, request: Request) -> Channel[Request]:
        """The channel of stage ``i`` that ``request`` goes to: the one place a replica is chosen.

        A stream goes to its pinned replica of each stage with state (``pinned_replica``), so its
        requests meet its state; any other request goes to the stage's one channel, which all its
        replicas take from.
        """
        channels = self._channels[i]
        if len(channels) == 1:
            return channels[0]
        return channels[pinned_replica(self._plans[i], request, len(channels)) or 0]

    def _hand_on(self, i: int) -> Callable[[Request], None]:
        """How a worker puts a request into stage ``i``'s queue (a bound method when there is one queue)."""
        if len(self._channels[i]) == 1:
            return self._channels[i][0].put
        return lambda request: self._channel(i, request).put(request)

    # -- the engine boundary --------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Requests the engine holds before :meth:`submit` waits: what its channels hold, and what
        its workers hold while they run (one request each, or a group of up to ``max_batch``)."""
        held = sum(runner.max_batch for runners in self._runners for runner in runners)
        return held + sum(channel.capacity for channels in self._channels for channel in channels)

    def submit(self, request: Request, block: bool = True) -> None:
        """Enqueue for the first stage; blocks while its queue is full (raises ``Full`` instead when ``block`` is false)."""
        self._channel(0, request).put(request, block)

    def watch_entry(self, callback: Callable[[Request], None]) -> bool:
        """Have the first stage's workers call ``callback(request)`` after handing each request on
        (see ``Engine.watch_entry``); told: ``True``. (The workers of a pipeline with state run the
        plain loop of :meth:`_work`, which calls it; a worker that batches stateless requests
        serves no stream and tells nothing.)"""
        self._entry_hook = callback
        return True

    def close(self) -> list[Request]:
        """Close the channels, cancel runs in progress, join the workers."""
        self._closing = True
        left: list[Request] = []
        for channels in self._channels:
            for channel in channels:
                left.extend(channel.close())
        for runners in self._runners:
            for runner in runners:
                runner.cancel()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(_JOIN_TIMEOUT_S)
        with self._lock:
            left.extend(self._orphans)
            self._orphans.clear()
        return left

    def recorders(self) -> list[list[StageRecorder]]:
        """Each stage's replicas' recorders."""
        return self._recorders

    def queues(self) -> list[tuple[int, int, int]]:
        """Each stage's input queue: depth now, high water, capacity."""
        return [(sum(len(c) for c in cs), sum(c.high_water for c in cs), sum(c.capacity for c in cs)) for cs in self._channels]

    def runners(self) -> list[list[Runner]]:
        """Each stage's replicas' runners, in pipeline order."""
        return self._runners

    def session_facts(self) -> list[SessionFacts]:
        """The first replica's session facts of each ONNX stage, in pipeline order."""
        return [SessionFacts.of(rs[0].session, rs[0].name) for rs in self._runners if rs and rs[0].session is not None]

    def resident_bytes(self) -> int | None:
        """The physical memory of this process, where the sessions run (``_stats.resident_bytes``)."""
        return resident_bytes()

    def diagnostics(self) -> list[StageDiagnostics]:
        """Each stage's replicas: runs, the streams each holds, its reuse of state blocks."""
        pid = os.getpid()
        return [
            StageDiagnostics(plan.stage.name, tuple(
                ReplicaDiagnostics(r, recorder.count, tuple(runner.streams()), runner.reused, runner.state_bytes(), pid)
                for r, (runner, recorder) in enumerate(zip(runners, recorders, strict=True))))
            for plan, runners, recorders in zip(self._plans, self._runners, self._recorders, strict=True)
        ]

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads (for tests and diagnostics)."""
        return list(self._threads)


def _ignore(request: Request) -> None:
    """The first stage's callback until ``watch_entry`` sets one."""
