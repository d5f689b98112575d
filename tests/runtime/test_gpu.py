"""NVML readings: "cpu" and no GPU series without a GPU; real readings where one exists;
and, through an NVML stand-in with several GPUs and MIG slices, only the pod's own GPUs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kiln.runtime.engine import gpu


def has_gpu() -> bool:
    return bool(gpu.read_gpus())


@pytest.mark.skipif(has_gpu(), reason="checks the behaviour without an NVIDIA GPU")
def test_without_a_gpu():
    assert gpu.detect_target() == "cpu"
    assert gpu.read_gpus() is None
    registry = CollectorRegistry()
    gpu.register_gpu_collector(registry, "resnet", "3")
    text = generate_latest(registry).decode()
    assert "kiln_gpu_" not in text  # absent, never a fake zero


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU (NVML)")
def test_with_a_gpu():
    assert gpu.detect_target().startswith("sm")
    samples = gpu.read_gpus()
    assert samples and all(0 < s.memory_total_bytes and 0 <= s.memory_used_bytes for s in samples)
    registry = CollectorRegistry()
    gpu.register_gpu_collector(registry, "resnet", "3")
    text = generate_latest(registry).decode()
    assert f'kiln_gpu_memory_total_bytes{{gpu="{samples[0].label}",model="resnet",version="3"}}' in text
    if samples[0].utilization is not None:
        assert "kiln_gpu_utilization_ratio{" in text


# ------------------------------------------------------------------ an NVML stand-in

class NvmlError(Exception):
    """pynvml's NVMLError_NotFound / _NotSupported, for the stand-in."""


@dataclass
class Device:
    uuid: str
    name: str = "NVIDIA H200"
    utilization: int | None = None  # percent; None where NVML does not say (a MIG slice)
    used: int = 1 << 30
    total: int = 141 << 30
    slices: dict[int, "Device"] | None = None  # MIG slot -> slice, on a GPU in MIG mode
    instances: tuple[int, int] | None = None  # a slice's GPU and compute instance ids
    capability: tuple[int, int] = (9, 0)


class FakeNvml:
    """The pynvml calls runtime/engine/gpu.py makes, over the GPUs a process sees."""

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, *gpus: Device):
        self.gpus = gpus

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle):
        return handle.name.encode()  # older pynvml answers bytes

    def nvmlDeviceGetUUID(self, handle):
        return handle.uuid

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return handle.capability

    def nvmlDeviceGetMigMode(self, handle):
        return (1, 1) if handle.slices is not None else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return 7 if handle.slices is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        if index not in handle.slices:
            raise NvmlError("NotFound")
        return handle.slices[index]

    def nvmlDeviceGetGpuInstanceId(self, handle):
        return handle.instances[0]

    def nvmlDeviceGetComputeInstanceId(self, handle):
        return handle.instances[1]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=handle.used, total=handle.total)

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle.slices is not None or handle.instances is not None:
            raise NvmlError("NotSupported")
        return SimpleNamespace(gpu=handle.utilization)


GPU0 = "GPU-00000000-1111-2222-3333-444444444444"
GPU1 = "GPU-11111111-1111-2222-3333-444444444444"
GPU2 = "GPU-22222222-1111-2222-3333-444444444444"
MIG_A = "MIG-aaaaaaaa-1111-2222-3333-444444444444"
MIG_B = "MIG-bbbbbbbb-1111-2222-3333-444444444444"


def node() -> FakeNvml:
    """What NVML shows with every GPU of the node visible: two H200s, the first busy with
    another tenant's work, and an A100 in MIG mode with two slices (slot 1 empty)."""
    return FakeNvml(
        Device(GPU0, utilization=95),
        Device(GPU1, utilization=20),
        Device(GPU2, name="NVIDIA A100-SXM4-80GB", capability=(8, 0), slices={
            0: Device(MIG_A, total=40 << 30, instances=(1, 0)),
            2: Device(MIG_B, total=20 << 30, instances=(5, 0))}))


ALL = ["0", "1", f"2/{MIG_A}", f"2/{MIG_B}"]


def given(environ, nvml=None) -> list[str]:
    return [s.label for s in gpu.VisibleDevices(environ).select(gpu.read_gpus(nvml or node()))]


