"""The Helm chart, rendered by a real helm and checked as the API server would see it.

Every `charts/kiln/ci/*-values.yaml` scenario is rendered with `helm template
--include-crds --kube-version`, and every object validated by kubernetes-validate in strict
mode against Kubernetes 1.30 (the CRD as an apiextensions.k8s.io/v1 object); the Prometheus
Operator's kinds, which it cannot know, structurally here. The autoscaling rules are checked
and unit-tested by promtool (tests/chart/rules/*_test.yaml). Needs `helm` on PATH (`make test`
puts the one from `make tools` there) and `promtool` (`make monitoring-tools`); each test is
skipped without its tool.
"""

from __future__ import annotations

import json
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
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.30.0"
NAMESPACE = "kiln-system"

HELM = shutil.which("helm")
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm is not on PATH: run `make tools` and put .tools on PATH (make test does)")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH: `make monitoring-tools` installs Debian's prometheus "
                             "(make test does)")

# The Prometheus Operator's kinds: a scenario that names them is rendered as if the cluster
# served them (.Capabilities.APIVersions), so the chart renders its monitoring objects.
MONITORING_APIS = tuple(f"monitoring.coreos.com/v1/{kind}" for kind in ("PrometheusRule", "ServiceMonitor", "PodMonitor"))
SCENARIO_API_VERSIONS = {"monitoring-values.yaml": MONITORING_APIS}
RULES_FILE = CHART / "files" / "kiln-autoscaling.rules.yaml"
RULES_KEY = "kiln-autoscaling.rules.yaml"
CACHE_RULES_FILE = CHART / "files" / "kiln-cache.rules.yaml"
CACHE_RULES_KEY = "kiln-cache.rules.yaml"
IDLE_RULES_FILE = CHART / "files" / "kiln-idle.rules.yaml"  # tests/chart/test_chart_scale_to_zero.py
REQUEST_RULES_FILE = CHART / "files" / "kiln-requests.rules.yaml"
REQUEST_RULES_KEY = "kiln-requests.rules.yaml"


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys (the API server's strict decoding does)."""


def _mapping(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {dupes}", node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 lambda loader, node: _mapping(loader, node, True))


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)


def render(*values: Path, extra: tuple[str, ...] = (), api_versions: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "kiln", str(CHART), "--namespace", NAMESPACE, "--include-crds",
            "--kube-version", KUBE_VERSION, *extra]
    for v in values:
        args += ["-f", str(v)]
        api_versions += SCENARIO_API_VERSIONS.get(v.name, ())
    for api in api_versions:
        args += ["--api-versions", api]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.load_all(out.stdout, Loader=_UniqueKeyLoader) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    """The objects of `kind` but the activator's (test_chart_scale_to_zero.py is about those)."""
    return [o for o in objs if o["kind"] == kind
            and (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") != "activator"]


def scenario(name: str) -> Path:
    return CHART / "ci" / f"{name}-values.yaml"


# ------------------------------------------------------------------ chart files

def test_chart_crd_is_the_repository_crd():
    assert (CHART / "crds" / "inferencemodels.kiln.dev.yaml").read_bytes() == (
        ROOT / "crds" / "inferencemodels.kiln.dev.yaml").read_bytes()
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(
        p.name for p in (ROOT / "crds").glob("*.yaml"))


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["name"], chart["version"], chart["appVersion"]) == (
        "v2", "kiln", "0.1.0", "0.1.0")


def test_every_values_key_has_a_comment():
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        stack = [(n, k) for n, k in stack if n < indent] + [(indent, key)]
        node = schema
        for _, k in stack:  # only keys the schema names are values keys (not map contents)
            props = node.get("properties")
            node = props.get(k) if props else None
            if node is None:
                break
        if node is None:
            continue
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if not prev.strip().startswith("#"):
            missing.append(".".join(k for _, k in stack))
    assert missing == []


def test_values_schema_is_strict():
    def objects(node, path="values"):
        if node.get("type") == "object" and "properties" in node:
            yield path, node
            for k, sub in node["properties"].items():
                yield from objects(sub, f"{path}.{k}")

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert [p for p, n in objects(schema) if n.get("additionalProperties") is not False] == []


def test_ci_scenarios_exist():
    assert {p.name for p in SCENARIOS} >= {"default-values.yaml", "all-namespaces-values.yaml",
                                           "namespaced-values.yaml", "no-pvc-values.yaml",
                                           "monitoring-values.yaml", "no-receiver-values.yaml"}
    assert set(SCENARIO_API_VERSIONS) <= {p.name for p in SCENARIOS}


# ------------------------------------------------------------------ helm

@needs_helm
def test_helm_lint_strict():
    for values in SCENARIOS:
        out = helm("lint", "--strict", str(CHART), "-f", str(values))
        assert out.returncode == 0, f"{values.name}: {out.stdout}{out.stderr}"


@needs_helm
@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.stem)
def test_every_rendered_object_is_valid_kubernetes(values):
    import kubernetes_validate

    objs = render(values)
    assert objs
    for obj in objs:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            assert_valid_monitoring_object(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")


@needs_helm
def test_rendered_crd_is_the_repository_crd():
    crds = by_kind(render(scenario("default")), "CustomResourceDefinition")
    assert crds == [yaml.safe_load((ROOT / "crds" / "inferencemodels.kiln.dev.yaml").read_text())]


@needs_helm
def test_operator_deployment_is_hardened_and_configured():
    (dep,) = by_kind(render(scenario("all-namespaces")), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/kiln-dev/kiln-operator:0.1.0"
    assert c["args"] == [
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--builder-image=registry.example.com/kiln/runtime:0.1.0-trt10.13",
        "--runtime-image=registry.example.com/kiln/runtime:0.1.0-trt10.13",
        "--backend-version=onnxruntime=1.32.0",
        "--backend-version=onnxruntime-cuda=1.31.1+cuda13.0",
        "--backend-version=tensorrt=10.13.0",
        "--default-targets=sm80,sm89,sm90",
        "--cache-claim=kiln-engine-cache",
        "--cache-gc-interval-seconds=3600",
        "--cache-gc-retention=1",
        "--cache-gc-grace-seconds=86400",
        "--alert-receiver-port=8081",
        "--alert-token-file=/etc/kiln/alert-token/token",
        "--activator-service=kiln-system/kiln-activator",
    ]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "alerts", "containerPort": 8081, "protocol": "TCP"}]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "privileged": False, "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["serviceAccountName"] == "kiln"


@needs_helm
@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_operator_args_are_what_kiln_operator_accepts(values):
    # The chart and `kiln operator` are written apart: the rendered args must parse with
    # the operator's own parser into a configuration it can run with.
    import argparse

    from kiln.operator import main

    (dep,) = by_kind(render(values), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser(prog="kiln operator", exit_on_error=False)
    main.configure(parser)
    config = main.config_from_args(parser.parse_args(c["args"]))
    assert config.default_targets and set(config.backend_versions) >= {"tensorrt", "onnxruntime"}


NAMESPACED_RULES = [
    {"apiGroups": ["kiln.dev"], "resources": ["inferencemodels"],
     "verbs": ["get", "list", "watch", "patch", "update"]},
    {"apiGroups": ["kiln.dev"], "resources": ["inferencemodels/status", "inferencemodels/scale"],
     "verbs": ["get", "patch", "update"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["configmaps"],  # delete: a cache GC plan a second operator made too
     "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]
# The held EndpointSlices of models at zero (the activator is on by default).
ACTIVATOR_RULE = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                  "verbs": ["get", "list", "create", "patch", "delete"]}
GATEWAY_RULE = {"apiGroups": ["gateway.networking.k8s.io"], "resources": ["httproutes", "grpcroutes"],
                "verbs": ["get", "list", "watch", "patch"]}
CRD_RULE = {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
            "verbs": ["get", "list", "watch"]}


@needs_helm
def test_all_namespaces_rbac_is_one_cluster_role_with_exactly_what_the_operator_uses():
    objs = render(scenario("default"))
    assert by_kind(objs, "Role") == [] and by_kind(objs, "RoleBinding") == []
    (role,) = by_kind(objs, "ClusterRole")
    assert role["rules"] == [
        CRD_RULE,
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"],
         "verbs": ["get", "list", "watch", "patch"]},
        *NAMESPACED_RULES, ACTIVATOR_RULE, GATEWAY_RULE]
    (binding,) = by_kind(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kiln", "namespace": NAMESPACE}]
    rules = by_kind(render(scenario("all-namespaces")), "ClusterRole")[0]["rules"]
    assert GATEWAY_RULE not in rules  # rbac.gatewayAPI: false


@needs_helm
def test_namespaced_mode_has_a_role_per_namespace():
    objs = render(scenario("namespaced"))
    (cluster_role,) = by_kind(objs, "ClusterRole")
    assert cluster_role["rules"] == [CRD_RULE]
    # (and kiln-activator-endpoints in the release namespace: test_chart_scale_to_zero.py)
    roles = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] != "kiln-activator-endpoints"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-prod", "ml-staging"]
    for role in roles:
        assert role["rules"] == [{"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"],
                                  "verbs": ["get", "list", "watch", "patch"]},
                                 *NAMESPACED_RULES, ACTIVATOR_RULE, GATEWAY_RULE]
    bindings = [b for b in by_kind(objs, "RoleBinding") if b["metadata"]["name"] != "kiln-activator-endpoints"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml-prod", "ml-staging"]
    assert all(b["subjects"][0]["namespace"] == NAMESPACE for b in bindings)
    (dep,) = by_kind(objs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--namespace=ml-prod", "--namespace=ml-staging"]
    assert "--all-namespaces" not in args and args[-1] == "--verbose"
    pvcs = by_kind(objs, "PersistentVolumeClaim")
    assert sorted(p["metadata"]["namespace"] for p in pvcs) == ["ml-prod", "ml-staging"]


@needs_helm
def test_cache_pvc_is_shared_and_kept_on_uninstall():
    (pvc,) = by_kind(render(scenario("all-namespaces")), "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "kiln-engine-cache"
    assert pvc["metadata"]["namespace"] == NAMESPACE
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs-rwx",
                           "resources": {"requests": {"storage": "1Ti"}}}


@needs_helm
def test_no_pvc_and_an_existing_service_account():
    objs = render(scenario("no-pvc"))
    assert by_kind(objs, "PersistentVolumeClaim") == [] and by_kind(objs, "ServiceAccount") == []
    (dep,) = by_kind(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kiln-operator"
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert "--cache-claim=shared-engines" in pod["containers"][0]["args"]
    assert by_kind(objs, "ClusterRoleBinding")[0]["subjects"][0]["name"] == "kiln-operator"


@needs_helm
@pytest.mark.parametrize("bad, message", [
    ("replicas: 2\n", "- at '': additional properties 'replicas' not allowed"),
    ("watch:\n  allNamespaces: \"yes\"\n", "- at '/watch/allNamespaces': got string, want boolean"),
    ("image:\n  pullPolicy: Sometimes\n",
     "- at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"),
    ("cache:\n  pvc:\n    size: lots\n", "- at '/cache/pvc/size': 'lots' does not match pattern"),
    ("operator:\n  extraArgs: [verbose]\n",
     "- at '/operator/extraArgs/0': 'verbose' does not match pattern '^--'"),
    ("autoscaling:\n  rules:\n    gpuUtilizationMetric: nvidia_smi_utilization\n",
     "- at '/autoscaling/rules/gpuUtilizationMetric': value must be one of 'kiln_gpu_utilization_ratio', "
     "'DCGM_FI_DEV_GPU_UTIL', 'DCGM_FI_PROF_GR_ENGINE_ACTIVE'"),
    ("autoscaling:\n  rules:\n    highFor: 1 minute\n",
     "- at '/autoscaling/rules/highFor': '1 minute' does not match pattern"),
    ("autoscaling:\n  rules:\n    lowFraction: 1.5\n", "- at '/autoscaling/rules/lowFraction': exclusiveMaximum: got 1.5, want 1"),
    ("autoscaling:\n  rules:\n    lowFraction: \"half\"\n",
     "- at '/autoscaling/rules/lowFraction': 'half' does not match pattern"),
    ("autoscaling:\n  rules:\n    containerConcurrency: -1\n",
     "- at '/autoscaling/rules/containerConcurrency': minimum: got -1, want 0"),
    ("autoscaling:\n  rules:\n    containerConcurrency: \"ten\"\n",
     "- at '/autoscaling/rules/containerConcurrency': 'ten' does not match pattern"),
    ("autoscaling:\n  receiver:\n    port: 80\n", "- at '/autoscaling/receiver/port': minimum: got 80, want 1,024"),
    ("monitoring:\n  podMonitor:\n    enabled: yes please\n",
     "- at '/monitoring/podMonitor/enabled': got string, want boolean"),
])
def test_bad_values_are_rejected_by_the_schema(tmp_path, bad, message):
    f = tmp_path / "bad-values.yaml"
    f.write_text(bad)
    out = helm("template", "kiln", str(CHART), "-f", str(f))
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr
    assert message in out.stderr


# ------------------------------------------------------------------ monitoring objects

# What the Prometheus Operator's CRDs accept (monitoring.coreos.com/v1), as far as the chart
# uses them: kubernetes-validate has no schema for them, and an unknown field would be pruned
# or refused by the API server.
RULE_GROUP_KEYS = {"name", "interval", "rules", "limit", "partial_response_strategy"}
RULE_KEYS = {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
ENDPOINT_KEYS = {"port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
                 "honorTimestamps", "relabelings", "metricRelabelings", "tlsConfig", "bearerTokenSecret",
                 "authorization", "basicAuth", "followRedirects", "enableHttp2", "proxyUrl"}
MONITOR_SPECS = {
    "PrometheusRule": ({"groups"}, {"groups"}),
    "ServiceMonitor": ({"selector", "endpoints"}, {"selector", "endpoints", "namespaceSelector", "jobLabel",
                                                   "targetLabels", "podTargetLabels", "sampleLimit"}),
    "PodMonitor": ({"selector", "podMetricsEndpoints"}, {"selector", "podMetricsEndpoints", "namespaceSelector",
                                                         "jobLabel", "podTargetLabels", "sampleLimit"}),
}
CRD_DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _string_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def assert_valid_monitoring_object(obj: dict) -> None:
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, where
    assert obj["kind"] in MONITOR_SPECS, where
    meta = obj["metadata"]
    assert set(meta) <= {"name", "namespace", "labels", "annotations"}, where
    assert DNS_SUBDOMAIN.match(meta["name"]) and len(meta["name"]) <= 253, where
    assert DNS_SUBDOMAIN.match(meta["namespace"]), where
    assert _string_map(meta.get("labels", {})) and _string_map(meta.get("annotations", {})), where
    required, allowed = MONITOR_SPECS[obj["kind"]]
    spec = obj["spec"]
    assert required <= set(spec) <= allowed, f"{where}: spec keys {sorted(spec)}"
    if obj["kind"] == "PrometheusRule":
        for group in spec["groups"]:
            assert {"name", "rules"} <= set(group) <= RULE_GROUP_KEYS, where
            assert CRD_DURATION.match(group.get("interval", "0")), where
            for rule in group["rules"]:
                assert set(rule) <= RULE_KEYS and ("record" in rule) != ("alert" in rule), f"{where}: {rule}"
                assert isinstance(rule["expr"], str) and CRD_DURATION.match(rule.get("for", "0")), f"{where}: {rule}"
                assert _string_map(rule.get("labels", {})) and _string_map(rule.get("annotations", {})), where
        return
    assert set(spec["selector"]) <= {"matchLabels", "matchExpressions"} and spec["selector"], where
    assert _string_map(spec["selector"].get("matchLabels", {})), where
    ns = spec.get("namespaceSelector", {})
    assert set(ns) <= {"any", "matchNames"} and isinstance(ns.get("any", False), bool), where
    assert all(DNS_SUBDOMAIN.match(n) for n in ns.get("matchNames", [])), where
    endpoints = spec["endpoints" if obj["kind"] == "ServiceMonitor" else "podMetricsEndpoints"]
    assert endpoints, where
    for endpoint in endpoints:
        assert set(endpoint) <= ENDPOINT_KEYS and "port" in endpoint, f"{where}: {endpoint}"
        assert CRD_DURATION.match(endpoint.get("interval", "0")), f"{where}: {endpoint}"
        assert endpoint.get("path", "/").startswith("/"), where


def test_the_structural_check_refuses_what_the_crds_would():
    good = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": "kiln-runtime", "namespace": NAMESPACE},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "http"}]}}
    assert_valid_monitoring_object(good)
    for bad in ({**good, "spec": {**good["spec"], "endpoints": [{"port": "http"}]}},
                {**good, "spec": {**good["spec"], "podMetricsEndpoints": [{"port": "http", "interval": "10 s"}]}},
                {**good, "spec": {"selector": {"matchLabels": {"a": "b"}}}},
                {**good, "kind": "Probe"}):
        with pytest.raises(AssertionError):
            assert_valid_monitoring_object(bad)


@needs_helm
def test_monitoring_objects_need_their_api_and_their_switch():
    kinds = {"PrometheusRule", "ServiceMonitor", "PodMonitor"}
    assert {o["kind"] for o in render(scenario("default"))} & kinds == set()
    assert {o["kind"] for o in render(scenario("default"), api_versions=MONITORING_APIS)} >= kinds
    off = ("--set", "autoscaling.prometheusRule.enabled=false", "--set", "monitoring.serviceMonitor.enabled=false",
           "--set", "monitoring.podMonitor.enabled=false", "--set", "monitoring.cacheRules.prometheusRule.enabled=false",
           "--set", "monitoring.requestRules.prometheusRule.enabled=false")
    assert {o["kind"] for o in render(scenario("default"), extra=off, api_versions=MONITORING_APIS)} & kinds == set()
    # The operator's /metrics is served by the receiver: without it, nothing to monitor.
    objs = render(scenario("no-receiver"), api_versions=MONITORING_APIS)
    assert {o["kind"] for o in objs} & kinds == {"PrometheusRule", "PodMonitor"}


def runtime_pod_template() -> dict:
    """A runtime pod as the operator builds it (labels, ports, annotations)."""
    from kiln.operator import manifests
    from kiln.operator.config import OperatorConfig
    from kiln.operator.plan import plan_engines
    from kiln.runtime.api import spec as specmod

    model = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
             "metadata": {"name": "resnet", "namespace": "ml-prod", "uid": "u-1", "generation": 1}}
    spec = specmod.apply_defaults({"model": {"uri": "pvc://models/resnet.onnx", "version": "1", "sha256": "3f" * 32},
                                   "engine": {"backend": "onnxruntime"}})
    config = OperatorConfig()
    engines = plan_engines(spec, config)
    dep = manifests.runtime_deployment(model, spec, engines, {e.index_key: {"path": "p"} for e in engines}, config)
    return dep["spec"]["template"]


@needs_helm
def test_pod_monitor_scrapes_the_runtime_pods_the_operator_builds():
    objs = render(scenario("monitoring"))
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pod = runtime_pod_template()
    assert pm["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "kiln",
                                                      "app.kubernetes.io/component": "runtime"}}
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "10s"}
    assert endpoint["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert endpoint["path"] == pod["metadata"]["annotations"]["prometheus.io/path"]
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    (pm,) = by_kind(render(scenario("namespaced"), api_versions=MONITORING_APIS), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["ml-prod", "ml-staging"]}


@needs_helm
def test_service_monitor_scrapes_the_operator_keeping_its_labels():
    objs = render(scenario("monitoring"))
    (sm,) = by_kind(objs, "ServiceMonitor")
    (svc,) = by_kind(objs, "Service")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert sm["spec"]["endpoints"] == [{"port": "alerts", "path": "/metrics", "honorLabels": True, "interval": "15s"}]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["alerts"]


# ------------------------------------------------------------------ the alert receiver

def operator_container(objs: list[dict]) -> tuple[dict, dict]:
    (dep,) = by_kind(objs, "Deployment")
    template = dep["spec"]["template"]
    (c,) = template["spec"]["containers"]
    return template, c


@needs_helm
def test_receiver_secret_service_and_mount():
    import base64

    objs = render(scenario("default"))
    (secret,) = by_kind(objs, "Secret")
    assert secret["metadata"]["name"] == "kiln-alert-token" and secret["metadata"]["namespace"] == NAMESPACE
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    # Generated, not a constant of the chart (an upgrade keeps the live one through lookup).
    assert by_kind(render(scenario("default")), "Secret")[0]["data"]["token"] != secret["data"]["token"]

    template, c = operator_container(objs)
    (svc,) = by_kind(objs, "Service")
    assert svc["metadata"]["name"] == "kiln-alerts"
    assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "alerts", "port": 8081, "targetPort": "alerts", "protocol": "TCP"}]
    assert {"name": "alerts", "containerPort": 8081, "protocol": "TCP"} in c["ports"]
    assert {"name": "alert-token", "mountPath": "/etc/kiln/alert-token", "readOnly": True} in c["volumeMounts"]
    assert {"name": "alert-token", "secret": {"secretName": "kiln-alert-token", "defaultMode": 0o440}} in (
        template["spec"]["volumes"])
    assert c["args"][-3:-1] == ["--alert-receiver-port=8081", "--alert-token-file=/etc/kiln/alert-token/token"]
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8081", "prometheus.io/path": "/metrics"}


@needs_helm
def test_receiver_with_an_existing_secret_and_its_own_port():
    objs = render(scenario("monitoring"))
    assert by_kind(objs, "Secret") == []
    template, c = operator_container(objs)
    assert {"name": "alert-token", "secret": {"secretName": "kiln-webhook-token", "defaultMode": 0o440}} in (
        template["spec"]["volumes"])
    assert "--alert-receiver-port=9095" in c["args"]
    (svc,) = by_kind(objs, "Service")
    assert svc["spec"]["ports"][0]["port"] == 9095
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "9095"


@needs_helm
def test_the_operator_knows_when_the_rules_scale_on_concurrency():
    # status.scaling.signal says what the rules read: the operator is told the one value that changes it.
    _, c = operator_container(render(extra=("--set", "autoscaling.rules.containerConcurrency=10")))
    assert "--container-concurrency=10" in c["args"]
    _, c = operator_container(render())
    assert not any(a.startswith("--container-concurrency") for a in c["args"])


@needs_helm
def test_receiver_disabled():
    objs = render(scenario("no-receiver"))
    assert by_kind(objs, "Secret") == [] and by_kind(objs, "Service") == []
    template, c = operator_container(objs)
    assert "--alert-receiver-port=0" in c["args"] and not any(a.startswith("--alert-token-file") for a in c["args"])
    assert [p["name"] for p in c["ports"]] == ["health"]
    assert [v["name"] for v in template["spec"]["volumes"]] == ["tmp"]
    assert "annotations" not in template["metadata"]


@needs_helm
def test_pod_annotations_of_ones_own_win_over_the_scrape_annotations():
    objs = render(scenario("all-namespaces"), extra=("--set-string", "podAnnotations.prometheus\\.io/scrape=false"))
    template, _ = operator_container(objs)
    assert template["metadata"]["annotations"] == {
        "example.com/owner": "ml-platform", "prometheus.io/scrape": "false", "prometheus.io/port": "8081",
        "prometheus.io/path": "/metrics"}


# ------------------------------------------------------------------ autoscaling rules

def exported(registry) -> set[str]:
    """The series names a prometheus-client registry exports (a counter's `_total`, a
    histogram's `_bucket`/`_sum`/`_count`), whether or not a labelled child exists yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {f.name + s for f in registry.collect() for s in suffixes.get(f.type, ("",))}


# The names the rules and the dashboard may read: what the runtime and the operator really
# export (their registries; the NVML collector exports only where a GPU is), DCGM exporter's
# GPU metrics, and Prometheus' own ALERTS.
RUNTIME_METRICS = exported(ServerMetrics().registry) | {"kiln_gpu_utilization_ratio"}
DCGM_METRICS = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"}
OPERATOR_METRICS = exported(OperatorMetrics().registry)
ALERTS = signals.ALERTS
RECORDED = "kiln:utilization:ratio"
RECORDED_SHORT = "kiln:utilization_short:ratio"  # over surgeWindow, KilnUtilizationSurge's
# What a CPU pod's utilization is the highest of: its engine's, its front ends' and its CPU's.
POD_SIGNALS = {"kiln_engine_busy_seconds_total", "kiln_pod_front_end_busy_seconds_total",
               "kiln_pod_cpu_seconds_total", "kiln_pod_cpu_limit_cores"}
SHORT_WINDOWS = ("autoscaling.rules.highFor=5s", "autoscaling.rules.lowFor=10s", "autoscaling.rules.missingFor=8s",
                 "autoscaling.rules.rateWindow=4s", "autoscaling.rules.interval=1s")
# Each promtool unit test file and the values its rules are rendered with.
RULE_TESTS = {
    "default_test.yaml": (),
    "gpu_visible_test.yaml": (),
    "dcgm_gpu_util_test.yaml": ("autoscaling.rules.gpuUtilizationMetric=DCGM_FI_DEV_GPU_UTIL",),
    "dcgm_engine_active_test.yaml": ("autoscaling.rules.gpuUtilizationMetric=DCGM_FI_PROF_GR_ENGINE_ACTIVE",),
    "cache_filling_test.yaml": (),  # the engine cache's rules (kiln-cache.rules.yaml), shipped as they are
    "model_idle_test.yaml": (),  # the scale-to-zero rule (kiln-idle.rules.yaml), shipped as it is
    "requests_refused_test.yaml": (),  # the request-outcome rule (kiln-requests.rules.yaml, default values)
    "surge_test.yaml": (),
    "cpu_bottleneck_test.yaml": (),
    "concurrency_test.yaml": ("autoscaling.rules.containerConcurrency=10",),
}
RULE_VARIANTS = {"default": (), "short-windows": SHORT_WINDOWS, **{
    name.removesuffix("_test.yaml"): sets for name, sets in RULE_TESTS.items() if sets}}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, labels, keywords or durations)."""
    expr = re.sub(r'"(\\.|[^"\\])*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\b(and|or|unless)\b", ";", expr)  # else the name before one reads as a function's
    names = set(re.findall(r"[A-Za-z_:][\w:]*(?!\s*[\w:(])", expr))
    return names - {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "Inf", "NaN"}


def test_metric_names_reads_names_only():
    assert metric_names('sum by (namespace, model, direction) (increase(kiln_scaling_decisions_total'
                        '{namespace=~"$namespace", model=~"a|b"}[5m])) or on (model) kiln:utilization:ratio') == {
        "kiln_scaling_decisions_total", "kiln:utilization:ratio"}
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m]))) > bool 2') == {"x_bucket"}
    assert metric_names('a and on (pod) b{t!="cpu"} or c unless d') == {"a", "b", "c", "d"}


