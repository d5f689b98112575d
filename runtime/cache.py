"""The engine cache: immutable, verified entries on a shared volume.

Layout: `<root>/<namespace>/<model>/<key>/` holds the engine file (named by the backend's
`engine_filename`) and `manifest.json`. Builders publish into a temporary sibling
(`.tmp-*`) and rename it into place, so a reader sees a complete entry or none, and two
builders of one key end with one valid entry. Runtime pods read the engine in one
streaming pass that hashes as it reads and refuse it when size or sha256 differ from the
manifest. Garbage collection keeps what is in use plus a few recent entries for rollback.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from kiln.runtime.backends.base import ShapeRange

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
TMP_PREFIX = ".tmp-"  # a publish in progress (or a crashed one)
TRASH_PREFIX = ".trash-"  # an entry GC renamed away before deleting it
CHUNK_BYTES = 8 << 20  # large enough to amortize syscalls, small enough to stay in cache
STALE_TEMP_SECONDS = 6 * 3600  # a publish never takes this long; older temporaries are debris


class CacheError(Exception):
    """The cache cannot serve or store an entry (bad layout, unreadable manifest)."""


class CacheIntegrityError(CacheError):
    """An engine file does not match its manifest: it must not be loaded."""


@dataclass(frozen=True)
class Manifest:
    key: str
    inputs: dict
    engine_file: str
    sha256: str
    size_bytes: int
    backend: str
    backend_version: str
    target: str
    build_seconds: float
    built_at: str  # ISO 8601, UTC

    def to_json(self) -> str:
        return json.dumps({
            "schema": MANIFEST_SCHEMA,
            "key": self.key,
            "inputs": self.inputs,
            "engineFile": self.engine_file,
            "sha256": self.sha256,
            "sizeBytes": self.size_bytes,
            "backend": self.backend,
            "backendVersion": self.backend_version,
            "target": self.target,
            "buildSeconds": self.build_seconds,
            "builtAt": self.built_at,
        }, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        try:
            d = json.loads(text)
            return cls(
                key=str(d["key"]), inputs=dict(d["inputs"]), engine_file=str(d["engineFile"]),
                sha256=str(d["sha256"]).lower(), size_bytes=int(d["sizeBytes"]),
                backend=str(d["backend"]), backend_version=str(d["backendVersion"]),
                target=str(d["target"]), build_seconds=float(d["buildSeconds"]),
                built_at=str(d["builtAt"]),
            )
        except (ValueError, TypeError, KeyError) as e:
            raise CacheError(f"invalid manifest: {type(e).__name__}: {e}") from e

    def profiles(self) -> dict[str, ShapeRange]:
        """The optimization profiles the engine was built with, as the loader wants them."""
        return {
            p["input"]: ShapeRange(tuple(p["min"]), tuple(p["opt"]), tuple(p["max"]))
            for p in self.inputs.get("profiles", [])
        }


@dataclass(frozen=True)
class LoadTimings:
    # Reading and hashing overlap; verify_seconds is only the hashing left after the last
    # byte arrived, i.e. what verification adds to a load.
    read_seconds: float
    verify_seconds: float


def _component(value: str, what: str) -> str:
    if (not isinstance(value, str) or not value or value in (".", "..") or value.startswith(".")
            or "/" in value or "\\" in value or "\0" in value):
        raise ValueError(f"invalid {what} {value!r} for a cache path: use a plain name "
                         f"(no '/', not starting with '.')")
    return value


def relative_path(namespace: str, model: str, key: str) -> str:
    """The entry's path below the cache root: what the operator passes to pods."""
    return "/".join((_component(namespace, "namespace"), _component(model, "model name"),
                     _component(key, "engine key")))


def entry_dir(root: str | os.PathLike, namespace: str, model: str, key: str) -> Path:
    return Path(root) / relative_path(namespace, model, key)


def _key_of(inputs: Mapping[str, Any]) -> str:
    # The same canonical form as enginekey.KeyInputs.key, so a manifest proves its key.
    from kiln.runtime.enginekey import KEY_LENGTH
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


