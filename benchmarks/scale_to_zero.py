"""Scale to zero (issue 24 items 1, 2 and 5): the first request at zero and where its time goes,
and a burst of 1,000 requests at zero.

Everything real: Kiln installed by helm on the local control plane (tests/support/localcluster)
with its activator (on by default, two replicas), the demo model (ONNX Runtime) with
`minReplicas: 0` and `scaleToZeroAfterSeconds: 5`, `kiln serve` pods run by the kubelet
harness, Debian's Prometheus (1 s scrape and evaluation) with the chart's idle rule, its
window cut from 1 m to 4 s so the model is idle again within seconds between tries (the time
to zero is not what is measured), and Alertmanager.

Each try starts at zero (the Service's EndpointSlice on the activator, no runtime pod) and
sends one request to the model's Service as an in-cluster client does (the harness has no
kube-proxy: the client resolves the EndpointSlices). A poller (every 50 ms) sees each stage
first: the activator's scale patch (spec.runtime.replicas 1), the pod created (the operator's
pass, the Deployment and ReplicaSet controllers), scheduled, its process started, Ready; the
runtime's own kiln_engine_load_seconds splits its start into engine read, verify, load
(deserialize) and warm-up.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TRIES = 10
BURST = 1000
STAGES = ("scaled", "pod created", "scheduled", "started", "ready", "answered")
WHY = {
    "scaled": "the activator reads the scale subresource and patches it to 1 (conditional)",
    "pod created": "the operator's pass (ScaledExternally, the Deployment's replicas 0 -> 1), the Deployment and "
                   "ReplicaSet controllers",
    "scheduled": "the scheduler binds the pod",
    "started": "the kubelet harness starts the `kiln serve` process",
    "ready": "`kiln serve` imports, reads the engine from the cache, verifies, loads and warms it up, and "
             "answers its readiness probe",
    "answered": "the activator's pod watch sees it Ready and forwards the held request; the answer",
}


def _idle_rules(path: Path) -> Path:
    text = (REPO / "charts" / "kiln" / "files" / "kiln-idle.rules.yaml").read_text()
    assert "increase(kiln_requests_total[1m])" in text
    path.write_text(text.replace("increase(kiln_requests_total[1m])", "increase(kiln_requests_total[4s])"))
    return path


def _load_stages(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^kiln_engine_load_seconds\{[^}]*stage="(\w+)"[^}]*\} (\S+)$', text, re.M)}


def _infer(address: str, port: int, seed: int, host: str, timeout: float = 180) -> tuple[int, dict]:
    body = json.dumps({"id": str(seed), "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32",
                                                    "data": [5.1 + seed % 7 * 0.1, 3.5, 1.4, 0.2]}]}).encode()
    request = urllib.request.Request(f"http://{address}:{port}/v2/models/iris/infer", data=body,
                                     headers={"Content-Type": "application/json", "Host": host})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


async def _burst(endpoints: list[tuple[str, int]], host: str, n: int) -> list[tuple[int, str, float]]:
    """n requests at once over aiohttp, spread over the Service's endpoints: (status, id, seconds)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str, float]:
        address, port = endpoints[i % len(endpoints)]
        doc = {"id": str(i), "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32",
                                         "data": [5.1 + i % 7 * 0.1, 3.5, 1.4, 0.2]}]}
        t0 = time.monotonic()
        try:
            async with session.post(f"http://{address}:{port}/v2/models/iris/infer", json=doc,
                                    headers={"Host": host}) as r:
                answer = await r.json(content_type=None)
                return r.status, str(answer.get("id", "")), time.monotonic() - t0
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 0, type(e).__name__, time.monotonic() - t0

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def measure(quick: bool) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from support import localcluster, monitoring
    from support.localcluster.client import Api, pods, ready, service_endpoints, wait_for

    tries, burst = (3, 200) if quick else (TRIES, BURST)
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-zero-"))
    cluster = localcluster.LocalCluster(root).up()
    servers: list[Any] = []
    try:
        api = Api(cluster.kubeconfig)
        ns = "bench"
        host = f"iris.{ns}.svc.cluster.local:8080"
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        cluster.seed_demo(ns)
        model = yaml.safe_load((REPO / "examples" / "demo" / "cluster.yaml").read_text())
        model["metadata"]["namespace"] = ns
        model["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                                        "targetGPUUtilization": 10, "scaleToZeroAfterSeconds": 5}
        api.request("POST", f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels", model)
        path = f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/iris"
        wait_for(lambda: (api.get(path) or {}).get("status", {}).get("phase") == "Ready", 300, "iris Ready")
        activators = lambda: [p for p in pods(api, localcluster.RELEASE_NAMESPACE,  # noqa: E731
                                              "app.kubernetes.io/component=activator") if ready(p)]
        wait_for(lambda: len(activators()) == 2, 120, "two activator pods Ready")
        op = next(p for p in pods(api, localcluster.RELEASE_NAMESPACE, "app.kubernetes.io/component=operator") if ready(p))
        port = localcluster.INSTALL_VALUES["autoscaling"]["receiver"]["port"]
        secret = api.get(f"/api/v1/namespaces/{localcluster.RELEASE_NAMESPACE}/secrets/{localcluster.RELEASE}-alert-token")
        (root / "token").write_text(base64.b64decode(secret["data"]["token"]).decode())
        cp = cluster.control_plane
        discovery = monitoring.PodDiscovery(cp.server, [ns], ca_file=str(cp.ca), cert_file=str(cp.root / "pki" / "admin.crt"),
                                            key_file=str(cp.root / "pki" / "admin.key")).start()
        servers.append(discovery)
        am = monitoring.Alertmanager(root / "am", monitoring.kiln_alertmanager_config(
            f"http://127.0.0.1:{port}/alerts", str(root / "token"), repeat_interval="1h"))
        servers.append(am)
        prom = monitoring.Prometheus(root / "prom", alertmanagers=[am.url], rule_files=[_idle_rules(root / "idle.yaml")],
                                     scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url),
                                                     monitoring.operator_scrape_config(
                                                         f"{op['status']['podIP']}:{port}",
                                                         labels={"namespace": localcluster.RELEASE_NAMESPACE})])
        servers.append(prom)
        am.start()
        prom.start()
        held = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/iris-activator"

        def runtime() -> list[dict]:
            return [p for p in pods(api, ns, "kiln.dev/model=iris") if not p["metadata"].get("deletionTimestamp")]

        def at_zero() -> None:
            wait_for(lambda: (api.get(path) or {})["spec"]["runtime"]["replicas"] == 0, 180, "replicas 0")
            wait_for(lambda: pods(api, ns, "kiln.dev/model=iris") == [], 60, "no runtime pod")
            wait_for(lambda: api.get(held), 30, "the held EndpointSlice")

        def one_try(seed: int) -> dict[str, float]:
            seen: dict[str, float] = {}
            done = threading.Event()
            t0 = time.monotonic()

            def poll() -> None:
                while not done.is_set():
                    now = time.monotonic() - t0
                    if (api.get(path) or {}).get("spec", {}).get("runtime", {}).get("replicas", 0) >= 1:
                        seen.setdefault("scaled", now)
                    for p in runtime():
                        seen.setdefault("pod created", now)
                        if p["spec"].get("nodeName"):
                            seen.setdefault("scheduled", now)
                        if any("running" in (c.get("state") or {}) for c in p.get("status", {}).get("containerStatuses") or []):
                            seen.setdefault("started", now)
                        if ready(p):
                            seen.setdefault("ready", now)
                    time.sleep(0.05)

            poller = threading.Thread(target=poll, daemon=True)
            endpoints = service_endpoints(api, ns, "iris")
            poller.start()
            status, answer = _infer(*endpoints[seed % len(endpoints)], seed, host)
            seen["answered"] = time.monotonic() - t0
            done.set()
            poller.join(5)
            assert status == 200 and answer.get("id") == str(seed), (status, answer)
            [pod] = [p for p in runtime() if ready(p)]
            text = urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/metrics", timeout=5).read().decode()
            return {**seen, **{f"engine {k}": v for k, v in _load_stages(text).items()}}

        results = []
        for attempt in range(tries):
            at_zero()
            results.append(one_try(attempt))
        at_zero()
        endpoints = service_endpoints(api, ns, "iris")
        t0 = time.monotonic()
        answers = asyncio.run(_burst(endpoints, host, burst))
        took = time.monotonic() - t0
        [pod] = wait_for(lambda: [p for p in runtime() if ready(p)], 60, "the pod Ready")
        text = urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/metrics", timeout=5).read().decode()
        counted = sum(float(m.group(1)) for m in re.finditer(
            r'^kiln_requests_total\{[^}]*outcome="success"[^}]*\} (\S+)$', text, re.M))
        return {"tries": results, "burst": answers, "burst_seconds": took, "burst_counted": counted,
                "endpoints": len(endpoints)}
    finally:
        for server in reversed(servers):
            server.stop()
        cluster.down()


