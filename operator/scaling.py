"""The scaling step: how many runtime replicas, and `status.scaling`.

Owns the replica count (`Scale`: the total, which the rollout step splits between the
tracks and the serving step applies as `spec.replicas` alone, so a scale change never rolls
the pods) and `status.scaling`. The count is `spec.runtime.replicas`, the field the scale
subresource exposes: `kubectl scale`, an HPA or KEDA may write it, and so does Kiln's
autoscaler. With `autoscaling.enabled` the Deployment's template leaves replicas out
(KServe's rule).

The autoscaler is `decide`, a pure function of the policy (the spec), the signals the alert
receiver recorded (`signals.py`), the state it keeps in `status.scaling` and the clock:

- it steps only on an active alert (firing, and heard of within the signal TTL): no alert, a
  resolved one, a stale one or KilnUtilizationMissing is a hold. Missing metrics never read
  as zero load. KilnUtilizationSurge (far above the target on a short window, at once) is a
  scale-up as KilnUtilizationHigh is; an up and a down alert both active is the newer one.
- up: toward the count the evidence asks for (`status.scaling.goal`: the HPA's
  ceil(replicas x utilization / target), at least one more), at most `maxStep` at a time,
  never above `maxReplicas`; not while the last step's pods are not Ready yet, nor within
  `scaleUpCooldownSeconds` of the last change. While the alert stays firing and fresh, the
  next step comes after the cooldown without waiting for a new delivery (Alertmanager
  repeats an unchanged alert only every repeat_interval); a delivery since the last change
  sets the goal again from the count now serving. An alert without a value steps by one.
- down: likewise toward the goal, only when KilnUtilizationLow has fired for
  `scaleDownStabilizationSeconds`, and `scaleDownCooldownSeconds` after the last change; at
  most `maxStep` at a time, never below `minReplicas`.
- a change made by someone else (`kubectl scale`, the activator's scale from zero) is
  recorded and kept, not fought: it starts the cooldowns like any change. Only a count
  outside [min, max] is put back.
- to zero (`_idle`): only with minReplicas 0, once KilnModelIdle ("no requests", not low
  utilization) has been active for `scaleToZeroAfterSeconds` with no scale change since,
  and only where the activator is installed (it holds the requests that bring the model
  back), else a hold that says so. Utilization alone never goes below one replica.

Each change, and each new reason to hold, goes into the bounded history and an Event.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Mapping

from kiln.operator import manifests
from kiln.operator import signals as sig
from kiln.operator.plan import targets_of
from kiln.operator.kube import ApiError
from kiln.operator.steps import Event, Owns, Pass, StepResult
from kiln.runtime.api import contract, enginekey

OWNS = Owns(fields=("scaling",), sticky=("scaling",))
HISTORY = 10  # status.scaling.history entries kept
# scaleToZeroAfterSeconds when unset: the operator's default, not the CRD's, so the defaulted
# spec of a model that does not scale to zero is what it was.
DEFAULT_TO_ZERO_AFTER = 300.0


@dataclasses.dataclass(frozen=True)
class Scale:
    replicas: int
    autoscaled: bool  # the count is not part of the applied template
    # The count serving before a scale-up whose new pods may still be starting (within the
    # startup budget): while those are up, fewer ready than desired is scaling, not degraded.
    scaling_up_from: int | None = None


@dataclasses.dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target: float  # utilization ratio, 0..1
    max_step: int
    up_cooldown: float
    down_cooldown: float
    stabilization: float
    to_zero_after: float = DEFAULT_TO_ZERO_AFTER  # scaleToZeroAfterSeconds: KilnModelIdle this long (minReplicas 0)
    activator: bool = False  # installed: a model at zero gets its requests held, so it may go there

    @classmethod
    def from_spec(cls, auto: Mapping[str, Any], activator: bool = False) -> "Policy":
        """From a defaulted spec's `autoscaling` (the CRD holds the defaults)."""
        return cls(int(auto["minReplicas"]), int(auto["maxReplicas"]), int(auto["targetGPUUtilization"]) / 100,
                   int(auto["maxStep"]), float(auto["scaleUpCooldownSeconds"]),
                   float(auto["scaleDownCooldownSeconds"]), float(auto["scaleDownStabilizationSeconds"]),
                   float(auto.get("scaleToZeroAfterSeconds", DEFAULT_TO_ZERO_AFTER)), activator)

    @property
    def floor(self) -> int:
        """The fewest replicas utilization may scale down to (zero is only ever the idle signal's)."""
        return max(1, self.min_replicas)


@dataclasses.dataclass(frozen=True)
class Decision:
    replicas: int  # what spec.runtime.replicas should be
    reason: str | None  # None: nothing worth recording (steady, or the same hold as before)
    source: str = ""  # the alert, "scale" (someone else), or "bounds"
    message: str = ""
    look_again: float | None = None  # seconds until the decision could change without any event
    goal: int | None = None  # the count the alert's evidence asks for, kept while it stays firing


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
    d = _on_utilization(policy, current, ready, active, state, now, last_change)
    idle = active.get(sig.IDLE) if policy.min_replicas == 0 and current > 0 else None
    return d if idle is None else _idle(policy, current, idle, last_change, now, d)


