"""Reading an entry's engine: verified (its size and digests checked against the manifest,
on several threads) or not (the benchmark's baselines); and the digests publish records."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from kiln.runtime.engine.cache.entry import (CHUNK_FIELDS, CHUNK_HASH, CHUNK_HASHES, MANIFEST,
                                             CacheError, CacheIntegrityError, LoadTimings,
                                             Manifest, open_entry)

CHUNK_BYTES = 16 << 20  # a read call: large enough to amortize syscalls
# Each DIGEST_CHUNK_BYTES piece of an engine has its own sha256 in the manifest, so pieces
# are checked on several cores at once; 16 MiB: 64 digests for a 1 GiB engine (about 4 KB
# of manifest), and what is left to hash after the last byte arrives is one piece (~8 ms).
DIGEST_CHUNK_BYTES = 16 << 20
MAX_VERIFY_THREADS = 8


def _verify_threads(chunks: int) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(max(cpus, 2), MAX_VERIFY_THREADS, chunks))


def compute_digests(view: memoryview, chunk_bytes: int) -> tuple[str, tuple[str, ...]]:
    """The whole buffer's sha256 and each chunk's CHUNK_HASH digest, on a few threads (both
    hashes release the GIL on large buffers): the whole digest on one, the chunks on the
    others."""
    from concurrent.futures import ThreadPoolExecutor

    spans = [(start, min(start + chunk_bytes, view.nbytes))
             for start in range(0, view.nbytes, chunk_bytes)]
    with ThreadPoolExecutor(max_workers=_verify_threads(len(spans) + 1),
                            thread_name_prefix="kiln-digest") as pool:
        whole = pool.submit(lambda: hashlib.sha256(view).hexdigest())
        chunk_digest = CHUNK_HASHES[CHUNK_HASH]
        chunks = list(pool.map(lambda span: chunk_digest(view[span[0]:span[1]]), spans))
        return whole.result(), tuple(chunks)


def _buffer(size: int) -> memoryview:
    """Uninitialised memory for an engine: a zero-filled bytearray would touch every page
    up front, on one thread, before the first byte is read; here the pages are first
    touched by the read itself, chunk by chunk, while the previous chunk is hashed."""
    import numpy as np

    return memoryview(np.empty(size, dtype=np.uint8)).cast("B")


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read into `view` from `offset` of the file: the one place the cache reads engine
    bytes (positional, so several threads share the one fd that was checked)."""
    return os.preadv(fd, [view], offset)


def _read_into(fd: int, view: memoryview, on_chunk: Callable[[memoryview], None] | None,
               chunk: int) -> int:
    done = 0
    while done < len(view):
        n = _read_at(fd, view[done:done + chunk], done)
        if not n:
            break
        if on_chunk is not None:
            on_chunk(view[done:done + n])
        done += n
    return done


def _grew(fd: int, size: int) -> bool:
    """Whether the file has bytes past `size`: then it is not the file the manifest describes."""
    return bool(os.pread(fd, 1, size))


def _open_published(entry: str | os.PathLike) -> tuple[Manifest, Path, int, int]:
    opened = open_entry(entry)
    if opened is None:
        raise CacheError(f"{entry}: not a published cache entry (no {MANIFEST})")
    return opened


