"""Kiln on a real control plane: upstream kube-apiserver, controllers and scheduler, installed
with helm from its own chart, the operator running with the chart's ServiceAccount, build
and runtime pods running the real `kiln build` and `kiln serve` (tests/support/localcluster).

The tests run in file order and share the cluster; each uses its own namespace. The last one
upgrades and uninstalls the release.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from kiln.operator import manifests
from kiln.operator import signals
from kiln.runtime.api import contract

from support import snippets
from support.localcluster import HELM, INSTALL_VALUES, RELEASE, RELEASE_NAMESPACE
from support.localcluster.client import Api, ClientThreads, ServiceClients, dump, infer, pods, ready, service_endpoints, wait_for
from support.versions import (failing_on_real_inputs, refusing_real_inputs, retrained_version, save_version,
                              shifted_version, slow_version)
from support.localcluster.controlplane import A100, REPO, gateway_api_crds

pytestmark = pytest.mark.e2e

DEMO_MODEL = REPO / "examples" / "demo" / "model.onnx"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml")) + [REPO / "examples" / "demo" / "cluster.yaml"]
INVALID = sorted((REPO / "tests" / "api" / "invalid").glob("*.yaml"))
OPERATOR_SA = "kiln"
KIM = "/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels"
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferencemodels.kiln.dev"


def expected_messages(path: Path) -> list[str]:
    return [line[len("# expect: "):] for line in path.read_text().splitlines() if line.startswith("# expect: ")]


def operator_pod(api) -> dict:
    found = [p for p in pods(api, RELEASE_NAMESPACE, "app.kubernetes.io/component=operator")
             if not p["metadata"].get("deletionTimestamp")]
    return found[0] if len(found) == 1 and ready(found[0]) else None


# ------------------------------------------------------------------------ install

def test_helm_install_runs_the_operator_with_the_charts_service_account(api, kubectl, transcript):
    transcript.section("Kiln installed with helm")
    pod = wait_for(lambda: operator_pod(api), 120, "the operator pod Ready")
    assert pod["spec"]["serviceAccountName"] == OPERATOR_SA
    assert pod["spec"]["nodeName"] and pod["status"]["podIP"].startswith("127.")
    kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "wide", show=True)
    crd = kubectl("get", "crd", "inferencemodels.kiln.dev", "-o", "json")
    conditions = {c["type"]: c["status"] for c in json.loads(crd.stdout)["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"


def test_the_chart_grants_what_the_operator_needs_and_no_more(cluster, tmp_path):
    sa = cluster.service_account_kubeconfig(RELEASE_NAMESPACE, OPERATOR_SA, tmp_path / "sa.kubeconfig")

    def can(verb: str, resource: str, ns: str = "default") -> bool:
        answer = cluster.kubectl("auth", "can-i", verb, resource, "-n", ns, kubeconfig=sa, check=False)
        return answer.stdout.strip() == "yes"

    for verb, resource in [("create", "jobs.batch"), ("delete", "jobs.batch"), ("watch", "pods"),
                           ("patch", "deployments.apps"), ("create", "services"), ("patch", "configmaps"),
                           ("create", "events"), ("patch", "inferencemodels.kiln.dev/status"),
                           ("list", "customresourcedefinitions.apiextensions.k8s.io")]:
        assert can(verb, resource), f"the chart does not grant {verb} {resource}"
    for verb, resource in [("get", "secrets"), ("create", "pods"), ("delete", "nodes"),
                           ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
                           ("create", "serviceaccounts/token"), ("delete", "customresourcedefinitions")]:
        assert not can(verb, resource), f"the chart grants {verb} {resource}, which the operator never does"
    refused = cluster.kubectl("get", "secrets", "-n", RELEASE_NAMESPACE, kubeconfig=sa, check=False)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stderr


# ------------------------------------------------------------------------ the API

def test_kubectl_explain_reads_the_crd_descriptions(kubectl, transcript):
    out = kubectl("explain", "inferencemodel.spec.engine.precision", show=True).stdout
    assert "KIND:" in out and "InferenceModel" in out and "fp16" in out
    assert "uri" in kubectl("explain", "kim.spec.model").stdout


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_the_real_api_server_rejects_invalid_manifests_with_their_message(kubectl, api, namespace, path):
    manifest = yaml.safe_load(path.read_text())
    manifest["metadata"]["namespace"] = namespace
    result = kubectl("apply", "-f", "-", check=False, input=json.dumps(manifest))
    if "# operator-only" in path.read_text():  # a rule the CRD cannot express: the operator's answer
        assert result.returncode == 0, result.stderr
        engine_ready = wait_for(lambda: next((c for c in api.status(namespace, "bad").get("conditions") or ()
                                              if c["type"] == "EngineReady" and c["reason"] == "InvalidSpec"), None),
                                60, "EngineReady=False/InvalidSpec")
        assert engine_ready["message"] == "; ".join(expected_messages(path))
        return
    assert result.returncode != 0, f"{path.name} was accepted"
    for message in expected_messages(path):
        assert message in result.stderr, f"{path.name}: {message!r} not in {result.stderr!r}"


def test_every_example_is_accepted_and_listed_with_the_printer_columns(kubectl, namespace, api, transcript):
    transcript.section("Every example, applied")
    for path in EXAMPLES:
        manifest = yaml.safe_load(path.read_text())
        manifest["metadata"]["namespace"] = namespace
        out = kubectl("apply", "-f", "-", input=json.dumps(manifest)).stdout
        assert "created" in out
    names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in EXAMPLES}
    wait_for(lambda: all(api.status(namespace, n).get("phase") for n in names), 60, "a phase on every model")
    table = kubectl("get", "kim", "-n", namespace, show=True).stdout
    header = table.splitlines()[0].split()
    assert header[:6] == ["NAME", "PHASE", "VERSION", "ENGINE", "READY", "DESIRED"], header
    assert names <= {line.split()[0] for line in table.splitlines()[1:]}


def test_the_manifests_in_the_docs_pass_the_real_api_servers_dry_run(kubectl, namespace):
    """Every whole manifest in the docs and the README, in the test's namespace, through
    `kubectl apply --dry-run=server`: the CRDs' schemas and rules, admission, all but storage."""
    checked = []
    for doc in snippets.DOCS:
        for text in snippets.blocks(doc.relative_to(REPO), "yaml"):
            manifest = yaml.safe_load(text)
            if not isinstance(manifest, dict) or "kind" not in manifest:
                continue  # a fragment: spec fields, chart values, a scrape config
            if manifest["apiVersion"].startswith("keda.sh/"):
                continue  # KEDA's CRD is not installed here
            manifest["metadata"]["namespace"] = namespace
            result = kubectl("apply", "--dry-run=server", "-f", "-", check=False, input=json.dumps(manifest))
            assert result.returncode == 0, f"{doc.name}: {manifest['kind']}: {result.stderr}"
            checked.append(manifest["kind"])
    assert {"InferenceModel", "HorizontalPodAutoscaler", "HTTPRoute"} <= set(checked), checked


# ------------------------------------------------------------------------ a model, end to end

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_version(directory: Path, version: str) -> Path:
    """The demo model as version `version`: the same graph, other bytes (a metadata entry),
    so each version has its own digest and so its own engine key."""
    return save_version(directory, version, lambda model: None)


def iris(namespace: str, version: str, digest: str, replicas: int = 1, rollout: dict | None = None) -> dict:
    return {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
        "metadata": {"name": "iris", "namespace": namespace},
        "spec": {
            "model": {"uri": f"pvc://models/iris/{version}/model.onnx", "version": version, "sha256": digest},
            "engine": {"backend": "onnxruntime", "precision": "fp32", "targets": ["cpu"],
                       "profiles": [{"input": "features", "min": [1, 4], "opt": [8, 4], "max": [64, 4]}]},
            "runtime": {"replicas": replicas,
                        "nodeSelector": {"nvidia.com/gpu.product": A100},
                        "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                      "limits": {"nvidia.com/gpu": 1}},
                        "batching": {"maxBatchSize": 64, "maxQueueDelayMicroseconds": 500}},
            "rollout": rollout or {"strategy": "Recreate"},
        },
    }


