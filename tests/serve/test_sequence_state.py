"""What a sequence may hold, and who may touch it (issue 36, items 4, 6 and 9), against a real
``onnxpipe serve``: a sequence whose state grows with each step (``tests.stateful_models.growing``,
what a KV cache does) is ended with a 400 naming ``--max-sequence-state`` when it passes it, and the
sequences of every model together with a 503 naming ``--sequence-state-budget``; what they hold is
``onnxpipe_sequence_state_bytes`` in ``/metrics``, and growing sequences sent without pause leave
the server's memory within the budget. A ``sequence_end`` always frees its sequence, even when its
step cannot run. Sequence ids are names any client with the token may use (as Triton's)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from onnxpipe.splitter import split
from tests.models import bundle_of
from tests.serve.process import ServerProcess
from tests.stateful_models import growing, recurrent

MIB = 1 << 20
#: One step's input: 1 MiB of float32, the bytes each step adds to its sequence's state.
ONE_MIB = np.ones((1, MIB // 4), np.float32)


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grown")
    return {
        "growing": bundle_of(split(growing(), ["stateN"], states="auto"), root / "growing"),
        "shaped": bundle_of(split(growing(reshaped=True), ["sum"], states="auto"), root / "shaped"),
        "rnn": bundle_of(split(recurrent(), ["state1N"], states="auto"), root / "rnn"),
    }


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _step(client: Any, sid: int | str, x: np.ndarray = ONE_MIB, model: str = "growing", shape: tuple[int, int] | None = None,
          **flags: Any) -> float:
    """One step; the sum of everything the sequence was sent, as the model answers it."""
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    if "headers" in flags:
        flags["headers"] = dict(flags["headers"])  # tritonclient.http adds its own to the dict it is given
    tensor = module.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    inputs = [tensor]
    if shape is not None:
        target = module.InferInput("shape", [2], "INT64")
        target.set_data_from_numpy(np.array(shape, np.int64))
        inputs.append(target)
    return float(client.infer(model, inputs, sequence_id=sid, **flags).as_numpy("y").sum())


def _refused(call: Any, *args: Any, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call(*args, **kwargs)
    return e.value


def _held(proc: ServerProcess) -> dict[str, float]:
    """``onnxpipe_sequence_state_bytes`` by model, as ``/metrics`` says it."""
    text = proc.get("/metrics")[1].decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^onnxpipe_sequence_state_bytes\{model="([^"]+)"\} (\S+)$', text, re.M)}


def _held_becomes(proc: ServerProcess, model: str, want: float, timeout: float = 10.0) -> None:
    """Until ``/metrics`` says ``model``'s sequences hold ``want`` bytes (an end reaches the model's worker after its answer is sent)."""
    deadline = time.monotonic() + timeout
    while (got := _held(proc).get(model)) != want:
        assert time.monotonic() < deadline, f"model '{model}' holds {got} bytes of sequence state, not {want}"
        time.sleep(0.02)


# -- #4: a bound per sequence, and over all of them --------------------------------------------


def test_a_sequence_past_max_sequence_state_is_ended_with_a_400_naming_the_flag(grown: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(f"growing={grown['growing']}", "--max-sequence-state", "4MiB") as proc:
        proc.start(tmp_path / "serve.log")
        http = httpclient.InferenceServerClient(proc.http)
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        for client, sid, module in ((http, 7, "400"), (grpc, "user-7", "StatusCode.INVALID_ARGUMENT")):
            for k in range(1, 5):  # 4 MiB: at the limit, not past it
                assert _step(client, sid, sequence_start=k == 1) == k * ONE_MIB.size
            assert _held(proc)["growing"] == 4 * MIB
            refused = _refused(_step, client, sid)
            assert (refused.status(), refused.message()) == (module, (
                f"sequence_id {sid!r} of model 'growing' holds 5.0 MiB of state after this step, over the 4.0 MiB a sequence may hold "
                "(--max-sequence-state): the sequence was ended and its state freed; start it again ('sequence_start': true) and end it sooner, "
                "send less in each step, or restart the server with a larger --max-sequence-state"))
            _held_becomes(proc, "growing", 0.0)
            refused = _refused(_step, client, sid)
            assert refused.message() == (f"sequence_id {sid!r} names no open sequence of model 'growing' (its state passed --max-sequence-state, "
                                         "and was freed): the first request of a sequence must set 'sequence_start': true")
            assert _step(client, sid, sequence_start=True, sequence_end=True) == ONE_MIB.size  # as it says: a fresh state
        stats = http.get_inference_statistics("growing")["model_stats"][0]["inference_stats"]
        assert stats["fail"]["count"] == 4  # the refused steps count as failed (Triton's OTHER: the request's own doing)
        assert proc.stop() == 0


def test_the_budget_over_every_model_ends_the_sequence_that_passes_it_with_a_503(grown: dict[str, Path], tmp_path: Path) -> None:
    """Two models share the budget: 6 + 6 MiB held, a third sequence passes 16 MiB at its fifth
    step and is ended; as its message says, ending another makes room."""
    args = (f"one={grown['growing']}", f"two={grown['growing']}", "--max-sequence-state", "8MiB", "--sequence-state-budget", "16MiB")
    with ServerProcess(*args) as proc:
        proc.start(tmp_path / "serve.log")
        http = httpclient.InferenceServerClient(proc.http)
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        for k in range(6):
            _step(http, 1, model="one", sequence_start=k == 0)
            _step(grpc, "b", model="two", sequence_start=k == 0)
        for k in range(4):
            _step(http, 3, model="one", sequence_start=k == 0)
        assert _held(proc) == {"one": 10 * MIB, "two": 6 * MIB}
        budget = ("the server's sequences hold 17.0 MiB of state after this step, over its 16.0 MiB (--sequence-state-budget): sequence_id 3 "
                  "of model 'one' (5.0 MiB of it) was ended and its state freed; end the sequences you no longer need ('sequence_end': true) "
                  "and start it again ('sequence_start': true), or restart the server with a larger --sequence-state-budget")
        refused = _refused(_step, http, 3, model="one")
        assert (refused.status(), refused.message()) == ("503", budget)
        _held_becomes(proc, "one", 6 * MIB)
        _step(grpc, "b", model="two", sequence_end=True)  # as it says: end one, and there is room
        _held_becomes(proc, "two", 0.0)
        for k in range(7):
            _step(http, 3, model="one", sequence_start=k == 0)
        assert _held(proc) == {"one": 13 * MIB, "two": 0.0}
        failures = http.get_inference_statistics("one")["model_stats"][0]
        metrics = proc.get("/metrics")[1].decode()
        assert 'nv_inference_request_failure{model="one",reason="REJECTED",version="1"} 1' in metrics, metrics  # a 503, as Triton counts it
        assert failures["inference_stats"]["fail"]["count"] == 1
        assert proc.stop() == 0


def test_growing_sequences_sent_without_pause_keep_memory_within_the_budget(grown: dict[str, Path], tmp_path: Path) -> None:
    """The issue's attack: 8 sequences of 24 steps of 1 MiB each, round-robin (192 MiB sent in about
    2 s), every refused sequence started again at once. Before: every step answered, 192 MiB of
    state held until --stream-timeout and RSS +326 MiB. Now the sequences hold at most the 32 MiB
    budget, every refusal names its flag, and RSS grows by less than the budget and a generous
    margin (measured: +64 MiB)."""
    with ServerProcess(f"growing={grown['growing']}", "--max-sequence-state", "8MiB", "--sequence-state-budget", "32MiB") as proc:
        proc.start(tmp_path / "serve.log")
        assert proc.proc is not None
        http = httpclient.InferenceServerClient(proc.http, network_timeout=120)
        _step(http, 999, sequence_start=True, sequence_end=True)  # warm
        before = _rss_mb(proc.proc.pid)
        restart, answered, refusals = set(range(1, 9)), 0, {}
        for _ in range(24):
            for sid in range(1, 9):
                try:
                    _step(http, sid, sequence_start=sid in restart)
                    restart.discard(sid)
                    answered += 1
                except InferenceServerException as e:
                    flag = re.search(r"--max-sequence-state|--sequence-state-budget", e.message())
                    assert flag is not None and e.status() == {"--max-sequence-state": "400", "--sequence-state-budget": "503"}[flag[0]], e
                    refusals[flag[0]] = refusals.get(flag[0], 0) + 1
                    restart.add(sid)
        assert answered > 100 and set(refusals) == {"--max-sequence-state", "--sequence-state-budget"}, (answered, refusals)
        assert _held(proc)["growing"] <= 32 * MIB
        grown_mb = _rss_mb(proc.proc.pid) - before
        assert grown_mb < 32 + 96, f"RSS grew by {grown_mb:.0f} MiB"
        for sid in set(range(1, 9)) - restart:
            _step(http, sid, x=ONE_MIB[:, :1], sequence_end=True)
        _held_becomes(proc, "growing", 0.0)
        assert proc.stop() == 0


def test_a_budget_below_what_one_sequence_may_hold_is_refused_at_start(grown: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(f"growing={grown['growing']}", "--max-sequence-state", "4GiB") as proc:
        proc.start(tmp_path / "serve.log", wait=False)
        assert proc.proc is not None and proc.proc.wait(90) == 1
    assert "error: sequence_state_budget_bytes (--sequence-state-budget) is 2147483648, less than max_sequence_state_bytes (--max-sequence-state), " \
           "4294967296: one sequence would pass the budget alone; give a budget at least as large" in proc.log(), proc.log()


# -- #6: an end always frees its sequence ------------------------------------------------------


def test_an_end_frees_a_sequence_whose_step_failed_in_a_later_stage(grown: dict[str, Path], tmp_path: Path) -> None:
    """``shaped``: stage0 keeps the growing state, stage1 reshapes the sum to the request's
    ``shape``, which onnxruntime refuses but for [1, 1]. A step with [2, 2] fails in stage1 after
    stage0 took it, so the sequence can take no more steps; with one slot and no idle timeout, the
    next start is refused and says to end one: the end is refused (its step cannot run) and frees
    the slot all the same, as its message says, and the start then goes through. So does an end
    whose inputs do not fit its sequence's state (``rnn``: a batch of 2 where the state has 1)."""
    with ServerProcess(f"shaped={grown['shaped']}", f"rnn={grown['rnn']}", "--max-streams", "1", "--stream-timeout", "0") as proc:
        proc.start(tmp_path / "serve.log")
        http = httpclient.InferenceServerClient(proc.http)
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        x = ONE_MIB[:, :4]
        assert _step(http, 1, x, "shaped", (1, 1), sequence_start=True) == 4.0
        failed = _refused(_step, http, 1, x, "shaped", (2, 2))
        assert failed.status() == "500"
        assert re.fullmatch(r"stage 'stage1' failed on request \d+: "
                            r"Reshape node 'shaped': The input tensor cannot be reshaped to the requested shape\. "
                            r"Input shape:\{1,1\}, requested shape:\{2,2\}; the sequence's state is no longer valid: stage\(s\) 'stage0' took step 1 "
                            r"and stage 'stage1' did not; start the sequence again with 'sequence_start': true", failed.message()), failed.message()
        room = ("model 'shaped' cannot start sequence 2: 1 sequences are open, the limit (--max-streams 1): sequence_ids 1; "
                "end one ('sequence_end': true), or restart the server with a larger --max-streams")
        refused = _refused(_step, http, 2, x, "shaped", (1, 1), sequence_start=True)
        assert (refused.status(), refused.message()) == ("503", room)
        ended = _refused(_step, http, 1, x, "shaped", (1, 1), sequence_end=True)  # as it says
        assert (ended.status(), ended.message()) == ("400", (
            "sequence_id 1 cannot take more steps: step 1 failed in stage 'stage1' after stage(s) 'stage0' had updated their state; start it again "
            "with 'sequence_start': true; the step did not run, and the sequence was ended ('sequence_end': true) and its state freed"))
        assert _step(grpc, 2, x, "shaped", (1, 1), sequence_start=True, sequence_end=True) == 4.0  # the slot is free
        _held_becomes(proc, "shaped", 0.0)

        _step(grpc, "r", x, "rnn", sequence_start=True)
        ended = _refused(_step, grpc, "r", np.ones((2, 4), np.float32), "rnn", sequence_end=True)
        assert (ended.status(), ended.message()) == ("StatusCode.INVALID_ARGUMENT", (
            "sequence_id 'r', step 1: input 'x' has batch=2, but the sequence's state was made with batch=1 on its first step; start a new "
            "sequence ('sequence_start': true) for another batch; the step did not run, and the sequence was ended ('sequence_end': true) "
            "and its state freed"))
        _step(http, "s", x, "rnn", sequence_start=True, sequence_end=True)  # the slot is free
        assert proc.stop() == 0


