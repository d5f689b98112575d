"""The Open Inference Protocol (v2) server, on aiohttp.

Layered as KServe's Python server is: endpoints (this module's handlers: HTTP in, HTTP
out) -> dataplane (`protocol`: decode, check, encode tensors) -> model (`ServedModel`:
engine, scheduler, readiness). Liveness never looks at a model; readiness is the models'.

    GET  /v2/health/live                       200 while the process runs
    GET  /v2/health/ready                      200 when every model is ready, else 503
    GET  /v2                                   server metadata
    GET  /v2/models/{name}[/versions/{v}]      model metadata
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer
    GET  /metrics                              Prometheus text

The same over gRPC (`inference.GRPCInferenceService`, `grpc_server`) on its own port when
`start` is given one: the same models, scheduler, readiness, draining and metrics, through
`find_model` and `track`.

Every failure answers `{"error": "..."}`, aiohttp's own parse errors included
(`connections`). SIGTERM (see `run_until_stopped`): readiness turns false, new inference
requests get 503 with Retry-After and `Connection: close`, in-flight requests finish (up to
the drain timeout), then the process exits 0.

Bounds per request, cheapest first: a full queue is a 429 before the body is read; a body
larger than the model's largest valid request (or --max-body-bytes) is a 413 before it is
read; the body must arrive within the body timeout (408); JSON too large to decode in a
few milliseconds is decoded in a worker process, so the event loop (and liveness) never
waits on it. Connections are capped and time-bounded (`connections.ConnectionLimits`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import time
from typing import Any, Awaitable, Callable, Iterable, TypeVar

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kiln import __version__
from kiln.runtime.serving import protocol
from kiln.runtime.serving.rest.connections import SERVER_HEADER, ConnectionLimits, Runner
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.model import LOADING, UNHEALTHY, ServedModel
from kiln.runtime.serving.protocol import HEADER_LENGTH
from kiln.runtime.serving.refusals import NOT_READY_RETRY_AFTER, Kind, Refusal, cut, scheduler_refusal
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, InvalidBatch, Overloaded
from kiln.runtime.serving.sequences.manager import request_tenant

log = logging.getLogger("kiln.runtime.serving.rest.server")
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 60.0
# JSON above this (request bytes, or response elements) is decoded or encoded in a worker
# process: the JSON codec holds the GIL throughout, so a thread would stall the loop as much.
# Below it, decoding takes a few milliseconds and stays inline (no inter-process copy).
_OFFLOAD_JSON_BYTES = 1 << 20
_OFFLOAD_JSON_ELEMENTS = 64 * 1024
# Bodies and answers larger than this are read and written in chunks of it.
_IO_CHUNK_BYTES = 1 << 20
# Requests that may wait for the decoding worker; beyond, a big JSON request gets 429
# before its body is read (each waiting one holds its body in memory).
_OFFLOAD_WAITING = 4
# Content types `kiln dev` accepts on POST: a page in a browser can only send others
# (text/plain, forms) without a CORS preflight, which Kiln does not answer.
_LOCAL_CONTENT_TYPES = ("application/json", "application/octet-stream")
# kiln_requests_total's outcomes (the scheduler counts "cancelled" inside it).
OUTCOMES = ("success", "bad_request", "overloaded", "unavailable", "error", "cancelled")
# The HTTP status of each kind of refusal.
HTTP_STATUS = {Kind.INVALID: 400, Kind.NOT_FOUND: 404, Kind.TIMEOUT: 408, Kind.CONFLICT: 409,
               Kind.TOO_LARGE: 413, Kind.UNSUPPORTED_MEDIA: 415, Kind.OVERLOADED: 429,
               Kind.FAILED: 500, Kind.UNAVAILABLE: 503}


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(body=protocol.dumps(doc), status=status,
                        content_type="application/json", headers=headers)


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   **extra: Any) -> web.Response:
    return json_response({"error": cut(message), **extra}, status, headers)


@web.middleware
async def _errors(request: web.Request, handler):
    """Give every failure, aiohttp's own included (404, 405), a v2 JSON error body."""
    try:
        return await handler(request)
    except Refusal as e:
        return error_response(HTTP_STATUS[e.kind], e.message)
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
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {e}")


