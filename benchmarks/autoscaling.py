"""Autoscaling from alerts (issue 9): the receiver under load, and from a webhook to replicas.

On the real control plane (tests/support/localcluster: upstream kube-apiserver and etcd, the real
Deployment and ReplicaSet controllers, kwok's nodes), the real operator as its own process
(`kiln operator` with its alert receiver, a ServiceAccount token bound to the chart's RBAC),
and the kubelet played cheaply (benchmarks.operator_scale_real.FakeKubelet: pods Ready at
once). M autoscaled models, every one Ready.

1. The receiver under 200 alerts/s (open loop: requests leave on schedule whatever the
   answers): half are new alert episodes (each an API read and a conditional write of the
   model's signal record, then a reconcile that records a hold), half duplicates. Latency
   from the request leaving to its answer, p50/p99, against a baseline at the same rate: a
   bare GET of a model from the API server (the floor any receiver that reads the model
   pays).
2. From the webhook POST (what Alertmanager sends) to spec.runtime.replicas changed in the
   API server (polled every 2 ms): once per model, sequentially.
3. From a load step to the first new replica Ready, everything real (tests/support/localcluster with
   Kiln installed by helm, `kiln serve` pods run by the kubelet harness, Debian's Prometheus
   and Alertmanager): the chart's rules with their shipped windows, a 15 s scrape and
   evaluation interval, the documented Alertmanager route; each stage's time as observed by
   polling every 0.5 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent

TARGETS = {"receiver_p99_ms": 50.0, "webhook_to_replicas_s": 1.0}
RATE = 200  # alerts per second
TOKEN = "bench-token"


def _model(ns: str, name: str) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"uri": f"https://models.example.invalid/{name}.onnx", "version": "1"},
                     "engine": {"backend": "onnxruntime", "precision": "fp32", "targets": ["cpu"]},
                     "runtime": {"replicas": 1, "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}},
                     "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetGPUUtilization": 50,
                                     "scaleUpCooldownSeconds": 0, "scaleDownStabilizationSeconds": 86400}}}


def _alert(ns: str, name: str, alertname: str, starts: float, value: str = "0.9") -> dict:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(starts)) + f".{int(starts * 1000) % 1000:03d}Z"
    return {"version": "4", "groupKey": f'{{}}:{{alertname="{alertname}",model="{name}"}}', "status": "firing",
            "receiver": "kiln", "alerts": [{
                "status": "firing", "labels": {"alertname": alertname, "namespace": ns, "model": name,
                                               "kiln_autoscaling": "true"},
                "annotations": {"value": value}, "startsAt": stamp, "endsAt": "0001-01-01T00:00:00Z",
                "fingerprint": f"{name}-{alertname}"}]}


def _delta(before: dict[float, float], after: dict[float, float]) -> list[float]:
    """The requests a histogram counted between two scrapes, each as its bucket's bound."""
    out, below = [], 0.0
    for bound in sorted(after):
        n = after[bound] - before.get(bound, 0.0)
        out += [bound] * int(n - below)
        below = n
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _open_loop(send, seconds: float, rate: int) -> list[float]:
    """Fire `send(i)` at `rate` per second for `seconds`, on schedule; the latency of each."""
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    start, tasks = loop.time(), []

    async def one(i: int) -> None:
        t = loop.time()
        await send(i)
        latencies.append(loop.time() - t)

    for i in range(int(seconds * rate)):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return latencies


