"""Scale-down removes the right pod: each Ready runtime pod's load becomes its
`controller.kubernetes.io/pod-deletion-cost` before the replicas go down (the ReplicaSet
controller removes the lowest cost first), and a PodDisruptionBudget per model.

The pure parts with plain dicts; then the real operator against the emulated API server,
with runtime pods played by the test (the emulator runs no controllers): each pod's
`/metrics` is a small HTTP server on loopback, its pod IP 127.0.0.1 and its `http` port
that server's.
"""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from kiln.operator import manifests, observations
from kiln.runtime.api import contract
from support.monitoring.process import free_port
from support.operator_play import finish_job, jobs, model, roll_out, status

COST = observations.ANN_DELETION_COST


def exposition(busy: float, inflight: float, model_name: str = "m") -> str:
    return (f"# TYPE kiln_engine_busy_ratio gauge\n"
            f'kiln_engine_busy_ratio{{model="{model_name}",version="1"}} {busy}\n'
            f"# TYPE kiln_inflight_requests gauge\n"
            f'kiln_inflight_requests{{model="{model_name}"}} {inflight}\n'
            f"# TYPE kiln_engine_busy_seconds counter\n"
            f'kiln_engine_busy_seconds_total{{model="{model_name}",version="1"}} 1234.5\n')


# ------------------------------------------------------------------------ pure

def test_a_pods_load_is_its_busy_ratio_and_its_requests_in_flight():
    assert observations.pod_load(exposition(0.25, 3)) == observations.PodLoad(0.25, 3.0)
    assert observations.pod_load("") == observations.PodLoad(0.0, 0.0)  # a runtime that served nothing yet


@pytest.mark.parametrize("text", ["<html>not metrics</html>", 'kiln_engine_busy_ratio{model="m" 1\n',
                                  "kiln_engine_busy_ratio NaN\n"])
def test_what_is_no_exposition_is_no_load(text):
    with pytest.raises(ValueError):
        observations.pod_load(text)


@pytest.mark.parametrize("load, cost", [
    (None, 0),  # did not answer: the first to go
    (observations.PodLoad(0.0, 0), 0),
    (observations.PodLoad(0.5, 0), 500),
    (observations.PodLoad(0.0, 3), 30),  # idle for 30 s, but requests now
    (observations.PodLoad(0.8, 2), 820),
    (observations.PodLoad(1.7, -1), 1000),  # out of range: clamped
    (observations.PodLoad(1.0, 1e12), 2**31 - 1),  # the annotation is an int32
])
def test_the_deletion_cost_grows_with_the_load(load, cost):
    assert observations.deletion_cost(load) == cost


