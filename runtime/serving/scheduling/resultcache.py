"""An opt-in cache of inference results, for models that see the same inputs again: this
pod's level (the shared level behind it is resultstore.py; resultlevels.py asks both).

Key: the engine key (so a new engine never answers from an old engine's results) plus a
digest of the tenant when the model keeps results per tenant, of the outputs kept ("*":
every output the engine returns, whatever a request asked for, so one entry answers any
choice of outputs) and of the input tensors, canonically (names, dtypes, shapes and
bytes). Bounded in bytes with least-recently-used eviction, and entries expire after a TTL
read from an injected clock. Stored arrays are private read-only copies and every hit
returns fresh copies, so no caller can change what another caller will read.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from kiln.runtime.api.spec import require_keys
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling.resultstore import SharedStoreConfig

MIB = 1 << 20
_KEYS = ("enabled", "maxMiB", "ttlSeconds", "perTenant", "shared")
_REQUIRED = ("enabled", "maxMiB", "ttlSeconds")


@dataclass(frozen=True)
class ResultCacheConfig:
    """`spec.runtime.resultCache`, validated."""

    enabled: bool
    max_bytes: int
    ttl_seconds: float
    shared: SharedStoreConfig | None = None  # the level the replicas share; None: this pod's only
    per_tenant: bool = False  # results kept apart per tenant (sequences.params.tenant_of)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"resultCache.enabled must be true or false, got {self.enabled!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"resultCache.maxMiB must be a positive integer, got {self.max_bytes!r}")
        if isinstance(self.ttl_seconds, bool) or not isinstance(self.ttl_seconds, (int, float)) \
                or self.ttl_seconds <= 0:
            raise ValueError(f"resultCache.ttlSeconds must be > 0, got {self.ttl_seconds!r}")
        if not isinstance(self.per_tenant, bool):
            raise ValueError(f"resultCache.perTenant must be true or false, got {self.per_tenant!r}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> "ResultCacheConfig":
        """From the manifest's `resultCache` map, with the CRD's defaults applied (`kiln
        serve` applies them); a missing key raises ValueError naming it."""
        spec = spec or {}
        if not isinstance(spec, Mapping):
            raise ValueError(f"runtime.resultCache must be a map, got {type(spec).__name__}")
        unknown = set(spec) - set(_KEYS)
        if unknown:
            raise ValueError(f"runtime.resultCache has unknown keys {sorted(unknown)}")
        # perTenant is defaulted by the CRD too, but a spec written before it existed means false.
        require_keys(spec, _REQUIRED, "runtime.resultCache")
        max_mib = spec["maxMiB"]
        if isinstance(max_mib, bool) or not isinstance(max_mib, int) or max_mib < 1:
            raise ValueError(f"resultCache.maxMiB must be a positive integer, got {max_mib!r}")
        return cls(enabled=spec["enabled"], max_bytes=max_mib * MIB, ttl_seconds=spec["ttlSeconds"],
                   shared=SharedStoreConfig.from_spec(spec.get("shared")),
                   per_tenant=spec.get("perTenant", False))


def input_digest(inputs: Mapping[str, np.ndarray]) -> bytes:
    """A canonical digest of the tensors: the same names, dtypes, shapes and bytes give the
    same digest whatever the dict order or memory layout; any difference, another digest."""
    h = hashlib.blake2b(digest_size=32)
    _hash_tensors(h, inputs)
    return h.digest()


# What an entry holds: every output. Part of the digest, so that a future entry holding only
# the requested outputs can never be read as a whole one.
ALL_OUTPUTS = "*"


def request_digest(inputs: Mapping[str, np.ndarray], tenant: str = "") -> bytes:
    """The digest of one request's answer: the tenant ("" when results are shared by every
    tenant), the outputs kept, and the inputs (`input_digest`'s canonical form)."""
    h = hashlib.blake2b(digest_size=32, person=b"kiln-request")
    for field in (tenant.encode(), ALL_OUTPUTS.encode()):
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    _hash_tensors(h, inputs)
    return h.digest()


def _hash_tensors(h: Any, inputs: Mapping[str, np.ndarray]) -> None:
    for name in sorted(inputs):
        a = inputs[name]
        # Length-prefixed fields, so no two different tensor sets hash the same stream.
        for field in (name.encode(), a.dtype.str.encode(), repr(a.shape).encode()):
            h.update(len(field).to_bytes(8, "little"))
            h.update(field)
        data = np.ascontiguousarray(a)
        h.update(data.nbytes.to_bytes(8, "little"))
        h.update(memoryview(data).cast("B"))


@dataclass
class _Entry:
    outputs: dict[str, np.ndarray]
    nbytes: int
    expires: float


class ResultCache:
    def __init__(self, max_bytes: int, ttl_seconds: float, *, metrics: ServerMetrics | None = None,
                 model: str = "", clock: Callable[[], float] = time.monotonic):
        ResultCacheConfig(enabled=True, max_bytes=max_bytes, ttl_seconds=ttl_seconds)  # validates
        self.max_bytes = max_bytes
        self.ttl_seconds = float(ttl_seconds)
        self._clock = clock
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()  # LRU order
        # Insertion order is expiry order (one TTL for all), so expired entries are a prefix.
        self._by_expiry: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._bytes = 0
        if metrics is not None:
            self._hits = metrics.result_cache.labels(model, "hit")
            self._misses = metrics.result_cache.labels(model, "miss")
            self._evictions = metrics.result_cache_evictions.labels(model)
            self._bytes_gauge = metrics.result_cache_bytes.labels(model)
        else:
            self._hits = self._misses = self._evictions = self._bytes_gauge = None

    @staticmethod
    def key(engine_key: str, inputs: Mapping[str, np.ndarray], tenant: str = "") -> tuple[str, bytes]:
        if not isinstance(engine_key, str) or not engine_key:
            raise ValueError("engine_key must be a non-empty string")
        return engine_key, request_digest(inputs, tenant)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, bytes]) -> dict[str, np.ndarray] | None:
        """Copies of the cached outputs, or None (a miss)."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None:
            self._count(self._misses)
            return None
        self._entries.move_to_end(key)
        self._count(self._hits)
        return {name: a.copy() for name, a in entry.outputs.items()}

    def put(self, key: tuple[str, bytes], outputs: Mapping[str, np.ndarray]) -> bool:
        """Store copies of `outputs`; False when they alone exceed the cache's size."""
        nbytes = sum(a.nbytes for a in outputs.values())
        if nbytes > self.max_bytes:
            return False
        self._expire()
        if key in self._entries:
            self._remove(key)
        while self._bytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self._count(self._evictions)
        stored = {}
        for name, a in outputs.items():
            copy = np.array(a, copy=True, order="C")
            copy.flags.writeable = False
            stored[name] = copy
        expires = self._clock() + self.ttl_seconds
        self._entries[key] = _Entry(stored, nbytes, expires)
        self._by_expiry[key] = expires
        self._bytes += nbytes
        self._set_gauge()
        return True

    def _expire(self) -> None:
        now = self._clock()
        while self._by_expiry:
            key, expires = next(iter(self._by_expiry.items()))
            if expires > now:
                break
            self._remove(key)
            self._count(self._evictions)

    def _remove(self, key: tuple[str, bytes]) -> None:
        entry = self._entries.pop(key)
        del self._by_expiry[key]
        self._bytes -= entry.nbytes
        self._set_gauge()

    @staticmethod
    def _count(counter: Any) -> None:
        if counter is not None:
            counter.inc()

    def _set_gauge(self) -> None:
        if self._bytes_gauge is not None:
            self._bytes_gauge.set(self._bytes)
