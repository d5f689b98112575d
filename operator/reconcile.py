"""Level-triggered reconcile of one InferenceModel: concern steps, merged, status written once.

Every entry point (create, update, resume, the resync timer, and the watch events of the
Jobs, build pods, Deployments and Services Kiln owns) calls `reconcile()`. It runs the
steps in order - engines, scaling, rollout, serving (`STEPS`; each a module that says what
it owns and does) - over one `steps.Pass`, merges what they return (`steps.merge`: a
condition or field owned twice, or returned by a step that does not own it, is an error),
writes status only when it changed, then posts the Events. An error raised midway still
posts the Events of what was already done; a request the API server refuses
(`ApiError.refused`) is no error but status (`steps.refused`), an Event, and another pass
after a backoff. Steps read kopf's in-memory indexes (no API reads) and write only where
the desired state differs, so an idle operator makes no API calls.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Awaitable, Callable, Mapping

import kopf

from kiln.operator import engines, rollout, scaling, serving
from kiln.operator.kube import ApiError
from kiln.operator.steps import (RECONCILE_OWNS, REFUSED, Context, Event, Owns, Pass, StepResult, Views,  # noqa: F401
                                 merge, refusal, refused)
from kiln.runtime.api import contract

logger = logging.getLogger("kiln.operator.reconcile")

# The steps, in the order they run; each reads what the earlier ones decided (`Pass.out`).
STEPS: dict[str, tuple[Callable[[Pass], Awaitable[StepResult]], Owns]] = {
    "engines": (engines.step, engines.OWNS),  # EngineReady, status.engines: build Jobs, the engine index
    "scaling": (scaling.step, scaling.OWNS),  # the replica count, status.scaling
    "rollout": (rollout.step, rollout.OWNS),  # Progressing, engineKey, stable, canary: what each track runs
    "serving": (serving.step, serving.OWNS),  # Available, Degraded, replicas: the Deployment, the Service
}
OWNERS = {name: owns for name, (_, owns) in STEPS.items()}


@dataclasses.dataclass
class Outcome:
    phase: str
    waiting: bool  # engines are being built or pods are starting
    writes: int  # API writes this pass made
    wake_after: float | None = None  # when a step wants to look again though nothing changes


async def reconcile(ctx: Context, model: Mapping[str, Any], views: Views) -> Outcome:
    """Bring one InferenceModel's world in line with its spec. Safe to call any time."""
    meta = model["metadata"]
    if meta.get("deletionTimestamp"):
        return Outcome("Terminating", False, 0)
    async with ctx.lock(meta["uid"]):
        return await _reconcile(ctx, model, views)


async def _reconcile(ctx: Context, model: Mapping[str, Any], views: Views) -> Outcome:
    writes_before = sum(ctx.kube.calls[m] for m in ("POST", "PATCH", "DELETE"))
    uid = model["metadata"]["uid"]
    spec, problems, engine_refs = ctx.plan(uid, model.get("spec") or {})
    previous = ctx.last_status.get(uid) or dict(model.get("status") or {})
    p = Pass(ctx, model, views, spec, engine_refs, "; ".join(problems) if problems else None, previous)
    results: dict[str, StepResult] = {}
    events: list[Event] = []
    refused_now = False
    try:
        for name, (run, _) in STEPS.items():
            try:
                results[name] = await run(p)
            except ApiError as e:
                if not e.refused:
                    raise
                results.update(refused(p, OWNERS, results, name, e))
                events += p.events + results[name].events
                p.events, refused_now = [], True
                break
            p.out[name] = results[name].out
            events += p.events + results[name].events
            p.events = []
        status = merge(p, OWNERS, results)
        if status["phase"] == "Ready" and previous.get("phase") != "Ready":
            events.append(("Normal", "Ready", f"version {p.version} is serving with engine {status.get('engineKey', '')}"))
        try:
            await _write_status(ctx, model, previous, status)
        except ApiError as e:
            if not e.refused:
                raise
            events.append(("Warning", REFUSED, refusal(e)))  # no condition can say it
            refused_now = True
    finally:  # an error midway still tells what was done (p.events: the failing step's actions so far)
        await _post_events(ctx, model, events + p.events)
    _back_off(ctx, p, refused_now)
    if p.invalid is not None:
        raise kopf.PermanentError(f"the spec cannot work: {p.invalid}")
    wake_after = min((r.wake_after for r in results.values() if r.wake_after is not None), default=None)
    if wake_after is not None:
        ctx.wake(p.ns, p.name, uid, wake_after)
    requeue = min((r.requeue for r in results.values() if r.requeue is not None), default=None)
    if requeue is not None:
        raise kopf.TemporaryError("waiting on a build Job that is being replaced", delay=requeue)
    writes = sum(ctx.kube.calls[m] for m in ("POST", "PATCH", "DELETE")) - writes_before
    waiting = any(r.waiting for r in results.values()) or status["phase"] in ("Building", "Deploying")
    return Outcome(status["phase"], waiting, writes, wake_after)