def measure(models: int, seconds: float) -> dict[str, Any]:
    import threading

    import aiohttp

    from benchmarks.operator_scale import terminate
    from benchmarks.operator_scale_real import FakeKubelet, bare_cluster, prepare
    from support.localcluster.client import wait_for
    from support.monitoring.process import free_port

    root = Path(tempfile.mkdtemp(prefix="kiln-bench-autoscaling-"))
    cp = bare_cluster(root)
    proc = kubelet = None
    try:
        ns = "bench"
        api, kubeconfig = prepare(cp, root, [ns])
        (root / "token").write_text(TOKEN)
        port = free_port()
        log = open(root / "operator.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "operator", "--standalone", "--kubeconfig",
                                 str(kubeconfig), "--liveness", "", "--alert-receiver-port", str(port),
                                 "--alert-token-file", str(root / "token")],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                cwd=root)
        kubelet = FakeKubelet(api)
        threading.Thread(target=kubelet.sync, daemon=True).start()
        names = [f"m{i:03d}" for i in range(models)]
        loaded, stepped = names[: models // 2], names[models // 2:]
        for name in names:
            api.request("POST", f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels", _model(ns, name))
        wait_for(lambda: sum((m.get("status") or {}).get("phase") == "Ready" for m in api.items(
            f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels")) == models, 600, "every model Ready", 1.0)
        url = f"http://127.0.0.1:{port}/alerts"
        headers = {"Authorization": f"Bearer {TOKEN}"}

        async def load() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session:
                ssl_ctx = ssl.create_default_context(cafile=str(cp.ca))
                ssl_ctx.load_cert_chain(str(cp.root / "pki" / "admin.crt"), str(cp.root / "pki" / "admin.key"))
                base = time.time()

                def mix(new_every: int) -> list[dict]:
                    """Deliveries over the loaded models: every `new_every`-th a new episode
                    (KilnUtilizationLow; the long stabilization window makes it a hold), the
                    rest repeats of the model's current one (Alertmanager's repeat_interval,
                    a second Alertmanager replica)."""
                    current: dict[str, dict] = {}
                    out = []
                    for i in range(int(seconds * RATE)):
                        name = loaded[i % len(loaded)]
                        if name not in current or i % new_every == 0:
                            current[name] = _alert(ns, name, "KilnUtilizationLow", base - 3600 + i * 0.001, "0.1")
                        out.append(current[name])
                    return out

                payloads: list[dict] = []

                async def post(i: int) -> None:
                    async with session.post(url, json=payloads[i], headers=headers) as r:
                        assert r.status == 200, (r.status, await r.text())
                        await r.read()

                async def get(i: int) -> None:
                    path = f"{cp.server}/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/{loaded[i % len(loaded)]}"
                    async with session.get(path, ssl=ssl_ctx) as r:
                        assert r.status == 200
                        await r.read()

                async def served(new_every: int) -> dict[str, list[float]]:
                    """POSTs at RATE and, at the same time, GETs at RATE / 4 (the API server's
                    latency under the same load), and the receiver's own time per request."""
                    payloads[:] = mix(new_every)
                    before = await receiver_seconds()
                    posts, gets = await asyncio.gather(_open_loop(post, seconds, RATE),
                                                       _open_loop(get, seconds, RATE // 4))
                    return {"client": posts, "probe": gets, "server": _delta(before, await receiver_seconds())}

                async def receiver_seconds() -> dict[float, float]:
                    async with session.get(url.replace("/alerts", "/metrics")) as r:
                        text = await r.text()
                    return {float(m.group(1)): float(m.group(2)) for m in re.finditer(
                        r'^kiln_alert_receiver_duration_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
                        if m.group(1) != "+Inf"}

                await served(10 ** 9)  # warm-up: connections made, the operator settled after the creates
                steady = await served(10 ** 9)
                storm = await served(5)
                # 2. webhook -> replicas, one model at a time (models part 1 left alone).
                to_replicas = []
                for name in stepped:
                    path = f"{cp.server}/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/{name}"
                    t = time.perf_counter()
                    async with session.post(url, json=_alert(ns, name, "KilnUtilizationHigh", time.time(), "0.9"),
                                            headers=headers) as r:
                        assert r.status == 200
                    while time.perf_counter() - t < 10:
                        async with session.get(path, ssl=ssl_ctx) as r:
                            if (await r.json())["spec"]["runtime"]["replicas"] == 2:
                                break
                        await asyncio.sleep(0.002)
                    to_replicas.append(time.perf_counter() - t)
                    await asyncio.sleep(0.05)
                return {"steady": steady, "storm": storm, "to_replicas": to_replicas}

        return asyncio.run(load())
    finally:
        if kubelet is not None:
            kubelet.stop.set()
        terminate(proc)
        cp.stop()


def _load_step(quick: bool) -> dict[str, float]:
    """Part 3: seconds from the load step to each stage."""
    import base64
    import threading
    import urllib.request

    from support import localcluster, monitoring
    from support.localcluster.client import Api, pods, ready, wait_for

    root = Path(tempfile.mkdtemp(prefix="kiln-bench-loadstep-"))
    cluster = localcluster.LocalCluster(root).up()
    stop = threading.Event()
    servers: list[Any] = []
    try:
        api = Api(cluster.kubeconfig)
        ns = "bench"
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        cluster.seed_demo(ns)
        model = yaml.safe_load((REPO / "examples" / "demo" / "cluster.yaml").read_text())
        model["metadata"]["namespace"] = ns
        model["spec"]["runtime"]["replicas"] = 1
        model["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetGPUUtilization": 20}
        api.request("POST", f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels", model)
        path = f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/iris"
        wait_for(lambda: (api.get(path) or {}).get("status", {}).get("phase") == "Ready", 300, "iris Ready")
        op = next(p for p in pods(api, localcluster.RELEASE_NAMESPACE, "app.kubernetes.io/component=operator") if ready(p))
        port = localcluster.INSTALL_VALUES["autoscaling"]["receiver"]["port"]
        secret = api.get(f"/api/v1/namespaces/{localcluster.RELEASE_NAMESPACE}/secrets/{localcluster.RELEASE}-alert-token")
        (root / "token").write_text(base64.b64decode(secret["data"]["token"]).decode())
        cp = cluster.control_plane
        discovery = monitoring.PodDiscovery(cp.server, [ns], ca_file=str(cp.ca), cert_file=str(cp.root / "pki" / "admin.crt"),
                                            key_file=str(cp.root / "pki" / "admin.key")).start()
        servers.append(discovery)
        am = monitoring.Alertmanager(root / "am", monitoring.kiln_alertmanager_config(
            f"http://{op['status']['podIP']}:{port}/alerts", str(root / "token"), group_wait="10s",
            group_interval="30s", repeat_interval="2m"))
        servers.append(am)
        interval = "5s" if quick else "15s"
        rules = subprocess.run([str(localcluster.HELM), "template", "kiln", str(REPO / "charts" / "kiln"), "--show-only",
                                "templates/autoscaling-rules.yaml", "--set", "autoscaling.rulesConfigMap.enabled=true"],
                               check=True, stdout=subprocess.PIPE, text=True).stdout
        rules_file = root / "kiln.rules.yaml"
        rules_file.write_text(next(d for d in yaml.safe_load_all(rules) if d and d["kind"] == "ConfigMap")["data"][
            "kiln-autoscaling.rules.yaml"])
        prom = monitoring.Prometheus(root / "prom", rule_files=[rules_file], alertmanagers=[am.url],
                                     scrape_interval=interval, evaluation_interval=interval, resend_delay="1m",
                                     scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url),
                                                     monitoring.operator_scrape_config(
                                                         f"{op['status']['podIP']}:{port}",
                                                         labels={"namespace": localcluster.RELEASE_NAMESPACE})])
        servers.append(prom)
        am.start()
        prom.start()
        prom.wait_for(f'kiln:utilization:ratio{{namespace="{ns}"}}', timeout=180)
        time.sleep(70)  # a minute of idle history, as a running cluster has

        body = json.dumps({"inputs": [{"name": "features", "shape": [64, 4], "datatype": "FP32",
                                       "data": [0.5] * 256}]}).encode()

        def client() -> None:
            while not stop.is_set():
                for pod in [p for p in pods(api, ns, "kiln.dev/model=iris") if ready(p)][:1]:
                    try:
                        for _ in range(20):
                            urllib.request.urlopen(urllib.request.Request(
                                f"http://{pod['status']['podIP']}:8080/v2/models/iris/infer", data=body,
                                headers={"Content-Type": "application/json"}), timeout=10).read()
                    except OSError:
                        pass

        stages: dict[str, float] = {}
        t0 = time.monotonic()
        for _ in range(8):
            threading.Thread(target=client, daemon=True).start()

        def mark(name: str, happened: bool) -> None:
            if happened and name not in stages:
                stages[name] = time.monotonic() - t0

        while "ready" not in stages and time.monotonic() - t0 < 600:
            util = prom.value(f'kiln:utilization:ratio{{namespace="{ns}",model="iris"}}') or 0.0
            mark("utilization above target", util > 0.2)
            alerts = [a for a in prom.alerts() if a["labels"].get("alertname") == "KilnUtilizationHigh"]
            mark("alert pending", bool(alerts))
            mark("alert firing", any(a["state"] == "firing" for a in alerts))
            obj = api.get(path) or {}
            mark("signal received", "KilnUtilizationHigh" in (obj["metadata"].get("annotations") or {}).get(
                "autoscaling.kiln.dev/signals", ""))
            mark("replicas patched", obj["spec"]["runtime"]["replicas"] == 2)
            running = [p for p in pods(api, ns, "kiln.dev/model=iris") if not p["metadata"].get("deletionTimestamp")]
            mark("pod created", len(running) == 2)
            mark("ready", len([p for p in running if ready(p)]) == 2)
            time.sleep(0.5)
        return stages
    finally:
        stop.set()
        for server in reversed(servers):
            server.stop()
        cluster.down()


def run(quick: bool) -> str:
    models, seconds = (10, 5.0) if quick else (50, 20.0)
    r = measure(models, seconds)
    stages = _load_step(quick)
    ms = lambda v: f"{v * 1000:.1f} ms"  # noqa: E731
    t50, t99, tmax = (_percentile(r["to_replicas"], 0.5), _percentile(r["to_replicas"], 0.99), max(r["to_replicas"]))
    met = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    lines = [
        "## Autoscaling from alerts: the receiver and the webhook-to-replicas path (issue 9)",
        "",
        "The real operator (`kiln operator`, its own process, with its alert receiver and a token of the chart's "
        "ServiceAccount) against upstream kube-apiserver v1.37 and etcd with the real controllers "
        f"(tests/support/localcluster); the kubelet played (pods Ready at once). {models} autoscaled models, all Ready.",
        "",
        f"**Receiver under {RATE} alerts/s**, open loop for {seconds:.0f} s each, spread over {models // 2} models. "
        "Steady: what Alertmanager sends while alerts stay as they are (its repeat_interval, a second "
        "Alertmanager replica): repeats, each answered from the receiver's memory, plus the refresh of each "
        "signal's `seen` every 10 s (a read and a write). Storm: one delivery in five a new alert "
        f"episode ({RATE // 5}/s: an API read and a write of the model's signal record, then the reconcile it "
        "wakes records a hold). Baseline, at the same time: GETs of a model from the API server at a quarter of "
        "the rate (what one API round trip costs on this machine under this load). The receiver's own time is "
        "its `kiln_alert_receiver_duration_seconds` histogram (a bucket's upper bound); the client's includes "
        "this machine's 2 cores shared by the API server, etcd, the operator and the client.",
        "",
        "| | client p50 | client p99 | baseline GET p99 | client p99 / baseline p99 | receiver's own p99 |",
        "|---|---|---|---|---|---|",
    ]
    for label in ("steady", "storm"):
        run_ = r[label]
        c50, c99 = _percentile(run_["client"], 0.5), _percentile(run_["client"], 0.99)
        b99, s99 = _percentile(run_["probe"], 0.99), _percentile(run_["server"], 0.99)
        lines.append(f"| {label} | {ms(c50)} | {ms(c99)} | {ms(b99)} | {c99 / b99:.1f} | <= {ms(s99)} "
                     f"({met(s99 * 1000 <= TARGETS['receiver_p99_ms'])} < {TARGETS['receiver_p99_ms']:.0f} ms) |")
    lines += [
        "",
        f"**Webhook to replicas**: from the POST Alertmanager would send (KilnUtilizationHigh, value 0.9, target "
        f"0.5) to spec.runtime.replicas 1 -> 2 read back from the API server, once for each of {len(r['to_replicas'])} "
        f"other models: "
        f"p50 {ms(t50)}, p99 {ms(t99)}, max {ms(tmax)} ({met(tmax < TARGETS['webhook_to_replicas_s'])} < 1 s). "
        "The path: the receiver's read and write of the signal record, the watch event, kopf's handler, the "
        "scaling step's conditional write of spec.runtime.replicas (and the Deployment's replicas in the same pass).",
        "",
        "**From a load step to the first new replica Ready**, everything real: Kiln installed by helm on the local "
        "control plane, the demo model (ONNX Runtime) in `kiln serve` pods run by the kubelet harness, 8 clients "
        "sending 64-row requests (about 60% engine busy against a 20% target), Debian's Prometheus with the chart's "
        "rules as shipped (rateWindow 1m, highFor 1m) and a "
        f"{'5' if quick else '15'} s scrape and evaluation interval, Alertmanager with the documented route "
        "(group_wait 10 s). Seconds after the load started, each stage as first observed (polling every 0.5 s):",
        "",
        "| stage | at | took | why |",
        "|---|---|---|---|",
    ]
    why = {
        "utilization above target": "the busy counter's rate over the 1 m window, evaluated each interval, crosses 0.2",
        "alert pending": "the next rule evaluation after that",
        "alert firing": "`for: 1m` (highFor) of evaluations, all above the target",
        "signal received": "Alertmanager's group_wait (10 s) for a new group, then the webhook",
        "replicas patched": "the receiver's write wakes the model; the scaling step decides and writes",
        "pod created": "the Deployment and ReplicaSet controllers, the scheduler",
        "ready": "the kubelet harness starts `kiln serve`: engine read, verified, loaded, warmed up",
    }
    last = 0.0
    for stage in why:
        if stage in stages:
            lines.append(f"| {stage} | {stages[stage]:.1f} s | {stages[stage] - last:.1f} s | {why[stage]} |")
            last = stages[stage]
        else:
            lines.append(f"| {stage} | not seen | | {why[stage]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
