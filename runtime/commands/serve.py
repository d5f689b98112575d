"""Serve a cached engine over the Open Inference Protocol (what a runtime pod runs).

The operator's Deployment passes one --engine per target it built for; the pod picks the
entry for its own GPU (or a cpu entry), verifies its sha256 against the cache manifest,
loads and warms it up, and only then reports ready. Liveness answers from the start.
SIGTERM: readiness false, in-flight requests finish (up to --drain-seconds), exit 0.
Sample requests that fail (spec.runtime.warmup, --samples-file): the model never becomes
ready, `<reason>: <message>` goes to the termination log and the process exits with the
reason's code (runtime.api.errors: WarmupFailed, 9), so the operator can tell the user.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from kiln.runtime.api.contract import CACHE_DIR as DEFAULT_CACHE_DIR, SERVICE_PORT as DEFAULT_PORT
from kiln.runtime.api.contract import GRPC_PORT as DEFAULT_GRPC_PORT
from kiln.runtime.api.contract import LOAD_TIMEOUT_SECONDS as DEFAULT_LOAD_TIMEOUT_SECONDS
DEFAULT_DRAIN_SECONDS = 30.0
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # same as dataplane.DEFAULT_MAX_REQUEST_BYTES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-name", required=True,
                        help="the name clients use in /v2/models/{name}")
    parser.add_argument("--model-version", default="1",
                        help="the version reported in metadata and kiln_model_info")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                        help="where the engine cache is mounted (default %(default)s)")
    parser.add_argument("--cache-claim", default="", metavar="NAME",
                        help="the PersistentVolumeClaim mounted at --cache-dir, the `claim` label "
                             "of the kiln_engine_cache_* metrics (the operator passes "
                             "spec.cache.claimName)")
    parser.add_argument("--engine", action="append", required=True, metavar="TARGET=RELPATH",
                        help="an engine entry for a target, relative to --cache-dir, e.g. "
                             "sm90=default/resnet/3f2a…; repeat for each target")
    parser.add_argument("--runtime-spec", default="{}", metavar="JSON",
                        help="spec.runtime of the InferenceModel as JSON (batching, "
                             "contexts, result cache); defaults are applied")
    parser.add_argument("--samples-file", default=None, metavar="PATH",
                        help="a JSON file of sample requests ({\"samples\": [...]}) run after the "
                             "warm-up, before the model reports ready, after those of "
                             "spec.runtime.warmup.samples (the operator passes "
                             "spec.runtime.warmup.samplesFile on the model's volume)")
    parser.add_argument("--termination-log", default=None, metavar="PATH",
                        help="where a failure no restart mends is written (default: the pod's "
                             "termination log when writable)")
    parser.add_argument("--host", default=os.environ.get("KILN_SERVE_HOST") or "0.0.0.0",
                        help="address to listen on (default $KILN_SERVE_HOST, else 0.0.0.0)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="(default %(default)s)")
    add_grpc_flags(parser)
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get 413 (default %(default)s)")
    parser.add_argument("--body-timeout-seconds", type=float, default=60.0,
                        help="a request body must arrive within this, else 408 "
                             "(default %(default)s)")
    parser.add_argument("--header-timeout-seconds", type=float, default=10.0,
                        help="a request's line and headers must arrive within this, else "
                             "the connection is closed (default %(default)s)")
    parser.add_argument("--keepalive-timeout-seconds", type=float, default=75.0,
                        help="an idle keep-alive connection is closed after this "
                             "(default %(default)s)")
    parser.add_argument("--max-connections", type=int, default=1000,
                        help="open connections at most; at the cap the oldest idle one is "
                             "closed, else a new one gets 503 (default %(default)s, lowered "
                             "to fit the open-file limit)")
    parser.add_argument("--drain-seconds", type=float, default=DEFAULT_DRAIN_SECONDS,
                        help="how long SIGTERM waits for in-flight requests "
                             "(default %(default)s)")
    parser.add_argument("--load-timeout-seconds", type=float,
                        default=DEFAULT_LOAD_TIMEOUT_SECONDS,
                        help="how long the engine load (read, verify, deserialize, warm-up) "
                             "may take before the model fails, not ready, with the reason "
                             "(default %(default)s)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--workers", default=os.environ.get("KILN_WORKERS"), metavar="N|auto",
                        help="front-end processes parsing HTTP in parallel before the one engine "
                             "(1: a single process); default: KILN_WORKERS, else "
                             "spec.runtime.frontendWorkers, else auto (the CPU limit less the "
                             "engine processes; 1 below 3 CPUs, 2 on 2 for a small CPU engine)")
    parser.add_argument("--engine-processes", default=os.environ.get("KILN_ENGINE_PROCESSES"),
                        metavar="N|auto",
                        help="engine processes behind the front ends, each with its own copy of "
                             "a CPU engine; default: KILN_ENGINE_PROCESSES, else "
                             "spec.runtime.engineProcesses, else auto (one per 4 CPUs for a "
                             "small CPU engine, else 1)")


def add_grpc_flags(parser: argparse.ArgumentParser, default: int = DEFAULT_GRPC_PORT) -> None:
    parser.add_argument("--grpc-port", type=int, default=None,
                        help=f"the gRPC endpoint's port (inference.GRPCInferenceService), on the "
                             f"same host; 0 picks a free one (default {default}, or a free one "
                             f"when --port is 0)")
    parser.add_argument("--no-grpc", dest="grpc", action="store_false",
                        help="serve HTTP only")
    parser.add_argument("--shadow-config", default=None, metavar="PATH",
                        help="a shadow config file (the operator's, during a canary rollout with "
                             "rollout.shadow): a sample of inferences is copied to the canary it names "
                             "and the answers compared; read again when it changes, absent: none")


def grpc_port(args: argparse.Namespace, default: int = DEFAULT_GRPC_PORT) -> int | None:
    """--grpc-port checked, or None with --no-grpc. Raises ValueError; ImportError (which
    names the runtime extra) when grpcio is not installed."""
    if not args.grpc:
        return None
    port = args.grpc_port
    if port is None:
        port = 0 if args.port == 0 else default
    if not 0 <= port <= 65535:
        raise ValueError(f"--grpc-port must be 0..65535, got {port}")
    if port == args.port != 0:
        raise ValueError(f"--grpc-port and --port are both {port}")
    import kiln.runtime.serving.grpc.endpoint  # noqa: F401  (grpcio, protobuf: fail now, not once serving)

    return port


def runtime_spec_with_defaults(text: str) -> dict:
    """`--runtime-spec` JSON -> spec.runtime with the CRD's defaults applied.

    The API server applied them already; applying them again costs nothing and keeps a
    hand-written Deployment (or an older operator) from running without them.
    """
    import json

    from kiln.runtime.api import spec

    try:
        runtime = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--runtime-spec is not valid JSON: {e}") from None
    if not isinstance(runtime, dict):
        raise ValueError("--runtime-spec must be a JSON object (spec.runtime)")
    return spec.runtime_with_defaults(runtime)


def check_result_cache(runtime: dict, environ=os.environ) -> None:
    """spec.runtime.resultCache checked before anything starts: a bad spec (or a shared store
    whose password the operator should have passed and did not) is a clear ValueError at
    start, not a model that fails to load later."""
    from kiln.runtime.serving.scheduling.resultcache import ResultCacheConfig

    config = ResultCacheConfig.from_spec(runtime.get("resultCache"))
    if config.enabled and config.shared is not None:
        config.shared.password(environ)


def engine_threads_setting(runtime: dict, cpus: float | None, workers: int,
                           engine_count: int) -> int | None:
    """The ONNX Runtime intra-op threads of each engine process: $KILN_ORT_INTRA_OP_THREADS
    when set (None here: the backend reads it), else spec.runtime.engineThreads, else
    derived from the CPU limit (`workers.engines.engine_threads`)."""
    from kiln.runtime.engine.backends.onnxruntime import THREADS_ENV
    from kiln.runtime.serving.workers.engines import engine_threads, parse_engine_threads

    chosen = parse_engine_threads(runtime.get("engineThreads"))
    if os.environ.get(THREADS_ENV):
        return None
    return chosen if chosen is not None else engine_threads(cpus, workers, engine_count)


def cache_namespace(engines: dict[str, str]) -> str:
    """The cache's <namespace>/ directory the model's entries are in: the first part of its
    first engine path (`<namespace>/<model>/<key>`, as the operator passes them), so the
    pod needs no downward-API variable to know the part of the cache it reads."""
    return next(iter(engines.values())).split("/", 1)[0]


def watch_engine_cache(metrics, cache_dir: str, claim: str, namespace: str) -> None:
    """Export the kiln_engine_cache_* gauges of `cache_dir` and `namespace` on `metrics`."""
    from kiln.runtime.engine.cache.usage import CachedCacheUsage

    metrics.engine_cache.watch(CachedCacheUsage(cache_dir, namespace), claim, namespace)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import threading

    from kiln.runtime.commands.termination import TERMINATION_LOG_LIMIT, termination_log, write_message
    from kiln.runtime.serving.rest.connections import ConnectionLimits
    from kiln.runtime.serving.workers.front_end import FrontEndConfig
    from kiln.runtime.serving.workers.engines import (EngineConfig, auto_engine_processes,
                                                      light_cpu_engine, parse_engine_processes)
    from kiln.runtime.serving.cpu import PodCpu, cpu_limit
    from kiln.runtime.serving.workers.supervisor import FrontEnds, parse_workers
    from kiln.runtime.serving.metrics import ServerMetrics
    from kiln.runtime.serving.loading import parse_engines
    from kiln.runtime.serving.model import ServedModel
    from kiln.runtime.serving.shadow import attach_shadow
    from kiln.runtime.serving.process import configure_logging, event_loop_choice, run_event_loop, run_until_stopped
    from kiln.runtime.serving.servers import InferenceServer

    configure_logging(args.log_level)
    try:
        engines = parse_engines(args.engine)
        runtime = runtime_spec_with_defaults(args.runtime_spec)
        check_result_cache(runtime)
        event_loop = event_loop_choice()
        if args.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be 0..65535, got {args.port}")
        grpc = grpc_port(args)
        for flag in ("body_timeout_seconds", "header_timeout_seconds",
                     "keepalive_timeout_seconds", "max_connections"):
            if not getattr(args, flag) > 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive, got "
                                 f"{getattr(args, flag)}")
        limits = ConnectionLimits(max_connections=args.max_connections,
                                  header_timeout=args.header_timeout_seconds,
                                  keepalive_timeout=args.keepalive_timeout_seconds)
        cpus = cpu_limit()
        light = light_cpu_engine(engines, args.cache_dir)
        engine_count = parse_engine_processes(
            args.engine_processes if args.engine_processes is not None
            else runtime.get("engineProcesses"), auto_engine_processes(cpus, light), engines)
        workers = parse_workers(args.workers if args.workers is not None
                                else runtime.get("frontendWorkers"), cpus, engine_count, light)
        if workers == 1:
            engine_count = 1  # a single process: the engine is the front end
        threads = engine_threads_setting(runtime, cpus, workers, engine_count)
        if runtime.get("warmup") is not None:  # checked now: a bad tolerance is no load failure
            from kiln.runtime.serving.samples import Tolerance

            Tolerance.from_spec(runtime["warmup"])
        if not (math.isfinite(args.load_timeout_seconds) and args.load_timeout_seconds > 0):
            raise ValueError(f"--load-timeout-seconds must be a positive number, "
                             f"got {args.load_timeout_seconds:g}")
    except ValueError as e:
        print(f"kiln serve: {e}", file=sys.stderr)
        return 2

    if threads is not None:  # read by the ONNX Runtime backend, here and in every engine process
        from kiln.runtime.engine.backends.onnxruntime import THREADS_ENV

        os.environ[THREADS_ENV] = str(threads)

    async def main() -> int:
        metrics = ServerMetrics()
        # Here, in the first engine process only: every engine process reads one volume.
        watch_engine_cache(metrics, args.cache_dir, args.cache_claim, cache_namespace(engines))
        model = ServedModel(args.model_name, args.model_version, args.cache_dir, engines,
                            runtime, metrics, load_timeout=args.load_timeout_seconds,
                            samples_file=args.samples_file)
        attach_shadow(model, args.shadow_config, engine_count)
        server = InferenceServer([model], metrics, max_body_bytes=args.max_body_bytes,
                                 body_timeout=args.body_timeout_seconds, limits=limits)
        front_ends = None
        if workers > 1:
            # The samples run in this engine process only: the others load the same engine.
            others_runtime = {k: v for k, v in runtime.items() if k != "warmup"}
            others = [EngineConfig(
                index=i, hub_path="", model_name=model.name, model_version=model.version,
                cache_dir=args.cache_dir, engines=engines, runtime=others_runtime,
                load_timeout=args.load_timeout_seconds, max_body_bytes=args.max_body_bytes,
                log_level=args.log_level, event_loop=event_loop, shadow_config=args.shadow_config,
                engine_processes=engine_count) for i in range(1, engine_count)]
            front_ends = FrontEnds(workers, args.host, args.port, lambda index, hub, batch, port: FrontEndConfig(
                index=index, hub_path=hub, batch_hub_path=batch, host=args.host, port=port,
                model_names=(model.name,), max_body_bytes=args.max_body_bytes,
                body_timeout=args.body_timeout_seconds, limits=limits,
                drain_seconds=args.drain_seconds, log_level=args.log_level,
                event_loop=event_loop), engines=others, drain_seconds=args.drain_seconds)
        # The pod's CPU, its limit and its HTTP loops' busy time (the autoscaling signal of
        # CPU models): this process's loop where it is the front end itself.
        own_loop = [(os.getpid(), threading.get_native_id())]
        metrics.pod_cpu.watch(PodCpu(cpus, front_ends.loops if front_ends else lambda: own_loop, workers))
        stop = asyncio.Event()

        async def stop_if_failed(_url: str | None) -> None:
            await server.wait_loaded()
            if model.failure is not None:
                write_message(termination_log(args.termination_log),
                              model.failure.termination_message().encode()[:TERMINATION_LOG_LIMIT].decode(errors="ignore"),
                              lambda m: print(f"kiln serve: {m}", file=sys.stderr))
                stop.set()

        await run_until_stopped(server, args.host, args.port, args.drain_seconds, on_started=stop_if_failed,
                                stop=stop, grpc_port=grpc, front_ends=front_ends)
        return model.failure.exit_code if model.failure is not None else 0

    try:
        code = run_event_loop(main(), event_loop)
    except OSError as e:  # the port is taken, the address is not this host's
        ports = args.port if grpc is None else f"{args.port} (gRPC {grpc})"
        print(f"kiln serve: cannot listen on {args.host}:{ports}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    return code
