"""The engine process's end of the front ends: a unix socket they connect to, their
requests run on the server's models, and their view of the models kept current."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import numpy as np

from kiln.runtime.serving.refusals import Refusal
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, SchedulerError
from kiln.runtime.serving.workers.wire import Channel, Segment, pack, unpack

_STATE_PERIOD = 0.05


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
                self.hub.server.record(name, outcome, seconds)
        elif kind == "metrics":
            from prometheus_client import generate_latest

            self.channel.send(("metrics", message[1], generate_latest(self.hub.server.metrics.registry)))
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
            model = self.hub.server.models[name]
            inputs = unpack(arena, descs, copy=False)
            scheduler = model.scheduler
            if getattr(scheduler, "cache", None) is None and hasattr(scheduler, "wait_for_room"):
                await scheduler.wait_for_room()
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


