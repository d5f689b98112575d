"""`kiln dev` and `make demo`'s module, run as a user runs them: real subprocesses, real HTTP.

The manifest names a real ONNX model (generated with onnx.helper, fixed seed) through a
relative `file://` URI; the answers are compared with ONNX Runtime run on the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from kiln.runtime.commands.dev import resolve_model_uri

pytestmark = pytest.mark.timeout(90)

KILN = Path(sys.executable).parent / "kiln"
REPO = Path(__file__).resolve().parents[2]


def scorer_model() -> bytes:
    """features FP32 [N,4] and bucket INT64 [N,1] -> score FP32 [N,2], best INT64 [N]."""
    rng = np.random.default_rng(11)
    init = [numpy_helper.from_array(rng.standard_normal((4, 2)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.standard_normal((5, 2)).astype(np.float32), "B")]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W"], ["proj"]),
         helper.make_node("Gather", ["B", "bucket"], ["bias3"], axis=0),
         helper.make_node("Squeeze", ["bias3", "one"], ["bias"]),
         helper.make_node("Add", ["proj", "bias"], ["score"]),
         helper.make_node("ArgMax", ["score"], ["best"], axis=1, keepdims=0)],
        "scorer",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("bucket", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("best", TensorProto.INT64, ["N"])],
        init + [numpy_helper.from_array(np.array([1], dtype=np.int64), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def manifest(tmp: Path, **engine) -> Path:
    (tmp / "models").mkdir(exist_ok=True)
    (tmp / "models" / "scorer.onnx").write_bytes(scorer_model())
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
           "metadata": {"name": "scorer", "namespace": "dev"},
           "spec": {"model": {"uri": "file://./models/scorer.onnx", "version": "3"},
                    "engine": {"backend": "onnxruntime", "precision": "fp32",
                               "targets": ["cpu"], **engine}}}
    path = tmp / "scorer.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        return resp.status, json.loads(resp.read())


def test_kiln_dev_builds_serves_and_answers_then_hits_the_cache(tmp_path, kiln_process):
    path = manifest(tmp_path)
    cache = tmp_path / "cache"
    dev = kiln_process(["dev", str(path), "--port", "0", "--cache-dir", str(cache)], tmp_path)
    try:
        key = dev.wait_for(r"^built engine ([0-9a-f]{20}) for cpu in [0-9.]+s -> "
                           r"dev/scorer/\1$").group(1)
        url = dev.wait_for(r"^serving scorer \(version 3\) at (http://127\.0\.0\.1:\d+)$") \
            .group(1)
        dev.wait_for(r"^press Ctrl-C to stop$")
        text = "\n".join(dev.lines)
        assert "  inputs:  features FP32[-1, 4], bucket INT64[-1, 1]" in text
        assert "  outputs: score FP32[-1, 2], best INT64[-1]" in text
        curl = next(line for line in dev.lines if "/infer" in line)
        argv = shlex.split(curl)
        assert argv[:5] == ["curl", "-s", "-X", "POST", f"{url}/v2/models/scorer/infer"]
        example = json.loads(argv[argv.index("-d") + 1])
        assert [(i["name"], i["shape"], i["datatype"]) for i in example["inputs"]] == [
            ("features", [1, 4], "FP32"), ("bucket", [1, 1], "INT64")]
        # The printed example works as printed.
        status, answer = post(f"{url}/v2/models/scorer/infer", json.dumps(example).encode())
        assert status == 200
        assert [o["name"] for o in answer["outputs"]] == ["score", "best"]

        features = np.array([[0.5, -1.0, 2.0, 0.25], [1.5, 0.0, -0.5, 3.0]], np.float32)
        bucket = np.array([[4], [0]], np.int64)
        status, answer = post(f"{url}/v2/models/scorer/infer", json.dumps({"inputs": [
            {"name": "features", "shape": [2, 4], "datatype": "FP32",
             "data": features.tolist()},
            {"name": "bucket", "shape": [2, 1], "datatype": "INT64",
             "data": bucket.tolist()}]}).encode())
        session = ort.InferenceSession(scorer_model(), providers=["CPUExecutionProvider"])
        score, best = session.run(["score", "best"], {"features": features, "bucket": bucket})
        outputs = {o["name"]: o for o in answer["outputs"]}
        np.testing.assert_allclose(np.array(outputs["score"]["data"]).reshape(2, 2), score,
                                   rtol=1e-5, atol=1e-6)
        assert outputs["best"]["data"] == best.tolist()
    finally:
        assert dev.stop() == 0
    assert dev.lines[-1] == "kiln dev: stopped"

    again = kiln_process(["dev", str(path), "--port", "0", "--cache-dir", str(cache)], tmp_path)
    try:
        again.wait_for(rf"^cache hit: engine {key} for cpu is already in dev/scorer/{key}$")
        again.wait_for(r"^serving scorer")
    finally:
        assert again.stop() == 0

    # A corrupt entry is moved aside and built again, and the person running it is told.
    entry = cache / "dev" / "scorer" / key
    engine = entry / json.loads((entry / "manifest.json").read_text())["engineFile"]
    engine.write_bytes(b"\0" + engine.read_bytes()[1:])
    rebuilt = kiln_process(["dev", str(path), "--port", "0", "--cache-dir", str(cache)], tmp_path)
    try:
        aside = rebuilt.wait_for(rf"^the cached engine {key} was corrupt \(.*does not match.*\); moved it aside "
                                 rf"to ({re.escape(str(cache))}/dev/scorer/\.quarantine-{key}-\S+) and built "
                                 rf"it again$").group(1)
        rebuilt.wait_for(rf"^built engine {key} for cpu in [0-9.]+s -> dev/scorer/{key}$")
        rebuilt.wait_for(r"^serving scorer")
        assert Path(aside).is_dir()
    finally:
        assert rebuilt.stop() == 0


def test_kiln_dev_prints_every_validation_error(tmp_path):
    path = manifest(tmp_path, precision="fp7")
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["model"]["version"] = "not a version!"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([str(KILN), "dev", str(path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"{path}: the InferenceModel is invalid (3 errors):"
    assert any("spec.engine.precision" in line and "fp7" in line for line in lines[1:])
    assert any("spec.model.version" in line for line in lines[1:])
    # An unsupported value stops the CEL rules, and the API server says so last.
    assert lines[-1] == "  - <nil>: Invalid value: null: some validation rules were not checked because " \
                        "the object was invalid; correct the existing errors to complete validation"


LAUGHS = "".join(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]\n" for i in range(1, 10))


def bad_manifest(tmp: Path, case: str) -> tuple[Path, str]:
    """A manifest `kiln dev` must refuse before building, and the first line it must print."""
    path = manifest(tmp)
    text = path.read_text()
    doc = yaml.safe_load(text)
    if case == "alias bomb":  # "billion laughs": ~1 KB that expands to 10^9 strings
        path.write_text(text + "x0: &x0 lol\n" + LAUGHS)
        return path, (f"kiln dev: {path}, line 1, column 1: the document expands to more than 100000 YAML "
                      f"nodes (aliases counted at their expansion); refusing it")
    if case == "duplicate key":
        path.write_text(text.replace("  name: scorer\n", "  name: scorer\n  name: other\n"))
        line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t == "  name: other")
        return path, f'kiln dev: {path}, line {line}, column 3: duplicate key "name" (first at line {line - 1})'
    if case == "fifo":
        path.unlink()
        os.mkfifo(path)
        return path, f"kiln dev: {path} is a FIFO (named pipe), not a regular file; a manifest is read only from a regular file"
    if case == "over 1 MiB":
        path.write_text(text + "#" * (1 << 20) + "\n")
        return path, f"kiln dev: {path}: larger than 1048576 bytes (1 MiB), the limit for a manifest; refusing it"
    if case == "wrong apiVersion":
        doc["apiVersion"] = "kiln.dev/v1"
        message = 'apiVersion: Unsupported value: "kiln.dev/v1": supported values: "kiln.dev/v1alpha1"'
    elif case == "uppercase name":
        doc["metadata"]["name"] = "Scorer"
        message = 'metadata.name: Invalid value: "Scorer": a lowercase RFC 1123 subdomain must consist of'
    elif case == "no name":
        del doc["metadata"]["name"]
        message = "metadata.name: Required value"
    elif case in ("dotted name", "64-character name"):  # names a cluster's Service could not carry
        doc["metadata"]["name"] = "scorer.v1" if case == "dotted name" else "s" * 64
        message = ("<nil>: Invalid value: metadata.name must be a DNS-1035 label" if case == "dotted name" else
                   "<nil>: Invalid value: metadata.name must be at most 56 characters")
    else:  # a wrongly typed field: "engine: [1]", "runtime: x", "autoscaling: 3"
        field, value = {"engine list": ("engine", [1]), "runtime string": ("runtime", "x"),
                        "autoscaling number": ("autoscaling", 3)}[case]
        doc["spec"][field] = value
        jtype = {list: "array", str: "string", int: "integer"}[type(value)]
        message = f'spec.{field}: Invalid value: "{jtype}": spec.{field} in body must be of type object: "{jtype}"'
    path.write_text(yaml.safe_dump(doc))
    return path, f"  - {message}"


@pytest.mark.parametrize("case", ["alias bomb", "duplicate key", "fifo", "over 1 MiB", "wrong apiVersion",
                                  "uppercase name", "no name", "dotted name", "64-character name",
                                  "engine list", "runtime string",
                                  "autoscaling number"])
def test_kiln_dev_refuses_a_bad_manifest_with_exit_2_before_building(tmp_path, case):
    path, first = bad_manifest(tmp_path, case)
    started = time.monotonic()
    proc = subprocess.run([str(KILN), "dev", str(path), "--cache-dir", str(tmp_path / "cache")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    if first.startswith("kiln dev: "):  # the file is refused: one line
        assert lines == [first]
    else:  # the InferenceModel is invalid: the list of what the API server would say
        assert lines[0].startswith(f"{path}: the InferenceModel is invalid (")
        assert any(line.startswith(first) for line in lines[1:]), lines
    assert not (tmp_path / "cache").exists()  # nothing was built
    if case == "alias bomb":
        assert time.monotonic() - started < 10  # refused at once, not after expanding it


@pytest.mark.timeout(30)  # a FIFO opened without O_NONBLOCK would block `kiln dev` forever
def test_kiln_dev_refuses_a_fifo_as_the_model(tmp_path):
    path = manifest(tmp_path)
    (tmp_path / "models" / "scorer.onnx").unlink()
    os.mkfifo(tmp_path / "models" / "scorer.onnx")
    proc = subprocess.run([str(KILN), "dev", str(path), "--cache-dir", str(tmp_path / "cache")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    fifo = (tmp_path / "models" / "scorer.onnx").resolve()
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (f"kiln dev: build failed (SourceUnreachable): {fifo.as_uri()}: {fifo} is a FIFO "
                           f"(named pipe), not a regular file; the model must be an ONNX file\n")


def test_kiln_dev_explains_tensorrt_without_gpu(tmp_path):
    from kiln.runtime.engine.gpu import detect_target
    if detect_target() != "cpu":
        pytest.skip("this machine has an NVIDIA GPU: tensorrt manifests build here")
    path = manifest(tmp_path, backend="tensorrt", targets=["sm90"])
    proc = subprocess.run([str(KILN), "dev", str(path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert "needs an NVIDIA GPU, and this machine has none" in proc.stderr
    assert "set `engine.backend: onnxruntime`" in proc.stderr


def test_relative_file_uris_resolve_against_the_manifest(tmp_path):
    assert resolve_model_uri("file://./m.onnx", tmp_path) == (tmp_path / "m.onnx").as_uri()
    assert resolve_model_uri("file:sub/m.onnx", tmp_path) == (tmp_path / "sub/m.onnx").as_uri()
    assert resolve_model_uri("file:///abs/m.onnx", tmp_path) == "file:///abs/m.onnx"
    assert resolve_model_uri("https://h/m.onnx", tmp_path) == "https://h/m.onnx"


def test_demo_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kiln.runtime.commands.demo", "--cache-dir",
                           str(tmp_path / "cache"), "--timeout", "60"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "request: POST http://127.0.0.1:" in out
    assert "answer: HTTP 200" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  [")]
    assert [r[4] for r in rows] == ["setosa", "versicolor", "virginica", "versicolor"]
    assert "kiln demo: server stopped (exit code 0)" in out


def test_demo_model_is_reproducible_and_pinned(tmp_path):
    demo = REPO / "examples" / "demo"
    subprocess.run([sys.executable, str(demo / "make_model.py"), str(tmp_path / "m.onnx")],
                   check=True, capture_output=True, timeout=60)
    regenerated = (tmp_path / "m.onnx").read_bytes()
    assert regenerated == (demo / "model.onnx").read_bytes()
    pinned = yaml.safe_load((demo / "inferencemodel.yaml").read_text())["spec"]["model"]
    assert pinned["sha256"] == hashlib.sha256(regenerated).hexdigest()
