"""What the operator and the runtime agree on, in one place: both halves import it.

- The API's names (group, version, kind), and the labels and annotations Kiln sets.
- Where the engine cache and pvc:// sources are mounted in Kiln's pods.
- The build request the operator writes into a Job (`build_request`) and the result a
  build pod leaves in its termination message (`parse_result`); `kiln build` parses the
  one (`runtime.build.BuildRequest.from_dict`) and writes the other. The exit codes and
  their reasons are `runtime.errors.EXIT_REASONS`; spec defaults and validation are
  `runtime.spec`; the engine key is `runtime.enginekey`.

Pure Python, no imports beyond the standard library: the operator image loads it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

GROUP = "kiln.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceModel"
PLURAL = "inferencemodels"

# Labels and annotations Kiln sets (and selects on).
LABEL_KEY = "kiln.dev/key"  # build Jobs and their pods: the engine key
LABEL_TARGET = "kiln.dev/target"  # build Jobs: the normalized architecture
LABEL_MODEL = "kiln.dev/model"  # runtime Deployments, Services, pods: the InferenceModel's name
LABEL_ENGINE_KEY = "kiln.dev/engine-key"  # runtime pods: the key they serve
LABEL_TRACK = "kiln.dev/track"  # runtime pods: stable, or canary during a rollout
LABEL_ROLE = "kiln.dev/role"  # builder nodes: label and taint value `builder`
ANN_REQUESTED_BY = "kiln.dev/requested-by"  # build Jobs: the model that created it
ANN_GENERATION = "kiln.dev/generation"  # build Jobs: that model's generation
ANN_MODEL_VERSION = "kiln.dev/model-version"
ANN_APPLIED = "kiln.dev/applied"  # JSON of the manifest Kiln last applied (for 3-way patches)
ANN_APPLIED_HASH = "kiln.dev/applied-hash"  # its hash: unchanged hash, no write
# InferenceModels: `kiln rollout promote|abort` asks, the rollout step takes and removes it.
# Outside kopf's kiln.dev/ prefix, which its diffs leave out: setting it is an event.
ANN_ROLLOUT_ACTION = "rollout.kiln.dev/action"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kiln", "app.kubernetes.io/part-of": "kiln"}
# A model at zero replicas: the operator writes an EndpointSlice for its Service that points at
# the activator's pods (`kiln activator` holds the requests); the activator watches those
# slices, by this managed-by, to learn which models it holds for.
LABEL_SLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
LABEL_SLICE_SERVICE = "kubernetes.io/service-name"
ACTIVATOR_SLICE_MANAGER = "activator.kiln.dev"  # a label value: no "/"

ENGINE_INDEX = "kiln-engine-index"  # ConfigMap per namespace: "<key>.<target>" -> build result JSON

# Mount points inside Kiln's pods (the operator's manifests and the CLIs' defaults).
CACHE_DIR = "/var/cache/kiln"
PVC_ROOT = "/mnt/models"
TERMINATION_LOG = "/dev/termination-log"
SERVICE_PORT = 8080
# The runtime's gRPC endpoint (inference.GRPCInferenceService), beside the HTTP one; the
# Service's port `grpc` is the same number.
GRPC_PORT = 8081
# Shared memory one front-end worker process of a runtime pod uses at most (its requests'
# tensors, handed to the engine process without a copy); the pod mounts a memory-backed
# /dev/shm sized for its workers (as many as `auto` may start when the spec sets none),
# counted in the pod's memory as used.
FRONT_END_SHM_BYTES = 32 * 1024 * 1024
MAX_FRONT_END_WORKERS = 64
MAX_AUTO_FRONT_END_WORKERS = 16
# spec.runtime.engineProcesses: engine processes of a CPU model's pod, each with its own copy.
MAX_ENGINE_PROCESSES = 16
# `kiln serve --load-timeout-seconds`: how long an engine load may take before the model
# fails (not ready, with the reason); the operator sets it from the startup-probe budget.
LOAD_TIMEOUT_SECONDS = 600.0
# Stateful sequences (spec.runtime.sequences): the runtime pod's environment variable that
# holds the store's password, set by the operator from store.passwordSecretRef (valueFrom a
# Secret; never in the args), and the one that names the pod's namespace (part of the keys).
SEQUENCE_STORE_PASSWORD_ENV = "KILN_SEQUENCE_STORE_PASSWORD"
NAMESPACE_ENV = "KILN_NAMESPACE"
# The shared result cache (spec.runtime.resultCache.shared): its store's password, the same way.
RESULT_STORE_PASSWORD_ENV = "KILN_RESULT_STORE_PASSWORD"
# The NVIDIA container toolkit's variable naming the GPUs a container gets (the device plugin
# sets it in pods that ask for GPUs; the runtime exports only those). A runtime pod whose
# engines all run on the CPU gets `void`: no GPU and no driver, whatever its image says.
NVIDIA_VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
NO_GPU_DEVICES = "void"


def index_key(key: str, architecture: str) -> str:
    """The engine index's data key for one engine."""
    return f"{key}.{architecture}"


def build_request(namespace: str, name: str, model: Mapping[str, Any], engine: Mapping[str, Any], target: str,
                  key: str, key_inputs: Mapping[str, Any],
                  sequence_states: list[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON `kiln build --request` reads. `keyInputs` travel along so that a builder whose
    own inputs hash differently (another TensorRT version, say) can name the input that differs.
    `sequenceStates` (spec.runtime.sequences.states, when set) are checked against the built
    engine; they are not part of the key."""
    model_req = {"uri": model["uri"], "version": model.get("version", "")}
    if model.get("sha256"):
        model_req["sha256"] = model["sha256"]
    engine_req: dict[str, Any] = {"backend": engine.get("backend", "tensorrt"),
                                  "precision": engine.get("precision", "fp16"),
                                  "profiles": list(engine.get("profiles") or [])}
    if engine.get("workspaceMiB") is not None:
        engine_req["workspaceMiB"] = engine["workspaceMiB"]
    if engine.get("builderFlags"):
        engine_req["builderFlags"] = dict(engine["builderFlags"])
    request = {"namespace": namespace, "name": name, "model": model_req, "engine": engine_req, "target": target,
               "key": key, "keyInputs": dict(key_inputs)}
    if sequence_states:
        request["sequenceStates"] = [{"input": p["input"], "output": p["output"]} for p in sequence_states]
    return request


def parse_result(text: str | None) -> dict[str, Any] | None:
    """A build result from a termination message (or an engine-index value), else None.

    With `FallbackToLogsOnError` the message may be the tail of the log: the result is its
    last JSON line that has `ok`.
    """
    for line in reversed((text or "").strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if isinstance(result, dict) and "ok" in result:
                return result
    return None
