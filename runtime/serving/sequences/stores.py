"""Where a sequence's state outlives the pod: the `SequenceStore` contract, `RedisStore`
(redis.asyncio; every call bounded by the store's timeout) and `MemoryStore` (the same
contract in this process: tests, benchmarks), and `make_store`, the store a spec names.

Values are `codec.encode_state` blobs; writes are compare-and-set on the blob's token (the
sequence's incarnation and step), so a step that two replicas race on is applied once, and
a write is one Redis command (a Lua script) or one transaction: never half a state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable, Mapping, Protocol

from kiln.runtime.api.contract import SEQUENCE_STORE_PASSWORD_ENV
# StoreUnavailable is part of this module's contract (the manager catches it from here).
from kiln.runtime.serving.redisclient import StoreUnavailable, bounded_call, redis_client  # noqa: F401
from kiln.runtime.serving.sequences.codec import TOKEN_BYTES, TOKEN_OFFSET, token_of
from kiln.runtime.serving.sequences.spec import StoreSpec

log = logging.getLogger(__name__)


class StoreFull(Exception):
    """The store refused a write for lack of memory (Redis `maxmemory` with noeviction)."""


# What a write or a delete found: done, no such key, or another token there.
OK, MISSING, CONFLICT = "ok", "missing", "conflict"


class SequenceStore(Protocol):
    """Where state outlives the pod. Values are `encode_state` blobs; `expect` is the token
    the stored value must have (None: the key must not exist). Every method raises
    StoreUnavailable when the store cannot answer in time."""

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        """Set `value` with a time to live, atomically, if the stored token is `expect`:
        OK, MISSING (expect given, no such key) or CONFLICT (another token, or the key
        exists when expect is None)."""

    async def delete(self, key: str, expect: bytes | None) -> str: ...

    async def close(self) -> None: ...


class MemoryStore:
    """The store contract in this process's memory, expiry by an injected clock: for tests
    and benchmarks (two managers on one MemoryStore are two replicas on one Redis)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._data: dict[str, tuple[bytes, float]] = {}
        self.down = False  # tests: True makes every call fail as a dead store would

    def _live(self, key: str) -> bytes | None:
        if self.down:
            raise StoreUnavailable("the memory store is down (a test said so)")
        item = self._data.get(key)
        if item is None:
            return None
        if self._clock() >= item[1]:
            del self._data[key]
            return None
        return item[0]

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def put(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        current = self._live(key)
        verdict = _compare(current, expect)
        if verdict == OK:
            self._data[key] = (bytes(value), self._clock() + ttl_ms / 1000)
        return verdict

    async def delete(self, key: str, expect: bytes | None) -> str:
        current = self._live(key)
        verdict = OK if expect is None else _compare(current, expect)
        if verdict == OK:
            self._data.pop(key, None)
        return verdict

    async def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._data)


def _compare(current: bytes | None, expect: bytes | None) -> str:
    if expect is None:
        return OK if current is None else CONFLICT
    if current is None:
        return MISSING
    return OK if token_of(current) == expect else CONFLICT


# One round trip each, atomic in Redis: compare the token at its offset, then write.
_PUT_SCRIPT = """
local at = tonumber(ARGV[3])
if ARGV[1] == '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
else
  local cur = redis.call('GETRANGE', KEYS[1], at, at + string.len(ARGV[1]) - 1)
  if cur == '' then return -1 end
  if cur ~= ARGV[1] then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
return 1
"""
_DELETE_SCRIPT = """
if ARGV[1] ~= '' then
  local at = tonumber(ARGV[2])
  local cur = redis.call('GETRANGE', KEYS[1], at, at + string.len(ARGV[1]) - 1)
  if cur == '' then return -1 end
  if cur ~= ARGV[1] then return 0 end
end
redis.call('DEL', KEYS[1])
return 1
"""
_VERDICTS = {1: OK, 0: CONFLICT, -1: MISSING}


# Values above this are written with WATCH + MULTI/EXEC instead of the script: Redis copies a
# script's arguments into Lua and back (a 1 MB write takes 5x a plain SET), a transaction
# does not (2.5x: three round trips instead of one, which is what small values pay).
_SCRIPT_MAX_BYTES = 256 << 10


class RedisStore:
    """Redis through `redis.asyncio`: GET to read; to write, compare the token, then SET with
    PX, atomically (a Lua script, or for large values WATCH + MULTI/EXEC), so a write is whole
    or absent and expiry is Redis's own TTL. No client-side retries: every call is bounded by
    `timeout` and a failure is StoreUnavailable at once (the step is refused as unavailable;
    the client retries, possibly on another replica)."""

    def __init__(self, address: str, *, password: str | None = None, timeout: float = 1.0):
        self.address = address
        self.timeout = timeout
        self._client = redis_client(address, password, timeout)
        self._put = self._client.register_script(_PUT_SCRIPT)
        self._delete = self._client.register_script(_DELETE_SCRIPT)

    async def _call(self, what: str, coro: Awaitable[Any]) -> Any:
        import redis.exceptions as rx

        where = f"the sequence store {self.address}"
        try:
            return await bounded_call(coro, timeout=self.timeout, where=where, what=what,
                                      password_env=SEQUENCE_STORE_PASSWORD_ENV)
        except rx.ResponseError as e:
            if "OOM" in str(e):
                raise StoreFull(f"{where} is out of memory: {e}") from None
            raise StoreUnavailable(f"{where} failed {what}: {e}") from None

    async def get(self, key: str) -> bytes | None:
        return await self._call("a read", self._client.get(key))

    async def put(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        ttl_ms = max(1, int(ttl_ms))
        if len(value) > _SCRIPT_MAX_BYTES:
            return await self._call("a write", self._put_watched(key, value, expect, ttl_ms))
        args = [expect or b"", value, TOKEN_OFFSET, ttl_ms]
        return _VERDICTS[int(await self._call("a write", self._put(keys=[key], args=args)))]

    async def _put_watched(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        import redis.exceptions as rx

        async with self._client.pipeline(transaction=True) as pipe:
            await pipe.watch(key)  # EXEC fails if anything writes the key from here on
            if expect is None:
                if await pipe.exists(key):
                    return CONFLICT
            else:
                current = await pipe.getrange(key, TOKEN_OFFSET, TOKEN_OFFSET + TOKEN_BYTES - 1)
                if not current:
                    return MISSING
                if current != expect:
                    return CONFLICT
            pipe.multi()
            pipe.set(key, value, px=ttl_ms)
            try:
                await pipe.execute()
            except rx.WatchError:
                return CONFLICT
        return OK

    async def delete(self, key: str, expect: bytes | None) -> str:
        args = [expect or b"", TOKEN_OFFSET]
        return _VERDICTS[int(await self._call("a delete", self._delete(keys=[key], args=args)))]

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout)
        except Exception as e:  # noqa: BLE001 - closing a dead connection is not worth failing
            log.debug("closing the sequence store: %s", e)


def make_store(spec: StoreSpec, environ: Mapping[str, str] = os.environ) -> SequenceStore | None:
    """The store a spec names: None for `memory` (the live state is all there is)."""
    if spec.type == "memory":
        return None
    password = environ.get(SEQUENCE_STORE_PASSWORD_ENV) or None
    if spec.password_required and password is None:
        raise ValueError(f"spec.runtime.sequences.store.passwordSecretRef is set but "
                         f"{SEQUENCE_STORE_PASSWORD_ENV} is not in the environment")
    return RedisStore(spec.address or "", password=password, timeout=spec.timeout)

