"""The engines step: every engine of the current spec exists in the cache, built once per key.

Owns `EngineReady` and `status.engines`; acts on build Jobs and the engine index
(docs/architecture.md, "Builds"):
- one Job per engine key and target; the model that asks first creates it, others wait on it;
- a succeeded Job's result goes into the namespace's engine index, which says an engine exists;
- a failed Job stays (EngineReady=False/BuildFailed) until a new generation retries it once;
- a Job this model created that no current spec of any model needs is deleted, and what it
  reports later is never read (nothing looks it up by a current key).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from kiln.operator import cachegc, manifests, observations
from kiln.operator import conditions as cond
from kiln.operator.kube import ApiError
from kiln.operator.plan import EngineRef
from kiln.operator.steps import Condition, Event, Owns, Pass, StepResult
from kiln.runtime.api import contract

OWNS = Owns(conditions=("EngineReady",), fields=("engines", "cache"), refused="EngineReady")
OUT_OF_DISK = "OutOfDisk"  # runtime/api/errors.py: the build ran out of space on the cache claim


@dataclasses.dataclass
class EngineObservation:
    engine: EngineRef
    state: str  # Ready | Building | Failed
    result: Mapping[str, Any] | None = None
    reason: str = ""
    message: str = ""
    retry: bool = False  # waiting on something no watch event ends (a Job still terminating)


async def step(p: Pass) -> StepResult:
    if p.invalid is not None:
        condition = (False, "InvalidSpec", p.invalid)
        kept = {k: p.previous[k] for k in ("cache",) if p.previous.get(k)}
        return StepResult(conditions={"EngineReady": condition}, status={"engines": list(p.previous.get("engines") or []), **kept},
                          events=transition_events(p.previous_condition("EngineReady"), condition, []), out=[])
    await _delete_obsolete_jobs(p)
    acted_before = len(p.events)
    observed = [await _observe(p, engine) for engine in p.engines]
    condition = engine_condition(observed)
    events = transition_events(p.previous_condition("EngineReady"), condition, p.events[acted_before:])
    current = {e.key for e in p.engines} | cachegc.engine_keys_of_status(p.previous)
    cache = cachegc.cache_status(p.ns, p.name, p.views.engine_index(p.ns), current, p.ctx.config.cache_claim)
    status = {"engines": status_engines(observed, p.version), **({"cache": cache} if cache else {})}
    return StepResult(conditions={"EngineReady": condition}, status=status,
                      events=events, waiting=any(o.state != "Ready" for o in observed), out=observed,
                      requeue=p.ctx.config.retry_seconds if any(o.retry for o in observed) else None)


# ------------------------------------------------------------------------ pure

def engine_condition(observed: list[EngineObservation]) -> Condition:
    failed = [o for o in observed if o.state == "Failed"]
    missing = [o for o in observed if o.state != "Ready"]
    if failed:
        # Out of space on the cache claim is the user's to fix (a bigger claim, cache GC's
        # settings), not the model's: its own reason.
        full = all(o.reason == OUT_OF_DISK for o in failed)
        hint = ("; the engine cache claim is out of space: give it more, or let cache GC remove more "
                "(the chart's cache.gc.retention and cache.gc.graceSeconds)" if full else "")
        return (False, OUT_OF_DISK if full else "BuildFailed", "; ".join(
            f"engine {o.engine.key} for {o.engine.architecture} (Job {o.engine.job_name}): {o.message}"
            for o in failed) + hint)
    if missing:
        return (False, "Building", "building " + ", ".join(
            f"engine {o.engine.key} for {o.engine.architecture} (Job {o.engine.job_name})" for o in missing))
    hits = sum(1 for o in observed if (o.result or {}).get("cacheHit"))
    return (True, "EnginesReady", f"{len(observed)} engine(s) in the cache ({hits} cache hit(s)): "
            + ", ".join(f"{o.engine.architecture}={o.engine.key}" for o in observed))


def transition_events(old: Mapping[str, Any], new: Condition, acted: list[Event]) -> list[Event]:
    """Events of an EngineReady change that no action of this pass already told."""
    value, reason, message = new
    acted_reasons = {r for _, r, _ in acted}
    if reason == "InvalidSpec":
        return [] if old.get("reason") == "InvalidSpec" else [("Warning", "InvalidSpec", message)]
    if reason in ("BuildFailed", OUT_OF_DISK):
        changed = old.get("reason") != reason or old.get("message") != message
        return [("Warning", reason, message)] if changed else []
    if value and old.get("status") != cond.TRUE and "BuildSucceeded" not in acted_reasons:
        return [("Normal", "EnginesReady", message)]  # built for another model, or earlier
    if reason == "Building" and old.get("reason") != "Building" and "BuildStarted" not in acted_reasons:
        return [("Normal", "BuildStarted", f"waiting for the shared build: {message}")]
    return []


def status_engines(observed: list[EngineObservation], version: str) -> list[dict[str, Any]]:
    out = []
    for o in observed:
        entry: dict[str, Any] = {"key": o.engine.key, "target": o.engine.target,
                                 "architecture": o.engine.architecture, "version": version}
        r = o.result or {}
        for field in ("path", "sha256", "sizeBytes", "buildSeconds", "cacheHit"):
            if r.get(field) is not None:
                entry[field] = r[field]
        out.append(entry)
    return out


def obsolete_jobs(p: Pass) -> list[Mapping[str, Any]]:
    """Jobs this model created that neither its current spec nor any other model's needs."""
    needed = {e.job_name for e in p.engines}
    found = []
    for job in p.views.owned_jobs(p.ns, p.uid):
        meta = job["metadata"]
        if meta["name"] in needed or meta.get("deletionTimestamp"):
            continue
        if p.ctx.replaced_jobs.get((p.ns, meta["name"])) == meta.get("uid"):
            continue  # deleted already; the index has not seen it go yet
        if p.views.models_needing(p.ns, meta["name"]) - {p.name}:
            continue  # another model's spec still needs this key
        found.append(job)
    return found