def _back_off(ctx: Context, p: Pass, refused_now: bool) -> None:
    """After a refused pass, another one later, and later each time: someone may fix the
    cause (RBAC, a quota, the spec), and no watch event says so."""
    if not refused_now:
        ctx.refusals.pop(p.uid, None)
        return
    tries = ctx.refusals[p.uid] = ctx.refusals.get(p.uid, 0) + 1
    ctx.wake(p.ns, p.name, p.uid, min(ctx.config.retry_seconds * 2 ** (tries - 1), ctx.config.resync_seconds))


# The status fields the steps and the reconcile own: cleared when no step sets them, unless
# sticky (status.scaling and status.canary are left as they are while nothing sets them).
OWNED_STATUS = tuple(f for owns in (RECONCILE_OWNS, *OWNERS.values()) for f in owns.fields if f not in
                     {s for o in OWNERS.values() for s in o.sticky})


async def _write_status(ctx: Context, model: Mapping[str, Any], previous: Mapping[str, Any],
                        status: dict[str, Any]) -> None:
    meta = model["metadata"]
    # What the server holds of the fields this pass decides (a sticky one counts when it is
    # set: else an operator's first pass rewrites an autoscaled model's unchanged status).
    server = {k: v for k, v in (model.get("status") or {}).items() if k in OWNED_STATUS or k in status}
    if ctx.last_status.get(meta["uid"]) != status and server != status:
        patch: dict[str, Any] = dict(status)
        for k in OWNED_STATUS:
            if k not in status and (k in server or k in previous):
                patch[k] = None
        for old in (server, previous):  # a merge patch keeps what it does not name: name what went
            _null_removed(patch, old, status)
        try:
            await ctx.kube.patch(contract.KIND, meta["namespace"], meta["name"], {"status": patch},
                                 subresource="status")
        except ApiError as e:
            if e.status == 404:
                return  # deleted meanwhile
            raise
    ctx.last_status[meta["uid"]] = status


def _null_removed(patch: dict[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Set to null, in `patch`, the keys of nested objects that `old` has and `new` has not
    (status.canary.stepStartedAt when a step ends), as a merge patch removes them."""
    for k, value in new.items():
        before = old.get(k)
        if isinstance(value, dict) and isinstance(before, dict) and isinstance(patch.get(k), dict):
            patch[k] = dict(patch[k])
            for gone in set(before) - set(value):
                patch[k][gone] = None
            _null_removed(patch[k], before, value)


async def _post_events(ctx: Context, model: Mapping[str, Any], events: list[Event]) -> None:
    meta = model["metadata"]
    involved = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": meta}
    for type_, reason, message in events:
        logger.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s/%s: %s: %s",
                   meta["namespace"], meta["name"], reason, message)
        await ctx.kube.event(involved, type_, reason, message, now=ctx.clock())
