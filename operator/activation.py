"""A model at zero: its Service points at the activator, and back once a pod is Ready.

While a model that may go to zero (autoscaling with minReplicas 0, the activator
installed) has no Ready runtime pod, the operator writes an EndpointSlice for the model's
Service `<model>` (`<model>-activator`, managed-by ACTIVATOR_SLICE_MANAGER, not the
EndpointSlice controller's) whose endpoints are the activator's pods: kube-proxy and a
Gateway send the Service's traffic there, and the activator holds it while the first
replica starts. Once a pod is Ready the slice is deleted: the activator is off the path.

Why a slice of our own and not a selector switch: the Service keeps its selector (the
EndpointSlice controller keeps writing the runtime pods' slice beside ours), so nothing
flips under kube-proxy; the activator lives in the chart's namespace, which a Service's
selector cannot reach; and while both slices exist (a pod just Ready, our slice not yet
gone) the activator forwards to that same pod, so either path answers.

The activator's addresses are its own Service's EndpointSlices (the EndpointSlice
controller's), read on each pass of a model at zero; a change of activator pods reaches a
model's slice at its next pass (an event, or the resync).
"""

from __future__ import annotations

import urllib.parse
from typing import Any, Mapping

from kiln.operator import manifests
from kiln.operator.steps import Pass
from kiln.runtime.api.contract import (ACTIVATOR_SLICE_MANAGER, GRPC_PORT, LABEL_MODEL, LABEL_SLICE_MANAGED_BY,
                                       LABEL_SLICE_SERVICE, MANAGED_BY, SERVICE_PORT)


def held_slice_name(model: str) -> str:
    return f"{model}-activator"


def may_hold(spec: Mapping[str, Any], activator_service: str | None) -> bool:
    """The model may go to zero, its requests then held by the activator."""
    auto = spec.get("autoscaling") or {}
    return bool(activator_service and auto.get("enabled") and int(auto.get("minReplicas", 1)) == 0)


def activator_endpoints(slices: list[Mapping[str, Any]]) -> tuple[list[str], dict[str, int]]:
    """(the Ready addresses, port name -> number) from the activator Service's EndpointSlices."""
    addresses: list[str] = []
    ports: dict[str, int] = {}
    for s in slices:
        for port in s.get("ports") or []:
            if port.get("name") and port.get("port"):
                ports[port["name"]] = int(port["port"])
        for endpoint in s.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready", True) is not False:
                addresses.extend(a for a in endpoint.get("addresses") or [] if a not in addresses)
    return sorted(addresses), ports


def held_slice(model: Mapping[str, Any], service: str, addresses: list[str], ports: Mapping[str, int]
               ) -> dict[str, Any]:
    """The model's Service's EndpointSlice pointing at the activator (its ports by the
    Service's port names, `http` and `grpc`)."""
    meta = model["metadata"]
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": held_slice_name(meta["name"]), "namespace": meta["namespace"],
                     "labels": {LABEL_SLICE_SERVICE: service, LABEL_SLICE_MANAGED_BY: ACTIVATOR_SLICE_MANAGER,
                                LABEL_MODEL: meta["name"], **MANAGED_BY},
                     "ownerReferences": [manifests.owner_reference(model)]},
        "addressType": "IPv6" if any(":" in a for a in addresses) else "IPv4",
        "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
        "ports": [{"name": manifests.RUNTIME_PORT_NAME, "port": ports.get(manifests.RUNTIME_PORT_NAME, SERVICE_PORT),
                   "protocol": "TCP"},
                  {"name": manifests.GRPC_PORT_NAME, "port": ports.get(manifests.GRPC_PORT_NAME, GRPC_PORT),
                   "protocol": "TCP", "appProtocol": "grpc"}],
    }


async def route(p: Pass, ready: int) -> bool:
    """Point the model's Service at the activator while it has no Ready pod, and back.
    True while its requests go to the activator."""
    activator = p.ctx.config.activator_service
    if not may_hold(p.spec, activator) or p.invalid is not None:
        return False
    if ready > 0 and int(p.previous.get("readyReplicas") or 0) > 0:
        return False  # serving since the last pass, which took the slice away: no call on a steady model
    kube, name = p.ctx.kube, held_slice_name(p.name)
    existing = await kube.get("EndpointSlice", p.ns, name)
    if ready > 0:
        if existing is not None:
            await kube.delete("EndpointSlice", p.ns, name)
            p.record("Normal", "ActivatorRemoved", f"{ready} pod(s) Ready: Service {p.name} no longer goes "
                                                   f"through the activator")
        return False
    namespace, service = str(activator).split("/", 1)
    listed = await kube.request("GET", f"/apis/discovery.k8s.io/v1/namespaces/{urllib.parse.quote(namespace)}"
                                       "/endpointslices",
                                query=[("labelSelector", f"{LABEL_SLICE_SERVICE}={service}")])
    addresses, ports = activator_endpoints(listed.get("items") or [])
    desired = held_slice(p.model, manifests.service_name(p.name), addresses, ports)
    if existing is None:
        await kube.create(desired)
        p.record("Normal" if addresses else "Warning", "Activating",
                 f"no Ready pod: Service {p.name} goes to the activator {activator} "
                 f"({len(addresses)} pod(s)), which holds its requests")
    elif any(existing.get(k) != desired[k] for k in ("endpoints", "ports")):
        await kube.patch("EndpointSlice", p.ns, name, {k: desired[k] for k in ("endpoints", "ports")})
    return True
