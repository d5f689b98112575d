"""Signals: what Alertmanager said about a model, as the receiver records it.

The receiver (`alerts.py`) keeps, per InferenceModel, the latest state of each of Kiln's
alerts in one annotation (`ANN_SIGNALS`, JSON); the scaling step reads the scaling ones, the
serving step KilnRequestsRefused. Living in the
object, the record survives an operator restart, reaches whichever replica leads, and wakes
the model through its watch (kopf's update handler on that annotation).

`merge` is what makes delivery idempotent: the same alert delivered twice (a retry, a
repeat, a second Alertmanager replica) changes nothing, an older episode never overwrites a
newer one, and a resolved alert is not revived by a replay of its firing notification.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Mapping

# Not under kiln.dev/: kopf ignores annotations under its own storage prefix when it diffs,
# and this one must wake the model's update handler.
ANN_SIGNALS = "autoscaling.kiln.dev/signals"

HIGH, LOW, MISSING = "KilnUtilizationHigh", "KilnUtilizationLow", "KilnUtilizationMissing"
# Far above the target over a short window, firing at once (Knative's panic mode): a scale-up
# as High is, seconds after a load step rather than after highFor.
SURGE = "KilnUtilizationSurge"
UP = (HIGH, SURGE)
ALERTS = (HIGH, SURGE, LOW, MISSING)  # the utilization rules (files/kiln-autoscaling.rules.yaml)
# No requests at all (files/kiln-idle.rules.yaml): with minReplicas 0, the way to zero.
IDLE = "KilnModelIdle"
# Most of a model's requests refused, bad_request or refused (the chart's templates/_requests.tpl):
# no scaling signal but the model's health, which the serving step reports (Degraded) and acts on never.
REFUSED = "KilnRequestsRefused"
RECEIVED = ALERTS + (IDLE, REFUSED)  # every alert the receiver records
FIRING, RESOLVED = "firing", "resolved"

# A repeat of an unchanged alert refreshes `seen` (fresh evidence for the next step) at most
# this often, so a burst of duplicates costs no writes.
REFRESH_SECONDS = 10.0


def parse_time(text: Any) -> datetime.datetime:
    """RFC 3339 (Alertmanager's and Kubernetes' timestamps) to a datetime in UTC. Raises ValueError."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"expected an RFC 3339 timestamp, got {text!r}")
    value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no time zone")
    try:
        return value.astimezone(datetime.timezone.utc)
    except OverflowError:  # 0001-01-01T00:00:00+01:00: no UTC time to record it as
        raise ValueError(f"timestamp {text!r} is out of range in UTC") from None


def format_time(value: datetime.datetime) -> str:
    return value.astimezone(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclasses.dataclass(frozen=True)
class Signal:
    state: str  # firing | resolved
    starts_at: datetime.datetime  # when Prometheus started firing this episode
    seen: datetime.datetime  # when a delivery last said so (refreshed at most every REFRESH_SECONDS)
    fingerprint: str = ""
    value: float | None = None  # what the rule saw (the `value` annotation): a utilization or refused share

    def active(self, now: datetime.datetime, ttl: float) -> bool:
        """Firing, and heard of recently enough to trust (no word within `ttl`: hold)."""
        return self.state == FIRING and (now - self.seen).total_seconds() <= ttl

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "startsAt": format_time(self.starts_at),
                               "seen": format_time(self.seen), "fingerprint": self.fingerprint}
        if self.value is not None:
            out["value"] = self.value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Signal":
        value = data.get("value")
        return cls(state=str(data["state"]), starts_at=parse_time(data["startsAt"]), seen=parse_time(data["seen"]),
                   fingerprint=str(data.get("fingerprint") or ""),
                   value=float(value) if isinstance(value, (int, float)) else None)


def parse(annotations: Mapping[str, Any] | None) -> dict[str, Signal]:
    """The signals recorded on a model; a damaged record reads as none (hold), never as an error."""
    text = (annotations or {}).get(ANN_SIGNALS)
    try:
        data = json.loads(text) if text else {}
        return {name: Signal.from_json(v) for name, v in data.items() if name in RECEIVED}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def dump(signals: Mapping[str, Signal]) -> str:
    return json.dumps({k: signals[k].to_json() for k in sorted(signals)}, sort_keys=True, separators=(",", ":"))


def merge(current: Signal | None, incoming: Signal) -> Signal | None:
    """The record after `incoming`, or None when it adds nothing (a duplicate or a stale replay)."""
    if current is None or incoming.starts_at > current.starts_at:
        return incoming  # a new episode
    if incoming.starts_at < current.starts_at:
        return None  # an older episode, replayed
    if current.state == RESOLVED:
        return None  # a resolved episode stays resolved
    if incoming.state == RESOLVED:
        return incoming
    if (incoming.seen - current.seen).total_seconds() >= REFRESH_SECONDS or incoming.value != current.value:
        return dataclasses.replace(current, seen=incoming.seen, value=incoming.value,
                                   fingerprint=incoming.fingerprint or current.fingerprint)
    return None