def rules_text(*sets: str) -> str:
    """The chart's rules file, from its ConfigMap, rendered with `sets` (--set)."""
    extra = ("--set", "autoscaling.rulesConfigMap.enabled=true", *(a for s in sets for a in ("--set", s)))
    (cm,) = [o for o in by_kind(render(extra=extra), "ConfigMap") if RULES_KEY in o["data"]]
    return cm["data"][RULES_KEY]


def prometheus_rule(*sets: str, name: str = "kiln-autoscaling") -> dict:
    (rule,) = [r for r in by_kind(render(extra=tuple(a for s in sets for a in ("--set", s)),
                                         api_versions=MONITORING_APIS), "PrometheusRule")
               if r["metadata"]["name"] == name]
    return rule


@needs_helm
def test_the_plain_rules_file_is_the_chart_rendered_with_default_values():
    # One source: the template. `make rules` writes the file; this fails until it is rerun.
    assert RULES_FILE.read_text() == rules_text(), "run `make rules`"
    assert prometheus_rule()["spec"] == yaml.safe_load(RULES_FILE.read_text())
    (cm,) = [o for o in by_kind(render(scenario("monitoring")), "ConfigMap") if RULES_KEY in o["data"]]
    assert cm["metadata"]["namespace"] == "monitoring"


