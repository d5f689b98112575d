"""The onnxruntime backend on real ONNX models: build, load, run, and clear refusals."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.runtime.engine.backends import get_backend
from kiln.runtime.engine.backends.base import (BuildOptions, InvalidModelError, InvalidProfileError,
                                        ShapeRange, TensorSpec, UnsupportedError)


def mlp(seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((8, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


PROFILE = {"x": ShapeRange((1, 8), (4, 8), (16, 8))}


def reference(model: bytes, x):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_build_load_run_matches_onnxruntime():
    backend = get_backend("onnxruntime")
    assert backend.engine_filename == "engine.onnx" and backend.version() == ort.__version__
    model = mlp()
    engine = backend.build(model, BuildOptions(precision="fp32", profiles=PROFILE))
    loaded = backend.load(engine, PROFILE)
    assert loaded.inputs == [TensorSpec("x", "FP32", (-1, 8))]
    assert loaded.outputs == [TensorSpec("y", "FP32", (-1, 4))]
    assert loaded.profiles == PROFILE
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    ctx = loaded.create_context()
    np.testing.assert_allclose(ctx.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)
    ctx.close()
    again = loaded.create_context()  # recreating a context after a failure must work
    np.testing.assert_allclose(again.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)
    loaded.close()


def test_fp16_build_keeps_fp32_io_and_close_results():
    model = mlp()
    backend = get_backend("onnxruntime")
    loaded = backend.load(backend.build(model, BuildOptions(precision="fp16")), {})
    assert loaded.inputs[0].datatype == "FP32"
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(loaded.create_context().run({"x": x})["y"], reference(model, x),
                               rtol=2e-2, atol=2e-2)


def scaled(factor: float) -> bytes:
    """y = x * factor: beyond fp16's range (65504) for a large factor."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])], "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(np.full((8,), factor, np.float32), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_an_fp16_engine_that_strays_from_the_fp32_model_is_refused_with_the_reason():
    backend = get_backend("onnxruntime")
    # 1e6 is beyond fp16 (its largest value is 65504): the converter clamps the weight.
    with pytest.raises(UnsupportedError, match=r"the fp16 engine disagrees with the fp32 model on "
                       r"output 'y': its largest difference is 93\.\d\d% .*build it as fp32"):
        backend.build(scaled(1e6), BuildOptions(precision="fp16"))
    # 1.0001 rounds to 1.0 in fp16: a 0.01% difference, over a tolerance of zero, under 2%.
    with pytest.raises(UnsupportedError, match=r"largest difference is 0\.01% of the output's "
                       r"largest magnitude, over the tolerance of 0\.00%"):
        backend.build(scaled(1.0001), BuildOptions(precision="fp16",
                                                   builder_flags={"fp16Tolerance": 0}))
    assert backend.build(scaled(1.0001), BuildOptions(precision="fp16"))
    with pytest.raises(UnsupportedError, match="fp16Tolerance must be a number from 0 to 1"):
        backend.build(mlp(), BuildOptions(precision="fp16", builder_flags={"fp16Tolerance": "1%"}))


def test_a_gpu_target_without_the_cuda_provider_is_refused_not_run_on_the_cpu():
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has the CUDA provider (the GPU tier tests it)")
    backend = get_backend("onnxruntime", "sm90")
    assert backend.uses_gpu and not get_backend("onnxruntime").uses_gpu
    for call in (backend.version, lambda: backend.build(mlp(), BuildOptions()),
                 lambda: backend.load(b"", {})):
        with pytest.raises(UnsupportedError, match=r"has no CUDA provider: a GPU target needs "
                           r"onnxruntime-gpu \(the kiln-operator\[gpu\] extra"):
            call()


@pytest.mark.parametrize("runtime, capacity, sizes", [
    ({}, 32, (1, 2, 4, 8, 16, 32)),
    ({"batching": {"maxBatchSize": 24}}, 24, (1, 2, 4, 8, 16, 24)),
    ({"gpu": {"graphBatchSizes": [8, 1, 64]}}, 32, (1, 8)),
    ({"gpu": {"cudaGraphs": False}}, 32, ()),
])
def test_cuda_graph_batch_sizes_follow_the_batching_and_the_setting(runtime, capacity, sizes):
    from kiln.runtime.api.spec import runtime_with_defaults
    from kiln.runtime.engine.backends.base import GpuOptions

    options = GpuOptions.from_runtime(runtime_with_defaults(runtime))
    assert options.max_batch == capacity and options.contexts == 2
    assert options.graph_sizes(capacity) == sizes


