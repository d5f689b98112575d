"""A pool of execution contexts over one loaded engine.

Each context has its own worker thread, so batches run concurrently while the event loop
keeps serving (ONNX Runtime, TensorRT and numpy release the GIL while they compute); a
batch that takes microseconds, on an engine whose contexts may run on any thread, runs on
the loop's own thread instead (`INLINE_BATCH_SECONDS`).
A failed execution closes its context, creates a fresh one from the same loaded engine
(never reloading the engine) and retries the batch, a bounded number of times. After
`unhealthy_after` consecutive batches fail every attempt the pool reports unhealthy
(the model turns not-ready); the next successful batch makes it healthy again. A batch
the engine refuses for its inputs (`InvalidInputError`) is neither retried nor counted:
it is the data's fault, and one client's data must not take the pod out of service.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from kiln.runtime.engine.backends.base import ExecutionContext, InvalidInputError, LoadedEngine
from kiln.runtime.serving.metrics import ServerMetrics

MAX_CONTEXTS = 16  # the CRD's bound on runtime.contextsPerGPU
# A batch expected to take less than this runs on the event loop's own thread, where the
# engine allows it: handing it to a context's thread and back costs the loop more (a wake-up,
# a cross-thread callback, the GIL passed twice) than a tiny model's whole execution.
INLINE_BATCH_SECONDS = 200e-6
_EWMA = 0.2


@dataclass
class Slot:
    """One execution context and the thread that is the only one to use it."""

    index: int
    executor: ThreadPoolExecutor
    context: ExecutionContext | None = None


@dataclass(frozen=True)
class RunResult:
    outputs: dict[str, np.ndarray]
    attempts: int
    seconds: float  # wall time of all attempts, recreations included
    recovery_seconds: float | None  # first failure -> successful retry; None without failure


class ExecutionError(Exception):
    """Every attempt at one batch failed; `__cause__` is the last error."""

    def __init__(self, message: str, attempts: int):
        super().__init__(message)
        self.attempts = attempts


class ContextPool:
    def __init__(self, engine: LoadedEngine, size: int, metrics: ServerMetrics, model: str, *,
                 version: str = "", max_retries: int = 2, unhealthy_after: int = 3,
                 clock: Callable[[], float] = time.monotonic):
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_CONTEXTS:
            raise ValueError(f"contextsPerGPU must be an integer from 1 to {MAX_CONTEXTS}, got {size!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        if isinstance(unhealthy_after, bool) or not isinstance(unhealthy_after, int) or unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be an integer >= 1, got {unhealthy_after!r}")
        self.engine = engine
        self.size = size
        self.max_retries = max_retries
        self.unhealthy_after = unhealthy_after
        self._clock = clock
        self._executions = {o: metrics.executions.labels(model, o)
                            for o in ("success", "retried", "failed", "refused")}
        self._recreations = metrics.context_recreations.labels(model)
        self._busy = metrics.engine_busy_seconds.labels(model, version)
        self._busy_recently = metrics.busy_window(model, version)
        self._recovery = metrics.context_recovery_seconds.labels(model)
        self._slots = [Slot(i, ThreadPoolExecutor(1, thread_name_prefix=f"kiln-context-{i}"))
                       for i in range(size)]
        self._free: asyncio.Queue[Slot] = asyncio.Queue()
        self._consecutive_failures = 0
        self._started = False
        self._closed = False
        self.last_recovery_seconds: float | None = None
        self._inline_ok = bool(getattr(engine, "contexts_any_thread", False))
        self._recent_seconds: float | None = None  # EWMA of one execution's wall time

    @property
    def healthy(self) -> bool:
        return self._started and not self._closed and self._consecutive_failures < self.unhealthy_after

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    async def start(self) -> None:
        """Create every context (each in its own thread, as it will be used)."""
        if self._started:
            raise RuntimeError("context pool already started")
        loop = asyncio.get_running_loop()
        contexts = await asyncio.gather(
            *(loop.run_in_executor(s.executor, self.engine.create_context) for s in self._slots),
            return_exceptions=True)
        errors = [c for c in contexts if isinstance(c, BaseException)]
        for slot, ctx in zip(self._slots, contexts):
            if not isinstance(ctx, BaseException):
                slot.context = ctx
        if errors:
            await self.close()
            raise errors[0]
        for slot in self._slots:
            self._free.put_nowait(slot)
        self._started = True

    async def acquire(self) -> Slot:
        """Wait for an idle context."""
        return await self._free.get()

    def release(self, slot: Slot) -> None:
        self._free.put_nowait(slot)

    def idle(self) -> int:
        return self._free.qsize()

    async def run(self, slot: Slot, inputs: Mapping[str, np.ndarray]) -> RunResult:
        """Run one batch on `slot`'s context in its thread; raise ExecutionError when every
        attempt failed."""
        if self._closed:
            raise RuntimeError("context pool is closed")
        started = self._clock()
        try:
            if self._inline_ok and self._recent_seconds is not None and \
                    self._recent_seconds < INLINE_BATCH_SECONDS:
                result = self._run_with_retries(slot, inputs)
            else:
                result = await asyncio.get_running_loop().run_in_executor(
                    slot.executor, self._run_with_retries, slot, inputs)
        except ExecutionError:
            self._consecutive_failures += 1
            raise
        finally:  # failed attempts kept the context busy too
            seconds = self._clock() - started
            self._busy.inc(seconds / self.size)
            self._busy_recently.add(seconds / self.size)
            self._recent_seconds = seconds if self._recent_seconds is None else (
                _EWMA * seconds + (1 - _EWMA) * self._recent_seconds)
        self._consecutive_failures = 0
        return result

    def _run_with_retries(self, slot: Slot, inputs: Mapping[str, np.ndarray]) -> RunResult:
        started = self._clock()
        first_failure: float | None = None
        last_error: BaseException | None = None
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                if slot.context is None:  # an earlier recreation failed: try again now
                    self._recreate(slot)
                outputs = slot.context.run(inputs)  # type: ignore[union-attr]
            except InvalidInputError:
                self._executions["refused"].inc()
                raise  # the context is fine, and would refuse these inputs again
            except Exception as e:  # noqa: BLE001 - any engine failure is retried on a fresh context
                last_error = e
                if first_failure is None:
                    first_failure = self._clock()
                self._executions["retried" if attempt < attempts else "failed"].inc()
                self._discard(slot)
                if attempt < attempts:
                    try:
                        self._recreate(slot)
                    except Exception as e2:  # noqa: BLE001 - retried on the next attempt
                        last_error = e2
                continue
            self._executions["success"].inc()
            now = self._clock()
            recovery = None
            if first_failure is not None:
                recovery = now - first_failure
                self.last_recovery_seconds = recovery
                self._recovery.observe(recovery)
            return RunResult(dict(outputs), attempt, now - started, recovery)
        raise ExecutionError(f"{type(last_error).__name__}: {last_error}", attempts) from last_error

    def _recreate(self, slot: Slot) -> None:
        slot.context = self.engine.create_context()
        self._recreations.inc()

    @staticmethod
    def _discard(slot: Slot) -> None:
        ctx, slot.context = slot.context, None
        if ctx is not None:
            try:
                ctx.close()
            except Exception:  # noqa: BLE001 - a broken context may fail to close; it is dropped anyway
                pass

    async def close(self) -> None:
        """Close every context in its own thread, after any batch it is running; do not wait
        for those batches (the scheduler has already waited as long as it was allowed to)."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            slot.executor.submit(self._discard, slot)
            slot.executor.shutdown(wait=False)
