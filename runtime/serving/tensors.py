"""Tensors against a model, whatever the transport: the checks every door makes on a
request's inputs and outputs (names, datatypes, ranks and dimensions, batch, profiles,
value ranges, the parameters of extensions Kiln does not implement), the bound on a valid
request's size, and `shown`, how a client's value appears in a message.

Every refusal is `refusals.invalid` (kind INVALID) with the same words on every door:
REST's JSON and binary codec (`protocol`) and gRPC's protobuf decoding (`grpc.endpoint`)
both call these.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from kiln.runtime.engine.backends.base import DATATYPES, ShapeRange, TensorSpec
from kiln.runtime.serving.refusals import invalid as bad_request


_DTYPE_NAMES = {dt: name for name, dt in DATATYPES.items()}


# Parameters of the v2 spec's other extensions that Kiln does not implement: refusing them
# beats silently answering something else than what the client asked for.
_UNSUPPORTED_PARAMETERS = {
    "shared_memory_region": "the shared-memory extension is not supported; send the tensor "
                            "in the body (JSON data or binary_data_size)",
    "classification": "the classification extension is not supported; request the raw output",
}


SHOWN_CHARS = 64


def shown(value: Any) -> str:
    """A client's value for an error message: its repr, cut to SHOWN_CHARS characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


def datatype_of(array: np.ndarray) -> str:
    try:
        return _DTYPE_NAMES[array.dtype]
    except KeyError:
        raise ValueError(f"no v2 datatype for numpy dtype {array.dtype}") from None


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


# What a request may hold beyond its tensors' elements (names, shapes, parameters, id), and
# the most bytes one element can take in JSON (a 17-digit float with exponent, sign,
# separator and the indentation of a pretty-printed nested list).
_JSON_OVERHEAD_BYTES = 64 * 1024


_JSON_BYTES_PER_ELEMENT = 64


def request_bytes_bound(inputs: Sequence[TensorSpec], profiles: Mapping[str, ShapeRange],
                        max_rows: int | None) -> int | None:
    """The largest body a valid request to this model can have, or None when a dimension
    has no bound (dynamic, without a profile). A body above it is refused before it is read.

    `max_rows` bounds a dynamic batch dimension (the scheduler's largest batch).
    """
    elements = 0
    for spec in inputs:
        rng = profiles.get(spec.name)
        count = 1
        for i, dim in enumerate(spec.shape):
            if dim >= 0:
                count *= dim
            elif i == 0 and max_rows is not None:
                count *= max_rows
            elif rng is not None and len(rng.max) == len(spec.shape):
                count *= rng.max[i]
            else:
                return None
        elements += count
    return _JSON_OVERHEAD_BYTES + elements * _JSON_BYTES_PER_ELEMENT


def check_parameters(params: Mapping[str, Any], where: str) -> None:
    """Refuse the parameters of extensions Kiln does not implement."""
    for name, why in _UNSUPPORTED_PARAMETERS.items():
        if name in params:
            raise bad_request(f"{where}: {why}")


def input_spec(name: str, specs: Mapping[str, TensorSpec],
               seen: Mapping[str, np.ndarray]) -> TensorSpec:
    """The model's spec of a request's input `name`: known, and not given before."""
    if name in seen:
        raise bad_request(f"input {shown(name)} is given twice")
    spec = specs.get(name)
    if spec is None:
        raise bad_request(f"unknown input {shown(name)}; the model's inputs are: "
                          f"{', '.join(specs)}")
    return spec


def check_datatype(spec: TensorSpec, datatype: Any) -> None:
    name = spec.name
    if not isinstance(datatype, str):
        raise bad_request(f"input '{name}': 'datatype' must be a string such as "
                          f"{spec.datatype}, got {shown(datatype)}")
    if datatype == "BYTES":
        raise bad_request(f"input '{name}': the BYTES datatype is not supported; "
                          f"the model expects {spec.datatype}")
    if datatype not in DATATYPES:
        raise bad_request(f"input '{name}': unknown datatype {shown(datatype)}; one of "
                          f"{', '.join(DATATYPES)}")
    if datatype != spec.datatype:
        raise bad_request(f"input '{name}' has datatype {datatype} but the model expects "
                          f"{spec.datatype}")


