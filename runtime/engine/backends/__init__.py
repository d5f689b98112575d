"""Engine backends behind one interface (base.py); each imported only when asked for."""

from __future__ import annotations

import importlib

from kiln.runtime.engine.backends.base import Backend, UnsupportedError

# name -> "module:class"; modules import their heavy libraries lazily too.
BACKENDS = {
    "onnxruntime": "kiln.runtime.engine.backends.onnxruntime:OnnxRuntimeBackend",
    "tensorrt": "kiln.runtime.engine.backends.tensorrt:TensorRTBackend",
}


def get_backend(name: str) -> Backend:
    """The backend called `name`; UnsupportedError lists the known ones otherwise."""
    target = BACKENDS.get(name)
    if target is None:
        raise UnsupportedError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()
