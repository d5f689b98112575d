"""Scale to zero (issue 24): the idle rule's decision as a pure function, the EndpointSlice
that points a model's Service at the activator, and the whole story with the real operator
against the emulated API server (conftest's `cluster`, `api`, `am`): idle -> 0 replicas,
status ScaledToZero with phase Ready, the Service's requests to the activator; the
activator's scale from zero -> a Ready pod -> the Service back on the pods.

The emulator has no controllers: the test writes the activator Service's EndpointSlice as
the EndpointSlice controller would, plays the Deployment controller (`roll_out`), and plays
the activator (its own conditional scale from zero, `kiln.activator.cluster.activate`).
"""

from __future__ import annotations

import asyncio
import datetime

import pytest

from kiln.activator import cluster as clustermod
from kiln.operator import activation, manifests, scaling
from kiln.operator import signals as sig
from kiln.runtime.api import contract
from support import kubeemu
from support.operator_play import condition, finish_job, jobs, model, reasons, roll_out, status

from .conftest import OperatorThread

T0 = datetime.datetime(2026, 1, 2, 3, 0, 0, tzinfo=datetime.timezone.utc)
ZERO = scaling.Policy(min_replicas=0, max_replicas=4, target=0.5, max_step=2, up_cooldown=60,
                      down_cooldown=300, stabilization=120, to_zero_after=300, activator=True)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def idle(starts: float = 0, seen: float | None = None) -> dict:
    return {sig.IDLE: sig.Signal(sig.FIRING, at(starts), at(starts if seen is None else seen), "fp", 0.0)}


def decide(signals, current=1, state=None, now=400.0, policy=ZERO):
    return scaling.decide(policy, current, current, signals, state or {}, at(now), 600.0)


# ------------------------------------------------------------------ the decision

def test_idle_for_its_time_goes_to_zero():
    d = decide(idle(starts=0, seen=390))
    assert (d.replicas, d.reason, d.source) == (0, "ScaledToZero", sig.IDLE)
    assert "no requests for 400s" in d.message


def test_idle_not_long_enough_waits_and_looks_again_when_the_time_is_up():
    d = decide(idle(starts=0), now=100)
    assert (d.replicas, d.reason, d.look_again) == (1, None, 200)


def test_the_idle_time_starts_again_at_a_scale_change():
    # The activator scaled the model from zero at 350: a full idle time from then.
    state = {"replicas": 1, "lastScaleTime": sig.format_time(at(350))}
    d = decide(idle(starts=0, seen=390), state=state)
    assert (d.replicas, d.look_again) == (1, 250)


def test_without_the_activator_the_model_stays_at_one_and_says_why():
    d = decide(idle(starts=0, seen=390), policy=scaling.Policy(**{**ZERO.__dict__, "activator": False}))
    assert (d.replicas, d.reason) == (1, "NoActivator")
    assert "activator is not installed" in d.message


def test_with_min_replicas_above_zero_idle_is_no_reason_to_scale():
    d = decide(idle(starts=0, seen=390), policy=scaling.Policy(**{**ZERO.__dict__, "min_replicas": 1}))
    assert (d.replicas, d.reason) == (1, None)


def test_a_stale_idle_alert_is_not_acted_on():
    assert decide(idle(starts=0, seen=0), now=700).replicas == 1  # not heard of within the TTL


def test_low_utilization_alone_never_goes_below_one():
    low = {sig.LOW: sig.Signal(sig.FIRING, at(0), at(390), "fp", 0.0)}
    d = decide(low, current=2)
    assert (d.replicas, d.reason) == (1, "UtilizationLow")
    d = decide(low, current=1)
    assert (d.replicas, d.reason) == (1, "AtMinReplicas")
    # Idle and low together: down by utilization while the idle time runs, then to zero.
    d = decide({**low, **idle(starts=200, seen=390)}, current=3)
    assert (d.replicas, d.reason, d.look_again) == (1, "UtilizationLow", 100)


def test_at_zero_nothing_but_someone_else_scales():
    # At zero the utilization is missing (no pods): a hold; the activator's 0 -> 1 is kept.
    missing = {sig.MISSING: sig.Signal(sig.FIRING, at(0), at(390), "fp", None)}
    assert decide(missing, current=0, state={"replicas": 0}).replicas == 0
    d = decide(missing, current=1, state={"replicas": 0})
    assert (d.replicas, d.reason) == (1, "ScaledExternally")


# ------------------------------------------------------------------ the EndpointSlice

ACTIVATOR_SLICE = {"ports": [{"name": "http", "port": 8080}, {"name": "grpc", "port": 8081}],
                   "endpoints": [{"addresses": ["10.0.0.22"], "conditions": {"ready": True}},
                                 {"addresses": ["10.0.0.21"]},
                                 {"addresses": ["10.0.0.23"], "conditions": {"ready": False}}]}


