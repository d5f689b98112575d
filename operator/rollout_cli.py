"""Show, promote or abort an InferenceModel's canary rollout by hand.

`status` prints the stable and canary versions, the step, the weights, the last analysis
(every check with its value and bounds) and the last rollback. `promote` and `abort` set
the annotation `rollout.kiln.dev/action` - only while a rollout runs (the write is
conditional on the status just checked) - and the operator acts on it and removes it;
`--wait` waits for that and prints the new status. Needs get and patch on inferencemodels.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any, Callable, Mapping

from kiln.runtime.api.contract import ANN_ROLLOUT_ACTION as ANN_ACTION, KIND

ACTIONS = ("promote", "abort")

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
POLL_SECONDS = 0.5
CONFLICT_RETRIES = 5  # the operator writes status often; each write moves the resourceVersion


# ---------------------------------------------------------------------------- arguments

def configure(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("name", metavar="NAME", help="the InferenceModel")
    common.add_argument("--namespace", "-n", default=None,
                        help="its namespace (default: the kubeconfig context's, else default)")
    common.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument("--wait", type=_seconds, default=0.0, metavar="SECONDS",
                         help="wait up to SECONDS for the operator to take the request, then show the status "
                              "(default 0: do not wait)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("status", parents=[common], help="where the rollout stands: step, weights, last analysis")
    sub.add_parser("promote", parents=[common, waiting],
                   help="make the canary stable now, skipping the remaining steps and their analysis")
    sub.add_parser("abort", parents=[common, waiting],
                   help="roll back now: all traffic to the stable version, the canary removed")


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    from kiln.operator.kube import ApiError

    try:
        models = Models.connect(args.kubeconfig)
        ns = args.namespace or models.namespace
        if args.action == "status":
            return show(models, ns, args.name)
        return request(models, ns, args.name, args.action, args.wait)
    except ApiError as e:
        return _fail(f"the API server refused: {e}")
    except Exception as e:  # no kubeconfig, unreachable server: one line, not a traceback
        if type(e).__name__ == "ConfigException":
            return _fail(f"no cluster configured: {e}")
        if type(e).__module__.startswith(("kubernetes", "urllib3")) or isinstance(e, OSError):
            return _fail(f"cannot reach the cluster: {e}")
        raise


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------------- the API

class Models:
    """InferenceModels over kiln.operator.kube's transport, synchronously (a CLI has no event loop)."""

    def __init__(self, kube: Any, namespace: str = "default") -> None:
        self.kube, self.namespace = kube, namespace

    @classmethod
    def connect(cls, kubeconfig: str | None) -> "Models":
        from kiln.operator import kube

        return cls(kube.Kube(kube.load_client(kubeconfig), component="kiln-rollout"), _context_namespace(kubeconfig))

    def get(self, ns: str, name: str) -> dict[str, Any] | None:
        from kiln.operator.kube import ApiError, path_for

        try:
            return self.kube._request_sync("GET", path_for(KIND, ns, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def patch(self, ns: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        from kiln.operator.kube import MERGE_PATCH, path_for

        return self.kube._request_sync("PATCH", path_for(KIND, ns, name), dict(patch), None, MERGE_PATCH)


def _context_namespace(kubeconfig: str | None) -> str:
    """kubectl's default namespace: the service account's in a pod, else the current context's."""
    import os

    if not (kubeconfig or os.environ.get("KUBECONFIG")):
        try:
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                return f.read().strip() or "default"
        except OSError:
            pass
    try:
        import kubernetes

        _, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig or os.environ.get("KUBECONFIG"))
        return (active or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig: load_client has already said so, or in-cluster
        return "default"


# ---------------------------------------------------------------------------- commands

def show(models: Models, ns: str, name: str, now: datetime.datetime | None = None) -> int:
    obj = models.get(ns, name)
    if obj is None:
        return _fail(f"{KIND} {ns}/{name} not found")
    print(describe(obj, now or _utcnow()))
    return EXIT_OK


def request(models: Models, ns: str, name: str, action: str, wait: float,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Annotate the model with `action`, only while its rollout runs; optionally wait for the operator."""
    from kiln.operator.kube import ApiError

    for _ in range(CONFLICT_RETRIES):
        obj = models.get(ns, name)
        if obj is None:
            return _fail(f"{KIND} {ns}/{name} not found")
        canary = (obj.get("status") or {}).get("canary")
        if not canary:
            return _fail(f"no rollout is running for {ns}/{name} (status.canary is absent): nothing to {action}",
                         EXIT_REFUSED)
        if action == "promote" and canary.get("phase") == "Promoting":
            print(f"{ns}/{name}: the canary (version {canary.get('version', '?')}) is already being promoted; "
                  "nothing to request")
            return EXIT_OK
        meta = obj["metadata"]
        pending = (meta.get("annotations") or {}).get(ANN_ACTION)
        try:
            models.patch(ns, name, {"metadata": {"resourceVersion": meta["resourceVersion"],
                                                 "annotations": {ANN_ACTION: action}}})
            break
        except ApiError as e:
            if e.status != 409:  # a concurrent write (the operator's status): look again
                raise
    else:
        return _fail(f"{ns}/{name} kept changing; {action} was not requested, try again")

    print(announce(obj, action, pending))
    if wait <= 0:
        return EXIT_OK
    deadline = clock() + wait
    while True:
        current = models.get(ns, name)
        if current is None:
            return _fail(f"{KIND} {ns}/{name} was deleted while waiting")
        if ANN_ACTION not in (current["metadata"].get("annotations") or {}):
            print(f"\nThe operator took the request. Now:\n{describe(current, _utcnow())}")
            return EXIT_OK
        if clock() >= deadline:
            return _fail(f"the operator did not take the request within {wait:g}s (is it running?); "
                         f"the annotation {ANN_ACTION}={action} stays, and the operator acts on it when it runs")
        sleep(min(POLL_SECONDS, max(deadline - clock(), 0.0)))


def announce(obj: Mapping[str, Any], action: str, pending: str | None = None) -> str:
    """What the request will do, in the user's words (the model's status as it was checked)."""
    meta, status = obj["metadata"], obj.get("status") or {}
    canary, stable = status.get("canary") or {}, status.get("stable") or {}
    who = f"{meta.get('namespace')}/{meta['name']}"
    new = f"version {canary.get('version', '?')} ({_key(canary.get('engineKey'))})"
    old = f"version {stable.get('version', '?')} ({_key(stable.get('engineKey'))})"
    if action == "promote":
        what = (f"the canary {new} becomes stable and takes all traffic, skipping the remaining steps and their "
                f"analysis; the old {old} is removed after the delay, its engine stays in the cache")
    else:
        what = (f"all traffic returns to the stable {old} at once and the canary {new} is removed; "
                f"status.rollback records it")
    note = "" if not pending or pending == action else f" (replaces the pending {pending!r})"
    return (f"{who}: {action} requested{note} ({ANN_ACTION}={action}).\n"
            f"When the operator takes it, {what}.")


# ---------------------------------------------------------------------------- the report

def describe(obj: Mapping[str, Any], now: datetime.datetime) -> str:
    """The rollout of `obj` as text: stable, canary (step, weights, time, failures, last analysis), rollback."""
    from kiln.operator.canary import Policy
    from kiln.runtime.api import spec as specmod

    meta, status = obj["metadata"], obj.get("status") or {}
    rollout = (specmod.apply_defaults(obj.get("spec") or {}).get("rollout") or {})
    policy = Policy.from_spec(rollout)
    steps = policy.steps  # with the shadow step first, where the spec asks for one
    limit = (rollout.get("analysis") or {}).get("failureLimit")
    lines = [f"{KIND} {meta.get('namespace')}/{meta['name']}: {status.get('phase') or 'no status yet'}"]

    stable = status.get("stable")
    if stable:
        ready = f", {stable.get('readyReplicas', 0)}/{stable.get('replicas', 0)} ready" if "replicas" in stable else ""
        lines.append(f"Stable:   version {stable.get('version', '?')}  key {stable.get('engineKey', '?')}  "
                     f"weight {_pct(stable.get('weight'))}{ready}")
    else:
        lines.append("Stable:   none yet")

    canary = status.get("canary")
    if canary:
        step = canary.get("step")
        of = f"{step + 1}/{len(steps)}" if isinstance(step, int) and steps else "?"
        of += " (shadow: copies of the stable side's requests, no client traffic)" \
            if policy.in_shadow_step(canary) else ""
        lines += [
            f"Canary:   version {canary.get('version', '?')}  key {canary.get('engineKey', '?')}  "
            f"{canary.get('phase', '?')}",
            f"  step:     {of}, weight {_pct(canary.get('weight'))} in effect, "
            f"target {_pct(canary.get('targetWeight'))}",
            f"  in step:  {_since(canary.get('stepStartedAt'), now)}",
            f"  started:  {_since(canary.get('startedAt'), now)}",
            f"  failures: {canary.get('analysisFailures', 0)}"
            + (f" (tolerated: {limit}; one more rolls back)" if limit is not None else ""),
        ]
        lines += _analysis(canary.get("lastAnalysis"), now)
    else:
        lines.append("Canary:   none (no rollout running)")

    pending = (meta.get("annotations") or {}).get(ANN_ACTION)
    if pending:
        lines.append(f"Pending:  {pending} (requested; the operator has not taken it yet)")

    rollback = status.get("rollback")
    if rollback:
        step = rollback.get("step")
        at = f" at step {step + 1}/{len(steps) or '?'}" if isinstance(step, int) else ""
        lines.append(f"Last rollback: version {rollback.get('version', '?')}  key {rollback.get('engineKey', '?')}"
                     f"{at}, {_since(rollback.get('time'), now, 'ago')}")
        if rollback.get("reason"):
            lines.append(f"  reason:   {rollback['reason']}")
    return "\n".join(lines)


def _analysis(last: Mapping[str, Any] | None, now: datetime.datetime) -> list[str]:
    if not last:
        return ["  last analysis: none yet"]
    head = f"  last analysis: {last.get('result', '?')}, {_since(last.get('time'), now, 'ago')}"
    lines = [head + (f": {last['message']}" if last.get("message") else "")]
    checks = last.get("checks") or []
    if checks:
        rows = [("CHECK", "RESULT", "VALUE", "MIN", "MAX")] + [
            (c.get("name", "?"), c.get("result", "?"), _num(c.get("value"), "no data"), _num(c.get("min")),
             _num(c.get("max"))) for c in checks]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines += ["    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines += [f"    {c['name']}: {c['detail']}" for c in checks if c.get("detail") and c.get("name")]
        lines += [f"    {c.get('name', '?')}: {_clip(c['query'])}" for c in checks if c.get("query")]
    return lines


# ---------------------------------------------------------------------------- formatting

def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _parse_time(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)


def _since(text: Any, now: datetime.datetime, suffix: str = "") -> str:
    """`1m05s (since 2026-01-01T00:00:00Z)`, or `1m05s ago (...)`; `unknown` without a time."""
    when = _parse_time(text)
    if when is None:
        return "unknown" if not text else str(text)
    ago = _duration((now - when).total_seconds())
    return f"{ago} {suffix} ({text})" if suffix else f"{ago} (since {text})"


def _duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def _pct(value: Any) -> str:
    return f"{value}%" if value is not None else "?"


def _num(value: Any, missing: str = "-") -> str:
    if value is None:
        return missing
    return f"{value:.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _key(key: Any) -> str:
    return f"key {key}" if isinstance(key, str) and key else "key ?"


def _clip(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
