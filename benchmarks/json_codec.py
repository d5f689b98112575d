"""JSON codec: decoding a request and encoding its response, orjson against the standard
library's json (issue 12, item 1), in-process, no server.

The request is the serving benchmark's compute-dominated one: float32 rows 2048 wide (1 and
32 rows per request); the response has the same shape. The baseline is what Kiln did
before orjson: `json.loads` with the strict NaN check, and `tolist()` plus `json.dumps`.
Both sides run the same checks (`protocol._parse`), so the ratio is the codec's.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import numpy as np

from kiln.runtime.serving import protocol
from kiln.runtime.engine.backends.base import TensorSpec

WIDTH = 2048
INPUTS = [TensorSpec("x", "FP32", (-1, WIDTH))]
OUTPUTS = [TensorSpec("y", "FP32", (-1, WIDTH))]


def stdlib_parse(body: bytes) -> protocol.InferRequest:
    return protocol._parse(protocol._stdlib_loads(body), memoryview(b""), INPUTS, OUTPUTS,
                           None, exact=True)


def stdlib_encode(request: protocol.InferRequest, y: np.ndarray) -> bytes:
    doc = {"model_name": "mlp2048", "model_version": "1",
           "outputs": [{"name": "y", "datatype": "FP32", "shape": list(y.shape),
                        "data": protocol.json_values(y)}]}
    return json.dumps(doc, separators=(",", ":")).encode()


def orjson_parse(body: bytes) -> protocol.InferRequest:
    return protocol.parse_infer_request(body, None, INPUTS, OUTPUTS)


def orjson_encode(request: protocol.InferRequest, y: np.ndarray) -> bytes:
    return protocol.encode_infer_response("mlp2048", "1", request, {"y": y})[0]


def per_call(fn: Callable[[], object], seconds: float) -> float:
    """Best mean seconds per call over a few rounds of `seconds` / 5 each."""
    fn()
    best = float("inf")
    for _ in range(5):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 5:
            fn()
            n += 1
        best = min(best, elapsed / n)
    return best


def measure(rows: int, seconds: float) -> dict[str, float]:
    x = np.random.default_rng(1).uniform(0.1, 7.0, (rows, WIDTH)).astype(np.float32)
    y = np.random.default_rng(2).uniform(-5.0, 5.0, (rows, WIDTH)).astype(np.float32)
    body, _ = protocol.encode_infer_request({"x": x})
    req = orjson_parse(body)
    # Same answers both ways: the request's array, and the response read back as float32.
    np.testing.assert_array_equal(stdlib_parse(body).inputs["x"], req.inputs["x"])
    for encoded in (stdlib_encode(req, y), orjson_encode(req, y)):
        data = np.asarray(json.loads(encoded)["outputs"][0]["data"], np.float32)
        np.testing.assert_array_equal(data.reshape(y.shape), y)
    return {
        "bytes": len(body),
        "stdlib_parse": per_call(lambda: stdlib_parse(body), seconds),
        "orjson_parse": per_call(lambda: orjson_parse(body), seconds),
        "stdlib_encode": per_call(lambda: stdlib_encode(req, y), seconds),
        "orjson_encode": per_call(lambda: orjson_encode(req, y), seconds),
    }


def run(quick: bool) -> str:
    seconds = 1.0 if quick else 3.0
    out = ["## JSON codec: orjson against json (`benchmarks/json_codec.py`)", "",
           "Decoding and checking a JSON request of float32 rows 2048 wide "
           "(`parse_infer_request`), and encoding a response of the same shape "
           "(`encode_infer_response`), in-process; best of five rounds.", "",
           "| rows | request | decode json | decode orjson | speed-up | encode json "
           "| encode orjson | speed-up | both, speed-up |",
           "|---|---|---|---|---|---|---|---|---|"]
    for rows in (1, 32):
        m = measure(rows, seconds)
        both_std = m["stdlib_parse"] + m["stdlib_encode"]
        both_or = m["orjson_parse"] + m["orjson_encode"]
        out.append(
            f"| {rows} | {m['bytes'] / 1024:.0f} KiB "
            f"| {m['stdlib_parse'] * 1e3:.2f} ms | {m['orjson_parse'] * 1e3:.2f} ms "
            f"| {m['stdlib_parse'] / m['orjson_parse']:.1f}x "
            f"| {m['stdlib_encode'] * 1e3:.2f} ms | {m['orjson_encode'] * 1e3:.2f} ms "
            f"| {m['stdlib_encode'] / m['orjson_encode']:.1f}x | {both_std / both_or:.1f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    print(run(quick=True))
