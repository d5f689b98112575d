"""Fetching the ONNX model: pvc://, local paths (kiln dev only), http(s) from a real local
server, s3 without boto3; only regular files are read, and nothing blocks on a FIFO."""

import hashlib
import http.server
import os
import socket
import threading
import urllib.parse

import pytest

from kiln.runtime.api import errors
from kiln.runtime.engine import fetch

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/model.onnx":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAYLOAD)))
            self.end_headers()
            self.wfile.write(PAYLOAD)
        else:
            self.send_error(404, "Not Found")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_download_is_hashed_and_pinned(server, tmp_path):
    got = fetch.fetch_model(f"{server}/model.onnx", tmp_path, sha256=DIGEST.upper())
    assert got.sha256 == DIGEST and got.size_bytes == len(PAYLOAD)
    assert got.path.parent == tmp_path and got.read_bytes() == PAYLOAD


def test_http_digest_mismatch(server, tmp_path):
    with pytest.raises(errors.DigestMismatch) as e:
        fetch.fetch_model(f"{server}/model.onnx", tmp_path, sha256="0" * 64)
    assert DIGEST in str(e.value) and "0" * 64 in str(e.value) and e.value.exit_code == 4


def test_http_without_a_pinned_digest_is_refused_before_any_download(server, tmp_path):
    # Plain HTTP can be changed on the way: the digest is its integrity (the CRD says the same).
    with pytest.raises(errors.BadRequest) as e:
        fetch.fetch_model(f"{server}/model.onnx", tmp_path)
    assert "needs model.sha256" in str(e.value) and e.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []


def test_http_errors_are_source_unreachable(server, tmp_path):
    with pytest.raises(errors.SourceUnreachable, match="HTTP 404"):
        fetch.fetch_model(f"{server}/missing.onnx", tmp_path, sha256=DIGEST)
    with pytest.raises(errors.SourceUnreachable, match="cannot connect") as e:
        fetch.fetch_model(f"http://127.0.0.1:{closed_port()}/m.onnx", tmp_path, sha256=DIGEST)
    assert e.value.exit_code == 3
    with pytest.raises(errors.SourceUnreachable, match="exceeds the 1000 byte limit"):
        fetch.fetch_model(f"{server}/model.onnx", tmp_path, sha256=DIGEST, max_bytes=1000)


def test_http_timeout(tmp_path):
    # A server that accepts the connection and never answers.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with pytest.raises(errors.SourceUnreachable, match="0.3"):
            fetch.fetch_model(f"http://127.0.0.1:{port}/m.onnx", tmp_path, sha256=DIGEST, timeout=0.3)


def test_local_file_pvc_and_plain_path(tmp_path):
    claim = tmp_path / "pvcs" / "models" / "resnet"
    claim.mkdir(parents=True)
    (claim / "model.onnx").write_bytes(PAYLOAD)
    path = claim / "model.onnx"
    for uri in ("pvc://models/resnet/model.onnx", f"file://{path}", str(path)):
        got = fetch.fetch_model(uri, tmp_path, sha256=DIGEST, pvc_root=tmp_path / "pvcs",
                                allow_local_files=True)
        assert got.path == path and got.sha256 == DIGEST
    with pytest.raises(errors.SourceUnreachable, match="no such file"):
        fetch.fetch_model("pvc://models/absent.onnx", tmp_path, pvc_root=tmp_path / "pvcs")
    with pytest.raises(errors.BadRequest, match="leaves the volume"):
        fetch.fetch_model("pvc://models/../../etc/passwd", tmp_path, pvc_root=tmp_path / "pvcs")


@pytest.mark.parametrize("form", ["file:///abs", "file://localhost/abs", "plain absolute", "plain relative"])
def test_local_files_are_read_only_when_allowed(tmp_path, monkeypatch, form):
    # `kiln build` (a build Job) must not read its node's disk; only `kiln dev` allows it.
    (tmp_path / "m.onnx").write_bytes(PAYLOAD)
    monkeypatch.chdir(tmp_path)
    uri = {"file:///abs": (tmp_path / "m.onnx").as_uri(),
           "file://localhost/abs": f"file://localhost{tmp_path}/m.onnx",
           "plain absolute": str(tmp_path / "m.onnx"), "plain relative": "m.onnx"}[form]
    with pytest.raises(errors.BadRequest) as e:
        fetch.fetch_model(uri, tmp_path)
    assert str(e.value) == (f"{uri}: file:// URIs and plain paths are read only by `kiln dev`; a build "
                            f"Job reads pvc://<claim>/<path>, https://, http:// or s3://")
    assert e.value.exit_code == 2
    assert fetch.fetch_model(uri, tmp_path, allow_local_files=True).sha256 == DIGEST


