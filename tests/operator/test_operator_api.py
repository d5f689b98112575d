"""The real operator (kopf + the kubernetes client) against the emulated API server.

What a user would see is asserted: Jobs, Deployments, Services, ConfigMaps, the
InferenceModel's status, Events. The emulator has no controllers, so the tests play the
Job controller and the kubelet where the story needs them, and say so:

- a build finishes: the test creates the Job's pod with a terminated `build` container
  whose termination message is the `kiln build` result JSON, then marks the Job
  Complete (or Failed) in its status - the order a Job controller reports them;
- runtime pods become Ready: the test writes the Deployment's status as the Deployment
  controller would.

One operator serves the whole module (kopf's startup costs a second); each test uses its
own namespace.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from kiln.operator import manifests
from kiln.runtime.api import contract
from support.operator_play import condition, finish_job, jobs, model, reasons, request_of, roll_out, status  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# ------------------------------------------------------------------------ scenarios

def example_manifests() -> list[dict]:
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceModel":
                found.append(doc)
    return found


@pytest.mark.parametrize("manifest", example_manifests() or [model("examples", "fixture")],
                         ids=lambda m: m["metadata"]["name"])
def test_example_manifest_builds_one_job_per_architecture(api, operator, manifest):
    from kiln.runtime.api import enginekey

    m = copy.deepcopy(manifest)
    ns = "ex-" + m["metadata"]["name"]
    m["metadata"]["namespace"] = ns
    api.apply(m)
    targets = m["spec"].get("engine", {}).get("targets") or ["sm90"]
    archs = sorted({enginekey.normalize_target(t) for t in targets})
    found = api.wait(lambda: (lambda js: js if len(js) == len(archs) else None)(jobs(api, ns)), 10, "build Jobs")
    assert sorted(j["metadata"]["labels"][contract.LABEL_TARGET] for j in found) == archs
    for job in found:
        req = request_of(job)
        assert job["metadata"]["name"] == f"kiln-build-{req['key']}-{req['target']}"
        assert req["model"]["uri"] == m["spec"]["model"]["uri"]
        assert req["engine"]["precision"] == m["spec"]["engine"]["precision"]
        pod = job["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"kiln.dev/role": "builder"}
        assert pod["tolerations"][0]["effect"] == "NoSchedule"
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert job["spec"]["activeDeadlineSeconds"] == m["spec"].get("build", {}).get("timeoutSeconds", 3600)
        assert job["metadata"]["ownerReferences"][0]["name"] == m["metadata"]["name"]
        if m["spec"]["model"]["uri"].startswith("pvc://"):
            claim = m["spec"]["model"]["uri"][len("pvc://"):].split("/")[0]
            assert {"name": "model-source", "mountPath": f"/mnt/models/{claim}", "readOnly": True} \
                in pod["containers"][0]["volumeMounts"]
    st = api.wait(lambda: status(api, ns, m["metadata"]["name"]).get("phase") == "Building"
                  and status(api, ns, m["metadata"]["name"]), 10, "phase Building")
    assert condition(st, "EngineReady")["reason"] == "Building"
    api.wait(lambda: "BuildStarted" in reasons(api, ns, m["metadata"]["name"]), 5, "a BuildStarted Event")

    # Every build succeeds: the runtime serves one engine per architecture.
    name = m["metadata"]["name"]
    for job in found:
        finish_job(api, job)
    dep = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the runtime Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    served = sorted(args[i + 1].split("=")[0] for i, a in enumerate(args) if a == "--engine")
    assert served == archs
    assert dep["spec"]["replicas"] == manifests.desired_replicas(m["spec"] | {"autoscaling": m["spec"].get("autoscaling", {})})
    # One Service for every pod; with the Gateway API the stable track's (the route weighs it against -canary).
    track = {contract.LABEL_TRACK: manifests.STABLE}  # the canary's pods join only in a weighted step
    service = api.wait(lambda: api.get("Service", ns, name), 10, "the Service")  # created right after the Deployment
    assert service["spec"]["selector"] == {contract.LABEL_MODEL: name, **track}
    roll_out(api, ns, name)
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Ready" and status(api, ns, name), 10, "Ready")
    assert sorted(e["architecture"] for e in st["engines"]) == archs
    assert all(e["sha256"] == "ab" * 32 for e in st["engines"])
    api.wait(lambda: {"BuildSucceeded", "Deploying", "Available", "Ready"} <= set(reasons(api, ns, name)), 5)


def test_build_succeeds_then_deployment_service_status_and_events(api, operator, cluster):
    ns, name = "life", "resnet"
    api.apply(model(ns, name))
    [job] = api.wait(lambda: jobs(api, ns), 10, "the build Job")
    assert api.get("Deployment", ns, manifests.runtime_name(name)) is None  # nothing runs before the engine exists

    finish_job(api, job)
    dep = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the runtime Deployment")
    req = request_of(job)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--engine") + 1] == f"sm90={ns}/{name}/{req['key']}"
    assert dep["spec"]["template"]["metadata"]["labels"][contract.LABEL_ENGINE_KEY] == req["key"]
    assert dep["spec"]["replicas"] == 1
    svc = api.wait(lambda: api.get("Service", ns, name), 10, "the Service")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"},
                                    {"name": "grpc", "port": 8081, "targetPort": "grpc", "protocol": "TCP",
                                     "appProtocol": "grpc"}]
    index = api.get("ConfigMap", ns, contract.ENGINE_INDEX)
    assert json.loads(index["data"][f"{req['key']}.sm90"])["sha256"] == "ab" * 32

    st = api.wait(lambda: status(api, ns, name).get("phase") == "Deploying" and status(api, ns, name), 10)
    assert condition(st, "EngineReady")["status"] == "True"
    assert condition(st, "Available")["status"] == "False"

    roll_out(api, ns, name)
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Ready" and status(api, ns, name), 10, "Ready")
    assert st["engineKey"] == req["key"]
    assert st["engines"] == [{"key": req["key"], "target": "H100", "architecture": "sm90", "version": "1",
                              "path": f"{ns}/{name}/{req['key']}", "sha256": "ab" * 32, "sizeBytes": 123456789,
                              "buildSeconds": 241.5, "cacheHit": False}]
    assert (st["replicas"], st["readyReplicas"], st["selector"]) == (1, 1, f"kiln.dev/model={name}")
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "EngineReady": "True", "Available": "True", "Progressing": "False", "Degraded": "False"}
    assert all(c["observedGeneration"] == 1 for c in st["conditions"])
    assert st["observedGeneration"] == 1
    api.wait(lambda: {"BuildStarted", "BuildSucceeded", "Deploying", "Available", "Ready"}
             <= set(reasons(api, ns, name)), 5, "the Events")

    # The scale subresource reads what the status says.
    scale = api.request("GET", f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/{name}/scale")
    assert scale["spec"]["replicas"] == 1 and scale["status"]["selector"] == f"kiln.dev/model={name}"

    # Idle: a further reconcile (poked by an unrelated change on the Deployment) writes nothing.
    writes = cluster.emu.writes()
    api.patch("Deployment", ns, manifests.runtime_name(name), {"metadata": {"labels": {"poke": "1"}}})
    import time
    time.sleep(1.5)
    assert cluster.emu.writes() - writes == 1, "the operator wrote something on a no-op reconcile"
    assert sum(1 for r in reasons(api, ns, name) if r == "Ready") == 1

    # The Job goes (its ttlSecondsAfterFinished; the test deletes it as the TTL controller
    # would): the engine index still says the engine exists, so nothing is rebuilt.
    api.delete("Job", ns, job["metadata"]["name"])
    time.sleep(1.0)
    assert jobs(api, ns) == []
    assert status(api, ns, name)["phase"] == "Ready"


def test_two_models_sharing_a_key_share_one_job(api, operator):
    ns = "shared"
    # The key follows the content when sha256 is pinned: two models, one digest, one engine.
    digest = "c" * 64
    for name in ("left", "right"):
        m = model(ns, name)
        m["spec"]["model"] = {"uri": f"https://mirror-{name}.example.com/m.onnx", "version": "7", "sha256": digest}
        api.apply(m)
    shared = api.wait(lambda: [j for j in jobs(api, ns) if request_of(j)["model"].get("sha256") == digest], 10)
    import time
    time.sleep(0.5)  # both models reconciled by now; still one Job
    shared = [j for j in jobs(api, ns) if request_of(j)["model"].get("sha256") == digest]
    assert len(shared) == 1
    for name in ("left", "right"):
        api.wait(lambda: condition(status(api, ns, name), "EngineReady").get("reason") == "Building", 10)
    finish_job(api, shared[0])
    for name in ("left", "right"):
        api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, f"Deployment of {name}")
        roll_out(api, ns, name)
    for name in ("left", "right"):
        st = api.wait(lambda: status(api, ns, name).get("phase") == "Ready" and status(api, ns, name), 10)
        assert st["engineKey"] == request_of(shared[0])["key"]
    told = api.wait(lambda: (lambda r: r if ("BuildSucceeded" in r[0] or "EnginesReady" in r[0])
                             and ("BuildSucceeded" in r[1] or "EnginesReady" in r[1]) else None)(
        [reasons(api, ns, "left"), reasons(api, ns, "right")]), 5, "an engine Event for each model")
    assert sum(r.count("BuildSucceeded") for r in told) == 1  # one build, reported once


def test_key_change_builds_first_then_rolls_the_deployment(api, operator):
    ns, name = "keychange", "bert"
    api.apply(model(ns, name, version="1", rollout={"strategy": "Recreate"}))
    [old_job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, old_job)
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10)
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("phase") == "Ready", 10)
    before = api.get("Deployment", ns, manifests.runtime_name(name))

    api.patch("InferenceModel", ns, name, {"spec": {"model": {"version": "2"}}})
    new_job = api.wait(lambda: [j for j in jobs(api, ns) if j["metadata"]["name"] != old_job["metadata"]["name"]],
                       10, "the new build Job")[0]
    assert request_of(new_job)["model"]["version"] == "2"
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Building" and status(api, ns, name), 10)
    assert condition(st, "Available")["status"] == "True"  # the old version keeps serving
    assert st["engineKey"] == request_of(old_job)["key"]
    during = api.get("Deployment", ns, manifests.runtime_name(name))
    assert during["spec"] == before["spec"]
    assert during["metadata"]["generation"] == before["metadata"]["generation"]

    finish_job(api, new_job)
    new_key = request_of(new_job)["key"]
    dep = api.wait(lambda: (lambda d: d if d["spec"]["template"]["metadata"]["labels"][contract.LABEL_ENGINE_KEY] == new_key
                            else None)(api.get("Deployment", ns, manifests.runtime_name(name))), 10, "the rollout")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"sm90={ns}/{name}/{new_key}" in args and args[args.index("--model-version") + 1] == "2"
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    roll_out(api, ns, name)
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Ready" and status(api, ns, name), 10)
    assert st["engineKey"] == new_key and st["stable"]["version"] == "2"


def test_failed_build_reports_and_retries_only_after_a_spec_change(api, operator):
    ns, name = "failing", "yolo"
    api.apply(model(ns, name))
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job, ok=False, exit_code=4)
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Failed" and status(api, ns, name), 10, "Failed")
    er = condition(st, "EngineReady")
    assert (er["status"], er["reason"]) == ("False", "BuildFailed")
    assert "DigestMismatch" in er["message"] and "BackoffLimitExceeded" in er["message"]
    warnings = api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "BuildFailed"], 5)
    assert warnings[0]["type"] == "Warning" and "DigestMismatch" in warnings[0]["message"]

    import time
    time.sleep(1.5)  # no retry loop: the failed Job stays, no new one appears
    [still] = jobs(api, ns)
    assert still["metadata"]["uid"] == job["metadata"]["uid"]
    assert len([e for e in api.events(ns, name) if e["reason"] == "BuildFailed"]) == 1

    # A spec change (a new generation) retries: the failed Job is replaced by a new one.
    api.patch("InferenceModel", ns, name, {"spec": {"runtime": {"replicas": 2}}})
    retried = api.wait(lambda: [j for j in jobs(api, ns) if j["metadata"]["uid"] != job["metadata"]["uid"]], 10,
                       "the retried Job")
    assert retried[0]["metadata"]["name"] == job["metadata"]["name"]
    assert retried[0]["metadata"]["annotations"][contract.ANN_GENERATION] == "2"
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Building" and status(api, ns, name), 10)
    assert condition(st, "EngineReady")["observedGeneration"] == 2
    finish_job(api, retried[0])
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment after the retry")


def test_spec_that_cannot_work_fails_without_building(api, operator):
    ns, name = "invalid", "nowhere"
    api.apply(model(ns, name, engine={"targets": ["Z9000"]}))
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Failed" and status(api, ns, name), 10, "Failed")
    er = condition(st, "EngineReady")
    assert (er["reason"], "Z9000" in er["message"]) == ("InvalidSpec", True)
    api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "InvalidSpec" and e["type"] == "Warning"], 5)
    assert jobs(api, ns) == []


def test_autoscaled_replicas_follow_the_scale_subresource_within_bounds(api, operator):
    ns, name = "autoscaled", "clip"
    api.apply(model(ns, name, autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 3}))
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job)
    dep = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
    assert dep["spec"]["replicas"] == 2  # spec.runtime.replicas 1, raised to minReplicas
    assert "replicas" not in json.loads(dep["metadata"]["annotations"][contract.ANN_APPLIED])["spec"]
    # An HPA, KEDA or Kiln's autoscaler scales the InferenceModel through its scale subresource.
    api.request("PATCH", f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/{name}/scale",
                {"spec": {"replicas": 5}}, "application/merge-patch+json")
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 3, 10,
             "replicas clamped to maxReplicas")
    template = api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["template"]
    assert template == dep["spec"]["template"]  # a replica change is not a rollout


def test_file_uri_is_refused_in_a_cluster(api, operator):
    ns, name = "fileuri", "local"
    m = model(ns, name)
    m["spec"]["model"]["uri"] = "file:///models/local.onnx"
    api.apply(m)  # the CRD accepts it (one manifest serves `kiln dev` too)
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Failed" and status(api, ns, name), 10, "Failed")
    er = condition(st, "EngineReady")
    assert er["reason"] == "InvalidSpec" and "kiln dev" in er["message"]
    import time
    time.sleep(0.5)
    assert jobs(api, ns) == []  # no build Job reads a builder node's filesystem


def test_deleted_service_comes_back_on_its_watch_event(api, operator):
    # The module's operator resyncs every 600 s: only the Service's own watch event can bring it back.
    ns, name = "svcwatch", "gone"
    api.apply(model(ns, name))
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job)
    svc = api.wait(lambda: api.get("Service", ns, name), 10, "the Service")
    api.delete("Service", ns, name)
    back = api.wait(lambda: (lambda s: s if s and s["metadata"]["uid"] != svc["metadata"]["uid"] else None)(
        api.get("Service", ns, name)), 5, "the Service recreated")
    assert back["spec"]["selector"] == {contract.LABEL_MODEL: name, contract.LABEL_TRACK: manifests.STABLE}


def test_a_build_made_obsolete_by_a_spec_change_is_deleted(api, operator):
    ns, name = "obsolete", "vit"
    api.apply(model(ns, name, version="1"))
    [old_job] = api.wait(lambda: jobs(api, ns), 10, "the first build Job")
    api.patch("InferenceModel", ns, name, {"spec": {"model": {"version": "2"}}})
    [new_job] = api.wait(lambda: (lambda js: js if len(js) == 1 and js[0]["metadata"]["name"] !=
                                  old_job["metadata"]["name"] else None)(jobs(api, ns)), 10,
                         "the obsolete Job deleted and the new one created")
    assert request_of(new_job)["model"]["version"] == "2"
    api.wait(lambda: "BuildCancelled" in reasons(api, ns, name), 10, "a BuildCancelled Event")
    index = api.get("ConfigMap", ns, contract.ENGINE_INDEX)
    assert index is None or not any(k.startswith(request_of(old_job)["key"]) for k in index.get("data") or {})


def test_a_shared_build_another_model_still_needs_is_kept(api, operator):
    ns, digest = "obsolete-shared", "d" * 64
    for name in ("first", "second"):
        m = model(ns, name)
        m["spec"]["model"]["sha256"] = digest
        api.apply(m)
        api.wait(lambda: condition(status(api, ns, name), "EngineReady").get("reason") == "Building", 10)
    [shared] = jobs(api, ns)
    owner = shared["metadata"]["ownerReferences"][0]["name"]
    api.patch("InferenceModel", ns, owner, {"spec": {"model": {"sha256": "e" * 64}}})
    api.wait(lambda: len(jobs(api, ns)) == 2, 10, "the owner's new Job")
    import time
    time.sleep(1.0)
    assert shared["metadata"]["uid"] in {j["metadata"]["uid"] for j in jobs(api, ns)}


def test_an_edit_to_the_runtime_pod_template_is_restored(api, operator):
    ns, name = "drift", "edited"
    api.apply(model(ns, name, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4}))
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job)
    dep = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("phase") == "Ready", 10, "Ready")
    want = dep["spec"]["template"]["spec"]["containers"][0]
    edited = {**want, "image": "registry.example/someone-else:1", "env": [{"name": "DEBUG", "value": "1"}],
              "readinessProbe": {"exec": {"command": ["true"]}}}
    api.patch("Deployment", ns, manifests.runtime_name(name), {
        "metadata": {"annotations": {"team.example/owner": "ml-platform"}},
        "spec": {"template": {"spec": {"containers": [edited]}}}})
    restored = api.wait(lambda: (lambda d: d if d["spec"]["template"]["spec"]["containers"][0]["image"] == want["image"]
                                 else None)(api.get("Deployment", ns, manifests.runtime_name(name))), 10, "the image restored")
    c = restored["spec"]["template"]["spec"]["containers"][0]
    assert "env" not in c and c["readinessProbe"] == want["readinessProbe"] and c["args"] == want["args"]
    assert restored["metadata"]["annotations"]["team.example/owner"] == "ml-platform"  # others' annotations stay
    api.wait(lambda: "DriftRestored" in reasons(api, ns, name), 10, "a DriftRestored Event")
    # A scale change someone made (autoscaled: the replica count is not Kiln's template) is no drift.
    api.patch("Deployment", ns, manifests.runtime_name(name), {"metadata": {"labels": {"poke": "1"}}})
    import time
    time.sleep(1.0)
    assert api.get("Deployment", ns, manifests.runtime_name(name))["metadata"]["generation"] == restored["metadata"]["generation"]


# -- autoscaling from Alertmanager's webhook ------------------------------------------------
# The operator's receiver is real HTTP; the tests post what Alertmanager posts (conftest's
# `post_alerts`, `alert`, `webhook`; the real Alertmanager and Prometheus drive it in tests/e2e).

def serving_autoscaled(api, ns, name, replicas=1, **auto):
    api.apply(model(ns, name, runtime={"replicas": replicas},
                    autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetGPUUtilization": 50,
                                 "scaleUpCooldownSeconds": 0, **auto}))
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job)
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("phase") == "Ready", 10, "Ready")


def spec_replicas(api, ns, name) -> int:
    return api.get("InferenceModel", ns, name)["spec"]["runtime"]["replicas"]


def history(api, ns, name) -> list[dict]:
    return (status(api, ns, name).get("scaling") or {}).get("history") or []


def test_a_high_alert_scales_up_once_and_a_replay_changes_nothing(api, operator, am):
    ns, name = "scale-up", "busy"
    serving_autoscaled(api, ns, name)
    high = am.webhook(am.alert(ns, name, "KilnUtilizationHigh", value="0.9"))
    assert am.post(operator, high) == (200, {"accepted": 1})
    api.wait(lambda: spec_replicas(api, ns, name) == 2, 10, "spec.runtime.replicas 1 -> 2 (1 x 0.9/0.5)")
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 2, 10, "the Deployment")
    [entry] = api.wait(lambda: history(api, ns, name), 10, "status.scaling.history")
    assert (entry["from"], entry["to"], entry["reason"], entry["source"]) == (2 - 1, 2, "UtilizationHigh",
                                                                              "KilnUtilizationHigh")
    assert status(api, ns, name)["scaling"]["lastDecision"] == "1->2 UtilizationHigh"
    # what the rules read for it (a TensorRT model: its GPUs), for kubectl describe
    assert status(api, ns, name)["scaling"]["signal"].startswith("gpu: ")
    api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "ScaledUp"], 5, "a ScaledUp Event")
    annotations = api.get("InferenceModel", ns, name)["metadata"]["annotations"]
    assert "KilnUtilizationHigh" in annotations["autoscaling.kiln.dev/signals"]
    # kopf's diff-base leaves the record out: a signal costs the receiver's write, not a second one.
    assert "signals" not in annotations.get("kiln.dev/last-handled-configuration", "")
    # The same group again (a retry, a second Alertmanager): one decision, however often.
    roll_out(api, ns, name)
    for _ in range(3):
        assert am.post(operator, high) == (200, {"duplicate": 1})
    import time
    time.sleep(1)
    assert (spec_replicas(api, ns, name), len(history(api, ns, name))) == (2, 1)
    resolved = am.webhook(am.alert(ns, name, "KilnUtilizationHigh", status="resolved"))
    resolved["alerts"][0]["startsAt"] = high["alerts"][0]["startsAt"]
    assert am.post(operator, resolved) == (200, {"accepted": 1})
    assert am.post(operator, high) == (200, {"duplicate": 1})  # a replayed firing does not revive it
    time.sleep(0.5)
    assert spec_replicas(api, ns, name) == 2


def test_a_low_alert_scales_down_after_its_stabilization_window(api, operator, am):
    ns, name = "scale-down", "idle"
    serving_autoscaled(api, ns, name, replicas=4, scaleDownStabilizationSeconds=2, scaleDownCooldownSeconds=0)
    assert am.post(operator, am.webhook(am.alert(ns, name, "KilnUtilizationLow", value="0.05"))) == (200, {"accepted": 1})
    [held] = api.wait(lambda: history(api, ns, name), 10, "a Stabilizing hold")
    assert (held["reason"], spec_replicas(api, ns, name)) == ("Stabilizing", 4)
    # No further delivery and no watch event: the operator looks again when the window ends.
    api.wait(lambda: spec_replicas(api, ns, name) == 2, 10, "4 -> 2 (maxStep) after the window")
    api.wait(lambda: history(api, ns, name)[-1]["reason"] == "UtilizationLow", 5, "the decision in status")


def test_missing_metrics_hold_and_a_manual_scale_is_kept(api, operator, am):
    ns, name = "no-data", "quiet"
    serving_autoscaled(api, ns, name, replicas=2)
    both = am.webhook(am.alert(ns, name, "KilnUtilizationHigh"), am.alert(ns, name, "KilnUtilizationMissing", value="",
                                                                 fingerprint="fp2"))
    assert am.post(operator, both) == (200, {"accepted": 2})
    [held] = api.wait(lambda: history(api, ns, name), 10, "a NoMetrics hold")
    assert (held["reason"], spec_replicas(api, ns, name)) == ("NoMetrics", 2)
    api.patch("InferenceModel", ns, name, {"spec": {"replicas": 3}}, subresource="scale")  # kubectl scale
    api.wait(lambda: "ScaledExternally" in [h["reason"] for h in history(api, ns, name)], 10, "the manual scale recorded")
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 3, 10, "followed")
    assert spec_replicas(api, ns, name) == 3


def test_the_receiver_refuses_what_it_cannot_trust_and_changes_nothing(api, operator, am):
    import urllib.request

    ns, name = "refused", "guarded"
    serving_autoscaled(api, ns, name)
    good = am.webhook(am.alert(ns, name, "KilnUtilizationHigh"))
    assert am.post(operator, good, token=None)[0] == 401
    assert am.post(operator, good, token="wrong")[0] == 401
    code, body = am.post(operator, b"{not json")
    assert code == 400 and "not JSON" in body["error"]
    code, body = am.post(operator, {**good, "version": "3"})
    assert code == 400 and "version" in body["error"]
    no_start = am.webhook({**am.alert(ns, name, "KilnUtilizationHigh"), "startsAt": "yesterday"})
    code, body = am.post(operator, no_start)
    assert code == 400 and "alerts[0].startsAt" in body["error"]
    assert am.post(operator, b" " * (2 << 20))[0] == 413
    other = am.webhook(am.alert(ns, "nosuchmodel", "KilnUtilizationHigh"))
    assert am.post(operator, other) == (200, {"unknown_model": 1})
    foreign = am.webhook({**am.alert(ns, name, "KilnUtilizationHigh"), "labels": {"alertname": "DiskFull"}})
    assert am.post(operator, foreign) == (200, {"ignored": 1})
    model_now = api.get("InferenceModel", ns, name)
    assert "autoscaling.kiln.dev/signals" not in (model_now["metadata"].get("annotations") or {})
    assert model_now["spec"]["runtime"]["replicas"] == 1 and history(api, ns, name) == []
    metrics = urllib.request.urlopen(operator.alerts_url.replace("/alerts", "/metrics"), timeout=5).read().decode()
    assert f'kiln_autoscaling_target_ratio{{model="{name}",namespace="{ns}"}} 0.5' in metrics
    assert 'kiln_alerts_received_total{result="unauthorized"} 2.0' in metrics


# -- requests refused: the model's health from Alertmanager's webhook -----------------------

def refused_alert(am, ns, name, **kw) -> dict:
    return am.alert(ns, name, "KilnRequestsRefused", fingerprint="refused", **kw)


def test_a_model_that_refuses_most_requests_is_degraded_until_the_alert_resolves(api, operator, am):
    """What the user sees after the receiver gets KilnRequestsRefused: `kubectl get kim` says
    Degraded, the condition says why with the share, one Warning Event; nothing is scaled or
    rolled back; the resolved notification clears it."""
    ns, name = "refusing", "iris"
    api.apply(model(ns, name, runtime={"replicas": 2}))  # no autoscaling: health is every model's
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job)
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("phase") == "Ready", 10, "Ready")

    firing = am.webhook(refused_alert(am, ns, name, value="0.98", ago=60))
    assert am.post(operator, firing) == (200, {"accepted": 1})
    st = api.wait(lambda: (lambda s: s if condition(s, "Degraded").get("reason") == "RequestsRefused" else None)(
        status(api, ns, name)), 10, "Degraded RequestsRefused")
    assert st["phase"] == "Degraded" and condition(st, "Degraded")["status"] == "True"
    said = condition(st, "Degraded")["message"]
    assert said.startswith("98% of the model's recent requests were refused (outcome bad_request or refused; "
                           "KilnRequestsRefused firing since ") and said.endswith(
        "the clients' inputs do not fit the model, or this version refuses them")
    assert condition(st, "Available")["status"] == "True"  # its pods still serve: they answer, with refusals
    [warning] = api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "RequestsRefused"], 5, "the Event")
    assert warning["type"] == "Warning" and warning["message"] == said

    # Alertmanager repeats it (a retry, repeat_interval): the record and the status stay, no second Event.
    assert am.post(operator, firing) == (200, {"duplicate": 1})
    import time
    time.sleep(0.5)
    assert [e["reason"] for e in api.events(ns, name)].count("RequestsRefused") == 1
    # A report only: the replicas and the version are what the spec asks.
    assert api.get("InferenceModel", ns, name)["spec"]["runtime"]["replicas"] == 2
    assert api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 2
    assert "scaling" not in status(api, ns, name) and "rollback" not in status(api, ns, name)

    resolved = am.webhook(refused_alert(am, ns, name, status="resolved", value="0.2"))
    resolved["alerts"][0]["startsAt"] = firing["alerts"][0]["startsAt"]
    assert am.post(operator, resolved) == (200, {"accepted": 1})
    st = api.wait(lambda: (lambda s: s if s.get("phase") == "Ready" else None)(status(api, ns, name)), 10, "Ready again")
    assert (condition(st, "Degraded")["status"], condition(st, "Degraded")["reason"]) == ("False", "AsExpected")
    assert [e["reason"] for e in api.events(ns, name)].count("RequestsRefused") == 1


# -- canary rollouts -------------------------------------------------------------------------
# The operator's analysis queries a real Prometheus (conftest's `prometheus`): the checks here
# are PromQL over constants and absent series, so they pass, fail or find no data on purpose.
# The tests play the Deployment controller for both tracks.

def canary_model(ns, name, check: dict, **rollout) -> dict:
    return model(ns, name, runtime={"replicas": 2}, rollout={
        "strategy": "Canary", "steps": [{"weight": 50, "pauseSeconds": 1}],
        "analysis": {"intervalSeconds": 5, "failureLimit": 0, "maxErrorRatio": None, "maxRefusedRatioIncrease": None,
                     "maxLatencyRatio": None,
                     "metrics": [check]}, **rollout})


def serving_then_version_2(api, ns, name, manifest) -> tuple[str, str]:
    """Version 1 Ready; then version 2 applied and built: (old key, new key)."""
    api.apply(manifest)
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job)
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("phase") == "Ready", 10, "Ready")
    api.patch("InferenceModel", ns, name, {"spec": {"model": {"version": "2"}}})
    new = api.wait(lambda: [j for j in jobs(api, ns) if j["metadata"]["name"] != job["metadata"]["name"]], 10)[0]
    finish_job(api, new)
    return request_of(job)["key"], request_of(new)["key"]


def roll_out_track(api, ns, deployment):
    dep = api.get("Deployment", ns, deployment)
    n = dep["spec"].get("replicas", 1)
    api.patch("Deployment", ns, deployment, {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
        "readyReplicas": n, "availableReplicas": n}}, subresource="status")


def needs_prometheus(prometheus):
    if prometheus is None:
        pytest.skip("Debian's prometheus is not installed (make test installs it): canary analysis needs it")


def test_a_canary_that_passes_its_analysis_is_promoted(api, operator, prometheus):
    needs_prometheus(prometheus)
    ns, name = "canary-good", "good"
    old, new = serving_then_version_2(api, ns, name, canary_model(ns, name, {"name": "ok", "query": "vector(0.01)",
                                                                               "max": 0.05}))
    canary = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)), 10, "the canary Deployment")
    assert canary["spec"]["replicas"] == 1  # 50% of 2
    assert canary["spec"]["template"]["metadata"]["labels"][contract.LABEL_ENGINE_KEY] == new
    stable = api.get("Deployment", ns, manifests.runtime_name(name))
    assert stable["spec"]["replicas"] == 2  # capacity first: stable shrinks only by Ready canary pods
    assert stable["spec"]["template"]["metadata"]["labels"][contract.LABEL_ENGINE_KEY] == old
    roll_out_track(api, ns, manifests.runtime_name(name, manifests.CANARY))
    st = api.wait(lambda: (status(api, ns, name).get("canary") or {}).get("weight") == 50 and status(api, ns, name),
                  10, "the canary's weight in effect")
    assert st["canary"]["engineKey"] == new
    assert (st["phase"], condition(st, "Progressing")["reason"]) == ("Progressing", "Canary")  # kubectl get kim says so
    # The step passes (vector(0.01) <= 0.05) and lasts 1 s; then the stable Deployment moves.
    # Promoted: the stable Deployment runs the new key at the full count (the count may
    # settle a pass after the key when the canary's pods change readiness meanwhile).
    api.wait(lambda: (lambda d: d["spec"]["template"]["metadata"]["labels"][contract.LABEL_ENGINE_KEY] == new
                      and d["spec"]["replicas"] == 2)(api.get("Deployment", ns, manifests.runtime_name(name))),
             15, "promotion at 2 replicas")
    roll_out_track(api, ns, manifests.runtime_name(name))
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)) is None, 10, "the canary removed")
    st = api.wait(lambda: not status(api, ns, name).get("canary") and status(api, ns, name), 10, "canary status gone")
    assert (st["engineKey"], st["stable"]["version"]) == (new, "2")
    api.wait(lambda: {"RolloutStarted", "Promoting", "Promoted", "CanaryRemoved"} <= {
        e["reason"] for e in api.events(ns, name)}, 5, "the rollout's Events")


def test_a_canary_that_fails_its_analysis_is_rolled_back_and_not_retried(api, operator, prometheus):
    needs_prometheus(prometheus)
    ns, name = "canary-bad", "bad"
    old, new = serving_then_version_2(api, ns, name, canary_model(ns, name, {"name": "errors", "query": "vector(0.5)",
                                                                               "max": 0.05}))
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)), 10, "the canary Deployment")
    roll_out_track(api, ns, manifests.runtime_name(name, manifests.CANARY))
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)) is None, 15, "the canary removed")
    st = api.wait(lambda: status(api, ns, name).get("rollback") and status(api, ns, name), 10, "status.rollback")
    assert st["rollback"]["engineKey"] == new and "errors = 0.5" in st["rollback"]["reason"]
    assert (condition(st, "Degraded")["reason"], condition(st, "Progressing")["reason"]) == ("RolledBack", "RolledBack")
    assert st["engineKey"] == old and not st.get("canary")
    [warning] = api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "RolledBack"], 5, "the Warning")
    assert warning["type"] == "Warning" and "vector(0.5)" in warning["message"] and "max 0.05" in warning["message"]
    assert api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 2  # all traffic on stable
    import time
    time.sleep(1.5)
    assert api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)) is None  # not retried until the spec changes


def test_no_data_pauses_the_rollout_and_abort_by_hand_rolls_it_back(api, operator, prometheus):
    needs_prometheus(prometheus)
    ns, name = "canary-nodata", "quiet"
    old, new = serving_then_version_2(api, ns, name, canary_model(ns, name, {
        "name": "gpu", "query": 'kiln_no_such_metric{model="{{model}}"}', "max": 1}))
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)), 10, "the canary Deployment")
    roll_out_track(api, ns, manifests.runtime_name(name, manifests.CANARY))
    st = api.wait(lambda: (status(api, ns, name).get("canary") or {}).get("phase") == "Paused" and status(api, ns, name),
                  15, "the rollout paused for want of data")
    assert st["canary"]["lastAnalysis"]["result"] == "Inconclusive"
    assert (st["phase"], condition(st, "Progressing")["reason"]) == ("Progressing", "RolloutPaused")
    assert api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["template"]["metadata"]["labels"][
        contract.LABEL_ENGINE_KEY] == old  # never promoted on no data
    api.patch("InferenceModel", ns, name, {"metadata": {"annotations": {"rollout.kiln.dev/action": "abort"}}})
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)) is None, 10, "the canary removed")
    st = api.wait(lambda: status(api, ns, name).get("rollback") and status(api, ns, name), 10, "status.rollback")
    assert "by hand" in st["rollback"]["reason"]
    meta = api.get("InferenceModel", ns, name)["metadata"]
    assert "rollout.kiln.dev/action" not in (meta.get("annotations") or {})  # taken


def test_a_newer_version_supersedes_a_running_rollout(api, operator, prometheus):
    needs_prometheus(prometheus)
    ns, name = "canary-superseded", "moving"
    old, v2 = serving_then_version_2(api, ns, name, canary_model(ns, name, {
        "name": "gpu", "query": 'kiln_no_such_metric{model="{{model}}"}', "max": 1}))  # v2 holds: no data
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)), 10, "v2's canary")
    roll_out_track(api, ns, manifests.runtime_name(name, manifests.CANARY))
    api.wait(lambda: (status(api, ns, name).get("canary") or {}).get("phase") == "Paused", 15, "v2 paused")
    api.patch("InferenceModel", ns, name, {"spec": {"model": {"version": "3"}}})
    v3_job = api.wait(lambda: [j for j in jobs(api, ns) if request_of(j)["model"]["version"] == "3"], 10)[0]
    # Until v3's engines exist no canary runs: v2's goes at once, stable keeps serving.
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)) is None, 10, "v2's canary removed")
    api.wait(lambda: "RolloutSuperseded" in [e["reason"] for e in api.events(ns, name)], 5, "the Event")
    assert api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["template"]["metadata"]["labels"][
        contract.LABEL_ENGINE_KEY] == old
    finish_job(api, v3_job)
    canary = api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name, manifests.CANARY)), 10, "v3's canary")
    assert canary["spec"]["template"]["metadata"]["labels"][contract.LABEL_ENGINE_KEY] == request_of(v3_job)["key"] != v2
    assert status(api, ns, name)["canary"]["version"] == "3"
