"""Fixtures for the operator's API-level tests: the emulated API server and the real operator.

The emulator (tests/support/kubeemu.py) runs in its own thread and event loop; the operator (the
real kopf, the real kubernetes client, `kiln.operator.main.serve`) in another; the tests
talk to the emulator over HTTP with the same client a user's tooling would use.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from support import kubeemu
from support.localcluster import client
from support.monitoring.process import free_port


def wait_for(what: Callable[[], Any], timeout: float = 15, message: str = "") -> Any:
    """`support.localcluster.client.wait_for` at the emulator's pace (it answers at once)."""
    return client.wait_for(what, timeout, message or str(what), interval=0.05)


class Api:
    """A user's view of the cluster: plain REST over the kubernetes client's transport."""

    def __init__(self, kubeconfig: Path) -> None:
        from kiln.operator import kube

        self.kube = kube.Kube(kube.load_client(str(kubeconfig)))
        self.path_for = kube.path_for

    wait = staticmethod(wait_for)

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> dict:
        return self.kube._request_sync(method, path, body, None, content_type)

    def apply(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return self.request("POST", self.path_for(obj["kind"], meta.get("namespace")), obj)

    def get(self, kind: str, ns: str, name: str) -> dict | None:
        from kiln.operator.kube import ApiError
        try:
            return self.request("GET", self.path_for(kind, ns, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict]:
        path = self.path_for(kind, ns)
        if selector:
            import urllib.parse
            path += "?labelSelector=" + urllib.parse.quote(selector)
        return self.request("GET", path)["items"]

    def patch(self, kind: str, ns: str, name: str, patch: dict, subresource: str | None = None) -> dict:
        return self.request("PATCH", self.path_for(kind, ns, name, subresource), patch,
                            "application/merge-patch+json")

    def delete(self, kind: str, ns: str, name: str) -> dict:
        return self.request("DELETE", self.path_for(kind, ns, name))

    def events(self, ns: str, name: str) -> list[dict]:
        return [e for e in self.list("Event", ns) if e["involvedObject"]["name"] == name
                and e["involvedObject"]["kind"] == "InferenceModel"]


class OperatorThread:
    """The real operator (`kiln.operator.main.serve`) in a background thread."""

    def __init__(self, kubeconfig: Path, alert_token: str | None = None, **config: Any) -> None:
        from kiln.operator import main
        from kiln.operator.config import OperatorConfig

        # Cache GC passes only where a test asks for them: they write the engine index on their
        # own timer, which tests that count the operator's writes would see.
        self.config = OperatorConfig(**{"cache_gc_interval_seconds": 0, **config})
        # The Alertmanager receiver on a free loopback port when a token is given.
        self.alert_token, self.alert_port = alert_token, free_port() if alert_token else 0
        self.alerts_url = f"http://127.0.0.1:{self.alert_port}/alerts"
        self.ready, self.stop_flag = threading.Event(), threading.Event()
        self.error: BaseException | None = None

        def target() -> None:
            try:
                asyncio.run(main.serve(self.config, standalone=True, liveness=None, kubeconfig=str(kubeconfig),
                                       ready_flag=self.ready, stop_flag=self.stop_flag,
                                       alert_port=self.alert_port, alert_token=alert_token))
            except BaseException as e:  # surfaced by start()/stop()
                self.error = e

        self.thread = threading.Thread(target=target, name="kiln-operator", daemon=True)

    def start(self) -> "OperatorThread":
        self.thread.start()
        if not self.ready.wait(30) or self.error:
            raise RuntimeError(f"the operator did not start: {self.error!r}")
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the operator did not stop"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kiln.runtime.api import spec as specmod

    emu = kubeemu.ThreadedEmulator(crd=specmod.load_crd())
    kubeconfig = emu.emu.kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig")
    import os
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    emu.kubeconfig = kubeconfig
    yield emu
    emu.close()
    if old is None:
        os.environ.pop("KUBECONFIG", None)
    else:
        os.environ["KUBECONFIG"] = old


@pytest.fixture(scope="module")
def api(cluster) -> Api:
    return Api(cluster.kubeconfig)


@pytest.fixture(scope="module")
def start_operator(cluster):
    """Start another operator against the same cluster (the caller stops it)."""
    return lambda **config: OperatorThread(cluster.kubeconfig, **config).start()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A real Prometheus (Debian's) for canary analysis, with nothing to scrape: the tests'
    checks are PromQL over constants and absent series. None where it is not installed."""
    from support import monitoring

    if monitoring.unavailable():
        yield None
        return
    with monitoring.Prometheus(tmp_path_factory.mktemp("prometheus")) as prom:
        yield prom


@pytest.fixture(scope="module")
def operator(cluster, prometheus):
    op = OperatorThread(cluster.kubeconfig, alert_token="test-token", resync_seconds=600, retry_seconds=0.5,
                        prometheus_url=prometheus.url if prometheus else None).start()
    yield op
    op.stop()


# ------------------------------------------------------------------ what Alertmanager posts

# The receiver alone (no kopf): its namespaces as `--namespace 'watched*'` gives them (a glob
# matches '/' too, so only a valid name keeps a label inside them).
RECEIVER_TOKEN, WATCHED_GLOB = "test-token", "watched*"


@pytest.fixture(scope="module")
def receiver(cluster):
    """A real alert receiver (`alerts.Server`) on loopback, its Kube against the emulator;
    `alerts_url` as on OperatorThread, so `am.post(receiver, ...)` posts to it; its `token`
    and `watched` glob."""
    import datetime
    import fnmatch
    import types

    from kiln.operator import alerts, kube
    from kiln.operator.metrics import OperatorMetrics

    rec = alerts.Receiver(kube.Kube(kube.load_client(str(cluster.kubeconfig))), RECEIVER_TOKEN, OperatorMetrics(),
                          lambda: datetime.datetime.now(datetime.timezone.utc),
                          lambda ns: fnmatch.fnmatchcase(ns, WATCHED_GLOB))
    port = free_port()
    server = alerts.Server(rec, port, "127.0.0.1").start()
    yield types.SimpleNamespace(receiver=rec, port=port, alerts_url=f"http://127.0.0.1:{port}/alerts",
                                token=RECEIVER_TOKEN, watched=WATCHED_GLOB)
    server.stop()


def _post_alerts(op, body, token: str | None = "test-token") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(op.alerts_url, data=data, method="POST", headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, _json(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _json(e.read() or b"{}")


def _json(body: bytes) -> dict:
    try:
        return json.loads(body)
    except ValueError:  # aiohttp's own 500 is text
        return {"not JSON": body[:200].decode(errors="replace")}


def _send(op, data: bytes, timeout: float = 10) -> tuple[int, dict]:
    """Raw bytes to the receiver (what no HTTP library sends): the answer's status and body."""
    import http.client
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(op.alerts_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        return answer.status, _json(answer.read())


def _alert(ns, name, alertname, status="firing", value="0.9", ago=0.0, fingerprint="fp1") -> dict:
    import datetime

    starts = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=ago)
    return {"status": status, "labels": {"alertname": alertname, "namespace": ns, "model": name,
                                         "kiln_autoscaling": "true"},
            "annotations": {"value": value}, "startsAt": starts.isoformat().replace("+00:00", "Z"),
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus/graph", "fingerprint": fingerprint}


def _webhook(*alerts, group="{}:{alertname=\"x\"}") -> dict:
    return {"version": "4", "groupKey": group, "truncatedAlerts": 0, "status": alerts[0]["status"],
            "receiver": "kiln", "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://alertmanager", "alerts": list(alerts)}


@pytest.fixture(scope="session")
def am():
    """Alertmanager's side of the webhook: `post(operator, payload, token=...)`, `alert(...)`, `webhook(...)`;
    and what Alertmanager would never send: `send(operator, raw_bytes)`."""
    import types

    return types.SimpleNamespace(post=_post_alerts, alert=_alert, webhook=_webhook, send=_send)
