"""Scale-up in seconds without flapping (issue 24 item 3), everything real and as shipped.

Kiln installed by helm on the local control plane (tests/support/localcluster), the demo
model behind a needless 20-layer MLP (tests/support/versions.py slow_version: the same
answers, about 10 ms a 64-row batch, so that clients keep its engine busy; the demo model
itself is too small for that) in `kiln serve` pods run by the kubelet harness, Debian's Prometheus
with the chart's rules as rendered with default values (the rule group's 5 s interval) and
the chart's PodMonitor scrape interval (5 s), Alertmanager with the route docs/operations.md
ships (DOCUMENTED_TIMINGS). The model autoscales with the CRD's defaults (scale-up cooldown
60 s, scale-down cooldown and stabilization 300 s, maxStep 2) between 1 and 4 replicas, a 20%
target, and has been idle long enough for KilnUtilizationLow to fire (a model at rest).

Then an oscillating load: high (8 clients sending 64-row requests) for 60 s, low (1 client)
for 60 s, for 10 minutes; each client sends to the
model's Ready pods in turn, as the Service would. Measured: the first high phase's stages,
from the load step to the first new replica Ready (target 30 s), and every change of
spec.runtime.replicas over the 10 minutes (at most one per direction per cooldown).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 30.0
TARGET_UTILIZATION = 0.20  # the model's targetGPUUtilization; Surge fires above twice it
HIGH_CLIENTS, LOW_CLIENTS = 8, 1
UP_COOLDOWN, DOWN_COOLDOWN = 60.0, 300.0  # the CRD's defaults, which the model keeps


def _chart_default(path: str) -> str:
    values = yaml.safe_load((REPO / "charts" / "kiln" / "values.yaml").read_text())
    for key in path.split("."):
        values = values[key]
    return str(values)


def measure(quick: bool) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from support import localcluster, monitoring, versions
    from support.localcluster.client import Api, pods, ready, wait_for

    phase, cycles, idle = (30.0, 2, 70.0) if quick else (60.0, 5, 150.0)
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-scaleup-"))
    cluster = localcluster.LocalCluster(root).up()
    stop = threading.Event()
    clients = [0]  # how many of the client threads send now
    servers: list[Any] = []
    try:
        api = Api(cluster.kubeconfig)
        ns = "bench"
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        cluster.seed_demo(ns)
        model = yaml.safe_load((REPO / "examples" / "demo" / "cluster.yaml").read_text())
        model["metadata"]["namespace"] = ns
        onnx = versions.slow_version(cluster.kubelet.claim_directory(ns, "models"), "1")
        model["spec"]["model"].update(uri="pvc://models/iris/1/model.onnx",
                                      sha256=hashlib.sha256(onnx.read_bytes()).hexdigest())
        model["spec"]["runtime"]["replicas"] = 1
        model["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 4,
                                        "targetGPUUtilization": round(TARGET_UTILIZATION * 100)}
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
            f"http://{op['status']['podIP']}:{port}/alerts", str(root / "token"), **monitoring.DOCUMENTED_TIMINGS))
        servers.append(am)
        rules_file = root / "kiln.rules.yaml"
        rules_file.write_text((REPO / "charts" / "kiln" / "files" / "kiln-autoscaling.rules.yaml").read_text())
        scrape = _chart_default("monitoring.podMonitor.interval")
        # The rule group carries its own interval (autoscaling.rules.interval); Prometheus'
        # global one is left at the scrape's.
        prom = monitoring.Prometheus(root / "prom", rule_files=[rules_file], alertmanagers=[am.url],
                                     scrape_interval=scrape, evaluation_interval=scrape, resend_delay="1m",
                                     scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url),
                                                     monitoring.operator_scrape_config(
                                                         f"{op['status']['podIP']}:{port}",
                                                         labels={"namespace": localcluster.RELEASE_NAMESPACE})])
        servers.append(prom)
        am.start()
        prom.start()
        prom.wait_for(f'kiln:utilization:ratio{{namespace="{ns}"}}', timeout=180)

        def low_firing() -> bool:
            return "KilnUtilizationLow" in ((api.get(path) or {}).get("metadata", {}).get("annotations") or {}).get(
                "autoscaling.kiln.dev/signals", "")

        time.sleep(idle)  # at rest: a model idle for a while has KilnUtilizationLow firing
        at_rest_low = low_firing()

        body = json.dumps({"inputs": [{"name": "features", "shape": [64, 4], "datatype": "FP32",
                                       "data": [0.5] * 256}]}).encode()
        answered = [0, 0]  # ok, failed
        targets: list[str] = []

        def refresh_targets() -> None:
            while not stop.is_set():
                targets[:] = [p["status"]["podIP"] for p in pods(api, ns, "kiln.dev/model=iris") if ready(p)]
                time.sleep(0.5)

        def client(i: int) -> None:
            turn = itertools.count(i)
            while not stop.is_set():
                if i >= clients[0] or not targets:
                    time.sleep(0.05)
                    continue
                ips = list(targets)
                try:
                    urllib.request.urlopen(urllib.request.Request(
                        f"http://{ips[next(turn) % len(ips)]}:8080/v2/models/iris/infer", data=body,
                        headers={"Content-Type": "application/json"}), timeout=10).read()
                    answered[0] += 1
                except OSError:
                    answered[1] += 1

        threading.Thread(target=refresh_targets, daemon=True).start()
        wait_for(lambda: bool(targets), 30, "a Ready pod")
        for i in range(HIGH_CLIENTS):
            threading.Thread(target=client, args=(i,), daemon=True).start()

        stages: dict[str, float] = {}
        peak = [0.0]  # the highest short-window utilization seen before the new replica was Ready
        changes: list[tuple[float, int, int, str]] = []  # (at, from, to, reason)
        def history() -> list[dict]:
            return ((api.get(path) or {}).get("status", {}).get("scaling", {}) or {}).get("history") or []

        seen_history = {json.dumps(h, sort_keys=True) for h in history()}  # before the load
        t0 = time.monotonic()
        clients[0] = HIGH_CLIENTS

        def mark(name: str, happened: bool) -> None:
            if happened and name not in stages:
                stages[name] = time.monotonic() - t0

        end = t0 + 2 * phase * cycles
        while time.monotonic() < end:
            now = time.monotonic() - t0
            clients[0] = HIGH_CLIENTS if int(now // phase) % 2 == 0 else LOW_CLIENTS
            obj = api.get(path) or {}
            for h in (obj.get("status", {}).get("scaling", {}) or {}).get("history") or []:
                key = json.dumps(h, sort_keys=True)
                if key not in seen_history:
                    seen_history.add(key)
                    if h["from"] != h["to"]:
                        changes.append((now, h["from"], h["to"], f"{h['reason']} ({h['source']})"))
            if "ready" not in stages:
                util = prom.value(f'kiln:utilization_short:ratio{{namespace="{ns}",model="iris"}}') or 0.0
                peak[0] = max(peak[0], util)
                mark("utilization above 2x target", util > 2 * TARGET_UTILIZATION)
                alerts = [a for a in prom.alerts() if a["labels"].get("alertname") == "KilnUtilizationSurge"]
                mark("alert firing", any(a["state"] == "firing" for a in alerts))
                mark("signal received", "KilnUtilizationSurge" in (obj["metadata"].get("annotations") or {}).get(
                    "autoscaling.kiln.dev/signals", ""))
                mark("replicas patched", obj["spec"]["runtime"]["replicas"] > 1)
                running = [p for p in pods(api, ns, "kiln.dev/model=iris") if not p["metadata"].get("deletionTimestamp")]
                mark("pod created", len(running) > 1)
                mark("ready", len([p for p in running if ready(p)]) > 1)
            time.sleep(0.5)
        return {"stages": stages, "changes": changes, "at_rest_low": at_rest_low, "phase": phase, "peak": peak[0],
                "cycles": cycles, "answered": answered[0], "failed": answered[1],
                "final": (api.get(path) or {}).get("spec", {}).get("runtime", {}).get("replicas")}
    finally:
        stop.set()
        for server in reversed(servers):
            server.stop()
        cluster.down()


def _min_gap(changes: list[tuple[float, int, int, str]], up: bool) -> float | None:
    times = [at for at, a, b, _ in changes if (b > a) == up]
    return min((b - a for a, b in zip(times, times[1:])), default=None)


def run(quick: bool) -> str:
    r = measure(quick)
    stages, changes = r["stages"], r["changes"]
    scrape = _chart_default("monitoring.podMonitor.interval")
    interval = _chart_default("autoscaling.rules.interval")
    why = {
        "utilization above 2x target": f"the busy counter's rate over surgeWindow ({_chart_default('autoscaling.rules.surgeWindow')}), "
                                       f"scraped every {scrape} and recorded every {interval}, crosses "
                                       f"{2 * TARGET_UTILIZATION:g} (it reached {r['peak']:.2f})",
        "alert firing": f"KilnUtilizationSurge, `for: {_chart_default('autoscaling.rules.surgeFor')}`: the evaluation that saw it",
        "signal received": "Alertmanager's group_wait "
                           f"({_documented('group_wait')}) for a new group, then the webhook",
        "replicas patched": "the receiver's write wakes the model; the scaling step decides (the newer Surge "
                            "over the older Low) and writes",
        "pod created": "the Deployment and ReplicaSet controllers, the scheduler",
        "ready": "the kubelet harness starts `kiln serve`: engine read, verified, loaded, warmed up",
    }
    lines = [
        f"## Scale-up in seconds, and an oscillating load (issue 24 item 3){' (quick)' if quick else ''}",
        "",
        "Everything real and as shipped: Kiln installed by helm on the local control plane, the demo model behind "
        "a needless 20-layer MLP (the same answers, about 10 ms a 64-row batch, so that clients keep its engine "
        "busy) in `kiln serve` pods run by the kubelet harness, Debian's Prometheus with the chart's rules "
        f"rendered with default values (the rule group's {interval} interval, KilnUtilizationSurge) and the "
        f"PodMonitor's {scrape} scrape, Alertmanager with the route docs/operations.md ships "
        f"(group_wait {_documented('group_wait')}, group_interval {_documented('group_interval')}). The model "
        f"autoscales between 1 and 4 replicas on a {TARGET_UTILIZATION:.0%} target with the CRD's cooldowns (up 60 s, down 300 s, "
        "stabilization 300 s, maxStep 2), after "
        f"an idle spell ({'KilnUtilizationLow firing' if r['at_rest_low'] else 'KilnUtilizationLow not yet firing'}). "
        f"Then {r['cycles']} cycles of {r['phase']:.0f} s high ({HIGH_CLIENTS} clients sending 64-row requests; the "
        f"short-window utilization reached {r['peak']:.0%} on one replica) and {r['phase']:.0f} s low ({LOW_CLIENTS} "
        "client), each client sending to "
        "the Ready pods in turn as the Service would. This machine's 2 cores are shared by the control plane, the "
        "pods, Prometheus and the clients.",
        "",
        "**From the load step to the first new replica Ready**, each stage as first observed (polling every 0.5 s):",
        "",
        "| stage | at | took | why |",
        "|---|---|---|---|",
    ]
    last = 0.0
    for stage in why:
        if stage in stages:
            lines.append(f"| {stage} | {stages[stage]:.1f} s | {stages[stage] - last:.1f} s | {why[stage]} |")
            last = stages[stage]
        else:
            lines.append(f"| {stage} | not seen | | {why[stage]} |")
    ready_at = stages.get("ready")
    met = ready_at is not None and ready_at <= TARGET_S
    lines += [
        "",
        f"Target: the first new replica Ready within {TARGET_S:.0f} s of the load step: "
        f"{'%.1f s, met' % ready_at if met else ('%.1f s, **missed**' % ready_at if ready_at else '**not seen**')} "
        "(before: 107.7 s with highFor 1m, rateWindow 1m, a 15 s scrape and group_wait 10 s).",
        "",
        f"**Replica changes under the oscillating load** ({2 * r['cycles'] * r['phase'] / 60:.0f} minutes; "
        f"{r['answered']} requests answered, {r['failed']} failed):",
        "",
        "| at | change | decision |",
        "|---|---|---|",
    ]
    lines += [f"| {at:.1f} s | {a} -> {b} | {reason} |" for at, a, b, reason in changes] or ["| - | none | |"]
    ups, downs = [c for c in changes if c[2] > c[1]], [c for c in changes if c[2] < c[1]]
    gap_up, gap_down = _min_gap(changes, True), _min_gap(changes, False)
    no_flap = (gap_up is None or gap_up >= UP_COOLDOWN) and (gap_down is None or gap_down >= DOWN_COOLDOWN)
    lines += [
        "",
        f"{len(ups)} up, {len(downs)} down; the closest two changes in one direction: "
        f"up {'%.0f s' % gap_up if gap_up is not None else '-'} (cooldown {UP_COOLDOWN:.0f} s), "
        f"down {'%.0f s' % gap_down if gap_down is not None else '-'} (cooldown {DOWN_COOLDOWN:.0f} s): "
        f"at most one change per direction per cooldown {'met' if no_flap else '**missed**'}. "
        f"Replicas at the end: {r['final']}. A low phase of {r['phase']:.0f} s is shorter than lowFor "
        f"({_chart_default('autoscaling.rules.lowFor')}) plus the stabilization window, so it scales nothing down; "
        "a surge fires in each high phase while the model is short of replicas, and the scale-up cooldown bounds "
        "how often it acts.",
    ]
    return "\n".join(lines) + "\n"


def _documented(key: str) -> str:
    sys.path.insert(0, str(REPO / "tests"))
    from support import monitoring

    return monitoring.DOCUMENTED_TIMINGS[key]


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
