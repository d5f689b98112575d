"""The seam every concern step plugs into: what a step reads, what it returns, who owns what.

A step is `async def step(p: Pass) -> StepResult`. It observes through `p.views` (kopf
indexes in production, plain dicts in tests), decides with pure functions, acts through
`p.ctx.kube`, records each Event of what it did the moment it did it (`p.record`, so an
error raised later loses none), and returns only what it owns (`OWNS`). The reconcile
merges the results (`merge`), derives the phase from the conditions (`PHASES`) and writes
status once. A request the API server refuses stops the pass at the step that made it
(`refused`): status and an Event say so, and the reconcile tries again with a backoff.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Callable, Mapping

from kiln.operator import conditions as cond
from kiln.operator.config import OperatorConfig
from kiln.operator.kube import ApiError, Kube
from kiln.operator.metrics import OperatorMetrics
from kiln.operator.plan import EngineRef, plan_engines
from kiln.runtime.api import spec as specmod

Event = tuple[str, str, str]  # (type, reason, message)
Condition = tuple[bool, str, str]  # (status, reason, message)


@dataclasses.dataclass
class Views:
    """Read access to what the operator watches (kopf indexes in production, dicts in tests)."""

    job: Callable[[str, str], Mapping[str, Any] | None]
    pods: Callable[[str, str], list[Mapping[str, Any]]]
    deployment: Callable[[str, str], Mapping[str, Any] | None]
    service: Callable[[str, str], Mapping[str, Any] | None]
    engine_index: Callable[[str], Mapping[str, str]]
    # (namespace, model uid) -> the build Jobs that model created (its controller ownerReference)
    owned_jobs: Callable[[str, str], list[Mapping[str, Any]]] = lambda ns, uid: []
    # (namespace, Job name) -> names of the models whose current spec needs that Job
    models_needing: Callable[[str, str], set[str]] = lambda ns, job: set()


@dataclasses.dataclass
class Context:
    """What lives as long as the operator process: configuration, client, clock, memory."""

    config: OperatorConfig
    kube: Kube
    clock: cond.Clock = cond.utcnow
    metrics: OperatorMetrics = dataclasses.field(default_factory=OperatorMetrics)
    # Reconciles a model again after a delay: (namespace, name, uid, seconds). handlers.py sets it.
    wake: Callable[[str, str, str, float], None] = lambda ns, name, uid, seconds: None
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    results: dict[tuple[str, str], dict[str, Any]] = dataclasses.field(default_factory=dict)
    last_status: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # (namespace, kind, route) -> the canary weight set on that HTTPRoute or GRPCRoute
    route_weights: dict[tuple[str, str, str], int] = dataclasses.field(default_factory=dict)
    # (namespace, model) -> the shadow config last written to `<model>-shadow` ("" for none)
    shadow_configs: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    # (namespace, model, track) whose runtime pod the watch saw end with WarmupFailed (warmup.py)
    warmup_failing: set[tuple[str, str, str]] = dataclasses.field(default_factory=set)
    signals_seen: dict[str, str] = dataclasses.field(default_factory=dict)  # uid -> the signal record last acted on
    replaced_jobs: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # -> uid of the deleted Job
    # (namespace, Deployment) -> the applied hash whose drift a patch could not undo (someone
    # keeps changing it back, e.g. a mutating webhook): not fought in a loop until the hash changes.
    stuck_drift: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    plans: dict[str, tuple[str, dict[str, Any], list[str], list[EngineRef]]] = dataclasses.field(
        default_factory=dict)
    refusals: dict[str, int] = dataclasses.field(default_factory=dict)  # uid -> passes refused in a row (backoff)
    # (namespace, engine index key): taken out of the index by cache GC; what the index view
    # still shows of it is not believed until a build records it again (cachegc.py).
    gc_forgotten: set[tuple[str, str]] = dataclasses.field(default_factory=set)

    def plan(self, uid: str, raw_spec: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[EngineRef]]:
        """Defaulted spec, validation problems, engines - computed once per distinct spec
        (validating against the CRD schema and its CEL rules costs milliseconds)."""
        text = json.dumps(raw_spec, sort_keys=True, separators=(",", ":"))
        cached = self.plans.get(uid)
        if cached is not None and cached[0] == text:
            return cached[1], cached[2], cached[3]
        spec = specmod.apply_defaults(dict(raw_spec))
        problems = specmod.validate_for_cluster(spec)
        engines: list[EngineRef] = []
        if not problems:
            try:
                engines = plan_engines(spec, self.config)
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
        self.signals_seen.pop(uid, None)
        self.refusals.pop(uid, None)


@dataclasses.dataclass
class Pass:
    """One reconcile of one model: its inputs, what earlier steps decided, the Events so far."""

    ctx: Context
    model: Mapping[str, Any]
    views: Views
    spec: dict[str, Any]
    engines: list[EngineRef]
    invalid: str | None  # why the spec cannot work; steps then act on nothing
    previous: Mapping[str, Any]  # the status as last written
    out: dict[str, Any] = dataclasses.field(default_factory=dict)  # step name -> its `StepResult.out`
    events: list[Event] = dataclasses.field(default_factory=list)

    @property
    def ns(self) -> str:
        return self.model["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.model["metadata"]["name"]

    @property
    def uid(self) -> str:
        return self.model["metadata"]["uid"]

    @property
    def generation(self) -> int:
        return int(self.model["metadata"].get("generation") or 1)

    @property
    def version(self) -> str:
        return str((self.spec.get("model") or {}).get("version", ""))

    def record(self, type_: str, reason: str, message: str) -> None:
        """An Event of something just done: kept even if the pass fails later."""
        self.events.append((type_, reason, message))

    def previous_condition(self, type_: str) -> dict[str, Any]:
        return cond.get_condition(self.previous.get("conditions"), type_) or {}


@dataclasses.dataclass(frozen=True)
class Owns:
    conditions: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    sticky: tuple[str, ...] = ()  # owned fields kept as they are while the step does not set them
    refused: str = ""  # the condition set False (reason ApiRefused) when the API server refuses this step


@dataclasses.dataclass
class StepResult:
    conditions: dict[str, Condition] = dataclasses.field(default_factory=dict)
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)  # from condition transitions
    requeue: float | None = None  # retry after this many seconds (a build Job being replaced)
    wake_after: float | None = None  # reconcile again after this many seconds (a cooldown's end: no event comes)
    waiting: bool = False  # engines are being built or pods are starting
    out: Any = None  # what later steps read (p.out[step name]); never status


# The reconcile's own status fields; every other field and condition belongs to one step.
RECONCILE_OWNS = Owns(fields=("phase", "observedGeneration", "conditions"))  # conditions: the merged list


def owners(steps: Mapping[str, Owns]) -> dict[str, str]:
    """`condition:<type>` / `field:<name>` -> the one step that owns it. Raises if two do."""
    found: dict[str, str] = {}
    for step, owns in {"reconcile": RECONCILE_OWNS, **steps}.items():
        for item in [f"condition:{c}" for c in owns.conditions] + [f"field:{f}" for f in owns.fields]:
            if item in found:
                raise ValueError(f"{item} is owned by both {found[item]} and {step}")
            found[item] = step
    return found


def merge(p: Pass, steps: Mapping[str, Owns], results: Mapping[str, StepResult]) -> dict[str, Any]:
    """The status from every step's result: conditions set the Kubernetes way, then the phase."""
    owners(steps)
    conds = list(p.previous.get("conditions") or [])
    status: dict[str, Any] = {"observedGeneration": p.generation}
    for name, result in results.items():
        owns = steps[name]
        stray = (set(result.conditions) - set(owns.conditions)) | (set(result.status) - set(owns.fields))
        if stray:
            raise ValueError(f"step {name} returned what it does not own: {sorted(stray)}")
        for type_, (value, reason, message) in result.conditions.items():
            conds = cond.set_condition(conds, type_, value, reason, message, p.generation, p.ctx.clock)
        status.update(result.status)
        for field in owns.sticky:
            if field not in result.status and p.previous.get(field) is not None:
                status[field] = p.previous[field]
    status["conditions"] = conds
    status["phase"] = phase_of(conds)
    return status


