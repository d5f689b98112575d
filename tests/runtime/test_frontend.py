"""`kiln serve --workers N`: front-end processes in front of one engine process.

Real `kiln serve` processes on loopback, a real engine built into a real cache, real HTTP;
every answer is compared with ONNX Runtime run directly, and with what the single process
answers for the same bad request.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.serving.workers.engines import (LIGHT_ENGINE_BYTES, auto_engine_processes,
                                                  engine_threads, light_cpu_engine, merge_metrics,
                                                  parse_engine_processes, parse_engine_threads)
from kiln.runtime.serving.workers.supervisor import default_workers, parse_workers
from kiln.runtime.serving.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request

from support.metrics import wait_for_metric
from support.serving import (NAME, Built, HttpClient, children, assert_matches, build_cpu_engine, json_inputs,
                             neg_model, sample)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("frontend"))


def serve(kiln_process, built: Built, tmp_path: Path, workers: int, runtime: dict | None = None,
          engines: int = 1):
    return start(kiln_process, tmp_path, workers, [
        "--model-name", NAME, "--cache-dir", str(built.cache), "--engine", f"cpu={built.rel}",
        "--runtime-spec", json.dumps(runtime or {}), "--engine-processes", str(engines)])


def start(kiln_process, tmp_path: Path, workers: int, args: list[str]):
    """`kiln serve ARGS` on a free loopback port with `workers`; returns it and a client
    once it is ready."""
    p = kiln_process(["serve", *args, "--host", "127.0.0.1", "--port", "0", "--no-grpc",
                      "--workers", str(workers), "--drain-seconds", "10"], tmp_path)
    if workers > 1:
        port = int(p.wait_for(r"front-end worker\(s\) on 127\.0\.0\.1:(\d+)").group(1))
    else:
        port = int(p.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    client = HttpClient(port)
    deadline = time.monotonic() + 30
    while True:
        try:
            if client.get("/v2/health/ready")[0] == 200:
                break
        except OSError:
            pass  # the front ends are not listening yet
        assert time.monotonic() < deadline, "\n".join(p.lines)
        time.sleep(0.05)
    return p, client


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def front_ends(pid: int) -> list[int]:
    """The engine's front-end processes (multiprocessing's resource tracker aside)."""
    return [c for c in children(pid)
            if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]


def test_workers_default_to_the_cpu_limit_less_the_engines_core():
    assert [default_workers(c) for c in (None, 1, 2, 2.5, 3, 4, 16, 64)] == [1, 1, 1, 1, 2, 3, 15, 16]
    assert parse_workers("auto", 8) == parse_workers(None, 8) == 7
    assert parse_workers("3", 1) == 3
    for bad in ("0", "65", "two"):
        with pytest.raises(ValueError, match="workers must be a number from 1 to 64 or 'auto'"):
            parse_workers(bad, 4)


def test_front_ends_answer_as_the_single_process_does(built, tmp_path, kiln_process):
    p, client = serve(kiln_process, built, tmp_path, 2)
    try:
        assert len(front_ends(p.proc.pid)) == 2
        # JSON and binary tensors, many at once over many connections: batched together
        # in the one engine, each answer the right one.
        def one(i: int):
            inputs = sample(1 + i % 4, seed=i)
            if i % 2:
                status, _, doc = client.infer({"inputs": json_inputs(inputs)})
                outputs = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in doc["outputs"]}
                outputs = {k: v.astype(built.expected(inputs)[k].dtype) for k, v in outputs.items()}
            else:
                body, n = encode_infer_request(inputs, binary=True, binary_outputs=True)
                status, headers, raw = client.request(
                    "POST", f"/v2/models/{NAME}/infer", body,
                    {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(n)})
                doc = decode_infer_response(raw, int(headers[HEADER_LENGTH]))
                outputs = {o["name"]: o["data"] for o in doc["outputs"]}
            assert status == 200, doc
            assert_matches(outputs, built.expected(inputs))

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(200)))

        status, _, meta = client.get(f"/v2/models/{NAME}")
        assert status == 200 and meta["platform"] == "onnxruntime"
        assert [i["name"] for i in meta["inputs"]] == ["features", "token_ids"]
        # Request metrics are the engine's, front ends' outcomes included.
        wait_for_metric(f"http://127.0.0.1:{client.port}", "kiln_requests_total",
                        {"model": NAME, "outcome": "success"}, lambda n: n == 200, timeout=5)
        assert client.metric("kiln_batch_size_count", model=NAME) >= 1
        bad = [{"inputs": [{"name": "features", "shape": [1, 5], "datatype": "FP32",
                            "data": [0.0] * 5}]},
               {"inputs": json_inputs(sample(40))},  # over maxBatchSize... or the profile
               b"{not json"]
        with_workers = [client.infer(doc) for doc in bad]
        assert client.get("/v2/models/nope")[0] == 404
    finally:
        assert p.stop() == 0

    p, single = serve(kiln_process, built, tmp_path, 1)
    try:
        alone = [single.infer(doc) for doc in bad]
    finally:
        p.stop()
    assert [(s, d) for s, _, d in with_workers] == [(s, d) for s, _, d in alone]
    assert all(s == 400 for s, _, _ in alone)


def test_a_request_the_engine_refuses_fails_alone(built, tmp_path, kiln_process):
    """Issue 19, item 4: requests a front end joins into one hand-over, one of them with
    data the engine refuses (an id outside the embedding): only that one gets the 400, the
    others their answers, and the model stays ready."""
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 20_000}}
    p, client = serve(kiln_process, built, tmp_path, 2, runtime)
    try:
        def one(i: int):
            inputs = sample(1, seed=i)
            if i % 5 == 0:
                inputs["token_ids"][0, 0] = 99
            status, _, doc = client.infer({"inputs": json_inputs(inputs)})
            if i % 5 == 0:
                assert status == 400 and "idx=99" in doc["error"], doc
                return
            assert status == 200, doc
            outputs = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in doc["outputs"]}
            expected = built.expected(inputs)
            assert_matches({k: v.astype(expected[k].dtype) for k, v in outputs.items()}, expected)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(200)))
        assert client.get("/v2/health/ready")[0] == 200
    finally:
        assert p.stop() == 0


def test_shared_memory_runs_never_overlap_and_what_does_not_fit_goes_inline():
    """A hand-over larger than a slot takes adjacent slots (an image-sized tensor travels in
    shared memory, not pickled on the socket); two runs never share a slot, which would hand
    one request's tensors to another."""
    from kiln.runtime.serving.workers.link import _SharedMemorySlots

    slots = _SharedMemorySlots(count=8, size=1 << 20)
    try:
        assert slots.needed(602_112) == 1  # one 224x224 image and its answer
        assert slots.needed(4 * 602_112) == 3 and slots.needed(8 << 20) == 0
        a, b, c = slots.take(3), slots.take(1), slots.take(4)
        assert (a, b, c) == (0, 3, 4) and slots.take(1) is None
        slots.give(b)
        assert slots.take(2) is None  # one free slot is no run of two
        slots.give(a, 3)
        assert slots.take(4) == 0 and slots.take(1) is None
    finally:
        slots.close()


