"""A real Alertmanager (Debian's `prometheus-alertmanager`, 0.25 on CI) for tests and benchmarks.

One instance, no clustering (`--cluster.listen-address=` empty: no gossip port, no wait for
peers to settle), its notification log and silences under the work directory. The config
is checked with `amtool check-config` before every start and reload. Several instances side
by side are independent replicas: each notifies on its own, as unclustered HA pairs do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .process import ServerProcess


class Alertmanager(ServerProcess):
    name = "alertmanager"
    config_name = "alertmanager.yml"
    checker = ["amtool", "check-config"]

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        """`config`: the whole alertmanager.yml as a dict (see `configs.alertmanager_config`);
        change `self.config` and `reload()` to apply another."""
        super().__init__(workdir)
        self.config = config

    def render_config(self) -> dict[str, Any]:
        return self.config

    def args(self) -> list[str]:
        return ["prometheus-alertmanager", f"--config.file={self.config_path}", f"--storage.path={self.data_dir}",
                f"--web.listen-address={self.address}", f"--web.external-url={self.url}",
                "--cluster.listen-address=", "--log.level=info"]

    def reload(self) -> None:
        """Write and check the config, then POST /-/reload (answers once it is in force)."""
        self.write_config()
        self.request("POST", "/-/reload", timeout=30)

    # ---------------------------------------------------------------- API v2

    def alerts(self, **filters: Any) -> list[dict[str, Any]]:
        """GET /api/v2/alerts: each with `labels`, `annotations`, `startsAt`, `endsAt`,
        `fingerprint`, `status` ({state: active|suppressed|unprocessed, ...}), `receivers`.
        `filters`: the endpoint's query parameters (active, silenced, inhibited, filter, receiver)."""
        params = {k: str(v).lower() if isinstance(v, bool) else v for k, v in filters.items()}
        return self.get_json("/api/v2/alerts", params or None)

    def groups(self) -> list[dict[str, Any]]:
        """GET /api/v2/alerts/groups: the aggregation groups, each with its receiver and alerts."""
        return self.get_json("/api/v2/alerts/groups")

    def post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        """POST /api/v2/alerts, as Prometheus does: each `{labels, annotations, startsAt,
        endsAt, generatorURL}`; an `endsAt` in the past resolves."""
        self.request("POST", "/api/v2/alerts", body=alerts)

    def status(self) -> dict[str, Any]:
        """GET /api/v2/status: `cluster`, `config.original` (the loaded YAML), `versionInfo`, `uptime`."""
        return self.get_json("/api/v2/status")
