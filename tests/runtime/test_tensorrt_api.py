"""The tensorrt backend against the real TensorRT runtime API, and its builder control flow.

CI has no GPU and cannot install TensorRT's builder (NVIDIA's index is unreachable), but
PyPI's lean runtime bindings (`tensorrt_lean_bindings`) import on a CPU machine: the first
tests check every runtime class, method and enum member the backend calls exists there,
with the signature the backend relies on. The builder half (Builder, OnnxParser, ...) is
absent from the lean bindings, so its control flow is tested with a FAKE `trt` module
that records calls; it runs for real only where TensorRT is installed.
"""

import inspect
import re

import pytest

from kiln.runtime.engine.backends import get_backend
from kiln.runtime.engine.backends import tensorrt as trt_backend
from kiln.runtime.engine.backends.base import (BackendError, BuildOptions, InvalidModelError,
                                        InvalidProfileError, ShapeRange, UnsupportedError)

lean = pytest.importorskip("tensorrt_lean_bindings",
                           reason="needs tensorrt-lean-cu13-bindings (requirements-test.txt)")

# What TrtEngine / TrtContext / TensorRTBackend.load call on the runtime classes.
RUNTIME_API = {
    "Runtime": ["deserialize_cuda_engine"],
    "ICudaEngine": ["num_io_tensors", "get_tensor_name", "get_tensor_mode", "get_tensor_dtype",
                    "get_tensor_shape", "get_tensor_profile_shape", "create_execution_context"],
    "IExecutionContext": ["set_input_shape", "set_tensor_address", "execute_async_v3",
                          "get_tensor_shape"],
    "ILogger": ["log", "INTERNAL_ERROR", "ERROR", "WARNING"],
    "TensorIOMode": ["INPUT", "OUTPUT"],
    "DataType": list(trt_backend.TRT_DATATYPES),
    "MemoryPoolType": ["WORKSPACE"],
}


@pytest.mark.parametrize("cls", sorted(RUNTIME_API))
def test_runtime_api_exists_on_the_real_bindings(cls):
    missing = [m for m in RUNTIME_API[cls] if not hasattr(getattr(lean, cls), m)]
    assert not missing, f"tensorrt_lean_bindings.{cls} lacks {missing}"


def _signature(method) -> str:
    return (method.__doc__ or "").replace("tensorrt_lean_bindings.tensorrt_lean.", "")


@pytest.mark.parametrize("method, pattern", [
    (lean.IExecutionContext.execute_async_v3,
     r"execute_async_v3\(self: IExecutionContext, stream_handle: typing\.SupportsInt\) -> bool"),
    (lean.IExecutionContext.set_tensor_address,
     r"set_tensor_address\(self: IExecutionContext, name: str, memory: typing\.SupportsInt\) -> bool"),
    (lean.IExecutionContext.set_input_shape,
     r"set_input_shape\(self: IExecutionContext, name: str, shape: tuple\) -> bool"),
    (lean.IExecutionContext.get_tensor_shape,
     r"get_tensor_shape\(self: IExecutionContext, name: str\) -> Dims"),
    (lean.ICudaEngine.get_tensor_profile_shape,
     r"get_tensor_profile_shape\(self: ICudaEngine, name: str, profile_index: typing\.SupportsInt\) -> list\[Dims\]"),
    (lean.ICudaEngine.get_tensor_mode, r"get_tensor_mode\(self: ICudaEngine, name: str\) -> TensorIOMode"),
    (lean.Runtime.deserialize_cuda_engine,
     r"deserialize_cuda_engine\(self: Runtime, serialized_engine: typing_extensions\.Buffer\) -> ICudaEngine"),
])
def test_runtime_signatures(method, pattern):
    assert re.search(pattern, _signature(method)), _signature(method)[:400]


def test_collecting_logger_subclasses_the_real_ilogger():
    logger = trt_backend.make_logger(lean)
    assert isinstance(logger, lean.ILogger)
    logger.log(lean.ILogger.ERROR, "boom")
    logger.log(lean.ILogger.WARNING, "careful")
    logger.log(lean.ILogger.INFO, "chatter")
    assert logger.errors == ["boom"] and logger.messages == ["ERROR: boom", "WARNING: careful"]


def test_backend_is_registered_and_imports_without_tensorrt():
    backend = get_backend("tensorrt")
    assert backend.name == "tensorrt" and backend.engine_filename == "engine.plan"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(UnsupportedError, match="TensorRT's Python package"):
            backend.version()


# ---- the FAKE builder half ---------------------------------------------------------------


class _Enum:
    def __init__(self, *names):
        for n in names:
            setattr(self, n, f"{type(self).__name__}.{n}")


