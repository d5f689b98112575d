"""Engine-cache garbage collection on the volume: the executor of the operator's plan, the
lock protocol with builds' cache hits, and `kiln cache-gc`."""

import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.runtime.commands import cache_gc as gc_command
from kiln.runtime.engine.cache import publish as publishing
from kiln.runtime.engine.cache.entry import CacheError, entry_dir, lookup
from kiln.runtime.engine.cache.gc import (STALE_TEMP_SECONDS, Plan, PlanError, collect)
from kiln.runtime.engine.cache.gclock import GC_LOCK, LockTimeout, model_lock, use_entry
from kiln.runtime.engine.cache.publish import quarantine
from kiln.runtime.api import enginekey

NS = "ml"
KILN = str(Path(sys.executable).parent / "kiln")
T0 = 1_700_000_000.0  # when each entry here was last used (in the past), unless told otherwise
ENGINE = b"engine-bytes" * 100


def inputs(version):
    return enginekey.key_inputs({"uri": "pvc://models/r.onnx", "version": str(version)},
                                {"backend": "onnxruntime", "precision": "fp32"}, "cpu", "1.32.0")


def entry(root, model, version, *, ns=NS, used=T0):
    """A published entry, last used at `used`; returns its key."""
    ki = inputs(version)
    publishing.publish(root, ns, model, ki.key, ENGINE, engine_file="engine.onnx",
                       inputs=ki.to_dict(), backend="onnxruntime", backend_version="1.32.0",
                       target="cpu", build_seconds=1.0)
    os.utime(entry_dir(root, ns, model, ki.key), (used, used))
    return ki.key


def plan(remove=(), keep=(), *, decided=T0 + 10, grace=3600, **extra):
    return Plan.from_dict({"schema": 1, "namespace": NS, "decidedAt": decided,
                           "graceSeconds": grace, "dryRun": False,
                           "remove": [{"model": m, "key": k} for m, k in remove],
                           "keep": [{"model": m, "key": k} for m, k in keep], **extra})


def names(path):
    return sorted(p.name for p in Path(path).iterdir())


def entry_bytes(root, model, key):
    return sum(p.stat().st_size for p in entry_dir(root, NS, model, key).iterdir())


def test_removes_what_the_plan_says_and_nothing_else(tmp_path):
    k = [entry(tmp_path, "m1", v) for v in range(4)]
    other_model = entry(tmp_path, "m2", 0)
    elsewhere = entry(tmp_path, "m1", 0, ns="other")  # same model and key, another namespace
    size = entry_bytes(tmp_path, "m1", k[0])
    lines = []
    out = collect(tmp_path, plan([("m1", k[0]), ("m1", k[1])],
                                 [("m1", k[2]), ("m1", k[3]), ("m2", other_model)]),
                  now=T0 + 100, settle_seconds=0, log=lines.append)
    assert sorted(r.key for r in out.entries) == sorted(k[:2])
    assert names(tmp_path / NS / "m1") == sorted([GC_LOCK, k[2], k[3]])  # no trash left
    assert names(tmp_path / NS / "m2") == [other_model]  # nothing due there: not even a lock
    assert lookup(tmp_path, "other", "m1", elsewhere) is not None
    d = out.to_dict()
    assert d["removedEntries"] == 2 and d["removedBytes"] == 2 * size and d["skipped"] == []
    assert d["orphans"] == [] and d["ok"] and not d["dryRun"]
    assert f"removed ml/m1/{k[0]} ({size} bytes, unneeded)" in lines


def test_keep_and_young_orphans_stay_old_orphans_go(tmp_path):
    now = T0 + 10 * 86400
    kept = entry(tmp_path, "m", 0)  # older than any grace: kept because the plan says so
    young = entry(tmp_path, "m", 1, used=now - 60)
    old = entry(tmp_path, "m", 2, used=now - 7200)
    deleted_model = entry(tmp_path, "gone", 0, used=now - 7200)  # no model, no index entry
    size = entry_bytes(tmp_path, "m", old)
    out = collect(tmp_path, plan(keep=[("m", kept)], decided=now - 5), now=now, settle_seconds=0)
    assert names(tmp_path / NS / "m") == sorted([GC_LOCK, kept, young])
    assert names(tmp_path / NS / "gone") == [GC_LOCK]  # the directory and its lock stay
    assert sorted(out.to_dict()["orphans"], key=lambda o: o["model"]) == [
        {"model": "gone", "key": deleted_model, "bytes": size},
        {"model": "m", "key": old, "bytes": size}]
    assert {r.reason for r in out.entries} == {"orphan"} and out.skipped == []


