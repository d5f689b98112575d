"""Shadow traffic: a sample of this pod's inferences copied to a canary, the answers compared.

While a canary rollout with `rollout.shadow.enabled` runs, the operator writes the model's
shadow config (JSON, the ConfigMap `<model>-shadow`, mounted in the stable pods; `--shadow-config`
names the file): the canary's engine key, its Ready pods, the share to copy and the bounds.
No file, or an empty one: nothing is copied.

Off the request path: `offer` is called in the engine process with an inference's inputs and
the answer it already has, decides (the percentage, then a token bucket of
`maxRequestsPerSecond`) and puts a copy on a bounded queue (full: dropped, counted). Sender
tasks post each copy to a canary pod (binary tensors, with a timeout) and compare the answers
(`compare`, pure). The client's answer never waits on any of it, and a slow or failing canary
costs only its copies.

Counted, labelled with the canary's engine key (Prometheus; the operator's analysis reads them):
    kiln_shadow_copies_total{outcome}           compared | error (the canary answered 5xx, or
                                                an unreadable answer) | unavailable (no
                                                answer in time) | dropped (queue full)
    kiln_shadow_comparisons_total{output, result}  agree | differ, per output (a canary that
                                                answered 4xx to a request the stable side
                                                answered: compared, every output differs)
    kiln_shadow_abs_difference{output}          max |canary - stable| per comparison (histogram)
    kiln_shadow_rel_difference{output}          max |canary - stable| / |stable| (histogram)
    kiln_shadow_canary_duration_seconds         the copy's round trip (histogram)

An output agrees when every element is within `absoluteTolerance + relativeTolerance *
|stable|` (numpy's allclose); an output named in `classOutputs` agrees when its argmax over the
last axis is the same in every row. A missing output or another shape never agrees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import re
import time
from typing import Any, Callable, Mapping

import numpy as np

log = logging.getLogger("kiln.runtime.serving.shadow")

QUEUE_SIZE = 32  # copies waiting to be sent; more are dropped
SENDERS = 4  # copies in flight at once
RELOAD_SECONDS = 1.0  # how often the config file is looked at (a stat, on the request path)
MAX_ANSWER_BYTES = 64 * 1024 * 1024
MAX_TARGETS = 256
MAX_CONFIG_BYTES = 1 << 20  # the operator writes a few hundred bytes
_TARGET = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})$")
_KEY = re.compile(r"^[a-z0-9][a-z0-9.-]{0,127}$")


@dataclasses.dataclass(frozen=True)
class ShadowConfig:
    canary: str  # the canary's engine key (a label of every shadow metric)
    targets: tuple[str, ...]  # host:port of the canary's Ready pods
    percent: float  # of this pod's inferences copied
    max_per_second: float  # this pod's bound on copies
    timeout: float  # seconds a copy may take
    class_outputs: frozenset[str] = frozenset()
    atol: float = 1e-3
    rtol: float = 1e-2


def _number(doc: Mapping[str, Any], key: str, low: float, high: float, default: float | None = None) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        raise ValueError(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def parse_config(text: str, model: str) -> ShadowConfig | None:
    """The config file's text -> a config, or None when it says to copy nothing (empty, or
    for another model). Anything else that is not a valid config raises ValueError: the file
    is written by the operator, but it is still bytes from outside this process."""
    if not text.strip():
        return None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("model") != model:
        return None
    canary = doc.get("canaryEngineKey")
    if not isinstance(canary, str) or not _KEY.match(canary):
        raise ValueError(f"canaryEngineKey must be an engine key, got {canary!r}")
    targets = doc.get("targets")
    if not isinstance(targets, list) or len(targets) > MAX_TARGETS:
        raise ValueError(f"targets must be a list of at most {MAX_TARGETS} host:port")
    for t in targets:
        m = _TARGET.match(t) if isinstance(t, str) else None
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"targets: {t!r} is not host:port")
    classes = doc.get("classOutputs") or []
    if not isinstance(classes, list) or not all(isinstance(c, str) and len(c) <= 256 for c in classes):
        raise ValueError("classOutputs must be a list of output names")
    if not targets:
        return None
    return ShadowConfig(canary, tuple(targets), _number(doc, "percent", 0.0, 100.0),
                        _number(doc, "maxRequestsPerSecond", 0.0, 10000.0), _number(doc, "timeoutSeconds", 0.01, 60.0),
                        frozenset(classes), _number(doc, "absoluteTolerance", 0.0, 1e30, 1e-3),
                        _number(doc, "relativeTolerance", 0.0, 1e30, 1e-2))


# ------------------------------------------------------------------------ the comparison

@dataclasses.dataclass(frozen=True)
class OutputComparison:
    name: str
    agreed: bool
    abs_difference: float  # inf when the canary's output is missing or of another shape
    rel_difference: float


def _differences(stable: np.ndarray, canary: np.ndarray) -> tuple[float, float]:
    a, b = stable.astype(np.float64), canary.astype(np.float64)
    delta = np.abs(a - b)
    delta = np.where(np.isnan(a) & np.isnan(b), 0.0, delta)  # NaN on both sides agrees
    delta = np.where(np.isnan(delta), np.inf, delta)
    if delta.size == 0:
        return 0.0, 0.0
    scale = np.abs(a)
    rel = np.divide(delta, scale, out=np.where(delta == 0, 0.0, np.inf), where=scale > 0)
    return float(delta.max()), float(rel.max())


def compare(stable: Mapping[str, np.ndarray], canary: Mapping[str, np.ndarray], *, class_outputs: frozenset[str],
            atol: float, rtol: float) -> list[OutputComparison]:
    """Every output of the stable answer against the canary's answer to the same inputs."""
    out = []
    for name, s in stable.items():
        c = canary.get(name)
        s = np.asarray(s)
        if c is None or np.shape(c) != s.shape:
            out.append(OutputComparison(name, False, math.inf, math.inf))
            continue
        c = np.asarray(c)
        numeric = s.dtype.kind in "biuf" and c.dtype.kind in "biuf"
        if not numeric:
            same = bool(np.array_equal(s, c))
            out.append(OutputComparison(name, same, 0.0 if same else math.inf, 0.0 if same else math.inf))
            continue
        abs_d, rel_d = _differences(s, c)
        if name in class_outputs and s.ndim >= 1 and s.shape[-1] > 0:
            agreed = bool(np.array_equal(np.argmax(s, axis=-1), np.argmax(c, axis=-1)))
        else:
            agreed = bool(np.allclose(c.astype(np.float64), s.astype(np.float64), rtol=rtol, atol=atol,
                                      equal_nan=True))
        out.append(OutputComparison(name, agreed, abs_d, rel_d))
    return out


