"""Pure builders: an InferenceModel's (defaulted) spec in, Kubernetes manifests and status out.

Nothing here talks to the API or reads the clock except through an argument, so every
function is tested without a cluster (tests/operator/test_builders.py).

- `plan_engines`: the engines the spec needs, one per distinct target architecture, with
  their keys (`kiln.runtime.enginekey`).
- `build_job`: the build Job for one engine (`kiln build --request ...`).
- `runtime_deployment`, `runtime_service`: the serving workload (`kiln serve ...`).
- `job_state`, `termination_result`: what a finished build Job and its pod say.
- `compute_status`: phase, conditions, engines, replicas from what was observed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Iterable, Mapping

from kiln.operator import conditions as cond
from kiln.operator.config import OperatorConfig
from kiln.runtime import enginekey

GROUP, VERSION, KIND = "kiln.dev", "v1alpha1", "InferenceModel"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels and annotations Kiln sets (and selects on).
LABEL_KEY = "kiln.dev/key"
LABEL_TARGET = "kiln.dev/target"
LABEL_MODEL = "kiln.dev/model"
LABEL_ENGINE_KEY = "kiln.dev/engine-key"
LABEL_TRACK = "kiln.dev/track"
LABEL_ROLE = "kiln.dev/role"
ANN_REQUESTED_BY = "kiln.dev/requested-by"
ANN_GENERATION = "kiln.dev/generation"
ANN_APPLIED = "kiln.dev/applied"  # JSON of the manifest Kiln last applied (for 3-way patches)
ANN_APPLIED_HASH = "kiln.dev/applied-hash"  # its hash: unchanged hash, no write
MANAGED_BY = {"app.kubernetes.io/managed-by": "kiln", "app.kubernetes.io/part-of": "kiln"}

ENGINE_INDEX = "kiln-engine-index"  # ConfigMap per namespace: "<key>.<target>" -> build result JSON
CACHE_DIR = "/var/cache/kiln"
PVC_ROOT = "/mnt/models"
RUNTIME_PORT_NAME = "http"
SERVICE_PORT = 8080
GPU = "nvidia.com/gpu"
NON_ROOT_UID = 65532  # the images' USER (Dockerfile)

# `kiln build` exit codes (the runtime's contract) -> a reason a person can act on.
EXIT_REASONS = {
    1: "BuildError", 2: "BadRequest", 3: "SourceUnreachable", 4: "DigestMismatch",
    5: "InvalidModel", 6: "Unsupported", 7: "OutOfDisk", 8: "KeyMismatch",
}


# ------------------------------------------------------------------------ engines

@dataclasses.dataclass(frozen=True)
class EngineRef:
    """One engine an InferenceModel needs."""

    key: str
    target: str  # as written in spec.engine.targets (or the default)
    architecture: str  # normalized: sm90, cpu
    backend: str
    backend_version: str

    @property
    def job_name(self) -> str:
        return job_name(self.key, self.architecture)

    @property
    def index_key(self) -> str:
        return f"{self.key}.{self.architecture}"


def job_name(key: str, architecture: str) -> str:
    """Deterministic from key and target: every model asking for the engine finds one Job."""
    return f"kiln-build-{key}-{architecture}"


def targets_of(spec: Mapping[str, Any], config: OperatorConfig) -> list[str]:
    engine = spec.get("engine") or {}
    targets = list(engine.get("targets") or ())
    if targets:
        return targets
    if engine.get("backend", "tensorrt") == "onnxruntime":
        return [enginekey.CPU_TARGET]
    return list(config.default_targets)


def plan_engines(spec: Mapping[str, Any], config: OperatorConfig) -> list[EngineRef]:
    """One EngineRef per distinct architecture, in the order of spec.engine.targets.

    Raises ValueError for a target or backend the operator cannot build for.
    """
    engine = spec.get("engine") or {}
    backend = engine.get("backend", "tensorrt")
    version = config.backend_version(backend)
    refs: list[EngineRef] = []
    seen: set[str] = set()
    for target in targets_of(spec, config):
        arch = enginekey.normalize_target(target)
        if arch in seen:
            continue
        if backend == "tensorrt" and arch == enginekey.CPU_TARGET:
            raise ValueError("backend tensorrt cannot build for target 'cpu': use backend onnxruntime")
        seen.add(arch)
        key = enginekey.key_inputs(spec["model"], engine, arch, version).key
        refs.append(EngineRef(key=key, target=target, architecture=arch, backend=backend, backend_version=version))
    return refs


# ------------------------------------------------------------------------ shared pieces

def owner_reference(model: Mapping[str, Any], controller: bool = True) -> dict[str, Any]:
    meta = model["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": controller, "blockOwnerDeletion": True}


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def with_applied(manifest: dict[str, Any]) -> dict[str, Any]:
    """Record the manifest (and its hash) in its own annotations, kubectl-apply style."""
    applied = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    out = json.loads(applied)
    ann = out["metadata"].setdefault("annotations", {})
    ann[ANN_APPLIED] = applied
    ann[ANN_APPLIED_HASH] = manifest_hash(manifest)
    return out


def merge_patch_between(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new` (None deletes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for k in old.keys() - new.keys():
        patch[k] = None
    for k, v in new.items():
        if k not in old:
            patch[k] = v
        elif old[k] != v:
            patch[k] = merge_patch_between(old[k], v) if isinstance(v, dict) and isinstance(old[k], dict) else v
    return patch


def _security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID, "fsGroup": NON_ROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _resources(section: Mapping[str, Any], backend: str) -> dict[str, Any]:
    given = section.get("resources")
    if given:
        return json.loads(json.dumps(given))
    if backend == "tensorrt":
        return {"limits": {GPU: 1}}
    return {"requests": {"cpu": "1", "memory": "2Gi"}}


def pvc_source(uri: str) -> tuple[str, str] | None:
    """`pvc://<claim>/<path>` -> (claim, path)."""
    if not uri.startswith("pvc://"):
        return None
    claim, _, path = uri[len("pvc://"):].partition("/")
    return claim, path


# ------------------------------------------------------------------------ build Job

def build_request(model: Mapping[str, Any], spec: Mapping[str, Any], engine: EngineRef) -> dict[str, Any]:
    m, e = spec["model"], spec.get("engine") or {}
    model_req = {"uri": m["uri"], "version": m.get("version", "")}
    if m.get("sha256"):
        model_req["sha256"] = m["sha256"]
    engine_req: dict[str, Any] = {"backend": engine.backend, "precision": e.get("precision", "fp16"),
                                  "profiles": list(e.get("profiles") or [])}
    if e.get("workspaceMiB") is not None:
        engine_req["workspaceMiB"] = e["workspaceMiB"]
    if e.get("builderFlags"):
        engine_req["builderFlags"] = dict(e["builderFlags"])
    # keyInputs: so that a builder whose own inputs hash differently (a TensorRT version
    # other than the operator's configuration, say) can name the input that differs.
    key_inputs = enginekey.key_inputs(m, e, engine.architecture, engine.backend_version).to_dict()
    return {"namespace": model["metadata"]["namespace"], "name": model["metadata"]["name"], "model": model_req,
            "engine": engine_req, "target": engine.architecture, "key": engine.key, "keyInputs": key_inputs}


def build_job(model: Mapping[str, Any], spec: Mapping[str, Any], engine: EngineRef,
              config: OperatorConfig) -> dict[str, Any]:
    meta = model["metadata"]
    build = spec.get("build") or {}
    cache = (spec.get("cache") or {}).get("claimName") or config.cache_claim
    labels = {LABEL_KEY: engine.key, LABEL_TARGET: engine.architecture,
              "app.kubernetes.io/name": "kiln-builder", "app.kubernetes.io/component": "engine-build", **MANAGED_BY}
    request = json.dumps(build_request(model, spec, engine), sort_keys=True, separators=(",", ":"))
    volumes: list[dict[str, Any]] = [
        {"name": "cache", "persistentVolumeClaim": {"claimName": cache}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    source = pvc_source(spec["model"]["uri"])
    if source is not None:
        volumes.append({"name": "model-source", "persistentVolumeClaim": {"claimName": source[0], "readOnly": True}})
        mounts.append({"name": "model-source", "mountPath": f"{PVC_ROOT}/{source[0]}", "readOnly": True})
    tolerations = build.get("tolerations")
    if tolerations is None:
        tolerations = [{"key": LABEL_ROLE, "operator": "Equal", "value": "builder", "effect": "NoSchedule"}]
    node_selector = build.get("nodeSelector")
    if node_selector is None:
        node_selector = {LABEL_ROLE: "builder"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": engine.job_name,
            "namespace": meta["namespace"],
            "labels": dict(labels),
            "annotations": {ANN_REQUESTED_BY: meta["name"], ANN_GENERATION: str(meta.get("generation", 1)),
                            "kiln.dev/model-version": str(spec["model"].get("version", ""))},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "backoffLimit": int(build.get("backoffLimit", 1)),
            "activeDeadlineSeconds": int(build.get("timeoutSeconds", 3600)),
            "ttlSecondsAfterFinished": int(build.get("ttlSecondsAfterFinished", 86400)),
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": dict(node_selector),
                    "tolerations": list(tolerations),
                    "securityContext": _pod_security_context(),
                    "containers": [{
                        "name": "build",
                        "image": build.get("image") or config.builder_image,
                        "command": ["kiln"],
                        "args": ["build", "--request", request, "--cache-dir", CACHE_DIR, "--pvc-root", PVC_ROOT],
                        "resources": _resources(build, engine.backend),
                        "securityContext": _security_context(),
                        "volumeMounts": mounts,
                        "terminationMessagePath": "/dev/termination-log",
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                    }],
                    "volumes": volumes,
                },
            },
        },
    }


# ------------------------------------------------------------------------ what a Job says

@dataclasses.dataclass(frozen=True)
class JobState:
    phase: str  # Active | Succeeded | Failed
    reason: str = ""
    message: str = ""


def job_state(job: Mapping[str, Any]) -> JobState:
    status = job.get("status") or {}
    for c in status.get("conditions") or ():
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return JobState("Succeeded")
        if c.get("type") == "Failed":
            return JobState("Failed", c.get("reason") or "BackoffLimitExceeded", c.get("message") or "")
    if status.get("succeeded"):
        return JobState("Succeeded")
    return JobState("Active")


def termination_state(pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest terminated `build` container state among a Job's pods."""
    best = None
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and (best is None or (term.get("finishedAt") or "") >= (best.get("finishedAt") or "")):
                best = term
    return best


