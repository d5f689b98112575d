"""Hostile input, one class of client mistake per test (issue 11, item 1: never a 5xx for a
client's mistake).

Each case is sent over a real socket to a real `InferenceServer` serving a real ONNX model
(support.serving's), with aiohttp's client for bodies and raw sockets for HTTP that no client
library sends. Every case must get a 4xx whose Content-Type is application/json and whose
body is `{"error": "<message of at most 1 KiB>"}`; the server's log ("kiln" and "aiohttp"
loggers) may hold at most one short line for it and no traceback; and afterwards a valid
request (JSON and binary) still answers what ONNX Runtime computes on the same model.

NaN and infinities, the policy tested here: JSON has no NaN or Infinity (RFC 8259), so a
request that writes them is refused with a 400 that names the literal; an answer is always
strict JSON (what a JSON client parses), whatever the model computed.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from kiln.runtime.serving.protocol import HEADER_LENGTH, encode_infer_request

from support.hostile_http import (HOSTILE_MAX_BODY, INFER, aiohttp_post, assert_client_error,
                                  assert_still_serves, client_error_log_problems, http_request,
                                  raw_exchange, strict_json)
from support.serving import Built, ServerThread, json_inputs, sample

pytestmark = pytest.mark.timeout(60)

# Both stay below the test model's request bound (about 72 KB: 16 rows of 7 elements), so
# they reach the JSON parser instead of being refused as too big from the headers.
DEEP = 10_000  # the C decoder's recursion limit is about 1,000 levels
HUGE_INT = "9" * 5000  # above Python's int-str conversion limit (4300 digits)
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def server(built):
    srv = ServerThread(built.cache, {"cpu": built.rel}, max_body_bytes=HOSTILE_MAX_BODY)
    assert srv.wait_loaded(), srv.model.status_message()
    yield srv
    srv.close()


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="kiln")
    caplog.set_level(logging.INFO, logger="aiohttp")
    return caplog


def verdict(server, built, log, check) -> None:
    """Run `check()` (the answer's assertions), then the log's and a valid request's; report
    every failure together, so one run says all that is wrong with a case."""
    failures = []
    try:
        check()
    except AssertionError as e:
        failures.append(f"answer: {e}")
    problems = client_error_log_problems(log.records)
    if problems:
        failures.append("log: " + "; ".join(problems))
    try:
        assert_still_serves(server.port, built)
    except AssertionError as e:
        failures.append(f"afterwards: {e}")
    if failures:
        raise AssertionError("\n".join(failures))


# -- request bodies -----------------------------------------------------------------------

def valid_doc(batch: int = 1) -> dict:
    return {"inputs": json_inputs(sample(batch))}


def with_input(name: str, **fields) -> dict:
    """A valid one-row request whose input `name` has `fields` replaced."""
    doc = valid_doc()
    for entry in doc["inputs"]:
        if entry["name"] == name:
            entry.update(fields)
    return doc


def with_literal(doc: dict, literal: str) -> bytes:
    """The JSON of `doc`, with the string "@" replaced by a raw literal (what json.dumps cannot
    write: 5,000-digit integers, NaN, deep nesting)."""
    return json.dumps(doc).replace('"@"', literal).encode()


async def post(server, body: bytes, headers: dict | None = None, path: str = INFER):
    return await aiohttp_post(server.url + path, body, headers)


# -- deep nesting -------------------------------------------------------------------------

DEEP_BODIES = {
    "unclosed lists": lambda: b"[" * DEEP,
    "balanced lists": lambda: b"[" * DEEP + b"]" * DEEP,
    "nested objects": lambda: b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "unclosed inputs": lambda: b'{"inputs":' + b"[" * DEEP,
    "in data": lambda: with_literal(with_input("features", data="@"),
                                    "[" * DEEP + "1" + "]" * DEEP),
    "in parameters": lambda: with_literal({**valid_doc(), "parameters": {"x": "@"}},
                                          "[" * DEEP + "]" * DEEP),
}


@pytest.mark.parametrize("case", DEEP_BODIES)
async def test_deep_nesting(server, built, log, case):
    answer = await post(server, DEEP_BODIES[case]())
    verdict(server, built, log, lambda: assert_client_error(answer))


# -- integer literals too long to parse ---------------------------------------------------

HUGE_INT_BODIES = {
    "the whole body": lambda: HUGE_INT.encode(),
    "INT64 data": lambda: with_literal(with_input("token_ids", data=["@", 1, 2]), HUGE_INT),
    "negative, INT64 data": lambda: with_literal(with_input("token_ids", data=["@", 1, 2]),
                                                 "-" + HUGE_INT),
    "FP32 data": lambda: with_literal(with_input("features", data=["@", 1, 2, 3]), HUGE_INT),
    "a shape dimension": lambda: with_literal(with_input("features", shape=["@", 4]), HUGE_INT),
    "id": lambda: with_literal({**valid_doc(), "id": "@"}, HUGE_INT),
    "binary_data_size": lambda: with_literal(
        with_input("features", parameters={"binary_data_size": "@"}), HUGE_INT),
}


@pytest.mark.parametrize("case", HUGE_INT_BODIES)
async def test_huge_integer_literal(server, built, log, case):
    answer = await post(server, HUGE_INT_BODIES[case]())
    verdict(server, built, log, lambda: assert_client_error(answer))


# -- datatype that is not a string --------------------------------------------------------

NOT_STRINGS = {"empty list": [], "list": ["FP32"], "empty object": {}, "object": {"FP32": 1},
               "integer": 5, "float": 1.5, "null": None, "true": True}


@pytest.mark.parametrize("case", NOT_STRINGS)
async def test_datatype_not_a_string(server, built, log, case):
    answer = await post(server, json.dumps(with_input("features", datatype=NOT_STRINGS[case])).encode())

    def check():
        message = assert_client_error(answer)
        if "datatype" not in message:
            raise AssertionError(f"the error does not name the datatype: {message!r}")
    verdict(server, built, log, check)


# -- shapes too big for any memory --------------------------------------------------------

def binary_features(shape: list[int], size: int, tail: bytes = b"") -> tuple[bytes, dict]:
    """A binary-extension request whose features input claims `shape` and `size` bytes."""
    ids = sample(1)["token_ids"]
    header, _ = encode_infer_request({"token_ids": ids})
    doc = json.loads(header)
    doc["inputs"].insert(0, {"name": "features", "shape": shape, "datatype": "FP32",
                             "parameters": {"binary_data_size": size}})
    text = json.dumps(doc).encode()
    return text + tail, {HEADER_LENGTH: str(len(text)), "Content-Type": "application/octet-stream"}


HUGE_SHAPES = {
    "2^64 rows": lambda: (with_input("features", shape=[2 ** 64, 4]), None),
    "10^30 rows": lambda: (with_input("features", shape=[10 ** 30, 4]), None),
    "2^63-1 rows": lambda: (with_input("features", shape=[2 ** 63 - 1, 4]), None),
    "2^62 columns": lambda: (with_input("features", shape=[1, 2 ** 62]), None),
    "2^32 x 2^32": lambda: (with_input("features", shape=[2 ** 32, 2 ** 32]), None),
    "rank 20k": lambda: (with_input("features", shape=[1] * 20_000), None),
    "binary, 2^61 rows claimed": lambda: binary_features([2 ** 61, 4], 2 ** 65, b"\0" * 16),
    "binary, 2^31 rows, exact size, no bytes": lambda: binary_features([2 ** 31, 4], 2 ** 35),
    "binary, 2^62 rows, size 16": lambda: binary_features([2 ** 62, 4], 16, b"\0" * 16),
}


@pytest.mark.parametrize("case", HUGE_SHAPES)
async def test_huge_shape(server, built, log, case):
    doc, headers = HUGE_SHAPES[case]()
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    answer = await post(server, body, headers)
    verdict(server, built, log, lambda: assert_client_error(answer))


# -- NaN and infinities -------------------------------------------------------------------

NON_FINITE = {
    "NaN in FP32 data": ("features", ["@", 1.0, 2.0, 3.0], "NaN"),
    "Infinity in FP32 data": ("features", ["@", 1.0, 2.0, 3.0], "Infinity"),
    "-Infinity in FP32 data": ("features", [1.0, "@", 2.0, 3.0], "-Infinity"),
    "NaN in INT64 data": ("token_ids", ["@", 1, 2], "NaN"),
    "Infinity in INT64 data": ("token_ids", [1, 2, "@"], "Infinity"),
}


@pytest.mark.parametrize("case", NON_FINITE)
async def test_non_finite_literals_are_refused(server, built, log, case):
    name, data, literal = NON_FINITE[case]
    answer = await post(server, with_literal(with_input(name, data=data), literal))

    def check():
        message = assert_client_error(answer)
        if literal.lstrip("-").lower() not in message.lower():
            raise AssertionError(f"the error does not name {literal}: {message!r}")
    verdict(server, built, log, check)


async def test_non_finite_outputs_are_strict_json(server, built, log):
    # Finite inputs near float32's maximum overflow the model's MatMul: scores become inf or
    # NaN. Whatever the server answers, the JSON it writes must parse as JSON.
    doc = with_input("features", data=[3.0e38, 3.0e38, -3.0e38, 3.0e38])
    answer = await post(server, json.dumps(doc).encode())

    def check():
        assert answer.status < 500, f"a 5xx: {answer}"
        try:
            strict_json(answer.body)
        except ValueError as e:
            raise AssertionError(f"the answer is not JSON ({e}): {answer}") from None
    verdict(server, built, log, check)


# -- numbers of the wrong kind, strings and other values in data --------------------------

WRONG_DATA = {
    "0.5 for INT64": ("token_ids", [0.5, 1, 2]),
    "integral floats for INT64": ("token_ids", [1.0, 2.0, 3.0]),
    "1e300 for INT64": ("token_ids", [1e300, 1e300, 1e300]),
    "2^64 for INT64": ("token_ids", [2 ** 64, 1, 2]),
    "-2^63-1 for INT64": ("token_ids", [-2 ** 63 - 1, 1, 2]),
    "strings for FP32": ("features", ["a", "b", "c", "d"]),
    "numeric strings for FP32": ("features", ["1.0", "2.0", "3.0", "4.0"]),
    "numeric strings for INT64": ("token_ids", ["1", "2", "3"]),
    "a string among numbers": ("features", [1.0, "a", 2.0, 3.0]),
    "nulls": ("features", [None, None, None, None]),
    "objects": ("features", [{}, {}, {}, {}]),
    "empty lists": ("features", [[], [], [], []]),
    "a mix": ("features", [True, {}, 1, "x"]),
    "a string, not a list": ("features", "1,2,3,4"),
}


@pytest.mark.parametrize("case", WRONG_DATA)
async def test_wrong_values_in_data(server, built, log, case):
    name, data = WRONG_DATA[case]
    answer = await post(server, json.dumps(with_input(name, data=data)).encode())
    verdict(server, built, log, lambda: assert_client_error(answer))


# -- malformed HTTP (raw sockets) ---------------------------------------------------------

def _raw(head: str | bytes, body: bytes = b"", path: str = INFER) -> bytes:
    """A POST whose header lines after Host and Content-Type are `head`, then `body`."""
    head = head.encode() if isinstance(head, str) else head
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            .encode() + head + b"\r\n" + body)


VALID_BODY = json.dumps(valid_doc()).encode()
LONG = 10_000  # aiohttp's limits: 8190 bytes for the request line and for a header

MALFORMED_HTTP = {
    # Each is refused by aiohttp's HTTP parser (llhttp) before any handler runs.
    "non-numeric Content-Length": _raw("Content-Length: abc\r\n", VALID_BODY),
    "negative Content-Length": _raw("Content-Length: -5\r\n", VALID_BODY),
    "two different Content-Lengths": _raw(f"Content-Length: {len(VALID_BODY)}\r\n"
                                          f"Content-Length: {len(VALID_BODY) + 1}\r\n", VALID_BODY),
    "Content-Length and Transfer-Encoding: chunked": _raw(
        f"Content-Length: {len(VALID_BODY)}\r\nTransfer-Encoding: chunked\r\n",
        f"{len(VALID_BODY):x}\r\n".encode() + VALID_BODY + b"\r\n0\r\n\r\n"),
    "request line over 8190 bytes": _raw(f"Content-Length: {len(VALID_BODY)}\r\n", VALID_BODY,
                                         path=INFER + "?q=" + "a" * LONG),
    "header value over 8190 bytes": _raw(f"X-Long: {'a' * LONG}\r\n"
                                         f"Content-Length: {len(VALID_BODY)}\r\n", VALID_BODY),
    "header name over 8190 bytes": _raw(f"{'X' * LONG}: 1\r\n"
                                        f"Content-Length: {len(VALID_BODY)}\r\n", VALID_BODY),
    "a header line without a colon": _raw(f"no colon here\r\nContent-Length: {len(VALID_BODY)}\r\n",
                                          VALID_BODY),
    "not HTTP at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n",
    # Refused while the handler reads the body (the request line and headers were fine).
    "a chunk size that is not hex": _raw("Transfer-Encoding: chunked\r\n",
                                         b"zz\r\n" + VALID_BODY + b"\r\n0\r\n\r\n"),
    "Content-Encoding: gzip on a body that is not": _raw(
        f"Content-Encoding: gzip\r\nContent-Length: {len(VALID_BODY)}\r\n", VALID_BODY),
}
# Refused by aiohttp's router before the app's handler (and middleware) runs: any 4xx will do
# (417 Expectation Failed is aiohttp's), as long as it is one, in JSON.
EXPECT_HEADERS = {
    "an unknown Expect": _raw(f"Expect: something-else\r\nContent-Length: {len(VALID_BODY)}\r\n",
                              VALID_BODY),
    "an Expect that is not UTF-8": _raw(b"Expect: \xb0\x8b\xad\r\n"
                                        + f"Content-Length: {len(VALID_BODY)}\r\n".encode(),
                                        VALID_BODY),
}


def test_raw_socket_control(server, built, log):
    # The raw requests above differ from this one only in what each names: framed right, the
    # same bytes get the right answer (so the cases fail for what is malformed, nothing else).
    answer = raw_exchange(server.port, _raw(f"Content-Length: {len(VALID_BODY)}\r\n", VALID_BODY))

    def check():
        assert answer.status == 200, f"the control request: {answer}"
        doc = json.loads(answer.body)
        expected = built.expected(sample(1))
        for out in doc["outputs"]:
            np.testing.assert_allclose(out["data"], expected[out["name"]].reshape(-1),
                                       rtol=1e-5, atol=1e-5)
    verdict(server, built, log, check)


@pytest.mark.parametrize("case", [*MALFORMED_HTTP, *EXPECT_HEADERS])
def test_malformed_http(server, built, log, case):
    if case in MALFORMED_HTTP:
        data, status = MALFORMED_HTTP[case], 400
    else:
        data, status = EXPECT_HEADERS[case], None
    answer = raw_exchange(server.port, data)
    verdict(server, built, log, lambda: assert_client_error(answer, status))


# -- what an error echoes must be bounded --------------------------------------------------

def _echo_cases():
    long = "x" * 60_000
    return {
        "input name, 60 KB": (INFER, json.dumps({"inputs": [
            {**json_inputs(sample(1))[0], "name": long}]}).encode(), None, 400),
        "output name, 60 KB": (INFER, json.dumps({**valid_doc(), "outputs": [{"name": long}]})
                               .encode(), None, 400),
        "datatype, 60 KB": (INFER, json.dumps(with_input("features", datatype=long)).encode(),
                            None, 400),
        "model name, 8,000 characters": (f"/v2/models/{'m' * 8000}/infer", VALID_BODY, None, 404),
        f"{HEADER_LENGTH}, 5,000 digits": (INFER, VALID_BODY, {HEADER_LENGTH: HUGE_INT}, 400),
    }


ECHO = list(_echo_cases())


@pytest.mark.parametrize("case", ECHO)
async def test_error_message_is_bounded(server, built, log, case):
    path, body, headers, status = _echo_cases()[case]
    answer = await post(server, body, headers, path=path)
    verdict(server, built, log, lambda: assert_client_error(answer, status))


# -- the binary extension's header length -------------------------------------------------

def _binary_body() -> tuple[bytes, int]:
    return encode_infer_request(sample(1), binary=True)


HEADER_LENGTHS = {
    "text": lambda n, total: "abc",
    "empty": lambda n, total: "",
    "negative": lambda n, total: "-1",
    "hexadecimal": lambda n, total: "0x10",
    "a float": lambda n, total: f"{n}.0",
    "past the body": lambda n, total: str(total + 1),
    "2^64": lambda n, total: str(2 ** 64),
    "zero": lambda n, total: "0",
    "inside the JSON": lambda n, total: str(n // 2),
    "past the JSON": lambda n, total: str(n + 3),
}


@pytest.mark.parametrize("case", HEADER_LENGTHS)
def test_bad_inference_header_length(server, built, log, case):
    body, n = _binary_body()
    value = HEADER_LENGTHS[case](n, len(body))
    answer = http_request(server.port, "POST", INFER, body,
                          {"Content-Type": "application/octet-stream", HEADER_LENGTH: value})
    verdict(server, built, log, lambda: assert_client_error(answer))
