"""A front end's connection to an engine process (`EngineLink`): requests out, answers
matched back, tensors through this front end's shared memory (workers.wire), batchable
requests joined into one hand-over, outcomes tallied."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Mapping

import numpy as np
from kiln.runtime.serving.scheduling import batching
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, InvalidBatch, ShuttingDown
from kiln.runtime.serving.workers.wire import SLOT_BYTES, SLOTS, Channel, Segment, pack, unpack

_TALLY_PERIOD = 0.1
# Joined hand-overs a front end keeps in flight per model. Requests that arrive while that
# many are at the engine wait here and leave together when one comes back: as the engine's
# batcher does with busy contexts, groups grow with load, and the engine process (one
# event loop for every front end) pays its per-hand-over cost once per group, not per
# request. At low load no group is in flight and a request leaves at once.
_GROUPS_IN_FLIGHT = 2
# A joined group's inputs, at most: image-sized requests join a few at a time, so that a
# group travels in shared memory (a run of slots) rather than pickled on the socket, and the
# front end's segment holds several groups at once.
_JOIN_BYTES = 4 * SLOT_BYTES
_CONNECT_TIMEOUT = 30.0


class EngineGone(ShuttingDown):
    """The engine process is not reachable: this front end is stopping."""

    def __init__(self, message: str = "the engine process stopped; retry on another replica"):
        super().__init__(1.0, message)


class _SharedMemorySlots:
    """This front end's shared memory, cut into SLOTS equal slots; a hand-over larger than
    one takes a run of adjacent slots (an image-sized tensor, a joined group)."""

    def __init__(self, count: int = SLOTS, size: int = SLOT_BYTES):
        self.size = size
        self.shm = Segment(create=True, size=count * size)
        self.arena = np.frombuffer(self.shm.buf, np.uint8)
        self._used = [False] * count

    def take(self, count: int = 1) -> int | None:
        """The first of `count` adjacent free slots, now taken; None when there is no such run."""
        run = 0
        for i, used in enumerate(self._used):
            run = 0 if used else run + 1
            if run == count:
                first = i - count + 1
                self._used[first:i + 1] = [True] * count
                return first
        return None

    def give(self, first: int, count: int = 1) -> None:
        self._used[first:first + count] = [False] * count

    def needed(self, nbytes: int) -> int:
        """Slots for `nbytes` of inputs and room for the outputs (an eighth more, at least
        64 KiB); more than the segment has: 0 (the hand-over goes inline)."""
        total = nbytes + max(nbytes // 8, 1 << 16)
        count = -(-total // self.size)
        return count if count <= len(self._used) else 0

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
        self._pending: dict[int, tuple[asyncio.Future, int | None, int]] = {}
        self._next_id = 0
        self._tallies: list[tuple[str, str | None, float]] = []
        self._joining: dict[tuple, list[tuple]] = {}  # (model, signature) -> requests
        self._join_rows: dict[str, int] = {}  # model -> rows a group may hold
        self._send_due = False
        self._groups: set[asyncio.Task] = set()
        self._groups_in_flight: dict[str, int] = {}  # model -> joined hand-overs out
        self._tally_task: asyncio.Task | None = None

    async def connect(self, path: str, timeout: float = _CONNECT_TIMEOUT) -> None:
        """Connect to an engine process's hub, retrying while its socket is not there yet
        (a second engine process starting, or starting again: its old socket is removed
        first); OSError after `timeout`, or at once when nothing listens on the socket."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                await loop.create_unix_connection(lambda: self._channel, path)
                break
            except FileNotFoundError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)
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
        future, slot, count = entry
        if kind == "ok":
            result: Any = unpack(self.slots.arena, message[2], copy=True)
        elif kind == "error":
            result = message[2]
        else:  # "cancelled", "metrics"
            result = message[2] if kind == "metrics" else None
        if slot is not None:
            self.slots.give(slot, count)
        if not future.done():
            future.set_result((kind, result))

    def _on_lost(self) -> None:
        self.lost.set()
        self.connected.set()  # a front end still waiting for its first state stops now
        for future, _, _ in self._pending.values():
            if not future.done():
                future.set_result(("gone", None))
        self._pending.clear()

    def _register(self, slot: int | None, count: int = 1) -> tuple[int, asyncio.Future]:
        if self.lost.is_set():
            raise EngineGone()
        self._next_id += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = (future, slot, count)
        return self._next_id, future

    async def join(self, name: str, inputs: Mapping[str, np.ndarray],
                    join_rows: int) -> dict[str, np.ndarray]:
        """Requests that arrive together (in one loop iteration, or while `_GROUPS_IN_FLIGHT`
        of this model's groups are at the engine) go to the engine as one, up to
        `join_rows` rows: its scheduler would batch them together anyway, and one hand-over
        costs the engine process what one request does."""
        future = asyncio.get_running_loop().create_future()
        key = (name, batching.signature(inputs))
        self._joining.setdefault(key, []).append((inputs, batching.request_rows(inputs), future,
                                                  sum(a.nbytes for a in inputs.values())))
        self._join_rows[name] = join_rows
        self._send_soon()
        return await future

    def _send_soon(self) -> None:
        if not self._send_due:
            self._send_due = True
            asyncio.get_running_loop().call_soon(self._send_joined)

    def _send_joined(self) -> None:
        """Start a group for each waiting (model, signature), oldest requests first, while
        the model has fewer than `_GROUPS_IN_FLIGHT` out; the rest wait for one to end."""
        self._send_due = False
        for key in list(self._joining):
            name = key[0]
            members = [m for m in self._joining.pop(key) if not m[2].cancelled()]
            at = 0
            while at < len(members) and self._groups_in_flight.get(name, 0) < _GROUPS_IN_FLIGHT:
                end, rows, size = at + 1, members[at][1], members[at][3]
                while end < len(members) and rows + members[end][1] <= self._join_rows[name] \
                        and size + members[end][3] <= _JOIN_BYTES:
                    rows += members[end][1]
                    size += members[end][3]
                    end += 1
                self._start_group(name, members[at:end])
                at = end
            if at < len(members):
                self._joining[key] = members[at:]

    def _start_group(self, name: str, members: list[tuple]) -> None:
        self._groups_in_flight[name] = self._groups_in_flight.get(name, 0) + 1
        task = asyncio.create_task(self._run_group(name, members))
        self._groups.add(task)
        task.add_done_callback(lambda t: self._group_done(name, t))

    def _group_done(self, name: str, task: asyncio.Task) -> None:
        self._groups.discard(task)
        self._groups_in_flight[name] -= 1
        if self._joining:
            self._send_soon()

    async def _run_group(self, name: str, members: list[tuple]) -> None:
        try:
            outputs = await self.hand_over(name, batching.concat([m[0] for m in members]), {}, "")
            try:
                parts = batching.split(outputs, [m[1] for m in members])
            except ValueError as e:  # as the scheduler does: never hand out another's rows
                raise ExecutionFailed(str(e)) from None
        except asyncio.CancelledError:
            for member in members:
                member[2].cancel()
            return
        except Exception as e:
            if isinstance(e, InvalidBatch) and len(members) > 1:
                # The engine refused one member's data: each goes again alone, so only its
                # own sender hears of it (as the engine's scheduler does with its batches).
                for member in members:
                    if not member[2].done():
                        self._start_group(name, [member])
                return
            for member in members:
                if not member[2].done():
                    member[2].set_exception(e)
            return
        for member, part in zip(members, parts):
            if not member[2].done():
                member[2].set_result(part)

    async def hand_over(self, name: str, inputs: Mapping[str, np.ndarray],
                         parameters: dict[str, Any], tenant: str) -> dict[str, np.ndarray]:
        count = self.slots.needed(sum(np.asarray(a).nbytes for a in inputs.values()))
        slot = self.slots.take(count) if count else None
        try:
            rid, future = self._register(slot, count)
        except EngineGone:
            if slot is not None:
                self.slots.give(slot, count)
            raise
        if slot is None:
            arena, at, room = None, 0, 0
        else:
            arena, at, room = self.slots.arena, slot * self.slots.size, count * self.slots.size
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
