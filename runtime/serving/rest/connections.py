"""The server's connections: how many, how long each may take, what a broken request gets.

aiohttp parses HTTP and runs the handlers; this module sets the bounds around it that a
server facing unknown clients needs and aiohttp leaves open:

- At most `max_connections` open at once. At the cap, the oldest idle keep-alive
  connection is closed to make room; with none idle, the newcomer is answered 503 and
  closed. Connections that never send a request therefore cannot exhaust the process's
  file descriptors and lock out working clients.
- A request's line and headers must arrive within `header_timeout` seconds (from the
  connection's accept, and from the first byte of each later request on it); an idle
  keep-alive connection is closed after `keepalive_timeout`. The body's own timeout is
  the infer handler's (`RestServer`), which answers 408; a body left unread by an
  answer that closes the connection is drained for at most `lingering_timeout`.
- A request aiohttp's parser refuses (bad Content-Length, both Content-Length and
  Transfer-Encoding, over-long lines) gets the same `{"error": ...}` JSON body as every
  other failure, and one short log line instead of a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kiln.runtime.serving.tensors import shown

log = logging.getLogger("kiln.runtime.serving.rest.server")

SERVER_HEADER = "kiln"  # not aiohttp's default, which names the Python and aiohttp versions
# File descriptors kept for what is not a client connection (the engine, logs, sockets
# the backend opens); the connection cap never goes above the process limit minus these.
_RESERVED_FDS = 64


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1000
    header_timeout: float = 10.0
    keepalive_timeout: float = 75.0  # nginx's default; longer than most clients' pools keep
    # After an answer that closes the connection with the body unread (a 413 from the
    # headers), the rest is read and dropped this long, so the client can read the answer
    # before the close resets it; then the connection goes (aiohttp's default: 10 s).
    lingering_timeout: float = 1.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be positive, got {self.max_connections}")
        for name in ("header_timeout", "keepalive_timeout", "lingering_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def effective_max_connections(self) -> int:
        """The cap, lowered to fit the process's open-file limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - _RESERVED_FDS))


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()


def _overloaded_response(cap: int) -> bytes:
    body = error_body(f"the server has reached its limit of {cap} open connections; "
                      f"retry shortly")
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nServer: " + SERVER_HEADER.encode()
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Connection(RequestHandler):
    """One client connection, with a header deadline and JSON errors from the parser."""

    def __init__(self, manager: "_Server", **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._limits = manager.limits
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial = False  # part of a request's head received, not all of it

    # -- admission and the header deadline ---------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        manager = self._manager
        assert isinstance(manager, _Server)
        if not manager.admit(self):
            transport.write(_overloaded_response(manager.cap))  # type: ignore[attr-defined]
            self.force_close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        parsed_before = self._request_count
        super().data_received(data)
        if self._request_count != parsed_before or self._busy:
            self._partial = False
            self._cancel_header_timer()
        elif data:
            self._partial = True
            self._arm_header_timer()  # a new request started arriving

    @property
    def _busy(self) -> bool:
        return bool(self._messages) or self._request_in_progress

    @property
    def idle(self) -> bool:
        """Waiting for a next request with none of it received: safe to close."""
        return (not self._busy and not self._partial and self._waiter is not None
                and not self._waiter.done() and not self._force_close)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self._force_close:
            self._header_timer = self._loop.call_later(self._limits.header_timeout,
                                                       self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._busy:
            log.info("closing a connection from %s: no complete request headers within %gs",
                     self.peername, self._limits.header_timeout)
            self.force_close()

    # -- errors aiohttp produces itself --------------------------------------------------

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, ConnectionResetError):  # the client went away mid-answer (rest.server)
            raise ConnectionError("the client closed the connection")
        if status >= 500:
            log.error("error handling a request from %s: %s", request.remote,
                      exc or message, exc_info=exc)
            text = "internal server error"
        else:  # the client's mistake: one line, no traceback
            text = _short(message or (str(exc) if exc else "") or "bad request")
            log.info("refused a malformed request from %s: %s", request.remote, text)
        if request.writer.output_size > 0:
            raise ConnectionError("the response was sent already; cannot send an error")
        resp = web.Response(status=status, body=error_body(text),
                            content_type="application/json",
                            headers={"Server": SERVER_HEADER})
        resp.force_close()
        return resp


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


class _Server(web.Server):
    """aiohttp's low-level server, making `_Connection`s and enforcing the cap."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.cap = limits.effective_max_connections()

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)

    def admit(self, new: _Connection) -> bool:
        """Make room for `new` (already counted) or refuse it."""
        if len(self._connections) <= self.cap:
            return True
        # aiohttp keeps a closed connection listed until its handler task ends: not counted.
        if sum(1 for c in self._connections if not c._force_close) <= self.cap:
            return True
        for conn in self._connections:  # oldest first (dicts keep insertion order)
            if conn is not new and isinstance(conn, _Connection) and conn.idle:
                conn.force_close()
                self._connections.pop(conn, None)
                return True
        self._connections.pop(new, None)
        log.warning("refused a connection: %d connections open, the limit", self.cap)
        return False


def _json_error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(message), content_type="application/json")


def _before_the_app(handle):
    """The app's handler, with what aiohttp does before the app's middleware (the Expect
    header, its system routes' exceptions) answered in JSON too."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        expect = request.headers.get("Expect")
        if expect is not None and expect.lower() != "100-continue":
            return _json_error(417, f"Expect {shown(expect)} is not supported; "
                                    f"only 100-continue is")
        try:
            return await handle(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _json_error(e.status, _short(e.reason))

    return handler


class Runner(web.AppRunner):
    """An AppRunner whose server is `_Server` (bounded connections, JSON parse errors)."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout,
                         lingering_time=limits.lingering_timeout, **kwargs)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts and freezes the app
        return _Server(_before_the_app(server.request_handler),
                       request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation,
                       limits=self._limits, **server._kwargs)
