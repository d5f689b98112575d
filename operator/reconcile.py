"""Level-triggered reconcile of one InferenceModel: observe -> desired -> diff -> act.

Every entry point (create, update, resume, the resync timer, and the watch events of the
Jobs, build pods and Deployments Kiln owns) calls `reconcile()`. It reads the observed
state from kopf's in-memory indexes (no API reads), acts only where the desired state
differs, and writes status and Events only when they change - so an idle operator
makes almost no API calls.

Build policy (docs/architecture.md has the full story):
- One Job per engine key and target, named `kiln-build-<key>-<target>`. The model that
  asks first creates it and owns it; any other model with the same key finds it by name
  (a 409 on create is success) and waits on it too.
- A succeeded Job's pod termination message is the build result; it is recorded in the
  ConfigMap `kiln-engine-index` (data key `<key>.<target>`), which outlives the Job (TTL)
  and the operator. The index, not the Job, says an engine exists.
- A failed Job stays: the model gets EngineReady=False/BuildFailed and a Warning Event,
  and nothing is retried until the spec changes (a new generation). Then the failed Job
  is deleted and created again, once per generation.
- The runtime Deployment changes only when every engine of the current key set exists:
  a key change builds first, then rolls the Deployment to the new engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any, Callable, Mapping

import kopf

from kiln.operator import builders as b
from kiln.operator import conditions as cond
from kiln.operator.config import OperatorConfig
from kiln.operator.kube import ApiError, Kube
from kiln.runtime import spec as specmod

logger = logging.getLogger("kiln.operator.reconcile")


@dataclasses.dataclass
class Views:
    """Read access to what the operator watches (kopf indexes in production, dicts in tests)."""

    job: Callable[[str, str], Mapping[str, Any] | None]
    pods: Callable[[str, str], list[Mapping[str, Any]]]
    deployment: Callable[[str, str], Mapping[str, Any] | None]
    service: Callable[[str, str], Mapping[str, Any] | None]
    engine_index: Callable[[str], Mapping[str, str]]


@dataclasses.dataclass
class Context:
    """What lives as long as the operator process: configuration, client, clock, memory."""

    config: OperatorConfig
    kube: Kube
    clock: cond.Clock = cond.utcnow
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    results: dict[tuple[str, str], dict[str, Any]] = dataclasses.field(default_factory=dict)
    last_status: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    replaced_jobs: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # -> uid of the deleted Job

    plans: dict[str, tuple[str, dict[str, Any], list[str], list[b.EngineRef]]] = dataclasses.field(default_factory=dict)

    def plan(self, uid: str, raw_spec: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[b.EngineRef]]:
        """Defaulted spec, validation problems, engines - computed once per distinct spec
        (validating against the CRD schema and its CEL rules costs milliseconds)."""
        text = json.dumps(raw_spec, sort_keys=True, separators=(",", ":"))
        cached = self.plans.get(uid)
        if cached is not None and cached[0] == text:
            return cached[1], cached[2], cached[3]
        spec = specmod.apply_defaults(dict(raw_spec))
        problems = specmod.validate_for_cluster(spec)
        engines: list[b.EngineRef] = []
        if not problems:
            try:
                engines = b.plan_engines(spec, self.config)
            except ValueError as e:
                problems = [str(e)]
        self.plans[uid] = (text, spec, problems, engines)
        return spec, problems, engines

    def lock(self, uid: str) -> asyncio.Lock:
        return self.locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        self.locks.pop(uid, None)
        self.last_status.pop(uid, None)
        self.plans.pop(uid, None)


@dataclasses.dataclass
class Outcome:
    phase: str
    waiting: bool  # engines are being built or pods are starting
    writes: int  # API writes this pass made


async def reconcile(ctx: Context, model: Mapping[str, Any], views: Views) -> Outcome:
    """Bring one InferenceModel's world in line with its spec. Safe to call any time."""
    meta = model["metadata"]
    if meta.get("deletionTimestamp"):
        return Outcome("Terminating", False, 0)
    async with ctx.lock(meta["uid"]):
        return await _reconcile(ctx, model, views)


