"""A real Kubernetes control plane on one machine, as plain processes on 127.0.0.1.

etcd (data on tmpfs), kube-apiserver (RBAC and Node authorization, TLS from a CA made at
start, service-account signing keys), kube-controller-manager (the controllers Kiln relies
on, each with its own service account), kube-scheduler, and kwok keeping fake nodes alive
that look like a GPU cluster. The binaries come from `hack/build_controlplane.py`.

Each component's readiness is polled, never slept for; a component that exits early
fails the start with the tail of its log. Logs stay in `<root>/logs` for a failing test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml

from . import certs

REPO = Path(__file__).resolve().parents[3]  # tests/support/localcluster/
HOST = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"  # addresses only written into objects, never sent to
KWOK_POD_CIDR = "127.20.0.0/16"  # pods kwok fakes (none of Kiln's)
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
HARNESS_POD_LABEL = ("app.kubernetes.io/part-of", "kiln")  # pods the kubelet harness runs for real
CONTROLLERS = [
    "job-controller", "deployment-controller", "replicaset-controller", "garbage-collector-controller",
    "ttl-after-finished-controller", "serviceaccount-controller", "serviceaccount-token-controller",
    "namespace-controller", "horizontal-pod-autoscaler-controller", "node-lifecycle-controller",
    "persistentvolume-binder-controller", "persistentvolume-protection-controller",
    "persistentvolumeclaim-protection-controller", "root-ca-certificate-publisher-controller",
    "pod-garbage-collector-controller",
]

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"


def _gpu_node(name: str, product: str, gpus: int, role: str | None = None) -> dict[str, Any]:
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.present": "true",
              "nvidia.com/gpu.count": str(gpus)}
    taints = []
    if role:
        labels["kiln.dev/role"] = role
        taints = [{"key": "kiln.dev/role", "value": role, "effect": "NoSchedule"}]
    return node(name, cpu="32", memory="256Gi", gpus=gpus, labels=labels, taints=taints)


def node(name: str, cpu: str, memory: str, gpus: int = 0, labels: dict[str, str] | None = None,
         taints: list[dict[str, str]] | None = None, pods: int = 110) -> dict[str, Any]:
    capacity = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "500Gi"}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1]},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok", **(labels or {})}},
        "spec": {"taints": taints or []},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def gpu_cluster_nodes() -> list[dict[str, Any]]:
    """Runtime nodes of two GPU products, dedicated builder nodes (label and taint), a CPU node."""
    return [
        _gpu_node("gpu-h100-0", H100, 8), _gpu_node("gpu-h100-1", H100, 8),
        _gpu_node("gpu-a100-0", A100, 8),
        _gpu_node("builder-h100-0", H100, 2, role="builder"),
        node("cpu-0", cpu="16", memory="64Gi"),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


BUILD_SCRIPT = REPO / "hack" / "build_controlplane.py"


def binaries() -> dict[str, Path]:
    """name -> path, from the folders the build script reports (built first if missing; the
    Gateway API CRDs are fetched with them)."""
    tools = REPO / ".tools"
    subprocess.run(["python3", str(BUILD_SCRIPT), "--dest", str(tools)], check=True)
    dirs = subprocess.run(["python3", str(BUILD_SCRIPT), "--dest", str(tools), "--print-dirs"], check=True,
                          stdout=subprocess.PIPE, text=True).stdout.split()
    return {p.name: p for d in dirs for p in Path(d).iterdir()}


def gateway_api_crds() -> Path:
    """The folder of the Gateway API's standard channel (sigs.k8s.io/gateway-api), which the
    build script fetches with the binaries."""
    folder = Path(subprocess.run(["python3", str(BUILD_SCRIPT), "--dest", str(REPO / ".tools"), "--print-crds"],
                                 check=True, stdout=subprocess.PIPE, text=True).stdout.strip())
    if not any(folder.glob("*.yaml")):
        raise StartError(f"no Gateway API CRDs in {folder}: run hack/build_controlplane.py (make controlplane)")
    return folder


def write_kubeconfig(path: Path, server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None,
                     token: str | None = None, user: str = "user") -> Path:
    creds: dict[str, str] = {}
    if cert and key:
        creds = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        creds = {"token": token}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kiln-local",
        "clusters": [{"name": "kiln-local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "kiln-local", "context": {"cluster": "kiln-local", "user": user}}],
    }))
    path.chmod(0o600)
    return path


def _die_with_parent() -> None:
    """In the child: SIGKILL when the process that started it dies (a killed test run
    leaves no control plane behind)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class StartError(RuntimeError):
    pass


