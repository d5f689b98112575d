"""What the operator writes, built from an InferenceModel's (defaulted) spec: the build Job,
the runtime Deployment and Service, the engine index ConfigMap, the JSON Patch that weighs
an HTTPRoute's or GRPCRoute's backends, and the kubectl-apply bookkeeping they carry.

Nothing here talks to the API or reads the clock except through an argument, so every
function is tested without a cluster (tests/operator/test_builders.py). What the operator
reads back from these objects is observations.py's; which engines a spec needs, plan.py's.

- `build_job`: the build Job for one engine (`kiln build --request ...`).
- `runtime_deployment`, `runtime_service`: the serving workload (`kiln serve ...`).
- `disruption_budget`: the model's PodDisruptionBudget (a node drain takes one pod at a time).
- `route_weights_patch`: the JSON Patch that sets backend weights on a Gateway API HTTPRoute or GRPCRoute.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import urllib.parse
from typing import Any, Iterable, Mapping

from kiln.operator.config import OperatorConfig
from kiln.operator.plan import EngineRef
from kiln.runtime.api import contract, enginekey
from kiln.runtime.api.contract import (ANN_APPLIED, ANN_APPLIED_HASH, ANN_GENERATION, ANN_MODEL_VERSION,
                                       ANN_REQUESTED_BY, API_VERSION, CACHE_DIR, ENGINE_INDEX, FRONT_END_SHM_BYTES,
                                       GRPC_PORT, KIND, LABEL_ENGINE_KEY, LABEL_KEY, LABEL_MODEL, LABEL_ROLE,
                                       LABEL_TARGET, LABEL_TRACK, MANAGED_BY, MAX_AUTO_FRONT_END_WORKERS, PVC_ROOT,
                                       SERVICE_PORT)

RUNTIME_PORT_NAME = "http"
GRPC_PORT_NAME = "grpc"
GPU = "nvidia.com/gpu"
NON_ROOT_UID = 65532  # the images' USER (Dockerfile)


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


def samples_path(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    """(claim, path in the runtime pod) of spec.runtime.warmup.samplesFile: beside the ONNX
    file on the model's claim, mounted read-only at <PVC_ROOT>/<claim>, as a build pod mounts
    it. None without one (the CRD allows samplesFile only with a pvc:// or file:// URI, and
    validate_for_cluster refuses file:// in a cluster)."""
    name = (((spec.get("runtime") or {}).get("warmup")) or {}).get("samplesFile")
    source = pvc_source(spec["model"]["uri"])
    if not name or source is None:
        return None
    directory = posixpath.dirname(urllib.parse.unquote(source[1]))
    return source[0], posixpath.join(PVC_ROOT, source[0], directory, name)


# ------------------------------------------------------------------------ build Job

def build_request(model: Mapping[str, Any], spec: Mapping[str, Any], engine: EngineRef) -> dict[str, Any]:
    m, e = spec["model"], spec.get("engine") or {}
    key_inputs = enginekey.key_inputs(m, e, engine.architecture, engine.backend_version).to_dict()
    states = ((spec.get("runtime") or {}).get("sequences") or {}).get("states")
    return contract.build_request(model["metadata"]["namespace"], model["metadata"]["name"], m,
                                  {**e, "backend": engine.backend}, engine.architecture, engine.key, key_inputs,
                                  states)


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
                            ANN_MODEL_VERSION: str(spec["model"].get("version", ""))},
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
                        "terminationMessagePath": contract.TERMINATION_LOG,
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                    }],
                    "volumes": volumes,
                },
            },
        },
    }


# ------------------------------------------------------------------------ runtime

STABLE, CANARY = "stable", "canary"


def runtime_name(model_name: str, track: str = STABLE) -> str:
    """The Deployment of a track: `<model>-runtime` (stable), `<model>-canary` during a rollout."""
    return f"{model_name}-runtime" if track == STABLE else f"{model_name}-canary"


def service_name(model_name: str, track: str = STABLE) -> str:
    """The Service of a track: `<model>`, and `<model>-canary` beside it with the Gateway API.
    The longest DNS-1035 label made from a model's name: the CRD's metadata.name rule keeps
    it within 63 characters."""
    return model_name if track == STABLE else f"{model_name}-canary"


SHADOW_DIR, SHADOW_FILE = "/etc/kiln/shadow", "shadow.json"
# A runtime pod's end: it serves on for PRE_STOP_SECONDS after its deletion (endpoints
# propagate), then SIGTERM: in-flight requests finish within `kiln serve`'s drain (30 s).
PRE_STOP_SECONDS, DRAIN_SECONDS = 5, 30