async def _reconcile(ctx: Context, model: Mapping[str, Any], views: Views) -> Outcome:
    kube, config = ctx.kube, ctx.config
    meta = model["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    generation = int(meta.get("generation") or 1)
    writes_before = sum(kube.calls[m] for m in ("POST", "PATCH", "DELETE"))
    events: list[tuple[str, str, str]] = []  # (type, reason, message)
    previous = ctx.last_status.get(uid) or dict(model.get("status") or {})
    model_with_prev = {**model, "status": previous}

    # ---------------------------------------------------------------- desired: the spec
    spec, problems, engines = ctx.plan(uid, model.get("spec") or {})
    if problems:
        message = "; ".join(problems)
        dep = views.deployment(ns, b.runtime_name(name))
        status = b.compute_status(model_with_prev, spec, [], b.observe_deployment(dep, None), ctx.clock,
                                  invalid=message)
        if (cond.get_condition(previous.get("conditions"), "EngineReady") or {}).get("reason") != "InvalidSpec":
            events.append(("Warning", "InvalidSpec", message))
        await _write_status(ctx, model, previous, status, events)
        raise kopf.PermanentError(f"the spec cannot work: {message}")

    # ---------------------------------------------------------------- engines: observe and act
    index = views.engine_index(ns)
    observed: list[b.EngineObservation] = []
    prev_engine_cond = cond.get_condition(previous.get("conditions"), "EngineReady") or {}
    failure_seen_earlier = (prev_engine_cond.get("reason") == "BuildFailed"
                            and int(prev_engine_cond.get("observedGeneration") or 0) < generation)
    created_any = False
    for engine in engines:
        result = ctx.results.get((ns, engine.index_key)) or _parse_result(index.get(engine.index_key))
        if result and result.get("ok") and result.get("key", engine.key) == engine.key:
            observed.append(b.EngineObservation(engine, "Ready", result))
            continue
        job = views.job(ns, engine.job_name)
        if job is not None and ctx.replaced_jobs.get((ns, engine.job_name)) == job["metadata"].get("uid"):
            job = None  # the index still shows the Job we deleted; ours is on its way
        if job is None:
            job, created = await kube.create(b.build_job(model, spec, engine, config))
            if created:
                created_any = True
                events.append(("Normal", "BuildStarted",
                               f"building engine {engine.key} for {engine.architecture} in Job {engine.job_name}"))
            observed.append(b.EngineObservation(engine, "Building"))
            if b.job_state(job).phase == "Active":
                continue
        if job["metadata"].get("deletionTimestamp"):
            raise kopf.TemporaryError(f"Job {engine.job_name} is being deleted; waiting to create it again",
                                      delay=config.retry_seconds)
        state = b.job_state(job)
        pods = [p for p in views.pods(ns, engine.job_name) if _owned_by(p, job)]
        if state.phase == "Succeeded":
            result = b.termination_result(pods)
            if result is None:
                _replace(observed, b.EngineObservation(engine, "Building", reason="Finishing",
                                                       message="waiting for the build pod's termination message"))
                continue
            if result.get("ok") and result.get("key", engine.key) == engine.key:
                await _record_result(ctx, ns, engine, result)
                hit = " (cache hit)" if result.get("cacheHit") else f" in {result.get('buildSeconds', 0):.0f} s"
                events.append(("Normal", "BuildSucceeded",
                               f"engine {engine.key} for {engine.architecture} is in the cache{hit}"))
                _replace(observed, b.EngineObservation(engine, "Ready", result))
                continue
            state = b.JobState("Failed", "KeyMismatch" if result.get("ok") else state.reason)
        if state.phase == "Failed":
            ann = job["metadata"].get("annotations") or {}
            created_for_older = (ann.get(b.ANN_REQUESTED_BY) == name
                                 and int(ann.get(b.ANN_GENERATION) or generation) < generation)
            if created_for_older or failure_seen_earlier:
                deleted = await kube.delete("Job", ns, engine.job_name, uid=job["metadata"].get("uid"))
                if deleted:
                    ctx.replaced_jobs[(ns, engine.job_name)] = job["metadata"].get("uid", "")
                try:
                    new_job, created = await kube.create(b.build_job(model, spec, engine, config))
                except ApiError as e:
                    raise kopf.TemporaryError(f"could not recreate Job {engine.job_name}: {e}",
                                              delay=config.retry_seconds)
                if new_job["metadata"].get("uid") == job["metadata"].get("uid"):
                    raise kopf.TemporaryError(f"Job {engine.job_name} is still being deleted",
                                              delay=config.retry_seconds)
                created_any = True
                events.append(("Normal", "BuildStarted",
                               f"retrying engine {engine.key} for {engine.architecture} after a spec change "
                               f"(generation {generation}) in Job {engine.job_name}"))
                _replace(observed, b.EngineObservation(engine, "Building"))
                continue
            if pods and b.termination_state(pods) is None:
                # The pod's final state has not reached us yet (it travels on another watch
                # stream than the Job's); its termination message is the useful part.
                _replace(observed, b.EngineObservation(engine, "Building", reason="Finishing",
                                                       message="waiting for the build pod's final state"))
                continue
            reason, message = b.failure_message(state, pods)
            _replace(observed, b.EngineObservation(engine, "Failed", reason=reason, message=message))
            continue
        _replace(observed, b.EngineObservation(engine, "Building"))

    # ---------------------------------------------------------------- runtime: only with every engine
    all_ready = all(o.state == "Ready" for o in observed)
    dep = views.deployment(ns, b.runtime_name(name))
    desired_hash = None
    if all_ready:
        results = {o.engine.index_key: dict(o.result or {}) for o in observed}
        autoscaled = bool((spec.get("autoscaling") or {}).get("enabled"))
        applied = b.runtime_deployment(model, spec, engines, results, config, include_replicas=not autoscaled)
        desired_hash = b.manifest_hash(applied)
        if dep is None:
            full = b.runtime_deployment(model, spec, engines, results, config, include_replicas=True)
            body = b.with_applied(applied)
            body["spec"]["replicas"] = full["spec"]["replicas"]
            dep, created = await kube.create(body)
            if created:
                events.append(("Normal", "Deploying", f"created Deployment {b.runtime_name(name)} "
                               f"serving engine {engines[0].key}"))
        if (dep["metadata"].get("annotations") or {}).get(b.ANN_APPLIED_HASH) != desired_hash:
            old_key = ((dep["spec"].get("template") or {}).get("metadata") or {}).get("labels", {}).get(b.LABEL_ENGINE_KEY)
            try:
                last = json.loads((dep["metadata"].get("annotations") or {}).get(b.ANN_APPLIED) or "null")
            except ValueError:
                last = None
            new = b.with_applied(applied)
            patch = b.merge_patch_between(last, new) if isinstance(last, dict) else new
            if isinstance(last, dict):  # the annotations themselves always go in whole
                patch.setdefault("metadata", {})["annotations"] = {b.ANN_APPLIED: new["metadata"]["annotations"][b.ANN_APPLIED],
                                                                   b.ANN_APPLIED_HASH: desired_hash}
            dep = await kube.patch("Deployment", ns, b.runtime_name(name), patch)
            what = (f"rolling Deployment {b.runtime_name(name)} from engine {old_key} to {engines[0].key}"
                    if old_key and old_key != engines[0].key else f"updated Deployment {b.runtime_name(name)}")
            events.append(("Normal", "Deploying", what))
        if autoscaled and int(dep["spec"].get("replicas", 1)) != b.desired_replicas(spec):
            # The template patch leaves replicas alone; the count follows spec.runtime.replicas,
            # which the autoscaler (or an HPA/KEDA through the scale subresource) owns.
            dep = await kube.patch("Deployment", ns, b.runtime_name(name),
                                   {"spec": {"replicas": b.desired_replicas(spec)}})
        svc = views.service(ns, name)
        desired_svc = b.runtime_service(model, spec)
        svc_hash = b.manifest_hash(desired_svc)
        if svc is None:
            svc, _ = await kube.create(b.with_applied(desired_svc))
        if (svc["metadata"].get("annotations") or {}).get(b.ANN_APPLIED_HASH) != svc_hash:
            await kube.patch("Service", ns, name, b.with_applied(desired_svc))

    # ---------------------------------------------------------------- status and events
    status = b.compute_status(model_with_prev, spec, observed, b.observe_deployment(dep, desired_hash), ctx.clock)
    new_cond = {c["type"]: c for c in status["conditions"]}
    old_cond = {c["type"]: c for c in previous.get("conditions") or ()}
    er_new, er_old = new_cond["EngineReady"], old_cond.get("EngineReady") or {}
    if er_new["reason"] == "BuildFailed" and (er_old.get("reason") != "BuildFailed"
                                              or er_old.get("message") != er_new["message"]):
        events.append(("Warning", "BuildFailed", er_new["message"]))
    if (er_new["status"] == cond.TRUE and er_old.get("status") != cond.TRUE
            and not any(reason == "BuildSucceeded" for _, reason, _ in events)):
        events.append(("Normal", "EnginesReady", er_new["message"]))  # built for another model, or earlier
    if er_new["reason"] == "Building" and er_old.get("reason") != "Building" and not created_any:
        events.append(("Normal", "BuildStarted", f"waiting for the shared build: {er_new['message']}"))
    for c in cond.transitions(previous.get("conditions"), status["conditions"]):
        if not old_cond.get(c["type"]) and c["status"] != cond.TRUE:
            continue  # a condition's first, negative value is no news
        if c["type"] == "Available":
            events.append(("Normal", "Available", c["message"]) if c["status"] == cond.TRUE
                          else ("Warning", "Unavailable", c["message"]))
        elif c["type"] == "Degraded" and c["status"] == cond.TRUE:
            events.append(("Warning", "Degraded", c["message"]))
    if status["phase"] == "Ready" and previous.get("phase") != "Ready":
        events.append(("Normal", "Ready", f"version {spec['model'].get('version', '')} is serving "
                                          f"with engine {status.get('engineKey', '')}"))
    await _write_status(ctx, model, previous, status, events)
    writes = sum(kube.calls[m] for m in ("POST", "PATCH", "DELETE")) - writes_before
    waiting = not all_ready or status["phase"] == "Deploying"
    return Outcome(status["phase"], waiting, writes)


def _replace(observed: list[b.EngineObservation], new: b.EngineObservation) -> None:
    for i, o in enumerate(observed):
        if o.engine == new.engine:
            observed[i] = new
            return
    observed.append(new)


def _owned_by(pod: Mapping[str, Any], job: Mapping[str, Any]) -> bool:
    """A pod of this very Job (a deleted namesake's pods may linger until garbage collection)."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or ()
    uid = job["metadata"].get("uid")
    return not refs or not uid or any(r.get("uid") == uid for r in refs)


def _parse_result(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _record_result(ctx: Context, ns: str, engine: b.EngineRef, result: Mapping[str, Any]) -> None:
    """Add the build result to the namespace's engine index (a merge patch adds one key)."""
    value = json.dumps(dict(result), sort_keys=True, separators=(",", ":"))
    try:
        await ctx.kube.patch("ConfigMap", ns, b.ENGINE_INDEX, {"data": {engine.index_key: value}})
    except ApiError as e:
        if e.status != 404:
            raise
        _, created = await ctx.kube.create(b.engine_index_configmap(ns, {engine.index_key: value}))
        if not created:
            await ctx.kube.patch("ConfigMap", ns, b.ENGINE_INDEX, {"data": {engine.index_key: value}})
    ctx.results[(ns, engine.index_key)] = dict(result)


# The status fields this reconciler owns; others (scaling history, canary) are left alone.
OWNED_STATUS = ("phase", "observedGeneration", "conditions", "engineKey", "engines", "stable", "replicas",
                "readyReplicas", "selector")


async def _write_status(ctx: Context, model: Mapping[str, Any], previous: Mapping[str, Any],
                        status: dict[str, Any], events: list[tuple[str, str, str]]) -> None:
    meta = model["metadata"]
    server = {k: v for k, v in (model.get("status") or {}).items() if k in OWNED_STATUS}
    if ctx.last_status.get(meta["uid"]) != status and server != status:
        patch: dict[str, Any] = dict(status)
        for k in OWNED_STATUS:
            if k not in status and (k in server or k in previous):
                patch[k] = None
        try:
            await ctx.kube.patch("InferenceModel", meta["namespace"], meta["name"], {"status": patch},
                                 subresource="status")
        except ApiError as e:
            if e.status == 404:
                return  # deleted meanwhile
            raise
    ctx.last_status[meta["uid"]] = status
    involved = {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": meta}
    for type_, reason, message in events:
        logger.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s/%s: %s: %s",
                   meta["namespace"], meta["name"], reason, message)
        await ctx.kube.event(involved, type_, reason, message, now=ctx.clock())
