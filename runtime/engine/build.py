"""The build pipeline: compute the key, fetch and check the model, build, publish, load once.

`build_engine` is what `kiln build` (runtime/commands/build.py, a build Job) runs: the
engine key from the model, engine settings, target and the backend version this builder
really has; a cache hit reports the existing entry; otherwise the ONNX model is fetched,
its pinned sha256 checked, the engine built and published atomically, then loaded once as a
runtime pod would. A corrupt existing entry is moved aside and built again.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from kiln.runtime.api.errors import (BadRequest, BuildError, InvalidModel, KeyMismatch, OutOfDisk,
                                 Unsupported)

from kiln.runtime.api.contract import PVC_ROOT as DEFAULT_PVC_ROOT
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")

Log = Callable[[str], None]


@dataclass
class BuildRequest:
    namespace: str
    name: str
    model: dict[str, Any]
    engine: dict[str, Any]
    target: str
    key: str | None = None
    # Optional: the operator's own key inputs, so a mismatch can say which input differs.
    key_inputs: dict[str, Any] | None = None
    # Optional: spec.runtime.sequences.states, checked against the built engine's tensors
    # (not part of the key: a state pair is how the runtime drives the engine).
    sequence_states: list[tuple[str, str]] | None = None

    @classmethod
    def from_dict(cls, d: Any) -> "BuildRequest":
        """Validate a request; BadRequest says what is wrong."""
        from kiln.runtime.api.enginekey import normalize_target

        if not isinstance(d, dict):
            raise BadRequest("the request must be a JSON object")
        for field_name in ("namespace", "name"):
            value = d.get(field_name)
            if not isinstance(value, str) or not _NAME.match(value):
                raise BadRequest(f"request.{field_name} must be a Kubernetes name, got {value!r}")
        model = d.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("uri"), str) or not model["uri"]:
            raise BadRequest("request.model.uri is required (pvc://, https://, http://, s3://)")
        if model.get("sha256") is not None and not re.fullmatch(r"[0-9a-fA-F]{64}",
                                                                 str(model["sha256"])):
            raise BadRequest(f"request.model.sha256 must be 64 hex characters, "
                             f"got {model['sha256']!r}")
        engine = dict(d.get("engine") or {})
        engine.setdefault("backend", "tensorrt")
        engine.setdefault("precision", "fp16")
        if engine["precision"] not in PRECISIONS:
            raise BadRequest(f"request.engine.precision {engine['precision']!r}: use one of "
                             f"{', '.join(PRECISIONS)}")
        ws = engine.get("workspaceMiB")
        if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws < 16):
            raise BadRequest(f"request.engine.workspaceMiB must be an integer >= 16, got {ws!r}")
        if not isinstance(engine.get("builderFlags") or {}, dict):
            raise BadRequest("request.engine.builderFlags must be an object")
        profiles = engine.get("profiles") or []
        if not isinstance(profiles, list):
            raise BadRequest("request.engine.profiles must be a list")
        for i, p in enumerate(profiles):
            ok = isinstance(p, dict) and isinstance(p.get("input"), str) and all(
                isinstance(p.get(k), list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                   for v in p[k])
                for k in ("min", "opt", "max"))
            if not ok:
                raise BadRequest(f"request.engine.profiles[{i}] must be "
                                 f"{{input: name, min: [ints], opt: [ints], max: [ints]}}")
        target = d.get("target")
        if not isinstance(target, str):
            raise BadRequest("request.target is required (cpu, sm90, 9.0 or a GPU product)")
        try:
            target = normalize_target(target)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        key = d.get("key")
        if key is not None and not isinstance(key, str):
            raise BadRequest("request.key must be a string")
        key_inputs = d.get("keyInputs")
        if key_inputs is not None and not isinstance(key_inputs, dict):
            raise BadRequest("request.keyInputs must be an object")
        states = d.get("sequenceStates")
        if states is not None:
            if not isinstance(states, list) or not all(
                    isinstance(p, dict) and isinstance(p.get("input"), str)
                    and isinstance(p.get("output"), str) for p in states):
                raise BadRequest("request.sequenceStates must be a list of {input, output}")
            states = [(p["input"], p["output"]) for p in states]
        return cls(namespace=d["namespace"], name=d["name"], model=dict(model), engine=engine,
                   target=target, key=key, key_inputs=key_inputs, sequence_states=states)


@dataclass
class BuildResult:
    manifest: Any  # cache.entry.Manifest
    path: str  # relative to the cache root: <namespace>/<model>/<key>
    cache_hit: bool
    seconds: float
    load_seconds: float  # read + verify + deserialize, as a runtime pod will do it
    # The corrupt entry this build moved aside, {"path": relative to the cache root,
    # "reason"}: the operator posts it as a Warning Event.
    quarantined: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        d = {"ok": True, "key": m.key, "target": m.target, "path": self.path,
             "sha256": m.sha256, "sizeBytes": m.size_bytes, "buildSeconds": m.build_seconds,
             "loadSeconds": round(self.load_seconds, 3), "cacheHit": self.cache_hit,
             "backend": m.backend, "backendVersion": m.backend_version}
        if self.quarantined:
            d["quarantined"] = dict(self.quarantined)
        return d


def _explain_key_mismatch(request: BuildRequest, ours: dict[str, Any], key: str) -> str:
    head = f"the request's engine key {request.key} is not {key}, the key this builder computes"
    if request.key_inputs:
        diffs = [f"{name}: requested {request.key_inputs.get(name)!r}, builder has {value!r}"
                 for name, value in ours.items() if request.key_inputs.get(name) != value]
        diffs += [f"{name}: requested {value!r}, builder has none"
                  for name, value in request.key_inputs.items() if name not in ours]
        if diffs:
            return f"{head}; inputs that differ: " + "; ".join(diffs)
    return (f"{head} from backend {ours['backend']} {ours['backendVersion']}, target "
            f"{ours['target']}, precision {ours['precision']}, model {ours['model']}; the usual "
            f"cause is a builder image whose backend version differs from the operator's "
            f"configuration")


def _options(engine: dict[str, Any]):
    from kiln.runtime.engine.backends.base import BuildOptions, ShapeRange

    profiles = {p["input"]: ShapeRange(tuple(p["min"]), tuple(p["opt"]), tuple(p["max"]))
                for p in engine.get("profiles") or []}
    return BuildOptions(precision=engine["precision"], profiles=profiles,
                        workspace_mib=engine.get("workspaceMiB"),
                        builder_flags=dict(engine.get("builderFlags") or {}))


def _backend_error(e: Exception) -> BuildError:
    from kiln.runtime.engine.backends import base

    if isinstance(e, base.InvalidProfileError):
        return BadRequest(str(e))
    if isinstance(e, base.InvalidModelError):
        return InvalidModel(str(e))
    if isinstance(e, base.UnsupportedError):
        return Unsupported(str(e))
    return BuildError(str(e))


def build_engine(request: BuildRequest, cache_dir: str | os.PathLike, *,
                 pvc_root: str | os.PathLike = DEFAULT_PVC_ROOT, log: Log | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 allow_local_files: bool = False) -> BuildResult:
    """Build (or find) the engine a request describes. Raises runtime.errors.BuildError.

    `allow_local_files`: read file:// URIs and plain paths (only `kiln dev` sets it; a build
    Job must not read its node's disk)."""
    from kiln.runtime.engine import fetch
    from kiln.runtime.engine.cache.entry import CacheError, entry_dir, relative_path
    from kiln.runtime.engine.cache.gclock import LockTimeout, use_entry
    from kiln.runtime.engine.cache.publish import publish, remove_dead_temporaries
    from kiln.runtime.api import enginekey
    from kiln.runtime.engine.backends import base, get_backend

    # Checked before the cache lookup too: a refused source is refused on a cache hit as well.
    fetch.local_path(request.model["uri"], pvc_root, allow_local_files=allow_local_files)
    log = log or (lambda _m: None)
    started = clock()
    try:
        backend = get_backend(request.engine["backend"], request.target)
        # A GPU target's onnxruntime needs the CUDA provider: refused here, before the cache,
        # where it has none (an engine built so earlier must not be handed out either).
        version = backend.version()
    except base.BackendError as e:
        raise _backend_error(e) from None
    inputs = enginekey.key_inputs(request.model, request.engine, request.target, version)
    key, ours = inputs.key, inputs.to_dict()
    if request.key and request.key != key:
        raise KeyMismatch(_explain_key_mismatch(request, ours, key))
    rel = relative_path(request.namespace, request.name, key)
    log(f"engine key {key} ({backend.name} {version}, {request.target}, "
        f"{request.engine['precision']})")

    entry = entry_dir(cache_dir, request.namespace, request.name, key)
    quarantined = None
    try:
        # Touched under the GC lock: a garbage collection decided before now leaves it.
        existing = use_entry(cache_dir, request.namespace, request.name, key)
    except LockTimeout as e:
        raise BuildError(str(e)) from None
    except CacheError as e:
        existing, quarantined = None, _quarantine(cache_dir, request, key, str(e), log)
    if existing is not None:
        log(f"cache hit: {rel} ({existing.size_bytes} bytes, built {existing.built_at})")
        try:
            load_seconds = _load_check(backend, entry, clock, log, request.sequence_states)
        except (base.BackendError, CacheError) as e:
            quarantined = _quarantine(cache_dir, request, key,
                                      f"the cached engine does not load: {e}", log)
        else:
            return BuildResult(existing, rel, True, clock() - started, load_seconds)
    for debris in remove_dead_temporaries(cache_dir, request.namespace, request.name, key):
        log(f"removed {debris.name}, left by a build of this key that did not finish")

    if backend.uses_gpu:
        from kiln.runtime.engine.gpu import detect_target
        here = detect_target()
        if here != request.target:
            raise Unsupported(f"{backend.name} GPU engines are specific to the GPU architecture: "
                              f"this builder has {here}, the request is for {request.target}; "
                              f"schedule the build Job on a {request.target} node")

    try:
        with tempfile.TemporaryDirectory(prefix="kiln-build-") as workdir:
            log(f"fetching {request.model['uri']}")
            fetched = fetch.fetch_model(request.model["uri"], workdir,
                                        sha256=request.model.get("sha256"), pvc_root=pvc_root,
                                        log=log, allow_local_files=allow_local_files)
            onnx_model = fetched.read_bytes()
        log(f"building with {backend.name} {version}")
        build_started = clock()
        try:
            engine = backend.build(onnx_model, _options(request.engine))
        except base.BackendError as e:
            raise _backend_error(e) from None
        build_seconds = clock() - build_started
        log(f"built in {build_seconds:.2f} s ({len(engine)} bytes)")
        manifest = publish(
            cache_dir, request.namespace, request.name, key, engine,
            engine_file=backend.engine_filename, inputs=ours, backend=backend.name,
            backend_version=version, target=request.target, build_seconds=build_seconds)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OutOfDisk(f"no space left on device: {e}") from None
        raise
    except LockTimeout as e:  # publish found the key published meanwhile: a cache hit
        raise BuildError(str(e)) from None
    log(f"published {rel} ({manifest.size_bytes} bytes, sha256 {manifest.sha256})")
    try:
        load_seconds = _load_check(backend, entry, clock, log, request.sequence_states)
    except (base.BackendError, CacheError) as e:
        # Left in place: the next build of the key finds it does not load and moves it aside.
        raise BuildError(f"the engine {backend.name} {version} just built and published as "
                         f"{rel} does not load back: {e}") from None
    return BuildResult(manifest, rel, False, clock() - started, load_seconds, quarantined)