# -- #9: sequence ids are shared names ---------------------------------------------------------


@pytest.fixture()
def guarded(grown: dict[str, Path], tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    (tmp_path / "token").write_text("shared-token")
    with ServerProcess(f"growing={grown['growing']}", "--auth-token-file", tmp_path / "token") as proc:
        proc.start(tmp_path / "serve.log")
        yield proc, {"authorization": "Bearer shared-token"}
        assert proc.stop() == 0


def test_any_client_with_the_token_may_restart_or_end_another_clients_sequence(guarded: tuple[ServerProcess, dict[str, str]]) -> None:
    """As Triton's (and as docs/serving.md says in its security section): a ``sequence_id`` is a
    name, not a capability. Client B's start on client A's id ends A's sequence (A's next step goes
    on from B's fresh state, a 200), and B's end of it ends it for A; ids B does not know (random
    64-bit ones, as the docs advise) it cannot touch."""
    proc, auth = guarded
    a = httpclient.InferenceServerClient(proc.http)
    b = grpcclient.InferenceServerClient(proc.grpc)
    x = ONE_MIB[:, :4]
    assert [_step(a, 41, x, headers=auth, sequence_start=k == 0) for k in range(3)] == [4.0, 8.0, 12.0]
    assert _step(b, 41, 10 * x, headers=auth, sequence_start=True) == 40.0  # B restarts A's sequence
    assert _step(a, 41, x, headers=auth) == 44.0  # A goes on from B's state, not its own 12
    _step(b, 41, x, headers=auth, sequence_end=True)  # B ends it
    refused = _refused(_step, a, 41, x, headers=auth)
    assert refused.message() == ("sequence_id 41 names no open sequence of model 'growing' (it ended with sequence_end): "
                                 "the first request of a sequence must set 'sequence_start': true")
    private = int.from_bytes(np.random.default_rng().bytes(8), "little") | 1  # a random 64-bit id
    _step(a, private, x, headers=auth, sequence_start=True)
    for guess in range(1, 201):  # ending ids blindly does not reach it
        if guess != private:
            _refused(_step, b, guess, x, headers=auth, sequence_end=True)
    assert _step(a, private, x, headers=auth, sequence_end=True) == 8.0
