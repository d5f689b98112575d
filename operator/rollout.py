"""The rollout step: which engines each track's Deployment runs, and how far it has got.

Owns `Progressing`, `status.engineKey`, `status.stable` and `status.canary`. It decides
and the serving step acts: `decide()` names the manifest of each track (today one,
`stable`). The policy today, whatever `spec.rollout.strategy` says: a track moves to the
new engines only once every one of them exists (nothing running changes before), and then
the Deployment rolls with its RollingUpdate. Canary rollouts plug in here: a `canary`
track with its own Deployment and weight, steps and analysis as a pure state machine over
`status.canary` (so a restart resumes), with an injected clock.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kiln.operator import builders
from kiln.operator.engines import EngineObservation
from kiln.operator.steps import Condition, Owns, Pass, StepResult

OWNS = Owns(conditions=("Progressing",), fields=("engineKey", "stable", "canary"), sticky=("canary",))


@dataclasses.dataclass(frozen=True)
class Track:
    name: str  # stable (canary later)
    engines: tuple[EngineObservation, ...]
    applied: dict[str, Any]  # the Deployment Kiln applies (replicas left out when autoscaled)
    hash: str  # builders.manifest_hash(applied)


@dataclasses.dataclass(frozen=True)
class Tracks:
    stable: Track | None  # None: leave the running Deployment as it is


async def step(p: Pass) -> StepResult:
    observed: list[EngineObservation] = p.out["engines"]
    live = p.views.deployment(p.ns, builders.runtime_name(p.name))
    if p.invalid is not None:
        keep = {k: p.previous[k] for k in ("engineKey", "stable") if p.previous.get(k) is not None}
        return StepResult(conditions={"Progressing": (False, "InvalidSpec", "the spec cannot work; change it to proceed")},
                          status=keep, out=Tracks(None))
    tracks = decide(p, observed, p.out["scaling"])
    return StepResult(conditions={"Progressing": progressing(p.version, observed, tracks, live)},
                      status=stable_status(p, tracks, live), out=tracks)


def decide(p: Pass, observed: list[EngineObservation], scale: Any) -> Tracks:
    """The stable track runs the current engines once every one of them exists."""
    if not observed or any(o.state != "Ready" for o in observed):
        return Tracks(None)
    results = {o.engine.index_key: dict(o.result or {}) for o in observed}
    applied = builders.runtime_deployment(p.model, p.spec, [o.engine for o in observed], results, p.ctx.config,
                                          include_replicas=not scale.autoscaled)
    return Tracks(Track("stable", tuple(observed), applied, builders.manifest_hash(applied)))


def in_sync(live: Mapping[str, Any] | None, track: Track) -> bool:
    """The live Deployment is what the track applies: same applied hash, no edits made outside Kiln."""
    if live is None:
        return False
    applied_hash = (live["metadata"].get("annotations") or {}).get(builders.ANN_APPLIED_HASH)
    return applied_hash == track.hash and not builders.template_drift(live, track.applied)


def progressing(version: str, observed: list[EngineObservation], tracks: Tracks,
                live: Mapping[str, Any] | None) -> Condition:
    if any(o.state == "Failed" for o in observed):
        return (False, "BuildFailed", "a build failed; change the spec to retry")
    if tracks.stable is None:
        return (True, "Building", f"building the engines for version {version}")
    key = tracks.stable.engines[0].engine.key
    if in_sync(live, tracks.stable) and builders.observe_deployment(live).rolled_out:
        return (False, "RolloutComplete", f"engine {key} for version {version} is rolled out")
    return (True, "RollingOut", f"rolling out engine {key} for version {version}")


def stable_status(p: Pass, tracks: Tracks, live: Mapping[str, Any] | None) -> dict[str, Any]:
    """engineKey and stable: the key the stable Deployment runs once the serving step acted."""
    dep = builders.observe_deployment(live)
    if tracks.stable is not None:
        key, version = tracks.stable.engines[0].engine.key, p.version
    else:
        key, version = dep.engine_key, str((p.previous.get("stable") or {}).get("version", ""))
    if not key:
        return {"engineKey": p.engines[0].key} if p.engines else {}
    return {"engineKey": key, "stable": {"version": version, "engineKey": key, "weight": 100,
                                         "replicas": dep.replicas, "readyReplicas": dep.ready}}
