"""Shared by test_hostile_input.py and test_fuzz.py (issue 11): a real server for hostile
requests, a raw-socket HTTP client for what no HTTP library sends, and the checks every
answer to a client's mistake must pass.

The server is support.serving's: the same ONNX model built into a real cache and served by
`InferenceServer` on 127.0.0.1 (its own event loop in a thread), with a body limit large
enough for the hostile bodies (1 MiB names, 100k-deep nesting).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass

import aiohttp

from kiln.runtime.serving.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request

from .serving import NAME, Built, assert_matches, json_inputs, sample

__all__ = ["INFER", "HOSTILE_MAX_BODY", "MAX_ERROR_CHARS", "Answer", "raw_exchange",
           "http_request", "aiohttp_post", "assert_client_error", "assert_still_serves",
           "client_error_log_problems", "strict_json"]

INFER = f"/v2/models/{NAME}/infer"
HOSTILE_MAX_BODY = 4 * 1024 * 1024
# An error message echoes at most this much: a 1 MiB name must not come back whole.
MAX_ERROR_CHARS = 1024
# "A client error is one short log line at most" (issue 11, item 1).
MAX_LOG_LINE = 300


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def __str__(self) -> str:
        shown = self.body[:300]
        more = f"... ({len(self.body)} bytes)" if len(self.body) > 300 else ""
        return f"{self.status} {self.headers.get('content-type')!r} {shown!r}{more}"


# -- clients ------------------------------------------------------------------------------

def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> Answer:
    """Send `data` as it is on a fresh connection and read one HTTP response (by its
    Content-Length, or to EOF). No HTTP library in between: the bytes are the test's."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before reading everything
        buf = b""
        deadline = time.monotonic() + timeout
        head_end = -1
        length = None
        while time.monotonic() < deadline:
            if head_end < 0:
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    for line in buf[:head_end].split(b"\r\n")[1:]:
                        k, _, v = line.partition(b":")
                        if k.strip().lower() == b"content-length":
                            length = int(v.strip())
            if head_end >= 0 and buf[9:10] == b"1":  # 100 Continue and the like: skip it
                buf, head_end, length = buf[head_end + 4:], -1, None
                continue
            if head_end >= 0 and length is not None and len(buf) >= head_end + 4 + length:
                break
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    if head_end < 0:
        raise AssertionError(f"no HTTP response to {data[:120]!r}...: got {buf[:300]!r}")
    lines = buf[:head_end].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    body = buf[head_end + 4:]
    if length is not None:
        body = body[:length]
    return Answer(status, headers, body)


def http_request(port: int, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 20) -> Answer:
    """One request with http.client (a fresh connection), as a plain HTTP client sends it."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


async def aiohttp_post(url: str, body: bytes, headers: dict[str, str] | None = None) -> Answer:
    """One POST with aiohttp's client."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, data=body, headers=headers) as r:
            return Answer(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())


# -- checks -------------------------------------------------------------------------------

def assert_client_error(answer: Answer, status: int | None = 400) -> str:
    """A client's mistake: a 4xx (`status` when given) with Content-Type application/json
    and the body `{"error": "<a bounded message>"}`. Returns the message."""
    assert answer.status < 500, f"a 5xx for a client's mistake: {answer}"
    if status is not None:
        assert answer.status == status, f"expected {status}, got {answer}"
    else:
        assert answer.status >= 400, f"expected a 4xx, got {answer}"
    ctype = answer.headers.get("content-type", "")
    assert ctype.split(";")[0].strip() == "application/json", f"not JSON: {answer}"
    try:
        doc = json.loads(answer.body)
    except ValueError:
        raise AssertionError(f"the error body is not JSON: {answer}") from None
    assert isinstance(doc, dict) and isinstance(doc.get("error"), str), \
        f"no string 'error' in the body: {answer}"
    message = doc["error"]
    assert message, f"an empty error message: {answer}"
    assert len(message) <= MAX_ERROR_CHARS, \
        f"the error message is {len(message)} characters (at most {MAX_ERROR_CHARS}): " \
        f"{message[:200]!r}..."
    return message


def assert_still_serves(port: int, built: Built, seed: int = 0) -> None:
    """A valid request, JSON and binary, answers what ONNX Runtime computes directly."""
    inputs = sample(2, seed)
    expected = built.expected(inputs)
    answer = http_request(port, "POST", INFER, json.dumps({"inputs": json_inputs(inputs)}).encode(),
                          {"Content-Type": "application/json"})
    assert answer.status == 200, f"a valid JSON request after a hostile one: {answer}"
    doc = decode_infer_response(answer.body, None)
    assert_matches({o["name"]: o["data"] for o in doc["outputs"]}, expected)

    body, json_length = encode_infer_request(inputs, binary=True, binary_outputs=True)
    answer = http_request(port, "POST", INFER, body, {"Content-Type": "application/octet-stream",
                                                      HEADER_LENGTH: str(json_length)})
    assert answer.status == 200, f"a valid binary request after a hostile one: {answer}"
    doc = decode_infer_response(answer.body, int(answer.headers[HEADER_LENGTH.lower()]))
    assert_matches({o["name"]: o["data"] for o in doc["outputs"]}, expected)


def client_error_log_problems(records: list[logging.LogRecord], requests: int = 1) -> list[str]:
    """What is wrong with the server's log of `requests` client errors: a traceback, more
    than one record per request, or a record longer than one short line."""
    mine = [r for r in records if r.name == "kiln" or r.name.startswith(("kiln.", "aiohttp"))]
    problems = []
    for r in mine:
        text = r.getMessage()
        if r.exc_info:
            problems.append(f"{r.name} {r.levelname} logged a traceback "
                            f"({r.exc_info[0].__name__}): {text[:200]!r}")
        elif "\n" in text or len(text) > MAX_LOG_LINE:
            problems.append(f"{r.name} {r.levelname} logged {len(text)} characters, "
                            f"{text.count(chr(10)) + 1} lines: {text[:200]!r}")
    if len(mine) > requests:
        problems.append(f"{len(mine)} log records for {requests} client error(s): "
                        + "; ".join(f"{r.name}: {r.getMessage()[:80]!r}" for r in mine))
    return problems


def strict_json(body: bytes):
    """json.loads that refuses NaN and Infinity, as JSON (RFC 8259) and most clients do."""
    def refuse(token: str):
        raise ValueError(f"non-JSON token {token}")
    return json.loads(body, parse_constant=refuse)
