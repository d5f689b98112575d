"""A request's way through the result cache's levels: the pod's memory, then the store the
replicas share (when `resultCache.shared` is set), then the engine.

- Memory (`ResultCache`) first; a hit costs no store call.
- Identical concurrent misses in this pod coalesce: the first computes (or reads the store),
  the others wait for its answer (a future per key) and get their own copies.
- The shared store: one round trip reads the value or claims the key (SET NX PX); a claim
  taken by another replica means it computes, so this one polls for its answer with a short
  backoff for up to `waitMilliseconds`, then computes itself. A value that fails its checks
  (resultcodec) is a miss. A shared hit fills memory.
- The engine's answer goes to memory and, when small enough, to the store (under the
  model's total bound, with the TTL).
- Degrading: every store call is bounded by the timeout; a failure opens a circuit (the
  store is skipped for a few seconds, by the injected clock), so a dead or hanging store
  costs one request its timeout, never an error to anyone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Awaitable, Callable, Mapping, Sequence

import numpy as np

from kiln.runtime.api.contract import NAMESPACE_ENV
from kiln.runtime.engine.backends.base import DATATYPES, TensorSpec
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling import resultcodec
from kiln.runtime.serving.scheduling.resultcache import ResultCache, ResultCacheConfig
from kiln.runtime.serving.scheduling.resultstore import (Circuit, RedisResultStore, SharedStoreConfig,
                                                        StoreUnavailable, key_prefix, lock_milliseconds)

Outputs = dict[str, np.ndarray]
Key = tuple[str, bytes]
_FIRST_POLL, _MOST_POLL = 0.002, 0.025  # seconds between polls for another replica's answer
_RETRY = object()  # a coalesced computation ended without an answer (cancelled): try again


def result_levels(config: ResultCacheConfig, metrics: ServerMetrics, model: str,
                  clock: Callable[[], float], environ: Mapping[str, str],
                  outputs: Sequence[TensorSpec] | None = None) -> "ResultLevels | None":
    """A model's result cache as configured: None when off; else the pod's memory, and the
    shared store when set (its keys under the pod's namespace and the model; its password
    from `environ`; not connected until the first request). `outputs`: the engine's output
    names and dtypes, which a stored value must have to be used."""
    if not config.enabled:
        return None
    memory = ResultCache(config.max_bytes, config.ttl_seconds, metrics=metrics, model=model, clock=clock)
    if config.shared is None:
        return ResultLevels(memory, metrics, model, per_tenant=config.per_tenant)
    namespace = environ.get(NAMESPACE_ENV) or "default"  # outside a cluster (kiln dev)
    store = RedisResultStore(config.shared.address, key_prefix(namespace, model),
                             password=config.shared.password(environ), timeout=config.shared.timeout)
    return ResultLevels(memory, metrics, model, store=store, shared=config.shared, clock=clock,
                        per_tenant=config.per_tenant,
                        outputs={o.name: DATATYPES[o.datatype] for o in outputs or ()} or None)


@dataclasses.dataclass(eq=False)
class _Flight:
    future: asyncio.Future
    waiters: int = 0


class ResultLevels:
    """The levels of one model's result cache. `store` None: memory only, as before issue 23."""

    def __init__(self, memory: ResultCache, metrics: ServerMetrics, model: str, *,
                 store: RedisResultStore | None = None, shared: SharedStoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, per_tenant: bool = False,
                 outputs: Mapping[str, np.dtype] | None = None):
        if (store is None) != (shared is None):
            raise ValueError("a shared store needs its config, and the config its store")
        self.memory = memory
        self.per_tenant = per_tenant
        self.outputs = dict(outputs) if outputs is not None else None
        self.store = store
        self.shared = shared
        self._ttl_ms = int(memory.ttl_seconds * 1000)
        self._flights: dict[Key, _Flight] = {}
        self._coalesced = metrics.result_cache_coalesced.labels(model)
        if store is not None:
            available = metrics.result_cache_shared_available.labels(model)
            available.set(1)
            self.circuit = Circuit(f"model {model}: the shared result store {store.address}",
                                   clock, on_change=lambda up: available.set(1 if up else 0))
            self._lookups = {r: metrics.result_cache_shared.labels(model, r)
                             for r in ("hit", "miss", "corrupt", "unavailable", "waited")}
            self._writes = {r: metrics.result_cache_shared_writes.labels(model, r)
                            for r in ("stored", "too_large", "failed")}
            self._written_bytes = metrics.result_cache_shared_written_bytes.labels(model)
            self._evictions = metrics.result_cache_shared_evictions.labels(model)

    def key(self, engine_key: str, inputs: Mapping[str, np.ndarray], tenant: str) -> Key:
        """The key of a request's answer: the tenant's own only when results are per tenant."""
        return ResultCache.key(engine_key, inputs, tenant if self.per_tenant else "")

    async def answer(self, key: Key, compute: Callable[[], Awaitable[Outputs]],
                     shared: bool = True) -> Outputs:
        """The outputs for `key`: from memory, a computation of the same key already running
        here, the shared store (unless `shared` is False: the warm-up must run the engine),
        or `compute()`."""
        hit = self.memory.get(key)
        if hit is not None:
            return hit
        while (flight := self._flights.get(key)) is not None:
            flight.waiters += 1
            try:
                answer = await asyncio.shield(flight.future)
            finally:
                flight.waiters -= 1
            if answer is not _RETRY:
                self._coalesced.inc()
                return {name: a.copy() for name, a in answer.items()}
        flight = _Flight(asyncio.get_running_loop().create_future())
        self._flights[key] = flight
        try:
            outputs = await self._fill(key, compute, shared)
        except BaseException as e:
            if flight.waiters and not isinstance(e, asyncio.CancelledError):
                flight.future.set_exception(e)  # the same inputs would fail the same way
            else:
                flight.future.set_result(_RETRY)
            raise
        finally:
            del self._flights[key]
        # The waiters' copy is made before the caller can change what it got.
        flight.future.set_result({n: a.copy() for n, a in outputs.items()} if flight.waiters
                                 else _RETRY)
        return outputs

    async def _fill(self, key: Key, compute: Callable[[], Awaitable[Outputs]],
                    shared: bool) -> Outputs:
        store = self.store if shared else None
        if store is None:
            return self._remember(key, await compute())
        if not self.circuit.allows():
            self._lookups["unavailable"].inc()
            return self._remember(key, await compute())
        name = store.value_key(*key)
        try:
            value, claimed = await store.lookup(name, lock_milliseconds(self.shared.wait))
        except StoreUnavailable as e:
            self.circuit.failed(e)
            self._lookups["unavailable"].inc()
            return self._remember(key, await compute())
        self.circuit.succeeded()
        result = "miss"
        if value is not None:
            found = self._decode(name, value)
            if found is not None:
                self._lookups["hit"].inc()
                return self._remember(key, found)
            result = "corrupt"
        elif not claimed:  # another replica computes it: wait a little for its answer
            found, result = await self._wait_for(store, name)
            if found is not None:
                self._lookups["waited"].inc()
                return self._remember(key, found)
        self._lookups[result].inc()
        outputs = self._remember(key, await compute())
        await self._offer(store, name, outputs)
        return outputs

    async def _wait_for(self, store: RedisResultStore, name: str) -> tuple[Outputs | None, str]:
        """Poll for another replica's answer for up to `waitMilliseconds`: (the outputs, or
        None and why: miss, corrupt or unavailable)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shared.wait
        pause = _FIRST_POLL
        while (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, _MOST_POLL)
            try:
                value = await store.get(name)
            except StoreUnavailable as e:
                self.circuit.failed(e)
                return None, "unavailable"
            if value is not None:
                found = self._decode(name, value)
                return found, "corrupt" if found is None else "waited"
        return None, "miss"

    def _decode(self, name: str, value: bytes) -> Outputs | None:
        """A stored value's outputs, or None: digest or framing wrong, or not the outputs this
        engine gives (a name missing or extra, another dtype): a value written by something
        else under the key must never be served, nor kept."""
        found = resultcodec.decode(name.encode(), value)
        if found is None or self.outputs is None:
            return found
        if {n: a.dtype for n, a in found.items()} != self.outputs:
            return None
        return found

    async def _offer(self, store: RedisResultStore, name: str, outputs: Outputs) -> None:
        value = resultcodec.encode(name.encode(), outputs, self.shared.max_entry_bytes)
        if value is None:
            self._writes["too_large"].inc()
            return
        if not self.circuit.allows():
            self._writes["failed"].inc()
            return
        try:
            evicted = await store.put(name, value, self._ttl_ms, self.shared.max_bytes)
        except StoreUnavailable as e:
            self.circuit.failed(e)
            self._writes["failed"].inc()
            return
        self.circuit.succeeded()
        if evicted < 0:
            self._writes["too_large"].inc()
            return
        self._writes["stored"].inc()
        self._written_bytes.inc(len(value))
        if evicted:
            self._evictions.inc(evicted)

    def _remember(self, key: Key, outputs: Outputs) -> Outputs:
        self.memory.put(key, outputs)
        return outputs

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
