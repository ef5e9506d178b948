"""Streams' KV state kept in place (issue 38, runtime/_inplace.py, Note: state in place).

The slab's arithmetic on plain arrays: the same members cost nothing, a member that leaves moves
only the rows after it, an open stream whose row is taken is copied out exactly, a joiner is copied
in, a slab outgrown is made anew with every member's positions kept. And onnxruntime-genai's
Llama export (tests/data/decoders/genai-llama), split and batching, its GroupQueryAttention caches
bound in place: tokens equal the whole export alone (mixed prompts, streams leaving, a member that
fails, on threads and on Ray), and a decode step copies nothing, however long the context."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxpipe.runtime import load
from onnxpipe.runtime._inplace import MAX_RUNS, InSlab, Slab, arrange, capacity_for, place
from onnxpipe.runtime._session import bound_outputs, run_options
from onnxpipe.splitter import split
from tests.decoder_exports import HAND_CUTS, WholeModel, decode_one_driver, model_path, prompts, step_feeds
from tests.models import bundle_of

AXES = {"k": 2}


def _own(length: int, value: float) -> dict[str, np.ndarray]:
    """One stream's state of its own: 1 row, 2 heads, ``length`` positions, 3 dims, all ``value``."""
    return {"k": np.full((1, 2, length, 3), value, np.float32)}


def _positions(slab: Slab, stream: int) -> np.ndarray:
    return slab.own(stream)["k"]


def _slab(lengths: list[int], rows: int | None = None, capacity: int = 64) -> tuple[Slab, list[InSlab]]:
    """A slab holding streams 0..n-1 in rows 0..n-1, stream ``s`` filled with ``s + 1``."""
    slab = Slab(_own(0, 0.0), AXES, rows or len(lengths), capacity)
    for s, n in enumerate(lengths):
        slab.put(s, s, _own(n, s + 1.0))
    return slab, [InSlab(slab) for _ in lengths]


def test_the_same_members_in_the_same_rows_copy_nothing() -> None:
    slab, helds = _slab([3, 5, 4])
    got, start, copied, evicted = arrange([0, 1, 2], helds, need=6, max_rows=8, axes=AXES)
    assert (got, start, copied, evicted) == (slab, 0, 0, {})


def test_a_stages_run_options_say_the_graph_id_a_bound_run_reads() -> None:
    # onnxruntime's run_with_iobinding reads gpu_graph_id from the run options on every call, and
    # an unset entry costs a C++ error caught in Python (33 us; Note: a run's failure is said once).
    options = run_options()
    assert options.get_run_config_entry("gpu_graph_id") == "0"  # onnxruntime's default, set: reading it raises nothing
    assert options.log_severity_level == 4


