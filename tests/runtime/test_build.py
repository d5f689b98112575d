"""`kiln build` as a build Job runs it: the real console script, its exit codes and messages."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3

from kiln.runtime.commands import build as build_command
from kiln.runtime.engine import build
from kiln.runtime.engine.cache.entry import relative_path
from kiln.runtime.engine.cache.verify import read_verified
from kiln.runtime.engine.backends import get_backend

KILN = str(Path(sys.executable).parent / "kiln")


@pytest.fixture
def model(tmp_path, matmul_onnx) -> Path:
    path = tmp_path / "models" / "mlp" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(matmul_onnx)
    return path


def request(uri, **engine):
    return {"namespace": "ml", "name": "mlp", "model": {"uri": uri, "version": "1"},
            "engine": {"backend": "onnxruntime", "precision": "fp32",
                       "profiles": [{"input": "x", "min": [1, 8], "opt": [4, 8], "max": [16, 8]}],
                       **engine},
            "target": "cpu"}


def kiln_build(tmp_path, req, *argv, command=(KILN,)):
    term = tmp_path / "termination-log"
    proc = subprocess.run(
        [*command, "build", "--request", json.dumps(req), "--cache-dir", str(tmp_path / "cache"),
         "--pvc-root", str(tmp_path), "--termination-log", str(term), *argv],
        capture_output=True, text=True, cwd=tmp_path, timeout=60)
    result = json.loads(term.read_text()) if term.exists() else None
    return proc, result


def test_build_then_cache_hit(tmp_path, model):
    req = request("pvc://models/mlp/model.onnx")
    proc, result = kiln_build(tmp_path, req)
    assert proc.returncode == 0, proc.stderr
    assert result["ok"] and not result["cacheHit"] and result["backend"] == "onnxruntime"
    assert result["path"] == f"ml/mlp/{result['key']}"
    for line in ("fetching pvc://models/mlp/model.onnx", "built in", "published ml/mlp/",
                 "load check: the engine loads in"):
        assert line in proc.stderr
    assert 0 < result["loadSeconds"] < 60  # what the operator sizes the startup probe from
    engine = tmp_path / "cache" / result["path"] / "engine.onnx"
    assert hashlib.sha256(engine.read_bytes()).hexdigest() == result["sha256"]
    manifest = json.loads((engine.parent / "manifest.json").read_text())
    assert manifest["inputs"]["profiles"][0]["max"] == [16, 8]
    assert len(json.dumps(result)) < 4096

    proc2, result2 = kiln_build(tmp_path, {**req, "key": result["key"]})
    assert proc2.returncode == 0 and result2["cacheHit"] and result2["key"] == result["key"]
    assert "cache hit" in proc2.stderr and "fetching" not in proc2.stderr


def test_build_engine_python_api(tmp_path, model):
    res = build.build_engine(build.BuildRequest.from_dict(request("pvc://models/mlp/model.onnx")),
                             tmp_path / "c", pvc_root=tmp_path)
    assert not res.cache_hit and res.path == relative_path("ml", "mlp", res.manifest.key)
    data, manifest, _ = read_verified(tmp_path / "c" / res.path)
    assert manifest == res.manifest and len(data) == manifest.size_bytes


@pytest.mark.parametrize("form", ["file URI", "plain absolute path", "plain relative path"])
def test_kiln_build_refuses_local_files_even_on_a_cache_hit(tmp_path, model, form, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where `kiln build` runs, so the relative path names the model
    uri = {"file URI": model.as_uri(), "plain absolute path": str(model),
           "plain relative path": "models/mlp/model.onnx"}[form]
    req = request(uri)
    proc, result = kiln_build(tmp_path, req)
    message = (f"{uri}: file:// URIs and plain paths are read only by `kiln dev`; a build Job "
               f"reads pvc://<claim>/<path>, https://, http:// or s3://")
    assert proc.returncode == 2, proc.stderr
    assert result == {"ok": False, "reason": "BadRequest", "message": message}
    assert message in proc.stderr and "fetching" not in proc.stderr
    # The same request built in-process as `kiln dev` does it: `kiln build` still refuses it.
    build.build_engine(build.BuildRequest.from_dict(req), tmp_path / "cache", allow_local_files=True)
    proc, result = kiln_build(tmp_path, req)
    assert proc.returncode == 2 and result["reason"] == "BadRequest" and "cache hit" not in proc.stderr


@pytest.mark.timeout(30)  # a FIFO opened without O_NONBLOCK would block the build forever
def test_a_fifo_on_the_volume_is_source_unreachable_without_blocking(tmp_path, model):
    os.mkfifo(tmp_path / "models" / "pipe.onnx")
    proc, result = kiln_build(tmp_path, request("pvc://models/pipe.onnx"))
    assert proc.returncode == 3, proc.stderr
    assert result["reason"] == "SourceUnreachable"
    assert result["message"] == (f"pvc://models/pipe.onnx: {tmp_path / 'models' / 'pipe.onnx'} is a FIFO "
                                 f"(named pipe), not a regular file; the model must be an ONNX file")


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case, code, reason, text", [
    ("unreachable", 3, "SourceUnreachable", "cannot connect"),
    ("digest", 4, "DigestMismatch", "does not match the pinned"),
    ("invalid", 5, "InvalidModel", "not an ONNX model"),
    ("precision", 6, "Unsupported", "precision 'int8' is not supported"),
    ("badjson", 2, "BadRequest", "precision 'fp64'"),
    ("profile", 2, "BadRequest", "model's inputs are: x"),
    ("key", 8, "KeyMismatch", "backendVersion: requested '0.0.1', builder has"),
    ("gpu target", 6, "Unsupported", "has no CUDA provider: a GPU target needs onnxruntime-gpu"),
])
def test_failures_exit_with_their_code_and_reason(tmp_path, model, case, code, reason, text):
    req = request("pvc://models/mlp/model.onnx")
    if case == "unreachable":
        req["model"]["uri"] = f"https://127.0.0.1:{closed_port()}/model.onnx"
    elif case == "digest":
        req["model"]["sha256"] = "f" * 64
    elif case == "invalid":
        bad = tmp_path / "models" / "bad.onnx"
        bad.write_bytes(b"\x08\x01garbage that is not an onnx protobuf \xff\xff")
        req["model"]["uri"] = "pvc://models/bad.onnx"
    elif case == "precision":
        req["engine"]["precision"] = "int8"
    elif case == "badjson":
        req["engine"]["precision"] = "fp64"
    elif case == "profile":
        req["engine"]["profiles"][0]["input"] = "images"
    elif case == "gpu target":  # once labelled sm90 and served on the CPU of an H100 node
        req["target"] = "sm90"
    elif case == "key":
        from kiln.runtime.api import enginekey
        theirs = enginekey.key_inputs(req["model"], req["engine"], "cpu", "0.0.1")
        req["key"], req["keyInputs"] = theirs.key, theirs.to_dict()
    proc, result = kiln_build(tmp_path, req)
    assert proc.returncode == code, proc.stderr
    assert result["ok"] is False and result["reason"] == reason and text in result["message"]
    assert text in proc.stderr
    assert not any((tmp_path / "cache").glob("*/*/*/manifest.json"))


def test_usage_errors_exit_2(tmp_path):
    proc = subprocess.run([KILN, "build"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "--request" in proc.stderr
    proc, result = kiln_build(tmp_path, "{not json")
    assert proc.returncode == 2 and result["reason"] == "BadRequest"


# ENOSPC cannot be produced honestly in CI (no tiny tmpfs to mount without root), so this
# test injects it at the one place publish writes data (publish._write_file), in a real
# process that runs the real `kiln` entry point.
ENOSPC_WRAPPER = """
import errno, sys
from kiln.runtime.engine.cache import publish
def full(path, data):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))
publish._write_file = full
from kiln.cli import main
sys.exit(main())
"""


def test_out_of_disk_exit_7_and_no_debris(tmp_path, model):
    wrapper = tmp_path / "enospc.py"
    wrapper.write_text(ENOSPC_WRAPPER)
    proc, result = kiln_build(tmp_path, request("pvc://models/mlp/model.onnx"),
                              command=(sys.executable, str(wrapper)))
    assert proc.returncode == 7, proc.stderr
    assert result["reason"] == "OutOfDisk" and "No space left on device" in result["message"]
    assert not [p for p in (tmp_path / "cache" / "ml" / "mlp").iterdir()]  # temp dir cleaned


def test_termination_message_stays_under_4_kib():
    text = build_command.result_json({"ok": False, "reason": "BuildFailed", "message": "x" * 10000})
    assert len(text.encode()) <= 4096 and json.loads(text)["reason"] == "BuildFailed"


# -- the cache heals ---------------------------------------------------------------------

def _corrupt(case, tmp_path, entry):
    """Damage a published entry in one way; return what the quarantine reason must say."""
    engine, manifest = entry / "engine.onnx", entry / "manifest.json"
    if case == "flipped":  # the size still matches: only the load check's digest sees it
        data = bytearray(engine.read_bytes())
        data[len(data) // 2] ^= 0xFF
        engine.write_bytes(bytes(data))
        return "does not match the manifest's"
    if case == "truncated":
        engine.write_bytes(engine.read_bytes()[:100])
        return "size 100 bytes"
    if case == "manifest":
        manifest.write_text('{"key": "')
        return "invalid manifest"
    if case == "symlink":
        outside = tmp_path / "outside.onnx"
        engine.rename(outside)
        engine.symlink_to(outside)
        return "the engine file is a symbolic link"
    if case == "unloadable":  # a sound entry whose bytes the backend cannot load
        garbage = b"\x08\x01 not an onnx model at all \xff\xff"
        engine.write_bytes(garbage)
        doc = json.loads(manifest.read_text())
        doc.update(sizeBytes=len(garbage), sha256=hashlib.sha256(garbage).hexdigest(),
                   chunkBlake3=[blake3(garbage).hexdigest()])  # one chunk
        manifest.write_text(json.dumps(doc))
        return "the cached engine does not load: ONNX Runtime cannot load the engine"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["flipped", "truncated", "manifest", "symlink", "unloadable"])
def test_a_corrupt_entry_is_moved_aside_and_built_again(tmp_path, model, case):
    req = request("pvc://models/mlp/model.onnx")
    proc, first = kiln_build(tmp_path, req)
    assert proc.returncode == 0, proc.stderr
    model_dir = tmp_path / "cache" / "ml" / "mlp"
    expected = _corrupt(case, tmp_path, model_dir / first["key"])

    proc, result = kiln_build(tmp_path, req)
    assert proc.returncode == 0, proc.stderr
    assert result["ok"] and not result["cacheHit"] and result["key"] == first["key"]
    aside = result["quarantined"]["path"]
    assert aside.startswith(f"ml/mlp/.quarantine-{first['key']}-")
    assert expected in result["quarantined"]["reason"]
    assert f"moved the corrupt entry aside to {aside}" in proc.stderr and expected in proc.stderr
    assert expected in (tmp_path / "cache" / aside / "quarantine-reason.txt").read_text()
    data, manifest, _ = read_verified(model_dir / first["key"])  # rebuilt, sound
    assert manifest.sha256 == result["sha256"] == first["sha256"]  # the build is deterministic

    proc, again = kiln_build(tmp_path, req)  # healed: an ordinary cache hit
    assert proc.returncode == 0 and again["cacheHit"] and "quarantined" not in again


# A build killed mid-write, for real: this wrapper runs the real `kiln` entry point and
# SIGKILLs its own process halfway through writing the engine (publish._write_file, the one
# place publish writes data), as an OOM kill or a node loss would.
KILLED_WRAPPER = """
import os, signal, sys
from kiln.runtime.engine.cache import publish
def die_halfway(path, data):
    with open(path, "xb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
publish._write_file = die_halfway
from kiln.cli import main
sys.exit(main())
"""


def test_the_next_build_removes_what_a_killed_build_left(tmp_path, model):
    wrapper = tmp_path / "killed.py"
    wrapper.write_text(KILLED_WRAPPER)
    req = request("pvc://models/mlp/model.onnx")
    proc, _ = kiln_build(tmp_path, req, command=(sys.executable, str(wrapper)))
    assert proc.returncode == -9, proc.stderr
    model_dir = tmp_path / "cache" / "ml" / "mlp"
    [debris] = list(model_dir.iterdir())
    assert debris.name.startswith(".tmp-") and (debris / "engine.onnx").stat().st_size > 0
    # Another key's debris is not this build's to remove.
    other = model_dir / ".tmp-0123456789abcdef0123-x"
    other.mkdir()
    (other / ".lock").touch()

    proc, result = kiln_build(tmp_path, req)
    assert proc.returncode == 0, proc.stderr
    assert f"removed {debris.name}, left by a build of this key that did not finish" in proc.stderr
    assert sorted(p.name for p in model_dir.iterdir()) == sorted([result["key"], other.name])


# Storage that corrupts what a build writes: the engine published is not the engine built.
CORRUPTING_WRAPPER = """
import sys
from kiln.runtime.engine.cache import publish
write = publish._write_file
def corrupt(path, data):
    data = bytearray(data)
    if path.name == "engine.onnx":
        data[len(data) // 2] ^= 0xFF
    write(path, data)
publish._write_file = corrupt
from kiln.cli import main
sys.exit(main())
"""


def test_a_fresh_engine_that_does_not_load_fails_the_build_and_the_next_build_heals(tmp_path, model):
    wrapper = tmp_path / "corrupt.py"
    wrapper.write_text(CORRUPTING_WRAPPER)
    req = request("pvc://models/mlp/model.onnx")
    proc, result = kiln_build(tmp_path, req, command=(sys.executable, str(wrapper)))
    assert proc.returncode == 1, proc.stderr
    assert result["reason"] == "BuildFailed"
    key = next(p.name for p in (tmp_path / "cache" / "ml" / "mlp").iterdir())
    version = get_backend("onnxruntime").version()
    assert result["message"].startswith(
        f"the engine onnxruntime {version} just built and published as ml/mlp/{key} "
        f"does not load back: ")
    assert "does not match the manifest's" in result["message"]

    proc, healed = kiln_build(tmp_path, req)
    assert proc.returncode == 0, proc.stderr
    assert not healed["cacheHit"] and healed["quarantined"]["path"].startswith(f"ml/mlp/.quarantine-{key}-")


@pytest.mark.timeout(60)  # a FIFO opened for a blocking read would hang the build forever
@pytest.mark.parametrize("kind, make, says", [
    ("FIFO", lambda p: os.mkfifo(p), "the request file: {p} is a FIFO (named pipe), not a regular file"),
    ("/dev/zero", lambda p: os.symlink("/dev/zero", p), "is a character device, not a regular file"),
    ("huge", lambda p: p.write_bytes(b" " * (2 << 20)), "is larger than 1048576 bytes, the limit for it"),
    ("not UTF-8", lambda p: p.write_bytes(b'{"name": "\xff"}'), "is not UTF-8 text (byte 10)"),
    ("deep JSON", lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nests too deeply"),
    ("not JSON", lambda p: p.write_text("{"), "is not valid JSON: "),
])
def test_a_request_file_that_cannot_be_read_is_bad_request_exit_2(tmp_path, kind, make, says):
    path, term = tmp_path / "request.json", tmp_path / "termination-log"
    make(path)
    proc = subprocess.run([KILN, "build", "--request-file", str(path), "--cache-dir",
                           str(tmp_path / "cache"), "--termination-log", str(term)],
                          capture_output=True, text=True, timeout=50)
    result = json.loads(term.read_text())
    assert proc.returncode == 2, proc.stderr
    assert result["reason"] == "BadRequest" and says.format(p=path) in result["message"], result
    assert "Traceback" not in proc.stderr
