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


def _onnx_engine(size: int) -> bytes:
    """A dense MLP whose float32 weights add up to `size` bytes, serialized ONNX."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    width = 4096
    layers = max(1, size // (width * width * 4))
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((width, width), dtype=np.float32) * 0.01
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


def full_load(quick: bool) -> str:
    """Read + deserialize (an ONNX Runtime session) with and without verification."""
    from kiln.runtime.backends import get_backend

    size = (128 if quick else 1024) << 20
    runs = 2 if quick else 3
    backend = get_backend("onnxruntime")
    root = tempfile.mkdtemp(prefix="kiln-bench-load-")
    try:
        ki = enginekey.key_inputs({"uri": "bench", "version": "1"},
                                  {"backend": "onnxruntime", "precision": "fp32"}, "cpu",
                                  backend.version())
        engine = _onnx_engine(size)
        cache.publish(root, "bench", "mlp", ki.key, engine, engine_file=backend.engine_filename,
                      inputs=ki.to_dict(), backend="onnxruntime",
                      backend_version=backend.version(), target="cpu", build_seconds=0)
        mib = len(engine) >> 20
        del engine
        entry = cache.entry_dir(root, "bench", "mlp", ki.key)

        def load(read) -> float:
            started = time.perf_counter()
            data = read(entry)[0]
            backend.load(data, {}).close()
            return time.perf_counter() - started

        load(cache.read_unverified)  # warm the page cache
        base = _best(lambda: load(cache.read_unverified), runs)
        ver = _best(lambda: load(cache.read_verified), runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    over = ver / base - 1
    return "\n".join([
        "### The whole load: read + deserialize",
        "",
        f"What a runtime pod does before warm-up: read the engine (a {mib} MiB ONNX model "
        f"with dense float32 weights) and deserialize it into an ONNX Runtime session; warm "
        f"page cache, best of {runs}.",
        "",
        "| without verification | with verification | ratio | overhead | target |",
        "|---|---|---|---|---|",
        f"| {base:.2f} s | {ver:.2f} s | {ver / base:.2f} | {over:+.0%} | "
        f"{'met' if over <= TARGET_OVERHEAD else 'missed'} |",
    ])


def run(quick: bool) -> str:
    return read_only(quick) + "\n\n" + full_load(quick)


def read_only(quick: bool) -> str:
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
