"""Storing an entry: publish (atomic, by rename from a locked temporary), the removal of
temporaries a killed writer left, and quarantine (moving a corrupt entry aside)."""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from kiln.runtime.engine.cache.entry import (CHUNK_HASH, MANIFEST, CacheError, Manifest,
                                             path_component, entry_dir)
from kiln.runtime.engine.cache.gclock import use_entry
from kiln.runtime.engine.cache.verify import DIGEST_CHUNK_BYTES, compute_digests

TMP_PREFIX = ".tmp-"  # a publish in progress (or a crashed one)
QUARANTINE_PREFIX = ".quarantine-"  # a corrupt entry a build moved aside (GC removes it later)
QUARANTINE_REASON = "quarantine-reason.txt"  # inside it: why, for whoever looks at the volume
LOCK_FILE = ".lock"  # inside a temporary: flock'd by its writer while it lives


def _key_of(inputs: Mapping[str, Any]) -> str:
    # The same canonical form as enginekey.KeyInputs.key, so a manifest proves its key.
    from kiln.runtime.api.enginekey import KEY_LENGTH
    canonical = json.dumps(dict(inputs), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write and fsync one file. The single place publish writes data (tests inject ENOSPC here)."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def publish(root: str | os.PathLike, namespace: str, model: str, key: str,
            engine: bytes | bytearray | memoryview, *, engine_file: str,
            inputs: Mapping[str, Any], backend: str, backend_version: str, target: str,
            build_seconds: float, clock: Callable[[], float] = time.time,
            chunk_bytes: int = DIGEST_CHUNK_BYTES) -> Manifest:
    """Store an engine under its key atomically and return the entry's manifest.

    The manifest holds the engine's sha256 and the sha256 of each `chunk_bytes` piece,
    both computed here from the same bytes in memory (the bytes then written).

    If the key is already published (another builder won the race) the existing entry
    stays, ours is discarded, and the existing manifest is returned: keys are immutable.
    Returning it is a cache hit, so it is looked up as one (gclock.use_entry: touched).
    `inputs` is `KeyInputs.to_dict()`; it must hash to `key`.
    """
    path_component(engine_file, "engine file name")
    if engine_file == MANIFEST:
        raise ValueError(f"engine file may not be named {MANIFEST}")
    if _key_of(inputs) != key:
        raise ValueError(f"key inputs hash to {_key_of(inputs)}, not to the key {key}")
    final = entry_dir(root, namespace, model, key)
    existing = use_entry(root, namespace, model, key)
    if existing is not None:
        return existing

    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    view = memoryview(engine).cast("B")
    whole, chunks = compute_digests(view, chunk_bytes)
    manifest = Manifest(
        key=key, inputs=json.loads(json.dumps(dict(inputs))), engine_file=engine_file,
        sha256=whole, size_bytes=view.nbytes, backend=backend,
        backend_version=backend_version, target=target, build_seconds=round(build_seconds, 3),
        built_at=datetime.datetime.fromtimestamp(clock(), datetime.timezone.utc)
        .isoformat(timespec="seconds").replace("+00:00", "Z"),
        chunk_bytes=chunk_bytes, chunk_digests=chunks, chunk_hash=CHUNK_HASH,
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(root, namespace, model, key)
    tmp, lock = _locked_temporary(final.parent, key)
    try:
        _write_file(tmp / engine_file, view)
        _write_file(tmp / MANIFEST, manifest.to_json().encode())
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; runtime pods may run as another user
        # The lock stays held (on the open fd) until we return; without its file, a
        # cleanup leaves this temporary alone, and the entry holds just the two files.
        os.unlink(tmp / LOCK_FILE)
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Lost the race: the winner's entry is complete (it was renamed in whole).
            shutil.rmtree(tmp, ignore_errors=True)
            winner = use_entry(root, namespace, model, key)
            if winner is None:
                raise CacheError(f"{final} exists but holds no manifest") from e
            return winner
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return manifest


def _locked_temporary(parent: Path, key: str) -> tuple[Path, int]:
    """A new `.tmp-<key>-*` directory and the fd of the lock inside it, held (flock) for as
    long as the fd is open: the process's death releases it, which is how the next build
    of the key knows the temporary is debris."""
    for _ in range(3):
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key}-", dir=parent))
        fd = os.open(tmp / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Between creating the file and locking it, another builder's cleanup may have
        # taken the free lock and removed the directory: then start again.
        try:
            if os.path.samestat(os.fstat(fd), os.stat(tmp / LOCK_FILE)):
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise CacheError(f"{parent}: a new temporary for {key} was removed as soon as it was "
                     f"made, three times; is another cleanup running?")


def remove_dead_temporaries(root: str | os.PathLike, namespace: str, model: str,
                            key: str) -> list[Path]:
    """Remove this key's `.tmp-<key>-*` left by writers that died (killed mid-publish).

    A temporary whose lock can be taken without waiting has no live writer. One without a
    lock file (a publish between creating its directory and its lock, or about to rename)
    is left alone; garbage collection removes what is still there hours later. Other keys'
    temporaries are not touched. Returns the paths removed.
    """
    parent = entry_dir(root, namespace, model, key).parent
    prefix = f"{TMP_PREFIX}{key}-"
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    except FileNotFoundError:
        return []
    return [parent / name for name in names if remove_dead_temporary(parent, name)]


def remove_dead_temporary(parent: str | os.PathLike | int, name: str, *,
                          lockless_too: bool = False) -> bool:
    """Remove the temporary `name` in `parent` (a path, or a directory's fd) when its writer
    is dead: its lock can be taken without waiting. `lockless_too`: also one without a
    lock file (only for one far older than any publish: see remove_dead_temporaries).
    Returns whether it was removed."""
    dir_fd = parent if isinstance(parent, int) else None
    path = name if dir_fd is not None else os.path.join(parent, name)
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        if not lockless_too:
            return False
        shutil.rmtree(path, ignore_errors=True, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # a live writer
    try:
        # While holding the lock: see _locked_temporary.
        shutil.rmtree(path, ignore_errors=True, dir_fd=dir_fd)
    finally:
        os.close(fd)
    return True


def quarantine(root: str | os.PathLike, namespace: str, model: str, key: str,
               reason: str, *, clock: Callable[[], float] = time.time) -> Path | None:
    """Move a corrupt entry aside to `.quarantine-<key>-<UTC time>` in its model directory,
    with the reason in a file inside it, so the key can be built again. Readers never look
    there; garbage collection removes it after the stale age. Returns the new path, or None
    when the entry was gone already (another builder moved it first)."""
    final = entry_dir(root, namespace, model, key)
    stamp = datetime.datetime.fromtimestamp(clock(), datetime.timezone.utc)
    aside = final.with_name(f"{QUARANTINE_PREFIX}{key}-{stamp:%Y%m%dT%H%M%S.%fZ}")
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        return None
    if not aside.is_symlink():
        try:  # also what dates it for garbage collection (a rename keeps the old mtime)
            (aside / QUARANTINE_REASON).write_text(reason + "\n")
        except OSError:
            pass
    return aside
