"""The Open Inference Protocol (v2) over gRPC: `inference.GRPCInferenceService`, as KServe
and Triton define it (runtime/serving/grpc/grpc_service.proto), on its own port beside the
HTTP server: the gRPC door of the dataplane.

A request flows door -> dataplane -> model -> scheduler: this module translates protobuf
to and from the dataplane's calls (`dataplane.Dataplane`: which model, readiness,
draining, in-flight tracking and outcome metrics, admission, tenancy from the call's
metadata, the inference), the same dataplane as the HTTP door's (`servers` starts both on
it), so a gRPC and an HTTP request are batched together by one scheduler. Each request's
work is `GrpcEndpoint.infer_message` (a unary ModelInfer's, a stream's). Only the encoding
differs from HTTP:

- inputs in `raw_input_contents` (what tritonclient sends: one entry per input, in order,
  its little-endian bytes, the exact size its shape and datatype need), or typed in each
  input's `contents` (fp32_contents, int64_contents...: the JSON `data` equivalent);
- outputs always in `raw_output_contents`, one per output in the order of `outputs`.

Every check on shapes, ranks, datatypes, profiles and the batch is `tensors`', with the
same messages as over HTTP. Each kind of refusal has its gRPC code (`CODES`): INVALID
INVALID_ARGUMENT, NOT_FOUND NOT_FOUND, OVERLOADED RESOURCE_EXHAUSTED (with a `retry-after`
trailer), UNAVAILABLE UNAVAILABLE (draining, a model not loaded), FAILED INTERNAL. A message over --max-body-bytes is refused
by gRPC itself (RESOURCE_EXHAUSTED) before it is decoded; bytes that are not the method's
message are INVALID_ARGUMENT (the handlers parse them, `_parsing`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Awaitable, Callable, Iterable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kiln import __version__
from kiln.runtime.serving.grpc import grpc_service_pb2 as pb
from kiln.runtime.serving.grpc.stream import ModelStreamInfer
from kiln.runtime.serving import protocol, tensors
from kiln.runtime.engine.backends.base import DATATYPES, TensorSpec
from kiln.runtime.serving.dataplane import Dataplane
from kiln.runtime.serving.model import Model
from kiln.runtime.serving.tensors import shown
from kiln.runtime.serving.refusals import Kind, Refusal, cut, internal_error
from kiln.runtime.serving.refusals import invalid as bad_request

log = logging.getLogger("kiln.runtime.grpc")

# The gRPC status code of each kind of refusal.
CODES = {
    Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.REFUSED: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Kind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,  # a sequence's state is another engine's
    Kind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.UNSUPPORTED_MEDIA: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.FAILED: grpc.StatusCode.INTERNAL,
    Kind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# The typed field of InferTensorContents that carries each datatype (FP16 has none: its
# tensors travel in raw_input_contents only, as in Triton).
CONTENTS_FIELD = {"BOOL": "bool_contents", "UINT8": "uint_contents", "INT8": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents"}
# How long stop() lets calls still open finish, after the server's own drain.
_STOP_GRACE_SECONDS = 1.0


async def _abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
    """End the call with the refusal's code (raises: the call ends here)."""
    trailers = () if refusal.retry_after is None else (
        ("retry-after", str(max(1, math.ceil(refusal.retry_after)))),)
    await context.abort(CODES[refusal.kind], cut(refusal.message), trailing_metadata=trailers)


