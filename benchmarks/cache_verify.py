"""Engine cache: what verifying an engine's digests adds to loading it.

Targets (issue 3, issue 12 item 5): on a 1 GiB engine file, verification adds at most 15%
to a cold read (from storage) and at most 50% to a warm one (from the page cache). A
runtime pod loads its engine once, into fresh memory, so every measurement runs in a
fresh process (interpreter start excluded from the timing): `read_verified` (min(CPUs, 8)
threads each read a chunk into the buffer and check its BLAKE3 digest at once) against the same
parallel reads without hashing (`read_unverified(threads=...)`, the baseline the targets
are judged by) and against `read_unverified`'s single read call; the same entry with SHA-256
chunk digests (as published before BLAKE3), and with none (as before chunk digests: the whole
file's sha256 on one core, overlapping the read); then a read followed by what comes next in
a real load, deserializing the engine (an ONNX Runtime session).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from kiln.runtime.engine.cache import publish, verify
from kiln.runtime.engine.cache.entry import CHUNK_HASHES, MANIFEST, entry_dir
from kiln.runtime.api import enginekey

TARGET_OVERHEAD = 0.15  # cold, and a whole load
TARGET_WARM_OVERHEAD = 0.50

# Runs in a fresh interpreter: one load, its seconds on stdout.
_CHILD = """
import sys, time
from kiln.runtime.engine.cache import verify
entry, mode, backend = sys.argv[1:4]
read = {"verified": verify.read_verified, "unverified": verify.read_unverified,
        "parallel": lambda e: verify.read_unverified(e, threads=verify._verify_threads(1 << 30))
        }[mode]
if backend != "-":
    from kiln.runtime.engine.backends import get_backend
    b = get_backend(backend)
started = time.perf_counter()
data = read(entry)[0]
if backend != "-":
    b.load(data, {}).close()
