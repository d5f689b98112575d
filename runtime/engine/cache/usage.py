"""How full the engine cache is: the volume's bytes, and one namespace's entries.

`cache_usage(root, namespace)` reads the volume (statvfs of the cache root) and walks
`<root>/<namespace>/<model>/<key>/`: an entry is complete when its directory holds a
regular `manifest.json` (publish renames a finished entry into place, so a reader never
sees a half-written one); names that start with a dot (temporaries, quarantined and
trashed entries, `.lock`) are not entries. Nothing is opened and no symbolic link is
followed (lstat only), and the walk stops after `limit` entry directories, saying so
(`truncated`), so a scrape of a huge cache stays bounded.

`CachedCacheUsage` is what a runtime pod's /metrics reads: statvfs on every call (one
system call), the walk at most every `max_age` seconds by its clock, on a background
thread, so a scrape never waits on a walk of the volume.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.runtime.engine.cache.entry import MANIFEST

log = logging.getLogger("kiln.runtime.engine.cache")

SCAN_LIMIT = 100_000  # entry directories one walk looks at, at most
RESCAN_SECONDS = 60.0


@dataclass(frozen=True)
class VolumeUsage:
    """The cache volume as `df` sees it: used, free to an unprivileged writer (a build
    pod's ENOSPC comes when this reaches 0), and the file system's size."""

    used_bytes: int
    free_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class EntriesUsage:
    """One namespace's complete entries: how many, their files' bytes, and the oldest
    entry directory's mtime (epoch seconds; None without entries)."""

    entries: int = 0
    entry_bytes: int = 0
    oldest_mtime: float | None = None
    truncated: bool = False  # the walk stopped at its limit: the numbers are a lower bound


@dataclass(frozen=True)
class CacheUsage:
    volume: VolumeUsage | None  # None when the root cannot be read (not mounted yet)
    entries: EntriesUsage | None  # None until CachedCacheUsage's first walk ends


def volume_usage(root: str | os.PathLike) -> VolumeUsage | None:
    """statvfs of `root`; None when it fails."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return VolumeUsage(used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
                       free_bytes=st.f_bavail * st.f_frsize,
                       capacity_bytes=st.f_blocks * st.f_frsize)


def _subdirectories(path: str) -> list[os.DirEntry]:
    """The real directories in `path` whose names do not start with a dot (a symbolic link
    to one is not one)."""
    try:
        with os.scandir(path) as it:
            return [e for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _tree_bytes(path: str) -> int:
    """The sizes of the regular files under `path`, links neither followed nor counted."""
    total = 0
    pending = [path]
    while pending:
        try:
            with os.scandir(pending.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        pending.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
        except OSError:
            pass  # removed while we looked (GC): count what was there
    return total


def _is_complete(entry: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(os.path.join(entry, MANIFEST)).st_mode)
    except OSError:
        return False


def scan_entries(root: str | os.PathLike, namespace: str, limit: int = SCAN_LIMIT) -> EntriesUsage:
    """The complete entries under `<root>/<namespace>/`, looking at `limit` entry
    directories at most."""
    count = size = seen = 0
    oldest: float | None = None
    part = os.path.join(root, namespace)
    try:
        if not stat.S_ISDIR(os.lstat(part).st_mode):
            return EntriesUsage()  # a link is not the namespace's part (the root may be one)
    except OSError:
        return EntriesUsage()
    for model in _subdirectories(part):
        for entry in _subdirectories(model.path):
            if seen >= limit:
                return EntriesUsage(count, size, oldest, truncated=True)
            seen += 1
            if not _is_complete(entry.path):
                continue
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue  # removed while we looked
            count += 1
            size += _tree_bytes(entry.path)
            oldest = mtime if oldest is None else min(oldest, mtime)
    return EntriesUsage(count, size, oldest)


def cache_usage(root: str | os.PathLike, namespace: str, limit: int = SCAN_LIMIT) -> CacheUsage:
    """The volume under `root` and the complete entries of `namespace` in it."""
    return CacheUsage(volume_usage(root), scan_entries(root, namespace, limit))


def _in_thread(work: Callable[[], None]) -> None:
    threading.Thread(target=work, name="kiln-cache-usage", daemon=True).start()


class CachedCacheUsage:
    """`cache_usage` for a /metrics that is scraped often: the volume read at each call, the
    entries walked again once the last walk is `max_age` seconds old (by `clock`), by
    `run` (a daemon thread; tests pass one that runs it at once). Until the first walk
    ends, the entries are None."""

    def __init__(self, root: str | os.PathLike, namespace: str, *,
                 max_age: float = RESCAN_SECONDS, limit: int = SCAN_LIMIT,
                 clock: Callable[[], float] = time.monotonic,
                 run: Callable[[Callable[[], None]], None] = _in_thread):
        self.root = Path(root)
        self.namespace = namespace
        self._max_age = max_age
        self._limit = limit
        self._clock = clock
        self._run = run
        self._lock = threading.Lock()
        self._entries: EntriesUsage | None = None
        self._started: float | None = None  # when the last walk began
        self._walking = False
        self._warned = False

    def __call__(self) -> CacheUsage:
        now = self._clock()
        with self._lock:
            due = not self._walking and (self._started is None
                                         or now - self._started >= self._max_age)
            if due:
                self._walking, self._started = True, now
        if due:
            self._run(self._walk)
        return CacheUsage(volume_usage(self.root), self._entries)

    def _walk(self) -> None:
        try:
            entries = scan_entries(self.root, self.namespace, self._limit)
            if entries.truncated and not self._warned:
                self._warned = True
                log.warning("engine cache %s/%s: more than %d entry directories; the entry "
                            "metrics count the first %d only", self.root, self.namespace,
                            self._limit, self._limit)
            self._entries = entries
        except Exception:  # a scrape must not fail for it: the last numbers stay
            log.exception("engine cache usage: walking %s/%s failed", self.root, self.namespace)
        finally:
            with self._lock:
                self._walking = False