@pytest.mark.parametrize("environ, labels", [
    # Neither set: bare metal, every GPU NVML shows.
    ({}, ALL),
    # The toolkit's own words for "nothing narrower than NVML's view"; `void` is also what
    # CDI injection leaves in a GPU pod while it hands the container only its own devices.
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, ALL),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, ALL),
    ({"NVIDIA_VISIBLE_DEVICES": ""}, ALL),
    ({"NVIDIA_VISIBLE_DEVICES": "none"}, []),
    # The device plugin's ids: UUIDs (its default), host indices, MIG in every form.
    ({"NVIDIA_VISIBLE_DEVICES": GPU1}, ["1"]),
    ({"NVIDIA_VISIBLE_DEVICES": f"{GPU1},{GPU0}"}, ["1", "0"]),
    ({"NVIDIA_VISIBLE_DEVICES": "1"}, ["1"]),
    ({"NVIDIA_VISIBLE_DEVICES": " 0 , 1 "}, ["0", "1"]),
    ({"NVIDIA_VISIBLE_DEVICES": MIG_B}, [f"2/{MIG_B}"]),
    ({"NVIDIA_VISIBLE_DEVICES": f"MIG-{GPU2}/5/0"}, [f"2/{MIG_B}"]),
    ({"NVIDIA_VISIBLE_DEVICES": "2:2"}, [f"2/{MIG_B}"]),
    ({"NVIDIA_VISIBLE_DEVICES": "2:0"}, [f"2/{MIG_A}"]),
    ({"NVIDIA_VISIBLE_DEVICES": GPU2}, [f"2/{MIG_A}", f"2/{MIG_B}"]),
    # Ids that name nothing NVML shows are ignored, the rest still count.
    ({"NVIDIA_VISIBLE_DEVICES": f"{GPU1},bogus,GPU-ffffffff,2:1,7"}, ["1"]),
    ({"NVIDIA_VISIBLE_DEVICES": "GPU-ffffffff"}, []),
    # CUDA_VISIBLE_DEVICES alone narrows NVML's view, as CUDA reads it: up to the first
    # device it cannot find.
    ({"CUDA_VISIBLE_DEVICES": "0"}, ["0"]),
    ({"CUDA_VISIBLE_DEVICES": MIG_A}, [f"2/{MIG_A}"]),
    ({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, ["1"]),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
    ({"CUDA_VISIBLE_DEVICES": ""}, []),
    # With both, CUDA only narrows what the pod was given, never widens it.
    ({"NVIDIA_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": GPU1}, ["1"]),
    ({"NVIDIA_VISIBLE_DEVICES": GPU1, "CUDA_VISIBLE_DEVICES": "0"}, []),
    ({"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "2"}, [f"2/{MIG_A}", f"2/{MIG_B}"]),
], ids=lambda v: " ".join(f"{k.split('_')[0]}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_only_the_devices_given_to_the_pod(environ, labels):
    assert given(environ) == labels


def test_host_indices_in_a_view_the_toolkit_narrowed():
    # The toolkit gave the container host GPUs 3 and 5 only; NVML numbers them 0 and 1.
    narrowed = FakeNvml(Device(GPU0, utilization=40), Device(GPU1, utilization=60))
    assert given({"NVIDIA_VISIBLE_DEVICES": "3,5"}, narrowed) == ["0", "1"]
    assert given({"NVIDIA_VISIBLE_DEVICES": "1"}, FakeNvml(Device(GPU1))) == ["0"]
    # A view wider than the ids (a privileged container sees the node): host numbering.
    assert given({"NVIDIA_VISIBLE_DEVICES": "1"}, narrowed) == ["1"]


def test_the_volume_mounts_device_list(tmp_path):
    # deviceListStrategy=volume-mounts: the variable names a directory, one entry per device.
    (tmp_path / GPU1).touch()
    (tmp_path / MIG_A).touch()
    assert given({"NVIDIA_VISIBLE_DEVICES": str(tmp_path)}) == ["1", f"2/{MIG_A}"]
    assert given({"NVIDIA_VISIBLE_DEVICES": str(tmp_path / "missing")}) == []


def test_an_unknown_id_is_logged_once(caplog):
    visible = gpu.VisibleDevices({"NVIDIA_VISIBLE_DEVICES": f"{GPU1},bogus"})
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.engine.gpu"):
        for _ in range(3):
            assert [s.label for s in visible.select(gpu.read_gpus(node()))] == ["1"]
        # `none` is the toolkit's word for "no GPU", not an unknown id.
        assert gpu.VisibleDevices({"NVIDIA_VISIBLE_DEVICES": "none"}).select(gpu.read_gpus(node())) == []
    assert [r.getMessage() for r in caplog.records] == [
        "NVIDIA_VISIBLE_DEVICES names 'bogus', which is none of the GPUs NVML shows here: ignored"]


def scrape(environ, nvml) -> str:
    registry = CollectorRegistry()
    gpu.register_gpu_collector(registry, "bert", "3", nvml=nvml, environ=environ)
    return generate_latest(registry).decode()


def test_the_collector_exports_only_the_pods_gpu():
    text = scrape({"NVIDIA_VISIBLE_DEVICES": GPU1}, node())
    series = [line for line in text.splitlines() if line.startswith("kiln_gpu_")]
    assert series == [
        'kiln_gpu_utilization_ratio{gpu="1",model="bert",version="3"} 0.2',
        'kiln_gpu_memory_used_bytes{gpu="1",model="bert",version="3"} 1.073741824e+09',
        'kiln_gpu_memory_total_bytes{gpu="1",model="bert",version="3"} 1.51397597184e+11']
    # A MIG slice: memory, no utilization; no GPU given: no series at all.
    text = scrape({"NVIDIA_VISIBLE_DEVICES": "2:0"}, node())
    assert f'kiln_gpu_memory_total_bytes{{gpu="2/{MIG_A}",model="bert",version="3"}}' in text
    assert "kiln_gpu_utilization_ratio" not in text
    assert "kiln_gpu_" not in scrape({"NVIDIA_VISIBLE_DEVICES": "none"}, node())


# ------------------------------------------------------------------ which models export them

@pytest.fixture
def gpu_node(monkeypatch):
    """This process sees the stand-in node's GPUs, as a pod does whose image says `all`."""
    fake = node()
    monkeypatch.setattr(gpu, "_nvml", lambda: fake)
    monkeypatch.setenv(gpu.NVIDIA_VISIBLE_DEVICES_ENV, "all")
    monkeypatch.delenv(gpu.CUDA_VISIBLE_DEVICES_ENV, raising=False)
    return fake


async def served_metrics(root, onnx, backend: str, target: str) -> str:
    """Load `onnx` as a `backend` engine for `target` on this node; its /metrics text."""
    from kiln.runtime.engine.cache.entry import relative_path
    from kiln.runtime.engine.cache.publish import publish
    from kiln.runtime.api import enginekey
    from kiln.runtime.api.spec import runtime_with_defaults
    from kiln.runtime.serving.metrics import ServerMetrics
    from kiln.runtime.serving.model import READY, ServedModel

    ki = enginekey.key_inputs({"uri": "pvc://models/m.onnx", "version": "1"},
                              {"backend": backend, "precision": "fp32"}, target, "1")
    publish(root, "ml", "m", ki.key, onnx, engine_file="engine", inputs=ki.to_dict(),
            backend=backend, backend_version="1", target=target, build_seconds=1)
    metrics = ServerMetrics()
    model = ServedModel("m", "1", root, {target: relative_path("ml", "m", ki.key)}, runtime_with_defaults(),
                        metrics)
    try:
        assert await model.load() and model.state == READY, model.error
        return generate_latest(metrics.registry).decode()
    finally:
        await model.close(0)


async def test_a_cpu_engine_on_a_gpu_node_exports_no_gpu_series(tmp_path, gpu_node, matmul_onnx):
    assert gpu.detect_target() == "sm90"  # the pod sees the node's GPUs
    text = await served_metrics(tmp_path, matmul_onnx, "onnxruntime", "cpu")
    assert 'backend="onnxruntime"' in text and 'target="cpu"' in text
    assert "kiln_gpu_" not in text  # it scales on its busy ratio, never on a GPU it does not use


async def test_a_gpu_engine_exports_only_its_own_gpu(tmp_path, gpu_node, matmul_onnx, monkeypatch):
    from kiln.runtime.engine.backends.onnxruntime import OnnxRuntimeBackend
    from kiln.runtime.engine.backends.tensorrt import TensorRTBackend

    # TensorRT cannot run here: its engine is run by ONNX Runtime, the rest is the GPU path.
    monkeypatch.setattr(TensorRTBackend, "load", lambda self, engine, profiles:
                        OnnxRuntimeBackend().load(engine, profiles))
    monkeypatch.setenv(gpu.NVIDIA_VISIBLE_DEVICES_ENV, GPU1)  # the device plugin's allocation
    text = await served_metrics(tmp_path, matmul_onnx, "tensorrt", "sm90")
    assert [line.split("{")[1].split(",")[0] for line in text.splitlines()
            if line.startswith("kiln_gpu_")] == ['gpu="1"'] * 3


def test_the_gpu_readings_script_reports_each_case():
    # hack/gpu_readings.py records the real readings on a GPU machine (docs/runtime.md).
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "hack" / "gpu_readings.py"
    spec = importlib.util.spec_from_file_location("gpu_readings", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = "\n".join(script.report(node(), {"NVIDIA_VISIBLE_DEVICES": GPU1}))
    assert "(a) CPU engine, backend onnxruntime, NVIDIA_VISIBLE_DEVICES=all:\n  (no kiln_gpu_ series)\n" in text
    own = text.split(" (this process):\n")[1].split("\n(b)")[0].splitlines()
    assert [line.split()[0] for line in own] == [
        'kiln_gpu_utilization_ratio{gpu="1",model="demo",version="1"}',
        'kiln_gpu_memory_used_bytes{gpu="1",model="demo",version="1"}',
        'kiln_gpu_memory_total_bytes{gpu="1",model="demo",version="1"}']
    assert f"(b) GPU engine, backend tensorrt, NVIDIA_VISIBLE_DEVICES={GPU0}:\n  kiln_gpu_utilization_ratio" \
           '{gpu="0",model="demo",version="1"} 0.95\n' in text
