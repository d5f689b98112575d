"""A write the API server refuses, through the real operator against the emulated API server:
status and a Warning Event say so, and the operator asks again until it is let through.

The emulator has no admission; the test plays an admission policy (a reaction that refuses
one namespace's Deployments while it is on). Its own module, so the reaction (and kmock's
slower dispatch with one) ends with it.
"""

from __future__ import annotations

import json
import threading

import kmock
import pytest

from kiln.operator import manifests
from kiln.operator.config import OperatorConfig
from kiln.operator.plan import plan_engines
from kiln.runtime.api import contract
from kiln.runtime.api import spec as specmod

from support import kubeemu  # the emulator the fixtures run (its ApiError)

NS, NAME = "refused", "iris"
DENIED = 'admission webhook "images.policy.example.com" denied the request: images must come from registry.example.com'


@pytest.fixture(scope="module")
def operator(start_operator):
    op = start_operator(retry_seconds=0.2, resync_seconds=600)
    yield op
    op.stop()


def condition(st: dict, type_: str) -> dict:
    return next((c for c in st.get("conditions") or () if c["type"] == type_), {})


def test_a_refused_deployment_is_a_condition_and_one_warning_until_the_policy_lets_it_through(cluster, api, operator):
    policy = threading.Event()
    policy.set()

    def admission(request):
        if policy.is_set() and request.namespace == NS:
            raise kubeemu.ApiError(status=400, reason="BadRequest", message=DENIED, details={})
        return None  # admitted: the emulator serves it

    cluster.emu[kmock.action.CREATE, kmock.resource("apps", "v1", "deployments")] << admission
    spec = {"model": {"uri": "https://models.example.com/iris.onnx", "version": "1"},
            "engine": {"backend": "onnxruntime"}}
    [engine] = plan_engines(specmod.apply_defaults(spec), OperatorConfig())
    result = {"ok": True, "key": engine.key, "target": engine.architecture, "path": f"{NS}/{NAME}/{engine.key}",
              "sha256": "ab" * 32, "sizeBytes": 10, "buildSeconds": 1.0, "cacheHit": False}
    api.apply(manifests.engine_index_configmap(NS, {engine.index_key: json.dumps(result)}))  # built before
    api.apply({"apiVersion": contract.API_VERSION, "kind": contract.KIND,
               "metadata": {"name": NAME, "namespace": NS}, "spec": spec})

    said = (f"the API server refused to create Deployment {NS}/{manifests.runtime_name(NAME)} (400 BadRequest): "
            f"{DENIED}; retrying")
    st = api.wait(lambda: (lambda s: s if condition(s, "Degraded").get("reason") == "ApiRefused" else None)(
        (api.get("InferenceModel", NS, NAME) or {}).get("status") or {}), 10, "Degraded=ApiRefused")
    assert st["phase"] == "Degraded" and condition(st, "Degraded")["message"] == said
    assert condition(st, "EngineReady")["status"] == "True"
    tries = api.wait(lambda: (lambda n: n if n >= 4 else None)(
        cluster.emu.counts[("POST", "apps/v1/deployments")]), 10, "the operator asking again")
    warnings = [e for e in api.events(NS, NAME) if e["type"] == "Warning"]
    assert [(e["reason"], e["message"]) for e in warnings] == [("ApiRefused", said)], tries  # once, not per try

    policy.clear()  # the policy is changed: the next try goes through, with no change to the model
    api.wait(lambda: api.get("Deployment", NS, manifests.runtime_name(NAME)), 10, "the Deployment created")
    st = api.wait(lambda: (lambda s: s if condition(s, "Degraded").get("reason") not in (None, "ApiRefused") else None)(
        api.get("InferenceModel", NS, NAME)["status"]), 10, "Degraded cleared")
    assert st["phase"] == "Deploying"
