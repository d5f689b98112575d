"""Canary analysis: Prometheus queries over the canary (and the stable side), with bounds.

Built-in checks read Kiln's own runtime metrics, tied to a track by the engine key its pods
serve (`kiln_model_info{engine_key}` joined on namespace and pod): the canary's error ratio
(`maxErrorRatio`), its share of requests refused as bad against the stable side's
(`maxRefusedRatioIncrease`), and its p99 latency against the stable side's (`maxLatencyRatio`).
User checks are PromQL with `min`/`max` bounds; `{{model}}`, `{{namespace}}`, `{{version}}`
and `{{engineKey}}` are filled in. No data (an empty answer, NaN) is inconclusive, never a
pass; a Prometheus that does not answer is an error: the rollout waits, it does not promote.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any, Mapping

PASSED, FAILED, INCONCLUSIVE, ERROR = "Passed", "Failed", "Inconclusive", "Error"
QUERY_SECONDS = 5.0
WINDOW = "1m"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    query: str
    min: float | None = None
    max: float | None = None
    detail: str | None = None  # a query whose series say why, when the check fails (label: value)


@dataclasses.dataclass(frozen=True)
class Outcome:
    result: str  # Passed | Failed | Inconclusive | Error
    checks: tuple[dict[str, Any], ...] = ()  # name, query, value, min, max, result
    message: str = ""


def _track(ns: str, model: str, key: str) -> str:
    return (f'* on (namespace, pod) group_left () max by (namespace, pod) '
            f'(kiln_model_info{{namespace="{ns}", model="{model}", engine_key="{key}"}})')


def builtin_checks(analysis: Mapping[str, Any], ns: str, model: str, canary_key: str, stable_key: str) -> list[Check]:
    """The checks every canary gets from the runtime's own metrics (turned off with null)."""
    sel = f'namespace="{ns}", model="{model}"'
    checks = []
    if analysis.get("maxErrorRatio") is not None:
        errors = f'sum(rate(kiln_requests_total{{{sel}, outcome=~"error|unavailable"}}[{WINDOW}]) {_track(ns, model, canary_key)})'
        total = f'sum(rate(kiln_requests_total{{{sel}}}[{WINDOW}]) {_track(ns, model, canary_key)})'
        checks.append(Check("error-ratio", f"({errors} or vector(0)) / {total}", max=float(analysis["maxErrorRatio"])))
    if analysis.get("maxRefusedRatioIncrease") is not None:
        # Whose mistake a refused input is cannot be read from one side: the same traffic
        # reaches both tracks (weights, replica ratio, or the shadow step's copies of what the
        # stable side answered), so the canary refusing more of it than the stable side is
        # the canary's failure, and inputs both refuse cancel out.
        def refused(key: str) -> str:
            bad = (f'sum(rate(kiln_requests_total{{{sel}, outcome=~"bad_request|refused"}}[{WINDOW}]) '
                   f'{_track(ns, model, key)})')
            every = f'sum(rate(kiln_requests_total{{{sel}}}[{WINDOW}]) {_track(ns, model, key)})'
            return f"(({bad} or vector(0)) / {every})"
        checks.append(Check("refused-ratio-increase", f"{refused(canary_key)} - {refused(stable_key)}",
                            max=float(analysis["maxRefusedRatioIncrease"])))
    if analysis.get("maxLatencyRatio") is not None:
        def p99(key: str) -> str:
            return (f'histogram_quantile(0.99, sum by (le) (rate(kiln_request_duration_seconds_bucket{{{sel}}}'
                    f'[{WINDOW}]) {_track(ns, model, key)}))')
        checks.append(Check("latency-p99-ratio", f"{p99(canary_key)} / {p99(stable_key)}",
                            max=float(analysis["maxLatencyRatio"])))
    return checks


def agreement_check(analysis: Mapping[str, Any], ns: str, model: str, canary_key: str) -> Check | None:
    """While the stable pods copy requests to the canary (rollout.shadow): the least share, over
    the outputs, of comparisons that agreed (runtime/serving/shadow.py counts them on the stable
    pods), once there are minSamples in the window; fewer is no data (inconclusive)."""
    a = analysis.get("agreement")
    if a is None:
        return None
    sel = f'namespace="{ns}", model="{model}", canary="{canary_key}"'
    compared = f"kiln_shadow_comparisons_total{{{sel}}}"
    # An output that never agreed has no "agree" series: 0 x its "differ" one stands in.
    agreed = (f'increase(kiln_shadow_comparisons_total{{{sel}, result="agree"}}[{WINDOW}]) or '
              f'0 * increase(kiln_shadow_comparisons_total{{{sel}, result="differ"}}[{WINDOW}])')
    samples = f'sum(increase(kiln_shadow_copies_total{{{sel}, outcome="compared"}}[{WINDOW}]))'
    query = (f"min(sum by (output) ({agreed}) / sum by (output) (increase({compared}[{WINDOW}]))) "
             f"and on () ({samples} >= {int(a['minSamples'])})")
    worst = (f"max by (output) (histogram_quantile(1, sum by (output, le) "
             f"(increase(kiln_shadow_abs_difference_bucket{{{sel}}}[{WINDOW}]))))")
    return Check("agreement", query, min=float(a["minRatio"]), detail=worst)


