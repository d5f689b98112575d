"""Fetch the ONNX model a build starts from, hashing it as it streams.

Sources: `pvc://<claim>/<path>` (the claim mounted at `<pvc_root>/<claim>`; symlinks may
not leave it), `https://` and `http://` (timeout and size bound, streamed to a temporary
file; `http://` only with a pinned sha256, as the CRD says), `s3://<bucket>/<key>`
(boto3, the `kiln-operator[s3]` extra), and, only with `allow_local_files` (`kiln dev`),
`file:///<path>` and plain paths: a build Job must not read its node's disk. Local sources
are read only when they are regular files (a FIFO, a device or a directory is refused,
without blocking). Failures are typed (runtime.errors) so `kiln build` exits with a code a
Job status can be read by.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from kiln.runtime.api.errors import (BadRequest, DigestMismatch, OutOfDisk, SourceUnreachable,
                                 Unsupported)
from kiln.runtime.api.localfile import NotARegularFile, open_regular

from kiln.runtime.api.contract import PVC_ROOT as DEFAULT_PVC_ROOT
DEFAULT_TIMEOUT_SECONDS = 60.0
# ONNX protobufs stop at 2 GiB; bigger models carry external data files, not one download.
DEFAULT_MAX_BYTES = 2 << 30
CHUNK_BYTES = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class FetchedModel:
    path: Path  # the local file: the original for local sources, a download otherwise
    sha256: str
    size_bytes: int
    source: str  # the URI as given

    def read_bytes(self) -> bytes:
        with open_regular(self.path) as f:
            return f.read()


def _hash_stream(chunks: Iterator[bytes], out, max_bytes: int, uri: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise SourceUnreachable(f"{uri}: larger than the {max_bytes} byte limit; refusing it")
        h.update(chunk)
        if out is not None:
            out.write(chunk)
    return h.hexdigest(), size


def _file_chunks(f) -> Iterator[bytes]:
    while True:
        chunk = f.read(CHUNK_BYTES)
        if not chunk:
            return
        yield chunk


def local_path(uri: str, pvc_root: str | os.PathLike = DEFAULT_PVC_ROOT, *,
               allow_local_files: bool = False) -> Path | None:
    """The file a local URI names, or None when the URI is remote. Bad URIs raise BadRequest,
    and so do file:// URIs and plain paths unless `allow_local_files` (only `kiln dev`)."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme == "pvc":
        claim, rel = parsed.netloc, urllib.parse.unquote(parsed.path).lstrip("/")
        if not claim or not rel:
            raise BadRequest(f"{uri}: a pvc URI is pvc://<claim>/<path to the ONNX file>")
        base = (Path(pvc_root) / claim).resolve()
        path = (base / rel).resolve()
        if base != path and base not in path.parents:
            raise BadRequest(f"{uri}: the path leaves the volume {claim!r}")
        return path
    if not uri:
        raise BadRequest("the model URI is empty")
    if parsed.scheme == "file" or parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        if not allow_local_files:
            raise BadRequest(f"{uri}: file:// URIs and plain paths are read only by `kiln dev`; "
                             f"a build Job reads pvc://<claim>/<path>, https://, http:// or s3://")
        if parsed.scheme != "file":
            return Path(uri)
        if parsed.netloc not in ("", "localhost"):
            raise BadRequest(f"{uri}: a file URI has no host (file:///absolute/path)")
        return Path(urllib.parse.unquote(parsed.path))
    if parsed.scheme in ("http", "https", "s3"):
        return None
    raise BadRequest(f"{uri}: unsupported scheme {parsed.scheme!r}; use pvc://, https://, "
                     f"http:// or s3:// (or file:// with `kiln dev`)")