def test_an_entry_touched_after_the_decision_stays(tmp_path):
    touched = entry(tmp_path, "m", 0, used=T0 + 20)  # a build used it after decidedAt
    hit = entry(tmp_path, "m", 1)
    assert use_entry(tmp_path, NS, "m", hit) is not None  # a build's cache hit touches it...
    assert os.stat(entry_dir(tmp_path, NS, "m", hit)).st_mtime > T0 + 10
    absent = inputs(9).key
    out = collect(tmp_path, plan([("m", touched), ("m", hit), ("m", absent), ("x", absent)]),
                  now=T0 + 100, settle_seconds=0)
    assert out.entries == []
    assert sorted((s.model, s.key, s.reason) for s in out.skipped) == sorted(
        [("m", touched, "touched"), ("m", hit, "touched"), ("m", absent, "absent"),
         ("x", absent, "absent")])
    assert lookup(tmp_path, NS, "m", touched) and lookup(tmp_path, NS, "m", hit)


def test_debris_goes_as_before(tmp_path):
    """What collect_garbage removed: trash always, dead temporaries and quarantined entries
    once older than the stale age; a live writer's temporary never."""
    key = entry(tmp_path, "m", 0)
    model_dir = tmp_path / NS / "m"
    crash = model_dir / f".tmp-{key}-crash"  # a killed writer's, no lock file
    crash.mkdir()
    (crash / "engine.onnx").write_bytes(b"half an eng")
    live, lock = publishing._locked_temporary(model_dir, key)
    trash = model_dir / f".trash-{key}-1-2"
    trash.mkdir()
    aside = quarantine(tmp_path, NS, "m", key, "sha256 does not match")
    since = (aside / "quarantine-reason.txt").stat().st_mtime
    for d in (crash, live):
        os.utime(d, (since, since))
    try:
        keep = plan(keep=[("m", key)], decided=since)
        out = collect(tmp_path, keep, now=since + 60, settle_seconds=0)
        assert [r.reason for r in out.debris] == ["trash"] and out.entries == []
        assert names(model_dir) == sorted([crash.name, live.name, aside.name])
        out = collect(tmp_path, keep, now=since + STALE_TEMP_SECONDS + 1, settle_seconds=0)
        assert sorted(r.reason for r in out.debris) == ["quarantine", "temporary"]
        assert names(model_dir) == [live.name]  # its writer holds the lock
    finally:
        os.close(lock)
    assert lookup(tmp_path, NS, "m", key) is None  # it was quarantined: the key builds again


def nothing_planned(**fields):
    return plan(keep=[], **fields)


# Moved from test_cache.py, collect_garbage's tests that still apply (the retention per
# model is the operator's decision now).
def test_crashed_writer_leaves_debris_that_lookup_ignores_and_gc_removes(tmp_path):
    key = inputs(0).key
    debris = tmp_path / NS / "m" / f".tmp-{key}-crash"
    debris.mkdir(parents=True)
    (debris / "engine.onnx").write_bytes(b"half an eng")
    assert lookup(tmp_path, NS, "m", key) is None
    mtime = debris.stat().st_mtime
    # A publish in progress (young temporary) is left alone...
    assert collect(tmp_path, nothing_planned(), now=mtime + 60).debris == []
    assert debris.exists()
    # ...one older than the bound is a crashed writer's and goes.
    out = collect(tmp_path, nothing_planned(), now=mtime + STALE_TEMP_SECONDS + 1)
    assert [(r.key, r.reason) for r in out.debris] == [(debris.name, "temporary")]
    assert not debris.exists()
    entry(tmp_path, "m", 0)  # and the key can still be published
    assert lookup(tmp_path, NS, "m", key) is not None


