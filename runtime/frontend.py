"""Front-end worker processes: HTTP parsed and tensors decoded on every core, one engine.

One Python process serves about 9,000 small requests a second (its event loop saturates
one core on HTTP parsing and JSON); an engine on a GPU does far more. With `workers` > 1,
`kiln serve` runs as:

    engine process (PID 1)          N front-end processes (spawned, SO_REUSEPORT on --port)
    models, schedulers, gRPC,  <--- each: the same InferenceServer handlers, over a
    result cache, metrics           RemoteModel per model instead of a ServedModel
              `---- one unix socket per front end + one shared-memory segment each

A front end reads and checks a request exactly as the single process does (every status
and message is the same code's), copies the decoded tensors into its shared-memory slot
and sends the engine a small descriptor; the engine views them in place (no copy, no
serialization), hands them to the one scheduler that batches across every front end,
writes the outputs into the same slot and answers with their descriptor. Tensors that do
not fit a slot (or hold Python objects: BYTES) travel inline on the socket instead.
Messages written in one loop iteration leave in one write, so under load one system call
carries many requests.

What stays whole across processes:
- readiness and metadata: the engine pushes its models' state to every front end when it
  changes (checked every `_STATE_PERIOD` seconds), so a probe is answered locally;
- metrics: /metrics on any front end is the engine's registry; front ends send their
  request outcomes and latencies to it (at most `_TALLY_PERIOD` seconds late);
- draining: SIGTERM reaches the engine (PID 1), which passes it to every front end; each
  drains as a single process does (503 + Connection: close, in-flight requests finish),
  then the engine drains its schedulers and exits;
- the result cache and the queue's admission wait are the engine's, shared by all. The
  one difference: a full queue is refused after the front end has read the body (the
  queue is in another process), not before.

A front end whose engine goes away stops (the pod restarts); a front end that dies is
restarted by the engine, at most once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kiln.runtime import batching
from kiln.runtime.connections import ConnectionLimits
from kiln.runtime.contract import FRONT_END_SHM_BYTES, MAX_AUTO_FRONT_END_WORKERS, MAX_FRONT_END_WORKERS
from kiln.runtime.metrics import ServerMetrics
from kiln.runtime.model import LOADING, STOPPED
from kiln.runtime.protocol import ProtocolError
from kiln.runtime.scheduler import ExecutionFailed, InvalidBatch, SchedulerError, ShuttingDown
from kiln.runtime.server import (InferenceServer, address, error_response, run_event_loop,
                                 run_until_stopped)

log = logging.getLogger("kiln.runtime.frontend")

# Each front end's shared memory: SLOTS requests in flight at once, each up to SLOT_BYTES of
# inputs and outputs together (32 rows of 2048 float32 in and out fit); the pages are
# touched only as used. What does not fit goes inline.
SLOT_BYTES = 1 << 20
SLOTS = FRONT_END_SHM_BYTES // SLOT_BYTES
_ALIGN = 64
_STATE_PERIOD = 0.05
_TALLY_PERIOD = 0.1
_RESTART_DELAY = 1.0
_METRICS_TIMEOUT = 5.0
_FIRST_STATE_TIMEOUT = 30.0
_FRAME = struct.Struct("<I")


def cpu_limit() -> float | None:
    """The CPUs this process may use: its cgroup's quota (a pod's CPU limit) if set, else
    its affinity mask; None when neither can be read."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return None


def default_workers(cpus: float | None) -> int:
    """One front end per CPU beyond the engine's own, up to 16; a single process (no
    hops between processes) below 3 CPUs, where a second process has no core to run on."""
    if cpus is None or cpus < 3:
        return 1
    return min(MAX_AUTO_FRONT_END_WORKERS, int(math.floor(cpus)) - 1)


def parse_workers(value: str | int | None, cpus: float | None) -> int:
    """`--workers` / KILN_WORKERS / spec.runtime.frontendWorkers -> a count; "auto" or
    None picks `default_workers`. Raises ValueError with the accepted forms."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return default_workers(cpus)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"workers must be a number from 1 to {MAX_FRONT_END_WORKERS} or "
                         f"'auto', got {value!r}") from None
    if not 1 <= n <= MAX_FRONT_END_WORKERS:
        raise ValueError(f"workers must be a number from 1 to {MAX_FRONT_END_WORKERS} or "
                         f"'auto', got {n}")
    return n


# -- the wire: length-prefixed pickles of small tuples; tensors live in shared memory -----

class _Channel(asyncio.Protocol):
    """One end of a front end <-> engine connection. Messages sent in one loop iteration
    are written together."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[], None]):
        self._on_message = on_message
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._inbox = bytearray()
        self._outbox: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        inbox = self._inbox
        inbox += data
        start = 0
        while len(inbox) - start >= _FRAME.size:
            (size,) = _FRAME.unpack_from(inbox, start)
            end = start + _FRAME.size + size
            if len(inbox) < end:
                break
            message = pickle.loads(memoryview(inbox)[start + _FRAME.size:end])
            start = end
            self._on_message(message)
        del inbox[:start]

    def send(self, message: Any) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._outbox += (_FRAME.pack(len(frame)), frame)

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(out))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._on_lost()


