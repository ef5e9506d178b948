"""Which streams' steps travel together, and when: the policy of iteration-level scheduling.

Note: groups, micro-batches and when a batch leaves.
    Every stream of a pipeline whose stages batch joins a *group* when it opens, and stays in it
    until it closes; a group's steps travel the pipeline as one request each time (a micro-batch:
    ``_batch.py``, Note: one batch, one request), so its members keep their rows from step to step
    and every stage feeds their KV caches back as one block. There are ``micro_batches`` groups
    (by default as many as the pipeline has stages, GPipe's point: while stage 1 runs group A's
    step, stage 0 runs group B's, so no stage waits for the other); a new stream joins the
    smallest, and a group never holds more than ``limit`` streams (the stages' smallest
    ``max_batch``): when all are full, another group is made. Streams whose state lives on
    different replicas of a stage never share a group (``pin``).

    A stream's step waits at the entry in its group until the group's next batch leaves, which is
    when (the first that holds):

    - every member of the group has a step waiting, but members whose step in flight has another
      shape (a new stream's prefill: it runs beside the decode batch, never inside it) and members
      that can take no more steps (their state is no longer valid): nothing else can join;
    - ``delay`` seconds have passed since its oldest waiting step came (the stages' largest
      ``max_delay_ms``), or at once when that is 0 (take what is there, never wait);
    - a caller hands many steps at once (``Pipeline.submit_steps``: they are what comes), or a
      member closes (its steps go before the close).

    A batch holds at most one step of each stream and only steps of one shape (the scheduler's
    key: equal shapes but for the batch axis and the axes that grow with the past, and the same
    parameters); a stream's later steps, and steps of other shapes, leave in the batches after
    it, in order. Its members are in the order they joined the group, so the same members give
    the same rows every step.

    The scheduler decides; it never runs anything. ``send`` (the pipeline's stream registry,
    ``_streams.StreamRegistry``) stacks a batch and submits it as one request; the registry joins
    and retires streams, offers their steps and says when each leaves. The thread engine, the Ray
    engine and the server's sequences all sit behind it.

Note: locks.
    ``_lock`` guards the groups and is never held while waiting on anything. A group's ``order``
    lock is held from forming its batches until they are submitted, so the batches of one group
    enter the pipeline in the order they were formed even when several threads (the callers, the
    deadline timer, a close) form them; a submission that waits for room in the pipeline holds
    only that. The pipeline's exit tells the scheduler a step is done (:meth:`done`), which
    takes ``_lock`` alone, so a full pipeline can always drain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Step", "StepScheduler", "step_key"]


@dataclass(eq=False)
class Step:
    """A stream's step, checked, waiting at the entry for its batch.

    Attributes:
        stream: The stream's id.
        number: The step's number in its stream.
        arrays: Its checked pipeline inputs.
        dims: The stream's state dims (``Request.dims``).
        params: The parameter snapshot it was submitted under.
        key: What a batch's steps share (see Note: groups, ...).
        future: Its outputs, once it leaves the pipeline.
        submitted: ``time.perf_counter()`` when it was submitted.
    """

    stream: int
    number: int
    arrays: dict[str, np.ndarray]
    dims: Mapping[str, int]
    params: Mapping[str, Mapping[str, np.ndarray]]
    key: Hashable
    future: Future[dict[str, np.ndarray]]
    submitted: float = field(default_factory=time.perf_counter)


class _Group:
    def __init__(self, pin: Hashable) -> None:
        self.pin = pin
        self.members: list[int] = []
        self.waiting: list[Step] = []
        self.since: float | None = None  # when its oldest waiting step came
        self.order = threading.Lock()  # held from forming its batches until they are submitted


class StepScheduler:
    """Forms the batches of streams' steps at the pipeline's entry (see Note: groups, ...).

    Args:
        send: Stacks one batch of steps (in row order) and submits it; may wait for room.
        limit: The most steps one batch holds (the stages' smallest ``max_batch``).
        micro_batches: Groups to spread streams over (batches in flight at once).
        delay: Seconds a waiting step may wait for its group's other members (0: never waits).
        pin: The replicas a stream's state lives on (streams with different pins never share a group).
    """

    def __init__(self, send: Callable[[list[Step]], None], limit: int, micro_batches: int, delay: float,
                 pin: Callable[[int], Hashable] = lambda stream: ()) -> None:
        self._send = send
        self.limit = limit
        self.micro_batches = micro_batches
        self.delay = delay
        self._pin = pin
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._groups: list[_Group] = []
        self._group_of: dict[int, _Group] = {}
        self._busy: dict[int, list[Hashable]] = {}  # stream -> the keys of its steps in flight
        self._retired: set[int] = set()
        self._closed = False
        self._timer: threading.Thread | None = None
        #: Batches sent, and steps in them (for diagnostics and tests).
        self.batches = 0
        self.steps = 0

    # -- membership ---------------------------------------------------------------------------

    def join(self, stream: int) -> None:
        """A stream opened: it joins the smallest group it may (a new one while there are fewer
        than ``micro_batches``, or when all are full)."""
        with self._lock:
            pin = self._pin(stream)
            mine = [g for g in self._groups if g.pin == pin]
            room = [g for g in mine if len(g.members) < self.limit]
            if len(mine) < self.micro_batches or not room:
                group = _Group(pin)
                self._groups.append(group)
            else:
                group = min(room, key=lambda g: len(g.members))
            group.members.append(stream)
            self._group_of[stream] = group

    def leave(self, stream: int) -> None:
        """A stream is closing: its waiting steps leave now (the close follows them), and it no
        longer holds its group back."""
        group = self._group_of.get(stream)
        if group is None:
            return
        with group.order:
            with self._lock:
                self._group_of.pop(stream, None)
                self._retired.discard(stream)
                if stream in group.members:
                    group.members.remove(stream)
                flush = any(s.stream == stream for s in group.waiting)
                batches = self._form(group) if group.waiting and (flush or self._ready(group)) else []
                if not group.members and not group.waiting:
                    self._groups.remove(group)
            self._submit(batches)

    def retire(self, stream: int) -> None:
        """A stream can take no more steps (its state is no longer valid): its group stops waiting
        for it. Takes only the scheduler's lock (the pipeline's exit calls it)."""
        with self._lock:
            self._retired.add(stream)

    def group_of(self, stream: int) -> list[int]:
        """The members of the stream's group, in row order (for diagnostics and tests)."""
        with self._lock:
            group = self._group_of.get(stream)
            return list(group.members) if group is not None else []

    # -- steps --------------------------------------------------------------------------------

    def offer(self, step: Step) -> None:
        """A stream's step arrives; it leaves in a batch when its group's next batch does."""
        self.offer_many([step], flush=False)

    def offer_many(self, steps: Iterable[Step], flush: bool = True) -> None:
        """Steps arrive together (of any groups); with ``flush``, every group they reach sends its
        batches now: the caller gave what there is."""
        by_group: dict[int, tuple[_Group, list[Step]]] = {}
        for step in steps:
            group = self._group_of[step.stream]
            by_group.setdefault(id(group), (group, []))[1].append(step)
        for group, mine in by_group.values():
            with group.order:
                with self._lock:
                    if group.since is None:
                        group.since = mine[0].submitted
                    group.waiting.extend(mine)
                    if not (flush or not self.delay or self._ready(group)):
                        self._arm()
                        continue
                    batches = self._form(group)
                self._submit(batches)

    def done(self, stream: int) -> None:
        """A step of ``stream`` left the pipeline (a stream's steps leave in the order they came)."""
        self.done_many((stream,))

    def done_many(self, streams: Iterable[int]) -> None:
        """A step of each of ``streams`` left the pipeline (a batch's members, at the exit)."""
        busy = self._busy
        with self._lock:
            for stream in streams:
                keys = busy.get(stream)
                if keys:
                    del keys[0]
                    if not keys:
                        del busy[stream]

    def close(self) -> None:
        """Stop the deadline timer (it ends once any submission it is in returns: :meth:`wait_stopped`);
        steps still waiting stay unsent (the pipeline fails them)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    def wait_stopped(self, timeout: float = 5.0) -> None:
        """Wait for the deadline timer to end, after :meth:`close` (and after the engine closed, so
        that a submission it waits in returns)."""
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout)

    def waiting(self) -> list[Step]:
        """Every step still waiting at the entry, and none of them any more (a closing pipeline fails them)."""
        with self._lock:
            left = [s for g in self._groups for s in g.waiting]
            for g in self._groups:
                g.waiting.clear()
                g.since = None
            return left

    # -- the policy ---------------------------------------------------------------------------

    def _ready(self, group: _Group) -> bool:
        """Whether nothing else can join the group's next batch (see Note: groups, ...)."""
        key = group.waiting[0].key
        waiting = {s.stream for s in group.waiting}
        for member in group.members:
            if member in waiting or member in self._retired:
                continue
            busy = self._busy.get(member)
            if busy and all(k != key for k in busy):
                continue  # its step in flight has another shape (a prefill): not waited for
            return False
        return True

    def _form(self, group: _Group) -> list[list[Step]]:
        """Every waiting step of the group, in batches: one step per stream and one key per batch,
        in row order; a stream's later steps (and steps of another key) in the batches after."""
        rank = {s: n for n, s in enumerate(group.members)}
        batches = []
        pending = group.waiting
        while pending:
            key = pending[0].key
            batch: list[Step] = []
            rest: list[Step] = []
            seen: set[int] = set()
            for step in pending:
                if step.stream not in seen and step.key == key and len(batch) < self.limit:
                    batch.append(step)
                else:
                    rest.append(step)
                seen.add(step.stream)
            batch.sort(key=lambda s: rank.get(s.stream, len(rank)))
            batches.append(batch)
            pending = rest
        group.waiting = []
        group.since = None
        for batch in batches:
            for step in batch:
                self._busy.setdefault(step.stream, []).append(step.key)
            self.batches += 1
            self.steps += len(batch)
        return batches

    def _submit(self, batches: list[list[Step]]) -> None:
        for batch in batches:
            self._send(batch)

    # -- the deadline -------------------------------------------------------------------------

    def _arm(self) -> None:
        """Make sure the deadline timer runs (``_lock`` held)."""
        if self._timer is None:
            self._timer = threading.Thread(target=self._expire, name="onnxpipe-step-scheduler", daemon=True)
            self._timer.start()
        else:
            self._wake.notify()

    def _expire(self) -> None:
        """The timer: sends each group's batches once its oldest waiting step has waited ``delay``."""
        clock = time.perf_counter
        while True:
            with self._lock:
                if self._closed:
                    return
                now = clock()
                due = [g for g in self._groups if g.since is not None and g.since + self.delay <= now]
                if not due:
                    nexts = [g.since + self.delay for g in self._groups if g.since is not None]
                    self._wake.wait(min(nexts) - now if nexts else None)
                    continue
            for group in due:
                self._send_due(group)

    def _send_due(self, group: _Group) -> None:
        with group.order:
            with self._lock:
                if group.since is None or group.since + self.delay > time.perf_counter():
                    return  # sent meanwhile
                batches = self._form(group)
            self._submit(batches)


def step_key(arrays: Mapping[str, np.ndarray], padded: Mapping[str, tuple[int, float]], params: Any) -> tuple[Any, ...]:
    """What the steps of one batch share: the parameter snapshot, and every input's shape but its
    batch axis (and, for an input that grows with the past, its growing axis)."""
    key: list[Any] = [id(params)]
    for name, value in arrays.items():
        shape = value.shape
        pad = padded.get(name)
        key.append(shape[1:] if pad is None else shape[1 : pad[0]] + shape[pad[0] + 1 :])
    return tuple(key)
