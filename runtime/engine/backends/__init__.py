"""Engine backends behind one interface (base.py); each imported only when asked for."""

from __future__ import annotations

import importlib

from kiln.runtime.engine.backends.base import Backend, GpuOptions, UnsupportedError

# name -> "module:class"; modules import their heavy libraries lazily too.
BACKENDS = {
    "onnxruntime": "kiln.runtime.engine.backends.onnxruntime:OnnxRuntimeBackend",
    "tensorrt": "kiln.runtime.engine.backends.tensorrt:TensorRTBackend",
}


def get_backend(name: str, target: str = "cpu", gpu: GpuOptions | None = None) -> Backend:
    """The backend called `name`, building and loading engines for `target` (cpu or a GPU
    architecture; `gpu` says how a GPU engine uses its device); UnsupportedError lists the
    known backends otherwise."""
    where = BACKENDS.get(name)
    if where is None:
        raise UnsupportedError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    module, cls = where.split(":")
    return getattr(importlib.import_module(module), cls).for_target(target, gpu or GpuOptions())
