"""Engine-cache health: `cache_usage` over real directories, its cached wrapper, the
kiln_engine_cache_* gauges, and a real `kiln serve` / `kiln dev` showing them on /metrics."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from kiln.runtime.commands.serve import cache_namespace
from kiln.runtime.engine.cache import usage as usage_module
from kiln.runtime.engine.cache.usage import (CachedCacheUsage, CacheUsage, EntriesUsage,
                                             cache_usage, scan_entries, volume_usage)
from kiln.runtime.serving.metrics import ENGINE_CACHE_GAUGES, ServerMetrics
from kiln.runtime.serving.workers.engines import merge_metrics

from support.metrics import metric_value, read_metric, wait_for_metric
from support.serving import NAME, Built

pytestmark = pytest.mark.timeout(60)

CACHE_NAMES = [name for name, *_ in ENGINE_CACHE_GAUGES]


def entry(root: Path, namespace: str, model: str, key: str, sizes: dict[str, int],
          mtime: float | None = None, manifest: bool = True) -> Path:
    """An entry directory with files of `sizes` bytes (and a manifest.json of 10 bytes)."""
    d = root / namespace / model / key
    d.mkdir(parents=True)
    files = {**sizes, **({"manifest.json": 10} if manifest else {})}
    for name, size in files.items():
        (d / name).write_bytes(b"x" * size)
    if mtime is not None:
        os.utime(d, (mtime, mtime))
    return d


# -- cache_usage --------------------------------------------------------------------------

def test_counts_complete_entries_their_bytes_and_the_oldest(tmp_path):
    entry(tmp_path, "prod", "resnet", "k1", {"engine.onnx": 1000}, mtime=1_700_000_300)
    entry(tmp_path, "prod", "resnet", "k2", {"engine.onnx": 2000}, mtime=1_700_000_100)
    entry(tmp_path, "prod", "bert", "k3", {"engine.plan": 500}, mtime=1_700_000_200)
    entry(tmp_path, "staging", "resnet", "k4", {"engine.onnx": 9999}, mtime=1_600_000_000)
    usage = cache_usage(tmp_path, "prod")
    assert usage.entries == EntriesUsage(entries=3, entry_bytes=1000 + 2000 + 500 + 3 * 10,
                                         oldest_mtime=1_700_000_100, truncated=False)
    assert scan_entries(tmp_path, "staging") == EntriesUsage(1, 10009, 1_600_000_000)
    v = usage.volume
    assert v.free_bytes > 0 and v.used_bytes > 0
    assert v.used_bytes + v.free_bytes <= v.capacity_bytes
    st = os.statvfs(tmp_path)
    assert v.capacity_bytes == st.f_blocks * st.f_frsize


def test_dot_names_and_unfinished_entries_are_not_entries(tmp_path):
    entry(tmp_path, "prod", "resnet", "k1", {"engine.onnx": 100})
    for debris in (".tmp-k2-abc", ".quarantine-k3-20260101T000000Z", ".trash-k4-1-2"):
        entry(tmp_path, "prod", "resnet", debris, {"engine.onnx": 1000})
    entry(tmp_path, "prod", ".hidden-model", "k5", {"engine.onnx": 1000})
    entry(tmp_path, ".gc", "resnet", "k6", {"engine.onnx": 1000})
    entry(tmp_path, "prod", "resnet", "k7", {"engine.onnx": 1000}, manifest=False)
    (tmp_path / "prod" / "resnet" / ".lock").write_text("")
    (tmp_path / "prod" / "resnet" / "stray-file").write_text("not an entry")
    usage = scan_entries(tmp_path, "prod")
    assert (usage.entries, usage.entry_bytes, usage.truncated) == (1, 110, False)


def test_symbolic_links_are_neither_followed_nor_counted(tmp_path):
    outside = entry(tmp_path / "elsewhere", "x", "y", "big", {"engine.onnx": 50_000})
    root = tmp_path / "cache"
    d = entry(root, "prod", "resnet", "k1", {"engine.onnx": 100})
    (d / "weights.bin").symlink_to(outside / "engine.onnx")  # a file link: not its target's bytes
    (d / "more").symlink_to(outside)  # a directory link inside an entry: not walked
    (root / "prod" / "resnet" / "k2").symlink_to(outside)  # an entry that is a link: not one
    (root / "prod" / "linked-model").symlink_to(outside.parent)  # a model dir that is a link
    linked = entry(root, "prod", "resnet", "k3", {"engine.onnx": 7}, manifest=False)
    (linked / "manifest.json").symlink_to(d / "manifest.json")  # a linked manifest: not complete
    (root / "linked-ns").symlink_to(root / "prod")
    usage = scan_entries(root, "prod")
    assert (usage.entries, usage.entry_bytes) == (1, 110)
    assert scan_entries(root, "linked-ns") == EntriesUsage()


def test_the_walk_is_bounded_and_says_so(tmp_path):
    for i in range(5):
        entry(tmp_path, "prod", "m", f"k{i}", {"engine.onnx": 1})
    exact = scan_entries(tmp_path, "prod", limit=5)
    assert (exact.entries, exact.entry_bytes, exact.truncated) == (5, 55, False)
    bounded = scan_entries(tmp_path, "prod", limit=3)
    assert bounded.truncated and bounded.entries == 3 and bounded.entry_bytes == 33


def test_a_namespace_without_entries_and_a_root_that_is_not_there(tmp_path):
    assert scan_entries(tmp_path, "prod") == EntriesUsage(0, 0, None, False)
    assert volume_usage(tmp_path / "missing") is None
    assert cache_usage(tmp_path / "missing", "prod") == CacheUsage(None, EntriesUsage())


# -- CachedCacheUsage ---------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_entries_are_walked_again_at_most_every_minute(tmp_path, monkeypatch):
    clock = Clock()
    walks, statvfs = [], []

    def run(work):
        walks.append(work)
        work()

    monkeypatch.setattr(usage_module, "volume_usage",
                        lambda root: statvfs.append(root) or volume_usage(root))
    usage = CachedCacheUsage(tmp_path, "prod", clock=clock, run=run)
    entry(tmp_path, "prod", "m", "k1", {"engine.onnx": 1})
    assert usage().entries.entries == 1 and len(walks) == 1
    entry(tmp_path, "prod", "m", "k2", {"engine.onnx": 1})
    clock.now += 59
    assert usage().entries.entries == 1 and len(walks) == 1  # the last walk's
    assert len(statvfs) == 2  # the volume, read at every call
    clock.now += 1
    assert usage().entries.entries == 2 and len(walks) == 2


def test_a_scrape_does_not_wait_for_the_walk(tmp_path):
    entry(tmp_path, "prod", "m", "k1", {"engine.onnx": 1})
    pending = []
    usage = CachedCacheUsage(tmp_path, "prod", clock=Clock(), run=pending.append)
    first = usage()
    assert first.entries is None and first.volume is not None  # the walk has not run yet
    assert usage().entries is None and len(pending) == 1  # one walk at a time
    pending[0]()
    assert usage().entries.entries == 1


def test_the_default_runs_the_walk_on_a_thread(tmp_path):
    entry(tmp_path, "prod", "m", "k1", {"engine.onnx": 1})
    usage = CachedCacheUsage(tmp_path, "prod")
    usage()
    deadline = time.monotonic() + 10
    while usage().entries is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert usage().entries.entries == 1


# -- the gauges ---------------------------------------------------------------------------

def test_a_server_without_a_cache_exports_the_names_and_no_samples():
    text = generate_latest(ServerMetrics().registry).decode()
    for name in CACHE_NAMES:
        assert f"# TYPE {name} gauge" in text
        assert metric_value(text, name) is None


def test_the_gauges_are_labelled_with_the_claim_and_the_cache_namespace(tmp_path):
    entry(tmp_path, "prod", "m", "k1", {"engine.onnx": 90}, mtime=1_700_000_000)
    metrics = ServerMetrics()
    metrics.engine_cache.watch(CachedCacheUsage(tmp_path, "prod", run=lambda work: work()),
                               "kiln-engine-cache", "prod")
    labels = {"claim": "kiln-engine-cache", "cache_namespace": "prod"}
    read = {name: read_metric(metrics.registry, name, labels) for name in CACHE_NAMES}
    assert read["kiln_engine_cache_entries"] == 1
    assert read["kiln_engine_cache_entry_bytes"] == 100
    assert read["kiln_engine_cache_oldest_entry_timestamp_seconds"] == 1_700_000_000
    assert read["kiln_engine_cache_free_bytes"] > 0
    assert read["kiln_engine_cache_capacity_bytes"] >= read["kiln_engine_cache_used_bytes"] > 0


def test_no_oldest_entry_without_entries(tmp_path):
    metrics = ServerMetrics()
    metrics.engine_cache.watch(CachedCacheUsage(tmp_path, "prod", run=lambda work: work()), "", "prod")
    labels = {"claim": "", "cache_namespace": "prod"}
    assert read_metric(metrics.registry, "kiln_engine_cache_entries", labels) == 0
    assert read_metric(metrics.registry, "kiln_engine_cache_oldest_entry_timestamp_seconds", labels) is None


def test_several_engine_processes_report_the_cache_once(tmp_path):
    entry(tmp_path, "prod", "m", "k1", {"engine.onnx": 90})
    texts = []
    for _ in range(3):  # as if every engine process watched it: still the first one's values
        metrics = ServerMetrics()
        metrics.engine_cache.watch(CachedCacheUsage(tmp_path, "prod", run=lambda work: work()), "c", "prod")
        metrics.requests.labels(model="m", outcome="success").inc()
        texts.append(generate_latest(metrics.registry))
    merged = merge_metrics(texts, engines=3).decode()
    labels = {"claim": "c", "cache_namespace": "prod"}
    assert metric_value(merged, "kiln_engine_cache_entries", labels) == 1
    assert metric_value(merged, "kiln_engine_cache_entry_bytes", labels) == 100
    first = texts[0].decode()
    assert metric_value(merged, "kiln_engine_cache_capacity_bytes", labels) == metric_value(
        first, "kiln_engine_cache_capacity_bytes", labels)
    assert metric_value(merged, "kiln_requests_total", {"model": "m"}) == 3  # the rest still add up


# -- the operator's arguments reach kiln serve ---------------------------------------------

def test_the_operator_passes_the_claim_and_the_engines_name_the_namespace():
    import argparse

    from kiln.operator import manifests
    from kiln.operator.config import OperatorConfig
    from kiln.operator.plan import plan_engines
    from kiln.runtime.api import spec as specmod
    from kiln.runtime.commands import serve
    from kiln.runtime.serving.loading import parse_engines

    model = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
             "metadata": {"name": "resnet", "namespace": "ml-prod", "uid": "u-1", "generation": 1}}
    config = OperatorConfig()
    for cache, claim in (({}, config.cache_claim), ({"claimName": "fast-cache"}, "fast-cache")):
        spec = specmod.apply_defaults({"model": {"uri": "pvc://models/resnet.onnx", "version": "1",
                                                 "sha256": "3f" * 32},
                                       "engine": {"backend": "onnxruntime"}, "cache": cache})
        engines = plan_engines(spec, config)
        dep = manifests.runtime_deployment(model, spec, engines, {}, config)
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
        parser = argparse.ArgumentParser()
        serve.configure(parser)
        args = parser.parse_args(container["args"][1:])
        assert args.cache_claim == claim == volume["persistentVolumeClaim"]["claimName"]
        assert cache_namespace(parse_engines(args.engine)) == "ml-prod"


# -- kiln serve and kiln dev --------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    built = Built(tmp_path_factory.mktemp("usage"))
    # A second, older entry of another model in the same namespace, and one elsewhere.
    entry(built.cache, "default", "other", "k-old", {"engine.onnx": 4096}, mtime=1_600_000_000)
    entry(built.cache, "elsewhere", "other", "k", {"engine.onnx": 1})
    return built


def wait_ready(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v2/models/{NAME}/ready", timeout=5):
                return
        except OSError:  # not listening yet, or 503 while it loads
            assert time.monotonic() < deadline, f"{url} not ready within {timeout} s"
            time.sleep(0.05)


def entry_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@pytest.mark.parametrize("workers,engines", [(1, 1), (2, 2)])
def test_kiln_serve_shows_the_cache_on_metrics(built, tmp_path, kiln_process, workers, engines):
    # With two engine processes behind two front ends: still one reading, the first engine's.
    p = kiln_process(["serve", "--model-name", NAME, "--cache-dir", str(built.cache),
                      "--engine", f"cpu={built.rel}", "--cache-claim", "kiln-engine-cache",
                      "--host", "127.0.0.1", "--port", "0", "--no-grpc", "--workers", str(workers),
                      "--engine-processes", str(engines)], tmp_path)
    listening = r"front-end worker\(s\) on" if workers > 1 else r"listening on"
    port = int(p.wait_for(listening + r" 127\.0\.0\.1:(\d+)").group(1))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    if engines > 1:
        p.wait_for(r"engine process 1 serving front ends")
    labels = {"claim": "kiln-engine-cache", "cache_namespace": "default"}
    assert wait_for_metric(url, "kiln_engine_cache_entries", labels, lambda n: n == 2) == 2
    expected = entry_bytes(built.cache / built.rel) + 4096 + 10
    assert read_metric(url, "kiln_engine_cache_entry_bytes", labels) == expected
    assert read_metric(url, "kiln_engine_cache_oldest_entry_timestamp_seconds", labels) == 1_600_000_000
    assert read_metric(url, "kiln_engine_cache_free_bytes", labels) > 0
    capacity = read_metric(url, "kiln_engine_cache_capacity_bytes", labels)
    assert capacity >= read_metric(url, "kiln_engine_cache_used_bytes", labels) > 0
    assert capacity == os.statvfs(built.cache).f_blocks * os.statvfs(built.cache).f_frsize


def test_kiln_dev_shows_the_cache_on_metrics(tmp_path, kiln_process, matmul_onnx):
    (tmp_path / "mm.onnx").write_bytes(matmul_onnx)
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
           "metadata": {"name": "mm", "namespace": "dev"},
           "spec": {"model": {"uri": "file://./mm.onnx", "version": "1"},
                    "engine": {"backend": "onnxruntime", "precision": "fp32", "targets": ["cpu"]}}}
    (tmp_path / "mm.yaml").write_text(yaml.safe_dump(doc))
    cache = tmp_path / "cache"
    dev = kiln_process(["dev", str(tmp_path / "mm.yaml"), "--port", "0", "--cache-dir", str(cache)], tmp_path)
    url = dev.wait_for(r"^serving mm \(version 1\) at (http://127\.0\.0\.1:\d+)$", timeout=60).group(1)
    labels = {"claim": "", "cache_namespace": "dev"}
    assert wait_for_metric(url, "kiln_engine_cache_entries", labels, lambda n: n == 1) == 1
    (key_dir,) = (cache / "dev" / "mm").iterdir()
    assert read_metric(url, "kiln_engine_cache_entry_bytes", labels) == entry_bytes(key_dir)
    assert read_metric(url, "kiln_engine_cache_free_bytes", labels) > 0
    assert json.loads((key_dir / "manifest.json").read_text())["target"] == "cpu"
