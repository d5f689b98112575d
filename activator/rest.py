"""The v2 REST paths, held and forwarded: what reaches the model's Service at zero.

    GET  /v2/health/live, /v2/health/ready      the activator's own (it is always ready to hold)
    GET  /v2/models/{name}[/versions/{v}][/ready]
    POST /v2/models/{name}[/versions/{v}]/infer

A model request waits in `holding.Holder` for a Ready pod (past its bounds: 503 with
Retry-After), then goes to that pod once: the body is read first (bounded), a connection
refused before anything was sent tries again (the pod may just have gone), and any failure
after the request was sent is a 502, never a second send, so nothing is answered twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from kiln.activator.holding import MAX_HELD_BYTES, Holder, Refused, Unknown
from kiln.activator.routing import NAMESPACE_HEADER
from kiln.activator.table import Endpoint
from kiln.runtime.serving.refusals import HTTP_STATUS, Kind, Refusal
from kiln.runtime.serving.rest.body import DEFAULT_BODY_TIMEOUT, read_body, too_big
from kiln.runtime.serving.rest.connections import ConnectionLimits, Runner

log = logging.getLogger("kiln.activator.rest")

PER_POD_CONNECTIONS = 256  # requests in flight to one pod at once (the rest wait for a connection)
CONNECT_TRIES = 3
# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself: never copied across.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "content-length", "host", NAMESPACE_HEADER}


def _json(status: int, doc: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(doc).encode(), content_type="application/json",
                        headers=headers)


def refused(e: Refused) -> web.Response:
    return _json(503, {"error": e.message}, {"Retry-After": str(e.retry_after)})


class RestProxy:
    """The REST door, on the same HTTP server as `kiln serve`'s (`Runner`: its connection cap,
    header and keep-alive timeouts, a client's reset logged without a traceback) and the same
    body reader (its bound and timeout)."""

    def __init__(self, holder: Holder, default_namespace: str | None = None,
                 max_body_bytes: int = MAX_HELD_BYTES, limits: ConnectionLimits | None = None,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.holder, self.default_namespace, self.max_body_bytes = holder, default_namespace, max_body_bytes
        self.limits = limits or ConnectionLimits()
        self.body_timeout = body_timeout
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.forwarded = 0  # requests sent to a pod (each once)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.add_routes([
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.live),
            web.route("*", "/v2/models/{name}", self.model),
            web.route("*", "/v2/models/{name}/{rest:.*}", self.model),
        ])
        return app

    async def start(self, host: str, port: int) -> int:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=PER_POD_CONNECTIONS),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False)
        self._runner = Runner(self.app(), self.limits, access_log=None, shutdown_timeout=5.0,
                              handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def live(self, request: web.Request) -> web.Response:
        return _json(200, {"live": True})

    async def model(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        key = await self.holder.key(name, request.host, self.default_namespace, request.headers.get(NAMESPACE_HEADER))
        if key is None:
            return _json(404, {"error": f"cannot tell the namespace of model {name!r}: "
                                        f"call it by its Service name, <model>.<namespace>.svc"})
        full = self.holder.refusal(key)
        if full is not None:  # before the body: a full queue must not fill memory with bodies
            return refused(full)
        why = "the activator's bound on a held body (--max-body-bytes)"
        try:
            length = request.content_length
            if length is not None and length > self.max_body_bytes:  # refused before it is read
                raise too_big(length, self.max_body_bytes, why)
            body = bytes(await read_body(request, self.max_body_bytes, why, self.body_timeout))
        except Refusal as e:
            status = HTTP_STATUS.get(e.kind, 400)
            return _json(status, {"error": e.message},
                         {"Connection": "close"} if e.kind in (Kind.TOO_LARGE, Kind.TIMEOUT) else None)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        for attempt in range(CONNECT_TRIES):
            try:
                endpoint = await self.holder.endpoint(key)
            except Refused as e:
                return refused(e)
            except Unknown as e:
                return _json(404, {"error": str(e)})
            try:
                return await self._send(request, endpoint, headers, body)
            except aiohttp.ClientConnectorError as e:  # nothing was sent: another try is safe
                log.info("connect to %s failed (%s); try %d of %d", endpoint.http_url, e, attempt + 1, CONNECT_TRIES)
                await asyncio.sleep(0.2 * (attempt + 1))
        return refused(Refused(f"{key[0]}/{key[1]}: no pod accepted a connection"))

    async def _send(self, request: web.Request, endpoint: Endpoint, headers: dict[str, str],
                    body: bytes) -> web.StreamResponse:
        assert self._session is not None
        try:
            async with self._session.request(request.method, endpoint.http_url + request.rel_url.path_qs,
                                             headers=headers, data=body) as upstream:
                self.forwarded += 1
                payload = await upstream.read()
                out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
                return web.Response(status=upstream.status, body=payload, headers=out)
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # The request may have reached the pod: sending it again could run it twice.
            return _json(502, {"error": f"the runtime pod {endpoint.host} failed to answer: {e}"})