def _read_parallel(fd: int, buf: memoryview, piece: int, expected: tuple[str, ...] | None,
                   workers: int, read_bytes: int, hash_name: str = CHUNK_HASH
                   ) -> tuple[int, float, list[tuple[int, str]]]:
    """Fill `buf` from `fd` one `piece` at a time on `workers` threads, each reading a whole
    chunk (os.preadv at its offset, so several reads are in flight on storage) and, when
    `expected` is given, hashing it at once against expected[index] (while it is still in
    the CPU's cache; both hashes release the GIL). Stops at the first mismatch or short read.
    Returns (bytes read, when the last read ended, [(chunk index, actual digest)])."""
    size = len(buf)
    chunk_digest = CHUNK_HASHES[hash_name]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for index in range(-(-size // piece)):
        todo.put(index)
    stop = threading.Event()
    failure: list[BaseException] = []
    mismatches: list[tuple[int, str]] = []
    short = [0]  # bytes missing: the file shrank while it was read
    read_end = [0.0]

    def work() -> None:
        try:
            while not stop.is_set():
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                start = index * piece
                end = min(size, start + piece)
                done = start
                while done < end:
                    n = _read_at(fd, buf[done:min(end, done + read_bytes)], done)
                    if not n:
                        short[0] += end - done
                        stop.set()
                        return
                    done += n
                read_end[0] = max(read_end[0], time.perf_counter())
                if expected is not None:
                    actual = chunk_digest(buf[start:end])
                    if actual != expected[index]:
                        mismatches.append((index, actual))
                        stop.set()
        except BaseException as e:  # reported in the caller's thread
            failure.append(e)
            stop.set()

    threads = [threading.Thread(target=work, name=f"kiln-engine-read-{i}", daemon=True)
               for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failure:
        raise failure[0]
    got = size - short[0]
    # A file that grew after fstat() is not the file the manifest describes.
    if not short[0] and not mismatches and _grew(fd, size):
        got = size + 1
    return got, read_end[0] or time.perf_counter(), mismatches


def read_verified(entry: str | os.PathLike, *, chunk_bytes: int = CHUNK_BYTES,
                  threads: int | None = None, whole_digest: bool = False
                  ) -> tuple[memoryview, Manifest, LoadTimings]:
    """Read an entry's engine and check its size and digests against the manifest.

    With chunk digests (every entry published since they exist): `threads` workers (by
    default min(CPUs, 8), at least 2) take the `chunkBytes` pieces in turn; each reads its
    piece into the preallocated buffer (os.preadv on the fd that was checked, at most
    `chunk_bytes` per call, so several reads are in flight on storage) and checks it at
    once against its `chunkBlake3` (or, for an entry published before BLAKE3, its
    `chunkSha256`), releasing the GIL, so verification spreads over cores and keeps up with
    storage: BLAKE3 hashes several times faster than SHA-256 on a core. The whole-file
    `sha256` is then not recomputed (one digest cannot be spread over cores): publish
    computed both from the same bytes, the build's load check reads the entry back with
    `whole_digest=True` (chunks, then the whole digest: one more pass, in the build Job
    only), and a chunk list that does not cover `sizeBytes` exactly is refused. A manifest
    is not signed, so chunk digests protect as much as the whole one: whoever could edit
    one could edit both. An entry without chunk digests (published before them) is
    checked against the whole file's sha256, hashed on this thread while a reader thread
    reads it, as before.

    By hand, with standard tools, in the entry directory: `sha256sum engine.plan` prints the
    manifest's `sha256`; `split -b <chunkBytes> -d -a 6 engine.plan /tmp/chunk. && b3sum
    /tmp/chunk.*` (Debian's b3sum) prints its `chunkBlake3`, in order.

    Returns the engine as a memoryview (no extra copy of a large file). Raises
    CacheIntegrityError naming the file and both values (for a chunk: its index, byte
    range and both digests).
    """
    manifest, path, fd, size = _open_published(entry)
    started = time.perf_counter()  # allocation included: a load needs the memory either way
    try:
        buf = _buffer(size)
        piece, expected = manifest.chunk_bytes, manifest.chunk_digests
        if expected:
            workers = max(1, int(threads)) if threads else _verify_threads(len(expected))
            got, read_end, mismatches = _read_parallel(fd, buf, piece, expected, workers,
                                                       max(1, chunk_bytes), manifest.chunk_hash)
            digest = hashlib.sha256(buf) if whole_digest and got == size and not mismatches \
                else None
        else:
            got, read_end, digest = _read_hashing(fd, buf, chunk_bytes)
            mismatches = []
    finally:
        os.close(fd)
    finished = time.perf_counter()
    if mismatches:
        index, actual = min(mismatches)
        start, end = index * piece, min(size, (index + 1) * piece)
        raise CacheIntegrityError(
            f"{path}: chunk {index} (bytes {start}-{end - 1}, chunkBytes {piece}): "
            f"{manifest.chunk_hash} {actual} does not match the manifest's "
            f"{CHUNK_FIELDS[manifest.chunk_hash]}[{index}] {expected[index]}; "
            f"the engine is corrupt or was modified, refusing to load it")
    if got != size:
        raise CacheIntegrityError(
            f"{path}: read {got} bytes, manifest expects {manifest.size_bytes} bytes "
            f"(the file changed while it was read); refusing to load it")
    if digest is not None and (actual := digest.hexdigest()) != manifest.sha256:
        raise CacheIntegrityError(
            f"{path}: sha256 {actual} does not match the manifest's {manifest.sha256}; "
            f"the engine is corrupt or was modified, refusing to load it")
    return buf, manifest, LoadTimings(read_seconds=read_end - started,
                                      verify_seconds=max(0.0, finished - read_end))


def _read_hashing(fd: int, buf: memoryview, chunk_bytes: int) -> tuple[int, float, Any]:
    """An entry without chunk digests: a reader thread fills the buffer chunk by chunk while
    this thread hashes each chunk (both release the GIL). (bytes read, read end, digest)"""
    size = len(buf)
    digest = hashlib.sha256()
    chunks: queue.SimpleQueue = queue.SimpleQueue()
    failure: list[BaseException] = []
    got = [0]
    read_end = [0.0]

    def reader() -> None:
        try:
            got[0] = _read_into(fd, buf, chunks.put, chunk_bytes)
            if got[0] == size and _grew(fd, size):
                got[0] = size + 1
        except BaseException as e:  # reported in the caller's thread
            failure.append(e)
        finally:
            read_end[0] = time.perf_counter()
            chunks.put(None)

    thread = threading.Thread(target=reader, name="kiln-engine-read", daemon=True)
    thread.start()
    while (piece := chunks.get()) is not None:
        digest.update(piece)
    thread.join()
    if failure:
        raise failure[0]
    return got[0], read_end[0], digest


def read_unverified(entry: str | os.PathLike, *, threads: int = 1, chunk_bytes: int = CHUNK_BYTES
                    ) -> tuple[memoryview, Manifest, float]:
    """Read an entry's engine without hashing it (the benchmark's baselines): one read call,
    or with `threads` > 1 the parallel reads read_verified makes, minus the hashing (by
    the manifest's chunks, else DIGEST_CHUNK_BYTES pieces). Seconds returned."""
    manifest, path, fd, size = _open_published(entry)
    started = time.perf_counter()
    try:
        buf = _buffer(size)
        if threads > 1:
            n = _read_parallel(fd, buf, manifest.chunk_bytes or DIGEST_CHUNK_BYTES, None,
                               threads, max(1, chunk_bytes))[0]
        else:
            n = _read_into(fd, buf, None, max(size, 1))
    finally:
        os.close(fd)
    if n != size:
        raise CacheIntegrityError(f"{path}: read {n} bytes, manifest expects {size} bytes")
    return buf, manifest, time.perf_counter() - started
