"""Triton's bidirectional ModelStreamInfer (runtime/serving/grpc/stream.py) end to end: Triton's
own client (`start_stream` / `async_stream_infer`) against real `kiln serve` processes, answers
compared with unary ModelInfer and with ONNX Runtime run directly; no mocks.

- a stateless model: many requests on one stream, answered with their ids and the unary
  answers; a refused request and bytes that are not a request are answered with an
  error_message, and the stream goes on;
- the metrics: streamed requests counted with the same outcomes as unary ones;
- the bounds: at most 64 requests of a stream in flight (the rest wait unread), and a client
  that goes away cancels what it left in flight;
- the drain: what was read finishes, what comes after is refused, the stream ends UNAVAILABLE;
- the headline: a stateful RNN streamed step by step, server A SIGTERMed midway; the client
  reconnects to server B (the same Redis) and continues the sequence there, every step equal
  to the uninterrupted run.
"""

from __future__ import annotations

import json
import queue
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from kiln.runtime.serving.grpc import grpc_service_pb2 as pb
from kiln.runtime.serving.grpc.stream import DRAINING_MESSAGE, MAX_IN_FLIGHT

tritonclient = pytest.importorskip("tritonclient.grpc")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from support.sequence_models import (RNN_STATES, RedisServer, build_engine_for,  # noqa: E402
                                     redis_server_binary, rnn_model)
from support.triton import triton_inputs  # noqa: E402
from support.serving import NAME, Built, assert_matches, sample  # noqa: E402

pytestmark = pytest.mark.timeout(120)
needs_redis = pytest.mark.skipif(redis_server_binary() is None,
                                 reason="needs redis-server (make redis)")
# What the dataplane answers a request that arrives while it drains (as over unary gRPC).
SHUTTING_DOWN = "the server is shutting down; retry on another replica"


# -- engines, servers, a stream ----------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("stream"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory, matmul_onnx):
    root = tmp_path_factory.mktemp("stream-engines")
    return root, {"rnn": build_engine_for(root, "rnn", rnn_model(), RNN_STATES).path,
                  "matmul": build_engine_for(root, "matmul", matmul_onnx).path}


class Kiln:
    """A `kiln serve` process serving HTTP and gRPC, ready."""

    def __init__(self, kiln_process, tmp_path: Path, name: str, cache: Path, rel: str,
                 runtime: dict | None = None):
        self.name = name
        self.p = kiln_process(["serve", "--model-name", name, "--cache-dir", str(cache),
                               "--engine", f"cpu={rel}", "--runtime-spec",
                               json.dumps(runtime or {}), "--host", "127.0.0.1", "--port", "0",
                               "--grpc-port", "0", "--drain-seconds", "10"], tmp_path)
        self.http = int(self.p.wait_for(r"(?<!gRPC )listening on 127\.0\.0\.1:(\d+)").group(1))
        grpc_port = self.p.wait_for(r"gRPC listening on 127\.0\.0\.1:(\d+)").group(1)
        self.grpc = f"127.0.0.1:{grpc_port}"
        with tritonclient.InferenceServerClient(self.grpc) as c:
            deadline = time.monotonic() + 30
            while not c.is_model_ready(name):
                assert time.monotonic() < deadline, "\n".join(self.p.lines)
                time.sleep(0.05)

    def metric(self, name: str, **labels) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def wait_metric(self, name: str, want: float, timeout: float = 20, **labels) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name, **labels) != want:
            assert time.monotonic() < deadline, (name, labels, self.metric(name, **labels), want)
            time.sleep(0.02)


