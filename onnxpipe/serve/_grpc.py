"""The gRPC front door: ``inference.GRPCInferenceService`` (the Open Inference Protocol's service,
with Triton's ModelConfig and ModelStatistics) on grpcio's asyncio server.

Messages are the generated ones of ``_proto/oip.proto`` (a wire-compatible subset of the canonical
protos); the service is registered under its canonical name, so the method paths are the ones
``tritonclient.grpc`` and ``perf_analyzer`` call. Inputs come from ``raw_input_contents`` (what
both clients send) or typed ``contents``; outputs always go back in ``raw_output_contents``, one
entry per output in order, which is all ``tritonclient.grpc`` reads.

Note: one stream, one order.
    ``ModelStreamInfer`` (Triton's bidirectional stream: tritonclient's ``start_stream`` /
    ``async_stream_infer``, ``perf_analyzer --streaming``) runs each request it reads exactly as
    ``ModelInfer`` runs one (``ServerState.infer``: admission, decoding, deadline, statistics).
    Many may be in flight at once, and their answers are written in the order the requests came,
    as Triton's stream handler does for a model that is not decoupled (it queues each request to
    answer in order; onnxpipe's models never are, as their configs say). A request that fails is
    answered on the stream with ``error_message`` (its ``id`` kept, as Triton's) and the stream
    goes on. Requests are also handed to their models in the order they came, whatever their
    decoding took (a large one is decoded on a thread): each waits for its predecessor's
    :class:`~onnxpipe.serve._state.Turn`, so a sequence's steps sent back to back run in the order
    sent; that holds because ``ServedModel.infer`` hands its request on before it first waits.
    At most ``--max-inflight`` requests of one stream are read and not yet answered: the stream
    reads on as its answers are written, so a client that sends without reading holds that many
    and no more; admission per model stays ``--max-inflight`` across streams and calls, refused
    with an error answer. The stream ends with the client's half-close once every answer is
    written. On a drain (SIGTERM) it stops reading, answers what it read, and ends UNAVAILABLE; a
    stream with nothing in flight that sends nothing for ``--idle-timeout`` ends UNAVAILABLE too
    (an open stream would otherwise keep its connection from ever being idle). A client's
    deadline or cancel ends the call, and its requests are withdrawn as a unary call's are
    (``_models``, Note: request timeouts). A message over ``--max-body-size`` ends the stream
    with RESOURCE_EXHAUSTED: grpc's core refuses it, as Triton's does.

Note: a message's bytes.
    grpc's core receives a call's message before any handler sees it, and would hold what a client
    sends of it for as long as the client likes: a client announcing 60 MiB messages, sending part
    of each and waiting, held 360 MB on an idle server, without a token (issue 36). Measured on
    grpcio 1.85 with a raw HTTP/2 client: a call that nobody reads takes its stream's flow-control
    window (8-32 MiB with grpc's default BDP probing, which grows the window to the link; 48 KiB a
    connection with ``grpc.http2.bdp_probe`` off and a 16 KiB lookahead), and a call whose message
    is being read takes all of it (up to ``grpc.max_receive_message_length``). So every method is
    registered as one that reads its own messages (a unary call is a stream of one message on the
    wire, so clients see no difference), and reads happen only in order: the token first (a call
    without it is refused before its message is read), then a reservation of ``--max-body-size``
    from the server's byte budget, shared with the HTTP door (``_budget``, Note: one budget, two
    doors), then the read, within ``--body-timeout`` for a call (reservation and read together:
    past it the call ends DEADLINE_EXCEEDED, or UNAVAILABLE when it never got room) and, for a
    stream, its idle timeout. Once the message is in, the reservation shrinks to the message's
    size, held until the request is answered. With BDP probing off and a 16 KiB lookahead, what
    a call holds before it reads is its connection's window, at most
    ``grpc.max_concurrent_streams`` (``--max-inflight``) calls a connection; a large message still
    arrives at the link's speed, since the window opens to the message's size once it is read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from onnxpipe._errors import OnnxpipeError
from onnxpipe.serve import _logs as logs
from onnxpipe.serve._budget import BodyBudget, Held, time_limit
from onnxpipe.serve._errors import RequestError, bad_request
from onnxpipe.serve._models import ModelPorts, Outputs, ServedModel, sequence_of, timeout_of
from onnxpipe.serve._proto import oip_pb2 as pb
from onnxpipe.serve._state import OFF_LOOP, Decoded, ServerState, Turn
from onnxpipe.serve._tensors import answer_bytes, check_shape, from_binary, from_contents, held_bytes, to_binary

__all__ = ["SERVICE", "make_server"]

SERVICE = "inference.GRPCInferenceService"
log = logging.getLogger("onnxpipe.serve")
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]
#: What grpc's core may take of a call's stream before the call reads (see Note: a message's bytes).
_LOOKAHEAD = 16 << 10


def make_server(state: ServerState, address: str, max_connections: int, budget: BodyBudget) -> tuple[grpc.aio.Server, int]:
    """The asyncio gRPC server of ``state``'s models, bound (not started) to ``address``; the
    messages it reads are counted against ``budget`` (see Note: a message's bytes).

    Returns:
        The server and the port it bound.

    Raises:
        OSError: the address cannot be bound.
    """
    o = state.options
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", o.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
        # As the HTTP listener's (see Note: connections in _connections): more connections are closed at once, idle ones after the timeout.
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_connection_idle_ms", int(o.idle_timeout * 1000)),
        # What a call may hold before it reads (see Note: a message's bytes).
        ("grpc.max_concurrent_streams", o.max_inflight),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", _LOOKAHEAD),
    ])
    receiver = _Receiver(budget, o.max_body_bytes, o.body_timeout)

    def method(fn: Callable[[Any, Held], Awaitable[Message]], request: type[Message], response: type[Message],
               open_to_all: bool = False) -> grpc.RpcMethodHandler:
        rpc = "".join(part.title() for part in fn.__name__.split("_"))  # model_infer: ModelInfer

        async def handle(_: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Message:
            """The call: its token, its message (see Note: a message's bytes), its answer, and its
            line where one is due (``_logs``, Note: one line per request)."""
            started = time.perf_counter()
            message: Any = None
            held: Held | None = None
            try:
                if not open_to_all:
                    authorize(context)
                message, held = await receiver.message(context, request)
                answer = await fn(message, held)
            except OnnxpipeError as e:  # a RequestError with its status; any other user error INVALID_ARGUMENT
                code, text = _status(e)
                logs.grpc_answered(rpc, message, context, started, o.access_log, code, text)  # before the client can see the answer
                await context.abort(code, text)
            except asyncio.CancelledError:
                gone = "the call was cancelled (by the client, or its deadline)"
                logs.grpc_answered(rpc, message, context, started, o.access_log, grpc.StatusCode.CANCELLED, gone)
                raise
            except Exception as e:  # a bug: logged with its traceback (the call's line), answered without it; the server goes on
                text = f"internal error: {type(e).__name__}: {e}"
                logs.grpc_answered(rpc, message, context, started, o.access_log, grpc.StatusCode.INTERNAL, text, e)
                await context.abort(grpc.StatusCode.INTERNAL, text)
            finally:
                if held is not None:
                    held.release()
            logs.grpc_answered(rpc, message, context, started, o.access_log)
            return answer

        # Read by the handler, not by grpc before it (see Note: a message's bytes): raw bytes, parsed by the receiver.
        return grpc.stream_unary_rpc_method_handler(handle, response_serializer=response.SerializeToString)

    def authorize(context: grpc.aio.ServicerContext) -> None:
        state.authorize([value for key, value in context.invocation_metadata() or () if key == "authorization"], protocol="grpc")

    async def server_live(_: Any, _held: Held) -> Message:
        return pb.ServerLiveResponse(live=state.live)

    async def server_ready(_: Any, _held: Held) -> Message:
        return pb.ServerReadyResponse(ready=state.serves)

    async def model_ready(r: Any, _held: Held) -> Message:
        # A model that is not served (unknown, loading, failed, another version) is not ready: an answer, not an error (as Triton).
        return pb.ModelReadyResponse(ready=state.takes(r.name, r.version))

    async def server_metadata(_: Any, _held: Held) -> Message:
        return json_format.ParseDict(state.metadata(), pb.ServerMetadataResponse())

    async def model_metadata(r: Any, _held: Held) -> Message:
        return json_format.ParseDict(state.model(r.name, r.version).metadata(), pb.ModelMetadataResponse())

    async def model_config(r: Any, _held: Held) -> Message:
        config = state.model(r.name, r.version).config(state.options.stream_timeout)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    async def model_statistics(r: Any, _held: Held) -> Message:
        return json_format.ParseDict(state.statistics(r.name, r.version), pb.ModelStatisticsResponse())

    async def model_infer(r: Any, held: Held, turn: Turn | None = None) -> Message:
        model = state.model(r.model_name, r.model_version)
        # ByteSize: reading raw_input_contents to measure would copy each of them (protobuf's Python API copies bytes fields).
        return await state.infer(model, "grpc", lambda: _decode(model.ports, r), lambda d, o: _encode(model, d, o, held), r.ByteSize(), turn)

    async def model_stream_infer(_: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """The stream, and its line where one is due: each request has its own, and the stream
        one more when it ends other than OK (its token refused, idle, drained, cancelled)."""
        started = time.perf_counter()

        async def end(code: grpc.StatusCode, text: str) -> NoReturn:
            logs.grpc_answered("ModelStreamInfer", None, context, started, o.access_log, code, text)  # before the client can see it
            await context.abort(code, text)
            raise AssertionError("context.abort returned")

        try:
            try:
                authorize(context)
            except RequestError as e:
                await end(*_status(e))
            await _Stream(state, context, model_infer, receiver, end).run()
        except asyncio.CancelledError:
            gone = "the stream was cancelled (by the client, or its deadline)"
            logs.grpc_answered("ModelStreamInfer", None, context, started, o.access_log, grpc.StatusCode.CANCELLED, gone)
            raise
        logs.grpc_answered("ModelStreamInfer", None, context, started, o.access_log)

    handlers = {
        "ServerLive": method(server_live, pb.ServerLiveRequest, pb.ServerLiveResponse, open_to_all=True),
        "ServerReady": method(server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse, open_to_all=True),
        "ModelReady": method(model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": method(server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": method(model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelConfig": method(model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelStatistics": method(model_statistics, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
        "ModelInfer": method(model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(model_stream_infer, response_serializer=pb.ModelStreamInferResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(address)
    if not port:
        raise OSError(f"cannot listen on {address}")
    return server, port


class _Receiver:
    """How every call reads its messages: within the server's byte budget and a deadline (see
    Note: a message's bytes).

    Args:
        budget: The server's byte budget, shared with the HTTP door.
        most: The largest message (``--max-body-size``): what a read reserves.
        timeout: Seconds a call's message may take to arrive, room included (``--body-timeout``).
    """

    def __init__(self, budget: BodyBudget, most: int, timeout: float) -> None:
        self.budget, self.most, self.timeout = budget, most, timeout
        self.leave = most if budget.limit >= 2 * most else 0  # for HTTP's bodies (``_budget``, Note: one budget, two doors)

    async def reserve(self, held: Held) -> None:
        """Room for one message (see Note: a message's bytes), waiting for it."""
        await self.budget.reserve(held, self.most, self.leave)

    async def message(self, context: grpc.aio.ServicerContext, request: type[Message]) -> tuple[Message, Held]:
        """A call's one message, parsed, and the bytes it holds (the caller releases them once answered).

        Raises:
            RequestError: 503 the budget had no room in time, 408 (DEADLINE_EXCEEDED) the message
                did not arrive in time, 400 it is missing or cannot be parsed.
        """
        held = self.budget.hold()
        try:
            try:
                async with time_limit(self.timeout):
                    await self.reserve(held)
                    data = await context.read()
            except TimeoutError:
                if not held.bytes:
                    raise self.budget.refusal(f"{self.timeout:g} s (--body-timeout)") from None
                raise RequestError(408, f"the message did not arrive within {self.timeout:g} s (--body-timeout)") from None
            if not isinstance(data, bytes):  # the client half-closed without a message
                raise bad_request(f"the call sent no {request.__name__}")
            held.keep(len(data))
            return await self.parsed(data, request), held
        except BaseException:
            held.release()
            raise

    async def parsed(self, data: bytes, request: type[Message]) -> Message:
        """``data`` as a ``request``, parsed on a thread when it is large (protobuf holds the
        interpreter while it copies).

        Raises:
            RequestError: 400, protobuf cannot parse it.
        """
        try:
            return await asyncio.to_thread(request.FromString, data) if len(data) >= OFF_LOOP else request.FromString(data)
        except DecodeError as e:
            raise bad_request(f"the message is not a valid {request.__name__}: {' '.join(str(e).split())[:200] or 'it cannot be parsed'}") from None


def _status(error: OnnxpipeError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message a refused request is answered with."""
    code = getattr(grpc.StatusCode, error.grpc_code) if isinstance(error, RequestError) else grpc.StatusCode.INVALID_ARGUMENT
    return code, str(error)


class _Stream:
    """One ``ModelStreamInfer`` call: reads its requests, runs each as ``ModelInfer`` does, and
    writes their answers in the order they came (see Note: one stream, one order).

    Args:
        state: The server's.
        context: The call's.
        infer: ``ModelInfer``'s work: a request, what it holds and its turn to its response.
        receiver: How its messages are read (see Note: a message's bytes).
        end: Ends the call with a status other than OK, its line logged first.
    """

    def __init__(self, state: ServerState, context: grpc.aio.ServicerContext, infer: Callable[[Any, Held, Turn], Awaitable[Message]],
                 receiver: _Receiver, end: Callable[[grpc.StatusCode, str], Awaitable[NoReturn]]) -> None:
        self.state, self.context, self.infer, self.receiver, self.end = state, context, infer, receiver, end
        self.roomless = False  # waiting for room in the byte budget to read the next request
        self.answers: asyncio.Queue[asyncio.Task[Message] | None] = asyncio.Queue()  # in request order; None: no more
        self.room = asyncio.Semaphore(state.options.max_inflight)  # requests read and not yet answered
        self.tasks: set[asyncio.Task[Message]] = set()
        self.unanswered = 0
        self.last = time.monotonic()  # when the stream last read or wrote

    async def run(self) -> None:
        """Serve the call until the client half-closes (every answer written), the server drains,
        or the stream stays idle (both UNAVAILABLE); a client's cancel or deadline cancels this."""
        reader = asyncio.create_task(self._read())
        writer = asyncio.create_task(self._write())
        drained = asyncio.create_task(self.state.drained())
        idle = self.state.options.idle_timeout
        try:
            while True:
                left = idle - (time.monotonic() - self.last) if not self.unanswered else idle
                await asyncio.wait({writer, drained}, timeout=max(left, 0.01), return_when=asyncio.FIRST_COMPLETED)
                if writer.done():
                    writer.result()  # every answer written (or the client gone: its error)
                    return
                if drained.done():
                    reader.cancel()  # no more requests: those read are answered first
                    self.answers.put_nowait(None)
                    await writer
                    await self.end(grpc.StatusCode.UNAVAILABLE, "the server is shutting down: the stream's requests were answered, and it "
                                                                          "takes no more; send the rest to another server")
                if not self.unanswered and time.monotonic() - self.last >= idle and self.roomless:
                    await self.end(grpc.StatusCode.UNAVAILABLE, str(self.receiver.budget.refusal(f"{idle:g} s (--idle-timeout)")))
                if not self.unanswered and time.monotonic() - self.last >= idle:
                    await self.end(grpc.StatusCode.UNAVAILABLE, f"the stream sent no request for {idle:g} s with none in flight "
                                                                          "(--idle-timeout); start a new stream")
        finally:
            for task in (reader, writer, drained, *self.tasks):
                task.cancel()  # a request still queued is withdrawn, its place freed (_models, Note: request timeouts)
            await asyncio.gather(reader, writer, drained, *self.tasks, return_exceptions=True)

    async def _read(self) -> None:
        turn: Turn | None = None
        budget = self.receiver.budget
        while True:
            await self.room.acquire()
            held = budget.hold()
            try:  # room for the message first, then the read (see Note: a message's bytes)
                self.roomless = True
                await self.receiver.reserve(held)
                self.roomless = False
                data = await self.context.read()
            except BaseException:
                held.release()
                raise
            if not isinstance(data, bytes):  # the client half-closed
                held.release()
                self.answers.put_nowait(None)
                return
            held.keep(len(data))
            self.last = time.monotonic()
            turn = Turn(turn)
            task = asyncio.create_task(self._answer(data, held, turn))
            self.tasks.add(task)
            self.unanswered += 1
            self.answers.put_nowait(task)

    async def _write(self) -> None:
        while (task := await self.answers.get()) is not None:
            answer = await task
            self.tasks.discard(task)
            await self.context.write(answer)
            self.unanswered -= 1
            self.last = time.monotonic()
            self.room.release()

    async def _answer(self, data: bytes, held: Held, turn: Turn) -> Message:
        """One request's answer: its response, or its error message (its ``id`` kept); its bytes
        are given back once it is answered."""
        started = time.perf_counter()
        code, text, bug = grpc.StatusCode.OK, None, None
        message: Any = None
        try:
            message = await self.receiver.parsed(data, pb.ModelInferRequest)
            del data  # the parsed message holds the bytes now
            return pb.ModelStreamInferResponse(infer_response=await self.infer(message, held, turn))
        except OnnxpipeError as e:
            code, text = _status(e)
        except asyncio.CancelledError:
            code, text = grpc.StatusCode.CANCELLED, "the stream was cancelled (by the client, or its deadline)"
            raise
        except Exception as e:  # a bug: logged with its traceback (its line), answered without it; the stream goes on
            code, text, bug = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}", e
        finally:
            held.release()
            turn.passed()  # refused before its model saw it: the next may go
            logs.grpc_answered("ModelStreamInfer", message, self.context, started, self.state.options.access_log, code, text, bug)
        return pb.ModelStreamInferResponse(error_message=text, infer_response=pb.ModelInferResponse(id=getattr(message, "id", "")))


def _parameters(params: Any) -> dict[str, Any]:
    """An ``InferParameter`` map as plain values."""
    plain = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        plain[key] = getattr(value, which) if which else None
    return plain


def _decode(model: ModelPorts, r: Any) -> Decoded:
    raw = r.raw_input_contents
    if raw and len(raw) != len(r.inputs):
        raise bad_request(f"raw_input_contents has {len(raw)} entries for {len(r.inputs)} inputs: give one per input, in order, or none")
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(r.inputs):
        port = model.input_port(tensor.name, arrays)
        shape = check_shape(port, tensor.datatype, list(tensor.shape))
        if raw:
            if tensor.HasField("contents"):
                raise bad_request(f"input '{tensor.name}' has both contents and raw_input_contents: give one")
            arrays[tensor.name] = from_binary(port, shape, memoryview(raw[i]))
        elif tensor.HasField("contents"):
            arrays[tensor.name] = from_contents(port, shape, tensor.contents)
        else:
            raise bad_request(f"input '{tensor.name}' has no data: fill raw_input_contents or its contents")
    parameters = _parameters(r.parameters)
    sequence = sequence_of(parameters)
    model.check_complete(arrays, sequence is None or sequence.start)
    r.ClearField("raw_input_contents")  # the arrays hold their own copies (protobuf copies a bytes field as it is read): the message's go
    outputs = []
    seen: set[str] = set()
    for out in r.outputs:
        model.output_port(out.name, out.parameters)
        if out.name in seen:
            raise bad_request(f"output '{out.name}' is asked for twice; ask for each output once")
        seen.add(out.name)
        outputs.append((out.name, True))
    return Decoded(arrays, sequence, r.id, outputs, True, timeout_of(parameters))


def _encode(model: ServedModel, decoded: Decoded, outputs: Outputs, held: Held | None = None) -> Message:
    """The response, its raw outputs in order; counted in ``held`` before it is built, as HTTP's
    answers are (``_http``, Note: what a request holds): the outputs, and the answer twice (its
    message, and the bytes grpc serializes it to).

    Raises:
        RequestError: 503 or 413 from ``held``.
    """
    names = [name for name, _ in decoded.outputs] or list(model.outputs)
    if held is not None:
        held.take(held_bytes(outputs, views=True), "its outputs")
        held.take(2 * answer_bytes([(model.outputs[name], outputs[name], True) for name in names], len(decoded.id)), "its answer")
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=decoded.id)
    for name in names:
        port, array = model.outputs[name], outputs[name]
        response.outputs.add(name=name, datatype=port.datatype, shape=array.shape)
        response.raw_output_contents.append(to_binary(port, array))
    return response
