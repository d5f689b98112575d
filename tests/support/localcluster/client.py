"""What the real tier's tests read the cluster with: REST as the admin, and polling."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote


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