class Stream:
    """tritonclient's stream: `start_stream` with a callback that queues each answer."""

    def __init__(self, address: str, headers: dict | None = None):
        self.client = tritonclient.InferenceServerClient(address)
        self.answers: queue.Queue = queue.Queue()
        self.client.start_stream(lambda result, error: self.answers.put((result, error)),
                                 headers=headers)

    def send(self, model: str, inputs: dict[str, np.ndarray], **kw) -> None:
        self.client.async_stream_infer(model, triton_inputs(inputs), **kw)

    def next(self, timeout: float = 20):
        """(InferResult, None) or (None, InferenceServerException)."""
        return self.answers.get(timeout=timeout)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def outputs(result) -> dict[str, np.ndarray]:
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def unary(address: str, model: str, inputs: dict[str, np.ndarray], **kw):
    """A unary ModelInfer: its outputs, or the InferenceServerException."""
    with tritonclient.InferenceServerClient(address) as c:
        try:
            return outputs(c.infer(model, triton_inputs(inputs), **kw))
        except InferenceServerException as e:
            return e


def too_wide(seed: int) -> dict[str, np.ndarray]:
    """A request the model refuses: features of 5 columns (it takes 4)."""
    inputs = sample(1, seed)
    inputs["features"] = np.zeros((1, 5), np.float32)
    return inputs


# -- a stateless model -------------------------------------------------------------------

def test_a_stream_answers_every_request_with_its_id_and_the_unary_answer(built, tmp_path,
                                                                       kiln_process):
    server = Kiln(kiln_process, tmp_path, NAME, built.cache, built.rel)
    refusal = unary(server.grpc, NAME, too_wide(0))
    assert isinstance(refusal, InferenceServerException)
    stream = Stream(server.grpc)
    sent = {f"r{i}": sample(1 + i % 4, seed=i) for i in range(48)}
    for i, (request_id, inputs) in enumerate(sent.items()):
        if i == 24:  # a bad one in the middle: answered, and the stream goes on
            stream.send(NAME, too_wide(0), request_id="bad")
        stream.send(NAME, inputs, request_id=request_id)
    answered, errors = {}, []
    for _ in range(len(sent) + 1):
        result, error = stream.next()
        if error is not None:
            errors.append(error)
        else:
            answered[result.get_response().id] = outputs(result)
    assert [e.message() for e in errors] == [refusal.message()]
    assert set(answered) == set(sent)
    for request_id, inputs in sent.items():
        want = unary(server.grpc, NAME, inputs)
        assert_matches(answered[request_id], want)
        assert_matches(answered[request_id], built.expected(inputs))
    stream.close()

    # The aio client's stream_infer: the same stream, an async iterator each way.
    import asyncio

    import tritonclient.grpc.aio as aio

    async def aio_stream() -> dict[str, dict[str, np.ndarray]]:
        async def requests():
            for request_id in list(sent)[:8]:
                yield {"model_name": NAME, "inputs": triton_inputs(sent[request_id]),
                       "request_id": request_id}

        async with aio.InferenceServerClient(server.grpc) as client:
            got = {}
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                got[result.get_response().id] = outputs(result)
                if len(got) == 8:
                    break
            return got

    aio_answered = asyncio.run(aio_stream())
    assert set(aio_answered) == set(list(sent)[:8])
    for request_id, got in aio_answered.items():
        assert_matches(got, answered[request_id])


