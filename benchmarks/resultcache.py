"""The result cache's two levels (issue 23): what a hit costs from memory and from Redis
against the engine, and how much engine work a shared level saves a fleet.

In-process `Scheduler.submit` (runtime/serving/scheduling/), not HTTP: a hit's cost is a few
microseconds to a loopback round trip, which an HTTP hop and a load generator would bury
(serving.py measures the HTTP server itself; wrk sends one body, so it cannot make misses).
Real ONNX Runtime (serving.py's compute-dominated model: four 2048-wide MatMul + Relu
layers, one intra-op thread) and Debian's `redis-server` on loopback
(tests/support/sequence_models.py starts it: no persistence, a free port).

- Latency, at concurrency 1 and 64 (that many requests in flight at once, batching on):
  the engine without a cache (the baseline); a miss in both levels (memory, Redis's lookup
  and claim, the engine, the write); a hit in memory; a hit from Redis (a replica whose
  memory is empty reads what another replica wrote).
- The fleet: 4 replicas (4 schedulers) on one Redis; each request goes to a random replica,
  as a Service spreads them; the requests follow a Zipf-like mix (s = 1.1) over 10,000
  distinct inputs. Engine work = rows the engines executed (`kiln_batch_size`'s sum), with
  per-pod caches alone and with the shared level, against the requests made.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.serving import WIDTH, compute_model
from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling.scheduler import Scheduler
from support.sequence_models import RedisServer, redis_server_binary

DISTINCT = 10_000
ZIPF_S = 1.1
REPLICAS = 4
POD_MIB = 16  # each pod's memory: ~2,000 of this model's 8 KiB answers, a fifth of the mix


def _engine(onnx_path: Path):
    from kiln.runtime.engine.backends.base import BuildOptions
    from kiln.runtime.engine.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(intra_op_threads=1)
    return backend.load(backend.build(onnx_path.read_bytes(), BuildOptions()), {})


def _spec(cache: dict | None) -> dict:
    return runtime_with_defaults({
        "contextsPerGPU": 1,
        "batching": {"maxBatchSize": 64, "maxQueueDelayMicroseconds": 0, "maxQueueSize": 4096},
        "resultCache": cache or {"enabled": False}})


def _cache(address: str | None, pod_mib: int = 1024) -> dict:
    cache = {"enabled": True, "maxMiB": pod_mib, "ttlSeconds": 3600}
    if address is not None:
        cache["shared"] = {"address": address, "maxMiB": 1024, "timeoutMilliseconds": 1000}
    return cache


def _inputs(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).uniform(0.1, 7.0, (1, WIDTH)).astype(np.float32)}


async def _latencies(scheduler: Scheduler, seeds: list[int], concurrency: int) -> list[float]:
    """Per-request seconds of submitting each seed's inputs once, `concurrency` at a time."""
    pending = [_inputs(s) for s in seeds]
    times: list[float] = []

    async def worker() -> None:
        while pending:
            inputs = pending.pop()
            started = time.perf_counter()
            await scheduler.submit(inputs)
            times.append(time.perf_counter() - started)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return times


async def _latency_table(onnx_path: Path, address: str, requests: int) -> dict[str, dict[int, float]]:
    engine = _engine(onnx_path)
    schedulers = []

    async def started(cache: dict | None, key: str = "bench") -> Scheduler:
        s = Scheduler(engine, _spec(cache), ServerMetrics(), "bench", key)
        await s.start()
        schedulers.append(s)
        return s

    table: dict[str, dict[int, float]] = {k: {} for k in ("engine", "miss", "memory", "redis")}
    try:
        plain = await started(None)
        writer = await started(_cache(address))
        await _latencies(writer, list(range(64)), 64)  # its connections to Redis
        seed = 1_000_000
        for concurrency in (1, 64):
            await _latencies(plain, list(range(64)), concurrency)  # warm
            fresh = list(range(seed, seed + requests))
            seed += requests
            table["engine"][concurrency] = statistics.median(
                await _latencies(plain, fresh, concurrency))
            # Misses: inputs no level has seen; the writer stores them in memory and Redis.
            table["miss"][concurrency] = statistics.median(
                await _latencies(writer, fresh, concurrency))
            table["memory"][concurrency] = statistics.median(
                await _latencies(writer, fresh, concurrency))
            # Another replica, its memory empty: every request is a hit from Redis. Its
            # connections are opened first, as a serving pod's are.
            reader = await started(_cache(address))
            await _latencies(reader, list(range(64)), concurrency)
            table["redis"][concurrency] = statistics.median(
                await _latencies(reader, fresh, concurrency))
    finally:
        for s in schedulers:
            await s.close(5)
        engine.close()
    return table


