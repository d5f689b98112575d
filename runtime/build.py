"""Build one engine and publish it into the cache (what a build Job runs).

    kiln build --request '{"namespace": "ml", "name": "resnet", "model": {...},
                           "engine": {...}, "target": "sm90", "key": "..."}'

Computes the engine key from the model, engine settings, target and the backend version
this builder really has; refuses to build when the request names a different key; on a
cache hit reports the existing entry without building; otherwise fetches the ONNX
model, checks its pinned sha256, builds and publishes atomically; then loads the engine
once as a runtime pod would (`loadSeconds`). An existing entry that is corrupt (it fails
the cache's checks or does not load) is moved aside and the engine built again; what a
killed build of the same key left behind is removed first. Progress goes to stderr; the
result, as JSON under 4 KiB, to the termination log, where the operator reads it:
{"ok": true, "key", "target", "path", "sha256", "sizeBytes", "buildSeconds",
"loadSeconds", "cacheHit", "backend", "backendVersion"[, "quarantined": {"path",
"reason"}]} or {"ok": false, "reason", "message"}.

Exit codes (reason):
  0  built, or already in the cache
  1  BuildFailed: any other failure (for example the backend's builder refused)
  2  BadRequest: malformed request or flags, profiles that do not fit the model, a
     file:// or plain-path model URI (only `kiln dev` reads local files)
  3  SourceUnreachable: the model URI cannot be read (network, missing file, too big)
  4  DigestMismatch: the model's sha256 differs from model.sha256
  5  InvalidModel: not a valid ONNX model
  6  Unsupported: the backend, precision or target cannot work on this builder (or the
     runtime extra is not installed: the message names the missing module)
  7  OutOfDisk: no space left while downloading or publishing
  8  KeyMismatch: the request's key is not what this builder computes
"""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.runtime.errors import (BadRequest, BuildError, InvalidModel, KeyMismatch, OutOfDisk,
                                 Unsupported)

from kiln.runtime.contract import CACHE_DIR as DEFAULT_CACHE_DIR
from kiln.runtime.contract import PVC_ROOT as DEFAULT_PVC_ROOT
from kiln.runtime.contract import TERMINATION_LOG as DEFAULT_TERMINATION_LOG
TERMINATION_LOG_LIMIT = 4096  # Kubernetes keeps at most 4 KiB of a termination message
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")

Log = Callable[[str], None]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--request", metavar="JSON", help="the build request as JSON")
    source.add_argument("--request-file", metavar="PATH", help="a file holding the request JSON")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, metavar="DIR",
                        help=f"engine cache root (default {DEFAULT_CACHE_DIR})")
    parser.add_argument("--pvc-root", default=DEFAULT_PVC_ROOT, metavar="DIR",
                        help=f"where pvc://<claim>/ volumes are mounted (default {DEFAULT_PVC_ROOT})")
    parser.add_argument("--termination-log", default=None, metavar="PATH",
                        help=f"where to write the result JSON (default {DEFAULT_TERMINATION_LOG} "
                             f"when writable)")


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
        from kiln.runtime.enginekey import normalize_target

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
    manifest: Any  # cache.Manifest
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