def claim(api, namespace: str, name: str, mode: str = "ReadWriteMany") -> None:
    api.request("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}}})


def claim_directory(cluster, api, namespace: str, name: str) -> Path:
    wait_for(lambda: (api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}") or {})
             .get("status", {}).get("phase") == "Bound", 60, f"PVC {name} Bound")
    return cluster.kubelet.claim_directory(namespace, name)


def jobs(api, ns: str) -> list[dict]:
    return api.items(f"/apis/batch/v1/namespaces/{ns}/jobs")


def runtime_pods(api, ns: str) -> list[dict]:
    return [p for p in pods(api, ns, f"{contract.LABEL_MODEL}=iris") if not p["metadata"].get("deletionTimestamp")]


def test_apply_builds_serves_scales_rolls_and_cleans_up(cluster, api, kubectl, namespace, transcript):
    import onnxruntime

    transcript.section("A model from apply to Ready")
    models = demo_models(cluster, api, namespace)
    digests = {version: sha256(model_version(models, version)) for version in ("1", "2")}

    kubectl("apply", "-f", "-", input=json.dumps(iris(namespace, "1", digests["1"])))
    job = wait_for(lambda: jobs(api, namespace), 60, "the build Job")[0]
    build_pod = wait_for(lambda: pods(api, namespace, f"job-name={job['metadata']['name']}"), 60, "the build pod")[0]
    node = wait_for(lambda: (api.get(f"/api/v1/namespaces/{namespace}/pods/{build_pod['metadata']['name']}")
                             or {}).get("spec", {}).get("nodeName"), 60, "the build pod scheduled")
    assert node.startswith("builder-"), f"the build pod ran on {node}, not a builder node"

    wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready", 180,
             f"phase Ready (status: {dump(api.status(namespace, 'iris'))})")
    status = api.status(namespace, "iris")
    engine = status["engines"][0]
    assert engine["sha256"] and engine["architecture"] == "cpu"
    cache = claim_directory(cluster, api, namespace, "kiln-engine-cache")
    assert (cache / engine["path"] / "manifest.json").exists(), "the engine is not in the cache PVC"
    kubectl("get", "kim", "-n", namespace, show=True)
    kubectl("get", "jobs,deployments,services", "-n", namespace, show=True)

    [pod] = runtime_pods(api, namespace)
    assert ready(pod) and pod["spec"]["nodeName"] == "gpu-a100-0", pod["spec"]["nodeName"]
    rows = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]
    answer = infer(pod, rows)
    direct = onnxruntime.InferenceSession(str(DEMO_MODEL)).run(None, {"features": np.array(rows, np.float32)})
    outputs = {o["name"]: o for o in answer["outputs"]}
    np.testing.assert_allclose(outputs["probabilities"]["data"], direct[0].ravel(), rtol=1e-5)
    assert outputs["species"]["data"] == direct[1].ravel().tolist()

    # Pods that were still starting were a rollout, not a degradation.
    reasons = [e["reason"] for e in api.items(f"/api/v1/namespaces/{namespace}/events")
               if e["involvedObject"]["kind"] == "InferenceModel"]
    assert "Degraded" not in reasons, reasons

    # The scale subresource: kubectl scale -> the Deployment -> two pods Ready.
    kubectl("scale", "kim", "iris", "-n", namespace, "--replicas=2", show=True)
    wait_for(lambda: len([p for p in runtime_pods(api, namespace) if ready(p)]) == 2
             and api.status(namespace, "iris").get("readyReplicas") == 2, 120, "two ready replicas")

    # A new version: its engine is built before anything running changes, then the real
    # Deployment controller rolls the pods.
    old_key = status["engineKey"]
    kubectl("apply", "-f", "-", input=json.dumps(iris(namespace, "2", digests["2"], replicas=2)))
    new_job = wait_for(lambda: [j for j in jobs(api, namespace) if old_key not in j["metadata"]["name"]], 60,
                       "the new version's build Job")[0]
    new_key = new_job["metadata"]["labels"][contract.LABEL_KEY]
    deployment = api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/iris-runtime")
    if not api.status(namespace, "iris").get("engineKey") == new_key:
        assert deployment["spec"]["template"]["metadata"]["labels"][contract.LABEL_ENGINE_KEY] == old_key
    wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready"
             and api.status(namespace, "iris").get("engineKey") == new_key
             and all(p["metadata"]["labels"].get(contract.LABEL_ENGINE_KEY) == new_key and ready(p)
                     for p in runtime_pods(api, namespace))
             and len(runtime_pods(api, namespace)) == 2, 240, "version 2 rolled out")
    infer(runtime_pods(api, namespace)[0], rows)
    kubectl("get", "kim", "-n", namespace, "-o", "wide", show=True)

    # Restarting the operator (its pod, deleted; the Deployment controller makes another)
    # creates nothing twice.
    before = {kind: sorted(o["metadata"]["uid"] for o in api.items(path)) for kind, path in (
        ("jobs", f"/apis/batch/v1/namespaces/{namespace}/jobs"),
        ("deployments", f"/apis/apps/v1/namespaces/{namespace}/deployments"),
        ("services", f"/api/v1/namespaces/{namespace}/services"))}
    old_operator = operator_pod(api)
    kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, old_operator["metadata"]["name"])
    wait_for(lambda: (operator_pod(api) or {}).get("metadata", {}).get("uid") not in (None, old_operator["metadata"]["uid"]),
             120, "a new operator pod Ready")
    kubectl("annotate", "kim", "iris", "-n", namespace, "e2e/poke=1")  # an event for the new operator
    wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready", 30, "Ready after the restart")
    after = {kind: sorted(o["metadata"]["uid"] for o in api.items(path)) for kind, path in (
        ("jobs", f"/apis/batch/v1/namespaces/{namespace}/jobs"),
        ("deployments", f"/apis/apps/v1/namespaces/{namespace}/deployments"),
        ("services", f"/api/v1/namespaces/{namespace}/services"))}
    assert after == before

    kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceModel",
            "--sort-by=.lastTimestamp", show=True)

    # Deleting the model: the real garbage collector removes what it owned.
    kubectl("delete", "kim", "iris", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(lambda: not api.items(f"/apis/apps/v1/namespaces/{namespace}/deployments")
             and not api.items(f"/api/v1/namespaces/{namespace}/services")
             and not runtime_pods(api, namespace)
             and not jobs(api, namespace), 120, "the garbage collector to remove the model's children")


# ------------------------------------------------------------------------ a write the API server refuses

def test_a_build_job_the_api_server_refuses_is_a_condition_and_a_warning_until_the_spec_is_fixed(
        api, kubectl, namespace, transcript):
    transcript.section("A write the API server refuses")
    model = iris(namespace, "1", "0" * 64)
    # The CRD passes core ResourceRequirements through; the core API refuses requests above limits.
    model["spec"]["build"] = {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}
    kubectl("apply", "-f", "-", input=json.dumps(model))

    def conditions() -> dict:
        return {c["type"]: c for c in api.status(namespace, "iris").get("conditions") or ()}

    refused = wait_for(lambda: conditions() if conditions().get("Degraded", {}).get("reason") == "ApiRefused" else None,
                       60, f"Degraded=ApiRefused (status: {dump(api.status(namespace, 'iris'))})")
    message = refused["Degraded"]["message"]
    assert message.startswith(f"the API server refused to create Job {namespace}/kiln-build-"), message
    assert "(422 Invalid)" in message and "must be less than or equal to cpu limit of 1" in message, message
    assert (refused["EngineReady"]["reason"], refused["EngineReady"]["message"]) == ("ApiRefused", message)
    assert api.status(namespace, "iris")["phase"] == "Degraded" and not jobs(api, namespace)
    events = f"/api/v1/namespaces/{namespace}/events"
    [warning] = wait_for(lambda: [e for e in api.items(events) if e["reason"] == "ApiRefused"], 30, "the Warning")
    assert (warning["type"], warning["message"], warning["involvedObject"]["name"]) == ("Warning", message, "iris")
    kubectl("get", "kim", "-n", namespace, show=True)
    kubectl("get", "events", "-n", namespace, "--field-selector", "reason=ApiRefused",
            "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message", show=True)

    # Fixed: the Job is created, and the refusal is gone from status.
    kubectl("patch", "kim", "iris", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"build": {"resources": {"requests": {"cpu": "1"}}}}}))
    wait_for(lambda: jobs(api, namespace), 60, "the build Job, once the spec is fixed")
    fixed = wait_for(lambda: conditions() if conditions()["Degraded"]["reason"] != "ApiRefused" else None, 30,
                     "Degraded no longer ApiRefused")
    assert fixed["EngineReady"]["reason"] == "Building"
    assert len([e for e in api.items(events) if e["reason"] == "ApiRefused"]) == 1  # told once


def test_the_documented_copy_puts_ones_own_model_on_the_local_clusters_models_claim(cluster, api, tmp_path):
    """docs/e2e.md's commands, as pasted, against the claim `models` in `default` (make cluster
    makes it): the file lands in the directory the harness mounts for that claim."""
    path = "/api/v1/namespaces/default/persistentvolumeclaims/models"
    made = api.get(path) is None
    if made:
        claim(api, "default", "models")
    try:
        directory = claim_directory(cluster, api, "default", "models")
        shutil.copy(DEMO_MODEL, tmp_path / "my-model.onnx")
        [commands] = snippets.blocks("docs/e2e.md", "sh", "Your own model on the `models` claim")
        copied = cluster.shell(commands, tmp_path)
        assert copied.returncode == 0, copied.stdout
        assert (directory / "mine" / "model.onnx").read_bytes() == DEMO_MODEL.read_bytes()
        assert sha256(DEMO_MODEL) in copied.stdout
    finally:
        if made:
            api.request("DELETE", path)


# ------------------------------------------------------------------------ autoscaling from real alerts

# The chart's rules with windows short enough for a test (the shipped ones are minutes).
TEST_WINDOWS = {"highFor": "3s", "lowFor": "3s", "missingFor": "10s", "rateWindow": "4s", "surgeWindow": "4s",
                "interval": "1s"}


def chart_rules(path: Path) -> Path:
    import subprocess

    sets = [f"autoscaling.rules.{k}={v}" for k, v in TEST_WINDOWS.items()] + ["autoscaling.rulesConfigMap.enabled=true"]
    rendered = subprocess.run([str(HELM), "template", "kiln", str(REPO / "charts" / "kiln"),
                               "--show-only", "templates/autoscaling-rules.yaml",
                               *[a for kv in sets for a in ("--set", kv)]],
                              check=True, stdout=subprocess.PIPE, text=True, timeout=60).stdout
    configmap = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap")
    path.write_text(configmap["data"]["kiln-autoscaling.rules.yaml"])
    return path


def demo_models(cluster, api, namespace: str) -> Path:
    """The claims a model needs in `namespace`, and the directory behind `models`."""
    claim(api, namespace, "kiln-engine-cache")
    claim(api, namespace, "models", "ReadOnlyMany")
    return claim_directory(cluster, api, namespace, "models")