def test_quarantine_moves_an_entry_aside_where_readers_do_not_look_and_gc_removes_it(tmp_path):
    t0 = 1_800_000_000.0
    key = entry(tmp_path, "m", 0)
    aside = quarantine(tmp_path, NS, "m", key, "sha256 does not match", clock=lambda: t0)
    assert aside.name.startswith(f".quarantine-{key}-20270115T080000")
    assert (aside / "quarantine-reason.txt").read_text() == "sha256 does not match\n"
    assert lookup(tmp_path, NS, "m", key) is None
    assert quarantine(tmp_path, NS, "m", key, "again") is None  # moved already
    # Dated from the quarantine (not the entry's build), it is neither an entry (an orphan
    # after the grace period) nor removed before the stale age.
    since = (aside / "quarantine-reason.txt").stat().st_mtime
    out = collect(tmp_path, nothing_planned(grace=0), now=since + 60)
    assert out.debris == [] and out.entries == []
    out = collect(tmp_path, nothing_planned(grace=0), now=since + STALE_TEMP_SECONDS + 1)
    assert [r.key for r in out.debris] == [aside.name] and out.entries == []
    assert not aside.exists()


def test_what_is_not_a_directory_goes_whole(tmp_path):
    """A plain file where an entry belongs (publish never makes one), and a file left as
    trash: removed, nothing left behind."""
    model_dir = tmp_path / NS / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "stray").write_bytes(b"12345")
    (model_dir / ".trash-file").write_bytes(b"1")
    os.utime(model_dir / "stray", (T0, T0))
    out = collect(tmp_path, plan([("m", "stray")]), now=T0 + 100, settle_seconds=0)
    assert [(r.key, r.bytes) for r in out.entries] == [("stray", 5)]
    assert [r.reason for r in out.debris] == ["trash"] and names(model_dir) == [GC_LOCK]


def test_links_are_unlinked_never_followed(tmp_path):
    outside = tmp_path / "outside"
    victim = entry(outside, "m", 0)
    target = entry_dir(outside, NS, "m", victim)
    model_dir = tmp_path / NS / "m"
    model_dir.mkdir(parents=True)
    (model_dir / victim).symlink_to(target)  # a linked entry, named as the plan's
    (tmp_path / NS / "linked").symlink_to(outside / NS / "m")  # a linked model directory
    out = collect(tmp_path, plan([("m", victim), ("linked", victim)]), now=T0 + 1e6,
                  settle_seconds=0)
    assert sorted(r.reason for r in out.debris) == ["symlink", "symlink"] and out.entries == []
    assert not (model_dir / victim).is_symlink() and not (tmp_path / NS / "linked").is_symlink()
    assert lookup(outside, NS, "m", victim) is not None and names(target)
    assert {(s.model, s.reason) for s in out.skipped} == {("linked", "absent")}
    # The namespace directory itself a link: refused, nothing followed.
    (tmp_path / "ns2").symlink_to(outside / NS)
    with pytest.raises(CacheError, match="never followed"):
        collect(tmp_path, Plan.from_dict({**_plan_dict(), "namespace": "ns2"}))
    assert lookup(outside, NS, "m", victim) is not None


def test_dry_run_removes_nothing_and_reports_the_same(tmp_path):
    due = entry(tmp_path, "m", 0)
    orphan = entry(tmp_path, "m", 1)
    (tmp_path / NS / "m" / ".trash-x").mkdir()
    size = entry_bytes(tmp_path, "m", orphan)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    out = collect(tmp_path, plan([("m", due)]), dry_run=True, now=T0 + 1e6)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    d = out.to_dict()
    assert d["dryRun"] and d["removedEntries"] == 2 and d["removedDebris"] == 1
    assert d["orphans"] == [{"model": "m", "key": orphan, "bytes": size}]
    # The plan's own dryRun does the same.
    assert collect(tmp_path, plan([("m", due)], dryRun=True), now=T0 + 1e6).dry_run
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def _plan_dict(**fields):
    return {"schema": 1, "namespace": NS, "decidedAt": T0, "graceSeconds": 60, "dryRun": False,
            "remove": [{"model": "m", "key": "k"}], "keep": [], **fields}