def test_bytes_that_are_not_a_request_are_answered_and_the_stream_goes_on(built, tmp_path,
                                                                        kiln_process):
    """Kiln's own messages over a raw stream: a refusal's answer names its request's id."""
    server = Kiln(kiln_process, tmp_path, NAME, built.cache, built.rel)

    def request(request_id: str, inputs: dict[str, np.ndarray]) -> bytes:
        message = pb.ModelInferRequest(model_name=NAME, id=request_id)
        for name, array in inputs.items():
            message.inputs.add(name=name, shape=list(array.shape),
                               datatype={np.float32: "FP32", np.int64: "INT64"}[array.dtype.type])
            message.raw_input_contents.append(array.tobytes())
        return message.SerializeToString()

    garbage = b"\xff\xff\xff"
    no_model = pb.ModelInferRequest(model_name="nope", id="who").SerializeToString()
    sent = [request("a", sample(2, 1)), garbage, request("bad", too_wide(2)),
            request("b", sample(3, 3)), no_model]
    with grpc.insecure_channel(server.grpc) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                     request_serializer=None,
                                     response_deserializer=pb.ModelStreamInferResponse.FromString)
        answers = list(call(iter(sent), timeout=20))
    assert len(answers) == len(sent)
    by_id = {a.infer_response.id: a for a in answers}
    for request_id, inputs in (("a", sample(2, 1)), ("b", sample(3, 3))):
        response = by_id[request_id].infer_response
        assert by_id[request_id].error_message == ""
        got = {o.name: np.frombuffer(raw, {"FP32": np.float32, "INT64": np.int64}[o.datatype])
               .reshape(list(o.shape))
               for o, raw in zip(response.outputs, response.raw_output_contents)}
        assert_matches(got, built.expected(inputs))
    assert by_id["bad"].error_message == unary(server.grpc, NAME, too_wide(2)).message()
    assert by_id["bad"].infer_response.model_name == NAME
    assert by_id["who"].error_message.startswith("unknown model 'nope'")
    assert by_id[""].error_message == (
        "the message is not a valid inference.ModelInferRequest: protobuf cannot parse its "
        "3 bytes (malformed, cut short, or a string that is not UTF-8)")


def test_the_proto_streams_as_tritons_does():
    from tritonclient.grpc import service_pb2 as triton

    def stream_method(descriptor):
        return descriptor.services_by_name["GRPCInferenceService"].methods_by_name[
            "ModelStreamInfer"]

    mine, theirs = stream_method(pb.DESCRIPTOR), stream_method(triton.DESCRIPTOR)
    assert (mine.client_streaming, mine.server_streaming) == (True, True)
    assert (theirs.client_streaming, theirs.server_streaming) == (True, True)


def test_steps_of_a_sequence_run_in_order_and_the_rest_concurrently():
    """The one test of stream.py alone, on a real grpc.aio server and tritonclient: its
    per-request function answers later steps faster, which the dataplane never does (so the
    order it keeps cannot be seen from outside). A sequence's steps still begin and end in
    the order sent; requests of other sequences, or of none, overlap."""
    import asyncio
    import threading

    from kiln.runtime.serving.grpc.stream import ModelStreamInfer

    began: list[str] = []

    async def later_steps_are_faster(request, metadata):
        began.append(request.id)
        await asyncio.sleep(0.05 * (5 - int(request.id.rsplit("-", 1)[1])))
        return pb.ModelInferResponse(model_name=request.model_name, id=request.id)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(
            ModelStreamInfer(later_steps_are_faster, asyncio.Event()).handle,
            response_serializer=lambda message: message.SerializeToString())
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelStreamInfer": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        stream = Stream(f"127.0.0.1:{port}")
        started = time.monotonic()
        for i in range(5):
            for seq in ("p", "q"):
                stream.send("m", {"x": np.zeros((1, 1), np.float32)}, request_id=f"{seq}-{i}",
                            sequence_id=seq, sequence_start=(i == 0))
            stream.send("m", {"x": np.zeros((1, 1), np.float32)}, request_id=f"none-{i}")
        ended = [stream.next()[0].get_response().id for _ in range(15)]
        took = time.monotonic() - started
        stream.close()
        for seq in ("p", "q"):
            order = [f"{seq}-{i}" for i in range(5)]
            assert [r for r in began if r.startswith(seq)] == order
            assert [r for r in ended if r.startswith(seq)] == order
        assert [r for r in ended if r.startswith("none")] == [f"none-{i}" for i in (4, 3, 2, 1, 0)]
        assert took < 1.2, took  # one sequence's 0.75 s, not the 2.25 s of all in a row
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


# -- the metrics -------------------------------------------------------------------------

