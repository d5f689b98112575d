"""The v2 server end to end on the CPU: build -> cache -> serve -> infer over real HTTP.

A real ONNX model (generated with onnx.helper, fixed seed) with a float32 and an int64
input, three outputs and a dynamic batch dimension is built by `build_engine` into a real
cache, served by `InferenceServer` on 127.0.0.1 (its own event loop in a thread, as in a
pod), and every answer is compared with ONNX Runtime run directly on the same model.
Timing-dependent cases (slow warm-up, overload, disconnects) use the batcher's real queue
delay, which the runtime spec sets; no mocks.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.serving.rest.connections import ConnectionLimits
from kiln.runtime.serving.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request

from support.metrics import wait_for_metric
from support.serving import (MAX_BODY, NAME, RUNTIME, Built, HttpClient, ServerThread, assert_matches,
                             build_cpu_engine, json_inputs, neg_model, sample)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def server(built):
    srv = ServerThread(built.cache, {"cpu": built.rel})
    assert srv.wait_loaded(), srv.model.status_message()
    yield srv
    srv.close()


# -- inference ---------------------------------------------------------------------------

def test_json_inference_matches_onnxruntime(server, built):
    inputs = sample(3)
    status, headers, doc = server.infer({"id": "req-7", "inputs": json_inputs(inputs)})
    assert status == 200, doc
    assert headers["Content-Type"].startswith("application/json")
    assert doc["id"] == "req-7"
    assert doc["model_name"] == NAME and doc["model_version"] == "1"
    assert [o["name"] for o in doc["outputs"]] == ["scores", "label", "pooled"]
    assert {o["name"]: o["datatype"] for o in doc["outputs"]} == {
        "scores": "FP32", "label": "INT64", "pooled": "FP32"}
    outputs = {o["name"]: o["data"] for o in decode_infer_response(
        json.dumps(doc).encode(), None)["outputs"]}
    assert_matches(outputs, built.expected(inputs))


def test_nested_data_and_output_selection(server, built):
    inputs = sample(2, seed=1)
    doc = {"inputs": [{"name": n, "shape": list(a.shape),
                       "datatype": "FP32" if a.dtype == np.float32 else "INT64",
                       "data": a.tolist()} for n, a in inputs.items()],
           "outputs": [{"name": "label"}]}
    status, _, answer = server.infer(doc)
    assert status == 200, answer
    assert [o["name"] for o in answer["outputs"]] == ["label"]
    assert answer["outputs"][0]["shape"] == [2]
    assert answer["outputs"][0]["data"] == built.expected(inputs)["label"].tolist()
    assert "id" not in answer


def test_binary_tensor_extension(server, built):
    """As tritonclient.http sends it: binary inputs, binary outputs for everything."""
    inputs = sample(5, seed=2)
    body, json_len = encode_infer_request(inputs, binary=True, binary_outputs=True,
                                          request_id="bin")
    status, headers, raw = server.request(
        "POST", f"/v2/models/{NAME}/infer", body,
        {HEADER_LENGTH: str(json_len), "Content-Type": "application/octet-stream"})
    assert status == 200, raw[:300]
    assert headers["Content-Type"] == "application/octet-stream"
    header_len = int(headers[HEADER_LENGTH])
    header = json.loads(raw[:header_len])
    assert header["id"] == "bin"
    assert all("data" not in o and o["parameters"]["binary_data_size"] > 0
               for o in header["outputs"])
    outputs = {o["name"]: o["data"] for o in decode_infer_response(raw, header_len)["outputs"]}
    assert_matches(outputs, built.expected(inputs))


def test_binary_inputs_mixed_outputs(server, built):
    """Binary input for one tensor, JSON for the other; one output binary, one JSON."""
    inputs = sample(2, seed=3)
    raw_ids = inputs["token_ids"].astype("<i8").tobytes()
    header = json.dumps({"inputs": [
        {"name": "features", "shape": [2, 4], "datatype": "FP32",
         "data": inputs["features"].reshape(-1).tolist()},
        {"name": "token_ids", "shape": [2, 3], "datatype": "INT64",
         "parameters": {"binary_data_size": len(raw_ids)}}],
        "outputs": [{"name": "scores", "parameters": {"binary_data": True}},
                    {"name": "pooled", "parameters": {"binary_data": False}}]}).encode()
    status, headers, raw = server.request("POST", f"/v2/models/{NAME}/infer", header + raw_ids,
                                          {HEADER_LENGTH: str(len(header))})
    assert status == 200, raw[:300]
    doc = decode_infer_response(raw, int(headers[HEADER_LENGTH]))
    by_name = {o["name"]: o for o in doc["outputs"]}
    assert set(by_name) == {"scores", "pooled"}
    assert "binary_data_size" in by_name["scores"]["parameters"]
    want = built.expected(inputs)
    np.testing.assert_allclose(by_name["scores"]["data"], want["scores"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(by_name["pooled"]["data"], want["pooled"], rtol=1e-5, atol=1e-5)


def test_versioned_infer_route(server):
    doc = {"inputs": json_inputs(sample(1))}
    assert server.infer(doc, f"/v2/models/{NAME}/versions/1/infer")[0] == 200
    status, _, answer = server.infer(doc, f"/v2/models/{NAME}/versions/2/infer")
    assert status == 404
    assert answer["error"] == f"model '{NAME}' has no version '2'; it serves version '1'"


# -- bad requests ------------------------------------------------------------------------

def _doc(**overrides):
    inputs = json_inputs(sample(2))
    for name, changes in overrides.items():
        for entry in inputs:
            if entry["name"] == name:
                entry.update(changes)
    return {"inputs": inputs}


BAD_REQUESTS = [
    ("unknown input",
     {"inputs": json_inputs(sample(1)) + [{"name": "extra", "shape": [1], "datatype": "FP32",
                                          "data": [1.0]}]},
     400, "unknown input 'extra'; the model's inputs are: features, token_ids"),
    ("missing input", {"inputs": json_inputs(sample(1))[:1]},
     400, "missing input 'token_ids'; the model needs: features, token_ids"),
    ("wrong datatype", _doc(features={"datatype": "FP64"}),
     400, "input 'features' has datatype FP64 but the model expects FP32"),
    ("bytes datatype", _doc(features={"datatype": "BYTES"}),
     400, "input 'features': the BYTES datatype is not supported; the model expects FP32"),
    ("rank", _doc(features={"shape": [8]}),
     400, "input 'features' has shape [8] (rank 1) but the model expects rank 2: [-1, 4]"),
    ("fixed dimension", _doc(features={"shape": [4, 2]}),
     400, "input 'features' has shape [4, 2] but the model expects [-1, 4] "
          "(dimension 1 must be 4)"),
    ("element count", _doc(features={"shape": [3, 4]}),
     400, "input 'features': shape [3, 4] needs 12 elements but 'data' has 8"),
    ("inconsistent batch", {"inputs": [json_inputs(sample(2))[0], json_inputs(sample(3))[1]]},
     400, "inputs disagree on the batch dimension (dimension 0): 'features' has 2, "
          "'token_ids' has 3"),
    ("float data for int64", _doc(token_ids={"data": [0.5] * 6}),
     400, "input 'token_ids': INT64 data must be integers"),
    ("unknown output", {"inputs": json_inputs(sample(1)), "outputs": [{"name": "nope"}]},
     400, "unknown output 'nope'; the model's outputs are: scores, label, pooled"),
    ("no inputs", {"id": "x"}, 400, "the request needs a non-empty 'inputs' list"),
    ("batch above maxBatchSize", {"inputs": json_inputs(sample(20))},
     400, "the request's batch of 20 rows exceeds maxBatchSize 16; split it into smaller "
          "requests"),
]


@pytest.mark.parametrize("doc,status,message", [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(server, doc, status, message):
    got, _, answer = server.infer(doc)
    assert (got, answer) == (status, {"error": message})


def test_malformed_json(server):
    status, _, answer = server.infer(b'{"inputs": [')
    assert status == 400
    assert answer["error"].startswith("malformed JSON in the request body: ")


def test_binary_size_mismatch(server):
    header = json.dumps({"inputs": [
        {"name": "features", "shape": [1, 4], "datatype": "FP32",
         "parameters": {"binary_data_size": 12}},
        {"name": "token_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}]}).encode()
    status, _, raw = server.request("POST", f"/v2/models/{NAME}/infer", header + bytes(12),
                                    {HEADER_LENGTH: str(len(header))})
    assert status == 400
    assert json.loads(raw) == {"error": "input 'features': binary_data_size is 12 bytes but "
                                        "shape [1, 4] of FP32 needs 16"}
    status, _, raw = server.request("POST", f"/v2/models/{NAME}/infer", header,
                                    {HEADER_LENGTH: str(len(header) + 5)})
    assert status == 400
    assert json.loads(raw)["error"] == (f"{HEADER_LENGTH} is {len(header) + 5} but the body "
                                        f"has {len(header)} bytes")


def test_body_over_limit_is_413(server):
    body = json.dumps({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32",
                                   "data": [0.0] * 4, "pad": "x" * MAX_BODY}]}).encode()
    status, _, raw = server.request("POST", f"/v2/models/{NAME}/infer", body)
    assert status == 413
    # 16 rows (maxBatchSize) of 4 + 3 elements: far below --max-body-bytes, so the model's
    # own bound refuses it, before the body is read.
    bound = 64 * 1024 + 16 * 7 * 64
    assert json.loads(raw) == {"error": f"the request body ({len(body)} bytes) is over {bound} "
                                        f"bytes, the largest valid request to model '{NAME}' "
                                        f"(its inputs at the largest batch and profile shapes)"}


def test_unknown_model_route_and_method(server):
    status, _, answer = server.infer({"inputs": []}, "/v2/models/other/infer")
    assert (status, answer) == (404, {"error": f"unknown model 'other'; this server serves: "
                                               f"{NAME}"})
    assert server.get("/v2/models/other")[0] == 404
    status, _, answer = server.get("/v3/nothing")
    assert (status, answer) == (404, {"error": "no such endpoint: /v3/nothing"})
    status, headers, raw = server.request("GET", f"/v2/models/{NAME}/infer")
    assert status == 405
    assert json.loads(raw) == {"error": f"method GET is not allowed on /v2/models/{NAME}/infer"}


# -- metadata, health, metrics -----------------------------------------------------------

def test_metadata_and_health(server):
    assert server.get("/v2/health/live")[:3:2] == (200, {"live": True})
    assert server.get("/v2/health/ready")[:3:2] == (200, {"ready": True})
    assert server.get(f"/v2/models/{NAME}/ready")[:3:2] == (200, {"name": NAME, "ready": True})
    status, _, meta = server.get("/v2")
    assert status == 200 and meta["name"] == "kiln"
    assert "binary_tensor_data" in meta["extensions"]
    status, _, meta = server.get(f"/v2/models/{NAME}")
    assert status == 200
    assert meta == {
        "name": NAME, "versions": ["1"], "platform": "onnxruntime",
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]},
                   {"name": "token_ids", "datatype": "INT64", "shape": [-1, 3]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 3]},
                    {"name": "label", "datatype": "INT64", "shape": [-1]},
                    {"name": "pooled", "datatype": "FP32", "shape": [-1, 4]}]}
    assert server.get(f"/v2/models/{NAME}/versions/1")[0] == 200


def test_metrics_count_requests_by_outcome_and_load_stages(server, built):
    def count(outcome):
        return server.metric("kiln_requests_total", model=NAME, outcome=outcome) or 0.0

    before = {o: count(o) for o in ("success", "bad_request")}
    requests_before = server.metric("kiln_request_duration_seconds_count", model=NAME) or 0.0
    for _ in range(3):
        assert server.infer({"inputs": json_inputs(sample(1))})[0] == 200
    for _ in range(2):
        assert server.infer({"inputs": json_inputs(sample(1))[:1]})[0] == 400
    assert count("success") - before["success"] == 3
    assert count("bad_request") - before["bad_request"] == 2
    assert server.metric("kiln_request_duration_seconds_count", model=NAME) \
        - requests_before == 5
    for stage in ("read", "verify", "deserialize", "warmup"):
        value = server.metric("kiln_engine_load_seconds", model=NAME, stage=stage)
        assert value is not None and value >= 0, stage
    assert server.metric("kiln_model_ready", model=NAME) == 1.0
    assert server.metric("kiln_model_info", model=NAME, version="1",
                         engine_key=built.result.manifest.key, backend="onnxruntime",
                         target="cpu") == 1.0
    _, headers, _ = server.request("GET", "/metrics")
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")


# -- readiness, load failures, overload, disconnects, engine failures ---------------------

SLOW = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 1_500_000,
                     "maxQueueSize": 2}}


def test_slow_warmup_overload_and_disconnect(built):
    """Warm-up waits out a 1.5 s queue delay: live throughout, ready only once warm."""
    srv = ServerThread(built.cache, {"cpu": built.rel}, SLOW)
    try:
        assert srv.get("/v2/health/live")[0] == 200
        status, headers, doc = srv.get("/v2/health/ready")
        assert status == 503 and headers["Retry-After"] == "5"
        assert doc == {"error": f"model '{NAME}' is loading", "ready": False}
        status, _, doc = srv.get(f"/v2/models/{NAME}/ready")
        assert (status, doc["state"]) == (503, "loading")
        status, headers, doc = srv.infer({"inputs": json_inputs(sample(1))})
        assert (status, doc["error"]) == (503, f"model '{NAME}' is loading")
        assert "Retry-After" in headers
        assert srv.metric("kiln_model_ready", model=NAME) == 0.0

        deadline = time.monotonic() + 15
        while srv.get("/v2/health/ready")[0] != 200:
            assert srv.get("/v2/health/live")[0] == 200
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)
        # Ready only after warm-up finished: the warm-up batch sat out the whole delay.
        assert srv.metric("kiln_engine_load_seconds", model=NAME, stage="warmup") >= 1.4

        # Overload: the queue holds 2 requests; the third gets 429 with Retry-After.
        results = []

        def send():
            results.append(srv.infer({"inputs": json_inputs(sample(1))}))
        threads = [threading.Thread(target=send) for _ in range(3)]
        for queued, t in enumerate(threads[:2], start=1):
            t.start()
            wait_for_metric(srv.url, "kiln_queue_depth", {"model": NAME}, lambda depth: depth == queued)
        threads[2].start()  # finds both places taken
        for t in threads:
            t.join(10)
        statuses = sorted(r[0] for r in results)
        assert statuses == [200, 200, 429], [r[2] for r in results]
        rejected = next(r for r in results if r[0] == 429)
        assert int(rejected[1]["Retry-After"]) >= 1
        assert rejected[2]["error"].startswith(f"model '{NAME}' is overloaded: ")
        assert srv.metric("kiln_requests_total", model=NAME, outcome="overloaded") == 1.0

        # A client that disconnects while queued cancels its request.
        body = json.dumps({"inputs": json_inputs(sample(1))}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(f"POST /v2/models/{NAME}/infer HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for_metric(srv.url, "kiln_queue_depth", {"model": NAME}, lambda depth: depth == 1)
        sock.close()
        # The disconnect is counted as cancelled.
        wait_for_metric(srv.url, "kiln_requests_total", {"model": NAME, "outcome": "cancelled"},
                        lambda n: n == 1, timeout=5)
        assert srv.metric("kiln_queue_depth", model=NAME) == 0.0
    finally:
        srv.close()


def test_tampered_engine_is_not_ready_with_both_digests(built, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built.cache / built.rel, cache / built.rel)
    manifest = json.loads((cache / built.rel / "manifest.json").read_text())
    engine = cache / built.rel / manifest["engineFile"]
    engine.chmod(0o644)
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    engine.write_bytes(bytes(data))
    from blake3 import blake3
    actual = blake3(data).hexdigest()

    srv = ServerThread(cache, {"cpu": built.rel})
    try:
        assert srv.wait_loaded() is False
        assert srv.get("/v2/health/live")[0] == 200
        status, headers, doc = srv.get(f"/v2/models/{NAME}/ready")
        assert status == 503 and doc["state"] == "failed"
        # A small engine is one chunk: its one chunk digest is the whole file's BLAKE3.
        (expected,) = manifest["chunkBlake3"]
        assert expected in doc["error"] and actual in doc["error"]
        assert doc["error"].startswith(
            f"model '{NAME}' failed to load: {engine}: chunk 0 (bytes 0-{len(data) - 1}, "
            f"chunkBytes {manifest['chunkBytes']}): blake3 ")
        assert "Retry-After" not in headers  # waiting will not fix it
        assert srv.get("/v2/health/ready")[0] == 503
        status, _, doc = srv.get(f"/v2/models/{NAME}")
        assert status == 503 and actual in doc["error"]
        assert srv.infer({"inputs": json_inputs(sample(1))})[0] == 503
        assert srv.metric("kiln_model_ready", model=NAME) == 0.0
        assert srv.metric("kiln_engine_load_seconds", model=NAME, stage="deserialize") is None
    finally:
        srv.close()


def test_no_engine_for_this_target(built):
    srv = ServerThread(built.cache, {"sm90": built.rel, "sm80": built.rel})
    try:
        assert srv.wait_loaded() is False
        status, _, doc = srv.get(f"/v2/models/{NAME}/ready")
        assert status == 503
        assert doc["error"] == (
            f"model '{NAME}' failed to load: no engine for target cpu (this pod has no GPU); "
            f"engines exist for: sm80, sm90. Add cpu to spec.engine.targets or schedule the "
            f"pods on nodes with a matching GPU")
    finally:
        srv.close()


def test_inputs_the_engine_refuses_are_400_and_the_model_stays_ready(built):
    """Issue 19, item 4: a failure caused by one request's data never counts toward the
    pod's health, and is not retried on fresh contexts."""
    srv = ServerThread(built.cache, {"cpu": built.rel})
    try:
        assert srv.wait_loaded()
        bad = sample(1)
        bad["token_ids"][0, 0] = 99  # outside the 10-row embedding: ONNX Runtime refuses it
        for _ in range(6):
            status, _, doc = srv.infer({"inputs": json_inputs(bad)})
            assert status == 400, doc
            assert doc["error"].startswith("ONNX Runtime refused the inputs: ") and \
                "indices element out of data bounds, idx=99" in doc["error"], doc
        assert srv.get("/v2/health/ready")[0] == 200
        assert srv.metric("kiln_context_recreations_total", model=NAME) == 0.0
        assert srv.metric("kiln_executions_total", model=NAME, outcome="refused") == 6.0
        # Counted apart from malformed requests: the canary analysis compares the tracks' shares.
        assert srv.metric("kiln_requests_total", model=NAME, outcome="refused") == 6.0
        assert srv.metric("kiln_requests_total", model=NAME, outcome="bad_request") == 0.0
        status, _, doc = srv.infer({"inputs": json_inputs(sample(2))})
        assert status == 200, doc
    finally:
        srv.close()


