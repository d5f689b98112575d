"""The GPU backend: TensorRT 10 engines, executed on CUDA streams with pycuda buffers.

Build: `trt.Builder` + `OnnxParser` + one optimization profile from the spec + precision
flags + a workspace limit -> `build_serialized_network` -> `engine.plan`. Load:
`trt.Runtime.deserialize_cuda_engine`. Each execution context owns device buffers sized
for the profile's maximum shapes (allocated once, reused), pinned host buffers and a
CUDA stream; a batch is async copies in, `execute_async_v3`, async copies out, one
synchronize. `tensorrt` and `pycuda` are imported only when used, so this module
imports on any machine; they exist where the builder and runtime images put them
(NVIDIA's TensorRT container plus the `kiln-operator[gpu]` extra).

INT8 and FP8 engines need an explicitly quantized ONNX model (QuantizeLinear /
DequantizeLinear nodes, e.g. from NVIDIA ModelOpt): Kiln does not run implicit
calibration, and says so when the model has no Q/DQ layers.

Static types: the runtime half (Runtime, ICudaEngine, IExecutionContext, ILogger and
their enums) is annotated with the classes of TensorRT's lean runtime bindings, which
install from PyPI and import without a GPU; CI generates stubs from them and runs mypy
over this module (tests/runtime/test_tensorrt_types.py). The builder half (Builder,
BuilderConfig, INetworkDefinition, OnnxParser) exists only in the full bindings, which
CI cannot install: it stays dynamically typed (Any) and is checked against TensorRT's
documented Python API and by unit tests with a fake module. pycuda has no stubs: Any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from kiln.runtime.engine.backends.base import (DATATYPES, BackendError, BuildOptions,
                                        InvalidInputError, InvalidModelError, ShapeRange,
                                        TensorSpec, UnsupportedError)
from kiln.runtime.engine.backends.shapes import validate_profiles
from kiln.runtime.engine.cuda import Device, Staged, import_cuda

if TYPE_CHECKING:
    # Types only, never imported at run time. The full `tensorrt` package that runs here
    # exposes the same runtime classes as the lean bindings (the lean runtime is a subset
    # of it), so these annotations describe the objects `tensorrt` hands back.
    import tensorrt_lean_bindings as trt_types

    class CollectingLogger(trt_types.ILogger):
        """What make_logger returns: an ILogger that keeps warnings and errors."""

        messages: list[str]
        errors: list[str]

DEFAULT_WORKSPACE_MIB = 4096

# precision -> the BuilderFlag that allows it (fp32 needs none).
PRECISION_FLAGS = {"fp16": "FP16", "bf16": "BF16", "int8": "INT8", "fp8": "FP8"}
EXPLICIT_QUANTIZATION = ("int8", "fp8")

# spec.engine.builderFlags -> what they set. Booleans toggle a BuilderFlag; the integers
# set a config attribute. Anything else is refused, so a typo never builds silently.
BOOL_FLAGS = {
    "tf32": "TF32",
    "versionCompatible": "VERSION_COMPATIBLE",
    "excludeLeanRuntime": "EXCLUDE_LEAN_RUNTIME",
    "sparseWeights": "SPARSE_WEIGHTS",
    "refit": "REFIT",
    "stripPlan": "STRIP_PLAN",
}
INT_FLAGS = {
    "builderOptimizationLevel": "builder_optimization_level",
    "maxAuxStreams": "max_aux_streams",
}

# TensorRT DataType member names -> Open Inference Protocol datatypes.
TRT_DATATYPES = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}


def _import_trt() -> Any:
    # Any: the full module also carries the builder half, which has no stubs in CI.
    try:
        import tensorrt
    except ImportError as e:
        raise UnsupportedError(
            f"the tensorrt backend needs TensorRT's Python package ({e}); run it in NVIDIA's "
            f"TensorRT container, or use backend 'onnxruntime' where there is no GPU") from None
    return tensorrt


def make_logger(trt: Any) -> CollectingLogger:
    """A TensorRT logger that keeps warnings and errors, so failures can quote them."""
    # The base class comes from whichever module is in use (tensorrt, the lean bindings or
    # a test's fake), so it is only known at run time; the severities are typed.
    base: Any = trt.ILogger
    levels: type[trt_types.ILogger] = trt.ILogger

    class _CollectingLogger(base):
        def __init__(self) -> None:
            base.__init__(self)
            self.messages: list[str] = []
            self.errors: list[str] = []

        def log(self, severity: trt_types.ILogger.Severity, msg: str) -> None:
            if severity in (levels.INTERNAL_ERROR, levels.ERROR):
                self.errors.append(str(msg))
                self.messages.append(f"ERROR: {msg}")
            elif severity == levels.WARNING:
                self.messages.append(f"WARNING: {msg}")

    return _CollectingLogger()


def _errors(logger: CollectingLogger) -> str:
    return "; ".join(logger.errors[-5:]) or "TensorRT logged no error"


class TensorRTBackend:
    name = "tensorrt"
    engine_filename = "engine.plan"
    uses_gpu = True

    @classmethod
    def for_target(cls, target: str, gpu: Any) -> "TensorRTBackend":
        return cls(device=gpu.device)

    def __init__(self, trt_module: Any = None, cuda_module: Any = None, device: int = 0):
        # The modules are injectable for tests: TensorRT's builder cannot be installed in CI.
        self._trt = trt_module
        self._cuda = cuda_module
        self.device = device

    @property
    def trt(self) -> Any:
        if self._trt is None:
            self._trt = _import_trt()
        return self._trt

    @property
    def cuda(self) -> Any:
        if self._cuda is None:
            self._cuda = import_cuda()
        return self._cuda

    def version(self) -> str:
        return str(self.trt.__version__)

    # -- build ---------------------------------------------------------------------------

    def build(self, onnx_model: bytes, options: BuildOptions) -> bytes:
        # The builder half: untyped (Any) on purpose, see the module docstring.
        trt = self.trt
        if options.precision != "fp32" and options.precision not in PRECISION_FLAGS:
            raise UnsupportedError(f"precision {options.precision!r}: use one of fp32, "
                                   f"{', '.join(PRECISION_FLAGS)}")
        flag_name = PRECISION_FLAGS.get(options.precision)
        if flag_name and not hasattr(trt.BuilderFlag, flag_name):
            raise UnsupportedError(
                f"precision {options.precision!r} needs BuilderFlag.{flag_name}, which TensorRT "
                f"{trt.__version__} does not have (newer releases build strongly typed networks "
                f"only); export the ONNX model in that precision and build it as fp32")
        unknown = sorted(set(options.builder_flags) - set(BOOL_FLAGS) - set(INT_FLAGS))
        if unknown:
            raise UnsupportedError(f"unknown builder flag(s) {unknown}; the tensorrt backend "
                                   f"knows: {', '.join(sorted({**BOOL_FLAGS, **INT_FLAGS}))}")

        logger = make_logger(trt)
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # explicit batch is TensorRT 10's only mode
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(bytes(onnx_model)):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise InvalidModelError("TensorRT's ONNX parser rejected the model: "
                                    + ("; ".join(errors) or _errors(logger)))

        inputs = {}
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            inputs[tensor.name] = tuple(int(d) for d in tensor.shape)
        validate_profiles(inputs, options.profiles, require_dynamic=True)

        if options.precision in EXPLICIT_QUANTIZATION and not _has_qdq(trt, network):
            raise UnsupportedError(
                f"precision {options.precision!r} needs an explicitly quantized ONNX model "
                f"(QuantizeLinear/DequantizeLinear nodes, e.g. from NVIDIA ModelOpt); Kiln "
                f"does not run implicit calibration. Use fp16 or bf16, or quantize the model")

        config = builder.create_builder_config()
        workspace = options.workspace_mib or DEFAULT_WORKSPACE_MIB
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace) << 20)
        if flag_name:
            config.set_flag(getattr(trt.BuilderFlag, flag_name))
        for name, value in sorted(options.builder_flags.items()):
            if name in BOOL_FLAGS:
                if not isinstance(value, bool):
                    raise UnsupportedError(f"builder flag {name} must be true or false, "
                                           f"got {value!r}")
                flag = getattr(trt.BuilderFlag, BOOL_FLAGS[name])
                (config.set_flag if value else config.clear_flag)(flag)
            else:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise UnsupportedError(f"builder flag {name} must be an integer, got {value!r}")
                setattr(config, INT_FLAGS[name], value)

        if options.profiles:
            profile = builder.create_optimization_profile()
            for name, r in sorted(options.profiles.items()):
                profile.set_shape(name, r.min, r.opt, r.max)
            if config.add_optimization_profile(profile) < 0:
                raise BackendError("TensorRT refused the optimization profile: " + _errors(logger))

        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise BackendError("TensorRT could not build the engine: " + _errors(logger))
        return bytes(memoryview(serialized))

    # -- load ----------------------------------------------------------------------------

    def load(self, engine: bytes, profiles: Mapping[str, ShapeRange]) -> "TrtEngine":
        trt = self.trt
        device = Device(self.device, self.cuda)
        with device.current():
            logger = make_logger(trt)
            runtime_class: type[trt_types.Runtime] = trt.Runtime
            runtime = runtime_class(logger)
            cuda_engine = runtime.deserialize_cuda_engine(engine)
            if cuda_engine is None:
                raise BackendError(
                    "TensorRT could not deserialize the engine (built for another GPU "
                    "architecture or TensorRT version?): " + _errors(logger))
            return TrtEngine(trt, device, runtime, cuda_engine, logger, profiles)


def _has_qdq(trt: Any, network: Any) -> bool:
    kinds = (trt.LayerType.QUANTIZE, trt.LayerType.DEQUANTIZE)
    return any(network.get_layer(i).type in kinds for i in range(network.num_layers))


def _datatype(trt: Any, name: str, dtype: trt_types.DataType) -> str:
    for member, v2 in TRT_DATATYPES.items():
        if dtype == getattr(trt.DataType, member):
            return v2
    raise UnsupportedError(f"tensor {name!r} has TensorRT type {dtype}, which the Open "
                           f"Inference Protocol datatypes here do not cover")


def _dims(dims: trt_types.Dims) -> tuple[int, ...]:
    # Dims iterates only through __getitem__ (it has no __iter__), which type checkers do
    # not model: index it.
    return tuple(int(dims[i]) for i in range(len(dims)))


class TrtEngine:
    def __init__(self, trt: Any, device: Device, runtime: trt_types.Runtime,
                 engine: trt_types.ICudaEngine, logger: CollectingLogger,
                 profiles: Mapping[str, ShapeRange]):
        self._trt, self.device = trt, device
        self._runtime: trt_types.Runtime | None = runtime
        self.engine: trt_types.ICudaEngine | None = engine
        self._logger = logger
        io_mode: type[trt_types.TensorIOMode] = trt.TensorIOMode
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            spec = TensorSpec(name=name, datatype=_datatype(trt, name, engine.get_tensor_dtype(name)),
                              shape=_dims(engine.get_tensor_shape(name)))
            if engine.get_tensor_mode(name) == io_mode.INPUT:
                self.inputs.append(spec)
            else:
                self.outputs.append(spec)
        # The engine's own profile 0 is the truth; the manifest's copy fills gaps only.
        self.profiles: dict[str, ShapeRange] = dict(profiles)
        for spec in self.inputs:
            if any(d < 0 for d in spec.shape):
                lo, opt, hi = engine.get_tensor_profile_shape(spec.name, 0)
                self.profiles[spec.name] = ShapeRange(_dims(lo), _dims(opt), _dims(hi))

    def max_shape(self, spec: TensorSpec) -> tuple[int, ...]:
        return self.profiles[spec.name].max if spec.name in self.profiles else spec.shape

    def create_context(self) -> "TrtContext":
        return TrtContext(self)

    def close(self) -> None:
        self.engine = None
        self._runtime = None


class TrtContext:
    """One IExecutionContext with its stream and staged buffers (runtime/engine/cuda.py);
    used by one thread at a time."""

    def __init__(self, engine: TrtEngine):
        self._engine = engine
        if engine.engine is None:
            raise BackendError("the engine is closed")
        cuda_engine = engine.engine
        self._buffers: dict[str, Staged] = {}
        with engine.device.current():
            # TensorRT returns None on failure although its bindings declare no Optional.
            ctx = cuda_engine.create_execution_context()
            if ctx is None:
                raise BackendError("TensorRT could not create an execution context (out of GPU "
                                   "memory?): " + _errors(engine._logger))
            self._ctx: trt_types.IExecutionContext | None = ctx
            self._stream: Any = engine.device.stream()
            # Output sizes follow from the inputs: size them at the inputs' maximum shapes.
            for spec in engine.inputs:
                shape = engine.max_shape(spec)
                if not ctx.set_input_shape(spec.name, shape):
                    raise BackendError(f"input {spec.name!r}: TensorRT refused shape {shape}")
                self._allocate(ctx, spec.name, shape, DATATYPES[spec.datatype])
            for spec in engine.outputs:
                shape = _dims(ctx.get_tensor_shape(spec.name))
                if any(d < 0 for d in shape):
                    raise UnsupportedError(f"output {spec.name!r} has a data-dependent shape "
                                           f"{shape}; Kiln needs outputs sized by their inputs")
                self._allocate(ctx, spec.name, shape, DATATYPES[spec.datatype])

    def _allocate(self, ctx: trt_types.IExecutionContext, name: str, shape: tuple[int, ...],
                  dtype: np.dtype) -> None:
        self._buffers[name] = buffer = self._engine.device.staged(shape, dtype)
        if not ctx.set_tensor_address(name, buffer.pointer):
            raise BackendError(f"tensor {name!r}: TensorRT refused its device address")

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        engine, ctx = self._engine, self._ctx
        if ctx is None:
            raise BackendError("the execution context is closed")
        with engine.device.current():
            for spec in engine.inputs:
                if spec.name not in inputs:
                    raise InvalidInputError(f"missing input {spec.name!r}")
                array = inputs[spec.name]
                if array.size > self._buffers[spec.name].capacity:
                    raise InvalidInputError(f"input {spec.name!r} shape {array.shape} exceeds "
                                            f"the engine's maximum {engine.max_shape(spec)}")
                if not ctx.set_input_shape(spec.name, array.shape):
                    raise InvalidInputError(f"input {spec.name!r}: TensorRT refused shape "
                                            f"{array.shape} (profile "
                                            f"{engine.profiles.get(spec.name)})")
                self._buffers[spec.name].upload(spec.name, array, self._stream)
            if not ctx.execute_async_v3(self._stream.handle):
                raise BackendError("TensorRT failed to enqueue the batch: "
                                   + _errors(engine._logger))
            views = {}
            for spec in engine.outputs:
                shape = _dims(ctx.get_tensor_shape(spec.name))
                count = int(np.prod(shape, dtype=np.int64)) if shape else 1
                views[spec.name] = (self._buffers[spec.name].download(count, self._stream), shape)
            self._stream.synchronize()
            # Copies: the pinned buffers are reused by the next batch.
            return {name: view.reshape(shape).copy() for name, (view, shape) in views.items()}

    def close(self) -> None:
        if self._ctx is None:
            return
        with self._engine.device.current():
            for buf in self._buffers.values():
                buf.free()
            self._buffers.clear()
            self._ctx = None
            self._stream = None
