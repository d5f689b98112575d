"""Two small stateful ONNX models for the sequence tests and the benchmark, made with
onnx.helper (deterministic weights from a seeded generator), and a real Redis to keep
their state in.

- `autoregressive_model(H, V)`: `token` [1, 1] INT64 and `past` [1, H] FP32 ->
  `present` = tanh(past @ A + E[token]) [1, H], `logits` = present @ W [1, V] and
  `next_token` = argmax(logits) [1, 1] INT64: one token per step, fed back as the next input.
- `rnn_model(D, H)`: `x` [1, D] and `h` [1, H] -> `h_next` = tanh(x @ W + h @ U) [1, H],
  `y` = h_next @ V [1, 4].
- `build_engine_for(root, name, onnx, states)`: such a model built for the CPU into root/cache.
- `RedisServer`: Debian's `redis-server` on a free loopback port, no persistence, in a
  temporary directory; stopped (and restartable on the same port) by the test.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

AR_STATES = [{"input": "past", "output": "present"}]
RNN_STATES = [{"input": "h", "output": "h_next"}]


def build_engine_for(root: Path, name: str, onnx_bytes: bytes, states=None):
    """`onnx_bytes` built for the CPU into root/cache (with its sequence state pairs, if any);
    the BuildResult."""
    from kiln.runtime.engine.build import BuildRequest, build_engine

    (root / f"{name}.onnx").write_bytes(onnx_bytes)
    request = BuildRequest.from_dict({
        "namespace": "default", "name": name,
        "model": {"uri": (root / f"{name}.onnx").as_uri(), "version": "1"},
        "engine": {"backend": "onnxruntime", "precision": "fp32"}, "target": "cpu",
        "sequenceStates": states})
    return build_engine(request, root / "cache", allow_local_files=True)


def _model(graph):
    from onnx import checker, helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    checker.check_model(model)
    return model.SerializeToString()


def autoregressive_model(hidden: int = 16, vocab: int = 11, seed: int = 0) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weights = {
        "A": rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.5,
        "E": rng.standard_normal((vocab, hidden)).astype(np.float32),
        "W": rng.standard_normal((hidden, vocab)).astype(np.float32),
    }
    init = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    init.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"))
    nodes = [
        helper.make_node("Gather", ["E", "token"], ["emb3"], axis=0),  # [1, 1, H]
        helper.make_node("ReduceSum", ["emb3", "axis1"], ["emb"], keepdims=0),  # [1, H]
        helper.make_node("MatMul", ["past", "A"], ["pa"]),
        helper.make_node("Add", ["pa", "emb"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["present"]),
        helper.make_node("MatMul", ["present", "W"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["next_token"], axis=1, keepdims=1),
    ]
    graph = helper.make_graph(
        nodes, "autoregressive",
        [helper.make_tensor_value_info("token", TensorProto.INT64, [1, 1]),
         helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, hidden])],
        [helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, hidden]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, vocab]),
         helper.make_tensor_value_info("next_token", TensorProto.INT64, [1, 1])],
        init)
    return _model(graph)


def rnn_model(inputs: int = 8, hidden: int = 32, seed: int = 1, batch: int | str = 1,
              initial_h: float | None = None) -> bytes:
    """`initial_h`: `h` also gets an initializer of this value, the model's declared initial
    state (ONNX: a graph input with a default)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weights = {
        "W": rng.standard_normal((inputs, hidden)).astype(np.float32) * 0.4,
        "U": rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.3,
        "V": rng.standard_normal((hidden, 4)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("MatMul", ["h", "U"], ["hu"]),
        helper.make_node("Add", ["xw", "hu"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["h_next"]),
        helper.make_node("MatMul", ["h_next", "V"], ["y"]),
    ]
    if initial_h is not None:
        weights["h"] = np.full((1, hidden), initial_h, dtype=np.float32)
    graph = helper.make_graph(
        nodes, "rnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, inputs]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [batch, hidden])],
        [helper.make_tensor_value_info("h_next", TensorProto.FLOAT, [batch, hidden]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return _model(graph)


def reference_autoregressive(session, first_token: int, steps: int, hidden: int = 16):
    """The uninterrupted run, straight through ONNX Runtime: [(logits, next_token)] per step."""
    past = np.zeros((1, hidden), dtype=np.float32)
    token = np.array([[first_token]], dtype=np.int64)
    out = []
    for _ in range(steps):
        present, logits, nxt = session.run(["present", "logits", "next_token"],
                                           {"token": token, "past": past})
        out.append((logits, nxt))
        past, token = present, nxt
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


class RedisServer:
    """`redis-server` on 127.0.0.1:<free port>, nothing saved to disk, in `workdir`."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None):
        self.binary = redis_server_binary()
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (make redis, or "
                               "apt-get install redis-server)")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes",
             "--daemonize", "no", "--loglevel", "warning",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "redis-server exited at start"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def command(self, *args: str) -> bytes:
        """One command in RESP, its raw answer (enough for FLUSHALL, DBSIZE, KEYS)."""
        wire = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(wire.encode())
            time.sleep(0.01)
            return s.recv(1 << 16)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