def pod_discovery(cluster, namespace: str):
    """The namespace's pods served to Prometheus over http_sd (Debian's has no Kubernetes SD)."""
    from support import monitoring

    cp = cluster.control_plane
    return monitoring.PodDiscovery(cp.server, [namespace], ca_file=str(cp.ca), cert_file=str(cp.root / "pki" / "admin.crt"),
                                   key_file=str(cp.root / "pki" / "admin.key")).start()


class Load(ClientThreads):
    """Clients a user's traffic would be: `threads` loops of `rows`-row requests over the Ready
    runtime pods (round robin, as a Service would spread them)."""

    def __init__(self, api, namespace: str, threads: int = 8, rows: int = 64) -> None:
        super().__init__([(self._run, ())] * threads)
        self.api, self.namespace, self.errors, self.rows = api, namespace, 0, rows

    def _run(self) -> None:
        rows = [[5.1, 3.5, 1.4, 0.2]] * self.rows
        i = 0
        while not self.stop_flag.is_set():
            ready_pods = [p for p in runtime_pods(self.api, self.namespace) if ready(p)]
            for pod in ready_pods[i % max(len(ready_pods), 1):][:1]:
                try:
                    for _ in range(20):
                        infer(pod, rows)
                except OSError:
                    self.errors += 1
            i += 1


def utilization(pod: dict, seconds: float = 3.0) -> dict[str, float]:
    """The runtime's own signals, read straight from the pod over `seconds`, as the chart's rules
    combine them for a CPU engine: the engine's busy fraction, the front ends' and the CPU over
    the pod's limit ("pod": the highest)."""
    import re
    import time

    def read() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/metrics", timeout=5).read().decode()
        return {name: float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))
                for name in ("kiln_engine_busy_seconds_total", "kiln_pod_front_end_busy_seconds_total",
                             "kiln_pod_cpu_seconds_total", "kiln_pod_cpu_limit_cores")}

    before = read()
    time.sleep(seconds)
    after = read()
    rate = {k: (after[k] - before[k]) / seconds for k in after}
    out = {"engine": rate["kiln_engine_busy_seconds_total"], "front_end": rate["kiln_pod_front_end_busy_seconds_total"],
           "cpu": rate["kiln_pod_cpu_seconds_total"] / after["kiln_pod_cpu_limit_cores"]}
    return {**out, "pod": max(out.values())}


def test_real_alerts_scale_a_model_up_under_load_hold_without_data_and_scale_down(
        cluster, api, kubectl, namespace, transcript, tmp_path):
    """The whole loop, every part real: `kiln serve` pods under load -> Prometheus (scrape, the
    chart's rules) -> Alertmanager (the documented route, the chart's token) -> the operator's
    receiver -> the scaling step -> spec.runtime.replicas -> the Deployment controller -> a new
    pod started and Ready; no data holds; idle scales back down after its window."""
    import base64
    import time

    from support import monitoring

    if monitoring.unavailable():
        pytest.skip(monitoring.unavailable())
    transcript.section("Autoscaling from real Prometheus and Alertmanager alerts")
    models = demo_models(cluster, api, namespace)
    # The light demo model: its engine stays ~5-30% busy under this load, its front ends and
    # its CPU do not (the rules scale a CPU pod on the highest of the three).
    model = iris(namespace, "1", sha256(model_version(models, "1")))
    model["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetGPUUtilization": 10,
                                    "maxStep": 1, "scaleUpCooldownSeconds": 0, "scaleDownCooldownSeconds": 0,
                                    "scaleDownStabilizationSeconds": 4}
    kubectl("apply", "-f", "-", input=json.dumps(model))
    wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready", 180, "phase Ready")

    op = wait_for(lambda: operator_pod(api), 60, "the operator pod")
    port = INSTALL_VALUES["autoscaling"]["receiver"]["port"]
    [documented] = snippets.blocks("docs/e2e.md", "yaml", "Alertmanager on the local cluster")
    receiver = yaml.safe_load(documented)[0]["url"]  # the operator's listener, not a Service name
    assert receiver == f"http://127.0.0.1:{port}/alerts"
    secret = api.get(f"/api/v1/namespaces/{RELEASE_NAMESPACE}/secrets/{RELEASE}-alert-token")
    token_file = tmp_path / "token"
    token_file.write_text(base64.b64decode(secret["data"]["token"]).decode())
    discovery = pod_discovery(cluster, namespace)
    # No repeats within the test: each step after the first comes from the same delivery.
    am = monitoring.Alertmanager(tmp_path / "am", monitoring.kiln_alertmanager_config(
        receiver, str(token_file), repeat_interval="1h"))
    prom = monitoring.Prometheus(tmp_path / "prom", rule_files=[chart_rules(tmp_path / "kiln.rules.yaml")],
                                 alertmanagers=[am.url], scrape_configs=[
                                     monitoring.pod_http_sd_scrape_config(discovery.url),
                                     monitoring.operator_scrape_config(f"{op['status']['podIP']}:{port}",
                                                                       labels={"namespace": RELEASE_NAMESPACE})])
    history = lambda: (api.status(namespace, "iris").get("scaling") or {}).get("history") or []  # noqa: E731
    spec_replicas = lambda: api.model(namespace, "iris")["spec"]["runtime"]["replicas"]  # noqa: E731
    try:
        am.start()
        prom.start()
        prom.wait_for(f'kiln:utilization:ratio{{namespace="{namespace}",model="iris"}}', timeout=60)
        prom.wait_for(f'kiln_autoscaling_target_ratio{{namespace="{namespace}",model="iris"}} == 0.1', timeout=30)

        # 1. No data: Prometheus down while real load runs. Nothing may move.
        prom.stop()
        with Load(api, namespace, rows=1) as load:
            [pod] = [p for p in runtime_pods(api, namespace) if ready(p)]
            seen = utilization(pod)
            print(f"\nunder load: {seen}")
            # Small requests: the HTTP around them, not the engine, is what keeps the pod busy.
            assert seen["pod"] > 0.2, f"the load keeps the pod {seen} busy, over twice the 10% target"
            assert max(seen["front_end"], seen["cpu"]) > seen["engine"], seen
            time.sleep(12)  # > highFor + group_wait + a decision, many times over
            assert spec_replicas() == 1 and "UtilizationHigh" not in [h["reason"] for h in history()]

            # 2. Prometheus back: the same load scales up through the whole chain, and keeps
            # stepping toward its goal (>= 3) on the one delivery, the model Ready throughout.
            phases: list[str] = []

            def replicas_seen() -> int:
                phases.append(api.status(namespace, "iris").get("phase"))
                return spec_replicas()

            t0 = time.monotonic()
            prom.start()
            wait_for(lambda: replicas_seen() >= 2, 90, "spec.runtime.replicas 1 -> 2 from KilnUtilizationHigh or Surge")
            decided = time.monotonic() - t0
            entry = wait_for(lambda: [h for h in history() if h["reason"] == "UtilizationHigh"], 10, "the decision")[0]
            # Over twice the target: Surge may fire before High's `for` is up; either steps up.
            assert (entry["from"], entry["to"]) == (1, 2) and entry["source"] in signals.UP, entry
            # kubectl describe says what the rules read for this CPU model
            assert api.status(namespace, "iris")["scaling"]["signal"].startswith("cpu: per pod the highest of")
            wait_for(lambda: replicas_seen() == 3, 120, "2 -> 3 once the second pod is Ready, with no new delivery")
            steps = lambda: [(h["from"], h["to"]) for h in history() if h["reason"] == "UtilizationHigh"]  # noqa: E731
            wait_for(lambda: steps() == [(1, 2), (2, 3)], 10, f"both steps in status.scaling.history: {steps()}")
            wait_for(lambda: replicas_seen() and len([p for p in runtime_pods(api, namespace) if ready(p)]) == 3, 120,
                     "the new pods started by the real Deployment controller, Ready")
            print(f"\nPrometheus start -> replicas patched {decided:.1f} s, -> 3 pods Ready "
                  f"{time.monotonic() - t0:.1f} s; load errors {load.errors}; phases seen {sorted(set(phases))}")
            assert set(phases) == {"Ready"}, phases  # serving and scaling: never Deploying or Degraded
            kubectl("get", "inferencemodel", "iris", "-n", namespace, show=True)

        # 3. Idle: KilnUtilizationLow, then the stabilization window, then steps down to 1.
        wait_for(lambda: spec_replicas() == 1, 90, "spec.runtime.replicas 3 -> 1 from KilnUtilizationLow")
        wait_for(lambda: history()[-1]["reason"] == "UtilizationLow", 10, "the decision in status")
        assert "Stabilizing" in [h["reason"] for h in history()]
        wait_for(lambda: len(runtime_pods(api, namespace)) == 1, 60, "the extra pod gone")
        kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceModel",
                "-o", "custom-columns=REASON:.reason,MESSAGE:.message", show=True)
        kubectl("get", "inferencemodel", "iris", "-n", namespace, "-o", "jsonpath={.status.scaling}", show=True)
    finally:
        prom.stop()
        am.stop()
        discovery.stop()
    # The real receiver refuses an unauthenticated payload.
    request = urllib.request.Request(receiver, data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401

    # An HPA instead of Kiln's autoscaler: the real HPA controller drives the scale subresource
    # (with no metrics API here it can only enforce its minReplicas, which is enough to show it).
    kubectl("patch", "inferencemodel", "iris", "-n", namespace, "--type=merge",
            "-p", '{"spec": {"autoscaling": {"enabled": false}}}')
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "iris", "namespace": namespace},
        "spec": {"scaleTargetRef": {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel", "name": "iris"},
                 "minReplicas": 2, "maxReplicas": 3,
                 "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                     "type": "Utilization", "averageUtilization": 70}}}]}}))
    wait_for(lambda: spec_replicas() == 2, 60, "the HPA controller raising spec.runtime.replicas to its minimum")
    wait_for(lambda: len([p for p in runtime_pods(api, namespace) if ready(p)]) == 2, 120, "2 pods Ready")
    kubectl("get", "hpa", "iris", "-n", namespace, show=True)


# ------------------------------------------------------------------------ scale-down: which pod goes

def deletion_cost(pod: dict) -> int | None:
    value = (pod["metadata"].get("annotations") or {}).get("controller.kubernetes.io/pod-deletion-cost")
    return None if value is None else int(value)


class Traffic:
    """Clients sending to one pod directly (its pod IP): `threads` loops of `rows`-row
    requests. Every outcome is counted: answered (200), refused before it was taken (503:
    the pod drains; connection refused: it is gone) and lost (sent, then no answer). With
    `until_refused` a client stops at its first refusal, as a Service stops sending to a pod
    that drains (its endpoint goes with readiness): what it sent before, the pod took."""

    def __init__(self, pod: dict, threads: int, rows: int, pause: float = 0.0, until_refused: bool = False) -> None:
        import collections
        import threading

        self.pod, self.rows, self.pause, self.until_refused = pod, rows, pause, until_refused
        self.stop_flag, self.lock = threading.Event(), threading.Lock()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.lost: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _one(self) -> str:
        import http.client

        try:
            infer(self.pod, [[5.1, 3.5, 1.4, 0.2]] * self.rows)
            return "answered"
        except urllib.error.HTTPError as e:
            return "refused" if e.code == 503 else f"http {e.code}"
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                return "refused"
            self.lost.append(repr(e))
            return "lost"
        except (http.client.HTTPException, ConnectionError, TimeoutError) as e:  # reset, closed mid-answer
            self.lost.append(repr(e))
            return "lost"

    def _run(self) -> None:
        import time

        while not self.stop_flag.is_set():
            outcome = self._one()
            with self.lock:
                self.outcomes[outcome] += 1
            if outcome == "refused" and self.until_refused:
                return
            time.sleep(self.pause)

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(30)


def test_a_scale_down_removes_the_idlest_pod_and_answers_every_request_in_flight(
        cluster, api, kubectl, namespace, transcript):
    """Two replicas, one of them loaded (requests to its pod IP), the other nearly idle:
    `kubectl scale kim --replicas=1` -> the operator sets each Ready pod's load as its
    pod-deletion-cost, then the replicas -> the ReplicaSet controller removes the idle pod,
    which drains: every request either pod took is answered. The model's
    PodDisruptionBudget is there (the local control plane runs no disruption controller, so
    nothing here evicts; a scale-down deletes, which no budget governs)."""
    import re
    import time

    transcript.section("A scale-down removes the idlest pod")
    models = demo_models(cluster, api, namespace)
    kubectl("apply", "-f", "-", input=json.dumps(iris(namespace, "1", sha256(model_version(models, "1")), replicas=2)))
    wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready"
             and len([p for p in runtime_pods(api, namespace) if ready(p)]) == 2, 180, "two replicas Ready")
    pdb = wait_for(lambda: api.get(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/iris"), 30,
                   "the model's PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["metadata"]["ownerReferences"][0]["name"] == "iris"
    kubectl("get", "pdb", "-n", namespace, show=True)

    busy, idle = sorted((p for p in runtime_pods(api, namespace) if ready(p)), key=lambda p: p["metadata"]["name"])

    def busy_ratio(pod: dict) -> float:
        text = urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/metrics", timeout=5).read().decode()
        return float(re.search(r"^kiln_engine_busy_ratio\{[^}]*\} (\S+)$", text, re.M).group(1))

    with Traffic(busy, threads=6, rows=64) as heavy, Traffic(idle, threads=1, rows=1, pause=0.05,
                                                                      until_refused=True) as light:
        wait_for(lambda: busy_ratio(busy) > 10 * max(busy_ratio(idle), 0.001), 30, "the loaded pod the busier")
        started = time.monotonic()
        kubectl("scale", "kim", "iris", "-n", namespace, "--replicas=1", show=True)
        wait_for(lambda: [p["metadata"]["name"] for p in pods(api, namespace, f"{contract.LABEL_MODEL}=iris")]
                 == [busy["metadata"]["name"]], 120, "the idle pod removed")
        removed_after = time.monotonic() - started
        time.sleep(1)  # the loaded pod keeps answering after the scale-down
    kept = api.get(f"/api/v1/namespaces/{namespace}/pods/{busy['metadata']['name']}")
    assert ready(kept) and deletion_cost(kept) and deletion_cost(kept) > 0, kept["metadata"].get("annotations")
    assert api.status(namespace, "iris").get("readyReplicas") == 1
    assert heavy.lost == [] and light.lost == [], (heavy.lost, light.lost)
    assert set(heavy.outcomes) == {"answered"}, heavy.outcomes  # the pod left never refused
    assert light.outcomes["answered"] > 0 and set(light.outcomes) <= {"answered", "refused"}, light.outcomes
    events = [e["message"] for e in api.items(f"/api/v1/namespaces/{namespace}/events")
              if e["involvedObject"]["kind"] == "InferenceModel" and e["reason"] == "ScaleDownUnordered"]
    assert events == []
    transcript.add("# outcomes", f"loaded pod kept (cost {deletion_cost(kept)}): {dict(heavy.outcomes)}; "
                                 f"idle pod removed after {removed_after:.1f} s: {dict(light.outcomes)}")


# ------------------------------------------------------------------------ traffic: Gateway API HTTPRoutes

HTTPROUTES = "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes"
JSON_PATCH = "application/json-patch+json"


def httproute(namespace: str, model: str, stable: int, canary: int) -> dict:
    """A user's route to a model during a canary: its Service and the canary's, weighted."""
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": model, "namespace": namespace},
            "spec": {"parentRefs": [{"name": "inference"}],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": f"/v2/models/{model}"}}],
                                "backendRefs": [{"name": model, "port": contract.SERVICE_PORT, "weight": stable},
                                                {"name": f"{model}-canary", "port": contract.SERVICE_PORT,
                                                 "weight": canary}]}]}}


