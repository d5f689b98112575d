"""HTTP bodies: read with their bound and their timeout, JSON too large for the event loop
decoded in a worker process, large answers written in chunks.

Bounds per request, cheapest first: a body larger than the model's largest valid request
(or --max-body-bytes; `Dataplane.request_bytes_limit`) is a 413 before it is read; the
body must arrive within the body timeout (408); JSON too large to decode in a few
milliseconds is decoded in a worker process (`JsonWorker`), so the event loop (and
liveness) never waits on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
from typing import Any, Callable

from aiohttp import web

from kiln.runtime.serving.refusals import Kind, Refusal

# JSON above this (request bytes, or response elements) is decoded or encoded in a worker
# process: the JSON codec holds the GIL throughout, so a thread would stall the loop as much.
# Below it, decoding takes a few milliseconds and stays inline (no inter-process copy).
OFFLOAD_JSON_BYTES = 1 << 20
OFFLOAD_JSON_ELEMENTS = 64 * 1024
# How long a request's body may take to arrive (408 after), unless a server is told otherwise.
DEFAULT_BODY_TIMEOUT = 60.0
# Bodies and answers larger than this are read and written in chunks of it.
IO_CHUNK_BYTES = 1 << 20
# Requests that may wait for the decoding worker; beyond, a big JSON request gets 429
# before its body is read (each waiting one holds its body in memory).
_OFFLOAD_WAITING = 4


def too_big(length: int | None, limit: int, why: str) -> Refusal:
    size = f"{length} bytes" if length is not None else "larger"
    return Refusal(Kind.TOO_LARGE, f"the request body ({size}) is over {limit} bytes, {why}")


async def read_body(request: web.Request, limit: int, why: str,
                    timeout: float) -> bytes | bytearray:
    """The body, at most `limit` bytes (else TOO_LARGE), within `timeout` s (else TIMEOUT)."""
    if request.content.is_eof():  # all of it has arrived (most small bodies): no timer
        return await _read(request, limit, why)
    try:
        async with asyncio.timeout(timeout):
            return await _read(request, limit, why)
    except TimeoutError:
        raise Refusal(Kind.TIMEOUT, f"the request body did not arrive within "
                                    f"{timeout:g} s") from None


async def _read(request: web.Request, limit: int, why: str) -> bytes | bytearray:
    try:
        return await _read_chunks(request, limit, why)
    except web.RequestPayloadError as e:  # e.g. Content-Encoding: gzip on a body that is not
        raise Refusal(Kind.INVALID, f"the request body cannot be read: "
                                    f"{' '.join(str(e).split())}") from None


async def _read_chunks(request: web.Request, limit: int, why: str) -> bytes | bytearray:
    length = request.content_length
    if length is not None and length <= IO_CHUNK_BYTES:
        return await request.read()  # one read: aiohttp stops at Content-Length
    # A large body is copied once, a chunk at a time, yielding to the loop between
    # chunks: aiohttp's read() joins and copies it whole, three times over.
    buf = bytearray()  # grown in place: a large realloc remaps pages, it does not copy
    while chunk := await request.content.read(IO_CHUNK_BYTES):
        buf += chunk
        if len(buf) > limit:
            raise too_big(None, limit, why)
        await asyncio.sleep(0)
    return buf


async def write_chunked(request: web.Request, payload: bytes, headers: dict[str, str]
                        ) -> web.StreamResponse:
    """A large answer in chunks, each awaited: one write of it all would copy the whole
    payload into the transport's buffer at once, stalling the loop for as long."""
    response = web.StreamResponse(headers=headers)
    response.content_length = len(payload)
    await response.prepare(request)
    view = memoryview(payload)
    for start in range(0, len(view), IO_CHUNK_BYTES):
        await response.write(view[start:start + IO_CHUNK_BYTES])
    await response.write_eof()
    return response


class JsonWorker:
    """A worker process for JSON too large to decode or encode on the event loop.

    Started on first use, by whichever process serves HTTP: the single process, or each
    front end (workers.supervisor). One at a time decodes (bounding the memory a burst of
    large JSON bodies can take: per serving process), a few wait, and `full` lets the
    server refuse the rest before reading their bodies. A worker that dies (killed for
    memory) is replaced on next use; one whose server dies dies with it (`_bind_to`).
    """

    def __init__(self, waiting: int = _OFFLOAD_WAITING):
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._limit = 1 + waiting
        self._pending = 0

    @property
    def full(self) -> bool:
        return self._pending >= self._limit

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._pool is None:
            # spawn, not fork: the server has threads (the backend's, the loop's) that a
            # forked child would inherit in whatever state they were.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_bind_to, initargs=(os.getpid(),))
        pool = self._pool
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except concurrent.futures.process.BrokenProcessPool:
            if self._pool is pool:
                self._pool = None
            raise Refusal(Kind.UNAVAILABLE, "the JSON worker process stopped (out of memory?); "
                                            "retry, or send the tensors in the binary "
                                            "extension") from None
        finally:
            self._pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _bind_to(server_pid: int) -> None:
    """In the JSON worker, first: ignore SIGINT (a Ctrl-C reaches the whole process group;
    the server decides when its worker stops) and, on Linux, be killed when the server
    process dies, so a front end killed for memory leaves no orphan holding a body. (The
    kernel sends it when the thread that started the worker ends: the event loop's.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:  # it died before the line above
        os._exit(0)