def termination_result(pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The build result JSON from the pod's termination message, or None if none is readable."""
    term = termination_state(pods)
    if not term or not term.get("message"):
        return None
    text = term["message"].strip()
    # FallbackToLogsOnError: the message may be the tail of the log; the result is its last JSON line.
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if isinstance(result, dict) and "ok" in result:
                return result
    return None


def failure_message(state: JobState, pods: Iterable[Mapping[str, Any]]) -> tuple[str, str]:
    """(reason, message) for a failed build: the Job's condition and what the pod said."""
    pods = list(pods)
    result = termination_result(pods)
    term = termination_state(pods)
    parts = []
    reason = "BuildFailed"
    if result and not result.get("ok"):
        detail = result.get("reason") or ""
        parts.append(f"{detail}: {result.get('message', '')}".strip(": "))
    elif term is not None:
        code = term.get("exitCode")
        parts.append(f"exit code {code} ({EXIT_REASONS.get(int(code or 0)) or term.get('reason') or 'Error'})"
                     + (f": {term['message'].strip()[-500:]}" if term.get("message") else ""))
    job_part = state.reason + (f": {state.message}" if state.message else "")
    if job_part:
        parts.append(f"Job {job_part}")
    return reason, "; ".join(p for p in parts if p) or "the build Job failed"


# ------------------------------------------------------------------------ runtime

def runtime_name(model_name: str) -> str:
    return f"{model_name}-runtime"


def selector_labels(model_name: str) -> dict[str, str]:
    return {LABEL_MODEL: model_name, LABEL_TRACK: "stable"}


def startup_budget(results: Iterable[Mapping[str, Any]], config: OperatorConfig) -> int:
    """Seconds the startup probe allows: 3x the measured load time (at least 60 s) when an
    engine's result records one, else the configured generous default."""
    loads = [float(r["loadSeconds"]) for r in results if r and r.get("loadSeconds") is not None]
    if not loads:
        return config.startup_budget_seconds
    return max(60, int(math.ceil(3 * max(loads))))


def desired_replicas(spec: Mapping[str, Any]) -> int:
    runtime = spec.get("runtime") or {}
    replicas = int(runtime.get("replicas", 1))
    auto = spec.get("autoscaling") or {}
    if auto.get("enabled"):
        lo, hi = int(auto.get("minReplicas", 1)), int(auto.get("maxReplicas", 4))
        replicas = min(max(replicas, lo), hi)
    return replicas


def runtime_deployment(model: Mapping[str, Any], spec: Mapping[str, Any], engines: list[EngineRef],
                       results: Mapping[str, Mapping[str, Any]], config: OperatorConfig,
                       include_replicas: bool = True) -> dict[str, Any]:
    """The runtime Deployment serving `engines` (every one present in `results`).

    `include_replicas=False` leaves `spec.replicas` out, for a patch while an autoscaler
    owns the replica count (`autoscaling.enabled`).
    """
    meta = model["metadata"]
    name = meta["name"]
    runtime = spec.get("runtime") or {}
    port = int(runtime.get("port", SERVICE_PORT))
    cache = (spec.get("cache") or {}).get("claimName") or config.cache_claim
    version = str(spec["model"].get("version", ""))
    first = engines[0]
    labels = {**selector_labels(name), LABEL_ENGINE_KEY: first.key, "app.kubernetes.io/name": "kiln-runtime",
              "app.kubernetes.io/instance": name, "app.kubernetes.io/component": "runtime",
              "app.kubernetes.io/version": version[:63], **MANAGED_BY}
    engine_args: list[str] = []
    for e in engines:
        path = (results.get(e.index_key) or {}).get("path") or f"{meta['namespace']}/{name}/{e.key}"
        engine_args += ["--engine", f"{e.architecture}={path}"]
    # Replicas are not the server's business: leaving them out keeps a scale change from
    # changing the pod template (which would roll every pod).
    serve_spec = {k: v for k, v in runtime.items() if k != "replicas"}
    budget = startup_budget([results.get(e.index_key) or {} for e in engines], config)
    period = 2
    ready_path = f"/v2/models/{name}/ready"
    container = {
        "name": "runtime",
        "image": runtime.get("image") or config.runtime_image,
        "command": ["kiln"],
        "args": ["serve", "--model-name", name, "--model-version", version, "--cache-dir", CACHE_DIR,
                 *engine_args, "--runtime-spec", json.dumps(serve_spec, sort_keys=True, separators=(",", ":")),
                 "--port", str(port)],
        "ports": [{"name": RUNTIME_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "startupProbe": {"httpGet": {"path": ready_path, "port": RUNTIME_PORT_NAME}, "periodSeconds": period,
                         "timeoutSeconds": 2, "failureThreshold": int(math.ceil(budget / period))},
        "readinessProbe": {"httpGet": {"path": ready_path, "port": RUNTIME_PORT_NAME}, "periodSeconds": 5,
                           "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": RUNTIME_PORT_NAME}, "periodSeconds": 10,
                          "timeoutSeconds": 2, "failureThreshold": 3},
        "resources": _resources(runtime, first.backend),
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_spec: dict[str, Any] = {
        "securityContext": _pod_security_context(),
        "containers": [container],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": cache, "readOnly": True}},
                    {"name": "tmp", "emptyDir": {}}],
        "terminationGracePeriodSeconds": 30,
    }
    for field in ("nodeSelector", "tolerations", "affinity"):
        if runtime.get(field):
            pod_spec[field] = runtime[field]
    dep_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "revisionHistoryLimit": 5,
        "template": {
            "metadata": {"labels": labels,
                         "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                         "prometheus.io/path": "/metrics", LABEL_ENGINE_KEY: first.key}},
            "spec": pod_spec,
        },
    }
    if include_replicas:
        dep_spec = {"replicas": desired_replicas(spec), **dep_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": runtime_name(name), "namespace": meta["namespace"],
                     "labels": {k: v for k, v in labels.items() if k != LABEL_TRACK},
                     "ownerReferences": [owner_reference(model)]},
        "spec": dep_spec,
    }


def runtime_service(model: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    meta = model["metadata"]
    name = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": meta["namespace"],
                     "labels": {LABEL_MODEL: name, "app.kubernetes.io/name": "kiln-runtime",
                                "app.kubernetes.io/instance": name, **MANAGED_BY},
                     "ownerReferences": [owner_reference(model)]},
        "spec": {"type": "ClusterIP", "selector": {LABEL_MODEL: name},
                 "ports": [{"name": RUNTIME_PORT_NAME, "port": SERVICE_PORT, "targetPort": RUNTIME_PORT_NAME,
                            "protocol": "TCP"}]},
    }