def backend_weights(route: dict) -> list[tuple[str, int]]:
    return [(ref["name"], ref["weight"]) for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]


def test_the_operator_shifts_httproute_weights_and_the_gateway_api_crd_refuses_bad_ones(
        cluster, api, namespace, tmp_path):
    # The standard channel of sigs.k8s.io/gateway-api at the version the build script pins.
    crd = api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/httproutes.gateway.networking.k8s.io")
    annotations = crd["metadata"]["annotations"]
    assert annotations["gateway.networking.k8s.io/channel"] == "standard"
    assert f"gateway-api-{annotations['gateway.networking.k8s.io/bundle-version']}" == gateway_api_crds().parent.name
    # No Gateway controller runs here: the API server checks the route (schema and CEL), nothing routes it.
    model, canary = "iris", "iris-canary"
    routes, path = HTTPROUTES.format(ns=namespace), HTTPROUTES.format(ns=namespace) + "/iris"
    api.request("POST", routes, httproute(namespace, model, 90, 10))  # the user's route; Kiln never creates one

    operator = Api(cluster.service_account_kubeconfig(RELEASE_NAMESPACE, OPERATOR_SA, tmp_path / "sa.kubeconfig"))
    assert [r["metadata"]["name"] for r in operator.items(routes)] == [model]
    route = operator.get(path)
    assert backend_weights(route) == [(model, 90), (canary, 10)]
    operator.request("PATCH", path, manifests.route_weights_patch(route, {model: 50, canary: 50}), JSON_PATCH)
    assert backend_weights(operator.get(path)) == [(model, 50), (canary, 50)]

    # A route whose refs moved since it was read: the patch's tests fail it whole, nothing is written.
    stale = operator.get(path)
    moved = httproute(namespace, model, 50, 50)["spec"]
    moved["rules"][0]["backendRefs"].reverse()
    api.request("PATCH", path, {"spec": moved}, "application/merge-patch+json")
    with pytest.raises(operator.ApiError) as refused:
        operator.request("PATCH", path, manifests.route_weights_patch(stale, {model: 0, canary: 100}), JSON_PATCH)
    assert refused.value.status == 422, refused.value
    assert backend_weights(operator.get(path)) == [(canary, 50), (model, 50)]

    # Weights out of the CRD's range are refused with its message.
    route = operator.get(path)
    for weight, message in [(-1, "should be greater than or equal to 0"),
                            (1000001, "should be less than or equal to 1000000")]:
        with pytest.raises(operator.ApiError) as refused:
            operator.request("PATCH", path, manifests.route_weights_patch(route, {canary: weight}), JSON_PATCH)
        assert refused.value.status == 422 and "spec.rules[0].backendRefs[0].weight" in refused.value.message
        assert message in refused.value.message, refused.value.message
    # The CRD's CEL rules run too: a Service backend needs a port.
    portless = httproute(namespace, "portless", 90, 10)
    del portless["spec"]["rules"][0]["backendRefs"][1]["port"]
    with pytest.raises(api.ApiError) as refused:
        api.request("POST", routes, portless)
    assert "Must have port for Service reference" in refused.value.message, refused.value.message

    # The chart grants get/list/watch/patch on routes, no more.
    for method, target, body in [("POST", routes, httproute(namespace, "other", 1, 1)), ("DELETE", path, None)]:
        with pytest.raises(operator.ApiError) as forbidden:
            operator.request(method, target, body)
        assert forbidden.value.status == 403, forbidden.value


# ------------------------------------------------------------------------ canary rollouts, analyzed

