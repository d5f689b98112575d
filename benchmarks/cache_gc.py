"""Engine cache: what garbage collection costs on a cache of 10,000 entries (issue 23 item 1).

A namespace of 10,000 entries (100 models of 100 keys; each a small engine file and a real
manifest, written directly rather than through publish's fsyncs) and a plan that removes
every other key of each model and keeps the rest. `kiln cache-gc`'s executor
(gc.collect) runs in a fresh process on a fresh copy of the cache: its seconds and its
peak memory (ru_maxrss, and tracemalloc's peak of what collect allocates, in a separate
run as tracing slows it) against the baseline, a plain os.scandir walk over the same tree
(every model directory and every entry's files, lstat'd) in a process that imported the
same modules. The ratios are what the figures mean; the absolute numbers are this
machine's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from kiln.runtime.api import enginekey
from kiln.runtime.engine.cache.entry import CHUNK_HASHES, CHUNK_HASH, MANIFEST, Manifest

NAMESPACE = "bench"
ENGINE_BYTES = 4096

# Runs in a fresh interpreter: one GC (or the baseline walk), a JSON line on stdout.
_CHILD = """
import json, os, resource, sys, time, tracemalloc
from kiln.runtime.engine.cache.gc import Plan, collect
root, plan_path, mode = sys.argv[1:4]
plan = Plan.from_dict(json.load(open(plan_path)))

def walk():
    files = 0
    with os.scandir(os.path.join(root, plan.namespace)) as models:
        for m in models:
            with os.scandir(m.path) as entries:
                for e in entries:
                    e.stat(follow_symlinks=False)
                    if e.is_dir(follow_symlinks=False):
                        with os.scandir(e.path) as inside:
                            files += sum(1 for f in inside if f.stat(follow_symlinks=False))
    return files

run = walk if mode.startswith("walk") else lambda: collect(root, plan, settle_seconds=0)
if mode.endswith("-traced"):
    tracemalloc.start()
started = time.perf_counter()
result = run()
seconds = time.perf_counter() - started
peak = tracemalloc.get_traced_memory()[1] if mode.endswith("-traced") else 0
removed = len(result.entries) if not isinstance(result, int) else 0
print(json.dumps({"seconds": seconds, "maxrssKiB": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss, "tracedPeak": peak, "removed": removed}))
"""


def _child(root: str, plan_path: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, root, plan_path, mode], check=True,
                         capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout)


def _make_cache(root: str, models: int, keys: int, used: float) -> list[tuple[str, str]]:
    """`models` x `keys` entries, each an engine file and its manifest; returns them."""
    engine = os.urandom(ENGINE_BYTES)
    sha = hashlib.sha256(engine).hexdigest()
    chunk = CHUNK_HASHES[CHUNK_HASH](memoryview(engine))
    built = datetime.datetime.fromtimestamp(used, datetime.timezone.utc).isoformat(
        timespec="seconds").replace("+00:00", "Z")
    made = []
    for m in range(models):
        model = f"model-{m}"
        for k in range(keys):
            ki = enginekey.key_inputs({"uri": f"pvc://models/{model}.onnx", "version": str(k)},
                                      {"backend": "onnxruntime", "precision": "fp32"}, "cpu",
                                      "bench")
            manifest = Manifest(key=ki.key, inputs=ki.to_dict(), engine_file="engine.onnx",
                                sha256=sha, size_bytes=ENGINE_BYTES, backend="onnxruntime",
                                backend_version="bench", target="cpu", build_seconds=1.0,
                                built_at=built, chunk_bytes=16 << 20, chunk_digests=(chunk,))
            d = os.path.join(root, NAMESPACE, model, ki.key)
            os.makedirs(d)
            with open(os.path.join(d, "engine.onnx"), "wb") as f:
                f.write(engine)
            with open(os.path.join(d, MANIFEST), "w") as f:
                f.write(manifest.to_json())
            os.utime(d, (used, used))
            made.append((model, ki.key))
    return made


def run(quick: bool) -> str:
    models, keys = (20, 50) if quick else (100, 100)
    runs = 1 if quick else 3
    work = tempfile.mkdtemp(prefix="kiln-bench-gc-")
    try:
        used = time.time() - 86400
        source = os.path.join(work, "source")
        made = _make_cache(source, models, keys, used)
        plan_path = os.path.join(work, "plan.json")
        with open(plan_path, "w") as f:
            json.dump({"schema": 1, "namespace": NAMESPACE, "decidedAt": time.time(),
                       "graceSeconds": 3600, "dryRun": False,
                       "remove": [{"model": m, "key": k} for m, k in made[::2]],
                       "keep": [{"model": m, "key": k} for m, k in made[1::2]]}, f)
        samples: dict[str, list[dict]] = {"walk": [], "gc": [], "walk-traced": [],
                                          "gc-traced": []}
        for i in range(runs):
            for mode in samples:
                if mode.startswith("walk"):  # reads only: the source itself
                    samples[mode].append(_child(source, plan_path, mode))
                    continue
                copy = os.path.join(work, f"copy-{i}-{mode}")
                shutil.copytree(source, copy, symlinks=True)  # directories' mtimes kept
                samples[mode].append(_child(copy, plan_path, mode))
                assert samples[mode][-1]["removed"] == len(made[::2]), samples[mode][-1]
                shutil.rmtree(copy)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(mode, field):
        return statistics.median(s[field] for s in samples[mode])

    walk, gc = median("walk", "seconds"), median("gc", "seconds")
    walk_rss, gc_rss = median("walk", "maxrssKiB"), median("gc", "maxrssKiB")
    walk_heap, gc_heap = median("walk-traced", "tracedPeak"), median("gc-traced", "tracedPeak")
    entries = models * keys
    return "\n".join([
        "## Engine cache: garbage collection (issue 23 item 1)",
        "",
        f"{entries:,} entries ({models} models of {keys} keys, {ENGINE_BYTES} B engines with "
        f"real manifests); the plan removes {len(made[::2]):,} (every other key) and keeps the "
        f"rest. `gc.collect` (what `kiln cache-gc` runs: scan, per model directory the "
        f"exclusive GC lock, a stat, rename and delete per entry removed) in a fresh process "
        f"on a fresh copy, median of {runs}, against a plain `os.scandir` walk of the same "
        f"tree (each entry and its files lstat'd) in a process that imported the same modules.",
        "",
        "| | os.scandir walk | gc.collect | ratio |",
        "|---|---|---|---|",
        f"| seconds | {walk:.3f} s | {gc:.3f} s | {gc / walk:.1f}x |",
        f"| per entry in the cache | {walk / entries * 1e6:.1f} us | "
        f"{gc / entries * 1e6:.1f} us | |",
        f"| peak memory of the process (ru_maxrss) | {walk_rss / 1024:.1f} MiB | "
        f"{gc_rss / 1024:.1f} MiB | {gc_rss / walk_rss:.2f}x |",
        f"| peak Python allocations of the call (tracemalloc) | {walk_heap / 1024:.0f} KiB | "
        f"{gc_heap / 1024:.0f} KiB | {gc_heap / entries:.0f} B an entry |",
        "",
        "Removing costs what the walk does not: per entry removed a stat under the lock, a "
        "rename, and the unlink of two files and a directory. What the executor allocates "
        "is its scan of one model directory at a time, the plan's keys and the result (an "
        "item per entry removed or skipped), not the tree's files.",
    ])