def test_engine_failures_turn_not_ready_then_recover(built):
    srv = ServerThread(built.cache, {"cpu": built.rel})
    try:
        assert srv.wait_loaded()
        # The engine's own failure: its session gone, as when its device is lost.
        engine = srv.model.engine
        session, engine.session = engine.session, None
        for _ in range(3):
            status, _, doc = srv.infer({"inputs": json_inputs(sample(1))})
            assert status == 500
            assert doc["error"].startswith("inference failed: execution failed after 3 attempts")
        engine.session = session
        status, _, doc = srv.get(f"/v2/models/{NAME}/ready")
        assert (status, doc["state"]) == (503, "unhealthy")
        assert srv.get("/v2/health/ready")[0] == 503
        assert srv.get("/v2/health/live")[0] == 200
        assert srv.metric("kiln_requests_total", model=NAME, outcome="error") == 3.0
        # Traffic that still arrives is served; a successful batch makes it ready again.
        status, _, doc = srv.infer({"inputs": json_inputs(sample(2))})
        assert status == 200, doc
        assert srv.get(f"/v2/models/{NAME}/ready")[0] == 200
        assert srv.metric("kiln_model_ready", model=NAME) == 1.0
    finally:
        srv.close()


# -- `kiln serve`, the runtime pod's command ---------------------------------------------