def zipf_mix(requests: int, distinct: int = DISTINCT, s: float = ZIPF_S, seed: int = 0) -> list[int]:
    """`requests` draws from ranks 1..distinct with P(k) proportional to k^-s."""
    weights = 1.0 / np.arange(1, distinct + 1) ** s
    rng = np.random.default_rng(seed)
    return list(rng.choice(distinct, size=requests, p=weights / weights.sum()))


async def _fleet(onnx_path: Path, address: str | None, mix: list[int], concurrency: int) -> float:
    """Rows the replicas' engines executed for `mix`, spread at random over the replicas."""
    engines = [_engine(onnx_path) for _ in range(REPLICAS)]
    metrics = [ServerMetrics() for _ in range(REPLICAS)]
    replicas = [Scheduler(e, _spec(_cache(address, POD_MIB)), m, "bench", "bench")
                for e, m in zip(engines, metrics)]
    for r in replicas:
        await r.start()
    route = random.Random(1)
    pending = [(replicas[route.randrange(REPLICAS)], seed) for seed in reversed(mix)]

    async def worker() -> None:
        while pending:
            replica, seed = pending.pop()
            await replica.submit(_inputs(int(seed)))
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for r in replicas:
            await r.close(5)
        for e in engines:
            e.close()
    return sum(m.registry.get_sample_value("kiln_batch_size_sum", {"model": "bench"}) or 0
               for m in metrics)


def _run(coro):
    from kiln.runtime.serving.process import run_event_loop
    return run_event_loop(coro)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def run(quick: bool, requests: int | None = None, fleet_requests: int | None = None) -> str:
    title = "## Result cache: memory, Redis, engine (`benchmarks/resultcache.py`, issue 23)"
    if redis_server_binary() is None:
        return f"{title}\n\nNot run: redis-server is not installed (`make redis`)."
    requests = requests or (128 if quick else 2000)
    fleet_requests = fleet_requests or (2_000 if quick else 50_000)
    mix = zipf_mix(fleet_requests)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-results-") as tmp:
        onnx_path = compute_model(Path(tmp) / "mlp.onnx")
        redis = RedisServer(Path(tmp) / "redis").start()
        try:
            table = _run(_latency_table(onnx_path, redis.address, requests))
            redis.command("FLUSHALL")
            per_pod = _run(_fleet(onnx_path, None, mix, 64))
            shared = _run(_fleet(onnx_path, redis.address, mix, 64))
        finally:
            redis.stop()

    labels = {"engine": "engine, no cache (baseline)", "miss": "miss in both levels",
              "memory": "hit in the pod's memory", "redis": "hit from Redis"}
    rows = [f"| {labels[k]} | " + " | ".join(
        f"{_us(table[k][c])} ({table[k][c] / table['engine'][c]:.2g}x)" for c in (1, 64)) + " |"
        for k in labels]
    distinct = len(set(mix))
    saved_pod, saved_shared = 1 - per_pod / len(mix), 1 - shared / len(mix)
    floor = 1 - distinct / len(mix)  # every distinct input computed once, fleet-wide
    return "\n".join([
        title,
        "",
        f"In-process `Scheduler.submit` over ONNX Runtime (four 2048-wide MatMul + Relu layers, "
        f"one thread, batching on) and a real `redis-server` on loopback; no HTTP. Median "
        f"latency per request of {requests} requests at each concurrency, and its ratio to the "
        f"engine without a cache at the same concurrency.",
        "",
        "| request | concurrency 1 | concurrency 64 |",
        "|---|---|---|",
        *rows,
        "",
        f"**Engine work across {REPLICAS} replicas.** {len(mix):,} requests, Zipf-like "
        f"(s = {ZIPF_S}) over {DISTINCT:,} distinct inputs ({distinct:,} of them drawn), each "
        f"to a random replica, 64 in flight; each pod's memory {POD_MIB} MiB (about a fifth of "
        f"the mix's answers), the shared level 1 GiB.",
        "",
        "| caches | rows the engines ran | engine work saved |",
        "|---|---|---|",
        f"| per pod only | {per_pod:,.0f} | {saved_pod:.1%} |",
        f"| per pod + shared (Redis) | {shared:,.0f} | {saved_shared:.1%} "
        f"({per_pod / max(shared, 1):.2f}x less engine work) |",
        f"| the floor: each distinct input once | {distinct:,} | {floor:.1%} |",
        "",
        "Reading the figures: a hit in memory is a digest of the inputs and a copy of the "
        "answer; a hit from Redis adds one loopback round trip, the digest check and the "
        "decode, still a fraction of this engine's time; a miss pays the engine plus two "
        "round trips (the lookup that claims the key, the write). Per pod, every replica "
        "computes each input once for itself (and again after its LRU drops it); with the "
        "shared level the fleet computes it about once, which is what the last two rows "
        "compare.",
    ])
