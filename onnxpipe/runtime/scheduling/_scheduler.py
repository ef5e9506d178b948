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

    - the group is *full*: every member has a step waiting, but members whose step in flight has
      another shape (a new stream's prefill: it runs beside the decode batch, never inside it) and
      members that can take no more steps (their state is no longer valid): nothing else can join;
    - a caller hands many steps at once (``Pipeline.submit_steps``: they are what comes), or a
      member closes (its steps go before the close);
    - the pipeline can take it (see Note: continuous batching): where the engine tells when its
      first stage frees up, once it is free and every member that must come is in; else (and
      as the bound of the first) ``delay`` (the stages' largest ``max_delay_ms``) after the
      oldest waiting step, or at once when that is 0.

    Members that miss a batch keep their place in the group's order: the batch is the others in
    that order, and a late member's step goes in a later batch of its group (the next, where the
    others are in flight then: they are waited for), one step behind them (members' pasts need
    not be equally long). So every batch of a group is its members in one order, and a stage
    keeping its state in place runs it on the rows where they are (a call per run of consecutive
    rows: one more per gap the missing members leave), moving nothing (``_inplace``, Note: state
    in place). (Putting the members that missed a batch after it, as this scheduler did, made
    each such batch move its group's rows twice, a whole past per stream moved: 17 MB a stream
    per stage at context 2048 on the 24.7 M Llama; docs/batching.md.)

    A batch holds at most one step of each stream and only steps of one shape (the scheduler's
    key: equal shapes but for the batch axis and the axes that grow with the past, and the same
    parameters); a stream's later steps, and steps of other shapes, leave in the batches after
    it, in order. Its members are in the group's order (the order they joined), so the same
    members give the same rows every step.

    The scheduler decides; it never runs anything. ``send`` (the pipeline's stream registry,
    ``_streams.StreamRegistry``) stacks a batch and submits it as one request; the registry joins
    and retires streams, offers their steps and says when each leaves. The thread engine, the Ray
    engine and the server's sequences all sit behind it.

Note: continuous batching.
    Where the engine tells the scheduler when its first stage is done with a request (``told``:
    the thread engine and the Ray engine, through ``Engine.watch_entry`` and the stream
    registry), a group's next batch leaves when the pipeline can take it, as a virtual engine of vLLM's pipeline-parallel
    scheduler schedules its next batch when its previous one has come back, not when a timer
    says. The scheduler counts the requests of steps it sent that the first stage has not
    finished (:meth:`entered`, :meth:`left_entry`):

    - while the first stage is busy, a group's steps that are not a full batch wait: sent now,
      they would only wait in its queue, and what came meanwhile would be a batch of its own.
      When it frees up (the count falls to 0), the releaser thread sends every group's waiting
      steps that the next rule lets go (the stage's worker that freed it only wakes the releaser:
      it never submits into the pipeline, so a full pipeline can always drain);
    - while the first stage is free, a group's steps wait only for the members that must come
      (:meth:`_missing`): those whose step of the same shape is in flight (they come back: no
      timer; so a group whose members fell out of step steps in lockstep again, as one driver's
      do), and those whose last step came back and whose caller is computing the next one. That
      window, from a batch's exit to its members' threads resubmitting (a thread's wake-up and the
      caller's own work: measured on a loaded 2-core host, median 0.3-0.5 ms, p90 3-5 ms, for a
      thread per stream and one driver alike; docs/batching.md), ends when the last of them
      submits; ``delay`` bounds it, counted from the group's oldest waiting step or the last
      member coming back, whichever is later. A member that misses the window (a thread that
      stopped stepping without closing) becomes *late*: it holds its group back once, and is not
      waited for again until it submits. With ``delay`` 0 nothing waits while the first stage
      is free.

    ``expired`` counts the batches that left because ``delay`` passed (``StreamsView.delayed``).
    Where the engine cannot tell (``watch_entry`` returns ``False``: an engine of a third party),
    the scheduler keeps the conservative rule: a group waits for every member (full), at most
    ``delay``.

Note: locks.
    ``_lock`` guards the groups and is never held while waiting on anything. A group's ``order``
    lock is held from forming its batches until they are submitted, so the batches of one group
    enter the pipeline in the order they were formed even when several threads (the callers, the
    releaser, a close) form them; a submission that waits for room in the pipeline holds
    only that. The pipeline's exit tells the scheduler a step is done (:meth:`done`), and the
    first stage that it finished one (:meth:`left_entry`); both take ``_lock`` alone and submit
    nothing (the releaser thread does), so a full pipeline can always drain.
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

#: Seconds the releaser thread waits with no step waiting before it ends (see ``_ended_idle``).
_IDLE_S = 0.5


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
        group: Its group's members in the group's order when its batch was formed (set then): where
            a stage keeping state in place puts a stream that joins (``_inplace``, Note: state in
            place), so that its group's later batches find their rows in order.
    """

    stream: int
    number: int
    arrays: dict[str, np.ndarray]
    dims: Mapping[str, int]
    params: Mapping[str, Mapping[str, np.ndarray]]
    key: Hashable
    future: Future[dict[str, np.ndarray]]
    submitted: float = field(default_factory=time.perf_counter)
    group: tuple[int, ...] = ()


class _Group:
    def __init__(self, pin: Hashable) -> None:
        self.pin = pin
        self.members: list[int] = []
        self.waiting: list[Step] = []
        self.since: float | None = None  # when its oldest waiting step came
        self.late: set[int] = set()  # members a batch left without after ``delay``, until they submit again (Note: continuous batching)
        self.order = threading.Lock()  # held from forming its batches until they are submitted


class StepScheduler:
    """Forms the batches of streams' steps at the pipeline's entry (see Note: groups, ...).

    Args:
        send: Stacks one batch of steps (in row order) and submits it; may wait for room.
        limit: The most steps one batch holds (the stages' smallest ``max_batch``).
        micro_batches: Groups to spread streams over (batches in flight at once).
        delay: Seconds a waiting step may wait for its group's other members (0: never waits).
        pin: The replicas a stream's state lives on (streams with different pins never share a group).
        told: Whether the engine tells when its first stage finishes a request (:meth:`left_entry`):
            batches then leave when the pipeline can take them (Note: continuous batching); else
            a group waits for every member, at most ``delay``.
    """

    def __init__(self, send: Callable[[list[Step]], None], limit: int, micro_batches: int, delay: float,
                 pin: Callable[[int], Hashable] = lambda stream: (), told: bool = False) -> None:
        self._send = send
        self.limit = limit
        self.micro_batches = micro_batches
        self.delay = delay
        self._pin = pin
        self.told = told
        self._entering = 0  # requests of steps sent that the first stage has not finished (told only)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._groups: list[_Group] = []
        self._group_of: dict[int, _Group] = {}
        self._busy: dict[int, list[Hashable]] = {}  # stream -> the keys of its steps in flight
        self._retired: set[int] = set()
        self._closed = False
        self._releaser: threading.Thread | None = None
        #: Batches sent, and steps in them (for diagnostics and tests).
        self.batches = 0
        self.steps = 0
        #: Batches that left because ``delay`` passed (Note: continuous batching: rarely, where told).
        self.expired = 0

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
                group.late.discard(stream)
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
            group = self._group_of.get(stream)
            if group is not None and group.waiting:
                self._arm()  # its group may no longer wait for it

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
                    fresh = group.since is None
                    if fresh:
                        group.since = mine[0].submitted
                    group.waiting.extend(mine)
                    group.late.difference_update(s.stream for s in mine)
                    batches = self._form(group) if flush else self._leave(group, time.perf_counter())
                    if batches is None:
                        if fresh:  # a later step moves no deadline (Note: continuous batching)
                            self._arm()
                        continue
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
                if self.told:
                    self._came_back(stream)
            if self.told and not busy:
                self._drained()

    def _came_back(self, stream: int) -> None:
        """A step of ``stream`` left the pipeline, where the engine tells: its group's window for
        it to submit opens now (Note: continuous batching). ``_lock`` held."""
        group = self._group_of.get(stream)
        if group is not None and group.waiting:
            group.since = time.perf_counter()
            self._arm()

    def _drained(self) -> None:
        """No step is in flight, so none is in the first stage, whatever the engine told: a lost
        word cannot hold steps back. ``_lock`` held."""
        if self._entering:
            self._entering = 0
            if any(g.waiting for g in self._groups):
                self._arm()

    def entered(self, requests: int = 1) -> None:
        """``requests`` more requests of steps went into the first stage than the batches formed (the
        registry sent a batch's steps alone); counted where the engine tells (``told``)."""
        if self.told:
            with self._lock:
                self._entering += requests

    def left_entry(self) -> None:
        """The first stage finished a request of steps (the engine's hook, on its worker: takes only
        ``_lock`` and submits nothing); once it is free, the releaser sends what may go."""
        with self._lock:
            self._entering = max(0, self._entering - 1)
            if not self._entering and any(g.waiting for g in self._groups):
                self._arm()

    def close(self) -> None:
        """Stop the releaser (it ends once any submission it is in returns: :meth:`wait_stopped`);
        steps still waiting stay unsent (the pipeline fails them)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    def wait_stopped(self, timeout: float = 5.0) -> None:
        """Wait for the releaser to end, after :meth:`close` (and after the engine closed, so
        that a submission it waits in returns)."""
        if self._releaser is not None and self._releaser is not threading.current_thread():
            self._releaser.join(timeout)

    def waiting(self) -> list[Step]:
        """Every step still waiting at the entry, and none of them any more (a closing pipeline fails them)."""
        with self._lock:
            left = [s for g in self._groups for s in g.waiting]
            for g in self._groups:
                g.waiting.clear()
                g.since = None
            return left

    # -- the policy ---------------------------------------------------------------------------

    def _verdict(self, group: _Group, now: float) -> str | None:
        """Why the group's waiting steps may leave now (``"full"``, ``"free"``: the first stage is
        free and nobody is to come, ``"delay"``), or ``None``: they wait (see Notes: groups, ...;
        continuous batching). ``_lock`` held, ``group.waiting`` not empty; changes nothing."""
        if self._ready(group):
            return "full"
        passed = not self.delay or (group.since is not None and group.since + self.delay <= now)
        if not self.told:
            return "delay" if passed else None
        if self._entering:
            return None  # the first stage is busy: they go when it frees up
        coming, flying = self._missing(group)
        if not (coming or flying):
            return "free"
        return "delay" if passed and (not flying or not self.delay) else None  # members in flight come back without a timer

    def _leave(self, group: _Group, now: float) -> list[list[Step]] | None:
        """The group's batches if its waiting steps may leave now, else ``None`` (``_lock`` held). A
        batch that leaves because ``delay`` passed stops waiting for the members that missed it."""
        verdict = self._verdict(group, now)
        if verdict is None:
            return None
        if verdict == "delay":
            self.expired += 1
            if self.told:
                group.late.update(self._missing(group)[0])  # not waited for again until they submit
        return self._form(group)

    def _deadline(self, group: _Group) -> float | None:
        """When ``delay`` lets the group's waiting steps leave (``None``: no timer does; something
        else wakes the releaser: the first stage freeing up, a member coming back or submitting)."""
        if group.since is None or (self.told and (self._entering or self._missing(group)[1])):
            return None  # members in flight come back without a timer
        return group.since + self.delay

    def _missing(self, group: _Group) -> tuple[list[int], list[int]]:
        """The members the group's next batch waits for while the first stage is free: those whose
        caller is to submit their next step (no step waiting or in flight; neither retired nor
        late), and those whose step of the batch's shape is in flight (Note: continuous batching)."""
        key = group.waiting[0].key
        waiting = {s.stream for s in group.waiting}
        gone = self._retired | group.late
        coming, flying = [], []
        for member in group.members:
            if member in waiting or member in gone:
                continue
            busy = self._busy.get(member)
            if not busy:
                coming.append(member)
            elif key in busy:
                flying.append(member)
        return coming, flying

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
        members = tuple(group.members)
        rank = {s: n for n, s in enumerate(members)}
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
            batch.sort(key=lambda s: rank.get(s.stream, len(rank)))  # members that missed it keep their place (Note: groups, ...)
            for step in batch:
                step.group = members
            batches.append(batch)
            pending = rest
        group.waiting = []
        group.since = None
        if self.told:
            self._entering += len(batches)
        for batch in batches:
            for step in batch:
                self._busy.setdefault(step.stream, []).append(step.key)
            self.batches += 1
            self.steps += len(batch)
        return batches

    def _submit(self, batches: list[list[Step]]) -> None:
        for batch in batches:
            self._send(batch)

    # -- the releaser ---------------------------------------------------------------------------

    def _arm(self) -> None:
        """Make sure the releaser runs, and have it look again (``_lock`` held)."""
        if self._releaser is None:
            self._releaser = threading.Thread(target=self._release, name="onnxpipe-step-scheduler", daemon=True)
            self._releaser.start()
        else:
            self._wake.notify()

    def _release(self) -> None:
        """The releaser: sends each group's waiting steps once they may leave (the first stage freed
        up, or ``delay`` passed: Note: continuous batching), and sleeps until the next deadline or
        :meth:`left_entry` wakes it."""
        while True:
            with self._lock:
                if self._closed or self._ended_idle():
                    return
                due = self._due()
                if not due:
                    continue
            for group in due:
                self._send_due(group)

    def _ended_idle(self) -> bool:
        """With no step waiting, wait up to :data:`_IDLE_S` for one; still none: the releaser ends
        (``_arm`` starts another), so a pipeline dropped without ``close`` leaves no thread behind.
        ``_lock`` held (let go while waiting)."""
        if any(g.waiting for g in self._groups):
            return False
        if self._wake.wait(_IDLE_S) or any(g.waiting for g in self._groups):
            return self._closed
        self._releaser = None
        return True

    def _due(self) -> list[_Group]:
        """The groups whose waiting steps may leave now; when none, first waits (``_lock`` held,
        let go while waiting) until the next deadline or a wake-up."""
        now = time.perf_counter()
        waiting = [g for g in self._groups if g.waiting]
        due = [g for g in waiting if self._verdict(g, now)]
        if waiting and not due:
            nexts = [t for t in map(self._deadline, waiting) if t is not None]
            self._wake.wait(max(0.0, min(nexts) - now) if nexts else None)
        return due

    def _send_due(self, group: _Group) -> None:
        with group.order:
            with self._lock:
                batches = self._leave(group, time.perf_counter()) if group.waiting else None
            if batches is not None:  # else sent meanwhile
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
