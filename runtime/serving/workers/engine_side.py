"""The engine process's end of the front ends: a unix socket they connect to, their
requests run on the dataplane's models, and their view of the models kept current.

A front end's request has been through its door and its dataplane already (every check,
its tracking); here it goes on to the model: `admit` (the queue's wait, which is this
process's), then `infer`, whose scheduler batches it with every other front end's."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from kiln.runtime.serving.model import ServedModel
from kiln.runtime.serving.refusals import Refusal
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, SchedulerError
from kiln.runtime.serving.workers.wire import Channel, Segment, pack, unpack

if TYPE_CHECKING:
    from kiln.runtime.serving.dataplane import Dataplane
    from kiln.runtime.serving.servers import InferenceServer

_STATE_PERIOD = 0.05


def model_state(models: Mapping[str, ServedModel]) -> dict[str, dict[str, Any]]:
    """What a front end needs of each model to answer like the engine would (its
    `RemoteModel` answers from it)."""
    state = {}
    for name, m in models.items():
        ready = m.ready  # evaluated first: it may move the state (unhealthy and back)
        state[name] = {
            "version": m.version, "state": m.state, "ready": ready, "serving": m.serving,
            "message": m.status_message(), "platform": m.platform,
            "loaded": m.loaded, "inputs": m.inputs, "outputs": m.outputs,
            "profiles": m.profiles, "max_rows": m.max_rows, "join_rows": _join_rows(m)}
    return state


def _join_rows(model: ServedModel) -> int | None:
    """Rows a front end may join requests into (None: never): only where the scheduler
    batches requests anyway, no result cache looks at each one, and no request carries a
    sequence's state."""
    scheduler = model.scheduler
    if (scheduler is None or not scheduler.batches_requests or scheduler.result_cache is not None
            or model.sequences is not None):
        return None
    return scheduler.max_rows


class EngineHub:
    """The engine process's end: a unix socket the front ends connect to. Runs their
    requests on the server's models and keeps their view of the models current."""

    def __init__(self, server: "InferenceServer", path: str):
        self.dataplane: Dataplane = server.dataplane
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
        self.state = model_state(self.dataplane.models)
        self._pusher = asyncio.create_task(self._push_state(), name="front-end state")

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(_STATE_PERIOD)
            state = model_state(self.dataplane.models)
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
        self.shm: Segment | None = None
        self.arena: np.ndarray | None = None  # the segment as bytes, for cheap views
        self.channel = Channel(self._on_message, self._on_lost)

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
                self.hub.dataplane.record(name, outcome, seconds)
        elif kind == "metrics":
            from prometheus_client import generate_latest

            registry = self.hub.dataplane.metrics.registry
            self.channel.send(("metrics", message[1], generate_latest(registry)))
        elif kind == "hello":
            # Attached, not created: the segment is the front end's, which unlinks it. (Both use
            # one resource tracker, started by this process, which unlinks what a front end
            # that died leaves behind once the last of them exits.)
            self.shm = Segment(name=message[1])
            self.arena = np.frombuffer(self.shm.buf, np.uint8)
            self.hub._links.add(self)
            self.channel.send(("state", self.hub.state))

    async def _infer(self, rid: int, name: str, descs: list[tuple], out_at: int,
                     out_room: int, parameters: dict[str, Any] | None, tenant: str) -> None:
        arena = self.arena
        try:
            model = self.hub.dataplane.models[name]
            inputs = unpack(arena, descs, copy=False)
            await model.admit()
            results = await model.infer(inputs, parameters, tenant)
            reply = ("ok", rid, pack(arena, out_at, out_room, results)[0])
        except asyncio.CancelledError:
            reply = ("cancelled", rid)
        except Exception as e:  # every failure is the request's answer, never the link's
            if not isinstance(e, (Refusal, SchedulerError)):  # these pickle
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


