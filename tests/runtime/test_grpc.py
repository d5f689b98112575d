"""The v2 gRPC endpoint end to end: Triton's own client (tritonclient.grpc) against a real
InferenceServer serving support.serving's real ONNX model, answers compared with ONNX Runtime
run directly; the same dataplane as HTTP (batching across both, one set of metrics, the
same messages); no mocks.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kiln.runtime.serving.grpc import grpc_service_pb2 as pb

tritonclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from support.metrics import wait_for_metric  # noqa: E402
from support.triton import triton_inputs
from support.serving import NAME, Built, ServerThread, assert_matches, json_inputs, sample  # noqa: E402

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("grpc"))


@pytest.fixture(scope="module")
def server(built):
    srv = ServerThread(built.cache, {"cpu": built.rel}, grpc_port=0)
    assert srv.wait_loaded(), srv.model.status_message()
    yield srv
    srv.close()


def client(srv: ServerThread) -> "tritonclient.InferenceServerClient":
    return tritonclient.InferenceServerClient(srv.server.grpc_address)


def infer(srv: ServerThread, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
          **kw) -> dict[str, np.ndarray]:
    with client(srv) as c:
        result = c.infer(NAME, triton_inputs(inputs), outputs=None if outputs is None else
                         [tritonclient.InferRequestedOutput(o) for o in outputs], **kw)
        names = outputs or [o.name for o in result.get_response().outputs]
        return {n: result.as_numpy(n) for n in names}


def refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# -- the stubs ---------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None,
                    reason="grpcio-tools (dev only) is not installed")
def test_committed_stubs_match_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_grpc", REPO / "hack" / "gen_grpc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for path in gen.generate(tmp_path):
        committed = REPO / "runtime" / "serving" / "grpc" / path.name
        assert path.read_text() == committed.read_text(), (
            f"runtime/serving/grpc/{path.name} is stale: run python hack/gen_grpc.py")


def model_infer(channel: grpc.Channel):
    """ModelInfer with Kiln's own messages (tritonclient would refuse a malformed request
    before sending it)."""
    return channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               request_serializer=pb.ModelInferRequest.SerializeToString,
                               response_deserializer=pb.ModelInferResponse.FromString)


def _fields(desc) -> dict:
    return {f.name: (f.number, f.type, f.is_repeated,
                     f.message_type.full_name if f.message_type else None)
            for f in desc.fields}


def test_the_proto_has_tritons_names_and_numbers():
    """Every message and method Kiln defines is Triton's (the wire format tritonclient
    uses), field for field; the stubs live in their own pool beside Triton's."""
    from tritonclient.grpc import service_pb2 as triton

    def compare(mine, theirs):
        assert mine.full_name == theirs.full_name
        assert _fields(mine) == _fields(theirs), mine.full_name
        for nested in mine.nested_types:
            compare(nested, theirs.nested_types_by_name[nested.name])
        assert [o.name for o in mine.oneofs] == [o.name for o in theirs.oneofs]

    for name, desc in pb.DESCRIPTOR.message_types_by_name.items():
        compare(desc, triton.DESCRIPTOR.message_types_by_name[name])
    mine = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert mine.full_name == "inference.GRPCInferenceService"
    for method in mine.methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == \
            (other.input_type.full_name, other.output_type.full_name)


# -- health, metadata, inference ---------------------------------------------------------

def test_health_and_metadata(server):
    with client(server) as c:
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready(NAME) and c.is_model_ready(NAME, "1")
        assert c.get_server_metadata(as_json=True)["name"] == "kiln"
        meta = c.get_model_metadata(NAME, as_json=True)
    assert meta["name"] == NAME and meta["versions"] == ["1"]
    assert meta["platform"] == server.model.platform
    # The HTTP metadata, tensor for tensor (proto3's JSON writes int64 as strings).
    _, _, http = server.get(f"/v2/models/{NAME}")
    for kind in ("inputs", "outputs"):
        assert [{**t, "shape": [int(d) for d in t["shape"]]} for t in meta[kind]] == http[kind]


