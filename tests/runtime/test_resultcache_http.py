"""The shared result cache where a user sees it: real HTTP servers as replicas on one
redis-server, tenants told apart by their headers (through front-end workers too), a killed
store that leaves every request answered, and `kiln serve` and the operator's pod template."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kiln.operator import manifests

from support.sequence_models import RedisServer, redis_server_binary
from support.serving import NAME, RUNTIME, Built, HttpClient, ServerThread, assert_matches, json_inputs, sample

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("shared-results"))


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def runtime(address: str, **cache) -> dict:
    return {**RUNTIME, "resultCache": {"enabled": True, "ttlSeconds": 60, **cache,
                                       "shared": {"address": address}}}


def outputs(doc: dict) -> dict[str, np.ndarray]:
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    return {o["name"]: np.asarray(o["data"], dtype=dtypes[o["datatype"]]).reshape(o["shape"])
            for o in doc["outputs"]}


def executions(srv: ServerThread) -> float:
    return srv.metric("kiln_executions_total", model=NAME, outcome="success") or 0.0


def test_a_second_replica_answers_from_the_store_without_its_engine(built, redis):
    replicas = [ServerThread(built.cache, {"cpu": built.rel}, runtime(redis.address)) for _ in range(2)]
    try:
        assert all(r.wait_loaded() for r in replicas)
        warm = [executions(r) for r in replicas]  # the warm-up ran each engine once
        inputs = sample(3, seed=21)
        for srv in replicas:
            status, _, doc = srv.infer({"inputs": json_inputs(inputs)})
            assert status == 200, doc
            assert_matches(outputs(doc), built.expected(inputs))
        assert [executions(r) - w for r, w in zip(replicas, warm)] == [1, 0]
        shared = replicas[1].metric("kiln_result_cache_shared_requests_total", model=NAME, result="hit")
        assert shared == 1
    finally:
        for r in replicas:
            r.close()


def test_a_killed_store_leaves_every_request_answered(built, redis):
    srv = ServerThread(built.cache, {"cpu": built.rel}, runtime(redis.address))
    try:
        assert srv.wait_loaded()
        assert srv.infer({"inputs": json_inputs(sample(2, seed=30))})[0] == 200
        redis.stop()
        for seed in range(31, 36):
            started = time.monotonic()
            inputs = sample(2, seed=seed)
            status, _, doc = srv.infer({"inputs": json_inputs(inputs)})
            assert status == 200, doc
            assert time.monotonic() - started < 1.0
            assert_matches(outputs(doc), built.expected(inputs))
        assert srv.metric("kiln_result_cache_shared_available", model=NAME) == 0
    finally:
        srv.close()


def tenant_request(client, inputs, tenant: str | None):
    headers = {"Content-Type": "application/json", **({"Kiln-Tenant": tenant} if tenant else {})}
    body = json.dumps({"inputs": json_inputs(inputs)}).encode()
    status, _, raw = client.request("POST", f"/v2/models/{NAME}/infer", body, headers)
    return status, json.loads(raw)


def _ready(client) -> bool:
    try:
        return client.get("/v2/health/ready")[0] == 200
    except OSError:
        return False  # the front ends are not listening yet


def test_per_tenant_results_through_front_end_workers(built, redis, tmp_path, kiln_process):
    """Front ends read the tenant from the headers as the engine process would: alice's
    cached answer is never bob's."""
    p = kiln_process(["serve", "--model-name", NAME, "--cache-dir", str(built.cache),
                      "--engine", f"cpu={built.rel}", "--runtime-spec",
                      json.dumps(runtime(redis.address, perTenant=True)), "--host", "127.0.0.1",
                      "--port", "0", "--no-grpc", "--workers", "2"], tmp_path)
    client = HttpClient(int(p.wait_for(r"front-end worker\(s\) on 127\.0\.0\.1:(\d+)").group(1)))
    try:
        deadline = time.monotonic() + 30
        while not _ready(client):
            assert time.monotonic() < deadline, "\n".join(p.lines)
            time.sleep(0.05)
        def lookups(result: str) -> float:
            return client.metric("kiln_result_cache_requests_total", model=NAME, result=result) or 0.0

        def shared(result: str) -> float:
            return client.metric("kiln_result_cache_shared_requests_total", model=NAME,
                                 result=result) or 0.0

        hits, misses = lookups("hit"), lookups("miss")
        inputs = sample(2, seed=40)
        for tenant in ("alice", "bob", "alice", None, "bob"):
            status, doc = tenant_request(client, inputs, tenant)
            assert status == 200, doc
            assert_matches(outputs(doc), built.expected(inputs))
        # alice, bob and the anonymous tenant each missed once; alice and bob hit once each.
        assert (lookups("miss") - misses, lookups("hit") - hits) == (3, 2)
        assert shared("miss") == 3
        assert len([k for k in redis.command("KEYS", "*:v:*").split(b"\r\n")
                    if k.startswith(b"kiln:")]) == 3
    finally:
        assert p.stop() == 0


def test_kiln_serve_refuses_a_bad_result_cache_at_start(built, tmp_path, kiln_process):
    secret = {"enabled": True, "shared": {"address": "redis:6379",
                                          "passwordSecretRef": {"name": "s", "key": "k"}}}
    for cache, message in [(secret, "KILN_RESULT_STORE_PASSWORD is not in the environment"),
                           ({"enabled": True, "shared": {"address": "r", "maxEntryKiB": 4096,
                                                         "maxMiB": 1}}, "maxEntryKiB must be <=")]:
        p = kiln_process(["serve", "--model-name", NAME, "--cache-dir", str(built.cache),
                          "--engine", f"cpu={built.rel}", "--port", "0", "--no-grpc",
                          "--runtime-spec", json.dumps({"resultCache": cache})], tmp_path)
        assert p.proc.wait(30) == 2
        p._reader.join(5)
        assert any(message in line for line in p.lines), p.lines


def test_the_pod_gets_the_namespace_and_the_password_from_the_secret_once():
    ref = {"name": "kiln-redis", "key": "password"}
    runtime = {"resultCache": {"enabled": True, "shared": {"address": "redis:6379",
                                                           "passwordSecretRef": ref}},
               "sequences": {"states": [{"input": "h", "output": "h_next"}],
                             "store": {"type": "redis", "address": "redis:6379"}}}
    env = manifests._unique_names(manifests.sequence_env(runtime) + manifests.result_cache_env(runtime))
    assert env == [
        {"name": "KILN_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "KILN_RESULT_STORE_PASSWORD", "valueFrom": {"secretKeyRef": ref}}]
    assert manifests.result_cache_env({"resultCache": {"enabled": True}}) == []
    assert manifests.result_cache_env({"resultCache": {"enabled": False, "shared": {"address": "r"}}}) == []
