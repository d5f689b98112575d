"""Engine-cache garbage collection, decided by the operator (operator/cachegc.py).

The pure decision first (plain dicts); then the real operator on the emulated API server:
versions rolled out one after another, a deleted model, a model re-created under the same
name, a dry run, two operators deciding at once, and a build that runs out of space. The
GC Job's executor on a real volume is tested in tests/runtime/test_cache_gc.py, and the two
together on the real control plane in tests/e2e.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import urllib.request

import pytest

from kiln.operator import cachegc, manifests
from kiln.operator.config import OperatorConfig
from kiln.operator.kube import Kube, load_client
from kiln.operator.steps import Context
from kiln.runtime.api import contract

from support.operator_play import condition, finish_job, jobs, model, reasons, request_of, roll_out, status

UTC = datetime.timezone.utc
T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
K = [f"{i:x}" * 16 for i in range(1, 8)]  # engine keys, 16 hex characters


def entry(key: str, model_name: str = "m", *, recorded: str = "2026-12-01T00:00:00Z", target: str = "sm90",
          unneeded_since: str | None = None, claim: str | None = None, ns: str = "ns") -> tuple[str, str]:
    value = {"ok": True, "key": key, "path": f"{ns}/{model_name}/{key}", "sizeBytes": 1000, "recordedAt": recorded}
    if unneeded_since:
        value["unneededSince"] = unneeded_since
    if claim:
        value["claim"] = claim
    return f"{key}.{target}", json.dumps(value)


def decide(index: dict, needed: set, models: set = frozenset({"m"}), now=T0, retention=1, grace=3600, dry=False):
    entries = [cachegc.parse_entry("ns", k, v, "kiln-engine-cache") for k, v in index.items()]
    return cachegc.decide([e for e in entries if e], needed, set(models), now, retention, grace, dry)


# ------------------------------------------------------------------------ the decision, pure

def test_needed_entries_and_the_newest_other_one_stay_the_rest_is_marked_first():
    index = dict(entry(k, recorded=f"2026-12-01T0{i}:00:00Z") for i, k in enumerate(K[:4]))
    d = decide(index, needed={K[3]})
    assert d.due == []
    assert {e.key for e in d.keep} == set(K[:4])
    marked = {k for k, v in d.updates.items() if v and json.loads(v).get("unneededSince")}
    assert marked == {f"{K[0]}.sm90", f"{K[1]}.sm90"}  # K[2]: the rollback target, K[3]: needed
    assert json.loads(d.updates[f"{K[0]}.sm90"])["unneededSince"] == "2026-12-01T12:00:00Z"


def test_an_entry_unneeded_for_the_grace_period_is_due_and_leaves_the_index():
    index = dict([entry(K[0], unneeded_since="2026-12-01T10:59:59Z"), entry(K[1], unneeded_since="2026-12-01T11:30:00Z"),
                  entry(K[2], recorded="2026-12-01T01:00:00Z"), entry(K[3], recorded="2026-12-01T02:00:00Z")])
    d = decide(index, needed={K[3]}, retention=0)
    assert [e.key for e in d.due] == [K[0]]
    assert d.updates[f"{K[0]}.sm90"] is None
    assert f"{K[1]}.sm90" not in d.updates  # marked already, grace not over
    assert json.loads(d.updates[f"{K[2]}.sm90"])["unneededSince"]  # retention 0: marked now


def test_a_needed_entry_loses_its_mark_and_a_dry_run_removes_nothing():
    index = dict([entry(K[0], unneeded_since="2026-11-01T00:00:00Z"), entry(K[1], unneeded_since="2026-11-01T00:00:00Z")])
    d = decide(index, needed={K[0]}, retention=0, dry=True)
    assert "unneededSince" not in json.loads(d.updates[f"{K[0]}.sm90"])
    assert [e.key for e in d.due] == [K[1]] and f"{K[1]}.sm90" not in d.updates


def test_a_deleted_models_entries_keep_no_rollback_and_go_after_the_grace_period():
    index = dict([entry(K[0], "gone", unneeded_since="2026-12-01T10:00:00Z"), entry(K[1], "gone"),
                  entry(K[2], "m")])
    d = decide(index, needed=set(), models={"m"})
    assert [e.key for e in d.due] == [K[0]]
    assert json.loads(d.updates[f"{K[1]}.sm90"])["unneededSince"]  # the newest, but its model is gone
    assert f"{K[2]}.sm90" not in d.updates  # m's only other entry: its rollback target


def test_retention_counts_per_target_and_a_shared_key_is_needed_under_every_model():
    index = dict([entry(K[0], target="sm90", recorded="2026-12-01T01:00:00Z"),
                  entry(K[0], target="sm80", recorded="2026-12-01T01:00:00Z"),
                  entry(K[1], "other", recorded="2026-12-01T02:00:00Z")])
    d = decide(index, needed={K[1]}, models={"m", "other"})
    assert d.updates == {}  # K[0] is m's rollback for each target; K[1] is needed (by key, whoever built it)


def test_what_gc_cannot_read_it_leaves_alone():
    index = {f"{K[0]}.sm90": "not json", f"{K[1]}.sm90": json.dumps({"ok": True, "path": "../../etc/x"}),
             f"{K[2]}.sm90": json.dumps({"ok": True, "key": K[2], "path": f"other-ns/m/{K[2]}"})}
    assert [cachegc.parse_entry("ns", k, v, "c") for k, v in index.items()] == [None, None, None]


def test_the_keys_a_deployment_runs_and_a_status_names_are_needed():
    dep = {"spec": {"template": {"spec": {"containers": [{"args": [
        "serve", "--engine", f"sm90=ns/m/{K[0]}", "--engine", f"sm80=ns/m/{K[1]}", "--port", "8080"]}]}}}}
    assert cachegc.engine_keys_of_deployment(dep) == {K[0], K[1]}
    st = {"engineKey": K[2], "stable": {"engineKey": K[2]}, "canary": {"engineKey": K[3]},
          "rollback": {"engineKey": K[4]}, "engines": [{"key": K[5]}]}
    assert cachegc.engine_keys_of_status(st) == {K[2], K[3], K[4], K[5]}


def test_the_plan_keeps_what_a_build_touched_just_before_the_decision():
    d = decide(dict([entry(K[0], unneeded_since="2026-11-01T00:00:00Z"), entry(K[1])]), needed={K[1]}, retention=0)
    plan = cachegc.plan_of("ns", T0, 3600, False, d.due, d.keep)
    assert plan["remove"] == [{"model": "m", "key": K[0]}] and plan["keep"] == [{"model": "m", "key": K[1]}]
    assert plan["decidedAt"] == T0.timestamp() - cachegc.CLOCK_SKEW_SECONDS


def test_the_gc_job_runs_kiln_cache_gc_with_the_lock_settle_time_the_operator_was_given():
    import argparse

    from kiln.runtime.commands import cache_gc

    def job_args(config: OperatorConfig) -> argparse.Namespace:
        job = manifests.cache_gc_job("ml", "kiln-engine-cache", "kiln-cache-gc-x", "plan-x", config)
        [container] = job["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["kiln"] and container["args"][0] == "cache-gc"
        parser = argparse.ArgumentParser(exit_on_error=False)
        cache_gc.configure(parser)
        return parser.parse_args(container["args"][1:])

    assert job_args(OperatorConfig()).lock_settle_seconds is None  # kiln cache-gc's own 60 s
    assert job_args(OperatorConfig(cache_gc_lock_settle_seconds=0.0)).lock_settle_seconds == 0.0


def test_status_cache_lists_a_models_engines_newest_first():
    index = dict([entry(K[0], recorded="2026-12-01T01:00:00Z", unneeded_since="2026-12-01T11:00:00Z"),
                  entry(K[1], recorded="2026-12-01T02:00:00Z"), entry(K[2], recorded="2026-12-01T03:00:00Z"),
                  entry(K[3], "other")])
    st = cachegc.cache_status("ns", "m", index, {K[2]}, "kiln-engine-cache")
    assert st["summary"] == "3 engines, 2.9 KiB" and st["bytes"] == 3000
    assert [(e["key"], e["use"]) for e in st["engines"]] == [(K[2], "current"), (K[1], "rollback"),
                                                            (K[0], "unneeded")]
    assert st["engines"][2]["unneededSince"] == "2026-12-01T11:00:00Z"
    assert cachegc.cache_status("ns", "nobody", index, set(), "c") is None


# ------------------------------------------------------------------------ the real operator, emulated API

GC = dict(cache_gc_interval_seconds=0.5, cache_gc_grace_seconds=1.0, cache_gc_retention=1, retry_seconds=0.5,
          resync_seconds=600)


@pytest.fixture
def gc_operator(start_operator):
    started = []

    def start(**config):
        op = start_operator(**{**GC, **config})
        started.append(op)
        return op
    yield start
    for op in started:
        op.stop()


def gc_jobs(api, ns):
    return api.list("Job", ns, selector="app.kubernetes.io/name=kiln-cache-gc")


def finish_gc(api, job, result: dict) -> None:
    """Play the Job controller and the kubelet for a GC Job (as finish_job does for a build)."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    pod = f"{name}-{job['metadata']['uid'][:5]}"
    api.apply({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod, "namespace": ns, "labels": {"job-name": name}},
               "spec": job["spec"]["template"]["spec"]})
    api.patch("Pod", ns, pod, {"status": {"phase": "Succeeded", "containerStatuses": [{
        "name": "cache-gc", "ready": False, "restartCount": 0, "image": "kiln", "imageID": "",
        "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": json.dumps(result),
                                 "finishedAt": "2026-12-01T00:00:00Z"}}}]}}, subresource="status")
    api.patch("Job", ns, name, {"status": {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}},
              subresource="status")