def _idle(policy: Policy, current: int, idle: sig.Signal, last_change: datetime.datetime | None,
          now: datetime.datetime, otherwise: Decision) -> Decision:
    """KilnModelIdle is active and the model may go to zero: to zero once it has been idle
    for `to_zero_after` since it last changed size (an activation brought it back: a full
    idle time again); until then `otherwise` (what utilization says), woken when the time is up."""
    since = idle.starts_at if last_change is None else max(idle.starts_at, last_change)
    idle_for = (now - since).total_seconds()
    if idle_for < policy.to_zero_after:
        wait, later = policy.to_zero_after - idle_for, otherwise.look_again
        return dataclasses.replace(otherwise, look_again=wait if later is None else min(later, wait))
    said = f"no requests for {idle_for:.0f}s (scaleToZeroAfterSeconds {policy.to_zero_after:.0f})"
    if not policy.activator:
        return Decision(current, "NoActivator", sig.IDLE,
                        f"{said}, but the activator is not installed (the chart's activator.enabled): "
                        f"nothing would hold the requests at zero; holding at {current}")
    return Decision(0, "ScaledToZero", sig.IDLE, said)


def _on_utilization(policy: Policy, current: int, ready: int, active: Mapping[str, sig.Signal],
                    state: Mapping[str, Any], now: datetime.datetime,
                    last_change: datetime.datetime | None) -> Decision:
    """The utilization alerts' decision (the module docstring says the rules)."""
    if sig.MISSING in active:
        return Decision(current, "NoMetrics", sig.MISSING, "the utilization metric is missing: holding")
    ups = [(name, active[name]) for name in sig.UP if name in active]
    up = max(ups, key=lambda u: u[1].value if u[1].value is not None else -1.0) if ups else None
    low = (sig.LOW, active[sig.LOW]) if sig.LOW in active else None
    if up and low:
        # One utilization is never above and below its target at once: the newer episode is
        # the present, and the older one's resolution is on its way (Alertmanager sends it at
        # the group's next interval). Only a tie is a conflict.
        if up[1].starts_at == low[1].starts_at:
            return Decision(current, "ConflictingSignals", f"{up[0]},{sig.LOW}", "high and low at once: holding")
        up, low = (up, None) if up[1].starts_at > low[1].starts_at else (None, low)
    if up is None and low is None:
        return Decision(current, None)
    name, signal = up or low
    delivered_since = last_change is None or signal.seen > last_change
    goal = _goal(policy, current, signal, state, delivered_since, up=up is not None)
    if goal is None:
        return Decision(current, None)  # nothing new since the last change, and nothing more asked
    since_change = math.inf if last_change is None else (now - last_change).total_seconds()
    return _toward(policy, current, ready, name, signal, goal, since_change, now)


def _toward(policy: Policy, current: int, ready: int, name: str, signal: sig.Signal, goal: int,
            since_change: float, now: datetime.datetime) -> Decision:
    """A step toward `goal` for the active alert `name`, or the hold that keeps it waiting."""
    seen = "" if signal.value is None else f"utilization {signal.value:.2f}, target {policy.target:.2f}"
    if name in sig.UP:
        if current >= policy.max_replicas:
            return Decision(current, "AtMaxReplicas", name, _says(seen, f"at maxReplicas {policy.max_replicas}"),
                            goal=goal)
        if ready < current:
            return Decision(current, "WaitingForReplicas", name, _says(seen, f"{ready}/{current} replica(s) ready"),
                            goal=goal)
        if since_change < policy.up_cooldown:
            return Decision(current, "CooldownActive", name, _says(seen, "scale-up cooldown"),
                            look_again=policy.up_cooldown - since_change, goal=goal)
        to = min(policy.max_replicas, current + policy.max_step, goal)
        return Decision(to, "UtilizationHigh", name, _says(seen, f"goal {goal}"), goal=goal)
    if current <= policy.floor:
        return Decision(current, "AtMinReplicas", name, _says(seen, f"at minReplicas {policy.min_replicas}"
                        if policy.min_replicas else "at 1 replica (only no requests at all goes to zero)"), goal=goal)
    low_for = (now - signal.starts_at).total_seconds()
    if low_for < policy.stabilization:
        return Decision(current, "Stabilizing", name, _says(seen, f"low for {low_for:.0f}s of the "
                        f"{policy.stabilization:.0f}s stabilization window"),
                        look_again=policy.stabilization - low_for, goal=goal)
    if since_change < policy.down_cooldown:
        return Decision(current, "CooldownActive", name, _says(seen, "scale-down cooldown"),
                        look_again=policy.down_cooldown - since_change, goal=goal)
    to = max(policy.floor, current - policy.max_step, goal)
    return Decision(to, "UtilizationLow", name, _says(seen, f"goal {goal}"), goal=goal)


