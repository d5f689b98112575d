"""Run the Kiln operator (kopf): build engines, deploy runtimes, keep status.

Configuration that is not in an InferenceModel's spec comes from flags: backend versions
(they are part of every engine key), default targets, images, the cache claim.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kiln.operator.config import (DEFAULT_BACKEND_VERSIONS, DEFAULT_BUILDER_IMAGE, DEFAULT_CACHE_CLAIM,
                                  DEFAULT_RUNTIME_IMAGE, OperatorConfig)

# Decisions on kopf's settings (docs/architecture.md explains them):
WATCH_SERVER_TIMEOUT = 600  # seconds; bounded server-side, so a silently dead stream is renewed
WATCH_CLIENT_TIMEOUT = 660
PROGRESS_PREFIX = "kiln.dev"  # kopf's progress and diff-base live in annotations under kiln.dev/


def _backend_version(text: str) -> tuple[str, str]:
    name, sep, version = text.partition("=")
    if not sep or not name or not version:
        raise argparse.ArgumentTypeError(f"expected BACKEND=VERSION (e.g. tensorrt=10.13.0), got {text!r}")
    return name, version


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="serve InferenceModels in this namespace (repeatable; globs allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="serve the whole cluster (default)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                        help="kopf liveness endpoint (empty to disable)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=None, metavar="NAME",
                         help="kopf peering object for leader election among replicas (default: kopf's "
                              "'default' peering when its CRD is installed, else standalone)")
    peering.add_argument("--standalone", action="store_true", help="no peering: the only replica")
    parser.add_argument("--backend-version", action="append", type=_backend_version, default=[],
                        metavar="BACKEND=VERSION",
                        help="engine backend version, part of every engine key (defaults: "
                             + ", ".join(f"{k}={v}" for k, v in DEFAULT_BACKEND_VERSIONS.items()) + ")")
    parser.add_argument("--default-target", "--default-targets", action="append", default=[], metavar="TARGET",
                        help="GPU architecture or product to build tensorrt engines for when "
                             "spec.engine.targets is empty (repeatable or comma-separated; default sm90; "
                             "onnxruntime: cpu)")
    parser.add_argument("--builder-image", default=DEFAULT_BUILDER_IMAGE, help="image of the build Jobs")
    parser.add_argument("--runtime-image", default=DEFAULT_RUNTIME_IMAGE, help="image of the runtime pods")
    parser.add_argument("--cache-claim", default=DEFAULT_CACHE_CLAIM,
                        help="engine cache PVC when spec.cache.claimName is empty")
    parser.add_argument("--resync-seconds", type=float, default=300.0,
                        help="interval of the level-triggered resync timer per model")
    parser.add_argument("--retry-seconds", type=float, default=5.0,
                        help="retry delay while waiting on something that cannot be watched")
    parser.add_argument("--alert-receiver-port", type=int, default=0, metavar="PORT",
                        help="port of the Alertmanager webhook receiver (POST /alerts) and the operator's "
                             "metrics (GET /metrics); 0 (the default) disables both; the chart sets 8081")
    parser.add_argument("--alert-token-file", default=None, metavar="PATH",
                        help="file holding the bearer token Alertmanager must send (a mounted Secret); "
                             "required while the receiver is on")
    parser.add_argument("--signal-ttl-seconds", type=float, default=600.0,
                        help="a firing alert not delivered again within this long is not acted on; "
                             "keep it above Alertmanager's repeat_interval for Kiln's route")
    parser.add_argument("--container-concurrency", type=_non_negative, default=0.0, metavar="N",
                        help="the chart's autoscaling.rules.containerConcurrency: above 0, the autoscaling rules "
                             "scale every model on requests in flight per pod over N (status.scaling.signal says so)")
    parser.add_argument("--prometheus-url", default=None, metavar="URL",
                        help="Prometheus for canary analysis (e.g. http://prometheus-operated.monitoring:9090); "
                             "without it the built-in checks are off and a spec's own checks hold the rollout")
    parser.add_argument("--cache-gc-interval-seconds", type=_non_negative, default=3600.0,
                        help="engine-cache garbage collection: a pass per namespace this often (0: off)")
    parser.add_argument("--cache-gc-retention", type=_count, default=1, metavar="N",
                        help="per model and target, keep the N newest engines no version needs (for a rollback)")
    parser.add_argument("--cache-gc-grace-seconds", type=_non_negative, default=86400.0,
                        help="remove an engine only once nothing has needed it for this long "
                             "(a deleted model's engines too)")
    parser.add_argument("--cache-gc-lock-settle-seconds", type=_non_negative, default=None, metavar="S",
                        help="the GC Job's wait after making a model directory's lock file, before it looks "
                             "(default: kiln cache-gc's, 60 s, longer than an NFS client caches a missing file)")
    parser.add_argument("--cache-gc-dry-run", action="store_true",
                        help="decide and report (Events EngineRemovable, the GC Job's log), remove nothing")
    parser.add_argument("--activator-service", default=None, metavar="NS/NAME", type=_namespaced_name,
                        help="the activator's Service (`kiln activator`): models with minReplicas 0 go to zero, "
                             "their Service pointing there; without it they stay at one replica")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def _namespaced_name(text: str) -> str:
    namespace, _, name = text.partition("/")
    if not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, got {text!r}")
    return text


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    versions = dict(DEFAULT_BACKEND_VERSIONS)
    versions.update(dict(args.backend_version))
    return OperatorConfig(
        backend_versions=versions,
        default_targets=tuple(t.strip() for arg in args.default_target for t in arg.split(",") if t.strip())
        or ("sm90",),
        builder_image=args.builder_image,
        runtime_image=args.runtime_image,
        cache_claim=args.cache_claim,
        resync_seconds=args.resync_seconds,
        retry_seconds=args.retry_seconds,
        signal_ttl_seconds=args.signal_ttl_seconds,
        prometheus_url=args.prometheus_url or None,
        cache_gc_interval_seconds=args.cache_gc_interval_seconds,
        cache_gc_retention=args.cache_gc_retention,
        cache_gc_grace_seconds=args.cache_gc_grace_seconds,
        cache_gc_lock_settle_seconds=args.cache_gc_lock_settle_seconds,
        cache_gc_dry_run=args.cache_gc_dry_run,
        activator_service=args.activator_service,
        container_concurrency=args.container_concurrency,
    )


def settings(verbose: bool = False) -> Any:
    """kopf settings, decided once (see module constants)."""
    import kopf

    from kiln.operator import handlers, rollout, signals

    s = kopf.OperatorSettings()
    # Kiln posts its own Events (BuildStarted, Available, ...); kopf posts only its warnings
    # and errors (a crashed handler), not a "Handler succeeded" per reconcile.
    s.posting.level = logging.WARNING
    # No status.kopf (the CRD's status schema would prune it): progress and the diff-base
    # are annotations, kiln.dev/reconcile and kiln.dev/last-handled-configuration.
    # No handler needs a finalizer (no kopf timer, no deletion handler: handlers.py says why),
    # so kopf adds none; naming the one earlier versions put on every model makes kopf remove
    # it from each model it sees, so those can be deleted once the operator is uninstalled.
    s.persistence.finalizer = "kiln.dev/finalizer"
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PROGRESS_PREFIX)
    # The alert receiver's signal record and a rollout action are no changes to handle (event
    # handlers act on them): left out of the diff-base, so they cost no second write.
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PROGRESS_PREFIX, key="last-handled-configuration",
        ignored_fields=[("metadata", "annotations", signals.ANN_SIGNALS),
                        ("metadata", "annotations", rollout.ANN_ACTION)])
    s.watching.server_timeout = WATCH_SERVER_TIMEOUT
    s.watching.client_timeout = WATCH_CLIENT_TIMEOUT
    s.watching.connect_timeout = 30
    for resource, selector in handlers.LABEL_SELECTORS.items():
        s.watching.label_selectors[resource] = selector
    for resource, selector in handlers.FIELD_SELECTORS.items():
        s.watching.field_selectors[resource] = selector
    s.networking.request_timeout = 60
    s.execution.max_workers = 8  # the kubernetes client's threads (asyncio.to_thread uses its own pool)
    s.queueing.error_delays = (1, 2, 5, 10, 30)
    return s


async def serve(config: OperatorConfig, *, namespaces: list[str] | None = None, standalone: bool = True,
                peering: str | None = None, liveness: str | None = None, kubeconfig: str | None = None,
                verbose: bool = False, ready_flag: Any = None, stop_flag: Any = None,
                kube: Any = None, alert_port: int = 0, alert_token: str | None = None) -> None:
    """Run the operator in the current event loop until `stop_flag` (tests use this directly)."""
    import asyncio
    import concurrent.futures
    import fnmatch

    import kopf

    from kiln.operator import alerts, handlers, kube as kubemod, reconcile

    # API calls run in threads (kube.py); as many as the client's connection pool, so a burst
    # of reconciles is not queued behind the default executor's few threads.
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(kubemod.POOL_SIZE, thread_name_prefix="kiln-api"))
    if kube is None:
        kube = kubemod.Kube(kubemod.load_client(kubeconfig), component=config.operator_name)
    ctx = reconcile.Context(config=config, kube=kube)
    receiver = None
    if alert_port:
        watched = (lambda ns: any(fnmatch.fnmatchcase(ns, g) for g in namespaces)) if namespaces else (lambda ns: True)
        # Its own client counts (kube.calls is this loop's), the same connection pool.
        receiver = alerts.Server(alerts.Receiver(kubemod.Kube(kube.client, kube.component), alert_token or "",
                                                 ctx.metrics, ctx.clock, watched), alert_port).start()
    registry = handlers.register(kopf.OperatorRegistry())
    # An explicit registry has no implicit login: kopf gets the credentials the operator's
    # client uses (in-cluster service account, else the kubeconfig).
    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return kubemod.connection_info(kubeconfig)

    try:
        await kopf.operator(
            registry=registry,
            settings=settings(verbose),
            standalone=standalone,
            peering_name=peering,
            liveness_endpoint=liveness or None,
            clusterwide=not namespaces,
            namespaces=namespaces or (),
            memo=kopf.Memo(ctx=ctx),
            ready_flag=ready_flag,
            stop_flag=stop_flag,
        )
    finally:
        if receiver is not None:
            receiver.stop()


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import sys

    import kopf

    from kiln.operator import alerts
    from kiln.runtime.api import enginekey

    config = config_from_args(args)
    try:
        for target in config.default_targets:
            enginekey.normalize_target(target)
    except ValueError as e:
        print(f"kiln operator: --default-target: {e}", file=sys.stderr)
        return 2

    kopf.configure(debug=args.verbose, verbose=args.verbose)
    logging.getLogger("kiln").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    token = None
    if args.alert_receiver_port:
        if not args.alert_token_file:
            print("kiln operator: --alert-token-file is required while --alert-receiver-port is set "
                  "(0 disables the receiver)", file=sys.stderr)
            return 2
        try:
            token = alerts.read_token(args.alert_token_file)
        except ValueError as e:
            print(f"kiln operator: {e}", file=sys.stderr)
            return 2
    if args.kubeconfig:  # read by kopf's login and by the kubernetes client alike
        os.environ["KUBECONFIG"] = args.kubeconfig
    asyncio.run(serve(config, namespaces=args.namespace or None, standalone=args.standalone,
                      peering=args.peering, liveness=args.liveness, kubeconfig=args.kubeconfig,
                      verbose=args.verbose, alert_port=args.alert_receiver_port, alert_token=token))
    return 0
