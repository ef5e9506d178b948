"""The gRPC door held to the HTTP door's limits (issue 36, item 1), attacked with a raw HTTP/2 client
(``h2``) against a real ``onnxpipe serve``: calls that announce a large message, send part of it and
wait. A call without a valid token is refused before its message is read; the messages being read
hold no more than the server's byte budget (``--max-inflight`` x ``--max-body-size``, shared with
HTTP); a message that does not arrive within ``--body-timeout`` ends its call; a connection carries
at most ``--max-inflight`` calls; every such call ends with a status and a log line."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.serve.conftest import serve_args
from tests.serve.h2calls import STREAM_INFER, PartialCalls
from tests.serve.process import ServerProcess

MIB = 1 << 20
MAX_BODY_MIB = 16
MAX_INFLIGHT = 4
BODY_TIMEOUT_S = 3
TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
#: What the server may hold beyond its byte budget under these attacks: its own allocations, grpc's
#: per-call buffers and windows, the allocator's slack (generous: RSS on a shared machine is noisy).
MARGIN_MB = 60


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def proc(bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("grpc-door")
    (root / "token").write_text(TOKEN + "\n")
    args = ("--auth-token-file", root / "token", "--max-body-size", f"{MAX_BODY_MIB}MiB", "--max-inflight", MAX_INFLIGHT,
            "--body-timeout", BODY_TIMEOUT_S, "--idle-timeout", "4")
    with ServerProcess(*serve_args(bundles, "twoout"), *args) as p:
        p.start(root / "serve.log")
        yield p


def _works(proc: ServerProcess) -> None:
    """A normal gRPC client is answered, and the server is ready."""
    client = grpcclient.InferenceServerClient(proc.grpc)
    tensor = grpcclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
    answer = client.infer("twoout", [tensor], headers={"authorization": f"Bearer {TOKEN}"}).as_numpy("Y")
    assert answer is not None and answer.shape == (1, 4)
    assert proc.get("/v2/health/ready")[0] == 200


def _attack(proc: ServerProcess, calls: list[PartialCalls], seconds: float) -> float:
    """Pump the calls for ``seconds`` (less once all ended); the server's peak RSS meanwhile, in MB."""
    assert proc.proc is not None
    peak = 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(c.open_calls() for c in calls):
        for c in calls:
            c.pump(0.02)
        peak = max(peak, _rss_mb(proc.proc.pid))
    return peak


def _statuses(calls: list[PartialCalls]) -> list[tuple[int, str]]:
    return [status for c in calls for status in c.ended.values()]


def test_calls_without_a_token_are_refused_before_their_message_is_held(proc: ServerProcess) -> None:
    """The issue's attack: 8 connections of one call and one of 16 calls, each announcing 60 MiB and
    sending what flow control lets through, without a token: 101 -> 362 MB held, no call ended, no
    line. Now each is refused UNAUTHENTICATED at once, having held no more than grpc's window (or,
    past the connection's --max-inflight calls, refused by HTTP/2 itself)."""
    assert proc.proc is not None
    before = _rss_mb(proc.proc.pid)
    calls = [PartialCalls(proc.grpc, 1, 60 * MIB, 16 * MIB) for _ in range(8)] + [PartialCalls(proc.grpc, 16, 60 * MIB, 8 * MIB)]
    try:
        peak = _attack(proc, calls, 10)
        statuses = _statuses(calls)
        refused = (grpc.StatusCode.UNAUTHENTICATED.value[0], "this server needs a bearer token: send the metadata 'authorization: Bearer <token>'")
        # The connection of 16 calls may open --max-inflight at once: the rest are refused by HTTP/2 (REFUSED_STREAM).
        assert len(statuses) == 24 and statuses.count(refused) == 8 + MAX_INFLIGHT, statuses
        assert set(statuses) <= {refused, (-1, "reset (11)")}, statuses
        assert sum(sum(c.sent.values()) for c in calls) < 24 * MIB  # what grpc's window let through: no call read on
    finally:
        for c in calls:
            c.close()
    assert peak - before < MARGIN_MB, (before, peak)
    _works(proc)
    assert proc.log().count("UNAUTHENTICATED") >= 8 + MAX_INFLIGHT  # a line each (the refused streams never reached onnxpipe)


