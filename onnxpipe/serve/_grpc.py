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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from onnxpipe._errors import OnnxpipeError
from onnxpipe.serve import _logs as logs
from onnxpipe.serve._errors import RequestError, bad_request
from onnxpipe.serve._models import ModelPorts, Outputs, ServedModel, sequence_of, timeout_of
from onnxpipe.serve._proto import oip_pb2 as pb
from onnxpipe.serve._state import Decoded, ServerState, Turn
from onnxpipe.serve._tensors import check_shape, from_binary, from_contents, to_binary

__all__ = ["SERVICE", "make_server"]

SERVICE = "inference.GRPCInferenceService"
log = logging.getLogger("onnxpipe.serve")
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]


def make_server(state: ServerState, address: str, max_connections: int) -> tuple[grpc.aio.Server, int]:
    """The asyncio gRPC server of ``state``'s models, bound (not started) to ``address``.

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
    ])

    def method(fn: Callable[[Any], Awaitable[Message]], request: type[Message], response: type[Message], open_to_all: bool = False) -> grpc.RpcMethodHandler:
        async def handle(message: Any, context: grpc.aio.ServicerContext) -> Message:
            if isinstance(message, _Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the message is not a valid {request.__name__}: {message.why}")
            try:
                if not open_to_all:
                    authorize(context)
                return await fn(message)
            except OnnxpipeError as e:  # a RequestError with its status; any other user error INVALID_ARGUMENT
                await context.abort(*_status(e))
            raise AssertionError("context.abort returned")

        rpc = "".join(part.title() for part in fn.__name__.split("_"))  # model_infer: ModelInfer

        async def logged(message: Any, context: grpc.aio.ServicerContext) -> Message:
            """``handle``, and the call's line where one is due (``_logs``, Note: one line per request)."""
            started = time.perf_counter()
            try:
                answer = await handle(message, context)
            except grpc.aio.AbortError:
                logs.grpc_answered(rpc, message, context, started, o.access_log, context.code(), context.details())
                raise
            except asyncio.CancelledError:
                gone = "the call was cancelled (by the client, or its deadline)"
                logs.grpc_answered(rpc, message, context, started, o.access_log, grpc.StatusCode.CANCELLED, gone)
                raise
            except Exception as e:  # a bug: logged with its traceback (the call's line), answered without it; the server goes on
                text = f"internal error: {type(e).__name__}: {e}"
                logs.grpc_answered(rpc, message, context, started, o.access_log, grpc.StatusCode.INTERNAL, text, e)
                await context.abort(grpc.StatusCode.INTERNAL, text)
            logs.grpc_answered(rpc, message, context, started, o.access_log)
            return answer

        return grpc.unary_unary_rpc_method_handler(logged, request_deserializer=_parser(request), response_serializer=response.SerializeToString)

    def authorize(context: grpc.aio.ServicerContext) -> None:
        state.authorize([value for key, value in context.invocation_metadata() or () if key == "authorization"], protocol="grpc")

    async def server_live(_: Any) -> Message:
        return pb.ServerLiveResponse(live=state.live)

    async def server_ready(_: Any) -> Message:
        return pb.ServerReadyResponse(ready=state.serves)

    async def model_ready(r: Any) -> Message:
        # A model that is not served (unknown, loading, failed, another version) is not ready: an answer, not an error (as Triton).
        return pb.ModelReadyResponse(ready=state.takes(r.name, r.version))

    async def server_metadata(_: Any) -> Message:
        return json_format.ParseDict(state.metadata(), pb.ServerMetadataResponse())

    async def model_metadata(r: Any) -> Message:
        return json_format.ParseDict(state.model(r.name, r.version).metadata(), pb.ModelMetadataResponse())

    async def model_config(r: Any) -> Message:
        config = state.model(r.name, r.version).config(state.options.stream_timeout)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    async def model_statistics(r: Any) -> Message:
        return json_format.ParseDict(state.statistics(r.name, r.version), pb.ModelStatisticsResponse())

    async def model_infer(r: Any, turn: Turn | None = None) -> Message:
        model = state.model(r.model_name, r.model_version)
        size = sum(len(c) for c in r.raw_input_contents)
        return await state.infer(model, "grpc", lambda: _decode(model.ports, r), lambda d, o: _encode(model, d, o), size, turn)

    async def model_stream_infer(_: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        try:
            authorize(context)
        except RequestError as e:
            logs.grpc_answered("ModelStreamInfer", None, context, started, o.access_log, *_status(e))
            await context.abort(*_status(e))
        await _Stream(state, context, model_infer).run()

    handlers = {
        "ServerLive": method(server_live, pb.ServerLiveRequest, pb.ServerLiveResponse, open_to_all=True),
        "ServerReady": method(server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse, open_to_all=True),
        "ModelReady": method(model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": method(server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": method(model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelConfig": method(model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelStatistics": method(model_statistics, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
        "ModelInfer": method(model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(model_stream_infer, request_deserializer=_parser(pb.ModelInferRequest),
                                                                  response_serializer=pb.ModelStreamInferResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(address)
    if not port:
        raise OSError(f"cannot listen on {address}")
    return server, port


class _Unparsable:
    """A request message protobuf cannot parse, and why."""

    def __init__(self, why: str) -> None:
        self.why = why


def _parser(request: type[Message]) -> Callable[[bytes], Any]:
    """How a method's messages are read: a message protobuf cannot parse becomes an
    :class:`_Unparsable`, answered INVALID_ARGUMENT by onnxpipe, not grpc's UNKNOWN naming protobuf's type."""

    def parse(data: bytes) -> Any:
        try:
            return request.FromString(data)
        except DecodeError as e:
            return _Unparsable(" ".join(str(e).split())[:200] or "it cannot be parsed")

    return parse


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
        infer: ``ModelInfer``'s work: a request and its turn to its response.
    """

    def __init__(self, state: ServerState, context: grpc.aio.ServicerContext, infer: Callable[[Any, Turn], Awaitable[Message]]) -> None:
        self.state, self.context, self.infer = state, context, infer
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
                    await self.context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down: the stream's requests were answered, and it "
                                                                          "takes no more; send the rest to another server")
                if not self.unanswered and time.monotonic() - self.last >= idle:
                    await self.context.abort(grpc.StatusCode.UNAVAILABLE, f"the stream sent no request for {idle:g} s with none in flight "
                                                                          "(--idle-timeout); start a new stream")
        finally:
            for task in (reader, writer, drained, *self.tasks):
                task.cancel()  # a request still queued is withdrawn, its place freed (_models, Note: request timeouts)
            await asyncio.gather(reader, writer, drained, *self.tasks, return_exceptions=True)

    async def _read(self) -> None:
        turn: Turn | None = None
        while True:
            await self.room.acquire()
            message = await self.context.read()
            if message is grpc.aio.EOF:
                self.answers.put_nowait(None)
                return
            self.last = time.monotonic()
            turn = Turn(turn)
            task = asyncio.create_task(self._answer(message, turn))
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

    async def _answer(self, message: Any, turn: Turn) -> Message:
        """One request's answer: its response, or its error message (its ``id`` kept)."""
        started = time.perf_counter()
        code, text, bug = grpc.StatusCode.OK, None, None
        try:
            if isinstance(message, _Unparsable):
                raise bad_request(f"the message is not a valid ModelInferRequest: {message.why}")
            return pb.ModelStreamInferResponse(infer_response=await self.infer(message, turn))
        except OnnxpipeError as e:
            code, text = _status(e)
        except asyncio.CancelledError:
            code, text = grpc.StatusCode.CANCELLED, "the stream was cancelled (by the client, or its deadline)"
            raise
        except Exception as e:  # a bug: logged with its traceback (its line), answered without it; the stream goes on
            code, text, bug = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}", e
        finally:
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
    model.check_complete(arrays)
    outputs = []
    seen: set[str] = set()
    for out in r.outputs:
        model.output_port(out.name, out.parameters)
        if out.name in seen:
            raise bad_request(f"output '{out.name}' is asked for twice; ask for each output once")
        seen.add(out.name)
        outputs.append((out.name, True))
    parameters = _parameters(r.parameters)
    return Decoded(arrays, sequence_of(parameters), r.id, outputs, True, timeout_of(parameters))


def _encode(model: ServedModel, decoded: Decoded, outputs: Outputs) -> Message:
    names = [name for name, _ in decoded.outputs] or list(model.outputs)
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=decoded.id)
    for name in names:
        port, array = model.outputs[name], outputs[name]
        response.outputs.add(name=name, datatype=port.datatype, shape=array.shape)
        response.raw_output_contents.append(to_binary(port, array))
    return response