def test_a_good_canary_is_promoted_step_by_step_and_a_slow_one_rolled_back(cluster, api, kubectl, namespace,
                                                                            transcript, tmp_path):
    """Real `kiln serve` pods of each version under load, scraped by a real Prometheus that
    the operator queries at every step; the HTTPRoute's weights follow the steps."""
    import time

    from support import monitoring
    from support.localcluster import PROMETHEUS_PORT

    if monitoring.unavailable():
        pytest.skip(monitoring.unavailable())
    transcript.section("A canary rollout, analyzed at every step")
    models = demo_models(cluster, api, namespace)
    rollout = {"strategy": "Canary", "steps": [{"weight": 25, "pauseSeconds": 3}, {"weight": 50, "pauseSeconds": 3}],
               "analysis": {"intervalSeconds": 5, "failureLimit": 0, "maxErrorRatio": 0.05, "maxLatencyRatio": 3},
               "traffic": {"mechanism": "GatewayAPI", "httpRoute": "iris", "grpcRoute": "iris-grpc"}}
    for kind, name, port in (("HTTPRoute", "iris", 8080), ("GRPCRoute", "iris-grpc", 8081)):
        kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"parentRefs": [{"name": "shared-gateway"}], "rules": [{"backendRefs": [
                {"name": "iris", "port": port, "weight": 100},
                {"name": "iris-canary", "port": port, "weight": 0}]}]}}))

    def route_weights(plural: str, name: str) -> dict[str, int]:
        return {r["name"]: r["weight"] for r in api.get(
            f"/apis/gateway.networking.k8s.io/v1/namespaces/{namespace}/{plural}/{name}")["spec"]["rules"][0]["backendRefs"]}

    weights = lambda: route_weights("httproutes", "iris")  # noqa: E731
    grpc_weights = lambda: route_weights("grpcroutes", "iris-grpc")  # noqa: E731
    apply = lambda version, path: kubectl("apply", "-f", "-", input=json.dumps(  # noqa: E731
        iris(namespace, version, sha256(path), replicas=2, rollout=rollout)))
    apply("1", model_version(models, "1"))
    wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready", 180, "version 1 Ready")

    discovery = pod_discovery(cluster, namespace)
    prom = monitoring.Prometheus(tmp_path / "prom", scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url)])
    prom.port = PROMETHEUS_PORT  # where the chart's --prometheus-url points (tests/support/localcluster)
    status = lambda: api.status(namespace, "iris")  # noqa: E731
    try:
        prom.start()
        with Load(api, namespace):
            prom.wait_for(f'kiln_requests_total{{namespace="{namespace}"}}', timeout=60)

            # A good version: every step analyzed and passed, the route's weights follow, promoted.
            apply("2", model_version(models, "2"))
            seen_weights, seen_grpc_weights, seen_phases = set(), set(), set()
            def promoted() -> bool:
                seen_weights.add(weights()["iris-canary"])
                seen_grpc_weights.add(grpc_weights()["iris-canary"])
                st = status()
                seen_phases.add(st.get("phase"))
                return st.get("stable", {}).get("version") == "2" and not st.get("canary")
            wait_for(promoted, 240, "version 2 promoted through both steps")
            assert {25, 50} <= seen_weights and weights() == {"iris": 100, "iris-canary": 0}
            assert "Progressing" in seen_phases, seen_phases  # the phase `kubectl get kim` shows during the steps
            # gRPC clients' route follows the same steps.
            assert {25, 50} <= seen_grpc_weights and grpc_weights() == {"iris": 100, "iris-canary": 0}
            wait_for(lambda: {"RolloutStarted", "RolloutStep", "Promoting", "Promoted", "TrafficShifted"} <= {
                e["reason"] for e in api.items(f"/api/v1/namespaces/{namespace}/events")
                if e["involvedObject"]["kind"] == "InferenceModel"}, 30, "the rollout's Events")
            wait_for(lambda: not api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/iris-canary"), 60,
                     "the canary Deployment gone")
            kubectl("get", "inferencemodel", "iris", "-n", namespace, show=True)

            # A slow version: its p99 latency against stable's fails the first analysis: rolled back.
            good_key = status()["engineKey"]
            apply("3", slow_version(models, "3"))
            st = wait_for(lambda: status().get("rollback") and status(), 240, "version 3 rolled back")
            assert "latency-p99-ratio" in st["rollback"]["reason"] and st["engineKey"] == good_key
            assert (st["stable"]["version"], weights()) == ("2", {"iris": 100, "iris-canary": 0})
            assert grpc_weights() == {"iris": 100, "iris-canary": 0}
            conditions = {c["type"]: c for c in st["conditions"]}
            assert conditions["Degraded"]["reason"] == "RolledBack"
            wait_for(lambda: not api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/iris-canary"), 60,
                     "the canary removed")
            time.sleep(3)
            assert not api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/iris-canary")  # not retried
        kubectl("get", "inferencemodel", "iris", "-n", namespace, show=True)
        kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceModel",
                "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message", show=True)
    finally:
        prom.stop()
        discovery.stop()


# ------------------------------------------------------------------------ shadow canaries

SHADOW_ROLLOUT = {"strategy": "Canary",
                  "shadow": {"enabled": True, "percent": 100, "maxRequestsPerSecond": 50, "pauseSeconds": 5},
                  "steps": [{"weight": 50, "pauseSeconds": 3}],
                  "analysis": {"intervalSeconds": 5, "failureLimit": 0, "maxErrorRatio": 0.05, "maxLatencyRatio": 5,
                               "agreement": {"minSamples": 10, "classOutputs": ["probabilities"]}}}


def test_shadow_canaries_roll_back_a_failing_and_a_wrong_version_unseen_and_promote_a_good_one(
        cluster, api, kubectl, namespace, transcript, tmp_path):
    """ReplicaRatio traffic (no gateway): the canary's pods stay out of the Service during the
    shadow step, the stable pods copy every request to them and compare; real Prometheus, the
    operator's analysis. No client sees a failure through the whole test."""
    from support import monitoring
    from support.localcluster import PROMETHEUS_PORT

    if monitoring.unavailable():
        pytest.skip(monitoring.unavailable())
    transcript.section("Shadow canaries: a version that fails and one that is wrong, rolled back unseen")
    models = demo_models(cluster, api, namespace)
    apply = lambda version, path: kubectl("apply", "-f", "-", input=json.dumps(  # noqa: E731
        iris(namespace, version, sha256(path), replicas=2, rollout=SHADOW_ROLLOUT)))
    status = lambda: api.status(namespace, "iris")  # noqa: E731
    apply("1", model_version(models, "1"))
    wait_for(lambda: status().get("phase") == "Ready", 180, "version 1 Ready")
    discovery = pod_discovery(cluster, namespace)
    prom = monitoring.Prometheus(tmp_path / "prom", scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url)])
    prom.port = PROMETHEUS_PORT
    service = lambda: api.get(f"/api/v1/namespaces/{namespace}/services/iris")["spec"]["selector"]  # noqa: E731
    try:
        prom.start()
        with ServiceClients(api, namespace) as clients:
            prom.wait_for(f'kiln_requests_total{{namespace="{namespace}"}}', timeout=60)

            # 500 on every real input: the copies fail, the clients never see it.
            good_key = status()["engineKey"]
            apply("2", failing_on_real_inputs(models, "2"))
            seen_selectors: list[dict] = []
            def rolled_back() -> dict | None:
                seen_selectors.append(service())
                return status().get("rollback") and status()
            st = wait_for(rolled_back, 240, "version 2 rolled back")
            assert "error-ratio" in st["rollback"]["reason"] and st["rollback"]["step"] == 0, st["rollback"]
            assert st["engineKey"] == good_key and st["stable"]["version"] == "1"
            assert all(s == {contract.LABEL_MODEL: "iris", contract.LABEL_TRACK: "stable"} for s in seen_selectors)
            wait_for(lambda: not api.get(f"/api/v1/namespaces/{namespace}/configmaps/iris-shadow"), 60,
                     "the shadow config removed")
            assert clients.failures == [], clients.failures[:5]

            # 200 with other numbers: no error, no latency check sees it; the agreement does.
            apply("3", shifted_version(models, "3"))
            st = wait_for(lambda: (status().get("rollback") or {}).get("version") == "3" and status(), 240,
                          "version 3 rolled back")
            assert "agreement" in st["rollback"]["reason"] and "output " in st["rollback"]["reason"], st["rollback"]
            assert st["stable"]["version"] == "1" and clients.failures == [], clients.failures[:5]
            warnings = [e["message"] for e in api.items(f"/api/v1/namespaces/{namespace}/events")
                        if e["reason"] == "RolledBack"]
            assert any("agreement" in w for w in warnings), warnings

            # Tiny float differences: the shadow step passes, the weighted step too, promoted.
            apply("4", retrained_version(models, "4"))
            seen_weights = set()
            def promoted() -> bool:
                st = status()
                if st.get("canary"):
                    seen_weights.add((st["canary"]["step"], st["canary"]["weight"], len(service())))
                return st.get("stable", {}).get("version") == "4" and not st.get("canary")
            wait_for(promoted, 240, "version 4 promoted through the shadow step")
            assert (0, 0, 2) in seen_weights and (1, 50, 1) in seen_weights, seen_weights  # shadow, then both tracks
            assert clients.failures == [] and len(clients.latencies) > 100, (clients.failures[:5], len(clients.latencies))
            agreed = prom.value(f'sum(kiln_shadow_comparisons_total{{namespace="{namespace}", result="agree"}})')
            assert agreed and agreed >= 10, agreed
        kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceModel",
                "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message", show=True)
    finally:
        prom.stop()
        discovery.stop()

