"""The scaling step: how many runtime replicas, and `status.scaling`.

Owns the replica count (`Scale`: the total, which the rollout step splits between the
tracks and the serving step applies as `spec.replicas` alone, so a scale change never rolls
the pods) and `status.scaling`. The count is `spec.runtime.replicas`, the field the scale
subresource exposes: `kubectl scale`, an HPA or KEDA may write it, and so does Kiln's
autoscaler. With `autoscaling.enabled` the Deployment's template leaves replicas out
(KServe's rule).

The autoscaler is `decide`, a pure function of the policy (the spec), the signals the alert
receiver recorded (`signals.py`), the state it keeps in `status.scaling` and the clock:

- it steps only on an active alert (firing, and heard of within the signal TTL), and only
  on evidence delivered after its previous change: no alert, a resolved one, a stale one or
  KilnUtilizationMissing is a hold. Missing metrics never read as zero load.
- up: by the utilization's excess over the target (HPA's ratio), at least 1, at most
  `maxStep`, never above `maxReplicas`; not while the last step's pods are not Ready yet,
  nor within `scaleUpCooldownSeconds` of the last change.
- down: only when KilnUtilizationLow has fired for `scaleDownStabilizationSeconds`, and
  `scaleDownCooldownSeconds` after the last change; at most `maxStep`, never below `minReplicas`.
- a change made by someone else (`kubectl scale`) is recorded and kept, not fought: it
  starts the cooldowns like any change. Only a count outside [min, max] is put back.

Each change, and each new reason to hold, goes into the bounded history and an Event.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Mapping

from kiln.operator import builders
from kiln.operator import signals as sig
from kiln.operator.kube import ApiError
from kiln.operator.steps import Event, Owns, Pass, StepResult
from kiln.runtime import contract

OWNS = Owns(fields=("scaling",), sticky=("scaling",))
HISTORY = 10  # status.scaling.history entries kept


@dataclasses.dataclass(frozen=True)
class Scale:
    replicas: int
    autoscaled: bool  # the count is not part of the applied template


@dataclasses.dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target: float  # utilization ratio, 0..1
    max_step: int
    up_cooldown: float
    down_cooldown: float
    stabilization: float

    @classmethod
    def from_spec(cls, auto: Mapping[str, Any]) -> "Policy":
        """From a defaulted spec's `autoscaling` (the CRD holds the defaults)."""
        return cls(int(auto["minReplicas"]), int(auto["maxReplicas"]), int(auto["targetGPUUtilization"]) / 100,
                   int(auto["maxStep"]), float(auto["scaleUpCooldownSeconds"]),
                   float(auto["scaleDownCooldownSeconds"]), float(auto["scaleDownStabilizationSeconds"]))


@dataclasses.dataclass(frozen=True)
class Decision:
    replicas: int  # what spec.runtime.replicas should be
    reason: str | None  # None: nothing worth recording (steady, or the same hold as before)
    source: str = ""  # the alert, "scale" (someone else), or "bounds"
    message: str = ""
    look_again: float | None = None  # seconds until the decision could change without any event


def decide(policy: Policy, current: int, ready: int, signals: Mapping[str, sig.Signal],
           state: Mapping[str, Any], now: datetime.datetime, ttl: float) -> Decision:
    """The autoscaler, as a pure function (the module docstring says the rules)."""
    last_change = _time(state.get("lastScaleTime"))
    external = state.get("replicas") is not None and int(state["replicas"]) != current
    if not policy.min_replicas <= current <= policy.max_replicas:
        bounded = min(max(current, policy.min_replicas), policy.max_replicas)
        return Decision(bounded, "OutsideBounds", "scale" if external else "bounds",
                        f"{current} is outside [{policy.min_replicas}, {policy.max_replicas}]")
    if external:
        return Decision(current, "ScaledExternally", "scale",
                        f"spec.runtime.replicas set to {current} outside the autoscaler; kept")
    active = {name: s for name, s in signals.items() if s.active(now, ttl)}
    if sig.MISSING in active:
        return Decision(current, "NoMetrics", sig.MISSING, "the utilization metric is missing: holding")
    high, low = active.get(sig.HIGH), active.get(sig.LOW)
    if high and low:
        return Decision(current, "ConflictingSignals", f"{sig.HIGH},{sig.LOW}", "high and low at once: holding")
    signal, name = (high, sig.HIGH) if high else (low, sig.LOW) if low else (None, "")
    if signal is None or (last_change is not None and signal.seen <= last_change):
        return Decision(current, None)  # nothing to act on, or nothing new since the last change
    since_change = math.inf if last_change is None else (now - last_change).total_seconds()
    seen = "" if signal.value is None else f"utilization {signal.value:.2f}, target {policy.target:.2f}"
    if name == sig.HIGH:
        if current >= policy.max_replicas:
            return Decision(current, "AtMaxReplicas", name, _says(seen, f"at maxReplicas {policy.max_replicas}"))
        if ready < current:
            return Decision(current, "WaitingForReplicas", name, _says(seen, f"{ready}/{current} replica(s) ready"))
        if since_change < policy.up_cooldown:
            return Decision(current, "CooldownActive", name, _says(seen, "scale-up cooldown"),
                            look_again=policy.up_cooldown - since_change)
        want = current + 1 if signal.value is None else math.ceil(current * signal.value / policy.target)
        to = min(policy.max_replicas, current + policy.max_step, max(current + 1, want))
        return Decision(to, "UtilizationHigh", name, seen)
    if current <= policy.min_replicas:
        return Decision(current, "AtMinReplicas", name, _says(seen, f"at minReplicas {policy.min_replicas}"))
    low_for = (now - signal.starts_at).total_seconds()
    if low_for < policy.stabilization:
        return Decision(current, "Stabilizing", name, _says(seen, f"low for {low_for:.0f}s of the "
                        f"{policy.stabilization:.0f}s stabilization window"), look_again=policy.stabilization - low_for)
    if since_change < policy.down_cooldown:
        return Decision(current, "CooldownActive", name, _says(seen, "scale-down cooldown"),
                        look_again=policy.down_cooldown - since_change)
    want = current - 1 if signal.value is None else math.ceil(current * signal.value / policy.target)
    to = max(policy.min_replicas, current - policy.max_step, min(current - 1, want))
    return Decision(to, "UtilizationLow", name, seen)


