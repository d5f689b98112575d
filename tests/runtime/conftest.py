"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.kilnprocess import KILN, KilnProcess


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
