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
import json
from pathlib import Path

from kiln.runtime.api.contract import CACHE_DIR as DEFAULT_CACHE_DIR
from kiln.runtime.api.contract import PVC_ROOT as DEFAULT_PVC_ROOT
from kiln.runtime.api.contract import TERMINATION_LOG as DEFAULT_TERMINATION_LOG
from kiln.runtime.api.errors import BadRequest, BuildError, Unsupported
from kiln.runtime.commands.termination import (result_json, stderr_logger, termination_log,
                                               write_result)

__all__ = ["configure", "run", "result_json"]  # result_json: what the termination log holds

stderr_log = stderr_logger("build")


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


# A build request is a few KiB (a model, an engine spec, the key's inputs).
MAX_REQUEST_BYTES = 1 << 20


def _write_result(path: Path | None, result: dict) -> None:
    write_result(path, result, stderr_log)


def _failed(term: Path | None, e: BuildError) -> int:
    stderr_log(f"failed ({e.reason}): {e}")
    _write_result(term, {"ok": False, "reason": e.reason, "message": str(e)})
    return e.exit_code


def run(args: argparse.Namespace) -> int:
    term = termination_log(args.termination_log)
    try:
        if args.request_file:
            from kiln.runtime.api.localfile import UnreadableFile, read_json

            try:
                raw = read_json(args.request_file, MAX_REQUEST_BYTES, "the request file")
            except UnreadableFile as e:
                raise BadRequest(str(e)) from None
        else:
            try:
                raw = json.loads(args.request)
            except (json.JSONDecodeError, RecursionError, ValueError) as e:
                raise BadRequest(f"the request is not valid JSON: {type(e).__name__}: {e}") from None
        from kiln.runtime.engine.build import BuildRequest, build_engine

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
