"""Front-end worker processes: HTTP parsed and tensors decoded on every core, one engine.

One Python process serves about 9,000 small requests a second (its event loop saturates
one core on HTTP parsing and JSON); an engine on a GPU does far more. With `workers` > 1,
`kiln serve` runs as:

    engine process (PID 1)          N front-end processes (spawned, SO_REUSEPORT on --port)
    models, schedulers, gRPC,  <--- each: the same InferenceServer handlers, over a
    result cache, metrics           RemoteModel per model instead of a ServedModel
              `---- one unix socket per front end + one shared-memory segment each

A front end reads and checks a request exactly as the single process does (every status
and message is the same code's), copies the decoded tensors into its shared-memory slot
and sends the engine a small descriptor; the engine views them in place (no copy, no
serialization), hands them to the one scheduler that batches across every front end,
writes the outputs into the same slot and answers with their descriptor. Tensors that do
not fit a slot (or hold Python objects: BYTES) travel inline on the socket instead.
Messages written in one loop iteration leave in one write, so under load one system call
carries many requests.

What stays whole across processes:
- readiness and metadata: the engine pushes its models' state to every front end when it
  changes (checked every `_STATE_PERIOD` seconds), so a probe is answered locally;
- metrics: /metrics on any front end is the engine's registry; front ends send their
  request outcomes and latencies to it (at most `_TALLY_PERIOD` seconds late);
- draining: SIGTERM reaches the engine (PID 1), which passes it to every front end; each
  drains as a single process does (503 + Connection: close, in-flight requests finish),
  then the engine drains its schedulers and exits;
- the result cache and the queue's admission wait are the engine's, shared by all. The
  one difference: a full queue is refused after the front end has read the body (the
  queue is in another process), not before.

A front end whose engine goes away stops (the pod restarts); a front end that dies is
restarted by the engine, at most once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from typing import Any, Callable

from kiln.runtime.api.contract import MAX_AUTO_FRONT_END_WORKERS, MAX_FRONT_END_WORKERS
from kiln.runtime.serving.rest.server import address
from kiln.runtime.serving.workers.engine_side import EngineHub
from kiln.runtime.serving.workers.engines import EngineConfig, engine_main
from kiln.runtime.serving.workers.front_end import FrontEndConfig, front_end_main
from kiln.runtime.serving.workers.link import EngineLink

log = logging.getLogger("kiln.runtime.serving.workers")

_RESTART_DELAY = 1.0


def default_workers(cpus: float | None, engines: int = 1, light: bool = False) -> int:
    """One front end per CPU beyond the engine processes' own, up to 16. Below 3 CPUs, a
    single process (no hops between processes, the engine's threads get the CPUs), except
    for a light model (workers.engines.light_cpu_engine) on 2: there the engine's work is
    the smallest part of a request, and 2 front ends before the engine serve 1.5-2.5x the
    single process's requests (docs/benchmarks.md)."""
    if cpus is None or cpus < 2 or (cpus < 3 and not light):
        return 1
    return max(2, min(MAX_AUTO_FRONT_END_WORKERS, int(math.floor(cpus)) - engines))


def parse_workers(value: str | int | None, cpus: float | None, engines: int = 1,
                  light: bool = False) -> int:
    """`--workers` / KILN_WORKERS / spec.runtime.frontendWorkers -> a count; "auto" or
    None picks `default_workers`. Raises ValueError with the accepted forms."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return default_workers(cpus, engines, light)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"workers must be a number from 1 to {MAX_FRONT_END_WORKERS} or "
                         f"'auto', got {value!r}") from None
    if not 1 <= n <= MAX_FRONT_END_WORKERS:
        raise ValueError(f"workers must be a number from 1 to {MAX_FRONT_END_WORKERS} or "
                         f"'auto', got {n}")
    return n


class FrontEnds:
    """The engine process's side of it all: holds the port, serves the hub, starts the
    front-end workers (and the other engine processes, workers.engines), restarts one that
    dies, and drains them on shutdown.

    The port is held by a socket bound with SO_REUSEPORT and never listened on: it keeps
    the port this pod's (port 0 picks one) while workers come and go."""

    def __init__(self, count: int, host: str, port: int,
                 make_config: Callable[[int, str, str | None, int], FrontEndConfig],
                 engines: list[EngineConfig] | None = None, drain_seconds: float = 30.0):
        """`engines`: the engine processes beyond this one (their `hub_path` is set here);
        front end i sends batchable requests to engine i mod (1 + len(engines))."""
        self.count = count
        self.host = host
        self.port = port
        self._make_config = make_config
        self._dir = tempfile.TemporaryDirectory(prefix="kiln-engine-")
        self.hub_path = os.path.join(self._dir.name, "engine.sock")
        self._engines = [dataclasses.replace(e, hub_path=os.path.join(self._dir.name, f"engine-{i}.sock"))
                         for i, e in enumerate(engines or (), start=1)]
        self._drain_seconds = drain_seconds
        self._reserved: socket.socket | None = None
        self._hub: EngineHub | None = None
        self._procs: dict[int, Any] = {}
        self._engine_procs: dict[int, Any] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    async def start(self, server: Any, grpc_port: int | None) -> str:
        """Start the models (and gRPC) on `server` without HTTP, the other engine processes,
        then the workers on the port. Returns the base URL."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.port))
        self._reserved = sock
        self.port = sock.getsockname()[1]
        for config in self._engines:
            self._spawn_engine(config)
        await server.start(self.host, None, grpc_port)
        self._hub = EngineHub(server, self.hub_path)
        self._hub.engines = 1 + len(self._engines)
        await self._hub.start()
        for config in self._engines:
            self._tasks.append(asyncio.create_task(self._link_to(config),
                                                   name=f"metrics link {config.index}"))
        for i in range(self.count):
            self._spawn(i)
        self._tasks.append(asyncio.create_task(self._restart_dead(), name="front-end supervisor"))
        server.url = f"http://{address(self.host, self.port)}"
        log.info("%d front-end worker(s) on %s:%s", self.count, self.host, self.port)
        if self._engines:
            log.info("%d engine processes", 1 + len(self._engines))
        return server.url

    def loops(self) -> list[tuple[int, int]]:
        """(pid, thread id) of each front end's event loop (its main thread), for
        cpu.PodCpu: the front ends' busy fraction."""
        return [(p.pid, p.pid) for p in list(self._procs.values()) if p.pid is not None]

    def _batch_hub(self, index: int) -> str | None:
        engine = index % (1 + len(self._engines))
        return self._engines[engine - 1].hub_path if engine else None

    def _spawn(self, index: int) -> None:
        # spawn, not fork: the engine process has threads (the backend's, the loop's).
        proc = multiprocessing.get_context("spawn").Process(
            target=front_end_main, name=f"kiln-front-end-{index}", daemon=True,
            args=(self._make_config(index, self.hub_path, self._batch_hub(index), self.port),))
        proc.start()
        self._procs[index] = proc

    def _spawn_engine(self, config: EngineConfig) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.hub_path)  # a dead one's socket: its front ends wait for the new one
        proc = multiprocessing.get_context("spawn").Process(
            target=engine_main, name=f"kiln-engine-{config.index}", daemon=True,
            args=(config, self._drain_seconds))
        proc.start()
        self._engine_procs[config.index] = proc
        log.info("engine process %d started (pid %d)", config.index, proc.pid)

    async def _link_to(self, config: EngineConfig) -> None:
        """Keep a link to another engine process for its metrics, again after a restart."""
        assert self._hub is not None
        while not self._stopping:
            link = EngineLink()
            try:
                await link.connect(config.hub_path, timeout=math.inf)
                self._hub.peers.append(link)
                await link.lost.wait()
            except OSError:
                await asyncio.sleep(_RESTART_DELAY)
            finally:
                if link in self._hub.peers:
                    self._hub.peers.remove(link)
                await link.close()

    async def _restart_dead(self) -> None:
        while not self._stopping:
            await asyncio.sleep(_RESTART_DELAY)
            for config in self._engines:
                proc = self._engine_procs[config.index]
                if not proc.is_alive() and not self._stopping:
                    log.error("engine process %d exited (code %s); starting it again",
                              config.index, proc.exitcode)
                    self._spawn_engine(config)
            for index, proc in list(self._procs.items()):
                if not proc.is_alive() and not self._stopping:
                    log.error("front end %d exited (code %s); starting it again", index,
                              proc.exitcode)
                    self._spawn(index)

    async def stop(self, drain_seconds: float) -> None:
        """SIGTERM every worker and wait for each to drain (its in-flight requests still
        run in the engine processes), up to the drain timeout and 5 s more; then the other
        engine processes, which drain their schedulers; then close the hub."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        deadline = time.monotonic() + max(0.0, drain_seconds) + 5
        await _terminate(self._procs.values(), deadline)
        # Nothing is in flight in them once their front ends are gone: a moment to exit cleanly.
        await _terminate(self._engine_procs.values(), max(deadline, time.monotonic() + 2))
        if self._hub is not None:
            await self._hub.stop()
        if self._reserved is not None:
            self._reserved.close()
        self._dir.cleanup()


async def _terminate(procs: Any, deadline: float) -> None:
    """SIGTERM each process, wait for it until `deadline`, kill what is left."""
    procs = list(procs)
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    for proc in procs:
        await loop.run_in_executor(None, proc.join, max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("%s did not stop in time; killing it", proc.name)
            proc.kill()
            await loop.run_in_executor(None, proc.join, 1)
