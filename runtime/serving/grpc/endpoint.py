"""The Open Inference Protocol (v2) over gRPC: `inference.GRPCInferenceService`, as KServe
and Triton define it (runtime/serving/grpc/grpc_service.proto), on its own port beside the HTTP server.

One process, one event loop, one dataplane: a `grpc.aio` server started and stopped by
`InferenceServer`, whose models, schedulers (a gRPC and an HTTP request are batched
together), readiness, draining and metrics (`kiln_requests_total` by outcome, the latency
histogram) it uses as they are. Only the encoding differs:

- inputs in `raw_input_contents` (what tritonclient sends: one entry per input, in order,
  its little-endian bytes, the exact size its shape and datatype need), or typed in each
  input's `contents` (fp32_contents, int64_contents...: the JSON `data` equivalent);
- outputs always in `raw_output_contents`, one per output in the order of `outputs`.

Every check on shapes, ranks, datatypes, profiles and the batch is `protocol`'s, with the
same messages as over HTTP. Each kind of refusal has its gRPC code (`CODES`): INVALID
INVALID_ARGUMENT, NOT_FOUND NOT_FOUND, OVERLOADED RESOURCE_EXHAUSTED (with a `retry-after`
trailer), UNAVAILABLE UNAVAILABLE (draining, a model not loaded), FAILED INTERNAL. A message over --max-body-bytes is refused
by gRPC itself (RESOURCE_EXHAUSTED) before it is decoded; bytes that are not the method's
message are INVALID_ARGUMENT (the handlers parse them, `_parsing`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kiln import __version__
from kiln.runtime.serving.grpc import grpc_service_pb2 as pb
from kiln.runtime.serving import protocol
from kiln.runtime.engine.backends.base import DATATYPES, TensorSpec
from kiln.runtime.serving.model import ServedModel
from kiln.runtime.serving.protocol import shown
from kiln.runtime.serving.refusals import NOT_READY_RETRY_AFTER, OUTCOME, Kind, Refusal, cut, scheduler_refusal
from kiln.runtime.serving.refusals import invalid as bad_request
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, InvalidBatch, Overloaded
from kiln.runtime.serving.sequences.manager import request_tenant

if TYPE_CHECKING:
    from kiln.runtime.serving.rest.server import InferenceServer  # noqa: F401 (the dataplane, for now)

log = logging.getLogger("kiln.runtime.grpc")

# The gRPC status code of each kind of refusal.
CODES = {
    Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
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


class _Refused:
    """A gRPC error to answer (the servicer aborts with it, after the metrics count it)."""

    __slots__ = ("kind", "code", "message", "retry_after")

    def __init__(self, kind: Kind, message: str, retry_after: float | None = None):
        self.kind = kind
        self.code = CODES[kind]
        self.message = cut(message)
        self.retry_after = retry_after


async def _abort(context: grpc.aio.ServicerContext, refused: _Refused) -> None:
    trailers = () if refused.retry_after is None else (
        ("retry-after", str(max(1, math.ceil(refused.retry_after)))),)
    await context.abort(refused.code, refused.message, trailing_metadata=trailers)


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
        return await handler(request, context)

    return parse_then_handle


def _outcome(result: Any) -> str:
    return OUTCOME[result.kind] if isinstance(result, _Refused) else "success"


SERVICE = "inference.GRPCInferenceService"


class GrpcEndpoint:
    """The service's methods, and the `grpc.aio` server they run on."""

    def __init__(self, server: "InferenceServer"):
        self.server = server
        self._grpc: grpc.aio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the port bound. A port that cannot
        be bound is an OSError, as for the HTTP server."""
        limit = self.server.max_body_bytes
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
        own failure to parse answers UNKNOWN and logs a traceback."""
        service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]]
        methods = {}
        for method in service.methods:
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
        s = self.server
        return pb.ServerReadyResponse(ready=not s.draining
                                      and all(m.ready for m in s.models.values()))

    async def ModelReady(self, request, context):
        model = await self._model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=not self.server.draining and model.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="kiln", version=__version__,
                                         extensions=[protocol.BINARY_EXTENSION])

    async def ModelMetadata(self, request, context):
        model = await self._model(request.name, request.version, context)
        if model.engine is None:
            await _abort(context, _Refused(Kind.UNAVAILABLE, self._unavailable(model)))
        return pb.ModelMetadataResponse(
            name=model.name, versions=[model.version], platform=model.platform or "",
            inputs=[_tensor_metadata(s) for s in model.inputs],
            outputs=[_tensor_metadata(s) for s in model.outputs])

    async def _model(self, name: str, version: str, context) -> ServedModel:
        try:
            return self.server.find_model(name, version or None)
        except Refusal as e:
            await _abort(context, _Refused(e.kind, e.message))
            raise  # abort raises; never reached

    def _unavailable(self, model: ServedModel) -> str:
        return "the server is shutting down" if self.server.draining else model.status_message()

    # -- inference ---------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        model = await self._model(request.model_name, request.model_version, context)
        result = await self.server.track(
            model, lambda in_scheduler: self._infer(request, model, in_scheduler, context), _outcome)
        if isinstance(result, _Refused):
            await _abort(context, result)
        return result

    async def _infer(self, request: pb.ModelInferRequest, model: ServedModel,
                     in_scheduler: list[bool], context) -> pb.ModelInferResponse | _Refused:
        if self.server.draining:
            return _Refused(Kind.UNAVAILABLE, "the server is shutting down; retry on another replica",
                            NOT_READY_RETRY_AFTER)
        if not model.serving:
            return _Refused(Kind.UNAVAILABLE, model.status_message(), NOT_READY_RETRY_AFTER)
        try:
            scheduler = model.scheduler
            if getattr(scheduler, "cache", None) is None and hasattr(scheduler, "wait_for_room"):
                await scheduler.wait_for_room()
            inputs, outputs = decode_request(request, model.inputs, model.outputs,
                                             model.profiles)
            in_scheduler.append(True)
            parameters = _parameters(request.parameters)
            tenant = request_tenant(parameters, lambda: context.invocation_metadata() or ())
            results = await model.infer(inputs, parameters, tenant)
        except Refusal as e:
            return _Refused(e.kind, e.message, e.retry_after)
        except (InvalidBatch, Overloaded, ExecutionFailed) as e:
            return _Refused(*scheduler_refusal(model.name, e))
        missing = [name for name in outputs if name not in results]
        if missing:
            return _Refused(Kind.FAILED, f"the engine returned no {', '.join(missing)}")
        return encode_response(model.name, model.version, request.id, outputs, results)