OK_NOTHING = {"ok": True, "dryRun": False, "removedEntries": 0, "removedBytes": 0, "seconds": 0.01,
              "skipped": [], "orphans": [], "truncated": 0}


def wait_gc(api, ns, what, timeout: float = 30, message: str = ""):
    """Wait for `what()`, playing the executor meanwhile: a GC Job whose plan removes nothing
    is finished (nothing removed), as it would be on a real volume."""
    finished: set[str] = set()

    def look():
        for job in gc_jobs(api, ns):
            cm = api.get("ConfigMap", ns, job["metadata"]["annotations"][manifests.ANN_GC_PLAN])
            done = job["metadata"]["uid"] in finished or (job.get("status") or {}).get("conditions")
            if done or cm is None or json.loads(cm["data"]["plan.json"])["remove"]:
                continue
            finish_gc(api, job, OK_NOTHING)
            finished.add(job["metadata"]["uid"])
        return what()
    return api.wait(look, timeout, message or str(what))


def gc_job_removing(api, ns, timeout: float = 30):
    """The first GC Job whose plan removes something."""
    return wait_gc(api, ns, lambda: next((j for j in gc_jobs(api, ns) if plan_of(api, j)["remove"]), None),
                   timeout, "a GC Job that removes something")


def plan_of(api, job) -> dict:
    cm = api.get("ConfigMap", job["metadata"]["namespace"], job["metadata"]["annotations"][manifests.ANN_GC_PLAN])
    return json.loads(cm["data"]["plan.json"]) if cm else {"remove": []}