class FakeTrt:
    """Just enough of TensorRT 10's builder API to drive TensorRTBackend.build."""

    __version__ = "10.13.0"

    def __init__(self, inputs, parse_ok=True, build_ok=True, layers=(), precision_flags=True):
        calls = self.calls = []
        fake = self
        flags = ["TF32", "VERSION_COMPATIBLE", "EXCLUDE_LEAN_RUNTIME", "SPARSE_WEIGHTS", "REFIT",
                 "STRIP_PLAN"] + (["FP16", "BF16", "INT8", "FP8"] if precision_flags else [])
        self.BuilderFlag = type("BuilderFlag", (_Enum,), {})(*flags)
        self.MemoryPoolType = type("MemoryPoolType", (_Enum,), {})("WORKSPACE")
        self.LayerType = type("LayerType", (_Enum,), {})("QUANTIZE", "DEQUANTIZE", "MATRIX_MULTIPLY")

        class ILogger:
            INTERNAL_ERROR, ERROR, WARNING, INFO = 0, 1, 2, 3

            def __init__(self):
                pass
        self.ILogger = ILogger

        class Tensor:
            def __init__(self, name, shape):
                self.name, self.shape = name, shape

        class Network:
            num_inputs = len(inputs)
            num_layers = len(layers)

            def get_input(self, i):
                return Tensor(*list(inputs.items())[i])

            def get_layer(self, i):
                return type("Layer", (), {"type": getattr(fake.LayerType, layers[i])})()

        class Parser:
            num_errors = 0 if parse_ok else 1

            def __init__(self, network, logger):
                calls.append(("OnnxParser",))

            def parse(self, data):
                calls.append(("parse", len(data)))
                return parse_ok

            def get_error(self, i):
                return "In node 0 (parseGraph): INVALID_NODE: Invalid Node - Frobnicate"

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                calls.append(("set_shape", name, tuple(lo), tuple(opt), tuple(hi)))

        class Config:
            def set_memory_pool_limit(self, pool, size):
                calls.append(("set_memory_pool_limit", pool, size))

            def set_flag(self, flag):
                calls.append(("set_flag", flag))

            def clear_flag(self, flag):
                calls.append(("clear_flag", flag))

            def add_optimization_profile(self, profile):
                calls.append(("add_optimization_profile",))
                return 0

            def __setattr__(self, name, value):
                calls.append(("set", name, value))

        class Builder:
            def __init__(self, logger):
                self.logger = logger

            def create_network(self, flags):
                calls.append(("create_network", flags))
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                calls.append(("build_serialized_network",))
                if not build_ok:
                    self.logger.log(ILogger.ERROR, "Insufficient workspace for tactic")
                    return None
                return memoryview(b"PLAN-BYTES")

        self.Builder, self.OnnxParser = Builder, Parser


DYNAMIC = {"x": (-1, 8)}
PROFILE = {"x": ShapeRange((1, 8), (4, 8), (16, 8))}


def test_fp16_build_sets_profile_workspace_and_flags():
    fake = FakeTrt(DYNAMIC)
    backend = trt_backend.TensorRTBackend(trt_module=fake)
    plan = backend.build(b"onnx", BuildOptions(precision="fp16", profiles=PROFILE, workspace_mib=2048,
                                               builder_flags={"tf32": False,
                                                              "builderOptimizationLevel": 5}))
    assert plan == b"PLAN-BYTES" and backend.version() == "10.13.0"
    assert fake.calls == [
        ("create_network", 0), ("OnnxParser",), ("parse", 4),
        ("set_memory_pool_limit", "MemoryPoolType.WORKSPACE", 2048 << 20),
        ("set_flag", "BuilderFlag.FP16"),
        ("set", "builder_optimization_level", 5),
        ("clear_flag", "BuilderFlag.TF32"),
        ("set_shape", "x", (1, 8), (4, 8), (16, 8)), ("add_optimization_profile",),
        ("build_serialized_network",),
    ]


def test_parser_errors_are_reported():
    backend = trt_backend.TensorRTBackend(trt_module=FakeTrt(DYNAMIC, parse_ok=False))
    with pytest.raises(InvalidModelError, match="INVALID_NODE: Invalid Node - Frobnicate"):
        backend.build(b"onnx", BuildOptions(profiles=PROFILE))


def test_failed_build_quotes_the_logger():
    backend = trt_backend.TensorRTBackend(trt_module=FakeTrt(DYNAMIC, build_ok=False))
    with pytest.raises(BackendError, match="could not build the engine: Insufficient workspace"):
        backend.build(b"onnx", BuildOptions(profiles=PROFILE))


def test_dynamic_input_needs_a_profile():
    backend = trt_backend.TensorRTBackend(trt_module=FakeTrt(DYNAMIC))
    with pytest.raises(InvalidProfileError, match="input 'x' has dynamic shape"):
        backend.build(b"onnx", BuildOptions())


def test_int8_needs_explicit_quantization():
    backend = trt_backend.TensorRTBackend(trt_module=FakeTrt(DYNAMIC, layers=["MATRIX_MULTIPLY"]))
    with pytest.raises(UnsupportedError, match="QuantizeLinear/DequantizeLinear"):
        backend.build(b"onnx", BuildOptions(precision="int8", profiles=PROFILE))
    fake = FakeTrt(DYNAMIC, layers=["QUANTIZE", "MATRIX_MULTIPLY", "DEQUANTIZE"])
    trt_backend.TensorRTBackend(trt_module=fake).build(
        b"onnx", BuildOptions(precision="int8", profiles=PROFILE))
    assert ("set_flag", "BuilderFlag.INT8") in fake.calls


def test_precision_flag_missing_from_this_tensorrt():
    backend = trt_backend.TensorRTBackend(trt_module=FakeTrt(DYNAMIC, precision_flags=False))
    with pytest.raises(UnsupportedError, match="needs BuilderFlag.FP16"):
        backend.build(b"onnx", BuildOptions(precision="fp16", profiles=PROFILE))


def test_unknown_or_mistyped_builder_flags():
    backend = trt_backend.TensorRTBackend(trt_module=FakeTrt(DYNAMIC))
    with pytest.raises(UnsupportedError, match=r"unknown builder flag\(s\) \['fastMath'\]"):
        backend.build(b"onnx", BuildOptions(profiles=PROFILE, builder_flags={"fastMath": True}))
    with pytest.raises(UnsupportedError, match="must be true or false"):
        backend.build(b"onnx", BuildOptions(profiles=PROFILE, builder_flags={"tf32": "yes"}))


def test_lean_bindings_lack_the_builder_half():
    # Why the builder tests above use a fake: the real classes are not in the lean runtime.
    assert not hasattr(lean, "Builder") and not hasattr(lean, "OnnxParser")
    assert inspect.isclass(lean.Runtime)
