"""One cache entry: its manifest, its paths, and the checks that open it (see the package's
docstring for the layout). Every check of an entry lives in open_entry."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from blake3 import blake3

from kiln.runtime.engine.backends.base import ShapeRange

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a few hundred bytes; more is not one
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


def path_component(value: str, what: str) -> str:
    if (not isinstance(value, str) or not value or value in (".", "..") or value.startswith(".")
            or "/" in value or "\\" in value or "\0" in value):
        raise ValueError(f"invalid {what} {value!r} for a cache path: use a plain name "
                         f"(no '/', not starting with '.')")
    if len(value.encode()) > 255:  # NAME_MAX: no file system makes a longer name
        raise ValueError(f"invalid {what} for a cache path: {len(value.encode())} bytes, over "
                         f"the 255 of a file name")
    return value


def relative_path(namespace: str, model: str, key: str) -> str:
    """The entry's path below the cache root: what the operator passes to pods."""
    return "/".join((path_component(namespace, "namespace"), path_component(model, "model name"),
                     path_component(key, "engine key")))


def entry_dir(root: str | os.PathLike, namespace: str, model: str, key: str) -> Path:
    return Path(root) / relative_path(namespace, model, key)


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


def read_entry_manifest(directory: Path) -> Manifest | None:
    dir_fd = _open_dir(directory)
    if dir_fd is None:
        return None
    try:
        return _manifest_at(dir_fd, directory)
    finally:
        os.close(dir_fd)


def open_entry(entry: str | os.PathLike) -> tuple[Manifest, Path, int, int] | None:
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
            plain = path_component(name, "engine file name") != MANIFEST
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
    opened = open_entry(entry_dir(root, namespace, model, key))
    if opened is None:
        return None
    manifest, _, fd, _ = opened
    os.close(fd)
    return manifest