def engine_index_configmap(namespace: str, data: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": ENGINE_INDEX, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "kiln-engine-index", **MANAGED_BY}},
            "data": dict(data)}


# ------------------------------------------------------------------------ status

@dataclasses.dataclass
class EngineObservation:
    engine: EngineRef
    state: str  # Ready | Building | Pending | Failed
    result: Mapping[str, Any] | None = None
    reason: str = ""
    message: str = ""


@dataclasses.dataclass
class DeploymentObservation:
    exists: bool = False
    engine_key: str = ""  # the key its pod template runs
    current: bool = False  # its template equals what the current engines need
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    desired: int = 0
    rolled_out: bool = False  # the controller saw the latest generation and every pod is updated


def observe_deployment(dep: Mapping[str, Any] | None, desired_hash: str | None) -> DeploymentObservation:
    if not dep:
        return DeploymentObservation()
    meta, spec, status = dep.get("metadata") or {}, dep.get("spec") or {}, dep.get("status") or {}
    desired = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    replicas = int(status.get("replicas") or 0)
    seen = int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    return DeploymentObservation(
        exists=True, engine_key=labels.get(LABEL_ENGINE_KEY, ""),
        current=desired_hash is not None and (meta.get("annotations") or {}).get(ANN_APPLIED_HASH) == desired_hash,
        replicas=replicas, ready=ready, updated=updated, desired=desired,
        rolled_out=seen and updated >= desired and replicas <= desired)


