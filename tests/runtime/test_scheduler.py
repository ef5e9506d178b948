"""The scheduler's policy alone (onnxpipe.runtime.scheduling.StepScheduler), with a recording
``send`` instead of a pipeline: no onnxruntime, every decision checked exactly (which streams share
a group, when a group's batch leaves, what a batch holds and in which order)."""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np
import pytest

from onnxpipe.runtime.scheduling import Step, StepBatch, StepScheduler, pad_stack, stack_steps, take_rows


class Recorder:
    def __init__(self) -> None:
        self.sent: list[list[tuple[int, int]]] = []

    def __call__(self, steps: list[Step]) -> None:
        self.sent.append([(s.stream, s.number) for s in steps])


def step(stream: int, number: int, key: object = "decode") -> Step:
    return Step(stream, number, {}, {}, {}, key, Future())


def scheduler(limit: int = 8, micro: int = 2, delay: float = 10.0, pin=lambda s: ()) -> tuple[StepScheduler, Recorder]:  # type: ignore[no-untyped-def]
    sent = Recorder()
    return StepScheduler(sent, limit, micro, delay, pin), sent


def test_streams_spread_over_the_micro_batches_and_a_full_group_makes_another() -> None:
    s, _ = scheduler(limit=2, micro=2)
    for stream in range(5):
        s.join(stream)
    assert [s.group_of(k) for k in (0, 1, 4)] == [[0, 2], [1, 3], [4]]


def test_streams_pinned_to_different_replicas_never_share_a_group() -> None:
    s, _ = scheduler(micro=1, pin=lambda stream: (stream % 2,))
    for stream in range(4):
        s.join(stream)
    assert s.group_of(0) == [0, 2] and s.group_of(1) == [1, 3]


def test_a_group_batch_leaves_once_every_member_has_a_step_waiting_in_member_order() -> None:
    s, sent = scheduler(micro=1)
    for stream in range(3):
        s.join(stream)
    s.offer(step(2, 0))
    s.offer(step(0, 0))
    assert sent.sent == []  # stream 1 has no step yet: the batch waits for it
    s.offer(step(1, 0))
    assert sent.sent == [[(0, 0), (1, 0), (2, 0)]]  # in the order the streams joined, not the order the steps came
    for stream in range(3):
        s.done(stream)


def test_a_member_running_a_step_of_another_shape_is_not_waited_for() -> None:
    s, sent = scheduler(micro=1)
    for stream in range(3):
        s.join(stream)
    s.offer_many([step(2, 0, key="prompt of 5")])  # sent at once (flush): stream 2's prompt is in flight
    s.offer(step(0, 3))
    s.offer(step(1, 3))
    assert sent.sent == [[(2, 0)], [(0, 3), (1, 3)]]


def test_a_batch_holds_one_step_per_stream_and_one_shape_the_rest_follows_in_order() -> None:
    s, sent = scheduler(micro=1)
    for stream in range(3):
        s.join(stream)
    s.offer_many([step(0, 4), step(0, 5), step(1, 0, key="prompt"), step(2, 7)])
    assert sent.sent == [[(0, 4), (2, 7)], [(0, 5)], [(1, 0)]]


def test_no_batch_holds_more_than_the_limit() -> None:
    s, sent = scheduler(limit=2, micro=1)
    for stream in range(2):
        s.join(stream)
    s.offer_many([step(0, 0), step(1, 0)])
    assert sent.sent == [[(0, 0), (1, 0)]]


def test_with_no_delay_a_step_leaves_as_it_comes() -> None:
    s, sent = scheduler(micro=1, delay=0.0)
    for stream in range(2):
        s.join(stream)
    s.offer(step(0, 0))
    assert sent.sent == [[(0, 0)]]


def test_after_the_delay_the_waiting_steps_leave_without_the_silent_member() -> None:
    s, sent = scheduler(micro=1, delay=0.02)
    for stream in range(3):
        s.join(stream)
    s.offer(step(0, 0))
    s.offer(step(1, 0))
    assert sent.sent == []
    deadline = time.monotonic() + 5
    while not sent.sent and time.monotonic() < deadline:
        time.sleep(0.005)
    s.close()
    s.wait_stopped()
    assert sent.sent == [[(0, 0), (1, 0)]]