def test_infer_matches_onnxruntime(server, built):
    inputs = sample(3, seed=1)
    assert_matches(infer(server, inputs), built.expected(inputs))
    # Output selection, in the order asked.
    got = infer(server, inputs, ["label", "scores"], request_id="r-1")
    assert list(got) == ["label", "scores"]
    np.testing.assert_array_equal(got["label"], built.expected(inputs)["label"])


def test_typed_contents_and_raw_outputs(server, built):
    """The typed path (fp32_contents, int64_contents), with Kiln's own stubs."""
    inputs = sample(2, seed=4)
    request = pb.ModelInferRequest(model_name=NAME, id="typed")
    f = request.inputs.add(name="features", datatype="FP32", shape=[2, 4])
    f.contents.fp32_contents.extend(inputs["features"].reshape(-1).tolist())
    t = request.inputs.add(name="token_ids", datatype="INT64", shape=[2, 3])
    t.contents.int64_contents.extend(inputs["token_ids"].reshape(-1).tolist())
    with grpc.insecure_channel(server.server.grpc_address) as channel:
        response = model_infer(channel)(request, timeout=20)
    assert (response.model_name, response.model_version, response.id) == (NAME, "1", "typed")
    outputs = {o.name: np.frombuffer(raw, dtype={"FP32": "<f4", "INT64": "<i8"}[o.datatype])
               .reshape(list(o.shape)) for o, raw in zip(response.outputs,
                                                         response.raw_output_contents)}
    assert_matches(outputs, built.expected(inputs))


def test_grpc_and_http_requests_are_batched_together(built):
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 300_000}}
    srv = ServerThread(built.cache, {"cpu": built.rel}, runtime, grpc_port=0)
    try:
        assert srv.wait_loaded()
        batches = srv.metric("kiln_batch_size_count", model=NAME)
        answers: dict[int, tuple[dict, dict]] = {}

        def send(i: int) -> None:
            inputs = sample(1 + i % 2, seed=10 + i)
            if i % 2:
                got = infer(srv, inputs)
            else:
                status, _, doc = srv.infer({"inputs": json_inputs(inputs)})
                assert status == 200, doc
                got = {o["name"]: np.asarray(o["data"], dtype=o["datatype"] == "FP32"
                                             and np.float32 or np.int64).reshape(o["shape"])
                       for o in doc["outputs"]}
            answers[i] = got, built.expected(inputs)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(answers) == 8
        for got, want in answers.values():
            assert_matches(got, want)
        # 8 requests, 12 rows, in (almost always) one batch: never one batch each.
        assert srv.metric("kiln_batch_size_count", model=NAME) - batches < 4
        assert srv.metric("kiln_requests_total", model=NAME, outcome="success") == 8
    finally:
        srv.close()


# -- refusals: the HTTP messages, the gRPC codes -------------------------------------------

def test_unknown_model_and_version_are_not_found(server):
    with client(server) as c:
        e = refused(lambda: c.infer("nope", triton_inputs(sample(1))))
        assert e.status() == "StatusCode.NOT_FOUND"
        _, _, http = server.infer({"inputs": json_inputs(sample(1))}, "/v2/models/nope/infer")
        assert e.message() == http["error"]
        e = refused(lambda: c.get_model_metadata(NAME, "7"))
        assert e.status() == "StatusCode.NOT_FOUND"
        assert e.message() == f"model '{NAME}' has no version '7'; it serves version '1'"
        assert refused(lambda: c.is_model_ready("nope")).status() == "StatusCode.NOT_FOUND"