def _owned_by(pod: Mapping[str, Any], job: Mapping[str, Any]) -> bool:
    """A pod of this very Job (a deleted namesake's pods may linger until garbage collection)."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or ()
    uid = job["metadata"].get("uid")
    return not refs or not uid or any(r.get("uid") == uid for r in refs)


def _is_current(result: Mapping[str, Any] | None, engine: EngineRef) -> bool:
    return bool(result and result.get("ok") and result.get("key", engine.key) == engine.key)


# ------------------------------------------------------------------------ acting

async def _delete_obsolete_jobs(p: Pass) -> None:
    for job in obsolete_jobs(p):
        meta = job["metadata"]
        if await p.ctx.kube.delete("Job", p.ns, meta["name"], uid=meta.get("uid")):
            p.ctx.replaced_jobs[(p.ns, meta["name"])] = meta.get("uid", "")
            key = (meta.get("labels") or {}).get(contract.LABEL_KEY, "")
            p.record("Normal", "BuildCancelled", f"deleted Job {meta['name']}: no current spec needs engine {key}")


async def _observe(p: Pass, engine: EngineRef) -> EngineObservation:
    """One engine: in the index, or its Job's state (creating the Job when there is none)."""
    indexed = p.views.engine_index(p.ns).get(engine.index_key)
    forgotten = (p.ns, engine.index_key) in p.ctx.gc_forgotten
    if forgotten and indexed is None:
        p.ctx.gc_forgotten.discard((p.ns, engine.index_key))  # the view caught up with cache GC
    result = p.ctx.results.get((p.ns, engine.index_key)) or (
        None if forgotten else contract.parse_result(indexed))
    if _is_current(result, engine):
        return EngineObservation(engine, "Ready", result)
    job = p.views.job(p.ns, engine.job_name)
    if job is not None and p.ctx.replaced_jobs.get((p.ns, engine.job_name)) == job["metadata"].get("uid"):
        job = None  # the index still shows the Job we deleted; ours is on its way
    if job is None:
        job, created = await p.ctx.kube.create(manifests.build_job(p.model, p.spec, engine, p.ctx.config))
        if created:
            p.record("Normal", "BuildStarted",
                     f"building engine {engine.key} for {engine.architecture} in Job {engine.job_name}")
        if observations.job_state(job).phase == "Active":
            return EngineObservation(engine, "Building")
    if job["metadata"].get("deletionTimestamp"):
        return EngineObservation(engine, "Building", reason="Replacing", retry=True,
                                 message=f"Job {engine.job_name} is being deleted; waiting to create it again")
    state = observations.job_state(job)
    pods = [pod for pod in p.views.pods(p.ns, engine.job_name) if _owned_by(pod, job)]
    if state.phase == "Succeeded":
        return await _succeeded(p, engine, job, pods)
    if state.phase == "Failed":
        return await _failed(p, engine, job, pods, state)
    return EngineObservation(engine, "Building")


