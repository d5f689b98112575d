"""What the operator reads back: a build Job and its pods -> the build's state and result;
a live runtime Deployment -> what it runs and whether it rolled out, and where its pod
template drifted from what Kiln applied.

Pure: tested without a cluster (tests/operator/test_builders.py).

- `job_state`, `termination_result`, `failure_message`: what a finished build Job and its pod say.
- `observe_deployment`, `template_drift`: what a live runtime Deployment says, and where
  its pod template differs from what Kiln applied.
- `serving_pod_addresses`, `pod_load`, `deletion_cost`: which runtime pod a scale-down
  should remove first (the least busy).
- `warmup_failure`: why a runtime Deployment's pods never become Ready, when their warm-up
  samples failed (their termination message).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from kiln.runtime.api import contract
from kiln.runtime.api.contract import LABEL_ENGINE_KEY
from kiln.runtime.api.errors import EXIT_REASONS, SERVE_EXIT_REASONS, WarmupFailed


# ------------------------------------------------------------------------ what a Job says

@dataclasses.dataclass(frozen=True)
class JobState:
    phase: str  # Active | Succeeded | Failed
    reason: str = ""
    message: str = ""


def job_state(job: Mapping[str, Any]) -> JobState:
    status = job.get("status") or {}
    for c in status.get("conditions") or ():
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return JobState("Succeeded")
        if c.get("type") == "Failed":
            return JobState("Failed", c.get("reason") or "BackoffLimitExceeded", c.get("message") or "")
    if status.get("succeeded"):
        return JobState("Succeeded")
    return JobState("Active")


def termination_state(pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest terminated `build` container state among a Job's pods."""
    best = None
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and (best is None or (term.get("finishedAt") or "") >= (best.get("finishedAt") or "")):
                best = term
    return best


def termination_result(pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The build result JSON from the pod's termination message, or None if none is readable."""
    term = termination_state(pods)
    return contract.parse_result(term.get("message")) if term else None


def failure_message(state: JobState, pods: Iterable[Mapping[str, Any]]) -> tuple[str, str]:
    """(reason, message) for a failed build: the Job's condition and what the pod said. The
    reason is BuildFailed, or OutOfDisk when the build ran out of space on the cache claim."""
    pods = list(pods)
    result = termination_result(pods)
    term = termination_state(pods)
    parts = []
    reason = "BuildFailed"
    if result and not result.get("ok"):
        detail = result.get("reason") or ""
        parts.append(f"{detail}: {result.get('message', '')}".strip(": "))
        if detail == "OutOfDisk":
            reason = detail
    elif term is not None:
        code = term.get("exitCode")
        if EXIT_REASONS.get(int(code or 0)) == "OutOfDisk":
            reason = "OutOfDisk"
        parts.append(f"exit code {code} ({EXIT_REASONS.get(int(code or 0)) or term.get('reason') or 'Error'})"
                     + (f": {term['message'].strip()[-500:]}" if term.get("message") else ""))
    job_part = state.reason + (f": {state.message}" if state.message else "")
    if job_part:
        parts.append(f"Job {job_part}")
    return reason, "; ".join(p for p in parts if p) or "the build Job failed"


# ------------------------------------------------------------------------ what a Deployment says

# On a runtime Deployment: the generation whose template was rolled out when Kiln last changed
# its replicas alone (the next generation is then a scale, not a rollout).
ANN_SCALED_FROM = "kiln.dev/scaled-from-generation"
# On the stable Deployment: the hash of the PodDisruptionBudget last applied (no watch shows the budget).
ANN_DISRUPTION_BUDGET = "kiln.dev/disruption-budget-hash"


@dataclasses.dataclass
class DeploymentObservation:
    exists: bool = False
    engine_key: str = ""  # the key its pod template runs
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    desired: int = 0
    rolled_out: bool = False  # the controller saw the latest generation and every pod is updated


def observe_deployment(dep: Mapping[str, Any] | None) -> DeploymentObservation:
    if not dep:
        return DeploymentObservation()
    meta, spec, status = dep.get("metadata") or {}, dep.get("spec") or {}, dep.get("status") or {}
    desired = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    replicas = int(status.get("replicas") or 0)
    generation, observed = int(meta.get("generation") or 0), int(status.get("observedGeneration") or 0)
    # The latest generation only scaled a rolled-out template (`set_replicas` says so): while
    # the controller and the ReplicaSet catch up, that is no rollout, every pod is of the
    # current template.
    scaled = ((meta.get("annotations") or {}).get(ANN_SCALED_FROM) == str(generation - 1)
              and observed >= generation - 1)
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    # The Deployment controller's own word that the rollout completed (its Progressing
    # condition; it stays so when a pod fails later): until then, pods that are still
    # starting are a rollout in progress, not a degradation.
    progressing = next((c for c in status.get("conditions") or () if c.get("type") == "Progressing"), None)
    completed = progressing is None or progressing.get("reason") == "NewReplicaSetAvailable"
    return DeploymentObservation(
        exists=True, engine_key=labels.get(LABEL_ENGINE_KEY, ""), replicas=replicas, ready=ready, updated=updated,
        desired=desired, rolled_out=completed and (updated >= replicas if scaled else
                                                   observed >= generation and updated >= desired and replicas <= desired))


# The container fields Kiln restores when someone else changes them (the kopf index of
# Deployments keeps these, and nothing else of the pod spec).
DRIFT_FIELDS = ("image", "command", "args", "env", "envFrom", "resources", "startupProbe", "readinessProbe",
                "livenessProbe")
_QUANTITY_SUFFIXES = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                      "P": 1e15, "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
                      "Ei": 2**60}