def _parsing(handler: Callable[[Any, Any], Awaitable[Any]], message_type: Any
             ) -> Callable[[bytes, Any], Awaitable[Any]]:
    """`handler` on the message parsed from the request's bytes; bytes that are not one
    (garbage, cut short, a string field that is not UTF-8) are INVALID_ARGUMENT."""
    name = message_type.DESCRIPTOR.full_name

    async def parse_then_handle(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = message_type.FromString(data)
        except DecodeError:  # upb's message names the type only
            log.info("gRPC: refused %d bytes that are not a valid %s", len(data), name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the message is not a valid {name}: protobuf cannot parse its "
                                f"{len(data)} bytes (malformed, cut short, or a string that is "
                                f"not UTF-8)")  # raises: the call ends here
        try:
            return await handler(request, context)
        except grpc.aio.AbortError:
            raise  # a refusal, answered
        except Exception:  # a bug: INTERNAL with a request id, not gRPC's "Unexpected <exception>"
            await _abort(context, internal_error(log, f"gRPC {handler.__name__}"))

    return parse_then_handle


SERVICE = "inference.GRPCInferenceService"


class GrpcEndpoint:
    """The service's methods over one dataplane, and the `grpc.aio` server they run on."""

    def __init__(self, dataplane: Dataplane):
        self.dataplane = dataplane
        self._grpc: grpc.aio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the port bound. A port that cannot
        be bound is an OSError, as for the HTTP server."""
        limit = self.dataplane.max_request_bytes
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", -1),
            # Without this, a second server on a taken port shares it silently.
            ("grpc.so_reuseport", 0),
        ])
        self._grpc.add_generic_rpc_handlers([self._handlers()])
        address = f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"
        try:
            bound = self._grpc.add_insecure_port(address)
        except RuntimeError as e:
            self._grpc = None
            raise OSError(f"gRPC cannot bind {address}: {e}") from None
        if bound == 0:  # older grpcio: 0 instead of an exception
            self._grpc = None
            raise OSError(f"gRPC cannot bind {address}")
        await self._grpc.start()
        return bound

    def _handlers(self) -> grpc.GenericRpcHandler:
        """One handler per method of the service in the .proto, each this class's method of
        that name (so a method the proto adds and this class lacks fails at start). Each
        gets the request's bytes (no request_deserializer) and parses them itself: gRPC's
        own failure to parse answers UNKNOWN and logs a traceback. The one streaming
        method, ModelStreamInfer, is stream.py's, over `infer_message`."""
        service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]]
        methods = {}
        for method in service.methods:
            if method.client_streaming:
                methods[method.name] = grpc.stream_stream_rpc_method_handler(
                    ModelStreamInfer(self.infer_message, self.dataplane.drain_started).handle,
                    response_serializer=lambda message: message.SerializeToString())
                continue
            methods[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsing(getattr(self, method.name), getattr(pb, method.input_type.name)),
                response_serializer=lambda message: message.SerializeToString())
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(_STOP_GRACE_SECONDS)
            self._grpc = None

    # -- health and metadata -----------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.dataplane.unready() is None)

    async def ModelReady(self, request, context):
        model = await _answered(context, self.dataplane.find_model, request.name,
                                request.version or None)
        return pb.ModelReadyResponse(ready=self.dataplane.model_ready(model))

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="kiln", version=__version__,
                                         extensions=[protocol.BINARY_EXTENSION])

    async def ModelMetadata(self, request, context):
        model = await _answered(context, self.dataplane.described_model, request.name,
                                request.version or None)
        return pb.ModelMetadataResponse(
            name=model.name, versions=[model.version], platform=model.platform or "",
            inputs=[_tensor_metadata(s) for s in model.inputs],
            outputs=[_tensor_metadata(s) for s in model.outputs])

    # -- inference ---------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        try:
            return await self.infer_message(request, context.invocation_metadata() or ())
        except Refusal as e:
            await _abort(context, e)

    async def infer_message(self, request: pb.ModelInferRequest,
                            metadata: Iterable[tuple[str, str]]) -> pb.ModelInferResponse:
        """One inference request, whatever call it came in (ModelInfer, a stream):
        `metadata` is the call's (its tenancy headers). Raises Refusal."""
        dataplane = self.dataplane
        model = dataplane.find_model(request.model_name, request.model_version or None)
        async with dataplane.request(model) as call:
            await call.admit()
            inputs, outputs = decode_request(request, model.inputs, model.outputs,
                                             model.profiles)
            parameters = _parameters(request.parameters)
            results = await call.infer(inputs, parameters, lambda: metadata, outputs)
            return encode_response(model.name, model.version, request.id, outputs, results)


