"""Serving that uses the whole machine: front-end workers and engine processes against the
single process, on the tiny model and the MLP (issue 12, item 2; issue 22).

Each configuration is a real `kiln serve` (engines built into a temporary cache) driven by
wrk, closed loop, one row per request, each point the median of `ROUNDS` rounds with their
spread:

- the tiny model (the demo's Iris classifier: its execution takes microseconds, so what
  limits a server is HTTP and the hand-overs), JSON, at concurrency 64 and 256: the single
  process (`--workers 1`), one engine process behind the CPU limit less one front ends
  (`--engine-processes 1`, the default above 2 CPUs before issue 22) and Kiln's defaults on
  this machine (front ends and engine processes picked from the CPUs);
- the MLP (4 x 2048 MatMul + Relu), binary, at concurrency 256, batching up to 256 rows:
  Kiln's defaults (engine threads from the CPU limit) and ONNX Runtime's own default
  threads, against ONNX Runtime alone with every CPU as a thread at its best batch (the
  ceiling the same CPUs reach). Target: >= 70% of that ceiling.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.__main__ import machine
from benchmarks.serving import (MAX_BATCH, build, ceiling, check_answer, iris_model, load,
                                median_round, mlp_model, serving, wrk_path)

ROUNDS = 3
TINY_CONCURRENCY = (64, 256)
MLP_CONCURRENCY = 256
CEILING_BATCHES = (256, 512)


def _processes(log: str) -> str:
    """'F front ends x E engines' as the server's log says it started."""
    import re

    workers = re.search(r"(\d+) front-end worker\(s\)", log)
    engines = re.search(r"(\d+) engine processes", log)
    if workers is None:
        return "1 process"
    return f"{workers.group(1)} front ends x {engines.group(1) if engines else 1} engine(s)"


def run(quick: bool) -> str:
    seconds, rounds = (2.0, 1) if quick else (3.0, ROUNDS)
    cores = len(os.sched_getaffinity(0))
    wrk_threads = max(1, min(4, cores // 4))
    wrk_path()
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-frontend-"))
    try:
        tiny = _tiny(workdir, cores, wrk_threads, seconds, rounds)
        mlp = _mlp(workdir, cores, wrk_threads, seconds, rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join([
        f"## Serving that uses the whole machine, {cores} CPUs (`benchmarks/frontend.py`, issue 22)",
        "", f"Run on: {machine()}, this process's CPUs: {cores}. wrk with {wrk_threads} thread(s), "
        f"closed loop, one row per request, {seconds:g} s per round after a 1 s warm-up; each "
        f"figure the median of {rounds} round(s), the spread is the slowest and fastest round. "
        f"Server CPU is every process of the server together, from /proc. Every server was "
        f"checked first: its answer equals ONNX Runtime run directly.", "",
        *tiny, "", *mlp, ""])


def _tiny(workdir: Path, cores: int, wrk_threads: int, seconds: float, rounds: int) -> list[str]:
    model = iris_model()
    build(model, workdir / "cache")
    configs = [("single process", ("--workers", "1")),
               ("one engine process", ("--engine-processes", "1")),
               ("Kiln's defaults", ())]
    if cores < 3:  # one engine process is the default here
        configs = [configs[0], configs[2]]
    out = ["The tiny model (the demo's Iris classifier), JSON, `spec.runtime` empty (Kiln's "
           "defaults: batching on, `maxBatchSize` 32, 2 contexts). Before issue 22 the default "
           "was the single process below 3 CPUs and one engine process behind the CPU limit "
           "less one front ends above:", "",
           "| configuration | processes | concurrency | req/s | spread | p50 | p99 | mean batch | server CPU / s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, args in configs:
        with serving(model, workdir / "cache", {}, None, workdir,
                     extra_args=("--no-grpc", "--log-level", "INFO", *args), workers=None) as srv:
            check_answer(srv.url, model)
            processes = _processes(_log(workdir, model.name, srv.url))
            for c in TINY_CONCURRENCY:
                runs = [load(srv, model, c, seconds, binary=False, threads=wrk_threads)
                        for _ in range(rounds)]
                r, low, high = median_round(runs)
                out.append(f"| {label} | {processes} | {c} | {r.throughput:,.0f} | "
                           f"{low:,.0f}-{high:,.0f} | {r.p50_us / 1e3:.2f} ms | "
                           f"{r.p99_us / 1e3:.2f} ms | {r.mean_batch or 0:.1f} | "
                           f"{(r.server_cpu or 0) / r.seconds:.2f} |")
        print(f"   tiny: {label} done", file=sys.stderr, flush=True)
    return out


def _mlp(workdir: Path, cores: int, wrk_threads: int, seconds: float, rounds: int) -> list[str]:
    from kiln.runtime.api.spec import runtime_with_defaults

    model = mlp_model(workdir)
    build(model, workdir / "cache")
    spec = runtime_with_defaults({"batching": {"maxBatchSize": MAX_BATCH, "maxQueueSize": 4096}})
    rows = []
    for label, threads in (("Kiln's defaults (engine threads from the CPU limit)", None),
                           ("ONNX Runtime's default threads (before issue 22)", 0)):
        with serving(model, workdir / "cache", spec, threads, workdir,
                     extra_args=("--no-grpc", "--log-level", "INFO"), workers=None) as srv:
            check_answer(srv.url, model)
            runs = [load(srv, model, MLP_CONCURRENCY, seconds, threads=wrk_threads)
                    for _ in range(rounds)]
            rows.append((label, _processes(_log(workdir, model.name, srv.url)), *median_round(runs)))
    ceilings = [ceiling(model, cores, CEILING_BATCHES, 1.0).best for _ in range(rounds)]
    (size, rate), low, high = median_round(ceilings, lambda best: best[1])
    out = [f"The MLP (4 x 2048 MatMul + Relu), binary, concurrency {MLP_CONCURRENCY}, "
           f"`maxBatchSize` {MAX_BATCH}, other settings the defaults, against ONNX Runtime "
           f"alone with {cores} intra-op threads (every CPU) at its best batch: {rate:,.0f} "
           f"rows/s (batch {size}; spread {low:,.0f}-{high:,.0f}). Target: >= 70%.", "",
           "| configuration | processes | rows/s | spread | of the ceiling | met | p99 | mean batch | server CPU / s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, processes, r, lo, hi in rows:
        share = r.rows_per_second / rate
        out.append(f"| {label} | {processes} | {r.rows_per_second:,.0f} | {lo:,.0f}-{hi:,.0f} | "
                   f"{share:.0%} | {'yes' if share >= 0.7 else '**no**'} | "
                   f"{r.p99_us / 1e3:.1f} ms | {r.mean_batch or 0:.1f} | "
                   f"{(r.server_cpu or 0) / r.seconds:.2f} |")
    print("   mlp done", file=sys.stderr, flush=True)
    return out


def _log(workdir: Path, name: str, url: str) -> str:
    return (workdir / f"serve-{name}-{url.rsplit(':', 1)[1]}.log").read_text()
