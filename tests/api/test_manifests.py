"""Manifest input that is not a well-formed InferenceModel: what `manifest.load_manifest` and
`spec.validate` (what `kiln dev` runs before anything else) say about it.

Loading is bounded (a regular file, at most MAX_MANIFEST_BYTES, no duplicate keys, aliases
expanding to at most MAX_YAML_NODES nodes and MAX_YAML_DEPTH levels) and every refusal is
one ManifestError line; validation answers any shape of object with messages, never an
exception.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from kiln.runtime.api import manifest, spec

ROOT = Path(__file__).resolve().parents[2]
GOOD = """\
apiVersion: kiln.dev/v1alpha1
kind: InferenceModel
metadata:
  name: resnet
  namespace: vision
spec:
  model:
    uri: pvc://models/resnet.onnx
    version: "1"
"""


def write(tmp: Path, text: str | bytes, name: str = "m.yaml") -> Path:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def refusal(path: Path) -> str:
    with pytest.raises(manifest.ManifestError) as e:
        manifest.load_manifest(path)
    message = str(e.value)
    assert "\n" not in message and isinstance(e.value, ValueError)
    return message


# ------------------------------------------------------------------ reading the file

def test_a_good_manifest_loads():
    obj = manifest.load_manifest(ROOT / "examples" / "demo" / "inferencemodel.yaml")
    assert obj["metadata"]["name"] == "iris" and spec.validate(obj) == []


@pytest.mark.timeout(10)  # a FIFO opened for reading without O_NONBLOCK waits for a writer forever
@pytest.mark.parametrize("kind", ["a FIFO (named pipe)", "a directory", "a character device"])
def test_only_a_regular_file_is_read(tmp_path, kind):
    path = {"a FIFO (named pipe)": tmp_path / "fifo.yaml", "a directory": tmp_path,
            "a character device": Path("/dev/zero")}[kind]
    if kind.startswith("a FIFO"):
        os.mkfifo(path)
    assert refusal(path) == f"{path} is {kind}, not a regular file; a manifest is read only from a regular file"


def test_a_missing_file(tmp_path):
    assert refusal(tmp_path / "absent.yaml") == f"{tmp_path / 'absent.yaml'}: no such file"


def test_the_size_bound(tmp_path):
    padding = manifest.MAX_MANIFEST_BYTES - len(GOOD)
    at_bound = write(tmp_path, GOOD + "#" * (padding - 1) + "\n")
    assert at_bound.stat().st_size == manifest.MAX_MANIFEST_BYTES
    assert manifest.load_manifest(at_bound)["metadata"]["name"] == "resnet"
    over = write(tmp_path, GOOD + "#" * padding + "\n")
    assert refusal(over) == (f"{over}: larger than {manifest.MAX_MANIFEST_BYTES} bytes (1 MiB), the limit for "
                             f"a manifest; refusing it")


def test_not_utf8_and_not_yaml(tmp_path):
    assert refusal(write(tmp_path, b"kind: \xff\xfe\n")) == f"{tmp_path / 'm.yaml'}: not UTF-8 text (byte 6)"
    path = write(tmp_path, "kind: InferenceModel\nspec:\n  model: [1\n")
    message = refusal(path)
    assert message.startswith(f"{path}, line ") and "expected ',' or ']'" in message


@pytest.mark.parametrize("text, key, line, first", [
    (GOOD + "kind: InferenceModel\n", "kind", 10, 2),  # top level
    (GOOD.replace('    version: "1"\n', '    version: "1"\n    version: "2"\n'), "version", 10, 9),  # nested
    (GOOD + "  engine:\n    profiles:\n    - {input: x, min: [1], input: y}\n", "input", 12, 12),  # flow, in a list
    (GOOD.replace("  name: resnet\n", "  name: resnet\n  name: Resnet\n"), "name", 5, 4),
    (GOOD + "  model: {uri: pvc://models/other.onnx}\n", "model", 10, 7),
    (GOOD + "  engine:\n    builderFlags:\n      1: a\n      1: b\n", 1, 13, 12),  # not only strings
])
def test_a_duplicate_key_is_refused_with_its_line(tmp_path, text, key, line, first):
    # PyYAML would keep the last value silently; the API server's strict decoding refuses.
    path = write(tmp_path, text)
    message = refusal(path)
    shown = f'"{key}"' if isinstance(key, str) else key
    assert message.startswith(f"{path}, line {line}, column ")
    assert message.endswith(f": duplicate key {shown} (first at line {first})")


def test_ordinary_anchors_aliases_and_merge_keys_still_work(tmp_path):
    path = write(tmp_path, GOOD + """\
  engine:
    backend: onnxruntime
    precision: fp32
    targets: [cpu]
    profiles:
    - &first {input: x, min: &shape [1, 4], opt: *shape, max: [8, 4]}
    - <<: *first
      input: y
