"""Property-based tests (Hypothesis) of the v2 endpoints against the real server (issue 11,
item 10: fuzzing in CI; issue 19, item 7: gRPC and the tenant headers).

One real `InferenceServer` per module (support.serving's ONNX model, real cache, real socket,
its own event loop in a thread), driven with http.client, and with raw sockets where the
bytes of the request itself are fuzzed. Strategies: arbitrary JSON values as the body
(recursive; integers past Python's int-str limit, NaN and infinities, deep nesting written
as raw literals); valid requests mutated field by field; the binary tensor extension with
arbitrary Inference-Header-Content-Length values, binary tails and binary_data_size values;
arbitrary bytes with arbitrary Content-Types; arbitrary methods and paths; arbitrary header
lines. For every example: no 5xx, and a 4xx has the body `{"error": "<string>"}` as JSON.
Every `CHECK_EVERY` examples, and after each test, a valid request (JSON and binary) must
still answer what ONNX Runtime computes directly on the same model.

Over gRPC, the same server's every RPC gets raw bytes: arbitrary ones, and its own
messages (ModelInfer's built valid, then changed field by field) cut short, with bytes
flipped or inserted, or with a string field that is not UTF-8: never UNKNOWN, INTERNAL or
UNAVAILABLE. A second server serves a stateful model (test_sequences' RNN) for the tenant
headers: the same (name, value) pairs over HTTP and gRPC metadata give the same tenant or
the same refusal, two values that differ anywhere are two tenants, and any bytes in them
over HTTP are never a 5xx. Throughout: never a traceback in the log, from any logger.

Bounded for CI by the profiles in tests/support/fuzzing.py; `max_examples` per test keeps the
file under a minute on two cores.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kiln.runtime.serving.grpc import grpc_service_pb2 as pb
from kiln.runtime.serving.grpc.endpoint import CODES, CONTENTS_FIELD
from kiln.runtime.serving.rest.server import HTTP_STATUS
from kiln.runtime.serving.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request

from support.fuzzing import deep_literals, dump, fuzz_settings, huge_literals, non_finite
from support.hostile_http import (HOSTILE_MAX_BODY, INFER, MAX_ERROR_CHARS, Answer,
                                  assert_still_serves, http_request, raw_exchange)
from support.sequence_models import RNN_STATES, rnn_model
from support.serving import (NAME, Built, ServerThread, assert_matches, build_cpu_engine, json_inputs,
                             sample)

pytestmark = pytest.mark.timeout(300)

CHECK_EVERY = 50  # examples between two checks that a valid request still answers right
OUTPUT_NAMES = ("scores", "label", "pooled")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("fuzz"))


class Tracebacks(logging.Handler):
    """Every record, from any logger, that carries a traceback: a client's input never
    earns one."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback (most recent call last)" in record.getMessage():
            self.records.append(record)

    def check(self, what: str) -> None:
        """No traceback logged since the last check (while answering `what`)."""
        records, self.records = self.records, []
        if records:
            r = records[0]
            raise AssertionError(f"{len(records)} traceback(s) in the log, for {what}; the "
                                 f"first: {r.name} {r.levelname} {r.getMessage()[:200]!r}")


@pytest.fixture(scope="module")
def tracebacks():
    handler = Tracebacks()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@dataclass
class Fuzzed:
    srv: ServerThread
    built: Built
    tracebacks: Tracebacks
    examples: int = 0

    @property
    def port(self) -> int:
        return self.srv.port

    def still_serves(self) -> None:
        """After a test's examples: a valid request still answers correctly."""
        assert_still_serves(self.port, self.built, seed=self.examples)

    def judge(self, answer: Answer, what: str) -> None:
        """The property every answer must have; a periodic check that the server still
        answers a valid request correctly."""
        assert answer.status < 500, f"a 5xx for {what}: {answer}"
        if answer.status >= 400:
            try:
                doc = json.loads(answer.body)
            except ValueError:
                raise AssertionError(f"a {answer.status} whose body is not JSON, for {what}: "
                                     f"{answer}") from None
            assert isinstance(doc, dict) and isinstance(doc.get("error"), str), \
                f"a {answer.status} without a string 'error', for {what}: {answer}"
        self.tracebacks.check(what)
        self.examples += 1
        if self.examples % CHECK_EVERY == 0:
            assert_still_serves(self.port, self.built, seed=self.examples)


