"""The rollout step: which engines each track's Deployment runs, its share, how far it got.

Owns `Progressing`, `status.engineKey`, `status.stable`, `status.canary` and
`status.rollback`. It decides and the serving step acts (`Tracks`: the manifest of each
track, the replicas of each, the canary's weight in effect).

- Nothing running changes before every engine of the new key exists.
- `strategy: Recreate`, or nothing serving yet: the stable Deployment moves to the new
  engines with its rolling update.
- `strategy: Canary` with something serving: the canary state machine (`canary.advance`,
  pure, its state in `status.canary`). The scaling step owns the total; this step splits it:
  the canary gets its weight's share (at least `canaryMinReplicas`), and the stable side
  shrinks only by the canary pods that are Ready, so capacity never drops before the new
  weight is in effect.
- Analysis (`analysis.py`) runs when the machine says one is due, against the operator's
  `--prometheus-url`; the built-in checks only where there is one.
- By hand: the annotation `rollout.kiln.dev/action: promote|abort` (`kiln rollout`), taken
  and removed in the same pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kiln.operator import analysis as an
from kiln.operator import manifests, observations, warmup
from kiln.operator import canary as cn
from kiln.operator.engines import EngineObservation
from kiln.operator.kube import ApiError
from kiln.operator.steps import Condition, Owns, Pass, StepResult
from kiln.runtime.api import contract

OWNS = Owns(conditions=("Progressing",), fields=("engineKey", "stable", "canary", "rollback"),
            sticky=("canary", "rollback"), refused="Progressing")
ANN_ACTION = contract.ANN_ROLLOUT_ACTION


@dataclasses.dataclass(frozen=True)
class Track:
    name: str  # stable | canary
    engines: tuple[EngineObservation, ...]
    applied: dict[str, Any]  # the Deployment Kiln applies (replicas left out when autoscaled)
    hash: str  # manifests.manifest_hash(applied)


@dataclasses.dataclass(frozen=True)
class Tracks:
    stable: Track | None  # None: leave the stable Deployment's template as it is
    canary: Track | None = None  # None: no canary Deployment (one that exists goes)
    stable_replicas: int | None = None  # None: the scaling step's count
    canary_replicas: int = 0
    weight: int = 0  # the canary's share of traffic in effect (Gateway API weights)
    rolled_back: Mapping[str, Any] | None = None
    hold: bool = False  # the spec cannot work: touch no Deployment
    canary_serves: bool = False  # the canary takes client traffic (a weighted step, not the shadow step)


async def step(p: Pass) -> StepResult:
    observed: list[EngineObservation] = p.out["engines"]
    live = p.views.deployment(p.ns, manifests.runtime_name(p.name))
    if p.invalid is not None:
        keep = {k: p.previous[k] for k in ("engineKey", "stable") if p.previous.get(k) is not None}
        return StepResult(conditions={"Progressing": (False, "InvalidSpec", "the spec cannot work; change it to proceed")},
                          status=keep, out=Tracks(None, hold=True))
    ready = bool(observed) and all(o.state == "Ready" for o in observed)
    serving = observations.observe_deployment(live)
    desired = observed[0].engine.key if observed else ""
    state = p.previous.get("canary") or None
    canaried = (p.spec["rollout"]["strategy"] == "Canary" and serving.exists and bool(desired)
                and (serving.engine_key != desired or (state or {}).get("engineKey") == desired))
    if not canaried:
        if p.ctx.shadow_configs.get((p.ns, p.name)) or (state and p.spec["rollout"]["shadow"]["enabled"]):
            await apply_shadow(p, None)  # the rollout that shadowed is over
        return without_canary(p, observed, ready, desired, live)
    return await with_canary(p, observed, ready, desired, serving, state)


def without_canary(p: Pass, observed: list[EngineObservation], ready: bool, desired: str,
                   live: Mapping[str, Any] | None) -> StepResult:
    """Recreate, or nothing serving yet: the stable Deployment moves once the engines exist."""
    tracks = Tracks(track(p, observed, manifests.STABLE) if ready else None)
    status = stable_status(p, tracks, live)
    if p.previous.get("canary"):
        status["canary"] = None  # superseded by a Recreate
    if p.previous.get("rollback") and p.previous["rollback"].get("engineKey") != desired:
        status["rollback"] = None  # the spec moved on
    return StepResult(conditions={"Progressing": progressing(p.version, observed, tracks, live)},
                      status=status, out=tracks)


async def with_canary(p: Pass, observed: list[EngineObservation], ready: bool, desired: str,
                      serving: observations.DeploymentObservation, state: Mapping[str, Any] | None) -> StepResult:
    total = p.out["scaling"].replicas
    policy = cn.Policy.from_spec(p.spec.get("rollout") or {})
    canary_dep = p.views.deployment(p.ns, manifests.runtime_name(p.name, manifests.CANARY))
    canary_live = observations.observe_deployment(canary_dep)
    target_weight = int((state or {}).get("targetWeight") or policy.steps[0][0])
    target = cn.canary_replicas(total, target_weight, policy.canary_min)
    canary_ready = canary_live.ready if canary_live.engine_key == desired else 0
    if (manifests.gateway_api(p.spec) and state and state.get("engineKey") == desired and not state.get("stepStartedAt")
            and canary_ready >= target and not await shift_traffic(p, target_weight)):
        canary_ready = 0  # the pods are there, the route's weight is not: the step's clock waits
    args = dict(desired_key=desired, version=p.version, engines_ready=ready, rollback=p.previous.get("rollback"),
                canary_ready=canary_ready, canary_target=target,
                stable_done=serving.engine_key == desired and serving.rolled_out and serving.ready >= total,
                action=await take_action(p), now=p.ctx.clock(),
                canary_failed=await warmup.failure(p, canary_dep) if canary_live.engine_key == desired else None)
    plan = cn.advance(policy, state=state, outcome=None, **args)
    if plan.analyze:
        outcome = await an.evaluate(p.ctx.config.prometheus_url, checks(p, plan.state, serving.engine_key))
        plan = cn.advance(policy, state=plan.state, outcome=outcome, **{**args, "action": None})
    for event in plan.events:
        p.record(*event)
    if plan.canary_key is None and manifests.gateway_api(p.spec):
        await shift_traffic(p, 0)  # rolled back, promoted, or nothing yet: all on stable
    s = plan.state
    weight = int(s["weight"]) if s else 0
    canary_track = track(p, observed, manifests.CANARY) if plan.canary_key else None
    shadowing = policy.shadow and canary_track is not None and s is not None and s["phase"] != cn.PROMOTING
    if policy.shadow or p.ctx.shadow_configs.get((p.ns, p.name)):
        await apply_shadow(p, await shadow_settings(p, s["engineKey"]) if shadowing else None)
    serves = canary_track is not None and not policy.in_shadow_step(s)
    if plan.promote:
        tracks = Tracks(track(p, observed, manifests.STABLE), canary_track, total, canary_live.replicas, weight,
                        canary_serves=serves)
    elif canary_track is not None:
        cap = cn.canary_replicas(total, int(s["targetWeight"]), policy.canary_min)
        # In the shadow step the canary's pods add to the stable side: it keeps its size.
        stable = total if not serves else max(total - min(canary_live.ready, cap), 1)
        tracks = Tracks(None, canary_track, stable, cap, weight, canary_serves=serves)
    else:  # before the engines exist, rolled back, or promoted
        tracks = Tracks(track(p, observed, manifests.STABLE) if s is None and serving.engine_key == desired
                        else None, None, total, 0, 0, plan.rollback)
    status = stable_status(p, tracks, p.views.deployment(p.ns, manifests.runtime_name(p.name)))
    status["canary"] = None if s is None else {**s, "replicas": canary_live.replicas, "readyReplicas": canary_live.ready}
    status["rollback"] = plan.rollback
    return StepResult(conditions={"Progressing": canary_progressing(p.version, observed, plan)}, status=status,
                      out=tracks, wake_after=plan.look_again)


def track(p: Pass, observed: list[EngineObservation], name: str) -> Track:
    results = {o.engine.index_key: dict(o.result or {}) for o in observed}
    applied = manifests.runtime_deployment(p.model, p.spec, [o.engine for o in observed], results, p.ctx.config,
                                           include_replicas=not p.out["scaling"].autoscaled and name == manifests.STABLE,
                                           track=name)
    return Track(name, tuple(observed), applied, manifests.manifest_hash(applied))


def checks(p: Pass, state: Mapping[str, Any] | None, stable_key: str) -> list[an.Check]:
    a = (p.spec.get("rollout") or {}).get("analysis") or {}
    key = (state or {}).get("engineKey", "")
    built_in = an.builtin_checks(a, p.ns, p.name, key, stable_key) if p.ctx.config.prometheus_url else []
    agreement = an.agreement_check(a, p.ns, p.name, key) if (
        p.spec["rollout"]["shadow"]["enabled"] and p.ctx.config.prometheus_url) else None
    built_in += [agreement] if agreement else []
    return built_in + an.user_checks(a, p.ns, p.name, p.version, key)


async def take_action(p: Pass) -> str | None:
    """promote / abort asked by hand: read and removed (an unknown value is removed, with a Warning)."""
    action = (p.model["metadata"].get("annotations") or {}).get(ANN_ACTION)
    if action is None:
        return None
    await p.ctx.kube.patch(contract.KIND, p.ns, p.name, {"metadata": {"annotations": {ANN_ACTION: None}}})
    if action not in (cn.PROMOTE, cn.ABORT):
        p.record("Warning", "UnknownRolloutAction", f"{ANN_ACTION}: {action!r} is neither promote nor abort; removed")
        return None
    if not (p.previous.get("canary") or {}):
        p.record("Warning", "NoRollout", f"{ANN_ACTION}: {action} asked with no rollout running; removed")
        return None
    return action


def in_sync(live: Mapping[str, Any] | None, track: Track) -> bool:
    """The live Deployment is what the track applies: same applied hash, no edits made outside Kiln."""
    if live is None:
        return False
    applied_hash = (live["metadata"].get("annotations") or {}).get(contract.ANN_APPLIED_HASH)
    return applied_hash == track.hash and not observations.template_drift(live, track.applied)


def progressing(version: str, observed: list[EngineObservation], tracks: Tracks,
                live: Mapping[str, Any] | None) -> Condition:
    if any(o.state == "Failed" for o in observed):
        return (False, "BuildFailed", "a build failed; change the spec to retry")
    if tracks.stable is None:
        return (True, "Building", f"building the engines for version {version}")
    key = tracks.stable.engines[0].engine.key
    if in_sync(live, tracks.stable) and observations.observe_deployment(live).rolled_out:
        return (False, "RolloutComplete", f"engine {key} for version {version} is rolled out")
    return (True, "RollingOut", f"rolling out engine {key} for version {version}")


def canary_progressing(version: str, observed: list[EngineObservation], plan: cn.Plan) -> Condition:
    if any(o.state == "Failed" for o in observed):
        return (False, "BuildFailed", "a build failed; change the spec to retry")
    if plan.rollback is not None:
        return (False, "RolledBack", f"version {plan.rollback.get('version')} rolled back: {plan.rollback.get('reason')}")
    s = plan.state
    if s is None:
        if plan.canary_key is None and not all(o.state == "Ready" for o in observed):
            return (True, "Building", f"building the engines for version {version}; nothing running changes")
        return (False, "RolloutComplete", f"version {version} is stable")
    where = f"step {s['step'] + 1}, canary at {s['weight']}% (target {s['targetWeight']}%)"
    if s["phase"] == cn.PROMOTING:
        return (True, "Promoting", f"version {version}: the stable Deployment moves to engine {s['engineKey']}")
    if s["phase"] == cn.PAUSED:
        return (True, "RolloutPaused", f"{where}: {(s.get('lastAnalysis') or {}).get('message', 'waiting for data')}")
    return (True, "Canary", f"version {version}: {where}")


def stable_status(p: Pass, tracks: Tracks, live: Mapping[str, Any] | None) -> dict[str, Any]:
    """engineKey and stable: the key the stable Deployment runs once the serving step acted."""
    dep = observations.observe_deployment(live)
    if tracks.stable is not None:
        key, version = tracks.stable.engines[0].engine.key, p.version
    else:
        key, version = dep.engine_key, str((p.previous.get("stable") or {}).get("version", ""))
    if not key:
        return {"engineKey": p.engines[0].key} if p.engines else {}
    return {"engineKey": key, "stable": {"version": version, "engineKey": key, "weight": 100 - tracks.weight,
                                         "replicas": dep.replicas, "readyReplicas": dep.ready}}


async def shadow_settings(p: Pass, canary_key: str) -> str:
    """The stable pods' shadow config: the canary's Ready pods (listed now: only during a
    rollout that shadows, and each Deployment event brings a pass) and the spec's bounds."""
    selector = ",".join(f"{k}={v}" for k, v in {**manifests.selector_labels(p.name, manifests.CANARY),
                                                contract.LABEL_ENGINE_KEY: canary_key}.items())
    try:
        pods = await p.ctx.kube.list("Pod", p.ns, selector)
    except ApiError as e:
        p.record("Warning", "ShadowNotSet", f"the canary's pods could not be listed: {e.message or e}")
        pods = []
    targets = observations.serving_pod_addresses(pods, manifests.RUNTIME_PORT_NAME).values()
    return manifests.shadow_settings(p.name, p.spec, canary_key, targets)


