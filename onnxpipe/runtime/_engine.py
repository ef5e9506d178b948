"""Engines: where stage workers live. The thread engine runs each stage replica on a thread of this
process (onnxruntime releases the GIL while it runs, so stages compute at the same time).

Note: the engine boundary.
    An engine receives the stage plans and a runner factory, takes requests with :meth:`submit`,
    and hands each finished request to ``request.done``. It knows nothing of futures, ordering,
    inputs or parameters: those live in the pipeline, and what a stage does lives in
    :class:`~onnxpipe.runtime._stage.StageRunner`. Another engine (processes, Ray actors) implements
    the five methods of :class:`Engine` and reuses the runners, the plans and the statistics.

Note: streams.
    A request of a stream (``request.stream``) must reach the same replica of each stage as the
    stream's other requests, since that replica's runner holds the stream's state; and it must
    reach it after them (first in, first out). A stage with state and several replicas therefore
    has one channel per replica, and :meth:`ThreadEngine._channel` is the one place a request's
    replica is chosen. Stateless stages keep one channel that all their replicas take from.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from onnxpipe._errors import ConfigError, StageError
from onnxpipe.runtime._channel import Channel, Closed, Reader
from onnxpipe.runtime._stage import CLOSE, Request, Runner, StagePlan, claimed, pinned_replica
from onnxpipe.runtime._stats import StageRecorder

__all__ = ["DEFAULT_QUEUE_DEPTH", "Engine", "RunnerFactory", "ThreadEngine"]

#: Makes the runner (and so the session) of one replica of one stage: see ``make_runner``.
RunnerFactory = Callable[[StagePlan, int], Runner]

_JOIN_TIMEOUT_S = 5.0
#: Requests that may wait in front of each stage. Deep enough to absorb a stage's jitter (a queue
#: of 2 left the next stage idle after hiccups on a shared 2-core machine), shallow enough that
#: a few large activations per stage stay in memory.
DEFAULT_QUEUE_DEPTH = 4


class Engine(Protocol):
    """What the pipeline needs from an engine."""

    def submit(self, request: Request, block: bool = True) -> None:
        """Enqueue a request for the first stage; block while the pipeline is full (or, when
        ``block`` is false, refuse at once and take nothing).

        Raises:
            Closed: the engine is closed.
            Full: ``block`` is false and the pipeline cannot take the request now.
        """

    def close(self) -> list[Request]:
        """Stop every worker promptly; return the requests that did not finish."""

    def recorders(self) -> list[list[StageRecorder]]:
        """Each stage's replicas' recorders, in pipeline order."""

    def queues(self) -> list[tuple[int, int, int]]:
        """Each stage's input queue: depth now, high water, capacity."""

    def runners(self) -> list[list[Runner]]:
        """Each stage's replicas' runners (and so their sessions), in pipeline order."""


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

    def __init__(self, plans: Sequence[StagePlan], factory: RunnerFactory, queue_depth: int = DEFAULT_QUEUE_DEPTH, trace: bool = False) -> None:
        if queue_depth < 1:
            raise ConfigError(f"queue_depth must be at least 1, got {queue_depth}")
        self._plans = list(plans)
        self._runners = [[factory(p, r) for r in range(p.stage.settings.replicas)] for p in self._plans]
        self._recorders = [[StageRecorder(p.stage.name, r, trace) for r in range(p.stage.settings.replicas)] for p in self._plans]
        # One channel per stage, or per replica of a stage with state (see Note: streams).
        self._channels: list[list[Channel[Request]]] = [
            [Channel(max(queue_depth, p.stage.settings.max_batch)) for _ in range(p.stage.settings.replicas if p.states else 1)] for p in self._plans
        ]
        self._orphans: list[Request] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._start()

    def _start(self) -> None:
        ready = threading.Barrier(sum(len(rs) for rs in self._runners) + 1)
        errors: list[BaseException] = []
        for i, runners in enumerate(self._runners):
            for r, runner in enumerate(runners):
                cores = self._plans[i].stage.settings.for_replica(r).worker_cores()
                t = threading.Thread(target=self._work, args=(i, r, runner, cores, ready, errors), name=f"onnxpipe-{runner.name}-{r}", daemon=True)
                self._threads.append(t)
                t.start()
        ready.wait()
        if errors:
            self.close()
            raise errors[0]

    def _work(self, i: int, r: int, runner: Runner, cores: set[int] | None, ready: threading.Barrier, errors: list[BaseException]) -> None:
        try:
            if cores is not None:
                os.sched_setaffinity(0, cores)  # 0: this thread, on Linux
        except OSError as e:
            errors.append(ConfigError(f"stage '{runner.name}': the OS refused CPU affinity {sorted(cores or ())}: {e.strerror}"))
            for channel in self._channels[i]:
                channel.close()
        recorder = self._recorders[i][r]
        ready.wait()
        own = self._channels[i]
        reader = own[r if len(own) > 1 else 0].reader()
        hand_on = self._hand_on(i + 1) if i + 1 < len(self._channels) else None
        if getattr(runner, "max_batch", 1) > 1:
            self._work_batched(runner, reader, recorder, hand_on)
            return
        # Hot loop: bound methods looked up once.
        take = reader.get
        record, record_steps, clock = recorder.record, recorder.record_steps, time.perf_counter
        steps = runner.plan.streams and runner.plan.stage.batching is not None  # its calls' sizes are counted
        first = i == 0  # records the batches' wait at the entry
        while True:
            try:
                request = take()
            except Closed:
                return
            if request.error is None and (request.claim is None or claimed(request)):
                batch = request.batch
                size, failed = request.size, len(batch.failed) if batch is not None else 0
                start = clock()
                try:
                    runner(request)
                except Exception as e:  # onnxruntime raises its own types; the request fails, the stage goes on
                    request.error = self._failure(runner.name, request.id, e)
                if request.step != CLOSE:
                    end = clock()
                    if not steps:
                        record(request.id, start, end, request.error is None, start - request.queued_at)
                    elif size:  # a batch whose members all failed earlier ran nothing here
                        failed = len(request.batch.failed) - failed if request.batch is not None else int(request.error is not None)
                        record_steps(request.id, start, end, size, failed, start - request.queued_at, batch.waited if first and batch is not None else 0.0)
                    request.queued_at = end
            if not self._pass_on(request, hand_on):
                self._orphan([request])
                return
            # Let go before waiting: a finished request refers to its pipeline (request.done).
            del request

    def _work_batched(self, runner: Runner, reader: Reader[Request], recorder: StageRecorder, hand_on: Callable[[Request], None] | None) -> None:
        """The worker of a stage that batches stateless requests (Triton's dynamic batcher): it
        takes a request, then what else is queued (up to ``max_batch``, waiting up to
        ``max_delay_ms`` for more), and runs them together. (Streams' steps are batched at the
        entry: ``onnxpipe.runtime.scheduling``.)"""
        settings = runner.plan.stage.settings
        most, delay = settings.max_batch, settings.max_delay_ms / 1e3
        clock = time.perf_counter
        while True:
            group: list[Request] = []
            try:
                group.append(reader.get())
                taken = clock()
                deadline = taken + delay
                while len(group) < most:
                    more = reader.get_more(max(0.0, deadline - clock()) if delay else 0.0)
                    if more is None:
                        break
                    group.append(more)
            except Closed:
                self._orphan(group)  # taken, never run: the pipeline fails them
                return
            waited = clock() - taken  # what the group's first call waited for it to fill
            for member in group:
                if member.claim is not None:
                    claimed(member)  # a withdrawn one is marked failed: run_many passes it over
            for call in runner.run_many(group):
                errors = [None if e is None else self._failure(runner.name, m.id, e) for m, e in zip(call.members, call.errors, strict=True)]
                for member, error in zip(call.members, errors, strict=True):
                    member.error = error
                if call.members[0].step != CLOSE:
                    recorder.record_call(call.members, call.start, call.end, errors, waited)
                    waited = 0.0
            for n, request in enumerate(group):
                if not self._pass_on(request, hand_on):
                    self._orphan(group[n:])
                    return
            del group, request

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

    def _failure(self, stage: str, request: int, error: Exception) -> StageError:
        if self._closing:
            return StageError(f"the pipeline was closed before request {request} finished", request=request)
        return StageError(f"stage '{stage}' failed on request {request}: {error}", stage=stage, request=request)

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

    def submit(self, request: Request, block: bool = True) -> None:
        """Enqueue for the first stage; blocks while its queue is full (raises ``Full`` instead when ``block`` is false)."""
        self._channel(0, request).put(request, block)

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

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads (for tests and diagnostics)."""
        return list(self._threads)
