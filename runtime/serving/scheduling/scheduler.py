"""The scheduling core between the HTTP server and the engine.

    request -> [result cache] -> bounded queue -> batcher -> context pool -> engine
                                                     <- split by rows <-

`Scheduler.submit()` is all the server calls per request. Requests wait in a bounded
queue grouped by what lets them share a batch; one batcher task waits for an idle
execution context, then forms the next batch (runtime/serving/scheduling/batching.py decides when) and hands
it to that context's thread (runtime/serving/scheduling/pool.py). Results go back to each request by its
rows; a failed batch fails its own requests and no others.

The errors a request can get are runtime/serving/scheduling/errors.py's.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping

import numpy as np

from kiln.runtime.api.spec import require_keys
from kiln.runtime.serving.scheduling import batching
from kiln.runtime.engine.backends.base import InvalidInputError, LoadedEngine
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, InputsRefused, InvalidBatch, Overloaded, ShuttingDown
from kiln.runtime.serving.scheduling.pool import ContextPool, ExecutionError, Slot
from kiln.runtime.serving.scheduling.resultcache import ResultCacheConfig
from kiln.runtime.serving.scheduling.resultlevels import result_levels

MAX_RETRIES = 2  # re-executions of a failed batch, each on a freshly created context
UNHEALTHY_AFTER = 3  # consecutive batches that failed every attempt -> not ready
_EWMA = 0.2  # weight of the newest batch in the running batch-time estimate


@dataclass(eq=False)
class _Request:
    inputs: Mapping[str, np.ndarray]
    rows: int
    group: Hashable
    enqueued: float
    future: asyncio.Future = field(repr=False)
    queued: bool = True


def _engine_batching(engine: LoadedEngine) -> tuple[bool, int | None]:
    """Whether the engine takes a batch in dimension 0 of every input, and the largest batch
    its optimization profiles allow (None when unbounded)."""
    batchable = bool(engine.inputs) and all(len(s.shape) >= 1 and s.shape[0] == -1 for s in engine.inputs)
    limits = [r.max[0] for r in (engine.profiles or {}).values() if len(r.max) >= 1]
    return batchable, (min(limits) if limits else None)


def _expire(place: asyncio.Future) -> None:
    if not place.done():
        place.set_result(False)


class Scheduler:
    """Dynamic batching over a pool of execution contexts of one loaded engine.

    `runtime_spec` is the InferenceModel's `spec.runtime` (`contextsPerGPU`, `batching`,
    `resultCache`) with the CRD's defaults applied (`kiln serve` applies them; by hand:
    kiln.runtime.api.spec.runtime_with_defaults); a missing key raises ValueError naming it.
    `clock` is read for queue delays, queue times, the result cache's TTL and its shared
    store's circuit; `environ` for the pod's namespace and the shared store's password.
    """

    def __init__(self, engine: LoadedEngine, runtime_spec: Mapping[str, Any] | None,
                 metrics: ServerMetrics, model: str, engine_key: str,
                 clock: Callable[[], float] = time.monotonic, version: str = "",
                 environ: Mapping[str, str] = os.environ):
        spec = runtime_spec or {}
        if not isinstance(spec, Mapping):
            raise ValueError(f"runtime spec must be a map, got {type(spec).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string")
        if not isinstance(engine_key, str) or not engine_key:
            raise ValueError("engine_key must be a non-empty string")
        self.model = model
        self.engine_key = engine_key
        require_keys(spec, ("contextsPerGPU", "batching", "resultCache"), "runtime")
        self.batching = batching.BatchingConfig.from_spec(spec["batching"])
        cache_config = ResultCacheConfig.from_spec(spec["resultCache"])
        self._clock = clock
        self._batchable, self.engine_max_batch = _engine_batching(engine)
        # Rows one batch may hold: the configured maximum, clipped to the engine's profile.
        self.max_rows = min(self.batching.max_batch_size, self.engine_max_batch or math.inf)
        self._batch_requests = self.batching.enabled and self._batchable
        self.pool = ContextPool(engine, spec["contextsPerGPU"], metrics, model,
                                version=version, max_retries=MAX_RETRIES, unhealthy_after=UNHEALTHY_AFTER, clock=clock)
        self.results = result_levels(cache_config, metrics, model, clock, environ, engine.outputs)
        self.result_cache = self.results.memory if self.results is not None else None

        self._m_queue_seconds = metrics.queue_seconds.labels(model)
        self._m_compute_seconds = metrics.compute_seconds.labels(model)
        self._m_batch_size = metrics.batch_size.labels(model)
        self._m_cancelled = metrics.requests.labels(model, "cancelled")
        # The two gauges are read at scrape time from plain counters: no metric update on
        # the request path.
        self._inflight = 0
        metrics.inflight.labels(model).set_function(lambda: self._inflight)
        metrics.queue_depth.labels(model).set_function(lambda: self._queued)

        # Compatible requests share a group; groups keep arrival order for fairness.
        self._groups: OrderedDict[Hashable, deque[_Request]] = OrderedDict()
        # Requests waiting for a place in a full queue (wait_for_room), oldest first.
        self._room: deque[asyncio.Future] = deque()
        self._queued = 0
        self._queued_rows = 0
        self._wake = asyncio.Event()
        self._batcher: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._executing: dict[asyncio.Task, list[_Request]] = {}
        self._batch_seconds: float | None = None  # running estimate for Retry-After
        self._started = False
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Create the execution contexts and start the batcher."""
        if self._started:
            raise RuntimeError("scheduler already started")
        await self.pool.start()
        self._batcher = asyncio.create_task(self._run_batcher(), name=f"kiln-batcher-{self.model}")
        self._started = True

    @property
    def healthy(self) -> bool:
        """False before start, while closing, and after consecutive failed batches."""
        return self._started and not self._closing and self.pool.healthy

    @property
    def last_recovery_seconds(self) -> float | None:
        """How long the latest recovered failure took: failure -> context recreated ->
        batch retried successfully."""
        return self.pool.last_recovery_seconds

    async def close(self, drain_timeout: float) -> None:
        """Stop accepting; finish queued and running batches for up to `drain_timeout`
        seconds, then fail whatever is left and close the contexts."""
        if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)) or drain_timeout < 0:
            raise ValueError(f"drain_timeout must be a number >= 0, got {drain_timeout!r}")
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        if self._batcher is not None:
            await asyncio.wait([self._batcher], timeout=drain_timeout)
        if self._running:  # the batcher has stopped (or timed out): no new batches start
            await asyncio.wait(list(self._running), timeout=max(0.0, deadline - loop.time()))
        if self._batcher is not None and not self._batcher.done():
            self._batcher.cancel()
        for group in self._groups.values():
            for req in group:
                req.queued = False
                self._fail(req, ShuttingDown(1.0, "the model is shutting down; retry on another replica"))
        self._groups.clear()
        self._queued = self._queued_rows = 0
        for task, requests in list(self._executing.items()):
            for req in requests:
                self._fail(req, ExecutionFailed(
                    f"the model shut down before the batch finished ({drain_timeout} s drain timeout)"))
            task.cancel()
        await self.pool.close()
        if self.results is not None:
            await self.results.close()

    # -- requests ----------------------------------------------------------------------

    async def submit(self, inputs: Mapping[str, np.ndarray], tenant: str = "", *,
                     shared: bool = True) -> dict[str, np.ndarray]:
        """Run one request (its own batch of rows in dimension 0) and return its outputs: from
        the result cache where the model has one (`tenant`'s own entries when results are
        kept per tenant; `shared` False skips the shared store: the warm-up runs the engine)."""
        rows = self._validate(inputs)
        if self.results is None:
            return await self._compute(inputs, rows)
        key = self.results.key(self.engine_key, inputs, tenant)
        return await self.results.answer(key, lambda: self._compute(inputs, rows), shared)

    async def _compute(self, inputs: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """Queue the request for the engine and wait for its outputs."""
        if not self._started:
            raise RuntimeError("scheduler not started")
        if self._closing:
            raise ShuttingDown(1.0, "the model is shutting down; retry on another replica")
        if self.full:
            raise Overloaded(self.retry_after())

        group = batching.signature(inputs) if self._batch_requests else None
        req = _Request(inputs, rows, group, self._clock(), asyncio.get_running_loop().create_future())
        self._groups.setdefault(group, deque()).append(req)
        self._queued += 1
        self._queued_rows += rows
        self._wake.set()
        self._inflight += 1
        try:
            outputs = await req.future
        except asyncio.CancelledError:
            # The client went away: drop it from the queue if it is still there; a request
            # already in a running batch just has its result discarded.
            if req.queued:
                self._unqueue(req)
            self._m_cancelled.inc()
            raise
        finally:
            self._inflight -= 1
        return outputs

    @property
    def batches_requests(self) -> bool:
        """Whether requests are batched together (batching on, an engine that can)."""
        return self._batch_requests

    @property
    def full(self) -> bool:
        """A request now would be refused Overloaded (a result-cache hit aside)."""
        return self._queued >= self.batching.max_queue_size

    async def wait_for_room(self) -> None:
        """Return once the queue has a place for one more request, waiting behind earlier
        waiters for up to `maxAdmissionWaitMilliseconds`; else raise Overloaded.

        The server calls it before reading a request's body: a waiting request holds only its
        headers and costs nothing, so clients that retry a 429 at once wait here instead of
        spending the server's time on refusals (goodput holds under overload).
        """
        if not self.full and not self._room:
            return
        wait = self.batching.max_admission_wait
        if self._closing or wait <= 0:
            raise Overloaded(self.retry_after(), "its queue is full")
        loop = asyncio.get_running_loop()
        place = loop.create_future()
        self._room.append(place)
        # A timer rather than asyncio.wait_for, which costs a task per waiting request.
        expiry = loop.call_later(wait, _expire, place)
        try:
            if not await place:
                raise Overloaded(self.retry_after(), f"its queue is full and no place freed "
                                                     f"up within {wait * 1e3:g} ms")
        finally:
            expiry.cancel()
            admitted = place.done() and not place.cancelled() and place.result()
            if not admitted:  # timed out, or the client went away: leave the line
                try:
                    self._room.remove(place)
                except ValueError:  # _make_room already dropped it
                    pass

    def _make_room(self, places: int) -> None:
        """`places` requests left the queue: let as many waiters in, oldest first."""
        while places > 0 and self._room:
            place = self._room.popleft()
            if not place.done():
                place.set_result(True)
                places -= 1

    def retry_after(self) -> float:
        """Seconds until the queue has likely drained: batches ahead of a new request times
        the recent batch time, spread over the contexts. Always > 0."""
        per_batch = self._batch_seconds if self._batch_seconds is not None else max(
            self.batching.max_queue_delay, 0.01)
        batches_ahead = math.ceil(self._queued_rows / self.max_rows) if self._batch_requests else self._queued
        return max(0.001, batches_ahead * per_batch / self.pool.size + self.batching.max_queue_delay)

    def _validate(self, inputs: Mapping[str, np.ndarray]) -> int:
        if not isinstance(inputs, Mapping) or not inputs:
            raise InvalidBatch("the request has no input tensors")
        for name, a in inputs.items():
            if not isinstance(a, np.ndarray):
                raise InvalidBatch(f"input {name!r} is not a tensor ({type(a).__name__})")
        if not self._batchable:
            return 1  # the engine has a fixed batch: each request runs as it is
        try:
            rows = batching.request_rows(inputs)
        except ValueError as e:
            raise InvalidBatch(str(e)) from None
        if rows < 1:
            raise InvalidBatch("the request has an empty batch (0 rows in dimension 0)")
        if rows > self.batching.max_batch_size:
            raise InvalidBatch(f"the request's batch of {rows} rows exceeds maxBatchSize "
                               f"{self.batching.max_batch_size}; split it into smaller requests")
        if self.engine_max_batch is not None and rows > self.engine_max_batch:
            raise InvalidBatch(f"the request's batch of {rows} rows exceeds the engine's largest "
                               f"profiled batch {self.engine_max_batch}")
        return rows

    def _unqueue(self, req: _Request) -> None:
        group = self._groups[req.group]
        group.remove(req)
        if not group:
            del self._groups[req.group]
        req.queued = False
        self._queued -= 1
        self._queued_rows -= req.rows
        self._make_room(1)

    @staticmethod
    def _fail(req: _Request, error: Exception) -> None:
        if not req.future.done():
            req.future.set_exception(error)

    # -- batcher -----------------------------------------------------------------------

    async def _run_batcher(self) -> None:
        # Wait for an idle context first: while every context is busy, requests keep
        # joining the queue, so batches grow with load instead of queueing behind each other.
        while True:
            slot = await self.pool.acquire()
            batch = await self._next_batch()
            if batch is None:
                self.pool.release(slot)
                return
            task = asyncio.create_task(self._execute(slot, batch))
            self._running.add(task)
            self._executing[task] = batch
            task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> list[_Request] | None:
        """The next batch's requests, taken off the queue; None once closing and empty."""
        while True:
            self._wake.clear()
            if not self._queued:
                if self._closing:
                    return None
                await self._wake.wait()
                continue
            now = self._clock()
            take, wait = self._choose(now)
            if take is not None:
                group, count = take
                queue = self._groups[group]
                batch = [queue.popleft() for _ in range(count)]
                if not queue:
                    del self._groups[group]
                for req in batch:
                    req.queued = False
                    self._queued -= 1
                    self._queued_rows -= req.rows
                    self._m_queue_seconds.observe(max(0.0, now - req.enqueued))
                self._make_room(len(batch))
                return batch
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            except asyncio.TimeoutError:  # the oldest request's delay is up
                pass

    def _choose(self, now: float) -> tuple[tuple[Hashable, int] | None, float]:
        """(group, number of requests) to dispatch now, oldest first; else how long to wait."""
        if not self._batch_requests:
            group = min(self._groups, key=lambda g: self._groups[g][0].enqueued)
            return (group, 1), 0.0
        best: tuple[float, Hashable, int] | None = None
        wait = math.inf
        delay = self.batching.max_queue_delay
        for group, queue in self._groups.items():
            waited = now - queue[0].enqueued
            count = batching.plan((r.rows for r in queue), waited, max_rows=self.max_rows,
                                  preferred=self.batching.preferred_batch_sizes,
                                  max_delay=delay, flush=self._closing)
            if count:
                if best is None or queue[0].enqueued < best[0]:
                    best = (queue[0].enqueued, group, count)
            else:
                wait = min(wait, delay - waited)
        if best is not None:
            return (best[1], best[2]), 0.0
        return None, max(wait, 1e-5)

    async def _execute(self, slot: Slot, batch: list[_Request]) -> None:
        try:
            await self._run(slot, batch)
        except Exception as e:  # noqa: BLE001 - never leave a request waiting forever
            for req in batch:
                self._fail(req, ExecutionFailed(f"{type(e).__name__}: {e}"))
        finally:
            self._executing.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self.pool.release(slot)

    async def _run(self, slot: Slot, batch: list[_Request]) -> None:
        """Run `batch` on `slot` and settle each of its requests."""
        rows = [r.rows for r in batch]
        inputs = batching.concat([r.inputs for r in batch])
        self._m_batch_size.observe(sum(rows))
        try:
            result = await self.pool.run(slot, inputs)
        except InvalidInputError as e:
            if len(batch) == 1:
                self._fail(batch[0], InputsRefused(str(e)))
                return
            # One request's data refused fails the whole batch: each runs alone, so only
            # its own sender hears of it.
            for req in batch:
                if not req.future.done():
                    await self._run(slot, [req])
            return
        except ExecutionError as e:
            error = ExecutionFailed(f"execution failed after {e.attempts} attempts: {e}")
            for req in batch:
                self._fail(req, error)
            return
        self._m_compute_seconds.observe(result.seconds)
        self._batch_seconds = result.seconds if self._batch_seconds is None else (
            _EWMA * result.seconds + (1 - _EWMA) * self._batch_seconds)
        try:
            parts = (batching.split(result.outputs, rows) if self._batch_requests
                     else [result.outputs])
        except ValueError as e:
            error = ExecutionFailed(str(e))
            for req in batch:
                self._fail(req, error)
            return
        for req, part in zip(batch, parts):
            if not req.future.done():
                req.future.set_result(part)
