"""Field errors in the API server's words: field paths (`a.b[0]`, map keys as
`labels[kiln.dev/role]`), values as Go prints them, and jsonschema's failures as the
messages `kubectl apply` shows."""

from __future__ import annotations

import json
from typing import Any, Iterator


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def field_path(prefix: str, node: dict | None, parts) -> str:
    """Field path as the API server prints it: `a.b[0]`, map keys as `labels[kiln.dev/role]`."""
    path = prefix
    for part in parts:
        props = (node or {}).get("properties", {})
        if isinstance(part, int):
            path, node = join_path(path, part), (node or {}).get("items")
        elif part in props:
            path, node = join_path(path, part), props[part]
        else:
            path, node = f"{path}.{part}", (node or {}).get("additionalProperties")
            node = node if isinstance(node, dict) else None
    return path


def go_format(value: Any) -> str:
    """A value as Go's %v/%q would show it in a field error."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # Go's %q keeps printable Unicode
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(_json_type(value))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def type_error(where: str, want: str, got: Any) -> str:
    return (f"{where}: Invalid value: {json.dumps(_json_type(got))}: {where} in body must be of "
            f"type {want}: {json.dumps(_json_type(got))}")


def translate(err, path: str) -> Iterator[str]:
    kw, want, got = err.validator, err.validator_value, err.instance
    where = path or "<nil>"
    if kw == "required":
        for name in want:
            if isinstance(got, dict) and name not in got:
                yield f"{join_path(path, name)}: Required value"
    elif kw == "type":  # a nullable field's ["number", "null"]: the API server says number
        yield type_error(where, ",".join(t for t in want if t != "null") if isinstance(want, list) else want, got)
    elif kw == "enum":
        supported = ", ".join(json.dumps(v) for v in want)
        yield f"{where}: Unsupported value: {go_format(got)}: supported values: {supported}"
    elif kw == "pattern":
        yield f"{where}: Invalid value: {go_format(got)}: {where} in body should match '{want}'"
    elif kw == "minimum":
        yield (f"{where}: Invalid value: {go_format(got)}: {where} in body should be greater than "
               f"or equal to {want}")
    elif kw == "maximum":
        yield (f"{where}: Invalid value: {go_format(got)}: {where} in body should be less than or "
               f"equal to {want}")
    elif kw == "minLength":
        yield f"{where}: Invalid value: {go_format(got)}: {where} in body should be at least {want} chars long"
    elif kw == "maxLength":
        yield f"{where}: Too long: may not be more than {want} bytes"
    elif kw == "minItems":
        yield f"{where}: Invalid value: {len(got)}: {where} in body should have at least {want} items"
    elif kw == "maxItems":
        yield f"{where}: Too many: {len(got)}: must have at most {want} items"
    elif kw == "maxProperties":
        yield f"{where}: Too many: {len(got)}: must have at most {want} items"
    elif kw == "anyOf" and all("type" in s for s in want):
        yield type_error(where, ",".join(s["type"] for s in want), got)
    else:
        yield f"{where}: Invalid value: {go_format(got)}: {err.message}"
