"""The operator's Prometheus metrics (served by the alert receiver's `GET /metrics`).

The autoscaling rules read two of them: `kiln_autoscaling_target_ratio` (each autoscaled
model's target, so one rule serves every model) and the replica gauges (the dashboard).
They carry their own `namespace` label, so the scrape keeps it (`honor_labels: true`).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

RECEIVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        model = ["namespace", "model"]
        self.target = Gauge("kiln_autoscaling_target_ratio",
                            "spec.autoscaling.targetGPUUtilization / 100 of each autoscaled model.", model, registry=r)
        self.replicas = Gauge("kiln_autoscaling_replicas", "spec.runtime.replicas of each autoscaled model.",
                              model, registry=r)
        self.min_replicas = Gauge("kiln_autoscaling_min_replicas", "spec.autoscaling.minReplicas.", model, registry=r)
        self.max_replicas = Gauge("kiln_autoscaling_max_replicas", "spec.autoscaling.maxReplicas.", model, registry=r)
        self.decisions = Counter("kiln_scaling_decisions", "Scaling decisions recorded in status.scaling, "
                                 "by direction (up, down, hold).", [*model, "direction"], registry=r)
        self.alerts_received = Counter(
            "kiln_alerts_received", "Alerts the receiver got, by result (accepted, duplicate, ignored, "
            "unknown_model, invalid: labels that name no object; and whole payloads refused: unauthorized, "
            "invalid, too_large).", ["result"], registry=r)
        self.receiver_seconds = Histogram("kiln_alert_receiver_duration_seconds",
                                          "From a webhook request's receipt to its answer.",
                                          buckets=RECEIVER_BUCKETS, registry=r)

        gc = ["namespace", "claim"]
        self.cache_gc_runs = Counter("kiln_cache_gc_runs", "Engine-cache GC Jobs finished, by result "
                                     "(succeeded, failed, dry_run).", [*gc, "result"], registry=r)
        self.cache_gc_removed_entries = Counter(
            "kiln_cache_gc_removed_entries", "Engine-cache entries GC removed, by reason (unneeded: no version "
            "needed it for the grace period; orphan: no engine index entry named it).", [*gc, "reason"], registry=r)
        self.cache_gc_removed_bytes = Counter("kiln_cache_gc_removed_bytes", "Bytes engine-cache GC removed.",
                                              gc, registry=r)
        self.cache_gc_last_success = Gauge("kiln_cache_gc_last_success_timestamp_seconds",
                                           "When an engine-cache GC Job last succeeded.", gc, registry=r)

    def set_autoscaled(self, namespace: str, model: str, auto: dict, replicas: int) -> None:
        self.target.labels(namespace, model).set(int(auto["targetGPUUtilization"]) / 100)
        self.replicas.labels(namespace, model).set(replicas)
        self.min_replicas.labels(namespace, model).set(int(auto["minReplicas"]))
        self.max_replicas.labels(namespace, model).set(int(auto["maxReplicas"]))

    def forget(self, namespace: str, model: str) -> None:
        """A model no longer autoscaled (or gone): its series go, so no rule fires for it."""
        for gauge in (self.target, self.replicas, self.min_replicas, self.max_replicas):
            try:
                gauge.remove(namespace, model)
            except KeyError:
                pass

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
