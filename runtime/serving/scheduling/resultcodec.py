"""The bytes of one shared result-cache entry, and their strict reading.

A value in the shared store is hostile until checked: anyone who can write to the Redis
can put anything under any key, and a value can be cut short or copied under another key.
So a value is

    magic "KRC1" | blake2b-256 over (len + the full store key, the payload) | payload
    payload: u16 count, then per tensor:
             u16 name length, name (UTF-8), u8 dtype code, u8 rank, rank x u64 dims, data

all little-endian, and `decode` returns the tensors only when the magic, the digest (of this
very key: a value copied under another key fails), the dtype (a whitelist), the rank, every
size and the total length all agree; anything else is None, never an exception. The digest
is not a signature: it proves the value was written for this key by a writer that follows
this format, which is what a cache needs (a corrupted or foreign value is a miss).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Mapping

import numpy as np

MAGIC = b"KRC1"
DIGEST_BYTES = 32
HEADER_BYTES = len(MAGIC) + DIGEST_BYTES
MAX_TENSORS = 256
MAX_RANK = 8
MAX_NAME_BYTES = 256

# The dtypes a value may carry, by a code that never changes (numpy's own names could).
_DTYPES: dict[int, np.dtype] = {code: np.dtype(name).newbyteorder("<") for code, name in enumerate(
    ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"))}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_U16, _U8x2 = struct.Struct("<H"), struct.Struct("<BB")


def _digest(key: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"kiln-result")
    h.update(len(key).to_bytes(8, "little"))
    h.update(key)
    h.update(payload)
    return h.digest()


def encode(key: bytes, outputs: Mapping[str, np.ndarray], max_bytes: int) -> bytes | None:
    """The value for `outputs` under `key`, or None when it cannot be shared: a dtype off the
    whitelist (strings stay per pod), too many tensors, too high a rank, or more than
    `max_bytes` in all."""
    if len(outputs) > MAX_TENSORS:
        return None
    parts = [_U16.pack(len(outputs))]
    size = HEADER_BYTES + 2
    for name, array in outputs.items():
        raw_name = name.encode()
        code = _CODES.get(array.dtype.newbyteorder("<")) if isinstance(array, np.ndarray) else None
        if code is None or array.ndim > MAX_RANK or len(raw_name) > MAX_NAME_BYTES:
            return None
        size += 2 + len(raw_name) + 2 + 8 * array.ndim + array.nbytes
        if size > max_bytes:
            return None
        data = np.ascontiguousarray(array, dtype=_DTYPES[code])
        parts += [_U16.pack(len(raw_name)), raw_name, _U8x2.pack(code, array.ndim),
                  struct.pack(f"<{array.ndim}Q", *array.shape), data.tobytes()]
    payload = b"".join(parts)
    return MAGIC + _digest(key, payload) + payload


def decode(key: bytes, value: bytes | None) -> dict[str, np.ndarray] | None:
    """The tensors of a value read under `key` (fresh writable arrays), or None when the value
    is anything but what `encode` wrote for this key."""
    if not isinstance(value, (bytes, bytearray)) or len(value) < HEADER_BYTES + 2 \
            or value[:len(MAGIC)] != MAGIC:
        return None
    view = memoryview(value)
    payload = view[HEADER_BYTES:]
    if _digest(key, payload) != value[len(MAGIC):HEADER_BYTES]:
        return None
    try:
        return _tensors(payload)
    except (struct.error, ValueError, UnicodeDecodeError):
        return None


def _tensors(payload: memoryview) -> dict[str, np.ndarray] | None:
    (count,), at = _U16.unpack_from(payload, 0), 2
    if count > MAX_TENSORS:
        return None
    tensors: dict[str, np.ndarray] = {}
    for _ in range(count):
        (length,) = _U16.unpack_from(payload, at)
        at += 2
        if length > MAX_NAME_BYTES or at + length > len(payload):
            return None
        name = bytes(payload[at:at + length]).decode()
        at += length
        code, rank = _U8x2.unpack_from(payload, at)
        at += 2
        dtype = _DTYPES.get(code)
        if dtype is None or rank > MAX_RANK or name in tensors:
            return None
        dims = struct.unpack_from(f"<{rank}Q", payload, at)
        at += 8 * rank
        # Python's integers do not overflow: a product of huge dims is just too big.
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes > len(payload) - at:
            return None
        array = np.frombuffer(payload, dtype=dtype, count=math.prod(dims), offset=at)
        tensors[name] = array.reshape(dims).astype(dtype.newbyteorder("="), copy=True)
        at += nbytes
    return tensors if at == len(payload) else None
