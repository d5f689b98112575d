"""The engines an InferenceModel's (defaulted) spec needs: one EngineRef per distinct target
architecture, with its key (`kiln.runtime.api.enginekey`) and its build Job's name.

Pure: tested without a cluster (tests/operator/test_builders.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kiln.operator.config import OperatorConfig
from kiln.runtime.api import contract, enginekey


@dataclasses.dataclass(frozen=True)
class EngineRef:
    """One engine an InferenceModel needs."""

    key: str
    target: str  # as written in spec.engine.targets (or the default)
    architecture: str  # normalized: sm90, cpu
    backend: str
    backend_version: str

    @property
    def job_name(self) -> str:
        return job_name(self.key, self.architecture)

    @property
    def index_key(self) -> str:
        return contract.index_key(self.key, self.architecture)


def job_name(key: str, architecture: str) -> str:
    """Deterministic from key and target: every model asking for the engine finds one Job."""
    return f"kiln-build-{key}-{architecture}"


def targets_of(spec: Mapping[str, Any], config: OperatorConfig) -> list[str]:
    engine = spec.get("engine") or {}
    targets = list(engine.get("targets") or ())
    if targets:
        return targets
    if engine.get("backend", "tensorrt") == "onnxruntime":
        return [enginekey.CPU_TARGET]
    return list(config.default_targets)


def plan_engines(spec: Mapping[str, Any], config: OperatorConfig) -> list[EngineRef]:
    """One EngineRef per distinct architecture, in the order of spec.engine.targets.

    Raises ValueError for a target or backend the operator cannot build for.
    """
    engine = spec.get("engine") or {}
    backend = engine.get("backend", "tensorrt")
    refs: list[EngineRef] = []
    seen: set[str] = set()
    for target in targets_of(spec, config):
        arch = enginekey.normalize_target(target)
        if arch in seen:
            continue
        if backend == "tensorrt" and arch == enginekey.CPU_TARGET:
            raise ValueError("backend tensorrt cannot build for target 'cpu': use backend onnxruntime")
        seen.add(arch)
        version = config.backend_version(backend, arch)
        key = enginekey.key_inputs(spec["model"], engine, arch, version).key
        refs.append(EngineRef(key=key, target=target, architecture=arch, backend=backend, backend_version=version))
    return refs
