"""Pure builders for the configs the tests give the real servers: plain dicts, no I/O.

The scrape configs mimic what the chart's PodMonitor (runtime pods) and ServiceMonitor (the
operator) make prometheus-operator generate, so a rule that works here works in a cluster:
runtime series get `namespace` and `pod` from the target, the operator's series keep their
own `namespace` (honor_labels). The Alertmanager config is docs/operations.md's
alertmanager.yml (a test compares them), with test-short timings unless told otherwise.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

KILN_MATCHER = 'kiln_autoscaling="true"'
KILN_GROUP_BY = ["namespace", "model", "alertname"]

# Pod annotations the runtime Deployment carries (operator/manifests.py), as service
# discovery spells them in meta labels.
_ANNOTATION = "__meta_kubernetes_pod_annotation_prometheus_io_"


# ---------------------------------------------------------------------- Alertmanager

def kiln_receiver(url: str, token_file: str | os.PathLike, *, name: str = "kiln",
                  max_alerts: int = 100) -> dict[str, Any]:
    """The webhook receiver for Kiln's alert endpoint: resolved alerts too, the bearer token
    read from `token_file` (on every request, so a rotated Secret takes effect). A relative
    path is made absolute here: Alertmanager would read it relative to its config file."""
    return {"name": name, "webhook_configs": [{
        "url": url, "send_resolved": True, "max_alerts": max_alerts,
        "http_config": {"authorization": {"type": "Bearer", "credentials_file": os.path.abspath(token_file)}},
    }]}


# The route's timings docs/operations.md ships (a test holds the two together).
DOCUMENTED_TIMINGS = {"group_wait": "1s", "group_interval": "5s", "repeat_interval": "2m"}


def kiln_route(*, receiver: str = "kiln", group_wait: str = "1s", group_interval: str = "1s",
               repeat_interval: str = "1h") -> dict[str, Any]:
    """The route for Kiln's alerts (label kiln_autoscaling="true"), one group per model and
    alert. The contract ships DOCUMENTED_TIMINGS; the defaults here are test-short, and
    `repeat_interval` is long so only changes notify unless a test asks for repeats."""
    return {"receiver": receiver, "matchers": [KILN_MATCHER], "group_by": list(KILN_GROUP_BY),
            "group_wait": group_wait, "group_interval": group_interval, "repeat_interval": repeat_interval}


def alertmanager_config(routes: list[dict[str, Any]], receivers: list[dict[str, Any]], *,
                        default_receiver: str = "default") -> dict[str, Any]:
    """A whole alertmanager.yml: `routes` under a root route whose own receiver (no
    integrations) takes everything else."""
    return {"route": {"receiver": default_receiver, "routes": routes},
            "receivers": [{"name": default_receiver}, *receivers]}


def kiln_alertmanager_config(url: str, token_file: str | os.PathLike, **timings: str) -> dict[str, Any]:
    """An Alertmanager that sends Kiln's alerts, and nothing else, to `url`. `timings`:
    group_wait, group_interval, repeat_interval (see `kiln_route`)."""
    return alertmanager_config([kiln_route(**timings)], [kiln_receiver(url, token_file)])


# ---------------------------------------------------------------------- Prometheus scrape configs

def pod_relabel_configs() -> list[dict[str, Any]]:
    """What a PodMonitor does with discovered pods, where pod IPs are reachable: keep pods
    annotated prometheus.io/scrape=true, scrape <podIP>:<prometheus.io/port> at
    <prometheus.io/path>, and give each target `namespace` and `pod`."""
    return [
        {"source_labels": [f"{_ANNOTATION}scrape"], "regex": "true", "action": "keep"},
        # What a PodMonitor drops too: pods that have finished keep their IP for a while.
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Failed|Succeeded", "action": "drop"},
        {"source_labels": ["__meta_kubernetes_pod_ip", f"{_ANNOTATION}port"], "regex": "(.+);([0-9]+)",
         "replacement": "$1:$2", "target_label": "__address__"},
        {"source_labels": [f"{_ANNOTATION}path"], "regex": "(.+)", "target_label": "__metrics_path__"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]


def pod_scrape_config(api_server: str, namespaces: list[str], *, job: str = "kiln-runtime",
                      ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                      bearer_token_file: str | None = None) -> dict[str, Any]:
    """Runtime pods found through a real API server with kubernetes_sd_configs (role pod),
    relabelled as `pod_relabel_configs`. Authenticate with a client certificate
    (cert_file/key_file) or a token (bearer_token_file); `ca_file` verifies the server.
    Needs an upstream Prometheus: Debian's has no Kubernetes discovery (see `discovery`,
    and `pod_http_sd_scrape_config` for the same targets through it)."""
    sd: dict[str, Any] = {"role": "pod", "api_server": api_server, "namespaces": {"names": list(namespaces)}}
    tls = {k: os.path.abspath(v) for k, v in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file))
           if v}
    if tls:
        sd["tls_config"] = tls
    if bearer_token_file:
        sd["authorization"] = {"type": "Bearer", "credentials_file": os.path.abspath(bearer_token_file)}
    return {"job_name": job, "kubernetes_sd_configs": [sd], "relabel_configs": pod_relabel_configs()}


def pod_http_sd_scrape_config(url: str, *, job: str = "kiln-runtime", refresh_interval: str = "1s"
                              ) -> dict[str, Any]:
    """The same pods and relabeling as `pod_scrape_config`, the targets from a
    `discovery.PodDiscovery` endpoint (`url`) instead of Prometheus's own Kubernetes client."""
    return {"job_name": job, "http_sd_configs": [{"url": url, "refresh_interval": refresh_interval}],
            "relabel_configs": pod_relabel_configs()}


def static_scrape_config(targets: Mapping[str, Mapping[str, str]], *, job: str = "kiln-runtime",
                         metrics_path: str = "/metrics", honor_labels: bool = False) -> dict[str, Any]:
    """Fixed targets, no cluster: `{"127.0.0.1:8080": {"namespace": "ns", "pod": "p-0"}}`,
    each with the target labels service discovery would have given it."""
    config: dict[str, Any] = {"job_name": job, "metrics_path": metrics_path, "static_configs": [
        {"targets": [address], "labels": dict(labels)} for address, labels in targets.items()]}
    if honor_labels:
        config["honor_labels"] = True
    return config


def operator_scrape_config(address: str, *, job: str = "kiln-operator", metrics_path: str = "/metrics",
                           labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The operator's receiver port, `honor_labels: true` as the chart's ServiceMonitor sets it:
    its series carry the model's `namespace`, which must win over the target's own (`labels`,
    e.g. {"namespace": "kiln-system"} as a ServiceMonitor would add)."""
    return static_scrape_config({address: labels or {}}, job=job, metrics_path=metrics_path, honor_labels=True)