@pytest.fixture(scope="module")
def server(built, tracebacks):
    srv = ServerThread(built.cache, {"cpu": built.rel}, max_body_bytes=HOSTILE_MAX_BODY,
                       grpc_port=0)
    assert srv.wait_loaded(), srv.model.status_message()
    yield Fuzzed(srv, built, tracebacks)
    srv.close()


# -- JSON values, with what json.dumps cannot write (tests/support/fuzzing.py) -----------

V2_WORDS = ["inputs", "outputs", "name", "shape", "datatype", "data", "parameters", "id",
            "binary_data_size", "binary_data", "binary_data_output", "shared_memory_region",
            "classification", "features", "token_ids", *OUTPUT_NAMES, "FP32", "INT64",
            "BYTES", "BOOL", "FP16", "UINT8"]

leaves = (st.none() | st.booleans() | st.integers() | st.floats()
          | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
          | st.text(max_size=12) | st.sampled_from(V2_WORDS)
          | huge_literals | non_finite | deep_literals)
keys = st.sampled_from(V2_WORDS) | st.text(max_size=8)
json_values = st.recursive(
    leaves, lambda children: st.lists(children, max_size=5)
    | st.dictionaries(keys, children, max_size=5), max_leaves=12)

# Objects shaped like an inference request, each field anything: gets past the first checks.
INPUT_FIELDS = ["name", "shape", "datatype", "data", "parameters"]
near_requests = st.fixed_dictionaries(
    {"inputs": st.lists(st.dictionaries(st.sampled_from(INPUT_FIELDS), json_values, max_size=5),
                        max_size=3)},
    optional={"outputs": st.lists(st.dictionaries(st.sampled_from(["name", "parameters"]),
                                                  json_values, max_size=2), max_size=3)
              | json_values,
              "parameters": st.dictionaries(keys, json_values, max_size=3) | json_values,
              "id": json_values})


def post(server: Fuzzed, body: bytes, headers: dict[str, str] | None = None,
         path: str = INFER) -> Answer:
    return http_request(server.port, "POST", path, body,
                        {"Content-Type": "application/json", **(headers or {})})


def test_arbitrary_json_bodies(server):
    @fuzz_settings(800)
    @given(st.one_of(json_values, near_requests))
    def prop(value):
        body = dump(value).encode()
        server.judge(post(server, body), f"the body {body[:200]!r}")
    prop()
    server.still_serves()


# -- valid requests, mutated field by field -----------------------------------------------

confusing = st.sampled_from([[], {}, "", 0, -1, 1.5, None, True, False, "FP32", "INT64",
                             [1], [[1]], {"name": "features"}, 2 ** 64, -2 ** 63 - 1])
replacements = confusing | json_values

FIELD_PATHS = (
    [("id",), ("parameters",), ("parameters", "binary_data_output"), ("inputs",),
     ("outputs",)]
    + [("inputs", i, *rest) for i in (0, 1) for rest in
       [(), ("name",), ("shape",), ("datatype",), ("data",), ("parameters",), ("shape", 0),
        ("shape", 1), ("data", 0), ("parameters", "binary_data_size")]]
    + [("outputs", j, *rest) for j in (0, 1) for rest in
       [(), ("name",), ("parameters",), ("parameters", "binary_data")]])


