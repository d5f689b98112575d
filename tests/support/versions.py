"""Versions of the demo model (examples/demo/model.onnx) that are wrong in the ways a bad
release is, for the rollout tests and benchmarks: each is saved where a model's `pvc://`
URI finds it (`<directory>/iris/<version>/model.onnx`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "examples" / "demo" / "model.onnx"


def save_version(directory: Path, version: str, change) -> Path:
    """The demo model, changed by `change(model)`, saved as `version`."""
    import onnx

    model = onnx.load(str(DEMO_MODEL))
    change(model)
    onnx.checker.check_model(model)
    onnx.helper.set_model_props(model, {"version": version})
    path = directory / "iris" / version / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _scaled_initializer(model, name_of: str, change) -> None:
    from onnx import numpy_helper

    node = next(n for n in model.graph.node if n.op_type == name_of)
    for init in model.graph.initializer:
        if init.name in node.input:
            init.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(init)), init.name))


def _checked_first(graph, checks: list) -> None:
    """`checks` (ending in `features_checked`) run first; the model's own nodes read that."""
    original = list(graph.node)
    for n in original:
        n.input[:] = ["features_checked" if i == "features" else i for i in n.input]
    del graph.node[:]
    graph.node.extend(checks + original)


def failing_on_real_inputs(directory: Path, version: str) -> Path:
    """A version that passes the warm-up, which sends zeros, and answers 500 to real inputs:
    the features go through a Reshape whose width is 4 when they are all zero, 5 otherwise."""
    from onnx import TensorProto, helper, numpy_helper

    def change(model) -> None:
        g = model.graph
        g.initializer.extend([numpy_helper.from_array(np.array([1.0], np.float32), "one_f"),
                              numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
                              numpy_helper.from_array(np.array([4], np.int64), "four")])
        checks = [helper.make_node("Abs", ["features"], ["abs_f"]),
                  helper.make_node("ReduceSum", ["abs_f"], ["sum_f"], keepdims=1),
                  helper.make_node("Reshape", ["sum_f", "minus_one"], ["sum_1"]),
                  helper.make_node("Min", ["sum_1", "one_f"], ["any_f"]),
                  helper.make_node("Ceil", ["any_f"], ["any_c"]),
                  helper.make_node("Cast", ["any_c"], ["any_i"], to=TensorProto.INT64),
                  helper.make_node("Add", ["four", "any_i"], ["width"]),
                  helper.make_node("Concat", ["minus_one", "width"], ["shape"], axis=0),
                  helper.make_node("Reshape", ["features", "shape"], ["features_checked"])]
        _checked_first(g, checks)

    return save_version(directory, version, change)


def refusing_real_inputs(directory: Path, version: str) -> Path:
    """A version that passes the warm-up, which sends zeros, and whose engine refuses real
    inputs (ONNX Runtime's INVALID_ARGUMENT, a 400, not a 500): each row picks a row of a
    4-row table by index 0 when its features are all zero, 7 otherwise (a Gather out of
    range), and adds 0 x that row to the features."""
    from onnx import TensorProto, helper, numpy_helper

    def change(model) -> None:
        g = model.graph
        g.initializer.extend([numpy_helper.from_array(np.array([1.0], np.float32), "one_r"),
                              numpy_helper.from_array(np.array([1], np.int64), "axis_r"),
                              numpy_helper.from_array(np.array(7, np.int64), "seven_r"),
                              numpy_helper.from_array(np.array(0.0, np.float32), "zero_r"),
                              numpy_helper.from_array(np.zeros((4, 4), np.float32), "table_r")])
        checks = [helper.make_node("Abs", ["features"], ["abs_r"]),
                  helper.make_node("ReduceSum", ["abs_r", "axis_r"], ["sum_r"], keepdims=0),
                  helper.make_node("Min", ["sum_r", "one_r"], ["any_r"]),
                  helper.make_node("Ceil", ["any_r"], ["ceil_r"]),
                  helper.make_node("Cast", ["ceil_r"], ["flag_r"], to=TensorProto.INT64),
                  helper.make_node("Mul", ["flag_r", "seven_r"], ["index_r"]),
                  helper.make_node("Gather", ["table_r", "index_r"], ["row_r"], axis=0),
                  helper.make_node("Mul", ["row_r", "zero_r"], ["nothing_r"]),
                  helper.make_node("Add", ["features", "nothing_r"], ["features_checked"])]
        _checked_first(g, checks)

    return save_version(directory, version, change)


def shifted_version(directory: Path, version: str) -> Path:
    """A version that answers 200 with other numbers: the first class's bias moved by 5."""
    def change(model) -> None:
        _scaled_initializer(model, "Add", lambda b: (b + np.array([5.0, 0, 0], np.float32)).astype(np.float32))
    return save_version(directory, version, change)


def retrained_version(directory: Path, version: str) -> Path:
    """A version with tiny float differences (weights x (1 + 1e-6)): it should pass."""
    def change(model) -> None:
        _scaled_initializer(model, "MatMul", lambda w: (w * np.float32(1 + 1e-6)).astype(np.float32))
    return save_version(directory, version, change)


def slow_version(directory: Path, version: str) -> Path:
    """The demo model's answers behind a needless 20-layer MLP (times zero): the same outputs,
    about a hundred times the latency - a version that is worse the way a bad build is, and
    a model whose engine a few clients keep busy (the autoscaling benchmarks)."""
    import onnx
    from onnx import numpy_helper

    def change(model) -> None:
        g, rng, width = model.graph, np.random.default_rng(7), 1024
        layers, x = [], "features"
        for i, (rows, cols) in enumerate([(4, width)] + [(width, width)] * 20 + [(width, 3)]):
            g.initializer.append(numpy_helper.from_array(rng.standard_normal((rows, cols)).astype(np.float32), f"w{i}"))
            layers += [onnx.helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]),
                       onnx.helper.make_node("Tanh", [f"h{i}"], [f"t{i}"])]
            x = f"t{i}"
        g.initializer.append(numpy_helper.from_array(np.zeros((1,), np.float32), "zero"))
        layers += [onnx.helper.make_node("Mul", [x, "zero"], ["nothing"])]
        scores = next(n for n in g.node if n.op_type == "Add").output[0]
        first = [n for n in g.node if n.op_type in ("MatMul", "Add")]
        last = [n for n in g.node if n.op_type not in ("MatMul", "Add")]
        for n in last:  # the outputs read the scores plus nothing
            n.input[:] = [f"{scores}_slow" if i == scores else i for i in n.input]
        nodes = first + layers + [onnx.helper.make_node("Add", [scores, "nothing"], [f"{scores}_slow"])] + last
        del g.node[:]
        g.node.extend(nodes)  # in topological order, as the ONNX checker (kiln build) requires

    return save_version(directory, version, change)