def test_the_held_slice_points_the_models_service_at_the_ready_activator_pods():
    addresses, ports = activation.activator_endpoints([ACTIVATOR_SLICE])
    assert (addresses, ports) == (["10.0.0.21", "10.0.0.22"], {"http": 8080, "grpc": 8081})
    m = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u1"}}
    s = activation.held_slice(m, "chat", addresses, ports)
    assert s["metadata"]["name"] == "chat-activator"
    assert s["metadata"]["labels"][contract.LABEL_SLICE_SERVICE] == "chat"
    assert s["metadata"]["labels"][contract.LABEL_SLICE_MANAGED_BY] == contract.ACTIVATOR_SLICE_MANAGER
    assert s["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert [e["addresses"] for e in s["endpoints"]] == [["10.0.0.21"], ["10.0.0.22"]]
    assert [(p["name"], p["port"]) for p in s["ports"]] == [("http", 8080), ("grpc", 8081)]


def test_only_a_model_that_may_go_to_zero_is_held():
    zero = {"autoscaling": {"enabled": True, "minReplicas": 0}}
    assert activation.may_hold(zero, "kiln/kiln-activator")
    assert not activation.may_hold(zero, None)
    assert not activation.may_hold({"autoscaling": {"enabled": True, "minReplicas": 1}}, "kiln/kiln-activator")
    assert not activation.may_hold({"autoscaling": {"enabled": False, "minReplicas": 0}}, "kiln/kiln-activator")


# ------------------------------------------------------------------ the real operator

ACTIVATOR_NS, ACTIVATOR_SVC = "kiln-system", "kiln-activator"


@pytest.fixture(scope="module")
def zero_operator(cluster):
    cluster.emu.add_resource(kubeemu.ResourceSpec("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"))
    op = OperatorThread(cluster.kubeconfig, alert_token="test-token", resync_seconds=600, retry_seconds=0.5,
                        activator_service=f"{ACTIVATOR_NS}/{ACTIVATOR_SVC}").start()
    yield op
    op.stop()


def test_idle_to_zero_held_by_the_activator_and_back(api, zero_operator, am):
    ns, name = "zero", "chat"
    api.apply({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",  # the EndpointSlice controller's
               "metadata": {"name": f"{ACTIVATOR_SVC}-x1", "namespace": ACTIVATOR_NS,
                            "labels": {contract.LABEL_SLICE_SERVICE: ACTIVATOR_SVC}},
               "addressType": "IPv4", **ACTIVATOR_SLICE})
    api.apply(model(ns, name, autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                           "scaleToZeroAfterSeconds": 2}))
    [job] = api.wait(lambda: jobs(api, ns), 10)
    finish_job(api, job)
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 10, "the Deployment")
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("phase") == "Ready", 10, "Ready")
    assert api.get("EndpointSlice", ns, activation.held_slice_name(name)) is None  # a pod is Ready: not held

    # No requests for long enough: to zero.
    assert am.post(zero_operator, am.webhook(am.alert(ns, name, sig.IDLE, value="0", ago=5))) == (200, {"accepted": 1})
    api.wait(lambda: api.get("InferenceModel", ns, name)["spec"]["runtime"]["replicas"] == 0, 10, "to zero")
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 0, 10,
             "the Deployment at 0")
    roll_out(api, ns, name)
    st = api.wait(lambda: (lambda s: s if condition(s, "Available").get("reason") == "ScaledToZero" else None)(
        status(api, ns, name)), 10, "Available False ScaledToZero")
    assert condition(st, "Available")["status"] == "False" and st["phase"] == "Ready"
    assert condition(st, "Degraded")["status"] == "False"
    assert st["scaling"]["history"][-1]["reason"] == "ScaledToZero"
    held = api.wait(lambda: api.get("EndpointSlice", ns, activation.held_slice_name(name)), 10, "the held slice")
    assert held["metadata"]["labels"][contract.LABEL_SLICE_SERVICE] == name
    assert [e["addresses"][0] for e in held["endpoints"]] == ["10.0.0.21", "10.0.0.22"]
    assert "ScaledDown" in reasons(api, ns, name) and "Activating" in reasons(api, ns, name)

    # The activator's scale from zero (a request arrived), then the alert resolves (it was served).
    assert asyncio.run(clustermod.activate(api.kube, ns, name)) is True
    resolved = am.webhook(am.alert(ns, name, sig.IDLE, status="resolved", value="0"))
    am.post(zero_operator, resolved)
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name))["spec"]["replicas"] == 1, 10,
             "the Deployment at 1")
    assert api.get("EndpointSlice", ns, activation.held_slice_name(name)) is not None  # still starting: held
    roll_out(api, ns, name)
    api.wait(lambda: api.get("EndpointSlice", ns, activation.held_slice_name(name)) is None, 10,
             "the Service back on its pods")
    st = api.wait(lambda: (lambda s: s if condition(s, "Available").get("status") == "True" else None)(
        status(api, ns, name)), 10, "Available")
    assert st["phase"] == "Ready"
    assert [h["reason"] for h in st["scaling"]["history"]][-2:] == ["ScaledToZero", "ScaledExternally"]
    assert "ActivatorRemoved" in reasons(api, ns, name)