print(time.perf_counter() - started)
"""


def _fresh(entry, mode: str, backend: str = "-") -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(entry), mode, backend],
                         check=True, capture_output=True, text=True, timeout=600)
    return float(out.stdout)


def _drop_page_cache(path) -> bool:
    # Evicts this file's clean pages (no root needed), so the next read comes from disk.
    try:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (AttributeError, OSError):
        return False


def _median(fn, runs: int, before=None) -> float:
    samples = []
    for _ in range(runs):
        if before:
            before()
        samples.append(fn())
    return statistics.median(samples)


def _publish(root, name: str, engine: bytes, backend: str, engine_file: str) -> str:
    ki = enginekey.key_inputs({"uri": "bench", "version": "1"},
                              {"backend": backend, "precision": "fp32"}, "cpu", "bench")
    publish.publish(root, "bench", name, ki.key, engine, engine_file=engine_file,
                    inputs=ki.to_dict(), backend=backend, backend_version="bench", target="cpu",
                    build_seconds=0)
    return str(entry_dir(root, "bench", name, ki.key))


def _onnx_engine(size: int) -> bytes:
    """A chain of MatMuls whose float32 weights add up to about `size` bytes."""
    import numpy as np
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
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _hash_seconds(size: int, name: str, threads: int = 0) -> float:
    """One `name` digest (CHUNK_HASHES) over `size` bytes (threads=0), or its chunk
    digests on `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    digest = CHUNK_HASHES[name]
    view = memoryview(os.urandom(16 << 20) * (size // (16 << 20)))
    started = time.perf_counter()
    if not threads:
        digest(view)
    else:
        step = verify.DIGEST_CHUNK_BYTES
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: digest(view[i:i + step]), range(0, size, step)))
    return time.perf_counter() - started


def _older_copy(root, entry: str, sha256_chunks: bool) -> str:
    """A copy of the entry under another model, its manifest as published before BLAKE3
    (SHA-256 chunk digests) or before chunk digests (none)."""
    import json

    copy = os.path.join(root, "bench", "sha256" if sha256_chunks else "old",
                        os.path.basename(entry))
    shutil.copytree(entry, copy)
    path = os.path.join(copy, MANIFEST)
    with open(path) as f:
        doc = json.load(f)
    del doc["chunkBlake3"]
    if sha256_chunks:
        with open(os.path.join(copy, doc["engineFile"]), "rb") as f:
            data = f.read()
        step = doc["chunkBytes"]
        doc["chunkSha256"] = [hashlib.sha256(data[i:i + step]).hexdigest()
                              for i in range(0, len(data), step)]
    else:
        del doc["chunkBytes"]
    with open(path, "w") as f:
        json.dump(doc, f)
    return copy


def run(quick: bool) -> str:
    size = (128 if quick else 1024) << 20
    runs = 3 if quick else 5
    mib = size >> 20
    rows = []

    def row(label, one, par, ver, target=TARGET_OVERHEAD):
        # Judged against the same parallel reads without hashing: what verification adds.
        over = ver / par - 1
        verdict = "" if target is None else (
            f"{target:+.0%}: {'met' if over <= target else 'missed'}")
        rows.append(f"| {label} | {one * 1000:.0f} ms | {par * 1000:.0f} ms | "
                    f"{ver * 1000:.0f} ms | {over:+.0%} | {ver / one - 1:+.0%} | {verdict} |")

    def measure(entry, backend="-", before=None, older=()):
        m = lambda mode, e=entry, b=before: _median(  # noqa: E731
            lambda: _fresh(e, mode, backend), runs, b)
        got = m("unverified"), m("parallel"), m("verified")
        return (*got, *(m("verified", e, b) for e, b in older))

    root = tempfile.mkdtemp(prefix="kiln-bench-cache-")
    try:
        raw = _publish(root, "raw", os.urandom(16 << 20) * (size // (16 << 20)),
                       "tensorrt", "engine.plan")
        sha_chunks, old = _older_copy(root, raw, True), _older_copy(root, raw, False)
        for entry in (raw, sha_chunks, old):
            _fresh(entry, "unverified")  # into the page cache
        one, par, ver, sha, whole = measure(raw, older=((sha_chunks, None), (old, None)))
        row("read, warm page cache", one, par, ver, TARGET_WARM_OVERHEAD)
        row("read, warm, SHA-256 chunk digests (an entry published before BLAKE3)", one, par,
            sha, None)
        row("read, warm, whole-file sha256 only (an entry without chunk digests)", one, par,
            whole, None)
        paths = [os.path.join(e, "engine.plan") for e in (raw, sha_chunks, old)]
        if _drop_page_cache(paths[0]):
            drops = [lambda p=p: _drop_page_cache(p) for p in paths]
            one, par, ver, sha, whole = measure(raw, before=drops[0], older=(
                (sha_chunks, drops[1]), (old, drops[2])))
            row("read, cold (page cache dropped)", one, par, ver)
            row("read, cold, SHA-256 chunk digests", one, par, sha, None)
            row("read, cold, whole-file sha256 only", one, par, whole, None)
        for entry in (raw, sha_chunks, old):
            shutil.rmtree(entry)

        onnx_entry = _publish(root, "mlp", _onnx_engine(size), "onnxruntime", "engine.onnx")
        _fresh(onnx_entry, "unverified")
        row("read + deserialize (ONNX Runtime session), warm page cache",
            *measure(onnx_entry, "onnxruntime"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    threads = verify._verify_threads(size // verify.DIGEST_CHUNK_BYTES)
    rates = {name: (mib / _hash_seconds(size, name), mib / _hash_seconds(size, name, threads))
             for name in ("sha256", "blake3")}

    return "\n".join([
        "## Engine cache: verification overhead (issue 3, issue 12 item 5)",
        "",
        f"A {mib} MiB engine, each load in a fresh process (as a pod loads it: once, into "
        f"fresh memory), median of {runs}. Targets: verification adds at most "
        f"{TARGET_OVERHEAD:.0%} to a cold read and to a whole load, at most "
        f"{TARGET_WARM_OVERHEAD:.0%} to a warm read. {os.cpu_count()} CPUs here; "
        f"{threads} threads, chunks of {verify.DIGEST_CHUNK_BYTES >> 20} MiB. The overhead is "
        f"against the same parallel reads without hashing (what verification adds); the "
        f"column after it is against `read_unverified`'s single read call, for reference.",
        "",
        "| load | unverified, one read call | unverified, the same parallel reads | verified "
        "| overhead | (against one read call) | target |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"One core here hashes {rates['sha256'][0]:.0f} MiB/s of SHA-256 (OpenSSL through "
        f"hashlib) and {rates['blake3'][0]:.0f} MiB/s of BLAKE3 (the blake3 package); as "
        f"{verify.DIGEST_CHUNK_BYTES >> 20} MiB chunk digests on {threads} threads, "
        f"{rates['sha256'][1]:.0f} and {rates['blake3'][1]:.0f} MiB/s. One digest of the whole "
        f"file cannot be spread over cores, so the manifest also holds each chunk's digest "
        f"(BLAKE3; the whole file's sha256 stays, for `sha256sum`); each thread reads a chunk "
        f"into the buffer (not zero-filled first; os.preadv, so several reads are in flight) "
        f"and hashes it at once, while the others read. A verified read costs about max(read, "
        f"hash spread over the threads): from storage the hash hides behind the read; from the "
        f"page cache the read is a memory copy, which SHA-256 on a few cores cannot keep up "
        f"with and BLAKE3 nearly can; in a whole load the deserialization that follows "
        f"dominates.",
    ])
