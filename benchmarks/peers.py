"""Peers: `kiln serve` against MLServer and KServe's Python model server in one run, the
same models, the same load generator, the same ONNX Runtime, the same CPUs (issue 12, item 6;
issue 22, item 4).

The CPUs are this process's affinity (`taskset -c 0-1 python -m benchmarks --only peers` is
a 2-CPU run on a big host); every server and wrk inherit it. Each peer runs in every
configuration a competent user would try for those CPUs (`peer_configs`): KServe's
`workers`, MLServer's `parallel_workers`, and several MLServer processes (replicas, as its
users scale it; on Kubernetes a Service spreads connections over them, here the load
generator does). Kiln runs once, with its defaults (`spec.runtime` empty, its intra-op
threads and front ends picked from the CPUs it has). The peers and their start-up live in
`benchmarks/_peer_servers.py`.

Every server is a real process driven on 127.0.0.1, checked first (its answer equals ONNX
Runtime run directly), then driven by wrk: closed loop, one row per request, the same v2
JSON body for every server at concurrency 1, 64 and 256, and the binary tensor extension
at 64 where the server has it (Kiln, KServe; MLServer's REST server reads JSON only). All
servers are up at once and each point runs on every server back to back, in rounds; each
figure is the median round, with the rounds' spread beside it.

`KILN_BENCH_PEERS_CONCURRENCY=64,256` measures only those JSON points (no binary): the
16-core run, which fits the time the 16-core host is lent that way."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._peer_servers import (MLSERVER_MAX_BATCH_SIZE, MLSERVER_MAX_BATCH_TIME,
                                      PeerConfig, PeerPython, PeerServer, peer_python, peer_server,
                                      peer_versions)
from benchmarks.serving import (HEADER_LENGTH, LoadResult, Model, _wrk, build, iris_model,
                                median_round, mlp_model, request_body, scrape, serving, wrk_files, wrk_path)

_ONLY = os.environ.get("KILN_BENCH_PEERS_CONCURRENCY")
JSON_CONCURRENCY = tuple(int(c) for c in _ONLY.split(",")) if _ONLY else (1, 64, 256)
BINARY_CONCURRENCY = () if _ONLY else (64,)
TARGET = 1.5  # Kiln's req/s over the best peer's, JSON, concurrency 64 and 256

KILN_DEFAULT: dict[str, Any] = {}  # spec.runtime as a user leaves it: every API default
KILN = "Kiln (defaults)"


def cpus() -> int:
    return len(os.sched_getaffinity(0))


def peer_configs(n: int) -> list[PeerConfig]:
    """Each peer's configurations for `n` CPUs: its default, one process per CPU but one
    (the load generator's) with one intra-op thread each, and on 8 CPUs or more a process
    per 4 CPUs with 4 threads each. From 8 CPUs on, the single-process configurations (one
    HTTP event loop, which the scaled-out ones exist to beat; the 2-CPU run measures them)
    are left out, to fit the run in the time a 16-core host is lent. Deduplicated, in order."""
    many = n - 1 if n >= 3 else 2
    single = n < 8
    configs = [
        *([PeerConfig("kserve", threads=0, workers=1)] if single else []),
        PeerConfig("kserve", threads=1, workers=many),
        *([PeerConfig("kserve", threads=4, workers=n // 4)] if n >= 8 else []),
        *([PeerConfig("mlserver", parallel_workers=1, batching=True),
           PeerConfig("mlserver", parallel_workers=0)] if single else []),
        PeerConfig("mlserver", threads=1, replicas=many),
        *([PeerConfig("mlserver", threads=4, replicas=n // 4)] if n >= 8 else []),
    ]
    return list(dict.fromkeys(configs))


def wrk_threads(n: int) -> int:
    """wrk threads for one URL: one is plenty for a few server processes (wrk is C and
    event-driven) and leaves the cores to the server; one cannot load 15 of them."""
    return min(4, n // 4) if n >= 8 else 1


def split(total: int, parts: int) -> list[int]:
    """`total` as `parts` shares as even as can be (64 over 15: 4 x 5, 11 x 4)."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


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


def drive(urls: list[str], model: Model, concurrency: int, seconds: float, binary: bool,
          threads: int = 1, warmup: float = 1.0, kiln: bool = False) -> LoadResult:
    """`serving.load` for any server: the same wrk, body and warm-up, then one request per
    URL answered before the measured run, so that requests the warm-up left queued (a server
    that does not drop the requests of closed connections) are done before it starts.

    Several URLs (replicas): one wrk per URL at the same time, one thread each, the
    connections split as evenly as can be; requests/s is their sum, p50 and p99 the highest
    of theirs. `threads`: wrk's threads for a single URL. `kiln`: the mean batch from Kiln's
    `kiln_batch_size` over the measured run."""
    body, headers = request_body(model, 1, binary)
    targets = [(f"{url}/v2/models/{model.name}/infer", c)
               for url, c in zip(urls, split(concurrency, len(urls))) if c > 0]
    threads = threads if len(urls) == 1 else 1
    with wrk_files(body) as (body_file, script), ThreadPoolExecutor(len(targets)) as pool:
        def wave(secs: float) -> list:
            return list(pool.map(lambda t: _wrk(t[0], body_file, headers, t[1], secs, script,
                                                min(threads, t[1])), targets))

        wave(warmup)
        for target, _ in targets:
            probe = urllib.request.Request(target, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(probe, timeout=300) as r:
                r.read()
        before = scrape(urls[0], model.name) if kiln else None
        cpu0 = os.times()
        runs = wave(seconds)
        cpu1 = os.times()
        after = scrape(urls[0], model.name) if kiln else None
    mean_batch = None
    if before and after and after["count"] > before["count"]:
        mean_batch = (after["sum"] - before["sum"]) / (after["count"] - before["count"])
    requests = sum(r.requests for r in runs)
    rate = sum(r.requests / r.seconds for r in runs if r.seconds)
    # wrk's CPU seconds, all of them: each `_wrk`'s own figure counts the others that ended
    # in its window
    client_cpu = (cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system)
    return LoadResult(concurrency, requests, sum(r.errors for r in runs),
                      requests / rate if rate else max(r.seconds for r in runs),
                      max(r.p50_us for r in runs), max(r.p99_us for r in runs),
                      mean_batch=mean_batch, client_cpu=client_cpu)


# -- the run -------------------------------------------------------------------------------

@dataclass
class Row:
    """One point on one server: the median round and the rounds' spread."""
    server: str
    body: str  # "JSON" or "binary"
    median: LoadResult
    low: float  # req/s, the slowest round
    high: float  # req/s, the fastest round

    @property
    def concurrency(self) -> int:
        return self.median.concurrency

    @property
    def throughput(self) -> float:
        return self.median.throughput


def summarize(server: str, body: str, rounds: list[LoadResult]) -> Row:
    """The median round (by req/s; the middle one of an odd number) and the spread."""
    return Row(server, body, *median_round(rounds))


def run(quick: bool) -> str:
    seconds, rounds = 3.0, 1 if quick else 3
    n = cpus()
    wrk_path()
    pythons = {peer: peer_python(peer) for peer in ("mlserver", "kserve")}
    versions = {peer: peer_versions(peer, py) for peer, py in pythons.items()}
    configs = peer_configs(n)
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-peers-"))
    results: dict[str, list[Row]] = {}
    try:
        cache_dir = workdir / "cache"
        tiny, mlp = iris_model(), mlp_model(workdir)
        for m in (tiny, mlp):
            build(m, cache_dir)
            results[m.name] = _compare(m, cache_dir, workdir, pythons, configs, n, seconds, rounds)
            print(f"   {m.name} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report(results, configs, versions, n, seconds, rounds, quick)


def _compare(m: Model, cache_dir: Path, workdir: Path, pythons: dict[str, PeerPython],
             configs: list[PeerConfig], n: int, seconds: float, rounds: int) -> list[Row]:
    """Every server up at once (idle ones cost little), checked, then each point measured
    on every server back to back, `rounds` times: load from elsewhere on the machine falls
    on all of them alike."""
    with ExitStack() as stack:
        # gRPC on as by default, on a free port (its default 8081 may be taken on a shared machine)
        kiln = stack.enter_context(serving(m, cache_dir, KILN_DEFAULT, None, workdir,
                                           extra_args=("--grpc-port", "0"), workers=None))
        servers = [PeerServer(KILN, [kiln.url], binary=True)]
        for cfg in configs:
            servers.append(stack.enter_context(peer_server(cfg, pythons[cfg.peer], m, workdir)))
        for srv in servers:
            for url in srv.urls:
                for binary in (False, True) if srv.binary else (False,):
                    check(url, m, binary)
        points = [("JSON", c) for c in JSON_CONCURRENCY] + [("binary", c) for c in BINARY_CONCURRENCY]
        samples: dict[tuple[str, str, int], list[LoadResult]] = {}
        for _ in range(rounds):
            for body, c in points:
                for srv in servers:
                    if body == "binary" and not srv.binary:
                        continue
                    r = drive(srv.urls, m, c, seconds, body == "binary", threads=wrk_threads(n),
                              kiln=srv.name == KILN)
                    samples.setdefault((srv.name, body, c), []).append(r)
    order = {srv.name: i for i, srv in enumerate(servers)}
    rows = [summarize(server, body, rs) for (server, body, _), rs in samples.items()]
    rows.sort(key=lambda r: (r.body != "JSON", r.concurrency, order[r.server]))
    return rows



# -- the report ----------------------------------------------------------------------------

TITLES = {"iris": "the tiny model: the demo's Iris classifier, one 4x3 MatMul + Softmax + ArgMax",
          "mlp2048": "the MLP: 4 x 2048-wide MatMul + Relu, float32"}
SHORT = {"iris": ("tiny (iris)", "tiny"), "mlp2048": ("MLP", "MLP")}


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def _get(rows: list[Row], server: str, body: str, c: int) -> Row | None:
    return next((r for r in rows if r.server == server and r.body == body
                 and r.concurrency == c), None)


def _peers(rows: list[Row], body: str, c: int) -> list[Row]:
    return [r for r in rows if r.server != KILN and r.body == body and r.concurrency == c]


def _best_peer(rows: list[Row], body: str, c: int) -> Row | None:
    return max(_peers(rows, body, c), key=lambda r: r.throughput, default=None)


def _met(ok: bool, why: str) -> str:
    return "yes" if ok else f"**no** ({why})"


def _how_it_ran(configs: list[PeerConfig], versions: dict[str, dict[str, str]], n: int,
                seconds: float, rounds: int) -> list[str]:
    import onnxruntime

    mv, kv = versions["mlserver"], versions["kserve"]
    labels = {peer: "; ".join(f"*{c.label}*" for c in configs if c.peer == peer)
              for peer in ("kserve", "mlserver")}
    single = f"wrk with {wrk_threads(n)} thread{'s' if wrk_threads(n) > 1 else ''}"
    return [
        f"One run, one machine, {n} CPUs (the benchmark's affinity, inherited by every server "
        f"and by wrk, which shares them), the same two models and the same load: closed loop, "
        f"{seconds:g} s per point after a 1 s warm-up, one row per request, the same v2 request "
        f"body for every server: JSON at concurrency {', '.join(map(str, JSON_CONCURRENCY))}"
        + (f", and the binary tensor extension at {', '.join(map(str, BINARY_CONCURRENCY))} where "
           f"the server has it" if BINARY_CONCURRENCY else "") +
        f". A server on one port is driven by {single}; MLServer's replicas "
        f"(separate processes, each on its own port) by one wrk per replica at the same time, "
        f"one thread each, the connections split as evenly as can be (as a Kubernetes Service "
        f"spreads connections): their req/s is the sum, their p50 and p99 the highest of the "
        f"replicas'. All servers are up at once and each point is measured on every server back "
        f"to back, {rounds} round{'s' if rounds > 1 else ''}; each figure is the median round "
        f"(its p50 and p99 too), the spread the slowest and the fastest round. Every server was "
        f"checked first (every replica): its answer (JSON, and binary where it has it) equals "
        f"ONNX Runtime run directly. Every server runs the model on ONNX Runtime "
        f"{onnxruntime.__version__} (numpy {np.__version__}), spinning off (Kiln's default), "
        f"inter-op threads 1 on the peers; \"ORT default threads\" is ONNX Runtime's own "
        f"choice, sized from the CPUs the process may use. No server writes a line per request. "
        f"The best peer of a point is the peer configuration with the highest median.",
        "",
        "- **Kiln**: `kiln serve` with `spec.runtime` empty and no `KILN_ORT_INTRA_OP_THREADS`, "
        "i.e. its defaults: dynamic batching on, `maxBatchSize` 32, `maxQueueDelayMicroseconds` "
        "0, `contextsPerGPU` 2, front-end workers, engine processes and intra-op threads picked "
        "from the CPUs it has (docs/runtime.md), spinning off; aiohttp on uvloop, orjson.",
        f"- **MLServer {mv['mlserver']}** (installed by the benchmark in its own venv, "
        f".tools/bench-peers/, or from `KILN_BENCH_PEER_SITES`: uvicorn {mv['uvicorn']}, fastapi "
        f"{mv['fastapi']}): an `MLModel` subclass decoding and encoding with `NumpyCodec`; "
        f"`debug` off. Configurations: {labels['mlserver']}. Adaptive batching is "
        f"`max_batch_size` {MLSERVER_MAX_BATCH_SIZE}, `max_batch_time` "
        f"{MLSERVER_MAX_BATCH_TIME:g} s (it batches only with a time above 0, and waits that long "
        f"for a batch to fill); `parallel_workers` 0 runs inference in the HTTP process; a "
        f"replica is one more `mlserver start`. Its REST server reads JSON only (no binary "
        f"tensor extension; raw tensors are gRPC-only there).",
        f"- **KServe {kv['kserve']}** (`kserve` package, own venv or site: uvicorn "
        f"{kv['uvicorn']}, fastapi {kv['fastapi']}): a `kserve.Model` whose `predict` takes the "
        f"v2 `InferRequest` (`as_numpy`) and returns an `InferResponse` (predict on the event "
        f"loop), served by `kserve.ModelServer(workers=...)` (uvicorn worker processes sharing "
        f"the port, each with its own session), gRPC, the access log and per-request timing "
        f"lines off. Configurations: {labels['kserve']}. It has the binary tensor extension on "
        f"v2 REST (`binary_data_size`, `binary_data_output`, `inference-header-content-length`). "
        f"No batching in its Python server.",
        "",
    ]


def _model_table(name: str, rows: list[Row]) -> list[str]:
    out = [f"### {name} ({TITLES.get(name, name)})", "",
           "| server | body | concurrency | req/s (median) | spread (min-max) | p50 ms | p99 ms "
           "| vs best peer |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = _best_peer(rows, r.body, r.concurrency)
        if best is None or not best.throughput:
            ratio = "-"
        elif r is best:
            ratio = "best peer"
        else:
            ratio = f"{r.throughput / best.throughput:.2f}x"
        answered = r.median.requests > 0
        out.append(f"| {r.server} | {r.body} | {r.concurrency} | {r.throughput:.0f} | "
                   f"{r.low:.0f}-{r.high:.0f} | {_ms(r.median.p50_us) if answered else '-'} | "
                   f"{_ms(r.median.p99_us) if answered else '-'} | {ratio} |")
    errors = sum(r.median.errors for r in rows)
    if errors:
        out.append(f"\n{errors} requests failed (non-200 or socket errors) in the median rounds above.")
    for c in (64, 256):
        k = _get(rows, KILN, "JSON", c)
        if k is not None and k.median.mean_batch is not None:
            out += ["", f"Kiln's mean batch at concurrency {c}, JSON: {k.median.mean_batch:.1f} "
                    f"requests (its `kiln_batch_size` histogram over that point, median round)."]
    return out + [""]


def _summary(results: dict[str, list[Row]], n: int) -> list[str]:
    out = ["### Summary", "",
           f"| | Kiln | best peer given the same {n} CPUs | ratio | target >= {TARGET:g}x |",
           "|---|---|---|---:|---|"]
    for name, rows in results.items():
        long, short = SHORT.get(name, (name, name))
        for i, c in enumerate((64, 256)):
            k, p = _get(rows, KILN, "JSON", c), _best_peer(rows, "JSON", c)
            if k is None or p is None:
                continue
            ratio = k.throughput / max(p.throughput, 1e-9)
            out.append(f"| {long if i == 0 else short}, JSON, c={c} | {k.throughput:.0f} req/s "
                       f"({k.low:.0f}-{k.high:.0f}) | {p.server}: {p.throughput:.0f} req/s "
                       f"({p.low:.0f}-{p.high:.0f}) | {ratio:.2f}x "
                       f"| {_met(ratio >= TARGET, f'{TARGET / ratio:.2f}x short')} |")
    for name, rows in results.items():
        k1 = _get(rows, KILN, "JSON", 1)
        peers1 = [r for r in _peers(rows, "JSON", 1) if r.median.requests > 0]
        if k1 is None or not k1.median.requests or not peers1:
            continue
        low50 = min(peers1, key=lambda r: r.median.p50_us)
        low99 = min(peers1, key=lambda r: r.median.p99_us)
        r50 = k1.median.p50_us / low50.median.p50_us
        r99 = k1.median.p99_us / low99.median.p99_us
        out.append(
            f"| {SHORT.get(name, (name,))[0]}, JSON, c=1: Kiln's p50 and p99 no higher than the "
            f"lowest peer's | p50 {_ms(k1.median.p50_us)} ms, p99 {_ms(k1.median.p99_us)} ms "
            f"| p50 {_ms(low50.median.p50_us)} ms ({low50.server}), p99 "
            f"{_ms(low99.median.p99_us)} ms ({low99.server}) | p50 {r50:.2f}, p99 {r99:.2f} "
            f"| {_met(r50 <= 1 and r99 <= 1, f'p50 {r50:.2f}x, p99 {r99:.2f}x the peer')} |")
    return out + [""]


def report(results: dict[str, list[Row]], configs: list[PeerConfig],
           versions: dict[str, dict[str, str]], n: int, seconds: float, rounds: int,
           quick: bool) -> str:
    out = [f"## Peers at {n} CPUs: Kiln against MLServer and KServe (`benchmarks/peers.py`)", ""]
    out += _how_it_ran(configs, versions, n, seconds, rounds)
    for name, rows in results.items():
        out += _model_table(name, rows)
    out += _summary(results, n)
    out.append(
        "- Ratios hold within this run; absolute figures move between runs on a shared "
        "machine (the spread column shows how much within this one), and a p99 at concurrency "
        "1 is one point of a few thousand requests." + (" A `--quick` run (one round)." if quick else ""))
    return "\n".join(out)
