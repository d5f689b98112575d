"""The CRD's `x-kubernetes-validations` rules, evaluated as the API server evaluates them
(cel-python, imported only when a rule runs)."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=256)
def _program(rule: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def run_rule(rule: dict, value: Any, node: dict) -> str | None:
    """None when the rule holds, else the message the API server would give."""
    import celpy

    expr = rule["rule"]
    message = rule.get("message") or f"failed rule: {expr}"
    try:
        result = _program(expr).evaluate({"self": _to_cel(value, node)})
    except celpy.CELEvalError as e:
        return f"{e.args[0] if e.args else e} evaluating rule: {expr}"
    if isinstance(result, celpy.CELEvalError):
        return f"{result.args[0] if result.args else result} evaluating rule: {expr}"
    return None if bool(result) else message


def _to_cel(value: Any, node: dict | None):
    """A JSON value as CEL sees it through its schema (numbers in a `number` field are doubles)."""
    from celpy import celtypes
    from celpy.adapter import json_to_cel

    node = node or {}
    if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
        return json_to_cel(value)
    if isinstance(value, dict):
        props = node.get("properties", {})
        extra = node.get("additionalProperties")
        return celtypes.MapType({
            celtypes.StringType(k): _to_cel(
                v, props.get(k) if k in props else (extra if isinstance(extra, dict) else None))
            for k, v in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([_to_cel(v, node.get("items")) for v in value])
    if node.get("type") == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return celtypes.DoubleType(float(value))
    return json_to_cel(value)