BAD_PLANS = [
    {"schema": 2}, {"schema": True}, {"schema": None}, {"namespace": "../x"},
    {"namespace": "/abs"}, {"namespace": ".hidden"}, {"decidedAt": "now"},
    {"decidedAt": True}, {"graceSeconds": -1}, {"graceSeconds": float("nan")},
    {"dryRun": "yes"}, {"remove": {"model": "m"}},
    {"remove": [{"model": "m", "key": "k"}, {"model": "../m", "key": "k"}]},
    {"remove": [{"model": "m", "key": "/etc"}]}, {"remove": [{"model": "m", "key": ".."}]},
    {"remove": [{"model": "m", "key": ".gc.lock"}]}, {"remove": [{"model": "m", "key": "a/b"}]},
    {"remove": [{"model": "m"}]}, {"keep": [{"model": ".trash-x", "key": "k"}]},
    {"keep": [{"model": "m", "key": "k"}]},  # in both lists
]


@pytest.mark.parametrize("fields", BAD_PLANS, ids=str)
def test_a_bad_plan_is_refused_whole(fields):
    with pytest.raises(PlanError):
        Plan.from_dict(_plan_dict(**fields))


@pytest.mark.parametrize("fields", [BAD_PLANS[0], BAD_PLANS[12], BAD_PLANS[-1]], ids=str)
def test_the_command_refuses_a_bad_plan_whole(tmp_path, fields):
    """Exit 2, BadRequest, nothing removed: not even the plan's good items."""
    key = entry(tmp_path, "m", 0)
    bad = json.loads(json.dumps(_plan_dict(**fields)).replace('"k"', json.dumps(key)))
    proc, result = kiln_gc(tmp_path, bad)
    assert proc.returncode == 2, proc.stderr
    assert result["reason"] == "BadRequest" and not result["ok"] and "refused" in result["message"]
    assert lookup(tmp_path, NS, "m", key) is not None


def kiln_gc(tmp_path, plan_dict, *argv):
    plan_file, term = tmp_path / "plan.json", tmp_path / "termination-log"
    plan_file.write_text(json.dumps(plan_dict))
    proc = subprocess.run([KILN, "cache-gc", "--plan", str(plan_file), "--cache-dir",
                           str(tmp_path), "--termination-log", str(term), *argv],
                          capture_output=True, text=True, timeout=120)
    return proc, (json.loads(term.read_text()) if term.exists() else None)


def test_the_command_end_to_end_fits_10000_orphans_in_4_kib(tmp_path):
    model_dir = tmp_path / NS / "old"
    model_dir.mkdir(parents=True)
    for i in range(10_000):  # orphans as a by-hand build would leave them (no manifest needed)
        d = model_dir / f"{i:020x}"
        d.mkdir()
        (d / "engine.onnx").write_bytes(b"x" * 10)
        os.utime(d, (T0, T0))
    due = entry(tmp_path, "m", 0)
    size = entry_bytes(tmp_path, "m", due)
    touched = entry(tmp_path, "m", 1, used=time.time() + 60)
    plan_dict = {"schema": 1, "namespace": NS, "decidedAt": time.time(), "graceSeconds": 60,
                 "dryRun": False, "remove": [{"model": "m", "key": k} for k in (due, touched)],
                 "keep": []}
    # New lock files: without the flag the executor would wait LOCK_SETTLE_SECONDS.
    proc, result = kiln_gc(tmp_path, plan_dict, "--lock-settle-seconds", "0")
    assert proc.returncode == 0, proc.stderr
    term = (tmp_path / "termination-log").read_bytes()
    assert len(term) <= 4096 and json.loads(proc.stdout) == result
    assert result["ok"] and result["removedEntries"] == 10_001
    assert result["removedBytes"] == 10 * 10_000 + size
    assert result["skipped"] == [{"model": "m", "key": touched, "reason": "touched"}]
    assert 0 < len(result["orphans"]) < 10_000
    assert result["truncated"] == 10_000 - len(result["orphans"])
    assert names(model_dir) == [GC_LOCK] and names(tmp_path / NS / "m") == [GC_LOCK, touched]
    assert f"removed ml/m/{due} (" in proc.stderr and "unneeded)" in proc.stderr
    assert proc.stderr.count(" (10 bytes, orphan)") == 10_000


