"""The serving step: each track's Deployment and the Service are what the rollout step decided.

Owns `Available`, `Degraded`, `status.replicas`, `status.readyReplicas` and
`status.selector`; acts on the runtime Deployment and the Service (and, while a model that
may go to zero has no Ready pod, the Service's EndpointSlice to the activator:
`activation.py`). Applying is kubectl-apply style: the manifest and its hash ride in
annotations; an unchanged hash and a live pod template that still has what Kiln set (image, command, args, env, resources,
probes) is no write. A changed hash is a merge patch against the last applied manifest (so
fields others set - annotations, replicas under an autoscaler - stay); containers edited
outside Kiln are put back whole.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kiln.operator import activation, manifests, observations
from kiln.operator import conditions as cond
from kiln.operator.rollout import Track, Tracks
from kiln.operator.steps import Condition, Event, Owns, Pass, StepResult
from kiln.runtime.api import contract

OWNS = Owns(conditions=("Available", "Degraded"), fields=("replicas", "readyReplicas", "selector"))


async def step(p: Pass) -> StepResult:
    tracks: Tracks = p.out["rollout"]
    dep = p.views.deployment(p.ns, manifests.runtime_name(p.name))
    canary = p.views.deployment(p.ns, manifests.runtime_name(p.name, manifests.CANARY))
    if not tracks.hold:
        stable_replicas = p.out["scaling"].replicas if tracks.stable_replicas is None else tracks.stable_replicas
        if tracks.stable is not None:
            dep = await apply_deployment(p, dep, tracks.stable, stable_replicas)
            await apply_service(p)
        dep = await set_replicas(p, dep, stable_replicas)
        if tracks.canary is not None:
            canary = await set_replicas(p, await apply_deployment(p, canary, tracks.canary, tracks.canary_replicas),
                                        tracks.canary_replicas)
            if manifests.gateway_api(p.spec):
                await apply_service(p, manifests.CANARY)
        elif canary is not None:
            await p.ctx.kube.delete("Deployment", p.ns, canary["metadata"]["name"])
            p.record("Normal", "CanaryRemoved", f"deleted Deployment {canary['metadata']['name']}")
            canary = None
    seen, seen_canary = observations.observe_deployment(dep), observations.observe_deployment(canary)
    await activation.route(p, seen.ready + seen_canary.ready)  # at zero, the Service goes to the activator
    failed = any(o.state == "Failed" for o in p.out["engines"])
    conditions = {"Available": available(seen, p.invalid is not None, waiting=tracks.stable is None and not seen.exists),
                  "Degraded": degraded(seen, p.invalid, failed, current=tracks.stable is not None,
                                       rolled_back=tracks.rolled_back,
                                       scaling_up_from=p.out["scaling"].scaling_up_from)}
    status = {"replicas": seen.replicas + seen_canary.replicas, "readyReplicas": seen.ready + seen_canary.ready,
              "selector": f"{contract.LABEL_MODEL}={p.name}"}
    starting = tracks.stable is not None and (not seen.rolled_out or (seen.desired > 0 and seen.ready == 0))
    told = [] if p.invalid is not None else transition_events(p.previous.get("conditions"), conditions)
    return StepResult(conditions=conditions, status=status, waiting=starting, events=told)  # InvalidSpec tells


# ------------------------------------------------------------------------ pure

def available(seen: observations.DeploymentObservation, invalid: bool, waiting: bool) -> Condition:
    if invalid:
        if seen.exists and seen.ready > 0:
            return (True, "MinimumReplicasAvailable", f"{seen.ready} ready replica(s) of the previous version")
        return (False, "NoEngine", "nothing is serving")
    if seen.exists and seen.ready > 0:
        return (True, "MinimumReplicasAvailable", f"{seen.ready}/{seen.desired} replica(s) ready, engine {seen.engine_key}")
    if seen.exists:
        return (False, "NoReadyReplicas" if seen.desired else "ScaledToZero", f"0/{seen.desired} replica(s) ready")
    if waiting:
        return (False, "NoEngine", "waiting for the engines to be built")
    return (False, "Deploying", "creating the runtime Deployment")


def degraded(seen: observations.DeploymentObservation, invalid: str | None, failed: bool, current: bool,
             rolled_back: Mapping[str, Any] | None = None, scaling_up_from: int | None = None) -> Condition:
    serving = seen.exists and seen.ready > 0
    if invalid is not None:
        return (True, "InvalidSpec", invalid)
    if rolled_back:
        return (True, "RolledBack", f"version {rolled_back.get('version')} was rolled back: {rolled_back.get('reason')}; "
                f"engine {seen.engine_key} serves")
    if failed and serving:
        return (True, "BuildFailed", f"serving engine {seen.engine_key}; the new engines failed to build")
    if current and seen.rolled_out and seen.ready < seen.desired:
        if scaling_up_from is not None and seen.ready >= scaling_up_from:  # the new pods are starting
            return (False, "ScalingUp", f"{seen.ready}/{seen.desired} replica(s) ready, scaling up from "
                                        f"{scaling_up_from}")
        return (True, "ReplicasUnavailable", f"{seen.ready}/{seen.desired} replica(s) ready")
    return (False, "AsExpected", "serving as the spec asks" if serving else "nothing is degraded")


def transition_events(old: Any, new: Mapping[str, Condition]) -> list[Event]:
    events: list[Event] = []
    for type_, (value, _, message) in new.items():
        before = cond.get_condition(old, type_)
        if before is None and not value or before is not None and (before.get("status") == cond.TRUE) == value:
            continue  # no flip; a condition's first, negative value is no news
        if type_ == "Available":
            events.append(("Normal", "Available", message) if value else ("Warning", "Unavailable", message))
        elif type_ == "Degraded" and value:
            events.append(("Warning", "Degraded", message))
    return events


def restore_patch(last: Any, new: dict[str, Any], drift: list[str]) -> dict[str, Any]:
    """The merge patch from the last applied manifest to `new`; containers whole when they drifted."""
    patch = manifests.merge_patch_between(last, new) if isinstance(last, dict) else json.loads(json.dumps(new))
    if isinstance(last, dict):  # the annotations themselves always go in whole
        ann = new["metadata"]["annotations"]
        patch.setdefault("metadata", {})["annotations"] = {
            contract.ANN_APPLIED: ann[contract.ANN_APPLIED], contract.ANN_APPLIED_HASH: ann[contract.ANN_APPLIED_HASH]}
    if drift:
        pod = patch.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
        pod["containers"] = new["spec"]["template"]["spec"]["containers"]
    return patch


# ------------------------------------------------------------------------ acting

async def set_replicas(p: Pass, dep: Mapping[str, Any] | None, replicas: int) -> Mapping[str, Any] | None:
    """spec.replicas alone (a scale or a traffic shift never changes the pod template)."""
    if dep is None or contract.ANN_APPLIED_HASH not in (dep["metadata"].get("annotations") or {}):
        return dep
    if int((dep.get("spec") or {}).get("replicas", 1)) == replicas:
        return dep
    patch: dict[str, Any] = {"spec": {"replicas": replicas}}
    if observations.observe_deployment(dep).rolled_out:  # then the generation this makes is a scale alone
        patch["metadata"] = {"annotations": {observations.ANN_SCALED_FROM: str(dep["metadata"].get("generation") or 0)}}
    return await p.ctx.kube.patch("Deployment", p.ns, dep["metadata"]["name"], patch)


async def apply_deployment(p: Pass, dep: Mapping[str, Any] | None, track: Track, replicas: int) -> Mapping[str, Any]:
    name, kube = track.applied["metadata"]["name"], p.ctx.kube
    new = manifests.with_applied(track.applied)
    if dep is None:
        body = json.loads(json.dumps(new))
        body["spec"]["replicas"] = replicas
        dep, created = await kube.create(body)
        if created:
            p.record("Normal", "Deploying", f"created Deployment {name} serving engine {track.engines[0].engine.key}")
    annotations = dep["metadata"].get("annotations") or {}
    try:
        last = json.loads(annotations.get(contract.ANN_APPLIED) or "null")
    except ValueError:
        last = None
    # Drift is the live object differing from what Kiln last applied, not from the new
    # manifest (a version change is no one's edit).
    drift = observations.template_drift(dep, last if isinstance(last, dict) else track.applied)
    if drift and p.ctx.stuck_drift.get((p.ns, name)) == track.hash:
        drift = []  # a patch could not undo it last time; not fought in a loop
    if annotations.get(contract.ANN_APPLIED_HASH) == track.hash and not drift:
        return dep
    old_key = ((dep["spec"].get("template") or {}).get("metadata") or {}).get("labels", {}).get(contract.LABEL_ENGINE_KEY)
    dep = await kube.patch("Deployment", p.ns, name, restore_patch(last, new, drift))
    key = track.engines[0].engine.key
    if drift:
        p.record("Warning", "DriftRestored", f"restored {', '.join(drift)} of Deployment {name}, changed outside Kiln")
        if observations.template_drift(dep, track.applied):
            p.ctx.stuck_drift[(p.ns, name)] = track.hash
    if annotations.get(contract.ANN_APPLIED_HASH) != track.hash:
        p.record("Normal", "Deploying", f"rolling Deployment {name} from engine {old_key} to {key}"
                 if old_key and old_key != key else f"updated Deployment {name}")
    return dep


async def apply_service(p: Pass, track: str = manifests.STABLE) -> None:
    desired = manifests.runtime_service(p.model, p.spec, track)
    name = desired["metadata"]["name"]
    svc = p.views.service(p.ns, name)
    if svc is None:
        svc, _ = await p.ctx.kube.create(manifests.with_applied(desired))
    if (svc["metadata"].get("annotations") or {}).get(contract.ANN_APPLIED_HASH) != manifests.manifest_hash(desired):
        await p.ctx.kube.patch("Service", p.ns, name, manifests.with_applied(desired))
