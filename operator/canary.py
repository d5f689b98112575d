"""The canary rollout as a pure state machine: `advance` over `status.canary` and the clock.

A change of engine key with `rollout.strategy: Canary` (and something already serving):

    Building     the new engines are built; nothing running changes, no traffic moves
    shadow       (rollout.shadow) step 0, weight 0: the canary's pods take no client traffic;
                 the stable pods copy a sample of their requests to them and compare the
                 answers (the agreement check); otherwise a step like the others
    step i       the canary Deployment runs the new key at `steps[i].weight`; the step's
                 clock starts once enough canary pods are Ready for that weight (the weight
                 is in effect); analysis runs every `intervalSeconds`
                 - a failed evaluation counts; more than `failureLimit` rolls back
                 - the step ends after `pauseSeconds` only on a passing evaluation made
                   during it; no data or no answer from Prometheus pauses (never promotes)
    Promoting    after the last step (or `kiln rollout promote`): the stable Deployment moves
                 to the new key at full size, then the canary goes; the old engine stays in
                 the cache
    rolled back  on failure (or `kiln rollout abort`, or canary pods whose warm-up samples
                 fail): the canary goes at once, all traffic on stable; the key is remembered
                 so it is not retried until the spec changes

The state lives in `status.canary` (and `status.rollback`), so a restarted operator resumes
exactly where it was. A newer key during a rollout supersedes it: its canary is removed and
the new one starts once its engines exist.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Mapping

from kiln.operator import analysis as an
from kiln.operator import signals as sig  # the one RFC 3339 parser and formatter

PROGRESSING, PAUSED, PROMOTING = "Progressing", "Paused", "Promoting"
PROMOTE, ABORT = "promote", "abort"


@dataclasses.dataclass(frozen=True)
class Policy:
    steps: tuple[tuple[int, float], ...]  # (weight percent, pause seconds); weight 0: the shadow step
    interval: float
    failure_limit: int
    canary_min: int
    shadow: bool = False  # steps[0] is the shadow step (rollout.shadow): copies, no client traffic

    @classmethod
    def from_spec(cls, rollout: Mapping[str, Any]) -> "Policy":
        """From a defaulted spec's `rollout` (the CRD holds the defaults)."""
        a = rollout["analysis"]
        shadow = rollout["shadow"]
        first = ((0, float(shadow["pauseSeconds"])),) if shadow["enabled"] else ()
        return cls(first + tuple((int(s["weight"]), float(s["pauseSeconds"])) for s in rollout["steps"]),
                   float(a["intervalSeconds"]), int(a["failureLimit"]), int(rollout["canaryMinReplicas"]),
                   bool(shadow["enabled"]))

    def in_shadow_step(self, state: Mapping[str, Any] | None) -> bool:
        """The canary has no client traffic: its step is the shadow step (weight 0)."""
        return bool(self.shadow and state and state.get("phase") != PROMOTING and int(state.get("step", 0)) == 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    canary_key: str | None  # the key the canary Deployment runs; None: no canary Deployment
    promote: bool  # the stable Deployment moves to the canary's key (at full size)
    state: dict[str, Any] | None  # status.canary
    rollback: dict[str, Any] | None  # status.rollback: the last rolled-back key (kept until the spec changes)
    events: tuple[tuple[str, str, str], ...] = ()
    analyze: bool = False  # an evaluation is due: run it and advance again with its outcome
    look_again: float | None = None


def canary_replicas(total: int, weight: int, canary_min: int) -> int:
    """Canary pods for `weight` percent of `total`: at least canary_min, at most the total."""
    return min(max(canary_min, math.ceil(total * weight / 100)), max(total, canary_min))


def advance(policy: Policy, *, desired_key: str, version: str, engines_ready: bool, state: Mapping[str, Any] | None,
            rollback: Mapping[str, Any] | None, canary_ready: int, canary_target: int, stable_done: bool,
            outcome: an.Outcome | None, action: str | None, now: datetime.datetime,
            canary_failed: str | None = None) -> Plan:
    """One step of the machine. `stable_done`: the stable Deployment runs `desired_key`,
    rolled out at full size (the end of Promoting). `outcome`: an evaluation made for this
    call (only when the previous call asked for one). `canary_failed`: why the canary's pods
    never become Ready (their warm-up samples failed), which rolls it back."""
    if rollback and rollback.get("engineKey") == desired_key:
        return Plan(None, False, None, dict(rollback))  # rolled back: not retried until the spec changes
    events: list[tuple[str, str, str]] = []
    s = dict(state) if state else None
    if s is not None and s.get("engineKey") != desired_key:
        events.append(("Normal", "RolloutSuperseded",
                       f"the rollout of engine {s.get('engineKey')} gave way to engine {desired_key}"))
        s = None
    if s is None:
        if not engines_ready:
            return Plan(None, False, None, None, tuple(events))
        weight = policy.steps[0][0]
        s = {"version": version, "engineKey": desired_key, "phase": PROGRESSING, "step": 0, "targetWeight": weight,
             "weight": 0, "startedAt": sig.format_time(now), "analysisFailures": 0}
        events.append(("Normal", "RolloutStarted", f"canary of engine {desired_key} (version {version}) starts "
                       + ("in a shadow step: copies of the stable pods' requests, no client traffic" if weight == 0
                          else f"at {weight}% of traffic")))
    if action == ABORT:
        return _rolled_back(s, now, "aborted by hand (kiln rollout abort)", events)
    if canary_failed and s["phase"] != PROMOTING:
        events.append(("Warning", "WarmupFailed", f"canary of engine {desired_key}: {canary_failed}"))
        return _rolled_back(s, now, f"its pods failed their warm-up samples: {canary_failed}", events)
    if action == PROMOTE and s["phase"] != PROMOTING:
        s["phase"] = PROMOTING
        events.append(("Normal", "Promoting", f"engine {desired_key} promoted by hand (kiln rollout promote)"))
    if s["phase"] == PROMOTING:
        if stable_done:
            events.append(("Normal", "Promoted", f"engine {desired_key} (version {version}) is stable"))
            return Plan(None, False, None, None, tuple(events))
        return Plan(desired_key, True, s, None, tuple(events))

    if outcome is not None:
        s["lastAnalysis"] = {"time": sig.format_time(now), "result": outcome.result, "message": outcome.message[:512],
                             "checks": [dict(c) for c in outcome.checks]}
        if outcome.result == an.FAILED:
            s["analysisFailures"] = int(s.get("analysisFailures", 0)) + 1
            if s["analysisFailures"] > policy.failure_limit:
                return _rolled_back(s, now, f"analysis failed {s['analysisFailures']} time(s): {_failing(outcome)}",
                                    events)
            events.append(("Warning", "AnalysisFailed", f"step {s['step'] + 1}: {_failing(outcome)} "
                           f"({s['analysisFailures']} of {policy.failure_limit} tolerated)"))

    if not s.get("stepStartedAt"):
        if canary_ready < canary_target:  # a Deployment event brings the next call; look again anyway
            return Plan(desired_key, False, s, None, tuple(events), look_again=policy.interval)
        s["stepStartedAt"], s["weight"] = sig.format_time(now), s["targetWeight"]
    started = sig.parse_time(s["stepStartedAt"])
    in_step = (now - started).total_seconds()
    pause = policy.steps[s["step"]][1]
    last = s.get("lastAnalysis") or {}
    evaluated_in_step = bool(last) and sig.parse_time(last["time"]) >= started
    since_analysis = math.inf if not last else (now - sig.parse_time(last["time"])).total_seconds()
    if since_analysis >= policy.interval and outcome is None:
        return Plan(desired_key, False, s, None, tuple(events), analyze=True)
    if in_step >= pause:
        if evaluated_in_step and last["result"] == an.PASSED:
            if s["step"] + 1 < len(policy.steps):
                s["step"] += 1
                s["targetWeight"] = policy.steps[s["step"]][0]
                s.pop("stepStartedAt")
                s["phase"] = PROGRESSING
                events.append(("Normal", "RolloutStep", f"step {s['step'] + 1} of {len(policy.steps)}: canary to "
                               f"{s['targetWeight']}% of traffic"))
                # Look again soon: the step's pods may be Ready already (no Deployment event comes).
                return Plan(desired_key, False, s, None, tuple(events), look_again=1.0)
            s["phase"] = PROMOTING
            events.append(("Normal", "Promoting", f"every step passed: engine {desired_key} becomes stable"))
            return Plan(desired_key, True, s, None, tuple(events))
        if s["phase"] != PAUSED:
            why = last.get("message") if evaluated_in_step else "no analysis yet in this step"
            events.append(("Warning", "RolloutPaused", f"step {s['step'] + 1} cannot end: {why}"))
        s["phase"] = PAUSED
    wait = [policy.interval - since_analysis] + ([pause - in_step] if in_step < pause else [])
    return Plan(desired_key, False, s, None, tuple(events), look_again=max(min(wait), 0.5))


def _failing(outcome: an.Outcome) -> str:
    bad = [c for c in outcome.checks if c["result"] == an.FAILED] or list(outcome.checks)
    return "; ".join(f"{c['name']} = {_shown(c['value'])} (min {c['min']}, max {c['max']})"
                     + (f", {c['detail']}" if c.get("detail") else "") + f" from {c['query']}" for c in bad)


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _rolled_back(s: Mapping[str, Any], now: datetime.datetime, reason: str,
                 events: list[tuple[str, str, str]]) -> Plan:
    rollback = {"engineKey": s["engineKey"], "version": s.get("version", ""), "time": sig.format_time(now),
                "reason": reason[:1024], "step": s.get("step", 0)}
    events.append(("Warning", "RolledBack", f"engine {s['engineKey']} rolled back at step {s.get('step', 0) + 1}, "
                   f"all traffic on stable: {reason}"))
    return Plan(None, False, None, rollback, tuple(events))
