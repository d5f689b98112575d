"""Kiln on a GPU (issue 47): `kiln serve` with ONNX Runtime's CUDA provider against the engine
alone and KServe's Python model server, on one GPU, in one run.

Models: ResNet-50 and MobileNetV3-Large (torchvision, random weights, exported to ONNX with
a dynamic batch), each built by Kiln for this GPU in fp32 and fp16.
- Ceiling: ONNX Runtime alone on Kiln's engine file, one process: fed from host memory
  (numpy in and out) at the batch sizes Kiln forms; and with device-resident I/O + CUDA graphs.
- Kiln: one image per request, binary tensors over HTTP (wrk) and over gRPC (grpc.aio
  clients in processes of their own), at 64 and 256 concurrent clients, dynamic batching on;
  batch-1 latency against the engine alone plus the transport (an identity-sized model's
  round trip through Kiln); CUDA graphs on and off.
- Peer: KServe 0.21 with an ONNX Runtime CUDA session on the same model (its workers tuned).
- NVML utilization sampled during each run.

Needs a GPU, onnxruntime-gpu, pycuda, torch and torchvision (to export the models), wrk and
KServe (KILN_BENCH_PEER_SITES): `make gpu` on a GPU machine (docs/gpu.md). Elsewhere `run`
returns None and `make bench` keeps the section last recorded. Results go to
$KILN_BENCH_GPU_JSON as they come (a run cut short keeps what it measured);
`python -m benchmarks.gpu --render FILE` writes the section from such a file.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from benchmarks.serving import Model, _free_port, _kiln_command, started

SECTION = "## Kiln on a GPU: the CUDA provider against the engine alone and KServe (`benchmarks/gpu.py`)"
CONCURRENCY = (64, 256)
MAX_BATCH = 64
CONTEXTS = 2
BATCHES = (1, 8, 16, 32, 64)
SIDE = 224
RESULTS_ENV = "KILN_BENCH_GPU_JSON"


class ImageModel(Model):
    def sample(self, rows: int, seed: int = 1) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {self.input: rng.standard_normal((rows, 3, SIDE, SIDE)).astype(np.float32)}


def available() -> str | None:
    """Why this machine cannot run it, or None."""
    try:
        import onnxruntime as ort
        import pycuda.driver  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError as e:
        return f"missing {e.name}"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "this ONNX Runtime has no CUDA provider"
    from kiln.runtime.engine.gpu import detect_target

    return "no GPU" if detect_target() == "cpu" else None


# -- models and engines ----------------------------------------------------------------------

def export(name: str, path: Path) -> None:
    import torch
    import torchvision

    net = getattr(torchvision.models, name)(weights=None).eval()
    x = torch.randn(1, 3, SIDE, SIDE)
    kwargs: dict[str, Any] = dict(input_names=["images"], output_names=["logits"],
                                  opset_version=17)
    try:
        torch.onnx.export(net, (x,), str(path), dynamo=False,
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, **kwargs)
    except Exception:  # a torch without the TorchScript exporter
        batch = torch.export.Dim("batch", min=1, max=4096)
        torch.onnx.export(net, (x,), str(path), dynamo=True,
                          dynamic_shapes={"x": {0: batch}}, **kwargs)


def build_engines(workdir: Path, target: str, record) -> dict[tuple[str, str], ImageModel]:
    """The engines Kiln builds; one its fp16 check refuses is recorded with the reason."""
    from kiln.runtime.api.errors import Unsupported
    from kiln.runtime.engine import build

    models = {}
    for name in ("resnet50", "mobilenet_v3_large"):
        onnx_path = workdir / "models" / f"{name}.onnx"
        onnx_path.parent.mkdir(parents=True, exist_ok=True)
        export(name, onnx_path)
        for precision in ("fp32", "fp16"):
            request = build.BuildRequest.from_dict({
                "namespace": "bench", "name": name.replace("_", "-"), "target": target,
                "model": {"uri": f"pvc://models/{name}.onnx", "version": "1"},
                "engine": {"backend": "onnxruntime", "precision": precision}})
            try:
                result = build.build_engine(request, workdir / "cache", pvc_root=workdir)
            except Unsupported as e:
                record(f"{name}/{precision}/refused", str(e))
                continue
            models[name, precision] = ImageModel(name, onnx_path, "images", 0, rel=result.path)
            print(f"   built {name} {precision} in {result.seconds:.1f} s", file=sys.stderr,
                  flush=True)
    return models


# -- NVML ------------------------------------------------------------------------------------

@contextmanager
def nvml_sampled() -> Iterator[list[float]]:
    """GPU 0's utilization (0..1), sampled every 100 ms over the block."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def _mean(xs: list[float]) -> float | None:
    return round(float(np.mean(xs)), 3) if xs else None