def run(quick: bool) -> str:
    r = measure(quick)
    tries = r["tries"]
    firsts = sorted(t["answered"] for t in tries)
    med = lambda values: statistics.median(values)  # noqa: E731
    lines = [
        f"## Scale to zero: requests at zero held by the activator (issue 24 items 1, 2 and 5){' (quick)' if quick else ''}",
        "",
        "`benchmarks/scale_to_zero.py`, everything real: Kiln installed by helm on the local control plane with its "
        "activator (on by default, two `kiln activator` pods), the demo model (ONNX Runtime, iris) with "
        "`minReplicas: 0` and `scaleToZeroAfterSeconds: 5`, `kiln serve` pods run by the kubelet harness, Debian's "
        "Prometheus (1 s scrape and evaluation) with KilnModelIdle's window cut from 1 m to 4 s (so each try starts "
        "from zero within seconds), Alertmanager. The harness has no kube-proxy: the client resolves the model's "
        "Service `iris` by its EndpointSlices, as kube-proxy would (its pod IPs are 127.10.x, which the API server "
        "refuses in an EndpointSlice, so the held slice carries the activator's ports and the client takes the "
        "Ready activator pods for its addresses). This machine's 2 cores are shared by the control plane, the "
        "pods, Prometheus and the client.",
        "",
        f"**The first request at zero to its answer**, {len(tries)} tries, each from zero: p50 "
        f"{med(firsts):.2f} s, max {firsts[-1]:.2f} s ({', '.join(f'{f:.2f}' for f in firsts)}).",
        "",
        "Where the time goes, the median over the tries of each stage's first sighting (a poller every 50 ms, so "
        "each stage is seen up to 50 ms late and the API reads it makes are part of the load):",
        "",
        "| stage | at (p50) | took (p50) | max at | what |",
        "|---|---:|---:|---:|---|",
    ]
    last = 0.0
    for stage in STAGES:
        values = [t[stage] for t in tries if stage in t]
        if not values:
            lines.append(f"| {stage} | not seen | | | {WHY[stage]} |")
            continue
        at = med(values)
        # The activator's watch can see the pod Ready before the poller does: no negative stage.
        took = f"{at - last:.2f} s" if at >= last else "(with ready)"
        lines.append(f"| {stage} | {at:.2f} s | {took} | {max(values):.2f} s | {WHY[stage]} |")
        last = max(last, at)
    engine = {k.removeprefix("engine "): med([t[k] for t in tries if k in t])
              for k in ("engine read", "engine verify", "engine deserialize", "engine warmup")}
    start_to_ready = med([t["ready"] - t["started"] for t in tries if "ready" in t and "started" in t])
    lines += [
        "",
        "Inside \"ready\" (process started to Ready, p50 " f"{start_to_ready:.2f} s), the runtime's own "
        "`kiln_engine_load_seconds`: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in engine.items())
        + f"; the rest ({(start_to_ready - sum(engine.values())):.2f} s) is the process's start: Python, its "
        "imports, ONNX Runtime, the HTTP and gRPC servers, and the readiness probe's period.",
        "",
    ]
    answers = r["burst"]
    ok = [a for a in answers if a[0] == 200]
    ids = sorted(int(a[1]) for a in ok)
    once = ids == list(range(len(answers)))
    seconds = sorted(a[2] for a in answers)
    lost = len(answers) - len(ok)
    statuses: dict[str, int] = {}
    for a in answers:
        if a[0] != 200:
            statuses[f"{a[0]} {a[1]}"] = statuses.get(f"{a[0]} {a[1]}", 0) + 1
    lines += [
        f"**A burst of {len(answers)} concurrent requests at zero** (aiohttp, one connection each, spread over the "
        f"{r['endpoints']} activator endpoints): {len(ok)} answered, **{lost} lost**"
        f"{' (' + ', '.join(f'{v} x {k}' for k, v in statuses.items()) + ')' if statuses else ''}; "
        f"{'each id answered once' if once else '**ids answered not exactly once**'}, and the runtime counted "
        f"{r['burst_counted']:.0f} successful requests (so none was sent twice); p50 {seconds[len(seconds) // 2]:.2f} s, "
        f"max {seconds[-1]:.2f} s, all in {r['burst_seconds']:.1f} s.",
        "",
        "Through an HTTPRoute: its backend is the same Service, so a Gateway's request reaches the same activator "
        "endpoints; the real tier sends one along an HTTPRoute with the listener's Host and the route's "
        "`kiln-namespace` header (tests/e2e, the gateway's part played by the test: no Gateway implementation runs "
        "on this control plane).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
