"""The agreement check's PromQL (operator/analysis.py) against a real Prometheus scraping the
runtime's own shadow counters (runtime/serving/metrics.py), as a stable pod exports them:
too few comparisons is no data, an output that never agreed is 0 (its "agree" series does
not exist), and a failure says which output differs by how much."""

from __future__ import annotations


import pytest
from prometheus_client import start_http_server

from kiln.operator import analysis as an
from kiln.runtime.serving.metrics import ServerMetrics

from support import monitoring
from support.monitoring import Prometheus, analysis_until, static_scrape_config
from support.monitoring.process import free_port

pytestmark = [pytest.mark.timeout(90)]

NS, MODEL = "shop", "iris"
AGREEMENT = {"minRatio": 0.99, "minSamples": 10}


@pytest.fixture(autouse=True)
def _binaries():
    reason = monitoring.unavailable()
    if reason:
        pytest.skip(reason)


def compare(metrics: ServerMetrics, canary: str, n: int, differ: dict[str, float]) -> None:
    """`n` copies compared: each output agrees, except those in `differ` (by that much)."""
    for _ in range(n):
        metrics.shadow_copies.labels(model=MODEL, canary=canary, outcome="compared").inc()
        for output in ("probabilities", "species"):
            result = "differ" if output in differ else "agree"
            metrics.shadow_comparisons.labels(model=MODEL, canary=canary, output=output, result=result).inc()
            metrics.shadow_abs_difference.labels(model=MODEL, canary=canary, output=output).observe(
                differ.get(output, 0.0))


def verdict(prom: Prometheus, canary: str, want: str) -> an.Outcome:
    return analysis_until(prom, [an.agreement_check({"agreement": AGREEMENT}, NS, MODEL, canary)], want)


def test_the_agreement_check_on_real_counters(tmp_path):
    metrics = ServerMetrics()
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    prom = Prometheus(tmp_path / "prom", scrape_configs=[static_scrape_config(
        {f"127.0.0.1:{port}": {"namespace": NS, "pod": "iris-runtime-0"}})])
    try:
        prom.start()
        compare(metrics, "good", 1, {})
        prom.wait_for(f'kiln_shadow_copies_total{{namespace="{NS}", canary="good"}}')
        compare(metrics, "good", 4, {})
        assert verdict(prom, "good", an.INCONCLUSIVE).result == an.INCONCLUSIVE  # 4 in the window: too few

        compare(metrics, "good", 30, {})
        outcome = verdict(prom, "good", an.PASSED)
        assert outcome.result == an.PASSED and outcome.checks[0]["value"] == pytest.approx(1.0)

        # species never agrees: no "agree" series for it, and the check still sees 0.
        compare(metrics, "wrong", 1, {"species": 1.0})
        prom.wait_for(f'kiln_shadow_copies_total{{namespace="{NS}", canary="wrong"}}')
        compare(metrics, "wrong", 30, {"species": 1.0})
        outcome = verdict(prom, "wrong", an.FAILED)
        [row] = outcome.checks
        assert outcome.result == an.FAILED and row["value"] == 0.0, outcome
        assert row["detail"].startswith("output species: max absolute difference <= 1"), row
    finally:
        prom.stop()
        server.shutdown()
