"""`spec.runtime.sequences` parsed (`SequenceSpec`, its `StoreSpec`); its state pairs are
checked against an engine's tensors by `engine.states.check_pairs`.

The CRD's defaults are not restated here: the API server applies them, and `kiln serve` and
`kiln dev` apply them again (kiln.runtime.api.spec.apply_defaults), so a key the CRD
defaults is required, and its absence is a ValueError that names it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping


_WHERE = "spec.runtime.sequences"


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    type: str  # memory | redis
    timeout: float  # seconds, every store call's bound
    address: str | None = None  # host:port, or a redis:// or rediss:// URL (redis only)
    password_required: bool = False  # passwordSecretRef is set: the env variable must be

    @classmethod
    def from_spec(cls, store: Any) -> "StoreSpec":
        """`spec.runtime.sequences.store` (defaults applied) -> a StoreSpec; ValueError says
        what is wrong."""
        where = f"{_WHERE}.store"
        if not isinstance(store, Mapping):
            raise ValueError(f"{where} must be an object")
        kind = _required(store, "type", where)
        if kind not in ("memory", "redis"):
            raise ValueError(f"{where}.type must be memory or redis, got {kind!r}")
        address = store.get("address")
        if kind == "redis" and not (isinstance(address, str) and address):
            raise ValueError(f"{where}.address is required for a redis store")
        return cls(type=kind, timeout=_positive(store, "timeoutMilliseconds", where) / 1000,
                   address=address if kind == "redis" else None,
                   password_required=bool(store.get("passwordSecretRef")))


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    states: tuple[tuple[str, str], ...]  # (input, output) pairs
    idle_timeout: float
    max_live: int
    max_bytes_per_sequence: int
    max_bytes_total: int
    store: StoreSpec

    @classmethod
    def from_runtime(cls, runtime: Mapping[str, Any] | None) -> "SequenceSpec | None":
        """`spec.runtime` with the CRD's defaults applied -> its SequenceSpec, None when it
        has no `sequences`. ValueError says what is wrong, a missing key included (the CRD
        refuses the rest first; this is for a hand-written --runtime-spec)."""
        raw = (runtime or {}).get("sequences")
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError(f"{_WHERE} must be an object")
        spec = cls(
            states=_pairs(raw.get("states")),
            idle_timeout=float(_positive(raw, "idleTimeoutSeconds")),
            max_live=int(_positive(raw, "maxLiveSequences")),
            max_bytes_per_sequence=int(_positive(raw, "maxBytesPerSequence")),
            max_bytes_total=int(_positive(raw, "maxBytesTotal")),
            store=StoreSpec.from_spec(_required(raw, "store", _WHERE)))
        if spec.max_bytes_per_sequence > spec.max_bytes_total:
            raise ValueError(f"{_WHERE}: maxBytesPerSequence must be <= maxBytesTotal")
        return spec

    @property
    def state_inputs(self) -> frozenset[str]:
        return frozenset(i for i, _ in self.states)

    @property
    def state_outputs(self) -> frozenset[str]:
        return frozenset(o for _, o in self.states)


def _pairs(states: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(states, list) or not states:
        raise ValueError(f"{_WHERE}.states must list at least one {{input, output}} pair")
    pairs = []
    for i, s in enumerate(states):
        if not (isinstance(s, Mapping) and isinstance(s.get("input"), str) and s["input"]
                and isinstance(s.get("output"), str) and s["output"]):
            raise ValueError(f"{_WHERE}.states[{i}] must be {{input: name, output: name}}")
        pairs.append((s["input"], s["output"]))
    for side, names in (("input", [p[0] for p in pairs]), ("output", [p[1] for p in pairs])):
        if len(set(names)) != len(names):
            raise ValueError(f"{_WHERE}.states: each state {side} may appear once")
    return tuple(pairs)


def _required(raw: Mapping[str, Any], name: str, where: str) -> Any:
    value = raw.get(name)
    if value is None:
        raise ValueError(f"{where}.{name} is missing (the CRD defaults it: apply the CRD's "
                         f"defaults to spec.runtime first, as kiln serve does)")
    return value


def _positive(raw: Mapping[str, Any], name: str, where: str = _WHERE) -> float:
    value = _required(raw, name, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"{where} {name} must be a positive number, got {value!r}")
    return value

