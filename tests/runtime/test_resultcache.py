"""The result cache: hits and misses, byte-bounded LRU, TTL on an injected clock, engine-key
isolation, and no caller able to change what another caller reads."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling.resultcache import MIB, ResultCache, ResultCacheConfig, input_digest


class FakeClock:
    def __init__(self):
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def out(value: float, n: int = 256) -> dict[str, np.ndarray]:
    return {"y": np.full(n, value, dtype=np.float32)}  # 1 KiB when n = 256


def inp(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, 3)).astype(np.float32)}


@pytest.fixture
def setup():
    clock, metrics = FakeClock(), ServerMetrics()
    cache = ResultCache(3 * 1024, ttl_seconds=10, metrics=metrics, model="m", clock=clock)
    return cache, clock, metrics


def value(metrics: ServerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model": "m", **labels}) or 0.0


def test_miss_then_hit_counted(setup):
    cache, _, metrics = setup
    key = ResultCache.key("engine-1", inp(0))
    assert cache.get(key) is None
    cache.put(key, out(1.0))
    np.testing.assert_array_equal(cache.get(key)["y"], out(1.0)["y"])
    assert value(metrics, "kiln_result_cache_requests_total", result="miss") == 1
    assert value(metrics, "kiln_result_cache_requests_total", result="hit") == 1
    assert value(metrics, "kiln_result_cache_bytes") == 1024


def test_least_recently_used_entry_is_evicted_by_size(setup):
    cache, _, metrics = setup
    keys = [ResultCache.key("engine-1", inp(i)) for i in range(4)]
    for i, k in enumerate(keys[:3]):
        cache.put(k, out(i))
    assert cache.get(keys[0]) is not None  # now keys[1] is the least recently used
    cache.put(keys[3], out(3))  # 4 KiB would exceed 3 KiB: one entry goes
    assert cache.get(keys[1]) is None
    assert all(cache.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    assert value(metrics, "kiln_result_cache_evictions_total") == 1
    assert value(metrics, "kiln_result_cache_bytes") == 3 * 1024 == cache.nbytes


def test_entry_larger_than_the_cache_is_not_stored(setup):
    cache, _, metrics = setup
    assert cache.put(ResultCache.key("engine-1", inp(0)), out(1.0, n=1024)) is False
    assert len(cache) == 0 and value(metrics, "kiln_result_cache_bytes") == 0


def test_entries_expire_after_the_ttl(setup):
    cache, clock, metrics = setup
    key = ResultCache.key("engine-1", inp(0))
    cache.put(key, out(1.0))
    clock.now += 9.9
    assert cache.get(key) is not None
    clock.now += 0.1
    assert cache.get(key) is None
    assert value(metrics, "kiln_result_cache_evictions_total") == 1
    assert value(metrics, "kiln_result_cache_bytes") == 0


def test_a_new_engine_key_never_sees_an_old_entry(setup):
    cache, _, _ = setup
    cache.put(ResultCache.key("engine-1", inp(0)), out(1.0))
    assert cache.get(ResultCache.key("engine-2", inp(0))) is None


def test_returned_arrays_are_not_aliases_of_cached_ones(setup):
    cache, _, _ = setup
    key, original = ResultCache.key("engine-1", inp(0)), out(1.0)
    cache.put(key, original)
    original["y"][:] = -1  # the producer changes its array after storing it
    first = cache.get(key)
    first["y"][:] = -2  # a consumer changes what it got
    np.testing.assert_array_equal(cache.get(key)["y"], out(1.0)["y"])


def test_digest_is_canonical_and_sees_every_difference():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    base = input_digest({"a": x, "b": x[:, :2].copy()})
    assert base == input_digest({"b": x[:, :2], "a": np.asfortranarray(x)})  # order, layout
    assert base != input_digest({"a": x.astype(np.float64), "b": x[:, :2].copy()})  # dtype
    assert base != input_digest({"a": x.reshape(4, 3), "b": x[:, :2].copy()})  # shape
    assert base != input_digest({"c": x, "b": x[:, :2].copy()})  # name
    changed = x.copy()
    changed[2, 3] += 1
    assert base != input_digest({"a": changed, "b": x[:, :2].copy()})  # bytes


def cache_spec(result_cache: dict) -> dict:
    """spec.runtime.resultCache with the CRD's defaults applied, as `kiln serve` reads it."""
    return runtime_with_defaults({"resultCache": result_cache})["resultCache"]


def test_config_defaults_and_validation():
    assert ResultCacheConfig.from_spec(cache_spec({})) == ResultCacheConfig(False, 64 * MIB, 300)
    with pytest.raises(ValueError, match="resultCache.ttlSeconds must be > 0, got 0"):
        ResultCacheConfig.from_spec(cache_spec({"ttlSeconds": 0}))
    # The defaults come from the CRD once (`kiln serve` applies them), never from here.
    with pytest.raises(ValueError, match=r"^runtime\.resultCache\.ttlSeconds is missing: "):
        ResultCacheConfig.from_spec({"enabled": True, "maxMiB": 1})
    with pytest.raises(ValueError, match="engine_key must be a non-empty string"):
        ResultCache.key("", inp(0))
