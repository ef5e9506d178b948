"""The gRPC front door: ``inference.GRPCInferenceService`` (the Open Inference Protocol's service,
with Triton's ModelConfig and ModelStatistics) on grpcio's asyncio server.

Messages are the generated ones of ``_proto/oip.proto`` (a wire-compatible subset of the canonical
protos); the service is registered under its canonical name, so the method paths are the ones
``tritonclient.grpc`` and ``perf_analyzer`` call. Inputs come from ``raw_input_contents`` (what
both clients send) or typed ``contents``; outputs always go back in ``raw_output_contents``, one
entry per output in order, which is all ``tritonclient.grpc`` reads.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from onnxpipe._errors import OnnxpipeError
from onnxpipe.serve._errors import RequestError, bad_request
from onnxpipe.serve._models import VERSION, ModelPorts, Outputs, ServedModel, sequence_of
from onnxpipe.serve._proto import oip_pb2 as pb
from onnxpipe.serve._state import Decoded, ServerState
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
                    state.authorize([value for key, value in context.invocation_metadata() or () if key == "authorization"], protocol="grpc")
                return await fn(message)
            except RequestError as e:
                await context.abort(getattr(grpc.StatusCode, e.grpc_code), str(e))
            except OnnxpipeError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:  # a bug: logged with its traceback, answered without it; the server goes on
                if isinstance(e, grpc.aio.AbortError):
                    raise
                log.exception("internal error on gRPC %s", fn.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
            raise AssertionError("context.abort returned")

        def parse(data: bytes) -> Any:
            try:
                return request.FromString(data)
            except DecodeError as e:  # answered INVALID_ARGUMENT by the handler, not grpc's UNKNOWN naming protobuf's type
                return _Unparsable(" ".join(str(e).split())[:200] or "it cannot be parsed")

        return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=parse, response_serializer=response.SerializeToString)

    async def server_live(_: Any) -> Message:
        return pb.ServerLiveResponse(live=state.live)

    async def server_ready(_: Any) -> Message:
        return pb.ServerReadyResponse(ready=state.serves)

    async def model_ready(r: Any) -> Message:
        # A model that is not served (unknown, loading, failed, another version) is not ready: an answer, not an error (as Triton).
        ready = r.name in state.models and r.version in ("", VERSION) and not state.draining
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(_: Any) -> Message:
        return json_format.ParseDict(state.metadata(), pb.ServerMetadataResponse())

    async def model_metadata(r: Any) -> Message:
        return json_format.ParseDict(state.model(r.name, r.version).metadata(), pb.ModelMetadataResponse())

    async def model_config(r: Any) -> Message:
        config = state.model(r.name, r.version).config(state.options.stream_timeout)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    async def model_statistics(r: Any) -> Message:
        return json_format.ParseDict(state.statistics(r.name, r.version), pb.ModelStatisticsResponse())

    async def model_infer(r: Any) -> Message:
        model = state.model(r.model_name, r.model_version)
        return await state.infer(model, "grpc", lambda: _decode(model.ports, r), lambda d, o: _encode(model, d, o), sum(len(c) for c in r.raw_input_contents))

    handlers = {
        "ServerLive": method(server_live, pb.ServerLiveRequest, pb.ServerLiveResponse, open_to_all=True),
        "ServerReady": method(server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse, open_to_all=True),
        "ModelReady": method(model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": method(server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": method(model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelConfig": method(model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelStatistics": method(model_statistics, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
        "ModelInfer": method(model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
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
    return Decoded(arrays, sequence_of(_parameters(r.parameters)), r.id, outputs, True)


def _encode(model: ServedModel, decoded: Decoded, outputs: Outputs) -> Message:
    names = [name for name, _ in decoded.outputs] or list(model.outputs)
    response = pb.ModelInferResponse(model_name=model.name, model_version=VERSION, id=decoded.id)
    for name in names:
        port, array = model.outputs[name], outputs[name]
        response.outputs.add(name=name, datatype=port.datatype, shape=array.shape)
        response.raw_output_contents.append(to_binary(port, array))
    return response