def shadow_config_name(model_name: str) -> str:
    """The ConfigMap the stable pods read their shadow copies' config from (runtime/serving/shadow.py)."""
    return f"{model_name}-shadow"


def shadow_config(model: Mapping[str, Any], text: str) -> dict[str, Any]:
    meta = model["metadata"]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": shadow_config_name(meta["name"]), "namespace": meta["namespace"],
                         "labels": {LABEL_MODEL: meta["name"], **MANAGED_BY},
                         "ownerReferences": [owner_reference(model)]},
            "data": {SHADOW_FILE: text}}


def shadow_settings(model_name: str, spec: Mapping[str, Any], canary_key: str, targets: Iterable[str]) -> str:
    """The shadow config file's text (runtime/serving/shadow.py reads it), from a defaulted spec."""
    shadow, agreement = spec["rollout"]["shadow"], spec["rollout"]["analysis"]["agreement"]
    # With the agreement check off (null) the runtime compares with its own tolerances: counted, not judged.
    compare = {k: agreement[k] for k in ("classOutputs", "absoluteTolerance", "relativeTolerance")
               if agreement and k in agreement}
    return json.dumps({"model": model_name, "canaryEngineKey": canary_key, "targets": sorted(targets),
                       "percent": shadow["percent"], "maxRequestsPerSecond": shadow["maxRequestsPerSecond"],
                       "timeoutSeconds": shadow["timeoutSeconds"], **compare}, sort_keys=True)


def selector_labels(model_name: str, track: str = STABLE) -> dict[str, str]:
    return {LABEL_MODEL: model_name, LABEL_TRACK: track}


def startup_budget(results: Iterable[Mapping[str, Any]], config: OperatorConfig) -> int:
    """Seconds the startup probe allows: 3x the measured load time (at least 60 s) when an
    engine's result records one, else the configured generous default."""
    loads = [float(r["loadSeconds"]) for r in results if r and r.get("loadSeconds") is not None]
    if not loads:
        return config.startup_budget_seconds
    return max(60, int(math.ceil(3 * max(loads))))


def load_timeout(budget: int) -> int:
    """`kiln serve --load-timeout-seconds` for a startup budget: the load's own deadline
    fires a little before the probe gives up, so a hung read ends as a not-ready model that
    says why (in readiness and the log) just before the kubelet restarts the pod."""
    return max(1, budget - 10)


def desired_replicas(spec: Mapping[str, Any]) -> int:
    runtime = spec.get("runtime") or {}
    replicas = int(runtime.get("replicas", 1))
    auto = spec.get("autoscaling") or {}
    if auto.get("enabled"):
        lo, hi = int(auto.get("minReplicas", 1)), int(auto.get("maxReplicas", 4))
        replicas = min(max(replicas, lo), hi)
    return replicas


def _shm_limit(runtime: Mapping[str, Any]) -> str:
    workers = int(runtime.get("frontendWorkers") or MAX_AUTO_FRONT_END_WORKERS)
    return f"{workers * FRONT_END_SHM_BYTES // 2**20}Mi"


