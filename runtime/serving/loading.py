"""What a served model needs before it loads: the engine entries it is given (`--engine
TARGET=RELPATH`), the one for this pod's GPU, the warm-up request at the profiles' optimal
shapes, and the daemon threads its blocking steps run on.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, Mapping

import numpy as np

from kiln.runtime.api.enginekey import CPU_TARGET, normalize_target
from kiln.runtime.engine.backends.base import DATATYPES, ShapeRange, TensorSpec


class ModelLoadError(Exception):
    """The model cannot load on this pod; the message says why and what to do."""


def parse_engines(values: list[str] | Mapping[str, str]) -> dict[str, str]:
    """`["sm90=ns/model/key", "cpu=..."]` (or a mapping) -> {normalized target: path}.

    Raises ValueError naming the bad entry.
    """
    items = values.items() if isinstance(values, Mapping) else []
    if not isinstance(values, Mapping):
        parsed = []
        for value in values:
            target, sep, path = value.partition("=")
            if not sep or not target.strip() or not path.strip():
                raise ValueError(f"--engine {value!r}: expected TARGET=RELPATH, "
                                 f"for example sm90=default/resnet/3f2a…")
            parsed.append((target, path))
        items = parsed
    engines: dict[str, str] = {}
    for target, path in items:
        t = normalize_target(target)
        path = path.strip()
        if os.path.isabs(path) or ".." in path.split("/"):
            raise ValueError(f"engine path {path!r} for {t} must be relative to the cache "
                             f"directory and stay inside it")
        if t in engines and engines[t] != path:
            raise ValueError(f"two engines for target {t}: {engines[t]!r} and {path!r}")
        engines[t] = path
    if not engines:
        raise ValueError("no engine given: pass --engine TARGET=RELPATH at least once")
    return engines


def pick_engine(engines: Mapping[str, str], target: str) -> tuple[str, str]:
    """The entry for this pod's target, else a CPU entry if there is one, else an error."""
    if target in engines:
        return target, engines[target]
    if CPU_TARGET in engines:
        return CPU_TARGET, engines[CPU_TARGET]
    where = "this pod has no GPU" if target == CPU_TARGET else f"this pod's GPU is {target}"
    raise ModelLoadError(f"no engine for target {target} ({where}); engines exist for: "
                         f"{', '.join(sorted(engines))}. Add {target} to spec.engine.targets "
                         f"or schedule the pods on nodes with a matching GPU")


def warmup_inputs(inputs: list[TensorSpec], profiles: Mapping[str, ShapeRange],
                  max_batch: int | None = None) -> dict[str, np.ndarray]:
    """Zero tensors at the profiles' optimal shapes; 1 for dynamic dims without a profile.

    Every input with a dynamic batch dimension gets the same batch (the first profiled
    input's optimal batch, at most `max_batch`), so the request is one consistent batch.
    Zeros are valid for index inputs too (embeddings, gathers).
    """
    batch = 1
    for spec in inputs:
        rng = profiles.get(spec.name)
        if rng is not None and spec.shape and spec.shape[0] < 0 and rng.opt:
            batch = int(rng.opt[0])
            break
    if max_batch is not None:
        batch = max(1, min(batch, max_batch))
    out = {}
    for spec in inputs:
        rng = profiles.get(spec.name)
        shape = []
        for i, dim in enumerate(spec.shape):
            if dim >= 0:
                shape.append(dim)
            elif i == 0:
                shape.append(batch)
            elif rng is not None and len(rng.opt) == len(spec.shape):
                shape.append(int(rng.opt[i]))
            else:
                shape.append(1)
        out[spec.name] = np.zeros(shape, dtype=DATATYPES[spec.datatype])
    return out


def on_daemon_thread(name: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run `fn(*args)` on a new daemon thread; its result comes back through a future.

    Not asyncio.to_thread: the default executor's workers are joined when the loop and
    the interpreter shut down, so one stuck in a read of a hung volume would keep a
    SIGTERM'd process alive. A daemon thread is abandoned at exit; cancelling the future
    abandons it sooner (its late result is dropped).
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled: the load gave up on it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def default_scheduler(engine, runtime_spec, metrics, model, engine_key, clock, version):
    """The object a ServedModel's requests go through: the batching Scheduler."""
    from kiln.runtime.serving.scheduling.scheduler import Scheduler
    return Scheduler(engine, runtime_spec, metrics, model, engine_key, clock=clock, version=version)


def detect_target() -> str:
    """This pod's GPU architecture (or cpu), to pick its engine."""
    from kiln.runtime.engine.gpu import detect_target as detect
    return detect()