# ------------------------------------------------------------------------ sampling

class Sampler:
    """The percentage, then a token bucket (`max_per_second`, a burst of one second's worth)."""

    def __init__(self, clock: Callable[[], float], rng: Callable[[], float] = random.random, share: float = 1.0):
        self._clock, self._rng, self._share = clock, rng, share
        self._tokens, self._at = 0.0, None

    def take(self, config: ShadowConfig) -> bool:
        if config.percent <= 0 or self._rng() * 100.0 >= config.percent:
            return False
        now, rate = self._clock(), config.max_per_second * self._share
        burst = max(rate, 1.0)
        self._tokens = burst if self._at is None else min(burst, self._tokens + (now - self._at) * rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


# ------------------------------------------------------------------------ the copies

class Shadow:
    """One process's copier: reads the config file when it changes, samples, sends, counts."""

    def __init__(self, path: str, model: str, metrics: Any, *, clock: Callable[[], float], share: float = 1.0,
                 rng: Callable[[], float] = random.random, send: Callable[..., Any] | None = None):
        """`send(target, model, body, json_length, timeout) -> (status, body, the answer's
        Inference-Header-Content-Length)`: the transport, aiohttp unless a test gives another.
        `share`: this process's part of the pod's rate bound (1 / its engine processes)."""
        self.path, self.model, self.metrics, self._clock = path, model, metrics, clock
        self.config: ShadowConfig | None = None
        self._sampler = Sampler(clock, rng, share)
        self._stamp: tuple[int, int] | None = None
        self._checked = -math.inf
        self._problem = ""
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._send = send or self._post
        self._session: Any = None
        self._turn = 0

    def _reload(self) -> None:
        now = self._clock()
        if now - self._checked < RELOAD_SECONDS:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        config, problem = None, ""
        if stamp is not None:
            # The one regular-file reader: a FIFO is refused at once (a blocking open would
            # stop the event loop), and the size is bounded. Whatever is wrong with the file,
            # the config it replaces is dropped: nothing is copied by a config no longer there.
            from kiln.runtime.api.localfile import UnreadableFile, read_bounded

            try:
                text = read_bounded(self.path, MAX_CONFIG_BYTES, "shadow config").decode("utf-8")
                config = parse_config(text, self.model)
            except UnreadableFile as e:
                problem = str(e)
            except (UnicodeDecodeError, ValueError) as e:
                problem = f"{self.path}: {e}"
            except RecursionError:
                problem = f"{self.path}: the JSON nests too deeply"
        if problem and problem != self._problem:
            log.warning("shadow config ignored, nothing is copied: %s", problem)
        elif config != self.config:
            log.info("shadow: %s", f"{config.percent:g}% (at most {config.max_per_second:g}/s) of inferences copied "
                     f"to canary {config.canary} ({len(config.targets)} pod(s))" if config else "off")
        self._problem, self.config = problem, config

    def offer(self, inputs: Mapping[str, np.ndarray], results: Mapping[str, np.ndarray]) -> None:
        """An inference this process answered: maybe copy it. Never raises, never waits."""
        try:
            self._reload()
            config = self.config
            if config is None or not self._sampler.take(config):
                return
            if self._queue is None:
                self._queue = asyncio.Queue(QUEUE_SIZE)
                self._tasks = [asyncio.get_running_loop().create_task(self._sender()) for _ in range(SENDERS)]
            # Copies: a front end's tensors live in shared memory that the next request reuses.
            copy = (config, {k: np.array(v) for k, v in inputs.items()}, {k: np.array(v) for k, v in results.items()})
            self._queue.put_nowait(copy)
        except asyncio.QueueFull:
            self._count(config, "dropped")
        except Exception as e:  # the copy is never worth the request
            log.warning("shadow: a copy was not made: %s", e)

    def _count(self, config: ShadowConfig, outcome: str) -> None:
        self.metrics.shadow_copies.labels(model=self.model, canary=config.canary, outcome=outcome).inc()

    async def _sender(self) -> None:
        from kiln.runtime.serving import protocol

        assert self._queue is not None
        while True:
            config, inputs, stable = await self._queue.get()
            target = config.targets[self._turn % len(config.targets)]
            self._turn += 1
            body, json_length = protocol.encode_infer_request(inputs, binary=True, outputs=list(stable),
                                                              binary_outputs=True)
            started = self._clock()
            try:
                status, answer, length_header = await asyncio.wait_for(
                    self._send(target, self.model, body, json_length, config.timeout), config.timeout)
            except (OSError, asyncio.TimeoutError, ValueError):
                self._count(config, "unavailable")
                continue
            except Exception as e:  # whatever the transport raised: the copy is lost, not the sender
                log.warning("shadow: copy to %s failed: %s", target, e)
                self._count(config, "unavailable")
                continue
            self.metrics.shadow_canary_seconds.labels(model=self.model, canary=config.canary).observe(
                self._clock() - started)
            try:
                if 400 <= status < 500:  # it refused what the stable side answered: nothing agrees
                    canary = {}
                elif status != 200:
                    raise ValueError(f"status {status}")
                else:
                    doc = protocol.decode_infer_response(answer, protocol.header_length(length_header, len(answer)))
                    canary = {o["name"]: o["data"] for o in doc.get("outputs") or ()}
            except Exception:  # a canary's bad answer is a failed copy, whatever is wrong with it
                self._count(config, "error")
                continue
            self._count(config, "compared")
            for c in compare(stable, canary, class_outputs=config.class_outputs, atol=config.atol, rtol=config.rtol):
                labels = {"model": self.model, "canary": config.canary, "output": c.name}
                self.metrics.shadow_comparisons.labels(**labels, result="agree" if c.agreed else "differ").inc()
                self.metrics.shadow_abs_difference.labels(**labels).observe(c.abs_difference)
                self.metrics.shadow_rel_difference.labels(**labels).observe(c.rel_difference)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._session is not None:
            await self._session.close()

    async def _post(self, target: str, model: str, body: bytes, json_length: int | None,
                    timeout: float) -> tuple[int, bytes, str | None]:
        """One copy over HTTP: the canary pod's v2 infer endpoint, binary tensors both ways.
        -> (status, body, its Inference-Header-Content-Length header)."""
        import aiohttp

        from kiln.runtime.serving.protocol import HEADER_LENGTH

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=SENDERS * 2))
        headers = {"Content-Type": "application/octet-stream"}
        if json_length is not None:
            headers[HEADER_LENGTH] = str(json_length)
        async with self._session.post(f"http://{target}/v2/models/{model}/infer", data=body, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            chunks, size = [], 0
            async for chunk in r.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    return 413, b"", None  # not read on: counted as the canary's error
                chunks.append(chunk)
            return r.status, b"".join(chunks), r.headers.get(HEADER_LENGTH)


def attach_shadow(model: Any, path: str | None, engine_processes: int) -> None:
    """`kiln serve --shadow-config`: each engine process copies its part of the pod's rate."""
    if path:
        model.shadow = Shadow(path, model.name, model.metrics, clock=time.monotonic,
                              share=1.0 / max(engine_processes, 1))
