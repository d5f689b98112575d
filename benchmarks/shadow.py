"""Shadow canaries (issue 25 item 4), on the local control plane, everything real.

Kiln installed by helm (tests/support/localcluster), `kiln serve` pods of the demo model
(ONNX Runtime) run by the kubelet harness, Debian's Prometheus (1 s scrape) that the operator
queries at every step, ReplicaRatio traffic (no gateway): clients of the model's Service send
8-row requests to the pods its selector picks (tests/support/localcluster/client.py
ServiceClients), and every answer that is not 200 is a failure a user saw.

1. A version that answers 500 to real inputs (it passes the warm-up, which sends zeros),
   rolled out without a shadow step and then with one: the clients' failures in each.
2. A version that answers 200 with other numbers (one class's bias moved): the time from
   `kubectl apply` to the rollback, with the shadow step (no error or latency check sees it).
3. The stable side's latency while it copies (the shadow defaults, 10% at most 20/s per pod)
   against the same clients with no rollout, measured twice for the noise.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
ANALYSIS = {"intervalSeconds": 5, "failureLimit": 0, "maxErrorRatio": 0.05, "maxLatencyRatio": 5,
            "agreement": {"minSamples": 20, "classOutputs": ["probabilities"]}}
STEPS = [{"weight": 10, "pauseSeconds": 20}, {"weight": 50, "pauseSeconds": 20}]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(quick: bool) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from support import localcluster, monitoring, versions
    from support.localcluster.client import Api, ServiceClients, wait_for

    window = 15.0 if quick else 30.0
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-shadow-"))
    cluster = localcluster.LocalCluster(root).up()
    servers: list[Any] = []
    try:
        api = Api(cluster.kubeconfig)
        ns = "bench"
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        cluster.seed_demo(ns)
        models = cluster.kubelet.claim_directory(ns, "models")
        path = f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels/iris"

        def apply(version: str, onnx: Path, shadow: dict | None) -> float:
            import hashlib

            model = yaml.safe_load((REPO / "examples" / "demo" / "cluster.yaml").read_text())
            model["metadata"]["namespace"] = ns
            model["spec"]["model"] = {"uri": f"pvc://models/iris/{version}/model.onnx", "version": version,
                                      "sha256": hashlib.sha256(onnx.read_bytes()).hexdigest()}
            model["spec"]["rollout"] = {"strategy": "Canary", "steps": STEPS, "analysis": ANALYSIS,
                                        "shadow": shadow or {"enabled": False}}
            cluster.kubectl("apply", "-f", "-", input=json.dumps(model))
            return time.monotonic()

        status = lambda: (api.get(path) or {}).get("status", {})  # noqa: E731
        apply("1", versions.save_version(models, "1", lambda m: None), None)
        wait_for(lambda: status().get("phase") == "Ready", 240, "version 1 Ready")
        cp = cluster.control_plane
        discovery = monitoring.PodDiscovery(cp.server, [ns], ca_file=str(cp.ca), cert_file=str(cp.root / "pki" / "admin.crt"),
                                            key_file=str(cp.root / "pki" / "admin.key")).start()
        servers.append(discovery)
        prom = monitoring.Prometheus(root / "prom", scrape_configs=[monitoring.pod_http_sd_scrape_config(discovery.url)])
        prom.port = localcluster.PROMETHEUS_PORT  # where the chart's --prometheus-url points
        servers.append(prom)
        prom.start()
        shadow = {"enabled": True, "pauseSeconds": 20}
        out: dict[str, Any] = {"window": window}
        with ServiceClients(api, ns) as clients:
            prom.wait_for(f'kiln_requests_total{{namespace="{ns}"}}', timeout=90)
            time.sleep(5)

            def rollback_of(version: str) -> dict:
                return wait_for(lambda: (status().get("rollback") or {}).get("version") == version and status(),
                                300, f"version {version} rolled back")

            def canary_gone() -> None:
                wait_for(lambda: not api.get(f"/apis/apps/v1/namespaces/{ns}/deployments/iris-canary"), 90,
                         "the canary Deployment gone")

            for name, version, with_shadow in (("without", "2", None), ("with", "3", shadow)):
                before, answered = len(clients.failures), len(clients.latencies)
                t0 = apply(version, versions.failing_on_real_inputs(models, version), with_shadow)
                st = rollback_of(version)
                took = time.monotonic() - t0
                canary_gone()
                time.sleep(3)  # answers in flight when it went
                out[f"failing {name}"] = {"failed": len(clients.failures) - before, "seconds": took,
                                          "answered": len(clients.latencies) - answered,
                                          "reason": st["rollback"]["reason"], "step": st["rollback"]["step"]}

            t0 = apply("4", versions.shifted_version(models, "4"), shadow)
            seen: dict[str, float] = {}
            def wrong_rolled_back() -> bool:
                st = status()
                if (st.get("canary") or {}).get("readyReplicas"):
                    seen.setdefault("canary Ready", time.monotonic() - t0)
                return (st.get("rollback") or {}).get("version") == "4"
            before = len(clients.failures)
            wait_for(wrong_rolled_back, 300, "version 4 rolled back")
            out["wrong"] = {"seconds": time.monotonic() - t0, "canary_ready": seen.get("canary Ready"),
                            "reason": status()["rollback"]["reason"], "failed": len(clients.failures) - before}
            canary_gone()

            def latencies_for(seconds: float) -> list[float]:
                start = len(clients.latencies)
                time.sleep(seconds)
                return clients.latencies[start:]

            time.sleep(5)
            out["baseline 1"] = latencies_for(window)
            out["baseline 2"] = latencies_for(window)
            apply("5", versions.retrained_version(models, "5"), {"enabled": True, "pauseSeconds": int(window * 3)})
            wait_for(lambda: (status().get("canary") or {}).get("stepStartedAt") and
                     api.get(f"/api/v1/namespaces/{ns}/configmaps/iris-shadow"), 240, "the shadow step in effect")
            time.sleep(5)  # the ConfigMap's update reaching the pods
            copies_before = prom.value(f'sum(kiln_shadow_copies_total{{namespace="{ns}", outcome="compared"}})') or 0
            out["shadowing"] = latencies_for(window)
            time.sleep(3)
            copies = (prom.value(f'sum(kiln_shadow_copies_total{{namespace="{ns}", outcome="compared"}})') or 0) - copies_before
            out["copies"] = copies
            st = status()
            out["shadow step held"] = (st.get("canary") or {}).get("step") == 0
            wait_for(lambda: status().get("stable", {}).get("version") == "5" and not status().get("canary"), 300,
                     "version 5 promoted")
            out["failed at the end"] = len(clients.failures)
        return out
    finally:
        for server in reversed(servers):
            server.stop()
        cluster.down()


def run(quick: bool) -> str:
    r = measure(quick)
    without, with_ = r["failing without"], r["failing with"]
    lines = [
        f"## Shadow canaries: a bad version reaches no client (issue 25){' (quick)' if quick else ''}",
        "",
        "`benchmarks/shadow.py`, everything real: Kiln installed by helm on the local control plane, the demo "
        "model (ONNX Runtime) at 2 replicas in `kiln serve` pods run by the kubelet harness, Debian's Prometheus "
        "(1 s scrape) that the operator queries, ReplicaRatio traffic (no gateway): 4 client loops of 8-row "
        "requests to the pods the model's Service selects, every answer that is not 200 counted. Canary steps "
        f"{', '.join(str(s['weight']) + '%' for s in STEPS)}, analysis every {ANALYSIS['intervalSeconds']} s, "
        f"failureLimit {ANALYSIS['failureLimit']}, maxErrorRatio {ANALYSIS['maxErrorRatio']}; the shadow step "
        "at its defaults (10% of each stable pod's requests, at most 20/s) with agreement minSamples "
        f"{ANALYSIS['agreement']['minSamples']}. This machine's 2 cores are shared by the control plane, every "
        "pod (the canary's too), Prometheus and the clients.",
        "",
        "**A version that answers 500 to real inputs** (it passes the warm-up, which sends zeros):",
        "",
        "| rollout | client-visible failures | requests answered meanwhile | apply to rollback | rolled back at |",
        "|---|---:|---:|---:|---|",
    ]
    for name, row in (("canary steps, no shadow step", without), ("shadow step first", with_)):
        where = " (the shadow step)" if row is with_ and row["step"] == 0 else ""
        lines.append(f"| {name} | **{row['failed']}** | {row['answered']} | {row['seconds']:.1f} s | "
                     f"step {row['step'] + 1}{where}: {row['reason'].split(' from ')[0]} |")
    wrong = r["wrong"]
    lines += [
        "",
        f"Target 0 failures with the shadow step: {'met' if with_['failed'] == 0 else '**missed**'} "
        f"({with_['failed']}, against {without['failed']} without it). Without it the canary takes its first "
        "step's share by replica ratio, which with 2 replicas is 1 stable pod and 1 canary pod, half the "
        "requests, until the first analysis fails.",
        "",
        f"**A version that answers 200 with other numbers** (the first class's bias moved by 5): rolled back "
        f"{wrong['seconds']:.1f} s after `kubectl apply` (its canary pod Ready at "
        f"{wrong['canary_ready'] or float('nan'):.1f} s: the build, the pod's start), with "
        f"{wrong['failed']} client-visible failures; the reason in status: "
        f"`{wrong['reason'].split(' from ')[0]}`. No error-ratio or latency check sees this version.",
        "",
        "**The stable side's answers while it copies** (client latency, the same clients, windows of "
        f"{r['window']:.0f} s):",
        "",
        "| window | answers | p50 | p99 | p50 vs first baseline |",
        "|---|---:|---:|---:|---:|",
    ]
    base = statistics.median(r["baseline 1"]) if r["baseline 1"] else float("nan")
    for name in ("baseline 1", "baseline 2", "shadowing"):
        values = r[name]
        p50, p99 = _percentile(values, 0.5), _percentile(values, 0.99)
        lines.append(f"| {name}{' (%d copies compared)' % r['copies'] if name == 'shadowing' else ''} | "
                     f"{len(values)} | {p50 * 1000:.1f} ms | {p99 * 1000:.1f} ms | {p50 / base:.2f} |")
    noise = abs(_percentile(r["baseline 2"], 0.5) / base - 1)
    added = _percentile(r["shadowing"], 0.5) / base - 1
    lines += [
        "",
        f"Added p50 while shadowing: {added * 100:+.1f}% against a baseline-to-baseline difference of "
        f"{noise * 100:.1f}% (target: within noise: {'met' if added <= max(noise, 0.05) else '**missed**'}). "
        "While shadowing the canary's pod also runs on these 2 cores, which a cluster would give it a node of "
        "its own for; the copies themselves are sent after each answer, by the stable pod's engine process. "
        f"Client-visible failures over the whole run: {r['failed at the end']} (those of the rollout without a "
        "shadow step; the promotion of the last version included).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
