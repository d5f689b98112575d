"""The scaling step: how many runtime replicas, and `status.scaling`.

Owns the replica count (`decide`, read by the rollout step's manifests and the serving
step's create) and `status.scaling`. Today the count is `spec.runtime.replicas` - the
field the scale subresource exposes, so `kubectl scale`, an HPA or KEDA write it - clamped
to `[minReplicas, maxReplicas]` when `autoscaling.enabled`; then the template leaves
replicas out (KServe's rule) and this step patches `spec.replicas` alone, so a scale change
never rolls the pods. The Alertmanager-driven autoscaler plugs in here: its decisions,
bounded by cooldowns and max step with an injected clock, recorded in `status.scaling`.
"""

from __future__ import annotations

import dataclasses

from kiln.operator import builders
from kiln.operator.steps import Owns, Pass, StepResult

OWNS = Owns(fields=("scaling",), sticky=("scaling",))


@dataclasses.dataclass(frozen=True)
class Scale:
    replicas: int
    autoscaled: bool  # the count is not part of the applied template


def decide(spec: dict) -> Scale:
    return Scale(builders.desired_replicas(spec), bool((spec.get("autoscaling") or {}).get("enabled")))


async def step(p: Pass) -> StepResult:
    scale = decide(p.spec)
    live = p.views.deployment(p.ns, builders.runtime_name(p.name))
    if p.invalid is None and scale.autoscaled and live is not None and _applied_by_kiln(live):
        if int((live.get("spec") or {}).get("replicas", 1)) != scale.replicas:
            await p.ctx.kube.patch("Deployment", p.ns, builders.runtime_name(p.name),
                                   {"spec": {"replicas": scale.replicas}})
    return StepResult(out=scale)


def _applied_by_kiln(live: dict) -> bool:
    return builders.ANN_APPLIED_HASH in (live["metadata"].get("annotations") or {})
