"""The Open Inference Protocol (v2) over HTTP, on aiohttp: the REST door of the dataplane.

A request flows door -> dataplane -> model -> scheduler: this module's handlers (HTTP in,
HTTP out) -> `dataplane.Dataplane` (which model, readiness, draining, in-flight tracking
and outcome metrics, admission, the per-model size bound, tenancy, the inference) ->
`model.Model` -> its scheduler. Tensors are decoded and encoded by `protocol`. Liveness
never looks at a model; readiness is the models'. What only HTTP has stays here: the Host
check of `kiln dev`, its Content-Type check (415), reading the body with its bound and its
timeout (`body`), the JSON worker process, chunked writes of large answers.

    GET  /v2/health/live                       200 while the process runs
    GET  /v2/health/ready                      200 when every model is ready, else 503
    GET  /v2                                   server metadata
    GET  /v2/models/{name}[/versions/{v}]      model metadata
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer
    GET  /metrics                              Prometheus text

Every refusal's kind is answered with its status from one table (`HTTP_STATUS`), as
`{"error": "..."}`, aiohttp's own parse errors included (`connections`). While draining
(SIGTERM, see `process.run_until_stopped`): readiness is false, new inference requests get
503 with Retry-After, every answer has `Connection: close`, in-flight requests finish.

Bounds per request, cheapest first: a full queue is a 429 before the body is read; a body
larger than the model's largest valid request (or --max-body-bytes) is a 413 before it is
read; the body must arrive within the body timeout (408); JSON too large to decode in a
few milliseconds is decoded in a worker process, so the event loop (and liveness) never
waits on it. Connections are capped and time-bounded (`connections.ConnectionLimits`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kiln import __version__
from kiln.runtime.serving import protocol, tensors
from kiln.runtime.serving.dataplane import Dataplane
from kiln.runtime.serving.model import Model
from kiln.runtime.serving.protocol import HEADER_LENGTH
from kiln.runtime.serving.refusals import (HTTP_STATUS, NOT_READY_RETRY_AFTER, Kind, ModelUnavailable, Refusal,
                                           cut, internal_error, overloaded)
from kiln.runtime.serving.rest.body import (DEFAULT_BODY_TIMEOUT, IO_CHUNK_BYTES, OFFLOAD_JSON_BYTES,
                                            OFFLOAD_JSON_ELEMENTS, JsonWorker, read_body, too_big,
                                            write_chunked)
from kiln.runtime.serving.rest.connections import SERVER_HEADER, ConnectionLimits, Runner

log = logging.getLogger("kiln.runtime.serving.rest.server")

# Content types `kiln dev` accepts on POST: a page in a browser can only send others
# (text/plain, forms) without a CORS preflight, which Kiln does not answer.
_LOCAL_CONTENT_TYPES = ("application/json", "application/octet-stream")


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(body=protocol.dumps(doc), status=status,
                        content_type="application/json", headers=headers)


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   **extra: Any) -> web.Response:
    return json_response({"error": cut(message), **extra}, status, headers)


def refusal_response(e: Refusal) -> web.Response:
    """A refusal as answered over HTTP: its kind's status, Retry-After where waiting helps,
    and for a model that cannot answer now, its name and state."""
    headers = None if e.retry_after is None else {"Retry-After": _retry_after(e.retry_after)}
    extra = ({"name": e.model, "ready": False, "state": e.state}
             if isinstance(e, ModelUnavailable) else {})
    return error_response(HTTP_STATUS[e.kind], e.message, headers, **extra)


@web.middleware
async def _errors(request: web.Request, handler):
    """Give every failure, aiohttp's own included (404, 405), a v2 JSON error body."""
    try:
        return await handler(request)
    except Refusal as e:
        return refusal_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            message = f"no such endpoint: {request.path}"
        elif e.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        else:
            message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        return error_response(e.status, message, {k: v for k, v in e.headers.items()
                                                  if k in ("Allow", "Retry-After")})
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except ConnectionResetError:  # the client went away mid-answer: no one to answer, nothing to log
        raise
    except Exception:
        return refusal_response(internal_error(log, f"{request.method} {request.path}"))


