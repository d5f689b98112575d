"""The InferenceModel CRD: what `kubectl apply` accepts or rejects, defaults, explain, columns.

Manifests are validated the way the API server does it (runtime/api/spec.py): the CRD's
openAPIV3Schema through jsonschema, then every x-kubernetes-validations CEL rule through
cel-python. Each tests/api/invalid/*.yaml carries the exact messages it must be rejected
with in `# expect:` comments.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from kiln.runtime.api import enginekey, manifest, spec

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / spec.CRD_FILE
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted(
    p for p in [ROOT / "examples" / "demo" / "inferencemodel.yaml", ROOT / "examples" / "demo" / "cluster.yaml"]
    if p.exists())
INVALID = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))


def expected_messages(path: Path) -> list[str]:
    return [line[len("# expect: "):].rstrip("\n") for line in path.read_text().splitlines()
            if line.startswith("# expect: ")]


def walk(node: dict, path: str = ""):
    """Every schema node with its path (properties, map values, array items)."""
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}" if path else name)
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}[*]")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")


def rules():
    for path, node in walk(spec.schema()):
        for rule in node.get("x-kubernetes-validations") or []:
            yield path, rule


# ------------------------------------------------------------------ accepted manifests

def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"vision-resnet50.yaml", "text-bert.yaml", "multi-gpu.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_is_accepted(path):
    obj = manifest.load_manifest(path)
    assert obj["apiVersion"] == "kiln.dev/v1alpha1" and obj["kind"] == "InferenceModel"
    assert spec.validate(obj) == []


def test_multi_gpu_example_builds_three_architectures():
    engine = spec.apply_defaults(manifest.load_manifest(ROOT / "examples" / "multi-gpu.yaml"))["spec"]["engine"]
    assert sorted({enginekey.normalize_target(t) for t in engine["targets"]}) == ["sm80", "sm89", "sm90"]


def test_a_minimal_manifest_is_accepted():
    assert spec.validate({"model": {"uri": "https://models.example.com/m.onnx", "version": "1"}}) == []


def test_an_http_uri_is_accepted_with_a_pinned_digest():
    # An in-cluster model store without TLS: the digest, which the builder checks, is the integrity.
    uri = "http://models.models.svc.cluster.local/resnet50/v1.onnx"
    assert spec.validate_for_cluster({"model": {"uri": uri, "version": "1", "sha256": "ab" * 32}}) == []
    assert spec.validate({"model": {"uri": uri, "version": "1"}}) == expected_messages(
        Path(__file__).parent / "invalid" / "uri-http-without-sha256.yaml")


# ------------------------------------------------------------------ rejected manifests

@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_manifest_is_rejected_with_its_message(path):
    expected = expected_messages(path)
    assert expected, f"{path.name} has no '# expect:' line"
    assert spec.validate(manifest.load_manifest(path)) == expected


def test_every_rule_has_an_invalid_manifest():
    seen = "\n".join(m for p in INVALID for m in expected_messages(p))
    missing = [r["message"] for _, r in rules() if r["message"] not in seen]
    assert missing == []


def test_every_violation_class_has_an_invalid_manifest():
    seen = "\n".join(m for p in INVALID for m in expected_messages(p))
    for fragment in ("Unsupported value", "should match", "Required value",
                     "greater than or equal to", "less than or equal to", "must be of type",
                     "Too many", "Too long", "should have at least", "Duplicate value",
                     "unknown field"):
        assert fragment in seen, fragment


def test_spec_only_validation_reports_spec_paths():
    bad = {"model": {"uri": "pvc://m/x.onnx", "version": "1"},
           "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}
    assert spec.validate(bad) == [
        'spec.autoscaling: Invalid value: minReplicas must be <= maxReplicas']


def test_rules_see_defaults_like_the_api_server():
    # maxReplicas defaults to 4, so minReplicas 6 alone is rejected; 4 is fine.
    model = {"uri": "pvc://m/x.onnx", "version": "1"}
    assert spec.validate({"model": model, "autoscaling": {"minReplicas": 4}}) == []
    assert spec.validate({"model": model, "autoscaling": {"minReplicas": 6}}) == [
        'spec.autoscaling: Invalid value: minReplicas must be <= maxReplicas']


def test_a_number_bound_may_be_written_as_an_integer():
    # YAML `min: 1` is an int; the schema says number, so CEL compares doubles.
    model = {"uri": "pvc://m/x.onnx", "version": "1"}
    metric = {"name": "rps", "query": "vector(3)", "min": 1, "max": 2.5}
    assert spec.validate({"model": model, "rollout": {"analysis": {"metrics": [metric]}}}) == []


def test_status_written_by_the_operator_is_accepted():
    obj = manifest.load_manifest(ROOT / "examples" / "vision-resnet50.yaml")
    obj["status"] = {
        "phase": "Progressing", "observedGeneration": 3, "engineKey": "0123456789abcdef0123",
        "conditions": [{"type": "EngineReady", "status": "True", "observedGeneration": 3,
                        "lastTransitionTime": "2025-01-01T00:00:00Z", "reason": "CacheHit",
                        "message": "1 engine in the cache"}],
        "engines": [{"key": "0123456789abcdef0123", "target": "H100", "architecture": "sm90",
                     "path": "vision/resnet50/0123456789abcdef0123", "sha256": "ab" * 32,
                     "sizeBytes": 51200000, "buildSeconds": 0, "cacheHit": True}],
        "stable": {"version": "v1.6", "engineKey": "fedcba9876543210fedc", "weight": 80,
                   "replicas": 2, "readyReplicas": 2},
        "canary": {"version": "v1.7", "engineKey": "0123456789abcdef0123", "weight": 20,
                   "step": 0, "replicas": 1, "readyReplicas": 1,
                   "startedAt": "2025-01-01T00:00:00Z", "stepStartedAt": "2025-01-01T00:00:00Z",
                   "analysisFailures": 0},
        "replicas": 3, "readyReplicas": 3, "selector": "kiln.dev/model=resnet50",
        "scaling": {"replicas": 3, "generation": 4, "lastScaleTime": "2025-01-01T00:00:00Z",
                    "lastDecision": "2->3 UtilizationHigh",
                    "history": [{"time": "2025-01-01T00:00:00Z", "from": 2, "to": 3, "reason": "UtilizationHigh",
                                 "source": "KilnUtilizationHigh", "message": "utilization 0.93, target 0.70"}]},
    }
    assert spec.validate(obj) == []
    obj["status"]["conditions"].append(dict(obj["status"]["conditions"][0]))
    obj["status"]["phase"] = "Happy"
    assert spec.validate(obj) == [
        'status.phase: Unsupported value: "Happy": supported values: "Building", '
        '"Deploying", "Ready", "Progressing", "Degraded", "Failed"',
        'status.conditions[1]: Duplicate value: {"type": "EngineReady"}',
        spec.RULES_NOT_CHECKED,  # an unsupported value stops the CEL rules, as in the API server
    ]


# ------------------------------------------------------------------ defaulting

def test_apply_defaults_fills_what_the_api_server_would():
    obj = manifest.load_manifest(ROOT / "examples" / "text-bert.yaml")
    d = spec.apply_defaults(obj)["spec"]
    assert d["engine"]["builderFlags"] == {}
    assert d["build"] == {
        "nodeSelector": {"kiln.dev/role": "builder"},
        "tolerations": [{"key": "kiln.dev/role", "operator": "Equal", "value": "builder",
                         "effect": "NoSchedule"}],
        "timeoutSeconds": 3600, "backoffLimit": 1, "ttlSecondsAfterFinished": 86400}
    assert d["cache"] == {"claimName": "kiln-engine-cache"}
    assert d["runtime"]["batching"]["maxBatchSize"] == 16  # set by the user, kept
    assert d["runtime"]["batching"]["enabled"] is True
    assert d["runtime"]["port"] == 8080 and d["runtime"]["contextsPerGPU"] == 2
    assert d["autoscaling"] == {"enabled": False, "minReplicas": 1, "maxReplicas": 4,
                                "targetGPUUtilization": 70, "scaleUpCooldownSeconds": 60,
                                "scaleDownCooldownSeconds": 300, "maxStep": 2,
                                "scaleDownStabilizationSeconds": 300}
    assert [s["pauseSeconds"] for s in d["rollout"]["steps"]] == [120, 300, 600]
    assert d["rollout"]["traffic"] == {"mechanism": "ReplicaRatio"}
    assert "targets" in d["engine"] and "image" not in d["runtime"]  # operator's defaults


def test_apply_defaults_on_a_bare_spec_matches_the_whole_object():
    obj = manifest.load_manifest(ROOT / "examples" / "multi-gpu.yaml")
    assert spec.apply_defaults(obj["spec"]) == spec.apply_defaults(obj)["spec"]


def test_apply_defaults_defaults_array_items_and_null_fields():
    d = spec.apply_defaults({"model": {"uri": "pvc://m/x.onnx", "version": "1"},
                             "rollout": {"steps": [{"weight": 5}, {"weight": 40}]},
                             "runtime": {"replicas": None}})
    assert d["rollout"]["steps"] == [{"weight": 5, "pauseSeconds": 60},
                                     {"weight": 40, "pauseSeconds": 60}]
    assert d["runtime"]["replicas"] == 1


def test_apply_defaults_is_idempotent_and_pure():
    obj = manifest.load_manifest(ROOT / "examples" / "vision-resnet50.yaml")
    before = copy.deepcopy(obj)
    once = spec.apply_defaults(obj)
    assert obj == before
    assert spec.apply_defaults(once) == once
    once["spec"]["build"]["nodeSelector"]["x"] = "y"  # defaults are copies, not shared
    assert "x" not in spec.apply_defaults(before)["spec"]["build"]["nodeSelector"]


def test_schema_defaults_match_the_engine_key_defaults():
    engine = spec.apply_defaults({"model": {"uri": "pvc://m/x.onnx", "version": "1"}})["engine"]
    inputs = enginekey.key_inputs({"uri": "pvc://m/x.onnx", "version": "1"}, {}, "sm90", "10")
    assert (engine["backend"], engine["precision"]) == (inputs.backend, inputs.precision)


def test_load_manifest_wants_exactly_one_inferencemodel(tmp_path):
    f = tmp_path / "two.yaml"
    f.write_text("kind: ConfigMap\n---\nkind: InferenceModel\n---\nkind: InferenceModel\n")
    with pytest.raises(ValueError, match="expected one InferenceModel document, found 2"):
        manifest.load_manifest(f)


# ------------------------------------------------------------------ the CRD itself

def test_crd_identity():
    crd = spec.load_crd()
    assert crd["metadata"]["name"] == "inferencemodels.kiln.dev"
    assert crd["spec"]["group"] == "kiln.dev" and crd["spec"]["scope"] == "Namespaced"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == (
        "InferenceModel", "inferencemodels", ["kim"], ["kiln"])
    # Gateway API Inference Extension's InferenceModel: short names must not collide.
    assert not {"im", "infm", "inferencemodel"} & set(names["shortNames"])
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]


def test_packaged_crd_is_the_repository_file():
    assert spec.load_crd() == yaml.safe_load(CRD_PATH.read_text())


def test_every_field_has_a_description():
    # metadata is the exception: the API server refuses anything but its type there.
    missing = [p for p, n in walk(spec.schema()) if p not in ("", "metadata") and not n.get("description")]
    assert missing == []


def test_schema_is_structural():
    problems = []
    for path, node in walk(spec.schema()):
        if path == "metadata":
            if set(node) - {"type"}:  # the real API server's rule (no description either)
                problems.append(f"{path}: only type is allowed")
            continue
        free = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        if "type" not in node and not free:
            problems.append(f"{path}: no type")
        if node.get("type") == "object" and "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties together")
        if node.get("type") == "array" and "items" not in node:
            problems.append(f"{path}: array without items")
        if node.get("uniqueItems"):
            problems.append(f"{path}: uniqueItems is forbidden in CRDs")
        for branch in node.get("anyOf", []):
            if set(branch) - {"type"}:
                problems.append(f"{path}: anyOf branches may only narrow the type")
        if "default" in node and not jsonschema.Draft202012Validator(node).is_valid(node["default"]):
            problems.append(f"{path}: default does not validate")
    assert problems == []


def test_lists_and_maps_with_rules_are_bounded():
    # The API server rejects a CRD whose CEL cost estimate is unbounded.
    unbounded = [p for p, n in walk(spec.schema())
                 if (n.get("type") == "array" and "maxItems" not in n)
                 or (n.get("x-kubernetes-validations") and n.get("type") == "object"
                     and "additionalProperties" in n and "maxProperties" not in n)]
    assert unbounded == []


K8S_ONLY_CEL = ("isSorted", "sum(", "indexOf", "lastIndexOf", "url(", "isURL", "quantity(",
                "ip(", "cidr(", "lowerAscii", "upperAscii", ".split(", ".join(", ".replace(",
                ".trim(", ".format(", "optional", "?.", "sets.", "isQuantity")


def test_cel_rules_use_only_standard_cel_and_compile():
    import celpy

    env = celpy.Environment()
    for path, rule in rules():
        assert not [f for f in K8S_ONLY_CEL if f in rule["rule"]], (path, rule["rule"])
        assert rule.get("message"), (path, rule["rule"])
        env.compile(rule["rule"])


def test_printer_columns_point_into_the_schema():
    version = spec.load_crd()["spec"]["versions"][0]
    paths = {p for p, _ in walk(spec.schema())}
    cols = version["additionalPrinterColumns"]
    assert [c["name"] for c in cols if not c.get("priority")] == [
        "Phase", "Version", "Engine", "Ready", "Desired", "Scaling", "Canary", "Step", "Cache", "Age"]
    for c in cols:
        path = c["jsonPath"].lstrip(".")
        assert path == "metadata.creationTimestamp" or path in paths, c


def test_scale_subresource_points_into_the_schema():
    version = spec.load_crd()["spec"]["versions"][0]
    scale, root = version["subresources"]["scale"], spec.schema()
    assert "status" in version["subresources"]
    for key, want in (("specReplicasPath", "integer"), ("statusReplicasPath", "integer"),
                      ("labelSelectorPath", "string")):
        node = root
        for part in scale[key].lstrip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == want, key


def test_api_reference_covers_every_spec_field():
    doc = (ROOT / "docs" / "api.md").read_text()
    fields = [p for p, _ in walk(spec.schema()["properties"]["spec"])
              if p and "[*]" not in p and not p.endswith("[]") and not re.search(r"(tolerations|resources|affinity)\b.", p)]
    missing = [p for p in fields if f"`{p}`" not in doc]
    assert missing == []


def test_defaults_and_validation_accept_read_only_mapping_views():
    # kopf passes handlers `spec` as a Mapping view, not a dict.
    from types import MappingProxyType

    spec_view = MappingProxyType({"model": {"uri": "pvc://m/x.onnx", "version": "1"}})
    assert spec.apply_defaults(spec_view)["runtime"]["replicas"] == 1
    assert spec.validate(spec_view) == []


def test_file_uris_are_for_kiln_dev_only():
    s = {"model": {"uri": "file:///models/m.onnx", "version": "1"}}
    assert spec.validate(s) == []  # the CRD (and `kiln dev`) accept it
    [problem] = spec.validate_for_cluster(s)
    assert problem.startswith('spec.model.uri: Invalid value: "file:///models/m.onnx"') and "kiln dev" in problem
    assert spec.validate_for_cluster({"model": {"uri": "pvc://models/m.onnx", "version": "1"}}) == []