def test_what_does_not_fit_shared_memory_travels_inline(tmp_path, kiln_process):
    """A request larger than a slot (a run of slots in, its outputs past the room left
    inline), and many at once (joined into hand-overs, or more than a front end has
    slots): answered like the others."""
    width = 65536  # 256 KiB a row: a 1 MiB slot holds 2 rows in and out
    rel = build_cpu_engine(tmp_path, "mm", neg_model(width))
    runtime = {"batching": {"maxBatchSize": 512, "maxQueueDelayMicroseconds": 300_000}}
    p, client = start(kiln_process, tmp_path, 2, [
        "--model-name", "mm", "--cache-dir", str(tmp_path / "cache"), "--engine", f"cpu={rel}",
        "--runtime-spec", json.dumps(runtime)])
    try:
        def one(rows: int, seed: int):
            x = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
            body, n = encode_infer_request({"x": x}, binary=True, binary_outputs=True)
            status, headers, raw = client.request(
                "POST", "/v2/models/mm/infer", body,
                {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(n)})
            assert status == 200, raw[:300]
            (out,) = decode_infer_response(raw, int(headers[HEADER_LENGTH]))["outputs"]
            np.testing.assert_array_equal(out["data"], -x)

        one(5, 1)  # 1.3 MB each way, over a 1 MiB slot
        with ThreadPoolExecutor(120) as pool:  # ~60 per front end at once, 32 slots each
            list(pool.map(lambda i: one(1, i), range(120)))
    finally:
        assert p.stop() == 0


