"""Fetching the ONNX model: local paths, pvc://, http(s) from a real local server, s3 without boto3."""

import hashlib
import http.server
import socket
import threading

import pytest

from kiln.runtime import errors, fetch

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


def test_http_errors_are_source_unreachable(server, tmp_path):
    with pytest.raises(errors.SourceUnreachable, match="HTTP 404"):
        fetch.fetch_model(f"{server}/missing.onnx", tmp_path)
    with pytest.raises(errors.SourceUnreachable, match="cannot connect") as e:
        fetch.fetch_model(f"http://127.0.0.1:{closed_port()}/m.onnx", tmp_path)
    assert e.value.exit_code == 3
    with pytest.raises(errors.SourceUnreachable, match="exceeds the 1000 byte limit"):
        fetch.fetch_model(f"{server}/model.onnx", tmp_path, max_bytes=1000)


def test_http_timeout(tmp_path):
    # A server that accepts the connection and never answers.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with pytest.raises(errors.SourceUnreachable, match="0.3"):
            fetch.fetch_model(f"http://127.0.0.1:{port}/m.onnx", tmp_path, timeout=0.3)


def test_local_file_pvc_and_plain_path(tmp_path):
    claim = tmp_path / "pvcs" / "models" / "resnet"
    claim.mkdir(parents=True)
    (claim / "model.onnx").write_bytes(PAYLOAD)
    path = claim / "model.onnx"
    for uri in ("pvc://models/resnet/model.onnx", f"file://{path}", str(path)):
        got = fetch.fetch_model(uri, tmp_path, sha256=DIGEST, pvc_root=tmp_path / "pvcs")
        assert got.path == path and got.sha256 == DIGEST
    with pytest.raises(errors.SourceUnreachable, match="no such file"):
        fetch.fetch_model("pvc://models/absent.onnx", tmp_path, pvc_root=tmp_path / "pvcs")
    with pytest.raises(errors.BadRequest, match="leaves the volume"):
        fetch.fetch_model("pvc://models/../../etc/passwd", tmp_path, pvc_root=tmp_path / "pvcs")


def test_bad_uris_and_pins(tmp_path):
    with pytest.raises(errors.BadRequest, match="unsupported scheme 'ftp'"):
        fetch.fetch_model("ftp://host/m.onnx", tmp_path)
    with pytest.raises(errors.BadRequest, match="64 hex"):
        fetch.fetch_model("/x", tmp_path, sha256="abc")


def test_s3_without_boto3_names_the_extra(tmp_path):
    try:
        import boto3  # noqa: F401
        pytest.skip("boto3 is installed; this checks the message shown without it")
    except ImportError:
        pass
    with pytest.raises(errors.Unsupported, match=r"kiln-operator\[s3\]"):
        fetch.fetch_model("s3://bucket/models/m.onnx", tmp_path)
