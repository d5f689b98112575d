"""A sequence's state as one blob (`encode_state`, `decode_state`: whole and untampered, or
CorruptState), its token (`make_token`, `token_of`: the incarnation and step, at a fixed
offset, which the stores compare and set), and `misfit`: whether stored tensors can be a
model's state inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
import time
from typing import Mapping

import numpy as np

from kiln.runtime.engine.backends.base import DATATYPES, TensorSpec
from kiln.runtime.serving.tensors import datatype_of
from kiln.runtime.engine.states import describe_tensor


class CorruptState(Exception):
    """A stored blob that is not a whole, untampered state."""


# Layout: MAGIC | token (32 ASCII bytes: incarnation 16 hex + step 16 digits) | header length
# (u32, big-endian) | header JSON | the state tensors' bytes, little-endian, in header order.
# The token sits at a fixed offset so the store's compare-and-set reads 32 bytes, not the state.
MAGIC = b"KSEQ1 "
TOKEN_OFFSET = len(MAGIC)
TOKEN_BYTES = 32
_HEADER_AT = TOKEN_OFFSET + TOKEN_BYTES
_MAX_HEADER_BYTES = 1 << 20


def make_token(incarnation: str, step: int) -> bytes:
    return f"{incarnation}{step:016d}".encode()


def token_of(blob: bytes) -> bytes:
    """The token of an encoded state, read at its fixed offset."""
    return blob[TOKEN_OFFSET:_HEADER_AT]


@dataclasses.dataclass
class StoredState:
    engine_key: str
    step: int  # steps taken: 1 after the start step
    incarnation: str  # 16 hex characters, new at every sequence_start
    tensors: dict[str, np.ndarray]  # state input name -> array (read-only views of the blob)

    @property
    def token(self) -> bytes:
        return make_token(self.incarnation, self.step)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values())


def encode_state(state: StoredState, model: str) -> bytes:
    """A state -> one blob (header with the engine key, step, dtypes, shapes and the sha256
    of the tensor bytes; then the bytes). One copy of the tensors."""
    chunks = []
    entries = []
    digest = hashlib.sha256()
    for name, array in state.tensors.items():
        raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        view = raw.reshape(-1).view(np.uint8)
        digest.update(view)
        chunks.append(view)
        dtype = datatype_of(array)
        entries.append({"name": name, "datatype": dtype, "shape": list(array.shape),
                        "nbytes": int(raw.nbytes)})
    header = json.dumps({"v": 1, "model": model, "engineKey": state.engine_key,
                         "step": state.step, "incarnation": state.incarnation,
                         "tensors": entries, "sha256": digest.hexdigest(),
                         "savedAt": round(time.time(), 3)},
                        separators=(",", ":")).encode()
    return b"".join([MAGIC, state.token, struct.pack(">I", len(header)), header, *chunks])


def decode_state(blob: bytes) -> StoredState:
    """A blob -> the state, its tensors read-only views of the blob. CorruptState unless
    the blob is whole: magic, header, sizes that add up, and the tensor bytes' sha256."""
    view = memoryview(blob)
    if len(view) < _HEADER_AT + 4 or bytes(view[:TOKEN_OFFSET]) != MAGIC:
        raise CorruptState("not a Kiln sequence state (bad magic)")
    (length,) = struct.unpack(">I", view[_HEADER_AT:_HEADER_AT + 4])
    start = _HEADER_AT + 4
    if length > _MAX_HEADER_BYTES or start + length > len(view):
        raise CorruptState(f"header length {length} does not fit the {len(view)}-byte value")
    try:
        header = json.loads(bytes(view[start:start + length]))
        tensors = header["tensors"]
        step, incarnation = int(header["step"]), str(header["incarnation"])
        engine_key, want = str(header["engineKey"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptState(f"unreadable header: {e}") from None
    if bytes(view[TOKEN_OFFSET:_HEADER_AT]) != make_token(incarnation, step):
        raise CorruptState("the token does not match the header")
    offset = start + length
    body = view[offset:]
    total = 0
    layout = []
    for t in tensors:
        try:
            dtype = DATATYPES[t["datatype"]]
            shape = [int(d) for d in t["shape"]]
            nbytes = int(t["nbytes"])
            name = str(t["name"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptState(f"bad tensor entry {str(t)[:100]}: {e}") from None
        if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != nbytes:
            raise CorruptState(f"tensor {name!r}: {nbytes} bytes do not make shape {shape}")
        layout.append((name, dtype, shape, total, nbytes))
        total += nbytes
    if total != len(body):
        raise CorruptState(f"the header accounts for {total} tensor bytes, the value has "
                           f"{len(body)}")
    got = hashlib.sha256(body).hexdigest()
    if got != want:
        raise CorruptState(f"sha256 of the tensor bytes is {got}, the header says {want}")
    arrays = {}
    for name, dtype, shape, at, nbytes in layout:
        array = np.frombuffer(body[at:at + nbytes], dtype=dtype.newbyteorder("<"))
        if not array.dtype.isnative:
            array = array.astype(dtype)
        arrays[name] = array.reshape(shape)
    return StoredState(engine_key, step, incarnation, arrays)


def misfit(tensors: Mapping[str, np.ndarray], inputs: Mapping[str, TensorSpec]) -> str | None:
    """Why stored state tensors cannot be the model's state inputs (names, datatypes, ranks,
    fixed dimensions), or None when they can."""
    if set(tensors) != set(inputs):
        return f"it has tensors {sorted(tensors)}, the model's state inputs are {sorted(inputs)}"
    for name, array in tensors.items():
        spec = inputs[name]
        if array.dtype != DATATYPES[spec.datatype]:
            return (f"{name!r} is {datatype_of(array)}, the model's input is "
                    f"{describe_tensor(spec)}")
        if len(array.shape) != len(spec.shape) or any(
                d >= 0 and d != got for d, got in zip(spec.shape, array.shape)):
            return (f"{name!r} has shape {list(array.shape)}, the model's input is "
                    f"{describe_tensor(spec)}")
    return None

