"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

KILN = Path(sys.executable).parent / "kiln"


class KilnProcess:
    """A `kiln` subprocess whose output (stdout and the stderr log) is collected as it
    arrives, so a test can wait for a line."""

    def __init__(self, args: list[str], cwd: Path, command: tuple[str, ...] = (str(KILN),)):
        # One process unless a test asks for front-end workers (`--workers`): the default
        # follows the machine's CPUs, and the tests' expectations should not.
        env = {**os.environ, "KILN_WORKERS": os.environ.get("KILN_WORKERS", "1")}
        self.proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, timeout: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the output:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
            self._reader.join(5)


@pytest.fixture
def kiln_process():
    """Start `kiln ARGS...` (or `COMMAND ARGS...`) in a directory; every process started is
    stopped afterwards."""
    started: list[KilnProcess] = []

    def start(args: list[str], cwd: Path, command: tuple[str, ...] = (str(KILN),)) -> KilnProcess:
        started.append(KilnProcess(args, cwd, command))
        return started[-1]

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def matmul_onnx() -> bytes:
    """A real ONNX model (an engine, for the onnxruntime backend): y = x @ w, x [batch, 8]."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w, "w")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()