def runtime_deployment(model: Mapping[str, Any], spec: Mapping[str, Any], engines: list[EngineRef],
                       results: Mapping[str, Mapping[str, Any]], config: OperatorConfig,
                       include_replicas: bool = True, track: str = STABLE) -> dict[str, Any]:
    """The runtime Deployment of `track` serving `engines` (every one present in `results`).

    `include_replicas=False` leaves `spec.replicas` out, for a patch while an autoscaler
    owns the replica count (`autoscaling.enabled`).
    """
    meta = model["metadata"]
    name = meta["name"]
    runtime = spec.get("runtime") or {}
    port = int(runtime.get("port", SERVICE_PORT))
    grpc_port = runtime_grpc_port(port)
    cache = (spec.get("cache") or {}).get("claimName") or config.cache_claim
    version = str(spec["model"].get("version", ""))
    first = engines[0]
    labels = {**selector_labels(name, track), LABEL_ENGINE_KEY: first.key, "app.kubernetes.io/name": "kiln-runtime",
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
                 *engine_args, "--cache-claim", cache,
                 "--runtime-spec", json.dumps(serve_spec, sort_keys=True, separators=(",", ":")),
                 "--load-timeout-seconds", str(load_timeout(budget)), "--port", str(port),
                 "--grpc-port", str(grpc_port)],
        "ports": [{"name": RUNTIME_PORT_NAME, "containerPort": port, "protocol": "TCP"},
                  {"name": GRPC_PORT_NAME, "containerPort": grpc_port, "protocol": "TCP"}],
        "startupProbe": {"httpGet": {"path": ready_path, "port": RUNTIME_PORT_NAME}, "periodSeconds": period,
                         "timeoutSeconds": 2, "failureThreshold": int(math.ceil(budget / period))},
        "readinessProbe": {"httpGet": {"path": ready_path, "port": RUNTIME_PORT_NAME}, "periodSeconds": 5,
                           "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": RUNTIME_PORT_NAME}, "periodSeconds": 10,
                          "timeoutSeconds": 2, "failureThreshold": 3},
        "resources": _resources(runtime, first.backend),
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "shm", "mountPath": "/dev/shm"}],
        # A pod being deleted leaves the Service's endpoints while it still serves: kube-proxy,
        # gateways and clients see the change a moment later, and their requests still land.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        # Why a pod will never be Ready (samples that fail: `WarmupFailed: ...`), for the operator.
        "terminationMessagePath": contract.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if track == STABLE:  # the stable pods copy to a canary while the rollout shadows (rollout.shadow)
        container["args"] += ["--shadow-config", f"{SHADOW_DIR}/{SHADOW_FILE}"]
        container["volumeMounts"].append({"name": "shadow", "mountPath": SHADOW_DIR, "readOnly": True})
    samples = samples_path(spec)
    if samples is not None:
        container["args"] += ["--samples-file", samples[1]]
        container["volumeMounts"].append({"name": "model-source", "mountPath": f"{PVC_ROOT}/{samples[0]}",
                                          "readOnly": True})
    env = _unique_names(sequence_env(runtime) + result_cache_env(runtime)) + device_env(engines)
    if env:
        container["env"] = env
    pod_spec: dict[str, Any] = {
        "securityContext": _pod_security_context(),
        "containers": [container],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": cache, "readOnly": True}},
                    {"name": "tmp", "emptyDir": {}},
                    # The front-end workers' tensors (frontend.py); a container's own /dev/shm
                    # is 64 MiB. Memory-backed: counted in the pod's memory as it is used.
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": _shm_limit(runtime)}}],
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS + DRAIN_SECONDS,
    }
    if track == STABLE:  # optional: it exists only while a rollout shadows; its updates reach the file
        pod_spec["volumes"].append({"name": "shadow", "configMap": {"name": shadow_config_name(name), "optional": True}})
    if samples is not None:
        pod_spec["volumes"].append({"name": "model-source",
                                    "persistentVolumeClaim": {"claimName": samples[0], "readOnly": True}})
    for field in ("nodeSelector", "tolerations", "affinity"):
        if runtime.get(field):
            pod_spec[field] = runtime[field]
    dep_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name, track)},
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
        "metadata": {"name": runtime_name(name, track), "namespace": meta["namespace"],
                     "labels": {k: v for k, v in labels.items() if k != LABEL_TRACK},
                     "ownerReferences": [owner_reference(model)]},
        "spec": dep_spec,
    }


