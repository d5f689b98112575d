"""Kiln on a real cluster (kind or k3d): the API server, the Job and Deployment controllers
and the garbage collector are real here, unlike in tests/operator.

    KUBECONFIG=... make test-e2e
    KILN_E2E_IMAGE=<a kiln runtime image the cluster can pull>   (for the full path to Ready)
    KILN_E2E_MODEL_URI=<an ONNX URL the cluster can reach>       (e.g. examples/demo/model.onnx served in the cluster)

Every test gets its own namespace, deleted afterwards.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from kiln.operator import builders as b

pytestmark = pytest.mark.e2e


def wait(what, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = what()
        if last:
            return last
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {message}: last={last!r}")


def model(ns: str, name: str, uri: str, **extra) -> dict:
    spec = {"model": {"uri": uri, "version": "1"},
            "engine": {"backend": "onnxruntime", "precision": "fp32", "targets": ["cpu"]},
            # kind has no dedicated builder nodes: schedule anywhere.
            "build": {"nodeSelector": {}, "tolerations": [], "timeoutSeconds": 600, "backoffLimit": 0},
            "runtime": {"replicas": 1}}
    spec.update(extra)
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def get(api, path):
    from kiln.operator.kube import ApiError
    try:
        return api._request_sync("GET", path)
    except ApiError as e:
        if e.status == 404:
            return None
        raise


def status(api, ns, name) -> dict:
    return (get(api, f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/{name}") or {}).get("status") or {}


def test_build_job_runs_on_the_cluster(api, namespace, operator):
    api._request_sync("POST", f"/apis/kiln.dev/v1alpha1/namespaces/{namespace}/inferencemodels",
                      model(namespace, "tiny", "https://models.example.invalid/tiny.onnx"))
    jobs = wait(lambda: get(api, f"/apis/batch/v1/namespaces/{namespace}/jobs")["items"], 60, "the build Job")
    assert len(jobs) == 1
    job = jobs[0]
    assert job["metadata"]["labels"][b.LABEL_TARGET] == "cpu"
    # The real Job controller made a pod for it.
    wait(lambda: get(api, f"/api/v1/namespaces/{namespace}/pods?labelSelector=job-name%3D{job['metadata']['name']}")
         ["items"], 120, "the build pod")
    st = wait(lambda: status(api, namespace, "tiny").get("phase"), 60, "a phase")
    assert st in ("Building", "Failed")


@pytest.mark.skipif(not os.environ.get("KILN_E2E_IMAGE"), reason="set KILN_E2E_IMAGE to a kiln runtime image "
                                                                  "the cluster can pull to run builds for real")
def test_unreachable_model_fails_the_build_with_a_reason(api, namespace, operator):
    api._request_sync("POST", f"/apis/kiln.dev/v1alpha1/namespaces/{namespace}/inferencemodels",
                      model(namespace, "broken", "https://models.example.invalid/missing.onnx"))
    wait(lambda: status(api, namespace, "broken").get("phase") == "Failed", 600, "phase Failed")
    er = next(c for c in status(api, namespace, "broken")["conditions"] if c["type"] == "EngineReady")
    assert er["reason"] == "BuildFailed" and er["message"]
    events = get(api, f"/api/v1/namespaces/{namespace}/events")["items"]
    assert any(e["reason"] == "BuildFailed" and e["type"] == "Warning" for e in events)


@pytest.mark.skipif(not (os.environ.get("KILN_E2E_IMAGE") and os.environ.get("KILN_E2E_MODEL_URI")),
                    reason="set KILN_E2E_IMAGE to a kiln runtime image the cluster can pull and "
                           "KILN_E2E_MODEL_URI to an ONNX file it can fetch, to run a build for real")
def test_model_becomes_ready(api, namespace, operator):
    uri = os.environ["KILN_E2E_MODEL_URI"]
    api._request_sync("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "kiln-engine-cache"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    api._request_sync("POST", f"/apis/kiln.dev/v1alpha1/namespaces/{namespace}/inferencemodels",
                      model(namespace, "iris", uri))
    wait(lambda: status(api, namespace, "iris").get("phase") == "Ready", 900, "phase Ready")
    st = status(api, namespace, "iris")
    assert st["readyReplicas"] == 1 and st["engines"][0]["sha256"]
    index = get(api, f"/api/v1/namespaces/{namespace}/configmaps/{b.ENGINE_INDEX}")
    assert json.loads(next(iter(index["data"].values())))["ok"] is True
