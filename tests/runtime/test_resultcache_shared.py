"""The result cache's shared level on a real redis-server: schedulers sharing one Redis are
replicas. Lookup order (memory, the store, the engine), keys that keep engines and tenants
apart, values that are checked before they answer, bounds inside Redis, single flight, and a
store that is dead or hangs costing at most its timeout, never an error."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest

from kiln.runtime.api.spec import runtime_with_defaults, validate
from kiln.runtime.engine.backends import get_backend
from kiln.runtime.engine.backends.base import BuildOptions
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling import resultcodec
from kiln.runtime.serving.scheduling.resultcache import ResultCache, ResultCacheConfig
from kiln.runtime.serving.scheduling.resultstore import (MIB, RedisResultStore, SharedStoreConfig,
                                                        key_prefix)
from kiln.runtime.serving.scheduling.scheduler import Scheduler

from support.sequence_models import RedisServer, redis_server_binary
from support.serving import neg_model

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")

WIDTH = 64  # y = -x, [N, 64] float32: 256 bytes a row


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine_bytes():
    backend = get_backend("onnxruntime")
    return backend.build(neg_model(WIDTH), BuildOptions())


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server):
    if redis_server.proc is None:
        redis_server.start()
    redis_server.command("FLUSHALL")
    return redis_server


def x(seed: int, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)}


class Replica:
    """One Scheduler, as one pod of the model runs it, with its own metrics."""

    def __init__(self, engine_bytes, shared: dict | None, *, key: str = "key-a", clock=None,
                 per_tenant: bool = False, environ=None):
        backend = get_backend("onnxruntime")
        self.metrics = ServerMetrics()
        cache = {"enabled": True, "ttlSeconds": 60, "perTenant": per_tenant}
        if shared is not None:
            cache["shared"] = shared
        spec = runtime_with_defaults({"contextsPerGPU": 1, "resultCache": cache})
        self.scheduler = Scheduler(backend.load(engine_bytes, {}), spec, self.metrics, "neg", key,
                                   clock=clock or Clock(), environ=environ or {"KILN_NAMESPACE": "ns"})

    async def __aenter__(self) -> "Replica":
        await self.scheduler.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.scheduler.close(5)

    def runs(self) -> float:
        return self.sample("kiln_executions_total", outcome="success")

    def shared(self, result: str) -> float:
        return self.sample("kiln_result_cache_shared_requests_total", result=result)

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, {"model": "neg", **labels}) or 0.0


def keys(redis: RedisServer, pattern: str = "*") -> list[bytes]:
    raw = redis.command("KEYS", pattern)
    return [line for line in raw.split(b"\r\n") if line.startswith(b"kiln:")]


# -- the value's format --------------------------------------------------------------------

def test_a_value_answers_only_for_its_own_key_and_only_whole():
    outputs = {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([1, 2], ">i8"),
               "empty": np.zeros((0, 4), np.uint8), "flag": np.array(True)}
    value = resultcodec.encode(b"k", outputs, 1 << 20)
    got = resultcodec.decode(b"k", value)
    assert set(got) == set(outputs) and all(got[n].flags.writeable for n in got)
    for name, want in outputs.items():
        np.testing.assert_array_equal(got[name], want)
        assert got[name].dtype == want.dtype.newbyteorder("=") and got[name].shape == want.shape
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert resultcodec.decode(b"k", bytes(flipped)) is None  # corrupted
    assert resultcodec.decode(b"k", value[:-1]) is None  # cut short
    assert resultcodec.decode(b"other", value) is None  # copied under another key
    assert resultcodec.decode(b"k", b"") is None and resultcodec.decode(b"k", None) is None
    assert resultcodec.encode(b"k", {"s": np.array(["a"], dtype=object)}, 1 << 20) is None
    assert resultcodec.encode(b"k", outputs, 64) is None  # over the entry bound


@pytest.mark.parametrize("payload", [
    b"\x01\x00" + b"\x01\x00y" + bytes([99, 1]) + (1).to_bytes(8, "little") + b"\0" * 4,  # dtype
    b"\x01\x00" + b"\x01\x00y" + bytes([10, 9]) + b"\0" * 80,  # rank above the bound
    b"\x01\x00" + b"\x01\x00y" + bytes([10, 1]) + (2).to_bytes(8, "little") + b"\0" * 4,  # short
    b"\x01\x00" + b"\x01\x00y" + bytes([10, 1]) + (1).to_bytes(8, "little") + b"\0" * 5,  # long
    b"\x01\x00" + b"\x01\x00y" + bytes([10, 1]) + (1 << 62).to_bytes(8, "little"),  # huge
    b"\x02\x00" + (b"\x01\x00y" + bytes([10, 0]) + b"\0" * 4) * 2,  # a name twice
    b"\x01\x00" + b"\x02\x00\xff\xfe" + bytes([10, 0]) + b"\0" * 4,  # not UTF-8
])
def test_a_well_signed_value_that_does_not_add_up_is_a_miss(payload):
    # The digest is right (anyone can compute it): the strict parse is what refuses these.
    value = resultcodec.MAGIC + resultcodec._digest(b"k", payload) + payload
    assert resultcodec.decode(b"k", value) is None


# -- configuration --------------------------------------------------------------------------

def cache_spec(result_cache: dict) -> dict:
    return runtime_with_defaults({"resultCache": result_cache})["resultCache"]


def test_shared_config_defaults_and_refusals():
    config = ResultCacheConfig.from_spec(cache_spec({"enabled": True, "shared": {"address": "r:6379"}}))
    assert config.shared == SharedStoreConfig("r:6379", 0.05, 1024 << 10, 1024 * MIB, 0.2)
    assert config.per_tenant is False
    assert ResultCacheConfig.from_spec(cache_spec({})).shared is None
    for shared, message in [({}, r"shared\.address is required"),
                            ({"address": "r", "maxEntryKiB": 2048, "maxMiB": 1}, "maxEntryKiB must be <="),
                            ({"address": "r", "waitMs": 1}, r"unknown keys \['waitMs'\]"),
                            ({"address": "r", "timeoutMilliseconds": 0}, "from 1 to 60000, got 0")]:
        with pytest.raises(ValueError, match=message):
            ResultCacheConfig.from_spec(cache_spec({"shared": shared}))
    secret = SharedStoreConfig.from_spec(cache_spec({"shared": {
        "address": "r", "passwordSecretRef": {"name": "s", "key": "p"}}})["shared"])
    with pytest.raises(ValueError, match="KILN_RESULT_STORE_PASSWORD is not in the environment"):
        secret.password({})
    assert secret.password({"KILN_RESULT_STORE_PASSWORD": "pw"}) == "pw"


def test_the_crd_refuses_an_entry_bound_above_the_total():
    model = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
             "metadata": {"name": "m", "namespace": "default"},
             "spec": {"model": {"uri": "pvc://models/m.onnx", "version": "v1"},
                      "engine": {"backend": "onnxruntime"},
                      "runtime": {"resultCache": {"enabled": True, "perTenant": True,
                                                  "shared": {"address": "redis:6379"}}}}}
    assert validate(model) == []
    model["spec"]["runtime"]["resultCache"]["shared"].update(maxEntryKiB=4096, maxMiB=1)
    assert validate(model) == ["spec.runtime.resultCache.shared: Invalid value: "
                               "maxEntryKiB must be <= maxMiB * 1024"]
    model["spec"]["runtime"]["resultCache"]["shared"] = {"address": "redis://:pw@redis"}
    assert any("address" in m for m in validate(model))


# -- lookup order, keys ---------------------------------------------------------------------

async def test_memory_then_the_store_then_the_engine(engine_bytes, redis):
    shared = {"address": redis.address}
    async with Replica(engine_bytes, shared) as a, Replica(engine_bytes, shared) as b:
        first = await a.scheduler.submit(x(1))
        np.testing.assert_array_equal(first["y"], -x(1)["x"])
        assert (a.runs(), a.shared("miss")) == (1, 1)
        await a.scheduler.submit(x(1))  # memory: no store call
        assert (a.runs(), a.shared("miss") + a.shared("hit")) == (1, 1)
        # Another replica never runs the engine for a key the first computed...
        got = await b.scheduler.submit(x(1))
        np.testing.assert_array_equal(got["y"], -x(1)["x"])
        assert (b.runs(), b.shared("hit")) == (0, 1)
        # ...and the shared hit filled its memory.
        await b.scheduler.submit(x(1))
        assert b.shared("hit") == 1
        assert b.sample("kiln_result_cache_requests_total", result="hit") == 1
        assert a.sample("kiln_result_cache_shared_written_bytes_total") > 256
        [value_key] = keys(redis, "*:v:*")
        assert value_key.startswith(key_prefix("ns", "neg").encode())


async def test_a_canary_never_reads_the_stable_versions_answers(engine_bytes, redis):
    shared = {"address": redis.address}
    async with Replica(engine_bytes, shared, key="key-stable") as stable, \
            Replica(engine_bytes, shared, key="key-canary") as canary:
        await stable.scheduler.submit(x(2))
        await canary.scheduler.submit(x(2))
        await stable.scheduler.submit(x(3))
        assert (stable.runs(), canary.runs(), canary.shared("hit")) == (2, 1, 0)
        assert len(keys(redis, "*:v:*")) == 3


async def test_results_per_tenant_are_kept_apart(engine_bytes, redis):
    shared = {"address": redis.address}
    async with Replica(engine_bytes, shared, per_tenant=True) as a, \
            Replica(engine_bytes, shared, per_tenant=True) as b:
        await a.scheduler.submit(x(4), "h:alice")
        await b.scheduler.submit(x(4), "h:bob")  # another tenant: computed again
        await b.scheduler.submit(x(4), "h:alice")  # alice's answer, from the store
        assert (a.runs(), b.runs(), b.shared("hit")) == (1, 1, 1)
    async with Replica(engine_bytes, shared) as c:  # not per tenant: one answer for everyone
        await c.scheduler.submit(x(5), "h:alice")
        await c.scheduler.submit(x(5), "h:bob")
        assert c.runs() == 1


async def test_a_corrupted_or_foreign_value_is_a_miss_never_an_answer(engine_bytes, redis):
    # A lookup that times out is a miss too, but not the one counted here: time enough on a busy machine.
    shared = {"address": redis.address, "timeoutMilliseconds": 2000}
    async with Replica(engine_bytes, shared) as a:
        await a.scheduler.submit(x(6))
        await a.scheduler.submit(x(7))
    [k6, k7] = sorted(keys(redis, "*:v:*"))
    store = RedisResultStore(redis.address, key_prefix("ns", "neg"))
    try:
        value6 = await store.get(k6.decode())
        value7 = await store.get(k7.decode())
        corrupted = bytearray(value6)
        corrupted[-3] ^= 0xFF
        await store._client.set(k6, bytes(corrupted))
        await store._client.set(k7, value6)  # a whole, valid value of another key
    finally:
        await store.close()
    assert value7 != value6
    async with Replica(engine_bytes, shared) as b:
        for seed in (6, 7):
            got = await b.scheduler.submit(x(seed))
            np.testing.assert_array_equal(got["y"], -x(seed)["x"])  # the engine's, not the store's
        assert (b.runs(), b.shared("corrupt"), b.shared("hit")) == (2, 2, 0)


@pytest.mark.parametrize("stored", [
    {"z": -np.ones((1, WIDTH), np.float32)},  # another output's name: the engine's "y" lacking
    {"y": -np.ones((1, WIDTH), np.float64)},  # the right name, another dtype
    {"y": -np.ones((1, WIDTH), np.float32), "z": np.ones(1, np.float32)},  # one output too many
], ids=["output missing", "other dtype", "output extra"])
async def test_a_well_signed_value_that_is_not_this_engines_outputs_is_corrupt_never_a_5xx(
        engine_bytes, redis, stored):
    shared = {"address": redis.address, "timeoutMilliseconds": 2000}
    async with Replica(engine_bytes, shared) as a:
        await a.scheduler.submit(x(8))
    [k8] = keys(redis, "*:v:*")
    store = RedisResultStore(redis.address, key_prefix("ns", "neg"))
    try:  # written under the key with its own digest, as a foreign writer would
        await store._client.set(k8, resultcodec.encode(k8, stored, 1 << 20))
    finally:
        await store.close()
    async with Replica(engine_bytes, shared) as b:
        for _ in range(2):  # never kept in the pod's memory either
            got = await b.scheduler.submit(x(8))
            np.testing.assert_array_equal(got["y"], -x(8)["x"])
            assert set(got) == {"y"}
        assert (b.runs(), b.shared("corrupt"), b.shared("hit")) == (1, 1, 0)


# -- bounds ---------------------------------------------------------------------------------

async def test_a_result_above_the_entry_bound_stays_in_the_pod(engine_bytes, redis):
    async with Replica(engine_bytes, {"address": redis.address, "maxEntryKiB": 1}) as a:
        await a.scheduler.submit(x(8, rows=8))  # 2 KiB of outputs
        await a.scheduler.submit(x(8, rows=8))
        assert a.runs() == 1  # from memory
        assert a.sample("kiln_result_cache_shared_writes_total", result="too_large") == 1
        assert keys(redis, "*:v:*") == []


async def test_the_models_total_is_a_bound_inside_redis(redis):
    store = RedisResultStore(redis.address, key_prefix("ns", "big"), timeout=1.0)
    try:
        entry = 200 * 1024
        names = [store.value_key("key-a", bytes([i]) * 32) for i in range(12)]
        evicted = [await store.put(n, bytes([i]) * entry, 60_000, 1 * MIB) for i, n in enumerate(names)]
        assert sum(evicted) == 12 - 5  # 5 entries of 200 KiB fit in 1 MiB
        total = int(await store._client.get(f"{store.prefix}bytes"))
        sizes = [await store._client.strlen(n) for n in names]
        assert total == sum(sizes) == 5 * entry
        assert [bool(s) for s in sizes] == [False] * 7 + [True] * 5  # the oldest went first
        assert await store._client.zcard(f"{store.prefix}idx") == 5
        assert await store.put(store.value_key("k", b"x" * 32), b"x" * (2 * MIB), 60_000, MIB) == -1
        # Writing a key again replaces its bytes, never counts them twice.
        await store.put(names[-1], b"y" * 10, 60_000, 1 * MIB)
        assert int(await store._client.get(f"{store.prefix}bytes")) == 4 * entry + 10
    finally:
        await store.close()


async def test_entries_expire_by_redis_ttl_and_leave_the_index(redis):
    store = RedisResultStore(redis.address, key_prefix("ns", "ttl"), timeout=1.0)
    try:
        old = store.value_key("key-a", b"o" * 32)
        await store.put(old, b"v" * 100, 100, MIB)
        assert 0 < await store._client.pttl(old) <= 100
        await asyncio.sleep(0.15)
        assert await store.get(old) is None  # Redis's own expiry
        await store.put(store.value_key("key-a", b"n" * 32), b"w" * 10, 60_000, MIB)
        assert await store._client.zcard(f"{store.prefix}idx") == 1
        assert int(await store._client.get(f"{store.prefix}bytes")) == 10
        # A shorter TTL (another replica's setting) never cuts the index's life short.
        await store.put(store.value_key("key-a", b"s" * 32), b"s" * 10, 100, MIB)
        assert await store._client.pttl(f"{store.prefix}idx") > 59_000
    finally:
        await store.close()


# -- single flight ----------------------------------------------------------------------------

async def test_concurrent_misses_across_two_replicas_run_the_engine_once(engine_bytes, redis):
    shared = {"address": redis.address, "waitMilliseconds": 2000}
    async with Replica(engine_bytes, shared) as a, Replica(engine_bytes, shared) as b:
        requests = [r.scheduler.submit(x(9)) for r in (a, b) for _ in range(8)]
        answers = await asyncio.gather(*requests)
        for got in answers:
            np.testing.assert_array_equal(got["y"], -x(9)["x"])
        assert a.runs() + b.runs() == 1
        waiting = a if a.runs() == 0 else b
        assert waiting.shared("waited") + waiting.shared("hit") == 1
        assert a.sample("kiln_result_cache_coalesced_total") + b.sample(
            "kiln_result_cache_coalesced_total") == 14


async def test_a_replica_waits_for_another_only_so_long(engine_bytes, redis):
    shared = {"address": redis.address, "waitMilliseconds": 50}
    async with Replica(engine_bytes, shared) as a:
        store = a.scheduler.results.store
        name = store.value_key(*ResultCache.key("key-a", x(10)))
        assert await store.lookup(name, 10_000) == (None, True)  # "another replica" claims it
        started = time.monotonic()
        await a.scheduler.submit(x(10))
        assert 0.05 <= time.monotonic() - started < 1.0
        assert (a.runs(), a.shared("miss")) == (1, 1)


# -- degrading ------------------------------------------------------------------------------

async def test_a_killed_store_degrades_to_the_pods_cache_and_comes_back(engine_bytes, redis, caplog):
    clock = Clock()
    async with Replica(engine_bytes, {"address": redis.address}, clock=clock) as a:
        await a.scheduler.submit(x(11))
        redis.stop()
        for seed in (12, 13, 14, 11):
            started = time.monotonic()
            got = await a.scheduler.submit(x(seed))
            assert time.monotonic() - started < 0.5
            np.testing.assert_array_equal(got["y"], -x(seed)["x"])
        assert a.shared("unavailable") == 3  # the first failed its call; the others skipped it
        assert a.sample("kiln_result_cache_shared_available") == 0
        assert len([r for r in caplog.records if "caching in this pod's memory" in r.message]) == 1
        redis.start()
        clock.now += 10  # past the circuit's pause: the next request probes the store
        await a.scheduler.submit(x(15))
        assert a.sample("kiln_result_cache_shared_available") == 1
        assert keys(redis, "*:v:*") != []


@pytest.fixture
def hanging_store():
    """A TCP port that accepts connections and never answers a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


async def test_a_store_that_hangs_costs_one_request_its_timeout(engine_bytes, hanging_store):
    async with Replica(engine_bytes, {"address": hanging_store, "timeoutMilliseconds": 50}) as a:
        seconds = []
        for seed in range(16, 22):
            started = time.monotonic()
            got = await a.scheduler.submit(x(seed))
            seconds.append(time.monotonic() - started)
            np.testing.assert_array_equal(got["y"], -x(seed)["x"])
        assert seconds[0] < 0.5  # one timeout (50 ms) and the engine
        assert max(seconds[1:]) < 0.05  # the circuit skips the store
        assert a.shared("unavailable") == 6