def test_kiln_serve_drains_an_in_flight_request_on_sigterm(built, tmp_path, kiln_process):
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 1_500_000}}
    p = kiln_process(["serve", "--model-name", NAME, "--model-version", "1", "--cache-dir",
                 str(built.cache), "--engine", f"cpu={built.rel}", "--runtime-spec",
                 json.dumps(runtime), "--host", "127.0.0.1", "--port", "0",
                 "--drain-seconds", "10"], tmp_path)
    try:
        port = int(p.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
        client = HttpClient(port)
        deadline = time.monotonic() + 20
        while client.get("/v2/health/ready")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        inputs = sample(2, seed=5)
        result = []
        sender = threading.Thread(
            target=lambda: result.append(client.infer({"inputs": json_inputs(inputs)})))
        sender.start()
        wait_for_metric(f"http://127.0.0.1:{port}", "kiln_queue_depth", {"model": NAME},
                        lambda depth: depth == 1)  # in the batching queue (1.5 s delay)
        p.proc.send_signal(signal.SIGTERM)
        p.wait_for(r"draining: 1 request\(s\) in flight")
        status, headers, doc = client.get("/v2/health/ready")
        assert (status, doc["error"]) == (503, "the server is shutting down")
        status, headers, doc = client.infer({"inputs": json_inputs(sample(1))})
        assert status == 503 and "Retry-After" in headers
        assert doc["error"] == "the server is shutting down; retry on another replica"

        sender.join(10)
        status, _, doc = result[0]
        assert status == 200, doc
        outputs = {o["name"]: o["data"] for o in decode_infer_response(
            json.dumps(doc).encode(), None)["outputs"]}
        assert_matches(outputs, built.expected(inputs))
        assert p.proc.wait(15) == 0
    finally:
        p.stop()


@pytest.mark.parametrize("flags,message", [
    (["--engine", "nonsense"],
     "kiln serve: --engine 'nonsense': expected TARGET=RELPATH, for example "
     "sm90=default/resnet/3f2a…"),
    (["--engine", "cpu=a/b/c", "--runtime-spec", "[1]"],
     "kiln serve: --runtime-spec must be a JSON object (spec.runtime)"),
    (["--engine", "cpu=/abs/path"],
     "kiln serve: engine path '/abs/path' for cpu must be relative to the cache directory "
     "and stay inside it"),
])
def test_kiln_serve_rejects_bad_flags(tmp_path, flags, message):
    proc = subprocess.run([str(Path(sys.executable).parent / "kiln"), "serve", "--model-name", "m", *flags], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == message


def test_kiln_serve_rejects_a_bad_event_loop(tmp_path):
    import os
    env = {**os.environ, "KILN_EVENT_LOOP": "tokio"}
    proc = subprocess.run([str(Path(sys.executable).parent / "kiln"), "serve", "--model-name", "m", "--engine", "cpu=a/b/c"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("kiln serve: KILN_EVENT_LOOP must be one of auto, uvloop, "
                                   "asyncio, got 'tokio'")


def test_event_loop_choice(monkeypatch):
    from kiln.runtime.serving.process import event_loop_choice, run_event_loop
    monkeypatch.setenv("KILN_EVENT_LOOP", "asyncio")
    assert event_loop_choice() == "asyncio"
    monkeypatch.delenv("KILN_EVENT_LOOP")
    assert event_loop_choice() == "uvloop"  # pinned in requirements-test.txt

    async def loop_type() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(loop_type(), "uvloop").startswith("uvloop")
    assert run_event_loop(loop_type(), "asyncio").startswith("asyncio")


def test_result_cache_answers_a_repeated_request_over_http(built):
    srv = ServerThread(built.cache, {"cpu": built.rel},
                       {**RUNTIME, "resultCache": {"enabled": True, "maxMiB": 1, "ttlSeconds": 60}})
    try:
        assert srv.wait_loaded()

        def cache(result):  # warm-up went through the scheduler too: count from here
            return srv.metric("kiln_result_cache_requests_total", model=NAME, result=result) or 0.0

        misses, hits = cache("miss"), cache("hit")
        executions = srv.metric("kiln_executions_total", model=NAME, outcome="success")
        inputs = sample(2, seed=5)
        answers = [srv.infer({"inputs": json_inputs(inputs)}) for _ in range(3)]
        assert [a[0] for a in answers] == [200, 200, 200]
        assert answers[0][2]["outputs"] == answers[1][2]["outputs"] == answers[2][2]["outputs"]
        assert (cache("miss") - misses, cache("hit") - hits) == (1.0, 2.0)
        assert srv.metric("kiln_result_cache_bytes", model=NAME) > 0
        # Only the first of the three reached the engine.
        assert srv.metric("kiln_executions_total", model=NAME, outcome="success") == executions + 1
    finally:
        srv.close()


# -- bounds: connections, timeouts, refusals decided from the headers ---------------------

def _raw(port: int, data: bytes, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response off a raw socket (the server closes or sends Content-Length)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _post_head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def test_refusals_from_the_headers_come_before_the_body(built):
    """A full queue (429) and a body over the model's bound (413) are answered from the
    headers: the client has sent none of its body when the answer arrives."""
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 1_500_000,
                            "maxQueueSize": 1, "maxAdmissionWaitMilliseconds": 0}}
    srv = ServerThread(built.cache, {"cpu": built.rel}, runtime)
    try:
        assert srv.wait_loaded()
        sock = _raw(srv.port, _post_head(f"/v2/models/{NAME}/infer", 10 << 20))
        status, headers, body = _response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert "the largest valid request to model" in json.loads(body)["error"]
        # ...and closed as it says, not held open waiting for a body it will not read.
        closing = time.monotonic()
        sock.settimeout(5)
        assert sock.recv(1) == b"" and time.monotonic() - closing < 2.5

        waiting = threading.Thread(target=srv.infer, args=({"inputs": json_inputs(sample(1))},))
        waiting.start()  # holds the queue's one place for 1.5 s
        wait_for_metric(srv.url, "kiln_queue_depth", {"model": NAME}, lambda depth: depth == 1,
                        timeout=5)
        sock = _raw(srv.port, _post_head(f"/v2/models/{NAME}/infer", 1000))
        status, headers, body = _response(sock)
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"] == f"model '{NAME}' is overloaded: its queue is full"
        waiting.join(10)
    finally:
        srv.close()


def test_a_full_queue_holds_requests_up_to_the_admission_wait(built):
    """One place in the queue, a batch every 0.4 s: a second request waits for the place
    instead of being refused; with a shorter admission wait it is refused after it."""
    for wait_ms, statuses in ((5000, [200, 200]), (100, [200, 429])):
        runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 400_000,
                                "maxQueueSize": 1, "maxAdmissionWaitMilliseconds": wait_ms}}
        srv = ServerThread(built.cache, {"cpu": built.rel}, runtime)
        try:
            assert srv.wait_loaded()
            answers: list = []
            senders = [threading.Thread(target=lambda: answers.append(
                srv.infer({"inputs": json_inputs(sample(1))}))) for _ in range(2)]
            senders[0].start()
            wait_for_metric(srv.url, "kiln_queue_depth", {"model": NAME}, lambda depth: depth == 1)
            senders[1].start()  # the queue's one place is taken
            for t in senders:
                t.join(10)
            assert sorted(a[0] for a in answers) == statuses, answers
            if 429 in statuses:
                refused = next(a for a in answers if a[0] == 429)
                assert refused[2]["error"] == (f"model '{NAME}' is overloaded: its queue is full "
                                               f"and no place freed up within 100 ms")
        finally:
            srv.close()


def test_slow_clients_are_timed_out(built):
    """A body that stops arriving gets 408; headers that never finish close the
    connection; meanwhile other clients are served."""
    limits = ConnectionLimits(header_timeout=0.5)
    srv = ServerThread(built.cache, {"cpu": built.rel}, body_timeout=0.5, limits=limits)
    try:
        assert srv.wait_loaded()
        sock = _raw(srv.port, _post_head(f"/v2/models/{NAME}/infer", 500) + b'{"inputs": [')
        status, headers, body = _response(sock)
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body) == {"error": "the request body did not arrive within 0.5 s"}

        slow = _raw(srv.port, b"POST /v2/models/multi/infer HTTP/1.1\r\nHost: x\r\n")
        silent = _raw(srv.port, b"")
        assert srv.get("/v2/health/live")[0] == 200
        assert _closed(slow, within=5) and _closed(silent, within=5)
    finally:
        srv.close()


