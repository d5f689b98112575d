"""Engine-cache garbage collection: the operator decides, a Job on the claim removes.

A pass per namespace that has an engine index, every `--cache-gc-interval-seconds` (the
index's annotation `kiln.dev/cache-gc-last-run` dates the last one, its creation the first,
so an operator restart postpones nothing). docs/architecture.md, "Cache garbage collection", says why each step is
safe against the races (a build publishing, a rollback, two operators, a re-created model).

1. Decide (`decide`, pure). An index entry (`<key>.<target>`) is *needed* when its key is one
   a model's spec builds or serves, that a model's status names (serving, stable, canary,
   rollback), that a Kiln runtime Deployment runs (`--engine`) or a running build Job builds; *kept*
   when it is one of the `retention` newest other entries of an existing model and target
   (the rollback target); else *unneeded*, marked so in its index value (`unneededSince`).
   An entry unneeded for `grace` seconds is due.
2. Forget (not in a dry run): the due keys leave the index in one merge patch conditional
   on its resourceVersion (a build recording a result meanwhile, or another operator's
   pass, makes it a 409 and the pass is tried again), their finished build Jobs are
   deleted, and this operator stops trusting what it remembers of them
   (`Context.gc_forgotten`). From then on a model that needs one runs a build Job, which
   touches the entry under the cache's shared lock (a cache hit) or builds it again.
3. Remove: one Job per claim, `kiln cache-gc --plan` (runtime/engine/cache/gc.py), removes
   each due entry unless a build touched it since the decision, plus orphans (entries the
   index does not know, untouched for `grace`) and debris. One Job name per claim: a second
   pass (another operator during a leader change) finds it and waits.
4. Report, once the Job finished: an Event on each model that lost an entry, a log line,
   the `kiln_cache_gc_*` metrics; then the Job is deleted (its plan ConfigMap with it).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import re
from typing import Any, Iterable, Mapping

from kiln.operator import manifests, observations
from kiln.operator.kube import ApiError
from kiln.operator.steps import Context
from kiln.runtime.api import contract

logger = logging.getLogger("kiln.operator.cachegc")

ANN_LAST_RUN = "kiln.dev/cache-gc-last-run"  # on the engine index: when the last pass decided
UNNEEDED_SINCE = "unneededSince"  # in an index value: since when no model needs the entry
# Filesystem clocks (an NFS server's) and the operator's differ: the Job keeps what a build
# touched up to this long before the decision, so a skew this size cannot remove a fresh touch.
CLOCK_SKEW_SECONDS = 600
POLL_SECONDS = 15.0  # while a GC Job runs: when to look for its result
WATCH_LAG_SECONDS = 2.0  # after the pass's index patch: when the operator's view of it is current
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_KEY = re.compile(r"[0-9a-f]{8,64}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One engine-index entry, as GC reads it."""

    index_key: str
    key: str
    target: str
    model: str  # the model directory the entry lives in (its path's middle part)
    claim: str
    size_bytes: int
    recorded_at: str  # ISO 8601: orders a model's entries, newest first
    unneeded_since: datetime.datetime | None
    result: Mapping[str, Any]


@dataclasses.dataclass
class Decision:
    updates: dict[str, str | None]  # index data key -> new value (marks), None: leaves the index
    due: list[Entry]
    keep: list[Entry]


