"""The Alertmanager webhook receiver: records scaling signals on the models they name.

`POST /alerts` takes Alertmanager's webhook payload (version 4). It is authenticated (a
bearer token from a Secret, compared in constant time: 401 otherwise, whatever bytes the
header holds), bounded (1 MiB: 413; READ_SECONDS: 408; at most MAX_ALERTS alerts, labels of
at most MAX_LABEL_BYTES), validated (400 with the reason, strict JSON; a request aiohttp's
parser refuses is a 400 too, `_Connection`): a client's mistake is never a 5xx. It is
idempotent: each alert is merged into the model's signal record (`signals.merge`), so a
payload delivered twice, or by several Alertmanager replicas, changes the record once.
Alerts are mapped to InferenceModels by their `namespace` and `model` labels; an unknown
model is counted and logged, then ignored. The receiver decides nothing: writing the record
wakes the model, and the scaling step (`scaling.py`) decides - on whichever operator replica
leads, since any replica may receive; KilnRequestsRefused the serving step only reports. `GET /metrics` serves the operator's metrics.

The labels are the client's words in an API path, so the receiver writes only where they
name an InferenceModel: an alert whose labels are no valid namespace and name (`../`, `?`,
`/status`) is counted "invalid" and dropped while the rest of the payload applies (a 400
would make Alertmanager drop the whole notification, and a retry cannot help it);
`kube.path_for` quotes what remains, and the object read must be an InferenceModel of
exactly that namespace and name before its record is patched.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from aiohttp import HttpVersion11, web, web_protocol

from kiln.operator import signals as sig
from kiln.operator.kube import POOL_SIZE, ApiError, Kube
from kiln.operator.metrics import OperatorMetrics
from kiln.runtime.api import spec as specmod
from kiln.runtime.api.contract import API_VERSION, KIND

logger = logging.getLogger("kiln.operator.alerts")

MAX_BODY_BYTES = 1 << 20
MAX_ALERTS = 1000
MAX_LABEL_BYTES = 1024
READ_SECONDS = 10.0  # a client that does not finish sending its body in this long gets 408
RECENT = 10_000  # alerts remembered as already applied (duplicates skip the API entirely)


class Invalid(ValueError):
    """The payload is not an Alertmanager webhook v4 payload Kiln can act on (400)."""


def parse_payload(body: bytes) -> tuple[str, list[dict[str, Any]]]:
    """(groupKey, alerts) from a webhook payload; raises Invalid with the reason."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except ValueError as e:  # also bytes that are no UTF-8, an integer past Python's int-str limit
        raise Invalid(f"the body is not JSON: {e}") from None
    except RecursionError:
        raise Invalid("the body's JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise Invalid("the payload must be a JSON object")
    if data.get("version") != "4":
        raise Invalid(f"unsupported payload version {data.get('version')!r}: Alertmanager's webhook sends \"4\"")
    group_key = data.get("groupKey")
    if not isinstance(group_key, str) or not group_key:
        raise Invalid("groupKey must be a non-empty string")
    alerts = data.get("alerts")
    if not isinstance(alerts, list):
        raise Invalid("alerts must be a list")
    if len(alerts) > MAX_ALERTS:
        raise Invalid(f"{len(alerts)} alerts in one payload; at most {MAX_ALERTS} (set max_alerts in the webhook config)")
    for i, alert in enumerate(alerts):
        where = f"alerts[{i}]"
        if not isinstance(alert, dict):
            raise Invalid(f"{where} must be an object")
        if alert.get("status") not in (sig.FIRING, sig.RESOLVED):
            raise Invalid(f"{where}.status must be firing or resolved, got {alert.get('status')!r}")
        for field in ("labels", "annotations"):
            value = alert.get(field, {})
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= MAX_LABEL_BYTES
                    for k, v in value.items()):
                raise Invalid(f"{where}.{field} must map strings to strings (each under {MAX_LABEL_BYTES} bytes)")
        try:
            sig.parse_time(alert.get("startsAt"))
        except ValueError as e:
            raise Invalid(f"{where}.startsAt: {e}") from None
        if not isinstance(alert.get("fingerprint", ""), str):
            raise Invalid(f"{where}.fingerprint must be a string")
    return group_key, alerts


def _no_constant(literal: str) -> None:
    raise ValueError(f"{literal} is not a JSON number")


def _value(annotations: Mapping[str, str]) -> float | None:
    try:
        value = float(annotations.get("value", ""))
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None  # NaN, Inf: unknown


@dataclasses.dataclass
class _Batch:
    signals: dict[str, sig.Signal]
    done: asyncio.Future  # the alert names that changed the record, or None (no such model)


