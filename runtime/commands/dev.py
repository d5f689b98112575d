"""Build and serve an InferenceModel manifest on this machine, no cluster needed.

Validates the manifest as the API server would (every error printed, exit 2), builds the
engine into a local cache (a second run reuses it), then serves it through the same
server code as a runtime pod, on 127.0.0.1 by default. The onnxruntime backend runs on
the CPU; a tensorrt manifest needs an NVIDIA GPU here.

A relative `file:` URI in spec.model.uri (`file://./model.onnx`, `file:model.onnx`) is
resolved against the manifest's directory; `kiln dev` is the one command that reads file:
URIs (a build Job refuses them).

Exit codes: 0 stopped by Ctrl-C; 1 the build or the server failed; 2 the manifest cannot be
read (not a regular file, over manifest.MAX_MANIFEST_BYTES, not YAML, duplicate keys,
aliases expanding past manifest.MAX_YAML_NODES nodes or manifest.MAX_YAML_DEPTH levels) or
is invalid, or a tensorrt manifest on a machine without a GPU; 2 also when the runtime extra
is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_CACHE_DIR = ".kiln/cache"
DEFAULT_PORT = 8080
DEFAULT_GRPC_PORT = 8081
_INLINE_ELEMENTS = 64  # larger example requests go to a file instead of the command line


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="an InferenceModel manifest (YAML)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port to listen on; 0 picks a free one (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="(default %(default)s)")
    from kiln.runtime.commands.serve import add_grpc_flags

    add_grpc_flags(parser, DEFAULT_GRPC_PORT)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                        help="the local engine cache (default %(default)s)")
    parser.add_argument("--drain-seconds", type=float, default=5.0,
                        help="how long Ctrl-C waits for in-flight requests (default %(default)s)")
    parser.add_argument("--verbose", "-v", action="store_true", help="log what the server does")


def resolve_model_uri(uri: str, base_dir: str | os.PathLike) -> str:
    """A relative `file:` URI -> `file:///absolute/path`, relative to `base_dir`.

    `file:///abs` stays as it is; other schemes too.
    """
    if not uri.startswith("file:") or uri.startswith("file:///"):
        return uri
    rest = uri[len("file:"):]
    rest = rest[2:] if rest.startswith("//") else rest
    if not rest:
        raise ValueError(f"{uri}: a file URI needs a path")
    path = Path(rest) if rest.startswith("/") else Path(base_dir) / rest
    return path.resolve().as_uri()


def example_request(inputs, profiles) -> dict[str, Any]:
    """A one-row request with the model's real input names, datatypes and shapes."""
    from kiln.runtime.serving.loading import warmup_inputs

    sample = warmup_inputs(inputs, profiles, max_batch=1)
    return {"inputs": [{"name": s.name, "shape": list(sample[s.name].shape),
                        "datatype": s.datatype, "data": sample[s.name].reshape(-1).tolist()}
                       for s in inputs]}


