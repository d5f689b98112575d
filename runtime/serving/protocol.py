"""The Open Inference Protocol (v2) over HTTP: request and response bodies, both encodings.

Pure functions over bytes, dicts and numpy arrays, no I/O: the HTTP door decodes its
bodies here (a request flows door -> dataplane -> model -> scheduler), and the client side
(`encode_infer_request`, `decode_infer_response`) serves the demo, tests and benchmarks.
The checks of tensors against the model are `tensors`', shared with the gRPC door. Both
encodings are handled:

- JSON tensors: `{"id", "parameters", "inputs": [{"name", "shape", "datatype", "data"}],
  "outputs": [{"name", "parameters"}]}`, `data` flat or nested in row-major order.
- The binary tensor extension as Triton's clients send it: the request header
  `Inference-Header-Content-Length: N`, the first N body bytes are the JSON header, then the
  raw little-endian bytes of every input whose `parameters.binary_data_size` is set, in the
  order the inputs are listed. Outputs are returned the same way when a requested output
  has `parameters.binary_data: true` or the request has `parameters.binary_data_output: true`.

Every rejection is a `Refusal` (refusals.py) carrying its kind and a message for people;
what a client sent is echoed in it shortened (`shown`), so an error stays small.

Non-finite floats: JSON has no NaN or Infinity. A request's bare `NaN`/`Infinity` literals
are refused (400); JSON `data` may carry them as the strings "NaN", "Infinity" and
"-Infinity" (proto3's JSON mapping, which KServe's gRPC gateway also uses), and a response
writes them that way. The binary extension carries them as they are.

JSON codec: orjson (several times faster than the standard library's json both ways, and it
writes numpy arrays without `tolist()`). What the API accepts and answers is the standard
library's strict reading, kept exactly: a body orjson refuses is read again by `json` for the
same verdict and message (NaN literals, deep nesting, 4300-digit integers, bad UTF-8; also
what only `json` accepts: `1e400` as infinity, UTF-16 bodies, lone surrogate escapes), and
float data that may hold an integer literal beyond 64 bits, which orjson turns into a float
where `json` keeps an int (refused), is decoded again the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import orjson

from kiln.runtime.serving.refusals import invalid as bad_request
from kiln.runtime.engine.backends.base import DATATYPES, ShapeRange, TensorSpec
from kiln.runtime.serving.tensors import (check_datatype, check_dimensions, check_inputs, check_output_name, check_parameters, check_range, datatype_of, from_bytes, input_spec, shown)


HEADER_LENGTH = "Inference-Header-Content-Length"


BINARY_EXTENSION = "binary_tensor_data"


def _no_constant(name: str) -> Any:
    raise bad_request(f"the request body holds {name}, which is not JSON; write non-finite "
                      f"numbers as the strings \"NaN\", \"Infinity\" or \"-Infinity\", or send "
                      f"the tensor in the binary extension")


def loads(text: bytes | str) -> Any:
    """Strict JSON: no NaN/Infinity literals; deep nesting and oversized integer literals
    are a 400 like any other malformed JSON, never an internal error.

    orjson reads it; what orjson refuses is read again by the standard library, whose verdict
    (a value, or the 400 and its message) is the API's.
    """
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return _stdlib_loads(text)


def _stdlib_loads(text: bytes | str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not UTF-8 JSON: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise bad_request("the request's JSON is nested too deeply") from None
    except ValueError as e:  # Python's int-str conversion limit, for one
        raise bad_request(f"malformed JSON in the request body: {str(e)[:200]}") from None


def dumps(doc: Any) -> bytes:
    """Compact JSON of `doc` (numpy arrays written directly). orjson writes what it can; a
    value it refuses (a lone surrogate in a string, an int beyond 64 bits) goes through the
    standard library, as before."""
    try:
        return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError:
        return json.dumps(doc, separators=(",", ":"), default=_tolist).encode()


def _tolist(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class _Reread(Exception):
    """orjson's reading of a request may differ from the standard library's: read it again."""


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[RequestedOutput]  # in the order the response lists them
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        first = next(iter(self.inputs.values()), None)
        return int(first.shape[0]) if first is not None and first.ndim else 1


def header_length(value: str | None, body_size: int) -> int | None:
    """The `Inference-Header-Content-Length` header -> the JSON header's byte count."""
    if value is None:
        return None
    try:
        n = int(value.strip())
    except ValueError:
        raise bad_request(f"{HEADER_LENGTH} must be an integer, got {shown(value)}") from None
    if n < 0 or n > body_size:
        raise bad_request(f"{HEADER_LENGTH} is {n} but the body has {body_size} bytes")
    return n