@pytest.fixture
def specials(tmp_path):
    """A claim holding a FIFO (with no writer) and a directory where a model should be."""
    claim = tmp_path / "pvcs" / "models"
    claim.mkdir(parents=True)
    os.mkfifo(claim / "fifo.onnx")
    (claim / "dir.onnx").mkdir()
    return claim


@pytest.mark.timeout(10)  # a FIFO read without O_NONBLOCK would wait for a writer forever
@pytest.mark.parametrize("uri, kind", [
    ("pvc://models/fifo.onnx", "a FIFO (named pipe)"),
    ("pvc://models/dir.onnx", "a directory"),
    ("pvc://models", None),  # the claim's root itself: a pvc URI names a file in it
    ("file://{claim}/fifo.onnx", "a FIFO (named pipe)"),
    ("file://{claim}/dir.onnx", "a directory"),
    ("file:///dev/zero", "a character device"),
    ("/dev/null", "a character device"),
])
def test_only_regular_files_are_read_and_nothing_blocks(tmp_path, specials, uri, kind):
    uri = uri.format(claim=specials)
    with pytest.raises(errors.BuildError) as e:
        fetch.fetch_model(uri, tmp_path, pvc_root=tmp_path / "pvcs", allow_local_files=True)
    if kind is None:
        assert isinstance(e.value, errors.BadRequest) and "pvc://<claim>/<path" in str(e.value)
        return
    path = urllib.parse.urlsplit(uri).path if "://" in uri else uri
    if uri.startswith("pvc://"):
        path = str(specials / uri.rsplit("/", 1)[1])
    assert isinstance(e.value, errors.SourceUnreachable) and e.value.exit_code == 3
    assert str(e.value) == f"{uri}: {path} is {kind}, not a regular file; the model must be an ONNX file"


def test_pvc_symlinks_may_not_leave_the_volume(tmp_path):
    claim = tmp_path / "pvcs" / "models"
    (claim / "sub").mkdir(parents=True)
    (tmp_path / "secret.onnx").write_bytes(PAYLOAD)
    (claim / "sub" / "real.onnx").write_bytes(PAYLOAD)
    (claim / "out.onnx").symlink_to(tmp_path / "secret.onnx")  # a file outside
    (claim / "outdir").symlink_to(tmp_path)  # a directory outside
    (claim / "etc").symlink_to("/etc")
    (claim / "in.onnx").symlink_to("sub/real.onnx")  # inside: fine
    for uri in ("pvc://models/out.onnx", "pvc://models/outdir/secret.onnx", "pvc://models/etc/passwd",
                "pvc://models/sub/../../../secret.onnx", "pvc://models/%2e%2e/secret.onnx"):
        with pytest.raises(errors.BadRequest) as e:
            fetch.fetch_model(uri, tmp_path, pvc_root=tmp_path / "pvcs")
        assert str(e.value) == f"{uri}: the path leaves the volume 'models'"
    got = fetch.fetch_model("pvc://models/in.onnx", tmp_path, pvc_root=tmp_path / "pvcs")
    assert got.sha256 == DIGEST and got.path == claim / "sub" / "real.onnx"


def test_bad_uris_and_pins(tmp_path):
    with pytest.raises(errors.BadRequest, match="unsupported scheme 'ftp'"):
        fetch.fetch_model("ftp://host/m.onnx", tmp_path)
    with pytest.raises(errors.BadRequest, match="64 hex"):
        fetch.fetch_model("pvc://models/x.onnx", tmp_path, sha256="abc")


def test_s3_without_boto3_names_the_extra(tmp_path):
    try:
        import boto3  # noqa: F401
        pytest.skip("boto3 is installed; this checks the message shown without it")
    except ImportError:
        pass
    with pytest.raises(errors.Unsupported, match=r"kiln-operator\[s3\]"):
        fetch.fetch_model("s3://bucket/models/m.onnx", tmp_path)
