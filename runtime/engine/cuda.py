"""The GPU path's one home for device memory, pinned host buffers and streams (pycuda).

Both GPU engines use it: TensorRT binds its tensor addresses to these buffers and enqueues on
the context's stream; ONNX Runtime's CUDA provider binds its I/O to the same buffers (I/O
binding takes raw device pointers) and runs on the same stream (its `user_compute_stream`).
A batch is one copy in per input from pinned memory, the engine, one copy out per output,
one synchronize; each execution context owns its buffers and stream, so several contexts
overlap one batch's copies with another's compute.

Every call here runs with the device's primary context current: the context the CUDA
runtime (which TensorRT and ONNX Runtime call) uses too, so pointers and streams made here
are valid to them. pycuda is imported only when a GPU engine loads, so this module imports
on any machine.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from kiln.runtime.engine.backends.base import InvalidInputError, UnsupportedError


def import_cuda() -> Any:
    try:
        import pycuda.driver as cuda
    except ImportError as e:
        raise UnsupportedError(
            f"GPU engines need pycuda for device buffers and streams ({e}); install the "
            f"kiln-operator[gpu] extra in the runtime image") from None
    return cuda


class Device:
    """One GPU through its primary context. `cuda`: pycuda.driver, injectable for tests."""

    def __init__(self, index: int = 0, cuda: Any = None):
        self.cuda = cuda if cuda is not None else import_cuda()
        self.cuda.init()
        self.index = index
        self.context = self.cuda.Device(index).retain_primary_context()

    @contextmanager
    def current(self) -> Iterator[None]:
        """This thread's current context is the device's, for the block."""
        self.context.push()
        try:
            yield
        finally:
            self.cuda.Context.pop()

    def stream(self) -> Any:
        return self.cuda.Stream()

    def staged(self, shape: tuple[int, ...], dtype: np.dtype) -> "Staged":
        return Staged(self.cuda, int(np.prod(shape, dtype=np.int64)) if shape else 1, dtype)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory."""
        free, total = self.cuda.mem_get_info()
        return int(free), int(total)


class Staged:
    """One tensor's device buffer at its largest shape and the pinned host buffer beside it."""

    def __init__(self, cuda: Any, count: int, dtype: np.dtype):
        self._cuda = cuda
        self.dtype = np.dtype(dtype)
        self.capacity = max(count, 1)
        self.host = cuda.pagelocked_empty(self.capacity, self.dtype)
        self.device = cuda.mem_alloc(self.capacity * self.dtype.itemsize)

    @property
    def pointer(self) -> int:
        return int(self.device)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.dtype.itemsize

    def upload(self, name: str, array: np.ndarray, stream: Any) -> None:
        """Stage `array` in pinned memory and queue its copy to the device on `stream`."""
        flat = np.ascontiguousarray(array, dtype=self.dtype).reshape(-1)
        if flat.size > self.capacity:
            raise InvalidInputError(f"input {name!r} shape {array.shape} is larger than the "
                                    f"buffer sized for the engine's largest batch")
        staged = self.host[:flat.size]
        staged[:] = flat
        self._cuda.memcpy_htod_async(self.device, staged, stream)

    def download(self, count: int, stream: Any) -> np.ndarray:
        """Queue the copy of the first `count` elements to pinned memory; the view is valid
        once `stream` is synchronized, until the next batch reuses the buffer."""
        view = self.host[:count]
        self._cuda.memcpy_dtoh_async(view, self.device, stream)
        return view

    def free(self) -> None:
        """Both buffers, now, with the device current: pinned memory left to the garbage
        collector would be freed on a thread without the context (pycuda warns, and leaks)."""
        self.device.free()
        allocation = getattr(self.host, "base", None)
        if hasattr(allocation, "free"):
            allocation.free()