def parse_infer_request(body: bytes, json_length: int | None,
                        inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                        profiles: Mapping[str, ShapeRange] | None = None) -> InferRequest:
    """Decode and check one inference request against the model's tensors.

    `json_length` is the value of the Inference-Header-Content-Length header (None when the
    whole body is JSON). Raises Refusal (INVALID) naming what is wrong.
    """
    header_bytes = body if json_length is None else body[:json_length]
    binary = memoryview(body)[len(header_bytes):]
    try:
        return _parse(loads(header_bytes), binary, inputs, outputs, profiles, exact=False)
    except _Reread:
        return _parse(_stdlib_loads(header_bytes), binary, inputs, outputs, profiles, exact=True)


def _parse(doc: Any, binary: memoryview, inputs: Sequence[TensorSpec],
           outputs: Sequence[TensorSpec], profiles: Mapping[str, ShapeRange] | None,
           exact: bool) -> InferRequest:
    if not isinstance(doc, dict):
        raise bad_request("the request body must be a JSON object with an 'inputs' list")
    parameters = _parameters(doc, "the request")
    req_id = doc.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise bad_request("'id' must be a string")

    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise bad_request("the request needs a non-empty 'inputs' list")
    specs = {s.name: s for s in inputs}
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise bad_request(f"inputs[{i}] must be an object with name, shape, datatype, data")
        name = raw.get("name")
        if not isinstance(name, str):
            raise bad_request(f"inputs[{i}] has no 'name'")
        spec = input_spec(name, specs, arrays)
        arrays[name], used = _decode_input(raw, spec, binary[offset:], exact)
        offset += used
    if offset != len(binary):
        raise bad_request(f"the body has {len(binary) - offset} bytes after the JSON header "
                          f"that no input's binary_data_size accounts for")
    check_inputs(arrays, inputs, profiles)

    default_binary = _flag(parameters, "binary_data_output", "the request")
    return InferRequest(inputs=arrays, outputs=_requested_outputs(doc, outputs, default_binary),
                        id=req_id, parameters=parameters)


def _parameters(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise bad_request(f"'parameters' of {where} must be an object")
    check_parameters(params, where)
    return params


def _flag(params: Mapping[str, Any], name: str, where: str) -> bool:
    value = params.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"parameter '{name}' of {where} must be true or false")
    return value


def _requested_outputs(doc: Mapping[str, Any], outputs: Sequence[TensorSpec],
                       default_binary: bool) -> list[RequestedOutput]:
    raw = doc.get("outputs")
    if raw is None:
        return [RequestedOutput(s.name, default_binary) for s in outputs]
    if not isinstance(raw, list):
        raise bad_request("'outputs' must be a list of {name, parameters}")
    chosen: list[RequestedOutput] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise bad_request(f"outputs[{i}] must be an object with a 'name'")
        name = item["name"]
        check_output_name(name, outputs)
        params = _parameters(item, f"output {shown(name)}")
        binary = _flag(params, "binary_data", f"output '{name}'") if "binary_data" in params \
            else default_binary
        chosen.append(RequestedOutput(name, binary))
    return chosen


