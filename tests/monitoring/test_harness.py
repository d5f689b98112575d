"""The monitoring harness against the real servers: Prometheus scraping a real `kiln serve`,
an alert travelling rule -> Prometheus -> Alertmanager -> webhook and resolving, and the
servers' own checkers rejecting bad configs.

Skipped only where the binaries are missing (Debian's prometheus and prometheus-alertmanager).
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kiln.runtime.engine.build import BuildRequest, build_engine
from kiln.runtime.commands.demo import http, wait_ready

from support import monitoring, snippets
from support.monitoring import (DOCUMENTED_TIMINGS, Alertmanager, ConfigError, Prometheus, WebhookRecorder, kiln_alertmanager_config,
                                operator_scrape_config, pod_http_sd_scrape_config, pod_scrape_config,
                                static_scrape_config)
from support.monitoring.process import check_config, die_with_parent, free_port

pytestmark = [pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]
KILN = Path(sys.executable).parent / "kiln"
DEMO_MODEL = REPO / "examples" / "demo" / "model.onnx"  # examples/demo/make_model.py writes it
TOKEN = "kiln-test-token"
NAMESPACE, MODEL, POD = "shop", "iris", "iris-6f7c9d-x2k4q"


@pytest.fixture(autouse=True)
def _binaries():
    reason = monitoring.unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def kiln_serve(tmp_path):
    """`kiln serve` (ONNX Runtime, CPU) on the demo's Iris model, as a runtime pod runs it:
    the engine built into a cache first, then served on a free port. Yields (url, build result)."""
    cache = tmp_path / "cache"
    built = build_engine(BuildRequest.from_dict({
        "namespace": NAMESPACE, "name": MODEL, "model": {"uri": DEMO_MODEL.as_uri(), "version": "1"},
        "engine": {"backend": "onnxruntime", "precision": "fp32"}, "target": "cpu"}), cache,
        allow_local_files=True)
    port = free_port()
    with open(tmp_path / "kiln-serve.log", "wb") as log:
        proc = subprocess.Popen([str(KILN), "serve", "--model-name", MODEL, "--model-version", "1",
                                 "--cache-dir", str(cache), "--engine", f"cpu={built.path}",
                                 "--host", "127.0.0.1", "--port", str(port), "--drain-seconds", "1"],
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, 30)
        except TimeoutError as e:
            raise AssertionError(f"{e}:\n{(tmp_path / 'kiln-serve.log').read_text()}") from None
        yield url, built
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def infer(url: str, rows: int) -> None:
    status, answer = http("POST", f"{url}/v2/models/{MODEL}/infer", {"inputs": [
        {"name": "features", "shape": [rows, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2] * rows}]})
    assert status == 200, answer


# ---------------------------------------------------------------------- scraping

def test_prometheus_scrapes_kiln_serve_with_the_target_labels(tmp_path, kiln_serve):
    url, built = kiln_serve
    for rows in (1, 2, 3):
        infer(url, rows)
    # The operator's metrics, where the series carry their own namespace (the target's
    # namespace, the operator's own, must not replace it).
    registry = CollectorRegistry()
    Gauge("kiln_autoscaling_target_ratio", "t", ["namespace", "model"], registry=registry) \
        .labels(NAMESPACE, MODEL).set(0.7)
    operator_port = free_port()
    operator, _thread = start_http_server(operator_port, "127.0.0.1", registry=registry)
    try:
        runtime_target = url.removeprefix("http://")
        with Prometheus(tmp_path / "prometheus", scrape_configs=[
                static_scrape_config({runtime_target: {"namespace": NAMESPACE, "pod": POD}}),
                operator_scrape_config(f"127.0.0.1:{operator_port}", labels={"namespace": "kiln-system"})]) as prom:
            started = time.monotonic()
            prom.wait_for_targets("kiln-runtime")
            print(f"\nfirst scrape of kiln serve {time.monotonic() - started:.1f} s after Prometheus was ready")

            info = prom.wait_for(f'kiln_model_info{{namespace="{NAMESPACE}", pod="{POD}"}}')
            assert [s["metric"] for s in info] == [{
                "__name__": "kiln_model_info", "job": "kiln-runtime", "instance": runtime_target,
                "namespace": NAMESPACE, "pod": POD, "model": MODEL, "version": "1",
                "engine_key": built.manifest.key, "backend": "onnxruntime", "target": "cpu"}]
            assert info[0]["value"][1] == "1"
            served = prom.value(f'sum by (namespace, pod, model) '
                                f'(kiln_requests_total{{namespace="{NAMESPACE}", pod="{POD}", outcome="success"}})')
            assert served == 3

            prom.wait_for_targets("kiln-operator")
            ratio = prom.wait_for("kiln_autoscaling_target_ratio")
            assert [(s["metric"]["namespace"], s["metric"]["model"], s["value"][1]) for s in ratio] == [
                (NAMESPACE, MODEL, "0.7")]
            # The target's own namespace still lands where the series has none.
            assert prom.query('up{job="kiln-operator"}')[0]["metric"]["namespace"] == "kiln-system"

            # An abrupt outage and a restart: the same URL, the samples kept (WAL replayed).
            prom.kill()
            assert not prom.running
            prom.start()
            assert prom.value(f'kiln_model_info{{pod="{POD}"}}') == 1
    finally:
        operator.shutdown()


# ---------------------------------------------------------------------- alerts

def rules_file(path: Path, *, firing: bool) -> Path:
    """One group; with `firing`, an alert that is true from the first evaluation on."""
    rules = [{"alert": "KilnTestAlwaysHigh", "expr": "vector(1) > 0",
              "labels": {"namespace": NAMESPACE, "model": MODEL, "kiln_autoscaling": "true"},
              "annotations": {"value": "{{ $value }}", "summary": "always true"}}] if firing else []
    path.write_text(yaml.safe_dump({"groups": [{"name": "kiln-test", "rules": rules}]}))
    return path


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_an_alert_reaches_the_webhook_through_alertmanager_then_resolves(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # as `echo` or a Secret edited by hand leaves it: trimmed
    rules = rules_file(tmp_path / "rules.yml", firing=True)
    with WebhookRecorder(token=TOKEN) as hook, \
            Alertmanager(tmp_path / "alertmanager", kiln_alertmanager_config(hook.url, str(token_file))) as am:
        prom = Prometheus(tmp_path / "prometheus", rule_files=[rules], alertmanagers=[am.url])
        started = time.monotonic()
        with prom:
            ready = time.monotonic()
            prom.wait_for_alertmanagers()
            in_use = time.monotonic()
            first = hook.wait_for(timeout=30)
            print(f"\nfirst notification {first.at - started:.1f} s after starting Prometheus: ready "
                  f"{ready - started:.1f} s, Alertmanager in use {in_use - ready:.1f} s later, "
                  f"notified {first.at - in_use:.1f} s after that")

            assert first.headers["Authorization"] == f"Bearer {TOKEN}"
            assert first.headers["Content-Type"] == "application/json"
            assert first.headers["User-Agent"].startswith("Alertmanager/")
            doc = first.payload
            assert (doc["version"], doc["status"], doc["receiver"]) == ("4", "firing", "kiln")
            assert doc["groupLabels"] == {"namespace": NAMESPACE, "model": MODEL, "alertname": "KilnTestAlwaysHigh"}
            assert doc["groupKey"] == ('{}/{kiln_autoscaling="true"}:'
                                       '{alertname="KilnTestAlwaysHigh", model="iris", namespace="shop"}')
            assert doc["truncatedAlerts"] == 0
            assert doc["externalURL"] == am.url
            [alert] = doc["alerts"]
            assert alert["status"] == "firing"
            assert alert["labels"] == {"alertname": "KilnTestAlwaysHigh", "namespace": NAMESPACE,
                                       "model": MODEL, "kiln_autoscaling": "true"}
            assert alert["annotations"] == {"value": "1", "summary": "always true"}
            assert len(alert["fingerprint"]) == 16 and int(alert["fingerprint"], 16) >= 0
            assert alert["generatorURL"].startswith(prom.url + "/graph?g0.expr=")
            starts = parse_time(alert["startsAt"])
            assert abs((datetime.datetime.now(datetime.timezone.utc) - starts).total_seconds()) < 30
            assert alert["endsAt"] == "0001-01-01T00:00:00Z"  # firing: no end given to the receiver
            print(f"firing: startsAt {alert['startsAt']} endsAt {alert['endsAt']}")

            # Both servers agree it fires; Alertmanager holds the end Prometheus promised.
            assert [a["state"] for a in prom.alerts()] == ["firing"]
            [held] = am.alerts()
            # The same instant: Alertmanager's API and its webhook write it with and without
            # trailing zeros (38.500Z, 38.5Z).
            assert (held["fingerprint"], parse_time(held["startsAt"])) == (alert["fingerprint"], starts)
            assert held["status"]["state"] == "active"
            assert parse_time(held["endsAt"]) > starts
            assert am.status()["cluster"]["status"] == "disabled"

            # The token file is read for every notification: a rotated Secret needs no reload.
            token_file.write_text("rotated-token")
            hook.token = "rotated-token"

            # Without the rule Prometheus sends nothing more for the alert (no resolved
            # alert), so Alertmanager resolves it when the endsAt of the last resend passes.
            last_end = parse_time(am.alerts()[0]["endsAt"])
            rules_file(rules, firing=False)
            reloading = time.monotonic()
            prom.reload()
            assert [r for g in prom.rules() for r in g["rules"]] == []
            resolved = hook.wait_for(lambda d: d.payload["status"] == "resolved", timeout=30)
            print(f"resolved notification {resolved.at - reloading:.1f} s after the reload")
            assert resolved.headers["Authorization"] == "Bearer rotated-token"
            [gone] = resolved.payload["alerts"]
            assert resolved.payload["groupKey"] == doc["groupKey"]
            assert (gone["status"], gone["fingerprint"], gone["startsAt"]) == (
                "resolved", alert["fingerprint"], alert["startsAt"])
            assert parse_time(gone["endsAt"]) >= last_end
            print(f"resolved: startsAt {gone['startsAt']} endsAt {gone['endsAt']}")
            deliveries = [(round(d.at - started, 1), d.payload["status"]) for d in hook.deliveries]
            print(f"deliveries (s after start, status): {deliveries}")
            assert [s for _, s in deliveries] == ["firing", "resolved"]  # repeat_interval 1h: no repeats


# ---------------------------------------------------------------------- configs

def test_a_bad_prometheus_config_fails_with_promtools_words(tmp_path):
    prom = Prometheus(tmp_path / "prometheus", scrape_configs=[{"job_name": "x", "scrape_interval": "banana"}])
    with pytest.raises(ConfigError, match='not a valid duration string: "banana"'):
        prom.start()
    assert prom.proc is None

    bad_rule = tmp_path / "rules.yml"
    bad_rule.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "sum(("}]}]}))
    with pytest.raises(ConfigError, match="parse error"):
        Prometheus(tmp_path / "prometheus2", rule_files=[bad_rule]).start()


def test_a_bad_alertmanager_config_fails_with_amtools_words(tmp_path):
    am = Alertmanager(tmp_path / "alertmanager", {"route": {"receiver": "nope"}, "receivers": [{"name": "kiln"}]})
    with pytest.raises(ConfigError, match='undefined receiver "nope" used in route'):
        am.start()
    assert am.proc is None


def test_the_documented_alertmanager_config_passes_amtool_and_is_the_one_the_tests_run(tmp_path):
    """docs/operations.md's alertmanager.yml, as pasted, passes `amtool check-config`, and is
    what `kiln_alertmanager_config` gives the tests' Alertmanagers (with the docs' URL, token
    file and timings), so the real tier runs the documented route."""
    [text] = snippets.blocks("docs/operations.md", "yaml", "The Alertmanager configuration")
    (tmp_path / "alertmanager.yml").write_text(text)
    check_config(["amtool", "check-config"], tmp_path / "alertmanager.yml")
    documented = yaml.safe_load(text)
    [route] = [r for r in documented["route"]["routes"] if r["receiver"] == "kiln"]
    [webhook] = [r for r in documented["receivers"] if r["name"] == "kiln"][0]["webhook_configs"]
    timings = {k: route[k] for k in ("group_wait", "group_interval", "repeat_interval")}
    assert timings == DOCUMENTED_TIMINGS
    assert documented == kiln_alertmanager_config(
        webhook["url"], webhook["http_config"]["authorization"]["credentials_file"], **timings)


def test_the_shipped_shapes_pass_the_checkers(tmp_path):
    """The pod discovery configs (TLS client certificate or token) are what promtool accepts."""
    for name in ("ca.crt", "client.crt", "client.key", "token"):
        (tmp_path / name).write_text("x")
    files = {k: str(tmp_path / name) for k, name in (("ca_file", "ca.crt"), ("cert_file", "client.crt"),
                                                      ("key_file", "client.key"))}
    prom = Prometheus(tmp_path / "prometheus", scrape_configs=[
        pod_http_sd_scrape_config("http://127.0.0.1:1/targets", job="via-http-sd"),
        operator_scrape_config("127.0.0.1:8081", labels={"namespace": "kiln-system"})])
    prom.write_config()
    kubernetes_sd = [pod_scrape_config("https://127.0.0.1:6443", ["shop"], **files),
                     pod_scrape_config("https://127.0.0.1:6443", ["shop", "lab"], job="by-token",
                                       ca_file=files["ca_file"], bearer_token_file=str(tmp_path / "token"))]
    prom.scrape_configs = kubernetes_sd
    try:
        prom.write_config()
    except ConfigError as e:  # Debian's build: no Kubernetes discovery compiled in (see discovery.py)
        assert "field kubernetes_sd_configs not found" in str(e)
    assert kubernetes_sd[1]["kubernetes_sd_configs"] == [{
        "role": "pod", "api_server": "https://127.0.0.1:6443", "namespaces": {"names": ["shop", "lab"]},
        "tls_config": {"ca_file": files["ca_file"]},
        "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "token")}}]