def user_checks(analysis: Mapping[str, Any], ns: str, model: str, version: str, canary_key: str) -> list[Check]:
    out = []
    for m in analysis.get("metrics") or ():
        query = (str(m["query"]).replace("{{model}}", model).replace("{{namespace}}", ns)
                 .replace("{{version}}", version).replace("{{engineKey}}", canary_key))
        out.append(Check(str(m["name"]), query, m.get("min"), m.get("max")))
    return out


def judge(check: Check, value: float | None) -> str:
    if value is None or math.isnan(value):
        return INCONCLUSIVE
    if (check.min is not None and value < check.min) or (check.max is not None and value > check.max):
        return FAILED
    return PASSED


def combine(checks: list[Check], values: list[float | None | Exception]) -> Outcome:
    """Every check's verdict, then the evaluation's: an error beats a failure beats no data."""
    rows, verdicts = [], []
    for check, value in zip(checks, values):
        if isinstance(value, Exception):
            verdict, shown = ERROR, None
        else:
            verdict, shown = judge(check, value), value
        verdicts.append(verdict)
        rows.append({"name": check.name, "query": check.query[:1024], "value": _number(shown),
                     "min": check.min, "max": check.max, "result": verdict})
    for result in (ERROR, FAILED, INCONCLUSIVE):
        if result in verdicts:
            names = [r["name"] for r in rows if r["result"] == result]
            return Outcome(result, tuple(rows), f"{result.lower()}: {', '.join(names)}")
    return Outcome(PASSED, tuple(rows), f"{len(rows)} check(s) passed")


def _number(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else value


async def query(session: Any, base_url: str, promql: str) -> float | None:
    """One instant query's single number; None for no data. Raises on an unreachable or
    failing Prometheus, or an answer that is not one number."""
    import aiohttp

    async with session.get(f"{base_url.rstrip('/')}/api/v1/query", params={"query": promql},
                           timeout=aiohttp.ClientTimeout(total=QUERY_SECONDS)) as r:
        body = await r.json(content_type=None)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus: {body.get('errorType', 'error')}: {body.get('error', '')}")
    data = body["data"]
    if data["resultType"] == "scalar":
        return float(data["result"][1])
    series = data["result"]
    if not series:
        return None
    if len(series) > 1:
        raise RuntimeError(f"the query returned {len(series)} series; an analysis query must return one number")
    return float(series[0]["value"][1])


async def query_series(session: Any, base_url: str, promql: str, label: str) -> list[tuple[str, float]]:
    """An instant query's series as (its `label`, value), at most 10."""
    import aiohttp

    async with session.get(f"{base_url.rstrip('/')}/api/v1/query", params={"query": promql},
                           timeout=aiohttp.ClientTimeout(total=QUERY_SECONDS)) as r:
        body = await r.json(content_type=None)
    if body.get("status") != "success" or body["data"]["resultType"] != "vector":
        return []
    return [(str(s["metric"].get(label, "")), float(s["value"][1])) for s in body["data"]["result"][:10]]


async def _details(session: Any, base_url: str, checks: list[Check], outcome: Outcome) -> Outcome:
    """The failed checks' details (the worst outputs' differences), in their rows."""
    rows = [dict(r) for r in outcome.checks]
    for check, row in zip(checks, rows):
        if check.detail and row["result"] == FAILED:
            try:
                found = await query_series(session, base_url, check.detail, "output")
            except Exception:  # a detail is not worth the verdict
                found = []
            worst = sorted((kv for kv in found if not math.isnan(kv[1])), key=lambda kv: -kv[1])[:3]
            if worst:
                row["detail"] = ", ".join(f"output {name}: max absolute difference <= {value:g}"
                                          for name, value in worst)
    return dataclasses.replace(outcome, checks=tuple(rows))


async def evaluate(base_url: str | None, checks: list[Check]) -> Outcome:
    """Run the checks; the built-in ones are left out by the caller where no Prometheus is
    configured, so a spec's own checks without one are an error (the rollout waits)."""
    if not checks:
        return Outcome(PASSED, (), "no checks: the step passes on time alone")
    if not base_url:
        return Outcome(ERROR, (), "the operator has no --prometheus-url to run the analysis with")
    import aiohttp

    async with aiohttp.ClientSession() as session:
        values = await asyncio.gather(*(query(session, base_url, c.query) for c in checks), return_exceptions=True)
        outcome = combine(checks, list(values))
        if outcome.result == FAILED and any(c.detail for c in checks):
            outcome = await _details(session, base_url, checks, outcome)
    return outcome
