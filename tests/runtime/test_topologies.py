"""The doors in every topology `kiln serve` chooses: one process (fewer than 3 CPUs, what
CI's 2 cores pick by default), and front-end processes before several engine processes
(what every production pod with more CPUs runs), forced by their flags.

Large JSON in and out, binary tensors, gRPC and its stream, on real `kiln serve` processes
over real sockets, every answer compared with ONNX Runtime run directly; and every code path
that starts a process from inside a front end (the JSON worker's, for a request and for an
answer), with what a user sees when that process dies. The activator's forwarding runs on
both topologies in tests/activator/test_activator.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.serving.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request

from support.metrics import wait_for_metric
from support.serving import (NAME, TOPOLOGIES, Built, ServeProcess, ServerThread, assert_matches,
                             build_cpu_engine, children, json_inputs, neg_model, sample, serve_in)

tritonclient = pytest.importorskip("tritonclient.grpc")
from support.triton import triton_inputs  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# One 224x224 RGB image, as a v2 JSON request carries it: 150,528 numbers each way, over
# both the decoding threshold (1 MiB of JSON) and the encoding one (64K elements).
IMAGE = 3 * 224 * 224
MAX_BODY = 64 << 20


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("topologies"))


@pytest.fixture(scope="module")
def image_model(tmp_path_factory) -> tuple[Path, str]:
    """y = -x for one flattened image a row: (its cache, its entry)."""
    root = tmp_path_factory.mktemp("image")
    return root / "cache", build_cpu_engine(root, NAME, neg_model(IMAGE))


@pytest.fixture(scope="module", params=TOPOLOGIES)
def server(request, built):
    srv = serve_in(request.param, built.cache, {"cpu": built.rel})
    yield srv
    srv.close()


@pytest.fixture(scope="module", params=TOPOLOGIES)
def image_server(request, image_model):
    cache, rel = image_model
    srv = serve_in(request.param, cache, {"cpu": rel}, {"batching": {"maxBatchSize": 4}},
                   max_body_bytes=MAX_BODY)
    yield srv
    srv.close()


def image_request(rows: int, seed: int) -> tuple[bytes, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((rows, IMAGE)).astype(np.float32)
    doc = {"inputs": [{"name": "x", "shape": [rows, IMAGE], "datatype": "FP32",
                       "data": x.reshape(-1).tolist()}]}
    return json.dumps(doc).encode(), x


def assert_negated(answer: tuple, x: np.ndarray) -> None:
    status, _, doc = answer
    assert status == 200, doc
    got = np.asarray(doc["outputs"][0]["data"], np.float32).reshape(x.shape)
    np.testing.assert_array_equal(got, -x)


# -- the doors ---------------------------------------------------------------------------

def test_large_json_in_and_out_is_answered_while_liveness_answers(image_server):
    """150,528 numbers in, as many out: decoded and encoded off the event loop (in the
    front end's own worker process there), the answer right, and liveness answers meanwhile."""
    body, x = image_request(2, seed=3)
    answers: list = []
    sender = threading.Thread(target=lambda: answers.append(image_server.infer(body)))
    sender.start()
    live = 0
    while sender.is_alive():
        assert image_server.get("/v2/health/live")[0] == 200
        live += 1
    sender.join()
    assert_negated(answers[0], x)
    assert live >= 1
    # Each front end decodes with a worker of its own: several at once are all answered.
    many = [image_request(1, seed) for seed in range(6)]
    with_threads: list = [None] * len(many)

    def send(i: int) -> None:
        with_threads[i] = image_server.infer(many[i][0])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(many))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (_, x), answer in zip(many, with_threads):
        status, headers, doc = answer
        if status == 429:  # past one server's bound: told to come back, never a 500
            assert "too many large JSON requests" in doc["error"] and "Retry-After" in headers
            continue
        assert_negated(answer, x)
    assert sum(a[0] == 200 for a in with_threads) >= 1


