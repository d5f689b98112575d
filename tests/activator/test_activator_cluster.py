"""The activator's Kubernetes side against the emulated API server (tests/support/kubeemu.py)
with the real kubernetes client: the conditional scale from zero (several replicas asking
at once scale the model once; a model not at zero is left as it is), and the watches that
fill the routing table (a pod's readiness, the operator's held EndpointSlices)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kiln.activator import cluster as clustermod
from kiln.activator.table import Table
from kiln.operator.kube import Kube, load_client
from kiln.runtime.api import spec as specmod
from kiln.runtime.api.contract import (ACTIVATOR_SLICE_MANAGER, API_VERSION, KIND, LABEL_MODEL,
                                       LABEL_SLICE_MANAGED_BY, LABEL_SLICE_SERVICE)
from support import kubeemu

NS = "ml"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    emu = kubeemu.ThreadedEmulator(crd=specmod.load_crd())
    emu.emu.add_resource(kubeemu.ResourceSpec("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"))
    emu.kubeconfig = emu.emu.kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig")
    yield emu
    emu.close()


def model(name: str, replicas: int) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"uri": "pvc://models/m.onnx", "version": "1"},
                     "engine": {"backend": "onnxruntime", "precision": "fp32"},
                     "runtime": {"replicas": replicas},
                     "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}}}


async def test_several_activators_scale_a_model_from_zero_once(emulator):
    kube = Kube(load_client(str(emulator.kubeconfig)))
    await kube.create(model("cold", 0))
    done = await asyncio.gather(*(clustermod.activate(kube, NS, "cold") for _ in range(5)))
    assert sorted(done) == [False] * 4 + [True]
    assert (await kube.get(KIND, NS, "cold"))["spec"]["runtime"]["replicas"] == 1
    # A model someone scaled meanwhile is not touched.
    await kube.create(model("warm", 3))
    assert await clustermod.activate(kube, NS, "warm") is False
    assert (await kube.get(KIND, NS, "warm"))["spec"]["runtime"]["replicas"] == 3


def runtime_pod(name: str) -> dict:
    """As created: no status yet (the kubelet's, through the status subresource)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {LABEL_MODEL: "m", "app.kubernetes.io/name": "kiln-runtime"}},
            "spec": {"containers": [{"name": "runtime", "image": "kiln",
                                     "ports": [{"name": "http", "containerPort": 8080},
                                               {"name": "grpc", "containerPort": 8081}]}]},
        }


async def wait_until(what, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("namespaces", [None, [NS]], ids=["cluster", "namespaced"])
async def test_the_watches_fill_the_table(emulator, namespaces):
    api_client = load_client(str(emulator.kubeconfig))
    kube = Kube(api_client)
    table = Table()
    watches = clustermod.Watches(api_client, table, asyncio.get_running_loop(), watch_seconds=1,
                                 namespaces=namespaces)
    await kube.create(runtime_pod("m-0"))
    watches.start()
    try:
        await asyncio.sleep(0.5)
        assert table.ready((NS, "m")) == []
        await kube.patch("Pod", NS, "m-0", {"status": {"podIP": "10.1.2.3",
                                                       "conditions": [{"type": "Ready", "status": "True"}]}},
                         subresource="status")
        await wait_until(lambda: [e.host for e in table.ready((NS, "m"))] == ["10.1.2.3"])
        await kube.delete("Pod", NS, "m-0")
        await wait_until(lambda: table.ready((NS, "m")) == [])
        held = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "held-activator", "namespace": NS,
                             "labels": {LABEL_SLICE_SERVICE: "held", LABEL_MODEL: "held",
                                        LABEL_SLICE_MANAGED_BY: ACTIVATOR_SLICE_MANAGER}},
                "addressType": "IPv4", "endpoints": [{"addresses": ["10.9.9.9"]}], "ports": []}
        await kube.request("POST", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", held)
        await wait_until(lambda: table.namespace_of("held") == NS)
        await kube.request("DELETE", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices/held-activator")
        await wait_until(lambda: table.namespace_of("held") is None)
    finally:
        watches.stop()
        await asyncio.sleep(1.5)  # each watch ends within watch_seconds, and its thread with it
