"""The chart's scale to zero: the KilnModelIdle rule (shipped as files/kiln-idle.rules.yaml,
rendered where the autoscaling rules are; its promtool unit test is
tests/chart/rules/model_idle_test.yaml, run by test_chart.py with the others) and the
activator (on by default: `activator.enabled` installs its Deployment, Service,
ServiceAccount, RBAC and PodDisruptionBudget and tells the operator). Needs `helm` on PATH
and `promtool` as test_chart.py does."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kiln.operator import signals
from kiln.operator.metrics import OperatorMetrics
from kiln.runtime.serving.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kiln"
NAMESPACE, KUBE_VERSION = "kiln-system", "1.30.0"
IDLE_RULES_FILE = CHART / "files" / "kiln-idle.rules.yaml"
IDLE_RULES_KEY = "kiln-idle.rules.yaml"
MONITORING_APIS = ("monitoring.coreos.com/v1/PrometheusRule",)
ON = ()  # the default
OFF = ("--set", "activator.enabled=false")
HELM, PROMTOOL = shutil.which("helm"), shutil.which("promtool")
needs_helm = pytest.mark.skipif(HELM is None, reason="helm is not on PATH (make test puts .tools there)")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not on PATH (make monitoring-tools)")


def render(*extra: str, api_versions: tuple[str, ...] = ()) -> list[dict]:
    args = [HELM, "template", "kiln", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION, *extra]
    for api in api_versions:
        args += ["--api-versions", api]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (component is None or (o["metadata"].get("labels") or {})
                                                      .get("app.kubernetes.io/component") == component)]


def series(registry) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {f.name + s for f in registry.collect() for s in suffixes.get(f.type, ("",))}


# ------------------------------------------------------------------ the idle rule

def test_the_idle_rule_is_the_contract():
    (group,) = yaml.safe_load(IDLE_RULES_FILE.read_text())["groups"]
    (rule,) = group["rules"]
    assert rule["alert"] == signals.IDLE and signals.IDLE in signals.RECEIVED
    assert rule["labels"] == {"kiln_autoscaling": "true"}  # routed to Kiln's receiver like the others
    assert rule["annotations"]["value"] == "{{ $value }}" and "for" not in rule
    # No requests of any outcome, from what the runtime and the operator really export.
    assert "sum by (namespace, model) (increase(kiln_requests_total[1m])) == 0" in rule["expr"]
    assert "max by (namespace, model) (kiln_autoscaling_min_replicas) == 0" in rule["expr"]
    assert {"kiln_requests_total"} <= series(ServerMetrics().registry)
    assert {"kiln_autoscaling_min_replicas"} <= series(OperatorMetrics().registry)
    assert not re.search(r"utilization|busy", rule["expr"])  # no requests, not low utilization


@needs_promtool
def test_promtool_checks_the_idle_rules_file():
    out = subprocess.run([PROMTOOL, "check", "rules", str(IDLE_RULES_FILE)], capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 1 rules found" in out.stdout, out.stdout + out.stderr


@needs_promtool
def test_the_idle_unit_test_fails_against_a_rule_on_utilization(tmp_path):
    text = IDLE_RULES_FILE.read_text()
    (tmp_path / IDLE_RULES_KEY).write_text(text.replace("kiln_requests_total", "kiln_engine_busy_seconds_total"))
    shutil.copy(ROOT / "tests" / "chart" / "rules" / "model_idle_test.yaml", tmp_path / "model_idle_test.yaml")
    out = subprocess.run([PROMTOOL, "test", "rules", "model_idle_test.yaml"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode != 0, out.stdout + out.stderr


@needs_helm
def test_the_idle_rule_renders_where_the_autoscaling_rules_do():
    (rule,) = [r for r in by_kind(render(api_versions=MONITORING_APIS), "PrometheusRule")
               if r["metadata"]["name"] == "kiln-idle"]
    assert rule["spec"] == yaml.safe_load(IDLE_RULES_FILE.read_text())
    assert [r for r in by_kind(render(), "PrometheusRule")] == []  # no Prometheus Operator
    (cm,) = [c for c in by_kind(render("--set", "autoscaling.rulesConfigMap.enabled=true",
                                       "--set", "autoscaling.rulesConfigMap.namespace=monitoring"), "ConfigMap")
             if IDLE_RULES_KEY in c["data"]]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["data"][IDLE_RULES_KEY] == IDLE_RULES_FILE.read_text()


# ------------------------------------------------------------------ the activator

@needs_helm
def test_the_activator_can_be_left_out():
    objs = render(*OFF)
    assert by_kind(objs, "Deployment", "activator") == [] and by_kind(objs, "Service", "activator") == []
    (op,) = by_kind(objs, "Deployment", "operator")
    assert not [a for a in op["spec"]["template"]["spec"]["containers"][0]["args"] if "activator" in a]


@needs_helm
def test_the_activator_is_installed_and_the_operator_told():
    from kiln.activator import command

    objs = render(*ON)
    (dep,) = by_kind(objs, "Deployment", "activator")
    (svc,) = by_kind(objs, "Service", "activator")
    (op,) = by_kind(objs, "Deployment", "operator")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["kiln", "activator"] and c["image"] == "ghcr.io/kiln-dev/kiln-operator:0.1.0"
    parser = argparse.ArgumentParser(exit_on_error=False)
    command.configure(parser)
    args = parser.parse_args(c["args"])
    assert (args.http_port, args.grpc_port, args.max_queued, args.max_wait_seconds, args.namespace) == (
        8080, 8081, 1000, 120.0, [])
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8080), ("grpc", 8081)]
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"]
    assert pod["serviceAccountName"] == "kiln-activator"
    # The Service the operator copies into a held model's EndpointSlice, by the same port names.
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("http", 8080, "http"), ("grpc", 8081, "grpc")]
    assert f"--activator-service={NAMESPACE}/{svc['metadata']['name']}" in (
        op["spec"]["template"]["spec"]["containers"][0]["args"])
    (pdb,) = by_kind(objs, "PodDisruptionBudget", "activator")
    assert pdb["spec"]["minAvailable"] == 1
    # Its RBAC: read runtime pods and held EndpointSlices, patch the scale subresource; nothing more.
    (role,) = by_kind(objs, "ClusterRole", "activator")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["kiln.dev"], "resources": ["inferencemodels/scale"], "verbs": ["get", "patch"]}]
    (binding,) = by_kind(objs, "ClusterRoleBinding", "activator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kiln-activator", "namespace": NAMESPACE}]
    # The operator may write the held EndpointSlices.
    (op_role,) = by_kind(objs, "ClusterRole", "operator")
    assert {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
            "verbs": ["get", "list", "create", "patch", "delete"]} in op_role["rules"]


@needs_helm
def test_the_activator_in_namespaced_mode_watches_only_those_namespaces():
    objs = render(*ON, "--set", "watch.allNamespaces=false", "--set", "watch.namespaces={ml-prod,ml-staging}",
                  "--set", "activator.replicas=1", "--set", "activator.maxQueued=50")
    (dep,) = by_kind(objs, "Deployment", "activator")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml-prod" in args and "--namespace=ml-staging" in args and "--max-queued=50" in args
    assert by_kind(objs, "PodDisruptionBudget", "activator") == []  # one replica: no budget to keep
    roles = by_kind(objs, "Role", "activator")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-prod", "ml-staging"]
    # The operator lists the activator's EndpointSlices in the release namespace, not watched here.
    (endpoints,) = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] == "kiln-activator-endpoints"]
    assert endpoints["metadata"]["namespace"] == NAMESPACE
    assert endpoints["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                   "verbs": ["list"]}]


@needs_helm
def test_the_activator_objects_are_valid_kubernetes_and_lint_clean():
    import kubernetes_validate

    for extra in (ON, (*ON, "--set", "watch.allNamespaces=false")):
        for obj in render(*extra):
            if obj["metadata"]["name"].startswith("kiln-activator"):
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    out = subprocess.run([HELM, "lint", "--strict", str(CHART), *ON], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_helm
def test_bad_activator_values_are_rejected():
    for bad in ("activator.maxQueued=0", "activator.replicas=0", "activator.bogus=1"):
        out = subprocess.run([HELM, "template", "kiln", str(CHART), "--set", bad], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr, bad