@pytest.mark.parametrize("precision", ["int8", "fp8", "bf16"])
def test_unsupported_precisions_are_refused(precision):
    with pytest.raises(UnsupportedError, match=f"precision '{precision}' is not supported"):
        get_backend("onnxruntime").build(mlp(), BuildOptions(precision=precision))


def test_invalid_models_profiles_and_flags():
    backend = get_backend("onnxruntime")
    with pytest.raises(InvalidModelError, match="not an ONNX model"):
        backend.build(b"\x00\x01 this is not protobuf", BuildOptions())
    with pytest.raises(InvalidProfileError, match="model's inputs are: x"):
        backend.build(mlp(), BuildOptions(profiles={"images": ShapeRange((1,), (1,), (1,))}))
    with pytest.raises(InvalidProfileError, match="fixed at 8"):
        backend.build(mlp(), BuildOptions(profiles={"x": ShapeRange((1, 4), (1, 4), (1, 4))}))
    with pytest.raises(UnsupportedError, match="graphOptimizationLevel"):
        backend.build(mlp(), BuildOptions(builder_flags={"tf32": True}))
    with pytest.raises(UnsupportedError, match="unknown backend 'triton'"):
        get_backend("triton")


def test_run_errors_are_backend_errors_that_say_whose_they_are():
    from kiln.runtime.engine.backends.base import BackendError, InvalidInputError

    backend = get_backend("onnxruntime")
    loaded = backend.load(backend.build(mlp(), BuildOptions()), {})
    context = loaded.create_context()
    # ONNX Runtime's INVALID_ARGUMENT: the inputs' fault, on one line.
    with pytest.raises(InvalidInputError, match=r"^ONNX Runtime refused the inputs: .*"
                       r"INVALID_ARGUMENT : Got invalid dimensions for input: x [^\n]*$"):
        context.run({"x": np.zeros((2, 3), np.float32)})
    loaded.close()
    with pytest.raises(BackendError, match="the engine is closed") as e:
        context.run({"x": np.zeros((2, 4), np.float32)})
    assert not isinstance(e.value, InvalidInputError)


def test_intra_op_threads_from_the_environment(monkeypatch):
    from kiln.runtime.engine.backends.base import BackendError
    from kiln.runtime.engine.backends.onnxruntime import OnnxRuntimeBackend
    monkeypatch.setenv("KILN_ORT_INTRA_OP_THREADS", "1")
    assert OnnxRuntimeBackend().intra_op_threads == 1
    monkeypatch.setenv("KILN_ORT_INTRA_OP_THREADS", "many")
    with pytest.raises(BackendError, match="KILN_ORT_INTRA_OP_THREADS"):
        OnnxRuntimeBackend()


def test_spinning_from_the_environment(monkeypatch):
    from kiln.runtime.engine.backends.base import BackendError
    from kiln.runtime.engine.backends.onnxruntime import OnnxRuntimeBackend
    monkeypatch.setenv("KILN_ORT_ALLOW_SPINNING", "0")
    backend = OnnxRuntimeBackend()
    assert backend.allow_spinning is False
    loaded = backend.load(backend.build(mlp(), BuildOptions()), {})
    options = loaded.session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    monkeypatch.delenv("KILN_ORT_ALLOW_SPINNING")
    assert OnnxRuntimeBackend().allow_spinning is False  # Kiln's default: off
    monkeypatch.setenv("KILN_ORT_ALLOW_SPINNING", "1")
    assert OnnxRuntimeBackend().allow_spinning is True
    monkeypatch.setenv("KILN_ORT_ALLOW_SPINNING", "yes")
    with pytest.raises(BackendError, match="KILN_ORT_ALLOW_SPINNING must be 0 or 1"):
        OnnxRuntimeBackend()


def test_the_engine_loads_with_this_cpus_layout_optimizations():
    """The build saves what holds on any CPU ("extended"); the load adds the transforms tied to
    the CPU it runs on ("all": NCHWc convolutions), which a saved engine cannot carry. Issue
    47: loaded with none, a convolution model ran at 25-45% of ONNX Runtime alone."""
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "k"], ["c"], strides=[2, 2]), helper.make_node("Relu", ["c"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, 13, 13])],
        [numpy_helper.from_array(rng.standard_normal((16, 3, 7, 7)).astype(np.float32), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    backend = get_backend("onnxruntime")
    loaded = backend.load(backend.build(model.SerializeToString(), BuildOptions()), {})
    assert (loaded.session.get_session_options().graph_optimization_level
            == ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    x = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(loaded.create_context().run({"x": x})["y"], want, rtol=1e-4, atol=1e-4)
