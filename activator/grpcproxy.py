"""The v2 gRPC service (`inference.GRPCInferenceService`), held and forwarded.

Messages travel as the client's bytes: each is parsed only for its model's name (the
runtime's generated `grpc_service_pb2`), held in `holding.Holder` until a pod is Ready
(past its bounds: UNAVAILABLE with a `retry-after` trailer; which model: `routing`, from
the message's model name and the `kiln-namespace` metadata or the one namespace known), then sent to that pod once.
The channel to the pod is connected before anything is sent (a pod that will not connect
is tried again), and once sent, the pod's answer, or its failure, is the answer: nothing
is sent twice. ServerLive, ServerReady and ServerMetadata are the activator's own.
ModelStreamInfer is held on its first message, then piped to one pod both ways.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from kiln import __version__
from kiln.activator.holding import MAX_HELD_BYTES, Holder, Refused, Unknown
from kiln.activator.routing import NAMESPACE_HEADER
from kiln.activator.table import Endpoint, Key
from kiln.runtime.serving.grpc import grpc_service_pb2 as pb

log = logging.getLogger("kiln.activator.grpc")

SERVICE = "inference.GRPCInferenceService"
CONNECT_SECONDS = 5.0
CONNECT_TRIES = 3
# The field naming the model in each held method's request.
MODEL_FIELD = {"ModelReady": "name", "ModelMetadata": "name", "ModelInfer": "model_name",
               "ModelStreamInfer": "model_name"}
_LOCAL = {"ServerLive": lambda: pb.ServerLiveResponse(live=True),
          "ServerReady": lambda: pb.ServerReadyResponse(ready=True),
          "ServerMetadata": lambda: pb.ServerMetadataResponse(name="kiln-activator", version=__version__)}


def _metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    """The call's metadata to pass on (not the transport's own)."""
    return tuple((k, v) for k, v in context.invocation_metadata() or ()
                 if not k.startswith(":") and not k.startswith("grpc-") and k not in ("user-agent", "te", NAMESPACE_HEADER))


def _named(context: grpc.aio.ServicerContext) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == NAMESPACE_HEADER:
            return v
    return None


class GrpcProxy:
    def __init__(self, holder: Holder, default_namespace: str | None = None,
                 max_message_bytes: int = MAX_HELD_BYTES) -> None:
        self.holder, self.default_namespace, self.max_message_bytes = holder, default_namespace, max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._server: grpc.aio.Server | None = None
        self.forwarded = 0

    async def start(self, host: str, port: int) -> int:
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.max_message_bytes),
                                                ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers([self._handlers()])
        bound = self._server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if bound == 0:
            raise OSError(f"gRPC cannot bind {host}:{port}")
        await self._server.start()
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(5.0)
        for channel in self._channels.values():
            await channel.close()

    def _handlers(self) -> grpc.GenericRpcHandler:
        service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]]
        methods = {}
        for method in service.methods:
            name = method.name
            if method.client_streaming:
                methods[name] = grpc.stream_stream_rpc_method_handler(self._stream(name))
            elif name in _LOCAL:
                methods[name] = grpc.unary_unary_rpc_method_handler(
                    self._local(name), response_serializer=lambda m: m.SerializeToString())
            else:
                methods[name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(name, getattr(pb, method.input_type.name)))
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def _local(self, name: str):
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            return _LOCAL[name]()
        return handle

    async def _key(self, method: str, message: bytes, message_type: Any, context: grpc.aio.ServicerContext) -> Key:
        try:
            model = getattr(message_type.FromString(message), MODEL_FIELD[method])
        except (DecodeError, UnicodeDecodeError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the bytes are not a {message_type.__name__}")
        key = await self.holder.key(model, None, self.default_namespace, _named(context))
        if key is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"cannot tell the namespace of model {model!r}: "
                                                           f"call it by its Service name, <model>.<namespace>.svc")
        return key

    async def _connected(self, key: Key, context: grpc.aio.ServicerContext) -> tuple[Endpoint, grpc.aio.Channel]:
        """A Ready pod and a channel already connected to it (so a send is the only send)."""
        for attempt in range(CONNECT_TRIES):
            try:
                endpoint = await self.holder.endpoint(key)
            except Refused as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, e.message,
                                    trailing_metadata=(("retry-after", str(e.retry_after)),))
            except Unknown as e:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            channel = self._channel(endpoint)
            try:
                async with asyncio.timeout(CONNECT_SECONDS):
                    await channel.channel_ready()
                return endpoint, channel
            except TimeoutError:
                log.info("gRPC connect to %s timed out; try %d of %d", endpoint.grpc_target, attempt + 1, CONNECT_TRIES)
                self._channels.pop(endpoint.grpc_target, None)
                await channel.close()
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{key[0]}/{key[1]}: no pod accepted a connection",
                            trailing_metadata=(("retry-after", "5"),))
        raise AssertionError("abort raises")

    def _channel(self, endpoint: Endpoint) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint.grpc_target)
        if channel is None:
            channel = grpc.aio.insecure_channel(endpoint.grpc_target, options=[
                ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
            self._channels[endpoint.grpc_target] = channel
        return channel

    def _unary(self, method: str, message_type: Any):
        path = f"/{SERVICE}/{method}"

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            key = await self._key(method, request, message_type, context)
            _, channel = await self._connected(key, context)
            self.forwarded += 1
            try:
                return await channel.unary_unary(path)(request, metadata=_metadata(context),
                                                       timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:  # the pod's answer: passed on, never sent again
                await context.abort(e.code(), e.details() or "", trailing_metadata=e.trailing_metadata() or ())
        return handle

    def _stream(self, method: str):
        path = f"/{SERVICE}/{method}"

        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            first = None
            async for first in requests:
                break
            if first is None:
                return
            key = await self._key(method, first, pb.ModelInferRequest, context)
            _, channel = await self._connected(key, context)

            async def upstream_requests() -> AsyncIterator[bytes]:
                yield first
                async for message in requests:
                    yield message

            self.forwarded += 1
            call = channel.stream_stream(path)(upstream_requests(), metadata=_metadata(context),
                                               timeout=context.time_remaining())
            try:
                async for answer in call:
                    yield answer
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "", trailing_metadata=e.trailing_metadata() or ())
        return handle
