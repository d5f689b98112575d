"""An emulated Kubernetes API server for API-level tests: kmock 0.8 plus a realism layer.

kmock's `KubernetesEmulator` serves discovery, stores objects and streams watch events,
but, used plainly, it is not enough for kopf and the `kubernetes` client. This subclass
keeps kmock's HTTP server, request recording and reaction DSL (a test can still inject a
fault with `emu[kmock.action.CREATE, kmock.resource('batch/v1/jobs')] << 500`) and
replaces the object store with one that behaves like a real API server where it matters:

- metadata: `uid`, a cluster-wide `resourceVersion` (409 on a stale one in a patch or a
  replace), `generation` bumped only when something outside metadata and status changes,
  `creationTimestamp`, `namespace` from the URL, `generateName`;
- create answers 201 and 409 `AlreadyExists`; lists carry `kind`, `apiVersion` and a
  `resourceVersion`;
- PATCH with `merge-patch`, `strategic-merge-patch` (treated as a merge patch: lists are
  replaced, not merged by key - the operator always sends whole lists) and `json-patch`
  (a failed `test` answers 422); PUT replaces;
- status and scale subresources isolated from the main resource (the main resource
  ignores `status`, `/status` changes nothing else, `/scale` maps to the replicas paths);
- label selectors (`=`, `==`, `!=`, `in`, `notin`, exists, `!`) and field selectors;
- watch streams from a `resourceVersion` with a server-side `timeoutSeconds`, and 410
  Gone for a version older than the kept history;
- `GET /api/v1/namespaces` (kmock 0.8 cannot parse that path); namespaces appear as
  objects get created in them;
- deletion honours finalizers (`deletionTimestamp` first, gone when they are removed).

What a real cluster does and this server does not: garbage collection by
ownerReferences, the Job/Deployment controllers, the kubelet, admission and schema
validation. Tests simulate those explicitly.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import json
import re
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import apps, enums, rendering

HISTORY = 50_000  # watch events kept per resource (older resourceVersions answer 410)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.frozen
class ApiError(kmock.KubernetesError):
    """A Kubernetes `Status` failure with a proper reason (`AlreadyExists`, `Conflict`, ...)."""


def _error(status: int, reason: str, message: str, **details: Any) -> ApiError:
    return ApiError(status=status, reason=reason, message=message, details=details or {"causes": []})


@attrs.frozen
class ResourceSpec:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()
    shortnames: tuple[str, ...] = ()
    # For the scale subresource: JSON paths (dotted) of spec and status replicas, selector.
    scale_spec: str = ".spec.replicas"
    scale_status: str = ".status.replicas"
    scale_selector: str = ".status.selector"

    @property
    def key(self) -> str:
        return f"{self.group}/{self.version}/{self.plural}" if self.group else f"{self.version}/{self.plural}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


BUILTIN = [
    ResourceSpec("", "v1", "namespaces", "Namespace", namespaced=False, subresources=("status",), shortnames=("ns",)),
    ResourceSpec("", "v1", "pods", "Pod", subresources=("status",), shortnames=("po",)),
    ResourceSpec("", "v1", "services", "Service", subresources=("status",), shortnames=("svc",)),
    ResourceSpec("", "v1", "configmaps", "ConfigMap", shortnames=("cm",)),
    ResourceSpec("", "v1", "events", "Event", shortnames=("ev",)),
    ResourceSpec("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", subresources=("status",)),
    ResourceSpec("batch", "v1", "jobs", "Job", subresources=("status",)),
    ResourceSpec("apps", "v1", "deployments", "Deployment", subresources=("status", "scale"), shortnames=("deploy",)),
    ResourceSpec("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", subresources=("status",), shortnames=("pdb",)),
    ResourceSpec("events.k8s.io", "v1", "events", "Event", shortnames=("ev",)),
    ResourceSpec("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                 namespaced=False, subresources=("status",), shortnames=("crd",)),
    ResourceSpec("coordination.k8s.io", "v1", "leases", "Lease"),
]


def crd_resources(crd: dict[str, Any]) -> list[ResourceSpec]:
    """The served versions of a CustomResourceDefinition, as ResourceSpecs."""
    spec = crd["spec"]
    out = []
    for v in spec["versions"]:
        if not v.get("served", True):
            continue
        subs = v.get("subresources") or {}
        scale = subs.get("scale") or {}
        out.append(ResourceSpec(
            spec["group"], v["name"], spec["names"]["plural"], spec["names"]["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            subresources=tuple(sorted(subs)),
            shortnames=tuple(spec["names"].get("shortNames", ())),
            scale_spec=scale.get("specReplicasPath", ".spec.replicas"),
            scale_status=scale.get("statusReplicasPath", ".status.replicas"),
            scale_selector=scale.get("labelSelectorPath", ".status.selector"),
        ))
    return out


# ---------------------------------------------------------------- selectors and paths

_SEL = re.compile(r"\s*([^\s!=,()]+)\s+(in|notin)\s+\(([^)]*)\)\s*|\s*([^,]+?)\s*(==|!=|=)\s*([^,]*?)\s*$|\s*(!?)([^,!=\s]+)\s*$")


def _split_selector(selector: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def match_labels(labels: dict[str, str], selector: str | None) -> bool:
    """Kubernetes label-selector semantics over a label map."""
    if not selector:
        return True
    for term in _split_selector(selector):
        m = _SEL.fullmatch(term)
        if not m:
            raise _error(400, "BadRequest", f"unable to parse requirement: {term!r}")
        if m.group(2):
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            present = m.group(1) in labels
            if m.group(2) == "in" and not (present and labels[m.group(1)] in values):
                return False
            if m.group(2) == "notin" and present and labels[m.group(1)] in values:
                return False
        elif m.group(5):
            key, op, val = m.group(4).strip(), m.group(5), m.group(6).strip()
            if op in ("=", "==") and labels.get(key) != val:
                return False
            if op == "!=" and labels.get(key) == val:
                return False
        else:
            negate, key = m.group(7) == "!", m.group(8)
            if (key in labels) == negate:
                return False
    return True


def get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.strip(".").split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


def match_fields(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    for term in _split_selector(selector):
        m = re.fullmatch(r"\s*([^!=]+?)\s*(==|!=|=)\s*(.*?)\s*", term)
        if not m:
            raise _error(400, "BadRequest", f"invalid field selector: {term!r}")
        value = get_path(obj, m.group(1))
        value = "" if value is None else str(value)
        if (value == m.group(3)) != (m.group(2) != "!="):
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 JSON patch; a failed `test` or a bad path answers 422 as the API does."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = _pointer(op["path"])
        parent: Any = doc
        for p in parts[:-1]:
            try:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            except (KeyError, IndexError, ValueError):
                raise _error(422, "Invalid", f"the server rejected our request: path {op['path']!r} not found")
        last = parts[-1] if parts else None
        kind = op["op"]
        if kind == "test":
            try:
                current = parent[int(last)] if isinstance(parent, list) else parent[last]
            except (KeyError, IndexError, ValueError, TypeError):
                current = None
            if current != op.get("value"):
                raise _error(422, "Invalid", f"the server rejected our request due to an error in our request: "
                                             f"testing value {op['path']} failed")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                idx = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(idx, copy.deepcopy(op["value"]))
                else:
                    parent[idx] = copy.deepcopy(op["value"])
            else:
                if kind == "replace" and last not in parent:
                    raise _error(422, "Invalid", f"replace operation does not apply: doc is missing key {op['path']}")
                parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            try:
                if isinstance(parent, list):
                    del parent[int(last)]
                else:
                    del parent[last]
            except (KeyError, IndexError, ValueError):
                raise _error(422, "Invalid", f"remove operation does not apply: doc is missing path {op['path']}")
        else:
            raise _error(422, "Invalid", f"unsupported json-patch operation {kind!r}")
    return doc


@attrs.frozen
class Route:
    spec: ResourceSpec | None
    namespace: str | None
    name: str | None
    subresource: str | None
    group: str | None
    version: str | None


# ---------------------------------------------------------------- the server

@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the realism layer described in the module docstring."""

    specs: dict[tuple[str, str, str], ResourceSpec] = attrs.field(factory=dict)
    store: dict[tuple[str, str, str], dict[str, Any]] = attrs.field(factory=dict)  # (res key, ns, name)
    rv: int = attrs.field(default=1000)
    history: dict[str, collections.deque] = attrs.field(factory=dict)
    # Set (and replaced) on every change: watches wait on the one they saw. An Event, not a
    # Condition: a wait_for on Condition.wait() cancelled at its timeout can fail to take the
    # lock back ("Lock is not acquired", Python 3.11) and leave the watch's handler hung.
    changed: asyncio.Event | None = attrs.field(default=None)
    counts: collections.Counter = attrs.field(factory=collections.Counter)  # (method, res key) -> n
    n_requests: int = attrs.field(default=0)
    keep_requests: bool = attrs.field(default=True)
    _builtin_payloads: int = attrs.field(default=0, init=False)
    _direct: dict[Any, Any] = attrs.field(factory=dict, init=False)
    bookmark_seconds: float = attrs.field(default=60.0)
    created_at: dict[tuple[str, str, str], float] = attrs.field(factory=dict)  # monotonic, for latency figures

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for spec in BUILTIN:
            self.add_resource(spec)
        self._builtin_payloads = len(self._payloads)  # more than these: a test added reactions
        self._direct = {enums.action.LIST: self._serve_list, enums.action.WATCH: self._serve_watch,
                        enums.action.FETCH: self._serve_fetch, enums.action.CREATE: self._serve_create,
                        enums.action.UPDATE: self._serve_update, enums.action.DELETE: self._serve_delete}

    # ---- configuration

    def add_resource(self, spec: ResourceSpec) -> None:
        self.specs[(spec.group, spec.version, spec.plural)] = spec
        verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
        self.resources[kmock.resource(spec.group, spec.version, spec.plural)] = kmock.ResourceInfo(
            kind=spec.kind, singular=spec.kind.lower(), namespaced=spec.namespaced, verbs=verbs,
            shortnames=set(spec.shortnames), subresources=set(spec.subresources))

    def add_crd(self, crd: dict[str, Any]) -> None:
        for spec in crd_resources(crd):
            self.add_resource(spec)
        body = copy.deepcopy(crd)
        self._store_new(self.specs[("apiextensions.k8s.io", "v1", "customresourcedefinitions")], None, body)

    def kubeconfig(self, path: Path | None = None) -> Path:
        """Write a kubeconfig pointing at this server; return its path."""
        server = self.servers[0]
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": f"http://{server.host}:{server.port}"}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
        }
        if path is None:
            path = Path(tempfile.mkdtemp(prefix="kubeemu-")) / "kubeconfig"
        path.write_text(yaml.safe_dump(cfg))
        return path

    # ---- direct access for tests (no HTTP)

    def object(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        spec = self._spec_by_key(resource)
        obj = self.store.get((spec.key, namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def objects_of(self, resource: str, namespace: str | None = None, labels: str | None = None) -> list[dict[str, Any]]:
        spec = self._spec_by_key(resource)
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.store.items(), key=lambda kv: kv[0])
                if k == spec.key and (namespace is None or ns == namespace)
                and match_labels(o.get("metadata", {}).get("labels") or {}, labels)]

    def _spec_by_key(self, resource: str) -> ResourceSpec:
        for spec in self.specs.values():
            if resource in (spec.key, spec.plural, f"{spec.plural}.{spec.group}"):
                return spec
        raise KeyError(resource)

    def writes(self) -> int:
        """API requests that change state (create, patch, put, delete) so far."""
        return sum(n for (method, _), n in self.counts.items() if method in ("POST", "PATCH", "PUT", "DELETE"))

    # ---- HTTP entry: parse paths ourselves (kmock 0.8 cannot parse /api/v1/namespaces)

    def route(self, path: str) -> Route | None:
        parts = [p for p in path.strip("/").split("/") if p]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        if not rest:
            return Route(None, None, None, None, group, version)
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), ("/".join(rest[2:]) or None)
        return Route(self.specs.get((group, version, plural)), namespace, name, sub, group, version)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        await raw_request.read()
        self.n_requests += 1
        route = self.route(raw_request.path)
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            if route is None or route.spec is None or raw_request.method not in ("GET", "POST", "PATCH", "PUT", "DELETE"):
                request = await rendering.Request._parse(raw_request, id=len(self._requests))
            else:
                body = await raw_request.read()
                try:
                    data = json.loads(body) if body else None
                except ValueError:
                    data = None
                query = dict(raw_request.query)
                method = raw_request.method
                if method == "GET" and query.get("watch") in ("true", "1"):
                    action = enums.action.WATCH
                elif route.name is None:
                    action = {"GET": enums.action.LIST, "POST": enums.action.CREATE}.get(method)
                else:
                    action = {"GET": enums.action.FETCH, "PATCH": enums.action.UPDATE, "PUT": enums.action.UPDATE,
                              "DELETE": enums.action.DELETE}.get(method)
                request = rendering.Request(
                    id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=method,
                    params=query, headers=dict(raw_request.headers), cookies=dict(raw_request.cookies),
                    data=data, body=body, text=body.decode(errors="replace"), action=action,
                    resource=kmock.resource(route.group, route.version, route.spec.plural),
                    namespace=route.namespace, name=route.name, subresource=route.subresource)
                self.counts[(method, route.spec.key)] += 1
            direct = self._direct.get(request.action) if len(self._payloads) == self._builtin_payloads else None
            if direct is not None and route is not None and route.spec is not None:
                # No test reactions: serve the verb directly. kmock's dispatch checks a request's
                # membership by scanning every request served so far, which grows without bound.
                if self.keep_requests:
                    self._requests.append(request)
                try:
                    return await rendering.Response(payload=direct)(request)
                except rendering.StreamingError as e:
                    raw_response = e.args[0]
                    raise e.__cause__ or e
            self._requests.append(request)
            try:
                return await self._handle(request)
            except rendering.StreamingError as e:
                raw_response = e.args[0]
                raise e.__cause__ or e
            finally:
                if not self.keep_requests:
                    self._requests.remove(request)
        except Exception as e:
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(e)
            await self._stream_error(e, raw_response)
            await raw_response.write_eof()
            return raw_response

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesError):
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": exc.status, "reason": exc.reason, "message": exc.message, "details": exc.details or {},
            }, status=exc.status)
        return await super()._render_error(exc)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # Skip kmock's own store mutations: ours happen in the _serve_* fallbacks, so a test
        # reaction that intercepts a request (an injected 500) leaves the store untouched.
        return await apps.RawHandler._handle(self, request)

    # ---- helpers

    def _spec_of(self, request: rendering.Request) -> ResourceSpec:
        assert request.resource is not None
        spec = self.specs.get((request.resource.group, request.resource.version, request.resource.plural))
        if spec is None:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        return spec

    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    async def _emit(self, spec: ResourceSpec, kind: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self.history.setdefault(spec.key, collections.deque(maxlen=HISTORY)).append((rv, kind, copy.deepcopy(obj)))
        if self.changed is not None:
            self.changed.set()
        self.changed = asyncio.Event()

    def _store_new(self, spec: ResourceSpec, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise _error(422, "Invalid", f"{spec.kind} is invalid: metadata.name: Required value")
        ns = (namespace or meta.get("namespace") or "default") if spec.namespaced else ""
        if spec.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise _error(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        key = (spec.key, ns, meta["name"])
        if key in self.store:
            raise _error(409, "AlreadyExists", f'{spec.plural}.{spec.group or "core"} "{meta["name"]}" already exists',
                         name=meta["name"], group=spec.group, kind=spec.plural)
        body["apiVersion"], body["kind"] = spec.api_version, spec.kind
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._bump(), creationTimestamp=_now())
        meta.pop("deletionTimestamp", None)
        if "spec" in body or spec.group not in ("", "events.k8s.io"):
            meta["generation"] = 1
        self.store[key] = body
        self.created_at[key] = time.monotonic()
        return body

    def _ensure_namespace(self, ns: str) -> dict[str, Any] | None:
        nsspec = self.specs[("", "v1", "namespaces")]
        if ns and (nsspec.key, "", ns) not in self.store:
            return self._store_new(nsspec, None, {"metadata": {"name": ns}, "spec": {"finalizers": ["kubernetes"]},
                                                  "status": {"phase": "Active"}})
        return None

    def _find(self, spec: ResourceSpec, request: rendering.Request) -> tuple[tuple[str, str, str], dict[str, Any]]:
        key = (spec.key, (request.namespace or "") if spec.namespaced else "", request.name or "")
        obj = self.store.get(key)
        if obj is None:
            raise _error(404, "NotFound", f'{spec.plural}.{spec.group or "core"} "{request.name}" not found',
                         name=request.name, group=spec.group, kind=spec.plural)
        return key, obj

    def _selected(self, spec: ResourceSpec, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        if spec.namespaced and request.namespace and meta.get("namespace") != request.namespace:
            return False
        if request.name and meta.get("name") != request.name:
            return False
        return (match_labels(meta.get("labels") or {}, request.params.get("labelSelector"))
                and match_fields(obj, request.params.get("fieldSelector")))

    # ---- verbs

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        spec = self._spec_of(request)
        items = [copy.deepcopy(o) for (k, _, _), o in self.store.items()
                 if k == spec.key and self._selected(spec, request, o)]
        return {"apiVersion": spec.api_version, "kind": f"{spec.kind}List",
                "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        spec = self._spec_of(request)
        _, obj = self._find(spec, request)
        if request.subresource == "scale":
            return self._scale_of(spec, obj)
        return copy.deepcopy(obj)

    def _scale_of(self, spec: ResourceSpec, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta},
                "spec": {"replicas": get_path(obj, spec.scale_spec) or 0},
                "status": {"replicas": get_path(obj, spec.scale_status) or 0,
                           "selector": get_path(obj, spec.scale_selector) or ""}}

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        spec = self._spec_of(request)
        body = copy.deepcopy(request.data or {})
        if not isinstance(body, dict):
            raise _error(400, "BadRequest", "the body of the request was in an unknown format")
        if spec.namespaced:
            ns_obj = self._ensure_namespace(request.namespace or body.get("metadata", {}).get("namespace") or "default")
            if ns_obj is not None:
                await self._emit(self.specs[("", "v1", "namespaces")], "ADDED", ns_obj)
        if "status" in spec.subresources:
            body.pop("status", None)  # as the API server does: status is written through /status only
        obj = self._store_new(spec, request.namespace, body)
        await self._emit(spec, "ADDED", obj)
        return rendering.Response(status=201, payload=copy.deepcopy(obj))

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        spec = self._spec_of(request)
        key, old = self._find(spec, request)
        sub = request.subresource
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        base = self._scale_of(spec, old) if sub == "scale" else old
        data = request.data
        if request.method == enums.method.PUT:
            new = copy.deepcopy(data or {})
        elif ctype == "application/json-patch+json":
            if not isinstance(data, list):
                raise _error(400, "BadRequest", "json patch must be a list of operations")
            new = json_patch(base, data)
        elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(data, dict):
                raise _error(400, "BadRequest", "merge patch must be an object")
            new = merge_patch(base, data)
        else:
            raise _error(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype!r}")

        # Optimistic concurrency: a resourceVersion in the body must match the current one.
        sent_rv = (new.get("metadata") or {}).get("resourceVersion")
        if request.method == enums.method.PUT or (isinstance(data, dict) and (data.get("metadata") or {}).get("resourceVersion")):
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise _error(409, "Conflict", f'Operation cannot be fulfilled on {spec.plural}.{spec.group or "core"} '
                                              f'"{request.name}": the object has been modified; please apply your '
                                              f'changes to the latest version and try again', name=request.name)

        result = copy.deepcopy(old)
        if sub == "scale":
            set_path(result, spec.scale_spec, (new.get("spec") or {}).get("replicas", 0))
        elif sub == "status":
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
        elif sub:
            raise _error(404, "NotFound", f"subresource {sub!r} is not served")
        else:
            keep_status = "status" in spec.subresources
            for k in set(result) | set(new):
                if k in ("apiVersion", "kind") or (k == "status" and keep_status):
                    continue
                if k == "metadata":
                    meta = dict(new.get("metadata") or {})
                    for fixed in ("uid", "creationTimestamp", "generation", "namespace", "name", "deletionTimestamp"):
                        if fixed in old["metadata"]:
                            meta[fixed] = old["metadata"][fixed]
                        else:
                            meta.pop(fixed, None)
                    result["metadata"] = meta
                elif k in new:
                    result[k] = new[k]
                else:
                    result.pop(k, None)

        def essence(o: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in o.items() if k not in ("metadata", "status", "apiVersion", "kind")}

        if result == old:
            return copy.deepcopy(old)  # a no-op write: no new resourceVersion, no watch event
        if essence(result) != essence(old) and "generation" in old["metadata"]:
            result["metadata"]["generation"] = old["metadata"]["generation"] + 1
        result["metadata"]["resourceVersion"] = self._bump()
        meta = result["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self.store[key]
            await self._emit(spec, "DELETED", result)
        else:
            self.store[key] = result
            await self._emit(spec, "MODIFIED", result)
        return self._scale_of(spec, result) if sub == "scale" else copy.deepcopy(result)

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        spec = self._spec_of(request)
        key, obj = self._find(spec, request)
        obj = copy.deepcopy(obj)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["resourceVersion"] = self._bump()
                self.store[key] = obj
                await self._emit(spec, "MODIFIED", obj)
            return rendering.Response(status=202, payload=copy.deepcopy(obj))
        del self.store[key]
        obj["metadata"]["resourceVersion"] = self._bump()
        await self._emit(spec, "DELETED", obj)
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success",
                "details": {"name": request.name, "group": spec.group, "kind": spec.plural, "uid": obj["metadata"]["uid"]}}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        spec = self._spec_of(request)
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        hist = self.history.setdefault(spec.key, collections.deque(maxlen=HISTORY))
        if since in (None, "", "0"):
            last = self.rv
            initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for (k, _, _), o in self.store.items()
                       if k == spec.key and self._selected(spec, request, o)]
        else:
            last = int(since)
            initial = []
            if hist and hist[0][0] > last + 1 and len(hist) == hist.maxlen:
                initial = [{"type": "ERROR", "object": {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                            "code": 410, "reason": "Expired", "message": f"too old resource version: {last}"}}]
        yield b""
        for event in initial:
            yield event
        if initial and initial[-1]["type"] == "ERROR":
            return
        if self.changed is None:
            self.changed = asyncio.Event()
        bookmarks = request.params.get("allowWatchBookmarks") in ("true", "1")
        next_bookmark = time.monotonic() + self.bookmark_seconds
        while True:
            pending = []
            for item in reversed(hist):  # resourceVersions only grow: read back to `last`
                if item[0] <= last:
                    break
                pending.append(item)
            if pending:
                for rv, kind, obj in reversed(pending):
                    last = rv
                    if self._selected(spec, request, obj):
                        yield {"type": kind, "object": obj}
                continue  # events may have arrived while we yielded
            now = time.monotonic()
            if now >= deadline:
                return
            if bookmarks and now >= next_bookmark:  # as the API server does, about once a minute
                next_bookmark = now + self.bookmark_seconds
                last = self.rv  # everything up to here was scanned above, with no await in between
                yield {"type": "BOOKMARK", "object": {"apiVersion": spec.api_version, "kind": spec.kind,
                                                      "metadata": {"resourceVersion": str(last)}}}
                continue
            transport = request._raw_request.transport if request._raw_request is not None else None
            if transport is None or transport.is_closing():
                return  # the client went away (aiohttp does not cancel handlers on disconnect)
            wait = min(deadline, next_bookmark if bookmarks else deadline, now + 1.0) - now
            try:  # no await since the scan above: a change from here on sets this event
                await asyncio.wait_for(self.changed.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass


async def start(crd: dict[str, Any] | None = None, **kwargs: Any) -> tuple[KubeEmulator, kmock.Server]:
    """Start an emulator with an HTTP server on a free loopback port (the caller stops both)."""
    emu = KubeEmulator(**kwargs)
    await emu.__aenter__()
    server = kmock.Server(emu)
    await server.__aenter__()
    if crd is not None:
        emu.add_crd(crd)
    return emu, server


async def stop(emu: KubeEmulator, server: kmock.Server) -> None:
    await server.__aexit__(None, None, None)
    await emu.__aexit__(None, None, None)


class ThreadedEmulator:
    """The emulator in its own thread and event loop (for synchronous callers: benchmarks)."""

    def __init__(self, crd: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._crd, self._kwargs = crd, kwargs
        self.thread = threading.Thread(target=self._main, name="kubeemu", daemon=True)
        self.thread.start()
        self._ready.wait(30)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.emu, self.server = self.loop.run_until_complete(start(self._crd, **self._kwargs))
        self._ready.set()
        self.loop.run_forever()

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(stop(self.emu, self.server))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
