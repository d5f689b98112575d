"""The serving step: each track's Deployment and the Service are what the rollout step decided.

Owns `Available`, `Degraded`, `status.replicas`, `status.readyReplicas` and
`status.selector`; acts on the runtime Deployment and the Service (and, while a model that
may go to zero has no Ready pod, the Service's EndpointSlice to the activator:
`activation.py`). Applying is kubectl-apply style: the manifest and its hash ride in
annotations; an unchanged hash and a live pod template that still has what Kiln set
(image, command, args, env, resources, probes) is no write. A changed hash is a merge patch against the last applied manifest (so
fields others set - annotations, replicas under an autoscaler - stay); containers edited
outside Kiln are put back whole.

The model's PodDisruptionBudget is applied beside the stable Deployment (no watch shows it:
that Deployment records the budget's hash, so an unchanged budget costs no API call). Before
a track's replicas go down, each of its Ready pods gets its load as its
`controller.kubernetes.io/pod-deletion-cost` (read from the pod's own /metrics at that
moment), so the ReplicaSet controller removes the idlest pod.

`Degraded` also says what the model's clients see: while KilnRequestsRefused (most of its
requests refused; the alert receiver records it, `signals.py`) is active, `Degraded` is True
with reason RequestsRefused and a Warning Event says so as it turns; it clears when the
alert resolves or goes stale (`--signal-ttl-seconds`: the step looks again then). A report
only: nothing scales, rolls back or changes on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping

import aiohttp

from kiln.operator import activation, manifests, observations, warmup
from kiln.operator import conditions as cond
from kiln.operator import signals as sig
from kiln.operator.kube import ApiError
from kiln.operator.rollout import Track, Tracks
from kiln.operator.steps import Condition, Event, Owns, Pass, StepResult
from kiln.runtime.api import contract

logger = logging.getLogger("kiln.operator.serving")

OWNS = Owns(conditions=("Available", "Degraded"), fields=("replicas", "readyReplicas", "selector"))


async def step(p: Pass) -> StepResult:
    tracks: Tracks = p.out["rollout"]
    dep = p.views.deployment(p.ns, manifests.runtime_name(p.name))
    canary = p.views.deployment(p.ns, manifests.runtime_name(p.name, manifests.CANARY))
    if not tracks.hold:
        stable_replicas = p.out["scaling"].replicas if tracks.stable_replicas is None else tracks.stable_replicas
        if tracks.stable is not None:
            dep = await apply_deployment(p, dep, tracks.stable, stable_replicas)
            await apply_disruption_budget(p, dep)
        if dep is not None:  # before the canary changes: its pods leave the Service before they go
            await apply_service(p, both_tracks=tracks.canary_serves)
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
    warmup_failed = None if p.invalid is not None else await warmup.failure(p, dep)
    now, ttl = p.ctx.clock(), p.ctx.config.signal_ttl_seconds
    refused = requests_refused(p.model, now, ttl)
    conditions = {"Available": available(seen, p.invalid is not None, waiting=tracks.stable is None and not seen.exists,
                                         warmup_failed=warmup_failed),
                  "Degraded": degraded(seen, p.invalid, failed, current=tracks.stable is not None,
                                       rolled_back=tracks.rolled_back,
                                       scaling_up_from=p.out["scaling"].scaling_up_from, warmup_failed=warmup_failed,
                                       refused=refused)}
    status = {"replicas": seen.replicas + seen_canary.replicas, "readyReplicas": seen.ready + seen_canary.ready,
              "selector": f"{contract.LABEL_MODEL}={p.name}"}
    starting = tracks.stable is not None and (not seen.rolled_out or (seen.desired > 0 and seen.ready == 0))
    told = [] if p.invalid is not None else transition_events(p.previous.get("conditions"), conditions)
    before = p.previous_condition("Degraded")
    if warmup_failed and (before.get("reason"), before.get("message")) != conditions["Degraded"][1:]:
        told.append(("Warning", WARMUP_FAILED, conditions["Degraded"][2]))  # once per distinct message
    if conditions["Degraded"][1] == REQUESTS_REFUSED and before.get("reason") != REQUESTS_REFUSED:
        told.append(("Warning", REQUESTS_REFUSED, conditions["Degraded"][2]))  # once as it turns, not per new share
    # A firing alert that Alertmanager stops repeating goes stale with no event to say so: look again then.
    stale_in = None if refused is None else max(ttl - (now - refused.seen).total_seconds(), 0.0) + 1.0
    return StepResult(conditions=conditions, status=status, waiting=starting, events=told,  # InvalidSpec tells
                      wake_after=stale_in)


# ------------------------------------------------------------------------ pure

WARMUP_FAILED = "WarmupFailed"
REQUESTS_REFUSED = "RequestsRefused"


def requests_refused(model: Mapping[str, Any], now: Any, ttl: float) -> sig.Signal | None:
    """The model's KilnRequestsRefused alert, when it is active (firing, and heard of within `ttl`)."""
    signal = sig.parse((model.get("metadata") or {}).get("annotations")).get(sig.REFUSED)
    return signal if signal is not None and signal.active(now, ttl) else None


