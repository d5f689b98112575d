"""The shared level of the result cache: `resultCache.shared` parsed (`SharedStoreConfig`),
the Redis that holds the entries (`RedisResultStore`), and the circuit that keeps a dead
store from adding its timeout to every request (`Circuit`).

Keys: every key of one model carries the hash tag `{<namespace>/<model>}`, so a model's
entries, lock keys and index live in one Redis Cluster slot and one script may touch them
all. `<prefix>v:<engine key>:<digest>` holds a value (resultcodec), `<prefix>l:...` the
lock of the replica computing it, and three keys account the model's bytes:
`<prefix>idx` (a ZSET of value keys scored by their expiry time, so the oldest are first),
`<prefix>sz` (each one's size) and `<prefix>bytes` (their sum).

Every call is bounded by the store's timeout and fails as StoreUnavailable; no retries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Any, Awaitable, Callable, Mapping

from kiln.runtime.api.contract import RESULT_STORE_PASSWORD_ENV
from kiln.runtime.serving.redisclient import StoreUnavailable, bounded_call, redis_client

log = logging.getLogger("kiln.runtime.serving.resultstore")

KIB, MIB = 1 << 10, 1 << 20
_WHERE = "runtime.resultCache.shared"
_KEYS = ("address", "passwordSecretRef", "timeoutMilliseconds", "maxEntryKiB", "maxMiB",
         "waitMilliseconds")


@dataclasses.dataclass(frozen=True)
class SharedStoreConfig:
    """`spec.runtime.resultCache.shared`, validated (the CRD's defaults applied)."""

    address: str
    timeout: float  # seconds, every store call's bound
    max_entry_bytes: int  # a larger result stays in the pod's memory only
    max_bytes: int  # the model's entries in the store, in all
    wait: float  # seconds a replica waits for another's answer to the same key
    password_required: bool = False  # passwordSecretRef is set: the env variable must be

    @classmethod
    def from_spec(cls, spec: Any) -> "SharedStoreConfig | None":
        if spec is None:
            return None
        if not isinstance(spec, Mapping):
            raise ValueError(f"{_WHERE} must be a map, got {type(spec).__name__}")
        unknown = set(spec) - set(_KEYS)
        if unknown:
            raise ValueError(f"{_WHERE} has unknown keys {sorted(unknown)}")
        address = spec.get("address")
        if not isinstance(address, str) or not address.strip():
            raise ValueError(f"{_WHERE}.address is required (host:port, or a redis:// or "
                             f"rediss:// URL)")
        ref = spec.get("passwordSecretRef")
        if ref is not None and not (isinstance(ref, Mapping) and ref.get("name") and ref.get("key")):
            raise ValueError(f"{_WHERE}.passwordSecretRef must be {{name, key}}")
        config = cls(address=address.strip(),
                     timeout=_integer(spec, "timeoutMilliseconds", 1, 60_000) / 1000,
                     max_entry_bytes=_integer(spec, "maxEntryKiB", 1, 1 << 20) * KIB,
                     max_bytes=_integer(spec, "maxMiB", 1, 1 << 20) * MIB,
                     wait=_integer(spec, "waitMilliseconds", 0, 60_000) / 1000,
                     password_required=ref is not None)
        if config.max_entry_bytes > config.max_bytes:
            raise ValueError(f"{_WHERE}: maxEntryKiB must be <= maxMiB x 1024")
        return config

    def password(self, environ: Mapping[str, str]) -> str | None:
        """The store's password from the environment; ValueError when the spec names a
        Secret and the operator did not pass it."""
        password = environ.get(RESULT_STORE_PASSWORD_ENV) or None
        if self.password_required and password is None:
            raise ValueError(f"{_WHERE}.passwordSecretRef is set but {RESULT_STORE_PASSWORD_ENV} "
                             f"is not in the environment")
        return password


def _integer(spec: Mapping[str, Any], name: str, least: int, most: int) -> int:
    value = spec.get(name)
    if value is None:
        raise ValueError(f"{_WHERE}.{name} is missing (the CRD defaults it: apply the CRD's "
                         f"defaults to spec.runtime first, as kiln serve does)")
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValueError(f"{_WHERE}.{name} must be an integer from {least} to {most}, got {value!r}")
    return value


def key_prefix(namespace: str, model: str) -> str:
    """The start of every key of one model: its namespace and name as a Redis hash tag."""
    return f"kiln:rc:{{{namespace}/{model}}}:"


class Circuit:
    """Whether to ask the store now: after a failure, not for `open_seconds` (by the injected
    clock), then one request probes it while the others still skip it. Logs each change of
    state once, never per request."""

    def __init__(self, where: str, clock: Callable[[], float], open_seconds: float = 3.0,
                 on_change: Callable[[bool], None] | None = None):
        self.where = where
        self.open_seconds = open_seconds
        self._clock = clock
        self._on_change = on_change
        self.up = True
        self._retry_at = 0.0

    def allows(self) -> bool:
        if self.up:
            return True
        now = self._clock()
        if now < self._retry_at:
            return False
        self._retry_at = now + self.open_seconds  # this request probes; the rest skip it
        return True

    def failed(self, error: Exception) -> None:
        self._retry_at = self._clock() + self.open_seconds
        if self.up:
            self.up = False
            log.warning("%s: %s; caching in this pod's memory only, retrying the store every "
                        "%g s", self.where, error, self.open_seconds)
            self._changed()

    def succeeded(self) -> None:
        if not self.up:
            self.up = True
            log.info("%s: the shared result store answers again", self.where)
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.up)