def test_partial_messages_hold_at_most_the_byte_budget_and_end_at_the_body_timeout(proc: ServerProcess) -> None:
    """24 calls with the token, each announcing 16 MiB (the largest message) and sending 15 MiB of
    it: no more than --max-inflight x --max-body-size (64 MiB) of them is read at once, less one
    --max-body-size left to HTTP's bodies, the rest wait for room; each call ends within --body-timeout (plus the wait for room) with a status that
    names the limit, and a line in the log."""
    assert proc.proc is not None
    before = _rss_mb(proc.proc.pid)
    calls = [PartialCalls(proc.grpc, 3, MAX_BODY_MIB * MIB, (MAX_BODY_MIB - 1) * MIB, AUTH) for _ in range(8)]
    try:
        peak = _attack(proc, calls, 1.0)
        assert all(c.open_calls() == 3 for c in calls)  # reading, or waiting for room
        # HTTP keeps one --max-body-size of the budget: a reservation costs the client nothing, a body must be sent.
        body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}).encode()
        assert proc.request("POST", "/v2/models/twoout/infer", body, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        peak = max(peak, _attack(proc, calls, 4 * BODY_TIMEOUT_S))
        statuses = _statuses(calls)
    finally:
        for c in calls:
            c.close()
    # Every call ended by the server, each with the status of the timer that ended it (below): the
    # body's wait, or the wait for room; none was left for the client to give up on.
    assert len(statuses) == 24, statuses
    late = (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], f"the message did not arrive within {BODY_TIMEOUT_S} s (--body-timeout)")
    assert statuses.count(late) >= MAX_INFLIGHT - 1, statuses  # read at once: all the budget less HTTP's share
    for status in set(statuses) - {late}:
        assert status == (grpc.StatusCode.UNAVAILABLE.value[0], f"no room to read the request in {BODY_TIMEOUT_S} s (--body-timeout): the server "
                                                                f"buffers at most {MAX_INFLIGHT * MAX_BODY_MIB * MIB} bytes of requests at once "
                                                                "(--max-inflight x --max-body-size), and held them all; retry later"), status
    budget = MAX_INFLIGHT * MAX_BODY_MIB
    assert peak - before < budget + MARGIN_MB, (before, peak)
    _works(proc)
    deadline = time.monotonic() + 15  # given back once the server is quiet (serve._budget, Note: memory given back)
    while _rss_mb(proc.proc.pid) - before >= MARGIN_MB and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _rss_mb(proc.proc.pid) - before < MARGIN_MB  # what the messages held went back to the system (was: 318 of 490 MB kept)
    assert proc.log().count("the message did not arrive within") >= MAX_INFLIGHT - 1


def test_a_connection_carries_at_most_max_inflight_calls(proc: ServerProcess) -> None:
    """The server says so in its HTTP/2 settings, and a call past it is refused by the protocol."""
    calls = PartialCalls(proc.grpc, MAX_INFLIGHT + 2, 1024, 0, AUTH)
    try:
        calls.pump(1.0)
        assert calls.max_streams == MAX_INFLIGHT
        assert sum(1 for status, _ in calls.ended.values() if status == -1) >= 2  # refused (reset) past the limit
    finally:
        calls.close()
    _works(proc)


def test_a_stream_that_stalls_mid_message_ends_at_its_idle_timeout_with_a_line(proc: ServerProcess) -> None:
    """ModelStreamInfer: a message sent in part, then nothing: the stream ends UNAVAILABLE at
    --idle-timeout (4 s), its bytes given back, and says so in the log (item 14)."""
    calls = PartialCalls(proc.grpc, 1, 8 * MIB, 4 * MIB, AUTH, path=STREAM_INFER)
    try:
        calls.pump(10)
        assert list(calls.ended.values()) == [(grpc.StatusCode.UNAVAILABLE.value[0], "the stream sent no request for 4 s with none in flight "
                                                                                     "(--idle-timeout); start a new stream")]
    finally:
        calls.close()
    deadline = time.monotonic() + 5
    while "ModelStreamInfer" not in proc.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(line for line in proc.log().splitlines() if "ModelStreamInfer" in line)
    assert "UNAVAILABLE" in line and "--idle-timeout" in line, line
    _works(proc)


def test_a_grpc_answer_is_counted_before_it_is_built(tmp_path: Path) -> None:
    """As HTTP's: the outputs and the answer (its message, and grpc's serialized copy) count against
    the budget before the answer is built. --max-inflight 2 x --max-body-size 8 MiB: a 1 MiB echo
    holds 1 + 1 + 2 x 1 MiB and is answered; a 6 MiB one would hold 24 MiB, more than the whole
    budget, and is refused RESOURCE_EXHAUSTED naming it."""
    from tests.serve.test_hostile_traffic import _echo_bundle

    with ServerProcess(f"echo={_echo_bundle(tmp_path)}", "--max-body-size", "8MiB", "--max-inflight", "2") as proc:
        proc.start(tmp_path / "serve.log")
        client = grpcclient.InferenceServerClient(proc.grpc)
        for mib, fits in ((1, True), (6, False)):
            x = np.random.default_rng(mib).standard_normal(mib * MIB // 4).astype(np.float32)
            tensor = grpcclient.InferInput("X", [x.size], "FP32")
            tensor.set_data_from_numpy(x)
            if fits:
                answer = client.infer("echo", [tensor]).as_numpy("Y")
                assert answer is not None and np.array_equal(answer, x)
                continue
            with pytest.raises(InferenceServerException) as refused:
                client.infer("echo", [tensor])
            assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
            assert "for its answer), more than it holds for all requests at once (16777216: --max-inflight x --max-body-size)" in str(refused.value)