def _parameters(params) -> dict[str, Any]:
    """A request's `parameters` map (InferParameter) as the JSON request's plain values."""
    return {name: getattr(p, p.WhichOneof("parameter_choice"))
            for name, p in params.items() if p.WhichOneof("parameter_choice")}


def _tensor_metadata(spec: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype,
                                                   shape=list(spec.shape))


# -- the encoding: protobuf <-> numpy, the checks protocol's --------------------------------

def decode_request(request: pb.ModelInferRequest, inputs: list[TensorSpec],
                   outputs: list[TensorSpec], profiles) -> tuple[dict[str, np.ndarray], list[str]]:
    """A ModelInferRequest -> (input arrays, names of the outputs to answer, in order).
    Raises Refusal (INVALID) with protocol's messages."""
    protocol.check_parameters(request.parameters, "the request")
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
        spec = protocol.input_spec(tensor.name, specs, arrays)
        protocol.check_parameters(tensor.parameters, f"input '{spec.name}'")
        protocol.check_datatype(spec, tensor.datatype)
        shape = list(tensor.shape)
        protocol.check_dimensions(spec, shape)
        if raw:
            if tensor.HasField("contents"):
                raise bad_request(f"input '{spec.name}' has both 'contents' and "
                                  f"raw_input_contents")
            arrays[spec.name] = _from_raw(spec, shape, raw[i], i)
        else:
            arrays[spec.name] = _from_contents(spec, shape, tensor)
    protocol.check_inputs(arrays, inputs, profiles)

    if not request.outputs:
        return arrays, [s.name for s in outputs]
    chosen: list[str] = []
    for item in request.outputs:
        protocol.check_output_name(item.name, outputs)
        protocol.check_parameters(item.parameters, f"output {shown(item.name)}")
        chosen.append(item.name)
    return arrays, chosen


def _from_raw(spec: TensorSpec, shape: list[int], data: bytes, index: int) -> np.ndarray:
    dtype = DATATYPES[spec.datatype]
    need = math.prod(shape) * dtype.itemsize
    if len(data) != need:
        raise bad_request(f"input '{spec.name}': raw_input_contents[{index}] has {len(data)} "
                          f"bytes but shape {shown(shape)} of {spec.datatype} needs {need}")
    return protocol.from_bytes(data, dtype, shape)


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
    protocol.check_range(name, wide, datatype, dtype)
    return wide.astype(dtype, copy=False).reshape(shape)


def encode_response(model_name: str, model_version: str, request_id: str, outputs: list[str],
                    results: dict[str, np.ndarray]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model_name, model_version=model_version,
                                     id=request_id)
    for name in outputs:
        array = np.asarray(results[name])
        response.outputs.add(name=name, datatype=protocol.datatype_of(array),
                             shape=list(array.shape))
        response.raw_output_contents.append(
            np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    return response