def mutate(doc, path: tuple, value, delete: bool) -> bool:
    """Set (or delete) `path` in `doc`; False when an earlier mutation removed the way."""
    node = doc
    for step in path[:-1]:
        if isinstance(node, dict) and isinstance(step, str) and step in node:
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and step < len(node):
            node = node[step]
        else:
            return False
    last = path[-1]
    if isinstance(node, dict) and isinstance(last, str):
        if delete:
            node.pop(last, None)
        else:
            node[last] = value
        return True
    if isinstance(node, list) and isinstance(last, int) and last < len(node):
        if delete:
            del node[last]
        else:
            node[last] = value
        return True
    return False


@st.composite
def mutated_requests(draw):
    inputs = sample(draw(st.integers(1, 4)), draw(st.integers(0, 10_000)))
    entries = json_inputs(inputs)
    for entry in entries:
        entry["parameters"] = {}
    doc = {"id": draw(st.text(max_size=8)), "inputs": entries,
           "outputs": [{"name": n, "parameters": {"binary_data": draw(st.booleans())}}
                       for n in draw(st.lists(st.sampled_from(OUTPUT_NAMES), min_size=1,
                                              max_size=3, unique=True))],
           "parameters": {"binary_data_output": False}}
    touched = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(FIELD_PATHS))
        if mutate(doc, path, draw(replacements), draw(st.integers(0, 4)) == 0):
            touched.append(path)
    return doc, inputs, touched


def answers_right(answer: Answer, inputs, built: Built) -> None:
    """A 200's outputs are what ONNX Runtime computes for `inputs`."""
    length = answer.headers.get(HEADER_LENGTH.lower())
    doc = decode_infer_response(answer.body, int(length) if length is not None else None)
    expected = built.expected(inputs)
    for out in doc["outputs"]:
        np.testing.assert_allclose(out["data"], expected[out["name"]], rtol=1e-5, atol=1e-5,
                                   err_msg=out["name"])


def test_mutated_valid_requests(server):
    @fuzz_settings(1000)
    @given(mutated_requests())
    def prop(case):
        doc, inputs, touched = case
        body = dump(doc).encode()
        answer = post(server, body)
        server.judge(answer, f"mutations {touched} giving {body[:300]!r}")
        if answer.status == 200 and not any(p[0] == "inputs" for p in touched):
            answers_right(answer, inputs, server.built)
    prop()
    server.still_serves()


# -- the binary tensor extension ----------------------------------------------------------

header_texts = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                     exclude_characters="\x7f"), max_size=30)
sizes = (st.integers() | st.integers(min_value=-2 ** 70, max_value=2 ** 70) | huge_literals
         | non_finite | st.floats() | st.text(max_size=6) | st.booleans() | st.none()
         | st.lists(st.integers(), max_size=2))


@st.composite
def binary_requests(draw):
    rows = draw(st.integers(1, 4))
    inputs = sample(rows, draw(st.integers(0, 10_000)))
    body, n = encode_infer_request(inputs, binary=True, binary_outputs=draw(st.booleans()))
    header, tail = body[:n], body[n:]
    changed = []
    if draw(st.booleans()):  # binary_data_size of one input, anything
        doc = json.loads(header)
        i = draw(st.integers(0, len(doc["inputs"]) - 1))
        doc["inputs"][i]["parameters"]["binary_data_size"] = draw(sizes)
        header = dump(doc).encode()
        changed.append(f"binary_data_size of inputs[{i}]")
    tail_op = draw(st.sampled_from(["keep", "append", "truncate", "replace"]))
    if tail_op == "append":
        tail += draw(st.binary(min_size=1, max_size=64))
    elif tail_op == "truncate":
        tail = tail[:draw(st.integers(0, max(0, len(tail) - 1)))]
    elif tail_op == "replace":
        tail = draw(st.binary(max_size=256))
    if tail_op != "keep":
        changed.append(f"tail {tail_op}")
    body = header + tail
    value = draw(st.one_of(
        st.just(str(len(header))), st.integers(-10 ** 6, 10 ** 6).map(str),
        st.integers(len(body) + 1, 10 ** 20).map(str), header_texts,
        st.integers(1, 5000).map(lambda k: "9" * k), st.none()))
    if value != str(len(header)):
        changed.append(f"{HEADER_LENGTH} {value!r:.40}")
    headers = {"Content-Type": "application/octet-stream"}
    if value is not None:
        headers[HEADER_LENGTH] = value
    return body, headers, inputs, changed


