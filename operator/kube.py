"""The one module that calls the Kubernetes API (besides kopf's own watching).

Built on the official `kubernetes` client's ApiClient (its configuration, auth and
connection pool) with plain JSON bodies in and out: the operator's builders produce
dicts, and the generated model classes would drop fields they do not know. Calls run in
a thread (`asyncio.to_thread`), so they never block kopf's event loop.

- `create` answers the existing object on 409: creating is idempotent.
- Patches are JSON merge patches (RFC 7386); a `resourceVersion` in the patch makes it
  conditional (409 on a concurrent change).
- `delete` treats 404 as done.
- `list` is for a moment's look only (the runtime pods at a scale-down); what reconciles
  read every pass comes from kopf's watches.
- An `ApiError` says what was asked (`action`) and whether the API server refused it
  (`refused`: the reconcile makes that an Event and a condition).
- Every call is counted (`calls`), so tests and benchmarks can see what reconciling costs.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import json
import logging
import os
import urllib.parse
import uuid
from typing import Any, Mapping

from kiln.runtime.api.contract import API_VERSION, KIND, PLURAL

logger = logging.getLogger("kiln.operator.kube")

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
POOL_SIZE = 32  # connections to the API server, and threads that make the calls

# kind -> (apiVersion, plural, namespaced) for everything the operator writes or reads.
KINDS: dict[str, tuple[str, str, bool]] = {
    KIND: (API_VERSION, PLURAL, True),
    "Job": ("batch/v1", "jobs", True),
    "Pod": ("v1", "pods", True),
    "Deployment": ("apps/v1", "deployments", True),
    "Service": ("v1", "services", True),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets", True),
    "ConfigMap": ("v1", "configmaps", True),
    "EndpointSlice": ("discovery.k8s.io/v1", "endpointslices", True),
    "Event": ("v1", "events", True),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes", True),
    "GRPCRoute": ("gateway.networking.k8s.io/v1", "grpcroutes", True),
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message
        self.action = ""  # what was asked, for people: "create Deployment ns/name" (set by the verbs)

    @property
    def refused(self) -> bool:
        """The API server refused the request itself (invalid, forbidden, bad): asking again
        fails the same way until someone changes something (the spec, RBAC, a quota, a
        policy). Not a missing object, a conflict or throttling."""
        return 400 <= self.status < 500 and self.status not in (404, 409, 410, 429)

    def asked(self, verb: str, kind: str, namespace: str | None, name: str, subresource: str | None = None) -> "ApiError":
        self.action = f"{verb} {kind} {namespace}/{name}" + (f" ({subresource})" if subresource else "")
        return self


def path_for(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    """The API path of a kind's collection, or of one object (and its subresource). Each of
    namespace, name and subresource is one path segment, quoted: nothing in them can change
    the query or the path (the client resolves '..', the server decodes `%2F` into a
    separator, so those are refused: ValueError). None leaves a part out."""
    api_version, plural, namespaced = KINDS[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced and namespace is not None:
        base += f"/namespaces/{_segment(namespace)}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{_segment(name)}"
    if subresource is not None:
        base += f"/{_segment(subresource)}"
    return base


def _segment(value: str) -> str:
    if value in ("", ".", "..") or "/" in value:
        raise ValueError(f"{value!r} is not an object's name or a subresource")
    return urllib.parse.quote(value, safe="")


def load_configuration(kubeconfig: str | None = None) -> Any:
    """The client configuration: the in-cluster service account, else the kubeconfig.

    The kubeconfig path is read now ($KUBECONFIG when none is given), not when the
    kubernetes package was imported (its default location is frozen at import).
    """
    import kubernetes

    configuration = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    try:
        if path:
            raise kubernetes.config.ConfigException("a kubeconfig is given")
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)
    return configuration


def load_client(kubeconfig: str | None = None) -> Any:
    import kubernetes

    configuration = load_configuration(kubeconfig)
    configuration.connection_pool_maxsize = POOL_SIZE
    return kubernetes.client.ApiClient(configuration)


def connection_info(kubeconfig: str | None = None) -> Any:
    """kopf's credentials from the same configuration the client uses (a kopf login handler)."""
    import kopf

    cfg = load_configuration(kubeconfig)
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                               username=cfg.username or None, password=cfg.password or None, scheme=scheme,
                               token=token, certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


