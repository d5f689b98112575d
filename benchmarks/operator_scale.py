"""Operator at scale: many InferenceModels against the emulated API server.

The real operator runs as a subprocess (`kiln operator --standalone --kubeconfig ...`, so
its memory is its own, read from /proc), against the emulated API server of the tests
(tests/support/kubeemu.py: kmock plus the realism layer) running in this process. Measured:

1. burst: N InferenceModels created at once (N=500; quick: 100), each with its own engine
   key; the time until every build Job exists;
2. latency when idle: models created one at a time after the burst; the time from the
   create call's answer to the build Job's creation in the API server (p50, p99);
3. idle cost: a quiet window (60 s; quick: 20 s) with every model waiting on its build and
   the resync timer firing inside the window; API requests the server received, per model
   per minute (watch-stream reconnects and bookmarks included);
4. the operator's resident memory (VmRSS, and the peak VmHWM) after all that.

Baseline from the same run: the emulator's own request cost (a list of the Jobs from this
process), so the figures can be read against what one API round trip costs here.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The watch streams the operator keeps (handlers.py): models, Jobs, pods, Deployments,
# Services, ConfigMaps, and kopf's own observer of CRDs (in all-namespaces mode).
WATCHED = ("inferencemodels", "jobs", "pods", "deployments", "services", "configmaps", "customresourcedefinitions")
TARGETS = {"burst_seconds": 60.0, "p99_seconds": 1.0, "idle_per_model_minute": 1.0, "rss_mb": 250.0}


def _model(ns: str, name: str, version: str) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"uri": f"https://models.example.com/{name}.onnx", "version": version},
                     "engine": {"backend": "tensorrt", "precision": "fp16", "targets": ["H100"]},
                     "runtime": {"replicas": 1}}}


def _rss(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]


def run(quick: bool) -> str:
    from kiln.operator import main
    from kiln.operator.config import OperatorConfig
    from kiln.operator.plan import plan_engines
    from kiln.runtime.api import spec as specmod

    from support import kubeemu

    n_burst = 100 if quick else 500
    n_single = 30 if quick else 60
    idle_window = 20.0 if quick else 60.0
    resync = idle_window / 2  # the timer fires inside the idle window
    namespaces = [f"bench-{i}" for i in range(10)]

    emu = kubeemu.ThreadedEmulator(crd=specmod.load_crd(), keep_requests=False)
    e = emu.emu
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    kubeconfig = e.kubeconfig(tmp / "kubeconfig")
    log = open(tmp / "operator.log", "w")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "operator", "--standalone", "--kubeconfig",
                             str(kubeconfig), "--liveness", "", "--resync-seconds", str(resync)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def jobs_in(prefix: str) -> int:
        return sum(1 for (k, ns, _) in list(e.store) if k == "batch/v1/jobs" and ns.startswith(prefix))

    async def create(obj: dict) -> float:
        ns = obj["metadata"]["namespace"]
        async with e.post(f"/apis/kiln.dev/v1alpha1/namespaces/{ns}/inferencemodels", json=obj) as resp:
            assert resp.status == 201, await resp.text()
        return time.monotonic()

    async def burst(objs: list[dict]) -> None:
        await asyncio.gather(*(create(o) for o in objs))

    async def call(method: str, path: str, body: Any, ctype: str = "application/json") -> None:
        async with e.request(method, path, data=json.dumps(body), headers={"Content-Type": ctype}) as resp:
            assert resp.status < 300, await resp.text()

    async def finish_builds(prefix: str) -> None:
        """Play the Job controller and kubelet for every build Job: pod terminated, Job Complete."""
        async def one(job: dict) -> None:
            ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
            args = job["spec"]["template"]["spec"]["containers"][0]["args"]
            req = json.loads(args[args.index("--request") + 1])
            result = {"ok": True, "key": req["key"], "target": req["target"], "sha256": "ab" * 32,
                      "path": f"{ns}/{req['name']}/{req['key']}", "sizeBytes": 1 << 20, "buildSeconds": 60.0,
                      "cacheHit": False, "backend": "tensorrt", "backendVersion": "10.13.0"}
            await call("POST", f"/api/v1/namespaces/{ns}/pods", {
                "metadata": {"name": name + "-p", "labels": {**job["metadata"]["labels"], "job-name": name},
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                  "uid": job["metadata"]["uid"]}]},
                "spec": {"containers": [{"name": "build", "image": "kiln"}]}})
            await call("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}-p/status",
                       {"status": {"containerStatuses": [{"name": "build", "state": {"terminated": {
                           "exitCode": 0, "message": json.dumps(result)}}}]}}, "application/merge-patch+json")
            await call("PATCH", f"/apis/batch/v1/namespaces/{ns}/jobs/{name}/status",
                       {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}},
                       "application/merge-patch+json")
        todo = [o for (k, ns, _), o in list(e.store.items()) if k == "batch/v1/jobs" and ns.startswith(prefix)]
        for i in range(0, len(todo), 50):
            await asyncio.gather(*(one(j) for j in todo[i:i + 50]))

    async def roll_out(prefix: str) -> None:
        """Play the Deployment controller: every runtime replica ready."""
        async def one(dep: dict) -> None:
            n = dep["spec"].get("replicas", 1)
            await call("PATCH", f"/apis/apps/v1/namespaces/{dep['metadata']['namespace']}/deployments/"
                                f"{dep['metadata']['name']}/status",
                       {"status": {"observedGeneration": dep["metadata"]["generation"], "replicas": n,
                                   "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n}},
                       "application/merge-patch+json")
        todo = [o for (k, ns, _), o in list(e.store.items()) if k == "apps/v1/deployments" and ns.startswith(prefix)]
        for i in range(0, len(todo), 50):
            await asyncio.gather(*(one(d) for d in todo[i:i + 50]))

    def phases(prefix: str) -> list[str]:
        return [((o.get("status") or {}).get("phase") or "") for (k, ns, _), o in list(e.store.items())
                if k == "kiln.dev/v1alpha1/inferencemodels" and ns.startswith(prefix)]

    def timer_ticks() -> int:
        return (tmp / "operator.log").read_text(errors="replace").count("reconciling on its timer")

    def idle(window: float) -> tuple[int, int, dict[str, int], int]:
        last = -1
        while last != e.n_requests:  # wait for quiet first
            last = e.n_requests
            time.sleep(2.0)
        before_req, before_writes, before_counts, ticks = e.n_requests, e.writes(), dict(e.counts), timer_ticks()
        time.sleep(window)
        by_kind = {f"{m} {k}": n - before_counts.get((m, k), 0) for (m, k), n in e.counts.items()
                   if n - before_counts.get((m, k), 0)}
        return e.n_requests - before_req, e.writes() - before_writes, by_kind, timer_ticks() - ticks

    def wait_until(cond, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            if proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {proc.returncode}; see {tmp / 'operator.log'}")
            time.sleep(0.02)
        return False

    try:
        # Baseline: one API round trip from here (list the Jobs, none yet).
        async def one_list() -> None:
            async with e.get("/apis/batch/v1/jobs") as resp:
                await resp.read()
        t0 = time.monotonic()
        for _ in range(50):
            emu.call(one_list())
        round_trip_ms = (time.monotonic() - t0) / 50 * 1000

        # Warm-up: the operator is up once it has built the Job of a first model.
        emu.call(create(_model("warmup", "warmup", "0")))
        if not wait_until(lambda: jobs_in("warmup") == 1, 60):
            raise RuntimeError(f"the operator did not start; see {tmp / 'operator.log'}")

        start_rss_mb, _ = _rss(proc.pid)

        # 1. Burst.
        objs = [_model(namespaces[i % len(namespaces)], f"m{i:04d}", f"{i}") for i in range(n_burst)]
        t0 = time.monotonic()
        emu.call(burst(objs), timeout=120)
        created_s = time.monotonic() - t0
        ok = wait_until(lambda: jobs_in("bench-") >= n_burst, 180)
        burst_s = time.monotonic() - t0
        if not ok:
            raise RuntimeError(f"only {jobs_in('bench-')} of {n_burst} Jobs after {burst_s:.0f} s")
        # Let the burst's status writes and events settle.
        wait_until(lambda: all(((e.store.get(("kiln.dev/v1alpha1/inferencemodels", o["metadata"]["namespace"],
                                                o["metadata"]["name"])) or {}).get("status") or {}).get("phase")
                               for o in objs), 120)

        # 2. One at a time, when idle.
        latencies = []
        for i in range(n_single):
            obj = _model("single", f"s{i:03d}", f"{i}")
            applied = emu.call(create(obj))
            job = plan_engines(specmod.apply_defaults(obj["spec"]), OperatorConfig())[0].job_name
            key = ("batch/v1/jobs", "single", job)
            wait_until(lambda: key in e.created_at, 30)
            latencies.append(e.created_at[key] - applied)
            time.sleep(0.2)

        # 3. Idle window while every model waits on its build.
        total_models = n_burst + n_single + 1
        idle_requests, idle_writes, by_kind, ticks = idle(idle_window)
        per_model_minute = idle_requests / total_models / (idle_window / 60)

        # 4. Every build finishes (the benchmark plays the Job controller), then every runtime
        #    Deployment rolls out (it plays the Deployment controller): time to Ready, then idle again.
        t0 = time.monotonic()
        emu.call(finish_builds("bench-"), timeout=300)
        ok = wait_until(lambda: sum(1 for (k, ns, _) in list(e.store) if k == "apps/v1/deployments"
                                    and ns.startswith("bench-")) >= n_burst, 300)
        deploy_s = time.monotonic() - t0
        if not ok:
            raise RuntimeError(f"not every model got its Deployment within {deploy_s:.0f} s")
        t1 = time.monotonic()
        emu.call(roll_out("bench-"), timeout=300)
        wait_until(lambda: phases("bench-").count("Ready") >= n_burst, 300)
        ready_s = time.monotonic() - t1
        ready_count = phases("bench-").count("Ready")
        ready_requests, ready_writes, ready_by_kind, ready_ticks = idle(idle_window)
        ready_per_model_minute = ready_requests / total_models / (idle_window / 60)

        # 5. Memory.
        rss_mb, hwm_mb = _rss(proc.pid)
    finally:
        terminate(proc)
        log.close()
        emu.close()

    p50, p99 = _quantile(latencies, 0.5), _quantile(latencies, 0.99)

    def verdict(value: float, target: float) -> str:
        return "met" if value < target else "**missed**"

    rows = [
        ("burst: every build Job exists", f"{burst_s:.1f} s for {n_burst} models (creates took {created_s:.1f} s)",
         f"< {TARGETS['burst_seconds']:.0f} s", verdict(burst_s, TARGETS["burst_seconds"])),
        ("idle: apply -> Job created, p50", f"{p50 * 1000:.0f} ms", "", ""),
        ("idle: apply -> Job created, p99", f"{p99 * 1000:.0f} ms ({n_single} models)", "< 1 s",
         verdict(p99, TARGETS["p99_seconds"])),
        ("idle, all Building: API requests per model per minute", f"{per_model_minute:.3f} ({idle_requests} requests, "
         f"{idle_writes} writes, {ticks} timer ticks, {total_models} models, {idle_window:.0f} s)", "< 1",
         verdict(per_model_minute, TARGETS["idle_per_model_minute"])),
        ("builds finish -> every Deployment exists", f"{deploy_s:.1f} s for {n_burst} models", "", ""),
        ("rollouts done -> every model Ready", f"{ready_s:.1f} s ({ready_count}/{n_burst} Ready)", "", ""),
        ("idle, all Ready: API requests per model per minute", f"{ready_per_model_minute:.3f} ({ready_requests} "
         f"requests, {ready_writes} writes, {ready_ticks} timer ticks)", "< 1",
         verdict(ready_per_model_minute, TARGETS["idle_per_model_minute"])),
        ("operator RSS (peak)", f"{rss_mb:.0f} MB ({hwm_mb:.0f} MB); {start_rss_mb:.0f} MB with one model",
         "< 250 MB", verdict(hwm_mb, TARGETS["rss_mb"])),
    ]
    lines = [
        "## Operator at scale",
        "",
        f"The real operator (`kiln operator --standalone`, a subprocess) against the emulated API server "
        f"(tests/support/kubeemu.py, in the benchmark's process, sharing the machine's cores). {n_burst} InferenceModels "
        f"created at once across {len(namespaces)} namespaces, each with its own engine key; then {n_single} created "
        f"one at a time; then {idle_window:.0f} s idle with every model waiting on its build; then every build "
        f"finishes and every runtime Deployment rolls out (the benchmark plays the Job and Deployment "
        f"controllers, as the API tests do), and another {idle_window:.0f} s idle with every model Ready. The "
        f"resync timer ({resync:.0f} s) fires inside each idle window (timer ticks below).",
        "",
        "| measure | result | target | |",
        "|---|---|---|---|",
        *[f"| {a} | {b_} | {c} | {d} |" for a, b_, c, d in rows],
        "",
        f"Baseline: one API round trip (list Jobs) from the benchmark process takes {round_trip_ms:.1f} ms here.",
        f"Idle requests by verb and resource: {', '.join(f'{k}: {v}' for k, v in sorted({**by_kind, **ready_by_kind}.items())) or 'none'} "
        "(watch-stream renewals and bookmarks are the only traffic an idle operator causes; the timer reads "
        "kopf's in-memory indexes, not the API).",
        "",
        f"The windows are shorter than the watch streams' server-side timeout ({main.WATCH_SERVER_TIMEOUT} s), so "
        f"no renewal falls inside them; an idle operator renews its {len(WATCHED)} streams once per timeout: "
        f"{len(WATCHED) * 60 / main.WATCH_SERVER_TIMEOUT:.2f} requests per minute in all, "
        f"{len(WATCHED) * 60 / main.WATCH_SERVER_TIMEOUT / total_models:.4f} per model at {total_models} models.",
    ]
    return "\n".join(lines) + "\n"


def terminate(proc: subprocess.Popen | None, timeout: float = 20) -> None:
    """Stop a benchmark's operator process: SIGTERM, then SIGKILL after `timeout`."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