def _goal(policy: Policy, current: int, signal: sig.Signal, state: Mapping[str, Any],
          delivered_since: bool, up: bool) -> int | None:
    """The count a firing alert asks for, or None when it asks for nothing more: from a
    delivery since the last change, the HPA's ratio over the count serving now (at least one
    step); from older evidence, the goal set when it arrived (None after an older operator,
    which kept none)."""
    if signal.value is None:
        return current + (1 if up else -1)  # no measure of the excess: one per cooldown while it fires
    if delivered_since:
        want = math.ceil(current * signal.value / policy.target)
        return max(current + 1, want) if up else min(current - 1, want)
    goal = state.get("goal")
    if not isinstance(goal, int):
        return None
    goal = min(max(goal, policy.floor), policy.max_replicas)  # at a bound, old news asks nothing
    return goal if (goal > current if up else goal < current) else None


def utilization_signal(targets: list[str], concurrency: float) -> str:
    """What the chart's rules (kiln.utilizationExpr) read as this model's utilization, for
    status.scaling.signal: with containerConcurrency, requests in flight; on a GPU engine, the
    GPU; on CPU engines, each pod's bottleneck (a light model saturates its front ends or its
    CPU limit long before its engine)."""
    if concurrency > 0:
        return f"concurrency: requests in flight per pod / {concurrency:g}"
    if any(t != enginekey.CPU_TARGET for t in targets):
        return "gpu: GPU utilization (engine busy fraction without a GPU metric)"
    return "cpu: per pod the highest of engine busy, front ends busy, CPU / CPU limit"


def next_state(state: Mapping[str, Any], current: int, d: Decision,
               now: datetime.datetime) -> tuple[dict[str, Any], bool]:
    """status.scaling after `d` (the count it stands at, the last change, a bounded history),
    and whether `d` made a new history entry (a repeat of the last one does not)."""
    history = list(state.get("history") or [])
    out: dict[str, Any] = {k: v for k, v in state.items() if k in ("lastScaleTime", "lastDecision", "generation")}
    out["replicas"] = d.replicas
    if d.goal is not None:
        out["goal"] = d.goal
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
        return StepResult(out=Scale(manifests.desired_replicas(p.spec), bool(auto.get("enabled"))))
    state = p.previous.get("scaling") if isinstance(p.previous.get("scaling"), dict) else {}
    now, budget = p.ctx.clock(), p.ctx.config.startup_budget_seconds
    if int(state.get("generation") or 0) > p.generation:
        # A view older than the autoscaler's own last write (a watch event still in flight):
        # deciding from it would undo that write.
        return StepResult(out=Scale(int(state["replicas"]), True, scaled_up_from(state, now, budget)))
    current = int((p.spec.get("runtime") or {}).get("replicas", 1))
    ready = sum(int(((p.views.deployment(p.ns, manifests.runtime_name(p.name, t)) or {}).get("status") or {})
                    .get("readyReplicas") or 0) for t in (manifests.STABLE, manifests.CANARY))
    d = decide(Policy.from_spec(auto, activator=p.ctx.config.activator_service is not None), current, ready, sig.parse(p.model["metadata"].get("annotations")),
               state, now, p.ctx.config.signal_ttl_seconds)
    new_state, recorded = next_state(state, current, d, now)
    new_state["signal"] = utilization_signal(targets_of(p.spec, p.ctx.config), p.ctx.config.container_concurrency)
    if d.replicas != current:
        generation = await _write_replicas(p, d.replicas)
        if generation is None:  # changed meanwhile: the pass its watch event brings decides again
            return StepResult(out=Scale(manifests.desired_replicas(p.spec), True, scaled_up_from(state, now, budget)))
        new_state["generation"] = generation
    told = event_of(current, d, recorded)
    if told:
        p.record(*told)
        direction = "up" if d.replicas > current else "down" if d.replicas < current else "hold"
        metrics.decisions.labels(p.ns, p.name, direction).inc()
    metrics.set_autoscaled(p.ns, p.name, auto, d.replicas)
    return StepResult(status={"scaling": new_state}, wake_after=d.look_again,
                      out=Scale(d.replicas, True, scaled_up_from(new_state, now, budget)))


def scaled_up_from(state: Mapping[str, Any], now: datetime.datetime, within: float) -> int | None:
    """The count before the last change, when that change was a scale-up less than `within` ago
    (holds recorded since, such as WaitingForReplicas, come after it in the history)."""
    changed = _time(state.get("lastScaleTime"))
    change = next((h for h in reversed(state.get("history") or []) if h.get("time") == state.get("lastScaleTime")),
                  None)
    if changed is None or change is None or not int(change.get("to", 0)) > int(change.get("from", 0)):
        return None
    return int(change["from"]) if (now - changed).total_seconds() < within else None


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