def test_binary_extension(server):
    @fuzz_settings(800)
    @given(binary_requests())
    def prop(case):
        body, headers, inputs, changed = case
        answer = post(server, body, headers)
        server.judge(answer, f"a binary request with {changed}: {body[:200]!r}")
        if answer.status == 200 and not changed:
            answers_right(answer, inputs, server.built)
    prop()
    server.still_serves()


# -- arbitrary bytes and Content-Types ----------------------------------------------------

content_types = st.sampled_from(["application/json", "application/octet-stream", "text/plain",
                                 "", "application/json; charset=utf-16",
                                 "multipart/form-data; boundary=x",
                                 "application/x-www-form-urlencoded"]) | header_texts


@st.composite
def byte_bodies(draw):
    valid = json.dumps({"inputs": json_inputs(sample(1))}).encode()
    kind = draw(st.sampled_from(["random", "flipped", "cut", "utf16"]))
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "flipped":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "cut":
        return valid[:draw(st.integers(0, len(valid) - 1))]
    return valid.decode().encode("utf-16")


def test_arbitrary_bytes_and_content_types(server):
    @fuzz_settings(600)
    @given(byte_bodies(), content_types, st.none() | header_texts)
    def prop(body, ctype, header_length):
        headers = {"Content-Type": ctype}
        if header_length is not None:
            headers[HEADER_LENGTH] = header_length
        server.judge(post(server, body, headers), f"{headers} and the body {body[:200]!r}")
    prop()
    server.still_serves()


# -- arbitrary methods and paths on the v2 routes -----------------------------------------

segments = st.sampled_from([NAME, "1", "2", "", "..", "%", "versions", "infer", "ready"]) \
    | st.text(max_size=12)


@st.composite
def routes(draw):
    name, version = draw(segments), draw(segments)
    template = draw(st.sampled_from([
        "/v2/models/{n}/infer", "/v2/models/{n}/versions/{v}/infer", "/v2/models/{n}",
        "/v2/models/{n}/versions/{v}", "/v2/models/{n}/ready", "/v2/models/{n}/versions/{v}/ready",
        "/v2", "/v2/health/live", "/v2/health/ready", "/v2/{n}", "/{n}", "/metrics"]))
    path = template.format(n=urllib.parse.quote(name, safe=""),
                           v=urllib.parse.quote(version, safe=""))
    if draw(st.booleans()):
        path += "?" + urllib.parse.urlencode({draw(st.text(max_size=5)): draw(st.text(max_size=5))})
    return draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])), path


def test_arbitrary_routes(server):
    valid = json.dumps({"inputs": json_inputs(sample(1))}).encode()

    @fuzz_settings(400)
    @given(routes(), st.sampled_from([b"", valid, b"{}", b"\xff"]))
    def prop(route, body):
        method, path = route
        answer = http_request(server.port, method, path, body,
                              {"Content-Type": "application/json"})
        server.judge(answer, f"{method} {path} with {body[:40]!r}")
    prop()
    server.still_serves()


# -- arbitrary header lines (raw sockets) --------------------------------------------------

header_names = st.sampled_from(["Content-Type", "Content-Length", "Transfer-Encoding", "Expect",
                                "Connection", "Host", HEADER_LENGTH, "Content-Encoding"]) \
    .map(str.encode) | st.binary(max_size=16).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
header_values = (st.binary(max_size=32) | st.integers(8000, 9000).map(lambda n: b"v" * n)
                 | st.sampled_from([b"chunked", b"gzip", b"100-continue", b"close", b"-1",
                                    b"abc", b"application/json", b"0"])) \
    .map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