class Receiver:
    """The HTTP side: one instance per operator process."""

    def __init__(self, kube: Kube, token: str, metrics: OperatorMetrics,
                 clock: Callable[[], Any], namespaces: Callable[[str], bool] = lambda ns: True):
        if not token:
            raise ValueError("the alert receiver needs a bearer token (--alert-token-file)")
        self.kube, self.metrics, self.clock, self.watched = kube, metrics, clock, namespaces
        self._expected = f"Bearer {token}".encode()
        self._batches: dict[tuple[str, str], _Batch] = {}  # per model: the alerts for its next write
        self._writers: dict[tuple[str, str], asyncio.Task] = {}  # per model: the task writing them
        # (namespace, model, alertname, fingerprint, startsAt, status) -> when it was applied
        self._recent: collections.OrderedDict[tuple[str, ...], float] = collections.OrderedDict()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/alerts", self.alerts, expect_handler=_expect)
        app.router.add_get("/metrics", self.prometheus, expect_handler=_expect)
        return app

    async def prometheus(self, _: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def alerts(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            return await self._alerts(request)
        finally:
            self.metrics.receiver_seconds.observe(time.perf_counter() - started)

    async def _alerts(self, request: web.Request) -> web.Response:
        # A header that is no UTF-8 reaches us with surrogates (aiohttp's surrogateescape):
        # surrogatepass encodes any str, so it compares unequal instead of raising.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(given, self._expected):
            self.metrics.alerts_received.labels("unauthorized").inc()
            return web.json_response({"error": "a valid bearer token is required"}, status=401,
                                     headers={"WWW-Authenticate": 'Bearer realm="kiln-alerts"'})
        try:
            body = await asyncio.wait_for(request.read(), READ_SECONDS)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.alerts_received.labels("too_large").inc()
            return web.json_response({"error": f"the payload is over {MAX_BODY_BYTES} bytes"}, status=413)
        except asyncio.TimeoutError:
            self.metrics.alerts_received.labels("invalid").inc()
            return web.json_response({"error": f"the body did not arrive within {READ_SECONDS:.0f} s"}, status=408)
        except (web.RequestPayloadError, ConnectionError) as e:  # a broken chunk or encoding; a client gone
            self.metrics.alerts_received.labels("invalid").inc()
            response = web.json_response({"error": f"the body cannot be read: {' '.join(str(e).split())}"},
                                         status=400)
            response.force_close()
            request.content.feed_eof()  # aiohttp's lingering read of the rest would raise it again, unhandled
            return response
        try:
            group_key, alerts = parse_payload(body)
        except Invalid as e:
            self.metrics.alerts_received.labels("invalid").inc()
            return web.json_response({"error": str(e)}, status=400)
        tally = await self.record(group_key, alerts)
        for result, n in tally.items():
            self.metrics.alerts_received.labels(result).inc(n)
        return web.json_response(tally)

    async def record(self, group_key: str, alerts: list[dict[str, Any]]) -> dict[str, int]:
        """Merge the alerts into their models' records; a tally by result."""
        tally: collections.Counter[str] = collections.Counter()
        now = self.clock()
        by_model: dict[tuple[str, str], dict[str, sig.Signal]] = {}
        keys: dict[tuple[str, str], list[tuple[str, ...]]] = {}
        invalid = None  # the first alert's labels that name no object (logged once a payload)
        for alert in alerts:
            labels = alert.get("labels") or {}
            name, ns, model = labels.get("alertname"), labels.get("namespace"), labels.get("model")
            if name not in sig.RECEIVED or not ns or not model:
                tally["ignored"] += 1
                continue
            if not (specmod.is_namespace(ns) and specmod.is_name(model)):
                tally["invalid"] += 1
                invalid = invalid or (ns, model)
                continue
            if not self.watched(ns):
                tally["ignored"] += 1
                continue
            fingerprint = str(alert.get("fingerprint") or "")
            key = (ns, model, name, fingerprint, alert["startsAt"], alert["status"])
            if self._is_recent(key, now):
                tally["duplicate"] += 1
                continue
            incoming = sig.Signal(state=alert["status"], starts_at=min(sig.parse_time(alert["startsAt"]), now),
                                  seen=now, fingerprint=fingerprint, value=_value(alert.get("annotations") or {}))
            mine = by_model.setdefault((ns, model), {})
            mine[name] = sig.merge(mine.get(name), incoming) or mine[name]
            keys.setdefault((ns, model), []).append(key)
        if invalid:
            logger.warning("%d alerts of group %r have labels that are no namespace and name (first: %r, %r): ignored",
                           tally["invalid"], group_key, *invalid)
        models = list(by_model)
        results = await asyncio.gather(*(self._apply(ns, model, by_model[(ns, model)], group_key)
                                         for ns, model in models))
        for (ns, model), result in zip(models, results):
            tally.update(result)
            if "unknown_model" not in result:  # applied: a repeat within REFRESH_SECONDS skips the API
                for key in keys[(ns, model)]:
                    self._remember(key, now)
        return dict(tally)

    async def _apply(self, ns: str, model: str, incoming: Mapping[str, sig.Signal], group_key: str) -> dict[str, int]:
        """Join the model's next write (group commit: one write in flight per model, and what
        arrives meanwhile goes into the one after it, so a burst costs a few writes, not one each)."""
        key = (ns, model)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch({}, asyncio.get_running_loop().create_future())
            if key not in self._writers:
                self._writers[key] = asyncio.create_task(self._write_batches(ns, model, group_key))
        for name, signal in incoming.items():
            batch.signals[name] = sig.merge(batch.signals.get(name), signal) or batch.signals[name]
        changed = await asyncio.shield(batch.done)
        if changed is None:
            return {"unknown_model": len(incoming)}
        accepted = sum(1 for name in incoming if name in changed)
        return {k: n for k, n in (("accepted", accepted), ("duplicate", len(incoming) - accepted)) if n}

    async def _write_batches(self, ns: str, model: str, group_key: str) -> None:
        key = (ns, model)
        try:
            while key in self._batches:
                batch = self._batches.pop(key)
                try:
                    batch.done.set_result(await self._write(ns, model, batch.signals, group_key))
                except Exception as e:  # every request in the batch answers 500; Alertmanager retries
                    batch.done.set_exception(e)
        finally:
            del self._writers[key]

    async def _write(self, ns: str, model: str, incoming: Mapping[str, sig.Signal], group_key: str) -> set[str] | None:
        """Read the model's record, merge, patch the record alone; the alerts that changed it
        (None: no such model). Not conditional on the resourceVersion (kopf's own annotations
        change it all the time): only this writer writes the record in this process, and the
        chart runs one operator (with several, a simultaneous delivery to two of them is set
        right by Alertmanager's next repeat)."""
        obj = await self.kube.get(KIND, ns, model)
        if obj is None:
            logger.warning("alerts of group %r name %s/%s, which is no InferenceModel: ignored", group_key, ns, model)
            return None
        meta = obj.get("metadata") or {}
        read = (obj.get("apiVersion"), obj.get("kind"), meta.get("namespace"), meta.get("name"))
        if read != (API_VERSION, KIND, ns, model):  # what answered is not what the alerts name: no write
            logger.warning("alerts of group %r name %s/%s, but the API answered %s %s %s/%s, which is not the "
                           "InferenceModel: ignored", group_key, ns, model, *read)
            return None
        record = sig.parse(meta.get("annotations"))
        changed = set()
        for name, signal in incoming.items():
            merged = sig.merge(record.get(name), signal)
            if merged is not None:
                record[name] = merged
                changed.add(name)
        if changed:
            try:
                await self.kube.patch(KIND, ns, model, {"metadata": {"annotations": {sig.ANN_SIGNALS: sig.dump(record)}}})
            except ApiError as e:
                if e.status == 404:
                    return None
                raise
        return changed

    def _is_recent(self, key: tuple[str, ...], now: Any) -> bool:
        at = self._recent.get(key)
        return at is not None and (now - at).total_seconds() < sig.REFRESH_SECONDS

    def _remember(self, key: tuple[str, ...], now: Any) -> None:
        self._recent[key] = now
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """The Expect header as aiohttp answers it, but another than 100-continue is a JSON 417
    (aiohttp's own refusal quotes the header into a body it cannot always encode: a 500)."""
    if request.version != HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        return web.json_response({"error": "only Expect: 100-continue is supported"}, status=417)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the response proper has not started
    return None


def read_token(path: str) -> str:
    """The bearer token from a mounted Secret's file; a clear error when it is missing or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the alert receiver's token file {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"the alert receiver's token file {path} is empty")
    return token


class Server:
    """The receiver on its own thread and event loop: its answers do not wait behind kopf's
    handlers (a burst of alerts wakes as many reconciles), only on its own API calls."""

    def __init__(self, receiver: Receiver, port: int, host: str = "0.0.0.0") -> None:
        self.receiver, self.port, self.host = receiver, port, host
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-alerts", daemon=True)

    def start(self, timeout: float = 30) -> "Server":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)
        logger.info("alert receiver listening on %s:%d (POST /alerts, GET /metrics)", self.host, self.port)
        return self

    async def _start(self) -> None:
        # API calls run in threads (kube.py): as many as the client's connection pool.
        self._loop.set_default_executor(ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="kiln-alerts-api"))
        self._runner = _Runner(self.receiver.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    def stop(self, timeout: float = 10) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


class _Connection(web_protocol.RequestHandler):
    """A request aiohttp's parser refuses (a bad header line or chunk size, Content-Length
    with Transfer-Encoding) is the client's mistake: a JSON 400 and one log line, where
    aiohttp logs an error with a traceback."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        reason = " ".join((message or str(exc or "") or "bad request").split())[:200]
        logger.info("refused a malformed request from %s: %s", request.remote, reason)
        if request.writer.output_size > 0:
            raise ConnectionError("the response was sent already; cannot send an error")
        response = web.json_response({"error": reason}, status=status)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    """An AppRunner whose connections are `_Connection`s."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts and freezes the app
        return _Server(server.request_handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation, loop=server._loop, **server._kwargs)
