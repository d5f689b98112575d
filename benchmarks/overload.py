"""Overload and big bodies (issue 11, items 2 and 5): goodput when clients retry 429s at
once, and liveness while 60 MB JSON bodies are in flight.

Real `kiln serve` processes started as benchmarks/serving.py starts them (its `serving`,
`build`, `request_body`, `check_answer` and wrk driver are reused), serving the demo model
(examples/demo, the Iris classifier: it computes in microseconds, so the server's own cost
per request is what is measured) with serving.py's tuned settings.

(a) Goodput: a small queue (`runtime.batching.maxQueueSize`, `QUEUE` requests) and wrk's
closed loop: each connection sends its next request the moment an answer arrives, a 429
included, so every refused request is retried at once. Peak goodput (2xx/s) at `QUEUE`
connections, the most that never overflow the queue; then 4x that, and 256 connections.
Target: goodput at 4x overload >= 80% of the peak.

(b) Liveness: `GET /v2/health/live` polled every 10 ms by a Python client (a new
connection per probe, as the kubelet makes) while 1, then 4 concurrent 60 MB JSON bodies are
posted to a server started with `--max-body-bytes` 128 MiB. Two models: the demo model,
whose largest valid request is a few KB (the body is refused from its headers), and a
"wide" one (y = -x over 1M floats a row) for which 60 MB of JSON is a valid request that is
decoded, computed and answered in JSON. Target: probe p99 < 100 ms. The server's RSS idle
and at its peak (VmHWM, /proc) and its JSON worker's peak, one fresh server per row.
"""

from __future__ import annotations

import http.client
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving import (TUNED, Model, Server, _wrk, build, check_answer, iris_model,
                                request_body, runtime_spec, serving, wrk_files, wrk_path)

WIDE = 1_000_000  # the wide model's row: 1M floats, about 4 MB of JSON at 3 digits each

QUEUE = 32  # maxQueueSize of the overload server: a small queue
OVERLOAD = 4  # the target's overload factor
GOODPUT_TARGET = 0.80
LIVE_TARGET_MS = 100.0
BIG_BODY_BYTES = 60_000_000
MAX_BODY = 128 * 1024 * 1024
PROBE_EVERY = 0.010
PROBE_TIMEOUT = 10.0  # seconds (the runtime pods' probes time out after 2 s: operator/manifests.py)



def overload_runtime(admission_wait_ms: int | None = None) -> dict[str, Any]:
    """The small queue; `admission_wait_ms` None keeps the API default (100 ms)."""
    spec = runtime_spec(TUNED, True)
    spec["batching"]["maxQueueSize"] = QUEUE
    if admission_wait_ms is not None:
        spec["batching"]["maxAdmissionWaitMilliseconds"] = admission_wait_ms
    return spec


# -- (a) goodput under overload ------------------------------------------------------------

@dataclass
class Point:
    connections: int
    label: str
    answers: int  # responses of any status
    refused: int  # responses >= 400 (429 here)
    socket_errors: int
    seconds: float
    p99_ms: float

    @property
    def goodput(self) -> float:
        return (self.answers - self.refused) / self.seconds

    @property
    def refused_rate(self) -> float:
        return self.refused / self.seconds


def closed_loop(srv: Server, model: Model, connections: int, seconds: float,
                warmup: float = 1.0, label: str = "") -> Point:
    """wrk, `connections` connections, each retrying at once whatever the answer."""
    url = f"{srv.url}/v2/models/{model.name}/infer"
    body, headers = request_body(model, 1, binary=True)
    with wrk_files(body) as (body_file, script):
        _wrk(url, body_file, headers, connections, warmup, script)
        run = _wrk(url, body_file, headers, connections, seconds, script)
    return Point(connections, label or f"{connections / QUEUE:g}x the queue", run.requests,
                 run.status_errors, run.socket_errors, run.seconds, run.p99_us / 1e3)


# -- (b) liveness while big bodies are in flight -------------------------------------------

