"""Garbage collection on the volume: the executor of a plan the operator decided.

The operator decides (which keys of a namespace no model needs) and removes the due keys
from its engine index first; a `kiln cache-gc` Job then runs `collect` on the plan:

    {"schema": 1, "namespace": "ns", "decidedAt": <epoch seconds>, "graceSeconds": 3600,
     "dryRun": false, "remove": [{"model", "key"}, ...], "keep": [{"model", "key"}, ...]}

In `<root>/<namespace>/` only, never following a symbolic link:
- a `remove` entry goes unless its directory was touched at or after `decidedAt` (a build
  used it since: skipped, "touched"); the check and the rename away happen under the
  model directory's exclusive GC lock (gclock), the deletion after it;
- an entry in neither list (an orphan: a build by hand, a removal a killed Job left half
  done) goes once its mtime is older than now - graceSeconds; `keep` entries always stay;
- debris: `.trash-*` always, `.tmp-*` whose writer is dead (publish's lock test) and
  `.quarantine-*` once older than the stale age, a symbolic link where a model directory
  or an entry belongs (unlinked, never followed).
An entry goes by rename to `.trash-...` then deletion, so a reader never sees half of one.
A dry run reports the same, removing nothing. Model directories and their lock files stay.
"""

from __future__ import annotations

import math
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from kiln.runtime.engine.cache.entry import CacheError, path_component
from kiln.runtime.engine.cache.gclock import (GC_LOCK, LOCK_SETTLE_SECONDS, LOCK_TIMEOUT_SECONDS,
                                             LockTimeout, model_lock)
from kiln.runtime.engine.cache.publish import (QUARANTINE_PREFIX, TMP_PREFIX,
                                               remove_dead_temporary)

PLAN_SCHEMA = 1
TRASH_PREFIX = ".trash-"  # an entry GC renamed away before deleting it
STALE_TEMP_SECONDS = 6 * 3600  # a publish never takes this long; older temporaries are debris
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Log = Callable[[str], None]


class PlanError(ValueError):
    """The plan is malformed: refused as a whole, nothing removed."""


@dataclass(frozen=True)
class Plan:
    namespace: str
    decided_at: float
    grace_seconds: float
    dry_run: bool
    remove: frozenset[tuple[str, str]]  # (model, key)
    keep: frozenset[tuple[str, str]]

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("the plan must be a JSON object")
        if d.get("schema") != PLAN_SCHEMA or isinstance(d.get("schema"), bool):
            raise PlanError(f"plan schema {d.get('schema')!r}: this executor reads {PLAN_SCHEMA}")
        try:
            namespace = path_component(d.get("namespace"), "namespace")
        except ValueError as e:
            raise PlanError(f"plan.namespace: {e}") from None
        decided_at = _seconds(d, "decidedAt")
        grace = _seconds(d, "graceSeconds")
        dry_run = d.get("dryRun", False)
        if not isinstance(dry_run, bool):
            raise PlanError(f"plan.dryRun must be true or false, got {dry_run!r}")
        remove, keep = _items(d, "remove"), _items(d, "keep")
        both = remove & keep
        if both:
            model, key = sorted(both)[0]
            raise PlanError(f"{len(both)} entries are both in plan.remove and plan.keep, "
                            f"e.g. {model}/{key}")
        return cls(namespace, decided_at, grace, dry_run, remove, keep)