def _quantity(value: Any) -> Any:
    """A resource quantity as a number ("1000m" and 1 are equal), else the value as text."""
    text = str(value)
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if suffix and not text.endswith(suffix):
            continue
        try:
            return round(float(text[:len(text) - len(suffix)] if suffix else text) * _QUANTITY_SUFFIXES[suffix], 9)
        except ValueError:
            continue
    return text


def _covers(live: Any, want: Any, quantities: bool = False) -> bool:
    """`live` has everything `want` has (the API server adds defaults: scheme, successThreshold ...)."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(_covers(live.get(k), v, quantities) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(
            _covers(a, b, quantities) for a, b in zip(live, want))
    if quantities:
        return _quantity(live) == _quantity(want)
    return live == want or (live is not None and str(live) == str(want))


def template_drift(live: Mapping[str, Any] | None, applied: Mapping[str, Any]) -> list[str]:
    """The container fields (`runtime.image`, ...) of the live Deployment that differ from the
    manifest Kiln applied; empty when they match or the live object shows no containers."""
    live_containers = (((live or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("containers")
    if live_containers is None:
        return []
    by_name = {c.get("name"): c for c in live_containers}
    drift = []
    for want in applied["spec"]["template"]["spec"]["containers"]:
        have = by_name.get(want["name"])
        if have is None:
            drift.append(want["name"])
            continue
        for field in DRIFT_FIELDS:
            if field in want:
                same = _covers(have.get(field), want[field], quantities=field == "resources")
            else:
                same = not have.get(field)
            if not same:
                drift.append(f"{want['name']}.{field}")
    drift += [f"{name} (added)" for name in by_name.keys() - {c["name"] for c in applied["spec"]["template"]["spec"]["containers"]}]
    return drift


def slim_containers(containers: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What the Deployments index keeps of each container: its name and DRIFT_FIELDS."""
    return [{k: c[k] for k in ("name", *DRIFT_FIELDS) if k in c} for c in containers]


# ------------------------------------------------------------------------ which pod goes first

# The ReplicaSet controller removes, among Ready pods, the lowest cost first (Kubernetes'
# pod-deletion-cost, beta and on by default since 1.22; unready pods go before any Ready one).
ANN_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
BUSY_RATIO, INFLIGHT = "kiln_engine_busy_ratio", "kiln_inflight_requests"
COST_PER_BUSY = 1000  # the busy ratio in thousandths
COST_PER_REQUEST = 10  # a request in flight weighs as 1 % busy: the load now, beside the last 30 s'
MAX_COST = 2**31 - 1  # the annotation is an int32