def test_a_version_that_refuses_real_inputs_is_rolled_back_with_and_without_the_shadow_step(
        cluster, api, kubectl, namespace, transcript, tmp_path):
    """Issue 34: a version whose engine refuses the real inputs the stable version answers
    (ONNX Runtime's INVALID_ARGUMENT: a 400, not a 500) is rolled back at its first analysis,
    on the share of requests it refuses against the stable side's; with a shadow step before
    any client sees it. Clients also send 20% malformed requests, which every version refuses:
    a version refusing only those is promoted."""
    from support import monitoring
    from support.localcluster import PROMETHEUS_PORT

    if monitoring.unavailable():
        pytest.skip(monitoring.unavailable())
    import time

    transcript.section("A version that refuses real inputs: rolled back, with and without a shadow step")
    models = demo_models(cluster, api, namespace)
    analysis = {"intervalSeconds": 5, "failureLimit": 0, "maxErrorRatio": 0.05, "maxLatencyRatio": 5,
                "agreement": None}
    weighted = {"strategy": "Canary", "steps": [{"weight": 50, "pauseSeconds": 10}], "analysis": analysis}
    shadowed = {**SHADOW_ROLLOUT, "analysis": {**analysis, "agreement": {"minSamples": 10}}}
    apply = lambda version, path, rollout: kubectl("apply", "-f", "-", input=json.dumps(  # noqa: E731
        iris(namespace, version, sha256(path), replicas=2, rollout=rollout)))
    status = lambda: api.status(namespace, "iris")  # noqa: E731
    canary_pods = lambda: [p for p in runtime_pods(api, namespace)  # noqa: E731
                           if p["metadata"]["labels"].get(contract.LABEL_TRACK) == "canary"]
    apply("1", model_version(models, "1"), weighted)
    wait_for(lambda: status().get("phase") == "Ready", 180, "version 1 Ready")
    discovery = pod_discovery(cluster, namespace)
    prom = monitoring.Prometheus(tmp_path / "prom", scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url)])
    prom.port = PROMETHEUS_PORT
    try:
        prom.start()
        with ServiceClients(api, namespace, malformed=0.2) as clients:
            prom.wait_for(f'kiln_requests_total{{namespace="{namespace}", outcome="bad_request"}}', timeout=60)
            good_key = status()["engineKey"]

            # No shadow step: the canary takes half the traffic, refuses it, and the first
            # analysis rolls it back (before issue 34, "every step passed" and it was promoted).
            apply("2", refusing_real_inputs(models, "2"), weighted)
            st = wait_for(lambda: (status().get("rollback") or {}).get("version") == "2" and status(), 240,
                          "version 2 rolled back")
            assert "refused-ratio-increase" in st["rollback"]["reason"] and st["rollback"]["step"] == 0, st["rollback"]
            assert st["engineKey"] == good_key and st["stable"]["version"] == "1"
            seen = {code for code, _ in clients.failures}
            assert seen <= {400}, clients.failures[:5]  # what clients of the canary saw meanwhile
            wait_for(lambda: not canary_pods(), 60, "the canary's pods gone")
            time.sleep(1.5)  # the clients' view of the Service's pods is half a second old
            refused_unseen = len(clients.failures)

            # With a shadow step: the copies of what the stable side answered are refused, and it
            # is rolled back at step 0, before any client reaches it.
            apply("3", refusing_real_inputs(models, "3"), shadowed)
            st = wait_for(lambda: (status().get("rollback") or {}).get("version") == "3" and status(), 240,
                          "version 3 rolled back")
            assert st["rollback"]["step"] == 0 and "refused-ratio-increase" in st["rollback"]["reason"], st["rollback"]
            assert len(clients.failures) == refused_unseen, clients.failures[refused_unseen:][:5]
            wait_for(lambda: not canary_pods(), 60, "the canary's pods gone")

            # A version that refuses only what both refuse (the malformed 20%): promoted.
            apply("4", retrained_version(models, "4"), weighted)
            wait_for(lambda: status().get("stable", {}).get("version") == "4" and not status().get("canary"), 240,
                     "version 4 promoted")
            assert len(clients.failures) == refused_unseen, clients.failures[refused_unseen:][:5]
            assert set(clients.refused) == {400} and len(clients.refused) > 20, clients.refused[:5]
        kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceModel",
                "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message", show=True)
    finally:
        prom.stop()
        discovery.stop()


def with_samples(model: dict, **warmup) -> dict:
    model["spec"]["runtime"]["warmup"] = warmup
    return model


SETOSA = [5.1, 3.5, 1.4, 0.2]


def setosa_sample(species: int) -> dict:
    """One flower, and the species the model must answer for it (the demo model says 0)."""
    return {"id": "setosa", "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": SETOSA}],
            "outputs": [{"name": "species", "shape": [1], "datatype": "INT64", "data": [species]}]}


def model_events(api, namespace: str) -> list[dict]:
    return [e for e in api.items(f"/api/v1/namespaces/{namespace}/events") if e["involvedObject"]["kind"] == "InferenceModel"]


