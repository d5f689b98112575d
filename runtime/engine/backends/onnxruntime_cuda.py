"""ONNX Runtime engines on the CUDA provider: a session, a stream, staged buffers and CUDA
graphs per execution context (the load half of a GPU target of the onnxruntime backend)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from kiln.runtime.engine.backends.base import DATATYPES, BackendError, ShapeRange, TensorSpec
from kiln.runtime.engine.backends.onnxruntime import (CUDA_PROVIDER, _run_error, _session_options,
                                               _spec)

if TYPE_CHECKING:
    from kiln.runtime.engine.backends.onnxruntime import OnnxRuntimeBackend

log = logging.getLogger("kiln.runtime.engine.onnxruntime")


def _batched(specs: list[TensorSpec]) -> bool:
    """Every tensor has a dynamic batch dimension and fixed others: buffers fit any batch."""
    return all(len(s.shape) >= 1 and s.shape[0] == -1 and all(d >= 0 for d in s.shape[1:])
               for s in specs)


def _fixed(specs: list[TensorSpec]) -> bool:
    return all(all(d >= 0 for d in s.shape) for s in specs)


class OrtCudaEngine:
    """An engine on ONNX Runtime's CUDA provider.

    Each context is a session of its own, on its own CUDA stream: the provider takes one
    compute stream per session, and a stream per context is what lets one context's copies
    overlap another's compute (the weights are on the GPU once per context). Where every
    tensor's shape is fixed but for the batch, a context binds its I/O to device buffers sized
    for the largest batch (`capacity`) and replays a CUDA graph per batch size, a formed batch
    padded up to the nearest captured size; other models run with ONNX Runtime's own copies.
    """

    contexts_any_thread = False  # a GPU batch runs in its slot's thread, never the event loop

    def __init__(self, backend: OnnxRuntimeBackend, ort: Any, engine: bytes,
                 profiles: dict[str, ShapeRange]):
        from kiln.runtime.engine.cuda import Device

        self._backend, self._ort, self._engine = backend, ort, engine
        self.options = backend.gpu
        self.device = Device(self.options.device)
        self.profiles = profiles
        # One context is made at a time: a CUDA graph capture fails if another thread
        # allocates meanwhile (the pool makes its contexts in parallel threads).
        self._lock = threading.Lock()
        self.graphs_off: str | None = None if self.options.cuda_graphs else "off by setting"
        with self._lock, self.device.current():
            self._spare: Any = self._open()
        session = self._spare[1]
        self.inputs = [_spec(a) for a in session.get_inputs()]
        self.outputs = [_spec(a) for a in session.get_outputs()]
        self.defaults = [_spec(a) for a in session.get_overridable_initializers()]
        self.default_values: dict[str, np.ndarray] = {}
        io = self.inputs + self.outputs
        self.bound = _batched(io) or _fixed(io)
        self.capacity = (self.options.max_batch or self._profile_batch() or 1) if _batched(io) \
            else (self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else 1)
        self.capture_seconds = 0.0
        log.info("CUDA engine on GPU %d: I/O %s, memory limit %s", self.device.index,
                 f"bound to device buffers for batches up to {self.capacity}" if self.bound
                 else "copied by ONNX Runtime (dynamic dimensions beside the batch)",
                 f"{self.options.memory_limit_mib} MiB for {self.options.contexts} context(s)"
                 if self.options.memory_limit_mib else "none (spec.runtime.gpu.memoryLimitMiB)")

    def _profile_batch(self) -> int | None:
        batches = [r.max[0] for r in self.profiles.values() if r.max]
        return min(batches) if batches else None

    def graph_sizes(self) -> tuple[int, ...]:
        if self.graphs_off or not self.bound:
            return ()
        if _fixed(self.inputs + self.outputs):
            return (self.capacity,)
        return self.options.graph_sizes(self.capacity)

    def _open(self, graphs: bool | None = None) -> tuple[Any, Any, bool]:
        """(stream, session, graphs on) for one context; the device is current."""
        ort = self._ort
        graphs = self.graphs_off is None if graphs is None else graphs
        stream = self.device.stream()
        cuda = {"device_id": str(self.device.index),
                "has_user_compute_stream": "1", "user_compute_stream": str(int(stream.handle))}
        if self.options.memory_limit_mib:
            share = (self.options.memory_limit_mib << 20) // max(self.options.contexts, 1)
            cuda.update(gpu_mem_limit=str(share), arena_extend_strategy="kSameAsRequested")
        if graphs:
            cuda["enable_cuda_graph"] = "1"
        # Intra-op threads only run the few nodes left on the CPU (shape arithmetic).
        so = _session_options(ort, self._backend.intra_op_threads or 1)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            session = self._backend._session(ort, self._engine, so,
                                             [(CUDA_PROVIDER, cuda), "CPUExecutionProvider"])
        except BackendError:
            raise
        except Exception as e:
            if graphs:  # e.g. nodes left on the CPU: graphs need every node on the GPU
                self.graphs_off = f"ONNX Runtime refused them: {' '.join(str(e).split())}"
                log.warning("CUDA graphs off for this engine: %s", self.graphs_off)
                return self._open(graphs=False)
            raise BackendError(f"ONNX Runtime cannot load the engine on GPU "
                               f"{self.device.index}: {e}") from None
        return stream, session, graphs

    def take_session(self) -> tuple[Any, Any, bool]:
        spare, self._spare = self._spare, None
        return spare if spare is not None else self._open()

    def create_context(self) -> "OrtCudaContext":
        if self._engine is None:
            raise BackendError("the engine is closed")
        return OrtCudaContext(self)

    def close(self) -> None:
        self._spare = None
        self._engine = None  # type: ignore[assignment]


class OrtCudaContext:
    """One session, its stream, its staged buffers and its CUDA graphs; used by one thread at
    a time."""

    def __init__(self, engine: OrtCudaEngine):
        ort = engine._ort
        self._engine = engine
        self._buffers: dict[str, Any] = {}
        self._options: dict[int, Any] = {}
        self.sizes: tuple[int, ...] = ()
        with engine._lock, engine.device.current():
            self._stream, self._session, graphs = engine.take_session()
            self._binding: Any = self._session.io_binding() if engine.bound else None
            if engine.bound:
                for spec in engine.inputs + engine.outputs:
                    shape = (engine.capacity,) + spec.shape[1:]
                    self._buffers[spec.name] = engine.device.staged(shape, DATATYPES[spec.datatype])
            self._plain = self._run_options(-1)
            if graphs:
                self._capture(ort, engine.graph_sizes())

    def _run_options(self, graph: int) -> Any:
        options = self._engine._ort.RunOptions()
        # -1: no graph (ONNX Runtime captures one per id on its first runs, then replays it).
        options.add_run_config_entry("gpu_graph_id", str(graph))
        self._options[graph] = options
        return options

    def _capture(self, ort: Any, sizes: tuple[int, ...]) -> None:
        engine = self._engine
        started = time.monotonic()
        try:
            for size in sizes:
                self._run_options(size)
                feeds = {s.name: np.zeros((size,) + s.shape[1:], DATATYPES[s.datatype])
                         for s in engine.inputs}
                for _ in range(3):  # a regular run, the capture, a replay
                    self._run_bound(feeds, size, size)
        except Exception as e:
            engine.graphs_off = f"the capture failed: {' '.join(str(e).split())}"
            log.warning("CUDA graphs off for this engine: %s", engine.graphs_off)
            self._stream, self._session, _ = engine._open(graphs=False)
            self._binding = self._session.io_binding()
            self._options = {}
            self._plain = self._run_options(-1)
            return
        self.sizes = sizes
        engine.capture_seconds = time.monotonic() - started
        log.info("captured CUDA graphs for batch sizes %s in %.2f s", list(sizes),
                 engine.capture_seconds)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        engine, session = self._engine, self._session
        if session is None:
            raise BackendError("the execution context is closed")
        try:
            if engine.bound:
                rows = self._rows(inputs)
                if rows is not None:
                    size = next((s for s in self.sizes if s >= rows), rows)
                    with engine.device.current():
                        return self._run_bound(inputs, rows, size)
            names = [o.name for o in engine.outputs]
            return dict(zip(names, session.run(names, dict(inputs), self._plain)))
        except Exception as e:
            raise _run_error(e) from None

    def _rows(self, inputs: Mapping[str, np.ndarray]) -> int | None:
        """The batch, when every input fits the buffers (else ONNX Runtime copies, and says
        what is wrong with the inputs)."""
        engine = self._engine
        rows = None
        for spec in engine.inputs:
            array = inputs.get(spec.name)
            if array is None or array.ndim != len(spec.shape) or \
                    array.shape[1:] != spec.shape[1:] or array.dtype != DATATYPES[spec.datatype]:
                return None
            if rows is None:
                rows = array.shape[0]
            elif array.shape[0] != rows:
                return None
        return rows if rows is not None and 0 < rows <= engine.capacity else None

    def _run_bound(self, inputs: Mapping[str, np.ndarray], rows: int, size: int) -> dict[str, np.ndarray]:
        """Copy in, run (replaying the graph of `size` where there is one), copy out. Rows
        past `rows` up to `size` are the buffers' leftovers: their answers are dropped."""
        engine, binding, stream = self._engine, self._binding, self._stream
        index = engine.device.index
        for spec in engine.inputs:
            buffer = self._buffers[spec.name]
            buffer.upload(spec.name, inputs[spec.name], stream)
            binding.bind_input(spec.name, "cuda", index, buffer.dtype.type, (size,) + spec.shape[1:],
                               buffer.pointer)
        for spec in engine.outputs:
            buffer = self._buffers[spec.name]
            binding.bind_output(spec.name, "cuda", index, buffer.dtype.type, (size,) + spec.shape[1:],
                                buffer.pointer)
        # The graph of `size` where one is captured (or being captured), else none.
        self._session.run_with_iobinding(binding, self._options.get(size, self._plain))
        views = {}
        for spec in engine.outputs:
            shape = (rows,) + spec.shape[1:]
            count = int(np.prod(shape, dtype=np.int64))
            views[spec.name] = (self._buffers[spec.name].download(count, stream), shape)
        stream.synchronize()
        # Copies: the pinned buffers are reused by the next batch.
        return {name: view.reshape(shape).copy() for name, (view, shape) in views.items()}

    def close(self) -> None:
        if self._session is None:
            return
        with self._engine.device.current():
            for buffer in self._buffers.values():
                buffer.free()
            self._buffers.clear()
            self._binding = self._session = self._stream = None