class InferenceServer:
    """The HTTP server for a set of models (a runtime pod serves one), and beside it, when
    started with a `grpc_port`, the gRPC endpoint (`grpc_server`) on the same dataplane."""

    def __init__(self, models: Iterable[ServedModel], metrics: ServerMetrics, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 limits: ConnectionLimits | None = None, local_only: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        """`local_only` (what `kiln dev` sets): refuse a Host header that is not the address
        served on and POST bodies that are neither JSON nor octet-stream, so a web page in
        the user's browser cannot drive the server (DNS rebinding, simple cross-site POSTs).
        """
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        if not body_timeout > 0:
            raise ValueError(f"body_timeout must be positive, got {body_timeout}")
        self.models = {m.name: m for m in models}
        if not self.models:
            raise ValueError("the server needs at least one model")
        self.metrics = metrics
        # Each model's request metrics, looked up once (a labels() call per request costs
        # more than the update itself).
        self._request_metrics = {
            name: ({o: metrics.requests.labels(model=name, outcome=o) for o in OUTCOMES},
                   metrics.request_seconds.labels(model=name))
            for name in self.models}
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.limits = limits or ConnectionLimits()
        self.local_only = local_only
        self._allowed_hosts: frozenset[str] | None = None  # set by start() when local_only
        self._json_worker = _JsonWorker()
        self._body_limits: dict[str, tuple[int, str]] = {}
        self._clock = clock
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._runner: web.AppRunner | None = None
        self._grpc: Any = None  # grpc_server.GrpcEndpoint while started with a grpc_port
        self._load_tasks: list[asyncio.Task] = []
        self.url: str | None = None
        self.grpc_address: str | None = None  # host:port of the gRPC endpoint, when started
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        # Bodies are read by the infer handler with its own limit (413 with a JSON body).
        app = web.Application(middlewares=[self._guard, _errors],
                              client_max_size=self.max_body_bytes + 1)
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

    async def start(self, host: str = "0.0.0.0", port: int | None = 8080,
                    grpc_port: int | None = None, *, reuse_port: bool = False) -> str | None:
        """Listen (HTTP on `port` unless None, as when front-end processes serve it; gRPC
        on `grpc_port` unless None; 0 picks a free one), then load every model in the
        background. Returns the base URL (None without HTTP here)."""
        if port is not None:
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
        if grpc_port is not None:
            from kiln.runtime.serving.grpc.endpoint import GrpcEndpoint  # grpcio only when serving it

            try:
                self._grpc = GrpcEndpoint(self)
                bound = await self._grpc.start(host, grpc_port)
            except BaseException:
                if self._runner is not None:
                    await self._runner.cleanup()
                    self._runner = None
                raise
            self.grpc_address = address(host, bound)
            log.info("gRPC listening on %s:%s", host or "0.0.0.0", bound)
        self._load_tasks = [asyncio.create_task(m.load(), name=f"load {m.name}")
                            for m in self.models.values()]
        return self.url

    async def wait_loaded(self) -> bool:
        """Wait for every model's load attempt; True when all are ready."""
        if self._load_tasks:
            await asyncio.gather(*self._load_tasks, return_exceptions=True)
        return all(m.ready for m in self.models.values())

    async def shutdown(self, drain_seconds: float = 30.0) -> bool:
        """Refuse new work, let in-flight requests finish (up to the timeout), stop.

        Returns True when every in-flight request finished in time.
        """
        self.draining = True
        deadline = self._clock() + max(0.0, drain_seconds)
        log.info("draining: %d request(s) in flight, up to %.0fs", self._inflight,
                 drain_seconds)
        drained = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, drain_seconds))
        except asyncio.TimeoutError:
            drained = False
            log.warning("drain timeout: %d request(s) still in flight are cancelled",
                        self._inflight)
        for task in self._load_tasks:
            task.cancel()
        await asyncio.gather(*self._load_tasks, return_exceptions=True)
        for model in self.models.values():
            await model.close(max(0.0, deadline - self._clock()))
        self._json_worker.close()
        if self._grpc is not None:
            await self._grpc.stop()
            self._grpc = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        log.info("stopped")
        return drained

    # -- health and metadata -----------------------------------------------------------

    def _not_ready(self) -> list[ServedModel]:
        return [m for m in self.models.values() if not m.ready]

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if self._allowed_hosts is not None and request.host.lower() not in self._allowed_hosts:
            return error_response(403, f"Host {protocol.shown(request.host)} is not an address "
                                       f"this server listens on ({self.url})")
        response = await handler(request)
        if self.draining:  # a keep-alive client learns to reconnect elsewhere, not by a reset
            response.force_close()
        return response

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        if self.draining:
            return error_response(503, "the server is shutting down", _retry_headers(),
                                  ready=False)
        waiting = self._not_ready()
        if waiting:
            return error_response(503, "; ".join(m.status_message() for m in waiting),
                                  _retry_headers(), ready=False)
        return json_response({"ready": True})

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response({"name": "kiln", "version": __version__,
                              "extensions": [protocol.BINARY_EXTENSION]})

    def _model(self, request: web.Request) -> ServedModel:
        return self.find_model(request.match_info["name"], request.match_info.get("version"))

    def find_model(self, name: str, version: str | None) -> ServedModel:
        """The model a request names (any version when None), else Refusal 404."""
        model = self.models.get(name)
        if model is None:
            raise Refusal(Kind.NOT_FOUND, f"unknown model {protocol.shown(name)}; this server serves: "
                                     f"{', '.join(self.models)}")
        if version is not None and version != model.version:
            raise Refusal(Kind.NOT_FOUND, f"model '{name}' has no version {protocol.shown(version)}; it serves "
                                     f"version '{model.version}'")
        return model

    async def model_metadata(self, request: web.Request) -> web.Response:
        model = self._model(request)
        if model.engine is None:
            return self._model_unavailable(model)
        return json_response({
            "name": model.name,
            "versions": [model.version],
            "platform": model.platform,
            "inputs": [protocol.tensor_metadata(s) for s in model.inputs],
            "outputs": [protocol.tensor_metadata(s) for s in model.outputs],
        })

    async def model_ready(self, request: web.Request) -> web.Response:
        model = self._model(request)
        if self.draining or not model.ready:
            return self._model_unavailable(model)
        return json_response({"name": model.name, "ready": True})

    def _model_unavailable(self, model: ServedModel) -> web.Response:
        message = "the server is shutting down" if self.draining else model.status_message()
        retry = self.draining or model.state in (LOADING, UNHEALTHY)
        return error_response(503, message, _retry_headers() if retry else None,
                              name=model.name, ready=False, state=model.state)

    async def prometheus(self, request: web.Request) -> web.Response:
        # The classic text format, which every Prometheus version reads; Kiln's metric
        # names need none of the newer format's UTF-8 escaping.
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    # -- inference ---------------------------------------------------------------------

    async def infer(self, request: web.Request) -> web.Response:
        model = self._model(request)
        return await self.track(model, lambda in_scheduler: self._infer(request, model,
                                                                        in_scheduler),
                                lambda response: _outcome(response.status))

    async def track(self, model: ServedModel, work: Callable[[list[bool]], Awaitable[T]],
                    outcome_of: Callable[[T], str]) -> T:
        """Run one inference request's `work(in_scheduler)`, whatever its protocol: counted
        in flight (shutdown waits for it), its outcome and latency in the metrics.
        `work` appends to `in_scheduler` once it hands the request to the scheduler."""
        started = self._clock()
        outcome: str | None = "error"
        in_scheduler: list[bool] = []
        self._inflight += 1
        self._idle.clear()
        # kiln_inflight_requests is the scheduler's (queued or executing); this counter
        # only holds shutdown until every accepted request is answered.
        try:
            result = await work(in_scheduler)
            outcome = outcome_of(result)
            return result
        except asyncio.CancelledError:
            # The client went away. A request cancelled inside the scheduler is counted
            # there (outcome="cancelled"); count the ones cancelled before they reached it.
            outcome = None if in_scheduler else "cancelled"
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
            self.record(model.name, outcome, self._clock() - started)

    def record(self, model: str, outcome: str | None, seconds: float) -> None:
        """Count one answered request (outcome None: counted by the scheduler already)."""
        counters, latency = self._request_metrics[model]
        if outcome is not None:
            counters[outcome].inc()
        latency.observe(seconds)

    async def _infer(self, request: web.Request, model: ServedModel,
                     in_scheduler: list[bool]) -> web.Response:
        if self.draining:
            return error_response(503, "the server is shutting down; retry on another "
                                       "replica", _retry_headers())
        if not model.serving:
            return self._model_unavailable(model)
        try:
            self._check_content_type(request)
            await self._admit(request, model)
            body = await self._read_body(request, *self._body_limit(model))
            json_length = protocol.header_length(request.headers.get(HEADER_LENGTH),
                                                 len(body))
            parse = (body, json_length, model.inputs, model.outputs, model.profiles)
            if (len(body) if json_length is None else json_length) > _OFFLOAD_JSON_BYTES:
                req = await self._json_worker.run(protocol.parse_infer_request, *parse)
            else:
                req = protocol.parse_infer_request(*parse)
            del body, parse
            in_scheduler.append(True)
            results = await model.infer(req.inputs, req.parameters,
                                        request_tenant(req.parameters, request.headers.items))
            missing = [o.name for o in req.outputs if o.name not in results]
            if missing:
                return error_response(500, f"the engine returned no {', '.join(missing)}")
            encode = (model.name, model.version, dataclasses.replace(req, inputs={}), results)
            if sum(results[o.name].size for o in req.outputs
                   if not o.binary) > _OFFLOAD_JSON_ELEMENTS:
                payload, json_length = await self._json_worker.run(
                    protocol.encode_infer_response, *encode)
            else:
                payload, json_length = protocol.encode_infer_response(*encode)
        except Refusal as e:
            response = error_response(HTTP_STATUS[e.kind], e.message, None if e.retry_after is None
                                      else {"Retry-After": _retry_after(e.retry_after)})
            if e.kind in (Kind.TIMEOUT, Kind.TOO_LARGE) or not request.content.is_eof():
                response.force_close()  # the rest of the body is not worth reading
                if request.content.exception() is not None:
                    # A body aiohttp could not decode: its lingering read of the rest would
                    # only raise the error again, as an unhandled one.
                    request.content.feed_eof()
            return response
        except (InvalidBatch, Overloaded, ExecutionFailed) as e:
            kind, message, retry = scheduler_refusal(model.name, e)
            return error_response(HTTP_STATUS[kind], message, None if retry is None
                                  else {"Retry-After": _retry_after(retry)})
        if json_length is None:
            headers = {"Content-Type": "application/json"}
        else:
            headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(json_length)}
        if len(payload) <= _IO_CHUNK_BYTES:
            return web.Response(body=payload, headers=headers)
        return await _stream(request, payload, headers)

    def _check_content_type(self, request: web.Request) -> None:
        if not self.local_only:
            return
        value = request.headers.get("Content-Type")
        if value is not None and value.split(";")[0].strip().lower() not in _LOCAL_CONTENT_TYPES:
            raise Refusal(Kind.UNSUPPORTED_MEDIA, f"Content-Type {protocol.shown(value)} is not accepted: "
                                     f"send application/json or application/octet-stream")

    async def _admit(self, request: web.Request, model: ServedModel) -> None:
        """Refuse what can be refused from the headers alone, before the body is read; wait
        for a place in a full queue (a result-cache hit would not need one)."""
        length = request.content_length
        limit, why = self._body_limit(model)
        if length is not None and length > limit:
            raise self._too_big(length, limit, why)
        header = request.headers.get(HEADER_LENGTH, "").strip()
        json_bytes = int(header) if header.isdigit() and len(header) < 20 else length
        if (json_bytes is None or json_bytes > _OFFLOAD_JSON_BYTES) and self._json_worker.full:
            raise Overloaded(1.0, "too many large JSON requests are being decoded; retry, or "
                                  "send the tensors in the binary extension")
        scheduler = model.scheduler
        if getattr(scheduler, "cache", None) is None and hasattr(scheduler, "wait_for_room"):
            await scheduler.wait_for_room()

    def _body_limit(self, model: ServedModel) -> tuple[int, str]:
        """(bytes, why): computed once per loaded model (it only asks for a serving one)."""
        limit = self._body_limits.get(model.name)
        if limit is None:
            bound = protocol.request_bytes_bound(model.inputs, model.profiles,
                                                 getattr(model.scheduler, "max_rows", None))
            if bound is not None and bound < self.max_body_bytes:
                limit = bound, (f"the largest valid request to model '{model.name}' (its "
                                f"inputs at the largest batch and profile shapes)")
            else:
                limit = self.max_body_bytes, "the server's limit (--max-body-bytes)"
            self._body_limits[model.name] = limit
        return limit

    async def _read_body(self, request: web.Request, limit: int, why: str) -> bytes:
        if request.content.is_eof():  # all of it has arrived (most small bodies): no timer
            return await self._read(request, limit, why)
        try:
            async with asyncio.timeout(self.body_timeout):
                return await self._read(request, limit, why)
        except TimeoutError:
            raise Refusal(Kind.TIMEOUT, f"the request body did not arrive within "
                                     f"{self.body_timeout:g} s") from None

    async def _read(self, request: web.Request, limit: int, why: str) -> bytes | bytearray:
        try:
            return await self._read_chunks(request, limit, why)
        except web.RequestPayloadError as e:  # e.g. Content-Encoding: gzip on a body that is not
            raise Refusal(Kind.INVALID, f"the request body cannot be read: "
                                     f"{' '.join(str(e).split())}") from None

    async def _read_chunks(self, request: web.Request, limit: int, why: str) -> bytes | bytearray:
        length = request.content_length
        if length is not None and length <= _IO_CHUNK_BYTES:
            return await request.read()  # one read: aiohttp stops at Content-Length
        # A large body is copied once, a chunk at a time, yielding to the loop between
        # chunks: aiohttp's read() joins and copies it whole, three times over.
        buf = bytearray()  # grown in place: a large realloc remaps pages, it does not copy
        while chunk := await request.content.read(_IO_CHUNK_BYTES):
            buf += chunk
            if len(buf) > limit:
                raise self._too_big(None, limit, why)
            await asyncio.sleep(0)
        return buf

    @staticmethod
    def _too_big(length: int | None, limit: int, why: str) -> Refusal:
        size = f"{length} bytes" if length is not None else "larger"
        return Refusal(Kind.TOO_LARGE, f"the request body ({size}) is over {limit} bytes, {why}")