def index_keys(api, ns) -> set[str]:
    return set((api.get("ConfigMap", ns, contract.ENGINE_INDEX) or {}).get("data") or {})


def serve_version(api, ns, name, version, first=False):
    if first:
        api.apply(model(ns, name, version=version, rollout={"strategy": "Recreate"}))
    else:
        api.patch("InferenceModel", ns, name, {"spec": {"model": {"version": version}}})
    job = api.wait(lambda: [j for j in jobs(api, ns) if request_of(j)["model"]["version"] == version], 30)[0]
    finish_job(api, job)
    key = request_of(job)["key"]
    api.wait(lambda: ((api.get("Deployment", ns, manifests.runtime_name(name)) or {}).get("spec") or {})
             .get("template", {}).get("metadata", {}).get("labels", {}).get(contract.LABEL_ENGINE_KEY) == key,
             30, f"version {version} rolled")
    roll_out(api, ns, name)
    api.wait(lambda: status(api, ns, name).get("engineKey") == key and status(api, ns, name)["phase"] == "Ready", 30)
    return key


def test_versions_1_2_3_the_oldest_engine_goes_the_rollback_target_stays(api, gc_operator):
    op = gc_operator(alert_token="gc-token")
    ns, name = "gc-versions", "resnet"
    k1 = serve_version(api, ns, name, "1", first=True)
    k2 = serve_version(api, ns, name, "2")
    k3 = serve_version(api, ns, name, "3")

    job = gc_job_removing(api, ns)
    plan = plan_of(api, job)
    assert plan["remove"] == [{"model": name, "key": k1}] and plan["namespace"] == ns and not plan["dryRun"]
    assert {(e["model"], e["key"]) for e in plan["keep"]} == {(name, k2), (name, k3)}
    assert job["spec"]["template"]["spec"]["volumes"][0] == {"name": "cache",
                                                             "persistentVolumeClaim": {"claimName": "kiln-engine-cache"}}
    # v1 left the index before the Job could remove it; its finished build Job went too (a model
    # needing v1 again builds it, touching the entry).
    assert index_keys(api, ns) == {f"{k2}.sm90", f"{k3}.sm90"}
    assert [request_of(j)["key"] for j in jobs(api, ns) if request_of(j)["key"] == k1] == []
    st = api.wait(lambda: (lambda s: s if len((s.get("cache") or {}).get("engines") or ()) == 2 else None)(
        status(api, ns, name)), 30, "status.cache without v1")
    assert [(e["key"], e["use"]) for e in st["cache"]["engines"]] == [(k3, "current"), (k2, "rollback")]
    assert st["cache"]["summary"] == "2 engines, 235.5 MiB"

    finish_gc(api, job, {"ok": True, "dryRun": False, "removedEntries": 1, "removedBytes": 123456789,
                         "seconds": 0.1, "skipped": [], "orphans": [], "truncated": 0})
    removed = api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "EngineRemoved"], 30)
    assert k1 in removed[0]["message"] and "kiln-engine-cache" in removed[0]["message"]
    api.wait(lambda: job["metadata"]["uid"] not in {j["metadata"]["uid"] for j in gc_jobs(api, ns)}, 30,
             "the finished GC Job deleted")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{op.alert_port}/metrics", timeout=5).read().decode()
    assert (f'kiln_cache_gc_removed_entries_total{{claim="kiln-engine-cache",namespace="{ns}",reason="unneeded"}} 1.0'
            in metrics)
    assert f'kiln_cache_gc_removed_bytes_total{{claim="kiln-engine-cache",namespace="{ns}"}} 1.23456789e+08' in metrics
    assert status(api, ns, name)["phase"] == "Ready"


