"""A real Prometheus (the `prometheus` binary, Debian's 2.42 on CI) for tests and benchmarks.

Short intervals by default: scrape and rule evaluation every second, and a resend delay of
1 s, so a firing alert goes to Alertmanager every 2 s (a resend needs strictly more than the
delay since the last send), each time with `endsAt` 4 s ahead (4 x the larger of evaluation
interval and resend delay): Alertmanager resolves an alert that stops coming within ~4 s,
whether its rule was removed or Prometheus stopped. Its own TSDB under the work directory;
the lifecycle API on, so `reload()` applies a changed config or rule file without a restart.
The config is checked with `promtool check config` (which also checks the rule files it
names) before every start and reload.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any, Callable

from .process import HTTPError, ServerProcess, wait_until

RESEND_DELAY = "1s"  # --rules.alert.resend-delay; the default, 1m, would make endsAt 4 min ahead


class QueryError(RuntimeError):
    """The HTTP API answered `status: error` (a bad expression, a timeout)."""


class Prometheus(ServerProcess):
    name = "prometheus"
    config_name = "prometheus.yml"
    checker = ["promtool", "check", "config"]

    def __init__(self, workdir: Path, *, scrape_configs: list[dict[str, Any]] = (),
                 rule_files: list[Path] = (), alertmanagers: list[str] = (), scrape_interval: str = "1s",
                 evaluation_interval: str = "1s", external_labels: dict[str, str] | None = None,
                 resend_delay: str = RESEND_DELAY) -> None:
        """`alertmanagers`: base URLs (`http://127.0.0.1:9093`). The attributes can be changed
        and applied with `reload()`."""
        super().__init__(workdir)
        self.scrape_configs = list(scrape_configs)
        self.rule_files = [Path(p) for p in rule_files]
        self.alertmanagers = list(alertmanagers)
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.external_labels = dict(external_labels or {})
        self.resend_delay = resend_delay

    def render_config(self) -> dict[str, Any]:
        glob: dict[str, Any] = {"scrape_interval": self.scrape_interval,
                                "evaluation_interval": self.evaluation_interval}
        if self.external_labels:
            glob["external_labels"] = self.external_labels
        doc: dict[str, Any] = {"global": glob}
        if self.rule_files:
            doc["rule_files"] = [str(p.resolve()) for p in self.rule_files]
        if self.alertmanagers:
            doc["alerting"] = {"alertmanagers": [_alertmanager(url) for url in self.alertmanagers]}
        doc["scrape_configs"] = self.scrape_configs
        return doc

    def args(self) -> list[str]:
        return ["prometheus", f"--config.file={self.config_path}", f"--storage.tsdb.path={self.data_dir}",
                f"--web.listen-address={self.address}", f"--web.external-url={self.url}",
                "--web.enable-lifecycle", f"--rules.alert.resend-delay={self.resend_delay}",
                "--log.level=info"]

    def reload(self) -> None:
        """Write and check the config from the attributes, then POST /-/reload, which answers
        once the new config and rule files are in force (HTTPError with Prometheus's reason
        when it refuses them). Every reload, even of an unchanged config, drops the
        Alertmanagers until discovery finds them again (about 5 s in 2.42): alerts evaluated
        in between are dropped, then resent. `wait_for_alertmanagers()` waits that out."""
        self.write_config()
        self.request("POST", "/-/reload", timeout=30)

    def wait_for_alertmanagers(self, timeout: float = 30) -> list[str]:
        """Until every configured Alertmanager is in use: after a start or a reload, 2.42's
        discovery hands them to the notifier only on its 5-second tick, and alerts sent
        before that are dropped (prometheus_notifications_dropped_total)."""
        def check() -> list[str] | None:
            urls = self.active_alertmanagers()
            return urls if len(urls) >= len(self.alertmanagers) else None

        return wait_until(check, timeout, f"Prometheus to use {self.alertmanagers}",
                          describe=lambda: f"in use: {self.active_alertmanagers()}")

    # ---------------------------------------------------------------- the HTTP API

    def api(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """GET /api/v1/<path> -> its `data`; QueryError when the API reports an error."""
        try:
            doc = self.get_json(f"/api/v1/{path}", params)
        except HTTPError as e:  # 400/422/503 carry the same JSON error document
            raise QueryError(f"{path} {params or ''}: {e.body.strip()}") from None
        if doc.get("status") != "success":
            raise QueryError(f"{path} {params or ''}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: `[{"metric": {...}, "value": [ts, "1"]}, ...]`. A scalar or string
        result comes back as one element with empty `metric`."""
        data = self.api("query", {"query": expr})
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The single sample `expr` returns as a float; None when it returns nothing."""
        result = self.query(expr)
        if len(result) > 1:
            raise QueryError(f"{expr}: {len(result)} series, expected at most one: {result}")
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, predicate: Callable[[list[dict[str, Any]]], bool] = bool,
                 timeout: float = 30) -> list[dict[str, Any]]:
        """Query `expr` until `predicate(result)` holds (default: any series); the result."""
        last: list[Any] = [None]

        def check() -> bool:
            last[0] = self.query(expr)
            return predicate(last[0])

        wait_until(check, timeout, f"{expr!r} as expected", describe=lambda: f"last result: {last[0]}")
        return last[0]

    def targets(self) -> list[dict[str, Any]]:
        """Active targets: each with `labels`, `discoveredLabels`, `scrapeUrl`, `health`
        (up, down, unknown), `lastError`, `lastScrape`."""
        return self.api("targets", {"state": "active"})["activeTargets"]

    def wait_for_targets(self, job: str, count: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
        """Until `job` has `count` targets, every one of them up (scraped successfully). The
        first scrape comes some 5 s after the start: discovery reports on a 5-second tick."""
        def check() -> list[dict[str, Any]] | None:
            found = [t for t in self.targets() if t["labels"].get("job") == job]
            return found if len(found) == count and all(t["health"] == "up" for t in found) else None

        return wait_until(check, timeout, f"{count} target(s) of job {job} up",
                          describe=lambda: "\n".join(f"{t['scrapeUrl']} {t['health']} {t['lastError']}"
                                                     for t in self.targets()))

    def active_alertmanagers(self) -> list[str]:
        """The Alertmanager endpoints alerts are sent to now (`.../api/v2/alerts`)."""
        return [a["url"] for a in self.api("alertmanagers")["activeAlertmanagers"]]

    def alerts(self) -> list[dict[str, Any]]:
        """Alerts pending or firing now: `labels`, `annotations`, `state`, `activeAt`, `value`."""
        return self.api("alerts")["alerts"]

    def rules(self) -> list[dict[str, Any]]:
        """Rule groups as loaded (after a reload: the new ones), with each rule's health."""
        return self.api("rules")["groups"]


def _alertmanager(url: str) -> dict[str, Any]:
    """A base URL -> one `alerting.alertmanagers` entry (static, API v2)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"an Alertmanager URL like http://127.0.0.1:9093, got {url!r}")
    entry: dict[str, Any] = {"scheme": parts.scheme, "api_version": "v2",
                             "static_configs": [{"targets": [parts.netloc]}]}
    if parts.path.strip("/"):
        entry["path_prefix"] = parts.path
    return entry
