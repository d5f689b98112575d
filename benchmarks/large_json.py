"""Image-size JSON on every topology `kiln serve` chooses (issue 46).

Before issue 46, every v2 JSON request of more than 64K numbers (one 224x224 RGB image is
150,528) got a 500 from any pod with front-end processes (every pod above 2 CPUs): the
front end could not start its JSON worker. This benchmark sends exactly such requests.

Two models, one image a request, made with onnx.helper and built for the CPU:
- `classifier`: the image (x [N, 150528], reshaped to [N, 3, 224, 224]) through a 7x7
  stride-4 convolution to 16 channels, ReLU, global average pooling and a 16 -> 10 layer:
  150,528 numbers in, 10 out;
- `negate`: y = -x over the same 150,528 numbers: as many out as in.
Each on three topologies: one process (`--workers 1`), 2 front ends before 2 engine
processes (forced by their flags), and what `kiln serve` picks from the machine's CPUs; JSON
at `CONCURRENCY` connections and binary tensors, wrk's closed loop: 2xx answers a second, the
server's own count of 429s and 500s; the first answer is checked against ONNX Runtime.

Targets: no 500 anywhere; only 200s within the bound. Reported: JSON's 2xx/s through front
ends against the single process's (on 2 cores front ends, JSON workers, engines and wrk share
two cores; the figure that matters for a pod is the 16-core one).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.serving import (TUNED, Model, build, check_answer, load, median_round,
                                runtime_spec, serving)

IMAGE = 3 * 224 * 224
# 4: within every topology's bound on large JSON in flight (one decoding and four waiting per
# process serving HTTP), so any answer but 200 is a failure; 32: past the single process's
# bound (429s by design), where front ends show what they add.
CONCURRENCY = (4, 32)
ROUNDS = 3
MAX_BODY = 64 << 20
# (front ends, engine processes); None: what `kiln serve` picks from the CPUs.
TOPOLOGIES = {"one process": (1, 1), "2 front ends x 2 engines": (2, 2), "Kiln's defaults": (None, None)}


def _write(path: Path, nodes: list, outputs: list, weights: list) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, path.stem, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IMAGE])],
        outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())
    return path


def classifier(workdir: Path) -> Model:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(np.array([-1, 3, 224, 224], np.int64), "shape"),
               numpy_helper.from_array((rng.standard_normal((16, 3, 7, 7)) * 0.05).astype(np.float32), "k"),
               numpy_helper.from_array((rng.standard_normal((16, 10)) * 0.2).astype(np.float32), "w"),
               numpy_helper.from_array(np.zeros(10, np.float32), "b")]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["img"]),
             helper.make_node("Conv", ["img", "k"], ["c"], strides=[4, 4]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["y"])]
    path = _write(workdir / "classifier.onnx", nodes,
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], weights)
    return Model("classifier", path, "x", IMAGE)


def negate(workdir: Path) -> Model:
    from onnx import TensorProto, helper

    path = _write(workdir / "negate.onnx", [helper.make_node("Neg", ["x"], ["y"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", IMAGE])], [])
    return Model("negate", path, "x", IMAGE)


def _goodput(result) -> float:
    return (result.requests - result.errors) / result.seconds


def _outcomes(url: str, model: str) -> dict[str, float]:
    """kiln_requests_total by outcome, from the server's own /metrics."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^kiln_requests_total{{model="{model}",outcome="(\w+)"}} (\S+)$', text, re.M)}


def run(quick: bool) -> str:
    from benchmarks.frontend import _log, _processes

    seconds, rounds = (2.0, 1) if quick else (3.0, ROUNDS)
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-json-"))
    runtime = runtime_spec({**TUNED, "delay": 500}, True)
    runtime["batching"]["maxBatchSize"] = 8
    rows, ratios, errors, within_bound = [], [], 0, 0
    try:
        for model in (classifier(workdir), negate(workdir)):
            build(model, workdir / "cache")
            single = {}
            for topology, (workers, engines) in TOPOLOGIES.items():
                extra = ("--max-body-bytes", str(MAX_BODY), "--no-grpc", "--log-level", "INFO",
                         *(("--engine-processes", str(engines)) if engines else ()))
                with serving(model, workdir / "cache", runtime, None, workdir, workers=workers,
                             extra_args=extra) as server:
                    check_answer(server.url, model, rows=1)
                    shape = _processes(_log(workdir, model.name, server.url))
                    for binary, concurrency in [(False, c) for c in CONCURRENCY] + [(True, CONCURRENCY[-1])]:
                        before = _outcomes(server.url, model.name)
                        result, low, high = median_round(
                            [load(server, model, concurrency, seconds, binary=binary, threads=2)
                             for _ in range(rounds)], _goodput)
                        after = _outcomes(server.url, model.name)
                        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                        errors += int(delta.get("error", 0))
                        if concurrency == CONCURRENCY[0]:
                            within_bound += result.errors
                        rate = _goodput(result)
                        if not binary:
                            single.setdefault(concurrency, rate)
                            if workers != 1:
                                ratios.append((model.name, topology, concurrency, rate / single[concurrency]))
                        rows.append(f"| {model.name} | {topology} ({shape}) | {'binary' if binary else 'JSON'} "
                                    f"| {concurrency} | {rate:.0f} ({low:.0f}-{high:.0f}) "
                                    f"| {int(delta.get('overloaded', 0))} | {int(delta.get('error', 0))} "
                                    f"| {result.percentile(50):.1f} | {result.percentile(99):.1f} |")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join([
        "## Image-size JSON on every topology (`benchmarks/large_json.py`, issue 46)",
        "",
        f"One 224x224 RGB image a request (150,528 numbers); wrk, closed loop, the median of {rounds} "
        f"rounds of {seconds:.0f} s (slowest-fastest); wrk and the server share this machine's cores. "
        "`classifier`: a 7x7 stride-4 convolution to 16 channels, pooling and a 16 -> 10 layer "
        "(10 numbers out); `negate`: y = -x (150,528 out). 429 and 500: the server's own "
        "`kiln_requests_total{outcome}` (overloaded, error) over the rounds. A process serving HTTP "
        "decodes one large JSON body at a time and lets four wait: the single process refuses the "
        "rest with 429 (by design), each front end holds as many. Before issue 46, every JSON row "
        "with front ends answered 500 to every request.",
        "",
        "| model | topology | encoding | connections | 2xx/s | 429 | 500 | p50 ms | p99 ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "### Targets",
        "",
        "| target | measured | baseline | ratio | met |",
        "|---|---:|---:|---:|---|",
        f"| no 500, any topology, any load | {errors} | 0 | - | {'met' if errors == 0 else 'not met'} |",
        f"| only 200 within the bound (4 connections), every topology | {within_bound} other answers "
        f"| 0 | - | {'met' if within_bound == 0 else 'not met'} |",
        *(f"| JSON 2xx/s, {name}, {topology}, {c} connections, against the single process (reported) "
          f"| {ratio:.2f}x | 1.00x | {ratio:.2f} | - |" for name, topology, c, ratio in ratios),
    ])
