"""Engine cache: what verifying an engine's sha256 adds to loading it.

Target (issue 3): verification costs at most 15% of a load without verification, on a
1 GiB engine file. `read_verified` overlaps reading and hashing in two threads; the
baseline `read_unverified` reads the file into memory in one call. Both allocate the
buffer inside the timing, as a real load must.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

from kiln.runtime import cache, enginekey

TARGET_OVERHEAD = 0.15


def _drop_page_cache(path) -> bool:
    # Evicts this file's clean pages (no root needed), so the next read comes from disk.
    try:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (AttributeError, OSError):
        return False


def _best(fn, runs: int, before=None) -> float:
    best = float("inf")
    for _ in range(runs):
        if before:
            before()
        best = min(best, fn())
    return best


def run(quick: bool) -> str:
    size = (128 if quick else 1024) << 20
    runs = 3 if quick else 5
    root = tempfile.mkdtemp(prefix="kiln-bench-cache-")
    try:
        ki = enginekey.key_inputs({"uri": "bench", "version": "1"},
                                  {"backend": "tensorrt", "precision": "fp16"}, "sm90", "bench")
        # Incompressible content, written in pieces to keep the generator's memory small.
        engine = bytearray(size)
        piece = os.urandom(16 << 20)
        for off in range(0, size, len(piece)):
            engine[off:off + len(piece)] = piece[: size - off]
        cache.publish(root, "bench", "engine", ki.key, engine, engine_file="engine.plan",
                      inputs=ki.to_dict(), backend="tensorrt", backend_version="bench",
                      target="sm90", build_seconds=0)
        del engine
        entry = cache.entry_dir(root, "bench", "engine", ki.key)
        path = entry / "engine.plan"

        def verified() -> float:
            started = time.perf_counter()
            cache.read_verified(entry)
            return time.perf_counter() - started

        def unverified() -> float:
            return cache.read_unverified(entry)[2]

        def sha_only() -> float:
            data = bytes(4 << 20) * (size // (4 << 20))
            started = time.perf_counter()
            hashlib.sha256(data).digest()
            return time.perf_counter() - started

        unverified()  # warm the page cache
        warm_base, warm_ver = _best(unverified, runs), _best(verified, runs)
        sha = _best(sha_only, 2)
        cold = _drop_page_cache(path)
        if cold:
            drop = lambda: _drop_page_cache(path)  # noqa: E731
            cold_base = _best(unverified, max(2, runs - 2), drop)
            cold_ver = _best(verified, max(2, runs - 2), drop)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mib = size >> 20

    def row(label, base, ver):
        over = ver / base - 1
        return (f"| {label} | {base * 1000:.0f} ms ({mib / base:.0f} MiB/s) | "
                f"{ver * 1000:.0f} ms ({mib / ver:.0f} MiB/s) | {ver / base:.2f} | {over:+.0%} | "
                f"{'met' if over <= TARGET_OVERHEAD else 'missed'} |")

    rows = [row("warm page cache", warm_base, warm_ver)]
    if cold:
        rows.append(row("cold (page cache dropped)", cold_base, cold_ver))
    floor = sha / warm_base
    return "\n".join([
        "## Engine cache: sha256 verification overhead",
        "",
        f"A {mib} MiB engine file, best of {runs} runs. Target: verification adds at most "
        f"{TARGET_OVERHEAD:.0%} to a load without it.",
        "",
        "| read | without verification | with verification | ratio | overhead | target |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"SHA-256 alone hashes {mib / sha:.0f} MiB/s on this CPU (OpenSSL via hashlib, one "
        f"stream cannot be split across cores), while a warm page-cache read runs at "
        f"{mib / warm_base:.0f} MiB/s. Since reading and hashing overlap, a verified load "
        f"takes about max(read, hash): from a warm page cache the hash alone is "
        f"{floor:.1f}x the whole unverified load, so the 15% target cannot be met there by "
        f"{'any' if floor > 1 + TARGET_OVERHEAD else 'this'} implementation of the same digest. "
        f"When the engine comes from storage (the cold row, and a network volume in a "
        f"cluster), the hash hides behind the read.",
    ])
