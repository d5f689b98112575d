"""Front-end workers: `kiln serve --workers N` against the single process, on the tiny
model (issue 12, item 2).

The demo's Iris classifier costs the engine microseconds a batch, so what limits a
server is its front end: HTTP parsing and tensor decoding. Each point starts a real
`kiln serve` (engines built into a temporary cache) with N front-end processes and drives
it with wrk, closed loop, JSON and binary tensors, one row per request. The baseline is
the same server as one process (`--workers 1`), measured in the same run. The target:
N workers serve >= 0.8 x N x one process's rate, up to the cores the engine process and
the load generator leave free; the table stops there (it needs a machine with the cores:
on 2 the single process is the default and the only point that fits).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.__main__ import machine
from benchmarks.serving import (CEILING_SIZES, TUNED, build, ceiling, check_answer, iris_model,
                                load, mlp_model, runtime_spec, serving, wrk_path)

CONCURRENCY = 256
REPEATS = 3  # each point's median: one run's rate moves with whatever else the host runs
# Cores kept for what is not a front end: the engine process (its loop and ONNX Runtime's
# one thread) and wrk's threads.
ENGINE_CORES = 1
# The MLP's engine threads, where the machine has the cores for front ends beside them.
MLP_THREADS = 4


def _plan(cores: int) -> tuple[int, list[int]]:
    """(wrk threads, the worker counts that fit this machine)."""
    wrk_threads = max(1, min(4, cores // 4))
    free = cores - ENGINE_CORES - wrk_threads
    counts = [n for n in (2, 4, 6, 8, 12) if n <= free]
    return wrk_threads, counts


def run(quick: bool) -> str:
    seconds, repeats = (2.0, 1) if quick else (4.0, REPEATS)
    cores = len(os.sched_getaffinity(0))
    wrk_threads, counts = _plan(cores)
    wrk_path()
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-frontend-"))
    rows: list[tuple[int, str, object]] = []
    try:
        demo = iris_model()
        build(demo, workdir / "cache")
        spec = runtime_spec(TUNED)
        for workers in [1, *counts]:
            with serving(demo, workdir / "cache", spec, 1, workdir,
                         extra_args=("--workers", str(workers), "--no-grpc")) as srv:
                check_answer(srv.url, demo)
                for binary in (False, True):
                    runs = sorted((load(srv, demo, CONCURRENCY, seconds, binary=binary,
                                        threads=wrk_threads) for _ in range(repeats)),
                                  key=lambda r: r.throughput)
                    rows.append((workers, "binary" if binary else "JSON", runs[len(runs) // 2]))
            print(f"   {workers} worker(s) done", file=sys.stderr, flush=True)
        mlp = _mlp_against_ceiling(workdir, cores, wrk_threads, seconds, repeats) if counts else None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    base = {body: r.throughput for w, body, r in rows if w == 1}
    out = ["## Front-end workers (`benchmarks/frontend.py`)", "",
           f"The demo's Iris model (the engine's part is microseconds), one row per request, "
           f"wrk with {wrk_threads} thread(s) and {CONCURRENCY} connections, closed loop, "
           f"{seconds:g} s per run after a 1 s warm-up, the median of {repeats} runs a point; "
           f"ONNX Runtime 1 thread; settings: "
           f"{TUNED['contexts']} context, batching on, queue delay {TUNED['delay']} us. "
           f"`workers 1` is the single process (no shared memory, no second hop). Server CPU "
           f"is the engine and its front ends together, from /proc. Run on: {machine()}; "
           f"counts above {cores - ENGINE_CORES - wrk_threads} are not run (no core left for "
           f"them beside the engine and wrk).", "",
           "| workers | body | req/s | x one process | target (0.8 x N) | p50 | p99 | mean batch | server CPU / s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workers, body, r in rows:
        ratio = r.throughput / base[body]
        target = "" if workers == 1 else ("met" if ratio >= 0.8 * workers else
                                          f"missed ({ratio / workers:.2f} x N)")
        out.append(f"| {workers} | {body} | {r.throughput:,.0f} | {ratio:.2f}x | {target} | "
                   f"{r.p50_us / 1e3:.2f} ms | {r.p99_us / 1e3:.2f} ms | "
                   f"{r.mean_batch or 0:.1f} | {(r.server_cpu or 0) / r.seconds:.2f} |")
    if not counts:
        out += ["", f"No worker count above 1 fits {cores} cores beside the engine and wrk: "
                    "scaling is measured on a larger machine (docs/benchmarks.md says where)."]
    if mlp is not None:
        out += ["", *mlp]
    return "\n".join(out)


def _mlp_against_ceiling(workdir: Path, cores: int, wrk_threads: int, seconds: float,
                         repeats: int) -> list[str]:
    """The serving benchmark's MLP, binary, one row per request: the single process and
    front ends against ONNX Runtime's in-process ceiling with the same threads."""
    mlp = mlp_model(workdir)
    build(mlp, workdir / "cache")
    threads = MLP_THREADS
    workers = max(1, cores - ENGINE_CORES - threads - wrk_threads)
    spec = runtime_spec(TUNED)
    best: dict[int, object] = {}
    for n in (1, workers):
        with serving(mlp, workdir / "cache", spec, threads, workdir,
                     extra_args=("--workers", str(n), "--no-grpc")) as srv:
            check_answer(srv.url, mlp)
            runs = sorted((load(srv, mlp, 256, seconds, threads=wrk_threads)
                           for _ in range(repeats)), key=lambda r: r.throughput)
            best[n] = runs[len(runs) // 2]
    top = ceiling(mlp, threads, CEILING_SIZES, 1.0)
    size, rate = top.best
    lines = [f"mlp2048 (4 x 2048 MatMul + Relu), binary, one row per request, 256 connections, "
             f"ONNX Runtime {threads} threads, against the backend in-process with the same "
             f"threads at its best batch ({size}: {rate:,.0f} rows/s); target >= 70%:", "",
             "| workers | rows/s | of the ceiling | p99 | mean batch |", "| --- | --- | --- | --- | --- |"]
    for n, r in best.items():
        lines.append(f"| {n} | {r.rows_per_second:,.0f} | {r.rows_per_second / rate:.0%} | "
                     f"{r.p99_us / 1e3:.1f} ms | {r.mean_batch or 0:.1f} |")
    return lines
