"""A hung cache volume: the engine load has a deadline, and stopping never waits for the read.

CI cannot hang an NFS read, so `ServedModel`'s reader (cache.read_verified by default) is
replaced by one that blocks on a threading.Event, in process; in the `kiln serve`
subprocess, the one place the cache reads engine bytes (cache._read_at) blocks forever.
Everything else is real: a built onnxruntime engine, the server, its signal handling.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.engine.build import BuildRequest, build_engine
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.model import FAILED, READY, STOPPED, ServedModel
from kiln.runtime.serving.servers import InferenceServer

pytestmark = pytest.mark.timeout(60)

RUNTIME = runtime_with_defaults({"batching": {"maxBatchSize": 4}})


@pytest.fixture(scope="module")
def built(tmp_path_factory, matmul_onnx) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("deadline")
    (root / "m.onnx").write_bytes(matmul_onnx)
    result = build_engine(BuildRequest.from_dict({
        "namespace": "ml", "name": "mlp", "model": {"uri": (root / "m.onnx").as_uri(), "version": "1"},
        "engine": {"backend": "onnxruntime", "precision": "fp32"}, "target": "cpu"}), root / "cache",
        allow_local_files=True)
    return root / "cache", result.path


class HungRead:
    """A reader stuck like a read of a hung network volume, until released."""

    def __init__(self):
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, entry):
        self.threads.append(threading.current_thread())
        self.release.wait()
        raise OSError("the volume came back too late")


@pytest.fixture
def hung():
    reader = HungRead()
    yield reader
    reader.release.set()


def served(built, **kw) -> ServedModel:
    cache_dir, rel = built
    return ServedModel("mlp", "1", cache_dir, {"cpu": rel}, RUNTIME, ServerMetrics(), target="cpu", **kw)


async def get(url: str) -> tuple[int, dict]:
    def fetch():
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    return await asyncio.to_thread(fetch)


async def test_a_hung_read_fails_the_load_at_its_deadline_and_readiness_says_why(built, hung):
    model = served(built, load_timeout=0.5, reader=hung)
    server = InferenceServer([model], model.metrics)
    url = await server.start("127.0.0.1", 0)
    try:
        started = time.monotonic()
        assert await asyncio.wait_for(server.wait_loaded(), 10) is False
        assert 0.5 <= time.monotonic() - started < 5
        entry = os.path.join(built[0], built[1])
        reason = f"the engine load did not finish within 0.5 s (reading {entry}; is the cache volume hung?)"
        assert model.state == FAILED and model.error == reason
        status, doc = await get(f"{url}/v2/health/ready")
        assert status == 503 and doc["error"] == f"model 'mlp' failed to load: {reason}"
        status, doc = await get(f"{url}/v2/models/mlp/ready")
        assert status == 503 and doc["state"] == "failed" and reason in doc["error"]
    finally:
        await server.shutdown(0)


async def test_a_load_within_its_deadline_is_ready(built):
    model = served(built, load_timeout=30)
    try:
        assert await model.load() and model.state == READY
    finally:
        await model.close(0)


async def test_shutdown_returns_within_the_drain_time_while_the_read_is_hung(built, hung):
    model = served(built, reader=hung)  # the default deadline: 600 s, far away
    server = InferenceServer([model], model.metrics)
    await server.start("127.0.0.1", 0)
    deadline = time.monotonic() + 10
    while not hung.threads:
        assert time.monotonic() < deadline, "the read never started"
        await asyncio.sleep(0.01)
    started = time.monotonic()
    await asyncio.wait_for(server.shutdown(1.0), 10)
    assert time.monotonic() - started < 1.0 + 1.0
    assert model.state == STOPPED
    # The read is still stuck, on a daemon thread: the interpreter's exit does not wait for
    # it (a worker of asyncio's default executor would be joined, forever).
    assert hung.threads[0].is_alive() and hung.threads[0].daemon


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_kiln_serve_refuses_a_load_timeout_that_is_not_positive(tmp_path, value):
    import subprocess
    proc = subprocess.run([str(Path(sys.executable).parent / "kiln"), "serve", "--model-name", "m",
                           "--engine", "cpu=a/b/c", f"--load-timeout-seconds={value}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kiln serve: --load-timeout-seconds must be a positive number, got {value}"


# The real `kiln serve` entry point; the engine read blocks forever where the cache reads
# bytes, as a read of a hung NFS volume does.
HUNG_WRAPPER = """
import sys, threading
from kiln.runtime.engine.cache import verify
def hung(fd, view, offset):
    print("engine read: hung", file=sys.stderr, flush=True)
    threading.Event().wait()
verify._read_at = hung
from kiln.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("load_timeout", [None, 1])
def test_kiln_serve_on_a_hung_volume_reports_it_and_exits_on_sigterm(built, tmp_path, kiln_process,
                                                                    load_timeout):
    wrapper = tmp_path / "hung.py"
    wrapper.write_text(HUNG_WRAPPER)
    cache_dir, rel = built
    flags = ["--load-timeout-seconds", str(load_timeout)] if load_timeout else []
    p = kiln_process(["serve", "--model-name", "mlp", "--cache-dir", str(cache_dir), "--engine",
                      f"cpu={rel}", "--host", "127.0.0.1", "--port", "0", "--drain-seconds", "2",
                      *flags], tmp_path, command=(sys.executable, str(wrapper)))
    port = int(p.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    p.wait_for("engine read: hung")
    if load_timeout:
        p.wait_for(r"model mlp: load failed: the engine load did not finish within 1 s \(reading ")
        status, doc = asyncio.run(get(f"http://127.0.0.1:{port}/v2/health/ready"))
        assert status == 503 and "is the cache volume hung?" in doc["error"]
    started = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(10) == 0, "\n".join(p.lines)
    assert time.monotonic() - started < 2 + 3  # the drain time, and the interpreter's exit
