"""Real Prometheus and Alertmanager for Kiln's tests and benchmarks, on 127.0.0.1.

`Prometheus` and `Alertmanager` run the Debian binaries as child processes with their
configs checked by promtool/amtool first; `configs` builds the scrape configs a PodMonitor
or ServiceMonitor would produce and the Alertmanager route users paste; `PodDiscovery` finds
pods through a real API server for a Prometheus without Kubernetes discovery (Debian's);
`WebhookRecorder` records what Alertmanager posts. Imported as `support.monitoring` (see
tests/support/__init__.py); its own tests are in tests/monitoring/.
"""

from .alertmanager import Alertmanager
from .configs import (DOCUMENTED_TIMINGS, KILN_GROUP_BY, KILN_MATCHER, alertmanager_config, kiln_alertmanager_config, kiln_receiver,
                      kiln_route, operator_scrape_config, pod_http_sd_scrape_config, pod_relabel_configs,
                      pod_scrape_config, static_scrape_config)
from .discovery import PodDiscovery
from .process import ConfigError, HTTPError, StartError, missing_binaries, wait_until
from .prometheus import Prometheus, QueryError
from .webhook import Delivery, WebhookRecorder

BINARIES = ("prometheus", "promtool", "prometheus-alertmanager", "amtool")


def unavailable() -> str | None:
    """Why the real servers cannot run here (a reason to skip with), or None."""
    missing = missing_binaries(*BINARIES)
    if missing:
        return (f"{', '.join(missing)} not on PATH: install Debian's prometheus and "
                f"prometheus-alertmanager packages")
    return None


def analysis_until(prom: Prometheus, checks: list, want: str, timeout: float = 30.0):
    """The operator's canary analysis (kiln.operator.analysis.evaluate) of `checks` against
    `prom`, again every half second until its result is `want` or `timeout` passes; the last."""
    import asyncio
    import time

    from kiln.operator import analysis

    deadline = time.monotonic() + timeout
    while True:
        outcome = asyncio.run(analysis.evaluate(prom.url, checks))
        if outcome.result == want or time.monotonic() > deadline:
            return outcome
        time.sleep(0.5)


__all__ = [
    "Alertmanager", "BINARIES", "analysis_until", "ConfigError", "DOCUMENTED_TIMINGS", "Delivery", "HTTPError", "KILN_GROUP_BY", "KILN_MATCHER",
    "PodDiscovery", "Prometheus", "QueryError", "StartError", "WebhookRecorder", "alertmanager_config",
    "kiln_alertmanager_config", "kiln_receiver", "kiln_route", "missing_binaries", "operator_scrape_config",
    "pod_http_sd_scrape_config", "pod_relabel_configs", "pod_scrape_config", "static_scrape_config",
    "unavailable", "wait_until",
]
