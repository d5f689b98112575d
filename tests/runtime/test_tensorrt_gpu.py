"""The TensorRT backend's CUDA half on a real GPU: pycuda buffers, streams and contexts.

TensorRT itself cannot be installed where these tests run (TESTING.md; not on the GPU
machine either), so the engine is a stand-in whose `execute_async_v3` launches a real
CUDA kernel (y = 2x + 1) over the device addresses the backend bound. Everything around
it is the backend's own code on a real GPU: the retained primary context pushed and
popped per call, pinned host buffers, device allocations sized for the profile's maximum,
`set_tensor_address`, async copies on each context's stream, synchronize, freeing, and
several contexts in several threads under the scheduler. Skipped without a GPU.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.engine.backends.base import BackendError
from kiln.runtime.engine.backends.tensorrt import TRT_DATATYPES, TensorRTBackend
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling.scheduler import Scheduler

pytestmark = pytest.mark.gpu


def _cuda():
    try:
        import pycuda.driver as cuda
        cuda.init()
        if cuda.Device.count() > 0:
            return cuda
    except Exception:  # no pycuda, no driver, or no device: all mean "not here"
        pass
    pytest.skip("needs an NVIDIA GPU and pycuda (the kiln-operator[gpu] extra)")


@pytest.fixture(scope="module")
def cuda():
    return _cuda()


KERNEL = """
__global__ void affine(const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + 1.0f;
}
"""
WIDTH, MAX_BATCH = 4, 64


class FakeTrt:
    """The few TensorRT names the backend's load path touches; the engine is AffineEngine."""

    __version__ = "gpu-test"

    class ILogger:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        def __init__(self):
            pass

    class TensorIOMode:
        INPUT, OUTPUT = "input", "output"

    DataType = type("DataType", (), {name: name for name in TRT_DATATYPES})

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            return AffineEngine() if bytes(data) == b"affine" else None


class AffineEngine:
    num_io_tensors = 2
    names = ("x", "y")

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return FakeTrt.TensorIOMode.INPUT if name == "x" else FakeTrt.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return FakeTrt.DataType.FLOAT

    def get_tensor_shape(self, name):
        return (-1, WIDTH)

    def get_tensor_profile_shape(self, name, profile):
        return (1, WIDTH), (8, WIDTH), (MAX_BATCH, WIDTH)

    def create_execution_context(self):
        return AffineContext()


class AffineContext:
    def __init__(self):
        from pycuda.compiler import SourceModule  # compiled in the context the backend pushed

        self.kernel = SourceModule(KERNEL).get_function("affine")
        self.shape = (MAX_BATCH, WIDTH)
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name, shape):
        self.shape = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        return self.shape

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream_handle):
        # On the legacy default stream, which orders itself after the copies the backend
        # queued on its own (blocking) stream, and before the copies back.
        n = math.prod(self.shape)
        self.kernel(np.uintp(self.addresses["x"]), np.uintp(self.addresses["y"]), np.int32(n),
                    block=(256, 1, 1), grid=((n + 255) // 256, 1))
        return True


def test_contexts_run_batches_through_real_device_buffers(cuda):
    backend = TensorRTBackend(trt_module=FakeTrt, cuda_module=cuda)
    engine = backend.load(b"affine", {})
    assert [(s.name, s.datatype, s.shape) for s in engine.inputs] == [("x", "FP32", (-1, WIDTH))]
    assert engine.profiles["x"].max == (MAX_BATCH, WIDTH)
    rng = np.random.default_rng(0)

    ctx = engine.create_context()
    for rows in (1, 8, 63, MAX_BATCH, 3):  # grow, then shrink: buffers are reused
        x = rng.standard_normal((rows, WIDTH), dtype=np.float32)
        y = ctx.run({"x": x})["y"]
        assert y.shape == (rows, WIDTH)
        np.testing.assert_array_equal(y, 2 * x + 1)
    with pytest.raises(BackendError, match=r"exceeds the engine's maximum \(64, 4\)"):
        ctx.run({"x": np.zeros((MAX_BATCH + 1, WIDTH), np.float32)})

    # Closing frees the device memory; a recreated context (what the pool does after a
    # failed execution) works on the same engine.
    with engine.device.current():
        free_before_close = engine.device.memory()[0]
    ctx.close()
    ctx.close()
    again = engine.create_context()
    x = rng.standard_normal((5, WIDTH), dtype=np.float32)
    np.testing.assert_array_equal(again.run({"x": x})["y"], 2 * x + 1)
    again.close()
    with engine.device.current():
        assert engine.device.memory()[0] >= free_before_close
    engine.close()


def test_scheduler_batches_over_gpu_contexts_in_threads(cuda):
    engine = TensorRTBackend(trt_module=FakeTrt, cuda_module=cuda).load(b"affine", {})
    spec = {"contextsPerGPU": 3,
            "batching": {"enabled": True, "maxBatchSize": MAX_BATCH, "maxQueueDelayMicroseconds": 500}}
    metrics = ServerMetrics()
    rng = np.random.default_rng(1)
    requests = [rng.standard_normal((int(rng.integers(1, 9)), WIDTH), dtype=np.float32)
                for _ in range(200)]

    async def main():
        scheduler = Scheduler(engine, runtime_with_defaults(spec), metrics, "affine", "k")
        await scheduler.start()
        try:
            return await asyncio.gather(*(scheduler.submit({"x": x}) for x in requests))
        finally:
            await scheduler.close(5)

    for x, out in zip(requests, asyncio.run(main())):
        np.testing.assert_array_equal(out["y"], 2 * x + 1)
    batches = metrics.registry.get_sample_value("kiln_batch_size_count", {"model": "affine"})
    assert batches < len(requests)  # requests shared batches on the GPU
    engine.close()