async def _answered(context: grpc.aio.ServicerContext, find: Callable[..., Model],
                    *args: Any) -> Model:
    """`find(*args)`, its Refusal answered as the call's error."""
    try:
        return find(*args)
    except Refusal as e:
        await _abort(context, e)
        raise  # abort raises; never reached


def _parameters(params) -> dict[str, Any]:
    """A request's `parameters` map (InferParameter) as the JSON request's plain values."""
    return {name: getattr(p, p.WhichOneof("parameter_choice"))
            for name, p in params.items() if p.WhichOneof("parameter_choice")}


def _tensor_metadata(spec: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(**tensors.tensor_metadata(spec))


# -- the encoding: protobuf <-> numpy, the checks tensors' ---------------------------------

def decode_request(request: pb.ModelInferRequest, inputs: list[TensorSpec],
                   outputs: list[TensorSpec], profiles) -> tuple[dict[str, np.ndarray], list[str]]:
    """A ModelInferRequest -> (input arrays, names of the outputs to answer, in order).
    Raises Refusal (INVALID) with tensors' messages."""
    tensors.check_parameters(request.parameters, "the request")
    if not request.inputs:
        raise bad_request("the request needs a non-empty 'inputs' list")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise bad_request(f"the request has {len(request.inputs)} inputs but "
                          f"{len(raw)} raw_input_contents; send every input's bytes there, "
                          f"in the order of 'inputs', or none")
    specs = {s.name: s for s in inputs}
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        spec = tensors.input_spec(tensor.name, specs, arrays)
        tensors.check_parameters(tensor.parameters, f"input '{spec.name}'")
        tensors.check_datatype(spec, tensor.datatype)
        shape = list(tensor.shape)
        tensors.check_dimensions(spec, shape)
        if raw:
            if tensor.HasField("contents"):
                raise bad_request(f"input '{spec.name}' has both 'contents' and "
                                  f"raw_input_contents")
            arrays[spec.name] = _from_raw(spec, shape, raw[i], i)
        else:
            arrays[spec.name] = _from_contents(spec, shape, tensor)
    tensors.check_inputs(arrays, inputs, profiles)

    if not request.outputs:
        return arrays, [s.name for s in outputs]
    chosen: list[str] = []
    for item in request.outputs:
        tensors.check_output_name(item.name, outputs)
        tensors.check_parameters(item.parameters, f"output {shown(item.name)}")
        chosen.append(item.name)
    return arrays, chosen


def _from_raw(spec: TensorSpec, shape: list[int], data: bytes, index: int) -> np.ndarray:
    dtype = DATATYPES[spec.datatype]
    need = math.prod(shape) * dtype.itemsize
    if len(data) != need:
        raise bad_request(f"input '{spec.name}': raw_input_contents[{index}] has {len(data)} "
                          f"bytes but shape {shown(shape)} of {spec.datatype} needs {need}")
    return tensors.from_bytes(data, dtype, shape)


def _from_contents(spec: TensorSpec, shape: list[int], tensor) -> np.ndarray:
    name, datatype = spec.name, spec.datatype
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise bad_request(f"input '{name}': {datatype} has no typed 'contents' field; send "
                          f"it in raw_input_contents")
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise bad_request(f"input '{name}': shape {shown(shape)} needs {count} elements "
                          f"but 'contents.{field}' has {len(values)}")
    dtype = DATATYPES[datatype]
    wide = np.fromiter(values, dtype=np.float32 if datatype == "FP32" else
                       np.float64 if datatype == "FP64" else np.bool_ if datatype == "BOOL"
                       else np.uint64 if field.startswith("uint") else np.int64, count=count)
    tensors.check_range(name, wide, datatype, dtype)
    return wide.astype(dtype, copy=False).reshape(shape)


def encode_response(model_name: str, model_version: str, request_id: str, outputs: list[str],
                    results: dict[str, np.ndarray]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model_name, model_version=model_version,
                                     id=request_id)
    for name in outputs:
        array = np.asarray(results[name])
        response.outputs.add(name=name, datatype=tensors.datatype_of(array),
                             shape=list(array.shape))
        response.raw_output_contents.append(
            np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    return response