def next_state(state: Mapping[str, Any], current: int, d: Decision,
               now: datetime.datetime) -> tuple[dict[str, Any], bool]:
    """status.scaling after `d` (the count it stands at, the last change, a bounded history),
    and whether `d` made a new history entry (a repeat of the last one does not)."""
    history = list(state.get("history") or [])
    out: dict[str, Any] = {k: v for k, v in state.items() if k in ("lastScaleTime", "lastDecision", "generation")}
    out["replicas"] = d.replicas
    recorded = False
    if d.reason is not None:
        entry = {"time": sig.format_time(now), "from": current, "to": d.replicas, "reason": d.reason,
                 "source": d.source, "message": d.message[:256]}
        last = history[-1] if history else {}
        if any(last.get(k) != entry[k] for k in ("from", "to", "reason", "source")):
            history, recorded = (history + [entry])[-HISTORY:], True
            out["lastDecision"] = f"{current}->{d.replicas} {d.reason}"
        if d.replicas != current or d.reason == "ScaledExternally":
            out["lastScaleTime"] = sig.format_time(now)
    out["history"] = history
    return out, recorded


def event_of(current: int, d: Decision, recorded: bool) -> Event | None:
    if d.reason is None or not recorded:
        return None
    if d.replicas > current:
        return ("Normal", "ScaledUp", f"{current} -> {d.replicas} replicas: {d.reason} ({d.source}) {d.message}".strip())
    if d.replicas < current:
        return ("Normal", "ScaledDown", f"{current} -> {d.replicas} replicas: {d.reason} ({d.source}) {d.message}".strip())
    return ("Normal", "ScalingHeld", f"{current} replicas: {d.reason} ({d.source}) {d.message}".strip())


def _says(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _time(text: Any) -> datetime.datetime | None:
    try:
        return sig.parse_time(text)
    except ValueError:
        return None


# ------------------------------------------------------------------------ the step

async def step(p: Pass) -> StepResult:
    auto = p.spec.get("autoscaling") or {}
    metrics = p.ctx.metrics
    if not auto.get("enabled") or p.invalid is not None:
        metrics.forget(p.ns, p.name)
        return StepResult(out=Scale(builders.desired_replicas(p.spec), bool(auto.get("enabled"))))
    state = p.previous.get("scaling") if isinstance(p.previous.get("scaling"), dict) else {}
    if int(state.get("generation") or 0) > p.generation:
        # A view older than the autoscaler's own last write (a watch event still in flight):
        # deciding from it would undo that write.
        return StepResult(out=Scale(int(state["replicas"]), True))
    current = int((p.spec.get("runtime") or {}).get("replicas", 1))
    ready = sum(int(((p.views.deployment(p.ns, builders.runtime_name(p.name, t)) or {}).get("status") or {})
                    .get("readyReplicas") or 0) for t in (builders.STABLE, builders.CANARY))
    now = p.ctx.clock()
    d = decide(Policy.from_spec(auto), current, ready, sig.parse(p.model["metadata"].get("annotations")),
               state, now, p.ctx.config.signal_ttl_seconds)
    new_state, recorded = next_state(state, current, d, now)
    if d.replicas != current:
        generation = await _write_replicas(p, d.replicas)
        if generation is None:  # changed meanwhile: the pass its watch event brings decides again
            return StepResult(out=Scale(builders.desired_replicas(p.spec), True))
        new_state["generation"] = generation
    told = event_of(current, d, recorded)
    if told:
        p.record(*told)
        direction = "up" if d.replicas > current else "down" if d.replicas < current else "hold"
        metrics.decisions.labels(p.ns, p.name, direction).inc()
    metrics.set_autoscaled(p.ns, p.name, auto, d.replicas)
    return StepResult(status={"scaling": new_state}, out=Scale(d.replicas, True), wake_after=d.look_again)


async def _write_replicas(p: Pass, replicas: int) -> int | None:
    """spec.runtime.replicas (the scale subresource's field), conditional on the version decided
    from: another writer in between (a person, a second operator) wins, and we decide again.
    The new generation, or None when the write lost."""
    body = {"metadata": {"resourceVersion": p.model["metadata"].get("resourceVersion")},
            "spec": {"runtime": {"replicas": replicas}}}
    try:
        written = await p.ctx.kube.patch(contract.KIND, p.ns, p.name, body)
    except ApiError as e:
        if e.status in (404, 409):
            return None
        raise
    return int(written["metadata"].get("generation") or 0)