def fetch_model(uri: str, workdir: str | os.PathLike, *, sha256: str | None = None,
                pvc_root: str | os.PathLike = DEFAULT_PVC_ROOT,
                timeout: float = DEFAULT_TIMEOUT_SECONDS, max_bytes: int = DEFAULT_MAX_BYTES,
                log: Callable[[str], None] | None = None,
                allow_local_files: bool = False) -> FetchedModel:
    """Fetch `uri` (downloads go into `workdir`), hash it while streaming, check the pin.
    `allow_local_files` lets file:// URIs and plain paths through (`kiln dev` only).

    Raises BadRequest, SourceUnreachable, DigestMismatch, OutOfDisk or Unsupported.
    """
    if sha256 is not None:
        sha256 = sha256.lower()
        if not _SHA256.match(sha256):
            raise BadRequest(f"model.sha256 must be 64 hex characters, got {sha256!r}")
    if sha256 is None and urllib.parse.urlsplit(uri).scheme == "http":
        raise BadRequest(f"{uri}: an http:// model URI needs model.sha256: plain HTTP can be changed on the way, "
                         f"and the digest is what the file is checked against; pin it or use https://")
    path = local_path(uri, pvc_root, allow_local_files=allow_local_files)
    try:
        if path is not None:
            digest, size = _fetch_local(uri, path, max_bytes)
        else:
            path = Path(workdir) / "model.onnx"
            scheme = urllib.parse.urlsplit(uri).scheme
            fetch = _fetch_s3 if scheme == "s3" else _fetch_http
            digest, size = fetch(uri, path, timeout, max_bytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OutOfDisk(f"{uri}: no space left on device while downloading to {workdir}") from e
        raise
    if sha256 is not None and digest != sha256:
        raise DigestMismatch(f"{uri}: sha256 {digest} does not match the pinned {sha256} "
                             f"(model.sha256); refusing to build from it")
    if log:
        log(f"fetched {uri}: {size} bytes, sha256 {digest}"
            + (" (matches the pin)" if sha256 else ""))
    return FetchedModel(path=path, sha256=digest, size_bytes=size, source=uri)


def _fetch_local(uri: str, path: Path, max_bytes: int) -> tuple[str, int]:
    try:
        f = open_regular(path)
    except FileNotFoundError:
        raise SourceUnreachable(f"{uri}: no such file {path}") from None
    except PermissionError:
        raise SourceUnreachable(f"{uri}: permission denied reading {path}") from None
    except NotARegularFile as e:
        raise SourceUnreachable(f"{uri}: {e}; the model must be an ONNX file") from None
    except OSError as e:
        raise SourceUnreachable(f"{uri}: cannot open {path}: {e.strerror or e}") from None
    with f:
        return _hash_stream(_file_chunks(f), None, max_bytes, uri)


def _fetch_http(uri: str, dest: Path, timeout: float, max_bytes: int) -> tuple[str, int]:
    request = urllib.request.Request(uri, headers={"User-Agent": "kiln-build"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise SourceUnreachable(f"{uri}: Content-Length {length} exceeds the "
                                        f"{max_bytes} byte limit; refusing it")
            with open(dest, "wb") as out:
                digest, size = _hash_stream(_file_chunks(response), out, max_bytes, uri)
            if length is not None and length.isdigit() and size != int(length):
                raise SourceUnreachable(f"{uri}: connection closed after {size} of {length} bytes")
            return digest, size
    except urllib.error.HTTPError as e:
        raise SourceUnreachable(f"{uri}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise SourceUnreachable(f"{uri}: cannot connect: {e.reason}") from None
    except (socket.timeout, TimeoutError):
        raise SourceUnreachable(f"{uri}: no answer within {timeout:g} s") from None
    except ConnectionError as e:
        raise SourceUnreachable(f"{uri}: connection failed: {e}") from None


def _fetch_s3(uri: str, dest: Path, timeout: float, max_bytes: int) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(uri)
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    if not bucket or not key:
        raise BadRequest(f"{uri}: an S3 URI is s3://<bucket>/<key>")
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise Unsupported(f"{uri}: s3:// sources need boto3; install the kiln-operator[s3] "
                          f"extra in the builder image") from None
    # Credentials and endpoint come from the usual AWS environment (AWS_ENDPOINT_URL, ...).
    client = boto3.client("s3", config=botocore.config.Config(
        connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 3}))
    try:
        obj = client.get_object(Bucket=bucket, Key=key)
        if int(obj.get("ContentLength", 0)) > max_bytes:
            raise SourceUnreachable(f"{uri}: {obj['ContentLength']} bytes exceeds the "
                                    f"{max_bytes} byte limit; refusing it")
        with open(dest, "wb") as out:
            return _hash_stream(obj["Body"].iter_chunks(CHUNK_BYTES), out, max_bytes, uri)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        raise SourceUnreachable(f"{uri}: {e}") from None
