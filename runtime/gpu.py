"""What GPU this pod has, through NVML (nvidia-ml-py): build target and utilization metrics.

Everything here degrades to "no GPU" when NVML or the driver is absent (a CPU node, CI):
`detect_target()` answers "cpu", `read_gpus()` answers None, and the Prometheus
collector exports no GPU series at all, never a zero that would read as an idle GPU.

MIG: NVML reports no utilization for a MIG slice (nvmlDeviceGetUtilizationRates is not
supported there), so a MIG device exports its memory and no utilization series; the
autoscaler treats the missing series as "hold".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator

from kiln.runtime.enginekey import CPU_TARGET, compute_capability_target


@dataclass(frozen=True)
class GpuSample:
    index: int  # NVML device index; for a MIG slice, its parent's index
    uuid: str  # "GPU-…" or "MIG-…"
    name: str
    utilization: float | None  # 0..1; None where NVML cannot say (MIG slices)
    memory_used_bytes: int
    memory_total_bytes: int
    mig: bool = False

    @property
    def label(self) -> str:
        """The `gpu` label: the index, plus the slice's UUID for MIG."""
        return f"{self.index}/{self.uuid}" if self.mig else str(self.index)


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


_init_lock = threading.Lock()
_initialized: dict[int, bool] = {}  # id(nvml module) -> did nvmlInit succeed


def _init(nvml) -> bool:
    # nvmlInit is reference counted and cheap after the first call; a failure (no driver)
    # is remembered, since a driver does not appear in a running pod.
    with _init_lock:
        state = _initialized.get(id(nvml))
        if state is None:
            try:
                nvml.nvmlInit()
                state = True
            except Exception:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
                state = False
            _initialized[id(nvml)] = state
        return state


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def detect_target(nvml: Any = None) -> str:
    """The first visible GPU's architecture ("sm90"), or "cpu" without NVML. Never raises."""
    nvml = nvml or _nvml()
    if nvml is None or not _init(nvml):
        return CPU_TARGET
    try:
        if nvml.nvmlDeviceGetCount() < 1:
            return CPU_TARGET
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        return compute_capability_target(int(major), int(minor))
    except Exception:
        return CPU_TARGET


def _mig_enabled(nvml, handle) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # not supported on this GPU
        return False
    return current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)


def _mig_devices(nvml, handle) -> Iterator[Any]:
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            yield nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except Exception:  # an empty slot (NVMLError_NotFound)
            continue


def read_gpus(nvml: Any = None) -> list[GpuSample] | None:
    """One sample per visible GPU (per MIG slice on a MIG GPU); None when NVML is absent."""
    nvml = nvml or _nvml()
    if nvml is None or not _init(nvml):
        return None
    try:
        samples = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(nvml.nvmlDeviceGetName(handle))
            if _mig_enabled(nvml, handle):
                for mig in _mig_devices(nvml, handle):
                    memory = nvml.nvmlDeviceGetMemoryInfo(mig)
                    samples.append(GpuSample(
                        index=index, uuid=_text(nvml.nvmlDeviceGetUUID(mig)), name=name,
                        utilization=None, memory_used_bytes=int(memory.used),
                        memory_total_bytes=int(memory.total), mig=True))
                continue
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization: float | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except Exception:
                utilization = None
            samples.append(GpuSample(
                index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)), name=name,
                utilization=utilization, memory_used_bytes=int(memory.used),
                memory_total_bytes=int(memory.total)))
        return samples
    except Exception:
        # A driver error mid-scrape: report nothing rather than a partial or fake reading.
        return None


class GpuCollector:
    """A Prometheus collector that reads NVML at scrape time."""

    def __init__(self, model: str, nvml: Any = None, version: str = ""):
        self.model = model
        self.version = version  # with namespace and pod from the scrape, ties a GPU to a model version
        self._nvml = nvml

    def describe(self):
        # Empty: the series exist only when a GPU does, so none are promised up front.
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        samples = read_gpus(self._nvml)
        if not samples:
            return
        util = GaugeMetricFamily("kiln_gpu_utilization_ratio",
                                 "GPU busy time ratio (0..1) from NVML; absent for MIG slices.",
                                 labels=["model", "version", "gpu"])
        used = GaugeMetricFamily("kiln_gpu_memory_used_bytes", "GPU memory in use (NVML).",
                                 labels=["model", "version", "gpu"])
        total = GaugeMetricFamily("kiln_gpu_memory_total_bytes", "GPU memory in all (NVML).",
                                  labels=["model", "version", "gpu"])
        for s in samples:
            labels = [self.model, self.version, s.label]
            if s.utilization is not None:
                util.add_metric(labels, s.utilization)
            used.add_metric(labels, s.memory_used_bytes)
            total.add_metric(labels, s.memory_total_bytes)
        for family in (util, used, total):
            if family.samples:
                yield family


def register_gpu_collector(registry, model: str, version: str = "", nvml: Any = None) -> GpuCollector:
    """Add the NVML collector to `registry`; it exports nothing where there is no GPU."""
    collector = GpuCollector(model, nvml, version)
    registry.register(collector)
    return collector