def big_body(model: Model, size: int = BIG_BODY_BYTES) -> bytes:
    """A JSON request of about `size` bytes: as many rows of the model's width as fit."""
    row = b",".join([b"5.1", b"3.5", b"1.4", b"0.2"] * (model.width // 4))
    head = b'{"inputs":[{"name":"%s","shape":[%d,%d],"datatype":"FP32","data":['
    rows = max(1, (size - len(head) - 40) // (len(row) + 1))
    return (head % (model.input.encode(), rows, model.width) + b",".join([row] * rows)
            + b"]}]}")


def wide_model(path: Path) -> Path:
    """y = -x, x: [N, WIDE] FP32: the compute is nothing, the request is all JSON."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDE])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _worker_peak_mb(pid: int) -> float:
    """The largest VmHWM among the server's child processes (its JSON worker), 0 if none."""
    peak = 0.0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if fields.get("PPid", "").strip() == str(pid) and "VmHWM" in fields:
            peak = max(peak, float(fields["VmHWM"].split()[0]) / 1024)
    return peak


def _status_kb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    return float("nan")


@dataclass
class Liveness:
    bodies: int
    probes_ms: list[float]  # a failed probe counts as its time or PROBE_TIMEOUT, the larger
    failed_probes: int
    answers: list[tuple[int, str, float]]  # status, start of the error, seconds
    idle_rss_mb: float
    peak_rss_mb: float
    worker_peak_mb: float
    model: str = ""

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.probes_ms, q))

    @property
    def over_target(self) -> int:
        return sum(1 for x in self.probes_ms if x >= LIVE_TARGET_MS)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def liveness(srv: Server, model: Model, body: bytes, bodies: int, rounds: int) -> Liveness:
    host, port = _host_port(srv.url)
    idle = _status_kb(srv.pid, "VmRSS") / 1024
    probes: list[float] = []
    failed = [0]
    answers: list[tuple[int, str, float]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection(host, port, timeout=PROBE_TIMEOUT)
            try:
                conn.request("GET", "/v2/health/live")
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except OSError:
                ok = False
            finally:
                conn.close()
            took = time.perf_counter() - t0
            failed[0] += not ok
            probes.append(took * 1e3 if ok else max(took, PROBE_TIMEOUT) * 1e3)
            time.sleep(max(0.0, PROBE_EVERY - took))

    def post() -> None:
        for _ in range(rounds):
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection(host, port, timeout=300)
            try:
                conn.request("POST", f"/v2/models/{model.name}/infer", body=body,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
                try:
                    message = str(json.loads(raw).get("error", "") or "answered")[:60]
                except ValueError:
                    message = raw[:60].decode("latin-1")
                answers.append((resp.status, message, time.perf_counter() - t0))
            except OSError as e:
                answers.append((0, f"{type(e).__name__}: {e}"[:60], time.perf_counter() - t0))
            finally:
                conn.close()

    poller = threading.Thread(target=probe, daemon=True)
    poller.start()
    time.sleep(0.3)  # a few idle probes first
    posters = [threading.Thread(target=post, daemon=True) for _ in range(bodies)]
    for t in posters:
        t.start()
    for t in posters:
        t.join()
    time.sleep(0.2)
    stop.set()
    poller.join(15)
    return Liveness(bodies, probes, failed[0], answers, idle, _status_kb(srv.pid, "VmHWM") / 1024,
                    _worker_peak_mb(srv.pid), model.name)


# -- the report ----------------------------------------------------------------------------

def _answers(answers: list[tuple[int, str, float]]) -> list[str]:
    """`n x STATUS (message) in a-b s`, one entry per distinct answer."""
    groups: dict[tuple[int, str], list[float]] = {}
    for status, message, took in answers:
        groups.setdefault((status, message), []).append(took)
    return [f"{len(t)} x {status or 'no answer'} ({message}) in "
            + (f"{t[0]:.1f} s" if len(t) == 1 else f"{min(t):.1f}-{max(t):.1f} s")
            for (status, message), t in groups.items()]


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def run(quick: bool) -> str:
    seconds = 2.0 if quick else 5.0
    rounds = 1 if quick else 2
    wrk_path()  # fail early, with the fix, when wrk is missing
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-overload-"))
    threads, spin = TUNED["threads"], TUNED["spin"]
    try:
        cache_dir = workdir / "cache"
        model = iris_model()
        build(model, cache_dir)

        peak_connections = (QUEUE,) if quick else (QUEUE // 2, QUEUE)
        with serving(model, cache_dir, overload_runtime(), threads, workdir, spin) as srv:
            check_answer(srv.url, model)
            peaks = [closed_loop(srv, model, c, seconds) for c in peak_connections]
            over = [closed_loop(srv, model, c, seconds) for c in (OVERLOAD * QUEUE, 256)]
            check_answer(srv.url, model)  # still right after the storm
        # The same storm when a full queue refuses at once (Triton's behavior): the baseline
        # the admission wait is there to beat.
        with serving(model, cache_dir, overload_runtime(0), threads, workdir, spin) as srv:
            at_once = closed_loop(srv, model, OVERLOAD * QUEUE, seconds,
                                  label=f"{OVERLOAD}x the queue, refused at once")
        print("   goodput done", file=sys.stderr, flush=True)

        wide = Model("wide", wide_model(workdir / "wide.onnx"), "x", WIDE)
        build(wide, cache_dir)
        live = []
        for m in (model, wide):
            body = big_body(m)
            for n in (1, 4):
                with serving(m, cache_dir, runtime_spec(TUNED, True), threads, workdir, spin,
                             extra_args=("--max-body-bytes", str(MAX_BODY))) as srv:
                    live.append(liveness(srv, m, body, n, rounds))
                print(f"   liveness, {m.name}, {n} body(ies) done", file=sys.stderr, flush=True)
        body_mb = len(body) / 1e6
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    peak = max(peaks, key=lambda p: p.goodput)
    out = [
        "## Overload and big bodies (`benchmarks/overload.py`, issue 11)",
        "",
        f"`kiln serve` as the serving benchmark starts it (same tuned settings, the demo model, "
        f"binary requests of one row) with `maxQueueSize: {QUEUE}`; wrk's closed loop, "
        f"{seconds:g} s per point after a 1 s warm-up: each connection sends its next request "
        f"the moment an answer arrives, so every 429 is retried at once. Peak goodput is the "
        f"best 2xx/s at up to {QUEUE} connections (the most that never overflow the queue). "
        f"A request that finds the queue full waits for a place for up to "
        f"`maxAdmissionWaitMilliseconds` (100 ms by default) with only its headers read, so "
        f"the connections beyond the queue wait instead of spinning on refusals; the last row "
        f"is the same storm with `maxAdmissionWaitMilliseconds: 0` (refused at once, as "
        f"Triton does), where refusing costs about as much server time as serving. "
        f"wrk and the server share this machine's cores.",
        "",
        "| connections | load | 2xx/s | 429/s | socket errors | p99 ms (all answers) | goodput / peak |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in [*peaks, *over, at_once]:
        out.append(f"| {p.connections} | {p.label} | {p.goodput:.0f} | {p.refused_rate:.0f} "
                   f"| {p.socket_errors} | {p.p99_ms:.1f} | {p.goodput / peak.goodput:.2f} |")
    out += [
        "",
        f"Liveness: `GET /v2/health/live` every {PROBE_EVERY * 1e3:.0f} ms (a new connection "
        f"each) while {body_mb:.0f} MB JSON bodies ({rounds} per sender, one after another) "
        f"are posted to a server started with `--max-body-bytes {MAX_BODY}`; a fresh server "
        f"per row, its RSS from /proc (VmRSS idle, VmHWM peak). `iris` (the demo model) "
        f"accepts requests of a few KB, so the body is refused from its headers; for `wide` "
        f"(y = -x over {WIDE} floats a row) the body is a valid request: read a chunk at a "
        f"time, decoded in the JSON worker process, computed, and its answer (several times "
        f"the body's size as JSON) encoded there and written in chunks.",
        "",
        "| model | bodies at once | probes | p50 ms | p99 ms | max ms | probes >= 100 ms "
        f"| probes failed ({PROBE_TIMEOUT:g} s timeout) | answers to the bodies | idle RSS MB "
        "| peak RSS MB | JSON worker peak MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for lv in live:
        answers = "; ".join(_answers(lv.answers))
        out.append(f"| {lv.model} | {lv.bodies} | {len(lv.probes_ms)} | {lv.percentile(50):.1f} "
                   f"| {lv.percentile(99):.1f} | {max(lv.probes_ms):.0f} | {lv.over_target} "
                   f"| {lv.failed_probes} | {answers} | {lv.idle_rss_mb:.0f} | {lv.peak_rss_mb:.0f} "
                   f"| {lv.worker_peak_mb:.0f} |")
    out += ["", "### Targets", "",
            "| target | measured | baseline | ratio | met |", "|---|---:|---:|---:|---|"]
    for p in over:
        label = (f"goodput at {OVERLOAD}x overload ({p.connections} connections) >= "
                 f"{GOODPUT_TARGET:.0%} of the peak" if p.connections == OVERLOAD * QUEUE
                 else f"same at {p.connections} connections ({p.connections / QUEUE:g}x)")
        ratio = p.goodput / peak.goodput
        out.append(f"| {label} | {p.goodput:.0f} 2xx/s | {peak.goodput:.0f} 2xx/s "
                   f"({peak.connections} connections) | {ratio:.2f} | {_met(ratio >= GOODPUT_TARGET)} |")
    ratio = at_once.goodput / peak.goodput
    out.append(f"| same at {OVERLOAD}x, refused at once (reported: the baseline the admission "
               f"wait beats) | {at_once.goodput:.0f} 2xx/s | {peak.goodput:.0f} 2xx/s | "
               f"{ratio:.2f} | - |")
    for lv in live:
        p99 = lv.percentile(99)
        out.append(f"| liveness p99 < {LIVE_TARGET_MS:.0f} ms, {lv.model}, {lv.bodies} x "
                   f"{body_mb:.0f} MB body in flight | {p99:.1f} ms | {LIVE_TARGET_MS:.0f} ms "
                   f"| {p99 / LIVE_TARGET_MS:.2f} | {_met(p99 < LIVE_TARGET_MS)} |")
    for lv in live:
        out.append(f"| peak RSS, {lv.model}, {lv.bodies} x {body_mb:.0f} MB body (reported) "
                   f"| {lv.peak_rss_mb:.0f} MB | {lv.idle_rss_mb:.0f} MB idle "
                   f"| {lv.peak_rss_mb / lv.idle_rss_mb:.1f}x | - |")
    return "\n".join(out)