def test_a_version_whose_sample_requests_fail_never_becomes_ready(cluster, api, kubectl, namespace, transcript):
    """Real `kiln serve` pods run the samples before they report Ready: passing ones serve; a
    canary whose answers differ is rolled back without a Ready pod (no traffic ever reaches
    it); a version whose samples file on the model's claim fails keeps the old pods serving."""
    transcript.section("Warm-up with real inputs")
    models = demo_models(cluster, api, namespace)
    canary = {"strategy": "Canary", "steps": [{"weight": 50, "pauseSeconds": 2}], "analysis": {"intervalSeconds": 5}}
    apply = lambda body: kubectl("apply", "-f", "-", input=json.dumps(body))  # noqa: E731
    status = lambda: api.status(namespace, "iris")  # noqa: E731

    # Samples that answer as expected: version 1 becomes Ready.
    apply(with_samples(iris(namespace, "1", sha256(model_version(models, "1")), rollout=canary),
                       samples=[setosa_sample(0)]))
    wait_for(lambda: status().get("phase") == "Ready", 180, "version 1, whose samples pass, Ready")
    stable_key = status()["engineKey"]

    # A canary whose samples expect another answer: its pods exit WarmupFailed, never Ready; rolled back.
    apply(with_samples(iris(namespace, "2", sha256(model_version(models, "2")), rollout=canary),
                       samples=[setosa_sample(2)]))
    canary_ready = []

    def rolled_back():
        st = status()
        canary_ready.append(((st.get("canary") or {}).get("readyReplicas") or 0)
                            + sum(ready(p) for p in runtime_pods(api, namespace) if p["metadata"]["labels"].get(
                                contract.LABEL_TRACK) == manifests.CANARY))
        return st.get("rollback") and st
    st = wait_for(rolled_back, 180, "the canary whose samples fail rolled back")
    assert max(canary_ready) == 0, "a canary pod became Ready"
    assert "its pods failed their warm-up samples" in st["rollback"]["reason"]
    assert 'sample 1 (of 1, spec.runtime.warmup.samples[0], id "setosa"): output "species" differs' in st["rollback"]["reason"]
    assert (st["engineKey"], st["stable"]["version"]) == (stable_key, "1")
    wait_for(lambda: not api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/iris-canary"), 60, "the canary gone")
    warned = wait_for(lambda: [e for e in model_events(api, namespace) if e["reason"] == "WarmupFailed"], 30,
                      "a WarmupFailed Event")
    assert warned[0]["type"] == "Warning" and "max abs difference 2 > tolerance" in warned[0]["message"]
    assert all(ready(p) for p in runtime_pods(api, namespace))  # version 1 serves on

    # Recreate, the samples in a file beside the model on its claim: the new pod never becomes
    # Ready, the old one keeps serving, and status and an Event say why.
    path = model_version(models, "3")
    (path.parent / "samples.json").write_text(json.dumps({"samples": [setosa_sample(1)]}))
    apply(with_samples(iris(namespace, "3", sha256(path)), samplesFile="samples.json"))
    degraded = wait_for(lambda: next((c for c in status().get("conditions") or ()
                                      if c["type"] == "Degraded" and c["reason"] == "WarmupFailed"), None),
                        180, "Degraded: WarmupFailed")
    assert 'sample 1 (of 1, samples.json[0], id "setosa"): output "species" differs' in degraded["message"]
    assert status()["phase"] == "Degraded"
    new = [p for p in runtime_pods(api, namespace)
           if "--samples-file" in p["spec"]["containers"][0]["args"]]
    assert new and not any(ready(p) for p in new)
    term = new[0]["status"]["containerStatuses"][0].get("lastState", {}).get("terminated") or \
        new[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 9 and term["message"].startswith("WarmupFailed: sample 1 (of 1, samples.json[0]")
    assert any(ready(p) for p in runtime_pods(api, namespace))  # the old version still answers
    infer(next(p for p in runtime_pods(api, namespace) if ready(p)), [SETOSA])
    kubectl("get", "kim", "iris", "-n", namespace, show=True)
    kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceModel,reason=WarmupFailed",
            "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message", show=True)


# ------------------------------------------------------------------------ upgrade and uninstall

def test_a_model_left_with_the_finalizer_of_an_earlier_version_loses_it(api, kubectl, namespace):
    """Earlier versions put kopf's finalizer on every model (for a kopf timer); this one needs
    none and removes it, so that a model stays deletable once the operator is uninstalled."""
    model = iris(namespace, "1", "0" * 64)
    model["metadata"]["finalizers"] = ["kiln.dev/finalizer"]
    kubectl("apply", "-f", "-", input=json.dumps(model))
    wait_for(lambda: not api.model(namespace, "iris")["metadata"].get("finalizers"), 60,
             "the operator removing kiln.dev/finalizer")
    wait_for(lambda: api.status(namespace, "iris").get("phase"), 60, "a phase: the operator handles it")
    assert not api.model(namespace, "iris")["metadata"].get("finalizers")


def test_the_crd_upgrade_command_the_chart_prints_applies_a_changed_crd(cluster, api, tmp_path):
    """The command NOTES.txt prints for a new CRD, run as printed from a checkout whose CRD
    changed, over the CRD `helm install` created: the change is applied (plain server-side
    apply conflicts with helm's ownership of .spec.versions). docs/operations.md gives it too."""
    notes = cluster.helm("get", "notes", RELEASE, "--namespace", RELEASE_NAMESPACE).stdout
    [command] = [line.strip() for line in notes.splitlines() if "charts/kiln/crds/" in line]
    crds = tmp_path / "charts" / "kiln" / "crds"
    shutil.copytree(REPO / "charts" / "kiln" / "crds", crds)
    path = crds / "inferencemodels.kiln.dev.yaml"
    crd = yaml.safe_load(path.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["description"] = changed = f"{schema.get('description', '')} (as a newer release says it)".strip()
    path.write_text(yaml.safe_dump(crd))

    applied = cluster.shell(command, tmp_path)
    assert applied.returncode == 0, applied.stdout
    assert api.get(CRD)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] == changed
    restored = cluster.shell(command, REPO)  # this checkout's CRD again, the same way
    assert restored.returncode == 0, restored.stdout
    assert api.get(CRD)["spec"]["versions"][0]["schema"]["openAPIV3Schema"].get("description") != changed
    [documented] = snippets.blocks("docs/operations.md", "sh", "The CRD: install and upgrade policy")
    assert command in documented.splitlines()


def test_cache_gc_removes_the_oldest_engine_from_the_pvc_and_keeps_the_rollback_target(
        cluster, api, kubectl, namespace, transcript):
    transcript.section("Cache GC: versions 1, 2 and 3 rolled out, the oldest engine leaves the PVC")
    models = demo_models(cluster, api, namespace)
    digests = {v: sha256(model_version(models, v)) for v in ("1", "2", "3")}

    def set_gc(interval: str, grace: str) -> None:
        old = wait_for(lambda: operator_pod(api), 60, "the operator Ready")
        cluster.helm("upgrade", RELEASE, str(REPO / "charts" / "kiln"), "--namespace", RELEASE_NAMESPACE,
                     "--reuse-values", "--set", f"cache.gc.intervalSeconds={interval},cache.gc.graceSeconds={grace}",
                     "--wait", "--timeout", "3m")
        wait_for(lambda: (lambda p: p if p and p["metadata"]["uid"] != old["metadata"]["uid"] else None)(
            operator_pod(api)), 120, "the operator with the new cache GC settings")

    set_gc("2", "2")
    try:
        keys = []
        for version in ("1", "2", "3"):
            kubectl("apply", "-f", "-", input=json.dumps(iris(namespace, version, digests[version])))
            wait_for(lambda: (lambda s: s.get("phase") == "Ready" and s.get("stable", {}).get("version") == version
                              and s.get("engineKey") not in keys)(api.status(namespace, "iris")), 240,
                     f"version {version} Ready")
            keys.append(api.status(namespace, "iris")["engineKey"])
        cache = claim_directory(cluster, api, namespace, "kiln-engine-cache") / namespace / "iris"
        wait_for(lambda: not (cache / keys[0]).exists(), 120, f"version 1's engine {keys[0]} removed from the PVC")
        for key in keys[1:]:  # the rollback target and the one serving
            assert (cache / key / "manifest.json").is_file(), f"{key} was removed"
        removed = wait_for(lambda: [e for e in api.items(f"/api/v1/namespaces/{namespace}/events")
                                    if e["reason"] == "EngineRemoved"], 60, "an EngineRemoved Event")
        assert keys[0] in removed[0]["message"] and removed[0]["involvedObject"]["name"] == "iris"
        index = api.get(f"/api/v1/namespaces/{namespace}/configmaps/{contract.ENGINE_INDEX}")["data"]
        assert {k.split(".")[0] for k in index} == set(keys[1:])
        st = wait_for(lambda: (lambda s: s if [e["key"] for e in (s.get("cache") or {}).get("engines", ())]
                               == keys[:0:-1] else None)(api.status(namespace, "iris")), 60, "status.cache")
        assert [e["use"] for e in st["cache"]["engines"]] == ["current", "rollback"]
        kubectl("get", "kim", "-n", namespace, show=True)
        assert infer(runtime_pods(api, namespace)[0], [[5.1, 3.5, 1.4, 0.2]])["outputs"]
    finally:
        set_gc(str(INSTALL_VALUES.get("cache", {}).get("gc", {}).get("intervalSeconds", 3600)),
               str(INSTALL_VALUES.get("cache", {}).get("gc", {}).get("graceSeconds", 86400)))
    kubectl("delete", "kim", "iris", "-n", namespace, "--wait=true", "--timeout=60s")


# ------------------------------------------------------------------------ scale to zero

def idle_rules(path: Path) -> Path:
    """The chart's KilnModelIdle with a test-short window (the shipped one is a minute)."""
    text = (REPO / "charts" / "kiln" / "files" / "kiln-idle.rules.yaml").read_text()
    assert "increase(kiln_requests_total[1m])" in text
    path.write_text(text.replace("increase(kiln_requests_total[1m])", "increase(kiln_requests_total[4s])"))
    return path


def post_infer(address: str, port: int, seed: int, headers: dict[str, str], timeout: float = 180) -> tuple[int, dict]:
    rows = [[5.1 + seed % 7 * 0.1, 3.5, 1.4, 0.2]]
    body = json.dumps({"id": str(seed), "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32",
                                                    "data": rows[0]}]}).encode()
    request = urllib.request.Request(f"http://{address}:{port}/v2/models/iris/infer", data=body,
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def infer_through_service(api, namespace: str, seed: int, timeout: float = 180,
                          host: str | None = None) -> tuple[int, dict, float]:
    """One request to the model's Service `iris` (a random endpoint, as kube-proxy picks one),
    with the Host an in-cluster client sends: (status, answer, seconds to the answer)."""
    import random
    import time

    t0 = time.monotonic()
    address, port = random.choice(wait_for(lambda: service_endpoints(api, namespace, "iris"), 30, "an endpoint"))
    status, answer = post_infer(address, port, seed, {"Host": host or f"iris.{namespace}.svc.cluster.local:{port}"},
                                timeout)
    return status, answer, time.monotonic() - t0


def public_route(namespace: str) -> dict:
    """An HTTPRoute a user exposes the model with through a Gateway: the gateway's Host names no
    namespace, so the route sets the activator's header (docs/operations.md)."""
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "iris-public", "namespace": namespace},
            "spec": {"parentRefs": [{"name": "models"}], "hostnames": ["models.example.com"],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v2/models/iris"}}],
                                "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                                    "set": [{"name": "kiln-namespace", "value": namespace}]}}],
                                "backendRefs": [{"name": "iris", "port": 8080}]}]}}


def infer_through_httproute(api, namespace: str, name: str, seed: int) -> tuple[int, dict, float]:
    """A request as a Gateway forwards it along the HTTPRoute `name`, read from the API server:
    its hostname as Host, its RequestHeaderModifier applied, to an endpoint of its backend
    Service (the EndpointSlices, as Gateway implementations route). No Gateway implementation
    runs on this control plane (each needs a proxy this machine cannot run, and the pods'
    loopback IPs are in no EndpointSlice), so the test does the gateway's part itself."""
    import random
    import time

    route = api.get(f"/apis/gateway.networking.k8s.io/v1/namespaces/{namespace}/httproutes/{name}")
    [rule] = route["spec"]["rules"]
    assert "/v2/models/iris/infer".startswith(rule["matches"][0]["path"]["value"])
    headers = {"Host": route["spec"]["hostnames"][0]}
    for f in rule.get("filters") or []:
        if f["type"] == "RequestHeaderModifier":
            headers.update({h["name"]: h["value"] for h in f["requestHeaderModifier"].get("set") or []})
    [backend] = rule["backendRefs"]
    t0 = time.monotonic()
    endpoints = wait_for(lambda: service_endpoints(api, namespace, backend["name"]), 30, "an endpoint")
    address, port = random.choice(endpoints)
    status, answer = post_infer(address, port, seed, headers)
    return status, answer, time.monotonic() - t0


def grpc_infer_through_service(api, namespace: str, request_id: str) -> tuple[str, set[str], float]:
    """A v2 gRPC ModelInfer to the model's Service port `grpc`, as an in-cluster gRPC client
    sends it: (its answer's id, its outputs' names, seconds to the answer)."""
    import random
    import time

    import grpc

    from kiln.runtime.serving.grpc import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="iris", id=request_id)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32).tobytes())
    t0 = time.monotonic()
    address, port = random.choice(wait_for(lambda: service_endpoints(api, namespace, "iris", "grpc"), 30, "an endpoint"))
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        answer = infer(request, timeout=180)
    assert len(answer.raw_output_contents) == len(answer.outputs)
    return answer.id, {o.name for o in answer.outputs}, time.monotonic() - t0