def sequence_env(runtime: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The runtime container's environment for stateful sequences (spec.runtime.sequences):
    the pod's namespace (part of every store key, so two namespaces can share one Redis) and
    the store's password from its Secret. Nothing for a stateless model, so its pod template
    is unchanged. The password is never in the args: `--runtime-spec` carries only the
    Secret's name and key."""
    sequences = runtime.get("sequences")
    if not sequences:
        return []
    env: list[dict[str, Any]] = [{"name": contract.NAMESPACE_ENV,
                                  "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    ref = (sequences.get("store") or {}).get("passwordSecretRef")
    if ref:
        env.append({"name": contract.SEQUENCE_STORE_PASSWORD_ENV,
                    "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}})
    return env


def result_cache_env(runtime: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The runtime container's environment for a shared result cache (resultCache.shared):
    the pod's namespace (part of every key) and the store's password from its Secret, never
    in the args. Nothing without a shared level, so other pod templates are unchanged."""
    cache = runtime.get("resultCache") or {}
    shared = cache.get("shared")
    if not (cache.get("enabled") and shared):
        return []
    env: list[dict[str, Any]] = [{"name": contract.NAMESPACE_ENV,
                                  "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    ref = shared.get("passwordSecretRef")
    if ref:
        env.append({"name": contract.RESULT_STORE_PASSWORD_ENV,
                    "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}})
    return env


def _unique_names(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first of each name (sequences and the result cache both want the namespace)."""
    seen: set[str] = set()
    return [e for e in env if not (e["name"] in seen or seen.add(e["name"]))]


def device_env(engines: list[EngineRef]) -> list[dict[str, Any]]:
    """`NVIDIA_VISIBLE_DEVICES=void` when every engine runs on the CPU. The runtime image
    (NVIDIA's TensorRT image) says `all`, and under the container toolkit's defaults that
    hands a pod that asked for no GPU every GPU of its node; `void` gives it no GPU and no
    driver (`none` would still mount the driver). Nothing for a GPU model: the device plugin
    sets the variable to what it allocated."""
    if all(e.architecture == enginekey.CPU_TARGET for e in engines):
        return [{"name": contract.NVIDIA_VISIBLE_DEVICES_ENV, "value": contract.NO_GPU_DEVICES}]
    return []


def runtime_grpc_port(port: int) -> int:
    """The runtime container's gRPC port: GRPC_PORT, unless spec.runtime.port took it."""
    return GRPC_PORT if port != GRPC_PORT else GRPC_PORT + 1


def gateway_api(spec: Mapping[str, Any]) -> bool:
    """Traffic split by an HTTPRoute's weights (else by replica ratio behind one Service)."""
    return ((spec.get("rollout") or {}).get("traffic") or {}).get("mechanism") == "GatewayAPI"


def runtime_service(model: Mapping[str, Any], spec: Mapping[str, Any], track: str = STABLE,
                    both_tracks: bool = False) -> dict[str, Any]:
    """The model's Service `<model>`: the stable track's pods, and the canary's too while it
    takes a weighted step by replica ratio (`both_tracks`: not in a shadow step, where it has
    no client traffic); with the Gateway API `<model>-canary` beside it for the canary's pods
    (the HTTPRoute weighs the two)."""
    meta = model["metadata"]
    name = meta["name"]
    both = both_tracks and not gateway_api(spec)
    selector = {LABEL_MODEL: name, **({} if both else {LABEL_TRACK: track})}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(name, track), "namespace": meta["namespace"],
                     "labels": {LABEL_MODEL: name, "app.kubernetes.io/name": "kiln-runtime",
                                "app.kubernetes.io/instance": name, **MANAGED_BY},
                     "ownerReferences": [owner_reference(model)]},
        "spec": {"type": "ClusterIP", "selector": selector,
                 "ports": [{"name": RUNTIME_PORT_NAME, "port": SERVICE_PORT, "targetPort": RUNTIME_PORT_NAME,
                            "protocol": "TCP"},
                           # The v2 gRPC endpoint (inference.GRPCInferenceService), HTTP/2 in clear.
                           {"name": GRPC_PORT_NAME, "port": GRPC_PORT, "targetPort": GRPC_PORT_NAME,
                            "protocol": "TCP", "appProtocol": "grpc"}]},
    }


def disruption_budget(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model's PodDisruptionBudget `<model>`: an eviction (a node drain) takes at most one
    of its runtime pods, of both tracks, at a time. `maxUnavailable: 1`, not `minAvailable`:
    a model of one replica (or none) can still be drained off a node, where `minAvailable: 1`
    would hold the drain forever. A PDB governs evictions only; the ReplicaSet controller
    deletes pods itself on a scale-down, so the budget never holds one, to zero neither.
    An unhealthy pod may always be evicted: a pod that does not serve protects nothing."""
    meta = model["metadata"]
    name = meta["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": meta["namespace"],
                     "labels": {LABEL_MODEL: name, "app.kubernetes.io/name": "kiln-runtime",
                                "app.kubernetes.io/instance": name, **MANAGED_BY},
                     "ownerReferences": [owner_reference(model)]},
        "spec": {"maxUnavailable": 1,
                 "selector": {"matchLabels": {LABEL_MODEL: name, "app.kubernetes.io/component": "runtime"}},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def engine_index_configmap(namespace: str, data: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": ENGINE_INDEX, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": ENGINE_INDEX, **MANAGED_BY}},
            "data": dict(data)}


# ------------------------------------------------------------------------ traffic

def route_weights_patch(route: Mapping[str, Any], weights: Mapping[str, int]) -> list[dict[str, Any]]:
    """The JSON Patch (RFC 6902) that sets the weight of every backendRef named in `weights`, in
    every rule of `route` (an HTTPRoute or a GRPCRoute as read from the API: their rules'
    backendRefs are alike).

    Each write is preceded by a `test` of that backendRef's name, so a route whose refs moved
    since it was read fails the whole patch (422) rather than weighting the wrong backend.
    The weights themselves are checked by the Gateway API's CRD (0 to 1000000).
    Raises ValueError naming the route when a backend in `weights` is in none of its rules.
    """
    patch: list[dict[str, Any]] = []
    found: set[str] = set()
    for i, rule in enumerate((route.get("spec") or {}).get("rules") or ()):
        for j, ref in enumerate(rule.get("backendRefs") or ()):
            name = ref.get("name")
            if name not in weights:
                continue
            found.add(name)
            at = f"/spec/rules/{i}/backendRefs/{j}"
            # `replace` needs the member: the CRD defaults it (1) on a route read from the API; `add` if absent.
            patch += [{"op": "test", "path": f"{at}/name", "value": name},
                      {"op": "replace" if "weight" in ref else "add", "path": f"{at}/weight", "value": weights[name]}]
    missing = sorted(set(weights) - found)
    if missing:
        meta = route.get("metadata") or {}
        raise ValueError(f"{route.get('kind', 'HTTPRoute')} {meta.get('namespace')}/{meta.get('name')} has no backendRef "
                         f"named {', '.join(missing)}")
    return patch


# ------------------------------------------------------------------------ cache garbage collection

GC_PLAN_DIR = "/etc/kiln/cache-gc"


ANN_GC_PLAN = "kiln.dev/cache-gc-plan"  # on a GC Job: the ConfigMap that holds its plan


def cache_gc_plan_name(job_name: str, decided_at: str) -> str:
    """A plan ConfigMap per pass (named by its time): a new Job of the same name never
    reads the plan of an earlier one the garbage collector has not removed yet."""
    return f"{job_name}-{decided_at}"


def cache_gc_job(namespace: str, claim: str, name: str, plan_name: str, config: OperatorConfig) -> dict[str, Any]:
    """The Job that executes a cache GC plan on one claim (`kiln cache-gc`, read-write mount).

    It runs where builds run (they mount the claim read-write too), reads its plan from the
    ConfigMap `plan_name` (created first, then owned by the Job), and is bounded: a GC that hangs on a dead
    volume fails by its deadline and the next pass tries again."""
    labels = {"app.kubernetes.io/name": "kiln-cache-gc", "app.kubernetes.io/component": "cache-gc", **MANAGED_BY}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                     "annotations": {"kiln.dev/cache-claim": claim, ANN_GC_PLAN: plan_name}},
        "spec": {
            "backoffLimit": 0,  # the next pass is the retry
            "activeDeadlineSeconds": int(config.cache_gc_job_timeout_seconds),
            "ttlSecondsAfterFinished": 86400,  # if no operator reads it
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {LABEL_ROLE: "builder"},
                    "tolerations": [{"key": LABEL_ROLE, "operator": "Equal", "value": "builder",
                                     "effect": "NoSchedule"}],
                    "securityContext": _pod_security_context(),
                    "containers": [{
                        "name": "cache-gc",
                        "image": config.builder_image,
                        "command": ["kiln"],
                        "args": ["cache-gc", "--plan", f"{GC_PLAN_DIR}/plan.json", "--cache-dir", CACHE_DIR,
                                 *([] if config.cache_gc_lock_settle_seconds is None else
                                   ["--lock-settle-seconds", f"{config.cache_gc_lock_settle_seconds:g}"])],
                        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                                      "limits": {"memory": "1Gi"}},
                        "securityContext": _security_context(),
                        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR},
                                         {"name": "plan", "mountPath": GC_PLAN_DIR, "readOnly": True},
                                         {"name": "tmp", "mountPath": "/tmp"}],
                        "terminationMessagePath": contract.TERMINATION_LOG,
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                    }],
                    "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": claim}},
                                {"name": "plan", "configMap": {"name": plan_name}},
                                {"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def cache_gc_plan(namespace: str, name: str, plan: Mapping[str, Any], report: Mapping[str, Any]) -> dict[str, Any]:
    """A GC Job's plan (what `kiln cache-gc` reads) and the operator's report of it (what it
    tells once the Job finished). The operator then makes the Job its owner, so it goes with it."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": "kiln-cache-gc", **MANAGED_BY}},
        "data": {"plan.json": json.dumps(dict(plan), sort_keys=True, separators=(",", ":")),
                 "report.json": json.dumps(dict(report), sort_keys=True, separators=(",", ":"))},
    }


def owned_by_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that makes `job` an object's owner (it is removed with the Job)."""
    meta = job["metadata"]
    return {"metadata": {"ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                              "uid": meta.get("uid"), "blockOwnerDeletion": False}]}}
