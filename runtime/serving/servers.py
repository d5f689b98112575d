"""The doors of one dataplane, started and stopped together: HTTP (`rest.server`) and
gRPC (`grpc.endpoint`) on their own ports, over the same models, schedulers, readiness,
draining and metrics (`dataplane.Dataplane`).

A request flows door -> dataplane -> model -> scheduler. This module is above both doors
(they never import each other): `kiln serve`, `kiln dev` and the front-end processes
(`workers.front_end`, HTTP only, over a dataplane of RemoteModels) start their servers here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

from kiln.runtime.serving.dataplane import DEFAULT_MAX_REQUEST_BYTES, Dataplane
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.model import Model
from kiln.runtime.serving.rest.connections import ConnectionLimits
from kiln.runtime.serving.rest.server import DEFAULT_BODY_TIMEOUT, RestServer, address

if TYPE_CHECKING:  # imported by start(), only when gRPC is served (grpcio)
    from kiln.runtime.serving.grpc.endpoint import GrpcEndpoint

log = logging.getLogger("kiln.runtime.serving.servers")

DEFAULT_MAX_BODY_BYTES = DEFAULT_MAX_REQUEST_BYTES


class InferenceServer:
    """A set of models (a runtime pod serves one) behind the HTTP door and, when started
    with a `grpc_port`, the gRPC door: one dataplane, each door only its transport."""

    def __init__(self, models: Iterable[Model], metrics: ServerMetrics, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 limits: ConnectionLimits | None = None, local_only: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        """`local_only` (what `kiln dev` sets): the HTTP door refuses a Host header that is
        not the address served on, and POST bodies that are neither JSON nor octet-stream
        (`rest.server.RestServer`)."""
        self._attach(Dataplane(models, metrics, max_request_bytes=max_body_bytes, clock=clock),
                     body_timeout=body_timeout, limits=limits, local_only=local_only)

    @classmethod
    def over(cls, dataplane: Dataplane, *, body_timeout: float = DEFAULT_BODY_TIMEOUT,
             limits: ConnectionLimits | None = None) -> "InferenceServer":
        """The doors over a dataplane built elsewhere (a front end's, over RemoteModels)."""
        server = cls.__new__(cls)
        server._attach(dataplane, body_timeout=body_timeout, limits=limits, local_only=False)
        return server

    def _attach(self, dataplane: Dataplane, *, body_timeout: float,
                limits: ConnectionLimits | None, local_only: bool) -> None:
        self.dataplane = dataplane
        self.rest = RestServer(dataplane, body_timeout=body_timeout, limits=limits,
                               local_only=local_only)
        self._grpc: GrpcEndpoint | None = None  # while started with a grpc_port
        self.url: str | None = None
        self.grpc_address: str | None = None  # host:port of the gRPC endpoint, when started

    async def start(self, host: str = "0.0.0.0", port: int | None = 8080,
                    grpc_port: int | None = None, *, reuse_port: bool = False) -> str | None:
        """Listen (HTTP on `port` unless None, as when front-end processes serve it; gRPC
        on `grpc_port` unless None; 0 picks a free one), then load every model in the
        background. Returns the base URL (None without HTTP here)."""
        if port is not None:
            self.url = await self.rest.start(host, port, reuse_port=reuse_port)
        if grpc_port is not None:
            from kiln.runtime.serving.grpc.endpoint import GrpcEndpoint  # grpcio only when serving it

            endpoint = GrpcEndpoint(self.dataplane)
            try:
                bound = await endpoint.start(host, grpc_port)
            except BaseException:
                await self.rest.stop()
                raise
            self._grpc = endpoint
            self.grpc_address = address(host, bound)
            log.info("gRPC listening on %s:%s", host or "0.0.0.0", bound)
        self.dataplane.start_loading()
        return self.url

    async def wait_loaded(self) -> bool:
        """Wait for every model's load attempt; True when all are ready."""
        return await self.dataplane.wait_loaded()

    async def shutdown(self, drain_seconds: float = 30.0) -> bool:
        """Refuse new work, let in-flight requests finish (up to the timeout), stop.

        Returns True when every in-flight request finished in time.
        """
        drained = await self.dataplane.drain(drain_seconds)
        if self._grpc is not None:
            await self._grpc.stop()
            self._grpc = None
        await self.rest.stop()
        log.info("stopped")
        return drained
