"""The serving process's life: its event loop, its signals, its logging.

`run_until_stopped` serves until SIGTERM or SIGINT, then drains: readiness false, new
requests refused with Retry-After, in-flight ones finish (up to the drain timeout).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine

if TYPE_CHECKING:
    from kiln.runtime.serving.servers import InferenceServer

log = logging.getLogger("kiln.runtime.server")


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def may_start_processes() -> None:
    """In a front end: let it start processes of its own (its JSON worker, rest.body). The
    supervisor starts front ends daemonic, so that the engine's exit ends them, and
    multiprocessing refuses a daemonic process children (they would be orphaned when it is
    ended); the JSON worker dies with its front end instead. The flag changed here is this
    process's own view of itself; the supervisor's handle is unchanged."""
    multiprocessing.current_process().daemon = False


EVENT_LOOP_ENV = "KILN_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_choice() -> str:
    """The event loop `run_event_loop` uses: uvloop when it is installed (the runtime
    extra installs it), unless `KILN_EVENT_LOOP=asyncio`. Raises ValueError on a bad value
    or `KILN_EVENT_LOOP=uvloop` without uvloop."""
    wanted = os.environ.get(EVENT_LOOP_ENV, "auto").strip().lower() or "auto"
    if wanted not in EVENT_LOOPS:
        raise ValueError(f"{EVENT_LOOP_ENV} must be one of {', '.join(EVENT_LOOPS)}, "
                         f"got {wanted!r}")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if wanted == "uvloop":
            raise ValueError(f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed "
                             f"(pip install 'kiln-operator[runtime]')") from None
        return "asyncio"
    return "uvloop"


def run_event_loop(main: Coroutine[Any, Any, Any], loop: str | None = None) -> Any:
    """Run `main` to completion on a new event loop (`loop`: "uvloop" or "asyncio";
    default `event_loop_choice()`). uvloop (libuv) serves about 5-10% more small requests
    per second than asyncio's own loop on the same core (docs/batching.md, Tuning)."""
    loop = loop or event_loop_choice()
    log.info("event loop: %s", loop)
    if loop == "uvloop":
        import uvloop
        return uvloop.run(main)
    return asyncio.run(main)


async def run_until_stopped(server: "InferenceServer", host: str, port: int,
                            drain_seconds: float,
                            on_started: Callable[[str], Coroutine[Any, Any, None]] | None = None,
                            stop: asyncio.Event | None = None,
                            grpc_port: int | None = None, *, reuse_port: bool = False,
                            front_ends: Any = None) -> bool:
    """Serve until SIGTERM or SIGINT (or `stop` is set), then drain and stop; gRPC too on
    `grpc_port` unless it is None. With `front_ends` (`workers.supervisor.FrontEnds`), HTTP is
    served by its worker processes, which drain first.

    `on_started(url)` runs as a task once the server listens. Returns what
    `InferenceServer.shutdown` returns.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    # Only the main thread may handle signals: a server run in a thread (tests, benchmarks)
    # is stopped through `stop` instead.
    handled = ((signal.SIGTERM, signal.SIGINT)
               if threading.current_thread() is threading.main_thread() else ())
    for sig in handled:
        loop.add_signal_handler(sig, stop.set)
    try:
        if front_ends is None:
            url = await server.start(host, port, grpc_port, reuse_port=reuse_port)
        else:
            url = await front_ends.start(server, grpc_port)
        task = asyncio.create_task(on_started(url)) if on_started else None
        await stop.wait()
        log.info("stop requested")
        if task is not None and not task.done():
            task.cancel()
        if front_ends is not None:
            started = time.monotonic()
            server.dataplane.stop_taking_work()  # gRPC here refuses new work while the workers drain
            await front_ends.stop(drain_seconds)
            drain_seconds = max(0.0, drain_seconds - (time.monotonic() - started))
        return await server.shutdown(drain_seconds)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