def refused_message(signal: sig.Signal) -> str:
    """In words, with the share the alert saw; a share that is none (the value annotation is
    the receiver's client's word) is not repeated."""
    share = signal.value
    said = f"{share:.0%} of" if share is not None and 0.0 <= share <= 1.0 else "most of"
    return (f"{said} the model's recent requests were refused (outcome bad_request or refused; {sig.REFUSED} "
            f"firing since {sig.format_time(signal.starts_at)}): the clients' inputs do not fit the model, "
            f"or this version refuses them")


def available(seen: observations.DeploymentObservation, invalid: bool, waiting: bool,
              warmup_failed: str | None = None) -> Condition:
    if invalid:
        if seen.exists and seen.ready > 0:
            return (True, "MinimumReplicasAvailable", f"{seen.ready} ready replica(s) of the previous version")
        return (False, "NoEngine", "nothing is serving")
    if seen.exists and seen.ready > 0:
        return (True, "MinimumReplicasAvailable", f"{seen.ready}/{seen.desired} replica(s) ready, engine {seen.engine_key}")
    if seen.exists and warmup_failed:
        return (False, WARMUP_FAILED, f"0/{seen.desired} replica(s) ready: the pods fail their warm-up samples and "
                                      f"never become Ready: {warmup_failed}")
    if seen.exists:
        return (False, "NoReadyReplicas" if seen.desired else "ScaledToZero", f"0/{seen.desired} replica(s) ready")
    if waiting:
        return (False, "NoEngine", "waiting for the engines to be built")
    return (False, "Deploying", "creating the runtime Deployment")


def degraded(seen: observations.DeploymentObservation, invalid: str | None, failed: bool, current: bool,
             rolled_back: Mapping[str, Any] | None = None, scaling_up_from: int | None = None,
             warmup_failed: str | None = None, refused: sig.Signal | None = None) -> Condition:
    serving = seen.exists and seen.ready > 0
    if invalid is not None:
        return (True, "InvalidSpec", invalid)
    if warmup_failed:
        return (True, WARMUP_FAILED, f"the new pods fail their warm-up samples and never become Ready "
                                     f"({seen.ready}/{seen.desired} ready): {warmup_failed}")
    if refused is not None:  # what every client sees now, before how the rollout or the replicas stand
        return (True, REQUESTS_REFUSED, refused_message(refused))
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
    await before_scale_down(p, dep, replicas)
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
    if "replicas" in new["spec"]:  # replicas in the manifest (no autoscaler): this patch may scale down
        await before_scale_down(p, dep, int(new["spec"]["replicas"]))
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


async def apply_service(p: Pass, track: str = manifests.STABLE, both_tracks: bool = False) -> None:
    desired = manifests.runtime_service(p.model, p.spec, track, both_tracks)
    name = desired["metadata"]["name"]
    svc = p.views.service(p.ns, name)
    if svc is None:
        svc, _ = await p.ctx.kube.create(manifests.with_applied(desired))
    if (svc["metadata"].get("annotations") or {}).get(contract.ANN_APPLIED_HASH) != manifests.manifest_hash(desired):
        # From the manifest last applied, as for a Deployment: a selector key it drops is named null.
        try:
            last = json.loads((svc["metadata"].get("annotations") or {}).get(contract.ANN_APPLIED) or "null")
        except ValueError:
            last = None
        await p.ctx.kube.patch("Service", p.ns, name, restore_patch(last, manifests.with_applied(desired), []))


