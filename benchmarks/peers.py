"""Peers: `kiln serve` against MLServer and KServe's Python model server in one run, the
same models, the same load generator, the same ONNX Runtime (issue 12, item 6).

Each peer is installed by this benchmark into its own virtual environment under
.tools/bench-peers/<peer>-<version>/ (made with the benchmark's Python, once: a marker file
holds the pins installed), with the ONNX Runtime and numpy versions of the interpreter running
the benchmark, so that every server runs the model on the same ONNX Runtime. Each peer serves
the ONNX file through a small model class written here (an `mlserver.MLModel`, a
`kserve.Model`) holding one `onnxruntime.InferenceSession` with Kiln's session settings:
intra-op threads ONNX Runtime's default (as Kiln's default), spinning off (Kiln's default),
inter-op threads 1.

Every server is a real process driven on 127.0.0.1 (KServe's ModelServer binds 0.0.0.0),
checked first (its answer equals ONNX Runtime run directly), then driven by wrk as
`benchmarks/serving.py` drives Kiln: closed loop, concurrency 1 and 64, one row per request,
the same v2 JSON body for every server and the binary tensor extension where the server has
it (Kiln, KServe; MLServer's REST server reads JSON only). All servers are up at once and each
point runs on every server back to back, a few rounds; each server's best round is kept.
Kiln runs with its defaults (`spec.runtime` empty)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from benchmarks.serving import (HEADER_LENGTH, REPO, LoadResult, Model, _free_port, _wrk, build,
                                iris_model, mlp_model, request_body, scrape, serving, started,
                                wrk_files, wrk_path)

# The peers, pinned: the releases issue 12 names, plus the benchmark interpreter's onnxruntime
# and numpy (1.32.0 and 2.4.6 when this was written); pip resolves the rest from PyPI (checked
# on a fresh venv, Python 3.11). One more pin: MLServer 1.7.1 leaves uvloop unpinned, and
# uvloop 0.22 on raises in `asyncio.get_event_loop()` with no loop set, which MLServer's
# inference worker processes call as they start (they die, the model never loads); 0.21.0 is
# the uvloop of MLServer 1.7.1's release.
MLSERVER_VERSION = "1.7.1"
KSERVE_VERSION = "0.21.0"
PEER_PINS = {
    "mlserver": (MLSERVER_VERSION, [f"mlserver=={MLSERVER_VERSION}", "uvloop==0.21.0"]),
    "kserve": (KSERVE_VERSION, [f"kserve=={KSERVE_VERSION}"]),
}
PEERS_DIR = REPO / ".tools" / "bench-peers"
MARKER = ".kiln-installed"

CONCURRENCY = (1, 64)
# MLServer's adaptive batching: Kiln's default maxBatchSize (32); MLServer needs a batch time
# above 0 to batch at all (it waits that long for a batch to fill, also for a lone request):
# 1 ms, Kiln's queue delay before issue 12.
MLSERVER_MAX_BATCH_SIZE = 32
MLSERVER_MAX_BATCH_TIME = 0.001
# MLServer, two settings: adaptive batching with its default `parallel_workers` (1: one
# inference process beside the HTTP process, 2 processes for 2 cores), and no batching with
# inference in the HTTP process (`parallel_workers` 0), its lowest latency at concurrency 1 in
# development runs. KServe: its default, one uvicorn worker, predict on the event loop (2
# workers, 1 intra-op thread each, were slower in development: 430 against 1,210 req/s, iris,
# JSON, concurrency 64).
MLSERVER_SETTINGS = (("adaptive batching", 1, True), ("no batching, parallel_workers 0", 0, False))
KSERVE_WORKERS = 1


# -- the peers' environments ---------------------------------------------------------------

def _same_runtime_pins() -> list[str]:
    import onnxruntime

    return [f"onnxruntime=={onnxruntime.__version__}", f"numpy=={np.__version__}"]


def peer_python(peer: str) -> Path:
    """The peer's virtual environment's python, installed first when missing or stale."""
    version, pins = PEER_PINS[peer]
    pins = pins + _same_runtime_pins()
    root = PEERS_DIR / f"{peer}-{version}"
    python = root / "bin" / "python"
    marker = root / MARKER
    wanted = "\n".join(pins) + "\n"
    if marker.exists() and marker.read_text() == wanted and python.exists():
        return python
    print(f"   installing {peer} {version} into {root} ...", file=sys.stderr, flush=True)
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *pins], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(pins)} failed for the {peer} benchmark peer:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    marker.write_text(wanted)
    return python


def _package_versions(python: Path, names: tuple[str, ...]) -> dict[str, str]:
    code = ("import json, sys\nfrom importlib import metadata\n"
            "print(json.dumps({n: metadata.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _peer_env() -> dict[str, str]:
    """The environment a peer starts in: ours without Kiln's import path or venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