REFUSED = "ApiRefused"


def refusal(error: ApiError) -> str:
    return (f"the API server refused to {error.action or 'answer a request'} ({error.status} {error.reason}): "
            f"{error.message}; retrying")


def refused(p: Pass, steps: Mapping[str, Owns], results: Mapping[str, StepResult], step: str,
            error: ApiError) -> dict[str, StepResult]:
    """The results of the steps a refused request stopped (`step` and those after it): each
    keeps what it owns as it was; `Degraded`, and the refused step's own condition, say why;
    a Warning Event tells it once (not again while the same refusal repeats)."""
    message = refusal(error)
    out = {name: StepResult(status={f: p.previous[f] for f in owns.fields if p.previous.get(f) is not None})
           for name, owns in steps.items() if name not in results}
    if steps[step].refused:
        out[step].conditions[steps[step].refused] = (False, REFUSED, message)
    owner = owners(steps).get("condition:Degraded")
    if owner is not None:
        (out.get(owner) or results[owner]).conditions["Degraded"] = (True, REFUSED, message)
    told = p.previous_condition("Degraded")
    if (told.get("reason"), told.get("message")) != (REFUSED, message):
        out[step].events.append(("Warning", REFUSED, message))
    return out


ANY = None
# The phase, from the conditions: the first row whose every (type: (status, reason)) matches.
# These phases are the CRD's status.phase enum (tests/operator/test_steps.py checks both ways).
PHASES: tuple[tuple[str, dict[str, tuple[str, str | None]]], ...] = (
    ("Failed", {"EngineReady": (cond.FALSE, "InvalidSpec")}),
    ("Failed", {"EngineReady": (cond.FALSE, "BuildFailed"), "Available": (cond.FALSE, ANY)}),
    ("Failed", {"EngineReady": (cond.FALSE, "OutOfDisk"), "Available": (cond.FALSE, ANY)}),
    ("Degraded", {"Degraded": (cond.TRUE, ANY)}),
    ("Building", {"EngineReady": (cond.FALSE, ANY)}),
    # A canary rollout runs beside the stable version that serves (rollout.canary_progressing's reasons).
    ("Progressing", {"Progressing": (cond.TRUE, "Canary"), "Available": (cond.TRUE, ANY)}),
    ("Progressing", {"Progressing": (cond.TRUE, "RolloutPaused"), "Available": (cond.TRUE, ANY)}),
    ("Progressing", {"Progressing": (cond.TRUE, "Promoting"), "Available": (cond.TRUE, ANY)}),
    ("Deploying", {"Progressing": (cond.TRUE, ANY)}),
    ("Ready", {"Available": (cond.FALSE, "ScaledToZero")}),
    ("Deploying", {"Available": (cond.FALSE, ANY)}),
    ("Ready", {}),
)


def phase_of(conditions: list[dict[str, Any]]) -> str:
    by_type = {c["type"]: c for c in conditions}
    for phase, when in PHASES:
        if all(t in by_type and by_type[t]["status"] == s and r in (ANY, by_type[t]["reason"])
               for t, (s, r) in when.items()):
            return phase
    return "Ready"
