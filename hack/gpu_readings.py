"""Print what `kiln serve` exports as GPU series on this machine, for docs/runtime.md.

    python3 hack/gpu_readings.py

Needs numpy, nvidia-ml-py (pynvml) and prometheus-client, and this checkout (installed or
not). For each case it prints the environment the runtime would see and the `kiln_gpu_*`
lines its /metrics would carry: (a) a CPU engine (onnxruntime, target cpu), and (b) a GPU
engine (tensorrt) with NVIDIA_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES unset, set to 0 and
to GPU 0's UUID (and more). First it prints what NVML shows, which is what every case
chooses from, and what a runtime before issue 26 exported (every GPU, for every engine).
The cases differ only in the environment handed to the collector, so one process on one
GPU shows them all; the real process environment is shown as found.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent


def _kiln():
    try:
        import kiln.runtime  # noqa: F401  (pip install -e .)
    except ImportError:
        # A bare checkout: map the package names as pyproject.toml's package-dir does.
        for name, folder in (("kiln", "cli"), ("kiln.runtime", "runtime")):
            module = types.ModuleType(name)
            module.__path__ = [str(ROOT / folder)]
            sys.modules[name] = module


def exported(backend: str, environ: dict[str, str], nvml=None) -> list[str]:
    """The kiln_gpu_* lines /metrics carries for an engine of `backend` under `environ`:
    runtime/serving/model.py registers the collector only where the backend uses the GPU."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.runtime.engine import gpu
    from kiln.runtime.engine.backends import get_backend

    registry = CollectorRegistry()
    if get_backend(backend).uses_gpu:
        gpu.register_gpu_collector(registry, "demo", "1", nvml=nvml, environ=environ)
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith("kiln_gpu_")]


def cases(samples, own: dict[str, str]) -> list[tuple[str, str, dict[str, str]]]:
    """(title, backend, environment) for each case, from what NVML shows; `own` is this
    process's own NVIDIA_/CUDA_VISIBLE_DEVICES."""
    first = samples[0].uuid if samples else "GPU-unknown"
    gpu_cases = [own, {}, {"NVIDIA_VISIBLE_DEVICES": "0"}, {"NVIDIA_VISIBLE_DEVICES": first},
                 {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": first},
                 {"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": first},
                 {"NVIDIA_VISIBLE_DEVICES": "void"}, {"NVIDIA_VISIBLE_DEVICES": "none"},
                 {"NVIDIA_VISIBLE_DEVICES": "GPU-00000000-0000-0000-0000-000000000000"}]
    if len({s.index for s in samples}) > 1:
        gpu_cases.insert(3, {"NVIDIA_VISIBLE_DEVICES": "1"})
    return ([("(a) CPU engine", "onnxruntime", {"NVIDIA_VISIBLE_DEVICES": "all"})]
            + [("(b) GPU engine", "tensorrt", env) for env in gpu_cases])


def report(nvml=None, environ=os.environ) -> Iterator[str]:
    """The report's lines, one case after another (a case's log lines print before its series)."""
    from kiln.runtime.engine import gpu

    own = {k: environ[k] for k in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if k in environ}
    yield f"this process: {' '.join(f'{k}={v}' for k, v in own.items()) or 'neither variable set'}"
    yield f"detect_target(): {gpu.detect_target(nvml)}"
    samples = gpu.read_gpus(nvml)
    if not samples:
        yield "NVML shows no GPU (no driver, or none visible): every case exports nothing"
        return
    yield "NVML shows:"
    for s in samples:
        yield (f"  index {s.index} {s.uuid} {s.name}" + (f" (MIG slot {s.mig_index})" if s.mig else "")
               + f": utilization {s.utilization}, memory {s.memory_used_bytes}/{s.memory_total_bytes}")
    yield "before issue 26, any engine on this node exported:"
    yield from (f"  {line}" for line in exported("tensorrt", {}, nvml))
    for title, backend, case in cases(samples, own):
        env = " ".join(f"{k}={v}" for k, v in case.items()) or "neither variable set"
        yield f"{title}, backend {backend}, {env}{' (this process)' if case is own else ''}:"
        yield from [f"  {line}" for line in exported(backend, case, nvml)] or ["  (no kiln_gpu_ series)"]


def main() -> int:
    _kiln()
    logging.basicConfig(stream=sys.stdout, format="  log: %(message)s")
    for line in report():
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
