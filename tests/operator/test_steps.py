"""The reconcile's concern steps through the `Views` seam: plain dicts for what the operator
watches, an in-memory API for what it writes (no server). Status and phase logic table-driven."""

from __future__ import annotations

import collections
import copy
import datetime
import json

import kopf
import pytest

from kiln.operator import engines, manifests, observations, reconcile, rollout, scaling, serving, signals, steps
from kiln.operator.config import OperatorConfig
from kiln.operator.kube import ApiError
from kiln.operator.plan import EngineRef, plan_engines
from kiln.runtime.api import contract
from kiln.runtime.api import spec as specmod

CONFIG = OperatorConfig(retry_seconds=2.0)
NS, NAME, UID = "vision", "resnet", "uid-model"
T0 = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


def model(generation=1, status=None, **spec) -> dict:
    body = {"model": {"uri": "https://models.example.com/r.onnx", "version": "1"},
            "engine": {"backend": "tensorrt", "targets": ["H100"]}, "runtime": {"replicas": 2}}
    for k, v in spec.items():
        body[k] = {**body.get(k, {}), **v}
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": generation},
            "spec": body, "status": status or {}}


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeKube:
    """What the operator writes, kept in memory; `fail` makes one kind of write raise, `refuse`
    makes the API server refuse it (`(method, kind, status, message)`)."""

    def __init__(self, fail: tuple[str, str] | None = None, refuse: tuple[str, str, int, str] | None = None) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.events: list[tuple[str, str, str]] = []
        self.fail, self.refuse = fail, refuse

    def _check(self, method: str, kind: str, namespace: str = NS, name: str = "") -> None:
        self.calls[method] += 1
        if self.fail == (method, kind):
            raise ApiError(500, "InternalError", f"{method} {kind} failed")
        if self.refuse and self.refuse[:2] == (method, kind):
            verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}[method]
            refusal = ApiError(self.refuse[2], "Invalid" if self.refuse[2] == 422 else "Forbidden", self.refuse[3])
            refusal.action = f"{verb} {kind} {namespace}/{name}"  # as Kube's verbs say it
            raise refusal

    async def create(self, obj):
        self._check("POST", obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            return self.objects[key], False
        new = copy.deepcopy(dict(obj))
        new["metadata"].update(uid=f"uid-{len(self.objects)}", generation=1)
        self.objects[key] = new
        return new, True

    async def patch(self, kind, namespace, name, patch, subresource=None):
        self._check("PATCH", kind, namespace, name)
        key = (kind, namespace, name)
        if key not in self.objects and kind != "InferenceModel":
            raise ApiError(404, "NotFound", name)
        obj = merge_patch(self.objects.get(key, {"metadata": {"generation": 1}}), patch)
        if "spec" in patch:
            obj["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
        self.objects[key] = obj
        return obj

    async def list(self, kind, namespace, label_selector=None):
        self.calls["GET"] += 1
        wanted = dict(kv.split("=", 1) for kv in (label_selector or "").split(",") if kv)
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace
                and wanted.items() <= (o["metadata"].get("labels") or {}).items()]

    async def delete(self, kind, namespace, name, uid=None):
        self._check("DELETE", kind, namespace, name)
        return self.objects.pop((kind, namespace, name), None) is not None

    async def event(self, involved, type_, reason, message, now=None):
        self.calls["POST"] += 1
        self.events.append((type_, reason, message))

    def writes(self) -> int:
        return sum(self.calls[m] for m in ("POST", "PATCH", "DELETE"))


class World:
    """What the kopf indexes would hold, as plain dicts."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.pods: dict[str, list[dict]] = {}
        self.deployments: dict[str, dict] = {}
        self.services: dict[str, dict] = {}
        self.index: dict[str, str] = {}
        self.needing: dict[str, set[str]] = {}

    def views(self) -> steps.Views:
        return steps.Views(
            job=lambda ns, name: self.jobs.get(name),
            pods=lambda ns, job: self.pods.get(job, []),
            deployment=lambda ns, name: self.deployments.get(name),
            service=lambda ns, name: self.services.get(name),
            engine_index=lambda ns: self.index,
            owned_jobs=lambda ns, uid: [j for j in self.jobs.values()
                                        if any(r["uid"] == uid for r in j["metadata"].get("ownerReferences", ()))],
            models_needing=lambda ns, job: self.needing.get(job, set()),
        )

    def sync(self, kube: FakeKube) -> None:
        """The watch streams deliver what the operator wrote."""
        for (kind, _, name), obj in kube.objects.items():
            {"Job": self.jobs, "Deployment": self.deployments, "Service": self.services}.get(kind, {})[name] = obj
            if kind == "ConfigMap":
                self.index = dict(obj.get("data") or {})


def ctx(kube) -> steps.Context:
    return steps.Context(config=CONFIG, kube=kube, clock=lambda: T0)


def engine_of(m):
    return plan_engines(specmod.apply_defaults(m["spec"]), CONFIG)[0]


def result_of(engine, **extra):
    return {"ok": True, "key": engine.key, "target": engine.architecture, "path": f"{NS}/{NAME}/{engine.key}",
            "sha256": "ab" * 32, "sizeBytes": 10, "buildSeconds": 5.0, "cacheHit": False, **extra}


def finished(job, ok=True, result=None):
    job = copy.deepcopy(job)
    job["status"] = {"conditions": [{"type": "Complete" if ok else "Failed", "status": "True",
                                     "reason": "" if ok else "BackoffLimitExceeded"}]}
    pod = {"metadata": {"ownerReferences": [{"uid": job["metadata"]["uid"]}]},
           "status": {"containerStatuses": [{"name": "build", "state": {"terminated": {
               "exitCode": 0 if ok else 4, "message": json.dumps(result), "finishedAt": "2026-01-01T00:00:00Z"}}}]}}
    return job, [pod]


def ready_deployment(world, kube):
    dep = kube.objects[("Deployment", NS, manifests.runtime_name(NAME))]
    n = dep["spec"]["replicas"]
    dep["status"] = {"observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
                     "readyReplicas": n}
    world.sync(kube)


async def run(c, m, world):
    try:
        return await reconcile.reconcile(c, m, world.views())
    except (kopf.TemporaryError, kopf.PermanentError):
        return None


def status_written(kube):
    return kube.objects.get(("InferenceModel", NS, NAME), {}).get("status", {})


# ------------------------------------------------------------------------ ownership and phase

class TestOwnership:
    def test_every_condition_and_field_has_one_owner(self):
        found = steps.owners(reconcile.OWNERS)
        assert {k for k, v in found.items() if k.startswith("condition:")} == {
            "condition:EngineReady", "condition:Available", "condition:Progressing", "condition:Degraded"}
        assert found["field:engines"] == "engines" and found["field:stable"] == "rollout"
        assert found["field:scaling"] == "scaling" and found["field:selector"] == "serving"

    def test_a_field_owned_twice_is_refused(self):
        twice = {**reconcile.OWNERS, "other": steps.Owns(fields=("engines",))}
        with pytest.raises(ValueError, match="field:engines is owned by both engines and other"):
            steps.owners(twice)

    def test_a_condition_owned_twice_is_refused(self):
        with pytest.raises(ValueError, match="condition:Available"):
            steps.owners({**reconcile.OWNERS, "other": steps.Owns(conditions=("Available",))})

    def test_a_step_returning_what_it_does_not_own_is_refused(self):
        p = steps.Pass(ctx(FakeKube()), model(), World().views(), {}, [], None, {})
        stray = steps.StepResult(conditions={"Available": (True, "X", "")})
        with pytest.raises(ValueError, match="does not own"):
            steps.merge(p, reconcile.OWNERS, {"engines": stray})


def conds(**given):
    return [{"type": t, "status": s, "reason": r} for t, (s, r) in given.items()]


@pytest.mark.parametrize("conditions,phase", [
    (conds(EngineReady=("False", "InvalidSpec"), Available=("True", "M"), Degraded=("True", "InvalidSpec")), "Failed"),
    (conds(EngineReady=("False", "BuildFailed"), Available=("False", "NoEngine"), Degraded=("False", "A")), "Failed"),
    (conds(EngineReady=("False", "BuildFailed"), Available=("True", "M"), Degraded=("True", "BuildFailed")), "Degraded"),
    (conds(EngineReady=("False", "Building"), Available=("True", "M"), Progressing=("True", "Building"),
           Degraded=("False", "A")), "Building"),
    (conds(EngineReady=("True", "E"), Available=("True", "M"), Progressing=("True", "RollingOut"),
           Degraded=("False", "A")), "Deploying"),
    (conds(EngineReady=("True", "E"), Available=("False", "NoReadyReplicas"), Progressing=("False", "R"),
           Degraded=("False", "A")), "Deploying"),
    (conds(EngineReady=("True", "E"), Available=("False", "ScaledToZero"), Progressing=("False", "R"),
           Degraded=("False", "A")), "Ready"),
    (conds(EngineReady=("True", "E"), Available=("True", "M"), Progressing=("False", "R"),
           Degraded=("True", "ReplicasUnavailable")), "Degraded"),
    (conds(EngineReady=("True", "E"), Available=("True", "M"), Progressing=("False", "R"),
           Degraded=("False", "A")), "Ready"),
])
def test_phase_table(conditions, phase):
    assert steps.phase_of(conditions) == phase


def test_the_phases_the_crd_lists_are_the_phases_the_table_produces():
    enum = specmod.schema()["properties"]["status"]["properties"]["phase"]["enum"]
    assert sorted(enum) == sorted({phase for phase, _ in steps.PHASES})
    for phase, when in steps.PHASES:  # every row can be reached: none hides behind an earlier one
        conditions = [{"type": t, "status": s, "reason": r or "Other"} for t, (s, r) in when.items()]
        assert steps.phase_of(conditions) == phase, when


@pytest.mark.parametrize("canary_phase", ["Progressing", "Paused", "Promoting"])
def test_a_running_canary_is_the_phase_progressing(canary_phase):
    state = {"engineKey": "k2", "step": 0, "weight": 20, "targetWeight": 20, "phase": canary_phase}
    plan = rollout.cn.Plan(canary_key="k2", promote=canary_phase == "Promoting", state=state, rollback=None)
    serving_stable = conds(EngineReady=("True", "EnginesReady"), Available=("True", "MinimumReplicasAvailable"),
                           Degraded=("False", "AsExpected"))
    value, reason, _ = rollout.canary_progressing("2", [obs("Ready", "k2")], plan)
    assert steps.phase_of(serving_stable + conds(Progressing=("True" if value else "False", reason))) == "Progressing"


# ------------------------------------------------------------------------ pure decisions

def obs(state, key="k1", **kw):
    ref = EngineRef(key=key, target="H100", architecture="sm90", backend="tensorrt", backend_version="10")
    return engines.EngineObservation(ref, state, {"cacheHit": True} if state == "Ready" else None, **kw)


@pytest.mark.parametrize("observed,want", [
    ([obs("Ready")], (True, "EnginesReady")),
    ([obs("Ready"), obs("Building", "k2")], (False, "Building")),
    ([obs("Failed", message="boom"), obs("Building", "k2")], (False, "BuildFailed")),
])
def test_engine_condition(observed, want):
    assert engines.engine_condition(observed)[:2] == want


@pytest.mark.parametrize("old,new,acted,reasons", [
    ({}, (False, "Building", "m"), [("Normal", "BuildStarted", "x")], []),
    ({}, (False, "Building", "m"), [], ["BuildStarted"]),  # waiting on another model's Job
    ({"reason": "Building"}, (False, "BuildFailed", "m"), [], ["BuildFailed"]),
    ({"reason": "BuildFailed", "message": "m"}, (False, "BuildFailed", "m"), [], []),
    ({"status": "False"}, (True, "EnginesReady", "m"), [], ["EnginesReady"]),
    ({"status": "False"}, (True, "EnginesReady", "m"), [("Normal", "BuildSucceeded", "x")], []),
    ({}, (False, "InvalidSpec", "m"), [], ["InvalidSpec"]),
    ({"reason": "InvalidSpec"}, (False, "InvalidSpec", "m"), [], []),
])
def test_engine_transition_events(old, new, acted, reasons):
    assert [r for _, r, _ in engines.transition_events(old, new, acted)] == reasons


def seen(**kw):
    return observations.DeploymentObservation(**{"exists": True, "engine_key": "k1", "replicas": 2, "ready": 2, "updated": 2,
                                                 "desired": 2, "rolled_out": True, **kw})


@pytest.mark.parametrize("observation,invalid,waiting,want", [
    (seen(), False, False, (True, "MinimumReplicasAvailable")),
    (seen(ready=0), False, False, (False, "NoReadyReplicas")),
    (seen(ready=0, desired=0), False, False, (False, "ScaledToZero")),
    (observations.DeploymentObservation(), False, True, (False, "NoEngine")),
    (observations.DeploymentObservation(), False, False, (False, "Deploying")),
    (seen(), True, False, (True, "MinimumReplicasAvailable")),
    (observations.DeploymentObservation(), True, False, (False, "NoEngine")),
])
def test_available(observation, invalid, waiting, want):
    assert serving.available(observation, invalid, waiting)[:2] == want


@pytest.mark.parametrize("observation,invalid,failed,current,want", [
    (seen(), None, False, True, (False, "AsExpected")),
    (seen(), "bad", False, False, (True, "InvalidSpec")),
    (seen(), None, True, False, (True, "BuildFailed")),
    (observations.DeploymentObservation(), None, True, False, (False, "AsExpected")),
    (seen(ready=1), None, False, True, (True, "ReplicasUnavailable")),
    (seen(ready=1, rolled_out=False), None, False, True, (False, "AsExpected")),
])
def test_degraded(observation, invalid, failed, current, want):
    assert serving.degraded(observation, invalid, failed, current)[:2] == want


def test_a_scale_up_whose_new_pods_are_starting_is_not_degraded():
    # 1 -> 3: the one that served before still serves; losing it while scaling is degradation.
    assert serving.degraded(seen(ready=1, desired=3), None, False, True, scaling_up_from=1)[:2] == (False, "ScalingUp")
    assert serving.degraded(seen(ready=1, desired=3), None, False, True, scaling_up_from=2)[:2] == (
        True, "ReplicasUnavailable")


def test_a_scale_up_counts_as_one_while_its_pods_may_still_start():
    state, _ = scaling.next_state({}, 1, scaling.Decision(3, "UtilizationHigh", "KilnUtilizationHigh"), T0)
    later = lambda s: T0 + datetime.timedelta(seconds=s)  # noqa: E731
    assert scaling.scaled_up_from(state, later(30), within=60) == 1
    waiting, _ = scaling.next_state(state, 3, scaling.Decision(3, "WaitingForReplicas", "KilnUtilizationHigh"),
                                    later(31))
    assert scaling.scaled_up_from(waiting, later(32), within=60) == 1  # a hold since does not end it
    assert scaling.scaled_up_from(state, later(61), within=60) is None  # past the startup budget: degraded
    down, _ = scaling.next_state(state, 3, scaling.Decision(2, "UtilizationLow", "KilnUtilizationLow"), later(40))
    assert scaling.scaled_up_from(down, later(41), within=60) is None


def test_progressing():
    building = rollout.Tracks(None)
    assert rollout.progressing("1", [obs("Building")], building, None)[:2] == (True, "Building")
    assert rollout.progressing("1", [obs("Failed")], building, None)[:2] == (False, "BuildFailed")
    track = rollout.Track("stable", (obs("Ready"),), {"spec": {"template": {"spec": {"containers": []}}}}, "h")
    assert rollout.progressing("1", [obs("Ready")], rollout.Tracks(track), None)[:2] == (True, "RollingOut")
    live = {"metadata": {"generation": 1, "annotations": {contract.ANN_APPLIED_HASH: "h"}},
            "spec": {"replicas": 1}, "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}}
    assert rollout.progressing("1", [obs("Ready")], rollout.Tracks(track), live)[:2] == (False, "RolloutComplete")


# ------------------------------------------------------------------------ steps, end to end over Views

async def test_the_story_from_nothing_to_ready_then_idle():
    kube, world, m = FakeKube(), World(), model()
    c = ctx(kube)
    await run(c, m, world)
    [job_key] = [k for k in kube.objects if k[0] == "Job"]
    assert ("Normal", "BuildStarted") in {e[:2] for e in kube.events}
    assert status_written(kube)["phase"] == "Building"
    assert not any(k[0] == "Deployment" for k in kube.objects)  # nothing runs before the engine exists

    world.sync(kube)
    engine = engine_of(m)
    world.jobs[job_key[2]], world.pods[job_key[2]] = finished(kube.objects[job_key], result=result_of(engine))
    await run(c, m, world)
    assert json.loads(kube.objects[("ConfigMap", NS, contract.ENGINE_INDEX)]["data"][engine.index_key])["ok"]
    dep = kube.objects[("Deployment", NS, manifests.runtime_name(NAME))]
    assert dep["spec"]["replicas"] == 2 and ("Service", NS, NAME) in kube.objects
    world.sync(kube)
    ready_deployment(world, kube)
    m["status"] = status_written(kube)
    await run(c, m, world)
    st = status_written(kube)
    assert st["phase"] == "Ready" and st["engineKey"] == engine.key and st["stable"]["readyReplicas"] == 2
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "EngineReady": "True", "Available": "True", "Progressing": "False", "Degraded": "False"}

    before = kube.writes()
    m["status"] = st
    outcome = await run(c, m, world)
    assert kube.writes() == before and outcome.writes == 0  # idle: no API call at all


async def test_a_build_that_quarantined_a_corrupt_entry_posts_a_warning():
    kube, world, m = FakeKube(), World(), model()
    c = ctx(kube)
    await run(c, m, world)
    world.sync(kube)
    [job_key] = [k for k in kube.objects if k[0] == "Job"]
    engine = engine_of(m)
    reason = f"/var/cache/kiln/{NS}/{NAME}/{engine.key}/engine.plan: sha256 00 does not match the manifest's ab"
    result = result_of(engine, quarantined={"path": f"{NS}/{NAME}/.quarantine-{engine.key}-20260102T030405Z",
                                            "reason": reason})
    world.jobs[job_key[2]], world.pods[job_key[2]] = finished(kube.objects[job_key], result=result)
    await run(c, m, world)
    [warning] = [e for e in kube.events if e[1] == "EngineQuarantined"]
    assert warning[0] == "Warning" and reason in warning[2]
    assert f".quarantine-{engine.key}-20260102T030405Z" in warning[2]
    assert "BuildSucceeded" in [e[1] for e in kube.events]
    world.sync(kube)
    m["status"] = status_written(kube)
    await run(c, m, world)  # told once: the next pass reads the engine index, not the Job
    assert [e[1] for e in kube.events].count("EngineQuarantined") == 1


async def test_invalid_spec_builds_nothing_and_keeps_what_serves():
    kube, world = FakeKube(), World()
    with pytest.raises(kopf.PermanentError):
        await reconcile.reconcile(ctx(kube), model(model={"uri": "file:///m.onnx"}), world.views())
    st = status_written(kube)
    assert st["phase"] == "Failed" and not any(k[0] == "Job" for k in kube.objects)
    assert [e[1] for e in kube.events] == ["InvalidSpec"]


async def test_events_of_what_was_done_survive_a_later_error():
    # The Job is created, then writing status fails: the BuildStarted Event is still posted.
    kube, world = FakeKube(fail=("PATCH", "InferenceModel")), World()
    with pytest.raises(ApiError):
        await reconcile.reconcile(ctx(kube), model(), world.views())
    assert any(k[0] == "Job" for k in kube.objects)
    assert [e[1] for e in kube.events] == ["BuildStarted"]


async def test_events_survive_a_job_still_terminating_on_another_target():
    # Two targets: one Job is created, the other's namesake is still being deleted.
    kube, world = FakeKube(), World()
    m = model(engine={"targets": ["H100", "A100"]})
    refs = plan_engines(specmod.apply_defaults(m["spec"]), CONFIG)
    world.jobs[refs[1].job_name] = {"metadata": {"name": refs[1].job_name, "uid": "old",
                                                 "deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {}}
    with pytest.raises(kopf.TemporaryError) as raised:
        await reconcile.reconcile(ctx(kube), m, world.views())
    assert raised.value.delay == CONFIG.retry_seconds
    assert [e[1] for e in kube.events] == ["BuildStarted"]
    assert ("Job", NS, refs[0].job_name) in kube.objects


async def test_failed_build_is_reported_once_and_not_retried_in_a_loop():
    kube, world, m = FakeKube(), World(), model()
    c = ctx(kube)
    await run(c, m, world)
    world.sync(kube)
    [name] = list(world.jobs)
    fail = {"ok": False, "reason": "DigestMismatch", "message": "sha256 differs"}
    world.jobs[name], world.pods[name] = finished(world.jobs[name], ok=False, result=fail)
    await run(c, m, world)
    await run(c, m, world)
    assert status_written(kube)["phase"] == "Failed"
    assert [e[1] for e in kube.events].count("BuildFailed") == 1
    assert kube.calls["DELETE"] == 0


async def test_an_obsolete_build_is_deleted_and_its_late_result_never_recorded():
    kube, world, m = FakeKube(), World(), model()
    c = ctx(kube)
    await run(c, m, world)
    world.sync(kube)
    [old_name] = list(world.jobs)
    old_engine = engine_of(m)
    m2 = model(generation=2, model={"version": "2"})
    # The old build finishes just as the spec changes: the watch shows it Complete.
    world.jobs[old_name], world.pods[old_name] = finished(world.jobs[old_name], result=result_of(old_engine))
    await run(c, m2, world)
    assert ("Job", NS, old_name) not in kube.objects
    assert ("Job", NS, engine_of(m2).job_name) in kube.objects
    assert ("ConfigMap", NS, contract.ENGINE_INDEX) not in kube.objects  # the late result is not recorded
    assert "BuildCancelled" in [e[1] for e in kube.events]
    deletes = kube.calls["DELETE"]
    await run(c, m2, world)  # the index still shows the deleted Job: not deleted twice
    assert kube.calls["DELETE"] == deletes


async def test_a_shared_build_another_model_needs_is_kept():
    kube, world, m = FakeKube(), World(), model()
    c = ctx(kube)
    await run(c, m, world)
    world.sync(kube)
    [name] = list(world.jobs)
    world.needing[name] = {NAME, "other-model"}
    await run(c, model(generation=2, model={"version": "2"}), world)
    assert ("Job", NS, name) in kube.objects


class Wakes:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, ns, name, uid, seconds) -> None:
        self.delays.append(seconds)


def condition(st, type_):
    return next(c for c in st["conditions"] if c["type"] == type_)


async def test_a_refused_write_is_a_condition_and_one_warning_and_is_retried_with_a_backoff():
    message = 'Service "resnet" is invalid: spec.ports[0].port: Invalid value: 0'
    kube, world, m = FakeKube(refuse=("POST", "Service", 422, message)), World(), model()
    engine = engine_of(m)
    world.index = {engine.index_key: json.dumps(result_of(engine))}
    c = ctx(kube)
    c.wake = wakes = Wakes()
    for _ in range(3):
        await run(c, m, world)  # no exception: the refusal is status
        world.sync(kube)
        m["status"] = status_written(kube)
    st = status_written(kube)
    said = f"the API server refused to create Service {NS}/{NAME} (422 Invalid): {message}; retrying"
    assert st["phase"] == "Degraded"
    assert (condition(st, "Degraded")["status"], condition(st, "Degraded")["reason"],
            condition(st, "Degraded")["message"]) == ("True", "ApiRefused", said)
    assert ("Deployment", NS, manifests.runtime_name(NAME)) in kube.objects  # what the step did before stays done
    assert [e for e in kube.events if e[0] == "Warning"] == [("Warning", "ApiRefused", said)]  # once, not per try
    assert wakes.delays == [2.0, 4.0, 8.0]  # retry_seconds, doubling

    kube.refuse = None  # someone fixed it (a quota, a policy)
    await run(c, m, world)
    st = status_written(kube)
    assert ("Service", NS, NAME) in kube.objects and condition(st, "Degraded")["reason"] != "ApiRefused"
    assert c.refusals == {}


async def test_a_refused_build_job_says_so_on_engine_ready_and_later_steps_keep_their_status():
    message = 'jobs.batch "x" is forbidden: exceeded quota: jobs, requested: count/jobs.batch=1'
    kube, world = FakeKube(refuse=("POST", "Job", 403, message)), World()
    previous = {"replicas": 2, "readyReplicas": 2, "selector": "kiln.dev/model=resnet", "engineKey": "old"}
    m = model(status=previous)
    c = ctx(kube)
    c.wake = Wakes()
    await run(c, m, world)
    st = status_written(kube)
    engine = engine_of(m)
    assert (condition(st, "EngineReady")["status"], condition(st, "EngineReady")["reason"]) == ("False", "ApiRefused")
    assert f"refused to create Job {NS}/{engine.job_name} (403 Forbidden): {message}" in condition(st, "EngineReady")["message"]
    assert condition(st, "Degraded")["reason"] == "ApiRefused" and st["phase"] == "Degraded"
    assert {k: st[k] for k in previous} == previous  # steps that did not run keep what they own
    assert [e[:2] for e in kube.events] == [("Warning", "ApiRefused")]


async def test_an_error_that_is_no_refusal_still_raises():
    kube, world = FakeKube(fail=("POST", "Job")), World()
    with pytest.raises(ApiError):
        await reconcile.reconcile(ctx(kube), model(), world.views())


async def ready_world(**spec):
    kube, world, m = FakeKube(), World(), model(**spec)
    engine = engine_of(m)
    world.index = {engine.index_key: json.dumps(result_of(engine))}
    c = ctx(kube)
    await run(c, m, world)
    world.sync(kube)
    ready_deployment(world, kube)
    m["status"] = status_written(kube)
    await run(c, m, world)
    return kube, world, m, c


async def test_drift_in_the_pod_template_is_restored_and_others_fields_stay():
    kube, world, m, c = await ready_world(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 5})
    name = manifests.runtime_name(NAME)
    dep = kube.objects[("Deployment", NS, name)]
    want = copy.deepcopy(dep["spec"]["template"]["spec"]["containers"])
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "someone-else:1"
    dep["metadata"]["annotations"]["team.example/owner"] = "ml"
    world.sync(kube)
    await run(c, m, world)
    dep = kube.objects[("Deployment", NS, name)]
    assert dep["spec"]["template"]["spec"]["containers"] == want
    assert dep["metadata"]["annotations"]["team.example/owner"] == "ml"
    assert "DriftRestored" in [e[1] for e in kube.events]


async def test_a_new_version_is_a_rollout_not_drift():
    # Seen on the real cluster: the live template differs from the *new* manifest because
    # Kiln has not applied it yet; drift is a difference from what Kiln last applied.
    kube, world, m, c = await ready_world()
    m2 = model(generation=2, model={"version": "2"})
    m2["status"] = m["status"]
    world.index[engine_of(m2).index_key] = json.dumps(result_of(engine_of(m2)))
    await run(c, m2, world)
    reasons = [e[1] for e in kube.events]
    assert "Deploying" in reasons and "DriftRestored" not in reasons


async def test_replicas_under_an_autoscaler_are_not_drift():
    kube, world, m, c = await ready_world(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 5})
    m["spec"]["runtime"]["replicas"] = 4  # the scale subresource was written
    before = kube.calls["PATCH"]
    await run(c, m, world)
    dep = kube.objects[("Deployment", NS, manifests.runtime_name(NAME))]
    assert dep["spec"]["replicas"] == 4
    assert kube.calls["PATCH"] - before == 2  # replicas alone, then status (Deploying: the pods scale)
    assert "DriftRestored" not in [e[1] for e in kube.events]


async def test_a_drift_a_patch_cannot_undo_is_not_fought_in_a_loop():
    kube, world, m, c = await ready_world()
    name = manifests.runtime_name(NAME)
    world.deployments[name] = copy.deepcopy(world.deployments[name])
    world.deployments[name]["spec"]["template"]["spec"]["containers"][0]["image"] = "webhook-rewrote:1"
    original_patch = kube.patch

    async def webhook(kind, namespace, obj_name, patch, subresource=None):  # a mutating webhook
        out = await original_patch(kind, namespace, obj_name, patch, subresource)
        if kind == "Deployment":
            out["spec"]["template"]["spec"]["containers"][0]["image"] = "webhook-rewrote:1"
        return out

    kube.patch = webhook
    await run(c, m, world)
    patches = kube.calls["PATCH"]
    await run(c, m, world)
    assert kube.calls["PATCH"] == patches


def runtime_pod(dep: dict, name: str, terminated: dict | None, where: str = "lastState") -> dict:
    """A pod of `dep`'s template as the kubelet reports it; `terminated`: its container's end."""
    container = dep["spec"]["template"]["spec"]["containers"][0]
    status = {"name": "runtime", "ready": False, "restartCount": 1,
              "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    if terminated is not None:
        status[where] = {"terminated": terminated}
    return {"kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": dict(dep["spec"]["selector"]["matchLabels"])},
            "spec": {"containers": [{"name": "runtime", "args": list(container["args"])}]},
            "status": {"phase": "Running", "containerStatuses": [status]}}


WARMUP_MESSAGE = ('WarmupFailed: sample 1 (of 1, spec.runtime.warmup.samples[0]): output "species" differs from the '
                  'expected: max abs difference 2 > tolerance (absolute 0.0001, relative 0.001); at [0]: 0, expected 2; '
                  '1 of 1 value(s) differ')


async def test_pods_whose_warm_up_samples_fail_are_the_models_status_and_one_warning():
    kube, world, m = FakeKube(), World(), model()
    c = ctx(kube)
    await run(c, m, world)
    [job_key] = [k for k in kube.objects if k[0] == "Job"]
    world.sync(kube)
    world.jobs[job_key[2]], world.pods[job_key[2]] = finished(kube.objects[job_key], result=result_of(engine_of(m)))
    await run(c, m, world)
    world.sync(kube)
    dep = kube.objects[("Deployment", NS, manifests.runtime_name(NAME))]
    assert dep["spec"]["template"]["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    dep["status"] = {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 0}
    failed = {"exitCode": 9, "reason": "Error", "message": WARMUP_MESSAGE, "finishedAt": "2026-01-01T00:00:05Z"}
    for i, pod in enumerate([runtime_pod(dep, "a", failed), runtime_pod(dep, "b", None)]):
        kube.objects[("Pod", NS, pod["metadata"]["name"])] = pod
    other = runtime_pod(dep, "older-template", {**failed, "message": "WarmupFailed: of another template"})
    other["spec"]["containers"][0]["args"] = ["serve", "--model-version", "0"]
    kube.objects[("Pod", NS, "older-template")] = other
    world.sync(kube)
    m["status"] = status_written(kube)
    gets = kube.calls["GET"]
    await run(c, m, world)  # pods not Ready, none seen failing by the watch: nothing is listed
    assert kube.calls["GET"] == gets
    c.warmup_failing.add((NS, NAME, manifests.STABLE))  # what the pod watch marks (handlers.on_runtime_pod_event)
    events_before = len(kube.events)
    await run(c, m, world)
    st = status_written(kube)
    conditions = {c["type"]: c for c in st["conditions"]}
    why = WARMUP_MESSAGE[len("WarmupFailed: "):]
    assert (conditions["Available"]["status"], conditions["Available"]["reason"]) == ("False", "WarmupFailed")
    assert conditions["Available"]["message"].endswith(f"never become Ready: {why}")
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == ("True", "WarmupFailed")
    assert st["phase"] == "Degraded"
    warnings = [e for e in kube.events[events_before:] if e[1] == "WarmupFailed"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning" and why in warnings[0][2]

    m["status"] = st  # the next pass, nothing new: no second Warning
    events_before = len(kube.events)
    await run(c, m, world)
    assert not [e for e in kube.events[events_before:] if e[1] == "WarmupFailed"]

    # Every pod Ready (the samples were fixed): no pod is listed, nothing is degraded.
    for key in [k for k in kube.objects if k[0] == "Pod"]:
        del kube.objects[key]
    ready_deployment(world, kube)
    gets = kube.calls["GET"]
    m["status"] = status_written(kube)
    await run(c, m, world)
    assert kube.calls["GET"] == gets  # a model whose pods all serve costs no list
    assert {c["type"]: c["reason"] for c in status_written(kube)["conditions"]}["Degraded"] != "WarmupFailed"


# ------------------------------------------------------------------------ requests refused

def refused_signal(state="firing", starts=-120.0, seen=-30.0, value=0.98):
    return signals.Signal(state, T0 + datetime.timedelta(seconds=starts), T0 + datetime.timedelta(seconds=seen),
                          "fp", value)


def with_refused(m, signal):
    m["metadata"].setdefault("annotations", {})[signals.ANN_SIGNALS] = signals.dump({signals.REFUSED: signal})
    return m


def test_requests_refused_is_degraded_and_says_the_share():
    value, reason, message = serving.degraded(seen(), None, False, True, refused=refused_signal())
    assert (value, reason) == (True, "RequestsRefused")
    assert message == ("98% of the model's recent requests were refused (outcome bad_request or refused; "
                       "KilnRequestsRefused firing since 2026-01-02T03:02:05.000Z): the clients' inputs do not fit "
                       "the model, or this version refuses them")
    # What every client sees comes before how the replicas or a rollout stand; a spec that cannot
    # work, or new pods that never become Ready, come first.
    assert serving.degraded(seen(ready=1), None, True, True, rolled_back={"version": "2", "reason": "x"},
                            refused=refused_signal())[1] == "RequestsRefused"
    assert serving.degraded(seen(), "bad", False, True, refused=refused_signal())[1] == "InvalidSpec"
    assert serving.degraded(seen(), None, False, True, warmup_failed="x", refused=refused_signal())[1] == "WarmupFailed"
    # The value is the receiver's client's word: a share that is none is not repeated.
    for nonsense in (None, 1e308, -0.5):
        assert serving.degraded(seen(), None, False, True, refused=refused_signal(value=nonsense))[2].startswith(
            "most of the model's recent requests were refused")


def test_only_an_active_refused_alert_counts():
    ttl = CONFIG.signal_ttl_seconds
    assert serving.requests_refused(with_refused(model(), refused_signal()), T0, ttl) == refused_signal()
    assert serving.requests_refused(with_refused(model(), refused_signal(state="resolved")), T0, ttl) is None
    assert serving.requests_refused(with_refused(model(), refused_signal(seen=-ttl - 1)), T0, ttl) is None  # stale
    assert serving.requests_refused(model(), T0, ttl) is None
    damaged = model()
    damaged["metadata"]["annotations"] = {signals.ANN_SIGNALS: "{not json"}
    assert serving.requests_refused(damaged, T0, ttl) is None


def test_the_autoscaler_does_not_act_on_refused_requests():
    policy = scaling.Policy(min_replicas=0, max_replicas=8, target=0.5, max_step=2, up_cooldown=0,
                            down_cooldown=0, stabilization=0, to_zero_after=0, activator=True)
    assert scaling.decide(policy, 2, 2, {signals.REFUSED: refused_signal()}, {}, T0, 600.0) == scaling.Decision(2, None)


async def test_refused_requests_are_the_models_status_and_one_warning_until_the_alert_resolves():
    kube, world, m, c = await ready_world()
    c.wake = wakes = Wakes()
    writes = {k: n for k, n in kube.calls.items()}
    deployment = copy.deepcopy(kube.objects[("Deployment", NS, manifests.runtime_name(NAME))])
    events = len(kube.events)
    await run(c, with_refused(m, refused_signal()), world)
    st = status_written(kube)
    degraded = condition(st, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RequestsRefused")
    assert degraded["message"].startswith("98% of the model's recent requests were refused")
    assert condition(st, "Available")["status"] == "True" and st["phase"] == "Degraded"
    assert [e for e in kube.events[events:] if e[1] == "RequestsRefused"] == [
        ("Warning", "RequestsRefused", degraded["message"])]
    # A report only: the Deployment, its replicas and the spec are as they were; one status write.
    assert kube.objects[("Deployment", NS, manifests.runtime_name(NAME))] == deployment
    assert kube.calls["PATCH"] - writes.get("PATCH", 0) == 1
    # It goes stale 600 s after the last delivery (30 s ago) unless Alertmanager repeats it: the pass looks then.
    assert wakes.delays == [pytest.approx(600 - 30 + 1)]

    # A repeat with another share: the message follows, no second Warning.
    m["status"] = st
    events = len(kube.events)
    await run(c, with_refused(m, refused_signal(value=0.91, seen=0)), world)
    st = status_written(kube)
    assert condition(st, "Degraded")["message"].startswith("91% of")
    assert [e for e in kube.events[events:] if e[1] in ("RequestsRefused", "Degraded")] == []

    # Resolved: serving as the spec asks again.
    m["status"] = st
    await run(c, with_refused(m, refused_signal(state="resolved", seen=10)), world)
    st = status_written(kube)
    assert (condition(st, "Degraded")["status"], condition(st, "Degraded")["reason"]) == ("False", "AsExpected")
    assert st["phase"] == "Ready"


async def test_a_refused_alert_that_goes_stale_clears_and_a_new_episode_warns_again():
    kube, world, m, c = await ready_world()
    await run(c, with_refused(m, refused_signal(seen=-599)), world)
    m["status"] = status_written(kube)
    assert condition(m["status"], "Degraded")["reason"] == "RequestsRefused"
    c.clock = lambda: T0 + datetime.timedelta(seconds=2)  # no delivery within the TTL: not trusted
    await run(c, m, world)
    m["status"] = status_written(kube)
    assert (condition(m["status"], "Degraded")["status"], m["status"]["phase"]) == ("False", "Ready")
    events = len(kube.events)
    await run(c, with_refused(m, refused_signal(starts=0, seen=1)), world)
    assert [e[1] for e in kube.events[events:] if e[1] == "RequestsRefused"] == ["RequestsRefused"]
