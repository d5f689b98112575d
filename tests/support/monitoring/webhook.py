"""A webhook endpoint that records what Alertmanager posts: a real aiohttp server on
127.0.0.1, on its own event loop in a thread, so synchronous tests (and the blocking
harness calls they make) can wait for a delivery without stalling the server.

It stands where the operator's receiver will: it answers 401 to a request without the
expected bearer token (and records it anyway, so a test can see what arrived).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from typing import Any, Callable

from aiohttp import web

from .process import HOST


@dataclasses.dataclass(frozen=True)
class Delivery:
    at: float  # time.monotonic() when the request arrived
    headers: dict[str, str]
    body: bytes

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)


class WebhookRecorder:
    def __init__(self, *, path: str = "/alerts", token: str | None = None) -> None:
        self.path, self.token = path, token
        self.deliveries: list[Delivery] = []
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="webhook", daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}{self.path}"

    def start(self) -> "WebhookRecorder":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post(self.path, self._receive)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind((HOST, 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def _receive(self, request: web.Request) -> web.Response:
        delivery = Delivery(time.monotonic(), dict(request.headers), await request.read())
        with self._changed:
            self.deliveries.append(delivery)
            self._changed.notify_all()
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"ok": True})

    def wait_for(self, predicate: Callable[[Delivery], bool] = lambda _d: True, timeout: float = 30,
                 after: int = 0) -> Delivery:
        """The first delivery (from index `after` on) that `predicate` accepts, waiting for it
        up to `timeout` seconds (TimeoutError listing what did arrive)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for delivery in self.deliveries[after:]:
                    if predicate(delivery):
                        return delivery
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = "\n".join(d.body.decode(errors="replace")[:500] for d in self.deliveries[after:])
                    raise TimeoutError(f"no matching webhook delivery within {timeout:g} s; got "
                                       f"{len(self.deliveries) - after}:\n{seen}")
                self._changed.wait(left)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def __enter__(self) -> "WebhookRecorder":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