def test_streamed_requests_are_counted_with_the_unary_outcomes(built, tmp_path, kiln_process):
    server = Kiln(kiln_process, tmp_path, NAME, built.cache, built.rel)
    requests = [sample(1, 1), too_wide(1), sample(2, 2), sample(3, 3), too_wide(2)]

    def counts() -> tuple[float, float, float]:
        return (server.metric("kiln_requests_total", model=NAME, outcome="success"),
                server.metric("kiln_requests_total", model=NAME, outcome="bad_request"),
                server.metric("kiln_request_duration_seconds_count", model=NAME))

    for inputs in requests:
        unary(server.grpc, NAME, inputs)
    assert unary(server.grpc, "nope", sample(1)).status() == "StatusCode.NOT_FOUND"
    after_unary = counts()
    assert after_unary == (3.0, 2.0, 5.0)

    stream = Stream(server.grpc)
    for inputs in requests:
        stream.send(NAME, inputs)
    stream.send("nope", sample(1))  # no model: counted by neither door
    got = [stream.next() for _ in range(len(requests) + 1)]
    assert sum(error is not None for _, error in got) == 3
    stream.close()
    assert counts() == tuple(2 * n for n in after_unary)


# -- the bounds --------------------------------------------------------------------------

def test_a_stream_holds_at_most_64_requests_and_a_client_that_leaves_cancels_them(
        engines, tmp_path, kiln_process):
    """Batches wait 1.5 s for more rows: the queue shows what the stream let in."""
    root, rels = engines
    server = Kiln(kiln_process, tmp_path, "matmul", root / "cache", rels["matmul"],
                  {"batching": {"maxBatchSize": 256, "maxQueueDelayMicroseconds": 1_500_000}})
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    stream = Stream(server.grpc)
    sent = {f"r{i}": np.full((1, 8), i, np.float32) for i in range(100)}
    for request_id, x in sent.items():
        stream.send("matmul", {"x": x}, request_id=request_id)
    server.wait_metric("kiln_queue_depth", MAX_IN_FLIGHT, model="matmul")
    time.sleep(0.3)  # the other 36 stay unread, not queued
    assert server.metric("kiln_queue_depth", model="matmul") == MAX_IN_FLIGHT
    answered = {}
    for _ in sent:
        result, error = stream.next()
        assert error is None, error
        answered[result.get_response().id] = result.as_numpy("y")
    assert set(answered) == set(sent)
    for request_id, x in sent.items():
        np.testing.assert_allclose(answered[request_id], x @ w, rtol=1e-6)
    stream.close()
    assert server.metric("kiln_requests_total", model="matmul", outcome="success") == 100

    leaving = Stream(server.grpc)
    for i in range(3):
        leaving.send("matmul", {"x": sent[f"r{i}"]})
    server.wait_metric("kiln_queue_depth", 3, model="matmul")
    leaving.close(cancel=True)
    server.wait_metric("kiln_requests_total", 3, model="matmul", outcome="cancelled")
    assert server.metric("kiln_queue_depth", model="matmul") == 0
    assert server.metric("kiln_requests_total", model="matmul", outcome="success") == 100


# -- the drain ---------------------------------------------------------------------------

def test_a_draining_server_answers_what_it_read_refuses_the_rest_then_ends_the_stream(
        engines, tmp_path, kiln_process):
    root, rels = engines
    server = Kiln(kiln_process, tmp_path, "matmul", root / "cache", rels["matmul"],
                  {"batching": {"maxBatchSize": 256, "maxQueueDelayMicroseconds": 3_000_000}})
    x = np.ones((1, 8), np.float32)
    stream = Stream(server.grpc)
    stream.send("matmul", {"x": x}, request_id="read")
    server.wait_metric("kiln_queue_depth", 1, model="matmul")
    server.p.proc.send_signal(signal.SIGTERM)
    server.p.wait_for(r"draining: 1 request\(s\) in flight")
    stream.send("matmul", {"x": x}, request_id="late")
    result, error = stream.next()
    assert result is None and error.message() == SHUTTING_DOWN
    assert server.metric("kiln_requests_total", model="matmul", outcome="unavailable") == 1
    result, error = stream.next()
    assert error is None and result.get_response().id == "read"
    np.testing.assert_allclose(result.as_numpy("y"), x @ np.arange(32, dtype=np.float32)
                               .reshape(8, 4))
    result, error = stream.next()
    assert result is None
    assert (error.status(), error.message()) == ("StatusCode.UNAVAILABLE", DRAINING_MESSAGE)
    stream.close()
    assert server.p.proc.wait(15) == 0


