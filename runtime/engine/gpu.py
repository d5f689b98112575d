"""What GPU this pod has, through NVML (nvidia-ml-py): build target and utilization metrics.

Everything here degrades to "no GPU" when NVML or the driver is absent (a CPU node, CI):
`detect_target()` answers "cpu", `read_gpus()` answers None, and the Prometheus
collector exports no GPU series at all, never a zero that would read as an idle GPU.

Only the GPUs given to the pod are exported (`VisibleDevices`): NVML shows every GPU the
process can reach, which can be more than the device plugin allocated (an image that sets
`NVIDIA_VISIBLE_DEVICES=all`, a privileged container), and a neighbour's load is not this
model's. Only engines that run on a GPU register the collector at all (runtime/serving/model.py).

MIG: NVML reports no utilization for a MIG slice (nvmlDeviceGetUtilizationRates is not
supported there), so a MIG device exports its memory and no utilization series; the
autoscaler treats the missing series as "hold".
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from kiln.runtime.api.contract import NVIDIA_VISIBLE_DEVICES_ENV
from kiln.runtime.api.enginekey import CPU_TARGET, compute_capability_target

log = logging.getLogger("kiln.runtime.engine.gpu")


@dataclass(frozen=True)
class GpuSample:
    index: int  # NVML device index; for a MIG slice, its parent's index
    uuid: str  # "GPU-…" or "MIG-…"
    name: str
    utilization: float | None  # 0..1; None where NVML cannot say (MIG slices)
    memory_used_bytes: int
    memory_total_bytes: int
    # A MIG slice's place: its GPU's UUID, its index among the GPU's MIG devices (the `0:1`
    # form names it), and its GPU and compute instance ids (the legacy `MIG-GPU-…/1/0` form).
    parent_uuid: str = ""
    mig_index: int | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None

    @property
    def mig(self) -> bool:
        return self.mig_index is not None

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


def _mig_devices(nvml, handle) -> Iterator[tuple[int, Any]]:
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            yield i, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except Exception:  # an empty slot (NVMLError_NotFound)
            continue


def _optional(read, handle) -> int | None:
    try:
        return int(read(handle))
    except Exception:
        return None


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
                parent = _text(nvml.nvmlDeviceGetUUID(handle))
                for mig_index, mig in _mig_devices(nvml, handle):
                    memory = nvml.nvmlDeviceGetMemoryInfo(mig)
                    samples.append(GpuSample(
                        index=index, uuid=_text(nvml.nvmlDeviceGetUUID(mig)), name=name,
                        utilization=None, memory_used_bytes=int(memory.used),
                        memory_total_bytes=int(memory.total), parent_uuid=parent,
                        mig_index=mig_index,
                        gpu_instance=_optional(nvml.nvmlDeviceGetGpuInstanceId, mig),
                        compute_instance=_optional(nvml.nvmlDeviceGetComputeInstanceId, mig)))
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


# Which GPUs a container was given. The device plugin sets NVIDIA_VISIBLE_DEVICES for the
# container toolkit: UUIDs (its default), host indices (deviceIDStrategy=index), or a
# directory holding one entry per device (deviceListStrategy=volume-mounts).
# CUDA_VISIBLE_DEVICES, where something sets it, narrows what CUDA itself uses.
CUDA_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
_INDEX = re.compile(r"(\d+)(?::(\d+))?")  # a GPU, or `gpu:mig` for a MIG device
_LEGACY_MIG = re.compile(r"MIG-(GPU-[^/]+)/(\d+)/(\d+)")  # MIG-GPU-<uuid>/<gi>/<ci>


def _matches(token: str, samples: list[GpuSample]) -> list[GpuSample]:
    """The samples a device id names: a GPU (all its slices on a MIG GPU) or one MIG slice."""
    legacy = _LEGACY_MIG.fullmatch(token)
    if legacy:
        instances = (int(legacy.group(2)), int(legacy.group(3)))
        return [s for s in samples if s.parent_uuid == legacy.group(1)
                and (s.gpu_instance, s.compute_instance) == instances]
    if token.startswith(("GPU-", "MIG-")):
        return [s for s in samples if token in (s.uuid, s.parent_uuid)]
    index = _INDEX.fullmatch(token)
    if index:
        gpu, mig = int(index.group(1)), index.group(2)
        return [s for s in samples if s.index == gpu and (mig is None or s.mig_index == int(mig))]
    return []


def _nvidia_devices(value: str | None) -> list[str] | None:
    """NVIDIA_VISIBLE_DEVICES as device ids; None where it does not narrow what NVML shows."""
    value = (value or "").strip()
    # Unset: bare metal. `all`: the container got what NVML shows. Empty or `void`: the
    # toolkit gave nothing (NVML then has no driver to load), or CDI injection, which leaves
    # `void` while it gives the container its own devices only: NVML's view is the pod's.
    if value in ("", "all", "void"):
        return None
    if value == "none":
        return []
    if value.startswith("/"):
        try:
            return sorted(os.listdir(value))
        except OSError as e:
            log.warning("%s=%s: cannot list its devices (%s); no GPU series",
                        NVIDIA_VISIBLE_DEVICES_ENV, value, e)
            return []
    return [t.strip() for t in value.split(",") if t.strip()]


class VisibleDevices:
    """Which of the GPUs NVML shows were given to this pod, from its environment.

    NVIDIA_VISIBLE_DEVICES's ids are resolved by UUID, else by index. Its indices are the
    host's: where NVML shows no more GPUs than the indices name, the toolkit has already
    narrowed the view to them (and NVML numbers it from 0), so every GPU shown is the pod's;
    a wider view (a privileged container) is numbered as the host's. CUDA_VISIBLE_DEVICES
    only narrows the result, never widens it: UUIDs, or indices into what this process sees
    (NVML's order, which is CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID or on a node of one GPU
    model), read as CUDA does up to the first it cannot find. An id that names no GPU NVML
    shows is logged once and ignored.
    """

    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self._nvidia = _nvidia_devices(environ.get(NVIDIA_VISIBLE_DEVICES_ENV))
        cuda = environ.get(CUDA_VISIBLE_DEVICES_ENV)
        self._cuda = None if cuda is None else [t.strip() for t in cuda.split(",") if t.strip()]
        self._ignored: set[tuple[str, str]] = set()

    def select(self, samples: list[GpuSample]) -> list[GpuSample]:
        chosen = samples if self._nvidia is None else self._given(samples, self._nvidia)
        if self._cuda is not None:
            cuda: set[str] = set()
            for token in self._cuda:
                found = _matches(token, samples)
                if not found:
                    self._ignore(CUDA_VISIBLE_DEVICES_ENV, token)
                    break
                cuda |= {s.uuid for s in found}
            chosen = [s for s in chosen if s.uuid in cuda]
        return chosen

    def _given(self, samples: list[GpuSample], tokens: list[str]) -> list[GpuSample]:
        indices = [_INDEX.fullmatch(t) for t in tokens]
        if tokens and all(indices):
            # Host indices: a view no wider than they name is the toolkit's, renumbered from 0.
            if len({s.index for s in samples}) <= len({int(m.group(1)) for m in indices if m}):
                return samples
        chosen: list[GpuSample] = []
        for token in tokens:
            found = _matches(token, samples)
            if not found:
                self._ignore(NVIDIA_VISIBLE_DEVICES_ENV, token)
            chosen += [s for s in found if s not in chosen]
        return chosen

    def _ignore(self, variable: str, token: str) -> None:
        if (variable, token) not in self._ignored:
            self._ignored.add((variable, token))
            log.warning("%s names %r, which is none of the GPUs NVML shows here: ignored",
                        variable, token)


class GpuCollector:
    """A Prometheus collector that reads NVML at scrape time, for the pod's own GPUs."""

    def __init__(self, model: str, nvml: Any = None, version: str = "",
                 environ: Mapping[str, str] | None = None):
        self.model = model
        self.version = version  # with namespace and pod from the scrape, ties a GPU to a model version
        self._nvml = nvml
        self._visible = VisibleDevices(environ)

    def describe(self):
        # Empty: the series exist only when a GPU does, so none are promised up front.
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        samples = read_gpus(self._nvml)
        if samples:
            samples = self._visible.select(samples)
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


def register_gpu_collector(registry, model: str, version: str = "", nvml: Any = None,
                           environ: Mapping[str, str] | None = None) -> GpuCollector:
    """Add the NVML collector to `registry`; it exports nothing where the pod has no GPU."""
    collector = GpuCollector(model, nvml, version, environ)
    registry.register(collector)
    return collector