def test_binary_tensors_in_and_out(server, built):
    inputs = sample(5, seed=11)
    body, json_length = encode_infer_request(inputs, binary=True, binary_outputs=True)
    status, headers, raw = server.request(
        "POST", f"/v2/models/{NAME}/infer", body,
        {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(json_length)})
    assert status == 200, raw
    answer = decode_infer_response(raw, int(headers[HEADER_LENGTH]))
    assert_matches({o["name"]: o["data"] for o in answer["outputs"]}, built.expected(inputs))


def test_inputs_the_engine_refuses_are_a_400_counted_as_refused(server):
    inputs = json_inputs(sample(1))
    inputs[1]["data"] = [0, 1, 99]  # an id outside the embedding: the engine refuses it
    before = server.metric("kiln_requests_total", model=NAME, outcome="refused") or 0
    status, _, doc = server.infer({"inputs": inputs})
    assert status == 400 and doc["error"].startswith("ONNX Runtime refused the inputs: "), doc
    refused = sample(1)
    refused["token_ids"][:] = 99
    with tritonclient.InferenceServerClient(server.grpc_address) as client:  # the same over gRPC
        with pytest.raises(tritonclient.InferenceServerException) as e:
            client.infer(NAME, triton_inputs(refused))
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message().startswith("ONNX Runtime refused the inputs: "), e.value.message()
    wait_for_metric(server.url, "kiln_requests_total", {"model": NAME, "outcome": "refused"},
                    lambda n: n == before + 2)


def test_grpc_unary_and_stream(server, built):
    inputs = [sample(3, seed=s) for s in range(4)]
    with tritonclient.InferenceServerClient(server.grpc_address) as client:
        result = client.infer(NAME, triton_inputs(inputs[0]))
        assert_matches({o: result.as_numpy(o) for o in ("scores", "label", "pooled")},
                       built.expected(inputs[0]))
        answers: dict = {}
        done = threading.Event()

        def callback(result, error):
            answers[result.get_response().id if result else "error"] = result or error
            if len(answers) == len(inputs):
                done.set()

        client.start_stream(callback=callback)
        for i, each in enumerate(inputs):
            client.async_stream_infer(NAME, triton_inputs(each), request_id=f"r{i}")
        assert done.wait(30), answers
        client.stop_stream()
    for i, each in enumerate(inputs):
        result = answers[f"r{i}"]
        assert_matches({o: result.as_numpy(o) for o in ("scores", "label", "pooled")},
                       built.expected(each))