def check_dimensions(spec: TensorSpec, shape: Sequence[int]) -> None:
    """A request's shape (a list of ints): every dimension positive, rank and fixed
    dimensions the model's."""
    if any(d < 1 for d in shape):
        raise bad_request(f"input '{spec.name}': every dimension of shape {shown(list(shape))} "
                          f"must be positive")
    check_shape(spec.name, tuple(shape), spec.shape)


def from_bytes(buffer: Any, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """A tensor's little-endian bytes (exactly its size: the caller checked) -> an array."""
    array = np.frombuffer(buffer, dtype=dtype.newbyteorder("<"), count=math.prod(shape))
    if not array.dtype.isnative:  # a big-endian host: convert (a copy)
        array = array.astype(dtype)
    # Otherwise a read-only view of the body: no copy on the request path (batching
    # copies rows into the batch anyway; a request running alone goes as it is).
    return array.reshape(shape)


def check_range(name: str, array: np.ndarray, datatype: str, dtype: np.dtype, what: str = "input") -> None:
    """Integer values that `dtype` (narrower than what carried them) cannot hold: a 400."""
    if dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise bad_request(f"{what} '{name}': a value is out of range for {datatype}")


def check_inputs(arrays: Mapping[str, np.ndarray], inputs: Sequence[TensorSpec],
                 profiles: Mapping[str, ShapeRange] | None) -> None:
    """The request's decoded inputs together: none missing, one batch size, the profile."""
    missing = [s.name for s in inputs if s.name not in arrays]
    if missing:
        raise bad_request(f"missing input{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(repr(n) for n in missing)}; the model needs: "
                          f"{', '.join(s.name for s in inputs)}")
    check_batch(arrays, inputs)
    if profiles:
        check_profiles(arrays, profiles)


def check_output_name(name: str, outputs: Sequence[TensorSpec]) -> None:
    if not any(s.name == name for s in outputs):
        raise bad_request(f"unknown output {shown(name)}; the model's outputs are: "
                          f"{', '.join(s.name for s in outputs)}")


def check_shape(name: str, shape: tuple[int, ...], model_shape: tuple[int, ...]) -> None:
    """Rank and fixed dimensions must match; -1 in the model accepts any size."""
    if len(shape) != len(model_shape):
        raise bad_request(f"input '{name}' has shape {shown(list(shape))} (rank {len(shape)}) but the "
                          f"model expects rank {len(model_shape)}: {list(model_shape)}")
    for i, (got, want) in enumerate(zip(shape, model_shape)):
        if want >= 0 and got != want:
            raise bad_request(f"input '{name}' has shape {list(shape)} but the model expects "
                              f"{list(model_shape)} (dimension {i} must be {want})")


def check_batch(arrays: Mapping[str, np.ndarray], specs: Sequence[TensorSpec]) -> None:
    """Inputs whose dimension 0 is dynamic (the batch) must agree on it."""
    sizes = {s.name: arrays[s.name].shape[0] for s in specs
             if s.shape and s.shape[0] < 0 and s.name in arrays}
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"'{n}' has {b}" for n, b in sizes.items())
        raise bad_request(f"inputs disagree on the batch dimension (dimension 0): {detail}")


def check_profiles(arrays: Mapping[str, np.ndarray], profiles: Mapping[str, ShapeRange]) -> None:
    """Dimensions after the batch must lie within the engine's optimization profile.

    The batch dimension is the scheduler's to judge (it splits or refuses big batches).
    """
    for name, rng in profiles.items():
        array = arrays.get(name)
        if array is None or len(rng.min) != array.ndim:
            continue
        for i in range(1, array.ndim):
            if not rng.min[i] <= array.shape[i] <= rng.max[i]:
                raise bad_request(
                    f"input '{name}' has shape {list(array.shape)} but the engine's profile "
                    f"allows dimension {i} only from {rng.min[i]} to {rng.max[i]} "
                    f"(min {list(rng.min)}, max {list(rng.max)})")