# -- the peers' model code (written into a temporary directory) ----------------------------

ORT_SESSION = '''
def make_session(path, threads):
    import onnxruntime as ort

    # Kiln's session settings: intra-op threads ONNX Runtime's default unless given,
    # inter-op 1, no spinning (Kiln's default), the default graph optimization level.
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
'''

MLSERVER_MODEL = ORT_SESSION + '''
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        params = self.settings.parameters
        self._session = make_session(params.uri, int(params.extra.get("threads", 0)))
        self._outputs = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        return InferenceResponse(
            model_name=self.name, id=payload.id,
            outputs=[NumpyCodec.encode_output(n, r) for n, r in zip(self._outputs, results)])
'''

KSERVE_SERVER = ORT_SESSION + '''
import os

from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve.utils.utils import from_np_dtype, generate_uuid


class OnnxModel(Model):
    def __init__(self, name, path, threads):
        super().__init__(name)
        self.path, self.threads = path, threads
        self.load()

    def load(self) -> bool:
        self._session = make_session(self.path, self.threads)
        self._outputs = [o.name for o in self._session.get_outputs()]
        self.ready = True
        return self.ready

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        feeds = {i.name: i.as_numpy() for i in payload.inputs}
        binary = payload.use_binary_outputs
        outputs = []
        for name, value in zip(self._outputs, self._session.run(self._outputs, feeds)):
            out = InferOutput(name=name, shape=list(value.shape), datatype=from_np_dtype(value.dtype))
            out.set_data_from_numpy(value, binary_data=binary)
            outputs.append(out)
        return InferResponse(response_id=payload.id or generate_uuid(), model_name=self.name,
                             infer_outputs=outputs, use_binary_outputs=binary,
                             requested_outputs=payload.request_outputs)


if __name__ == "__main__":
    import logging

    env = os.environ
    model = OnnxModel(env["PEER_MODEL_NAME"], env["PEER_MODEL_PATH"], int(env["PEER_THREADS"]))
    server = ModelServer(http_port=int(env["PEER_HTTP_PORT"]), workers=int(env["PEER_WORKERS"]),
                         enable_grpc=False, enable_latency_logging=False)
    # No line per request (Kiln writes none): uvicorn's access log off; KSERVE_LOGLEVEL=WARNING
    # (set by the benchmark) silences the kserve.trace timing lines.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    server.start([model])
'''


@dataclass
class PeerServer:
    name: str  # the table's label
    url: str
    binary: bool  # speaks the binary tensor extension on REST