@dataclasses.dataclass
class ControlPlane:
    root: Path
    bins: dict[str, Path]
    procs: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)
    api_port: int = 0
    etcd_dir: Path | None = None

    @property
    def server(self) -> str:
        return f"https://{HOST}:{self.api_port}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def ca(self) -> Path:
        return self.root / "pki" / "ca.crt"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ---------------------------------------------------------------- processes

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log(name), "ab")
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    def _wait(self, name: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise StartError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                if check():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise StartError(f"{name} was not ready after {timeout:.0f} s:\n{self.log_tail(name)}")

    def _https_ok(self, port: int, path: str) -> bool:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = False
        if port != self.api_port:  # controller-manager / scheduler: their own self-signed serving certs
            context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(str(self.root / "pki" / "admin.crt"), str(self.root / "pki" / "admin.key"))
        with urllib.request.urlopen(f"https://{HOST}:{port}{path}", context=context, timeout=3) as r:
            return r.status == 200

    # ---------------------------------------------------------------- start

    def start(self, nodes: list[dict[str, Any]], timeout: float = 180) -> "ControlPlane":
        pki = self.root / "pki"
        for d in (pki, self.root / "logs"):
            d.mkdir(parents=True, exist_ok=True)
        ca = certs.CertificateAuthority(pki)
        serving = ca.issue("apiserver", "kube-apiserver", server=True, hosts=(
            HOST, "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local", "10.96.0.1"))
        admin = ca.issue("admin", "kubernetes-admin", org="system:masters")
        sa_private, sa_public = certs.service_account_keys(pki)
        self.api_port = free_port()
        write_kubeconfig(self.admin_kubeconfig, self.server, self.ca, cert=admin[0], key=admin[1], user="admin")

        shm = Path("/dev/shm")
        self.etcd_dir = Path(tempfile.mkdtemp(prefix="kiln-etcd-", dir=shm if shm.is_dir() else None))
        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://{HOST}:{etcd_port}"
        self._spawn("etcd", [str(self.bins["etcd"]), "--data-dir", str(self.etcd_dir), "--unsafe-no-fsync",
                             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                             "--listen-peer-urls", f"http://{HOST}:{peer_port}",
                             "--initial-advertise-peer-urls", f"http://{HOST}:{peer_port}",
                             "--initial-cluster", f"default=http://{HOST}:{peer_port}",
                             "--listen-metrics-urls", f"http://{HOST}:{free_port()}", "--log-level", "warn"])
        self._wait("etcd", lambda: urllib.request.urlopen(f"{etcd_url}/health", timeout=2).status == 200, 30)

        self._spawn("kube-apiserver", [
            str(self.bins["kube-apiserver"]), f"--etcd-servers={etcd_url}", f"--bind-address={HOST}",
            f"--advertise-address={HOST}", f"--secure-port={self.api_port}",
            "--authorization-mode=Node,RBAC", f"--client-ca-file={self.ca}",
            f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_public}", f"--service-account-signing-key-file={sa_private}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            "--disable-admission-plugins=TaintNodesByCondition", "--endpoint-reconciler-type=none",
            "--profiling=false", "--v=1",
        ])
        self._wait("kube-apiserver", lambda: self._https_ok(self.api_port, "/readyz"), timeout)

        kcm = ca.issue("controller-manager", "system:kube-controller-manager")
        scheduler = ca.issue("scheduler", "system:kube-scheduler")
        kwok = ca.issue("kwok", "kwok-controller", org="system:masters")
        kubeconfigs = {name: write_kubeconfig(self.root / f"{name}.kubeconfig", self.server, self.ca,
                                              cert=pair[0], key=pair[1], user=name)
                       for name, pair in (("controller-manager", kcm), ("scheduler", scheduler), ("kwok", kwok))}
        kcm_port, scheduler_port = free_port(), free_port()
        self._spawn("kube-controller-manager", [
            str(self.bins["kube-controller-manager"]), f"--kubeconfig={kubeconfigs['controller-manager']}",
            f"--authentication-kubeconfig={kubeconfigs['controller-manager']}",
            f"--authorization-kubeconfig={kubeconfigs['controller-manager']}",
            f"--bind-address={HOST}", f"--secure-port={kcm_port}", "--leader-elect=false",
            f"--controllers={','.join(CONTROLLERS)}", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={sa_private}", f"--root-ca-file={self.ca}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--node-monitor-grace-period=40s",
            "--concurrent-gc-syncs=5", "--v=1",
        ])
        self._spawn("kube-scheduler", [
            str(self.bins["kube-scheduler"]), f"--kubeconfig={kubeconfigs['scheduler']}",
            f"--authentication-kubeconfig={kubeconfigs['scheduler']}",
            f"--authorization-kubeconfig={kubeconfigs['scheduler']}",
            f"--bind-address={HOST}", f"--secure-port={scheduler_port}", "--leader-elect=false", "--v=1",
        ])
        self._spawn("kwok", [
            str(self.bins["kwok"]), f"--kubeconfig={kubeconfigs['kwok']}", f"--config={self.bins['stages.yaml']}",
            f"--manage-nodes-with-annotation-selector={'='.join(KWOK_NODE_ANNOTATION)}",
            f"--disregard-status-with-label-selector={'='.join(HARNESS_POD_LABEL)}",
            f"--cidr={KWOK_POD_CIDR}", f"--node-ip={HOST}", "--node-lease-duration-seconds=40",
        ])
        self._wait("kube-controller-manager", lambda: self._https_ok(kcm_port, "/healthz"), timeout)
        self._wait("kube-scheduler", lambda: self._https_ok(scheduler_port, "/healthz"), timeout)
        self.create_nodes(nodes)
        return self

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bins["kubectl"]), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
                               *args], check=check, text=True, input=input,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)

    def install_crds(self, folder: Path, timeout: float = 60) -> list[str]:
        """Apply every manifest in `folder` and wait until each CRD among them is Established.
        Server-side: client-side apply's last-applied annotation cannot hold CRDs this large."""
        applied = self.kubectl("apply", "--server-side", "-f", str(folder), "-o", "name", check=False)
        if applied.returncode != 0:
            raise StartError(f"kubectl apply --server-side -f {folder} failed:\n{applied.stderr}")
        crds = [name for name in applied.stdout.split() if name.startswith("customresourcedefinition.")]
        established = self.kubectl("wait", "--for=condition=Established", f"--timeout={timeout:.0f}s", *crds,
                                   check=False)
        if established.returncode != 0:
            raise StartError(f"CRDs from {folder} not Established after {timeout:.0f} s:\n{established.stderr}")
        return crds

    def create_nodes(self, nodes: list[dict[str, Any]]) -> None:
        self.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(n) for n in nodes))

        def all_ready() -> bool:
            listed = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
            ready = {n["metadata"]["name"] for n in listed
                     if any(c["type"] == "Ready" and c["status"] == "True"
                            for c in (n.get("status") or {}).get("conditions") or ())}
            return {n["metadata"]["name"] for n in nodes} <= ready
        self._wait("kwok", all_ready, 60)

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()
        if self.etcd_dir is not None:
            shutil.rmtree(self.etcd_dir, ignore_errors=True)