class RestServer:
    """The HTTP door: a set of routes over one dataplane, and their listening socket."""

    def __init__(self, dataplane: Dataplane, *, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 limits: ConnectionLimits | None = None, local_only: bool = False):
        """`local_only` (what `kiln dev` sets): refuse a Host header that is not the address
        served on and POST bodies that are neither JSON nor octet-stream, so a web page in
        the user's browser cannot drive the server (DNS rebinding, simple cross-site POSTs).
        """
        if not body_timeout > 0:
            raise ValueError(f"body_timeout must be positive, got {body_timeout}")
        self.dataplane = dataplane
        self.body_timeout = body_timeout
        self.limits = limits or ConnectionLimits()
        self.local_only = local_only
        self._allowed_hosts: frozenset[str] | None = None  # set by start() when local_only
        self._json_worker = JsonWorker()
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        # Bodies are read by the infer handler with its own limit (413 with a JSON body).
        app = web.Application(middlewares=[self._guard, _errors],
                              client_max_size=self.dataplane.max_request_bytes + 1)
        app.on_response_prepare.append(_server_header)
        m = "/v2/models/{name}"
        v = m + "/versions/{version}"
        app.add_routes([
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.ready),
            web.get("/v2", self.server_metadata),
            web.get(m, self.model_metadata),
            web.get(v, self.model_metadata),
            web.get(m + "/ready", self.model_ready),
            web.get(v + "/ready", self.model_ready),
            web.post(m + "/infer", self.infer),
            web.post(v + "/infer", self.infer),
            web.get("/metrics", self.prometheus),
        ])
        return app

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> str:
        """Listen on host:port (0 picks a free one); returns the base URL."""
        # handler_cancellation: a client that disconnects cancels its handler, and the
        # scheduler drops the request from its queue instead of computing it for nobody.
        self._runner = Runner(self.app, self.limits, handler_cancellation=True,
                              access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=reuse_port or None)
        await site.start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{address(host, bound_port)}"
        if self.local_only:
            self._allowed_hosts = _host_names(host, bound_port)
        log.info("listening on %s:%s", bound_host, bound_port)
        return self.url

    async def stop(self) -> None:
        self._json_worker.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- health and metadata -----------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if self._allowed_hosts is not None and request.host.lower() not in self._allowed_hosts:
            return error_response(403, f"Host {tensors.shown(request.host)} is not an address "
                                       f"this server listens on ({self.url})")
        response = await handler(request)
        if self.dataplane.draining:  # a keep-alive client learns to reconnect elsewhere, not by a reset
            response.force_close()
        return response

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        reason = self.dataplane.unready()
        if reason is not None:
            return error_response(503, reason, {"Retry-After": str(NOT_READY_RETRY_AFTER)},
                                  ready=False)
        return json_response({"ready": True})

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response({"name": "kiln", "version": __version__,
                              "extensions": [protocol.BINARY_EXTENSION]})

    def _model(self, request: web.Request) -> Model:
        return self.dataplane.find_model(request.match_info["name"],
                                         request.match_info.get("version"))

    async def model_metadata(self, request: web.Request) -> web.Response:
        model = self.dataplane.described_model(request.match_info["name"],
                                               request.match_info.get("version"))
        return json_response({
            "name": model.name,
            "versions": [model.version],
            "platform": model.platform,
            "inputs": [tensors.tensor_metadata(s) for s in model.inputs],
            "outputs": [tensors.tensor_metadata(s) for s in model.outputs],
        })

    async def model_ready(self, request: web.Request) -> web.Response:
        model = self._model(request)
        if not self.dataplane.model_ready(model):
            raise self.dataplane.unavailable(model)
        return json_response({"name": model.name, "ready": True})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=await self.dataplane.metrics_text(),
                            headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    # -- inference ---------------------------------------------------------------------

    async def infer(self, request: web.Request) -> web.StreamResponse:
        model = self._model(request)
        try:
            async with self.dataplane.request(model) as call:
                self._check_content_type(request)
                limit, why = self.dataplane.request_bytes_limit(model)
                self._refuse_early(request, model, limit, why)
                await call.admit()
                body = await read_body(request, limit, why, self.body_timeout)
                json_length = protocol.header_length(request.headers.get(HEADER_LENGTH),
                                                     len(body))
                parse = (body, json_length, model.inputs, model.outputs, model.profiles)
                if (len(body) if json_length is None else json_length) > OFFLOAD_JSON_BYTES:
                    req = await self._json_worker.run(protocol.parse_infer_request, *parse)
                else:
                    req = protocol.parse_infer_request(*parse)
                del body, parse
                results = await call.infer(req.inputs, req.parameters, request.headers.items,
                                           [o.name for o in req.outputs])
                encode = (model.name, model.version, dataclasses.replace(req, inputs={}), results)
                if sum(results[o.name].size for o in req.outputs
                       if not o.binary) > OFFLOAD_JSON_ELEMENTS:
                    payload, json_length = await self._json_worker.run(
                        protocol.encode_infer_response, *encode)
                else:
                    payload, json_length = protocol.encode_infer_response(*encode)
                if json_length is None:
                    headers = {"Content-Type": "application/json"}
                else:
                    headers = {"Content-Type": "application/octet-stream",
                               HEADER_LENGTH: str(json_length)}
                if len(payload) <= IO_CHUNK_BYTES:
                    return web.Response(body=payload, headers=headers)
                return await write_chunked(request, payload, headers)
        except Refusal as e:
            response = refusal_response(e)
            if _closes(e, request):
                response.force_close()  # the rest of the body is not worth reading
                if request.content.exception() is not None:
                    # A body aiohttp could not decode: its lingering read of the rest would
                    # only raise the error again, as an unhandled one.
                    request.content.feed_eof()
            return response

    def _check_content_type(self, request: web.Request) -> None:
        if not self.local_only:
            return
        value = request.headers.get("Content-Type")
        if value is not None and value.split(";")[0].strip().lower() not in _LOCAL_CONTENT_TYPES:
            raise Refusal(Kind.UNSUPPORTED_MEDIA, f"Content-Type {tensors.shown(value)} is not "
                                                  f"accepted: send application/json or "
                                                  f"application/octet-stream")

    def _refuse_early(self, request: web.Request, model: Model, limit: int, why: str) -> None:
        """Refuse what can be refused from the headers alone, before the body is read."""
        length = request.content_length
        if length is not None and length > limit:
            raise too_big(length, limit, why)
        header = request.headers.get(HEADER_LENGTH, "").strip()
        json_bytes = int(header) if header.isdigit() and len(header) < 20 else length
        if (json_bytes is None or json_bytes > OFFLOAD_JSON_BYTES) and self._json_worker.full:
            raise overloaded(model.name, "too many large JSON requests are being decoded; "
                                         "retry, or send the tensors in the binary extension",
                             1.0)


def _closes(e: Refusal, request: web.Request) -> bool:
    """Whether a refused request's connection closes: after a body too slow or too large,
    or one left unread; not when the client is asked to come back (a full queue, a model
    not serving yet), as a keep-alive client would reconnect only to ask again."""
    if e.kind in (Kind.TIMEOUT, Kind.TOO_LARGE):
        return True
    return (not request.content.is_eof() and e.kind is not Kind.OVERLOADED
            and not isinstance(e, ModelUnavailable))


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_HEADER


def address(host: str, port: int) -> str:
    """host:port to connect to a server listening on `host` (every address: loopback)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"


def _host_names(host: str, port: int) -> frozenset[str] | None:
    """The Host header values that name this server, or None (listening on every
    address, there is no one name to check)."""
    if host in ("", "0.0.0.0", "::"):
        return None
    names = {host, "localhost", "127.0.0.1", "[::1]"} if host in (
        "127.0.0.1", "localhost", "::1") else {f"[{host}]" if ":" in host else host}
    return frozenset(f"{name}:{port}".lower() for name in names)
