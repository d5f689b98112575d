"""The v2 server as the tests run it: a real ONNX model (a float32 and an int64 input,
three outputs, a dynamic batch dimension) built by `build_engine` into a real cache, and
`InferenceServer` on 127.0.0.1 on its own event loop in a thread, as in a pod, with a plain
HTTP client over real sockets. Shared by the server, gRPC, front-end, hostile-input and
fuzzing tests; every answer is compared with ONNX Runtime run directly on the same model.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kiln.runtime.engine.build import BuildRequest, build_engine
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.model import ServedModel
from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.serving.servers import InferenceServer

from .kilnprocess import KilnProcess
from .metrics import metric_value

NAME = "multi"
PROFILES = [{"input": "features", "min": [1, 4], "opt": [4, 4], "max": [32, 4]},
            {"input": "token_ids", "min": [1, 3], "opt": [4, 3], "max": [32, 3]}]
RUNTIME = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 2000}}
MAX_BODY = 256 * 1024


# -- the model, the cache, the server ----------------------------------------------------

def multi_model() -> bytes:
    """features FP32 [N,4] + token_ids INT64 [N,3] -> scores FP32 [N,3], label INT64 [N],
    pooled FP32 [N,4]: an embedding bag added to the features, then a 2-layer MLP."""
    rng = np.random.default_rng(7)
    init = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
            for n, s in (("E", (10, 4)), ("W1", (4, 8)), ("b1", (8,)), ("W2", (8, 3)),
                         ("b2", (3,)))]
    init.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"))
    nodes = [
        helper.make_node("Gather", ["E", "token_ids"], ["emb"], axis=0),
        helper.make_node("ReduceSum", ["emb", "axis1"], ["pooled"], keepdims=0),
        helper.make_node("Add", ["features", "pooled"], ["x"]),
        helper.make_node("MatMul", ["x", "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["s0"]),
        helper.make_node("Add", ["s0", "b2"], ["scores"]),
        helper.make_node("ArgMax", ["scores"], ["label"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "multi",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("token_ids", TensorProto.INT64, ["N", 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["N", 4])],
        init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def sample(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"features": rng.standard_normal((batch, 4)).astype(np.float32),
            "token_ids": rng.integers(0, 10, size=(batch, 3)).astype(np.int64)}


class Built:
    def __init__(self, root: Path):
        self.onnx = multi_model()
        (root / "multi.onnx").write_bytes(self.onnx)
        self.cache = root / "cache"
        request = BuildRequest.from_dict({
            "namespace": "default", "name": NAME,
            "model": {"uri": (root / "multi.onnx").as_uri(), "version": "1"},
            "engine": {"backend": "onnxruntime", "precision": "fp32", "profiles": PROFILES},
            "target": "cpu"})
        self.result = build_engine(request, self.cache, allow_local_files=True)
        self.rel = self.result.path
        self.session = ort.InferenceSession(self.onnx, providers=["CPUExecutionProvider"])

    def expected(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, inputs)))


class HttpClient:
    """A plain HTTP client over real sockets to a server on 127.0.0.1:`port`."""

    def __init__(self, port: int):
        self.port = port

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 20):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def get(self, path: str):
        status, headers, body = self.request("GET", path)
        return status, headers, json.loads(body) if path != "/metrics" else body.decode()

    def infer(self, doc, path: str = f"/v2/models/{NAME}/infer"):
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        status, headers, raw = self.request("POST", path, body,
                                            {"Content-Type": "application/json"})
        return status, headers, json.loads(raw)

    def metric(self, name: str, **labels) -> float | None:
        _, _, text = self.get("/metrics")
        return metric_value(text, name, labels)


class ServerThread(HttpClient):
    """An InferenceServer on its own event loop in a thread, on a free port: one process,
    what `kiln serve` runs on fewer than 3 CPUs."""

    def __init__(self, cache: Path, engines: dict[str, str], runtime: dict | None = None,
                 max_body_bytes: int = MAX_BODY, target: str = "cpu",
                 grpc_port: int | None = None, **server_args):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.metrics = ServerMetrics()
        self.model = ServedModel(NAME, "1", cache, engines, runtime_with_defaults(runtime or RUNTIME),
                                 self.metrics,
                                 target=target)
        self.server = InferenceServer([self.model], self.metrics,
                                      max_body_bytes=max_body_bytes, **server_args)
        self.url = self.call(self.server.start("127.0.0.1", 0, grpc_port))
        super().__init__(urllib.parse.urlsplit(self.url).port)

    @property
    def grpc_address(self) -> str | None:
        return self.server.grpc_address

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_loaded(self) -> bool:
        return self.call(self.server.wait_loaded())

    def close(self) -> None:
        self.call(self.server.shutdown(2.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class ServeProcess(HttpClient):
    """`kiln serve` in the topology a pod with more than 2 CPUs runs: `workers` front-end
    processes (HTTP) before `engine_processes` engine processes, forced by their flags
    (on CI's 2 cores `kiln serve` would choose one process; `workers=1`: one process),
    HTTP and gRPC on free loopback ports; Ready when constructed."""

    def __init__(self, cache: Path, engines: dict[str, str], runtime: dict | None = None,
                 max_body_bytes: int = MAX_BODY, workers: int = 2, engine_processes: int = 2,
                 name: str = NAME, cwd: Path | None = None):
        args = ["serve", "--model-name", name, "--cache-dir", str(cache),
                *(f"--engine={target}={rel}" for target, rel in engines.items()),
                "--runtime-spec", json.dumps(runtime or RUNTIME),
                "--max-body-bytes", str(max_body_bytes), "--host", "127.0.0.1", "--port", "0",
                "--grpc-port", "0", "--workers", str(workers),
                "--engine-processes", str(engine_processes), "--drain-seconds", "5"]
        self.process = KilnProcess(args, cwd or Path(cache).parent)
        try:
            listening = (r"front-end worker\(s\) on" if workers > 1 else "listening on")
            super().__init__(int(self.process.wait_for(
                listening + r" 127\.0\.0\.1:(\d+)", 60).group(1)))
            self.grpc_address = "127.0.0.1:" + self.process.wait_for(
                r"gRPC listening on 127\.0\.0\.1:(\d+)").group(1)
            self.url = f"http://127.0.0.1:{self.port}"
            self._wait_ready(60)
        except BaseException:
            self.process.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.request("GET", "/v2/health/ready", timeout=5)[0] == 200:
                    return
            except OSError:
                pass  # the front ends are not listening yet
            assert time.monotonic() < deadline, "\n".join(self.process.lines)
            time.sleep(0.05)

    def pids(self) -> list[int]:
        """The engine's front-end and engine processes (its children), itself first."""
        return [self.process.proc.pid, *children(self.process.proc.pid)]

    def close(self) -> None:
        self.process.stop()


# What a door test runs on: the single process, and front ends before two engine processes.
TOPOLOGIES = ("one process", "front ends + 2 engines")


def serve_in(topology: str, cache: Path, engines: dict[str, str], runtime: dict | None = None,
             max_body_bytes: int = MAX_BODY) -> ServerThread | ServeProcess:
    """A ready server in `topology` (one of TOPOLOGIES), gRPC on too."""
    if topology == TOPOLOGIES[0]:
        server = ServerThread(cache, engines, runtime, max_body_bytes, grpc_port=0)
        assert server.wait_loaded(), server.model.status_message()
        return server
    return ServeProcess(cache, engines, runtime, max_body_bytes)


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (multiprocessing's resource tracker among them)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def json_inputs(inputs: dict[str, np.ndarray]) -> list[dict]:
    dt = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
    return [{"name": n, "shape": list(a.shape), "datatype": dt[a.dtype],
             "data": a.reshape(-1).tolist()} for n, a in inputs.items()]


def assert_matches(outputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(outputs) == set(expected)
    for name, want in expected.items():
        got = outputs[name]
        assert got.shape == want.shape, name
        assert got.dtype == want.dtype, name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


# -- other engines, built for the CPU ---------------------------------------------------

def neg_model(width: int) -> bytes:
    """y = -x for x [N, width] float32: a row of it is width * 4 bytes each way."""
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])], "neg",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def build_cpu_engine(root: Path, name: str, onnx_model: bytes) -> str:
    """`onnx_model` built for the CPU into root/cache; its entry, relative to the cache."""
    (root / f"{name}.onnx").write_bytes(onnx_model)
    return build_engine(BuildRequest.from_dict({
        "namespace": "default", "name": name,
        "model": {"uri": (root / f"{name}.onnx").as_uri(), "version": "1"},
        "engine": {"backend": "onnxruntime", "precision": "fp32"}, "target": "cpu"}),
        root / "cache", allow_local_files=True).path