def test_the_rules_are_the_contract():
    (group,) = yaml.safe_load(RULES_FILE.read_text())["groups"]
    records = [r["record"] for r in group["rules"] if "record" in r]
    alerts = {r["alert"]: r for r in group["rules"] if "alert" in r}
    assert records == [RECORDED, RECORDED_SHORT] and tuple(alerts) == ALERTS
    # recorded before the alerts read them, in one evaluation
    assert [r.get("record") for r in group["rules"][:2]] == [RECORDED, RECORDED_SHORT]
    assert group["interval"] == "5s"
    for name, rule in alerts.items():
        assert rule["labels"] == {"kiln_autoscaling": "true"}, name
        assert rule["annotations"]["value"] == "{{ $value }}", name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        reads = RECORDED_SHORT if name == signals.SURGE else RECORDED
        assert metric_names(rule["expr"]) == {reads, "kiln_autoscaling_target_ratio"}, name
    assert [alerts[a]["for"] for a in ALERTS] == ["1m", "0s", "2m", "2m"]
    for rule, window in zip(group["rules"][:2], ("1m", "20s")):
        assert metric_names(rule["expr"]) == POD_SIGNALS | {"kiln_gpu_utilization_ratio", "kiln_model_info"}
        assert POD_SIGNALS <= RUNTIME_METRICS
        for counter in ("kiln_engine_busy_seconds_total", "kiln_pod_front_end_busy_seconds_total",
                        "kiln_pod_cpu_seconds_total"):
            assert f"rate({counter}[{window}])" in rule["expr"]
        # per pod the highest of the three, clamped to 1, then the model's pods' average
        assert rule["expr"].count("label_replace(") == 3 and "clamp_max(max by (namespace, pod, model) (" in rule["expr"]
        assert rule["expr"].count('kiln_model_info{target="cpu"}') == 2  # not the GPU engines'
    assert "(0.5 * max by (namespace, model) (kiln_autoscaling_target_ratio))" in alerts["KilnUtilizationLow"]["expr"]
    assert "clamp_max(2 * max by (namespace, model) (kiln_autoscaling_target_ratio), 0.9)" in alerts[signals.SURGE]["expr"]