def test_a_bound_runs_outputs_are_read_from_the_first_asked_on_as_onnxruntime_gives_them() -> None:
    # A stage keeping state in place reads only the outputs after its states (bound in place);
    # read through the binding's vector, not a Python OrtValue made for every output.
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [helper.make_node("Identity", ["x"], ["kept"]), helper.make_node("Neg", ["x"], ["neg"]), helper.make_node("Exp", ["x"], ["exp"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("kept", "neg", "exp")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_cpu_input("x", x)
    kept = ort.OrtValue.ortvalue_from_numpy(np.zeros_like(x))
    binding.bind_ortvalue_output("kept", kept)
    for name in ("neg", "exp"):
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding, run_options())
    want = [v.numpy() for v in binding.get_outputs()]
    assert np.array_equal(want[0], x) and np.array_equal(kept.numpy(), x)
    for first in range(4):
        got = bound_outputs(binding, first)
        assert len(got) == 3 - first and all(np.array_equal(g, w) for g, w in zip(got, want[first:], strict=True))
    assert np.array_equal(bound_outputs(binding, 1)[0], -x) and np.allclose(bound_outputs(binding, 2)[0], np.exp(x))


def test_members_in_a_row_anywhere_in_the_slab_run_where_they_are() -> None:
    slab, helds = _slab([3, 5, 4, 2])
    got, start, copied, evicted = arrange([2, 3], helds[2:], need=5, max_rows=8, axes=AXES)
    assert (got, start, copied, evicted) == (slab, 2, 0, {})
    assert got.view(start, 2)["k"].shape == (2, 2, 64, 3)


def test_a_member_that_missed_a_batch_moves_after_it_and_the_rows_after_it_move_up() -> None:
    slab, helds = _slab([3, 5, 4, 2])
    got, start, copied, evicted = arrange([0, 2, 3], [helds[0], helds[2], helds[3]], need=5, max_rows=8, axes=AXES)
    assert got is slab and start == 0 and evicted == {}
    # streams 2 and 3 move up a row, stream 1 (still open, in the way) to the row freed after them:
    # 3 rows of the longest moved (5 positions) x 2 heads x 3 dims, float32, nothing copied out
    assert copied == 3 * 5 * 2 * 3 * 4
    assert [slab.row[s] for s in (0, 2, 3, 1)] == [0, 1, 2, 3]
    for s, n in ((0, 3), (1, 5), (2, 4), (3, 2)):
        assert np.array_equal(_positions(slab, s), _own(n, s + 1.0)["k"])
    # the next batch of all four, in the order the scheduler gives after it, moves nothing
    assert arrange([0, 2, 3, 1], [InSlab(slab)] * 4, need=6, max_rows=8, axes=AXES)[1:] == (0, 0, {})


def test_an_open_stream_in_the_way_with_no_free_row_is_copied_out_exactly() -> None:
    slab, helds = _slab([3, 5, 4])
    got, _, copied, evicted = arrange([0, 2, 9], [helds[0], helds[2], _own(2, 9.0)], need=5, max_rows=3, axes=AXES)
    assert got is slab and list(evicted) == [1]
    assert np.array_equal(evicted[1]["k"], _own(5, 2.0)["k"])
    assert 1 not in slab.row and [slab.row[s] for s in (0, 2, 9)] == [0, 1, 2]
    assert copied == (5 + 4 + 2) * 2 * 3 * 4  # stream 1 out, stream 2 up a row, the joiner in


def test_a_joiner_is_copied_into_its_row_and_the_others_stay() -> None:
    slab, helds = _slab([3, 5], rows=4)
    joiner = _own(7, 9.0)
    got, start, copied, _ = arrange([0, 1, 7], [*helds, joiner], need=8, max_rows=8, axes=AXES)
    assert got is slab and start == 0
    assert copied == joiner["k"].nbytes
    assert np.array_equal(_positions(slab, 7), joiner["k"]) and slab.row[7] == 2


def test_an_outgrown_slab_is_made_anew_longer_with_every_members_positions() -> None:
    slab, helds = _slab([60, 64])
    got, start, copied, _ = arrange([0, 1], helds, need=65, max_rows=8, axes=AXES)
    assert got is not slab and start == 0
    assert got.capacity == capacity_for(65, 64) == 65 + 256 + 63 - (65 + 256 + 63) % 64
    assert copied == (60 + 64) * 2 * 3 * 4
    for s, n in ((0, 60), (1, 64)):
        assert np.array_equal(_positions(got, s), _own(n, s + 1.0)["k"])
    assert not slab.row  # the members left the old slab


def test_more_members_than_rows_double_the_rows_up_to_max_batch() -> None:
    _, helds = _slab([2, 2, 2])
    got, _, _, _ = arrange([0, 1, 2, 5], [*helds, _own(1, 6.0)], need=3, max_rows=5, axes=AXES)
    assert got.rows == 5


def test_a_batch_some_members_missed_runs_where_their_rows_are_in_runs_and_moves_nothing() -> None:
    slab, helds = _slab([3, 5, 4, 2, 6])
    got, runs, order, copied, evicted = place([0, 2, 3], [helds[0], helds[2], helds[3]], need=6, max_rows=8, axes=AXES)
    assert (got, runs, order, copied, evicted) == (slab, [(0, 1), (2, 2)], None, 0, {})
    got, runs, order, copied, _ = place([1, 4], [helds[1], helds[4]], need=7, max_rows=8, axes=AXES)
    assert (got, runs, order, copied) == (slab, [(1, 1), (4, 1)], None, 0)
    assert [slab.row[s] for s in range(5)] == [0, 1, 2, 3, 4]  # nobody moved
    assert place([0, 1, 2, 3, 4], helds, need=7, max_rows=8, axes=AXES)[1:] == ([(0, 5)], None, 0, {})


def test_a_batch_out_of_its_rows_order_runs_where_they_are_in_row_order() -> None:
    """Members whose rows do not ascend in the batch's order (a gathered group's, below) run where
    they are, in row order: nothing moves, and the order says which member each row is."""
    slab, helds = _slab([2, 3, 4, 5])
    got, runs, order, copied, evicted = place([2, 0, 3, 1], [helds[2], helds[0], helds[3], helds[1]], need=6, max_rows=8, axes=AXES)
    assert (got, runs, order, copied, evicted) == (slab, [(0, 4)], [1, 3, 0, 2], 0, {})
    assert [slab.row[s] for s in range(4)] == [0, 1, 2, 3]


def test_a_batch_in_more_runs_than_max_runs_is_gathered_by_swapping_rows_with_open_streams() -> None:
    """9 streams in 9 rows, a batch of every other one (MAX_RUNS + 1 runs): the 5 rows that hold
    most members already (0-4) take the 2 outside (streams 6 and 8 swap rows with streams 1 and 3,
    4 rows copied); nobody is copied out, and every stream keeps its positions."""
    n = 2 * MAX_RUNS + 1
    slab, helds = _slab([s + 1 for s in range(n)])
    before = {s: _positions(slab, s) for s in range(n)}
    every_other = list(range(0, n, 2))
    got, runs, order, copied, evicted = place(every_other, [helds[s] for s in every_other], need=n + 1, max_rows=n, axes=AXES)
    assert (got, runs, evicted) == (slab, [(0, 5)], {})
    assert [slab.row[s] for s in every_other] == [0, 2, 4, 1, 3] and (slab.row[1], slab.row[3]) == (6, 8)
    assert order == [0, 3, 1, 4, 2]  # the batch's members by row
    longest = max(slab.lengths[s] for s in (1, 3, 6, 8))
    assert copied == 4 * longest * 2 * 3 * 4  # 4 rows of 2 heads x 3 dims float32, up to the longest moved
    for s in range(n):
        assert np.array_equal(_positions(slab, s), before[s]), f"stream {s}"


def test_a_slab_made_for_a_batch_leaves_rows_free_on_both_sides_for_joiners() -> None:
    """A group whose first prompt ran alone and the others' together: its first decode batch (in
    the order the members joined) copies in the one that ran alone and moves nobody."""
    together = [_own(4, 2.0), _own(4, 3.0), _own(4, 4.0)]
    slab, start, copied, _ = arrange([1, 2, 3], together, need=4, max_rows=8, axes=AXES)
    assert (slab.rows, start) == (6, 1)  # twice the batch's rows, the free ones split
    alone = _own(4, 1.0)
    got, runs, _, copied, _ = place([0, 1, 2, 3], [alone, InSlab(slab), InSlab(slab), InSlab(slab)], need=5, max_rows=8, axes=AXES)
    assert got is slab and runs == [(0, 4)] and copied == alone["k"].nbytes
    later = _own(4, 5.0)  # a stream that joins the group later goes after them
    got, runs, _, copied, _ = place([0, 1, 2, 3, 4], [*[InSlab(slab)] * 4, later], need=5, max_rows=8, axes=AXES)
    assert got is slab and runs == [(0, 5)] and copied == later["k"].nbytes
    for s in range(5):
        assert np.array_equal(_positions(slab, s), _own(4, s + 1.0)["k"])


# -- onnxruntime-genai's export, bound in place ------------------------------------------------

NAME = "genai-llama"


@pytest.fixture(scope="module")
def whole() -> WholeModel:
    return WholeModel(NAME)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = split(str(model_path(NAME)), [HAND_CUTS[NAME]], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=8, max_delay_ms=60_000)  # one driver hands every step at once: the delay never runs out
    return bundle_of(plan, tmp_path_factory.mktemp("genai"))


def test_the_build_marks_group_query_attention_caches_shared(bundle: Path) -> None:
    with load(bundle) as pipe:
        assert pipe.spec.states and all(link.shared for link in pipe.spec.states)


def test_streams_decoded_in_place_give_the_whole_exports_tokens(bundle: Path, whole: WholeModel) -> None:
    starts = prompts(6)
    counts = [9, 6, 9, 4, 9, 7]  # streams leave from the middle of the batch
    with load(bundle, micro_batches=1) as pipe:  # one group: all 6 in one slab
        got = decode_one_driver(pipe, whole.inputs, starts, counts)
        stats = pipe.stats()
    for k, prompt in enumerate(starts):
        want, logits = whole.generate(prompt, counts[k])
        assert got[k][0] == want, f"stream {k}"
        assert all(np.all(np.isfinite(a)) for a in got[k][1])
        np.testing.assert_allclose(np.stack(got[k][1]), np.stack(logits), atol=1e-4)
    assert all(max(s.batch_sizes) == 6 for s in stats.stages)


def test_a_large_slabs_buffers_are_memory_maps_of_zeros_and_a_small_ones_are_not() -> None:
    """Note: slab memory: a buffer of 1 MB or more is an anonymous map (pages zeroed when first
    written), a smaller one ``np.zeros``; both hold zeros, take writes and give their bytes."""
    like = {"k": np.zeros((1, 4, 0, 64), np.float32), "v": np.zeros((1, 4, 0, 64), np.float16)}
    big = Slab(like, {"k": 2, "v": 2}, rows=16, capacity=512)  # k: 8 MB, v: 4 MB
    small = Slab(like, {"k": 2, "v": 2}, rows=2, capacity=64)  # 128 KB, 64 KB
    for slab, mapped in ((big, True), (small, False)):
        for name, buffer in slab.buffers.items():
            assert buffer.dtype == like[name].dtype and buffer.shape == (slab.rows, 4, slab.capacity, 64)
            owner: Any = buffer
            while isinstance(owner, np.ndarray | memoryview):  # np.frombuffer's base is a memoryview of the map
                owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
            assert isinstance(owner, mmap.mmap) is mapped, name
            assert not buffer.any()
        slab.put(7, 1, {"k": np.ones((1, 4, 3, 64), np.float32), "v": np.ones((1, 4, 3, 64), np.float16)})
        assert slab.own(7)["k"].sum() == 4 * 3 * 64 and slab.nbytes() == sum(b.nbytes for b in slab.buffers.values())


def test_a_prompt_that_knows_its_group_runs_in_its_row_of_the_groups_slab() -> None:
    """The scheduler tells the group (members 4, 5, 6, 7, in order): the first prompt alone makes
    the group's slab, ``max_rows`` rows, and takes the row of its place in the order; the others'
    prompts, alone or together, take the free rows after the members before them (or before the
    members after them); the decode batch of all four then runs where they are, in one call."""
    group = (4, 5, 6, 7)
    fresh = {"k": np.zeros((1, 2, 0, 3), np.float32)}  # a stream's initial state: no positions
    slab, start, copied, _ = arrange([5], [fresh], need=4, max_rows=8, axes=AXES, group=group)
    assert (slab.rows, start, copied) == (8, 1, 0)
    kin = {5: InSlab(slab)}
    got, start, copied, _ = arrange([6, 7], [fresh, fresh], need=4, max_rows=8, axes=AXES, group=group, kin=kin)
    assert (got, start, copied) == (slab, 2, 0)  # after stream 5, nothing copied
    kin = {m: InSlab(slab) for m in (5, 6, 7)}
    got, start, copied, _ = arrange([4], [_own(3, 1.0)], need=4, max_rows=8, axes=AXES, group=group, kin=kin)
    assert (got, start, copied) == (slab, 0, _own(3, 1.0)["k"].nbytes)  # before stream 5: only its own positions copied
    assert place(list(group), [InSlab(slab)] * 4, need=5, max_rows=8, axes=AXES, group=group)[1:] == ([(0, 4)], None, 0, {})


def test_a_joiner_with_no_room_beside_its_group_or_a_slab_too_short_gets_a_slab_of_its_own() -> None:
    group = (0, 1, 2)
    slab, kin_helds = _slab([3, 3], rows=2)  # streams 0 and 1 fill the slab
    kin = {0: kin_helds[0], 1: kin_helds[1]}
    got, _, _, _ = arrange([2], [_own(2, 3.0)], need=4, max_rows=4, axes=AXES, group=group, kin=kin)
    assert got is not slab and got.rows == 4
    slab, kin_helds = _slab([3], rows=4, capacity=8)
    got, _, _, _ = arrange([1], [_own(2, 2.0)], need=9, max_rows=4, axes=AXES, group=group, kin={0: kin_helds[0]})
    assert got is not slab  # the group's slab holds 8 positions, the prompt 9
    assert slab.row == {0: 0}


def _copied_by_decode_steps(pipe: Any, inputs: set[str], length: int) -> list[int]:
    """Bytes each stage copied over 5 decode steps of 4 streams in lockstep, after their prompts
    of ``length`` tokens (and a first batched step, where they join) are in."""
    streams = [pipe.stream() for _ in range(4)]
    texts = [[(5 * k + 7 * t + 1) % 200 for t in range(length)] for k in range(4)]
    done = [0] * 4

    def round_() -> None:
        futures = pipe.submit_steps({s: step_feeds(inputs, texts[k], done[k]) for k, s in enumerate(streams)})
        for k, s in enumerate(streams):
            done[k] = len(texts[k])
            texts[k].append(int(np.argmax(futures[s].result(timeout=60)["logits"][0, -1])))

    round_()
    round_()
    pipe.reset_stats()
    for _ in range(5):
        round_()
    copied = [s.bytes_copied for s in pipe.stats().stages]
    for s in streams:
        s.close()
    return copied


def test_a_decode_step_in_place_copies_nothing_at_any_context(bundle: Path, whole: WholeModel) -> None:
    with load(bundle) as pipe:
        assert _copied_by_decode_steps(pipe, whole.inputs, 8) == [0, 0]
        assert _copied_by_decode_steps(pipe, whole.inputs, 200) == [0, 0]


def _decode_rounds(pipe: Any, inputs: set[str], texts: list[list[int]], rounds: list[list[int]], counted_from: int = 2) -> list[int]:
    """Opens a stream per text; each round, the steps of the streams it names handed at once
    (``submit_steps``: a batch of just them); each stream's tokens appended to its text. The
    bytes each stage copied from round ``counted_from`` on (by default the third: after the
    prompts and a first step)."""
    streams = [pipe.stream() for _ in texts]
    done = [0] * len(texts)
    for n, members in enumerate(rounds):
        if n == counted_from:
            pipe.reset_stats()
        futures = pipe.submit_steps({streams[k]: step_feeds(inputs, texts[k], done[k]) for k in members})
        for k in members:
            done[k] = len(texts[k])
            texts[k].append(int(np.argmax(futures[streams[k]].result(timeout=60)["logits"][0, -1])))
    copied = [s.bytes_copied for s in pipe.stats().stages]
    for s in streams:
        s.close()
    return copied


def test_batches_that_members_missed_run_where_their_rows_are_and_copy_nothing(bundle: Path, whole: WholeModel) -> None:
    """One group of 4 in one slab; batches without a member in the middle, without two, without
    the ends, and the late ones in the next batch one step behind the others: the group's order
    and rows never change, so a decode step copies nothing (each stage runs a batch with gaps in
    a call per run of rows), and every stream's tokens are the whole export's."""
    starts = [[(5 * k + 7 * t + 1) % 200 for t in range(12)] for k in range(4)]
    texts = [list(p) for p in starts]
    every = [0, 1, 2, 3]
    rounds = [every, every, [0, 2, 3], every, [0, 3], every, [1, 2], every, [0, 1, 3], every]
    with load(bundle, micro_batches=1) as pipe:
        copied = _decode_rounds(pipe, whole.inputs, texts, rounds)
        sizes = pipe.stats().stages[0].batch_sizes
    assert copied == [0, 0]
    assert sizes.get(2, 0) == 2 and sizes.get(3, 0) == 2 and sizes.get(4, 0) == 4
    for k, prompt in enumerate(starts):
        count = sum(k in r for r in rounds)
        assert texts[k][len(prompt):] == whole.generate(prompt, count)[0], f"stream {k}"


def test_a_batch_gathered_from_many_gaps_leaves_the_batches_after_it_copying_nothing(tmp_path: Path, whole: WholeModel) -> None:
    """A group of 10 in one slab; a batch of every other member (5 runs, more than MAX_RUNS) is
    gathered into 5 rows by swapping 2 members with 2 open streams; then the whole group (its rows
    no longer in its order) and the other half run where their rows are, in row order, copying
    nothing (before, each re-ordered the rows: the whole past of most members copied twice), and
    every stream's tokens are the whole export's."""
    plan = split(str(model_path(NAME)), [HAND_CUTS[NAME]], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=10, max_delay_ms=60_000)
    starts = [[(5 * k + 7 * t + 1) % 200 for t in range(12)] for k in range(10)]
    texts = [list(p) for p in starts]
    every = list(range(10))
    rounds = [every, every, [0, 2, 4, 6, 8], every, [1, 3, 5, 7, 9], every, every]
    with load(bundle_of(plan, tmp_path), micro_batches=1) as pipe:
        copied = _decode_rounds(pipe, whole.inputs, texts, rounds, counted_from=3)
        sizes = pipe.stats().stages[0].batch_sizes
    assert copied == [0, 0]
    assert sizes == {10: 3, 5: 1}  # counted from the 4th round: the whole group thrice, the other half once
    for k, prompt in enumerate(starts):
        assert texts[k][len(prompt):] == whole.generate(prompt, sum(k in r for r in rounds))[0], f"stream {k}"


@pytest.mark.parametrize("prompts", [[[0], [1, 2, 3]], [[0], [1], [2], [3]], [[0, 1], [2], [3]]], ids=["one-then-three", "one-by-one", "two-one-one"])
def test_a_group_whose_prompts_came_in_pieces_copies_nothing(bundle: Path, whole: WholeModel, prompts: list[list[int]]) -> None:
    """The group's prompts run alone or a few together (a thread per stream's come one by one):
    the scheduler tells each stage the group, so each prompt runs in the rows after the ones
    before it in the group's order, in one slab, and the decode batches that follow find every
    member where it is: nothing is copied, from the third round on (the prompts after the second
    included), and the tokens are the whole export's. (Before, the prompts that ran alone ran in
    slabs of their own, and the first decode batch copied each of them into the group's.)"""
    length = 12
    starts = [[(5 * k + 7 * t + 1) % 200 for t in range(length)] for k in range(4)]
    texts = [list(p) for p in starts]
    every = [0, 1, 2, 3]
    rounds = [*prompts, every, every, every]
    with load(bundle, micro_batches=1) as pipe:
        copied = _decode_rounds(pipe, whole.inputs, texts, rounds)
        assert copied == [0, 0]
    for k, prompt in enumerate(starts):
        assert texts[k][length:] == whole.generate(prompt, sum(k in r for r in rounds))[0], f"stream {k}"


def test_a_member_that_fails_leaves_and_the_others_decode_the_whole_exports_tokens(bundle: Path, whole: WholeModel) -> None:
    """Stream 1's third step names a token past the vocabulary: the batched call fails, each member
    runs alone from its state as it was, stream 1 fails, the others go on (and batch again)."""
    starts = prompts(3)
    with load(bundle) as pipe:
        streams = [pipe.stream() for _ in starts]
        texts, done = [list(p) for p in starts], [0, 0, 0]
        for n in range(6):
            going = [k for k in range(3) if k != 1 or n <= 2]
            feeds = {streams[k]: step_feeds(whole.inputs, texts[k], done[k]) for k in going}
            if n == 2:
                feeds[streams[1]]["input_ids"] = np.array([[10**6]], np.int64)
            futures = pipe.submit_steps(feeds)
            for k in going:
                if k == 1 and n == 2:
                    with pytest.raises(Exception, match="stage"):
                        futures[streams[k]].result(timeout=60)
                    continue
                done[k] = len(texts[k])
                texts[k].append(int(np.argmax(futures[streams[k]].result(timeout=60)["logits"][0, -1])))
        batched = pipe.stats().stages[0].batch_sizes
    for k in (0, 2):
        assert texts[k][len(starts[k]):] == whole.generate(starts[k], 6)[0], f"stream {k}"
    assert batched.get(2, 0) >= 3  # streams 0 and 2 batched again after stream 1 left


@pytest.mark.xdist_group("ray")
def test_streams_in_place_on_ray_give_the_whole_exports_tokens(ray_cluster: Any, bundle: Path, whole: WholeModel) -> None:
    starts = prompts(4)
    counts = [6, 4, 6, 5]
    with load(bundle, engine="ray") as pipe:
        got = decode_one_driver(pipe, whole.inputs, starts, counts)
    for k, prompt in enumerate(starts):
        assert got[k][0] == whole.generate(prompt, counts[k])[0], f"stream {k}"


@pytest.fixture(scope="module")
def unbatched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = split(str(model_path(NAME)), [HAND_CUTS[NAME]], states="auto")
    return bundle_of(plan, tmp_path_factory.mktemp("genai-unbatched"))  # max_batch 1: every step alone


def test_a_stream_alone_in_place_copies_nothing(unbatched: Path, whole: WholeModel) -> None:
    """One stream of a stage that does not batch: its prompt of 60 tokens is written into a slab of
    its own (room for 320 positions), each step after it adds one position in place, nothing is
    copied, and its tokens are the whole export's. (A slab that grows: the slab tests above; this
    export's rotary cache holds 256 positions.)"""
    prompt = [(3 * t + 1) % 200 for t in range(60)]
    with load(unbatched) as pipe:
        stream = pipe.stream()
        tokens, done = list(prompt), 0
        for _ in range(8):
            out = stream.step(step_feeds(whole.inputs, tokens, done))
            done = len(tokens)
            tokens.append(int(np.argmax(out["logits"][0, -1])))
        copied = [s.bytes_copied for s in pipe.stats().stages]
        held = stream.state_bytes
    assert tokens[60:] == whole.generate(prompt, 8)[0]
    assert copied == [0, 0]
    assert capacity_for(60) == 320 and held % 320 == 0


def test_a_stream_with_a_parameter_override_runs_its_state_copied_and_decodes_the_whole_exports_tokens(tmp_path: Path, whole: WholeModel) -> None:
    """A parameter override is an initializer, which IOBinding cannot bind: such a call runs
    through ``session.run`` (its state copied, as before state in place) instead of failing. The
    override here is the weight's own value, so the tokens are the whole export's."""
    import onnx

    plan = split(str(model_path(NAME)), [HAND_CUTS[NAME]], states="auto")
    stage = plan.config.stages[1]
    name = next(n for n in stage.weights if "norm" in n)
    plan.config.add_param_group("norm", stage, [name])
    for s in plan.config.stages:
        s.configure(max_batch=8, max_delay_ms=60_000)
    stored = next(onnx.numpy_helper.to_array(t) for t in onnx.load(str(model_path(NAME))).graph.initializer if t.name == name)
    starts = prompts(3)
    with load(bundle_of(plan, tmp_path)) as pipe:
        pipe.set_params("norm", {name: stored})
        got = decode_one_driver(pipe, whole.inputs, starts, [5, 5, 5])
        copied = pipe.stats().stages[1].bytes_copied
    for k, prompt in enumerate(starts):
        assert got[k][0] == whole.generate(prompt, 5)[0], f"stream {k}"
    assert copied > 0  # stage 1's state went through session.run: its presents made apart from its pasts