def test_connection_cap_closes_idle_connections_first(built):
    limits = ConnectionLimits(max_connections=4, header_timeout=30)
    srv = ServerThread(built.cache, {"cpu": built.rel}, limits=limits)
    try:
        assert srv.wait_loaded()
        # Four connections that never send a request fill the cap; a real client still gets
        # in, because the oldest idle one is closed to make room.
        idle = [_raw(srv.port, b"") for _ in range(4)]
        time.sleep(0.2)
        assert srv.get("/v2/health/live")[0] == 200
        assert _closed(idle[0], within=2)
        # Connections mid-request are not idle: once they fill the cap (more are opened than
        # it holds, the idle ones closing to make room), a new connection is refused with 503.
        busy = [_raw(srv.port, b"GET /v2/health/live HTTP/1.1\r\n") for _ in range(6)]
        time.sleep(0.3)
        status, headers, body = _response(_raw(srv.port, b""))
        assert status == 503 and headers["connection"] == "close"
        assert json.loads(body)["error"].startswith("the server has reached its limit of 4 open")
        for sock in busy + idle:
            sock.close()
    finally:
        srv.close()


def test_draining_answers_keepalive_clients_with_connection_close(built):
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 1_500_000}}
    srv = ServerThread(built.cache, {"cpu": built.rel}, runtime)
    try:
        assert srv.wait_loaded()
        keepalive = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        keepalive.request("GET", "/v2/health/live")
        assert keepalive.getresponse().read()
        in_flight = threading.Thread(target=srv.infer, args=({"inputs": json_inputs(sample(1))},))
        in_flight.start()
        wait_for_metric(srv.url, "kiln_queue_depth", {"model": NAME}, lambda depth: depth == 1)
        drained = asyncio.run_coroutine_threadsafe(srv.server.shutdown(5.0), srv.loop)
        time.sleep(0.2)
        body = json.dumps({"inputs": json_inputs(sample(1))}).encode()
        keepalive.request("POST", f"/v2/models/{NAME}/infer", body,
                          {"Content-Type": "application/json"})
        resp = keepalive.getresponse()
        assert resp.status == 503 and resp.getheader("Connection") == "close"
        assert json.loads(resp.read())["error"].startswith("the server is shutting down")
        in_flight.join(10)
        assert drained.result(10) is True
    finally:
        srv.loop.call_soon_threadsafe(srv.loop.stop)