def test_fit_cuts_orphans_before_skipped():
    result = {"ok": True, "dryRun": False, "removedEntries": 0, "removedBytes": 0,
              "removedDebris": 0, "seconds": 0.1,
              "skipped": [{"model": "m", "key": f"{i:020x}", "reason": "touched"}
                          for i in range(20)],
              "orphans": [{"model": "m", "key": f"{i:020x}", "bytes": 1} for i in range(500)],
              "truncated": 0}
    text = gc_command.fit(result)
    got = json.loads(text)
    assert len(text.encode()) <= 4096 and got["skipped"] == result["skipped"]
    assert got["orphans"] == result["orphans"][:len(got["orphans"])]
    assert got["truncated"] == 500 - len(got["orphans"])
    assert json.loads(gc_command.fit({**result, "orphans": []}))["truncated"] == 0


# -- the race: a build's cache hit against the executor --------------------------------

def _hit_when(root, key, go, results):
    go.wait()
    results.put(use_entry(root, NS, "m", key) is not None)


def test_a_build_waits_for_the_executors_lock_and_then_misses(tmp_path):
    key = entry(tmp_path, "m", 0)
    model_dir = tmp_path / NS / "m"
    ctx = multiprocessing.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    # Forked before the lock is taken: a child holding the parent's lock fd would hold it too.
    child = ctx.Process(target=_hit_when, args=(tmp_path, key, go, results))
    child.start()
    with model_lock(model_dir, exclusive=True, create=True):
        go.set()
        time.sleep(0.3)  # the build is waiting for the shared lock now
        assert results.empty()
        os.rename(entry_dir(tmp_path, NS, "m", key), model_dir / ".trash-x")  # as GC does
    assert results.get(timeout=10) is False  # a miss: it builds, never reports a hit
    child.join(10)
    with model_lock(model_dir, exclusive=True, create=True):
        with pytest.raises(LockTimeout, match="not free within 0.2 s"):
            use_entry(tmp_path, NS, "m", key, timeout=0.2)


def _hit_after(root, key, delay, barrier, results):
    barrier.wait()
    time.sleep(delay)
    results.put(use_entry(root, NS, "m", key) is not None)


@pytest.mark.parametrize("lock_file", ["made by an earlier GC", "not made yet"])
def test_a_cache_hit_racing_the_executor_is_kept_or_a_miss(tmp_path, lock_file):
    """Many rounds of a build's hit (in another process) against collect on the same entry,
    at random offsets: each ends kept-and-touched with a hit, or removed with a miss."""
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(23)
    outcomes = set()
    for round_ in range(40):
        root = tmp_path / str(round_)
        key = entry(root, "m", 0)
        if lock_file == "made by an earlier GC":
            (root / NS / "m" / GC_LOCK).touch()
        # Decided before the build starts (a model re-created since); a second earlier, as
        # file times come from a coarser clock than time.time().
        decided = plan([("m", key)], decided=time.time() - 1)
        barrier, results = ctx.Barrier(2), ctx.Queue()
        child = ctx.Process(target=_hit_after,
                            args=(root, key, rng.uniform(0, 0.004), barrier, results))
        child.start()
        barrier.wait()
        time.sleep(rng.uniform(0, 0.004))
        out = collect(root, decided, settle_seconds=0)
        hit = results.get(timeout=10)
        child.join(10)
        removed = [r.key for r in out.entries] == [key]
        exists = lookup(root, NS, "m", key) is not None
        assert (hit and exists and not removed and out.skipped[0].reason == "touched") or (
            not hit and removed and not exists), (hit, removed, exists, out)
        outcomes.add(hit)
    assert outcomes  # (both orders are usual; either alone is still correct)


