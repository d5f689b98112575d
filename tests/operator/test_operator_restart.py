"""Operator restarts against the emulated API server: nothing is built twice, nothing rewritten;
and the resync timer, which needs an operator of its own settings.

The module has its own emulator and starts and stops operators itself (no shared one).
The test plays the Job controller as in test_operator_api.py: it creates the build pod
with its termination message and marks the Job Complete.
"""

from __future__ import annotations

import json
import time

from kiln.operator import manifests
from kiln.runtime.api import contract


def inference_model(ns: str, name: str) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"uri": "https://models.example.com/r.onnx", "version": "3"},
                     "engine": {"backend": "onnxruntime", "precision": "fp32"}, "runtime": {"replicas": 2}}}


def complete(api, job: dict) -> None:
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    req = json.loads(args[args.index("--request") + 1])
    result = {"ok": True, "key": req["key"], "target": req["target"], "path": f"{ns}/{req['name']}/{req['key']}",
              "sha256": "ef" * 32, "sizeBytes": 2048, "buildSeconds": 3.2, "cacheHit": True,
              "backend": "onnxruntime", "backendVersion": "1.32.0"}
    labels = {**job["spec"]["template"]["metadata"]["labels"], "job-name": name}
    api.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name + "-abcde", "namespace": ns, "labels": labels,
        "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"]}]},
        "spec": job["spec"]["template"]["spec"]})
    api.patch("Pod", ns, name + "-abcde", {"status": {"containerStatuses": [{"name": "build", "state": {
        "terminated": {"exitCode": 0, "reason": "Completed", "message": json.dumps(result)}}}]}}, subresource="status")
    api.patch("Job", ns, name, {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}},
              subresource="status")


def test_restart_mid_build_creates_no_duplicate_job_and_resumes(api, cluster, start_operator):
    ns, name = "restart", "tiny"
    first = start_operator(retry_seconds=0.5)
    try:
        api.apply(inference_model(ns, name))
        [job] = api.wait(lambda: api.list("Job", ns, selector=contract.LABEL_KEY), 10, "the build Job")
        api.wait(lambda: (api.get("InferenceModel", ns, name).get("status") or {}).get("phase") == "Building", 10)
    finally:
        first.stop()

    second = start_operator(retry_seconds=0.5)
    try:
        time.sleep(1.0)  # the second operator resumed the model
        jobs = api.list("Job", ns, selector=contract.LABEL_KEY)
        assert [j["metadata"]["uid"] for j in jobs] == [job["metadata"]["uid"]]
        assert job["spec"]["template"]["spec"]["containers"][0]["resources"] == {
            "requests": {"cpu": "1", "memory": "2Gi"}}  # onnxruntime: no GPU
        assert job["metadata"]["labels"][contract.LABEL_TARGET] == "cpu"

        complete(api, job)
        dep = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
        assert dep["spec"]["replicas"] == 2
        api.patch("Deployment", ns, dep["metadata"]["name"], {"status": {
            "observedGeneration": dep["metadata"]["generation"], "replicas": 2, "updatedReplicas": 2,
            "readyReplicas": 2, "availableReplicas": 2}}, subresource="status")
        st = api.wait(lambda: (lambda s: s if s.get("phase") == "Ready" else None)(
            api.get("InferenceModel", ns, name).get("status") or {}), 10, "Ready")
        assert st["engines"][0]["cacheHit"] is True
        events = [e["reason"] for e in api.events(ns, name)]
        assert events.count("BuildStarted") == 1, events
    finally:
        second.stop()

    # A third start on a Ready model: resuming writes nothing at all.
    writes = cluster.emu.writes()
    third = start_operator(retry_seconds=0.5)
    try:
        time.sleep(1.5)
        assert cluster.emu.writes() == writes, cluster.emu.counts
    finally:
        third.stop()


