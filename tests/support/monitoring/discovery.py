"""Kubernetes pod discovery for a Prometheus built without it.

Debian's prometheus has no Kubernetes service discovery at all (removed from the package
since 1.5 for client-go's dependencies: `kubernetes_sd_configs` is "field not found"). This
stands in for it: an HTTP service discovery endpoint (`http_sd_configs`, which Debian's
build has) that lists pods from a real API server on every refresh and labels each target
with the same `__meta_kubernetes_*` labels the pod role of kubernetes_sd_configs gives, so
the relabeling of `configs.pod_relabel_configs()` (what a PodMonitor does) is the same
either way and proves the same thing.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .process import HOST

_META = "__meta_kubernetes_"


def sanitize(name: str) -> str:
    """A label or annotation name as a label name suffix (Prometheus: every other character -> _)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The target groups kubernetes_sd_configs (role pod) makes of one pod: one target per
    declared container port, one per container without ports; none before it has an IP."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ip = status.get("podIP") or ""
    if not ip:
        return []
    ready = next((c["status"].lower() for c in status.get("conditions") or () if c["type"] == "Ready"), "unknown")
    labels = {f"{_META}namespace": meta["namespace"], f"{_META}pod_name": meta["name"],
              f"{_META}pod_ip": ip, f"{_META}pod_ready": ready, f"{_META}pod_phase": status.get("phase", ""),
              f"{_META}pod_node_name": spec.get("nodeName", ""), f"{_META}pod_host_ip": status.get("hostIP", ""),
              f"{_META}pod_uid": meta.get("uid", "")}
    for kind, values in (("label", meta.get("labels") or {}), ("annotation", meta.get("annotations") or {})):
        for key, value in values.items():
            labels[f"{_META}pod_{kind}_{sanitize(key)}"] = value
            labels[f"{_META}pod_{kind}present_{sanitize(key)}"] = "true"
    controller = next((o for o in meta.get("ownerReferences") or () if o.get("controller")), None)
    if controller:
        labels[f"{_META}pod_controller_kind"] = controller["kind"]
        labels[f"{_META}pod_controller_name"] = controller["name"]
    host = f"[{ip}]" if ":" in ip else ip
    groups = []
    for init, containers in ((False, spec.get("containers") or ()), (True, spec.get("initContainers") or ())):
        for c in containers:
            container = {f"{_META}pod_container_name": c["name"], f"{_META}pod_container_image": c.get("image", ""),
                         f"{_META}pod_container_init": str(init).lower()}
            if not c.get("ports"):
                groups.append({"targets": [host], "labels": {**labels, **container}})
            for port in c.get("ports") or ():
                groups.append({"targets": [f"{host}:{port['containerPort']}"], "labels": {
                    **labels, **container, f"{_META}pod_container_port_name": port.get("name", ""),
                    f"{_META}pod_container_port_number": str(port["containerPort"]),
                    f"{_META}pod_container_port_protocol": port.get("protocol", "TCP")}})
    return groups


class PodDiscovery:
    """An HTTP SD endpoint (`url`) over the pods of `namespaces`, read from `api_server` with
    a client certificate or a token, as `configs.pod_scrape_config` takes them. Each
    Prometheus refresh is one list per namespace; an API error answers 502, and Prometheus
    keeps the targets it had."""

    def __init__(self, api_server: str, namespaces: list[str], *, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None,
                 bearer_token_file: str | None = None) -> None:
        self.api_server, self.namespaces = api_server.rstrip("/"), list(namespaces)
        self.token_file = bearer_token_file
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file and key_file:
            context.load_cert_chain(cert_file, key_file)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                   urllib.request.HTTPSHandler(context=context))
        self.refreshes = 0
        self.last_error: str | None = None
        self._server = ThreadingHTTPServer((HOST, 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="pod-discovery", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}/targets"

    def groups(self) -> list[dict[str, Any]]:
        return [g for ns in self.namespaces for pod in self._list(ns) for g in pod_targets(pod)]

    def _list(self, namespace: str) -> list[dict[str, Any]]:
        headers = {"Accept": "application/json"}
        if self.token_file:
            headers["Authorization"] = f"Bearer {Path(self.token_file).read_text().strip()}"
        req = urllib.request.Request(f"{self.api_server}/api/v1/namespaces/{namespace}/pods", headers=headers)
        with self._opener.open(req, timeout=10) as resp:
            return json.loads(resp.read())["items"]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        discovery = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    status, body = 200, json.dumps(discovery.groups()).encode()
                    discovery.last_error = None
                except Exception as e:  # the API server's answer, whatever it is, goes to Prometheus
                    discovery.last_error = f"{type(e).__name__}: {e}"
                    status, body = 502, discovery.last_error.encode()
                discovery.refreshes += 1
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def start(self) -> "PodDiscovery":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> "PodDiscovery":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
