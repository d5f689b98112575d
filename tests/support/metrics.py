"""What a user reads off a server's /metrics, and waiting on it instead of sleeping.

A test that needs a request in the batching queue, or in flight, before its next step waits
until `kiln_queue_depth` or `kiln_inflight_requests` says so, as an operator watching the
server would see it: no guess of how long getting there takes on a loaded machine.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

# A source of samples: a server's base URL (its /metrics is read over HTTP) or, in process,
# the registry it exports.
Source = str | CollectorRegistry


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The value of the first sample `name` in the exposition `text` whose labels include
    `labels`; None when there is none."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


def read_metric(source: Source, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """One reading of `name` from `source` (see Source); None when it has no such sample."""
    if isinstance(source, CollectorRegistry):
        return source.get_sample_value(name, dict(labels or {}))
    url = source if source.endswith("/metrics") else source.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return metric_value(resp.read().decode(), name, labels)


def wait_for_metric(source: Source, name: str, labels: Mapping[str, str] | None,
                    predicate: Callable[[float], bool], timeout: float = 10.0,
                    interval: float = 0.02) -> float:
    """Poll `name{labels}` on `source` until `predicate(value)` holds and return that value;
    an AssertionError naming the last reading after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = read_metric(source, name, labels)
        if value is not None and predicate(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{name}{dict(labels or {})} did not reach the expected value "
                                 f"within {timeout} s: last read {value!r}")
        time.sleep(interval)