def _pack(arena: np.ndarray | None, offset: int, capacity: int,
          arrays: Mapping[str, np.ndarray]) -> tuple[list[tuple], int]:
    """Arrays -> (descriptors, arena bytes used): each copied into
    arena[offset:offset + capacity] when all fit (one copy, no serialization), else all
    carried inline (0 bytes used)."""
    descs = []
    at, end = offset, offset + capacity
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        n = a.nbytes
        if arena is None or a.dtype.hasobject or at + n > end:
            return [(name, None, None, None, np.asarray(a)) for name, a in arrays.items()], 0
        arena[at:at + n] = a.reshape(-1).view(np.uint8)
        descs.append((name, a.dtype.str, a.shape, at, n))
        at += -(-n // _ALIGN) * _ALIGN
    return descs, at - offset


def _unpack(arena: np.ndarray | None, descs: list[tuple], copy: bool) -> dict[str, np.ndarray]:
    out = {}
    for name, dtype, shape, at, inline in descs:
        if at is None:
            out[name] = inline
        else:
            view = arena[at:at + inline].view(dtype).reshape(shape)
            out[name] = view.copy() if copy else view
    return out


class _Segment(shared_memory.SharedMemory):
    """A shared-memory segment whose close leaves the mapping to its last view: a batch
    cancelled at shutdown may still hold views, and the standard close then raises
    BufferError, again from __del__ at exit, where it is printed with a traceback."""

    def close(self) -> None:
        try:  # not contextlib: at exit, __del__ may run after module globals are gone
            super().close()
        except BufferError:
            pass


# -- the engine side ---------------------------------------------------------------------

def model_state(server: Any) -> dict[str, dict[str, Any]]:
    """What a front end needs of each model to answer like the engine would."""
    state = {}
    for name, m in server.models.items():
        ready = m.ready  # evaluated first: it may move the state (unhealthy and back)
        state[name] = {
            "version": m.version, "state": m.state, "ready": ready, "serving": m.serving,
            "message": m.status_message(), "platform": m.platform,
            "loaded": m.engine is not None, "inputs": m.inputs, "outputs": m.outputs,
            "profiles": m.profiles, "max_rows": getattr(m.scheduler, "max_rows", None),
            # Rows a front end may join requests into (None: never): only where the
            # scheduler batches requests anyway, no result cache looks at each one, and no
            # request carries a sequence's state.
            "join_rows": (m.scheduler.max_rows if getattr(m.scheduler, "batches_requests", False)
                          and m.scheduler.cache is None and getattr(m, "sequences", None) is None
                          else None)}
    return state


class EngineHub:
    """The engine process's end: a unix socket the front ends connect to. Runs their
    requests on the server's models and keeps their view of the models current."""

    def __init__(self, server: Any, path: str):
        self.server = server
        self.path = path
        self._links: set[_EngineSide] = set()
        self._listener: asyncio.AbstractServer | None = None
        self._pusher: asyncio.Task | None = None
        self.state: dict[str, dict[str, Any]] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Messages are pickles, so only this pod's own processes may connect: the socket
        # is in a directory only this user can enter (FrontEnds' 0700 temporary one).
        self._listener = await loop.create_unix_server(lambda: _EngineSide(self).channel,
                                                        self.path)
        os.chmod(self.path, 0o600)
        self.state = model_state(self.server)
        self._pusher = asyncio.create_task(self._push_state(), name="front-end state")

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(_STATE_PERIOD)
            state = model_state(self.server)
            if state != self.state:
                self.state = state
                for link in list(self._links):
                    link.channel.send(("state", state))

    async def stop(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            await asyncio.gather(self._pusher, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for link in list(self._links):
            link.channel.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _EngineSide:
    """One front end's connection, on the engine."""

    def __init__(self, hub: EngineHub):
        self.hub = hub
        self.tasks: dict[int, asyncio.Task] = {}
        self.shm: _Segment | None = None
        self.arena: np.ndarray | None = None  # the segment as bytes, for cheap views
        self.channel = _Channel(self._on_message, self._on_lost)

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "infer":
            _, rid, name, descs, out_at, out_room, parameters, tenant = message
            self.tasks[rid] = asyncio.create_task(
                self._infer(rid, name, descs, out_at, out_room, parameters, tenant))
        elif kind == "cancel":
            task = self.tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == "tally":
            for name, outcome, seconds in message[1]:
                self.hub.server.record(name, outcome, seconds)
        elif kind == "metrics":
            from prometheus_client import generate_latest

            self.channel.send(("metrics", message[1], generate_latest(self.hub.server.metrics.registry)))
        elif kind == "hello":
            # Attached, not created: the segment is the front end's, which unlinks it. (Both use
            # one resource tracker, started by this process, which unlinks what a front end
            # that died leaves behind once the last of them exits.)
            self.shm = _Segment(name=message[1])
            self.arena = np.frombuffer(self.shm.buf, np.uint8)
            self.hub._links.add(self)
            self.channel.send(("state", self.hub.state))

    async def _infer(self, rid: int, name: str, descs: list[tuple], out_at: int,
                     out_room: int, parameters: dict[str, Any] | None, tenant: str) -> None:
        arena = self.arena
        try:
            model = self.hub.server.models[name]
            inputs = _unpack(arena, descs, copy=False)
            scheduler = model.scheduler
            if getattr(scheduler, "cache", None) is None and hasattr(scheduler, "wait_for_room"):
                await scheduler.wait_for_room()
            results = await model.infer(inputs, parameters, tenant)
            reply = ("ok", rid, _pack(arena, out_at, out_room, results)[0])
        except asyncio.CancelledError:
            reply = ("cancelled", rid)
        except Exception as e:  # every failure is the request's answer, never the link's
            if not isinstance(e, (ProtocolError, SchedulerError)):  # these pickle
                e = ExecutionFailed(f"{type(e).__name__}: {e}")
            reply = ("error", rid, e)
        finally:
            self.tasks.pop(rid, None)
        self.channel.send(reply)

    def _on_lost(self) -> None:
        self.hub._links.discard(self)
        for task in self.tasks.values():
            task.cancel()
        shm, self.shm, self.arena = self.shm, None, None
        if shm is not None:
            shm.close()


# -- the front-end side ------------------------------------------------------------------

class EngineGone(ShuttingDown):
    """The engine process is not reachable: this front end is stopping."""

    def __init__(self, message: str = "the engine process stopped; retry on another replica"):
        super().__init__(1.0, message)


class _Slots:
    """This front end's shared memory, cut into SLOTS equal slots."""

    def __init__(self, count: int = SLOTS, size: int = SLOT_BYTES):
        self.size = size
        self.shm = _Segment(create=True, size=count * size)
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
        self.slots = _Slots()
        self.state: dict[str, dict[str, Any]] = {}
        self.connected = asyncio.Event()
        self.lost = asyncio.Event()
        self._channel = _Channel(self._on_message, self._on_lost)
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
            result: Any = _unpack(self.slots.arena, message[2], copy=True)
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
        if not join_rows or (parameters and "sequence_id" in parameters):
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
        descs, used = _pack(arena, at, room, inputs)  # what inputs leave is for outputs
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


class _RemoteScheduler:
    """What a front end's server asks of a model's scheduler: its batch bound only (the
    queue and its admission wait are the engine's)."""

    cache = None

    def __init__(self, max_rows: int | None):
        self.max_rows = max_rows


class RemoteModel:
    """A model served by the engine process, as a front end's InferenceServer sees it: the
    engine's last pushed state, and inference through the link."""

    def __init__(self, name: str, link: EngineLink):
        self.name = name
        self._link = link

    @property
    def _state(self) -> dict[str, Any]:
        return self._link.state.get(self.name) or {"version": "", "state": LOADING}

    version = property(lambda self: self._state["version"])
    state = property(lambda self: STOPPED if self._link.lost.is_set() else self._state["state"])
    ready = property(lambda self: bool(self._state.get("ready")) and not self._link.lost.is_set())
    serving = property(lambda self: bool(self._state.get("serving")) and not self._link.lost.is_set())
    platform = property(lambda self: self._state.get("platform"))
    inputs = property(lambda self: self._state.get("inputs") or [])
    outputs = property(lambda self: self._state.get("outputs") or [])
    profiles = property(lambda self: self._state.get("profiles") or {})
    # Metadata answers need only to know an engine is loaded.
    engine = property(lambda self: True if self._state.get("loaded") else None)
    scheduler = property(lambda self: _RemoteScheduler(self._state.get("max_rows")))

    def status_message(self) -> str:
        if self._link.lost.is_set():
            return f"model '{self.name}' is shutting down"
        return self._state.get("message") or f"model '{self.name}' is loading"

    async def load(self) -> bool:
        return True  # the engine process loads; its state arrives through the link

    async def infer(self, inputs: Mapping[str, np.ndarray],
                    parameters: Mapping[str, Any] | None = None,
                    tenant: str = "") -> dict[str, np.ndarray]:
        return await self._link.infer(self.name, inputs, parameters, tenant)

    async def close(self, drain_timeout: float) -> None:
        pass


class FrontEndServer(InferenceServer):
    """A front-end process's server: the same handlers, over RemoteModels. Its request
    outcomes are counted by the engine, and /metrics is the engine's registry."""

    def __init__(self, models: list[RemoteModel], link: EngineLink, **kwargs: Any):
        self._link = link
        super().__init__(models, ServerMetrics(), **kwargs)  # a registry nobody scrapes

    def record(self, model: str, outcome: str | None, seconds: float) -> None:
        self._link.tally(model, outcome, seconds)

    async def prometheus(self, request: web.Request) -> web.Response:
        try:
            text = await asyncio.wait_for(self._link.metrics_text(), _METRICS_TIMEOUT)
        except (EngineGone, TimeoutError):
            return error_response(503, "the engine process is not answering")
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


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
    from kiln.runtime.serve import configure_logging

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
        server = FrontEndServer([RemoteModel(n, link) for n in config.model_names], link,
                                max_body_bytes=config.max_body_bytes,
                                body_timeout=config.body_timeout, limits=config.limits)
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


class FrontEnds:
    """The engine process's side of it all: holds the port, serves the hub, starts the
    front-end workers, restarts one that dies, and drains them on shutdown.

    The port is held by a socket bound with SO_REUSEPORT and never listened on: it keeps
    the port this pod's (port 0 picks one) while workers come and go."""

    def __init__(self, count: int, host: str, port: int,
                 make_config: Callable[[int, str, int], FrontEndConfig]):
        self.count = count
        self.host = host
        self.port = port
        self._make_config = make_config
        self._dir = tempfile.TemporaryDirectory(prefix="kiln-engine-")
        self.hub_path = os.path.join(self._dir.name, "engine.sock")
        self._reserved: socket.socket | None = None
        self._hub: EngineHub | None = None
        self._procs: dict[int, Any] = {}
        self._watch: asyncio.Task | None = None
        self._stopping = False

    async def start(self, server: Any, grpc_port: int | None) -> str:
        """Start the models (and gRPC) on `server` without HTTP, then the workers on the
        port. Returns the base URL."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.port))
        self._reserved = sock
        self.port = sock.getsockname()[1]
        await server.start(self.host, None, grpc_port)
        self._hub = EngineHub(server, self.hub_path)
        await self._hub.start()
        for i in range(self.count):
            self._spawn(i)
        self._watch = asyncio.create_task(self._restart_dead(), name="front-end supervisor")
        server.url = f"http://{address(self.host, self.port)}"
        log.info("%d front-end worker(s) on %s:%s", self.count, self.host, self.port)
        return server.url

    def _spawn(self, index: int) -> None:
        # spawn, not fork: the engine process has threads (the backend's, the loop's).
        proc = multiprocessing.get_context("spawn").Process(
            target=front_end_main, name=f"kiln-front-end-{index}", daemon=True,
            args=(self._make_config(index, self.hub_path, self.port),))
        proc.start()
        self._procs[index] = proc

    async def _restart_dead(self) -> None:
        while not self._stopping:
            await asyncio.sleep(_RESTART_DELAY)
            for index, proc in list(self._procs.items()):
                if not proc.is_alive() and not self._stopping:
                    log.error("front end %d exited (code %s); starting it again", index,
                              proc.exitcode)
                    self._spawn(index)

    async def stop(self, drain_seconds: float) -> None:
        """SIGTERM every worker and wait for each to drain (its in-flight requests still
        run here), up to the drain timeout and 5 s more; then close the hub."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        for proc in self._procs.values():
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, drain_seconds) + 5
        loop = asyncio.get_running_loop()
        for proc in self._procs.values():
            await loop.run_in_executor(None, proc.join, max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("%s did not stop in time; killing it", proc.name)
                proc.kill()
                await loop.run_in_executor(None, proc.join, 1)
        if self._hub is not None:
            await self._hub.stop()
        if self._reserved is not None:
            self._reserved.close()
        self._dir.cleanup()
