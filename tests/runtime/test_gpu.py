"""NVML readings: "cpu" and no GPU series without a GPU; real readings where one exists."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kiln.runtime import gpu


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