def status_engines(observed: list[EngineObservation], version: str) -> list[dict[str, Any]]:
    out = []
    for o in observed:
        entry: dict[str, Any] = {"key": o.engine.key, "target": o.engine.target,
                                 "architecture": o.engine.architecture, "version": version}
        r = o.result or {}
        for src, dst in (("path", "path"), ("sha256", "sha256"), ("sizeBytes", "sizeBytes"),
                         ("buildSeconds", "buildSeconds"), ("cacheHit", "cacheHit")):
            if r.get(src) is not None:
                entry[dst] = r[src]
        out.append(entry)
    return out


def compute_status(model: Mapping[str, Any], spec: Mapping[str, Any], engines: list[EngineObservation],
                   deployment: DeploymentObservation, clock: cond.Clock = cond.utcnow,
                   invalid: str | None = None) -> dict[str, Any]:
    """The whole status from what was observed. Conditions keep their transition times."""
    meta = model["metadata"]
    previous = (model.get("status") or {})
    generation = int(meta.get("generation") or 1)
    conds = list(previous.get("conditions") or [])
    name = meta["name"]
    version = str(spec.get("model", {}).get("version", ""))
    status: dict[str, Any] = {"observedGeneration": generation}

    def setc(type_: str, value: bool | str, reason: str, message: str) -> None:
        nonlocal conds
        conds = cond.set_condition(conds, type_, value, reason, message, generation, clock)

    if invalid is not None:
        setc("EngineReady", False, "InvalidSpec", invalid)
        setc("Progressing", False, "InvalidSpec", "the spec cannot work; change it to proceed")
        serving = deployment.exists and deployment.ready > 0
        setc("Available", serving, "MinimumReplicasAvailable" if serving else "NoEngine",
             f"{deployment.ready} ready replica(s) of the previous version" if serving else "nothing is serving")
        setc("Degraded", True, "InvalidSpec", invalid)
        status.update(phase="Failed", conditions=conds, engines=list(previous.get("engines") or []),
                      replicas=deployment.replicas, readyReplicas=deployment.ready,
                      selector=f"{LABEL_MODEL}={name}")
        for k in ("engineKey", "stable"):
            if previous.get(k) is not None:
                status[k] = previous[k]
        return status

    failed = [o for o in engines if o.state == "Failed"]
    missing = [o for o in engines if o.state != "Ready"]
    if failed:
        setc("EngineReady", False, "BuildFailed", "; ".join(
            f"engine {o.engine.key} for {o.engine.architecture} (Job {o.engine.job_name}): {o.message}" for o in failed))
    elif missing:
        setc("EngineReady", False, "Building", "building " + ", ".join(
            f"engine {o.engine.key} for {o.engine.architecture} (Job {o.engine.job_name})" for o in missing))
    else:
        hits = sum(1 for o in engines if (o.result or {}).get("cacheHit"))
        setc("EngineReady", True, "EnginesReady",
             f"{len(engines)} engine(s) in the cache ({hits} cache hit(s)): "
             + ", ".join(f"{o.engine.architecture}={o.engine.key}" for o in engines))

    current_key = engines[0].engine.key if engines else ""
    serving = deployment.exists and deployment.ready > 0
    on_current = deployment.exists and deployment.current
    if serving:
        setc("Available", True, "MinimumReplicasAvailable",
             f"{deployment.ready}/{deployment.desired} replica(s) ready, engine {deployment.engine_key}")
    elif deployment.exists:
        setc("Available", False, "NoReadyReplicas" if deployment.desired else "ScaledToZero",
             f"0/{deployment.desired} replica(s) ready")
    else:
        setc("Available", False, "NoEngine" if missing else "Deploying",
             "waiting for the engines to be built" if missing else "creating the runtime Deployment")

    rolling = on_current and not deployment.rolled_out
    if missing and not failed:
        setc("Progressing", True, "Building", f"building the engines for version {version}")
    elif failed:
        setc("Progressing", False, "BuildFailed", "a build failed; change the spec to retry")
    elif not on_current or rolling:
        setc("Progressing", True, "RollingOut", f"rolling out engine {current_key} for version {version}")
    else:
        setc("Progressing", False, "RolloutComplete", f"engine {current_key} for version {version} is rolled out")

    degraded_reason = ""
    if failed and serving:
        degraded_reason, degraded_msg = "BuildFailed", f"serving engine {deployment.engine_key}; the new engines failed to build"
    elif on_current and deployment.rolled_out and deployment.ready < deployment.desired:
        degraded_reason, degraded_msg = "ReplicasUnavailable", f"{deployment.ready}/{deployment.desired} replica(s) ready"
    if degraded_reason:
        setc("Degraded", True, degraded_reason, degraded_msg)
    else:
        setc("Degraded", False, "AsExpected", "serving as the spec asks" if serving else "nothing is degraded")

    if failed and not serving:
        phase = "Failed"
    elif degraded_reason:
        phase = "Degraded"
    elif missing:
        phase = "Building"
    elif not on_current or rolling or (deployment.desired > 0 and deployment.ready == 0):
        phase = "Deploying"
    else:
        phase = "Ready"

    status.update(phase=phase, conditions=conds, engines=status_engines(engines, version),
                  replicas=deployment.replicas, readyReplicas=deployment.ready, selector=f"{LABEL_MODEL}={name}")
    stable_key = current_key if on_current else (deployment.engine_key or "")
    if stable_key:
        status["engineKey"] = stable_key
        stable_version = version if on_current else str((previous.get("stable") or {}).get("version", ""))
        status["stable"] = {"version": stable_version, "engineKey": stable_key, "weight": 100,
                            "replicas": deployment.replicas, "readyReplicas": deployment.ready}
    elif current_key:
        status["engineKey"] = current_key
    return status