def test_a_busier_pod_costs_more_than_an_idler_one():
    idle, busy = observations.PodLoad(0.1, 1), observations.PodLoad(0.6, 0)
    assert observations.deletion_cost(idle) < observations.deletion_cost(busy)


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, port: int = 8080,
        deleting: bool = False, annotations: dict | None = None) -> dict:
    meta: dict = {"name": name, "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta,
            "spec": {"containers": [{"name": "runtime", "ports": [{"name": "http", "containerPort": port},
                                                                   {"name": "grpc", "containerPort": 8081}]}]},
            "status": {**({"podIP": ip} if ip else {}),
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_only_ready_pods_with_an_address_are_asked():
    pods = [pod("a"), pod("b", ready=False), pod("c", ip=None), pod("d", deleting=True),
            pod("e", ip="fd00::5", port=9000)]
    assert observations.serving_pod_addresses(pods, "http") == {"a": "10.0.0.1:8080", "e": "[fd00::5]:9000"}


def test_the_disruption_budget_takes_one_pod_of_either_track_at_a_time():
    m = {"metadata": {"name": "resnet", "namespace": "vision", "uid": "u1"}}
    pdb = manifests.disruption_budget(m)
    assert pdb["apiVersion"] == "policy/v1" and pdb["kind"] == "PodDisruptionBudget"
    assert (pdb["metadata"]["name"], pdb["metadata"]["namespace"]) == ("resnet", "vision")
    assert pdb["metadata"]["ownerReferences"] == [manifests.owner_reference(m)]
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert contract.LABEL_TRACK not in selector  # stable and canary pods alike
    for track in (manifests.STABLE, manifests.CANARY):  # the runtime pods' own labels match it
        labels = {**manifests.selector_labels("resnet", track), "app.kubernetes.io/component": "runtime"}
        assert selector.items() <= labels.items()


# ------------------------------------------------------------------------ the operator, emulated API

class MetricsServer:
    """A runtime pod's /metrics: answers `text`, or (hang=True) accepts and never answers."""

    def __init__(self, text: str = "", hang: bool = False) -> None:
        self.text, self.hang, self.port, self.asked = text, hang, free_port(), 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.asked += 1
                if outer.hang:
                    time.sleep(5)
                    return
                body = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def runtime_pod(api, ns: str, name: str, pod_name: str, port: int, ready: bool = True) -> dict:
    """Play the ReplicaSet controller and the kubelet: a Ready runtime pod of the stable track."""
    dep = api.get("Deployment", ns, manifests.runtime_name(name))
    template = dep["spec"]["template"]
    spec = {**template["spec"], "containers": [{**template["spec"]["containers"][0],
                                                 "ports": [{"name": "http", "containerPort": port}]}]}
    api.apply({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "namespace": ns, "labels": template["metadata"]["labels"]},
               "spec": spec})
    return api.patch("Pod", ns, pod_name, {"status": {
        "phase": "Running", "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}, subresource="status")


@pytest.fixture(scope="module")
def scale_operator(start_operator):
    op = start_operator(resync_seconds=600, retry_seconds=0.5)
    yield op
    op.stop()


def ready_model(api, ns: str, name: str, replicas: int, **spec) -> None:
    api.apply(model(ns, name, runtime={"replicas": replicas}, **spec))
    [job] = api.wait(lambda: jobs(api, ns), 10, "the build Job")
    finish_job(api, job)
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the runtime Deployment")
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("phase") == "Ready", 10, "Ready")


def test_the_disruption_budget_is_the_models(api, scale_operator):
    ns, name = "down-pdb", "resnet"
    ready_model(api, ns, name, 2)
    pdb = api.wait(lambda: api.get("PodDisruptionBudget", ns, name), 10, "the PodDisruptionBudget")
    m = api.get("InferenceModel", ns, name)
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == m["metadata"]["uid"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == {contract.LABEL_MODEL: name,
                                                      "app.kubernetes.io/component": "runtime"}
    dep = api.get("Deployment", ns, manifests.runtime_name(name))
    assert dep["metadata"]["annotations"][observations.ANN_DISRUPTION_BUDGET] == \
        pdb["metadata"]["annotations"][contract.ANN_APPLIED_HASH]

    # The budget an older operator applied: a newer one applies its own.
    api.patch("PodDisruptionBudget", ns, name, {"metadata": {"annotations": {contract.ANN_APPLIED_HASH: "old"}},
                                                "spec": {"maxUnavailable": 3}})
    api.patch("Deployment", ns, dep["metadata"]["name"],
              {"metadata": {"annotations": {observations.ANN_DISRUPTION_BUDGET: "old"}}})
    api.wait(lambda: api.get("PodDisruptionBudget", ns, name)["spec"]["maxUnavailable"] == 1, 10,
             "the budget patched")


@pytest.mark.parametrize("autoscaled", [False, True], ids=["replicas", "autoscaled"])
def test_the_idlest_pods_cost_least_before_the_replicas_go_down(api, scale_operator, autoscaled):
    # Without an autoscaler the replicas are in the Deployment's manifest (the applied patch
    # scales); with one, they are the Deployment's spec.replicas alone (kubectl scale is kept).
    ns, name = f"down-cost-{'auto' if autoscaled else 'fixed'}", "resnet"
    ready_model(api, ns, name, 4, **({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6}}
                                     if autoscaled else {}))
    busy, idle = MetricsServer(exposition(0.8, 2, name)), MetricsServer(exposition(0.0, 0, name))
    hung, unready = MetricsServer(hang=True), MetricsServer(exposition(0.9, 5, name))
    try:
        pods = {"busy": busy, "idle": idle, "hung": hung}
        for pod_name, server in pods.items():
            runtime_pod(api, ns, name, pod_name, server.port)
        runtime_pod(api, ns, name, "starting", unready.port, ready=False)
        # A stale cost from an earlier scale-down is overwritten, not trusted.
        api.patch("Pod", ns, "hung", {"metadata": {"annotations": {COST: "999"}}})

        started = time.monotonic()
        api.patch("InferenceModel", ns, name, {"spec": {"replicas": 3}}, subresource="scale")  # kubectl scale
        dep = api.wait(lambda: (lambda d: d if d["spec"]["replicas"] == 3 else None)(
            api.get("Deployment", ns, manifests.runtime_name(name))), 15, "the Deployment scaled down")
        assert time.monotonic() - started < 10  # the hung pod held it a second at most

        got = {n: api.get("Pod", ns, n) for n in (*pods, "starting")}
        costs = {n: (p["metadata"].get("annotations") or {}).get(COST) for n, p in got.items()}
        assert costs == {"busy": "820", "idle": "0", "hung": "0", "starting": None}
        assert unready.asked == 0  # an unready pod goes first anyway: not asked
        # Each cost was written before the replicas (the emulator's resourceVersions are one counter).
        for n in pods:
            assert int(got[n]["metadata"]["resourceVersion"]) < int(dep["metadata"]["resourceVersion"]), n

        # Scaling up costs nobody a look.
        asked = busy.asked
        api.patch("InferenceModel", ns, name, {"spec": {"replicas": 4}}, subresource="scale")
        api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 4, 15)
        assert busy.asked == asked

        # The next scale-down reads the loads again: the busy pod went idle, the idle one busy.
        busy.text, idle.text = exposition(0.0, 0, name), exposition(0.3, 0, name)
        api.patch("InferenceModel", ns, name, {"spec": {"replicas": 2}}, subresource="scale")
        api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 2, 15)
        assert {n: api.get("Pod", ns, n)["metadata"]["annotations"][COST] for n in ("busy", "idle")} == \
            {"busy": "0", "idle": "300"}

        if not autoscaled:  # to zero every pod goes: nobody is asked
            asked = busy.asked
            api.patch("InferenceModel", ns, name, {"spec": {"replicas": 0}}, subresource="scale")
            api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 0, 15)
            assert busy.asked == asked
    finally:
        for server in (busy, idle, hung, unready):
            server.close()
