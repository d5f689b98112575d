"""Hold requests for models scaled to zero while their first replica starts (activator Deployment)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from kiln.activator import holding  # light: configure() runs for every `kiln --help`
from kiln.runtime.api.contract import GRPC_PORT, SERVICE_PORT


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=os.environ.get("KILN_SERVE_HOST") or "0.0.0.0",
                        help="address to listen on (default $KILN_SERVE_HOST, as `kiln serve`, else 0.0.0.0)")
    parser.add_argument("--http-port", type=int, default=SERVICE_PORT, help="the v2 REST port (port name http)")
    parser.add_argument("--grpc-port", type=int, default=GRPC_PORT, help="the v2 gRPC port (port name grpc)")
    parser.add_argument("--max-queued", type=int, default=holding.DEFAULT_MAX_QUEUED, metavar="N",
                        help="requests held per model at most; past it 503 with Retry-After (gRPC UNAVAILABLE)")
    parser.add_argument("--max-wait-seconds", type=float, default=holding.DEFAULT_MAX_WAIT, metavar="S",
                        help="how long a request is held at most for a Ready pod; then 503 with Retry-After")
    parser.add_argument("--max-body-bytes", type=int, default=holding.MAX_HELD_BYTES, metavar="N",
                        help="the largest request body or gRPC message held")
    parser.add_argument("--default-namespace", default=None, metavar="NS",
                        help="the namespace of a model when the Host names none and the watch knows no single one")
    parser.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                        help="watch the runtime pods of this namespace (repeatable); default: every namespace")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from kiln.activator import cluster, rest
    from kiln.activator.grpcproxy import GrpcProxy
    from kiln.activator.table import Table
    from kiln.operator.kube import Kube, load_client

    api_client = load_client(args.kubeconfig)
    kube = Kube(api_client, component="kiln-activator")
    table = Table()

    async def activate(namespace: str, model: str) -> None:
        done = await cluster.activate(kube, namespace, model)
        logging.getLogger("kiln.activator").info("%s/%s: %s", namespace, model, "scaled from zero to 1" if done
                                                 else "not at zero (scaled already): waiting for its pod")

    holder = holding.Holder(table, activate, args.max_queued, args.max_wait_seconds)
    watches = cluster.Watches(api_client, table, asyncio.get_running_loop(), namespaces=args.namespace)
    watches.start()
    http = rest.RestProxy(holder, args.default_namespace, args.max_body_bytes)
    grpc = GrpcProxy(holder, args.default_namespace, args.max_body_bytes)
    await http.start(args.host, args.http_port)
    await grpc.start(args.host, args.grpc_port)
    logging.getLogger("kiln.activator").info("holding on :%d (REST) and :%d (gRPC)", args.http_port, args.grpc_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    watches.stop()
    await grpc.stop()
    await http.stop()
    return 0