@pytest.mark.timeout(300)
def test_kiln_build_racing_the_executor_never_reports_a_hit_for_a_removed_entry(
        tmp_path, matmul_onnx):
    """The real `kiln build` (a cache hit unless GC removed the entry first) while
    `kiln cache-gc` removes its key, at several offsets."""
    model = tmp_path / "models" / "mlp" / "model.onnx"
    model.parent.mkdir(parents=True)
    model.write_bytes(matmul_onnx)
    req = {"namespace": NS, "name": "mlp", "model": {"uri": "pvc://models/mlp/model.onnx",
                                                     "version": "1"},
           "engine": {"backend": "onnxruntime", "precision": "fp32"}, "target": "cpu"}
    cache = tmp_path / "cache"

    def build():
        return subprocess.Popen(
            [KILN, "build", "--request", json.dumps(req), "--cache-dir", str(cache),
             "--pvc-root", str(tmp_path), "--termination-log", str(tmp_path / "build-term")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = build()
    assert first.wait(120) == 0, first.stderr.read()
    key = json.loads((tmp_path / "build-term").read_text())["key"]
    seen = set()
    for delay in (0.0, 0.4, 0.8, 1.2, 1.6, 3.0):
        entry_path = entry_dir(cache, NS, "mlp", key)
        os.utime(entry_path, (T0, T0))
        proc = build()
        time.sleep(delay)
        plan_file = tmp_path / "plan.json"
        plan_file.write_text(json.dumps({"schema": 1, "namespace": NS, "decidedAt": T0 + 10,
                                         "graceSeconds": 3600, "dryRun": False,
                                         "remove": [{"model": "mlp", "key": key}], "keep": []}))
        gc = subprocess.run([KILN, "cache-gc", "--plan", str(plan_file), "--cache-dir",
                             str(cache), "--lock-settle-seconds", "0"],
                            capture_output=True, text=True, timeout=120)
        assert gc.returncode == 0, gc.stderr
        assert proc.wait(120) == 0, proc.stderr.read()
        built = json.loads((tmp_path / "build-term").read_text())
        gc_result = json.loads(gc.stdout)
        removed = gc_result["removedEntries"] == 1
        if built["cacheHit"]:
            assert not removed and gc_result["skipped"][0]["reason"] == "touched"
        else:
            assert removed  # the build saw the miss and built it again
        assert lookup(cache, NS, "mlp", key) is not None  # either way the key is there after
        seen.add(built["cacheHit"])
    assert seen


HOSTILE_FILES = {
    # name -> (how to make it at a path, what the message says)
    "FIFO": (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    "/dev/zero": (lambda p: os.symlink("/dev/zero", p), "is a character device, not a regular file"),
    "huge": (lambda p: p.write_bytes(b" " * (17 << 20)), "bytes, the limit for it"),
    "deep JSON": (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nests too deeply"),
    "long integer": (lambda p: p.write_text('{"schema": ' + "9" * 5000 + "}"), "is refused: "),
    "not UTF-8": (lambda p: p.write_bytes(b'{"schema": "\xff"}'), "is not UTF-8 text (byte 12)"),
}


@pytest.mark.timeout(60)  # a FIFO opened for a blocking read would hang the command forever
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_plan_file_that_cannot_be_read_is_bad_request_exit_2_nothing_removed(tmp_path, kind):
    make, says = HOSTILE_FILES[kind]
    key = entry(tmp_path, "m", 0)
    plan_file, term = tmp_path / "plan.json", tmp_path / "termination-log"
    make(plan_file)
    proc = subprocess.run([KILN, "cache-gc", "--plan", str(plan_file), "--cache-dir",
                           str(tmp_path), "--termination-log", str(term)],
                          capture_output=True, text=True, timeout=50)
    result = json.loads(term.read_text())
    assert proc.returncode == 2, proc.stderr
    assert result["reason"] == "BadRequest" and says in result["message"], result
    assert result["message"].startswith(f"the plan {plan_file}" if kind not in ("FIFO", "/dev/zero")
                                         else "the plan: ")
    assert "Traceback" not in proc.stderr and lookup(tmp_path, NS, "m", key) is not None


def test_a_plan_with_a_namespace_longer_than_a_file_name_is_refused(tmp_path):
    proc, result = kiln_gc(tmp_path, {**_plan_dict(), "namespace": "n" * 5000})
    assert proc.returncode == 2 and result["reason"] == "BadRequest"
    assert "5000 bytes, over the 255 of a file name" in result["message"], result
