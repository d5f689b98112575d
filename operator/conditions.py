"""Status conditions the Kubernetes way (metav1.Condition, as cert-manager sets them).

- Types are CamelCase (`EngineReady`, `Available`, `Progressing`, `Degraded`).
- `observedGeneration` is always set to the generation the condition describes.
- `lastTransitionTime` moves only when `status` flips; a new reason or message alone
  keeps the old time.
- The clock is injected, so tests control time.

Pure functions: a list of condition dicts in, a new list out.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterable

Clock = Callable[[], datetime.datetime]

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

# The order conditions appear in status (stable, so equal statuses compare equal).
ORDER = ("EngineReady", "Available", "Progressing", "Degraded")


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def timestamp(when: datetime.datetime) -> str:
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def get_condition(conditions: Iterable[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    for c in conditions or ():
        if c.get("type") == type_:
            return c
    return None


def is_true(conditions: Iterable[dict[str, Any]] | None, type_: str) -> bool:
    c = get_condition(conditions, type_)
    return bool(c and c.get("status") == TRUE)


def set_condition(conditions: Iterable[dict[str, Any]] | None, type_: str, status: str | bool, reason: str,
                  message: str, generation: int, clock: Clock = utcnow) -> list[dict[str, Any]]:
    """Return a new condition list with `type_` set; the others are kept as they are."""
    if isinstance(status, bool):
        status = TRUE if status else FALSE
    if status not in (TRUE, FALSE, UNKNOWN):
        raise ValueError(f"condition status must be True, False or Unknown, not {status!r}")
    if not type_ or not type_[0].isupper() or not type_.isalnum():
        raise ValueError(f"condition type must be CamelCase, not {type_!r}")
    if not reason or not reason[0].isalpha() or not reason.replace("_", "").isalnum():
        raise ValueError(f"condition reason must be CamelCase, not {reason!r}")
    old = get_condition(conditions, type_)
    transition = old["lastTransitionTime"] if old and old.get("status") == status and old.get(
        "lastTransitionTime") else timestamp(clock())
    new = {"type": type_, "status": status, "observedGeneration": int(generation),
           "lastTransitionTime": transition, "reason": reason, "message": message}
    out = [dict(c) for c in conditions or () if c.get("type") != type_] + [new]
    rank = {t: i for i, t in enumerate(ORDER)}
    return sorted(out, key=lambda c: (rank.get(c["type"], len(ORDER)), c["type"]))


def transitions(old: Iterable[dict[str, Any]] | None, new: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conditions in `new` whose status differs from `old` (or that are new)."""
    out = []
    for c in new:
        before = get_condition(old, c["type"])
        if before is None or before.get("status") != c["status"]:
            out.append(c)
    return out
