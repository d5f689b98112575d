"""ONNX Runtime engines: the embedded default on the CPU, and the CUDA provider on a GPU.

One backend, two targets. For `cpu` the build validates the ONNX model and writes ONNX
Runtime's offline-optimized graph (the "engine", `engine.onnx`, optimized up to "extended",
what holds on any CPU); the load adds the layout transforms tied to the CPU it runs on
("all"), which cannot be saved. For a GPU architecture (`sm90`) the build runs on a GPU of
that architecture and optimizes for the CUDA provider (its fusions are CUDA kernels, and a
CPU-optimized graph may not load on CUDA: "FusedConv ... unsupported activation"); the
engine's version names ONNX Runtime's and CUDA's (`1.31.1+cuda13.0`), so both are in the
engine key, and a machine whose ONNX Runtime has no CUDA provider refuses a GPU target
instead of building or running a CPU engine under a GPU's label.

fp16 converts the weights with ONNX Runtime's own float16 tool, inputs and outputs kept fp32,
and the converted engine is checked against the fp32 model on random inputs at the
profiles' optimal shapes before it is published (`fp16Tolerance`); int8, fp8 and bf16 need a
model quantized beforehand, and are refused clearly.

On a GPU each execution context is its own session on its own CUDA stream, with device
buffers for its largest batch bound by I/O binding and a CUDA graph per batch size
(`OrtCudaContext`); runtime/engine/cuda.py holds the buffers and streams.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from kiln.runtime.api.enginekey import CPU_TARGET
from kiln.runtime.engine.backends.base import (DATATYPES, BackendError, BuildOptions, GpuOptions,
                                        InvalidInputError, InvalidModelError, ShapeRange,
                                        TensorSpec, UnsupportedError)
from kiln.runtime.engine.backends.shapes import validate_profiles

THREADS_ENV = "KILN_ORT_INTRA_OP_THREADS"
# "0": intra-op threads sleep as soon as a run ends instead of spinning for more work
# (ONNX Runtime's `session.intra_op.allow_spinning`). Spinning threads take the cores an
# HTTP event loop on the same node needs; see docs/batching.md, Tuning.
SPINNING_ENV = "KILN_ORT_ALLOW_SPINNING"

# ONNX Runtime's type strings -> Open Inference Protocol datatypes.
ORT_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(int8)": "INT8",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
}

# Offline optimization stops at "extended": "all" adds layout changes tied to the CPU
# that built the model, and an engine must load on any CPU node.
OPTIMIZATION_LEVELS = ("disabled", "basic", "extended")
# An fp16 engine's largest difference from the fp32 model on any output, as a fraction of
# that output's largest magnitude, on random inputs at the profiles' optimal shapes.
DEFAULT_FP16_TOLERANCE = 0.02
KNOWN_FLAGS = {"graphOptimizationLevel": " | ".join(OPTIMIZATION_LEVELS),
               "fp16Tolerance": "a number from 0 to 1"}
CUDA_PROVIDER = "CUDAExecutionProvider"


def _dims(shape: list[Any]) -> tuple[int, ...]:
    # ORT reports symbolic or unknown dimensions as strings or None.
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)


def _onnx_input_shapes(model) -> dict[str, tuple[int, ...]]:
    initializers = {i.name for i in model.graph.initializer}
    shapes = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)
    return shapes


def _session_options(ort, threads: int | None, allow_spinning: bool | None = None):
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    if allow_spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    return so


def _import_ort(cuda: bool) -> Any:
    import onnxruntime as ort

    if cuda:
        if CUDA_PROVIDER not in ort.get_available_providers():
            raise UnsupportedError(
                f"this ONNX Runtime ({ort.__version__}, providers "
                f"{', '.join(ort.get_available_providers())}) has no CUDA provider: a GPU target "
                f"needs onnxruntime-gpu (the kiln-operator[gpu] extra, in the runtime image); "
                f"use target cpu for a CPU engine")
        preload = getattr(ort, "preload_dlls", None)
        if preload is not None and not _preloaded.is_set():
            # CUDA and cuDNN from NVIDIA's pip wheels where the image has them there; a no-op
            # where they are the system's.
            preload()
            _preloaded.set()
    return ort


_preloaded = threading.Event()


def cuda_version() -> str:
    """The CUDA version this ONNX Runtime was built for ("13.0"), from its build info."""
    try:
        from onnxruntime.capi import build_and_package_info as info
    except ImportError:
        info = None
    return str(getattr(info, "cuda_version", "") or "unknown")


class OnnxRuntimeBackend:
    name = "onnxruntime"
    engine_filename = "engine.onnx"

    @classmethod
    def for_target(cls, target: str, gpu: GpuOptions) -> "OnnxRuntimeBackend":
        return cls(target=target, gpu=gpu)

    def __init__(self, intra_op_threads: int | None = None, allow_spinning: bool | None = None,
                 target: str = CPU_TARGET, gpu: GpuOptions | None = None):
        self.target = target
        # The CUDA provider for a GPU target, else the CPU provider, whatever the node has.
        self.uses_gpu = target != CPU_TARGET
        self.gpu = gpu or GpuOptions()
        if intra_op_threads is None and os.environ.get(THREADS_ENV):
            raw = os.environ[THREADS_ENV]
            if not raw.isdigit():
                raise BackendError(f"{THREADS_ENV} must be a non-negative integer, got {raw!r}")
            intra_op_threads = int(raw)
        if intra_op_threads is not None and intra_op_threads < 0:
            raise BackendError(f"intra-op threads must be >= 0, got {intra_op_threads}")
        self.intra_op_threads = intra_op_threads or None  # 0: ONNX Runtime's default
        if allow_spinning is None and os.environ.get(SPINNING_ENV):
            raw = os.environ[SPINNING_ENV].strip()
            if raw not in ("0", "1"):
                raise BackendError(f"{SPINNING_ENV} must be 0 or 1, got {raw!r}")
            allow_spinning = raw == "1"
        # Off unless asked for: spinning threads take the core the event loop needs, for
        # 1-2% of engine speed (docs/batching.md, Tuning).
        self.allow_spinning = False if allow_spinning is None else allow_spinning

    def version(self) -> str:
        """ONNX Runtime's version; on a GPU target CUDA's too (`1.31.1+cuda13.0`)."""
        ort = _import_ort(self.uses_gpu)
        return f"{ort.__version__}+cuda{cuda_version()}" if self.uses_gpu else ort.__version__

    def _providers(self) -> list[Any]:
        if not self.uses_gpu:
            return ["CPUExecutionProvider"]
        return [(CUDA_PROVIDER, {"device_id": str(self.gpu.device)}), "CPUExecutionProvider"]

    def _session(self, ort: Any, model: bytes, so: Any, providers: list[Any] | None = None) -> Any:
        """A session that runs where this backend's target says, or BackendError: ONNX Runtime
        falls back to the CPU when its CUDA provider fails to start, and an engine for a GPU
        must not run on the CPU unnoticed."""
        session = ort.InferenceSession(model, so, providers=providers or self._providers())
        if self.uses_gpu and CUDA_PROVIDER not in session.get_providers():
            raise BackendError(f"ONNX Runtime did not start its CUDA provider on GPU "
                               f"{self.gpu.device} (session providers: "
                               f"{', '.join(session.get_providers())}); its log says why")
        return session

    def build(self, onnx_model: bytes, options: BuildOptions) -> bytes:
        import onnx

        ort = _import_ort(self.uses_gpu)
        unknown = sorted(set(options.builder_flags) - set(KNOWN_FLAGS))
        if unknown:
            known = ", ".join(f"{k} ({v})" for k, v in KNOWN_FLAGS.items())
            raise UnsupportedError(f"builder flag(s) {unknown} mean nothing to the onnxruntime "
                                   f"backend; it knows: {known}")
        level_name = str(options.builder_flags.get("graphOptimizationLevel", "extended"))
        if level_name not in OPTIMIZATION_LEVELS:
            raise UnsupportedError(f"graphOptimizationLevel {level_name!r}: use one of "
                                   f"{', '.join(OPTIMIZATION_LEVELS)}")
        tolerance = options.builder_flags.get("fp16Tolerance", DEFAULT_FP16_TOLERANCE)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
                or not 0 <= tolerance <= 1:
            raise UnsupportedError(f"fp16Tolerance must be a number from 0 to 1, got {tolerance!r}")
        if options.precision not in ("fp32", "fp16"):
            raise UnsupportedError(
                f"precision {options.precision!r} is not supported by the onnxruntime backend "
                f"(fp32 and fp16 are); use backend 'tensorrt' on a GPU, or quantize the ONNX "
                f"model beforehand and build it with precision fp32")
        try:
            model = onnx.load_from_string(bytes(onnx_model))
        except Exception as e:  # protobuf's DecodeError and friends
            raise InvalidModelError(f"not an ONNX model: {type(e).__name__}: {e}") from None
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as e:
            raise InvalidModelError(f"the ONNX model is invalid: {e}") from None
        validate_profiles(_onnx_input_shapes(model), options.profiles, require_dynamic=False)
        reference = model.SerializeToString()
        if options.precision == "fp16":
            model = _to_fp16(model)

        level = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                 "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                 "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED}[level_name]
        with tempfile.TemporaryDirectory(prefix="kiln-ort-build-") as tmp:
            out = Path(tmp) / self.engine_filename
            so = _session_options(ort, self.intra_op_threads)
            so.graph_optimization_level = level
            so.optimized_model_filepath = str(out)
            where = f"{self.target}'s CUDA" if self.uses_gpu else "CPU"
            try:
                self._session(ort, model.SerializeToString(), so)
            except BackendError:
                raise
            except Exception as e:  # ORT raises its own exception types per status code
                if options.precision == "fp16":
                    raise UnsupportedError(
                        f"ONNX Runtime's {where} provider cannot run this model in fp16: {e}; "
                        f"use precision fp32 with the onnxruntime backend") from None
                raise InvalidModelError(f"ONNX Runtime cannot load the model: {e}") from None
            engine = out.read_bytes()
        if options.precision == "fp16":
            self._check_fp16(ort, reference, engine, options.profiles, float(tolerance))
        return engine

    def _check_fp16(self, ort: Any, reference: bytes, engine: bytes,
                    profiles: Mapping[str, ShapeRange], tolerance: float) -> None:
        """Refuse an fp16 engine whose answers stray from the fp32 model's: the same random
        inputs (at the profiles' optimal shapes, 1 for other dynamic dimensions) through
        both, on this backend's provider."""
        so = _session_options(ort, self.intra_op_threads)
        fp32, fp16 = self._session(ort, reference, so), self._session(ort, engine, so)
        rng = np.random.default_rng(0)
        feeds = {}
        for arg in fp32.get_inputs():
            spec = _spec(arg)
            shape = profiles[spec.name].opt if spec.name in profiles else \
                tuple(d if d >= 0 else 1 for d in spec.shape)
            dtype = DATATYPES[spec.datatype]
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" \
                else np.zeros(shape, dtype)
        names = [o.name for o in fp32.get_outputs()]
        expected, got = fp32.run(names, feeds), fp16.run(names, feeds)
        for name, want, have in zip(names, expected, got):
            want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
            if not np.all(np.isfinite(have)) and np.all(np.isfinite(want)):
                raise UnsupportedError(
                    f"the fp16 engine gives non-finite values on output {name!r} where the fp32 "
                    f"model does not (values beyond fp16's range, 65504?); build it as fp32")
            scale = float(np.max(np.abs(want))) if want.size else 0.0
            error = float(np.max(np.abs(have - want))) / scale if scale > 0 else \
                float(np.max(np.abs(have - want), initial=0.0))
            if error > tolerance:
                raise UnsupportedError(
                    f"the fp16 engine disagrees with the fp32 model on output {name!r}: its "
                    f"largest difference is {error:.2%} of the output's largest magnitude, over "
                    f"the tolerance of {tolerance:.2%} (random inputs at the profiles' optimal "
                    f"shapes); build it as fp32, or raise builderFlags.fp16Tolerance")

    def load(self, engine: bytes, profiles: Mapping[str, ShapeRange]) -> "OrtEngine":
        ort = _import_ort(self.uses_gpu)
        if self.uses_gpu:
            from kiln.runtime.engine.backends.onnxruntime_cuda import OrtCudaEngine

            return self._with_defaults(OrtCudaEngine(self, ort, bytes(engine), dict(profiles)),
                                       engine)
        so = _session_options(ort, self.intra_op_threads, self.allow_spinning)
        # The build did what holds on any CPU; "all" adds this CPU's layout transforms (NCHWc
        # convolutions), which a saved engine cannot carry, for about a millisecond of load.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            session = ort.InferenceSession(bytes(engine), so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise BackendError(f"ONNX Runtime cannot load the engine: {e}") from None
        return self._with_defaults(OrtEngine(session, dict(profiles)), engine)

    @staticmethod
    def _with_defaults(loaded: Any, engine: bytes) -> Any:
        if 0 < len(loaded.defaults) <= MAX_DEFAULT_INPUTS:
            loaded.default_values = _initializer_values(engine, {s.name for s in loaded.defaults})
        return loaded


# Inputs with a default value (an initializer of the same name) whose values `load` reads:
# a stateful model's declared initial state. A model exported with every weight as an input
# has hundreds; their values are not read (their state starts at zeros).
MAX_DEFAULT_INPUTS = 64


def _initializer_values(engine: bytes, names: set[str]) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load_from_string(bytes(engine))
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in names}


