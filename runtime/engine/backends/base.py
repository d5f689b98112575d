"""The one small interface every engine backend implements.

Nothing above this module (builder, cache, server, batcher, operator) may know which
backend is in use. A backend turns ONNX bytes into engine bytes, loads engine bytes,
and gives out execution contexts that run one batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

# Open Inference Protocol (v2) datatype names <-> numpy dtypes.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "INT8": np.dtype(np.int8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}


class BackendError(Exception):
    """A failure inside the backend (build or execution), with a message for people."""


class UnsupportedError(BackendError):
    """The request cannot work with this backend (for example an unsupported precision)."""


class InvalidModelError(BackendError):
    """The ONNX model is malformed or cannot be parsed by the backend."""


class InvalidInputError(BackendError):
    """The engine refused a batch for its inputs (a shape, datatype or value the model
    cannot take), not for a fault of its own: a fresh context would refuse it the same way,
    and it says nothing about the engine's health."""


class InvalidProfileError(BackendError):
    """The shape profiles do not fit the model's inputs (unknown input, rank, min > max)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # a key of DATATYPES
    shape: tuple[int, ...]  # -1 for a dynamic dimension; dimension 0 is the batch when dynamic


@dataclass(frozen=True)
class ShapeRange:
    """One input's optimization-profile range (TensorRT's min/opt/max)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


@dataclass(frozen=True)
class BuildOptions:
    precision: str = "fp32"  # fp32, fp16, bf16, int8, fp8
    profiles: Mapping[str, ShapeRange] = field(default_factory=dict)
    workspace_mib: int | None = None
    builder_flags: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuOptions:
    """How a GPU engine uses its device (spec.runtime.gpu and the batching it serves); CPU
    engines ignore it."""

    device: int = 0
    max_batch: int | None = None  # the batcher's largest batch: device buffers are sized for it
    contexts: int = 1  # execution contexts over the engine (each its own stream and buffers)
    memory_limit_mib: int | None = None  # for the whole pod's engine, shared by its contexts
    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = ()  # empty: powers of two up to max_batch, and max_batch

    @classmethod
    def from_runtime(cls, runtime: Mapping[str, Any]) -> "GpuOptions":
        """From a runtime spec with its defaults applied (kiln.runtime.api.spec)."""
        gpu = runtime.get("gpu") or {}
        batching = runtime.get("batching") or {}
        return cls(max_batch=batching.get("maxBatchSize") if batching.get("enabled", True) else None,
                   contexts=int(runtime.get("contextsPerGPU") or 1),
                   memory_limit_mib=gpu.get("memoryLimitMiB"),
                   cuda_graphs=bool(gpu.get("cudaGraphs", True)),
                   graph_batch_sizes=tuple(sorted(set(gpu.get("graphBatchSizes") or ()))))

    def graph_sizes(self, capacity: int) -> tuple[int, ...]:
        """The batch sizes to capture a CUDA graph for, none above `capacity`."""
        if not self.cuda_graphs:
            return ()
        if self.graph_batch_sizes:
            return tuple(b for b in self.graph_batch_sizes if b <= capacity)
        sizes = {capacity}
        b = 1
        while b < capacity:
            sizes.add(b)
            b *= 2
        return tuple(sorted(sizes))


class ExecutionContext(Protocol):
    """Runs one batch at a time; used from one worker thread at a time."""

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class LoadedEngine(Protocol):
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    profiles: Mapping[str, ShapeRange]  # empty when the engine has static shapes
    # Optional (read with getattr): inputs the engine has a default value for, which it
    # runs without (a stateful model's declared initial state), and those values.
    # defaults: list[TensorSpec]; default_values: Mapping[str, np.ndarray]
    # contexts_any_thread: bool -- its contexts may run on any thread (ONNX Runtime's are
    # handles on a thread-safe session; TensorRT's are bound to their CUDA thread).

    def create_context(self) -> ExecutionContext: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """One backend for one target (`get_backend(name, target)`): its engines run there."""

    name: str  # "tensorrt" | "onnxruntime"
    engine_filename: str  # file name inside a cache entry, e.g. "engine.plan"
    uses_gpu: bool  # its engines run on a GPU: only then does the pod export GPU series

    def version(self) -> str: ...

    def build(self, onnx_model: bytes, options: BuildOptions) -> bytes: ...

    def load(self, engine: bytes, profiles: Mapping[str, ShapeRange]) -> LoadedEngine: ...