def test_arbitrary_header_lines(server):
    body = json.dumps({"inputs": json_inputs(sample(1))}).encode()

    @fuzz_settings(300)
    @given(st.lists(st.tuples(header_names, header_values), min_size=1, max_size=4))
    def prop(lines):
        head = b"".join(n + b": " + v + b"\r\n" for n, v in lines)
        data = (f"POST {INFER} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + head
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        server.judge(raw_exchange(server.port, data), f"the header lines {head[:300]!r}")
    prop()
    server.still_serves()


# -- gRPC: raw messages on every RPC ------------------------------------------------------

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
# What a client's input may get: never UNKNOWN or INTERNAL (a 5xx), nor UNAVAILABLE (the
# server is up throughout).
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
DATATYPES = ["FP32", "INT64", "FP16", "FP64", "INT32", "INT8", "UINT8", "BOOL", "BYTES", ""]


def rpc(channel: grpc.Channel, method: str, data: bytes, metadata=()) -> tuple:
    """(code, details, answer bytes) of one call with these bytes as the message."""
    call = channel.unary_unary(f"/{SERVICE.full_name}/{method}", request_serializer=None,
                               response_deserializer=None)
    try:
        return grpc.StatusCode.OK, "", call(data, metadata=list(metadata), timeout=20)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.srv.server.grpc_address) as channel:
        yield channel


def judge_grpc(server: Fuzzed, channel, answer: tuple, what: str) -> None:
    code, details, _ = answer
    assert code in CLIENT_CODES, f"{code} for {what}: {details[:300]!r}"
    assert len(details) <= MAX_ERROR_CHARS, f"{len(details)} characters of details for {what}"
    server.tracebacks.check(what)
    server.examples += 1
    if server.examples % CHECK_EVERY == 0:
        grpc_still_serves(channel, server.built, server.examples)


def grpc_still_serves(channel, built: Built, seed: int) -> None:
    inputs = sample(2, seed)
    request = pb.ModelInferRequest(model_name=NAME)
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype="FP32" if array.dtype == np.float32 else "INT64",
                           shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    code, details, raw = rpc(channel, "ModelInfer", request.SerializeToString())
    assert code == grpc.StatusCode.OK, f"a valid gRPC request after hostile ones: {details}"
    response = pb.ModelInferResponse.FromString(raw)
    assert_matches({o.name: np.frombuffer(b, {"FP32": "<f4", "INT64": "<i8"}[o.datatype])
                    .reshape(list(o.shape)) for o, b in zip(response.outputs,
                                                            response.raw_output_contents)},
                   built.expected(inputs))


int64s = st.integers(-2 ** 63, 2 ** 63 - 1)
PARAMETER_VALUES = {"bool_param": st.booleans(), "int64_param": int64s,
                    "string_param": st.text(max_size=8), "double_param": st.floats(),
                    "uint64_param": st.integers(0, 2 ** 64 - 1)}
CONTENTS_VALUES = {"bool_contents": st.booleans(),
                   "int_contents": st.integers(-2 ** 31, 2 ** 31 - 1),
                   "int64_contents": int64s, "uint_contents": st.integers(0, 2 ** 32 - 1),
                   "uint64_contents": st.integers(0, 2 ** 64 - 1),
                   "fp32_contents": st.floats(width=32), "fp64_contents": st.floats(),
                   "bytes_contents": st.binary(max_size=8)}
parameter_names = st.sampled_from(
    ["sequence_id", "sequence_start", "sequence_end", "binary_data_output", "binary_data",
     "binary_data_size", "classification", "shared_memory_region", "priority"]) \
    | st.text(max_size=6)
tensor_names = st.sampled_from(["features", "token_ids", *OUTPUT_NAMES]) | st.text(max_size=6)


def add_parameters(draw, parameters) -> None:
    for name in draw(st.lists(parameter_names, max_size=3, unique=True)):
        field = draw(st.sampled_from(sorted(PARAMETER_VALUES)))
        setattr(parameters[name], field, draw(PARAMETER_VALUES[field]))


