"""The InferenceModel API in Python: the CRD, defaulting and validation as the API server does them.

The CRD (`crds/inferencemodels.kiln.dev.yaml`, shipped in the wheel as `kiln.crds`) is the
one source of truth; nothing here restates its fields. Reading a manifest file is
manifest.py's (`load_manifest`).

- `load_crd()`, `schema()`: the CRD and its v1alpha1 `openAPIV3Schema`.
- `apply_defaults(obj)`: structural defaulting, as the API server applies the schema's
  `default`s. Takes a whole InferenceModel (a dict with any of apiVersion, kind, metadata,
  spec, status) or just its spec (the operator calls it on `body.spec`, so it works against
  an emulated API server that does not default). Returns a new dict.
  `runtime_with_defaults(runtime)`: the same for a bare `spec.runtime`.
- `validate(obj)`: what `kubectl apply` would be told, as a list of messages formatted like
  the API server's (`spec.autoscaling: Invalid value: minReplicas must be <=
  maxReplicas`); empty when the object is accepted. Same object-or-spec rule as above; a
  whole object's apiVersion, kind and metadata name and namespace are checked too. Never
  raises for a wrongly typed value anywhere in the object: that is a message too.
- `is_name(s)`, `is_namespace(s)`: whether a string may name an InferenceModel, a namespace
  (the same rules; the alert receiver checks its labels with them).

Pure Python with PyYAML and jsonschema; the CEL rules run in cel.py (cel-python, imported
only when a rule runs).
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import re
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import yaml

from kiln.runtime.api.cel import run_rule
from kiln.runtime.api.contract import API_VERSION, GROUP, KIND, PLURAL, VERSION  # noqa: F401 (re-exported)
from kiln.runtime.api.fielderrors import field_path, go_format, join_path, translate, type_error

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"

_OBJECT_KEYS = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})


# ---------------------------------------------------------------------------- the CRD

@functools.lru_cache(maxsize=1)
def _crd_text() -> str:
    return importlib.resources.files("kiln.crds").joinpath(CRD_FILE).read_text(encoding="utf-8")


def load_crd() -> dict:
    """The CustomResourceDefinition, parsed from the copy inside the installed package."""
    return yaml.safe_load(_crd_text())


@functools.lru_cache(maxsize=4)
def _schema(version: str) -> dict:
    for v in load_crd()["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{CRD_NAME} has no version {version!r}")


def schema(version: str = VERSION) -> dict:
    """The `openAPIV3Schema` of one served version (a fresh copy; callers may change it)."""
    return copy.deepcopy(_schema(version))


def _plain(obj: Mapping) -> dict:
    """A deep plain-dict copy (kopf hands handlers Mapping views such as `kopf.Spec`)."""
    if not isinstance(obj, Mapping):
        raise TypeError(f"expected a mapping, got {type(obj).__name__}")
    return copy.deepcopy(dict(obj))


def _split(obj: dict) -> tuple[dict, str]:
    """(schema node, path prefix) for a whole object or a bare spec."""
    root = _schema(VERSION)
    if _OBJECT_KEYS & obj.keys():
        return root, ""
    return root["properties"]["spec"], "spec"


# ---------------------------------------------------------------------------- defaulting

def apply_defaults(obj: Mapping) -> dict:
    """A copy of `obj` with every absent (or null) property that has a schema default set.

    Like the API server's structural defaulting: a defaulted object is itself defaulted
    (so `autoscaling: {}` gains minReplicas, maxReplicas, ...), array items and map values
    are defaulted with their item schema, unknown fields are kept untouched. Idempotent.
    """
    value = _plain(obj)
    node, _ = _split(value)
    return _default(value, node)


def _default(value: Any, node: dict) -> Any:
    if isinstance(value, dict):
        props = node.get("properties")
        if props:
            for name, sub in props.items():
                # Absent: defaulted. Null: defaulted too, unless the field is nullable (null is
                # then a value, e.g. "this check off"), as the API server does.
                if "default" in sub and (name not in value or value[name] is None and not sub.get("nullable")):
                    value[name] = copy.deepcopy(sub["default"])
                if name in value:
                    value[name] = _default(value[name], sub)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for k in list(value):
                if not props or k not in props:
                    value[k] = _default(value[k], extra)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_default(v, node["items"]) for v in value]
    return value


def runtime_with_defaults(runtime: Mapping[str, Any] | None = None) -> dict:
    """`spec.runtime` with the CRD's defaults applied, as the API server stores it: for code
    that writes a runtime spec by hand (tests, benchmarks) instead of reading a stored one."""
    return apply_defaults({"runtime": dict(runtime or {})})["runtime"]


def require_keys(section: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    """ValueError naming each of `keys` that `section` (the map at `where`, e.g.
    `runtime.batching`) lacks. Code that reads a spec relies on its defaults having been
    applied (by the API server, `kiln serve`, runtime_with_defaults) and restates none."""
    missing = [f"{where}.{k}" for k in keys if k not in section]
    if missing:
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: the spec "
                         f"needs the CRD's defaults applied (kiln.runtime.api.spec.apply_defaults)")


# ---------------------------------------------------------------------------- validation

def validate(obj: Mapping) -> list[str]:
    """The API server's answer to `obj`: one message per problem, none when accepted.

    Defaults are applied first (the API server defaults before it validates). Checks, in
    order: unknown fields (kubectl's strict field validation), the OpenAPI schema
    (jsonschema; `x-kubernetes-*` keys are not jsonschema's), `x-kubernetes-list-type`
    set/map duplicates, and every `x-kubernetes-validations` CEL rule at its node, with
    `self` bound to that node. Transition rules (those using `oldSelf`) are skipped: there
    is no old object here. As the API server does, the CEL rules are skipped when the schema
    found a wrong type, a missing field, an unsupported value or a value too long or with too
    many items (the rules assume the schema's shape), and a line says so. A whole object's
    apiVersion and kind must be this API's, and its metadata name and namespace valid
    Kubernetes names.
    """
    plain = _plain(obj)
    node, prefix = _split(plain)
    errors = [] if prefix else _object_errors(plain)
    errors += [f'unknown field "{p}"' for p in _unknown_fields(plain, node, prefix)]
    value = apply_defaults(plain)
    schema_errors, blocking = _schema_errors(value, node, prefix)
    errors += schema_errors
    # A whole object with no name (or not a string) never reaches the rules: the API server
    # stops at that. The root's rules read metadata.name.
    name = _get(plain, "metadata", "name")
    unnamed = not prefix and not (isinstance(name, str) and name)
    errors += _walk_k8s(value, node, prefix, rules=not blocking and not unnamed)
    if blocking:
        errors.append(RULES_NOT_CHECKED)
    errors += _builder_flag_errors(value, prefix)
    errors += _warmup_errors(value, prefix)
    return errors


# The API server's words when a blocking schema error stops the CEL rules.
RULES_NOT_CHECKED = ('<nil>: Invalid value: null: some validation rules were not checked because the '
                     'object was invalid; correct the existing errors to complete validation')
# jsonschema keywords whose failures are the API server's blocking errors (TypeInvalid,
# Required, NotSupported, TooLong, TooMany).
_BLOCKING = frozenset({"type", "anyOf", "required", "enum", "maxLength", "maxItems", "maxProperties"})

# Object names as apimachinery validates them (metadata.name of a custom resource: a DNS-1123
# subdomain; metadata.namespace: a DNS-1123 label), with its messages.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MAX_NAME, MAX_NAMESPACE = 253, 63
_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                  "'-' or '.', and must start and end with an alphanumeric character (e.g. "
                  f"'example.com', regex used for validation is '{_SUBDOMAIN.pattern}')")
_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
              "and must start and end with an alphanumeric character (e.g. 'my-name',  or "
              f"'123-abc', regex used for validation is '{_LABEL.pattern}')")


def _object_errors(obj: dict) -> list[str]:
    """apiVersion, kind, metadata.name and metadata.namespace of a whole object."""
    errors = []
    for field, want in (("apiVersion", API_VERSION), ("kind", KIND)):
        got = obj.get(field)
        if got is None or got == "":
            errors.append(f"{field}: Required value")
        elif isinstance(got, str) and got != want:  # another type: the schema says so
            errors.append(f"{field}: Unsupported value: {go_format(got)}: supported values: {go_format(want)}")
    meta = obj.get("metadata") or {}
    if isinstance(meta, dict):  # another type: the schema says so
        if meta.get("name") in (None, ""):
            errors.append("metadata.name: Required value")
        else:
            errors += _name_errors("metadata.name", meta["name"], MAX_NAME, _SUBDOMAIN, _SUBDOMAIN_MSG)
        if meta.get("namespace") not in (None, ""):
            errors += _name_errors("metadata.namespace", meta["namespace"], MAX_NAMESPACE, _LABEL, _LABEL_MSG)
    return errors


def is_name(value: Any) -> bool:
    """Whether `value` may be an InferenceModel's metadata.name."""
    return isinstance(value, str) and len(value) <= MAX_NAME and _SUBDOMAIN.fullmatch(value) is not None


def is_namespace(value: Any) -> bool:
    """Whether `value` may be a namespace's name."""
    return isinstance(value, str) and len(value) <= MAX_NAMESPACE and _LABEL.fullmatch(value) is not None


def _name_errors(where: str, value: Any, max_len: int, pattern: re.Pattern, message: str) -> list[str]:
    if not isinstance(value, str):
        return [type_error(where, "string", value)]
    errors = []
    if len(value) > max_len:
        errors.append(f"{where}: Invalid value: {go_format(value)}: must be no more than {max_len} characters")
    if not pattern.fullmatch(value):
        errors.append(f"{where}: Invalid value: {go_format(value)}: {message}")
    return errors


def _get(value: Any, *keys: str) -> Any:
    """value[k1][k2]..., or None where a level is missing or not an object."""
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


# URI schemes that only `kiln dev` reads: a build Job would read its builder node's disk.
DEV_ONLY_SCHEMES = ("file:",)


def validate_for_cluster(obj: Mapping) -> list[str]:
    """`validate(obj)` plus what the operator refuses in a cluster and `kiln dev` accepts:
    a `file://` model URI (the CRD allows it so that one manifest serves both)."""
    errors = validate(obj)
    plain = _plain(obj)
    spec = plain.get("spec") if _OBJECT_KEYS & plain.keys() else plain
    uri = _get(spec, "model", "uri")
    if isinstance(uri, str) and uri.startswith(DEV_ONLY_SCHEMES):
        errors.append(f"spec.model.uri: Invalid value: {go_format(uri)}: file:// URIs are for `kiln dev` only; "
                      f"in a cluster use pvc://<claim>/<path>, https:// or s3://")
    return errors


def _builder_flag_errors(value: Mapping, prefix: str) -> list[str]:
    """builderFlags values must be scalars. The operator's check, not the API server's: CEL
    cannot type a map whose values preserve unknown fields, so the CRD cannot say it."""
    flags = _get(value, "engine", "builderFlags") if prefix else _get(value, "spec", "engine", "builderFlags")
    if isinstance(flags, dict) and any(isinstance(v, (dict, list)) or v is None for v in flags.values()):
        return ['spec.engine.builderFlags: Invalid value: '
                'builderFlags values must be strings, numbers or booleans']
    return []


# spec.runtime.warmup.samples travel in the runtime container's args (--runtime-spec): kept
# small there; a larger set belongs in samplesFile. The operator's check, not the API
# server's: CEL cannot measure values whose schema preserves unknown fields (nested data).
MAX_INLINE_SAMPLES_BYTES = 64 * 1024


def _warmup_errors(value: Mapping, prefix: str) -> list[str]:
    samples = (_get(value, "runtime", "warmup", "samples") if prefix
               else _get(value, "spec", "runtime", "warmup", "samples"))
    if not isinstance(samples, list):
        return []
    size = len(json.dumps(samples, separators=(",", ":"), default=str))
    if size > MAX_INLINE_SAMPLES_BYTES:
        return [f"spec.runtime.warmup.samples: Too long: the samples are {size} bytes of JSON, at most "
                f"{MAX_INLINE_SAMPLES_BYTES} may be written inline; put them in warmup.samplesFile"]
    return []


def _unknown_fields(value: Any, node: dict, path: str) -> Iterator[str]:
    if node.get("x-kubernetes-preserve-unknown-fields") or path == "metadata":
        return
    if isinstance(value, dict) and node.get("type") == "object":
        props = node.get("properties", {})
        extra = node.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                yield from _unknown_fields(v, props[k], join_path(path, k))
            elif isinstance(extra, dict):
                yield from _unknown_fields(v, extra, f"{path}[{k}]")
            elif extra is not True:
                yield join_path(path, k)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, v in enumerate(value):
            yield from _unknown_fields(v, node["items"], join_path(path, i))


@functools.lru_cache(maxsize=4)
def _validator(prefix: str):
    import jsonschema

    root = _nullable(_schema(VERSION))
    return jsonschema.Draft202012Validator(root if prefix == "" else root["properties"]["spec"])


def _nullable(node: Any) -> Any:
    """OpenAPI's `nullable: true` in jsonschema's words: null is one more allowed type."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _schema_errors(value: dict, node: dict, prefix: str) -> tuple[list[str], bool]:
    """The schema's messages, and whether one of them blocks the CEL rules."""
    out: list[str] = []
    blocking = False
    for err in _validator(prefix).iter_errors(value):
        path = field_path(prefix, node, err.absolute_path)
        blocking = blocking or err.validator in _BLOCKING
        for msg in translate(err, path):
            if msg not in out:
                out.append(msg)
    return out, blocking


def _walk_k8s(value: Any, node: dict, path: str, rules: bool = True) -> Iterator[str]:
    """List-type duplicates and (when `rules`) CEL rules, depth-first like the API server."""
    if value is None:
        return
    for rule in node.get("x-kubernetes-validations") or [] if rules else []:
        if "oldSelf" in rule["rule"]:
            continue
        msg = run_rule(rule, value, node)
        if msg is not None:  # the API server shows a scalar's value, not an object's or a list's
            shown = "" if isinstance(value, (dict, list)) else f"{go_format(value)}: "
            yield f"{path or '<nil>'}: Invalid value: {shown}{msg}"
    if isinstance(value, dict):
        props = node.get("properties", {})
        extra = node.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                yield from _walk_k8s(v, props[k], join_path(path, k), rules)
            elif isinstance(extra, dict):
                yield from _walk_k8s(v, extra, f"{path}[{k}]", rules)
    elif isinstance(value, list):
        yield from _duplicates(value, node, path)
        items = node.get("items")
        if isinstance(items, dict):
            for i, v in enumerate(value):
                yield from _walk_k8s(v, items, join_path(path, i), rules)


def _duplicates(value: list, node: dict, path: str) -> Iterator[str]:
    kind = node.get("x-kubernetes-list-type")
    if kind not in ("set", "map"):
        return
    keys = node.get("x-kubernetes-list-map-keys", [])
    seen: list[Any] = []
    for i, item in enumerate(value):
        if kind == "map" and not isinstance(item, dict):
            continue  # not an object: the schema says so; it has no keys to compare
        ident = item if kind == "set" else tuple((k, item.get(k)) for k in keys)
        if ident in seen:
            shown = go_format(item) if kind == "set" else "{" + ", ".join(
                f"{json.dumps(k)}: {go_format(v)}" for k, v in ident) + "}"
            yield f"{join_path(path, i)}: Duplicate value: {shown}"
        else:
            seen.append(ident)

