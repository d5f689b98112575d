"""Pod discovery against the real control plane (tests/support/localcluster): pods created
through the real API server, their IPs given by kwok, found by `PodDiscovery` and relabelled by the
PodMonitor-like config in Debian's Prometheus, which scrapes a metrics endpoint listening
on the pod's own 127.x address.

Skipped where the servers or the control plane binaries are missing.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from support import monitoring
from support.monitoring import PodDiscovery, Prometheus, pod_http_sd_scrape_config
from support.monitoring.discovery import pod_targets

pytestmark = [pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
PORT = 8080


def pod(namespace: str, name: str, *, scrape: bool) -> dict:
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
                   "prometheus.io/path": "/metrics"} if scrape else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "iris"},
                         "annotations": annotations},
            "spec": {"nodeName": "cpu-0", "containers": [{
                "name": "runtime", "image": "kiln:dev",
                "ports": [{"name": "http", "containerPort": PORT}, {"name": "debug", "containerPort": 9999}]}]}}


def test_pod_targets_carry_the_pod_roles_meta_labels():
    doc = pod("shop", "iris-0", scrape=True)
    doc["metadata"].update(uid="u-1", ownerReferences=[{"kind": "ReplicaSet", "name": "iris-6f7c9d",
                                                         "controller": True}])
    assert pod_targets(doc) == []  # no IP yet: nothing to scrape
    doc["status"] = {"phase": "Running", "podIP": "127.20.0.7", "hostIP": "127.0.0.1",
                     "conditions": [{"type": "Ready", "status": "True"}]}
    groups = pod_targets(doc)
    assert [g["targets"] for g in groups] == [["127.20.0.7:8080"], ["127.20.0.7:9999"]]
    labels = groups[0]["labels"]
    assert {k: v for k, v in labels.items() if "_annotation" in k or "_label" in k} == {
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
        "__meta_kubernetes_pod_annotationpresent_prometheus_io_scrape": "true",
        "__meta_kubernetes_pod_annotation_prometheus_io_port": "8080",
        "__meta_kubernetes_pod_annotationpresent_prometheus_io_port": "true",
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
        "__meta_kubernetes_pod_annotationpresent_prometheus_io_path": "true",
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": "iris",
        "__meta_kubernetes_pod_labelpresent_app_kubernetes_io_name": "true"}
    assert (labels["__meta_kubernetes_namespace"], labels["__meta_kubernetes_pod_name"],
            labels["__meta_kubernetes_pod_ready"], labels["__meta_kubernetes_pod_controller_kind"],
            labels["__meta_kubernetes_pod_container_port_name"]) == ("shop", "iris-0", "true", "ReplicaSet", "http")


def _unavailable() -> str | None:
    reason = monitoring.unavailable()
    if reason:
        return reason
    if not any((REPO / ".tools").glob("kubernetes-*/bin/kube-apiserver")) and shutil.which("go") is None:
        return "no Kubernetes control plane in .tools/ and no Go toolchain to build it (make tools)"
    return None


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    from support.localcluster.controlplane import ControlPlane, binaries, node

    started = time.monotonic()
    cp = ControlPlane(tmp_path_factory.mktemp("cp"), binaries())
    try:
        cp.start([node("cpu-0", cpu="16", memory="64Gi")])
        print(f"\ncontrol plane up in {time.monotonic() - started:.0f} s")
        yield cp
    finally:
        cp.stop()


def test_prometheus_scrapes_pods_it_found_through_the_api_server(tmp_path, control_plane):
    import json

    from support.localcluster.client import Api, wait_for

    cp = control_plane
    api = Api(cp.admin_kubeconfig)
    for ns in ("shop", "lab"):
        api.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    for doc in (pod("shop", "iris-0", scrape=True), pod("shop", "quiet-0", scrape=False),
                pod("lab", "iris-0", scrape=True)):
        api.request("POST", f"/api/v1/namespaces/{doc['metadata']['namespace']}/pods", doc)
    ip = wait_for(lambda: ((api.get("/api/v1/namespaces/shop/pods/iris-0") or {}).get("status") or {}).get("podIP"),
                  30, "kwok to give iris-0 an IP")

    # The pod's process: a metrics endpoint on the pod's own address, as `kiln serve` has.
    registry = CollectorRegistry()
    Gauge("kiln_model_info", "i", ["model", "version", "engine_key", "backend", "target"], registry=registry) \
        .labels("iris", "1", "k" * 20, "onnxruntime", "cpu").set(1)
    server, _thread = start_http_server(PORT, ip, registry=registry)

    # Discovery as a token of a ServiceAccount that may only list pods in `shop` (what a
    # Prometheus's RBAC would grant), and as the admin's client certificate.
    cp.kubectl("create", "serviceaccount", "prometheus", "-n", "shop")
    cp.kubectl("create", "role", "pods-reader", "--verb=list", "--resource=pods", "-n", "shop")
    cp.kubectl("create", "rolebinding", "prometheus", "--role=pods-reader", "--serviceaccount=shop:prometheus",
               "-n", "shop")
    token = tmp_path / "token"
    token.write_text(cp.kubectl("create", "token", "prometheus", "-n", "shop").stdout)
    with PodDiscovery(cp.server, ["shop"], ca_file=str(cp.ca), bearer_token_file=str(token)) as by_token:
        names = {g["labels"]["__meta_kubernetes_pod_name"] for g in by_token.groups()}
        assert names == {"iris-0", "quiet-0"}
    with PodDiscovery(cp.server, ["lab"], ca_file=str(cp.ca), bearer_token_file=str(token)) as forbidden:
        with pytest.raises(Exception, match="403"):
            forbidden.groups()

    admin = {"ca_file": str(cp.ca), "cert_file": str(cp.root / "pki" / "admin.crt"),
             "key_file": str(cp.root / "pki" / "admin.key")}
    try:
        with PodDiscovery(cp.server, ["shop"], **admin) as discovery, \
                Prometheus(tmp_path / "prometheus", scrape_configs=[pod_http_sd_scrape_config(discovery.url)]) as prom:
            started = time.monotonic()
            [target] = prom.wait_for_targets("kiln-runtime")
            print(f"pod target up {time.monotonic() - started:.1f} s after Prometheus was ready "
                  f"({discovery.refreshes} discovery refreshes)")
            assert target["scrapeUrl"] == f"http://{ip}:{PORT}/metrics"
            assert target["labels"] == {"job": "kiln-runtime", "instance": f"{ip}:{PORT}",
                                        "namespace": "shop", "pod": "iris-0"}
            info = prom.wait_for('kiln_model_info{namespace="shop", pod="iris-0"}')
            assert [s["metric"]["model"] for s in info] == ["iris"], json.dumps(info)
            # quiet-0 (not annotated) and lab/iris-0 (another namespace) were never targets.
            assert [t["labels"]["pod"] for t in prom.targets()] == ["iris-0"]
    finally:
        server.shutdown()