def _decode_input(raw: Mapping[str, Any], spec: TensorSpec,
                  binary: memoryview, exact: bool = True) -> tuple[np.ndarray, int]:
    """One request input -> (array, bytes of the binary section it used)."""
    name = spec.name
    datatype = raw.get("datatype")
    check_datatype(spec, datatype)
    shape = raw.get("shape")
    if not exact and isinstance(shape, list) and any(_big_float(d) for d in shape):
        raise _Reread
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise bad_request(f"input '{name}': 'shape' must be a list of integers")
    check_dimensions(spec, shape)
    dtype = DATATYPES[datatype]
    count = math.prod(shape)
    params = _parameters(raw, f"input '{name}'")

    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if not exact and _big_float(size):
            raise _Reread
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad_request(f"input '{name}': binary_data_size must be a non-negative integer")
        if "data" in raw:
            raise bad_request(f"input '{name}' has both 'data' and binary_data_size")
        if size != count * dtype.itemsize:
            raise bad_request(f"input '{name}': binary_data_size is {size} bytes but shape "
                              f"{shown(shape)} of {datatype} needs {count * dtype.itemsize}")
        if size > len(binary):
            raise bad_request(f"input '{name}': binary_data_size is {size} bytes but only "
                              f"{len(binary)} bytes of binary data remain in the body")
        return from_bytes(binary, dtype, shape), size

    if "data" not in raw:
        raise bad_request(f"input '{name}' has neither 'data' nor binary_data_size")
    return json_tensor(name, raw["data"], shape, datatype, dtype, exact), 0


# orjson reads an integer literal beyond 64 bits as the nearest float, which float data
# would accept; the standard library keeps the int, which numpy cannot hold (a 400).
_INT64_MAGNITUDE = 2.0 ** 63


def json_tensor(name: str, data: Any, shape: list[int], datatype: str,
                dtype: np.dtype, exact: bool = True, what: str = "input") -> np.ndarray:
    """A tensor's JSON `data`, checked (`what`: an input, or a warm-up's expected output)."""
    if not isinstance(data, list):
        data = [data]
    count = math.prod(shape)
    # A flat list's length is known before numpy converts a possibly huge list for nothing.
    if data and not isinstance(data[0], list) and len(data) != count:
        raise bad_request(f"{what} '{name}': shape {shown(shape)} needs {count} elements "
                          f"but 'data' has {len(data)}")
    try:
        source = np.array(data)
    except (ValueError, RecursionError):
        raise bad_request(f"{what} '{name}': 'data' is a ragged nested list") from None
    kind = source.dtype.kind
    if not exact and (kind == "f" and source.size and _may_hold_big_int(source)
                      or kind in "UO" and _holds_big_float(data)):
        raise _Reread
    if kind == "U" and dtype.kind == "f":
        if not _numbers_or_non_finite_names(data):
            raise bad_request(f"{what} '{name}': 'data' must hold numbers for {datatype} "
                              f"(or the strings \"NaN\", \"Infinity\", \"-Infinity\")")
        source, kind = source.astype(dtype), "f"
    if source.size and kind not in "biuf":
        raise bad_request(f"{what} '{name}': 'data' must hold numbers for {datatype}")
    if dtype.kind == "b" and source.size and kind != "b":
        raise bad_request(f"{what} '{name}': BOOL data must be true or false")
    if dtype.kind in "iu" and kind == "f":
        raise bad_request(f"{what} '{name}': {datatype} data must be integers")
    if source.size != count:
        raise bad_request(f"{what} '{name}': shape {shown(shape)} needs {count} elements "
                          f"but 'data' has {source.size}")
    check_range(name, source, datatype, dtype, what)
    return source.astype(dtype).reshape(shape)


def _may_hold_big_int(source: np.ndarray) -> bool:
    return bool(np.abs(source).max() >= _INT64_MAGNITUDE)  # orjson reads no NaN


def _big_float(value: Any) -> bool:
    return isinstance(value, float) and abs(value) >= _INT64_MAGNITUDE


