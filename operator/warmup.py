"""What a runtime Deployment's pods say about their warm-up samples (spec.runtime.warmup): a
pod whose samples fail exits with `WarmupFailed` and never becomes Ready; the serving step
shows it in `Available` and `Degraded`, and the rollout step rolls such a canary back.

The pods are listed, not kept in an index (memory stays flat at hundreds of models), and only
for a track whose pod the watch saw end so (handlers.on_runtime_pod_event marks it in
`Context.warmup_failing` and wakes the model) while its Deployment is not fully Ready: a
model scaling up or rolling out costs no call.
"""

from __future__ import annotations

from typing import Any, Mapping

from kiln.operator import manifests, observations
from kiln.operator.steps import Pass
from kiln.runtime.api import contract


async def failure(p: Pass, dep: Mapping[str, Any] | None) -> str | None:
    """Why the current pods of the runtime Deployment `dep` (as the index shows it) fail
    their warm-up, else None."""
    seen = observations.observe_deployment(dep)
    if not seen.exists:
        return None
    template = (dep.get("spec") or {}).get("template") or {}
    track = ((template.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_TRACK, manifests.STABLE)
    key = (p.ns, p.name, track)
    if key not in p.ctx.warmup_failing or (seen.rolled_out and seen.ready >= seen.desired):
        p.ctx.warmup_failing.discard(key)
        return None
    containers = (template.get("spec") or {}).get("containers") or [{}]
    selector = ",".join(f"{k}={v}" for k, v in manifests.selector_labels(p.name, track).items())
    pods = await p.ctx.kube.list("Pod", p.ns, selector)
    failure = observations.warmup_failure(pods, containers[0].get("args"))
    if failure is None:
        p.ctx.warmup_failing.discard(key)  # a new template, or the failing pods went
    return failure
