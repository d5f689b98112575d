"""Engine processes beyond the first: more event loops for models whose own work is small.

Front ends scale HTTP parsing with the cores, but every request they read still passes
through the engine process's one event loop (its hand-over, its scheduler, its reply), and
on a model whose execution takes microseconds that loop is what caps the pod (about 35,000
requests/s on the tiny model with 8-15 front ends on 16 cores, docs/benchmarks.md). With
`--engine-processes E` > 1, `kiln serve` runs E - 1 more engine processes beside the first
(PID 1), each loading the same engine file and running its own scheduler and EngineHub;
front end i sends its batchable requests to engine i mod E, and everything else to the
first:

- requests that carry state the pod must hold in one place (a sequence's, or a model with
  a result cache) and models that do not batch go to the first engine, as without them;
- readiness: a front end is ready when the first engine and its own are;
- metrics: the first engine's `/metrics` adds up the others' registries (`merge_metrics`);
- a second engine that dies is started again by the first; its front ends stop with it and
  are started again too (as a front end whose engine went away always does).

Only for CPU engines: each process holds its own copy of the model in memory, which on a
GPU would be GPU memory spent E times. The default (`auto_engine_processes`) is one per 4
CPUs when every engine of the model is a CPU engine of at most `LIGHT_ENGINE_BYTES` (there,
the loop is the limit: `light_cpu_engine`); one otherwise (there, the cores are better spent
as threads of one session: docs/benchmarks.md, Serving that uses the whole machine).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kiln.runtime.api.contract import MAX_ENGINE_PROCESSES
from kiln.runtime.api.enginekey import CPU_TARGET

log = logging.getLogger("kiln.runtime.serving.workers")

# Engine entries up to this size (weights, for a dense model about 4 bytes a parameter) cost
# the engine loop more per request than their execution does: the ~1M parameters of 4 MiB
# are ~2 MFLOP a row, tens of microseconds on one core, like one hand-over.
LIGHT_ENGINE_BYTES = 4 * 1024 * 1024
CPUS_PER_ENGINE = 4
_ORPHAN_CHECK_SECONDS = 1.0


def light_cpu_engine(engines: Mapping[str, str], cache_dir: str) -> bool:
    """Whether every engine of the model is a CPU engine of at most `LIGHT_ENGINE_BYTES`:
    one whose execution costs less than a request's trip through an event loop, so that
    the pod's requests a second are the loops' to raise (front ends, engine processes)."""
    if set(engines) != {CPU_TARGET}:
        return False
    entry = Path(cache_dir) / engines[CPU_TARGET]
    try:
        size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
    except OSError:
        return False  # the load will say what is wrong with the entry
    return size <= LIGHT_ENGINE_BYTES


def auto_engine_processes(cpus: float | None, light: bool) -> int:
    """The engine processes `kiln serve` runs by default: one per `CPUS_PER_ENGINE` CPUs
    for a light CPU model (`light_cpu_engine`), one for anything else (a GPU target, a
    larger engine, an unknown CPU limit)."""
    if cpus is None or cpus < 2 * CPUS_PER_ENGINE or not light:
        return 1
    return min(MAX_ENGINE_PROCESSES, int(cpus // CPUS_PER_ENGINE))


def parse_engine_processes(value: str | int | None, default: int,
                           engines: Mapping[str, str]) -> int:
    """`--engine-processes` / KILN_ENGINE_PROCESSES / spec.runtime.engineProcesses -> a
    count; "auto" or None gives `default`. Raises ValueError with the accepted forms, and
    for more than one on a model with a GPU engine."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if not 1 <= n <= MAX_ENGINE_PROCESSES or isinstance(value, bool):
        raise ValueError(f"engine processes must be a number from 1 to {MAX_ENGINE_PROCESSES} "
                         f"or 'auto', got {value!r}")
    if n > 1 and set(engines) != {CPU_TARGET}:
        raise ValueError(f"{n} engine processes need CPU engines only (each process loads its "
                         f"own copy; a GPU's memory is spent once): this model has engines for "
                         f"{', '.join(sorted(engines))}")
    return n


MAX_ENGINE_THREADS = 256  # the CRD's bound on runtime.engineThreads


