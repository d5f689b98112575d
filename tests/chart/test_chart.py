"""The Helm chart, rendered by a real helm and checked as the API server would see it.

Every `charts/kiln/ci/*-values.yaml` scenario is rendered with `helm template
--include-crds --kube-version`, and every object validated by kubernetes-validate in strict
mode against Kubernetes 1.30 (the CRD as an apiextensions.k8s.io/v1 object). Needs `helm`
on PATH (`make test` puts the one from `make tools` there); skipped without it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kiln"
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.30.0"
NAMESPACE = "kiln-system"

HELM = shutil.which("helm")
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm is not on PATH: run `make tools` and put .tools on PATH (make test does)")


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


def render(*values: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "kiln", str(CHART), "--namespace", NAMESPACE, "--include-crds",
            "--kube-version", KUBE_VERSION, *extra]
    for v in values:
        args += ["-f", str(v)]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.load_all(out.stdout, Loader=_UniqueKeyLoader) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


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
                                           "namespaced-values.yaml", "no-pvc-values.yaml"}


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
        "--backend-version=tensorrt=10.13.0",
        "--default-targets=sm80,sm89,sm90",
        "--cache-claim=kiln-engine-cache",
    ]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
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
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"],
     "verbs": ["get", "list", "watch", "create", "patch", "update"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]
GATEWAY_RULE = {"apiGroups": ["gateway.networking.k8s.io"], "resources": ["httproutes"],
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
        *NAMESPACED_RULES, GATEWAY_RULE]
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
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-prod", "ml-staging"]
    for role in roles:
        assert role["rules"] == [{"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"],
                                  "verbs": ["get", "list", "watch", "patch"]},
                                 *NAMESPACED_RULES, GATEWAY_RULE]
    bindings = by_kind(objs, "RoleBinding")
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
])
def test_bad_values_are_rejected_by_the_schema(tmp_path, bad, message):
    f = tmp_path / "bad-values.yaml"
    f.write_text(bad)
    out = helm("template", "kiln", str(CHART), "-f", str(f))
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr
    assert message in out.stderr