@st.composite
def infer_messages(draw) -> pb.ModelInferRequest:
    """A valid ModelInferRequest (raw or typed contents), then up to four changes to it,
    each anything its field can hold."""
    inputs = sample(draw(st.integers(1, 3)), draw(st.integers(0, 10_000)))
    request = pb.ModelInferRequest(model_name=draw(st.sampled_from([NAME, NAME, "", "nope"])),
                                   model_version=draw(st.sampled_from(["", "1", "2"])),
                                   id=draw(st.text(max_size=6)))
    raw = draw(st.booleans())
    for name, array in inputs.items():
        datatype = "FP32" if array.dtype == np.float32 else "INT64"
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if raw:
            request.raw_input_contents.append(array.tobytes())
        else:
            getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(array.reshape(-1).tolist())
    for _ in range(draw(st.integers(0, 4))):
        tensor = request.inputs[draw(st.integers(0, len(request.inputs) - 1))] \
            if request.inputs else request.inputs.add()
        change = draw(st.sampled_from(["name", "datatype", "shape", "contents", "raw", "add",
                                       "drop", "parameters", "outputs"]))
        if change == "name":
            tensor.name = draw(tensor_names)
        elif change == "datatype":
            tensor.datatype = draw(st.sampled_from(DATATYPES) | st.text(max_size=5))
        elif change == "shape":
            tensor.shape[:] = draw(st.lists(int64s | st.integers(-2, 40), max_size=4))
        elif change == "contents":
            field = draw(st.sampled_from(sorted(CONTENTS_VALUES)))
            values = getattr(tensor.contents, field)
            values[:] = draw(st.lists(CONTENTS_VALUES[field], max_size=24))
        elif change == "raw":
            request.raw_input_contents[:] = draw(st.lists(st.binary(max_size=128), max_size=3))
        elif change == "add":
            request.inputs.add(name=draw(tensor_names), datatype=draw(st.sampled_from(DATATYPES)),
                               shape=draw(st.lists(st.integers(-1, 4), max_size=3)))
        elif change == "drop":
            del request.inputs[-1]
        elif change == "parameters":
            add_parameters(draw, draw(st.sampled_from([request.parameters, tensor.parameters])))
        else:
            for name in draw(st.lists(tensor_names, max_size=3)):
                add_parameters(draw, request.outputs.add(name=name).parameters)
    return request


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@st.composite
def wire_changes(draw, message: bytes) -> bytes:
    """`message`'s bytes as they are, cut short, with bytes flipped or inserted, or with a
    string field whose bytes are not UTF-8 (fields 1-3 are strings in every request)."""
    how = draw(st.sampled_from(["keep", "keep", "cut", "flip", "insert", "not-utf8"]))
    if how == "cut" and message:
        return message[:draw(st.integers(0, len(message) - 1))]
    if how == "flip" and message:
        data = bytearray(message)
        for _ in range(draw(st.integers(1, 3))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "insert":
        at = draw(st.integers(0, len(message)))
        return message[:at] + draw(st.binary(min_size=1, max_size=16)) + message[at:]
    if how == "not-utf8":
        text = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"a\x80b"]))
        field = bytes([draw(st.integers(1, 3)) << 3 | 2]) + varint(len(text)) + text
        return draw(st.sampled_from([field + message, message + field]))
    return message


def test_grpc_model_infer_messages(server, channel):
    @fuzz_settings(600)
    @given(st.data())
    def prop(data):
        message = data.draw(infer_messages())
        wire = data.draw(wire_changes(message.SerializeToString()))
        answer = rpc(channel, "ModelInfer", wire)
        judge_grpc(server, channel, answer, f"ModelInfer with {wire[:200]!r}")
    prop()
    grpc_still_serves(channel, server.built, seed=1)


