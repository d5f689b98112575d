"""A front-end process: the HTTP door over a dataplane of RemoteModels, whose inference
goes to the engine process through an EngineLink.

A request flows door (rest.server, here) -> dataplane (`FrontEndDataplane`: every check
the single process makes, the same code) -> model (`RemoteModel`) -> an engine process
(workers.link, then workers.engine_side), whose model admits it to its scheduler. Outcomes are tallied to the
engine, and /metrics is the engine's registry."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from kiln.runtime.engine.backends.base import ShapeRange, TensorSpec
from kiln.runtime.serving.dataplane import Dataplane
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.model import LOADING, STOPPED
from kiln.runtime.serving.process import run_event_loop, run_until_stopped
from kiln.runtime.serving.refusals import Kind, Refusal
from kiln.runtime.serving.rest.connections import ConnectionLimits
from kiln.runtime.serving.servers import InferenceServer
from kiln.runtime.serving.sequences.params import names_sequence
from kiln.runtime.serving.workers.link import EngineGone, EngineLink

log = logging.getLogger("kiln.runtime.serving.workers")

_METRICS_TIMEOUT = 5.0
_FIRST_STATE_TIMEOUT = 30.0


class RemoteModel:
    """A model served by the engine processes, as a front end's dataplane sees it: the
    engines' last pushed state (`engine_side.model_state`), and inference through a link.

    `link` is the first engine process (sequences, result cache, tallies, metrics); `batch`
    the engine process this front end sends batchable requests to (workers.engines), the
    same link when the pod runs one engine process."""

    def __init__(self, name: str, link: EngineLink, batch: EngineLink | None = None):
        self.name = name
        self._link = link
        self._batch = batch or link

    @property
    def _state(self) -> dict[str, Any]:
        """The first engine's state (its `ready` is the pod's: every engine's), serving
        only while this front end's own engine process serves too."""
        state = self._link.state.get(self.name) or {"version": "", "state": LOADING}
        if self._batch is self._link or not state.get("serving"):
            return state
        other = self._batch.state.get(self.name) or {}
        if other.get("serving"):
            return state
        return {**state, "serving": False,
                "message": other.get("message") or f"model '{self.name}' is loading"}

    @property
    def _gone(self) -> bool:
        return self._link.lost.is_set() or self._batch.lost.is_set()

    @property
    def version(self) -> str:
        return self._state["version"]

    @property
    def state(self) -> str:
        return STOPPED if self._gone else self._state["state"]

    @property
    def ready(self) -> bool:
        return bool(self._state.get("ready")) and not self._gone

    @property
    def serving(self) -> bool:
        return bool(self._state.get("serving")) and not self._gone

    @property
    def loaded(self) -> bool:
        return bool(self._state.get("loaded"))

    @property
    def platform(self) -> str | None:
        return self._state.get("platform")

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._state.get("inputs") or []

    @property
    def outputs(self) -> list[TensorSpec]:
        return self._state.get("outputs") or []

    @property
    def profiles(self) -> Mapping[str, ShapeRange]:
        return self._state.get("profiles") or {}

    @property
    def max_rows(self) -> int | None:
        return self._state.get("max_rows")

    @property
    def results_per_tenant(self) -> bool:
        return bool(self._state.get("results_per_tenant"))

    def status_message(self) -> str:
        if self._gone:
            return f"model '{self.name}' is shutting down"
        return self._state.get("message") or f"model '{self.name}' is loading"

    async def load(self) -> bool:
        return True  # the engine process loads; its state arrives through the link

    async def admit(self) -> None:
        pass  # the queue and its admission wait are the engine's (engine_side)

    async def infer(self, inputs: Mapping[str, np.ndarray],
                    parameters: Mapping[str, Any] | None = None,
                    tenant: str = "") -> dict[str, np.ndarray]:
        join_rows = self._state.get("join_rows")
        if join_rows and not names_sequence(parameters):
            return await self._batch.join(self.name, inputs, join_rows)
        return await self._link.hand_over(self.name, inputs, dict(parameters or {}), tenant)

    async def close(self, drain_timeout: float) -> None:
        pass


class FrontEndDataplane(Dataplane):
    """A front-end process's dataplane, over RemoteModels: every check as in the engine
    process, but its request outcomes are counted by the engine, and its metrics are the
    engine's registry."""

    def __init__(self, models: list[RemoteModel], link: EngineLink, **kwargs: Any):
        self._link = link
        super().__init__(models, ServerMetrics(), **kwargs)  # a registry nobody scrapes

    def record(self, model: str, outcome: str | None, seconds: float) -> None:
        self._link.tally(model, outcome, seconds)

    async def metrics_text(self) -> bytes:
        try:
            return await asyncio.wait_for(self._link.metrics_text(), _METRICS_TIMEOUT)
        except (EngineGone, TimeoutError):
            raise Refusal(Kind.UNAVAILABLE, "the engine process is not answering") from None


@dataclass(frozen=True)
class FrontEndConfig:
    """What a front-end process is started with (pickled to it: plain values only)."""

    index: int
    hub_path: str
    batch_hub_path: str | None  # the engine process for batchable requests; None: hub_path's
    host: str
    port: int
    model_names: tuple[str, ...]
    max_body_bytes: int
    body_timeout: float
    limits: ConnectionLimits
    drain_seconds: float
    log_level: str = "INFO"
    event_loop: str = "asyncio"


def front_end_main(config: FrontEndConfig) -> None:
    """A front-end process: connect to the engine, serve HTTP until SIGTERM, drain, exit."""
    from kiln.runtime.serving.process import configure_logging, may_start_processes

    configure_logging(config.log_level)
    may_start_processes()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when to stop
    run_event_loop(_serve_front_end(config), config.event_loop)


async def _serve_front_end(config: FrontEndConfig) -> None:
    link = EngineLink()
    batch = EngineLink() if config.batch_hub_path else link
    try:
        try:
            await link.connect(config.hub_path)
            if batch is not link:
                await batch.connect(config.batch_hub_path)  # type: ignore[arg-type]
        except OSError as e:  # the engine process went away before this one connected
            log.error("cannot reach the engine process (%s); this front end stops", e)
            return
        for each in {link, batch}:
            await asyncio.wait_for(each.connected.wait(), _FIRST_STATE_TIMEOUT)
        if link.lost.is_set() or batch.lost.is_set():
            log.error("the engine process went away before this front end started")
            return
        dataplane = FrontEndDataplane([RemoteModel(n, link, batch) for n in config.model_names],
                                      link, max_request_bytes=config.max_body_bytes)
        server = InferenceServer.over(dataplane, body_timeout=config.body_timeout,
                                      limits=config.limits)
        stop = asyncio.Event()
        watchers = [asyncio.create_task(_stop_when(each.lost, stop)) for each in {link, batch}]
        await run_until_stopped(server, config.host, config.port, config.drain_seconds,
                                stop=stop, reuse_port=True)
        for watcher in watchers:
            watcher.cancel()
    finally:
        for each in {link, batch}:
            await each.close()


async def _stop_when(event: asyncio.Event, stop: asyncio.Event) -> None:
    await event.wait()
    log.error("the engine process went away; this front end stops")
    stop.set()


