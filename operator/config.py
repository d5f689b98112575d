"""The operator's configuration: what is not in an InferenceModel's spec.

Filled from `kiln operator` flags (see `kiln.operator.main`); the builders and the
reconciler only read it. Frozen, so a test can build one and share it.
"""

from __future__ import annotations

import dataclasses

# onnxruntime-cuda: ONNX Runtime's CUDA build, for onnxruntime engines of a GPU target (its
# version names CUDA's too: runtime/engine/backends/onnxruntime.py).
DEFAULT_BACKEND_VERSIONS = {"tensorrt": "10.13.0", "onnxruntime": "1.32.0",
                            "onnxruntime-cuda": "1.31.1+cuda13.0"}
DEFAULT_BUILDER_IMAGE = "ghcr.io/kiln-dev/kiln-runtime:0.1.0"
DEFAULT_RUNTIME_IMAGE = "ghcr.io/kiln-dev/kiln-runtime:0.1.0"
DEFAULT_CACHE_CLAIM = "kiln-engine-cache"


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    backend_versions: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_BACKEND_VERSIONS))
    default_targets: tuple[str, ...] = ("sm90",)  # tensorrt; onnxruntime always defaults to ("cpu",)
    builder_image: str = DEFAULT_BUILDER_IMAGE
    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    cache_claim: str = DEFAULT_CACHE_CLAIM
    resync_seconds: float = 300.0  # the timer: a level-triggered safety net, not the main path
    retry_seconds: float = 5.0  # TemporaryError delay while waiting on something we cannot watch
    startup_budget_seconds: int = 600  # startup probe budget when no load time was measured
    operator_name: str = "kiln-operator"
    # A firing alert not heard of again within this long is not trusted (hold): longer than
    # Alertmanager's repeat_interval for Kiln's route (docs/operations.md).
    signal_ttl_seconds: float = 600.0
    # Canary analysis queries this Prometheus (its HTTP API); None: only the spec's own checks,
    # which then cannot run, so such a rollout waits.
    prometheus_url: str | None = None
    # Engine-cache garbage collection (cachegc.py): a pass per namespace this often (0: off);
    # per model and target the newest `retention` entries no version needs stay for a rollback;
    # an entry goes once nothing has needed it for `grace`; a dry run only says what would go.
    cache_gc_interval_seconds: float = 3600.0
    cache_gc_retention: int = 1
    cache_gc_grace_seconds: float = 86400.0
    # How long the GC Job waits after making a model directory's lock file (an NFS client's
    # cached negative lookup); None: `kiln cache-gc`'s own default (gclock.LOCK_SETTLE_SECONDS).
    cache_gc_lock_settle_seconds: float | None = None
    cache_gc_dry_run: bool = False
    cache_gc_job_timeout_seconds: int = 1800
    # The activator's Service, "namespace/name" (`kiln activator`, installed by the chart): a
    # model with minReplicas 0 goes to zero only with one, its Service then pointing there.
    activator_service: str | None = None
    # The chart's autoscaling.rules.containerConcurrency: above 0 its rules scale every model
    # on requests in flight per pod over it; status.scaling.signal says which signal a model has.
    container_concurrency: float = 0.0

    def backend_version(self, backend: str, architecture: str = "cpu") -> str:
        """The version of `backend` that builds for `architecture`."""
        if backend == "onnxruntime" and architecture != "cpu":
            backend = "onnxruntime-cuda"
        try:
            return self.backend_versions[backend]
        except KeyError:
            raise ValueError(f"no version configured for backend {backend!r} "
                             f"(known: {', '.join(sorted(self.backend_versions))}); "
                             f"start the operator with --backend-version {backend}=<version>") from None