def _print(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def _fail(message: str, code: int) -> int:
    print(f"kiln dev: {message}", file=sys.stderr, flush=True)
    return code


def run(args: argparse.Namespace) -> int:
    import logging

    from kiln.runtime.api import manifest, spec
    from kiln.runtime.serving.process import configure_logging

    configure_logging("INFO" if args.verbose else "WARNING")
    if not args.verbose:
        logging.getLogger("kiln").setLevel(logging.WARNING)

    from kiln.runtime.commands.serve import grpc_port

    try:
        args.grpc_port = grpc_port(args, DEFAULT_GRPC_PORT)
    except ValueError as e:
        return _fail(str(e), 2)
    path = Path(args.file)
    try:
        obj = manifest.load_manifest(path)
    except manifest.ManifestError as e:
        return _fail(str(e), 2)
    model_spec = obj.get("spec", {}).get("model") if isinstance(obj.get("spec"), dict) else None
    if isinstance(model_spec, dict) and isinstance(model_spec.get("uri"), str):
        try:
            model_spec["uri"] = resolve_model_uri(model_spec["uri"], path.resolve().parent)
        except ValueError as e:
            return _fail(f"{path}: spec.model.uri: {e}", 2)
    errors = spec.validate(obj)
    if errors:
        lines = [f"{path}: the InferenceModel is invalid ({len(errors)} error"
                 f"{'s' if len(errors) > 1 else ''}):", *(f"  - {e}" for e in errors)]
        print("\n".join(lines), file=sys.stderr, flush=True)
        return 2
    obj = spec.apply_defaults(obj)
    name = obj["metadata"]["name"]  # validate() checked it
    namespace = obj["metadata"].get("namespace") or "default"
    body = obj["spec"]
    backend = body["engine"]["backend"]

    if backend == "tensorrt":
        from kiln.runtime.engine.gpu import detect_target
        target = detect_target()
        if target == "cpu":
            return _fail(f"{path}: engine.backend is tensorrt, which needs an NVIDIA GPU, and "
                         f"this machine has none. To run the model on the CPU here, set "
                         f"`engine.backend: onnxruntime` (and `engine.targets: [cpu]`).", 2)
    else:
        target = "cpu"

    from kiln.runtime.engine.build import BuildRequest, build_engine
    from kiln.runtime.api.errors import BuildError

    cache_dir = Path(args.cache_dir)
    try:
        states = ((body.get("runtime") or {}).get("sequences") or {}).get("states")
        request = BuildRequest.from_dict({"namespace": namespace, "name": name,
                                          "model": body["model"], "engine": body["engine"],
                                          "target": target, "sequenceStates": states})
        result = build_engine(request, cache_dir, allow_local_files=True)
    except BuildError as e:
        return _fail(f"build failed ({e.reason}): {e}", 1)
    key = result.manifest.key
    if result.quarantined:  # the person running this should learn their cache was bad
        aside = cache_dir / result.quarantined["path"]
        _print(f"the cached engine {key} was corrupt ({result.quarantined['reason']}); "
               f"moved it aside to {aside} and built it again")
    if result.cache_hit:
        _print(f"cache hit: engine {key} for {target} is already in {result.path}")
    else:
        _print(f"built engine {key} for {target} in {result.seconds:.2f}s -> {result.path}")

    return _serve(args, name, namespace, str(body["model"]["version"]), target, key,
                  body.get("runtime") or {}, cache_dir, samples_file(body))


def samples_file(body: dict) -> str | None:
    """spec.runtime.warmup.samplesFile beside the model's file (a file: URI, resolved), else None."""
    from kiln.runtime.engine.fetch import local_path

    name = ((body.get("runtime") or {}).get("warmup") or {}).get("samplesFile")
    uri = body["model"]["uri"]
    if not name or not uri.startswith("file:"):
        return None
    return str(local_path(uri, allow_local_files=True).parent / name)


def _serve(args, name: str, namespace: str, version: str, target: str, key: str,
           runtime: dict, cache_dir: Path, samples: str | None = None) -> int:
    import asyncio

    from kiln.runtime.commands.serve import watch_engine_cache
    from kiln.runtime.engine.cache.entry import relative_path
    from kiln.runtime.serving.metrics import ServerMetrics
    from kiln.runtime.serving.model import ServedModel
    from kiln.runtime.serving.process import run_event_loop, run_until_stopped
    from kiln.runtime.serving.servers import InferenceServer

    failed: list[str] = []

    async def main() -> None:
        metrics = ServerMetrics()
        watch_engine_cache(metrics, str(cache_dir), "", namespace)  # no claim: a local directory
        model = ServedModel(name, version, cache_dir,
                            {target: relative_path(namespace, name, key)}, runtime, metrics,
                            target=target, samples_file=samples)
        # local_only: a page in the user's browser must not be able to drive it.
        server = InferenceServer([model], metrics, local_only=True)
        stop = asyncio.Event()

        async def announce(url: str) -> None:
            if not await server.wait_loaded():
                failed.append(model.status_message())
                stop.set()
                return
            _print(*usage(url, model, cache_dir, server.grpc_address))

        # gRPC on the same host (a browser page cannot speak it: local_only is HTTP's).
        await run_until_stopped(server, args.host, args.port, args.drain_seconds,
                                on_started=announce, stop=stop, grpc_port=args.grpc_port)

    try:
        run_event_loop(main())
    except OSError as e:  # the port is taken, the address is not this host's
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}", 1)
    if failed:
        return _fail(failed[0], 1)
    _print("kiln dev: stopped")
    return 0


def usage(url: str, model, cache_dir: Path, grpc_address: str | None = None) -> list[str]:
    """What to print once the model is ready: the URL (and gRPC address) and requests to
    try."""
    base = f"{url}/v2/models/{model.name}"
    doc = example_request(model.inputs, model.profiles)
    elements = sum(len(i["data"]) for i in doc["inputs"])
    if elements <= _INLINE_ELEMENTS:
        data = "'" + json.dumps(doc, separators=(",", ":")) + "'"
    else:
        file = cache_dir.parent / f"{model.name}.request.json"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(doc))
        data = f"@{file}"
    inputs = ", ".join(f"{s.name} {s.datatype}{list(s.shape)}" for s in model.inputs)
    outputs = ", ".join(f"{s.name} {s.datatype}{list(s.shape)}" for s in model.outputs)
    return [
        f"serving {model.name} (version {model.version}) at {url}",
        f"  inputs:  {inputs}",
        f"  outputs: {outputs}",
        "try:",
        f"  curl -s {base}",
        f"  curl -s -X POST {base}/infer -H 'Content-Type: application/json' -d {data}",
        f"  curl -s {url}/metrics",
        *([f"gRPC (inference.GRPCInferenceService, as tritonclient.grpc speaks it) at "
           f"{grpc_address}"] if grpc_address else []),
        "press Ctrl-C to stop",
    ]