@contextmanager
def mlserver(python: Path, model: Model, workdir: Path, threads: int, *, parallel_workers: int,
             batching: bool, label: str) -> Iterator[PeerServer]:
    root = Path(tempfile.mkdtemp(prefix="mlserver-", dir=workdir))
    model_dir = root / model.name
    model_dir.mkdir()
    (model_dir / "kiln_peer_model.py").write_text(MLSERVER_MODEL)
    (model_dir / "model-settings.json").write_text(json.dumps({
        "name": model.name, "implementation": "kiln_peer_model.OnnxModel",
        "max_batch_size": MLSERVER_MAX_BATCH_SIZE if batching else 0,
        "max_batch_time": MLSERVER_MAX_BATCH_TIME if batching else 0,
        "parameters": {"uri": str(model.onnx_path), "extra": {"threads": threads}}}))
    port = _free_port()
    (root / "settings.json").write_text(json.dumps({
        "debug": False, "host": "127.0.0.1", "http_port": port, "grpc_port": _free_port(),
        "metrics_port": _free_port(), "parallel_workers": parallel_workers}))
    url = f"http://127.0.0.1:{port}"
    cmd = [str(python.parent / "mlserver"), "start", str(root)]
    with started(cmd, f"{url}/v2/models/{model.name}/ready", root / "mlserver.log",
                 env=_peer_env(), cwd=root, what="mlserver start", own_group=True):
        yield PeerServer(f"MLServer {MLSERVER_VERSION} ({label})", url, binary=False)


@contextmanager
def kserve(python: Path, model: Model, workdir: Path, threads: int) -> Iterator[PeerServer]:
    script = workdir / "kiln_peer_kserve.py"
    script.write_text(KSERVE_SERVER)
    port = _free_port()
    env = {**_peer_env(), "PEER_MODEL_NAME": model.name, "PEER_MODEL_PATH": str(model.onnx_path),
           "PEER_THREADS": str(threads), "PEER_HTTP_PORT": str(port),
           "PEER_WORKERS": str(KSERVE_WORKERS), "KSERVE_LOGLEVEL": "WARNING"}
    url = f"http://127.0.0.1:{port}"
    with started([str(python), str(script)], f"{url}/v2/models/{model.name}/ready",
                 workdir / f"kserve-{model.name}.log", env=env, cwd=workdir,
                 what="kserve ModelServer", own_group=True):
        yield PeerServer(f"KServe {KSERVE_VERSION}", url, binary=True)


# -- checking and driving ------------------------------------------------------------------

def check(url: str, model: Model, binary: bool, rows: int = 3) -> None:
    """The server's answer (JSON or binary) equals ONNX Runtime run directly."""
    import onnxruntime as ort

    from kiln.runtime.serving.protocol import decode_infer_response

    body, headers = request_body(model, rows, binary)
    req = urllib.request.Request(f"{url}/v2/models/{model.name}/infer", data=body,
                                 headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        length = r.headers.get(HEADER_LENGTH)
        doc = decode_infer_response(r.read(), int(length) if length is not None else None)
    if binary and length is None:
        raise AssertionError(f"{url} answered a binary request without binary outputs")
    session = ort.InferenceSession(str(model.onnx_path), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in session.get_outputs()],
                        session.run(None, model.sample(rows))))
    got = {out["name"]: out["data"] for out in doc["outputs"]}
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for name, value in expected.items():
        # MLServer adds a trailing dimension to 1-D outputs ([N] -> [N, 1]): compare values.
        assert got[name].size == value.size, (name, got[name].shape, value.shape)
        np.testing.assert_allclose(got[name].ravel(), value.ravel(), rtol=1e-4, atol=1e-5)