def test_a_model_recreated_after_gc_forgot_its_engine_builds_it_again(api, gc_operator):
    gc_operator()
    ns, name = "gc-recreate", "bert"
    key = serve_version(api, ns, name, "1", first=True)
    [old_build] = jobs(api, ns)
    api.delete("InferenceModel", ns, name)
    api.delete("Deployment", ns, manifests.runtime_name(name))  # the garbage collector's part
    job = gc_job_removing(api, ns)
    assert plan_of(api, job)["remove"] == [{"model": name, "key": key}]
    assert f"{key}.sm90" not in index_keys(api, ns)  # forgotten before the Job removes it

    api.apply(model(ns, name, version="1", rollout={"strategy": "Recreate"}))
    [build] = api.wait(lambda: [j for j in jobs(api, ns) if j["metadata"]["uid"] != old_build["metadata"]["uid"]],
                       30, "a new build Job of the same key")
    assert request_of(build)["key"] == key
    assert api.get("Deployment", ns, manifests.runtime_name(name)) is None  # nothing serves a removed engine
    finish_job(api, build, result={**json.loads(json.dumps(request_result(build))), "cacheHit": True})
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 30, "served again")
    assert f"{key}.sm90" in index_keys(api, ns)


def request_result(job) -> dict:
    req = request_of(job)
    return {"ok": True, "key": req["key"], "target": req["target"], "path": f"{req['namespace']}/{req['name']}/{req['key']}",
            "sha256": "ab" * 32, "sizeBytes": 1000, "buildSeconds": 0, "backend": "tensorrt", "backendVersion": "10.13.0"}