def _iso(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_time(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)


def parse_entry(namespace: str, index_key: str, value: str | None, default_claim: str) -> Entry | None:
    """An index value as GC reads it; None when it is not one Kiln wrote (left alone)."""
    result = contract.parse_result(value)
    key, _, target = index_key.rpartition(".")
    if not result or not result.get("ok") or not _KEY.fullmatch(key) or not target:
        return None
    parts = str(result.get("path") or "").split("/")
    if len(parts) != 3 or parts[0] != namespace or parts[2] != key or not _NAME.fullmatch(parts[1]):
        return None
    size = result.get("sizeBytes")
    claim = result.get("claim") or default_claim
    return Entry(index_key, key, target, parts[1], str(claim),
                 size if isinstance(size, int) and not isinstance(size, bool) else 0,
                 str(result.get("recordedAt") or result.get("builtAt") or ""),
                 parse_time(result.get(UNNEEDED_SINCE)), result)


def engine_keys_of_status(status: Mapping[str, Any]) -> set[str]:
    """Every engine key a model's status says it serves, canaries or may roll back to."""
    keys = {status.get("engineKey")}
    for field in ("stable", "canary", "rollback"):
        keys.add((status.get(field) or {}).get("engineKey"))
    keys.update((e or {}).get("key") for e in status.get("engines") or ())
    return {k for k in keys if isinstance(k, str) and k}


def engine_keys_of_deployment(dep: Mapping[str, Any]) -> set[str]:
    """The keys a runtime Deployment's pods load: the last part of each `--engine arch=path`."""
    keys = set()
    for c in ((dep.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or ():
        args = list(c.get("args") or ())
        for flag, value in zip(args, args[1:]):
            if flag == "--engine" and isinstance(value, str):
                keys.add(value.partition("=")[2].rstrip("/").rpartition("/")[2])
    return {k for k in keys if k}


def decide(entries: Iterable[Entry], needed: set[str], models: set[str], now: datetime.datetime,
           retention: int, grace_seconds: float, dry_run: bool = False) -> Decision:
    """What a pass does to the index: marks set and cleared, the due entries, the rest."""
    entries = list(entries)
    kept: set[str] = set()
    groups: dict[tuple[str, str], list[Entry]] = {}
    for e in entries:
        if e.key not in needed:
            groups.setdefault((e.model, e.target), []).append(e)
    for (model, _), group in groups.items():
        if model in models:  # a deleted model has no rollback
            group.sort(key=lambda e: (e.recorded_at, e.key), reverse=True)
            kept.update(e.index_key for e in group[:retention])
    decision = Decision({}, [], [])
    for e in entries:
        wanted = e.key in needed or e.index_key in kept
        if wanted:
            if e.unneeded_since is not None:
                decision.updates[e.index_key] = _value({k: v for k, v in e.result.items() if k != UNNEEDED_SINCE})
            decision.keep.append(e)
        elif e.unneeded_since is None:
            decision.updates[e.index_key] = _value({**e.result, UNNEEDED_SINCE: _iso(now)})
            decision.keep.append(e)
        elif (now - e.unneeded_since).total_seconds() >= grace_seconds:
            decision.due.append(e)
            if not dry_run:
                decision.updates[e.index_key] = None
        else:
            decision.keep.append(e)
    return decision


MAX_STATUS_ENGINES = 20


def cache_status(namespace: str, model: str, index: Mapping[str, str], current: set[str],
                 default_claim: str) -> dict[str, Any] | None:
    """`status.cache`: the engines in the cache that live in this model's directory, newest
    first, what each is kept for, and their total size; None when it holds none."""
    held = [e for e in (parse_entry(namespace, k, v, default_claim) for k, v in index.items())
            if e is not None and e.model == model]
    if not held:
        return None
    held.sort(key=lambda e: (e.recorded_at, e.key), reverse=True)
    total = sum(e.size_bytes for e in held)
    engines = []
    for e in held[:MAX_STATUS_ENGINES]:
        row: dict[str, Any] = {"key": e.key, "target": e.target, "sizeBytes": e.size_bytes, "claim": e.claim,
                               "use": "current" if e.key in current else "unneeded" if e.unneeded_since
                               else "rollback"}
        if e.unneeded_since is not None and e.key not in current:
            row["unneededSince"] = _iso(e.unneeded_since)
        engines.append(row)
    return {"summary": f"{len(held)} engine{'s' if len(held) != 1 else ''}, {_size(total)}",
            "bytes": total, "engines": engines}


def _value(result: Mapping[str, Any]) -> str:
    return json.dumps(dict(result), sort_keys=True, separators=(",", ":"))


def job_name(claim: str) -> str:
    """One GC Job per claim and namespace (a hash: a claim name may be longer than a Job's)."""
    return f"kiln-cache-gc-{hashlib.sha256(claim.encode()).hexdigest()[:12]}"


def plan_of(namespace: str, decided_at: datetime.datetime, grace_seconds: float, dry_run: bool,
            due: list[Entry], keep: list[Entry]) -> dict[str, Any]:
    """The plan file `kiln cache-gc` executes (runtime/engine/cache/gc.py)."""
    cutoff = decided_at - datetime.timedelta(seconds=CLOCK_SKEW_SECONDS)
    return {"schema": 1, "namespace": namespace, "decidedAt": cutoff.timestamp(),
            "graceSeconds": grace_seconds, "dryRun": dry_run,
            "remove": [{"model": e.model, "key": e.key} for e in due],
            "keep": [{"model": e.model, "key": e.key} for e in keep]}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------ the pass

@dataclasses.dataclass
class Namespace:
    """What the pass reads of a namespace from the operator's in-memory indexes."""

    models: list[Mapping[str, Any]]
    deployments: list[Mapping[str, Any]]
    build_jobs: list[Mapping[str, Any]]


def needed_keys(ctx: Context, seen: Namespace) -> set[str]:
    needed: set[str] = set()
    for model in seen.models:
        _, _, engines = ctx.plan(model["metadata"]["uid"], model.get("spec") or {})
        needed.update(e.key for e in engines)
        needed |= engine_keys_of_status(model.get("status") or {})
        needed |= engine_keys_of_status(ctx.last_status.get(model["metadata"]["uid"]) or {})
    for dep in seen.deployments:
        needed |= engine_keys_of_deployment(dep)
    for job in seen.build_jobs:  # a build in flight publishes its key (a finished one holds only a result)
        key = ((job.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_KEY)
        if key and observations.job_state(job).phase == "Active":
            needed.add(key)
    return needed


async def collect(ctx: Context, namespace: str, read: Any) -> float:
    """One pass over a namespace; returns the seconds until the next. `read()` gives the
    namespace's `Namespace` at the moment it is called (the indexes, live)."""
    config, kube = ctx.config, ctx.kube
    index = await kube.get("ConfigMap", namespace, contract.ENGINE_INDEX)
    if index is None:
        return config.cache_gc_interval_seconds
    data = dict(index.get("data") or {})
    entries = [e for e in (parse_entry(namespace, k, v, config.cache_claim) for k, v in data.items()) if e]
    claims = sorted({e.claim for e in entries} | {config.cache_claim})
    busy = False
    for claim in claims:
        busy |= await _finish(ctx, namespace, claim)
    poll = min(POLL_SECONDS, config.cache_gc_interval_seconds)
    if busy:
        return poll
    now = ctx.clock()
    meta = index.get("metadata") or {}
    last = parse_time((meta.get("annotations") or {}).get(ANN_LAST_RUN) or meta.get("creationTimestamp"))
    if last is not None and (now - last).total_seconds() < config.cache_gc_interval_seconds:
        return config.cache_gc_interval_seconds - (now - last).total_seconds()

    # From reading the indexes to marking what is forgotten: no await, so no reconcile can
    # run in between and start using an entry this pass removes.
    seen = read()
    decision = decide(entries, needed_keys(ctx, seen), {m["metadata"]["name"] for m in seen.models}, now,
                      config.cache_gc_retention, config.cache_gc_grace_seconds, config.cache_gc_dry_run)
    if not config.cache_gc_dry_run:
        for e in decision.due:
            ctx.gc_forgotten.add((namespace, e.index_key))
            ctx.results.pop((namespace, e.index_key), None)
    patch = {"metadata": {"resourceVersion": index["metadata"].get("resourceVersion"),
                          "annotations": {ANN_LAST_RUN: _iso(now)}},
             "data": decision.updates}
    try:
        await kube.patch("ConfigMap", namespace, contract.ENGINE_INDEX, patch)
    except ApiError as e:
        for entry in decision.due:
            ctx.gc_forgotten.discard((namespace, entry.index_key))
        if e.status in (404, 409):
            logger.info("%s: the engine index changed during the cache GC pass; trying again", namespace)
            return config.retry_seconds
        raise
    if not config.cache_gc_dry_run:
        for e in decision.due:
            await _delete_build_job(ctx, namespace, e)
    changed = {e.model for e in entries if e.index_key in decision.updates}
    for model in seen.models:  # their status.cache says what changed, once the index view has it
        meta = model["metadata"]
        if meta["name"] in changed:
            ctx.wake(namespace, meta["name"], meta["uid"], WATCH_LAG_SECONDS)
    for claim in claims:
        due = [e for e in decision.due if e.claim == claim]
        keep = [e for e in decision.keep if e.claim == claim or e.claim == config.cache_claim]
        plan = plan_of(namespace, now, config.cache_gc_grace_seconds, config.cache_gc_dry_run, due, keep)
        report = {"claim": claim, "unneeded": [dict(model=e.model, key=e.key, target=e.target, bytes=e.size_bytes,
                                                    since=_iso(e.unneeded_since or now)) for e in due]}
        await _start(ctx, namespace, claim, plan, report)
    return poll


async def _delete_build_job(ctx: Context, namespace: str, e: Entry) -> None:
    """A finished build Job of a forgotten key still holds its result: without it, the next
    model that needs the key runs the build again (and so touches the entry)."""
    name = f"kiln-build-{e.key}-{e.target}"
    job = await ctx.kube.get("Job", namespace, name)
    if job is None or observations.job_state(job).phase == "Active":
        return
    uid = job["metadata"].get("uid")
    if await ctx.kube.delete("Job", namespace, name, uid=uid):
        ctx.replaced_jobs[(namespace, name)] = uid or ""


async def _start(ctx: Context, namespace: str, claim: str, plan: dict[str, Any], report: dict[str, Any]) -> None:
    kube, name = ctx.kube, job_name(claim)
    plan_name = manifests.cache_gc_plan_name(name, ctx.clock().strftime("%Y%m%d%H%M%S"))
    await kube.create(manifests.cache_gc_plan(namespace, plan_name, plan, report))
    job, created = await kube.create(manifests.cache_gc_job(namespace, claim, name, plan_name, ctx.config))
    if not created:  # another pass's Job (another operator): it reads its own plan
        await kube.delete("ConfigMap", namespace, plan_name)
        return
    await kube.patch("ConfigMap", namespace, plan_name, manifests.owned_by_job(job))
    logger.info("%s: cache GC of claim %s started (Job %s): %d entr%s due, %d kept%s", namespace, claim, name,
                len(plan["remove"]), "y" if len(plan["remove"]) == 1 else "ies", len(plan["keep"]),
                " (dry run)" if plan["dryRun"] else "")


async def _finish(ctx: Context, namespace: str, claim: str) -> bool:
    """Read a finished GC Job's result, tell it, delete the Job. True while one still runs."""
    name = job_name(claim)
    job = await ctx.kube.get("Job", namespace, name)
    if job is None:
        return False
    state = observations.job_state(job)
    if state.phase == "Active" or job["metadata"].get("deletionTimestamp"):
        return True
    pods = (await ctx.kube.request("GET", f"/api/v1/namespaces/{namespace}/pods",
                                   query=[("labelSelector", f"job-name={name}")])).get("items") or []
    result = observations.termination_result(pods) or {}
    plan_name = (job["metadata"].get("annotations") or {}).get(manifests.ANN_GC_PLAN) or ""
    data = ((await ctx.kube.get("ConfigMap", namespace, plan_name) if plan_name else None) or {}).get("data") or {}
    try:
        report, plan = json.loads(data.get("report.json") or "{}"), json.loads(data.get("plan.json") or "{}")
    except ValueError:
        report, plan = {}, {}
    # Deleted first: of two operators reading the same Job (a leader change), only the one
    # whose delete went through tells it.
    if await ctx.kube.delete("Job", namespace, name, uid=job["metadata"].get("uid")):
        await _tell(ctx, namespace, claim, state.phase == "Succeeded" and bool(result.get("ok")),
                    bool(plan.get("dryRun")), result, report, state)
    return True  # looked at again once it is gone


async def _tell(ctx: Context, namespace: str, claim: str, ok: bool, dry: bool, result: Mapping[str, Any],
                report: Mapping[str, Any], state: observations.JobState) -> None:
    m = ctx.metrics
    outcome = "failed" if not ok else "dry_run" if dry else "succeeded"
    m.cache_gc_runs.labels(namespace, claim, outcome).inc()
    if not ok:
        logger.warning("%s: cache GC of claim %s failed: %s %s", namespace, claim,
                       result.get("reason") or state.reason, result.get("message") or state.message)
        return
    m.cache_gc_last_success.labels(namespace, claim).set(ctx.clock().timestamp())
    skipped = {(s.get("model"), s.get("key")): s.get("reason") for s in result.get("skipped") or ()}
    verb = "would remove" if dry else "removed"
    told: list[tuple[Any, str, str]] = []  # (model, reason, message)
    for e in report.get("unneeded") or ():
        if (e.get("model"), e.get("key")) in skipped:
            logger.info("%s: kept engine %s of %s on claim %s: %s", namespace, e.get("key"), e.get("model"), claim,
                        skipped[(e.get("model"), e.get("key"))])
            continue
        told.append((e.get("model"), "unneeded", f"{verb} engine {e.get('key')} ({e.get('target')}, "
                     f"{_size(int(e.get('bytes') or 0))}) from the cache claim {claim}: no version of the model "
                     f"has needed it since {e.get('since')}"))
    for o in result.get("orphans") or ():
        told.append((o.get("model"), "orphan", f"{verb} {o.get('key')} ({_size(int(o.get('bytes') or 0))}) from "
                     f"the cache claim {claim}: no engine index entry names it"))
    models: dict[Any, list[str]] = {}
    for model, reason, message in told:
        models.setdefault(model, []).append(message)
        logger.info("%s/%s: %s", namespace, model, message)
        if not dry:
            m.cache_gc_removed_entries.labels(namespace, claim, reason).inc()
    if not dry:
        m.cache_gc_removed_bytes.labels(namespace, claim).inc(int(result.get("removedBytes") or 0))
    for model, messages in models.items():
        obj = await ctx.kube.get(contract.KIND, namespace, model) if isinstance(model, str) else None
        if obj is None:
            continue  # a deleted model: the log line says it
        involved = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": obj["metadata"]}
        for message in messages:
            await ctx.kube.event(involved, "Normal", "EngineRemovable" if dry else "EngineRemoved", message,
                                 now=ctx.clock())