def _quarantine(cache_dir, request: BuildRequest, key: str, reason: str,
                log: Log) -> dict[str, str] | None:
    from kiln.runtime.engine.cache.publish import quarantine

    aside = quarantine(cache_dir, request.namespace, request.name, key, reason)
    if aside is None:  # another builder moved it first
        log(f"the corrupt entry for {key} was already moved aside ({reason}); building it")
        return None
    rel = "/".join((request.namespace, request.name, aside.name))
    log(f"moved the corrupt entry aside to {rel}: {reason}; building it again")
    return {"path": rel, "reason": reason[:1000]}


def _load_check(backend, entry, clock: Callable[[], float], log: Log,
                sequence_states: list[tuple[str, str]] | None = None) -> float:
    """Load the published engine once, as a runtime pod will (read, verify, deserialize,
    one execution context). An engine that does not load fails the build here, not in
    every pod; the time is what the operator sizes the pods' startup probe from.
    `sequence_states` (spec.runtime.sequences.states) must fit the engine's tensors, else
    BadRequest naming both tensors (the engine stays published: a spec fix is a cache hit).
    Raises cache.entry.CacheError or the backend's BackendError."""
    from kiln.runtime.engine.cache.verify import read_verified

    started = clock()
    # The one read that also recomputes the whole file's sha256: it proves, from the bytes
    # on the volume, that the manifest's chunk digests and whole digest describe one file
    # (pods check the chunk digests only).
    data, manifest, _ = read_verified(entry, whole_digest=True)
    engine = backend.load(data, manifest.profiles())
    try:
        engine.create_context().close()
        if sequence_states:
            from kiln.runtime.engine.states import check_pairs

            inputs = list(engine.inputs) + list(getattr(engine, "defaults", ()))
            problems = check_pairs(sequence_states, inputs, engine.outputs)
            if problems:
                raise BadRequest("; ".join(problems))
    finally:
        engine.close()
    seconds = clock() - started
    log(f"load check: the engine loads in {seconds:.2f} s")
    return seconds
