"""kopf wiring, and nothing else: every handler calls `reconcile.reconcile()`.

- InferenceModels: create / update / resume, and a resync (a level-triggered safety net with
  a long interval; it reads only in-memory indexes, so an idle tick costs no API call
  unless something drifted). The resync is a `Waker` timer, not a kopf timer: kopf puts a
  finalizer on every object with a timer, and a finalizer nobody removes once the operator
  is uninstalled keeps `kubectl delete` waiting forever. Nothing here needs one: what a
  model owns goes by ownerReferences, and its in-memory state goes on its DELETED event.
- What Kiln owns is watched through kopf indexes (in-memory views, filtered server-side
  with label/field selectors set in main.py): build Jobs and their pods, runtime
  Deployments and Services, the engine-index ConfigMaps. `reconcile()` reads these
  instead of the API.
- A runtime pod whose container ended with WarmupFailed (its samples failed) reconciles its
  model; runtime pods are not indexed (warmup.py lists them when it needs them).
- A watch event on a build Job or its pod reconciles every model that needs that Job
  (found through the `kiln_models_by_job` index, so models that share a Job without
  owning it are woken too); an event on a runtime Deployment or Service reconciles its model. That
  is how a finished build is acted on within a second, without polling.

- The engine index's watch events arm a per-namespace timer for cache GC passes
  (`CacheCollector`, cachegc.py); each pass sets the next.

- A change of the scaling-signal annotation (written by the alert receiver), or a rollout
  action (`kiln rollout promote|abort`), reconciles the model at once; a step that must look again later (a cooldown's end) gets a `Waker` timer.

Handlers are registered on an explicit registry by `register()`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

import kopf

from kiln.operator import cachegc, observations, reconcile, rollout
from kiln.operator import signals as sig
from kiln.runtime.api import contract

logger = logging.getLogger("kiln.operator.handlers")

MODELS = (contract.GROUP, contract.VERSION, contract.PLURAL)
JOBS = ("batch", "v1", "jobs")
PODS = ("", "v1", "pods")
DEPLOYMENTS = ("apps", "v1", "deployments")
SERVICES = ("", "v1", "services")
CONFIGMAPS = ("", "v1", "configmaps")

# Server-side selectors for the watch streams (main.py puts them into kopf's settings); the
# same filters repeat client-side on the handlers, in case a selector is not honoured.
LABEL_SELECTORS = {
    JOBS: contract.LABEL_KEY,
    # Build pods (indexed) and runtime pods (not indexed: only their warm-up failures are news).
    PODS: ",".join(f"{k}={v}" for k, v in contract.MANAGED_BY.items() if k.endswith("managed-by")),
    DEPLOYMENTS: ",".join(f"{k}={v}" for k, v in contract.MANAGED_BY.items() if k.endswith("managed-by")),
    SERVICES: ",".join(f"{k}={v}" for k, v in contract.MANAGED_BY.items() if k.endswith("managed-by")),
}
FIELD_SELECTORS = {CONFIGMAPS: f"metadata.name={contract.ENGINE_INDEX}"}
KILN = {k: v for k, v in contract.MANAGED_BY.items() if k.endswith("managed-by")}


# ------------------------------------------------------------------------ indexes

# The indexes keep only what reconcile() reads, so memory stays flat at hundreds of models
# (managedFields, kopf's own annotations and pod specs are the bulk of an object).
DROP_ANNOTATIONS = ("kiln.dev/last-handled-configuration", "kubectl.kubernetes.io/last-applied-configuration")


def _meta(body: Mapping[str, Any]) -> dict:
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    if meta.get("annotations"):
        meta["annotations"] = {k: v for k, v in meta["annotations"].items() if k not in DROP_ANNOTATIONS}
    return meta


def kiln_models(namespace: str, name: str, body: Mapping[str, Any], **_: Any) -> dict:
    slim = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": _meta(body),
            "spec": dict(body.get("spec") or {}), "status": dict(body.get("status") or {})}
    return {(namespace, name): slim}


def kiln_models_by_job(namespace: str, name: str, uid: str, spec: Mapping[str, Any], memo: Any, **_: Any) -> dict:
    """Which models need which build Job (so a Job event can wake all of them)."""
    try:
        _, _, engines = memo.ctx.plan(uid, dict(spec))
    except (ValueError, KeyError, TypeError):
        return {}
    return {(namespace, e.job_name): name for e in engines}


def kiln_jobs(namespace: str, name: str, body: Mapping[str, Any], **_: Any) -> dict:
    return {(namespace, name): {"metadata": _meta(body), "status": dict(body.get("status") or {})}}


def kiln_jobs_by_owner(namespace: str, body: Mapping[str, Any], **_: Any) -> dict:
    """The build Jobs each model created (its controller ownerReference), for obsolete-Job cleanup."""
    meta = body.get("metadata") or {}
    owners = [r.get("uid") for r in meta.get("ownerReferences") or ()
              if r.get("kind") == contract.KIND and r.get("controller") and r.get("uid")]
    slim = {"metadata": {k: meta.get(k) for k in ("name", "uid", "labels", "deletionTimestamp") if k in meta}}
    return {(namespace, uid): slim for uid in owners}


def kiln_build_pods(namespace: str, labels: Mapping[str, str], body: Mapping[str, Any], **_: Any) -> dict:
    job = labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")
    status = body.get("status") or {}
    slim = {"metadata": _meta(body), "status": {"containerStatuses": status.get("containerStatuses") or []}}
    return {(namespace, job): slim} if job else {}


def kiln_deployments(namespace: str, name: str, body: Mapping[str, Any], **_: Any) -> dict:
    spec = body.get("spec") or {}
    template = spec.get("template") or {}
    # The pod spec is in kiln.dev/applied; of the live one only what drift is checked on.
    containers = observations.slim_containers((template.get("spec") or {}).get("containers") or ())
    slim_spec = {"template": {"metadata": dict(template.get("metadata") or {}), "spec": {"containers": containers}}}
    if "replicas" in spec:
        slim_spec["replicas"] = spec["replicas"]
    return {(namespace, name): {"metadata": _meta(body), "spec": slim_spec, "status": dict(body.get("status") or {})}}


def kiln_services(namespace: str, name: str, body: Mapping[str, Any], **_: Any) -> dict:
    return {(namespace, name): {"metadata": _meta(body)}}


def kiln_engine_index(namespace: str, body: Mapping[str, Any], **_: Any) -> dict:
    return {namespace: dict(body.get("data") or {})}


def _one(index: Any, key: Any) -> Any:
    if key in index:
        for value in index[key]:
            return value
    return None


def views(kw: Mapping[str, Any]) -> reconcile.Views:
    """Views over the kopf indexes a handler received as keyword arguments."""
    jobs, pods, deps, svcs, cms = (kw["kiln_jobs"], kw["kiln_build_pods"], kw["kiln_deployments"],
                                   kw["kiln_services"], kw["kiln_engine_index"])
    by_owner, needs = kw["kiln_jobs_by_owner"], kw["kiln_models_by_job"]
    return reconcile.Views(
        job=lambda ns, name: _one(jobs, (ns, name)),
        pods=lambda ns, job: list(pods[(ns, job)]) if (ns, job) in pods else [],
        deployment=lambda ns, name: _one(deps, (ns, name)),
        service=lambda ns, name: _one(svcs, (ns, name)),
        engine_index=lambda ns: _one(cms, ns) or {},
        owned_jobs=lambda ns, uid: list(by_owner[(ns, uid)]) if (ns, uid) in by_owner else [],
        models_needing=lambda ns, job: set(needs[(ns, job)]) if (ns, job) in needs else set(),
    )


class Waker:
    """Reconciles a model again after a delay, through the same indexes the handlers got:
    for what ends with no watch event (a cooldown), and the resync. One timer per model, the
    earliest wins. Timers are set by reconciles, which kopf starts only on the leading
    operator; a reconcile a timer started sets the next one (docs/architecture.md: a replica
    that yields the lead keeps its timers)."""

    def __init__(self, memo: Any) -> None:
        self.memo = memo
        self.kw: Mapping[str, Any] | None = None  # the kopf indexes, live views, from any handler
        self.timers: dict[str, asyncio.TimerHandle] = {}

    def __call__(self, namespace: str, name: str, uid: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + max(seconds, 0.0)
        timer = self.timers.get(uid)
        if timer is not None and not timer.cancelled() and timer.when() <= when + 0.05:
            return
        if timer is not None:
            timer.cancel()
        self.timers[uid] = loop.call_at(when, lambda: asyncio.ensure_future(self._fire(namespace, name, uid)))

    async def _fire(self, namespace: str, name: str, uid: str) -> None:
        self.timers.pop(uid, None)
        if self.kw is not None:
            logger.info("%s/%s: reconciling on its timer", namespace, name)
            await _reconcile_models([(namespace, name)], self.memo, self.kw, logger)

    def cancel(self, uid: str) -> None:
        timer = self.timers.pop(uid, None)
        if timer is not None:
            timer.cancel()


class CacheCollector:
    """Runs a cache GC pass (cachegc.collect) per namespace on its own timer, which each pass
    sets again. Armed by the engine index's watch events, which kopf delivers only on the
    leading operator (and at its start, for every index there is)."""

    def __init__(self, memo: Any) -> None:
        self.memo = memo
        self.kw: Mapping[str, Any] | None = None
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.passes: set[asyncio.Task] = set()

    def arm(self, namespace: str, seconds: float) -> None:
        if namespace in self.timers or self.memo.ctx.config.cache_gc_interval_seconds <= 0:
            return
        loop = asyncio.get_running_loop()
        self.timers[namespace] = loop.call_later(max(seconds, 0.0), self._start, namespace)

    def _start(self, namespace: str) -> None:
        task = asyncio.ensure_future(self._fire(namespace))
        self.passes.add(task)
        task.add_done_callback(self.passes.discard)

    async def _fire(self, namespace: str) -> None:
        ctx = self.memo.ctx
        try:
            delay = await cachegc.collect(ctx, namespace, lambda: self._read(namespace))
        except Exception as e:  # noqa: BLE001 - a failed pass is tried again, never the operator's end
            logger.warning("%s: cache GC pass failed: %s", namespace, e)
            delay = ctx.config.retry_seconds * 6
        self.timers.pop(namespace, None)
        self.arm(namespace, delay)

    def _read(self, namespace: str) -> cachegc.Namespace:
        kw = self.kw or {}

        def values(index: Any) -> list[Any]:
            return [v for key in list(index or ()) if key[0] == namespace for v in index[key]]
        return cachegc.Namespace(models=values(kw.get("kiln_models")), deployments=values(kw.get("kiln_deployments")),
                                 build_jobs=values(kw.get("kiln_jobs")))


def _seen(memo: Any, kw: Mapping[str, Any]) -> None:
    waker = getattr(memo, "waker", None)
    if waker is None:
        memo.waker = waker = Waker(memo)
        memo.ctx.wake = waker
    waker.kw = kw
    collector = getattr(memo, "collector", None)
    if collector is None:
        memo.collector = collector = CacheCollector(memo)
    collector.kw = kw


# ------------------------------------------------------------------------ handlers

async def _reconcile(model: Mapping[str, Any], memo: Any, kw: Mapping[str, Any]) -> None:
    """Every entry point's reconcile. The resync is armed first, so a pass that fails is
    also tried again by then at the latest."""
    _seen(memo, kw)
    meta = model["metadata"]
    memo.waker(meta["namespace"], meta["name"], meta["uid"], memo.ctx.config.resync_seconds)
    await reconcile.reconcile(memo.ctx, dict(model), views(kw))


async def on_model(body: Mapping[str, Any], memo: Any, **kw: Any) -> None:
    """create / update / resume: reconcile; kopf retries on TemporaryError, stops on PermanentError."""
    await _reconcile(body, memo, kw)


async def _reconcile_quietly(body: Mapping[str, Any], memo: Any, kw: Mapping[str, Any], log: logging.Logger,
                             why: str) -> None:
    """Reconcile from a handler kopf does not retry: failures are logged, the next event or tick retries."""
    try:
        await _reconcile(body, memo, kw)
    except (kopf.TemporaryError, kopf.PermanentError) as e:
        log.debug(f"reconcile after {why}: {e}")


async def on_scaling_signal(uid: str, body: Mapping[str, Any], memo: Any, logger: logging.Logger, **kw: Any) -> None:
    """The alert receiver wrote a model's signal record: reconcile it now. An event handler,
    not an update handler: kopf keeps no diff-base for it, so a signal costs no second write."""
    text = ((body.get("metadata") or {}).get("annotations") or {}).get(sig.ANN_SIGNALS)
    if memo.ctx.signals_seen.get(uid) == text:
        return  # another change of the model (its status, kopf's annotations)
    memo.ctx.signals_seen[uid] = text
    await _reconcile_quietly(body, memo, kw, logger, "a scaling signal")


async def on_rollout_action(body: Mapping[str, Any], memo: Any, logger: logging.Logger, **kw: Any) -> None:
    """`kiln rollout promote|abort` set the action annotation: reconcile now (it takes and removes it)."""
    await _reconcile_quietly(body, memo, kw, logger, "a rollout action")


def _gone(type: str, **_: Any) -> bool:  # kopf names the watch event's type `type`
    return type == "DELETED"


async def on_model_gone(namespace: str, name: str, uid: str, memo: Any, **_: Any) -> None:
    """The model is gone from the API (a watch event, no finalizer): forget it."""
    memo.ctx.forget(uid)  # the owned objects go by ownerReferences (the garbage collector)
    memo.ctx.metrics.forget(namespace, name)
    if getattr(memo, "waker", None) is not None:
        memo.waker.cancel(uid)


async def _reconcile_models(names: list[tuple[str, str]], memo: Any, kw: Mapping[str, Any],
                            log: logging.Logger) -> None:
    models = kw["kiln_models"]
    for ns, name in names:
        model = _one(models, (ns, name))
        if model is None:
            continue  # gone: no reconcile, so no timer either
        try:
            await _reconcile(model, memo, kw)
        except (kopf.TemporaryError, kopf.PermanentError) as e:
            log.debug(f"reconcile of {ns}/{name} after a watch event: {e}")


async def _wake_models_of_job(namespace: str, job: str, memo: Any, kw: Mapping[str, Any],
                              log: logging.Logger) -> None:
    needs = kw["kiln_models_by_job"]
    names = sorted({(namespace, m) for m in needs[(namespace, job)]}) if (namespace, job) in needs else []
    await _reconcile_models(names, memo, kw, log)


async def on_job_event(namespace: str, name: str, memo: Any, logger: logging.Logger, **kw: Any) -> None:
    await _wake_models_of_job(namespace, name, memo, kw, logger)


async def on_build_pod_event(namespace: str, labels: Mapping[str, str], body: Mapping[str, Any], memo: Any,
                             logger: logging.Logger, **kw: Any) -> None:
    terminated = any((cs.get("state") or {}).get("terminated")
                     for cs in (body.get("status") or {}).get("containerStatuses") or ())
    job = labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")
    if not terminated or not job:
        return  # only a finished build pod carries news (its termination message)
    await _wake_models_of_job(namespace, job, memo, kw, logger)


async def on_runtime_pod_event(namespace: str, labels: Mapping[str, str], body: Mapping[str, Any], memo: Any,
                               logger: logging.Logger, **kw: Any) -> None:
    """A runtime pod's container ended because its warm-up samples failed: reconcile its model
    (which lists the pods and tells why). Any other change of a runtime pod is no news here."""
    if observations.warmup_failure([body], ((body.get("spec") or {}).get("containers") or [{}])[0].get("args")):
        model = labels[contract.LABEL_MODEL]
        memo.ctx.warmup_failing.add((namespace, model, labels.get(contract.LABEL_TRACK, "stable")))
        await _reconcile_models([(namespace, model)], memo, kw, logger)


async def on_runtime_event(namespace: str, labels: Mapping[str, str], memo: Any, logger: logging.Logger,
                           **kw: Any) -> None:
    """A runtime Deployment or Service changed or went: reconcile its model (label kiln.dev/model)."""
    model = labels.get(contract.LABEL_MODEL)
    if model:
        await _reconcile_models([(namespace, model)], memo, kw, logger)


async def on_engine_index(namespace: str, body: Mapping[str, Any], memo: Any, **kw: Any) -> None:
    """An engine index exists (or changed): its namespace gets cache GC passes, the first one
    an interval after the last (the index's annotation; a new index: its creation), and not
    before the indexes filled (a few seconds after the operator's start)."""
    _seen(memo, kw)
    interval = memo.ctx.config.cache_gc_interval_seconds
    meta = body.get("metadata") or {}
    last = cachegc.parse_time((meta.get("annotations") or {}).get(cachegc.ANN_LAST_RUN)
                              or meta.get("creationTimestamp"))
    since = (memo.ctx.clock() - last).total_seconds() if last else interval
    memo.collector.arm(namespace, max(interval - since, min(STARTUP_SECONDS, interval)))


# Before a first cache GC pass: kopf's indexes of models, Deployments and Jobs are full.
STARTUP_SECONDS = 10.0


def register(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    kopf.index(*MODELS, registry=registry)(kiln_models)
    kopf.index(*MODELS, registry=registry)(kiln_models_by_job)
    kopf.index(*JOBS, labels={contract.LABEL_KEY: kopf.PRESENT}, registry=registry)(kiln_jobs)
    kopf.index(*JOBS, labels={contract.LABEL_KEY: kopf.PRESENT}, registry=registry)(kiln_jobs_by_owner)
    kopf.index(*PODS, labels={contract.LABEL_KEY: kopf.PRESENT}, registry=registry)(kiln_build_pods)
    kopf.index(*DEPLOYMENTS, labels=KILN, registry=registry)(kiln_deployments)
    kopf.index(*SERVICES, labels=KILN, registry=registry)(kiln_services)
    kopf.index(*CONFIGMAPS, field="metadata.name", value=contract.ENGINE_INDEX, registry=registry)(kiln_engine_index)

    kopf.on.create(*MODELS, id="reconcile", registry=registry)(on_model)
    kopf.on.update(*MODELS, id="reconcile", field="spec", registry=registry)(on_model)
    kopf.on.resume(*MODELS, id="reconcile", registry=registry)(on_model)
    kopf.on.event(*MODELS, id="scaling-signal", annotations={sig.ANN_SIGNALS: kopf.PRESENT},
                  registry=registry)(on_scaling_signal)
    kopf.on.event(*MODELS, id="rollout-action", annotations={rollout.ANN_ACTION: kopf.PRESENT},
                  registry=registry)(on_rollout_action)
    kopf.on.event(*MODELS, id="forget", when=_gone, registry=registry)(on_model_gone)

    kopf.on.event(*JOBS, id="job", labels={contract.LABEL_KEY: kopf.PRESENT}, registry=registry)(on_job_event)
    kopf.on.event(*PODS, id="build-pod", labels={contract.LABEL_KEY: kopf.PRESENT}, registry=registry)(on_build_pod_event)
    kopf.on.event(*PODS, id="runtime-pod", labels={contract.LABEL_MODEL: kopf.PRESENT},
                  registry=registry)(on_runtime_pod_event)
    kopf.on.event(*DEPLOYMENTS, id="deployment", labels=KILN, registry=registry)(on_runtime_event)
    kopf.on.event(*SERVICES, id="service", labels=KILN, registry=registry)(on_runtime_event)
    kopf.on.event(*CONFIGMAPS, id="engine-index", field="metadata.name", value=contract.ENGINE_INDEX,
                  when=lambda type, **_: type != "DELETED", registry=registry)(on_engine_index)
    return registry