def stderr_log(message: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    print(f"{now[:-4]}Z kiln build: {message}", file=sys.stderr, flush=True)


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
    from kiln.runtime.backends.base import BuildOptions, ShapeRange

    profiles = {p["input"]: ShapeRange(tuple(p["min"]), tuple(p["opt"]), tuple(p["max"]))
                for p in engine.get("profiles") or []}
    return BuildOptions(precision=engine["precision"], profiles=profiles,
                        workspace_mib=engine.get("workspaceMiB"),
                        builder_flags=dict(engine.get("builderFlags") or {}))


def _backend_error(e: Exception) -> BuildError:
    from kiln.runtime.backends import base

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
    from kiln.runtime import cache, enginekey, fetch
    from kiln.runtime.backends import base, get_backend

    # Checked before the cache lookup too: a refused source is refused on a cache hit as well.
    fetch.local_path(request.model["uri"], pvc_root, allow_local_files=allow_local_files)
    log = log or (lambda _m: None)
    started = clock()
    try:
        backend = get_backend(request.engine["backend"])
        version = backend.version()
    except base.BackendError as e:
        raise _backend_error(e) from None
    inputs = enginekey.key_inputs(request.model, request.engine, request.target, version)
    key, ours = inputs.key, inputs.to_dict()
    if request.key and request.key != key:
        raise KeyMismatch(_explain_key_mismatch(request, ours, key))
    rel = cache.relative_path(request.namespace, request.name, key)
    log(f"engine key {key} ({backend.name} {version}, {request.target}, "
        f"{request.engine['precision']})")

    entry = cache.entry_dir(cache_dir, request.namespace, request.name, key)
    quarantined = None
    try:
        existing = cache.lookup(cache_dir, request.namespace, request.name, key)
    except cache.CacheError as e:
        existing, quarantined = None, _quarantine(cache_dir, request, key, str(e), log)
    if existing is not None:
        log(f"cache hit: {rel} ({existing.size_bytes} bytes, built {existing.built_at})")
        try:
            load_seconds = _load_check(backend, entry, clock, log, request.sequence_states)
        except (base.BackendError, cache.CacheError) as e:
            quarantined = _quarantine(cache_dir, request, key,
                                      f"the cached engine does not load: {e}", log)
        else:
            return BuildResult(existing, rel, True, clock() - started, load_seconds)
    for debris in cache.remove_dead_temporaries(cache_dir, request.namespace, request.name, key):
        log(f"removed {debris.name}, left by a build of this key that did not finish")

    if backend.name == "tensorrt":
        from kiln.runtime.gpu import detect_target
        here = detect_target()
        if here != request.target:
            raise Unsupported(f"TensorRT engines are specific to the GPU architecture: this "
                              f"builder has {here}, the request is for {request.target}; "
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
        manifest = cache.publish(
            cache_dir, request.namespace, request.name, key, engine,
            engine_file=backend.engine_filename, inputs=ours, backend=backend.name,
            backend_version=version, target=request.target, build_seconds=build_seconds)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OutOfDisk(f"no space left on device: {e}") from None
        raise
    log(f"published {rel} ({manifest.size_bytes} bytes, sha256 {manifest.sha256})")
    try:
        load_seconds = _load_check(backend, entry, clock, log, request.sequence_states)
    except (base.BackendError, cache.CacheError) as e:
        # Left in place: the next build of the key finds it does not load and moves it aside.
        raise BuildError(f"the engine {backend.name} {version} just built and published as "
                         f"{rel} does not load back: {e}") from None
    return BuildResult(manifest, rel, False, clock() - started, load_seconds, quarantined)


def _quarantine(cache_dir, request: BuildRequest, key: str, reason: str,
                log: Log) -> dict[str, str] | None:
    from kiln.runtime import cache

    aside = cache.quarantine(cache_dir, request.namespace, request.name, key, reason)
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
    Raises cache.CacheError or the backend's BackendError."""
    from kiln.runtime import cache

    started = clock()
    # The one read that also recomputes the whole file's sha256: it proves, from the bytes
    # on the volume, that the manifest's chunk digests and whole digest describe one file
    # (pods check the chunk digests only).
    data, manifest, _ = cache.read_verified(entry, whole_digest=True)
    engine = backend.load(data, manifest.profiles())
    try:
        engine.create_context().close()
        if sequence_states:
            from kiln.runtime.sequences import check_pairs

            inputs = list(engine.inputs) + list(getattr(engine, "defaults", ()))
            problems = check_pairs(sequence_states, inputs, engine.outputs)
            if problems:
                raise BadRequest("; ".join(problems))
    finally:
        engine.close()
    seconds = clock() - started
    log(f"load check: the engine loads in {seconds:.2f} s")
    return seconds


def _termination_log(path: str | None) -> Path | None:
    if path:
        return Path(path)
    default = Path(DEFAULT_TERMINATION_LOG)
    return default if os.access(default, os.W_OK) else None


def result_json(result: dict[str, Any]) -> str:
    """The termination message, shortened to fit Kubernetes' 4 KiB."""
    text = json.dumps(result, separators=(",", ":"))
    while len(text.encode()) > TERMINATION_LOG_LIMIT and result.get("message"):
        message = result["message"]
        result = {**result, "message": message[: max(0, len(message) - 256)] + "…"}
        if len(result["message"]) <= 1:
            result["message"] = ""
        text = json.dumps(result, separators=(",", ":"))
    return text


def _write_result(path: Path | None, result: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        path.write_text(result_json(result))
    except OSError as e:
        stderr_log(f"cannot write the termination log {path}: {e}")


def _failed(term: Path | None, e: BuildError) -> int:
    stderr_log(f"failed ({e.reason}): {e}")
    _write_result(term, {"ok": False, "reason": e.reason, "message": str(e)})
    return e.exit_code


def run(args: argparse.Namespace) -> int:
    term = _termination_log(args.termination_log)
    try:
        try:
            text = (Path(args.request_file).read_text() if args.request_file
                    else args.request)
        except OSError as e:
            raise BadRequest(f"cannot read the request file: {e}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadRequest(f"the request is not valid JSON: {e}") from None
        request = BuildRequest.from_dict(raw)
        result = build_engine(request, args.cache_dir, pvc_root=args.pvc_root, log=stderr_log)
    except BuildError as e:
        return _failed(term, e)
    except Exception as e:  # anything unforeseen still leaves a readable reason for the Job
        from kiln.cli import missing_extra

        if missing_extra("build", e):  # e.g. no onnxruntime: the runtime extra is not installed
            return _failed(term, Unsupported(missing_extra("build", e)))
        stderr_log(f"failed: {type(e).__name__}: {e}")
        _write_result(term, {"ok": False, "reason": BuildError.reason,
                             "message": f"{type(e).__name__}: {e}"})
        return BuildError.exit_code
    payload = result.to_dict()
    _write_result(term, payload)
    print(json.dumps(payload), flush=True)
    return 0