async def apply_shadow(p: Pass, text: str | None) -> None:
    """The `<model>-shadow` ConfigMap holds `text`, or is gone (None). Written when it
    changes (remembered per model; a restart reads it once)."""
    key, name = (p.ns, p.name), manifests.shadow_config_name(p.name)
    if p.ctx.shadow_configs.get(key) == (text or ""):  # absent: not known since this process started
        return
    live = await p.ctx.kube.get("ConfigMap", p.ns, name)
    if text is None:
        if live is not None:
            await p.ctx.kube.delete("ConfigMap", p.ns, name)
    elif live is None:
        await p.ctx.kube.create(manifests.shadow_config(p.model, text))
        p.record("Normal", "ShadowStarted", f"the stable pods copy requests to the canary ({name})")
    elif (live.get("data") or {}).get(manifests.SHADOW_FILE) != text:
        await p.ctx.kube.patch("ConfigMap", p.ns, name, {"data": {manifests.SHADOW_FILE: text}})
    p.ctx.shadow_configs[key] = text or ""


async def shift_traffic(p: Pass, weight: int) -> bool:
    """The routes' weights (the HTTPRoute's, and the GRPCRoute's for gRPC clients): `<model>`
    100 - weight, `<model>-canary` weight. Written when they change (remembered per route; a
    restart reads and writes them once). False when a write failed: the weight is not in
    effect, and the step's clock does not start."""
    traffic = (p.spec.get("rollout") or {}).get("traffic") or {}
    shifted = True
    for kind, route in (("HTTPRoute", traffic.get("httpRoute")), ("GRPCRoute", traffic.get("grpcRoute"))):
        key = (p.ns, kind, route)
        if not route or p.ctx.route_weights.get(key) == weight:
            continue
        try:
            live = await p.ctx.kube.get(kind, p.ns, route)
            if live is None:
                raise ValueError(f"{kind} {p.ns}/{route} does not exist")
            await p.ctx.kube.patch(kind, p.ns, route, manifests.route_weights_patch(
                live, {manifests.service_name(p.name): 100 - weight,
                       manifests.service_name(p.name, manifests.CANARY): weight}))
        except (ValueError, ApiError) as e:
            p.record("Warning", "TrafficNotShifted", f"canary weight {weight}% not set on the {kind}: {e}")
            shifted = False
            continue
        p.ctx.route_weights[key] = weight
        p.record("Normal", "TrafficShifted", f"{kind} {route}: {p.name} {100 - weight}, {p.name}-canary {weight}")
    return shifted