def _read_manifest(directory: Path) -> Manifest | None:
    try:
        text = (directory / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    try:
        return Manifest.from_json(text)
    except CacheError as e:
        raise CacheError(f"{directory / MANIFEST}: {e}") from e


def lookup(root: str | os.PathLike, namespace: str, model: str, key: str) -> Manifest | None:
    """The manifest of a complete entry, or None. Temporaries are never complete entries.

    Cheap: checks the engine file's size, not its digest (read_verified does that).
    """
    directory = entry_dir(root, namespace, model, key)
    manifest = _read_manifest(directory)
    if manifest is None:
        return None
    if manifest.key != key:
        raise CacheIntegrityError(
            f"{directory / MANIFEST} names key {manifest.key}, but the entry is {key}")
    _engine_file(directory, manifest)
    return manifest


def _engine_file(directory: Path, manifest: "Manifest") -> tuple[Path, int]:
    """The entry's engine path and size, once its size matches the manifest's."""
    path = directory / manifest.engine_file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CacheIntegrityError(f"{path}: engine file missing from a published entry") from None
    if size != manifest.size_bytes:
        raise CacheIntegrityError(
            f"{path}: size {size} bytes, manifest expects {manifest.size_bytes} bytes "
            f"(truncated or replaced); refusing to load it")
    return path, size


def publish(root: str | os.PathLike, namespace: str, model: str, key: str,
            engine: bytes | bytearray | memoryview, *, engine_file: str,
            inputs: Mapping[str, Any], backend: str, backend_version: str, target: str,
            build_seconds: float, clock: Callable[[], float] = time.time) -> Manifest:
    """Store an engine under its key atomically and return the entry's manifest.

    If the key is already published (another builder won the race) the existing entry
    stays, ours is discarded, and the existing manifest is returned: keys are immutable.
    `inputs` is `KeyInputs.to_dict()`; it must hash to `key`.
    """
    _component(engine_file, "engine file name")
    if engine_file == MANIFEST:
        raise ValueError(f"engine file may not be named {MANIFEST}")
    if _key_of(inputs) != key:
        raise ValueError(f"key inputs hash to {_key_of(inputs)}, not to the key {key}")
    final = entry_dir(root, namespace, model, key)
    existing = lookup(root, namespace, model, key)
    if existing is not None:
        return existing

    view = memoryview(engine).cast("B")
    manifest = Manifest(
        key=key, inputs=json.loads(json.dumps(dict(inputs))), engine_file=engine_file,
        sha256=hashlib.sha256(view).hexdigest(), size_bytes=view.nbytes, backend=backend,
        backend_version=backend_version, target=target, build_seconds=round(build_seconds, 3),
        built_at=datetime.datetime.fromtimestamp(clock(), datetime.timezone.utc)
        .isoformat(timespec="seconds").replace("+00:00", "Z"),
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key}-", dir=final.parent))
    try:
        _write_file(tmp / engine_file, view)
        _write_file(tmp / MANIFEST, manifest.to_json().encode())
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; runtime pods may run as another user
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Lost the race: the winner's entry is complete (it was renamed in whole).
            shutil.rmtree(tmp, ignore_errors=True)
            winner = lookup(root, namespace, model, key)
            if winner is None:
                raise CacheError(f"{final} exists but holds no manifest") from e
            return winner
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _buffer(size: int) -> memoryview:
    """Uninitialised memory for an engine: a zero-filled bytearray would touch every page
    up front, on one thread, before the first byte is read; here the pages are first
    touched by the read itself, chunk by chunk, while the previous chunk is hashed."""
    import numpy as np

    return memoryview(np.empty(size, dtype=np.uint8)).cast("B")


def _read_into(f, view: memoryview, on_chunk: Callable[[memoryview], None] | None,
               chunk: int) -> int:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:done + chunk])
        if not n:
            break
        if on_chunk is not None:
            on_chunk(view[done:done + n])
        done += n
    return done


def _open_entry(entry: str | os.PathLike) -> tuple[Manifest, Path, int]:
    directory = Path(entry)
    manifest = _read_manifest(directory)
    if manifest is None:
        raise CacheError(f"{directory}: not a published cache entry (no {MANIFEST})")
    path, size = _engine_file(directory, manifest)
    return manifest, path, size


def read_verified(entry: str | os.PathLike, *, chunk_bytes: int = CHUNK_BYTES
                  ) -> tuple[memoryview, Manifest, LoadTimings]:
    """Read an entry's engine and check its size and sha256 against the manifest.

    One pass over the file: a reader thread fills a preallocated buffer chunk by chunk
    while this thread hashes each chunk (both release the GIL), so on storage slower than
    SHA-256 the check costs almost nothing. Returns the engine as a memoryview (no extra
    copy of a large file). Raises CacheIntegrityError naming the file and both values.
    """
    manifest, path, size = _open_entry(entry)
    started = time.perf_counter()  # allocation included: a load needs the memory either way
    buf = _buffer(size)
    digest = hashlib.sha256()
    chunks: queue.SimpleQueue = queue.SimpleQueue()
    failure: list[BaseException] = []
    got = [0]
    read_end = [0.0]

    def reader() -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                got[0] = _read_into(f, buf, chunks.put, chunk_bytes)
                # A file that grew after stat() is not the file the manifest describes.
                if f.read(1):
                    got[0] = size + 1
        except BaseException as e:  # reported in the caller's thread
            failure.append(e)
        finally:
            read_end[0] = time.perf_counter()
            chunks.put(None)

    thread = threading.Thread(target=reader, name="kiln-engine-read", daemon=True)
    thread.start()
    while True:
        piece = chunks.get()
        if piece is None:
            break
        digest.update(piece)
    thread.join()
    finished = time.perf_counter()
    if failure:
        raise failure[0]
    if got[0] != size:
        raise CacheIntegrityError(
            f"{path}: read {got[0]} bytes, manifest expects {manifest.size_bytes} bytes "
            f"(the file changed while it was read); refusing to load it")
    actual = digest.hexdigest()
    if actual != manifest.sha256:
        raise CacheIntegrityError(
            f"{path}: sha256 {actual} does not match the manifest's {manifest.sha256}; "
            f"the engine is corrupt or was modified, refusing to load it")
    return buf, manifest, LoadTimings(read_seconds=read_end[0] - started,
                                      verify_seconds=max(0.0, finished - read_end[0]))


def read_unverified(entry: str | os.PathLike) -> tuple[memoryview, Manifest, float]:
    """Read an entry's engine without hashing it (the benchmark's baseline). Seconds returned."""
    manifest, path, size = _open_entry(entry)
    started = time.perf_counter()
    buf = _buffer(size)
    with open(path, "rb", buffering=0) as f:
        n = _read_into(f, buf, None, max(size, 1))
    if n != size:
        raise CacheIntegrityError(f"{path}: read {n} bytes, manifest expects {size} bytes")
    return buf, manifest, time.perf_counter() - started


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
                if d.name.startswith(TMP_PREFIX):
                    if age > stale_seconds:
                        shutil.rmtree(d, ignore_errors=True)
                        removed.append(d)
                    continue
                if d.name in keys or (ns_dir.name, model_dir.name, d.name) in triples:
                    continue
                try:
                    manifest = _read_manifest(d)
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
