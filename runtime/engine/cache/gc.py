"""Garbage collection: unreferenced entries beyond a retention per model, and debris."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Iterable

from kiln.runtime.engine.cache.entry import CacheError, read_entry_manifest
from kiln.runtime.engine.cache.publish import QUARANTINE_PREFIX, TMP_PREFIX

TRASH_PREFIX = ".trash-"  # an entry GC renamed away before deleting it
STALE_TEMP_SECONDS = 6 * 3600  # a publish never takes this long; older temporaries are debris


def _remove(path: Path) -> None:
    # Rename first so a reader never sees a half-deleted entry, then delete at leisure.
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _in_use(in_use: Iterable[str | tuple[str, str, str]]) -> tuple[set[str], set[tuple]]:
    keys: set[str] = set()
    triples: set[tuple] = set()
    for item in in_use:
        if isinstance(item, str):
            keys.add(item)
        else:
            triples.add(tuple(item))
    return keys, triples


def collect_garbage(root: str | os.PathLike, in_use: Iterable[str | tuple[str, str, str]],
                    retention: int, *, now: float | None = None,
                    stale_seconds: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Remove unreferenced entries beyond `retention` per model, and a crashed writer's debris.

    `in_use` holds keys (protected under every model) or (namespace, model, key) triples.
    Per model, the `retention` most recently built entries that are not in use are kept
    for rollback; in-use entries are never removed. Temporaries older than `stale_seconds`
    (by `now`, epoch seconds) are removed. Returns the paths removed.
    """
    if retention < 0:
        raise ValueError(f"retention must be >= 0, got {retention}")
    now = time.time() if now is None else now
    keys, triples = _in_use(in_use)
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for ns_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for model_dir in sorted(p for p in ns_dir.iterdir()
                                if p.is_dir() and not p.name.startswith(".")):
            candidates: list[tuple[str, Path]] = []
            for d in model_dir.iterdir():
                if not d.is_dir():
                    continue
                age = now - d.stat().st_mtime
                if d.name.startswith(TRASH_PREFIX):
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(d)
                    continue
                if d.name.startswith((TMP_PREFIX, QUARANTINE_PREFIX)):
                    if age > stale_seconds:
                        shutil.rmtree(d, ignore_errors=True)
                        removed.append(d)
                    continue
                if d.name in keys or (ns_dir.name, model_dir.name, d.name) in triples:
                    continue
                try:
                    manifest = read_entry_manifest(d)
                except CacheError:
                    manifest = None
                if manifest is None:
                    # Not something publish makes: only remove it once it is clearly old.
                    if age > stale_seconds:
                        _remove(d)
                        removed.append(d)
                    continue
                candidates.append((manifest.built_at, d))
            candidates.sort(key=lambda c: (c[0], c[1].name), reverse=True)
            for _, d in candidates[retention:]:
                _remove(d)
                removed.append(d)
    return removed