@dataclasses.dataclass(frozen=True)
class PodLoad:
    busy_ratio: float  # kiln_engine_busy_ratio: the engines' busy fraction over the last 30 s
    inflight: float  # kiln_inflight_requests: accepted and not yet answered


def pod_load(metrics_text: str) -> PodLoad:
    """A runtime pod's load from its /metrics exposition (ValueError when it is none).
    A pod serves one model; its series are summed (inflight) or the busiest taken (ratio)."""
    from prometheus_client.parser import text_string_to_metric_families

    busy, inflight = 0.0, 0.0
    try:
        for family in text_string_to_metric_families(metrics_text):
            for s in family.samples:
                if s.name in (BUSY_RATIO, INFLIGHT) and s.value != s.value:
                    raise ValueError(f"{s.name} is NaN")
                if s.name == BUSY_RATIO:
                    busy = max(busy, s.value)
                elif s.name == INFLIGHT:
                    inflight += s.value
    except ValueError:
        raise
    except Exception as e:  # the parser raises what it meets; whatever it is, no load was read
        raise ValueError(f"not a Prometheus exposition: {e}") from e
    return PodLoad(busy, inflight)


def deletion_cost(load: PodLoad | None) -> int:
    """The pod's pod-deletion-cost: higher for a busier pod. A pod whose load could not be
    read (None) is 0, the first to go: one that cannot answer its /metrics in time is the one
    least known to serve, and its requests in flight still finish when it drains."""
    if load is None:
        return 0
    busy = min(max(load.busy_ratio, 0.0), 1.0)
    cost = round(COST_PER_BUSY * busy + COST_PER_REQUEST * max(load.inflight, 0.0))
    return min(cost, MAX_COST)


def serving_pod_addresses(pods: Iterable[Mapping[str, Any]], port_name: str) -> dict[str, str]:
    """pod name -> `ip:port` of its `port_name` port, for the Ready pods that are not being
    deleted (the only ones a cost orders)."""
    out = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        ports = [p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or ()
                 for p in c.get("ports") or () if p.get("name") == port_name]
        ip = status.get("podIP")
        if ready and not meta.get("deletionTimestamp") and ip and ports:
            out[meta["name"]] = f"[{ip}]:{ports[0]}" if ":" in ip else f"{ip}:{ports[0]}"
    return out


# ------------------------------------------------------------------------ what a runtime pod says

def warmup_failure(pods: Iterable[Mapping[str, Any]], args: list[str] | None) -> str | None:
    """Why the runtime pods of the current template never become Ready, when their samples
    failed (spec.runtime.warmup): the message `kiln serve` left in its termination log
    (`WarmupFailed: <why>`, exit code WarmupFailed's) of the newest such container among
    `pods` that run `args` (the Deployment's template: pods of an older template that failed
    tell nothing about this one) and are not being deleted; None when none did."""
    newest, message = "", None
    for pod in pods:
        containers = (pod.get("spec") or {}).get("containers") or [{}]
        if (pod.get("metadata") or {}).get("deletionTimestamp") or containers[0].get("args") != args:
            continue
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            for state in (cs.get("state"), cs.get("lastState")):
                term = (state or {}).get("terminated") or {}
                code = term.get("exitCode")
                if not isinstance(code, int) or SERVE_EXIT_REASONS.get(code) != WarmupFailed.reason:
                    continue
                text = " ".join(str(term.get("message") or "").split())
                prefix = f"{WarmupFailed.reason}: "
                said = text[len(prefix):] if text.startswith(prefix) else ""  # else the log's tail: no reason
                if (term.get("finishedAt") or "") >= newest:
                    newest = term.get("finishedAt") or ""
                    message = (said or f"exit code {code}")[:1024]
    return message