class _JsonWorker:
    """A worker process for JSON too large to decode or encode on the event loop.

    Started on first use; one at a time decodes (bounding the memory a burst of large
    JSON bodies can take), a few wait, and `full` lets the server refuse the rest before
    reading their bodies. A worker that dies (killed for memory) is replaced on next use.
    """

    def __init__(self, waiting: int = _OFFLOAD_WAITING):
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._limit = 1 + waiting
        self._pending = 0

    @property
    def full(self) -> bool:
        return self._pending >= self._limit

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._pool is None:
            # spawn, not fork: the server has threads (the backend's, the loop's) that a
            # forked child would inherit in whatever state they were.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"))
        pool = self._pool
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except concurrent.futures.process.BrokenProcessPool:
            if self._pool is pool:
                self._pool = None
            raise Refusal(Kind.UNAVAILABLE, "the JSON worker process stopped (out of memory?); "
                                     "retry, or send the tensors in the binary extension") from None
        finally:
            self._pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


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


async def _stream(request: web.Request, payload: bytes, headers: dict[str, str]
                  ) -> web.StreamResponse:
    """A large answer in chunks, each awaited: one write of it all would copy the whole
    payload into the transport's buffer at once, stalling the loop for as long."""
    response = web.StreamResponse(headers=headers)
    response.content_length = len(payload)
    await response.prepare(request)
    view = memoryview(payload)
    for start in range(0, len(view), _IO_CHUNK_BYTES):
        await response.write(view[start:start + _IO_CHUNK_BYTES])
    await response.write_eof()
    return response


def _retry_headers() -> dict[str, str]:
    return {"Retry-After": str(NOT_READY_RETRY_AFTER)}


def _outcome(status: int) -> str:
    if status < 400:
        return "success"
    if status == 429:
        return "overloaded"
    if status == 503:
        return "unavailable"
    if status < 500:
        return "bad_request"
    return "error"