def test_a_client_that_leaves_mid_answer_is_counted_cancelled_not_an_error(image_server):
    """A large answer written in chunks to a client that resets the connection after its
    first bytes: counted `cancelled`, never `error` (nor logged as a failure)."""
    body, _ = image_request(4, seed=5)  # 602,112 numbers back: over 6 MB of JSON
    before = {o: image_server.metric("kiln_requests_total", model=NAME, outcome=o) or 0
              for o in ("cancelled", "error")}
    for _ in range(3):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # the answer cannot all be sent
            sock.settimeout(20)
            sock.connect(("127.0.0.1", image_server.port))
            sock.sendall(f"POST /v2/models/{NAME}/infer HTTP/1.1\r\nHost: x\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
    wait_for_metric(image_server.url, "kiln_requests_total", {"model": NAME, "outcome": "cancelled"},
                    lambda n: n == before["cancelled"] + 3)
    assert (image_server.metric("kiln_requests_total", model=NAME, outcome="error") or 0) == before["error"]
    assert image_server.get("/v2/health/ready")[0] == 200


# -- the processes a front end starts ----------------------------------------------------

def parents(pid: int) -> dict[int, list[int]]:
    """The children of `pid` that have children of their own, with theirs."""
    return {c: kids for c in children(pid) if (kids := children(c))}


def test_a_front_ends_json_worker_is_its_own_and_dies_with_it(image_model):
    """The one process a front end starts: its JSON worker, for a large request and for a
    large answer. Killed, the front end's next large request is a clear 503 and the one
    after is answered by a new worker; a front end killed takes its worker with it."""
    cache, rel = image_model
    srv = ServeProcess(cache, {"cpu": rel}, {"batching": {"maxBatchSize": 4}},
                       max_body_bytes=MAX_BODY, workers=2, engine_processes=2)
    body, x = image_request(1, seed=1)
    # A large answer to a small request: also the worker's.
    zeros = np.zeros((1, IMAGE), np.float32)
    small = json.dumps({"inputs": [{"name": "x", "shape": [1, IMAGE], "datatype": "FP32",
                                    "data": [0] * IMAGE}]}).encode()

    def until_every_front_end_has_a_worker(first_answers: set[int]) -> dict[int, list[int]]:
        """Send large requests until both front ends have a JSON worker; each answer is
        right, or (a front end's first after its worker was killed) in `first_answers`."""
        deadline = time.monotonic() + 60
        while len(workers := parents(srv.process.proc.pid)) < 2:
            for request, want in ((body, x), (small, zeros)):
                status, _, doc = answer = srv.infer(request)
                if status == 503 and 503 in first_answers:
                    assert "the JSON worker process stopped" in doc["error"], doc
                    first_answers.discard(503)
                    continue
                assert_negated(answer, want)
            assert time.monotonic() < deadline, workers
        assert all(len(kids) == 1 for kids in workers.values()), workers
        return workers

    try:
        workers = until_every_front_end_has_a_worker(set())
        for (worker,) in workers.values():
            os.kill(worker, signal.SIGKILL)
        status, _, doc = srv.infer(body)
        assert status == 503 and "the JSON worker process stopped" in doc["error"], doc
        replaced = until_every_front_end_has_a_worker({503})
        assert not set(sum(replaced.values(), [])) & set(sum(workers.values(), []))

        front_end, (worker,) = next(iter(replaced.items()))
        os.kill(front_end, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(worker) not in ("gone", "Z"):
            assert time.monotonic() < deadline, "the JSON worker outlived its front end"
            time.sleep(0.05)
        # The engine starts it again (connections queued on the dead one's socket are reset:
        # SO_REUSEPORT); once it listens, both answer as before.
        deadline = time.monotonic() + 30
        while sum("rest.server: listening on" in line for line in list(srv.process.lines)) < 3:
            assert time.monotonic() < deadline, "\n".join(srv.process.lines)
            time.sleep(0.05)
        until_every_front_end_has_a_worker(set())
    finally:
        srv.close()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# -- an unexpected failure ---------------------------------------------------------------

def test_an_unexpected_failure_is_a_500_with_a_request_id_and_no_exception_text(
        built, monkeypatch, caplog):
    """A bug (here an encoder that raises, put in by the test): the client gets 500 (gRPC
    INTERNAL) with a request id and none of the exception's text; the log has the
    traceback under that id."""
    from kiln.runtime.serving import protocol
    from kiln.runtime.serving.grpc import endpoint

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals at /var/lib/kiln")

    srv = ServerThread(built.cache, {"cpu": built.rel}, grpc_port=0)
    try:
        assert srv.wait_loaded(), srv.model.status_message()
        monkeypatch.setattr(protocol, "encode_infer_response", broken)
        monkeypatch.setattr(endpoint, "encode_response", broken)
        with caplog.at_level(logging.ERROR):
            status, _, doc = srv.infer({"inputs": json_inputs(sample(1))})
            with tritonclient.InferenceServerClient(srv.grpc_address) as client:
                with pytest.raises(tritonclient.InferenceServerException) as grpc_error:
                    client.infer(NAME, triton_inputs(sample(1)))
        assert status == 500 and "secret" not in doc["error"], doc
        assert doc["error"].startswith("internal error (request id "), doc
        assert grpc_error.value.status() == "StatusCode.INTERNAL"
        assert "secret" not in grpc_error.value.message()
        for answer in (doc["error"], grpc_error.value.message()):
            request_id = answer.split("request id ")[1].split(")")[0]
            logged = [r for r in caplog.records if request_id in r.getMessage()]
            assert logged and "secret internals" in str(logged[0].exc_info[1]), answer
        assert srv.metric("kiln_requests_total", model=NAME, outcome="error") == 2
    finally:
        srv.close()