@pytest.mark.parametrize("engines", [1, 2], ids=["one engine", "two engine processes"])
def test_the_result_cache_is_shared_by_every_front_end(built, tmp_path, kiln_process, engines):
    """With two engine processes too: requests of a model with a result cache all go to the
    first, whichever front end reads them."""
    p, client = serve(kiln_process, built, tmp_path, 2, {"resultCache": {"enabled": True}},
                      engines)
    try:
        def lookups(result: str) -> float:
            return client.metric("kiln_result_cache_requests_total", model=NAME, result=result)

        misses = lookups("miss")  # the warm-up's
        inputs = sample(3, seed=9)
        for _ in range(12):  # a new connection each: the kernel spreads them over both
            status, _, doc = client.infer({"inputs": json_inputs(inputs)})
            assert status == 200, doc
        assert (lookups("miss") - misses, lookups("hit")) == (1, 11)
    finally:
        assert p.stop() == 0


def test_sigterm_drains_every_front_end_then_the_engine(built, tmp_path, kiln_process):
    runtime = {"batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 1_500_000}}
    p, client = serve(kiln_process, built, tmp_path, 2, runtime)
    pids = front_ends(p.proc.pid)
    inputs = sample(2, seed=5)
    results = []
    senders = [threading.Thread(target=lambda: results.append(
        client.infer({"inputs": json_inputs(inputs)}))) for _ in range(4)]
    for s in senders:
        s.start()
    # In the engine's batching queue (1.5 s delay): 1 to 4 entries, since a front end hands
    # requests that arrive together over as one.
    wait_for_metric(f"http://127.0.0.1:{client.port}", "kiln_queue_depth", {"model": NAME},
                    lambda depth: depth >= 1)
    p.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # While draining, a front end refuses new work the way the single process does.
    try:
        status, headers, doc = client.infer({"inputs": json_inputs(sample(1))})
        assert status == 503 and "Retry-After" in headers, doc
        assert doc["error"] == "the server is shutting down; retry on another replica"
    except ConnectionError:
        pass  # a front end with nothing in flight may have finished already
    for s in senders:
        s.join(15)
    assert [r[0] for r in results] == [200] * 4, results
    for status, _, doc in results:
        outputs = {o["name"]: o["data"] for o in decode_infer_response(
            json.dumps(doc).encode(), None)["outputs"]}
        assert_matches(outputs, built.expected(inputs))
    assert p.proc.wait(20) == 0
    assert not any(alive(pid) for pid in pids)
    p.stop()  # every line read
    log = "\n".join(p.lines)
    assert "Traceback" not in log and "Exception ignored" not in log, log


def test_a_front_end_that_dies_is_replaced(built, tmp_path, kiln_process):
    """...and its shared memory does not outlive it in /dev/shm (memory, in a pod)."""
    p, client = serve(kiln_process, built, tmp_path, 2)

    def listening(count: int) -> None:
        deadline = time.monotonic() + 30
        while sum("rest.server: listening on" in line for line in list(p.lines)) < count:
            assert time.monotonic() < deadline, "\n".join(p.lines)
            time.sleep(0.05)

    try:
        listening(2)  # both front ends: connected to the engine, then listening
        first = front_ends(p.proc.pid)
        segments = {line.split()[-1] for line in Path(f"/proc/{first[0]}/maps").read_text()
                    .splitlines() if "/dev/shm/" in line}
        assert segments
        os.kill(first[0], signal.SIGKILL)
        p.wait_for(r"front end \d exited \(code -9\); starting it again", timeout=10)
        listening(3)
        assert not any(Path(segment).exists() for segment in segments), segments
        for i in range(20):  # every connection lands on a live front end
            status, _, doc = client.infer({"inputs": json_inputs(sample(1, seed=i))})
            assert status == 200, doc
    finally:
        assert p.stop() == 0


def kill_the_engine_and_see_them_stop(p, pids: list[int]) -> None:
    p.proc.kill()
    p.proc.wait(5)
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "front ends outlived their engine"
        time.sleep(0.1)


def test_front_ends_stop_when_the_engine_is_killed(built, tmp_path, kiln_process):
    p, client = serve(kiln_process, built, tmp_path, 2)
    pids = front_ends(p.proc.pid)
    assert len(pids) == 2
    kill_the_engine_and_see_them_stop(p, pids)


def test_front_ends_still_starting_stop_when_the_engine_is_killed(built, tmp_path, kiln_process):
    p = kiln_process(["serve", "--model-name", NAME, "--cache-dir", str(built.cache),
                      "--engine", f"cpu={built.rel}", "--host", "127.0.0.1", "--port", "0",
                      "--no-grpc", "--workers", "2"], tmp_path)
    p.wait_for(r"front-end worker\(s\) on")  # spawned, still importing: not connected yet
    pids = front_ends(p.proc.pid)
    kill_the_engine_and_see_them_stop(p, pids)


# -- engine processes beyond the first (workers.engines) --------------------------------------

def test_engine_processes_and_threads_follow_the_cpus_and_the_engine(tmp_path):
    light, heavy = tmp_path / "light", tmp_path / "heavy"
    light.mkdir()
    heavy.mkdir()
    (light / "engine.onnx").write_bytes(b"x" * 1000)
    (heavy / "engine.onnx").write_bytes(b"x" * (LIGHT_ENGINE_BYTES + 1))
    def light(engines: dict) -> bool:
        return light_cpu_engine(engines, str(tmp_path))

    assert light({"cpu": "light"})
    assert not light({"cpu": "heavy"}) and not light({"cpu": "nowhere"})
    assert not light({"cpu": "light", "sm90": "light"})  # a GPU pod: its memory spent once
    assert [auto_engine_processes(c, True) for c in (None, 2, 7, 8, 16, 64, 200)] == [1, 1, 1, 2, 4, 16, 16]
    assert auto_engine_processes(16, False) == 1
    assert parse_engine_processes("auto", 4, {"cpu": "x"}) == parse_engine_processes(None, 4, {"cpu": "x"}) == 4
    assert parse_engine_processes("3", 1, {"cpu": "x"}) == 3
    for bad in ("0", "17", "two", True):
        with pytest.raises(ValueError, match="engine processes must be a number from 1 to 16 or 'auto'"):
            parse_engine_processes(bad, 1, {"cpu": "x"})
    with pytest.raises(ValueError, match="2 engine processes need CPU engines only .* sm90"):
        parse_engine_processes(2, 1, {"cpu": "x", "sm90": "y"})
    assert parse_engine_threads(None) is None and parse_engine_threads(6) == 6
    for bad in (0, 257, "4", True, 2.5):
        with pytest.raises(ValueError, match="runtime.engineThreads must be a number from 1 to 256"):
            parse_engine_threads(bad)
    # Front ends take the CPUs the engine processes leave (2 CPUs: 2 for a light model);
    # engine threads the rest.
    assert [default_workers(16, e) for e in (1, 4)] == [15, 12]
    assert [default_workers(c, 1, light=True) for c in (None, 1, 2, 3, 4)] == [1, 1, 2, 2, 3]
    assert [engine_threads(c, w, e) for c, w, e in
            [(None, 1, 1), (2, 1, 1), (16, 15, 1), (16, 12, 4), (4, 3, 1), (3.5, 2, 1)]] == \
        [None, 2, 12, 3, 3, 2]


def test_metrics_of_several_engine_processes_add_up():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kiln.runtime.serving.metrics import ServerMetrics

    first, second = ServerMetrics(), ServerMetrics()
    for m, rows, busy, ready in ((first, 8, 3.0, 1), (second, 4, 1.0, 0)):
        m.batch_size.labels(NAME).observe(rows)
        m.engine_busy_seconds.labels(NAME, "1").inc(busy)
        m.model_ready.labels(NAME).set(ready)
        m.model_info.labels(NAME, "1", "k", "onnxruntime", "cpu").set(1)
    m.model_info.labels(NAME, "1", "other", "onnxruntime", "cpu").set(1)  # the second's only
    first.requests.labels(NAME, "success").inc(5)  # front ends tally to the first alone
    merged = merge_metrics([generate_latest(first.registry), generate_latest(second.registry)], 2)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(merged.decode()) for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model": NAME, **labels}.items())))]

    assert value("kiln_batch_size_count") == 2
    assert value("kiln_batch_size_sum") == 12
    assert value("kiln_batch_size_bucket", le="8.0") == 2
    assert value("kiln_batch_size_bucket", le="4.0") == 1
    assert value("kiln_engine_busy_seconds_total", version="1") == 2.0  # (3 + 1) / 2 engines
    assert value("kiln_model_ready") == 0  # ready when every engine is
    assert value("kiln_requests_total", outcome="success") == 5
    info = [k for k in samples if k[0] == "kiln_model_info"]
    assert [dict(k[1])["engine_key"] for k in info] == ["k"]


def test_engine_processes_share_the_front_ends(built, tmp_path, kiln_process):
    """Two engine processes behind four front ends: every answer right, /metrics adds both
    engines up, a killed second engine is started again (its front ends with it) and the
    pod answers again; SIGTERM stops everything, exit 0."""
    p, client = start(kiln_process, tmp_path, 4, [
        "--model-name", NAME, "--cache-dir", str(built.cache), "--engine", f"cpu={built.rel}",
        "--engine-processes", "2"])
    base = f"http://127.0.0.1:{client.port}"

    def burst(n: int, seed: int) -> int:
        def one(i: int) -> int:
            inputs = sample(1 + i % 3, seed=seed + i)
            status, _, doc = client.infer({"inputs": json_inputs(inputs)})
            assert status == 200, doc
            outputs = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in doc["outputs"]}
            expected = built.expected(inputs)
            assert_matches({k: v.astype(expected[k].dtype) for k, v in outputs.items()}, expected)
            return 1 + i % 3

        with ThreadPoolExecutor(16) as pool:
            return sum(pool.map(one, range(n)))

    try:
        second = int(p.wait_for(r"engine process 1 started \(pid (\d+)\)").group(1))
        assert len(front_ends(p.proc.pid)) == 5, "4 front ends and a second engine process"
        warmup = client.metric("kiln_batch_size_sum", model=NAME)
        rows = burst(300, 0)
        # The first engine's /metrics counts the rows both engines ran, and every request.
        wait_for_metric(base, "kiln_batch_size_sum", {"model": NAME}, lambda v: v == warmup + rows)
        wait_for_metric(base, "kiln_requests_total", {"model": NAME, "outcome": "success"},
                        lambda n: n == 300)
        assert client.metric("kiln_model_ready", model=NAME) == 1
        os.kill(second, signal.SIGKILL)
        p.wait_for(r"engine process 1 exited \(code -9\); starting it again", timeout=10)
        p.wait_for(r"engine process 1 started \(pid \d+\)")
        deadline = time.monotonic() + 60
        while True:  # its front ends stopped with it, and are back once it has loaded
            try:
                burst(40, 1000)
                break
            except (AssertionError, OSError):
                assert time.monotonic() < deadline, "\n".join(p.lines)
                time.sleep(0.2)
        burst(100, 2000)
    finally:
        assert p.stop() == 0
    log = "\n".join(p.lines)
    assert "Traceback" not in log and "Exception ignored" not in log, log


