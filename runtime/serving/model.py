"""The served model: pick this pod's engine, verify it, load it, warm it up, then be ready.

A request flows door (rest/, grpc/) -> dataplane (`dataplane.Dataplane`) -> model (a
`Model`: `ServedModel` here, or a front-end process's `workers.front_end.RemoteModel`) ->
scheduler (batching, the queue, the engine's execution contexts). `Model` is all the
dataplane asks of a model, wherever it runs.

`ServedModel.load()` runs in a background task after the HTTP server is listening, so
liveness answers during a long load and readiness stays false until warm-up is done. A
load failure (no engine for this GPU, an integrity error, a backend error) keeps the model
not-ready with its message in `error`, logged once; the pod never crash-loops on it.
The whole load has a deadline (`load_timeout`): a read that blocks on a hung volume ends
as a failure that says so, and the pod's startup probe restarts it. Blocking steps run on
daemon threads, so a read that never returns cannot keep a stopping process alive.

Stages, each recorded in `kiln_engine_load_seconds{stage}`:
    read         the engine file from the cache (the PVC)
    verify       size and sha256 against manifest.json, before anything is deserialized
    deserialize  the backend turns the bytes into a loaded engine
    warmup       the scheduler starts its execution contexts and runs one batch at the
                 profiles' optimal shapes (batch 1 for dynamic dimensions without a profile)
    samples      the user's sample requests (samples.py): failing, `failure`, which `kiln serve` exits with
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import numpy as np

from kiln.runtime.engine.backends.base import LoadedEngine, ShapeRange, TensorSpec
from kiln.runtime.api.contract import LOAD_TIMEOUT_SECONDS as DEFAULT_LOAD_TIMEOUT_SECONDS
from kiln.runtime.api.enginekey import normalize_target
from kiln.runtime.serving.loading import (ModelLoadError, default_scheduler, detect_target, on_daemon_thread,
                                          pick_engine, warmup_inputs)
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving import samples

if TYPE_CHECKING:  # imported where used: a front-end process needs none of them
    from kiln.runtime.engine.cache.entry import Manifest
    from kiln.runtime.serving.shadow import Shadow
    from kiln.runtime.serving.scheduling.scheduler import Scheduler
    from kiln.runtime.serving.sequences.manager import SequenceManager

log = logging.getLogger("kiln.runtime.serving.model")

LOADING, READY, FAILED, UNHEALTHY, STOPPED = "loading", "ready", "failed", "unhealthy", "stopped"


class Model(Protocol):
    """What the dataplane asks of a model, wherever it runs: `ServedModel` in this process,
    or a front end's `RemoteModel`, which answers from the engine process's pushed state."""

    name: str

    @property
    def version(self) -> str: ...
    @property
    def state(self) -> str: ...  # LOADING, READY, FAILED, UNHEALTHY or STOPPED
    @property
    def ready(self) -> bool: ...
    @property
    def serving(self) -> bool: ...  # takes requests (an unhealthy model still does)
    @property
    def loaded(self) -> bool: ...  # has an engine to describe in metadata
    @property
    def platform(self) -> str | None: ...
    @property
    def inputs(self) -> list[TensorSpec]: ...
    @property
    def outputs(self) -> list[TensorSpec]: ...
    @property
    def profiles(self) -> Mapping[str, ShapeRange]: ...
    @property
    def max_rows(self) -> int | None: ...  # the largest batch one request may carry
    @property
    def results_per_tenant(self) -> bool: ...  # its result cache keeps each tenant's apart

    def status_message(self) -> str: ...

    async def admit(self) -> None:
        """Wait for room in the model's queue, where waiting is this process's to do."""

    async def infer(self, inputs: dict[str, np.ndarray],
                    parameters: Mapping[str, Any] | None = None,
                    tenant: str = "") -> dict[str, np.ndarray]: ...

    async def load(self) -> bool: ...

    async def close(self, drain_timeout: float) -> None: ...


class ServedModel:
    """One model a server answers for; the v2 dataplane talks to it, never to an engine.

    `scheduler_factory(engine, runtime_spec, metrics, model, engine_key, clock, version)` builds the
    object requests go through (the batching Scheduler by default). `reader(entry)` reads
    and verifies an entry (`cache.read_verified` by default). `load_timeout`: seconds the
    whole load (read, verify, deserialize, warm-up) may take before the model fails.
    """

    def __init__(self, name: str, version: str, cache_dir: str | os.PathLike,
                 engines: Mapping[str, str], runtime_spec: Mapping[str, Any],
                 metrics: ServerMetrics, *, target: str | None = None,
                 scheduler_factory: Callable[..., "Scheduler"] = default_scheduler,
                 clock: Callable[[], float] = time.monotonic,
                 load_timeout: float = DEFAULT_LOAD_TIMEOUT_SECONDS,
                 reader: Callable[[str], Any] | None = None, samples_file: str | None = None):
        if not name:
            raise ValueError("the model needs a name")
        if not (isinstance(load_timeout, (int, float)) and math.isfinite(load_timeout)
                and load_timeout > 0):
            raise ValueError(f"the load timeout must be a positive number of seconds, "
                             f"got {load_timeout!r}")
        self.load_timeout = float(load_timeout)
        self._reader = reader
        self._doing = "starting"  # what the load is doing, for the deadline's message
        self.name = name
        self.version = version or "1"
        self.cache_dir = os.fspath(cache_dir)
        self.engines = dict(engines)
        self.runtime_spec = dict(runtime_spec)
        self.metrics = metrics
        self._target = target
        self._scheduler_factory = scheduler_factory
        self._clock = clock
        self.state = LOADING
        self.error: str | None = None
        self.samples_file = samples_file  # `--samples-file`: run after spec.runtime.warmup's samples
        self.failure: samples.WarmupFailed | None = None  # samples that failed: `kiln serve` exits with it
        self.target: str | None = None
        self.manifest: Manifest | None = None
        self.engine: LoadedEngine | None = None
        self.scheduler: Scheduler | None = None
        # spec.runtime.sequences: the manager once loaded (runtime/serving/sequences/manager.py), else None.
        self.sequences: SequenceManager | None = None
        self._state_tensors: frozenset[str] = frozenset()
        self.timings: dict[str, float] = {}
        self.shadow: Shadow | None = None  # copies to a canary while a rollout shadows (shadow.py)
        metrics.model_ready.labels(model=name).set_function(lambda: float(self.ready))

    # -- state -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        if self.state not in (READY, UNHEALTHY):
            return False
        healthy = self.scheduler.healthy if self.scheduler is not None else True
        new_state = READY if healthy else UNHEALTHY
        if new_state != self.state:
            # Logged on the flip only: readiness is polled every few seconds.
            if healthy:
                log.info("model %s: executions succeed again; ready", self.name)
            else:
                log.error("model %s: repeated execution failures; not ready", self.name)
            self.state = new_state
        return healthy

    @property
    def serving(self) -> bool:
        """Loaded and not stopped. An unhealthy model still takes requests: readiness keeps
        traffic away, and the next batch that succeeds is what makes it healthy again."""
        return self.state in (READY, UNHEALTHY) and self.scheduler is not None

    @property
    def loaded(self) -> bool:
        """An engine to describe: kept after a stop, dropped when the load failed."""
        return self.engine is not None

    @property
    def max_rows(self) -> int | None:
        return self.scheduler.max_rows if self.scheduler is not None else None

    @property
    def results_per_tenant(self) -> bool:
        """Whether requests need their tenant read (`resultCache.perTenant`), known from the
        spec before the load, so no request reaches the cache without it."""
        cache = self.runtime_spec.get("resultCache") or {}
        return bool(cache.get("enabled") and cache.get("perTenant"))

    @property
    def inputs(self) -> list[TensorSpec]:
        """The inputs a client sends: a stateful model's state inputs are the server's."""
        return [s for s in self.engine.inputs if s.name not in self._state_tensors] \
            if self.engine is not None else []

    @property
    def outputs(self) -> list[TensorSpec]:
        """The outputs a client can ask for: not a stateful model's state outputs."""
        return [s for s in self.engine.outputs if s.name not in self._state_tensors] \
            if self.engine is not None else []

    @property
    def profiles(self) -> Mapping[str, ShapeRange]:
        return dict(self.engine.profiles) if self.engine is not None else {}

    @property
    def platform(self) -> str | None:
        return self.manifest.backend if self.manifest is not None else None

    def status_message(self) -> str:
        if self.state == LOADING:
            return f"model '{self.name}' is loading"
        if self.state == FAILED:
            return f"model '{self.name}' failed to load: {self.error}"
        if self.state == UNHEALTHY:
            return (f"model '{self.name}' is not ready: executions are failing "
                    f"({self.error or 'see the server log'})")
        if self.state == STOPPED:
            return f"model '{self.name}' is shutting down"
        return f"model '{self.name}' is ready"

    # -- load --------------------------------------------------------------------------

    async def load(self) -> bool:
        """Load and warm up; never raises (the message goes to `error` and the log)."""
        started = self._clock()
        try:
            try:
                async with asyncio.timeout(self.load_timeout) as deadline:
                    await self._load()
            except TimeoutError:
                if not deadline.expired():  # a TimeoutError of the load's own (ETIMEDOUT)
                    raise
                raise ModelLoadError(
                    f"the engine load did not finish within {self.load_timeout:g} s "
                    f"({self._doing})") from None
        except asyncio.CancelledError:
            self.state = STOPPED
            raise
        except Exception as e:  # every failure keeps the pod alive and not-ready
            self.state = FAILED
            self.error = _describe(e)
            self.failure = e if isinstance(e, samples.WarmupFailed) else None
            log.error("model %s: load failed: %s", self.name, self.error)
            await self._release()
            return False
        self.state = READY
        log.info("model %s: ready in %.3fs (target %s, engine %s; %s)", self.name,
                 self._clock() - started, self.target, self.manifest.key,
                 ", ".join(f"{k} {v:.3f}s" for k, v in self.timings.items()))
        return True

    async def _load(self) -> None:
        from kiln.runtime.engine.backends import GpuOptions, get_backend

        self._doing = "detecting this pod's GPU"
        detected = self._target or await on_daemon_thread("kiln-detect", detect_target)
        self.target, relpath = pick_engine(self.engines, normalize_target(detected))
        entry = os.path.join(self.cache_dir, relpath)
        log.info("model %s: loading engine %s for target %s (this pod: %s)", self.name, entry,
                 self.target, detected)
        self._doing = f"reading {entry}; is the cache volume hung?"
        # isdir runs on the thread too: a stat on a hung volume blocks as a read does.
        engine_bytes, manifest, timings = await on_daemon_thread(
            "kiln-engine-load", self._read, entry)
        self.manifest = manifest
        self._stage("read", timings.read_seconds)
        self._stage("verify", timings.verify_seconds)

        backend = get_backend(manifest.backend, manifest.target,
                              GpuOptions.from_runtime(self.runtime_spec))
        t = self._clock()
        self._doing = f"deserializing the {manifest.backend} engine"
        self.engine = await on_daemon_thread("kiln-engine-deserialize", backend.load,
                                              engine_bytes, manifest.profiles())
        del engine_bytes
        self._stage("deserialize", self._clock() - t)
        sequence_spec = self._sequence_spec()
        self.metrics.model_info.labels(model=self.name, version=self.version,
                                       engine_key=manifest.key, backend=manifest.backend,
                                       target=self.target).set(1)
        if backend.uses_gpu:  # a CPU engine on a GPU node must not scale on that GPU
            self._register_gpu_metrics()

        t = self._clock()
        self._doing = "warming up"
        self.scheduler = self._scheduler_factory(self.engine, self.runtime_spec, self.metrics,
                                                 self.name, manifest.key, self._clock, self.version)
        await self.scheduler.start()
        batching = self.runtime_spec.get("batching") or {}
        max_batch = batching.get("maxBatchSize") if batching.get("enabled", True) else None
        sample = warmup_inputs(list(self.engine.inputs), self.profiles, max_batch)
        outputs = await self.scheduler.submit(sample, shared=False)  # the engine must run
        missing = [o.name for o in self.engine.outputs if o.name not in outputs]
        if missing:
            raise ModelLoadError(f"warm-up returned no {', '.join(missing)}")
        self._stage("warmup", self._clock() - t)
        if sequence_spec is not None:
            self._start_sequences(sequence_spec, manifest.key)
        t, self._doing = self._clock(), "reading and running the warm-up samples; is the model volume hung?"
        if await samples.warm_up(self, self.runtime_spec.get("warmup"), self.samples_file):
            self._stage("samples", self._clock() - t)

    def _sequence_spec(self):
        """spec.runtime.sequences checked against the loaded engine's tensors, or None."""
        from kiln.runtime.engine.states import check_pairs
        from kiln.runtime.serving.sequences import spec as sequences

        try:
            spec = sequences.SequenceSpec.from_runtime(self.runtime_spec)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        if spec is None:
            return None
        problems = check_pairs(spec.states, self._engine_inputs(), self.engine.outputs)
        if problems:
            raise ModelLoadError("; ".join(problems))
        self._state_tensors = spec.state_inputs | spec.state_outputs
        return spec

    def _start_sequences(self, spec, engine_key: str) -> None:
        from kiln.runtime.serving.sequences import manager as sequences, stores
        from kiln.runtime.api.contract import NAMESPACE_ENV

        try:
            store = stores.make_store(spec.store)
        except (ValueError, ImportError) as e:
            raise ModelLoadError(f"sequence store: {e}") from None
        # Not connected yet: a store that is down fails sequence requests (503), never the
        # model's readiness or its stateless requests.
        self.sequences = sequences.SequenceManager(
            spec, self.name, engine_key, self._submit, self._engine_inputs(), self.engine.outputs,
            store=store, namespace=os.environ.get(NAMESPACE_ENV) or None, clock=self._clock,
            initial=getattr(self.engine, "default_values", None))
        self.sequences.start()
        manager = self.sequences
        self.metrics.sequences_live.labels(model=self.name).set_function(
            lambda: manager.live_sequences)
        self.metrics.sequence_state_bytes.labels(model=self.name).set_function(
            lambda: manager.live_bytes)

    def _engine_inputs(self) -> list[TensorSpec]:
        """Every input the engine takes: those it needs, and those it has a default for."""
        return list(self.engine.inputs) + list(getattr(self.engine, "defaults", ()))

    def _read(self, entry: str):
        from kiln.runtime.engine.cache import verify

        if not os.path.isdir(entry):
            raise ModelLoadError(f"engine entry {entry} does not exist: is the cache volume "
                                 f"mounted and the engine built?")
        return (self._reader or verify.read_verified)(entry)

    def _stage(self, stage: str, seconds: float) -> None:
        self.timings[stage] = seconds
        self.metrics.engine_load_seconds.labels(model=self.name, stage=stage).set(seconds)

    def _register_gpu_metrics(self) -> None:
        try:
            from kiln.runtime.engine.gpu import register_gpu_collector
            register_gpu_collector(self.metrics.registry, self.name, self.version)
        except Exception as e:  # metrics are not worth failing the model for
            log.warning("model %s: GPU metrics unavailable: %s", self.name, _describe(e))

    # -- serve -------------------------------------------------------------------------

    async def admit(self) -> None:
        """Wait for a place in a full queue. Not with a result cache: a hit needs no place,
        and a miss is refused by the queue itself."""
        scheduler = self.scheduler
        if scheduler is not None and scheduler.result_cache is None:
            await scheduler.wait_for_room()

    async def infer(self, inputs: dict[str, np.ndarray], parameters: Mapping[str, Any] | None = None,
                    tenant: str = "") -> dict[str, np.ndarray]:
        """Run one request. A stateful model (spec.runtime.sequences) steps the sequence the
        request's `parameters` name (runtime/serving/sequences/manager.py); `tenant` owns it,
        and owns the cached results of a model that keeps them per tenant."""
        if self.sequences is not None:
            return await self.sequences.step(inputs, parameters, tenant)
        from kiln.runtime.serving.sequences.params import names_sequence

        if names_sequence(parameters):
            from kiln.runtime.serving.protocol import bad_request
            raise bad_request(f"model '{self.name}' is not stateful (no spec.runtime.sequences): "
                              f"drop the sequence_id parameter")
        results = await self._submit(inputs, tenant)
        if self.shadow is not None:
            self.shadow.offer(inputs, results)  # a decision and a queue put, never a wait
        return results

    async def _submit(self, inputs: dict[str, np.ndarray], tenant: str = "") -> dict[str, np.ndarray]:
        scheduler = self.scheduler
        if scheduler is None:  # closed after a drain timeout, or never loaded
            from kiln.runtime.serving.scheduling.errors import ShuttingDown
            raise ShuttingDown(1.0, self.status_message())
        return await scheduler.submit(inputs, tenant)

    async def close(self, drain_timeout: float) -> None:
        """Finish what the scheduler holds (up to the timeout), then free the engine."""
        if self.state != FAILED:
            self.state = STOPPED
        started = time.monotonic()
        if self.shadow is not None:
            await self.shadow.close()
        if self.sequences is not None:  # its running steps need the scheduler: close it first
            await self.sequences.close(drain_timeout)  # then it refuses steps (503)
        await self._release(max(0.0, drain_timeout - (time.monotonic() - started)))

    async def _release(self, drain_timeout: float = 0.0) -> None:
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            try:
                await scheduler.close(drain_timeout)
            except Exception as e:
                log.warning("model %s: scheduler close: %s", self.name, _describe(e))
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception as e:
                log.warning("model %s: engine close: %s", self.name, _describe(e))
            if self.state == FAILED:
                self.engine = None  # metadata must not describe an engine that is not served


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    return text if text else type(e).__name__
