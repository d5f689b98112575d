"""Dynamic batching: which queued requests form the next batch, and how their tensors are
joined into one batch and split back.

Triton's dynamic batcher semantics, as pure functions over plain values; the scheduler
owns the queue, the clock and the event loop. A batch is dispatched as soon as
- it is full: its rows reach the maximum, or the next queued request would not fit;
- or its rows reach a preferred batch size (the largest one a FIFO prefix reaches);
- or its oldest request has waited the maximum queue delay (then everything that fits).
Only requests whose tensors agree on everything but dimension 0 (names, dtypes, trailing
dimensions) can share a batch; `signature()` names that group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

import numpy as np

from kiln.runtime.api.spec import require_keys

MAX_BATCH_SIZE_LIMIT = 4096  # the CRD's bound on runtime.batching.maxBatchSize
# The keys of spec.runtime.batching the CRD gives a default.
_DEFAULTED_KEYS = ("enabled", "maxBatchSize", "maxQueueDelayMicroseconds", "maxQueueSize",
                   "maxAdmissionWaitMilliseconds")


def _int(value: Any, name: str, low: int, high: int | None = None) -> int:
    # bool is an int in Python; a manifest's `true` is not a size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


@dataclass(frozen=True)
class BatchingConfig:
    """`spec.runtime.batching`, validated; delays in seconds."""

    enabled: bool
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay: float
    max_queue_size: int
    # A request that finds the queue full waits this long for a place, holding only its
    # headers, before it is refused: clients that retry at once then wait instead of spinning.
    max_admission_wait: float

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"batching.enabled must be true or false, got {self.enabled!r}")
        _int(self.max_batch_size, "batching.maxBatchSize", 1, MAX_BATCH_SIZE_LIMIT)
        for size in self.preferred_batch_sizes:
            _int(size, "batching.preferredBatchSizes[]", 1, self.max_batch_size)
        if not isinstance(self.max_queue_delay, (int, float)) or isinstance(self.max_queue_delay, bool) \
                or self.max_queue_delay < 0:
            raise ValueError(f"batching.maxQueueDelayMicroseconds must be >= 0, got {self.max_queue_delay!r}")
        _int(self.max_queue_size, "batching.maxQueueSize", 1)
        if not isinstance(self.max_admission_wait, (int, float)) or isinstance(self.max_admission_wait, bool) \
                or self.max_admission_wait < 0:
            raise ValueError(f"batching.maxAdmissionWaitMilliseconds must be >= 0, got {self.max_admission_wait!r}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> "BatchingConfig":
        """From the manifest's camelCase `batching` map, with the CRD's defaults applied
        (`kiln serve` applies them); a missing key raises ValueError naming it."""
        spec = spec or {}
        if not isinstance(spec, Mapping):
            raise ValueError(f"runtime.batching must be a map, got {type(spec).__name__}")
        unknown = set(spec) - {*_DEFAULTED_KEYS, "preferredBatchSizes"}
        if unknown:
            raise ValueError(f"runtime.batching has unknown keys {sorted(unknown)}")
        require_keys(spec, _DEFAULTED_KEYS, "runtime.batching")
        # The one optional key: the CRD has no default for it (no preferred size).
        preferred = spec.get("preferredBatchSizes") or []
        if not isinstance(preferred, (list, tuple)):
            raise ValueError(f"batching.preferredBatchSizes must be a list, got {preferred!r}")
        delay_us = spec["maxQueueDelayMicroseconds"]
        _int(delay_us, "batching.maxQueueDelayMicroseconds", 0)
        wait_ms = spec["maxAdmissionWaitMilliseconds"]
        _int(wait_ms, "batching.maxAdmissionWaitMilliseconds", 0)
        return cls(
            enabled=spec["enabled"],
            max_batch_size=spec["maxBatchSize"],
            preferred_batch_sizes=tuple(sorted(set(preferred))),
            max_queue_delay=delay_us / 1e6,
            max_queue_size=spec["maxQueueSize"],
            max_admission_wait=wait_ms / 1e3,
        )


def plan(rows: Iterable[int], waited: float, *, max_rows: int, preferred: Sequence[int] = (),
         max_delay: float, flush: bool = False) -> int:
    """How many queued requests (a FIFO prefix of one compatible group) to dispatch now.

    `rows` are the queued requests' row counts, oldest first (read lazily: only as far as
    a batch can reach); `waited` is how long the oldest has waited. 0 means: wait for more
    requests or for the delay. `flush` dispatches whatever is queued (shutdown drain).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    preferred_set = set(preferred)
    taken = total = best_preferred = 0
    next_does_not_fit = False
    for r in rows:
        if total + r > max_rows:
            next_does_not_fit = True
            break
        total += r
        taken += 1
        if total in preferred_set:
            best_preferred = taken
        if total == max_rows:
            break
    if taken == 0:
        # Only reachable when the head request alone exceeds max_rows, which submit() refuses.
        return 0
    if total == max_rows or next_does_not_fit or flush or waited >= max_delay:
        return taken
    return best_preferred


def request_rows(inputs: Mapping[str, np.ndarray]) -> int:
    """The request's batch size: dimension 0, which every input must agree on."""
    rows = {name: (a.shape[0] if a.ndim else None) for name, a in inputs.items()}
    scalars = sorted(n for n, r in rows.items() if r is None)
    if scalars:
        raise ValueError(f"input {scalars[0]!r} is a scalar, but dimension 0 is the batch")
    distinct = set(rows.values())
    if len(distinct) != 1:
        detail = ", ".join(f"{n}: {r}" for n, r in sorted(rows.items()))
        raise ValueError(f"inputs disagree on the batch size (dimension 0): {detail}")
    return distinct.pop()


def signature(inputs: Mapping[str, np.ndarray]) -> Hashable:
    """What requests must share to be concatenated along dimension 0."""
    return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in inputs.items()))


def concat(requests: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch from compatible requests (same signature), rows in request order."""
    if len(requests) == 1:
        return dict(requests[0])
    return {name: np.concatenate([r[name] for r in requests], axis=0) for name in requests[0]}


def split(outputs: Mapping[str, np.ndarray], rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Each request's share of a batch's outputs, by its rows (views, not copies).

    Refuses outputs whose dimension 0 is not the batch: silently handing a request
    another request's rows would be the worst possible failure.
    """
    if len(rows) == 1:
        return [dict(outputs)]
    expected = sum(rows)
    for name, a in outputs.items():
        got = a.shape[0] if a.ndim else None
        if got != expected:
            raise ValueError(
                f"output {name!r} has batch dimension {got} for a batch of {expected} rows "
                f"from {len(rows)} requests; cannot split it back")
    # Plain slices: np.split costs several times more per piece, once per request.
    parts: list[dict[str, np.ndarray]] = []
    start = 0
    items = list(outputs.items())
    for r in rows:
        end = start + r
        parts.append({name: a[start:end] for name, a in items})
        start = end
    return parts