def test_a_closing_member_sends_its_waiting_steps_and_no_longer_holds_its_group() -> None:
    s, sent = scheduler(micro=1)
    for stream in range(3):
        s.join(stream)
    s.offer(step(0, 0))
    s.leave(0)  # its step goes before its close
    assert sent.sent == [[(0, 0)]]
    s.done(0)
    s.offer(step(1, 1))
    s.leave(2)  # stream 2 will send no more: stream 1's step need not wait for it
    assert sent.sent == [[(0, 0)], [(1, 1)]]


def test_a_retired_member_is_not_waited_for() -> None:
    s, sent = scheduler(micro=1)
    for stream in range(2):
        s.join(stream)
    s.retire(1)  # its state is no longer valid: it takes no more steps
    s.offer(step(0, 2))
    assert sent.sent == [[(0, 2)]]


def test_waiting_steps_are_handed_back_when_the_pipeline_closes() -> None:
    s, sent = scheduler(micro=1)
    for stream in range(2):
        s.join(stream)
    s.offer(step(0, 0))
    s.close()
    assert [(w.stream, w.number) for w in s.waiting()] == [(0, 0)] and sent.sent == []


# -- the batch's layout ----------------------------------------------------------------------------


def test_stack_steps_pads_growing_inputs_on_the_left_and_says_the_layout() -> None:
    masks = [np.ones((1, n), np.int64) for n in (3, 5, 4)]
    steps = [{"ids": np.array([[k]]), "mask": m} for k, m in enumerate(masks)]
    stacked = stack_steps(steps, {"mask": (1, 0.0)})
    assert stacked is not None
    values, rows, shifts = stacked
    assert rows == (0, 1, 2, 3) and shifts == (2, 0, 1)
    np.testing.assert_array_equal(values["mask"], [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    np.testing.assert_array_equal(values["ids"], [[0], [1], [2]])


def test_stack_steps_refuses_growing_inputs_that_do_not_line_up() -> None:
    steps = [{"a": np.ones((1, 3)), "b": np.ones((1, 3))}, {"a": np.ones((1, 5)), "b": np.ones((1, 4))}]
    assert stack_steps(steps, {"a": (1, 0.0), "b": (1, 0.0)}) is None


def test_a_batch_without_its_failed_members_keeps_the_others_rows() -> None:
    batch = StepBatch((10, 11, 12), (0, 1, 2), (4, 4, 4), ({}, {}, {}), (0.0, 0.0, 0.0), (0, 1, 3, 4), (0, 2, 1))
    error = RuntimeError("bad")
    smaller = batch.without({1: error})
    assert smaller.streams == (0, 2) and smaller.rows == (0, 1, 2) and smaller.shifts == (0, 1)
    assert [(f.id, f.stream, f.error) for f in smaller.failed] == [(11, 1, error)]
    value = np.arange(4)[:, None]
    np.testing.assert_array_equal(take_rows(value, batch.rows, [0, 2]), [[0], [3]])


@pytest.mark.parametrize("fill", [0.0, -1e4])
def test_pad_stack_fills_the_padding(fill: float) -> None:
    out = pad_stack([np.ones((1, 2), np.float32), np.ones((1, 3), np.float32)], 1, fill, [1, 0])
    np.testing.assert_array_equal(out, [[fill, 1, 1], [1, 1, 1]])


# -- continuous batching: the engine tells when its first stage frees up ---------------------------


def told(limit: int = 8, micro: int = 1, delay: float = 60.0) -> tuple[StepScheduler, Recorder]:
    """A scheduler whose engine tells it when the first stage finishes a request (``left_entry``)."""
    sent = Recorder()
    return StepScheduler(sent, limit, micro, delay, told=True), sent


def wait_for(sent: Recorder, batches: int) -> None:
    """Poll, with a deadline, until the releaser thread has sent ``batches`` batches."""
    deadline = time.monotonic() + 10
    while len(sent.sent) < batches and time.monotonic() < deadline:
        time.sleep(0.002)


def test_while_the_first_stage_is_busy_steps_wait_for_it_to_free_up_and_leave_together() -> None:
    """No delay (never wait), yet a step that comes while the first stage runs a batch waits for
    it, and leaves with everything else that came meanwhile: one batch, not one per step."""
    s, sent = told(delay=0.0)
    for stream in range(4):
        s.join(stream)
    s.offer_many([step(0, 0, key="prompt")])  # in the first stage now
    s.offer(step(1, 0))
    s.offer(step(2, 0))
    assert sent.sent == [[(0, 0)]]  # the first stage is busy: they wait
    s.left_entry()  # it frees up: the releaser sends what waits
    wait_for(sent, 2)
    s.close()
    s.wait_stopped()
    assert sent.sent == [[(0, 0)], [(1, 0), (2, 0)]]


def test_while_the_first_stage_is_free_a_batch_waits_for_no_timer_once_every_member_is_in() -> None:
    """A delay of 60 s: the members' steps come one by one while the first stage is free, and the
    batch leaves with the last of them, at once; a member with a step in flight (a prompt) is not
    waited for."""
    s, sent = told()
    for stream in range(4):
        s.join(stream)
    s.offer_many([step(3, 0, key="prompt")])
    s.left_entry()
    for stream in range(3):
        assert len(sent.sent) == 1
        s.offer(step(stream, 5))
    assert sent.sent == [[(3, 0)], [(0, 5), (1, 5), (2, 5)]]


def test_a_member_that_missed_a_batch_after_the_delay_is_not_waited_for_until_it_submits() -> None:
    """Stream 1 stops stepping without closing: its group waits for it once (the delay), then not
    until it submits again."""
    s, sent = told(delay=0.02)
    for stream in range(2):
        s.join(stream)
    s.offer(step(0, 0))
    wait_for(sent, 1)
    assert sent.sent == [[(0, 0)]] and s.expired == 1
    s.left_entry()
    s.done(0)
    s.offer(step(0, 1))  # stream 1 is late: not waited for
    assert sent.sent == [[(0, 0)], [(0, 1)]]
    s.left_entry()
    s.done(0)
    s.offer(step(1, 0))  # it submits again: waited for again
    s.offer(step(0, 2))
    s.close()
    s.wait_stopped()
    assert sent.sent == [[(0, 0)], [(0, 1)], [(0, 2), (1, 0)]] and s.expired == 1


def test_the_releaser_thread_ends_once_nothing_waits() -> None:
    """A scheduler left without close (its pipeline dropped) leaves no thread behind: the releaser
    that sent the delayed batch ends once no step waits."""
    import threading

    before = {t.ident for t in threading.enumerate()}
    s, sent = told(delay=0.01)
    for stream in range(2):
        s.join(stream)
    s.offer(step(0, 0))
    wait_for(sent, 1)

    def releasers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "onnxpipe-step-scheduler" and t.ident not in before]

    deadline = time.monotonic() + 10
    while releasers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent.sent == [[(0, 0)]] and releasers() == []


def test_members_that_missed_a_batch_keep_their_place_in_the_groups_order() -> None:
    """So every batch of the group is its members in one order, and a stage keeping its state in
    place runs it where their rows are (the batch a member missed too: a run of rows each side of
    its row), moving nothing (_inplace, Note: state in place)."""
    s, sent = scheduler(micro=1)
    for stream in range(4):
        s.join(stream)
    s.offer_many([step(0, 0), step(2, 0), step(3, 0)])  # stream 1 missed it
    assert sent.sent == [[(0, 0), (2, 0), (3, 0)]]
    assert s.group_of(0) == [0, 1, 2, 3]
    for stream in (0, 2, 3):
        s.done(stream)
    s.offer_many([step(1, 0), step(0, 1), step(2, 1), step(3, 1)])  # the late one, one step behind the others
    assert sent.sent[-1] == [(0, 1), (1, 0), (2, 1), (3, 1)]
