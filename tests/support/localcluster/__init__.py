"""Kiln on a real Kubernetes control plane on one machine: upstream kube-apiserver,
controller-manager and scheduler, etcd, kwok's fake GPU nodes, the kubelet harness for the
pods that do real work, the Gateway API's CRDs (standard channel), and Kiln installed from
its own chart with the real helm.

Used by the real tier of the tests (tests/e2e) and by `make cluster` (`python -m support.localcluster`,
from tests/).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .controlplane import REPO, ControlPlane, binaries, gateway_api_crds, gpu_cluster_nodes, write_kubeconfig
from .kubelet import Kubelet

RELEASE, RELEASE_NAMESPACE = "kiln", "kiln-system"
HELM = REPO / ".tools" / "helm"
# The operator's health and alert receiver ports: every pod shares the host's network here,
# and runtime pods take 8080 on their own addresses, so the operator's wildcard listeners go
# elsewhere.
# Canary analysis: the Prometheus a test starts on PROMETHEUS_PORT (none runs there otherwise,
# so a rollout with checks waits, as it would without one).
PROMETHEUS_PORT = 18090
# Cache GC: the claims are host directories of this one machine, no NFS client to outwait.
INSTALL_VALUES = {"operator": {"healthPort": 18080, "prometheusUrl": f"http://127.0.0.1:{PROMETHEUS_PORT}"},
                  "autoscaling": {"receiver": {"port": 18081}}, "cache": {"gc": {"lockSettleSeconds": 0}}}


class LocalCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.control_plane: ControlPlane | None = None
        self.kubelet: Kubelet | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.control_plane.admin_kubeconfig

    def up(self, install: bool = True) -> "LocalCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.control_plane = ControlPlane(self.root, binaries())
            self.control_plane.start(gpu_cluster_nodes())
            # Before the chart: a cluster with the Gateway API, where Kiln patches HTTPRoutes.
            self.control_plane.install_crds(gateway_api_crds())
            self.kubelet = Kubelet(self.kubeconfig, self.root, self.control_plane.api_port).start()
            if install:
                self.helm("install", RELEASE, str(REPO / "charts" / "kiln"), "--namespace", RELEASE_NAMESPACE,
                          "--create-namespace", "--wait", "--timeout", "3m", values=INSTALL_VALUES)
        except BaseException:
            self.down()
            raise
        return self

    def seed_demo(self, namespace: str = "default") -> None:
        """The PVCs examples/demo/cluster.yaml expects: the engine cache, and `models` holding
        examples/demo/model.onnx at iris/model.onnx (what a user copies onto a volume)."""
        from .client import Api, wait_for

        api = Api(self.kubeconfig)
        for name in ("kiln-engine-cache", "models"):
            api.request("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", {
                "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
        path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/models"
        wait_for(lambda: (api.get(path) or {}).get("status", {}).get("phase") == "Bound", 60, "PVC models Bound")
        target = self.kubelet.claim_directory(namespace, "models") / "iris" / "model.onnx"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "examples" / "demo" / "model.onnx", target)

    def down(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.control_plane is not None:
            self.control_plane.stop()

    # ---- tools a user runs

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                input: str | None = None) -> subprocess.CompletedProcess:
        return self.control_plane.kubectl(*args, kubeconfig=kubeconfig, check=check, input=input)

    def _env(self) -> dict[str, str]:
        home = self.root / "helm"
        return {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                "HELM_DATA_HOME": str(home / "data"), "KUBECONFIG": str(self.kubeconfig)}

    def helm(self, *args: str, values: dict[str, Any] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        extra: list[str] = []
        if values:
            path = self.root / "helm-values.yaml"
            path.write_text(yaml.safe_dump(values))
            extra = ["--values", str(path)]
        result = subprocess.run([str(HELM), *args, *extra], env=self._env(), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, timeout=300)
        if check and result.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        return result

    def shell(self, script: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        """`script` as a user pastes it into bash in `cwd`: this cluster's kubectl and helm first on
        PATH, KUBECONFIG exported, stopping at the first command that fails (returncode; stdout
        holds stderr too). Still running after `timeout`: all of it is killed, TimeoutExpired."""
        env = self._env()
        env["PATH"] = f"{self.control_plane.bins['kubectl'].parent}:{HELM.parent}:{env.get('PATH', '')}"
        with subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as proc:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # a waiting kubectl too, not only bash
                proc.communicate()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig holding a TokenRequest token of a ServiceAccount: exactly its RBAC."""
        token = self.kubectl("create", "token", name, "--namespace", namespace, "--duration", "2h").stdout.strip()
        return write_kubeconfig(path, self.control_plane.server, self.control_plane.ca, token=token,
                                user=f"{namespace}:{name}")
