"""`kiln build` as a build Job runs it: the real console script, its exit codes and messages."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.runtime import build, cache

KILN = str(Path(sys.executable).parent / "kiln")


@pytest.fixture
def model(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w, "w")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path / "models" / "mlp" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(m, path)
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
    assert not res.cache_hit and res.path == cache.relative_path("ml", "mlp", res.manifest.key)
    data, manifest, _ = cache.read_verified(tmp_path / "c" / res.path)
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
])
def test_failures_exit_with_their_code_and_reason(tmp_path, model, case, code, reason, text):
    req = request("pvc://models/mlp/model.onnx")
    if case == "unreachable":
        req["model"]["uri"] = f"http://127.0.0.1:{closed_port()}/model.onnx"
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
    elif case == "key":
        from kiln.runtime import enginekey
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
# test injects it at the one place publish writes data (cache._write_file), in a real
# process that runs the real `kiln` entry point.
ENOSPC_WRAPPER = """
import errno, sys
from kiln.runtime import cache
def full(path, data):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))
cache._write_file = full
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
    text = build.result_json({"ok": False, "reason": "BuildFailed", "message": "x" * 10000})
    assert len(text.encode()) <= 4096 and json.loads(text)["reason"] == "BuildFailed"