# -- the headline: a sequence across a SIGTERM ---------------------------------------------

@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def rnn_x(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal((1, 8)).astype(np.float32)


def reference_rnn(steps: int) -> list[np.ndarray]:
    """The uninterrupted run, straight through ONNX Runtime."""
    import onnxruntime as ort

    session = ort.InferenceSession(rnn_model(), providers=["CPUExecutionProvider"])
    h = np.zeros((1, 32), dtype=np.float32)
    out = []
    for i in range(steps):
        h, y = session.run(["h_next", "y"], {"x": rnn_x(i), "h": h})
        out.append(y)
    return out


def step(stream: Stream, seq: str, i: int, last: int) -> np.ndarray:
    """Step i of sequence `seq`, waited for: y."""
    stream.send("rnn", {"x": rnn_x(i)}, request_id=f"{seq}-{i}", sequence_id=seq,
                sequence_start=(i == 0), sequence_end=(i == last))
    result, error = stream.next()
    assert error is None, error
    assert result.get_response().id == f"{seq}-{i}"
    return result.as_numpy("y")


@needs_redis
def test_a_sequence_streamed_across_a_sigterm_continues_on_another_server(
        engines, redis_server, tmp_path, kiln_process):
    root, rels = engines
    runtime = {"sequences": {"states": RNN_STATES,
                             "store": {"type": "redis", "address": redis_server.address}}}
    steps, cut = 25, 9
    tenant = {"kiln-tenant": "acme"}
    a = Kiln(kiln_process, tmp_path, "rnn", root / "cache", rels["rnn"], runtime)

    # Two sequences sent whole, without waiting, interleaved on one stream: each runs in
    # the order it was sent, whatever the other does.
    stream = Stream(a.grpc, tenant)
    for i in range(steps):
        for seq in ("p", "q"):
            stream.send("rnn", {"x": rnn_x(i)}, request_id=f"{seq}-{i}", sequence_id=seq,
                        sequence_start=(i == 0), sequence_end=(i == steps - 1))
    answered = {}
    for _ in range(2 * steps):
        result, error = stream.next()
        assert error is None, error
        answered[result.get_response().id] = result.as_numpy("y")
    uninterrupted = [answered[f"p-{i}"] for i in range(steps)]
    assert all(np.array_equal(answered[f"q-{i}"], y) for i, y in enumerate(uninterrupted))
    for got, want in zip(uninterrupted, reference_rnn(steps)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # The sequence to cut, step by step; another tenant cannot continue it.
    head = [step(stream, "cut", i, steps - 1) for i in range(cut)]
    stranger = Stream(a.grpc, {"kiln-tenant": "mallory"})
    stranger.send("rnn", {"x": rnn_x(cut)}, sequence_id="cut")
    result, error = stranger.next()
    assert result is None and "no such sequence 'cut'" in error.message()
    stranger.close()

    a.p.proc.send_signal(signal.SIGTERM)
    result, error = stream.next()
    assert result is None
    assert (error.status(), error.message()) == ("StatusCode.UNAVAILABLE", DRAINING_MESSAGE)
    stream.close()
    assert a.p.proc.wait(15) == 0

    # Server B, the same store: the client reconnects and goes on where it was.
    b = Kiln(kiln_process, tmp_path, "rnn", root / "cache", rels["rnn"], runtime)
    stream = Stream(b.grpc, tenant)
    tail = [step(stream, "cut", i, steps - 1) for i in range(cut, steps)]
    stream.close()
    assert len(head + tail) == steps
    for i, (got, want) in enumerate(zip(head + tail, uninterrupted)):
        assert got.tobytes() == want.tobytes() and got.dtype == want.dtype, i