# One round trip for a lookup: the value, else try to become the replica that computes it.
_LOOKUP = """
local v = redis.call('GET', KEYS[1])
if v then return {1, v} end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return {0, 1} end
return {0, 0}
"""

# Add one entry and keep the model's total under the bound, atomically: drop the index
# members that expired (their values are gone by Redis's own TTL), replace an older value of
# the same key, evict the oldest until the entry fits, then write it and release the lock.
_PUT = """
local size, ttl, most = string.len(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local idx, sizes, total = KEYS[3], KEYS[4], KEYS[5]
if size > most then return -1 end
local function forget(member)
  local s = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('HDEL', sizes, member)
  redis.call('ZREM', idx, member)
  if s > 0 then redis.call('DECRBY', total, s) end
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', idx, '-inf', now, 'LIMIT', 0, 1000)) do
  forget(m)
end
if redis.call('HEXISTS', sizes, KEYS[1]) == 1 then forget(KEYS[1]) end
local evicted = 0
while tonumber(redis.call('GET', total) or '0') + size > most do
  local oldest = redis.call('ZRANGE', idx, 0, 0)[1]
  if not oldest then break end
  forget(oldest)
  redis.call('DEL', oldest)
  evicted = evicted + 1
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', idx, now + ttl, KEYS[1])
redis.call('HSET', sizes, KEYS[1], size)
redis.call('INCRBY', total, size)
-- The index lives as long as its longest-lived entry (replicas may differ in ttlSeconds).
for _, k in ipairs({idx, sizes, total}) do
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
redis.call('DEL', KEYS[2])
return evicted
"""


class RedisResultStore:
    """One model's shared entries in Redis (redis.asyncio). `lookup` is one round trip (the
    value, or the lock to compute it), `get` polls a value, `put` adds one under the bound."""

    def __init__(self, address: str, prefix: str, *, password: str | None = None,
                 timeout: float = 0.05):
        self.address = address
        self.prefix = prefix
        self.timeout = timeout
        self._client = redis_client(address, password, timeout)
        self._lookup = self._client.register_script(_LOOKUP)
        self._put = self._client.register_script(_PUT)

    def value_key(self, engine_key: str, digest: bytes) -> str:
        return f"{self.prefix}v:{engine_key}:{digest.hex()}"

    def _lock_key(self, value_key: str) -> str:
        return f"{self.prefix}l:{value_key[len(self.prefix) + 2:]}"

    @property
    def _index_keys(self) -> list[str]:
        return [f"{self.prefix}idx", f"{self.prefix}sz", f"{self.prefix}bytes"]

    async def lookup(self, key: str, lock_ms: int) -> tuple[bytes | None, bool]:
        """(the value, None when absent; whether this caller now holds the key's lock)."""
        found, item = await self._call("a lookup", self._lookup(
            keys=[key, self._lock_key(key)], args=[max(1, int(lock_ms))]))
        return (item, False) if int(found) else (None, bool(int(item)))

    async def get(self, key: str) -> bytes | None:
        return await self._call("a read", self._client.get(key))

    async def put(self, key: str, value: bytes, ttl_ms: int, max_bytes: int) -> int:
        """Store `value` under `key` for `ttl_ms`: the number of older entries evicted to keep
        the model under `max_bytes` (-1: the value alone is larger)."""
        return int(await self._call("a write", self._put(
            keys=[key, self._lock_key(key), *self._index_keys],
            args=[value, max(1, int(ttl_ms)), max_bytes])))

    async def _call(self, what: str, coro: Awaitable[Any]) -> Any:
        import redis.exceptions as rx

        where = f"the shared result store {self.address}"
        try:
            return await bounded_call(coro, timeout=self.timeout, where=where, what=what,
                                      password_env=RESULT_STORE_PASSWORD_ENV)
        except rx.RedisError as e:  # OOM, NOAUTH, a script refused: all a miss, never an error
            raise StoreUnavailable(f"{where} failed {what}: {e}") from None

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), max(self.timeout, 0.5))
        except Exception as e:  # noqa: BLE001 - closing a dead connection is not worth failing
            log.debug("closing the shared result store: %s", e)


def lock_milliseconds(wait: float) -> int:
    """How long a replica's claim to compute a key lasts: twice what the others wait for it,
    so a replica that arrives while the first still computes waits too; a claim whose holder
    died ends on its own."""
    return max(1, math.ceil(2 * wait * 1000))