def _holds_big_float(data: list) -> bool:  # data numpy made strings or objects of: rare
    return any(_holds_big_float(v) if isinstance(v, list) else _big_float(v) for v in data)


_NON_FINITE_NAMES = frozenset({"NaN", "Infinity", "-Infinity"})


def _numbers_or_non_finite_names(data: list) -> bool:
    # numpy turned the whole list into strings; only the proto3 names may have been strings.
    return all(_numbers_or_non_finite_names(v) if isinstance(v, list)
               else v in _NON_FINITE_NAMES if isinstance(v, str)
               else isinstance(v, (int, float)) and not isinstance(v, bool)
               for v in data)


def encode_infer_response(model_name: str, model_version: str, request: InferRequest,
                          results: Mapping[str, np.ndarray]) -> tuple[bytes, int | None]:
    """Results -> (body, JSON header length or None when the body is plain JSON)."""
    outputs = []
    chunks: list[bytes] = []
    for out in request.outputs:
        array = np.asarray(results[out.name])
        entry: dict[str, Any] = {"name": out.name, "datatype": datatype_of(array),
                                 "shape": list(array.shape)}
        if out.binary:
            raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
            entry["parameters"] = {"binary_data_size": raw.nbytes}
            chunks.append(raw.reshape(-1).view(np.uint8))  # joined below without tobytes()
        else:
            entry["data"] = json_data(array)
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version,
                           "outputs": outputs}
    if request.id is not None:
        doc["id"] = request.id
    header = dumps(doc)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)  # the only copy of the outputs' bytes


_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def json_data(array: np.ndarray) -> np.ndarray | list:
    """An output's `data`: the array itself, flat, for orjson to write when every element is
    finite (float32 in its shortest round-tripping form); `json_values` otherwise, for the
    proto3 strings orjson would write as null."""
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return json_values(array)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return np.ascontiguousarray(array.reshape(-1))


def json_values(array: np.ndarray) -> list:
    """An array's elements, flat, for JSON: non-finite floats as proto3 writes them."""
    values = array.reshape(-1).tolist()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        values = [v if math.isfinite(v) else _NON_FINITE.get(v, "NaN") for v in values]
    return values


def decode_infer_response(body: bytes, json_length: int | None) -> dict[str, Any]:
    """A response (JSON or binary) -> its JSON with every output's data as a numpy array.

    What a client does; the demo and the tests read answers with it.
    """
    header = body if json_length is None else body[:json_length]
    doc = json.loads(header)
    offset = 0 if json_length is None else json_length
    for out in doc.get("outputs", []):
        dtype = DATATYPES[out["datatype"]]
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            out["data"] = np.frombuffer(body[offset:offset + size],
                                        dtype=dtype.newbyteorder("<")).astype(dtype) \
                .reshape(out["shape"])
            offset += size
        else:
            out["data"] = np.asarray(out["data"], dtype=dtype).reshape(out["shape"])
    return doc


def encode_infer_request(inputs: Mapping[str, np.ndarray], *, binary: bool = False,
                         outputs: Sequence[str] | None = None, binary_outputs: bool = False,
                         request_id: str | None = None) -> tuple[bytes, int | None]:
    """Arrays -> a request body (and its JSON header length when binary), as a client sends."""
    doc: dict[str, Any] = {"inputs": []}
    chunks: list[bytes] = []
    for name, value in inputs.items():
        array = np.asarray(value)
        entry: dict[str, Any] = {"name": name, "shape": list(array.shape),
                                 "datatype": datatype_of(array)}
        if binary:
            raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = array.reshape(-1).tolist()
        doc["inputs"].append(entry)
    if outputs is not None:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": binary_outputs}}
                          for n in outputs]
    elif binary_outputs:
        doc["parameters"] = {"binary_data_output": True}
    if request_id is not None:
        doc["id"] = request_id
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)
