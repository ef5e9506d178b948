"""Messages that send a client or a deployer the right way (issue 29, item 6), from a real server:
a bundle's code refused names ``onnxpipe serve``'s ``--allow-code`` and the pattern; sequence refusals
name the client's ``sequence_id``s and the server's flags (``--max-streams``, ``--stream-timeout``),
never the pipeline's stream numbers or ``load()``'s arguments; the gRPC 401 says to send the
lowercase ``authorization`` metadata, the HTTP one the ``Authorization`` header. Each message's
advice is then followed, and works."""

from __future__ import annotations

import asyncio
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

from onnxpipe import runtime
from onnxpipe.serve import RequestError
from onnxpipe.serve._models import Sequence, ServedModel, client_text
from tests import models
from tests.serve.conftest import serve_args
from tests.serve.process import ServerProcess
from tests.waiting import skip_if_stalled

TOKEN = "messages-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TIMEOUT_S = 2.0
#: The code stage of the ``labelled`` bundle, as the refusal names it and the pattern that allows it.
LABEL = "'tests.code_stages:label' (stage 'label')"
ALLOW = "--allow-code 'tests.code_stages:label'"


@pytest.fixture(scope="module")
def guarded(bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``rnn`` (state per sequence) and ``mlp``, behind a token, two sequences at most, idle ones freed after TIMEOUT_S."""
    root = tmp_path_factory.mktemp("messages")
    (root / "token").write_text(TOKEN)
    with ServerProcess(*serve_args(bundles, "rnn", "mlp"), "--auth-token-file", root / "token", "--max-streams", "2",
                       "--stream-timeout", str(TIMEOUT_S)) as proc:
        proc.start(root / "serve.log")
        yield proc
        assert proc.stop() == 0, proc.log()


def _x(rows: int = 1) -> np.ndarray:
    return np.linspace(-1, 1, 4 * rows, dtype=np.float32).reshape(rows, 4)


def _step(client: Any, module: Any, sid: int | str, x: np.ndarray, **flags: bool) -> Any:
    tensor = module.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    headers = {"authorization": AUTH["Authorization"]} if module is grpcclient else AUTH
    return client.infer("rnn", [tensor], sequence_id=sid, headers=headers, **flags)


def _refused(call: Any, *args: Any, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call(*args, **kwargs)
    return e.value


def _wait_exit(proc: ServerProcess, seconds: float = 90) -> int:
    assert proc.proc is not None
    return proc.proc.wait(seconds)


# -- the code a bundle runs ----------------------------------------------------------------------


def test_serve_refusing_code_names_its_flag_and_the_pattern(bundles: dict[str, Path], tmp_path: Path) -> None:
    with ServerProcess(*serve_args(bundles, "labelled")) as proc:
        proc.start(tmp_path / "refused.log", wait=False)
        assert _wait_exit(proc) == 1, proc.log()
    error = [line for line in proc.log().splitlines() if line.startswith("error: ")]
    assert error == [f"error: model 'labelled' ({bundles['labelled']}): the pipeline runs Python this host has not allowed: {LABEL}; "
                     f"nothing is allowed by default; allow it: onnxpipe serve ... {ALLOW} (fnmatch patterns: 'mypkg.*' allows a whole package)"], proc.log()
    assert "onnxpipe run" not in proc.log() and "allow_code=" not in proc.log()
    with ServerProcess(*serve_args(bundles, "labelled", "twoout"), "--allow-partial") as proc:  # the same words for a model left out
        proc.start(tmp_path / "partial.log")
        assert f"not serving model 'labelled' ({bundles['labelled']}): the pipeline runs Python this host has not allowed: {LABEL}" in proc.log()
        assert f"allow it: onnxpipe serve ... {ALLOW}" in proc.log()
        assert proc.stop() == 0
    with ServerProcess(*serve_args(bundles, "labelled"), "--allow-code", "tests.code_stages:label") as proc:  # as it says
        proc.start(tmp_path / "allowed.log")
        assert proc.get("/v2/models/labelled/ready")[0] == 200
        assert proc.stop() == 0


# -- sequences -----------------------------------------------------------------------------------


def test_a_sequence_refused_for_room_names_the_open_sequence_ids_and_max_streams(guarded: ServerProcess) -> None:
    http = httpclient.InferenceServerClient(guarded.http)
    grpc = grpcclient.InferenceServerClient(guarded.grpc)
    since = time.monotonic()
    _step(http, httpclient, 11, _x(), sequence_start=True)
    _step(grpc, grpcclient, "user-7", _x(), sequence_start=True)
    room = (f"model 'rnn' cannot start sequence 13: 2 sequences are open, the limit (--max-streams 2): sequence_ids 11, 'user-7'; "
            f"end one ('sequence_end': true), let one stay idle for --stream-timeout ({TIMEOUT_S:g} s), or restart the server with a larger --max-streams")
    by_http = _refused(_step, http, httpclient, 13, _x(), sequence_start=True)
    by_grpc = _refused(_step, grpc, grpcclient, 13, _x(), sequence_start=True)
    # a step sizing the state otherwise: named by its sequence_id, with the protocol's remedy
    sized = _refused(_step, http, httpclient, 11, _x(2))
    skip_if_stalled(since, TIMEOUT_S)  # both sequences were still open for the three (tests/waiting.py)
    assert (by_http.status(), by_http.message()) == ("503", room)
    assert by_grpc.status() == "StatusCode.UNAVAILABLE" and by_grpc.message() == room
    for words in ("ids 0", "max_streams=", "load the pipeline"):
        assert words not in room
    assert (sized.status(), sized.message()) == ("400", "sequence_id 11, step 1: input 'x' has batch=2, but the sequence's state was made with "
                                                        "batch=1 on its first step; start a new sequence ('sequence_start': true) for another batch")
    _step(http, httpclient, 11, _x(), sequence_end=True)  # as the first refusal says: end one, and there is room
    _step(http, httpclient, 13, _x(), sequence_start=True)
    time.sleep(TIMEOUT_S + 1.5)  # idle past --stream-timeout: freed by the server's timer
    refused = _refused(_step, grpc, grpcclient, "user-7", _x())
    assert refused.message() == (f"sequence_id 'user-7' names no open sequence of model 'rnn' (it was idle for more than --stream-timeout {TIMEOUT_S:g} s, "
                                 "and its state was freed): the first request of a sequence must set 'sequence_start': true")
    _step(grpc, grpcclient, "user-7", _x(), sequence_start=True, sequence_end=True)  # as it says


class _FailOnce:
    """A session whose next run fails (as tests/runtime/test_streams.py injects one)."""

    def __init__(self, session: Any) -> None:
        self.session, self.armed = session, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def run(self, *args: Any) -> Any:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected failure")
        return self.session.run(*args)


def test_a_sequence_whose_state_is_lost_says_to_start_it_again(bundles: dict[str, Path]) -> None:
    """A step failing after an earlier stage took it (a stage failure cannot be asked of a real
    server): the served model says it in the protocol's terms, the step's 500 and the next step's 400."""
    with runtime.load(bundles["rnn"]) as pipe:
        model = ServedModel("rnn", bundles["rnn"], pipe, max_inflight=4)

        async def step(**flags: bool) -> Any:
            return await model.infer({"x": _x()}, Sequence(5, **flags))

        try:
            asyncio.run(step(start=True))
            stage1 = pipe.idle_runners()[1]
            stage1.session = _FailOnce(stage1.session)
            with pytest.raises(RequestError) as failed:
                asyncio.run(step())
            assert failed.value.status == 500
            assert str(failed.value).endswith("the sequence's state is no longer valid: stage(s) 'stage0' took step 1 and stage 'stage1' did not; "
                                              "start the sequence again with 'sequence_start': true"), failed.value
            with pytest.raises(RequestError) as refused:
                asyncio.run(step())
            assert (refused.value.status, str(refused.value)) == (400, "sequence_id 5 cannot take more steps: step 1 failed in stage 'stage1' after stage(s) "
                                                                       "'stage0' had updated their state; start it again with 'sequence_start': true")
            asyncio.run(step(start=True, end=True))  # as it says
        finally:
            model.close()  # the pipeline, then the model's worker thread


# -- a stage's failure ---------------------------------------------------------------------------


def test_a_failure_inside_onnxruntime_is_answered_without_its_source_and_logged_whole(tmp_path: Path) -> None:
    """``failing``: its stage 'reshape' reshapes x [N, 4] to [2, 4], which onnxruntime refuses for
    N = 3 (issue 36, item 17). Over HTTP and gRPC the 500 names the stage, the node and the shapes,
    without onnxruntime's source file, function and failed check; the request's one log line has
    them."""
    bundle = models.bundle_of(models.failing_config("failing"), tmp_path / "failing")
    with ServerProcess(f"failing={bundle}") as proc:
        proc.start(tmp_path / "serve.log")
        answered = {}
        for module, url, status in ((httpclient, proc.http, "500"), (grpcclient, proc.grpc, "StatusCode.INTERNAL")):
            tensor = module.InferInput("x", [3, 4], "FP32")
            tensor.set_data_from_numpy(np.zeros((3, 4), np.float32))
            rid = f"failing-{module.__name__.rsplit('.', 1)[-1]}"
            refused = _refused(module.InferenceServerClient(url).infer, "failing", [tensor], request_id=rid)
            assert refused.status() == status
            assert re.fullmatch(r"stage 'reshape' failed on request \d+: "
                                r"Reshape node: The input tensor cannot be reshaped to the requested shape\. "
                                r"Input shape:\{3,4\}, requested shape:\{2,4\}", refused.message()), refused.message()
            answered[rid] = refused.message()
        deadline = time.monotonic() + 10
        while not all(f"id={rid} " in proc.log() for rid in answered) and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid, message in answered.items():
            (line,) = [line for line in proc.log().splitlines() if f"id={rid} " in line]
            logged = line.split(": ", 2)[2]
            assert "/onnxruntime_src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:" in logged and "onnxruntime::ReshapeHelper::" in logged
            assert client_text(logged) == message, line  # the log's text is the answer's with onnxruntime's source, on one line
        assert proc.stop() == 0


@pytest.mark.parametrize(("text", "shown"), [
    # ORT_ENFORCE: file and line, __PRETTY_FUNCTION__, the check, then the message; a stream's words after onnxruntime's line break
    ("Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:84 onnxruntime::ReshapeHelper::ReshapeHelper("
     "const onnxruntime::TensorShape&, onnxruntime::TensorShapeVector&, bool) size != 0 && (input_shape_size % size) == 0 was false. "
     "The input tensor cannot be reshaped to the requested shape. Input shape:{6}, requested shape:{4,-1}\n; the stream's state is unchanged",
     "Status Message: The input tensor cannot be reshaped to the requested shape. Input shape:{6}, requested shape:{4,-1}; the stream's state is unchanged"),
    # a return type, and a check with pointers in it
    ("x: /onnxruntime_src/onnxruntime/core/framework/execution_frame.cc:12 onnxruntime::common::Status onnxruntime::IExecutionFrame::"
     "GetOrCreateNodeOutputMLValue(int, int, const onnxruntime::TensorShape*, OrtValue*&, const onnxruntime::Node&) shape && "
     "tensor.Shape() == *shape was false. OrtValue shape verification failed.", "x: OrtValue shape verification failed."),
    # __FUNCTION__ after a bare file name
    ("Status Message: matmul_helper.h:59 Compute MatMul dimension mismatch", "Status Message: MatMul dimension mismatch"),
    # no source: as it was
    ("Status Message: indices element out of data bounds, idx=7 must be within the inclusive range [-2,1]",
     "Status Message: indices element out of data bounds, idx=7 must be within the inclusive range [-2,1]"),
    # a path elsewhere (CUDA's), and file names that are no source
    ("out of memory ; file=/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_allocator.cc ; line=47", "out of memory; file=; line=47"),
    ("model.onnx, x.h and y.cc: left", "model.onnx, x.h and y.cc: left"),
])
def test_a_stages_failure_is_shown_without_onnxruntimes_source(text: str, shown: str) -> None:
    assert client_text(text) == shown


def test_a_long_failure_is_cleaned_in_its_first_16_kib() -> None:
    """A code stage's message may hold what a request sent: the regular expressions see the first
    16 KiB (the answer shows 4,096 characters of it), and the count says how long it was."""
    text = "a.cc:1 f " + "x " * 500_000
    assert client_text(text) == " ".join(["x"] * ((16384 - 9 + 1) // 2)) + "… (1000009 characters)"  # the x's of its first 16384 characters


# -- the token -----------------------------------------------------------------------------------


def test_grpc_401_says_lowercase_metadata_and_http_the_header(guarded: ServerProcess) -> None:
    grpc = grpcclient.InferenceServerClient(guarded.grpc)
    refused = _refused(grpc.get_model_metadata, "mlp")
    assert refused.status() == "StatusCode.UNAUTHENTICATED"
    assert refused.message() == "this server needs a bearer token: send the metadata 'authorization: Bearer <token>'"
    assert grpc.get_model_metadata("mlp", headers={"authorization": f"Bearer {TOKEN}"}).name == "mlp"  # as it says
    status, body = guarded.get("/v2/models/mlp")
    assert (status, body) == (401, b'{"error":"this server needs a bearer token: send the header \'Authorization: Bearer <token>\'"}')
    assert guarded.get("/v2/models/mlp", headers=AUTH)[0] == 200