def test_an_idle_model_goes_to_zero_and_requests_at_zero_are_held_and_answered(
        cluster, api, kubectl, namespace, transcript, tmp_path):
    """Scale to zero with every part real: the chart's activator (on by default, two replicas),
    KilnModelIdle from a real Prometheus through Alertmanager to the receiver, the scaling step
    to 0, the model's Service pointed at the activator (its EndpointSlice), a request at zero
    held while the activator scales the model to one and the real Deployment controller starts
    a pod, answered, through the Service and along an HTTPRoute; a model the activator does not
    serve refused; then a burst at zero, nothing lost. Clients reach the Service by resolving
    its EndpointSlices themselves (no kube-proxy here). docs/benchmarks.md's figures come from
    benchmarks/scale_to_zero.py (10 tries, the stages, a burst of 1,000)."""
    import base64
    import concurrent.futures
    import time

    from support import monitoring

    if monitoring.unavailable():
        pytest.skip(monitoring.unavailable())
    transcript.section("Scale to zero: idle to 0 replicas, requests at zero held by the activator")
    activators = lambda: [p for p in pods(api, RELEASE_NAMESPACE, "app.kubernetes.io/component=activator")  # noqa: E731
                          if ready(p)]
    discovery = am = prom = None
    try:
        wait_for(lambda: len(activators()) == 2, 120, "two activator pods Ready")
        models = demo_models(cluster, api, namespace)
        model = iris(namespace, "1", sha256(model_version(models, "1")))
        model["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                                        "targetGPUUtilization": 10, "scaleToZeroAfterSeconds": 5}
        kubectl("apply", "-f", "-", input=json.dumps(model))
        kubectl("apply", "-f", "-", input=json.dumps(public_route(namespace)))
        wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready", 180, "phase Ready")
        op = wait_for(lambda: operator_pod(api), 120, "the operator pod")
        assert any(a.startswith("--activator-service=") for a in op["spec"]["containers"][0]["args"])
        port = INSTALL_VALUES["autoscaling"]["receiver"]["port"]
        receiver = f"http://127.0.0.1:{port}/alerts"
        secret = api.get(f"/api/v1/namespaces/{RELEASE_NAMESPACE}/secrets/{RELEASE}-alert-token")
        token_file = tmp_path / "token"
        token_file.write_text(base64.b64decode(secret["data"]["token"]).decode())
        discovery = pod_discovery(cluster, namespace)
        am = monitoring.Alertmanager(tmp_path / "am", monitoring.kiln_alertmanager_config(
            receiver, str(token_file), repeat_interval="1h"))
        prom = monitoring.Prometheus(tmp_path / "prom", alertmanagers=[am.url], rule_files=[
            chart_rules(tmp_path / "kiln.rules.yaml"), idle_rules(tmp_path / "kiln-idle.rules.yaml")],
            scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url),
                            monitoring.operator_scrape_config(f"{op['status']['podIP']}:{port}",
                                                              labels={"namespace": RELEASE_NAMESPACE})])
        am.start()
        prom.start()
        spec_replicas = lambda: api.model(namespace, "iris")["spec"]["runtime"]["replicas"]  # noqa: E731
        held = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/iris-activator"

        def at_zero(what: str) -> float:
            t0 = time.monotonic()
            wait_for(lambda: spec_replicas() == 0, 180, f"{what}: spec.runtime.replicas 0 from KilnModelIdle")
            wait_for(lambda: runtime_pods(api, namespace) == [], 60, f"{what}: the runtime pod gone")
            slice_ = wait_for(lambda: api.get(held), 30, f"{what}: the Service's EndpointSlice to the activator")
            assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "iris"
            assert [(p["name"], p["port"]) for p in slice_["ports"]] == [("http", 8080), ("grpc", 8081)]
            # The pass that writes the slice writes the status at its end, a moment later.
            def scaled_to_zero() -> tuple[str, str, str]:
                st = api.status(namespace, "iris")
                available = next(c for c in st["conditions"] if c["type"] == "Available")
                return (available["status"], available["reason"], st["phase"])
            wait_for(lambda: scaled_to_zero() == ("False", "ScaledToZero", "Ready"), 10,
                     f"{what}: Available ScaledToZero, phase Ready")
            return time.monotonic() - t0

        # 1. No requests: to zero after the idle time.
        idle = at_zero("idle")
        kubectl("get", "inferencemodel", "iris", "-n", namespace, show=True)
        # 2. A request naming a model the activator does not serve (here, another namespace's):
        # refused, and nothing scaled.
        status_, answer, _ = infer_through_service(api, namespace, 0, host="iris.kube-system.svc:8080")
        assert status_ == 404 and "not one the activator holds" in answer["error"], answer
        # 3. A request at zero through the Service: held, the model scaled to one, answered.
        assert spec_replicas() == 0
        status_, answer, first = infer_through_service(api, namespace, 0)
        assert status_ == 200 and answer["id"] == "0" and answer["outputs"], answer
        wait_for(lambda: api.get(held) is None, 60, "the Service back on the runtime pod")
        reasons_ = [h["reason"] for h in api.status(namespace, "iris")["scaling"]["history"]]
        assert "ScaledToZero" in reasons_ and "ScaledExternally" in reasons_, reasons_
        # 4. Idle again: at zero, a request along the HTTPRoute (as a Gateway forwards it) and a
        # gRPC one through the Service, at once: both held, one activation, both answered.
        at_zero("idle before the HTTPRoute and gRPC")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            along_route = pool.submit(infer_through_httproute, api, namespace, "iris-public", 1)
            over_grpc = pool.submit(grpc_infer_through_service, api, namespace, "g1")
            status_, answer, routed = along_route.result()
            grpc_id, grpc_outputs, grpc_seconds = over_grpc.result()
        assert status_ == 200 and answer["id"] == "1" and answer["outputs"], answer
        assert grpc_id == "g1" and grpc_outputs == {o["name"] for o in answer["outputs"]}, grpc_outputs
        # 5. Idle again, then a burst at zero: every request answered, once.
        at_zero("idle again")
        burst = 200
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            results = list(pool.map(lambda i: infer_through_service(api, namespace, i), range(2, burst + 2)))
        took = time.monotonic() - t0
        answered = [r for r in results if r[0] == 200]
        assert sorted(int(a["id"]) for _, a, _ in answered) == list(range(2, burst + 2)), [
            r for r in results if r[0] != 200][:3]
        seconds = sorted(s for _, _, s in results)
        print(f"\nscale to zero: idle -> 0 replicas {idle:.1f} s after the rule could fire; first request at zero "
              f"to its answer {first:.2f} s through the Service, {routed:.2f} s along the HTTPRoute ({grpc_seconds:.2f} s "
              f"over gRPC beside it); burst of "
              f"{burst} at zero: {len(answered)} answered, {burst - len(answered)} lost, "
              f"p50 {seconds[len(seconds) // 2]:.2f} s, max {seconds[-1]:.2f} s, all in {took:.1f} s")
        kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceModel",
                "-o", "custom-columns=REASON:.reason,MESSAGE:.message", show=True)
    finally:
        for process in (prom, am, discovery):
            if process is not None:
                process.stop()
        kubectl("delete", "httproute", "iris-public", "-n", namespace, "--ignore-not-found")
        kubectl("delete", "inferencemodel", "iris", "-n", namespace, "--ignore-not-found", "--wait=true")


def test_helm_upgrade_rolls_the_operator(cluster, api):
    old = wait_for(lambda: operator_pod(api), 60, "the operator Ready")
    cluster.helm("upgrade", RELEASE, str(REPO / "charts" / "kiln"), "--namespace", RELEASE_NAMESPACE,
                 "--reuse-values", "--set", "operator.defaultTargets={sm80}", "--wait", "--timeout", "3m")
    new = wait_for(lambda: (lambda p: p if p and p["metadata"]["uid"] != old["metadata"]["uid"] else None)(
        operator_pod(api)), 120, "the upgraded operator pod")
    assert "--default-targets=sm80" in new["spec"]["containers"][0]["args"]


def test_uninstall_keeps_models_serving_and_the_documented_commands_remove_the_rest(
        cluster, api, kubectl, namespace, transcript, tmp_path):
    """docs/operations.md's Uninstall, as pasted: `helm uninstall` keeps the CRD, the models
    and their serving pods, the cache claim and the engine index; then its removal commands,
    with no operator left, delete all of it within a bound (a finalizer would hold them)."""
    models = demo_models(cluster, api, namespace)
    kubectl("apply", "-f", "-", input=json.dumps(iris(namespace, "1", sha256(model_version(models, "1")))))
    wait_for(lambda: api.status(namespace, "iris").get("phase") == "Ready", 180, "phase Ready")
    index = f"/api/v1/namespaces/{namespace}/configmaps/{contract.ENGINE_INDEX}"
    assert api.get(index)
    uninstall, removal = snippets.blocks("docs/operations.md", "sh", "Uninstall")

    transcript.section("helm uninstall")
    out = cluster.shell(uninstall, tmp_path)
    assert out.returncode == 0, out.stdout
    transcript.add(uninstall.strip(), out.stdout)
    wait_for(lambda: not api.items(f"/apis/apps/v1/namespaces/{RELEASE_NAMESPACE}/deployments"), 60,
             "the operator Deployment gone")
    assert not api.get(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{RELEASE}-cluster")
    assert api.get(CRD) and api.get(index)
    assert api.get(f"/api/v1/namespaces/{RELEASE_NAMESPACE}/persistentvolumeclaims/kiln-engine-cache")
    [pod] = [p for p in runtime_pods(api, namespace) if ready(p)]
    assert infer(pod, [[5.1, 3.5, 1.4, 0.2]])["outputs"], "the model keeps serving without its operator"

    removed = cluster.shell(removal, tmp_path, timeout=180)
    assert removed.returncode == 0, removed.stdout
    assert not api.model(namespace, "iris") and not api.get(CRD) and not api.get(index)
    assert not api.get(f"/api/v1/namespaces/{RELEASE_NAMESPACE}/persistentvolumeclaims/kiln-engine-cache")
    # The foreground delete returned only once the garbage collector had removed all it owned.
    assert not api.items(f"/apis/apps/v1/namespaces/{namespace}/deployments") and not jobs(api, namespace)
    assert not api.items(f"/api/v1/namespaces/{namespace}/services")
    assert not pods(api, namespace, f"{contract.LABEL_MODEL}=iris")