@st.composite
def any_request(draw) -> tuple[str, bytes]:
    """Any RPC of the service, with bytes: arbitrary ones, or its own request message with
    names and versions from the server's and elsewhere, changed on the wire."""
    method = draw(st.sampled_from(list(SERVICE.methods)))
    kind = draw(st.sampled_from(["bytes", "message"]))
    if kind == "bytes":
        return method.name, draw(st.binary(max_size=256))
    message = getattr(pb, method.input_type.name)()
    for field in message.DESCRIPTOR.fields:  # name and version: the only fields they have
        if field.type == field.TYPE_STRING:
            setattr(message, field.name,
                    draw(st.sampled_from([NAME, "1", ""]) | st.text(max_size=8)))
    return method.name, draw(wire_changes(message.SerializeToString()))


def test_grpc_every_rpc(server, channel):
    @fuzz_settings(400)
    @given(any_request())
    def prop(request):
        method, wire = request
        judge_grpc(server, channel, rpc(channel, method, wire), f"{method} with {wire[:200]!r}")
    prop()
    grpc_still_serves(channel, server.built, seed=2)


# -- the tenant: Kiln-Tenant and Authorization, over both doors ------------------------------

@dataclass
class Stateful:
    """A stateful model (test_sequences' RNN: x [1, 8], state h [1, 32], memory store) on
    HTTP and gRPC, and fresh sequence ids."""
    srv: ServerThread
    tracebacks: Tracebacks
    ids: itertools.count

    def http_step(self, seq: str, headers, start: bool = True) -> tuple[int, str]:
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32",
                                       "data": [0.5] * 8}],
                           "parameters": {"sequence_id": seq, "sequence_start": start}}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.srv.port, timeout=20)
        try:
            conn.putrequest("POST", INFER)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            for name, value in headers:
                conn.putheader(name, value)
            conn.endheaders(body)
            resp = conn.getresponse()
            answer = Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()},
                            resp.read())
        finally:
            conn.close()
        assert answer.status < 500, f"a 5xx for the headers {headers!r:.300}: {answer}"
        self.tracebacks.check(f"the headers {headers!r:.300}")
        return answer.status, "" if answer.status == 200 else json.loads(answer.body)["error"]

    def grpc_step(self, channel, seq: str, metadata, start: bool = True) -> tuple:
        request = pb.ModelInferRequest(model_name=NAME)
        request.parameters["sequence_id"].string_param = seq
        request.parameters["sequence_start"].bool_param = start
        request.inputs.add(name="x", datatype="FP32", shape=[1, 8]).contents.fp32_contents \
            .extend([0.5] * 8)
        code, details, _ = rpc(channel, "ModelInfer", request.SerializeToString(), metadata)
        assert code in CLIENT_CODES, f"{code} for the metadata {metadata!r:.300}: {details}"
        self.tracebacks.check(f"the metadata {metadata!r:.300}")
        return code, details


@pytest.fixture(scope="module")
def stateful(tmp_path_factory, tracebacks):
    root = tmp_path_factory.mktemp("fuzz-tenants")
    rel = build_cpu_engine(root, "rnn", rnn_model())
    # Examples start sequences and leave them live: room for kiln-explore's many.
    runtime = {"sequences": {"states": RNN_STATES, "maxLiveSequences": 100_000}}
    srv = ServerThread(root / "cache", {"cpu": rel}, runtime, grpc_port=0)
    assert srv.wait_loaded(), srv.model.status_message()
    with grpc.insecure_channel(srv.server.grpc_address) as channel:
        yield Stateful(srv, tracebacks, itertools.count()), channel
    srv.close()


# What gRPC metadata can carry (printable ASCII), so both doors can send the same pairs.
ascii_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24)
padded = st.builds(lambda a, b, c: a + b + c, st.sampled_from(["", " ", "  "]), ascii_text,
                   st.sampled_from(["", " "]))
tenant_values = (ascii_text | padded
                 | st.sampled_from(["", "Bearer s3cret", "acme", "spiffe://corp/" + "x" * 250])
                 | st.integers(4090, 4100).map(lambda n: "t" * n))
