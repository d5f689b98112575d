"""The refused-ratio check's PromQL (operator/analysis.py) against a real Prometheus scraping
the runtime's own request counters (runtime/serving/metrics.py) from a stable and a canary
pod: no requests is no data; inputs both tracks refuse cancel out; a canary refusing what the
stable side answers fails (the version of issue 34 that was promoted)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import start_http_server

from kiln.operator import analysis as an
from kiln.runtime.serving.metrics import ServerMetrics

from support import monitoring
from support.monitoring import Prometheus, analysis_until, static_scrape_config
from support.monitoring.process import free_port

pytestmark = [pytest.mark.timeout(120)]

NS, MODEL = "shop", "iris"
SPEC = {"maxErrorRatio": None, "maxLatencyRatio": None, "maxRefusedRatioIncrease": 0.05}


@pytest.fixture(autouse=True)
def _binaries():
    reason = monitoring.unavailable()
    if reason:
        pytest.skip(reason)


class Pod:
    """A runtime pod's registry, served over HTTP, serving `key`."""

    def __init__(self, key: str):
        self.metrics = ServerMetrics()
        self.metrics.model_info.labels(MODEL, "1", key, "onnxruntime", "cpu").set(1)
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=self.metrics.registry)

    def answer(self, success: int = 0, refused: int = 0, bad_request: int = 0) -> None:
        for outcome, n in (("success", success), ("refused", refused), ("bad_request", bad_request)):
            self.metrics.requests.labels(MODEL, outcome).inc(n)


def verdict(prom: Prometheus, want: str) -> an.Outcome:
    return analysis_until(prom, an.builtin_checks(SPEC, NS, MODEL, "canary", "stable"), want, timeout=40.0)


def traffic(pods: tuple[Pod, Pod], seconds: int, stable: dict[str, int], canary: dict[str, int]) -> None:
    """Both pods answer for `seconds`, each second as `stable` and `canary` say."""
    for _ in range(seconds):
        pods[0].answer(**stable)
        pods[1].answer(**canary)
        time.sleep(1)


def test_the_refused_ratio_check_compares_the_canary_with_the_stable_side(tmp_path):
    stable, canary = Pod("stable"), Pod("canary")
    prom = Prometheus(tmp_path / "prom", scrape_configs=[static_scrape_config({
        f"127.0.0.1:{stable.port}": {"namespace": NS, "pod": "iris-runtime-0"},
        f"127.0.0.1:{canary.port}": {"namespace": NS, "pod": "iris-runtime-canary-0"}})])
    try:
        prom.start()
        stable.answer(success=0)
        canary.answer(success=0)
        prom.wait_for(f'kiln_requests_total{{namespace="{NS}", pod="iris-runtime-canary-0"}}')
        assert verdict(prom, an.INCONCLUSIVE).result == an.INCONCLUSIVE  # no requests: no data

        # A client sending 20% garbage (400s) to both tracks: the same share on each, passed.
        both = {"success": 8, "bad_request": 1, "refused": 1}
        traffic((stable, canary), 4, stable=both, canary=both)
        outcome = verdict(prom, an.PASSED)
        assert outcome.result == an.PASSED, outcome
        assert outcome.checks[0]["value"] == pytest.approx(0.0, abs=0.02)

        # The canary's engine refuses what the stable one answers: failed.
        traffic((stable, canary), 6, stable={"success": 10}, canary={"refused": 10})
        outcome = verdict(prom, an.FAILED)
        assert outcome.result == an.FAILED and outcome.checks[0]["value"] > 0.3, outcome
        assert outcome.checks[0]["name"] == "refused-ratio-increase"
    finally:
        prom.stop()
        stable.server.shutdown()
        canary.server.shutdown()