def _to_fp16(model):
    try:
        # Maintained with ONNX Runtime itself (onnxruntime.transformers).
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError:
        raise UnsupportedError(
            "precision fp16 needs onnxruntime.transformers.float16, which this ONNX Runtime "
            "installation lacks; use precision fp32") from None
    return convert_float_to_float16(model, keep_io_types=True)


def _spec(arg) -> TensorSpec:
    datatype = ORT_DATATYPES.get(arg.type)
    if datatype is None:
        raise UnsupportedError(f"tensor {arg.name!r} has type {arg.type}, which the Open "
                               f"Inference Protocol datatypes here do not cover")
    return TensorSpec(name=arg.name, datatype=datatype, shape=_dims(arg.shape))


class OrtEngine:
    contexts_any_thread = True  # an InferenceSession may be run from any thread

    def __init__(self, session, profiles: dict[str, ShapeRange]):
        self.session = session
        self.inputs = [_spec(a) for a in session.get_inputs()]
        self.outputs = [_spec(a) for a in session.get_outputs()]
        # Inputs that have a default (ONNX: a graph input that is also an initializer): ONNX
        # Runtime leaves them out of get_inputs() and uses the default unless one is fed.
        self.defaults = [_spec(a) for a in session.get_overridable_initializers()]
        self.default_values: dict[str, np.ndarray] = {}
        self.profiles = profiles
        self._output_names = [o.name for o in self.outputs]

    def create_context(self) -> "OrtContext":
        if self.session is None:
            raise BackendError("the engine is closed")
        return OrtContext(self)

    def close(self) -> None:
        self.session = None


class OrtContext:
    """A cheap handle: ONNX Runtime sessions are safe to run from several threads."""

    def __init__(self, engine: OrtEngine):
        self._engine = engine

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._engine.session
        if session is None:
            raise BackendError("the engine is closed")
        try:
            results = session.run(self._engine._output_names, dict(inputs))
        except Exception as e:
            raise _run_error(e) from None
        return dict(zip(self._engine._output_names, results))

    def close(self) -> None:
        self._engine = _CLOSED


def _run_error(e: Exception) -> BackendError:
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    if isinstance(e, BackendError):
        return e
    if isinstance(e, InvalidArgument):  # the feeds: a shape, a type, an index past the end
        return InvalidInputError(f"ONNX Runtime refused the inputs: {' '.join(str(e).split())}")
    return BackendError(f"ONNX Runtime failed to run the batch: {e}")


class _Closed:
    session = None


_CLOSED: Any = _Closed()