def _seconds(d: Mapping[str, Any], name: str) -> float:
    value = d.get(name)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise PlanError(f"plan.{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _items(d: Mapping[str, Any], name: str) -> frozenset[tuple[str, str]]:
    items = d.get(name, [])
    if not isinstance(items, list):
        raise PlanError(f"plan.{name} must be a list of {{model, key}}")
    out = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise PlanError(f"plan.{name}[{i}] must be an object {{model, key}}")
        try:
            out.add((path_component(item.get("model"), "model name"),
                     path_component(item.get("key"), "engine key")))
        except ValueError as e:
            raise PlanError(f"plan.{name}[{i}]: {e}") from None
    return frozenset(out)


@dataclass(frozen=True)
class Removal:
    model: str
    key: str  # an entry's key, or the debris' name
    bytes: int
    # "unneeded" (the plan's), "orphan"; debris: "trash", "temporary", "quarantine", "symlink"
    reason: str


@dataclass(frozen=True)
class Skip:
    model: str
    key: str
    reason: str  # "touched", "absent", "locked" (not free in time), "failed" (see the log)


@dataclass
class Outcome:
    dry_run: bool
    entries: list[Removal] = field(default_factory=list)  # the plan's and orphans
    debris: list[Removal] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The result (whole: `kiln cache-gc` cuts the lists to fit its termination log)."""
        return {"ok": True, "dryRun": self.dry_run, "removedEntries": len(self.entries),
                "removedBytes": sum(r.bytes for r in (*self.entries, *self.debris)),
                "removedDebris": len(self.debris), "seconds": round(self.seconds, 3),
                "skipped": [{"model": s.model, "key": s.key, "reason": s.reason}
                            for s in self.skipped],
                "orphans": [{"model": r.model, "key": r.key, "bytes": r.bytes}
                            for r in self.entries if r.reason == "orphan"],
                "truncated": 0}


def collect(root: str | os.PathLike, plan: Plan, *, dry_run: bool = False,
            now: float | None = None, stale_seconds: float = STALE_TEMP_SECONDS,
            lock_timeout: float = LOCK_TIMEOUT_SECONDS,
            settle_seconds: float = LOCK_SETTLE_SECONDS, log: Log | None = None) -> Outcome:
    """Carry out `plan` on the cache at `root` (see the module docstring); returns what was
    removed and skipped, logging a line per removal. `dry_run` (or the plan's) removes
    nothing and reports the same. `now` (epoch seconds) dates orphans and debris. Raises
    CacheError when the namespace directory is not a directory (a link is not followed)."""
    started = time.monotonic()
    run = _Executor(plan, Outcome(dry_run or plan.dry_run),
                    now=time.time() if now is None else now, stale_seconds=stale_seconds,
                    lock_timeout=lock_timeout, settle_seconds=settle_seconds,
                    log=log or (lambda _m: None))
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            ns_fd = os.open(plan.namespace, _DIR_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            ns_fd = None
        except OSError as e:  # ELOOP, ENOTDIR
            raise CacheError(f"{os.path.join(root, plan.namespace)}: not a directory "
                             f"({e.strerror}); a symbolic link is never followed") from None
    finally:
        os.close(root_fd)
    if ns_fd is None:
        run.out.skipped += [Skip(m, k, "absent") for m, k in sorted(plan.remove)]
    else:
        try:
            run.namespace(ns_fd)
        finally:
            os.close(ns_fd)
    run.out.seconds = time.monotonic() - started
    return run.out


@dataclass
class _Executor:
    plan: Plan
    out: Outcome
    now: float
    stale_seconds: float
    lock_timeout: float
    settle_seconds: float
    log: Log
    planned: dict[str, set[str]] = field(default_factory=dict)  # model -> the plan's keys

    def namespace(self, ns_fd: int) -> None:
        for model, key in self.plan.remove:
            self.planned.setdefault(model, set()).add(key)
        with os.scandir(ns_fd) as it:
            dirents = sorted(it, key=lambda e: e.name)
        scanned: set[str] = set()
        due: dict[str, dict[str, str]] = {}  # model -> {key: reason}, checked again locked
        for e in dirents:
            if e.name.startswith("."):
                continue  # never a model directory (path_component)
            if e.is_symlink():
                self.debris(ns_fd, e.name, e.name, "symlink")
            elif e.is_dir(follow_symlinks=False):
                candidates = self.scan_model(ns_fd, e.name)
                if candidates is not None:
                    scanned.add(e.name)
                    if candidates:
                        due[e.name] = candidates
        for model, key in sorted(self.plan.remove):
            if model not in scanned:
                self.out.skipped.append(Skip(model, key, "absent"))
        if (not self.out.dry_run and _make_lock_files(ns_fd, list(due))
                and self.settle_seconds > 0):
            time.sleep(self.settle_seconds)  # see gclock.LOCK_SETTLE_SECONDS
        for model, candidates in due.items():
            self.remove_due(ns_fd, model, candidates)

    def scan_model(self, ns_fd: int, model: str) -> dict[str, str] | None:
        """Remove one model directory's debris, report what was touched, and return the
        entries due ({key: "unneeded" or "orphan"}); None when the directory is gone."""
        try:
            mfd = os.open(model, _DIR_FLAGS, dir_fd=ns_fd)
        except OSError:  # gone, or replaced by a link since the listing
            return None
        plan, due = self.plan, {}
        try:
            planned = self.planned.get(model, set())
            with os.scandir(mfd) as it:
                dirents = sorted(it, key=lambda e: e.name)
            for e in dirents:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                old = self.now - st.st_mtime > self.stale_seconds
                if e.name.startswith(TRASH_PREFIX):
                    self.debris(mfd, model, e.name, "trash")
                elif e.name.startswith(QUARANTINE_PREFIX):
                    if old:
                        self.debris(mfd, model, e.name, "quarantine")
                elif e.name.startswith(TMP_PREFIX):
                    if old:
                        self.debris(mfd, model, e.name, "temporary")
                elif e.name.startswith("."):
                    continue  # GC_LOCK, or nothing publish makes
                elif stat.S_ISLNK(st.st_mode):
                    self.debris(mfd, model, e.name, "symlink")
                elif (model, e.name) in plan.keep:
                    continue
                elif e.name in planned:
                    if st.st_mtime >= plan.decided_at:
                        self.out.skipped.append(Skip(model, e.name, "touched"))
                    else:
                        due[e.name] = "unneeded"
                elif st.st_mtime < self.now - plan.grace_seconds:
                    due[e.name] = "orphan"
            seen = {e.name for e in dirents}
            self.out.skipped += [Skip(model, k, "absent") for k in sorted(planned - seen)]
        finally:
            os.close(mfd)
        return due

    def remove_due(self, ns_fd: int, model: str, candidates: dict[str, str]) -> None:
        try:
            mfd = os.open(model, _DIR_FLAGS, dir_fd=ns_fd)
        except OSError as e:
            self.failed(model, candidates, e)
            return
        try:
            if self.out.dry_run:  # nothing renamed: no lock needed
                self.remove_entries(mfd, model, candidates)
                return
            with model_lock(model, exclusive=True, create=True, timeout=self.lock_timeout,
                            dir_fd=mfd):
                trash = self.remove_entries(mfd, model, candidates)
            for name in trash:  # deleted unlocked: no reader looks at a .trash- name
                _delete(mfd, name)
        except LockTimeout:
            self.out.skipped += [Skip(model, k, "locked") for k in sorted(candidates)]
        except OSError as e:  # the lock file is a link, say
            self.failed(model, candidates, e)
        finally:
            os.close(mfd)

    def failed(self, model: str, candidates: dict[str, str], e: OSError) -> None:
        self.out.skipped += [Skip(model, k, "failed") for k in sorted(candidates)]
        self.log(f"{self.plan.namespace}/{model}: nothing removed: {e}")

    def remove_entries(self, mfd: int, model: str, candidates: dict[str, str]) -> list[str]:
        """Check each candidate again (under the lock, unless dry) and rename it away;
        returns the trash names to delete."""
        plan, trash = self.plan, []
        for key, reason in sorted(candidates.items()):
            try:
                st = os.stat(key, dir_fd=mfd, follow_symlinks=False)
            except FileNotFoundError:
                if reason == "unneeded":
                    self.out.skipped.append(Skip(model, key, "absent"))
                continue
            if stat.S_ISLNK(st.st_mode):  # replaced by a link since the scan
                self.debris(mfd, model, key, "symlink")
                continue
            since = plan.decided_at if reason == "unneeded" else self.now - plan.grace_seconds
            if st.st_mtime >= since:
                if reason == "unneeded":
                    self.out.skipped.append(Skip(model, key, "touched"))
                continue  # an orphan touched since is young again
            removal = Removal(model, key, _tree_bytes(mfd, key), reason)
            if not self.out.dry_run:
                aside = _trash_name(key)
                try:
                    os.rename(key, aside, src_dir_fd=mfd, dst_dir_fd=mfd)
                except OSError as e:
                    self.out.skipped.append(Skip(model, key, "failed"))
                    self.log(f"{plan.namespace}/{model}/{key}: not removed: {e}")
                    continue
                trash.append(aside)
            self.removed(removal, self.out.entries)
        return trash

    def debris(self, dir_fd: int, model: str, name: str, reason: str) -> None:
        """Remove one piece of debris in `dir_fd` (a link is unlinked, never followed)."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        removal = Removal(model, "" if name == model else name, _tree_bytes(dir_fd, name),
                          reason)
        if not self.out.dry_run:
            if reason == "temporary" and stat.S_ISDIR(st.st_mode):
                # Only a dead writer's (its lock is free), or one without a lock file.
                if not remove_dead_temporary(dir_fd, name, lockless_too=True):
                    return
            elif not _delete(dir_fd, name):
                return
        self.removed(removal, self.out.debris)

    def removed(self, removal: Removal, into: list[Removal]) -> None:
        into.append(removal)
        where = "/".join(p for p in (self.plan.namespace, removal.model, removal.key) if p)
        self.log(f"{'would remove' if self.out.dry_run else 'removed'} {where} "
                 f"({removal.bytes} bytes, {removal.reason})")


def _delete(dir_fd: int, name: str) -> bool:
    """Delete a directory tree, a file or a link in `dir_fd`; whether it was there."""
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _trash_name(key: str) -> str:
    # Within NAME_MAX however long the orphan's name.
    return f"{TRASH_PREFIX}{key[:180]}-{os.getpid()}-{time.monotonic_ns()}"


def _tree_bytes(dir_fd: int, name: str) -> int:
    """The sizes of the regular files in `name` (or of `name`, a file), links not followed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    return sum(_file_sizes(dir_fd, name)) if stat.S_ISDIR(st.st_mode) else 0


def _file_sizes(dir_fd: int, name: str) -> Iterator[int]:
    """The size of each regular file below `name`, one directory fd open at a time."""
    pending = [name]
    while pending:
        path = pending.pop()
        try:
            fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        yield st.st_size
                    elif stat.S_ISDIR(st.st_mode):
                        pending.append(f"{path}/{e.name}")
        finally:
            os.close(fd)


def _make_lock_files(ns_fd: int, models: list[str]) -> bool:
    """Make the GC lock file of each model directory that lacks one; whether any was made."""
    made = False
    for name in models:
        try:
            mfd = os.open(name, _DIR_FLAGS, dir_fd=ns_fd)
        except OSError:
            continue  # gone since: remove_locked says so
        try:
            os.close(os.open(GC_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o666, dir_fd=mfd))
            made = True
        except OSError:
            pass  # there already (or a link: the lock below refuses it)
        finally:
            os.close(mfd)
    return made
