"""The engine cache: immutable, verified entries on a shared volume.

Layout: `<root>/<namespace>/<model>/<key>/` holds the engine file (named by the backend's
`engine_filename`) and `manifest.json`. Builders publish into a temporary sibling
(`.tmp-<key>-*`, locked by its writer for as long as it lives) and rename it into place,
so a reader sees a complete entry or none, and two builders of one key end with one valid
entry. Runtime pods read the engine in one streaming pass that hashes as it reads and
refuse it when its size or a digest differs from the manifest: the manifest records the
whole file's sha256 (what `sha256sum` prints) and the sha256 of each `chunkBytes` piece,
which several threads read and check at once (see read_verified).

An entry is trusted only for what lies inside its own directory: its manifest must name
its directory's key and a plain engine file name, and both files must be regular files
opened without following a symbolic link (docs/architecture.md, "The engine cache").
A corrupt entry is moved aside (`.quarantine-<key>-*`) by the next build of its key.
Garbage collection keeps what is in use plus a few recent entries for rollback.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from blake3 import blake3

from kiln.runtime.engine.backends.base import ShapeRange

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
TMP_PREFIX = ".tmp-"  # a publish in progress (or a crashed one)
TRASH_PREFIX = ".trash-"  # an entry GC renamed away before deleting it
QUARANTINE_PREFIX = ".quarantine-"  # a corrupt entry a build moved aside (GC removes it later)
QUARANTINE_REASON = "quarantine-reason.txt"  # inside it: why, for whoever looks at the volume
LOCK_FILE = ".lock"  # inside a temporary: flock'd by its writer while it lives
MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a few hundred bytes; more is not one
CHUNK_BYTES = 16 << 20  # a read call: large enough to amortize syscalls
# Each DIGEST_CHUNK_BYTES piece of an engine has its own sha256 in the manifest, so pieces
# are checked on several cores at once; 16 MiB: 64 digests for a 1 GiB engine (about 4 KB
# of manifest), and what is left to hash after the last byte arrives is one piece (~8 ms).
DIGEST_CHUNK_BYTES = 16 << 20
MAX_VERIFY_THREADS = 8
_HEX64 = re.compile(r"[0-9a-f]{64}")


# Chunk digests: how each is computed, and its manifest field. New entries use CHUNK_HASH;
# BLAKE3 (its 256-bit default output) hashes several times faster than SHA-256 on a core, so
# a warm read (a memory copy) pays far less for its check; entries published with
# chunkSha256 still verify as they did.
CHUNK_HASHES: dict[str, Callable[[memoryview], str]] = {
    "blake3": lambda data: blake3(data).hexdigest(),
    "sha256": lambda data: hashlib.sha256(data).hexdigest()}
CHUNK_FIELDS = {"blake3": "chunkBlake3", "sha256": "chunkSha256"}
CHUNK_HASH = "blake3"
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
    # The digest of each chunk_bytes piece of the engine, in order (the last may be
    # shorter), by `chunk_hash` (CHUNK_HASHES: "blake3" since it is the default, "sha256"
    # before). Entries published before chunk digests existed have none (0, ()), and are
    # verified with the whole file's sha256.
    chunk_bytes: int = 0
    chunk_digests: tuple[str, ...] = ()
    chunk_hash: str = CHUNK_HASH

    def to_json(self) -> str:
        chunks = ({"chunkBytes": self.chunk_bytes,
                   CHUNK_FIELDS[self.chunk_hash]: list(self.chunk_digests)}
                  if self.chunk_bytes else {})
        return json.dumps({
            **chunks,
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
                built_at=str(d["builtAt"]), **_chunks_of(d),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CacheError(f"invalid manifest: {type(e).__name__}: {e}") from e

    def chunk_count_expected(self) -> int:
        """How many chunk digests an engine of size_bytes has in chunk_bytes pieces."""
        return -(-self.size_bytes // self.chunk_bytes) if self.chunk_bytes else 0

    def profiles(self) -> dict[str, ShapeRange]:
        """The optimization profiles the engine was built with, as the loader wants them."""
        return {
            p["input"]: ShapeRange(tuple(p["min"]), tuple(p["opt"]), tuple(p["max"]))
            for p in self.inputs.get("profiles", [])
        }


def _chunks_of(d: Mapping[str, Any]) -> dict[str, Any]:
    fields = [f for f in CHUNK_FIELDS.values() if f in d]
    if "chunkBytes" not in d and not fields:
        return {}  # an entry published before chunk digests: the whole-file sha256 only
    if len(fields) != 1:
        raise ValueError(f"chunkBytes needs exactly one of {', '.join(CHUNK_FIELDS.values())}, "
                         f"got {', '.join(fields) or 'neither'}")
    field = fields[0]
    size, digests = d["chunkBytes"], d[field]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"chunkBytes must be a positive integer, got {size!r}")
    if not isinstance(digests, list) or not all(
            isinstance(x, str) and _HEX64.fullmatch(x.lower()) for x in digests):
        raise ValueError(f"{field} must be a list of digests (64 hex characters)")
    return {"chunk_bytes": size, "chunk_digests": tuple(x.lower() for x in digests),
            "chunk_hash": next(h for h, f in CHUNK_FIELDS.items() if f == field)}


@dataclass(frozen=True)
class LoadTimings:
    # Reading and hashing overlap; read_seconds runs from allocating the buffer to the last
    # byte read, verify_seconds is only the hashing (on every verifying thread) left after
    # the last byte arrived, i.e. what verification adds to a load.
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


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _open_dir(directory: Path) -> int | None:
    """An fd of the entry directory itself (never a symlink's target); None when absent."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # a file, or (with O_NOFOLLOW) a symbolic link
        if directory.is_symlink():
            raise CacheIntegrityError(
                f"{directory}: the entry is a symbolic link; publish never makes one, "
                f"refusing it") from None
        return None


def _open_file(dir_fd: int, directory: Path, name: str, what: str) -> int:
    """An fd of a regular file inside the entry, refusing anything else without blocking.

    O_NOFOLLOW: a symlink is refused even when it points inside the entry (publish never
    makes one). O_NONBLOCK: a FIFO opens at once instead of waiting for a writer, and fstat
    on this very fd (no stat-then-open race) refuses it; regular files ignore the flag.
    Raises FileNotFoundError when there is no such file.
    """
    path = directory / name
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheIntegrityError(
                f"{path}: the {what} is a symbolic link; an entry's files must be regular "
                f"files inside it, refusing it") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CacheIntegrityError(
                f"{path}: the {what} is {_kind(mode)}, not a regular file; refusing it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _manifest_at(dir_fd: int, directory: Path) -> Manifest | None:
    path = directory / MANIFEST
    try:
        fd = _open_file(dir_fd, directory, MANIFEST, "manifest")
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        text = f.read(MANIFEST_MAX_BYTES + 1)
    if len(text) > MANIFEST_MAX_BYTES:
        raise CacheError(f"{path}: larger than {MANIFEST_MAX_BYTES} bytes, not a manifest")
    try:
        return Manifest.from_json(text)
    except CacheError as e:
        raise CacheError(f"{path}: {e}") from e


def _read_manifest(directory: Path) -> Manifest | None:
    dir_fd = _open_dir(directory)
    if dir_fd is None:
        return None
    try:
        return _manifest_at(dir_fd, directory)
    finally:
        os.close(dir_fd)


def _open_entry(entry: str | os.PathLike) -> tuple[Manifest, Path, int, int] | None:
    """(manifest, engine path, engine fd, size) of a complete entry, None when there is none.

    Every check of an entry lives here: the manifest names this directory's key and a
    plain engine file name, both are regular files inside the directory, and the engine's
    size is the manifest's. The caller reads (and closes) the fd that was checked.
    """
    directory = Path(entry)
    dir_fd = _open_dir(directory)
    if dir_fd is None:
        return None
    try:
        manifest = _manifest_at(dir_fd, directory)
        if manifest is None:
            return None
        if manifest.key != directory.name:
            raise CacheIntegrityError(
                f"{directory / MANIFEST} names key {manifest.key}, but the entry is "
                f"{directory.name}; refusing it")
        name = manifest.engine_file
        try:
            plain = _component(name, "engine file name") != MANIFEST
        except ValueError:  # '..', a path, an absolute path
            plain = False
        if not plain:
            raise CacheIntegrityError(
                f"{directory / MANIFEST}: engineFile {manifest.engine_file!r} is not a plain "
                f"file name inside the entry; refusing it")
        path = directory / name
        try:
            fd = _open_file(dir_fd, directory, name, "engine file")
        except FileNotFoundError:
            raise CacheIntegrityError(
                f"{path}: engine file missing from a published entry") from None
    finally:
        os.close(dir_fd)
    size = os.fstat(fd).st_size
    if size != manifest.size_bytes:
        os.close(fd)
        raise CacheIntegrityError(
            f"{path}: size {size} bytes, manifest expects {manifest.size_bytes} bytes "
            f"(truncated or replaced); refusing to load it")
    # Chunk digests cover the file exactly: ceil(size / chunkBytes) of them, none past the
    # end, none missing (the whole-file sha256 is not recomputed when they exist).
    if manifest.chunk_bytes and len(manifest.chunk_digests) != manifest.chunk_count_expected():
        os.close(fd)
        raise CacheIntegrityError(
            f"{directory / MANIFEST}: {len(manifest.chunk_digests)} chunk digests, but "
            f"sizeBytes {manifest.size_bytes} in chunks of {manifest.chunk_bytes} bytes makes "
            f"{manifest.chunk_count_expected()}; the manifest is inconsistent, refusing it")
    return manifest, path, fd, size


def lookup(root: str | os.PathLike, namespace: str, model: str, key: str) -> Manifest | None:
    """The manifest of a complete entry, or None. Temporaries are never complete entries.

    Cheap: checks the engine file's size, not its digest (read_verified does that).
    Raises CacheError (CacheIntegrityError) for an entry that exists but is not sound.
    """
    opened = _open_entry(entry_dir(root, namespace, model, key))
    if opened is None:
        return None
    manifest, _, fd, _ = opened
    os.close(fd)
    return manifest


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

    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    view = memoryview(engine).cast("B")
    whole, chunks = _digests(view, chunk_bytes)
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
            winner = lookup(root, namespace, model, key)
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


def _verify_threads(chunks: int) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(max(cpus, 2), MAX_VERIFY_THREADS, chunks))


def _digests(view: memoryview, chunk_bytes: int) -> tuple[str, tuple[str, ...]]:
    """The whole buffer's sha256 and each chunk's CHUNK_HASH digest, on a few threads (both
    hashes release the GIL on large buffers): the whole digest on one, the chunks on the
    others."""
    from concurrent.futures import ThreadPoolExecutor

    spans = [(start, min(start + chunk_bytes, view.nbytes))
             for start in range(0, view.nbytes, chunk_bytes)]
    with ThreadPoolExecutor(max_workers=_verify_threads(len(spans) + 1),
                            thread_name_prefix="kiln-digest") as pool:
        whole = pool.submit(lambda: hashlib.sha256(view).hexdigest())
        chunk_digest = CHUNK_HASHES[CHUNK_HASH]
        chunks = list(pool.map(lambda span: chunk_digest(view[span[0]:span[1]]), spans))
        return whole.result(), tuple(chunks)


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
    is left alone; collect_garbage removes what is still there hours later. Other keys'
    temporaries are not touched. Returns the paths removed.
    """
    parent = entry_dir(root, namespace, model, key).parent
    prefix = f"{TMP_PREFIX}{key}-"
    removed: list[Path] = []
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    except FileNotFoundError:
        return removed
    for name in names:
        d = parent / name
        try:
            fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live writer
        try:
            shutil.rmtree(d, ignore_errors=True)  # while holding the lock: see _locked_temporary
        finally:
            os.close(fd)
        removed.append(d)
    return removed


def quarantine(root: str | os.PathLike, namespace: str, model: str, key: str,
               reason: str, *, clock: Callable[[], float] = time.time) -> Path | None:
    """Move a corrupt entry aside to `.quarantine-<key>-<UTC time>` in its model directory,
    with the reason in a file inside it, so the key can be built again. Readers never look
    there; collect_garbage removes it after the stale age. Returns the new path, or None
    when the entry was gone already (another builder moved it first)."""
    final = entry_dir(root, namespace, model, key)
    stamp = datetime.datetime.fromtimestamp(clock(), datetime.timezone.utc)
    aside = final.with_name(f"{QUARANTINE_PREFIX}{key}-{stamp:%Y%m%dT%H%M%S.%fZ}")
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        return None
    if not aside.is_symlink():
        try:  # also what dates it for collect_garbage (a rename keeps the old mtime)
            (aside / QUARANTINE_REASON).write_text(reason + "\n")
        except OSError:
            pass
    return aside


def _buffer(size: int) -> memoryview:
    """Uninitialised memory for an engine: a zero-filled bytearray would touch every page
    up front, on one thread, before the first byte is read; here the pages are first
    touched by the read itself, chunk by chunk, while the previous chunk is hashed."""
    import numpy as np

    return memoryview(np.empty(size, dtype=np.uint8)).cast("B")


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read into `view` from `offset` of the file: the one place the cache reads engine
    bytes (positional, so several threads share the one fd that was checked)."""
    return os.preadv(fd, [view], offset)


def _read_into(fd: int, view: memoryview, on_chunk: Callable[[memoryview], None] | None,
               chunk: int) -> int:
    done = 0
    while done < len(view):
        n = _read_at(fd, view[done:done + chunk], done)
        if not n:
            break
        if on_chunk is not None:
            on_chunk(view[done:done + n])
        done += n
    return done


def _grew(fd: int, size: int) -> bool:
    """Whether the file has bytes past `size`: then it is not the file the manifest describes."""
    return bool(os.pread(fd, 1, size))


def _open_published(entry: str | os.PathLike) -> tuple[Manifest, Path, int, int]:
    opened = _open_entry(entry)
    if opened is None:
        raise CacheError(f"{entry}: not a published cache entry (no {MANIFEST})")
    return opened


def _read_parallel(fd: int, buf: memoryview, piece: int, expected: tuple[str, ...] | None,
                   workers: int, read_bytes: int, hash_name: str = CHUNK_HASH
                   ) -> tuple[int, float, list[tuple[int, str]]]:
    """Fill `buf` from `fd` one `piece` at a time on `workers` threads, each reading a whole
    chunk (os.preadv at its offset, so several reads are in flight on storage) and, when
    `expected` is given, hashing it at once against expected[index] (while it is still in
    the CPU's cache; both hashes release the GIL). Stops at the first mismatch or short read.
    Returns (bytes read, when the last read ended, [(chunk index, actual digest)])."""
    size = len(buf)
    chunk_digest = CHUNK_HASHES[hash_name]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for index in range(-(-size // piece)):
        todo.put(index)
    stop = threading.Event()
    failure: list[BaseException] = []
    mismatches: list[tuple[int, str]] = []
    short = [0]  # bytes missing: the file shrank while it was read
    read_end = [0.0]

    def work() -> None:
        try:
            while not stop.is_set():
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                start = index * piece
                end = min(size, start + piece)
                done = start
                while done < end:
                    n = _read_at(fd, buf[done:min(end, done + read_bytes)], done)
                    if not n:
                        short[0] += end - done
                        stop.set()
                        return
                    done += n
                read_end[0] = max(read_end[0], time.perf_counter())
                if expected is not None:
                    actual = chunk_digest(buf[start:end])
                    if actual != expected[index]:
                        mismatches.append((index, actual))
                        stop.set()
        except BaseException as e:  # reported in the caller's thread
            failure.append(e)
            stop.set()

    threads = [threading.Thread(target=work, name=f"kiln-engine-read-{i}", daemon=True)
               for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failure:
        raise failure[0]
    got = size - short[0]
    # A file that grew after fstat() is not the file the manifest describes.
    if not short[0] and not mismatches and _grew(fd, size):
        got = size + 1
    return got, read_end[0] or time.perf_counter(), mismatches


def read_verified(entry: str | os.PathLike, *, chunk_bytes: int = CHUNK_BYTES,
                  threads: int | None = None, whole_digest: bool = False
                  ) -> tuple[memoryview, Manifest, LoadTimings]:
    """Read an entry's engine and check its size and digests against the manifest.

    With chunk digests (every entry published since they exist): `threads` workers (by
    default min(CPUs, 8), at least 2) take the `chunkBytes` pieces in turn; each reads its
    piece into the preallocated buffer (os.preadv on the fd that was checked, at most
    `chunk_bytes` per call, so several reads are in flight on storage) and checks it at
    once against its `chunkBlake3` (or, for an entry published before BLAKE3, its
    `chunkSha256`), releasing the GIL, so verification spreads over cores and keeps up with
    storage: BLAKE3 hashes several times faster than SHA-256 on a core. The whole-file
    `sha256` is then not recomputed (one digest cannot be spread over cores): publish
    computed both from the same bytes, the build's load check reads the entry back with
    `whole_digest=True` (chunks, then the whole digest: one more pass, in the build Job
    only), and a chunk list that does not cover `sizeBytes` exactly is refused. A manifest
    is not signed, so chunk digests protect as much as the whole one: whoever could edit
    one could edit both. An entry without chunk digests (published before them) is
    checked against the whole file's sha256, hashed on this thread while a reader thread
    reads it, as before.

    By hand, with standard tools, in the entry directory: `sha256sum engine.plan` prints the
    manifest's `sha256`; `split -b <chunkBytes> -d -a 6 engine.plan /tmp/chunk. && b3sum
    /tmp/chunk.*` (Debian's b3sum) prints its `chunkBlake3`, in order.

    Returns the engine as a memoryview (no extra copy of a large file). Raises
    CacheIntegrityError naming the file and both values (for a chunk: its index, byte
    range and both digests).
    """
    manifest, path, fd, size = _open_published(entry)
    started = time.perf_counter()  # allocation included: a load needs the memory either way
    try:
        buf = _buffer(size)
        piece, expected = manifest.chunk_bytes, manifest.chunk_digests
        if expected:
            workers = max(1, int(threads)) if threads else _verify_threads(len(expected))
            got, read_end, mismatches = _read_parallel(fd, buf, piece, expected, workers,
                                                       max(1, chunk_bytes), manifest.chunk_hash)
            digest = hashlib.sha256(buf) if whole_digest and got == size and not mismatches \
                else None
        else:
            got, read_end, digest = _read_hashing(fd, buf, chunk_bytes)
            mismatches = []
    finally:
        os.close(fd)
    finished = time.perf_counter()
    if mismatches:
        index, actual = min(mismatches)
        start, end = index * piece, min(size, (index + 1) * piece)
        raise CacheIntegrityError(
            f"{path}: chunk {index} (bytes {start}-{end - 1}, chunkBytes {piece}): "
            f"{manifest.chunk_hash} {actual} does not match the manifest's "
            f"{CHUNK_FIELDS[manifest.chunk_hash]}[{index}] {expected[index]}; "
            f"the engine is corrupt or was modified, refusing to load it")
    if got != size:
        raise CacheIntegrityError(
            f"{path}: read {got} bytes, manifest expects {manifest.size_bytes} bytes "
            f"(the file changed while it was read); refusing to load it")
    if digest is not None and (actual := digest.hexdigest()) != manifest.sha256:
        raise CacheIntegrityError(
            f"{path}: sha256 {actual} does not match the manifest's {manifest.sha256}; "
            f"the engine is corrupt or was modified, refusing to load it")
    return buf, manifest, LoadTimings(read_seconds=read_end - started,
                                      verify_seconds=max(0.0, finished - read_end))


def _read_hashing(fd: int, buf: memoryview, chunk_bytes: int) -> tuple[int, float, Any]:
    """An entry without chunk digests: a reader thread fills the buffer chunk by chunk while
    this thread hashes each chunk (both release the GIL). (bytes read, read end, digest)"""
    size = len(buf)
    digest = hashlib.sha256()
    chunks: queue.SimpleQueue = queue.SimpleQueue()
    failure: list[BaseException] = []
    got = [0]
    read_end = [0.0]

    def reader() -> None:
        try:
            got[0] = _read_into(fd, buf, chunks.put, chunk_bytes)
            if got[0] == size and _grew(fd, size):
                got[0] = size + 1
        except BaseException as e:  # reported in the caller's thread
            failure.append(e)
        finally:
            read_end[0] = time.perf_counter()
            chunks.put(None)

    thread = threading.Thread(target=reader, name="kiln-engine-read", daemon=True)
    thread.start()
    while (piece := chunks.get()) is not None:
        digest.update(piece)
    thread.join()
    if failure:
        raise failure[0]
    return got[0], read_end[0], digest


def read_unverified(entry: str | os.PathLike, *, threads: int = 1, chunk_bytes: int = CHUNK_BYTES
                    ) -> tuple[memoryview, Manifest, float]:
    """Read an entry's engine without hashing it (the benchmark's baselines): one read call,
    or with `threads` > 1 the parallel reads read_verified makes, minus the hashing (by
    the manifest's chunks, else DIGEST_CHUNK_BYTES pieces). Seconds returned."""
    manifest, path, fd, size = _open_published(entry)
    started = time.perf_counter()
    try:
        buf = _buffer(size)
        if threads > 1:
            n = _read_parallel(fd, buf, manifest.chunk_bytes or DIGEST_CHUNK_BYTES, None,
                               threads, max(1, chunk_bytes))[0]
        else:
            n = _read_into(fd, buf, None, max(size, 1))
    finally:
        os.close(fd)
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
                if d.name.startswith((TMP_PREFIX, QUARANTINE_PREFIX)):
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
