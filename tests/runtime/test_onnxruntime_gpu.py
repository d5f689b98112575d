"""ONNX Runtime's CUDA provider behind Kiln, on a real GPU: the build for this GPU's
architecture (fp32 and fp16), device buffers, CUDA graphs, contexts recreated, and `kiln serve`
answering with the GPU's series. Skipped without a GPU and onnxruntime-gpu (`make gpu` runs
them where there are both; docs/gpu.md)."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.runtime.engine import build
from kiln.runtime.engine.backends import get_backend
from kiln.runtime.engine.backends.base import GpuOptions
from kiln.runtime.engine.cache.verify import read_verified

pytestmark = pytest.mark.gpu

CLASSES = 10


@pytest.fixture(scope="module")
def target() -> str:
    import onnxruntime as ort

    from kiln.runtime.engine.gpu import detect_target

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"needs an NVIDIA GPU and onnxruntime-gpu (the kiln-operator[gpu] extra); this "
                    f"ONNX Runtime {ort.__version__} has {ort.get_available_providers()}")
    here = detect_target()
    if here == "cpu":
        pytest.skip("needs an NVIDIA GPU: NVML (nvidia-ml-py) sees none")
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        pytest.skip("needs pycuda (the kiln-operator[gpu] extra)")
    return here


def conv_model() -> bytes:
    """A small convolution network: [batch, 3, 32, 32] -> [batch, 10]."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 3, 3, 3)) * 0.2).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    fc = (rng.standard_normal((16, CLASSES)) * 0.5).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("GlobalAveragePool", ["r"], ["p"]),
         helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("MatMul", ["f", "fc"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
         numpy_helper.from_array(fc, "fc")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def reference(x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(conv_model(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory, target):
    """The model built for this GPU in fp32 and fp16: {precision: (cache dir, result)}."""
    root = tmp_path_factory.mktemp("gpu")
    (root / "models").mkdir()
    (root / "models" / "conv.onnx").write_bytes(conv_model())
    results = {}
    for precision in ("fp32", "fp16"):
        request = build.BuildRequest.from_dict({
            "namespace": "ml", "name": "conv", "target": target,
            "model": {"uri": "pvc://models/conv.onnx", "version": "1"},
            "engine": {"backend": "onnxruntime", "precision": precision}})
        results[precision] = build.build_engine(request, root / "cache", pvc_root=root)
    return root / "cache", results


def test_engines_for_this_gpu_carry_cuda_in_their_key_and_differ_by_precision(built, target):
    import onnxruntime as ort

    _cache, results = built
    fp32, fp16 = results["fp32"].manifest, results["fp16"].manifest
    assert fp32.target == fp16.target == target
    assert re.fullmatch(re.escape(ort.__version__) + r"\+cuda\d+\.\d+", fp32.backend_version)
    assert fp32.key != fp16.key
    assert get_backend("onnxruntime").version() == ort.__version__  # cpu: a key of its own


def test_a_build_for_another_architecture_is_refused_here(tmp_path, target):
    other = "sm80" if target != "sm80" else "sm90"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "conv.onnx").write_bytes(conv_model())
    request = build.BuildRequest.from_dict({
        "namespace": "ml", "name": "conv", "target": other,
        "model": {"uri": "pvc://models/conv.onnx", "version": "1"},
        "engine": {"backend": "onnxruntime", "precision": "fp32"}})
    with pytest.raises(build.Unsupported, match=f"this builder has {target}, the request is for "
                                                f"{other}"):
        build.build_engine(request, tmp_path / "cache", pvc_root=tmp_path)


# fp32 within TF32's precision: the CUDA provider computes fp32 convolutions and matrix
# products in TF32 on Ampere and later (its `use_tf32`, on by default); on an H100 the largest
# difference from the CPU was 0.08% of the output's largest magnitude.
TF32 = 2e-3


@pytest.mark.parametrize("precision, tolerance", [("fp32", TF32), ("fp16", 2e-2)])
def test_contexts_answer_as_the_cpu_does_through_device_buffers_and_graphs(built, target,
                                                                            precision, tolerance):
    cache, results = built
    data, manifest, _ = read_verified(cache / results[precision].path)
    options = GpuOptions(max_batch=16, contexts=2)
    engine = get_backend("onnxruntime", target, options).load(data, manifest.profiles())
    assert engine.bound and engine.capacity == 16 and engine.graphs_off is None
    contexts = [engine.create_context() for _ in range(2)]
    assert all(c.sizes == (1, 2, 4, 8, 16) for c in contexts)
    rng = np.random.default_rng(1)
    # Captured sizes, sizes padded up to one, and 17 rows (above the buffers: ONNX Runtime's
    # own copies) all answer as the CPU does.
    for rows in (1, 3, 8, 16, 5, 17):
        x = rng.standard_normal((rows, 3, 32, 32), dtype=np.float32)
        want = reference(x)
        for context in contexts:
            got = context.run({"x": x})["y"]
            assert got.shape == (rows, CLASSES)
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    # A context closed and made again (the pool's retry after a CUDA failure) works, and how
    # long that takes is the recovery's cost.
    contexts[0].close()
    started = time.monotonic()
    again = engine.create_context()
    print(f"context recreated with graphs in {time.monotonic() - started:.3f} s")
    x = rng.standard_normal((4, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(again.run({"x": x})["y"], reference(x), rtol=tolerance,
                               atol=tolerance * np.abs(reference(x)).max())
    for context in (again, contexts[1]):
        context.close()
    engine.close()


def test_graphs_off_by_setting_and_refused_inputs_are_the_clients(built, target):
    from kiln.runtime.engine.backends.base import InvalidInputError

    cache, results = built
    data, manifest, _ = read_verified(cache / results["fp32"].path)
    engine = get_backend("onnxruntime", target, GpuOptions(max_batch=8, cuda_graphs=False)).load(
        data, manifest.profiles())
    context = engine.create_context()
    assert context.sizes == () and engine.graphs_off == "off by setting"
    x = np.random.default_rng(2).standard_normal((3, 3, 32, 32), dtype=np.float32)
    want = reference(x)
    np.testing.assert_allclose(context.run({"x": x})["y"], want, rtol=TF32,
                               atol=TF32 * np.abs(want).max())
    with pytest.raises(InvalidInputError, match="ONNX Runtime refused the inputs"):
        context.run({"x": np.zeros((2, 3, 16, 16), np.float32)})
    context.close()
    engine.close()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def test_kiln_serve_answers_on_the_gpu_and_exports_its_series(built, target, tmp_path,
                                                              kiln_process):
    cache, results = built
    runtime = {"contextsPerGPU": 2, "batching": {"maxBatchSize": 8}}
    p = kiln_process(["serve", "--model-name", "conv", "--cache-dir", str(cache), "--engine",
                      f"{target}={results['fp16'].path}", "--runtime-spec", json.dumps(runtime),
                      "--host", "127.0.0.1", "--port", "0", "--workers", "1"], tmp_path,
                     command=(sys.executable, "-m", "kiln.cli"))
    port = int(p.wait_for(r"listening on 127\.0\.0\.1:(\d+)", timeout=120).group(1))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            _get(f"{base}/v2/health/ready")
            break
        except OSError:
            time.sleep(0.2)
    x = np.random.default_rng(3).standard_normal((2, 3, 32, 32), dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()
    request = urllib.request.Request(f"{base}/v2/models/conv/infer", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    y = np.array(answer["outputs"][0]["data"], np.float32).reshape(2, CLASSES)
    np.testing.assert_allclose(y, reference(x), rtol=2e-2, atol=2e-2 * np.abs(reference(x)).max())
    metrics = _get(f"{base}/metrics").decode()
    assert re.search(rf'kiln_model_info\{{[^}}]*backend="onnxruntime"[^}}]*target="{target}"',
                     metrics), metrics[:2000]
    assert re.search(r"^kiln_gpu_utilization_ratio\{", metrics, re.M), "no GPU series for a GPU engine"
