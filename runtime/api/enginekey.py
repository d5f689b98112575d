"""The engine key: one hash over everything that makes an engine different.

The operator computes it to name build Jobs and decide what is missing; `kiln build`
recomputes it from the same inputs and refuses to publish under a key it does not
reproduce. Pure Python, no heavy imports: the operator image loads this module too.

Same inputs, same key; any change (model digest, backend or its version, GPU compute
capability, precision, shape profiles, builder flags), a new key.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

KEY_SCHEMA = 1  # bump when the meaning of an input changes, so old keys stop matching
KEY_LENGTH = 20  # hex characters (80 bits): short enough for Job names, no realistic collisions

CPU_TARGET = "cpu"

# GPU products a user may name in spec.engine.targets, and the architecture an engine
# for them is built for. TensorRT engines are specific to the compute capability.
PRODUCT_ARCHITECTURES: dict[str, str] = {
    "T4": "sm75",
    "A100": "sm80",
    "A30": "sm80",
    "A10": "sm86",
    "A10G": "sm86",
    "A40": "sm86",
    "RTX-A6000": "sm86",
    "L4": "sm89",
    "L40": "sm89",
    "L40S": "sm89",
    "H100": "sm90",
    "H200": "sm90",
    "GH200": "sm90",
    "B200": "sm100",
    "GB200": "sm100",
}

_ARCH = re.compile(r"^sm(\d{2,3})$")


def normalize_target(target: str) -> str:
    """`sm90`, `8.0`, `H100`, `NVIDIA-H100-80GB-HBM3` or `cpu` -> `sm90` / `sm80` / `cpu`.

    Raises ValueError with the accepted forms when the target is not recognised.
    """
    t = target.strip()
    if t.lower() == CPU_TARGET:
        return CPU_TARGET
    if _ARCH.match(t.lower()):
        return t.lower()
    m = re.fullmatch(r"(\d{1,2})\.(\d)", t)
    if m:
        return f"sm{m.group(1)}{m.group(2)}"
    # Node labels such as nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3.
    name = t.upper().removeprefix("NVIDIA-").removeprefix("NVIDIA ")
    for product in sorted(PRODUCT_ARCHITECTURES, key=len, reverse=True):
        if name == product or name.startswith(product + "-"):
            return PRODUCT_ARCHITECTURES[product]
    raise ValueError(
        f"unknown target {target!r}: use 'cpu', an architecture such as 'sm90' or '9.0', "
        f"or a GPU product: {', '.join(sorted(PRODUCT_ARCHITECTURES))}"
    )


def compute_capability_target(major: int, minor: int) -> str:
    """NVML's (major, minor) compute capability -> target name."""
    return f"sm{major}{minor}"


@dataclass(frozen=True)
class KeyInputs:
    """Everything an engine depends on. `manifest.json` records these verbatim."""

    model: str  # "sha256:<hex>" when pinned, else "<uri>@<version>"
    backend: str
    backend_version: str
    target: str
    precision: str
    profiles: tuple = ()  # canonical: tuple of (input, min, opt, max) with shapes as tuples
    builder_flags: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": KEY_SCHEMA,
            "model": self.model,
            "backend": self.backend,
            "backendVersion": self.backend_version,
            "target": self.target,
            "precision": self.precision,
            "profiles": [
                {"input": n, "min": list(lo), "opt": list(opt), "max": list(hi)}
                for n, lo, opt, hi in self.profiles
            ],
            "builderFlags": dict(sorted(self.builder_flags.items())),
        }

    @property
    def key(self) -> str:
        return key_of(self.to_dict())


def key_of(inputs: Mapping[str, Any]) -> str:
    """The key of a `KeyInputs.to_dict()` (as recorded in a manifest or a build request)."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]


def model_identity(uri: str, version: str | None, sha256: str | None) -> str:
    """A pinned digest identifies the model by content; otherwise uri + version do."""
    if sha256:
        return "sha256:" + sha256.lower()
    return f"{uri}@{version or ''}"


def canonical_profiles(profiles: list[Mapping[str, Any]] | None) -> tuple:
    """spec.engine.profiles -> a canonical, order-independent tuple."""
    out = []
    for p in profiles or ():
        out.append((p["input"], tuple(p["min"]), tuple(p["opt"]), tuple(p["max"])))
    return tuple(sorted(out))


def builder_flags(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The spec.engine fields that change the built engine beyond precision and profiles."""
    flags: dict[str, Any] = {}
    if engine.get("workspaceMiB") is not None:
        flags["workspaceMiB"] = int(engine["workspaceMiB"])
    for name, value in sorted((engine.get("builderFlags") or {}).items()):
        flags[name] = value
    return flags


def key_inputs(model: Mapping[str, Any], engine: Mapping[str, Any], target: str,
               backend_version: str) -> KeyInputs:
    """spec.model + spec.engine + one target -> the key's inputs.

    The backend version is not in the spec: the operator knows it from its configuration
    (the builder image it uses), the builder from the library it runs.
    """
    return KeyInputs(
        model=model_identity(model["uri"], model.get("version"), model.get("sha256")),
        backend=engine.get("backend", "tensorrt"),
        backend_version=backend_version,
        target=normalize_target(target),
        precision=engine.get("precision", "fp16"),
        profiles=canonical_profiles(engine.get("profiles")),
        builder_flags=builder_flags(engine),
    )
