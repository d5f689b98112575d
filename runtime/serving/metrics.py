"""Every Prometheus metric the runtime exports, in one place.

Each server owns a `ServerMetrics` bound to its own registry, so several servers can run
in one process (tests, benchmarks) without colliding. Names and labels follow Prometheus
conventions: base units (seconds, bytes, ratios), `_total` on counters, `model` on all but
the engine cache's gauges (one volume, whatever the model: `claim` and `cache_namespace`).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.runtime.engine.cache.usage import CacheUsage

if TYPE_CHECKING:
    from kiln.runtime.serving.cpu import PodCpu

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DIFFERENCE_BUCKETS = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kiln_requests", "Inference requests by outcome "
            "(success, bad_request, refused: the engine refused the inputs, overloaded, unavailable, "
            "error, cancelled).",
            ["model", "outcome"], registry=r)
        self.request_seconds = Histogram(
            "kiln_request_duration_seconds", "Inference request latency, receipt to response.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram(
            "kiln_queue_duration_seconds", "Time a request waited in the batching queue.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram(
            "kiln_execution_duration_seconds", "Time one batch spent in the engine.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "kiln_batch_size", "Rows per executed batch.", ["model"],
            buckets=BATCH_BUCKETS, registry=r)
        self.engine_busy_seconds = Counter(
            "kiln_engine_busy_seconds", "Seconds the execution contexts spent executing, divided "
            "by their number: the rate is the fraction of engine capacity in use (0..1) on every "
            "backend, the autoscaler's signal where no GPU metric exists.",
            ["model", "version"], registry=r)
        self.engine_busy_ratio = Gauge(
            "kiln_engine_busy_ratio", f"Fraction of engine capacity in use over the last "
            f"{BUSY_WINDOW_SECONDS:.0f} s (kiln_engine_busy_seconds over that window, read at scrape "
            "time): one read says how busy the pod is now (the operator's pod-deletion-cost).",
            ["model", "version"], registry=r)
        self.executions = Counter(
            "kiln_executions", "Batch executions by outcome (success, retried, failed, refused).",
            ["model", "outcome"], registry=r)
        self.context_recreations = Counter(
            "kiln_context_recreations", "Execution contexts recreated after a failure.",
            ["model"], registry=r)
        self.context_recovery_seconds = Histogram(
            "kiln_context_recovery_seconds", "From a failed execution to its successful retry "
            "on a recreated context (no engine reload).", ["model"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.inflight = Gauge(
            "kiln_inflight_requests", "Requests accepted and not yet answered.",
            ["model"], registry=r)
        self.queue_depth = Gauge(
            "kiln_queue_depth", "Requests waiting in the batching queue.", ["model"], registry=r)
        self.result_cache = Counter(
            "kiln_result_cache_requests", "Result cache lookups by result (hit, miss).",
            ["model", "result"], registry=r)
        self.result_cache_evictions = Counter(
            "kiln_result_cache_evictions", "Result cache entries evicted (size or TTL).",
            ["model"], registry=r)
        self.result_cache_bytes = Gauge(
            "kiln_result_cache_bytes", "Bytes held by the result cache.", ["model"], registry=r)
        self.result_cache_coalesced = Counter(
            "kiln_result_cache_coalesced", "Result cache misses answered by an identical "
            "request's computation already running in this pod.", ["model"], registry=r)
        self.result_cache_shared = Counter(
            "kiln_result_cache_shared_requests", "Shared result store lookups after a miss in "
            "the pod's memory, by result (hit, miss, corrupt: a value that failed its checks, "
            "unavailable: the store down, slow or skipped, waited: another replica's answer "
            "waited for).", ["model", "result"], registry=r)
        self.result_cache_shared_writes = Counter(
            "kiln_result_cache_shared_writes", "Results offered to the shared store, by result "
            "(stored, too_large: over maxEntryKiB or not shareable, failed).",
            ["model", "result"], registry=r)
        self.result_cache_shared_written_bytes = Counter(
            "kiln_result_cache_shared_written_bytes", "Bytes written to the shared result store.",
            ["model"], registry=r)
        self.result_cache_shared_evictions = Counter(
            "kiln_result_cache_shared_evictions", "Older entries evicted from the shared store "
            "by this pod's writes to keep the model under its maxMiB.", ["model"], registry=r)
        self.result_cache_shared_available = Gauge(
            "kiln_result_cache_shared_available", "1 while the shared result store answers, 0 "
            "while it is skipped after a failure.", ["model"], registry=r)
        self.sequences_live = Gauge(
            "kiln_sequences_live", "Stateful sequences whose state this replica holds in "
            "memory (spec.runtime.sequences).", ["model"], registry=r)
        self.sequence_state_bytes = Gauge(
            "kiln_sequence_state_bytes", "Bytes of sequence state this replica holds in memory.",
            ["model"], registry=r)
        self.engine_load_seconds = Gauge(
            "kiln_engine_load_seconds", "Engine load time by stage "
            "(read, verify, deserialize, warmup, samples).", ["model", "stage"], registry=r)
        self.model_ready = Gauge(
            "kiln_model_ready", "1 when the model answers inference, else 0.", ["model"],
            registry=r)
        self.model_info = Gauge(
            "kiln_model_info", "Constant 1, labelled with what the pod serves.",
            ["model", "version", "engine_key", "backend", "target"], registry=r)
        # Shadow copies to a canary (runtime/serving/shadow.py), labelled with its engine key.
        self.shadow_copies = Counter(
            "kiln_shadow_copies", "Inferences copied to the canary, by outcome (compared, error: the "
            "canary's answer was not 200 or unreadable, unavailable: none in time, dropped: queue full).",
            ["model", "canary", "outcome"], registry=r)
        self.shadow_comparisons = Counter(
            "kiln_shadow_comparisons", "Outputs of copied inferences compared with the canary's, by "
            "result (agree, differ).", ["model", "canary", "output", "result"], registry=r)
        self.shadow_abs_difference = Histogram(
            "kiln_shadow_abs_difference", "Largest absolute difference between the canary's output and "
            "this pod's, per comparison.", ["model", "canary", "output"], buckets=DIFFERENCE_BUCKETS,
            registry=r)
        self.shadow_rel_difference = Histogram(
            "kiln_shadow_rel_difference", "Largest relative difference between the canary's output and "
            "this pod's, per comparison.", ["model", "canary", "output"], buckets=DIFFERENCE_BUCKETS,
            registry=r)
        self.shadow_canary_seconds = Histogram(
            "kiln_shadow_canary_duration_seconds", "A copy's round trip to the canary, from this pod.",
            ["model", "canary"], buckets=LATENCY_BUCKETS, registry=r)
        # GPU utilization and memory come from NVML at scrape time (runtime/engine/gpu.py registers
        # its collector on this registry when a GPU is present; absent otherwise).
        self.engine_cache = EngineCacheCollector()
        r.register(self.engine_cache)
        self.pod_cpu = PodCpuCollector()
        r.register(self.pod_cpu)

    def busy_window(self, model: str, version: str) -> "BusyWindow":
        """The window behind `kiln_engine_busy_ratio{model, version}`: what `add` records
        there is read at every scrape."""
        window = BusyWindow()
        self.engine_busy_ratio.labels(model, version).set_function(window.ratio)
        return window


BUSY_WINDOW_SECONDS = 30.0


class BusyWindow:
    """Busy seconds (already divided by the context count) in one-second buckets over the
    last `seconds`: the counter's rate without a second sample. An execution counts in the
    second it ended. Executions end on the event loop's threads, scrapes read from another:
    a lock."""

    def __init__(self, seconds: float = BUSY_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.seconds, self._clock = seconds, clock
        self._buckets: collections.deque[list[float]] = collections.deque()  # [second, busy seconds]
        self._lock = threading.Lock()

    def add(self, busy_seconds: float) -> None:
        second = float(int(self._clock()))
        with self._lock:
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += busy_seconds
            else:
                self._buckets.append([second, busy_seconds])
            self._forget(second)

    def ratio(self) -> float:
        """0..1: the busy seconds of the window over its length."""
        with self._lock:
            self._forget(float(int(self._clock())))
            busy = sum(b for _, b in self._buckets)
        return min(1.0, busy / self.seconds)

    def _forget(self, second: float) -> None:
        while self._buckets and self._buckets[0][0] <= second - self.seconds:
            self._buckets.popleft()


# The engine cache's gauges, labelled `claim` (the PVC) and `cache_namespace` (the cache's
# <namespace>/ directory), not `namespace`: Prometheus gives every runtime series the pod's
# `namespace` from discovery, and a `namespace` of the series' own would be renamed
# `exported_namespace` (or, with honor_labels, replace the pod's).
ENGINE_CACHE_LABELS = ("claim", "cache_namespace")
# name, help, and where the value is in a CacheUsage (its part, the part's field).
ENGINE_CACHE_GAUGES = (
    ("kiln_engine_cache_used_bytes", "Bytes used on the engine cache's volume (all of it: every "
     "namespace's entries and anything else on it).", "volume", "used_bytes"),
    ("kiln_engine_cache_free_bytes", "Bytes free on the engine cache's volume for a build to "
     "write (builds fail with ENOSPC at 0).", "volume", "free_bytes"),
    ("kiln_engine_cache_capacity_bytes", "Size of the engine cache's volume in bytes.",
     "volume", "capacity_bytes"),
    ("kiln_engine_cache_entries", "Complete engine entries in this namespace's part of the "
     "cache (a lower bound past the walk's limit).", "entries", "entries"),
    ("kiln_engine_cache_entry_bytes", "Bytes of those entries' files.", "entries", "entry_bytes"),
    ("kiln_engine_cache_oldest_entry_timestamp_seconds", "When the oldest of those entries was "
     "last used by a build (its directory's mtime, Unix time); absent without entries.",
     "entries", "oldest_mtime"),
)


class EngineCacheCollector:
    """The engine cache gauges, read at scrape time from `watch`'s source (a
    `CachedCacheUsage`): a server that watches no cache exports the names and no samples."""

    def __init__(self):
        self._source: Callable[[], CacheUsage] | None = None
        self._labels: list[str] = []

    def watch(self, source: Callable[[], CacheUsage], claim: str, cache_namespace: str) -> None:
        self._source = source
        self._labels = [claim, cache_namespace]
        source()  # the first walk of the entries starts now, not at the first scrape

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, doc, _, _ in ENGINE_CACHE_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=ENGINE_CACHE_LABELS)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        usage = self._source() if self._source is not None else CacheUsage(None, None)
        for family, (_, _, part, field) in zip(self.describe(), ENGINE_CACHE_GAUGES):
            value = getattr(getattr(usage, part), field, None)
            if value is not None:
                family.add_metric(self._labels, value)
            yield family


class PodCpuCollector:
    """The pod's CPU, read at scrape time from `watch`'s `cpu.PodCpu` (the first engine
    process's; the others watch none). Unlabelled: Prometheus gives each series the pod's
    namespace and pod, and the rules join them to the model through kiln_model_info. A value
    that cannot be read is left out, never exported as 0."""

    def __init__(self):
        self._pod: PodCpu | None = None

    def watch(self, pod: "PodCpu") -> None:
        self._pod = pod

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield CounterMetricFamily(
            "kiln_pod_cpu_seconds", "CPU seconds the pod's container used (its cgroup's "
            "cpu.stat usage_usec where readable, else its processes' from /proc): over "
            "kiln_pod_cpu_limit_cores, how much of its CPU limit the pod uses.", labels=())
        yield GaugeMetricFamily(
            "kiln_pod_cpu_limit_cores", "The CPUs the pod may use (its cgroup's cpu.max, or "
            "its CPU affinity where lower); absent when neither can be read.", labels=())
        yield CounterMetricFamily(
            "kiln_pod_front_end_busy_seconds", "CPU seconds of the event loops that serve HTTP "
            "(each front end's; the one process's where there are none), divided by their "
            "number: the rate is their mean busy fraction (0..1).", labels=())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        usage, limit, loops = self.describe()
        if self._pod is not None:
            values = (self._pod.usage_seconds(), self._pod.limit, self._pod.loop_seconds())
            for family, value in zip((usage, limit, loops), values):
                if value is not None:
                    family.add_metric([], value)
        yield from (usage, limit, loops)
