"""Playing the controllers the emulated API server lacks (tests/support/kubeemu.py), for the
operator's API-level tests: InferenceModel manifests, a build Job that finishes (its pod's
termination message, then the Job's condition, the order a Job controller reports them), a
Deployment that rolls out, and what a user reads back (status, conditions, Events)."""

from __future__ import annotations

import json

from kiln.operator import manifests
from kiln.runtime.api import contract


def model(ns: str, name: str, version: str = "1", **spec) -> dict:
    body = {"model": {"uri": f"https://models.example.com/{name}.onnx", "version": version},
            "engine": {"backend": "tensorrt", "precision": "fp16", "targets": ["H100"]},
            "runtime": {"replicas": 1}}
    for k, v in spec.items():
        body[k] = {**body.get(k, {}), **v}
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": ns}, "spec": body}


def jobs(api, ns):
    return api.list("Job", ns, selector=contract.LABEL_KEY)


def request_of(job: dict) -> dict:
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    return json.loads(args[args.index("--request") + 1])


def finish_job(api, job: dict, ok: bool = True, exit_code: int = 0, result: dict | None = None,
               job_reason: str = "BackoffLimitExceeded", job_message: str = "Job has reached the specified backoff limit"):
    """Play the Job controller and the kubelet: the build pod terminates, then the Job finishes."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    req = request_of(job)
    if result is None:
        result = ({"ok": True, "key": req["key"], "target": req["target"],
                   "path": f"{req['namespace']}/{req['name']}/{req['key']}", "sha256": "ab" * 32,
                   "sizeBytes": 123456789, "buildSeconds": 241.5, "cacheHit": False, "backend": "tensorrt",
                   "backendVersion": "10.13.0"} if ok else
                  {"ok": False, "reason": "DigestMismatch",
                   "message": "sha256 of https://models.example.com/x.onnx is 1234..., expected 9a0b..."})
    pod_name = f"{name}-{job['metadata']['uid'][:5]}"
    labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name,
              "job-name": name}
    api.apply({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "namespace": ns, "labels": labels,
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                 "uid": job["metadata"]["uid"], "controller": True}]},
               "spec": job["spec"]["template"]["spec"]})
    api.patch("Pod", ns, pod_name, {"status": {
        "phase": "Succeeded" if ok else "Failed",
        "containerStatuses": [{"name": "build", "ready": False, "restartCount": 0, "image": "kiln", "imageID": "",
                               "state": {"terminated": {"exitCode": exit_code, "reason": "Completed" if ok else "Error",
                                                        "message": json.dumps(result),
                                                        "finishedAt": "2026-01-01T00:04:01Z"}}}]}},
              subresource="status")
    cond = ({"type": "Complete", "status": "True"} if ok else
            {"type": "Failed", "status": "True", "reason": job_reason, "message": job_message})
    api.patch("Job", ns, name, {"status": {"conditions": [cond], "succeeded": 1 if ok else 0,
                                           "failed": 0 if ok else 1}}, subresource="status")


def roll_out(api, ns: str, name: str, ready: int | None = None):
    """Play the Deployment controller: every replica updated and (by default) Ready."""
    dep = api.get("Deployment", ns, manifests.runtime_name(name))
    n = dep["spec"].get("replicas", 1)
    ready = n if ready is None else ready
    api.patch("Deployment", ns, dep["metadata"]["name"], {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
        "readyReplicas": ready, "availableReplicas": ready}}, subresource="status")


def status(api, ns, name) -> dict:
    return (api.get("InferenceModel", ns, name) or {}).get("status") or {}


def condition(st: dict, type_: str) -> dict:
    return next((c for c in st.get("conditions") or () if c["type"] == type_), {})


def reasons(api, ns, name) -> list[str]:
    return [e["reason"] for e in api.events(ns, name)]