class Kube:
    def __init__(self, api_client: Any, component: str = "kiln-operator") -> None:
        self.client = api_client
        self.component = component
        self.calls: collections.Counter[str] = collections.Counter()

    # ---- transport

    def _request_sync(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
                      content_type: str | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        elif body is not None:
            headers["Content-Type"] = "application/json"
        m, url, hdrs, b, post = self.client.param_serialize(
            method=method, resource_path=path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"])
        resp = self.client.call_api(m, url, header_params=hdrs, body=b, post_params=post, _request_timeout=(5, 30))
        resp.read()
        data = resp.data or b""
        try:
            payload = json.loads(data) if data else {}
        except ValueError:
            payload = {"message": data.decode(errors="replace")}
        if not 200 <= resp.status < 300:
            raise ApiError(resp.status, str(payload.get("reason") or resp.reason or ""), str(payload.get("message") or ""))
        return payload

    async def request(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
                      content_type: str | None = None) -> dict[str, Any]:
        self.calls[method] += 1
        return await asyncio.to_thread(self._request_sync, method, path, body, query, content_type)

    # ---- verbs

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path_for(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise e.asked("get", kind, namespace, name)

    async def list(self, kind: str, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        try:
            return list((await self.request("GET", path_for(kind, namespace), query=query)).get("items") or [])
        except ApiError as e:
            raise e.asked("list", kind, namespace, label_selector or "*")

    async def create(self, obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create `obj`; on 409 answer the existing object. Returns (object, created)."""
        meta = obj["metadata"]
        try:
            return await self.request("POST", path_for(obj["kind"], meta.get("namespace")), body=dict(obj)), True
        except ApiError as e:
            if e.status != 409:
                raise e.asked("create", obj["kind"], meta.get("namespace"), meta["name"])
        existing = await self.get(obj["kind"], meta.get("namespace"), meta["name"])
        if existing is None:  # deleted in between: the caller's next pass creates it
            raise ApiError(409, "Conflict", f"{obj['kind']} {meta['name']} exists but could not be read")
        return existing, False

    async def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any] | list[dict[str, Any]],
                    subresource: str | None = None) -> dict[str, Any]:
        """A merge patch (a mapping), or a JSON Patch (a list of operations)."""
        json_patch = isinstance(patch, list)
        try:
            return await self.request("PATCH", path_for(kind, namespace, name, subresource),
                                      body=list(patch) if json_patch else dict(patch),
                                      content_type=JSON_PATCH if json_patch else MERGE_PATCH)
        except ApiError as e:
            raise e.asked("patch", kind, namespace, name, subresource)

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", path_for(kind, namespace, name), body=body)
            return True
        except ApiError as e:
            if e.status in (404, 409):  # gone already, or a newer object took the name
                return False
            raise e.asked("delete", kind, namespace, name)

    async def event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str,
                    now: datetime.datetime | None = None) -> None:
        """Post a core/v1 Event about `involved` (Normal or Warning). Failures are logged, not raised."""
        meta = involved["metadata"]
        now = now or datetime.datetime.now(datetime.timezone.utc)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        micro = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": self.component}, "reportingComponent": self.component,
            "reportingInstance": self.component, "action": reason,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "eventTime": micro, "count": 1,
        }
        try:
            await self.request("POST", path_for("Event", meta["namespace"]), body=body)
        except Exception as e:  # an event is worth a log line, never a failed reconcile
            logger.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], e)