def drive(url: str, model: Model, concurrency: int, seconds: float, binary: bool,
          warmup: float = 1.0, kiln: bool = False) -> LoadResult:
    """`serving.load` for any server: the same wrk, body and warm-up, then one request
    answered before the measured run, so that requests the warm-up left queued (a server
    that does not drop the requests of closed connections) are done before it starts.
    `kiln`: the mean batch from Kiln's `kiln_batch_size` over the measured run."""
    body, headers = request_body(model, 1, binary)
    target = f"{url}/v2/models/{model.name}/infer"
    with wrk_files(body) as (body_file, script):
        _wrk(target, body_file, headers, concurrency, warmup, script)
        probe = urllib.request.Request(target, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(probe, timeout=300) as r:
            r.read()
        before = scrape(url, model.name) if kiln else None
        run = _wrk(target, body_file, headers, concurrency, seconds, script)
        after = scrape(url, model.name) if kiln else None
    mean_batch = None
    if before and after and after["count"] > before["count"]:
        mean_batch = (after["sum"] - before["sum"]) / (after["count"] - before["count"])
    return LoadResult(concurrency, run.requests, run.errors, run.seconds, run.p50_us, run.p99_us,
                      mean_batch=mean_batch, client_cpu=run.client_cpu)


# -- the run and the report ----------------------------------------------------------------

KILN_DEFAULT: dict[str, Any] = {}  # spec.runtime as a user leaves it: every API default
KILN = "Kiln (defaults)"


@dataclass
class Row:
    server: str
    body: str  # "JSON" or "binary"
    result: LoadResult


def _physical_cores() -> int:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.cpu_count() or 1
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            cores.add((phys, value.strip()))
    return len(cores) or os.cpu_count() or 1


def run(quick: bool) -> str:
    seconds, rounds = (2.0, 1) if quick else (4.0, 3)
    wrk_path()
    pythons = {peer: peer_python(peer) for peer in PEER_PINS}
    versions = {peer: _package_versions(python, ("uvicorn", "fastapi", "onnxruntime", "numpy"))
                for peer, python in pythons.items()}
    threads = 0  # ONNX Runtime's default on every server, as Kiln's default
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-peers-"))
    results: dict[str, list[Row]] = {}
    batches: dict[str, float | None] = {}
    try:
        cache_dir = workdir / "cache"
        tiny, mlp = iris_model(), mlp_model(workdir)
        for m in (tiny, mlp):
            build(m, cache_dir)
            results[m.name], batches[m.name] = _compare(m, cache_dir, workdir, pythons, threads,
                                                        seconds, rounds)
            print(f"   {m.name} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _report(results, batches, versions, seconds, rounds, quick)


def _compare(m: Model, cache_dir: Path, workdir: Path, pythons: dict[str, Path], threads: int,
             seconds: float, rounds: int) -> tuple[list[Row], float | None]:
    """Every server up at once (idle ones cost nothing), checked, then each point measured
    on every server back to back, `rounds` times: load from elsewhere on the machine falls
    on all of them alike. Each server's best round per point is kept."""
    with ExitStack() as stack:
        # gRPC on as by default, on a free port (its default 8081 may be taken on a shared machine)
        kiln = stack.enter_context(serving(m, cache_dir, KILN_DEFAULT, threads, workdir,
                                           extra_args=("--grpc-port", "0")))
        servers = [PeerServer(KILN, kiln.url, binary=True)]
        for label, workers, batching in MLSERVER_SETTINGS:
            servers.append(stack.enter_context(mlserver(
                pythons["mlserver"], m, workdir, threads, parallel_workers=workers,
                batching=batching, label=label)))
        servers.append(stack.enter_context(kserve(pythons["kserve"], m, workdir, threads)))
        for srv in servers:
            for binary in (False, True) if srv.binary else (False,):
                check(srv.url, m, binary)
        samples: dict[tuple[str, str, int], list[LoadResult]] = {}
        for _ in range(rounds):
            for binary in (False, True):
                for c in CONCURRENCY:
                    for srv in servers:
                        if binary and not srv.binary:
                            continue
                        r = drive(srv.url, m, c, seconds, binary, kiln=srv.name == KILN)
                        samples.setdefault((srv.name, "binary" if binary else "JSON", c), []).append(r)
    rows = [Row(server, body, max(rs, key=lambda r: r.throughput))
            for (server, body, c), rs in samples.items()]
    order = {srv.name: i for i, srv in enumerate(servers)}
    rows.sort(key=lambda r: (r.body != "JSON", r.result.concurrency, order[r.server]))
    k64 = _get(rows, KILN, "JSON", 64)
    return rows, k64.result.mean_batch if k64 else None


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def _best_peer(rows: list[Row], body: str, c: int) -> Row | None:
    peers = [r for r in rows if r.server != KILN and r.body == body and r.result.concurrency == c]
    return max(peers, key=lambda r: r.result.throughput, default=None)


def _get(rows: list[Row], server: str, body: str, c: int) -> Row | None:
    return next((r for r in rows if r.server == server and r.body == body
                 and r.result.concurrency == c), None)


def _report(results: dict[str, list[Row]], batches: dict[str, float | None],
            versions: dict[str, dict[str, str]], seconds: float, rounds: int, quick: bool) -> str:
    import onnxruntime

    out = ["## Peers: Kiln against MLServer and KServe (`benchmarks/peers.py`)", ""]
    mv, kv = versions["mlserver"], versions["kserve"]
    out += [
        f"One run, one machine, the same two models and the same load: wrk (one thread), closed "
        f"loop, {seconds:g} s per point after a 1 s warm-up, one row per request, concurrency 1 "
        f"and 64, the same v2 request body for every server (JSON; the binary tensor extension "
        f"too where the server has it). All servers are up at once and each point is measured on "
        f"every server back to back, {rounds} round{'s' if rounds > 1 else ''}; the table keeps "
        f"each server's best round. wrk and the servers share the machine's cores. Every server "
        f"was checked first: its answer (JSON, and binary where it has it) equals ONNX Runtime "
        f"run directly. Every server runs the model on ONNX Runtime {onnxruntime.__version__} "
        f"(numpy {np.__version__}) in one `InferenceSession`: intra-op threads ONNX Runtime's "
        f"default (one per physical core: {_physical_cores()} here), spinning off (Kiln's "
        f"default), inter-op threads 1 on the peers. No server writes a line per request.",
        "",
        "- **Kiln**: `kiln serve` with `spec.runtime` empty, i.e. its defaults: dynamic batching "
        "on, `maxBatchSize` 32, `maxQueueDelayMicroseconds` 0, `contextsPerGPU` 2 (over one "
        "engine), intra-op threads ONNX Runtime's default, spinning off; aiohttp on uvloop, "
        "orjson.",
        f"- **MLServer {MLSERVER_VERSION}** (`mlserver` installed by the benchmark in its own venv, "
        f".tools/bench-peers/: uvicorn {mv['uvicorn']}, fastapi {mv['fastapi']}): an `MLModel` "
        f"subclass decoding and encoding with `NumpyCodec`; `debug` off. Two settings: adaptive "
        f"batching (`max_batch_size` {MLSERVER_MAX_BATCH_SIZE}, `max_batch_time` "
        f"{MLSERVER_MAX_BATCH_TIME:g} s: it batches only with a time above 0, and waits that long "
        f"for a batch to fill) with its default `parallel_workers` 1 (one inference process beside "
        f"the HTTP process: 2 processes, 2 cores); and no batching with inference in the HTTP "
        f"process (`parallel_workers` 0), its fastest at concurrency 1. Its REST server reads JSON "
        f"only (no binary tensor extension; raw tensors are gRPC-only there).",
        f"- **KServe {KSERVE_VERSION}** (`kserve` package, own venv: uvicorn {kv['uvicorn']}, "
        f"fastapi {kv['fastapi']}): a `kserve.Model` whose `predict` takes the v2 `InferRequest` "
        f"(`as_numpy`) and returns an `InferResponse`, served by `kserve.ModelServer(workers="
        f"{KSERVE_WORKERS})` (its default; predict runs on the event loop), gRPC, the access log "
        f"and per-request timing lines off. It has the binary tensor extension on v2 REST "
        f"(`binary_data_size`, `binary_data_output`, `inference-header-content-length`). No "
        f"batching in its Python server.",
        "",
    ]
    verdicts = []
    titles = {"iris": "the tiny model: the demo's Iris classifier, one 4x3 MatMul + Softmax + ArgMax",
              "mlp2048": "the MLP: 4 x 2048-wide MatMul + Relu, float32"}
    for name, rows in results.items():
        out += [f"### {name} ({titles.get(name, name)})", "",
                "| server | body | concurrency | req/s | p50 ms | p99 ms | req/s vs best peer |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            best = _best_peer(rows, r.body, r.result.concurrency)
            if best is None or not best.result.throughput:
                ratio = "-"
            elif r is best:
                ratio = "best peer"
            else:
                ratio = f"{r.result.throughput / best.result.throughput:.2f}x"
            answered = r.result.requests > 0
            out.append(f"| {r.server} | {r.body} | {r.result.concurrency} | "
                       f"{r.result.throughput:.0f} | {_ms(r.result.p50_us) if answered else '-'} "
                       f"| {_ms(r.result.p99_us) if answered else '-'} | {ratio} |")
        errors = sum(r.result.errors for r in rows)
        if errors:
            out.append(f"\n{errors} requests failed (non-200 or socket errors) in the rows above.")
        if batches.get(name) is not None:
            out += ["", f"Kiln's mean batch at concurrency 64, JSON: {batches[name]:.1f} requests "
                    f"(its `kiln_batch_size` histogram over that point)."]
        out.append("")

        k64, p64 = _get(rows, KILN, "JSON", 64), _best_peer(rows, "JSON", 64)
        ratio = k64.result.throughput / max(p64.result.throughput, 1e-9)
        verdicts.append(
            f"| JSON, concurrency 64, {name}: Kiln >= 1.5x the best peer | {k64.result.throughput:.0f} "
            f"req/s | {p64.server}: {p64.result.throughput:.0f} req/s | {ratio:.2f}x "
            f"| {_met(ratio >= 1.5, f'{1.5 / ratio:.2f}x short')} |")
        for body in ("JSON", "binary"):
            k1 = _get(rows, KILN, body, 1)
            peers1 = [r for r in rows if r.server != KILN and r.body == body
                      and r.result.concurrency == 1 and r.result.requests > 0]
            if k1 is None or not k1.result.requests or not peers1:
                continue
            low50 = min(peers1, key=lambda r: r.result.p50_us)
            low99 = min(peers1, key=lambda r: r.result.p99_us)
            r50 = k1.result.p50_us / low50.result.p50_us
            r99 = k1.result.p99_us / low99.result.p99_us
            verdicts.append(
                f"| {body}, concurrency 1, {name}: Kiln's p50 and p99 no higher than the lowest "
                f"peer's | p50 {_ms(k1.result.p50_us)} ms, p99 {_ms(k1.result.p99_us)} ms "
                f"| p50 {_ms(low50.result.p50_us)} ms ({low50.server}), p99 "
                f"{_ms(low99.result.p99_us)} ms ({low99.server}) | p50 {r50:.2f}, p99 {r99:.2f} "
                f"| {_met(r50 <= 1 and r99 <= 1, f'p50 {r50:.2f}x, p99 {r99:.2f}x the peer')} |")
        kb, pb = _get(rows, KILN, "binary", 64), _best_peer(rows, "binary", 64)
        if kb is not None and pb is not None:
            ratio = kb.result.throughput / max(pb.result.throughput, 1e-9)
            verdicts.append(
                f"| binary, concurrency 64, {name}: Kiln's binary extension against {pb.server}'s "
                f"(reported; no target) | {kb.result.throughput:.0f} req/s | "
                f"{pb.result.throughput:.0f} req/s | {ratio:.2f}x | - |")
    out += ["### Targets", "", "| target | Kiln | peer | ratio | met |", "|---|---|---|---:|---|",
            *verdicts, ""]
    out.append(
        "- Ratios hold within this run; absolute figures move 10-20% between runs on this "
        "shared 2-core machine (see the serving section's notes), and a p99 at concurrency 1 "
        "is one point of a few thousand requests." + (" A `--quick` run." if quick else ""))
    return "\n".join(out)


def _met(ok: bool, why: str) -> str:
    return "yes" if ok else f"**no** ({why})"
