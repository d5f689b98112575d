"""Holding: per model a bounded queue and a bounded wait for a Ready pod, and the
activation (scale 0 -> 1) asked once per episode.

`Holder.endpoint(key)` answers a Ready pod at once when the table has one (a request that
reaches the activator just as the Service is handed back), else holds the caller: at most
`max_queued` callers per model wait (past that, `Refused` with a Retry-After), each at most
`max_wait` seconds (then `Refused`). The first held caller of an episode starts the
activation; a failed one is asked again by the next caller after `RETRY_ACTIVATION`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Awaitable, Callable

from kiln.activator.routing import model_key
from kiln.activator.table import Endpoint, Key, Table

log = logging.getLogger("kiln.activator.holding")

DEFAULT_MAX_QUEUED = 1000
DEFAULT_MAX_WAIT = 120.0
RETRY_ACTIVATION = 5.0  # seconds before a failed activation is asked again
RETRY_AFTER = 5  # seconds, told with every refusal
SETTLE_SECONDS = 2.0  # how long a request for a model not (yet) known here waits to be known
MAX_HELD_BYTES = 64 << 20  # the largest request body (or gRPC message) held in memory

Activate = Callable[[str, str], Awaitable[object]]  # (namespace, model): scale to one if at zero


@dataclasses.dataclass
class Refused(Exception):
    """The request is not held: 503 with Retry-After (gRPC UNAVAILABLE)."""
    message: str
    retry_after: int = RETRY_AFTER

    def __str__(self) -> str:
        return self.message


class Unknown(Exception):
    """The request names no model the activator serves: 404 (gRPC NOT_FOUND)."""


@dataclasses.dataclass
class _Model:
    held: int = 0
    activation: asyncio.Task | None = None
    failed_at: float | None = None


class Holder:
    def __init__(self, table: Table, activate: Activate, max_queued: int = DEFAULT_MAX_QUEUED,
                 max_wait: float = DEFAULT_MAX_WAIT, clock: Callable[[], float] = time.monotonic) -> None:
        if max_queued < 1 or not max_wait > 0:
            raise ValueError(f"max_queued must be >= 1 and max_wait > 0, got {max_queued}, {max_wait}")
        self.table, self.activate = table, activate
        self.max_queued, self.max_wait, self.clock = max_queued, max_wait, clock
        self._models: dict[Key, _Model] = {}
        self._turn = itertools.count()  # spreads requests over a model's Ready pods
        self.activations = 0  # activations asked (tests and the log read it)

    async def key(self, model: str, host: str | None, default_namespace: str | None,
                  named: str | None = None) -> Key | None:
        """The request's model (routing.model_key), waiting up to SETTLE_SECONDS for the table
        to know it: the operator hands a model's Service here and clients follow at once,
        while this activator's own watch of that may come a moment later. A model still
        unknown then is answered as unknown (None: no namespace to tell)."""
        deadline = self.clock() + SETTLE_SECONDS
        while True:
            key = model_key(model, host, self.table, default_namespace, named)
            left = deadline - self.clock()
            if (key is not None and self.table.known(key)) or left <= 0:
                return key
            try:
                async with asyncio.timeout(left):
                    await self.table.changed()
            except TimeoutError:
                pass

    def held(self, key: Key) -> int:
        return self._models[key].held if key in self._models else 0

    def refusal(self, key: Key) -> Refused | None:
        """Refused when a request for `key` would find the model's queue full now: checked
        before its body is read, so a full queue costs a refusal no body's memory
        (`endpoint` checks again once it is read)."""
        model = self._models.get(key)
        if self.table.ready(key) or model is None or model.held < self.max_queued:
            return None
        return Refused(f"{key[0]}/{key[1]} is starting and {model.held} requests are already held "
                       f"(at most {self.max_queued}); retry later")

    async def endpoint(self, key: Key) -> Endpoint:
        """A Ready pod of the model, once there is one; raises Refused past the bounds."""
        ready = self.table.ready(key)
        if ready:
            return self._pick(ready)
        if not self.table.known(key):
            # The name and namespace come from the request: only a model whose Service points
            # here is held and scaled, so no caller can wake (or fill memory with) any other.
            raise Unknown(f"model {key[0]}/{key[1]} is not one the activator holds requests for")
        full = self.refusal(key)
        if full is not None:
            raise full
        model = self._models.setdefault(key, _Model())
        model.held += 1
        try:
            self._start_activation(key, model)
            async with asyncio.timeout(self.max_wait):
                while not (ready := self.table.ready(key)):
                    await self.table.changed()
            return self._pick(ready)
        except TimeoutError:
            raise Refused(f"{key[0]}/{key[1]} has no Ready replica after {self.max_wait:g}s; retry later") from None
        finally:
            model.held -= 1
            if model.held == 0 and (model.activation is None or model.activation.done()):
                self._models.pop(key, None)

    def _pick(self, ready: list[Endpoint]) -> Endpoint:
        return ready[next(self._turn) % len(ready)]

    def _start_activation(self, key: Key, model: _Model) -> None:
        if model.activation is not None and not model.activation.done():
            return
        if model.activation is not None and model.failed_at is None:
            return  # asked already this episode, and it worked: waiting for the pod
        if model.failed_at is not None and self.clock() - model.failed_at < RETRY_ACTIVATION:
            return
        model.failed_at = None
        self.activations += 1
        model.activation = asyncio.create_task(self._activate(key, model))

    async def _activate(self, key: Key, model: _Model) -> None:
        try:
            await self.activate(*key)
        except Exception as e:  # the next held request asks again; the held ones keep waiting
            model.failed_at = self.clock()
            log.warning("could not scale %s/%s from zero: %s", key[0], key[1], e)