def test_a_model_recreated_within_the_grace_period_keeps_its_engine(api, gc_operator):
    gc_operator(cache_gc_grace_seconds=3600)
    ns, name = "gc-keep", "vit"
    key = serve_version(api, ns, name, "1", first=True)
    api.delete("InferenceModel", ns, name)
    api.delete("Deployment", ns, manifests.runtime_name(name))
    wait_gc(api, ns, lambda: "unneededSince" in json.loads(
        api.get("ConfigMap", ns, contract.ENGINE_INDEX)["data"][f"{key}.sm90"]), 30, "marked unneeded")
    builds = {j["metadata"]["uid"] for j in jobs(api, ns)}
    api.apply(model(ns, name, version="1", rollout={"strategy": "Recreate"}))
    api.wait(lambda: api.get("Deployment", ns, manifests.runtime_name(name)), 30, "served from the cache at once")
    assert {j["metadata"]["uid"] for j in jobs(api, ns)} == builds  # no new build
    wait_gc(api, ns, lambda: "unneededSince" not in json.loads(
        api.get("ConfigMap", ns, contract.ENGINE_INDEX)["data"][f"{key}.sm90"]), 30, "the mark cleared")


def test_a_dry_run_says_what_would_go_and_removes_nothing(api, gc_operator):
    gc_operator(cache_gc_dry_run=True, cache_gc_retention=0)
    ns, name = "gc-dry", "yolo"
    k1 = serve_version(api, ns, name, "1", first=True)
    serve_version(api, ns, name, "2")
    job = gc_job_removing(api, ns)
    assert plan_of(api, job)["dryRun"] is True and plan_of(api, job)["remove"] == [{"model": name, "key": k1}]
    finish_gc(api, job, {"ok": True, "dryRun": True, "removedEntries": 0, "removedBytes": 0, "seconds": 0.1,
                         "skipped": [], "orphans": [], "truncated": 0})
    told = api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "EngineRemovable"], 30)
    assert "would remove" in told[0]["message"] and k1 in told[0]["message"]
    assert f"{k1}.sm90" in index_keys(api, ns)
    assert "EngineRemoved" not in reasons(api, ns, name)


def test_two_operators_deciding_at_once_start_one_gc_job_and_tell_it_once(api, cluster):
    ns = "gc-two"
    api.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
                   "name": contract.ENGINE_INDEX, "namespace": ns,
                   "annotations": {cachegc.ANN_LAST_RUN: "2026-01-01T00:00:00Z"}},
               "data": dict([entry(K[0], "gone", unneeded_since="2026-01-01T00:00:00Z", ns=ns)])})

    async def both():
        config = OperatorConfig(**GC)
        contexts = [Context(config=config, kube=Kube(load_client(str(cluster.kubeconfig)))) for _ in range(2)]
        empty = lambda: cachegc.Namespace([], [], [])  # noqa: E731
        return await asyncio.gather(*(cachegc.collect(c, ns, empty) for c in contexts))

    asyncio.run(both())
    assert len(gc_jobs(api, ns)) == 1  # one decided (its conditional patch went through), one Job
    assert f"{K[0]}.sm90" not in index_keys(api, ns)
    assert len(api.list("ConfigMap", ns, selector="app.kubernetes.io/name=kiln-cache-gc")) == 1


def test_a_build_out_of_space_on_the_claim_says_so(api, gc_operator):
    gc_operator()
    ns, name = "gc-full", "llm"
    api.apply(model(ns, name))
    [job] = api.wait(lambda: jobs(api, ns), 30)
    finish_job(api, job, ok=False, exit_code=7, result={"ok": False, "reason": "OutOfDisk",
                                                        "message": "no space left on device: [Errno 28]"})
    st = api.wait(lambda: status(api, ns, name).get("phase") == "Failed" and status(api, ns, name), 30)
    er = condition(st, "EngineReady")
    assert er["reason"] == "OutOfDisk" and "out of space" in er["message"] and "cache.gc.graceSeconds" in er["message"]
    assert api.wait(lambda: [e for e in api.events(ns, name) if e["reason"] == "OutOfDisk"], 5)[0]["type"] == "Warning"