async def apply_disruption_budget(p: Pass, dep: Mapping[str, Any]) -> None:
    """The model's PodDisruptionBudget, created or patched when the stable Deployment does not
    record its hash yet (a new model, a changed budget, an operator that never applied one);
    then the Deployment records it. A budget deleted by hand is back at the next change.
    What the record's patch answers is not this pass's view of the Deployment: its status
    may be newer than the watch's, and conditions would flip back and forth."""
    desired = manifests.disruption_budget(p.model)
    want = manifests.manifest_hash(desired)
    if (dep["metadata"].get("annotations") or {}).get(observations.ANN_DISRUPTION_BUDGET) == want:
        return
    budget, created = await p.ctx.kube.create(manifests.with_applied(desired))
    if not created and (budget["metadata"].get("annotations") or {}).get(contract.ANN_APPLIED_HASH) != want:
        await p.ctx.kube.patch("PodDisruptionBudget", p.ns, desired["metadata"]["name"], manifests.with_applied(desired))
    await p.ctx.kube.patch("Deployment", p.ns, dep["metadata"]["name"],
                           {"metadata": {"annotations": {observations.ANN_DISRUPTION_BUDGET: want}}})


# Reading the pods' loads before a scale-down: bounded, so a pod that hangs delays it by a
# second at most, and a hundred pods are not a hundred connections at once.
METRICS_TIMEOUT_SECONDS = 1.0
METRICS_AT_ONCE = 8
METRICS_MAX_BYTES = 4 << 20


async def before_scale_down(p: Pass, dep: Mapping[str, Any], replicas: int) -> None:
    if 0 < replicas < int((dep.get("spec") or {}).get("replicas", 1)):  # to zero, every pod goes
        await set_deletion_costs(p, dep)


async def set_deletion_costs(p: Pass, dep: Mapping[str, Any]) -> None:
    """Each Ready pod of `dep` gets its load as its pod-deletion-cost, so the scale-down that
    follows removes the idlest. The pods are listed now, not watched (the operator would hold
    every runtime pod in memory for a moment it needs rarely). Best effort: a list or a patch
    that fails is a Warning Event and the scale-down goes on, in the ReplicaSet's own order."""
    labels = ((dep.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}
    track = labels.get(contract.LABEL_TRACK, manifests.STABLE)
    selector = ",".join(f"{k}={v}" for k, v in manifests.selector_labels(p.name, track).items())
    try:
        pods = await p.ctx.kube.list("Pod", p.ns, selector)
        addresses = observations.serving_pod_addresses(pods, manifests.RUNTIME_PORT_NAME)
        loads = await read_pod_loads(addresses)
        costs = {name: observations.deletion_cost(loads.get(name)) for name in addresses}
        await asyncio.gather(*(set_deletion_cost(p, pod, costs[pod["metadata"]["name"]])
                               for pod in pods if pod["metadata"]["name"] in costs))
    except ApiError as e:
        logger.warning("scale-down of %s/%s without deletion costs: %s", p.ns, dep["metadata"]["name"], e)
        p.record("Warning", "ScaleDownUnordered", f"could not {e.action or 'set the pods deletion costs'}: "
                 f"{e.message or e}; the ReplicaSet picks the pod to remove")


async def set_deletion_cost(p: Pass, pod: Mapping[str, Any], cost: int) -> None:
    if (pod["metadata"].get("annotations") or {}).get(observations.ANN_DELETION_COST) == str(cost):
        return
    try:
        await p.ctx.kube.patch("Pod", p.ns, pod["metadata"]["name"],
                               {"metadata": {"annotations": {observations.ANN_DELETION_COST: str(cost)}}})
    except ApiError as e:
        if e.status != 404:  # a pod gone meanwhile needs no cost
            raise


async def read_pod_loads(addresses: Mapping[str, str]) -> dict[str, observations.PodLoad]:
    """pod name -> its load, from `http://<address>/metrics`; a pod that does not answer
    in time, or not with metrics, is left out (its cost is then 0)."""
    at_once = asyncio.Semaphore(METRICS_AT_ONCE)
    timeout = aiohttp.ClientTimeout(total=METRICS_TIMEOUT_SECONDS)

    async def one(session: aiohttp.ClientSession, name: str, address: str) -> tuple[str, observations.PodLoad | None]:
        async with at_once:
            try:
                async with session.get(f"http://{address}/metrics") as resp:
                    if resp.status != 200:
                        return name, None
                    text = (await resp.content.read(METRICS_MAX_BYTES)).decode(errors="replace")
                return name, observations.pod_load(text)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                logger.info("pod %s did not tell its load (%s): cost 0", name, e or type(e).__name__)
                return name, None

    if not addresses:
        return {}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        found = await asyncio.gather(*(one(session, n, a) for n, a in addresses.items()))
    return {name: load for name, load in found if load is not None}