async def _succeeded(p: Pass, engine: EngineRef, job: Mapping[str, Any],
                     pods: list[Mapping[str, Any]]) -> EngineObservation:
    result = observations.termination_result(pods)
    if result is None:
        return EngineObservation(engine, "Building", reason="Finishing",
                                 message="waiting for the build pod's termination message")
    if not _is_current(result, engine):
        state = observations.JobState("Failed", "KeyMismatch" if result.get("ok") else "")
        return await _failed(p, engine, job, pods, state)
    await record_result(p, engine, result)
    quarantined = result.get("quarantined")
    if isinstance(quarantined, Mapping):
        p.record("Warning", "EngineQuarantined",
                 f"engine {engine.key} for {engine.architecture}: the cached entry was corrupt, moved aside "
                 f"to {quarantined.get('path')} and built again: {quarantined.get('reason')}")
    hit = " (cache hit)" if result.get("cacheHit") else f" in {result.get('buildSeconds', 0):.0f} s"
    p.record("Normal", "BuildSucceeded", f"engine {engine.key} for {engine.architecture} is in the cache{hit}")
    return EngineObservation(engine, "Ready", result)


async def _failed(p: Pass, engine: EngineRef, job: Mapping[str, Any], pods: list[Mapping[str, Any]],
                  state: observations.JobState) -> EngineObservation:
    if _retry_now(p, job):
        return await _recreate(p, engine, job)
    if pods and observations.termination_state(pods) is None:
        # The pod's final state has not reached us yet (it travels on another watch
        # stream than the Job's); its termination message is the useful part.
        return EngineObservation(engine, "Building", reason="Finishing", message="waiting for the build pod's final state")
    reason, message = observations.failure_message(state, pods)
    return EngineObservation(engine, "Failed", reason=reason, message=message)


def _retry_now(p: Pass, job: Mapping[str, Any]) -> bool:
    """Once per generation: the Job was created for an older generation of this model, or this
    model recorded the failure at an older generation."""
    ann = job["metadata"].get("annotations") or {}
    created_for_older = (ann.get(contract.ANN_REQUESTED_BY) == p.name
                         and int(ann.get(contract.ANN_GENERATION) or p.generation) < p.generation)
    seen = p.previous_condition("EngineReady")
    seen_earlier = seen.get("reason") in ("BuildFailed", OUT_OF_DISK) and int(seen.get("observedGeneration") or 0) < p.generation
    return created_for_older or seen_earlier


async def _recreate(p: Pass, engine: EngineRef, job: Mapping[str, Any]) -> EngineObservation:
    kube, uid = p.ctx.kube, job["metadata"].get("uid")
    if await kube.delete("Job", p.ns, engine.job_name, uid=uid):
        p.ctx.replaced_jobs[(p.ns, engine.job_name)] = uid or ""
    waiting = EngineObservation(engine, "Building", reason="Replacing", retry=True,
                                message=f"Job {engine.job_name} is still being deleted")
    try:
        new_job, _ = await kube.create(manifests.build_job(p.model, p.spec, engine, p.ctx.config))
    except ApiError as e:
        if e.refused:
            raise
        return waiting
    if new_job["metadata"].get("uid") == uid:
        return waiting
    p.record("Normal", "BuildStarted", f"retrying engine {engine.key} for {engine.architecture} after a spec change "
                                       f"(generation {p.generation}) in Job {engine.job_name}")
    return EngineObservation(engine, "Building")


async def record_result(p: Pass, engine: EngineRef, result: Mapping[str, Any]) -> None:
    """Add the build result to the namespace's engine index (a merge patch adds one key),
    with what cache GC reads: when it was recorded, and on which claim."""
    result = {**result, "recordedAt": p.ctx.clock().isoformat(timespec="seconds").replace("+00:00", "Z"),
              "claim": (p.spec.get("cache") or {}).get("claimName") or p.ctx.config.cache_claim}
    kube, value = p.ctx.kube, json.dumps(result, sort_keys=True, separators=(",", ":"))
    try:
        await kube.patch("ConfigMap", p.ns, contract.ENGINE_INDEX, {"data": {engine.index_key: value}})
    except ApiError as e:
        if e.status != 404:
            raise
        _, created = await kube.create(manifests.engine_index_configmap(p.ns, {engine.index_key: value}))
        if not created:
            await kube.patch("ConfigMap", p.ns, contract.ENGINE_INDEX, {"data": {engine.index_key: value}})
    p.ctx.results[(p.ns, engine.index_key)] = result
    p.ctx.gc_forgotten.discard((p.ns, engine.index_key))
