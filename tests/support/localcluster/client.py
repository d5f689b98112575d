"""What the real tier's tests read the cluster with: REST as the admin, and polling."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

from kiln.runtime.api import contract


def wait_for(what: Callable[[], Any], timeout: float, message: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = what()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {message}: last={last!r}")


class Api:
    """REST as the cluster admin, over the kubernetes client's transport."""

    def __init__(self, kubeconfig: Path) -> None:
        from kiln.operator import kube

        self.kube = kube.Kube(kube.load_client(str(kubeconfig)))
        self.ApiError = kube.ApiError

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> dict:
        return self.kube._request_sync(method, path, body, None, content_type)

    def get(self, path: str) -> dict | None:
        try:
            return self.request("GET", path)
        except self.ApiError as e:
            if e.status == 404:
                return None
            raise

    def items(self, path: str) -> list[dict]:
        return (self.get(path) or {}).get("items") or []

    def model(self, ns: str, name: str) -> dict | None:
        return self.get(f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/{name}")

    def status(self, ns: str, name: str) -> dict:
        return (self.model(ns, name) or {}).get("status") or {}


def pods(api: Api, ns: str, selector: str) -> list[dict]:
    return api.items(f"/api/v1/namespaces/{ns}/pods?labelSelector={quote(selector)}")


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or ())


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)[:4000]


def service_endpoints(api: Api, namespace: str, service: str, port: str = "http") -> list[tuple[str, int]]:
    """Where a client of the Service gets to: the harness has no kube-proxy, so this resolves
    the Service's EndpointSlices (every one labelled with its name, whoever manages it) to
    their ready addresses and the port of that name, as kube-proxy would.

    One thing this control plane cannot show: its pods' IPs are loopback addresses (127.10.x),
    which the API server refuses in any EndpointSlice (the EndpointSlice controller's for a
    runtime or the activator Service fail the same way), so the operator's held slice for a
    model at zero has its ports and no addresses here. For a held slice the addresses are then
    the Ready activator pods', what the operator copies into it on a real cluster."""
    from . import RELEASE_NAMESPACE

    found = []
    for s in api.items(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
                       f"?labelSelector=kubernetes.io%2Fservice-name%3D{service}"):
        ports = {p.get("name"): p["port"] for p in s.get("ports") or []}
        if port not in ports:
            continue
        addresses = [a for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready") is not False
                     for a in e["addresses"]]
        if not addresses and s["metadata"]["labels"].get(contract.LABEL_SLICE_MANAGED_BY) == contract.ACTIVATOR_SLICE_MANAGER:
            addresses = [p["status"]["podIP"] for p in pods(api, RELEASE_NAMESPACE, "app.kubernetes.io/component=activator")
                         if ready(p)]
        found += [(a, ports[port]) for a in addresses]
    return found


def infer(pod: dict, rows: list[list[float]], model: str = "iris") -> dict:
    """One v2 JSON request of `rows` to a runtime pod's port 8080; HTTPError for an answer that is not 2xx."""
    body = json.dumps({"inputs": [{"name": "features", "shape": [len(rows), 4], "datatype": "FP32",
                                   "data": [x for r in rows for x in r]}]}).encode()
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8080/v2/models/{model}/infer", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


class ClientThreads:
    """Client loops on threads, from `with` until its end: each runs while `stop_flag` is clear."""

    def __init__(self, targets: list[tuple[Callable[..., None], tuple]]) -> None:
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=run, args=args, daemon=True) for run, args in targets]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(30)


class ServiceClients(ClientThreads):
    """What users of the model's Service see: `threads` loops of requests (8 rows of iris
    features each, drawn at random) to the Ready pods its selector picks, read from the API
    every half second (the harness has no kube-proxy; its pod IPs are in no EndpointSlice).
    Every answer that is not 200 is kept."""

    def __init__(self, api, namespace: str, service: str = "iris", threads: int = 4,
                 malformed: float = 0.0) -> None:
        """`malformed`: the share of requests sent with 3 features a row instead of 4, which
        every version refuses (400); their answers are kept apart, in `refused`."""
        super().__init__([(self._send, (i,)) for i in range(threads)] + [(self._resolve, ())])
        self.api, self.namespace, self.service, self.targets = api, namespace, service, []
        self.malformed = malformed
        self.latencies: list[float] = []  # of every 200, in order
        self.failures: list[tuple[int, Any]] = []  # (status, or 0 for no answer; what came back)
        self.refused: list[int] = []  # the statuses answered to the malformed requests

    def _resolve(self) -> None:
        while not self.stop_flag.is_set():
            try:
                svc = self.api.get(f"/api/v1/namespaces/{self.namespace}/services/{self.service}")
                selector = ",".join(f"{k}={v}" for k, v in svc["spec"]["selector"].items())
                self.targets = [p for p in pods(self.api, self.namespace, selector)
                                if ready(p) and not p["metadata"].get("deletionTimestamp")]
            except Exception:  # the API server busy: the last answer stands
                pass
            time.sleep(0.5)

    def _send(self, i: int) -> None:
        import numpy as np

        rng, turn = np.random.default_rng(i), i
        while not self.stop_flag.is_set():
            targets = list(self.targets)
            if not targets:
                time.sleep(0.05)
                continue
            turn += 1
            rows = (rng.uniform([4.3, 2.0, 1.0, 0.1], [7.9, 4.4, 6.9, 2.5], (8, 4))).round(1).tolist()
            bad = rng.random() < self.malformed
            try:
                started = time.monotonic()
                infer(targets[turn % len(targets)], [r[:3] for r in rows] if bad else rows)
                if bad:
                    self.failures.append((200, "a malformed request was answered"))
                else:
                    self.latencies.append(time.monotonic() - started)
            except urllib.error.HTTPError as e:
                if bad:
                    self.refused.append(e.code)
                else:
                    self.failures.append((e.code, e.read()[:200]))
            except OSError as e:
                self.failures.append((0, str(e)))
