"""The embedded backend: ONNX Runtime on the CPU (a laptop, CI, a CPU node).

Build validates the ONNX model and writes ONNX Runtime's offline-optimized graph (the
"engine", `engine.onnx`, optimized up to "extended", what holds on any CPU); the load adds
the layout transforms tied to the CPU it runs on ("all"), which cannot be saved. An engine
is built for the `cpu` target only: this backend runs on the CPU provider, and an engine
labelled for a GPU would run on the CPU of a GPU node. fp16 converts the
weights with ONNX Runtime's own float16 tool, inputs and outputs kept fp32; int8, fp8
and bf16 need a GPU backend or a model quantized beforehand, and are refused clearly.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from kiln.runtime.engine.backends.base import (BackendError, BuildOptions, InvalidInputError,
                                        InvalidModelError, ShapeRange, TensorSpec,
                                        UnsupportedError)
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
KNOWN_FLAGS = {"graphOptimizationLevel": OPTIMIZATION_LEVELS}


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


class OnnxRuntimeBackend:
    name = "onnxruntime"
    engine_filename = "engine.onnx"
    uses_gpu = False  # the CPU execution provider only, whatever the node has

    def __init__(self, intra_op_threads: int | None = None, allow_spinning: bool | None = None):
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
        import onnxruntime as ort
        return ort.__version__

    def build(self, onnx_model: bytes, options: BuildOptions) -> bytes:
        import onnx
        import onnxruntime as ort

        unknown = sorted(set(options.builder_flags) - set(KNOWN_FLAGS))
        if unknown:
            known = ", ".join(f"{k} ({' | '.join(v)})" for k, v in KNOWN_FLAGS.items())
            raise UnsupportedError(f"builder flag(s) {unknown} mean nothing to the onnxruntime "
                                   f"backend; it knows: {known}")
        level_name = str(options.builder_flags.get("graphOptimizationLevel", "extended"))
        if level_name not in OPTIMIZATION_LEVELS:
            raise UnsupportedError(f"graphOptimizationLevel {level_name!r}: use one of "
                                   f"{', '.join(OPTIMIZATION_LEVELS)}")
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
            try:
                ort.InferenceSession(model.SerializeToString(), so,
                                     providers=["CPUExecutionProvider"])
            except Exception as e:  # ORT raises its own exception types per status code
                if options.precision == "fp16":
                    raise UnsupportedError(
                        f"ONNX Runtime's CPU provider cannot run this model in fp16: {e}; "
                        f"use precision fp32 with the onnxruntime backend") from None
                raise InvalidModelError(f"ONNX Runtime cannot load the model: {e}") from None
            return out.read_bytes()

    def load(self, engine: bytes, profiles: Mapping[str, ShapeRange]) -> "OrtEngine":
        import onnxruntime as ort

        so = _session_options(ort, self.intra_op_threads, self.allow_spinning)
        # The build did what holds on any CPU; "all" adds this CPU's layout transforms (NCHWc
        # convolutions), which a saved engine cannot carry, for about a millisecond of load.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            session = ort.InferenceSession(bytes(engine), so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise BackendError(f"ONNX Runtime cannot load the engine: {e}") from None
        loaded = OrtEngine(session, dict(profiles))
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
            from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

            if isinstance(e, InvalidArgument):  # the feeds: a shape, a type, an index past the end
                raise InvalidInputError(f"ONNX Runtime refused the inputs: "
                                        f"{' '.join(str(e).split())}") from None
            raise BackendError(f"ONNX Runtime failed to run the batch: {e}") from None
        return dict(zip(self._engine._output_names, results))

    def close(self) -> None:
        self._engine = _CLOSED


class _Closed:
    session = None


_CLOSED: Any = _Closed()