@needs_helm
def test_rule_values_reach_the_rules():
    (group,) = yaml.safe_load(rules_text(*SHORT_WINDOWS, "autoscaling.rules.lowFraction=0.25",
                                         "autoscaling.rules.surgeFactor=3", "autoscaling.rules.surgeCeiling=0.8",
                                         "autoscaling.rules.surgeWindow=3s", "autoscaling.rules.surgeFor=1s"))["groups"]
    assert group["interval"] == "1s"
    assert [r.get("for") for r in group["rules"]] == [None, None, "5s", "1s", "10s", "8s"]
    assert "rate(kiln_engine_busy_seconds_total[4s])" in group["rules"][0]["expr"]
    assert "rate(kiln_engine_busy_seconds_total[3s])" in group["rules"][1]["expr"]
    assert "clamp_max(3 * max by (namespace, model) (kiln_autoscaling_target_ratio), 0.8)" in group["rules"][3]["expr"]
    assert "(0.25 * max by" in group["rules"][4]["expr"]
    for sets, names in [(RULE_TESTS["dcgm_gpu_util_test.yaml"], {"DCGM_FI_DEV_GPU_UTIL", "kiln_model_info"}),
                        (RULE_TESTS["dcgm_engine_active_test.yaml"],
                         {"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "kiln_model_info"})]:
        expr = yaml.safe_load(rules_text(*sets))["groups"][0]["rules"][0]["expr"]
        assert metric_names(expr) == names | POD_SIGNALS
        assert "on (namespace, pod) group_left (model)" in expr and 'kiln_model_info{target!="cpu"}' in expr
        assert ("DCGM_FI_DEV_GPU_UTIL / 100" in expr) == ("DCGM_FI_DEV_GPU_UTIL" in names)


@needs_helm
def test_container_concurrency_switches_every_model_to_requests_in_flight():
    (group,) = yaml.safe_load(rules_text("autoscaling.rules.containerConcurrency=10", "autoscaling.rules.rateWindow=4s",
                                         "autoscaling.rules.surgeWindow=3s"))["groups"]
    for rule, window in zip(group["rules"][:2], ("4s", "3s")):
        assert metric_names(rule["expr"]) == {"kiln_inflight_requests"}
        assert f"avg_over_time(kiln_inflight_requests[{window}])" in rule["expr"] and rule["expr"].strip().endswith(") / 10")
    assert yaml.safe_load(rules_text("autoscaling.rules.containerConcurrency=0")) == yaml.safe_load(RULES_FILE.read_text())


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_promtool_checks_the_plain_rules_file():
    out = promtool("check", "rules", str(RULES_FILE))
    assert out.returncode == 0 and "SUCCESS: 6 rules found" in out.stdout, out.stdout + out.stderr


@needs_helm
@needs_promtool
@pytest.mark.parametrize("variant", RULE_VARIANTS)
def test_promtool_checks_the_prometheus_rule(tmp_path, variant):
    rule = prometheus_rule(*RULE_VARIANTS[variant])
    assert_valid_monitoring_object(rule)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0 and "SUCCESS: 6 rules found" in out.stdout, out.stdout + out.stderr


def test_every_rules_unit_test_is_run():
    assert sorted(p.name for p in (ROOT / "tests" / "chart" / "rules").glob("*.yaml")) == sorted(RULE_TESTS)


@needs_helm
@needs_promtool
@pytest.mark.parametrize("test_file", RULE_TESTS)
def test_promtool_rules_unit_tests(tmp_path, test_file):
    # The test file names `kiln-autoscaling.rules.yaml` beside it: the shipped file, or the rules
    # rendered with the values this variant is about; or the shipped `kiln-cache.rules.yaml`.
    sets = RULE_TESTS[test_file]
    (tmp_path / RULES_KEY).write_text(rules_text(*sets) if sets else RULES_FILE.read_text())
    shutil.copy(CACHE_RULES_FILE, tmp_path / CACHE_RULES_KEY)
    shutil.copy(IDLE_RULES_FILE, tmp_path / IDLE_RULES_FILE.name)
    shutil.copy(REQUEST_RULES_FILE, tmp_path / REQUEST_RULES_KEY)
    shutil.copy(ROOT / "tests" / "chart" / "rules" / test_file, tmp_path / test_file)
    out = promtool("test", "rules", test_file, cwd=tmp_path)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def with_utilization(text: str, swap) -> str:
    """The rules file with both utilization records' `GPU or CPU` expressions passed through `swap`."""
    doc = yaml.safe_load(text)
    for rule in doc["groups"][0]["rules"][:2]:
        gpu, cpu = rule["expr"].split("\nor\n")
        rule["expr"] = swap(gpu.strip(), cpu.strip())
    return yaml.safe_dump(doc)


@needs_promtool
@pytest.mark.parametrize("test_file, broken, fails_on", [
    # busy time before the GPU: bert takes its busy fraction
    ("default_test.yaml", lambda gpu, cpu: f"{cpu}\nor\n{gpu}", 'model="bert"'),
    # the engine's busy fraction alone, as before the pod's CPU signals: a light model with
    # saturated front ends reads 0.2
    ("cpu_bottleneck_test.yaml",
     lambda gpu, cpu: f"{gpu}\nor\navg by (namespace, model) (rate(kiln_engine_busy_seconds_total[1m]))",
     'model="light"'),
])
def test_promtool_rules_unit_tests_can_fail(tmp_path, test_file, broken, fails_on):
    # The same unit tests against broken rules: they must fail.
    (tmp_path / RULES_KEY).write_text(with_utilization(RULES_FILE.read_text(), broken))
    shutil.copy(ROOT / "tests" / "chart" / "rules" / test_file, tmp_path / test_file)
    out = promtool("test", "rules", test_file, cwd=tmp_path)
    assert out.returncode != 0 and fails_on in out.stderr, out.stdout + out.stderr
    # ...and pass with the rules as they are, put through the same YAML round trip.
    (tmp_path / RULES_KEY).write_text(with_utilization(RULES_FILE.read_text(), lambda gpu, cpu: f"{gpu}\nor\n{cpu}"))
    assert promtool("test", "rules", test_file, cwd=tmp_path).returncode == 0


# ------------------------------------------------------------------ engine cache rules

CACHE_RECORDED = "kiln:engine_cache_used:ratio"
CACHE_ALERT = "KilnEngineCacheFilling"


def cache_rule_objects(*sets: str, api_versions: tuple[str, ...] = MONITORING_APIS) -> list[dict]:
    objs = render(extra=tuple(a for s in sets for a in ("--set", s)), api_versions=api_versions)
    return ([o for o in by_kind(objs, "PrometheusRule") if o["metadata"]["name"] == "kiln-cache"]
            + [o for o in by_kind(objs, "ConfigMap") if CACHE_RULES_KEY in o.get("data", {})])


@needs_helm
def test_the_cache_rules_render_only_when_enabled():
    (rule,) = cache_rule_objects()
    assert_valid_monitoring_object(rule)
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["spec"] == yaml.safe_load(CACHE_RULES_FILE.read_text())  # the file, as it is
    (rule,) = cache_rule_objects("monitoring.cacheRules.prometheusRule.labels.release=kube-prometheus-stack")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert cache_rule_objects(api_versions=()) == []  # no Prometheus Operator
    assert cache_rule_objects("monitoring.cacheRules.prometheusRule.enabled=false") == []
    (cm,) = cache_rule_objects("monitoring.cacheRules.prometheusRule.enabled=false",
                               "monitoring.cacheRules.rulesConfigMap.enabled=true",
                               "monitoring.cacheRules.rulesConfigMap.namespace=monitoring", api_versions=())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "kiln-cache-rules"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["data"] == {CACHE_RULES_KEY: CACHE_RULES_FILE.read_text()}


def test_the_cache_rules_are_the_contract():
    (group,) = yaml.safe_load(CACHE_RULES_FILE.read_text())["groups"]
    record, alert = group["rules"]
    assert record["record"] == CACHE_RECORDED and alert["alert"] == CACHE_ALERT
    assert metric_names(record["expr"]) == {"kiln_engine_cache_used_bytes", "kiln_engine_cache_free_bytes"}
    assert metric_names(alert["expr"]) == {CACHE_RECORDED, "kiln_engine_cache_free_bytes"}
    assert metric_names(record["expr"] + alert["expr"]) - {CACHE_RECORDED} <= RUNTIME_METRICS
    # One number per volume: every pod of a namespace reports it (and `namespace` is the pod's).
    assert "max by (namespace, claim)" in record["expr"]
    assert "predict_linear(max by (namespace, claim) (kiln_engine_cache_free_bytes)[6h:5m], 24 * 3600) < 0" in (
        alert["expr"])
    assert f"{CACHE_RECORDED} > 0.85" in alert["expr"] and alert["for"] == "15m"
    # Routed as the user's own warnings, never to Kiln's autoscaling receiver.
    assert alert["labels"] == {"severity": "warning"} and CACHE_ALERT not in ALERTS
    assert "{{ $labels.claim }}" in alert["annotations"]["summary"]
    for words in ("{{ $labels.claim }}", "{{ $value | humanizePercentage }}", "garbage collection", "bigger claim"):
        assert words in alert["annotations"]["description"], words


@needs_promtool
def test_promtool_checks_the_cache_rules_file():
    out = promtool("check", "rules", str(CACHE_RULES_FILE))
    assert out.returncode == 0 and "SUCCESS: 2 rules found" in out.stdout, out.stdout + out.stderr


@needs_promtool
@pytest.mark.parametrize("broken", ["< 0", "> 0.85"])
def test_promtool_cache_unit_tests_can_fail(tmp_path, broken):
    # Without the prediction (never below -1 PB) or the threshold (above 100%): the filling
    # claim, or the full one, goes quiet, and the unit tests say so.
    text = CACHE_RULES_FILE.read_text()
    assert text.count(broken) == 1
    (tmp_path / CACHE_RULES_KEY).write_text(text.replace(broken, {"< 0": "< -1e15", "> 0.85": "> 1"}[broken]))
    shutil.copy(ROOT / "tests" / "chart" / "rules" / "cache_filling_test.yaml", tmp_path / "cache_filling_test.yaml")
    out = promtool("test", "rules", "cache_filling_test.yaml", cwd=tmp_path)
    claim = {"< 0": "kiln-engine-cache", "> 0.85": "archive"}[broken]
    assert out.returncode != 0 and f"claim=\"{claim}\"" in out.stderr, out.stdout + out.stderr


# ------------------------------------------------------------------ request-outcome rules

REFUSED_OUTCOMES = 'outcome=~"bad_request|refused"'


def request_rule_objects(*sets: str, api_versions: tuple[str, ...] = MONITORING_APIS) -> list[dict]:
    objs = render(extra=tuple(a for s in sets for a in ("--set", s)), api_versions=api_versions)
    return ([o for o in by_kind(objs, "PrometheusRule") if o["metadata"]["name"] == "kiln-requests"]
            + [o for o in by_kind(objs, "ConfigMap") if REQUEST_RULES_KEY in o.get("data", {})])


def request_rules_text(*sets: str) -> str:
    (cm,) = request_rule_objects("monitoring.requestRules.rulesConfigMap.enabled=true", *sets, api_versions=())
    return cm["data"][REQUEST_RULES_KEY]


@needs_helm
def test_the_plain_request_rules_file_is_the_chart_rendered_with_default_values():
    # One source: the template. `make rules` writes the file; this fails until it is rerun.
    assert REQUEST_RULES_FILE.read_text() == request_rules_text(), "run `make rules`"
    (rule,) = request_rule_objects()
    assert_valid_monitoring_object(rule)
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["spec"] == yaml.safe_load(REQUEST_RULES_FILE.read_text())


@needs_helm
def test_the_request_rules_render_only_when_enabled():
    (rule,) = request_rule_objects("monitoring.requestRules.prometheusRule.labels.release=kube-prometheus-stack")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert request_rule_objects(api_versions=()) == []  # no Prometheus Operator
    assert request_rule_objects("monitoring.requestRules.prometheusRule.enabled=false") == []
    (cm,) = request_rule_objects("monitoring.requestRules.prometheusRule.enabled=false",
                                 "monitoring.requestRules.rulesConfigMap.enabled=true",
                                 "monitoring.requestRules.rulesConfigMap.namespace=monitoring", api_versions=())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "kiln-requests-rules"
    assert cm["metadata"]["namespace"] == "monitoring"


def test_the_request_rules_are_the_contract():
    (group,) = yaml.safe_load(REQUEST_RULES_FILE.read_text())["groups"]
    (alert,) = group["rules"]
    # The receiver records it, and the documented route (kiln_autoscaling="true") delivers it.
    assert alert["alert"] == signals.REFUSED and signals.REFUSED in signals.RECEIVED
    assert signals.REFUSED not in ALERTS  # no scaling signal
    assert alert["labels"] == {"kiln_autoscaling": "true"}
    assert alert["annotations"]["value"] == "{{ $value }}"
    assert {"summary", "description"} <= set(alert["annotations"])
    assert metric_names(alert["expr"]) == {"kiln_requests_total"} and "kiln_requests_total" in RUNTIME_METRICS
    # The model's share (every pod), over the window, above the bound, at a minimum rate.
    assert f"sum by (namespace, model) (increase(kiln_requests_total{{{REFUSED_OUTCOMES}}}[5m]))" in alert["expr"]
    assert "sum by (namespace, model) (increase(kiln_requests_total[5m]))" in alert["expr"]
    assert ") > 0.5\n" in alert["expr"] and alert["expr"].index(") > 0.5") < alert["expr"].index("and on")
    assert "sum by (namespace, model) (rate(kiln_requests_total[5m])) >= 0.05" in alert["expr"]
    assert alert["for"] == "1m"


@needs_helm
def test_request_rule_values_reach_the_rules():
    (group,) = yaml.safe_load(request_rules_text(
        "monitoring.requestRules.refusedRatio=0.25", "monitoring.requestRules.window=10m",
        "monitoring.requestRules.minRate=1.5", "monitoring.requestRules.refusedFor=3m"))["groups"]
    (alert,) = group["rules"]
    assert f"increase(kiln_requests_total{{{REFUSED_OUTCOMES}}}[10m])" in alert["expr"]
    assert ") > 0.25\n" in alert["expr"] and "(rate(kiln_requests_total[10m])) >= 1.5" in alert["expr"]
    assert alert["for"] == "3m" and "in the last 10m" in alert["annotations"]["description"]
    for bad in ("monitoring.requestRules.refusedRatio=1", "monitoring.requestRules.refusedRatio=half",
                "monitoring.requestRules.minRate=-1", "monitoring.requestRules.window=5 minutes"):
        out = helm("template", "kiln", str(CHART), "--set", bad)
        assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr, bad


@needs_promtool
def test_promtool_checks_the_request_rules_file():
    out = promtool("check", "rules", str(REQUEST_RULES_FILE))
    assert out.returncode == 0 and "SUCCESS: 1 rules found" in out.stdout, out.stdout + out.stderr


@needs_promtool
@pytest.mark.parametrize("broken", ["min-rate", "per-pod"])
def test_promtool_request_unit_tests_can_fail(tmp_path, broken):
    # Without the minimum rate the trickle fires; a pod's share instead of the model's fires
    # for the split model: the unit tests say so.
    text = REQUEST_RULES_FILE.read_text()
    if broken == "min-rate":
        assert text.count(">= 0.05") == 1
        text, model = text.replace(">= 0.05", ">= 0"), "trickle"
    else:
        assert text.count("sum by (namespace, model) (increase(") == 2
        text = text.replace("sum by (namespace, model) (increase(", "sum by (namespace, model, pod) (increase(")
        model = "split"
    (tmp_path / REQUEST_RULES_KEY).write_text(text)
    shutil.copy(ROOT / "tests" / "chart" / "rules" / "requests_refused_test.yaml", tmp_path / "requests_refused_test.yaml")
    out = promtool("test", "rules", "requests_refused_test.yaml", cwd=tmp_path)
    assert out.returncode != 0 and f'model="{model}"' in out.stderr, out.stdout + out.stderr


# ------------------------------------------------------------------ dashboards

DASHBOARDS = sorted((CHART / "files" / "dashboards").glob("*.json"))


def panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_read_only_known_metrics():
    (group,) = yaml.safe_load(RULES_FILE.read_text())["groups"]
    known = RUNTIME_METRICS | DCGM_METRICS | OPERATOR_METRICS | {RECORDED, RECORDED_SHORT, "ALERTS"}
    assert {r["record"] for r in group["rules"] if "record" in r} <= known
    dashboard = json.loads((CHART / "files" / "dashboards" / "kiln-autoscaling.json").read_text())
    assert dashboard["uid"] == "kiln-autoscaling"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "namespace", "model"]
    exprs = panel_exprs(dashboard)
    read = set().union(*(metric_names(e) for _, e in exprs))
    assert read <= known
    # Utilization against target, replicas within bounds, decisions, the alerts.
    assert {RECORDED, "kiln_autoscaling_target_ratio", "kiln_autoscaling_replicas", "kiln_autoscaling_min_replicas",
            "kiln_autoscaling_max_replicas", "kiln_scaling_decisions_total", "ALERTS"} <= read
    for title, expr in exprs:
        receiver_wide = {m for m in OPERATOR_METRICS if m.startswith("kiln_alert")}  # no model label
        if metric_names(expr) & ({RECORDED, "ALERTS"} | OPERATOR_METRICS) - receiver_wide:
            assert 'namespace=~"$namespace"' in expr and 'model=~"$model"' in expr, title
    (alerts_expr,) = [e for _, e in exprs if "ALERTS" in metric_names(e)]
    assert 'kiln_autoscaling="true"' in alerts_expr


def test_the_dashboard_shows_the_engine_cache():
    dashboard = json.loads((CHART / "files" / "dashboards" / "kiln-autoscaling.json").read_text())
    cache = [(title, expr) for title, expr in panel_exprs(dashboard) if "kiln_engine_cache_" in expr]
    assert {title for title, _ in cache} == {"Engine cache: used and free", "Engine cache: how full",
                                             "Engine cache: entries", "Engine cache: oldest entry age"}
    read = set().union(*(metric_names(e) for _, e in cache))
    assert read == {"kiln_engine_cache_used_bytes", "kiln_engine_cache_free_bytes", "kiln_engine_cache_entry_bytes",
                    "kiln_engine_cache_entries", "kiln_engine_cache_oldest_entry_timestamp_seconds"} <= RUNTIME_METRICS
    for title, expr in cache:  # one line per claim (every pod reports its volume), in the chosen namespaces
        assert "by (namespace, claim)" in expr and 'namespace=~"$namespace"' in expr, title
    (age,) = [e for t, e in cache if t == "Engine cache: oldest entry age"]
    assert age.startswith("time() - min by (namespace, claim)")


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    # promtool parses them as recording rules (Grafana's $variables sit inside label matchers).
    for path in DASHBOARDS:
        rules = [{"record": f"dashboard:query:{i}", "expr": expr}
                 for i, (_, expr) in enumerate(panel_exprs(json.loads(path.read_text())))]
        f = tmp_path / f"{path.stem}.yaml"
        f.write_text(yaml.safe_dump({"groups": [{"name": path.stem, "rules": rules}]}))
        out = promtool("check", "rules", str(f))
        assert out.returncode == 0, out.stdout + out.stderr


@needs_helm
def test_dashboards_are_config_maps_for_the_grafana_sidecar():
    def dashboards(objs):
        return [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("kiln-dashboard-")]

    (cm,) = dashboards(render(scenario("default")))
    assert cm["metadata"]["name"] == "kiln-dashboard-autoscaling" and cm["metadata"]["namespace"] == NAMESPACE
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert [json.loads(cm["data"][p.name]) for p in DASHBOARDS] == [json.loads(p.read_text()) for p in DASHBOARDS]
    (cm,) = dashboards(render(scenario("monitoring")))
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "kiln"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Kiln"}
    assert dashboards(render(scenario("default"), extra=("--set", "monitoring.dashboards.enabled=false"))) == []
