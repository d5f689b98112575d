"""The wire between a front end and the engine process: length-prefixed pickles of small
tuples on a unix socket, and tensors in the front end's shared memory (inline on the
socket when they do not fit or hold Python objects)."""

from __future__ import annotations

import asyncio
import pickle
import struct
from multiprocessing import shared_memory
from typing import Any, Callable, Mapping

import numpy as np

from kiln.runtime.api.contract import FRONT_END_SHM_BYTES

# Each front end's shared memory: SLOTS requests in flight at once, each up to SLOT_BYTES of
# inputs and outputs together (32 rows of 2048 float32 in and out fit); the pages are
# touched only as used. What does not fit goes inline.
SLOT_BYTES = 1 << 20
SLOTS = FRONT_END_SHM_BYTES // SLOT_BYTES
_ALIGN = 64
_FRAME = struct.Struct("<I")


class Channel(asyncio.Protocol):
    """One end of a front end <-> engine connection. Messages sent in one loop iteration
    are written together."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[], None]):
        self._on_message = on_message
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._inbox = bytearray()
        self._outbox: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        inbox = self._inbox
        inbox += data
        start = 0
        while len(inbox) - start >= _FRAME.size:
            (size,) = _FRAME.unpack_from(inbox, start)
            end = start + _FRAME.size + size
            if len(inbox) < end:
                break
            message = pickle.loads(memoryview(inbox)[start + _FRAME.size:end])
            start = end
            self._on_message(message)
        del inbox[:start]

    def send(self, message: Any) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._outbox += (_FRAME.pack(len(frame)), frame)

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(out))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._on_lost()


def pack(arena: np.ndarray | None, offset: int, capacity: int,
          arrays: Mapping[str, np.ndarray]) -> tuple[list[tuple], int]:
    """Arrays -> (descriptors, arena bytes used): each copied into
    arena[offset:offset + capacity] when all fit (one copy, no serialization), else all
    carried inline (0 bytes used)."""
    descs = []
    at, end = offset, offset + capacity
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        n = a.nbytes
        if arena is None or a.dtype.hasobject or at + n > end:
            return [(name, None, None, None, np.asarray(a)) for name, a in arrays.items()], 0
        arena[at:at + n] = a.reshape(-1).view(np.uint8)
        descs.append((name, a.dtype.str, a.shape, at, n))
        at += -(-n // _ALIGN) * _ALIGN
    return descs, at - offset


def unpack(arena: np.ndarray | None, descs: list[tuple], copy: bool) -> dict[str, np.ndarray]:
    out = {}
    for name, dtype, shape, at, inline in descs:
        if at is None:
            out[name] = inline
        else:
            view = arena[at:at + inline].view(dtype).reshape(shape)
            out[name] = view.copy() if copy else view
    return out


class Segment(shared_memory.SharedMemory):
    """A shared-memory segment whose close leaves the mapping to its last view: a batch
    cancelled at shutdown may still hold views, and the standard close then raises
    BufferError, again from __del__ at exit, where it is printed with a traceback."""

    def close(self) -> None:
        try:  # not contextlib: at exit, __del__ may run after module globals are gone
            super().close()
        except BufferError:
            pass


