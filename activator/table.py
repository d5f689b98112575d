"""Which runtime pods are Ready, per model: the activator's in-memory routing table.

Filled from a watch of runtime pods (`cluster.py`) and read by the holding queues
(`holding.py`). Pure apart from the asyncio.Event it sets on each change, so tests fill it
by hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Mapping

from kiln.runtime.api.contract import GRPC_PORT, LABEL_MODEL, SERVICE_PORT

RUNTIME_PORT_NAME, GRPC_PORT_NAME = "http", "grpc"  # the runtime container's port names (manifests.py)

Key = tuple[str, str]  # (namespace, model)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    host: str
    http_port: int
    grpc_port: int

    @property
    def http_url(self) -> str:
        return f"http://[{self.host}]:{self.http_port}" if ":" in self.host else f"http://{self.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"[{self.host}]:{self.grpc_port}" if ":" in self.host else f"{self.host}:{self.grpc_port}"


def endpoint_of(pod: Mapping[str, Any]) -> tuple[Key, Endpoint | None] | None:
    """(model key, the pod's endpoint when it is Ready and not terminating, else None);
    None for a pod that is no model's."""
    meta = pod.get("metadata") or {}
    model = (meta.get("labels") or {}).get(LABEL_MODEL)
    if not model or not meta.get("namespace"):
        return None
    key = (meta["namespace"], model)
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not ready or meta.get("deletionTimestamp") or not status.get("podIP"):
        return key, None
    ports = {p.get("name"): int(p["containerPort"]) for c in (pod.get("spec") or {}).get("containers") or []
             for p in c.get("ports") or [] if p.get("containerPort")}
    return key, Endpoint(status["podIP"], ports.get(RUNTIME_PORT_NAME, SERVICE_PORT), ports.get(GRPC_PORT_NAME, GRPC_PORT))


class Table:
    """(namespace, model) -> {pod name: Endpoint} of its Ready pods."""

    def __init__(self) -> None:
        self._ready: dict[Key, dict[str, Endpoint]] = {}
        self._pods: dict[tuple[str, str], Key] = {}  # (namespace, pod) -> its model
        self._activating: set[Key] = set()  # models whose Service points here (the operator's EndpointSlices)
        self._changed = asyncio.Event()

    def set_pod(self, pod: Mapping[str, Any]) -> None:
        """A pod added or modified (a watch event); a pod that is no longer Ready leaves."""
        found = endpoint_of(pod)
        if found is None:
            return
        key, endpoint = found
        name = (key[0], pod["metadata"]["name"])
        if endpoint is None:
            self.remove_pod(*name)
            return
        self._pods[name] = key
        self._ready.setdefault(key, {})[name[1]] = endpoint
        self._notify()

    def remove_pod(self, namespace: str, name: str) -> None:
        key = self._pods.pop((namespace, name), None)
        if key is not None:
            self._ready.get(key, {}).pop(name, None)
            if not self._ready.get(key):
                self._ready.pop(key, None)
            self._notify()

    def replace(self, pods: list[Mapping[str, Any]]) -> None:
        """Everything, from a fresh list (a watch that starts again)."""
        self._ready.clear()
        self._pods.clear()
        for pod in pods:
            self.set_pod(pod)
        self._notify()

    def set_activating(self, keys: set[Key]) -> None:
        self._activating = set(keys)

    def known(self, key: Key) -> bool:
        """A model the activator serves: one with Ready pods, or whose Service points here."""
        return key in self._activating or key in self._ready

    def namespace_of(self, model: str) -> str | None:
        """The one namespace a model of this name is known in (a short Host such as
        `resnet:8080` names none), else None."""
        found = {ns for ns, name in self._activating | set(self._ready) if name == model}
        return found.pop() if len(found) == 1 else None

    def ready(self, key: Key) -> list[Endpoint]:
        return sorted(self._ready.get(key, {}).values(), key=lambda e: e.host)

    async def changed(self) -> None:
        """Returns at the next change."""
        event = self._changed
        await event.wait()

    def _notify(self) -> None:
        # Wake everyone waiting, then arm a fresh event for the next change.
        self._changed.set()
        self._changed = asyncio.Event()
