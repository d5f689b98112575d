"""Autoscaling from alerts (issue 9): the receiver under load, and from a webhook to replicas.

On the real control plane (tests/localcluster: upstream kube-apiserver and etcd, the real
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

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

    import localcluster
    from benchmarks.operator_scale_real import FakeKubelet
    from localcluster.client import Api, wait_for
    from localcluster.controlplane import ControlPlane, binaries, node
    from kiln.runtime import spec as specmod

    root = Path(tempfile.mkdtemp(prefix="kiln-bench-autoscaling-"))
    cp = ControlPlane(root, binaries())
    proc = kubelet = None
    try:
        big = {"cpu": "100000", "memory": "100Ti", "pods": 10000}
        cp.start([node("builder-0", labels={"kiln.dev/role": "builder"},
                       taints=[{"key": "kiln.dev/role", "value": "builder", "effect": "NoSchedule"}], **big),
                  node("cpu-0", **big)])
        api = Api(cp.admin_kubeconfig)
        api.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", specmod.load_crd())
        wait_for(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in (api.get(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferencemodels.kiln.dev") or {})
            .get("status", {}).get("conditions") or ()), 60, "the CRD established")
        cluster = localcluster.LocalCluster(root)
        cluster.control_plane = cp
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": "kiln-system"}})
        rendered = subprocess.run([str(localcluster.HELM), "template", "kiln", str(REPO / "charts" / "kiln"),
                                   "--namespace", "kiln-system", "--set", "cache.pvc.create=false"],
                                  check=True, stdout=subprocess.PIPE, text=True).stdout
        rbac = "\n---\n".join(doc for doc in rendered.split("\n---") if re.search(
            r"^kind: (ServiceAccount|ClusterRole|ClusterRoleBinding)$", doc, re.M))
        cp.kubectl("apply", "-f", "-", input=rbac)
        kubeconfig = cluster.service_account_kubeconfig("kiln-system", "kiln", root / "operator.kubeconfig")
        ns = "bench"
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        from localcluster.kubelet import Kubelet
        Kubelet(cp.admin_kubeconfig, root, cp.api_port).provision(api.request(
            "POST", f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
                "metadata": {"name": "kiln-engine-cache"},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
        (root / "token").write_text(TOKEN)
        port = 18581
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

                baseline = await _open_loop(get, seconds, RATE)
                payloads[:] = mix(new_every=10 ** 9)
                steady = await _open_loop(post, seconds, RATE)
                payloads[:] = mix(new_every=5)
                storm = await _open_loop(post, seconds, RATE)
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
                return {"baseline": baseline, "steady": steady, "storm": storm, "to_replicas": to_replicas}

        out = asyncio.run(load())
        decisions = [m for m in api.items(f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels")
                     if ((m.get("status") or {}).get("scaling") or {}).get("history")]
        out["models_with_history"] = len(decisions)
        return out
    finally:
        if kubelet is not None:
            kubelet.stop.set()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        cp.stop()


def run(quick: bool) -> str:
    models, seconds = (10, 5.0) if quick else (50, 20.0)
    r = measure(models, seconds)
    ms = lambda v: f"{v * 1000:.1f} ms"  # noqa: E731
    b50, b99 = _percentile(r["baseline"], 0.5), _percentile(r["baseline"], 0.99)
    t50, t99, tmax = (_percentile(r["to_replicas"], 0.5), _percentile(r["to_replicas"], 0.99), max(r["to_replicas"]))
    met = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    lines = [
        "## Autoscaling from alerts: the receiver and the webhook-to-replicas path (issue 9)",
        "",
        "The real operator (`kiln operator`, its own process, with its alert receiver and a token of the chart's "
        "ServiceAccount) against upstream kube-apiserver v1.37 and etcd with the real controllers "
        f"(tests/localcluster); the kubelet played (pods Ready at once). {models} autoscaled models, all Ready.",
        "",
        f"**Receiver under {RATE} alerts/s**, open loop for {seconds:.0f} s each, spread over {models // 2} models. "
        "Steady: what Alertmanager sends while alerts stay as they are (its repeat_interval, a second "
        "Alertmanager replica): repeats, each answered from the receiver's memory, plus the refresh of each "
        "signal's `seen` every 10 s (a read and a conditional write). Storm: one delivery in five a new alert "
        f"episode ({RATE // 5}/s: an API read and a conditional write of the model's signal record, then the "
        "reconcile it wakes records a hold). Baseline: a bare GET of a model from the API server at the same rate.",
        "",
        "| | p50 | p99 | p99 / baseline p99 |",
        "|---|---|---|---|",
        f"| baseline: GET a model | {ms(b50)} | {ms(b99)} | 1.0 |",
    ]
    for label in ("steady", "storm"):
        p50, p99 = _percentile(r[label], 0.5), _percentile(r[label], 0.99)
        lines.append(f"| POST /alerts, {label} | {ms(p50)} | {ms(p99)} | {p99 / b99:.1f} "
                     f"({met(p99 * 1000 < TARGETS['receiver_p99_ms'])} < {TARGETS['receiver_p99_ms']:.0f} ms) |")
    lines += [
        "",
        f"**Webhook to replicas**: from the POST Alertmanager would send (KilnUtilizationHigh, value 0.9, target "
        f"0.5) to spec.runtime.replicas 1 -> 2 read back from the API server, once for each of {len(r['to_replicas'])} "
        f"other models: "
        f"p50 {ms(t50)}, p99 {ms(t99)}, max {ms(tmax)} ({met(tmax < TARGETS['webhook_to_replicas_s'])} < 1 s). "
        "The path: the receiver's read and write of the signal record, the watch event, kopf's handler, the "
        "scaling step's conditional write of spec.runtime.replicas (and the Deployment's replicas in the same pass).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
