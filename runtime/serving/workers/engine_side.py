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
_PEER_METRICS_TIMEOUT = 2.0


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
            "profiles": m.profiles, "max_rows": m.max_rows, "join_rows": _join_rows(m),
            "results_per_tenant": m.results_per_tenant}
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
        # The first engine process's links to the others (workers.engines), whose metrics
        # its /metrics adds up; `engines` counts them all, connected or not.
        self.peers: list[Any] = []
        self.engines = 1

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Messages are pickles, so only this pod's own processes may connect: the socket
        # is in a directory only this user can enter (FrontEnds' 0700 temporary one).
        self._listener = await loop.create_unix_server(lambda: _EngineSide(self).channel,
                                                        self.path)
        os.chmod(self.path, 0o600)
        self.state = self._state()
        self._pusher = asyncio.create_task(self._push_state(), name="front-end state")

    def _state(self) -> dict[str, dict[str, Any]]:
        """The models' state; with other engine processes, a model is ready (the pod's
        probes) only while every engine process is connected and has it ready."""
        state = model_state(self.dataplane.models)
        if self.engines > 1:
            every = len(self.peers) == self.engines - 1
            for name, s in state.items():
                s["ready"] = s["ready"] and every and all(
                    (peer.state.get(name) or {}).get("ready") for peer in self.peers)
        return state

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(_STATE_PERIOD)
            state = self._state()
            if state != self.state:
                self.state = state
                for link in list(self._links):
                    link.channel.send(("state", state))

    async def metrics_text(self) -> bytes:
        """This process's registry, with the other engine processes' added in when there
        are others (an engine that does not answer in time is left out of this scrape)."""
        from prometheus_client import generate_latest

        own = generate_latest(self.dataplane.metrics.registry)
        if not self.peers:
            return own
        from kiln.runtime.serving.workers.engines import merge_metrics

        answers = await asyncio.gather(
            *(asyncio.wait_for(peer.metrics_text(), _PEER_METRICS_TIMEOUT) for peer in self.peers),
            return_exceptions=True)
        return merge_metrics([own, *(a for a in answers if isinstance(a, bytes))], self.engines)

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
            rid = message[1]
            self.tasks[rid] = asyncio.create_task(self._send_metrics(rid))  # cancelled with the link
            self.tasks[rid].add_done_callback(lambda _: self.tasks.pop(rid, None))
        elif kind == "hello":
            # Attached, not created: the segment is the front end's, which unlinks it as it
            # stops; one that dies cannot, and `_on_lost` does it for it.
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

    async def _send_metrics(self, rid: int) -> None:
        self.channel.send(("metrics", rid, await self.hub.metrics_text()))

    def _on_lost(self) -> None:
        self.hub._links.discard(self)
        for task in self.tasks.values():
            task.cancel()
        shm, self.shm, self.arena = self.shm, None, None
        if shm is not None:
            # The front end is gone: if it died (killed for memory), its 32 MiB segment would
            # stay in the pod's memory-backed /dev/shm with each restart, until the pod stops.
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
            shm.close()


