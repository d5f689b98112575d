"""The real tier: one upstream control plane per test session (tests/support/localcluster),
Kiln installed from its chart with the real helm, a namespace per test.

Everything listens on 127.0.0.1 and pods get 127.x addresses: nothing leaves the machine.
Skipped, with the reason, only where the control plane cannot run: no Go toolchain to build
it, or not root (the kubelet harness mounts volumes in private mount namespaces).
Set KILN_E2E_KEEP=1 to keep the cluster's state (logs, pod logs, volumes) after the session;
it is always kept, and its path printed, when a test failed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from support import localcluster
from support.localcluster.client import Api
from support.localcluster.controlplane import REPO

# `make e2e-docs`: the kubectl sessions the tests show replace what stands between the
# markers in docs/e2e.md (only after a run with no failure).
TRANSCRIPT_ENV = "KILN_E2E_TRANSCRIPT"
TRANSCRIPT_START, TRANSCRIPT_END = "<!-- transcript: written by make e2e-docs -->", "<!-- /transcript -->"


def _unavailable() -> str | None:
    tools = REPO / ".tools"
    built = any(tools.glob("kubernetes-*/bin/kube-apiserver"))
    if not built and shutil.which("go") is None:
        return "no Go toolchain to build the Kubernetes control plane from upstream modules (needs Go 1.26)"
    if os.geteuid() != 0:
        return "the kubelet harness needs root for private mount namespaces (unshare -m); run as root"
    if not (tools / "helm").exists():
        return "no helm in .tools/ (make tools)"
    return None


class Transcript:
    """The kubectl sessions the tests show, in order: docs/e2e.md is made from them."""

    def __init__(self) -> None:
        self.sections: list[tuple[str, list[str]]] = []

    def section(self, title: str) -> None:
        self.sections.append((title, []))

    def add(self, command: str, output: str) -> None:
        if not self.sections:
            self.section("Session")
        self.sections[-1][1].append(f"$ {command}\n{output.rstrip()}")

    def markdown(self) -> str:
        return "\n".join(f"### {title}\n\n```\n" + "\n\n".join(blocks) + "\n```\n" for title, blocks in self.sections)


@pytest.fixture(scope="session")
def cluster(request):
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="kiln-cluster-"))
    started = time.monotonic()
    c = localcluster.LocalCluster(root).up()
    print(f"\nlocal control plane up in {time.monotonic() - started:.0f} s (state: {root})")
    yield c
    c.down()
    failed = request.session.testsfailed
    if failed or os.environ.get("KILN_E2E_KEEP"):
        print(f"\nthe local cluster's logs are kept in {root} (logs/, pods/)")
    else:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def api(cluster) -> Api:
    return Api(cluster.kubeconfig)


@pytest.fixture(scope="session")
def transcript(request):
    t = Transcript()
    yield t
    target = os.environ.get(TRANSCRIPT_ENV)
    if target and t.sections and not request.session.testsfailed:
        path = Path(target)
        text = path.read_text()
        start, end = text.index(TRANSCRIPT_START) + len(TRANSCRIPT_START), text.index(TRANSCRIPT_END)
        path.write_text(text[:start] + "\n" + t.markdown() + text[end:])


@pytest.fixture()
def namespace(cluster, api):
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    api.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    api.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture()
def kubectl(cluster, transcript):
    """kubectl as the admin; `show=True` records the command and its output for docs/e2e.md."""
    def run(*args: str, show: bool = False, check: bool = True, input: str | None = None):
        result = cluster.kubectl(*args, check=False, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        if show:
            transcript.add("kubectl " + " ".join(args), result.stdout + result.stderr)
        return result
    return run
