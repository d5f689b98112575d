"""The dataplane: what every door asks of the models, whatever its transport.

A request flows door -> dataplane -> model -> scheduler:

- a door (`rest.server`: HTTP; `grpc.endpoint`: gRPC) reads its transport's bytes and
  headers, decodes the tensors (`protocol`), and answers a `Refusal` with its own status
  from its one table. Doors never import each other: what both need is here, in
  `protocol` or in `refusals`;
- the dataplane (`Dataplane`, this module) finds the model, answers readiness, refuses
  new work while draining or while the model does not serve, counts each request in
  flight (shutdown waits for them) and its outcome (`refusals.OUTCOME` of the refusal's
  kind, once for every door), bounds its size per model, admits it (the queue's wait),
  reads its tenant (a sequence's, or a per-tenant result cache's), runs the inference and
  checks that every requested output came back; the scheduler's refusals become
  `Refusal`s here (`refusals.scheduler_refusal`);
- the model (`model.Model`: a `ServedModel` in this process, a `RemoteModel` in a
  front-end process) steps a sequence or submits to its scheduler, which batches.

A door runs one inference request as:

    model = dataplane.find_model(name, version)          # Refusal NOT_FOUND
    async with dataplane.request(model) as call:         # draining, not serving: refused
        await call.admit()                               # a place in the queue
        ...decode the request...
        results = await call.infer(inputs, parameters, headers, outputs)
        ...encode the answer...

No aiohttp and no grpc here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from prometheus_client import generate_latest

from kiln.runtime.serving import tensors
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.model import LOADING, UNHEALTHY, Model
from kiln.runtime.serving.refusals import (NOT_READY_RETRY_AFTER, OUTCOME, Kind, ModelUnavailable,
                                           Refusal, scheduler_refusal)
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, InvalidBatch, Overloaded
from kiln.runtime.serving.sequences.params import request_tenant, tenant_of

log = logging.getLogger("kiln.runtime.serving.dataplane")

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# kiln_requests_total's outcomes (the scheduler counts "cancelled" inside it).
OUTCOMES = ("success", "bad_request", "refused", "overloaded", "unavailable", "error", "cancelled")
SHUTTING_DOWN = "the server is shutting down"


class Dataplane:
    """The models a server answers for (a runtime pod serves one), their metrics, and the
    checks every request goes through, whichever door it came in by."""

    def __init__(self, models: Iterable[Model], metrics: ServerMetrics, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        """`max_request_bytes`: the largest request any door reads (--max-body-bytes)."""
        if max_request_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_request_bytes}")
        self.models: dict[str, Model] = {m.name: m for m in models}
        if not self.models:
            raise ValueError("the server needs at least one model")
        self.metrics = metrics
        # Each model's request metrics, looked up once (a labels() call per request costs
        # more than the update itself).
        self._request_metrics = {
            name: ({o: metrics.requests.labels(model=name, outcome=o) for o in OUTCOMES},
                   metrics.request_seconds.labels(model=name))
            for name in self.models}
        self.max_request_bytes = max_request_bytes
        self._clock = clock
        self._request_bounds: dict[str, tuple[int, str]] = {}
        self.drain_started = asyncio.Event()  # set once: new work is refused from then on
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._load_tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------

    def start_loading(self) -> None:
        """Load every model in the background (the doors listen already)."""
        self._load_tasks = [asyncio.create_task(m.load(), name=f"load {m.name}")
                            for m in self.models.values()]

    async def wait_loaded(self) -> bool:
        """Wait for every model's load attempt; True when all are ready."""
        if self._load_tasks:
            await asyncio.gather(*self._load_tasks, return_exceptions=True)
        return all(m.ready for m in self.models.values())

    async def drain(self, drain_seconds: float) -> bool:
        """Refuse new work, let in-flight requests finish (up to the timeout), then close
        the models with what is left of it. True when every request finished in time."""
        self.stop_taking_work()
        deadline = self._clock() + max(0.0, drain_seconds)
        log.info("draining: %d request(s) in flight, up to %.0fs", self._inflight,
                 drain_seconds)
        drained = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, drain_seconds))
        except asyncio.TimeoutError:
            drained = False
            log.warning("drain timeout: %d request(s) still in flight are cancelled",
                        self._inflight)
        for task in self._load_tasks:
            task.cancel()
        await asyncio.gather(*self._load_tasks, return_exceptions=True)
        for model in self.models.values():
            await model.close(max(0.0, deadline - self._clock()))
        return drained

    @property
    def draining(self) -> bool:
        return self.drain_started.is_set()

    def stop_taking_work(self) -> None:
        """Refuse new requests from now on (drain() does; the engine process does it
        first while its front ends drain)."""
        self.drain_started.set()

    # -- models and readiness ----------------------------------------------------------

    def find_model(self, name: str, version: str | None) -> Model:
        """The model a request names (any version when None), else Refusal NOT_FOUND."""
        model = self.models.get(name)
        if model is None:
            raise Refusal(Kind.NOT_FOUND, f"unknown model {tensors.shown(name)}; this server "
                                          f"serves: {', '.join(self.models)}")
        if version is not None and version != model.version:
            raise Refusal(Kind.NOT_FOUND, f"model '{name}' has no version "
                                          f"{tensors.shown(version)}; it serves version "
                                          f"'{model.version}'")
        return model

    def described_model(self, name: str, version: str | None) -> Model:
        """The model whose metadata a request asks for: found and loaded, else refused."""
        model = self.find_model(name, version)
        if not model.loaded:
            raise self.unavailable(model)
        return model

    def unready(self) -> str | None:
        """Why the server is not ready (draining, or its models' status), None when it is."""
        if self.draining:
            return SHUTTING_DOWN
        waiting = [m for m in self.models.values() if not m.ready]
        return "; ".join(m.status_message() for m in waiting) if waiting else None

    def model_ready(self, model: Model) -> bool:
        return not self.draining and model.ready

    def unavailable(self, model: Model) -> ModelUnavailable:
        """The refusal of a model that cannot answer now; Retry-After where waiting helps
        (a load in progress, executions failing, the server draining)."""
        message = SHUTTING_DOWN if self.draining else model.status_message()
        retry = self.draining or model.state in (LOADING, UNHEALTHY)
        return ModelUnavailable(model.name, model.state, message,
                                NOT_READY_RETRY_AFTER if retry else None)

    # -- inference ---------------------------------------------------------------------

    def request(self, model: Model) -> "Call":
        """One inference request to `model`, as `async with dataplane.request(model) as
        call:` (see the module docstring)."""
        return Call(self, model)

    def request_bytes_limit(self, model: Model) -> tuple[int, str]:
        """(bytes, why): the largest request worth reading for a model, computed once per
        loaded model (only a serving one is asked)."""
        limit = self._request_bounds.get(model.name)
        if limit is None:
            bound = tensors.request_bytes_bound(model.inputs, model.profiles, model.max_rows)
            if bound is not None and bound < self.max_request_bytes:
                limit = bound, (f"the largest valid request to model '{model.name}' (its "
                                f"inputs at the largest batch and profile shapes)")
            else:
                limit = self.max_request_bytes, "the server's limit (--max-body-bytes)"
            self._request_bounds[model.name] = limit
        return limit

    def record(self, model: str, outcome: str | None, seconds: float) -> None:
        """Count one answered request (outcome None: counted by the scheduler already)."""
        counters, latency = self._request_metrics[model]
        if outcome is not None:
            counters[outcome].inc()
        latency.observe(seconds)

    async def metrics_text(self) -> bytes:
        """The metrics, in Prometheus's classic text format, which every Prometheus version
        reads (Kiln's metric names need none of the newer format's UTF-8 escaping)."""
        return generate_latest(self.metrics.registry)

    def _begin(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()


class Call:
    """One inference request in flight: counted from `async with` to its end (shutdown
    waits for it), its outcome and latency recorded as it ends, from the kind of the
    `Refusal` it ended with."""

    __slots__ = ("dataplane", "model", "in_scheduler", "_started")

    def __init__(self, dataplane: Dataplane, model: Model):
        self.dataplane = dataplane
        self.model = model
        self.in_scheduler = False  # handed to the model, which counts its own cancellation
        self._started = 0.0

    async def __aenter__(self) -> "Call":
        dataplane = self.dataplane
        self._started = dataplane._clock()
        dataplane._begin()
        try:
            if dataplane.draining:
                raise Refusal(Kind.UNAVAILABLE, f"{SHUTTING_DOWN}; retry on another replica",
                              NOT_READY_RETRY_AFTER)
            if not self.model.serving:
                raise dataplane.unavailable(self.model)
        except Refusal as e:
            self._finish(OUTCOME[e.kind])
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: Any) -> None:
        if kind is None:
            outcome: str | None = "success"
        elif isinstance(error, Refusal):
            outcome = OUTCOME[error.kind]
        elif isinstance(error, asyncio.CancelledError):
            # The client went away. A request cancelled inside the scheduler is counted
            # there (outcome="cancelled"); count the ones cancelled before they reached it.
            outcome = None if self.in_scheduler else "cancelled"
        elif isinstance(error, ConnectionResetError):  # it went away while its answer was written
            outcome = "cancelled"
        else:
            outcome = "error"
        self._finish(outcome)

    def _finish(self, outcome: str | None) -> None:
        dataplane = self.dataplane
        dataplane._end()
        dataplane.record(self.model.name, outcome, dataplane._clock() - self._started)

    async def admit(self) -> None:
        """Wait for a place in the model's queue (a full one refuses: OVERLOADED)."""
        try:
            await self.model.admit()
        except Overloaded as e:
            raise scheduler_refusal(self.model.name, e) from None

    async def infer(self, inputs: dict[str, np.ndarray], parameters: Mapping[str, Any] | None,
                    headers: Callable[[], Iterable[tuple[str, str]]],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run the request: `headers()` (every (name, value) received) are read for its
        tenant only when it names a sequence or the model keeps cached results per tenant;
        `outputs`, the names it asked for, must all come back."""
        self.in_scheduler = True
        model = self.model
        try:
            tenant = (tenant_of(headers()) if model.results_per_tenant
                      else request_tenant(parameters, headers))
            results = await model.infer(inputs, parameters, tenant)
        except (InvalidBatch, Overloaded, ExecutionFailed) as e:
            raise scheduler_refusal(model.name, e) from None
        self.in_scheduler = False  # answered: a client that leaves now is this call's to count
        missing = [name for name in outputs if name not in results]
        if missing:
            raise Refusal(Kind.FAILED, f"the engine returned no {', '.join(missing)}")
        return results