def parse_engine_threads(value: Any) -> int | None:
    """spec.runtime.engineThreads -> a count, None when absent. Raises ValueError with the
    accepted range (a hand-written --runtime-spec is not checked by an API server)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ENGINE_THREADS:
        raise ValueError(f"runtime.engineThreads must be a number from 1 to {MAX_ENGINE_THREADS}, "
                         f"got {value!r}")
    return value


def engine_threads(cpus: float | None, front_ends: int, engines: int) -> int | None:
    """ONNX Runtime intra-op threads of each engine process: the CPU limit less a core for
    every 4 front ends busy on HTTP (at least one), shared by the engine processes; None
    (ONNX Runtime's own default) when the limit is unknown. ONNX Runtime's default is one
    thread per physical core of the node, which in a pod limited to fewer CPUs means
    threads that wait on each other's throttled quota."""
    if cpus is None:
        return None
    whole = max(1, int(math.floor(cpus)))
    reserved = math.ceil(front_ends / 4) if front_ends > 1 else 0
    return max(1, (whole - reserved) // max(1, engines))


@dataclass(frozen=True)
class EngineConfig:
    """What a second engine process is started with (pickled to it: plain values only)."""

    index: int
    hub_path: str
    model_name: str
    model_version: str
    cache_dir: str
    engines: Mapping[str, str]
    runtime: Mapping[str, Any]
    load_timeout: float
    max_body_bytes: int
    log_level: str = "INFO"
    event_loop: str = "asyncio"
    shadow_config: str | None = None  # kiln serve --shadow-config
    engine_processes: int = 1


def engine_main(config: EngineConfig, drain_seconds: float) -> None:
    """A second engine process: load the model, serve front ends on its hub until SIGTERM,
    drain its scheduler, exit."""
    from kiln.runtime.serving.process import configure_logging, run_event_loop

    configure_logging(config.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first engine decides when to stop
    run_event_loop(_serve_engine(config, drain_seconds), config.event_loop)


async def _serve_engine(config: EngineConfig, drain_seconds: float) -> None:
    from kiln.runtime.serving.metrics import ServerMetrics
    from kiln.runtime.serving.model import ServedModel
    from kiln.runtime.serving.servers import InferenceServer
    from kiln.runtime.serving.workers.engine_side import EngineHub

    metrics = ServerMetrics()
    model = ServedModel(config.model_name, config.model_version, config.cache_dir,
                        config.engines, config.runtime, metrics, load_timeout=config.load_timeout)
    from kiln.runtime.serving.shadow import attach_shadow

    attach_shadow(model, config.shadow_config, config.engine_processes)
    server = InferenceServer([model], metrics, max_body_bytes=config.max_body_bytes)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await server.start(port=None)
    hub = EngineHub(server, config.hub_path)
    await hub.start()
    log.info("engine process %d serving front ends", config.index)
    orphaned = asyncio.create_task(_stop_when_orphaned(stop))
    await stop.wait()
    orphaned.cancel()
    await server.shutdown(drain_seconds)
    await hub.stop()


async def _stop_when_orphaned(stop: asyncio.Event) -> None:
    """The first engine process was killed (it would have sent SIGTERM otherwise): stop
    too, rather than hold a model no front end can reach."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(_ORPHAN_CHECK_SECONDS)
    log.error("the first engine process went away; engine process stops")
    stop.set()


BUSY_FRACTIONS = ("kiln_engine_busy_seconds", "kiln_engine_busy_ratio")  # of the pod's capacity: / engines


def merge_metrics(texts: list[bytes], engines: int) -> bytes:
    """The first engine's exposition (`texts[0]`) with the other engines' added in: counters,
    histograms and gauges summed by series, except `kiln_model_ready` (the lowest: ready
    only when every engine is), the first engine's own `kiln_model_info`,
    `kiln_engine_load_seconds`, `kiln_engine_cache_*` (one volume, however many engines
    read it) and `kiln_pod_*` (the whole pod's, which only the first reads), and `kiln_engine_busy_seconds` and `kiln_engine_busy_ratio` divided by the
    engine count (the rate, and the ratio, stay the fraction of the pod's engine capacity in
    use, 0..1: a ratio is averaged over the engines, not summed)."""
    from prometheus_client.core import Metric
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector, CollectorRegistry

    own = ("kiln_model_info", "kiln_engine_load_seconds")
    own_prefixes = ("kiln_gpu_", "kiln_engine_cache_", "kiln_pod_")
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for i, text in enumerate(texts):
        for family in text_string_to_metric_families(text.decode()):
            if i and (family.name in own or family.name.startswith(own_prefixes)):
                continue
            families.setdefault(family.name, family)
            series = values.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in series:
                    series[key] = s.value
                elif s.name.endswith("_created"):
                    series[key] = min(series[key], s.value)
                elif family.name == "kiln_model_ready":
                    series[key] = min(series[key], s.value)
                else:
                    series[key] += s.value

    class _Merged(Collector):
        def collect(self):
            for name, family in families.items():
                merged = Metric(name, family.documentation, family.type, family.unit)
                scale = 1 / engines if name in BUSY_FRACTIONS else 1
                for (sample, labels), value in values[name].items():
                    merged.add_sample(sample, dict(labels),
                                      value if sample.endswith("_created") else value * scale)
                yield merged

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