# -- the engine alone --------------------------------------------------------------------------

def engine_alone(engine: bytes, seconds: float) -> dict[str, Any]:
    """Rows/s at each batch size, and batch-1 latency: host-fed (numpy in and out), and with
    device-resident I/O replaying a CUDA graph per batch size."""
    import onnxruntime as ort

    ort.preload_dlls()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    out: dict[str, Any] = {"host": {}, "graphs": {}}
    host = ort.InferenceSession(engine, so, providers=["CUDAExecutionProvider"])
    name = host.get_inputs()[0].name
    rng = np.random.default_rng(0)
    for bs in BATCHES:
        x = rng.standard_normal((bs, 3, SIDE, SIDE)).astype(np.float32)
        with nvml_sampled() as util:
            times = _timed(lambda: host.run(None, {name: x}), seconds)
        out["host"][bs] = {"rows_per_s": bs / float(np.median(times)),
                           "p50_ms": 1e3 * float(np.median(times)), "nvml": _mean(util)}
    del host
    for bs in BATCHES:
        session = ort.InferenceSession(
            engine, so, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
        x = ort.OrtValue.ortvalue_from_numpy(
            rng.standard_normal((bs, 3, SIDE, SIDE)).astype(np.float32), "cuda", 0)
        y = ort.OrtValue.ortvalue_from_shape_and_type(
            [bs, session.get_outputs()[0].shape[1]], np.float32, "cuda", 0)
        binding = session.io_binding()
        binding.bind_ortvalue_input(name, x)
        binding.bind_ortvalue_output(session.get_outputs()[0].name, y)
        with nvml_sampled() as util:
            times = _timed(lambda: session.run_with_iobinding(binding), seconds)
        out["graphs"][bs] = {"rows_per_s": bs / float(np.median(times)),
                             "p50_ms": 1e3 * float(np.median(times)), "nvml": _mean(util)}
        del binding, session
    return out


def _timed(call, seconds: float) -> list[float]:
    for _ in range(5):
        call()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


# -- servers -----------------------------------------------------------------------------------

@dataclass
class Served:
    url: str
    grpc_port: int | None


@contextmanager
def kiln(model: ImageModel, cache: Path, target: str, log_dir: Path, graphs: bool = True,
         max_batch: int = MAX_BATCH) -> Iterator[Served]:
    port, grpc_port = _free_port(), _free_port()
    runtime = {"contextsPerGPU": CONTEXTS, "batching": {"maxBatchSize": max_batch},
               "gpu": {"cudaGraphs": graphs}}
    cmd = _kiln_command() + [
        "serve", "--model-name", model.name, "--cache-dir", str(cache),
        "--engine", f"{target}={model.rel}", "--runtime-spec", json.dumps(runtime),
        "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
        "--log-level", "INFO", "--drain-seconds", "2"]
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"kiln-{model.name}-{port}.log"
    with started(cmd, f"{url}/v2/health/ready", log_path, cwd=log_dir):
        yield Served(url, grpc_port)


@contextmanager
def kserve(model: ImageModel, workers: int, workdir: Path) -> Iterator[Served]:
    from benchmarks._peer_servers import PeerConfig, peer_python, peer_server

    py = peer_python("kserve")
    # Its site first, then ours: the same onnxruntime-gpu as Kiln's.
    py.env["PYTHONPATH"] = os.pathsep.join(filter(None, [py.env.get("PYTHONPATH"),
                                                         os.environ.get("PYTHONPATH")]))
    py.env["PEER_PROVIDERS"] = "CUDAExecutionProvider"
    with peer_server(PeerConfig("kserve", threads=1, workers=workers), py, model, workdir) as s:
        yield Served(s.urls[0], None)


# -- load ----------------------------------------------------------------------------------------

def http_load(served: Served, model: ImageModel, concurrency: int, seconds: float,
              kiln_server: bool) -> dict[str, Any]:
    from benchmarks.peers import drive, wrk_threads

    with nvml_sampled() as util:
        r = drive([served.url], model, concurrency, seconds, binary=True,
                  threads=wrk_threads(os.cpu_count() or 2), kiln=kiln_server)
    return {"rps": r.throughput, "p50_ms": r.p50_us / 1e3, "p99_ms": r.p99_us / 1e3,
            "errors": r.errors, "batch": r.mean_batch, "nvml": _mean(util)}


def _grpc_worker(port: int, model_name: str, concurrency: int, seconds: float, queue) -> None:
    import grpc

    from kiln.runtime.serving.grpc import grpc_service_pb2 as pb

    x = np.random.default_rng(1).standard_normal((1, 3, SIDE, SIDE)).astype(np.float32)
    request = pb.ModelInferRequest(model_name=model_name)
    tensor = request.inputs.add(name="images", datatype="FP32", shape=list(x.shape))
    del tensor
    request.raw_input_contents.append(x.tobytes())
    payload = request.SerializeToString()

    async def main() -> tuple[int, int, list[float]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                       request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            latencies: list[float] = []
            errors = 0
            end = time.perf_counter() + seconds

            async def client() -> None:
                nonlocal errors
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    try:
                        await call(payload, timeout=30)
                    except grpc.aio.AioRpcError:
                        errors += 1
                        continue
                    latencies.append(time.perf_counter() - t0)

            await asyncio.gather(*(client() for _ in range(concurrency)))
            return len(latencies), errors, latencies

    queue.put(asyncio.run(main()))


def grpc_load(served: Served, model: ImageModel, concurrency: int, seconds: float,
              processes: int = 4) -> dict[str, Any]:
    """Unary ModelInfer calls, one image each, from `processes` client processes."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    assert served.grpc_port
    for warm in (True, False):
        procs = [ctx.Process(target=_grpc_worker, args=(
            served.grpc_port, model.name, max(1, concurrency // processes), 1.0 if warm else seconds,
            queue)) for _ in range(processes)]
        with nvml_sampled() as util:
            for p in procs:
                p.start()
            results = [queue.get(timeout=seconds + 120) for _ in procs]
            for p in procs:
                p.join()
    done = sum(r[0] for r in results)
    latencies = np.concatenate([np.array(r[2]) for r in results]) if done else np.array([0.0])
    return {"rps": done / seconds, "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
            "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
            "errors": sum(r[1] for r in results), "nvml": _mean(util)}


def _series(url: str) -> dict[str, float]:
    """Kiln's GPU series and its engine's busy seconds, from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("kiln_gpu_utilization_ratio", "kiln_gpu_memory_used_bytes",
                     "kiln_engine_busy_seconds_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def rising(served: Served, model: ImageModel, seconds: float) -> list[dict[str, Any]]:
    """Kiln's own GPU series, scraped every second, while the load rises: idle, then 1 to
    256 clients (issue 47, item 4)."""
    steps = []
    for clients in (0, 1, 8, 64, 256):
        samples: list[tuple[float, dict[str, float]]] = []
        stop = threading.Event()

        def scrape() -> None:
            while not stop.wait(1.0):
                samples.append((time.monotonic(), _series(served.url)))

        thread = threading.Thread(target=scrape, daemon=True)
        thread.start()
        load = http_load(served, model, clients, seconds, True) if clients else None
        if not clients:
            time.sleep(seconds)
        stop.set()
        thread.join()
        steps.append({"clients": clients, "samples": samples, "load": load})
    return steps


# -- the run -------------------------------------------------------------------------------------

def run(quick: bool) -> str | None:
    why = available()
    if why:
        print(f"   gpu: not run ({why}); the section recorded in docs/benchmarks.md stays",
              file=sys.stderr)
        return None
    seconds = 3.0 if quick else 6.0
    results_path = Path(os.environ.get(RESULTS_ENV) or tempfile.mktemp(suffix=".json"))
    results: dict[str, Any] = {"machine": _machine(), "runs": {}}

    def record(key: str, value: Any) -> None:
        results["runs"][key] = value
        results_path.write_text(json.dumps(results, indent=1))
        print(f"   {key}: {json.dumps(value)[:300]}", file=sys.stderr, flush=True)

    from kiln.runtime.engine.gpu import detect_target

    target = detect_target()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-gpu-") as tmp:
        workdir = Path(tmp)
        models = build_engines(workdir, target, record)
        cache = workdir / "cache"
        transport = _transport(workdir, cache, seconds)
        record("transport", transport)
        for (name, precision), model in models.items():
            entry = cache / model.rel / "engine.onnx"
            record(f"{name}/{precision}/alone", engine_alone(entry.read_bytes(), seconds / 2))
            for graphs in (True, False):
                if not graphs and precision == "fp32":
                    continue
                with kiln(model, cache, target, workdir, graphs=graphs) as served:
                    tag = f"{name}/{precision}/kiln{'' if graphs else '-nographs'}"
                    record(f"{tag}/c1", http_load(served, model, 1, seconds, True))
                    for c in CONCURRENCY:
                        record(f"{tag}/http/{c}", http_load(served, model, c, seconds, True))
                        if graphs:
                            record(f"{tag}/grpc/{c}", grpc_load(served, model, c, seconds))
                    if graphs and name == "resnet50" and precision == "fp16":
                        record(f"{tag}/rising", rising(served, model, seconds))
            if precision == "fp32" and os.environ.get("KILN_BENCH_PEER_SITES"):
                for workers in (1, 4):
                    with kserve(model, workers, workdir) as served:
                        for c in CONCURRENCY:
                            record(f"{name}/{precision}/kserve-{workers}/http/{c}",
                                   http_load(served, model, c, seconds, False))
    return render(results)


def _transport(workdir: Path, cache: Path, seconds: float) -> dict[str, Any]:
    """The round trip of one image-sized binary request through Kiln on a model that does
    nothing but a Flatten (the transport: HTTP, decoding, batching, encoding)."""
    from onnx import TensorProto, helper

    from kiln.runtime.engine import build

    path = workdir / "models" / "flat.onnx"
    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["images"], ["logits"], axes=[2, 3], keepdims=0)], "flat",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, SIDE, SIDE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    request = build.BuildRequest.from_dict({
        "namespace": "bench", "name": "flat", "target": "cpu",
        "model": {"uri": "pvc://models/flat.onnx", "version": "1"},
        "engine": {"backend": "onnxruntime", "precision": "fp32"}})
    result = build.build_engine(request, cache, pvc_root=workdir)
    model = ImageModel("flat", path, "images", 0, rel=result.path)
    with kiln(model, cache, "cpu", workdir) as served:
        return http_load(served, model, 1, seconds, True)


def _machine() -> dict[str, Any]:
    import onnxruntime as ort
    import pynvml

    from kiln.runtime.engine.backends.onnxruntime import cuda_version

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(handle)
    return {"gpu": name.decode() if isinstance(name, bytes) else name,
            "driver": str(pynvml.nvmlSystemGetDriverVersion()),
            "onnxruntime": ort.__version__, "cuda": cuda_version(), "cpus": os.cpu_count()}


# -- the section ---------------------------------------------------------------------------------

def render(results: dict[str, Any]) -> str:
    runs, m = results["runs"], results["machine"]
    out = [SECTION, "",
           f"On {m['gpu']} (driver {m['driver']}), {m['cpus']} CPU cores; ONNX Runtime "
           f"{m['onnxruntime']} (CUDA {m['cuda']}). Kiln: `kiln serve`, {CONTEXTS} contexts, "
           f"maxBatchSize {MAX_BATCH}, one 3x{SIDE}x{SIDE} image per request as binary tensors; "
           f"wrk for HTTP, grpc.aio clients in 4 processes for gRPC, all on the same machine. "
           f"The transport (an image through Kiln over HTTP on a model that only reduces it, "
           f"one client): p50 {_f(runs.get('transport', {}).get('p50_ms'))} ms.", ""]
    for name in ("resnet50", "mobilenet_v3_large"):
        for precision in ("fp32", "fp16"):
            refused = runs.get(f"{name}/{precision}/refused")
            if refused:
                out += [f"### {name}, {precision}", "", f"Not built: Kiln refused it: {refused}", ""]
            alone = runs.get(f"{name}/{precision}/alone")
            if not alone:
                continue
            out += _table(runs, name, precision, alone)
    return "\n".join(out)


def _f(x: Any, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ceiling_at(host: dict[int, Any], batch: float | None) -> tuple[int, float]:
    """The host-fed ceiling at the measured batch size nearest above the one Kiln formed."""
    bs = next((b for b in sorted(host) if batch is not None and b >= batch), max(host))
    return bs, host[bs]["rows_per_s"]


def _table(runs: dict[str, Any], name: str, precision: str, alone: dict[str, Any]) -> list[str]:
    prefix = f"{name}/{precision}"
    host = {int(k): v for k, v in alone["host"].items()}
    graphs = {int(k): v for k, v in alone["graphs"].items()}
    out = [f"### {name}, {precision}", "",
           "| engine alone | " + " | ".join(f"batch {b}" for b in sorted(host)) + " |",
           "|---|" + "---|" * len(host),
           "| host-fed (numpy in/out), images/s | " + " | ".join(
               _f(host[b]["rows_per_s"], 0) for b in sorted(host)) + " |",
           "| device I/O + CUDA graph, images/s | " + " | ".join(
               _f(graphs[b]["rows_per_s"], 0) for b in sorted(graphs)) + " |",
           "| NVML utilization (host-fed) | " + " | ".join(
               _f(host[b]["nvml"]) for b in sorted(host)) + " |", "",
           f"Batch 1 alone: {_f(host[1]['p50_ms'])} ms host-fed, {_f(graphs[1]['p50_ms'])} ms "
           f"with graphs.", "",
           "| server | transport | clients | images/s | p50 ms | p99 ms | mean batch | "
           "host-fed ceiling at that batch | Kiln / ceiling | NVML | errors |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for server in ("kiln", "kiln-nographs", "kserve-1", "kserve-4"):
        for transport in ("http", "grpc"):
            for c in CONCURRENCY:
                r = runs.get(f"{prefix}/{server}/{transport}/{c}")
                if not r:
                    continue
                batch = r.get("batch") or (runs.get(f"{prefix}/{server}/http/{c}") or {}).get("batch")
                bs, ceiling = _ceiling_at(host, batch)
                ratio = r["rps"] / ceiling if ceiling else None
                out.append(f"| {server} | {transport} | {c} | {_f(r['rps'], 0)} | {_f(r['p50_ms'])} | "
                           f"{_f(r['p99_ms'])} | {_f(r.get('batch'), 1)} | {_f(ceiling, 0)} (batch {bs}) | "
                           f"{_f(ratio)} | {_f(r.get('nvml'))} | {r['errors']} |")
    out.append("")
    c1 = runs.get(f"{prefix}/kiln/c1")
    transport = runs.get("transport", {}).get("p50_ms")
    if c1 and transport is None:
        out.append(f"Batch-1 latency through Kiln with graphs: p50 {_f(c1['p50_ms'])} ms (the "
                   f"transport was not measured in this run).")
    elif c1:
        budget = graphs[1]["p50_ms"] + (transport or 0) + 0.5
        out.append(f"Batch-1 latency through Kiln with graphs: p50 {_f(c1['p50_ms'])} ms; the engine "
                   f"alone with graphs plus the transport plus 0.5 ms: {_f(budget)} ms "
                   f"({'met' if c1['p50_ms'] <= budget else 'not met'}).")
    kiln_best = max((runs[k]["rps"] for k in runs if k.startswith(f"{prefix}/kiln/")
                     and ("/http/" in k or "/grpc/" in k)), default=None)
    peer_best = max((runs[k]["rps"] for k in runs if k.startswith(f"{prefix}/kserve-")), default=None)
    if kiln_best and peer_best:
        out.append(f"Kiln's best over KServe's best: {_f(kiln_best / peer_best)}x (target >= 2x).")
    out.append("")
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(json.loads(Path(sys.argv[2]).read_text())))
    else:
        print(run("--quick" in sys.argv) or "not run")