def test_bad_requests_are_invalid_argument_with_the_http_message(server):
    cases = [
        {"features": np.zeros((1, 5), np.float32), "token_ids": np.zeros((1, 3), np.int64)},
        {"features": np.zeros((2, 4), np.float32), "token_ids": np.zeros((3, 3), np.int64)},
        {"features": np.zeros((1, 4), np.float32)},
        {"features": np.zeros((1, 4, 1), np.float32), "token_ids": np.zeros((1, 3), np.int64)},
    ]
    with client(server) as c:
        for inputs in cases:
            e = refused(lambda: c.infer(NAME, triton_inputs(inputs)))
            status, _, http = server.infer({"inputs": json_inputs(inputs)})
            assert status == 400
            assert (e.status(), e.message()) == ("StatusCode.INVALID_ARGUMENT", http["error"])
        # The wrong datatype: FP64 features.
        inputs = {"features": np.zeros((1, 4), np.float64),
                  "token_ids": np.zeros((1, 3), np.int64)}
        i = tritonclient.InferInput("features", [1, 4], "FP64")
        i.set_data_from_numpy(inputs["features"])
        e = refused(lambda: c.infer(NAME, [i, *triton_inputs({"token_ids": inputs["token_ids"]})]))
        assert e.status() == "StatusCode.INVALID_ARGUMENT"
        assert e.message() == "input 'features' has datatype FP64 but the model expects FP32"
        e = refused(lambda: c.infer(NAME, triton_inputs(sample(1)),
                                    outputs=[tritonclient.InferRequestedOutput("nope")]))
        assert e.message() == ("unknown output 'nope'; the model's outputs are: "
                               "scores, label, pooled")
    assert server.metric("kiln_requests_total", model=NAME, outcome="bad_request") >= 6


def test_raw_contents_of_the_wrong_size(server):
    request = pb.ModelInferRequest(model_name=NAME)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 4])
    request.inputs.add(name="token_ids", datatype="INT64", shape=[1, 3])
    request.raw_input_contents.extend([b"\0" * 16, b"\0" * 23])
    with grpc.insecure_channel(server.server.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            model_infer(channel)(request, timeout=20)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == ("input 'token_ids': raw_input_contents[1] has 23 bytes "
                                        "but shape [1, 3] of INT64 needs 24")
        del request.raw_input_contents[1]
        with pytest.raises(grpc.RpcError) as info:
            model_infer(channel)(request, timeout=20)
        assert info.value.details().startswith("the request has 2 inputs but 1 raw_input_contents")


def raw_call(channel: grpc.Channel, method: str):
    """A method of the service that sends and answers bytes as they are."""
    return channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                               request_serializer=None, response_deserializer=None)


# Bytes no message parses: a bad tag, a length past the end, groups nested past the limit.
NOT_PROTOBUF = [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0b" * 100_000]


def test_malformed_messages_are_invalid_argument_in_one_line(server, built, caplog):
    """Issue 19, item 5: bytes that are not the method's message are refused with
    INVALID_ARGUMENT on every RPC, one short log line each, no traceback."""
    caplog.set_level("INFO")
    valid = pb.ModelInferRequest(model_name=NAME, id="x").SerializeToString()
    # Every unary method (a stream answers such bytes on the stream: test_grpc_stream.py).
    cases = [(m.name, m.input_type.full_name, data)
             for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
             if not m.client_streaming for data in NOT_PROTOBUF]
    # A string field that is not UTF-8 (proto3 refuses it), and a message cut short.
    cases += [(method, f"inference.{method}Request", b"\x0a\x02\xc3\x28")
              for method in ("ModelReady", "ModelMetadata", "ModelInfer")]
    cases.append(("ModelInfer", "inference.ModelInferRequest", valid[:-1]))
    with grpc.insecure_channel(server.server.grpc_address) as channel:
        for method, message, data in cases:
            with pytest.raises(grpc.RpcError) as info:
                raw_call(channel, method)(data, timeout=20)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the message is not a valid {message}: protobuf cannot parse its "
                f"{len(data)} bytes (malformed, cut short, or a string that is not UTF-8)"), \
                (method, data[:20])
    assert [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()] == []
    mine = [r.getMessage() for r in caplog.records if r.name.startswith(("kiln", "grpc"))]
    assert len(mine) == len(cases) and all("\n" not in m and len(m) < 200 for m in mine), mine
    inputs = sample(2, seed=5)
    assert_matches(infer(server, inputs), built.expected(inputs))