# ------------------------------------------------------------------------ the pod's CPU signals

def pod_signals(client) -> dict[str, float | None]:
    return {"cpu": client.metric("kiln_pod_cpu_seconds_total"), "limit": client.metric("kiln_pod_cpu_limit_cores"),
            "front_end": client.metric("kiln_pod_front_end_busy_seconds_total"),
            "engine": client.metric("kiln_engine_busy_seconds_total", model=NAME)}


@pytest.mark.parametrize("workers", [2, 1])
def test_a_loaded_light_model_shows_its_front_ends_busier_than_its_engine(built, tmp_path, kiln_process, workers):
    p, client = serve(kiln_process, built, tmp_path, workers)
    try:
        if workers > 1:
            assert len(front_ends(p.proc.pid)) == workers
        before, t0 = pod_signals(client), time.monotonic()
        assert before["limit"] == float(len(os.sched_getaffinity(p.proc.pid)))
        doc = {"inputs": json_inputs(sample(1))}
        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(lambda _: client.infer(doc)[0], range(1500))) == {200}
        after, seconds = pod_signals(client), time.monotonic() - t0
        rate = {k: (after[k] - before[k]) / seconds for k in ("cpu", "front_end", "engine")}
        # The engine's busy fraction misses where the work is: HTTP in the loops, the pod's CPU.
        assert rate["front_end"] > rate["engine"], rate
        if workers > 1:  # the hand-overs between processes cost CPU the engine never sees
            assert max(rate["front_end"], rate["cpu"] / after["limit"]) > 1.5 * rate["engine"], rate
        assert 0 < rate["front_end"] <= 1.05 and 0 < rate["cpu"] <= after["limit"] * 1.05, rate
        print(f"\n{workers} front end(s): {rate}")
    finally:
        assert p.stop() == 0
