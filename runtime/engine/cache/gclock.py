"""The lock between garbage collection and builds: one `.gc.lock` per model directory.

GC removes an entry only when its directory's mtime is older than the moment the operator
decided to remove it (the plan's `decidedAt`), so a build that uses an entry marks it: a
cache hit (use_entry) takes a SHARED flock on `<root>/<namespace>/<model>/.gc.lock`, looks
the entry up, touches it (os.utime: "last used") and releases. The executor (gc.py) takes
the EXCLUSIVE flock on the same file while it checks mtimes and renames entries away (the
deletion itself comes after, unlocked). So a build either touched the entry before GC
looked (GC skips it: "touched") or looks after GC renamed it away (a miss: it builds),
never "cache hit" on an entry being removed. A fresh publish's directory was written just
before its rename into place, so it is recent anyway.

Only the executor makes the lock file, in a pass of its own, LOCK_SETTLE_SECONDS before it
first locks it (see use_entry for how a build without one stays safe); it is never removed
(a lock on an unlinked file would not exclude one on its successor), and its dot name keeps
it out of every listing of entries. Waits are bounded (LockTimeout), never forever. Only
writers take the lock (builds, the GC Job); runtime pods mount the cache read-only and
never do.

NFS: Linux emulates flock on NFS (v4) with a whole-file POSIX lock, which the server holds
as a lease: a client that cannot renew it (partitioned, suspended) loses it after the lease
time (about 90 s) and another client may then take it. The lock file is opened read-write
because an emulated exclusive lock needs a file open for writing. A client may believe a
new file absent for a while (cached negative lookups): hence the settle time. Touches and
`decidedAt` are compared as times: the operator's clock and the volume's (the NFS server
sets mtimes) must agree to well within the grace period.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Iterator

from kiln.runtime.engine.cache.entry import CacheError, Manifest, entry_dir, lookup

GC_LOCK = ".gc.lock"
LOCK_TIMEOUT_SECONDS = 30.0
# How long the executor waits after making a model directory's lock file before it looks at
# mtimes: longer than an NFS client may keep believing the file is absent (a cached negative
# lookup, up to acdirmax, 60 s by default). Once per model directory: the file stays.
LOCK_SETTLE_SECONDS = 60.0


class LockTimeout(Exception):
    """The model directory's GC lock was not free within the timeout."""


@contextlib.contextmanager
def model_lock(model_dir: str | os.PathLike, *, exclusive: bool, create: bool,
               timeout: float = LOCK_TIMEOUT_SECONDS,
               dir_fd: int | None = None) -> Iterator[bool]:
    """Hold the GC lock of a model directory (shared or exclusive) for the `with` block.

    Yields True while held; False (nothing held) when there is no lock file and `create`
    is false. With `dir_fd`, `model_dir` is ignored and the lock file is in that directory
    (the executor's fd of the model directory, opened without following a link). The lock
    file is opened without following a symbolic link (ELOOP otherwise). Raises LockTimeout
    after `timeout` seconds; FileNotFoundError when the directory is gone and `create`.
    """
    path = GC_LOCK if dir_fd is not None else os.path.join(model_dir, GC_LOCK)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o666, dir_fd=dir_fd)
    except FileNotFoundError:
        if create:
            raise
        yield False
        return
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    where = GC_LOCK if dir_fd is not None else path
                    raise LockTimeout(f"{where}: not free within {timeout:g} s (an engine-cache "
                                      f"garbage collection or build holds it)") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.25)
        yield True
    finally:
        os.close(fd)  # releases the lock


def use_entry(root: str | os.PathLike, namespace: str, model: str, key: str, *,
              timeout: float = LOCK_TIMEOUT_SECONDS) -> Manifest | None:
    """What a build's cache hit runs: `lookup` under the shared GC lock, touching the entry
    it finds so that a garbage collection decided before now leaves it in place.

    A build never makes the lock file (only the executor does, so a cache no GC has run
    on holds just entries). Without one, the entry is looked up and touched unlocked and
    the lock file looked for again: still none, then no GC had made it, so none had looked
    at this entry's mtime before the touch; one now, then a GC may be at work here, so the
    entry is looked up again under the lock (the answer that counts).
    Raises what lookup raises (CacheError), and LockTimeout. Needs a writable cache.
    """
    model_dir = entry_dir(root, namespace, model, key).parent
    with model_lock(model_dir, exclusive=False, create=False, timeout=timeout) as held:
        if held:
            return _look_and_touch(root, namespace, model, key)
    try:
        unlocked, error = _look_and_touch(root, namespace, model, key), None
    except CacheError as e:  # perhaps a GC deleting it as we read: the locked look decides
        unlocked, error = None, e
    with model_lock(model_dir, exclusive=False, create=False, timeout=timeout) as held:
        if held:
            return _look_and_touch(root, namespace, model, key)
    if error is not None:
        raise error
    return unlocked


def _look_and_touch(root, namespace: str, model: str, key: str) -> Manifest | None:
    manifest = lookup(root, namespace, model, key)
    if manifest is not None:
        try:  # lookup opened it without following a link, so this is the entry itself
            os.utime(entry_dir(root, namespace, model, key), follow_symlinks=False)
        except FileNotFoundError:  # removed since (unlocked): a miss
            return None
    return manifest