def test_a_message_over_max_body_bytes_is_refused_by_grpc(server):
    inputs = sample(1)
    inputs["features"] = np.zeros((30_000, 4), np.float32)  # 480 KB > MAX_BODY (256 KiB)
    with client(server) as c:
        e = refused(lambda: c.infer(NAME, triton_inputs(inputs)))
    assert e.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_overload_is_resource_exhausted(built):
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 400_000,
                            "maxQueueSize": 1, "maxAdmissionWaitMilliseconds": 100}}
    srv = ServerThread(built.cache, {"cpu": built.rel}, runtime, grpc_port=0)
    try:
        assert srv.wait_loaded()
        answers: list = []

        def send() -> None:
            try:
                answers.append(infer(srv, sample(1)))
            except InferenceServerException as e:
                answers.append(e)
        senders = [threading.Thread(target=send) for _ in range(2)]
        senders[0].start()
        wait_for_metric(srv.url, "kiln_queue_depth", {"model": NAME}, lambda depth: depth == 1)
        senders[1].start()  # the queue's one place is taken
        for t in senders:
            t.join(10)
        errors = [a for a in answers if isinstance(a, InferenceServerException)]
        assert len(answers) == 2 and len(errors) == 1, answers
        assert errors[0].status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert errors[0].message() == (f"model '{NAME}' is overloaded: its queue is full and "
                                       f"no place freed up within 100 ms")
        assert srv.metric("kiln_requests_total", model=NAME, outcome="overloaded") == 1.0
    finally:
        srv.close()


def test_draining_is_unavailable_and_in_flight_requests_finish(built):
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 1_500_000}}
    srv = ServerThread(built.cache, {"cpu": built.rel}, runtime, grpc_port=0)
    try:
        assert srv.wait_loaded()
        inputs = sample(2, seed=3)
        result: list = []
        in_flight = threading.Thread(target=lambda: result.append(infer(srv, inputs)))
        in_flight.start()
        # Queued: the batch waits 1.5 s.
        wait_for_metric(srv.url, "kiln_queue_depth", {"model": NAME}, lambda depth: depth == 1)
        drained = asyncio.run_coroutine_threadsafe(srv.server.shutdown(5.0), srv.loop)
        time.sleep(0.2)
        with client(srv) as c:
            assert c.is_server_live() and not c.is_server_ready()
            assert not c.is_model_ready(NAME)
            e = refused(lambda: c.infer(NAME, triton_inputs(sample(1))))
        assert e.status() == "StatusCode.UNAVAILABLE"
        assert e.message() == "the server is shutting down; retry on another replica"
        in_flight.join(10)
        assert_matches(result[0], built.expected(inputs))
        assert drained.result(10) is True
        assert srv.metrics.registry.get_sample_value(
            "kiln_requests_total", {"model": NAME, "outcome": "unavailable"}) == 1.0
    finally:
        srv.loop.call_soon_threadsafe(srv.loop.stop)


def test_kiln_serve_serves_grpc_on_its_port(built, tmp_path, kiln_process):
    """`kiln serve` on its default event loop (uvloop when installed) with --grpc-port."""
    p = kiln_process(["serve", "--model-name", NAME, "--cache-dir", str(built.cache),
                      "--engine", f"cpu={built.rel}", "--host", "127.0.0.1", "--port", "0",
                      "--grpc-port", "0", "--drain-seconds", "2"], tmp_path)
    try:
        port = int(p.wait_for(r"gRPC listening on 127\.0\.0\.1:(\d+)").group(1))
        with tritonclient.InferenceServerClient(f"127.0.0.1:{port}") as c:
            deadline = time.monotonic() + 20
            while not c.is_model_ready(NAME):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            inputs = sample(2, seed=8)
            result = c.infer(NAME, triton_inputs(inputs))
            assert_matches({n: result.as_numpy(n) for n in built.expected(inputs)},
                           built.expected(inputs))
        p.stop()
    finally:
        p.stop()


def test_kiln_serve_grpc_flags(tmp_path):
    import subprocess
    import sys

    kiln = str(Path(sys.executable).parent / "kiln")
    proc = subprocess.run([kiln, "serve", "--model-name", "m", "--engine", "cpu=a/b/c",
                           "--port", "9000", "--grpc-port", "9000"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stderr.strip()) == (
        2, "kiln serve: --grpc-port and --port are both 9000")