tenant_header_names = st.sampled_from(["Kiln-Tenant", "kiln-tenant", "KILN-TENANT",
                                       "Authorization", "authorization", "Kiln-Tenants",
                                       "X-Tenant"])


def test_tenant_headers_are_read_alike_on_both_doors(stateful):
    """The same (name, value) pairs name the same tenant, or get the same refusal, over HTTP
    and gRPC; a sequence started on one door continues on the other."""
    service, channel = stateful

    @fuzz_settings(150)
    @given(st.lists(st.tuples(tenant_header_names, tenant_values), max_size=3))
    def prop(pairs):
        # gRPC's own limit on metadata (8 KiB) is not the tenant's.
        assume(sum(len(v) for _, v in pairs) < 6000)
        metadata = [(k.lower(), v) for k, v in pairs]
        seq, other = f"h{next(service.ids)}", f"g{next(service.ids)}"
        status, message = service.http_step(seq, pairs)
        code, details = service.grpc_step(channel, other, metadata)
        assert (code, details) == (CODES[{s: k for k, s in HTTP_STATUS.items()}[status]] if status != 200 else grpc.StatusCode.OK,
                                   message), pairs
        if status == 200:  # one tenant on both doors: gRPC continues what HTTP started
            assert service.grpc_step(channel, seq, metadata, start=False)[0] == grpc.StatusCode.OK
    prop()


def test_a_tenant_is_its_whole_value(stateful):
    """Two values that differ anywhere (past the 256th character too) are two tenants."""
    service, channel = stateful

    @fuzz_settings(100)
    @given(ascii_text.filter(lambda t: t.strip()), st.sampled_from(["", "x" * 300]),
           st.sampled_from(["append", "change", "cut"]), st.characters(min_codepoint=0x21,
                                                                       max_codepoint=0x7E))
    def prop(text, padding, how, char):
        mine = padding + text
        theirs = {"append": mine + char, "cut": mine[:-1],
                  "change": mine[:-1] + chr(0x21 + (ord(mine[-1]) - 0x20) % 0x5E)}[how]
        assume(theirs.strip() and theirs.strip() != mine.strip())
        seq = f"w{next(service.ids)}"
        assert service.http_step(seq, [("Kiln-Tenant", mine)])[0] == 200
        code, _ = service.grpc_step(channel, seq, [("kiln-tenant", theirs)], start=False)
        assert code == grpc.StatusCode.NOT_FOUND, (mine, theirs)
        assert service.grpc_step(channel, seq, [("kiln-tenant", mine)], start=False)[0] == \
            grpc.StatusCode.OK
    prop()


def test_tenant_header_bytes_over_http(stateful):
    """Any bytes in the tenant headers (what HTTP carries and gRPC cannot): never a 5xx."""
    service, _ = stateful
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32",
                                   "data": [0.5] * 8}],
                       "parameters": {"sequence_id": "b", "sequence_start": True,
                                      "sequence_end": True}}).encode()
    values = st.binary(max_size=24).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))

    @fuzz_settings(200)
    @given(st.lists(st.tuples(tenant_header_names.map(str.encode), values), max_size=3))
    def prop(lines):
        head = b"".join(n + b": " + v + b"\r\n" for n, v in lines)
        data = (f"POST {INFER} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + head
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = raw_exchange(service.srv.port, data)
        assert answer.status < 500, f"a 5xx for the header lines {head!r}: {answer}"
        assert answer.status == 200 or isinstance(json.loads(answer.body).get("error"), str)
        service.tracebacks.check(f"the header lines {head!r}")
    prop()


def test_profile_writes_nothing_into_the_repository():
    repo = Path(__file__).resolve().parents[2]
    assert not (repo / ".hypothesis").exists()
    assert settings.get_profile("kiln-ci").database is None
    assert settings.get_profile("kiln-ci").derandomize
