"""The activator's Kubernetes side: the watches that fill the table, and the scale from zero.

Two watches (the official client's, each in a thread, every call time-bounded): the
runtime pods (`app.kubernetes.io/name=kiln-runtime`), whose Ready ones the table routes
to, and the EndpointSlices the operator writes for models at zero (managed-by
ACTIVATOR_SLICE_MANAGER), which say which models are held here. A watch that ends or
fails lists again (after a short backoff), so a missed event is repaired by the next list.

`activate` reads the model's scale subresource and, at zero, patches it to one conditional
on the resourceVersion it read: several activator replicas asking at once scale it once,
and a model someone scaled meanwhile is left as it is (409: nothing to do).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

from kiln.activator.table import Table
from kiln.operator.kube import ApiError, Kube, path_for
from kiln.runtime.api.contract import ACTIVATOR_SLICE_MANAGER, KIND, LABEL_MODEL, LABEL_SLICE_MANAGED_BY

log = logging.getLogger("kiln.activator.cluster")

RUNTIME_PODS = "app.kubernetes.io/name=kiln-runtime"
HELD_SLICES = f"{LABEL_SLICE_MANAGED_BY}={ACTIVATOR_SLICE_MANAGER}"
WATCH_SECONDS = 60  # the API server ends each watch after this long; the client's own timeout is a little more
BACKOFF_SECONDS = 2.0


async def activate(kube: Kube, namespace: str, model: str) -> bool:
    """Scale `model` to one if it is at zero; True when this call did it.

    Conditional on the resourceVersion read with the zero: a second activator (or a person)
    in between gets 409, and the model is scaled once. (Not a JSON Patch `test` op on
    /spec/replicas: the Scale object leaves replicas out when it is 0, so the path does not
    exist at zero - the real API server's answer, found on the local control plane.)"""
    scale = await kube.request("GET", path_for(KIND, namespace, model, "scale"))
    if int((scale.get("spec") or {}).get("replicas") or 0) != 0:
        return False
    try:
        await kube.patch(KIND, namespace, model, {"metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]},
                                                  "spec": {"replicas": 1}}, subresource="scale")
        return True
    except ApiError as e:
        if e.status == 409:  # changed since the read: someone else scaled it
            return False
        raise


class Watches:
    """The two watches, feeding `table` on its event loop."""

    def __init__(self, api_client: Any, table: Table, loop: asyncio.AbstractEventLoop,
                 watch_seconds: int = WATCH_SECONDS, namespaces: list[str] | None = None) -> None:
        """`namespaces`: watch only these (the chart's namespaced mode), else the whole cluster."""
        self.client, self.table, self.loop, self.watch_seconds = api_client, table, loop, watch_seconds
        self.namespaces = namespaces or []
        self.stopping = threading.Event()
        self._pods: dict[str | None, list[dict]] = {}  # the last list of each namespace watched
        self._slices: dict[tuple[str, str], tuple[str, str]] = {}  # (namespace, slice) -> model key

    def start(self) -> None:
        import functools

        import kubernetes

        core, discovery = kubernetes.client.CoreV1Api(self.client), kubernetes.client.DiscoveryV1Api(self.client)
        scopes: list[tuple[str | None, Callable[..., Any], Callable[..., Any]]] = (
            [(ns, functools.partial(core.list_namespaced_pod, ns),
              functools.partial(discovery.list_namespaced_endpoint_slice, ns)) for ns in self.namespaces]
            or [(None, core.list_pod_for_all_namespaces, discovery.list_endpoint_slice_for_all_namespaces)])
        for ns, pods, slices in scopes:
            for what, lister, selector, on_list, on_event in (
                    ("pods", pods, RUNTIME_PODS, functools.partial(self._pods_listed, ns), self._pod_event),
                    ("slices", slices, HELD_SLICES, functools.partial(self._slices_listed, ns), self._slice_event)):
                threading.Thread(target=self._run, args=(lister, selector, on_list, on_event),
                                 name=f"watch-{what}-{ns or 'all'}", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self, lister: Callable[..., Any], selector: str, on_list: Callable[[list[dict]], None],
             on_event: Callable[[str, dict], None]) -> None:
        import kubernetes

        while not self.stopping.is_set():
            try:
                listed = self.client.sanitize_for_serialization(
                    lister(label_selector=selector, _request_timeout=(5, 30)))
                self.loop.call_soon_threadsafe(on_list, listed.get("items") or [])
                version = (listed.get("metadata") or {}).get("resourceVersion")
                stream = kubernetes.watch.Watch().stream(lister, label_selector=selector, resource_version=version,
                                                         timeout_seconds=self.watch_seconds,
                                                         _request_timeout=(5, self.watch_seconds + 10))
                for event in stream:
                    if self.stopping.is_set():
                        return
                    obj = self.client.sanitize_for_serialization(event["object"])
                    self.loop.call_soon_threadsafe(on_event, event["type"], obj)
            except Exception as e:  # relist after a pause: the list repairs whatever was missed
                log.warning("watch of %s failed, listing again: %s", selector, e)
                self.stopping.wait(BACKOFF_SECONDS)

    def _pods_listed(self, namespace: str | None, pods: list[dict]) -> None:
        self._pods[namespace] = pods
        self.table.replace([p for listed in self._pods.values() for p in listed])

    def _pod_event(self, kind: str, pod: dict) -> None:
        if kind == "DELETED":
            self.table.remove_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
        elif kind in ("ADDED", "MODIFIED"):
            self.table.set_pod(pod)

    def _slices_listed(self, namespace: str | None, slices: list[dict]) -> None:
        self._slices = {k: v for k, v in self._slices.items() if namespace is not None and k[0] != namespace}
        for s in slices:
            self._slice_event("ADDED", s)

    def _slice_event(self, kind: str, endpoint_slice: dict) -> None:
        meta = endpoint_slice.get("metadata") or {}
        name = (meta.get("namespace"), meta.get("name"))
        model = (meta.get("labels") or {}).get(LABEL_MODEL)
        if kind == "DELETED" or not model:
            self._slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._slices[name] = (name[0], model)
        self.table.set_activating(set(self._slices.values()))
