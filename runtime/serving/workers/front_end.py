"""A front-end process: the HTTP door over a dataplane of RemoteModels, whose inference
goes to the engine process through an EngineLink.

A request flows door (rest.server, here) -> dataplane (`FrontEndDataplane`: every check
the single process makes, the same code) -> model (`RemoteModel`) -> the engine process
(workers.engine_side), whose model admits it to its scheduler. Outcomes are tallied to the
engine, and /metrics is the engine's registry."""

from __future__ import annotations

import asyncio
import contextlib
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
from kiln.runtime.serving.scheduling import batching
from kiln.runtime.serving.servers import InferenceServer
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, InvalidBatch, ShuttingDown
from kiln.runtime.serving.sequences.params import names_sequence
from kiln.runtime.serving.workers.wire import SLOT_BYTES, SLOTS, Channel, Segment, pack, unpack

log = logging.getLogger("kiln.runtime.serving.workers")

_TALLY_PERIOD = 0.1
_METRICS_TIMEOUT = 5.0
_FIRST_STATE_TIMEOUT = 30.0


class EngineGone(ShuttingDown):
    """The engine process is not reachable: this front end is stopping."""

    def __init__(self, message: str = "the engine process stopped; retry on another replica"):
        super().__init__(1.0, message)


class _SharedMemorySlots:
    """This front end's shared memory, cut into SLOTS equal slots."""

    def __init__(self, count: int = SLOTS, size: int = SLOT_BYTES):
        self.size = size
        self.shm = Segment(create=True, size=count * size)
        self.arena = np.frombuffer(self.shm.buf, np.uint8)
        self._free = list(range(count - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def close(self) -> None:
        self.arena = None
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()
        self.shm.close()


class EngineLink:
    """A front end's connection to the engine: sends requests, matches answers."""

    def __init__(self):
        self.slots = _SharedMemorySlots()
        self.state: dict[str, dict[str, Any]] = {}
        self.connected = asyncio.Event()
        self.lost = asyncio.Event()
        self._channel = Channel(self._on_message, self._on_lost)
        self._pending: dict[int, tuple[asyncio.Future, int | None]] = {}
        self._next_id = 0
        self._tallies: list[tuple[str, str | None, float]] = []
        self._joining: dict[tuple, list[tuple]] = {}  # (model, signature) -> requests
        self._groups: set[asyncio.Task] = set()
        self._tally_task: asyncio.Task | None = None

    async def connect(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: self._channel, path)
        self._channel.send(("hello", self.slots.shm.name))
        self._tally_task = asyncio.create_task(self._send_tallies(), name="tallies")

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "state":
            self.state = message[1]
            self.connected.set()
            return
        entry = self._pending.pop(message[1], None)
        if entry is None:
            return
        future, slot = entry
        if kind == "ok":
            result: Any = unpack(self.slots.arena, message[2], copy=True)
        elif kind == "error":
            result = message[2]
        else:  # "cancelled", "metrics"
            result = message[2] if kind == "metrics" else None
        if slot is not None:
            self.slots.give(slot)
        if not future.done():
            future.set_result((kind, result))

    def _on_lost(self) -> None:
        self.lost.set()
        self.connected.set()  # a front end still waiting for its first state stops now
        for future, _ in self._pending.values():
            if not future.done():
                future.set_result(("gone", None))
        self._pending.clear()

    def _register(self, slot: int | None) -> tuple[int, asyncio.Future]:
        if self.lost.is_set():
            raise EngineGone()
        self._next_id += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = (future, slot)
        return self._next_id, future

    async def infer(self, name: str, inputs: Mapping[str, np.ndarray],
                    parameters: Mapping[str, Any] | None = None,
                    tenant: str = "") -> dict[str, np.ndarray]:
        join_rows = (self.state.get(name) or {}).get("join_rows")
        if not join_rows or names_sequence(parameters):
            return await self._hand_over(name, inputs, dict(parameters or {}), tenant)
        return await self._join(name, inputs, join_rows)

    async def _join(self, name: str, inputs: Mapping[str, np.ndarray],
                    join_rows: int) -> dict[str, np.ndarray]:
        """Requests that arrive together (in one loop iteration) go to the engine as one,
        up to `join_rows` rows: its scheduler would batch them together anyway, and one
        hand-over costs the engine process what one request does."""
        future = asyncio.get_running_loop().create_future()
        if not self._joining:
            asyncio.get_running_loop().call_soon(self._send_joined, join_rows)
        key = (name, batching.signature(inputs))
        self._joining.setdefault(key, []).append((inputs, batching.request_rows(inputs), future))
        return await future

    def _send_joined(self, join_rows: int) -> None:
        joining, self._joining = self._joining, {}
        for (name, _), members in joining.items():
            chunk: list[tuple] = []
            rows = 0
            for member in members:
                if member[2].cancelled():  # its client went away before it left
                    continue
                if chunk and rows + member[1] > join_rows:
                    self._start_group(name, chunk)
                    chunk, rows = [], 0
                chunk.append(member)
                rows += member[1]
            if chunk:
                self._start_group(name, chunk)

    def _start_group(self, name: str, members: list[tuple]) -> None:
        task = asyncio.create_task(self._run_group(name, members))
        self._groups.add(task)
        task.add_done_callback(self._groups.discard)

    async def _run_group(self, name: str, members: list[tuple]) -> None:
        try:
            outputs = await self._hand_over(name, batching.concat([m[0] for m in members]), {}, "")
            try:
                parts = batching.split(outputs, [m[1] for m in members])
            except ValueError as e:  # as the scheduler does: never hand out another's rows
                raise ExecutionFailed(str(e)) from None
        except asyncio.CancelledError:
            for _, _, future in members:
                future.cancel()
            return
        except Exception as e:
            if isinstance(e, InvalidBatch) and len(members) > 1:
                # The engine refused one member's data: each goes again alone, so only its
                # own sender hears of it (as the engine's scheduler does with its batches).
                for member in members:
                    if not member[2].done():
                        self._start_group(name, [member])
                return
            for _, _, future in members:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, _, future), part in zip(members, parts):
            if not future.done():
                future.set_result(part)

    async def _hand_over(self, name: str, inputs: Mapping[str, np.ndarray],
                         parameters: dict[str, Any], tenant: str) -> dict[str, np.ndarray]:
        slot = self.slots.take()
        try:
            rid, future = self._register(slot)
        except EngineGone:
            if slot is not None:
                self.slots.give(slot)
            raise
        if slot is None:
            arena, at, room = None, 0, 0
        else:
            arena, at, room = self.slots.arena, slot * self.slots.size, self.slots.size
        descs, used = pack(arena, at, room, inputs)  # what inputs leave is for outputs
        self._channel.send(("infer", rid, name, descs, at + used, room - used, parameters, tenant))
        try:
            kind, result = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The engine drops it from the queue; the slot is freed by the answer it
            # still sends (the engine may be writing into it until then).
            self._channel.send(("cancel", rid))
            raise
        if kind == "ok":
            return result
        if kind == "error":
            raise result
        if kind == "gone":
            raise EngineGone()
        raise asyncio.CancelledError()  # the engine cancelled it (it was shutting down)

    async def metrics_text(self) -> bytes:
        rid, future = self._register(None)
        self._channel.send(("metrics", rid))
        kind, text = await future
        if kind != "metrics":
            raise EngineGone()
        return text

    def tally(self, name: str, outcome: str | None, seconds: float) -> None:
        self._tallies.append((name, outcome, seconds))

    async def _send_tallies(self) -> None:
        try:
            while True:
                await asyncio.sleep(_TALLY_PERIOD)
                self.flush_tallies()
        finally:
            self.flush_tallies()

    def flush_tallies(self) -> None:
        if self._tallies:
            self._channel.send(("tally", self._tallies))
            self._tallies = []

    async def close(self) -> None:
        if self._tally_task is not None:
            self._tally_task.cancel()
            await asyncio.gather(self._tally_task, return_exceptions=True)
        await asyncio.sleep(0)  # the last tallies' write
        self._channel.close()
        self.slots.close()


class RemoteModel:
    """A model served by the engine process, as a front end's dataplane sees it: the
    engine's last pushed state (`engine_side.model_state`), and inference through the link."""

    def __init__(self, name: str, link: EngineLink):
        self.name = name
        self._link = link

    @property
    def _state(self) -> dict[str, Any]:
        return self._link.state.get(self.name) or {"version": "", "state": LOADING}

    @property
    def _gone(self) -> bool:
        return self._link.lost.is_set()

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
        return await self._link.infer(self.name, inputs, parameters, tenant)

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
    from kiln.runtime.serving.process import configure_logging

    configure_logging(config.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when to stop
    run_event_loop(_serve_front_end(config), config.event_loop)


async def _serve_front_end(config: FrontEndConfig) -> None:
    link = EngineLink()
    try:
        try:
            await link.connect(config.hub_path)
        except OSError as e:  # the engine process went away before this one connected
            log.error("cannot reach the engine process (%s); this front end stops", e)
            return
        await asyncio.wait_for(link.connected.wait(), _FIRST_STATE_TIMEOUT)
        if link.lost.is_set():
            log.error("the engine process went away before this front end started")
            return
        dataplane = FrontEndDataplane([RemoteModel(n, link) for n in config.model_names], link,
                                      max_request_bytes=config.max_body_bytes)
        server = InferenceServer.over(dataplane, body_timeout=config.body_timeout,
                                      limits=config.limits)
        stop = asyncio.Event()
        watcher = asyncio.create_task(_stop_when(link.lost, stop))
        await run_until_stopped(server, config.host, config.port, config.drain_seconds,
                                stop=stop, reuse_port=True)
        watcher.cancel()
    finally:
        await link.close()


async def _stop_when(event: asyncio.Event, stop: asyncio.Event) -> None:
    await event.wait()
    log.error("the engine process went away; this front end stops")
    stop.set()