def test_the_same_alert_at_two_operators_is_one_step_and_a_restart_keeps_the_cooldown(api, cluster, start_operator, am):
    # Alertmanager in HA delivers a group once per replica; two operators (no peering here)
    # each receive it and each decide. The conditional write of spec.runtime.replicas lets one
    # step land; the other sees a count it did not set and keeps it.
    ns, name = "ha", "busy"
    first = start_operator(alert_token="test-token", retry_seconds=0.5)
    model = inference_model(ns, name)
    model["spec"]["runtime"]["replicas"] = 1
    model["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetGPUUtilization": 50,
                                    "maxStep": 1, "scaleUpCooldownSeconds": 300}
    api.apply(model)
    [job] = api.wait(lambda: api.list("Job", ns, selector=contract.LABEL_KEY), 10, "the build Job")
    complete(api, job)
    dep = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
    api.patch("Deployment", ns, dep["metadata"]["name"], {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1,
        "availableReplicas": 1}}, subresource="status")
    second = start_operator(alert_token="test-token", retry_seconds=0.5)
    high = am.webhook(am.alert(ns, name, "KilnUtilizationHigh", value="0.9"))
    assert [am.post(op, high)[0] for op in (first, second)] == [200, 200]
    spec = lambda: api.get("InferenceModel", ns, name)["spec"]["runtime"]["replicas"]  # noqa: E731
    api.wait(lambda: spec() == 2, 10, "one step, 1 -> 2")
    time.sleep(1.5)
    history = lambda: (api.get("InferenceModel", ns, name).get("status") or {}).get("scaling", {}).get("history", [])  # noqa: E731
    assert spec() == 2 and [h["reason"] for h in history()].count("UtilizationHigh") == 1
    first.stop()
    second.stop()

    # A new operator resumes from status.scaling: a fresh alert within the cooldown holds.
    third = start_operator(alert_token="test-token", retry_seconds=0.5)
    try:
        api.patch("Deployment", ns, dep["metadata"]["name"], {"status": {"replicas": 2, "updatedReplicas": 2,
                                                                          "readyReplicas": 2, "availableReplicas": 2}},
                  subresource="status")
        again = am.webhook(am.alert(ns, name, "KilnUtilizationHigh", value="0.9", fingerprint="fp9"))
        again["alerts"][0]["startsAt"] = am.alert(ns, name, "x", ago=-1)["startsAt"]  # a new episode
        assert am.post(third, again)[0] == 200
        api.wait(lambda: history()[-1]["reason"] == "CooldownActive", 10, "the cooldown held after the restart")
        assert spec() == 2
    finally:
        third.stop()

    # And a restart of an idle autoscaled model writes nothing: not even its status again.
    writes = cluster.emu.writes()
    fourth = start_operator(alert_token="test-token", retry_seconds=0.5)
    try:
        time.sleep(1.5)
        assert cluster.emu.writes() == writes, cluster.emu.counts
    finally:
        fourth.stop()


def test_the_resync_needs_no_finalizer_and_ends_with_the_model(api, start_operator, caplog):
    """The resync is the operator's own timer, not kopf's (which puts a finalizer on every
    model): a model carries none, is gone at once when deleted, and its timer goes with it."""
    ns, name = "resync", "tiny"

    def ticks() -> list:
        return [r for r in caplog.records if r.getMessage() == f"{ns}/{name}: reconciling on its timer"]

    op = start_operator(retry_seconds=0.5, resync_seconds=0.5)
    try:
        with caplog.at_level("INFO", logger="kiln.operator.handlers"):
            api.apply(inference_model(ns, name))
            api.wait(lambda: len(ticks()) >= 2, 10, "two resync ticks")
            assert not api.get("InferenceModel", ns, name)["metadata"].get("finalizers")
            api.delete("InferenceModel", ns, name)
            assert api.get("InferenceModel", ns, name) is None
            time.sleep(0.5)  # the operator sees the deletion
            seen = len(ticks())
            time.sleep(1.5)
            assert len(ticks()) == seen, "a timer still fires for a deleted model"
    finally:
        op.stop()