def test_kiln_dev_mode_refuses_foreign_hosts_and_form_posts(built):
    """What `kiln dev` runs (local_only): a web page cannot reach it through DNS rebinding
    (a foreign Host) or a cross-site form or text/plain POST; the Server header names no
    versions."""
    srv = ServerThread(built.cache, {"cpu": built.rel}, local_only=True)
    try:
        assert srv.wait_loaded()
        status, headers, body = srv.request("GET", "/v2/health/live",
                                            headers={"Host": f"attacker.example:{srv.port}"})
        assert status == 403
        assert json.loads(body)["error"].startswith("Host 'attacker.example:")
        assert headers["Server"] == "kiln"
        for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}"):
            assert srv.request("GET", "/v2/health/live", headers={"Host": host})[0] == 200
        good = json.dumps({"inputs": json_inputs(sample(1))}).encode()
        for ctype in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x"):
            status, _, body = srv.request("POST", f"/v2/models/{NAME}/infer", good,
                                          {"Content-Type": ctype})
            assert status == 415, ctype
            assert "send application/json or application/octet-stream" in json.loads(body)["error"]
        status, headers, _ = srv.request("POST", f"/v2/models/{NAME}/infer", good,
                                         {"Content-Type": "application/json; charset=utf-8"})
        assert status == 200 and headers["Server"] == "kiln"
    finally:
        srv.close()