""")
    obj = manifest.load_manifest(path)
    x, y = obj["spec"]["engine"]["profiles"]
    assert x["opt"] == [1, 4] and y == {"input": "y", "min": [1, 4], "opt": [1, 4], "max": [8, 4]}
    assert spec.validate(obj) == []


LAUGHS = GOOD + "  engine:\n    builderFlags:\n      lol0: &l0 lol\n" + "".join(
    f"      lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))


@pytest.mark.parametrize("name, text, problem", [
    # The classic "billion laughs": 9 levels of 9 aliases, 1.4 KB, 10^9 strings once expanded.
    ("billion laughs", LAUGHS, f"the document expands to more than {manifest.MAX_YAML_NODES} YAML nodes "
                               f"(aliases counted at their expansion); refusing it"),
    ("mappings of aliases", "a: &a {x: 1, y: 1, z: 1, w: 1}\n" + "".join(
        f"{c}: &{c} {{{', '.join(f'k{j}: *{p}' for j in range(12))}}}\n"
        for p, c in zip("abcdefgh", "bcdefghi")),
     f"the document expands to more than {manifest.MAX_YAML_NODES} YAML nodes (aliases counted at their "
     f"expansion); refusing it"),
    ("an alias inside itself", "kind: InferenceModel\nloop: &loop [*loop]\n",
     f"the document nests deeper than {manifest.MAX_YAML_DEPTH} levels; refusing it"),
    ("deep nesting", "a: " + "[" * (manifest.MAX_YAML_DEPTH + 1) + "]" * (manifest.MAX_YAML_DEPTH + 1) + "\n",
     f"the document nests deeper than {manifest.MAX_YAML_DEPTH} levels; refusing it"),
])
def test_alias_bombs_and_deep_nesting_are_refused_at_once(tmp_path, name, text, problem):
    path = write(tmp_path, text)
    assert os.path.getsize(path) < 4096
    started = time.monotonic()
    message = refusal(path)
    assert time.monotonic() - started < 1.0, name
    assert message.startswith(f"{path}, line ") and message.endswith(f": {problem}")


def test_nesting_too_deep_for_the_yaml_parser_is_refused_too(tmp_path):
    depth = 2 * sys.getrecursionlimit()  # PyYAML composes recursively: past Python's recursion limit
    path = write(tmp_path, "a: " + "[" * depth + "]" * depth + "\n")
    assert refusal(path) == f"{path}: the YAML nests deeper than {manifest.MAX_YAML_DEPTH} levels; refusing it"


def test_a_file_without_an_inferencemodel_names_the_kinds_it_has(tmp_path):
    path = write(tmp_path, GOOD.replace("kind: InferenceModel", "kind: Inferencemodel") + "---\nkind: ConfigMap\n")
    assert refusal(path) == (f'{path}: expected one InferenceModel document, found 0 (the file has '
                             f'kind: "ConfigMap", "Inferencemodel")')


# ------------------------------------------------------------------ the object's identity

def obj(**changes) -> dict:
    o = yaml.safe_load(GOOD)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = o
        for p in parents:
            target = target[p]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return o


def test_api_version_and_kind_must_be_this_apis():
    assert spec.validate(obj(apiVersion="kiln.dev/v1")) == [
        'apiVersion: Unsupported value: "kiln.dev/v1": supported values: "kiln.dev/v1alpha1"']
    assert spec.validate(obj(apiVersion=...)) == ["apiVersion: Required value"]
    assert spec.validate(obj(kind="Deployment")) == [
        'kind: Unsupported value: "Deployment": supported values: "InferenceModel"']
    assert spec.validate(obj(apiVersion=1))[0] == (
        'apiVersion: Invalid value: "integer": apiVersion in body must be of type string: "integer"')


SUBDOMAIN = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
             "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
             "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
LABEL = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
         "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
         "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")


# The CRD's own rules on the name (at its root): what the objects Kiln makes can carry.
TOO_LONG, NOT_A_SERVICE_NAME = (f"<nil>: Invalid value: {r['message']}" for r in spec.schema()["x-kubernetes-validations"])


@pytest.mark.parametrize("name", ["Resnet", "RESNET", "res_net", "res net", "-resnet", "resnet-", "resnet.",
                                  ".resnet", "res..net", "résnet", "resnet/1"])
def test_an_invalid_name_gets_the_api_servers_message(name):
    assert spec.validate(obj(metadata__name=name)) == [f'metadata.name: Invalid value: "{name}": {SUBDOMAIN}',
                                                       NOT_A_SERVICE_NAME]


def test_names_the_api_server_accepts_and_lengths():
    for name in ("r", "resnet", "resnet-50", "a" * 56):
        assert spec.validate(obj(metadata__name=name)) == [], name
    for name in ("resnet.v1.example", "0", "9lives"):  # Kubernetes names, but no Service's
        assert spec.validate(obj(metadata__name=name)) == [NOT_A_SERVICE_NAME], name
    assert spec.validate(obj(metadata__name="a" * 57)) == [TOO_LONG]
    assert spec.validate(obj(metadata__name="a" * 254)) == [
        f'metadata.name: Invalid value: "{"a" * 254}": must be no more than 253 characters', TOO_LONG]
    assert spec.validate(obj(metadata__name=...)) == ["metadata.name: Required value"]
    assert spec.validate(obj(metadata__name="")) == ["metadata.name: Required value"]
    assert spec.validate(obj(metadata__name=50)) == [
        'metadata.name: Invalid value: "integer": metadata.name in body must be of type string: "integer"']


def test_the_namespace_is_a_label():
    assert spec.validate(obj(metadata__namespace="Vision")) == [
        f'metadata.namespace: Invalid value: "Vision": {LABEL}']
    assert spec.validate(obj(metadata__namespace="a.b")) == [f'metadata.namespace: Invalid value: "a.b": {LABEL}']
    assert spec.validate(obj(metadata__namespace="a" * 64)) == [
        f'metadata.namespace: Invalid value: "{"a" * 64}": must be no more than 63 characters']
    assert spec.validate(obj(metadata__namespace=...)) == []  # kiln dev uses "default"


# ------------------------------------------------------------------ wrong types anywhere

def field_paths(node: dict, parts: tuple = ()):
    """(path parts, schema node) of every field the schema describes: properties, array items
    (index 0), map values (key "k")."""
    yield parts, node
    for name, sub in (node.get("properties") or {}).items():
        yield from field_paths(sub, parts + (name,))
    if isinstance(node.get("additionalProperties"), dict):
        yield from field_paths(node["additionalProperties"], parts + ("k",))
    if isinstance(node.get("items"), dict):
        yield from field_paths(node["items"], parts + (0,))


def put(o: dict, parts: tuple, value) -> dict:
    """`o` with `value` at `parts`, creating (or replacing) the containers on the way."""
    cur = o
    for part, nxt in zip(parts, parts[1:]):
        want = list if isinstance(nxt, int) else dict
        if isinstance(part, int):
            if not cur:
                cur.append(want())
            elif not isinstance(cur[0], want):
                cur[0] = want()
            cur = cur[0]
        else:
            if not isinstance(cur.get(part), want):
                cur[part] = want()
            cur = cur[part]
    if isinstance(parts[-1], int):
        cur[:1] = [value]
    else:
        cur[parts[-1]] = value
    return o


def printed(parts: tuple) -> str:
    """The path as the schema errors print it."""
    out = ""
    for p in parts:
        out = f"{out}[{p}]" if isinstance(p, int) else f"{out}.{p}" if out else p
    return out


# One value of each JSON type; each field gets those its schema type does not allow.
WRONG = {"array": [1], "object": {"a": 1}, "string": "x", "integer": 3, "number": 2.5, "boolean": True}
ALLOWS = {"array": {"array"}, "object": {"object"}, "string": {"string"}, "integer": {"integer"},
          "number": {"number", "integer"}, "boolean": {"boolean"}}


def test_validate_answers_a_wrong_type_at_every_field_with_a_message():
    # `engine: [1]` once ended in a TypeError; every field of the schema, every wrong type.
    base = manifest.load_manifest(ROOT / "examples" / "vision-resnet50.yaml")
    checked = 0
    for parts, node in field_paths(spec.schema()):
        if not parts or "type" not in node:  # int-or-string and free-form fields take anything
            continue
        for jtype, value in WRONG.items():
            if jtype in ALLOWS[node["type"]]:
                continue
            o = put(copy.deepcopy(base), parts, copy.deepcopy(value))
            errors = spec.validate(o)
            where = printed(parts)
            assert (f'{where}: Invalid value: "{jtype}": {where} in body must be of type '
                    f'{node["type"]}: "{jtype}"') in errors, (where, value, errors)
            assert errors[-1] == spec.RULES_NOT_CHECKED, errors
            assert isinstance(spec.apply_defaults(o), dict)
            checked += 1
    assert checked > 900


def test_a_wrong_type_stops_the_cel_rules_as_in_the_api_server():
    # minReplicas 6 > maxReplicas would fail a rule; with a wrongly typed field the rules do not run.
    o = obj(spec={"model": {"uri": "pvc://m/x.onnx", "version": "1"},
                  "autoscaling": {"minReplicas": 6, "maxReplicas": 4, "maxStep": "two"}})
    assert spec.validate(o) == [
        'spec.autoscaling.maxStep: Invalid value: "string": spec.autoscaling.maxStep in body must be of type '
        'integer: "string"', spec.RULES_NOT_CHECKED]
    del o["spec"]["autoscaling"]["maxStep"]
    assert spec.validate(o) == ["spec.autoscaling: Invalid value: minReplicas must be <= maxReplicas"]


@pytest.mark.parametrize("value", [None, [1], "x", 3, True, {"a": [1]}])
def test_validate_for_cluster_takes_any_spec_shape(value):
    errors = spec.validate_for_cluster({"model": value, "engine": {"builderFlags": value}})
    assert all(isinstance(e, str) for e in errors)
