"""A kubelet stand-in for the pods that must do real work, and a volume provisioner.

kwok fakes every pod except those labelled `app.kubernetes.io/part-of=kiln` (the operator's
own pod from the chart, build Job pods, runtime pods): this harness runs those for real.
For each such pod the scheduler has bound to a node, it

- runs the container's command and args (the image's ENTRYPOINT/CMD, read from the
  Dockerfile, where the pod gives none) as a local process, with the container's env
  (`$(VAR)` expanded, `fieldRef`s resolved) and the service variables a kubelet sets;
- mounts the pod's volumes at their mountPaths in a private mount namespace
  (`unshare -m`): PVCs as the directory of their bound PersistentVolume, read-only where
  the pod says so; emptyDir; projected service-account tokens from a real TokenRequest
  bound to the pod; ConfigMaps and Secrets;
- reports status through the API: Running with its own 127.x IP, Ready from the
  container's own startup and readiness probes, restarts under `restartPolicy: Always`
  when the process exits or its liveness probe fails, terminated with the exit code and
  the termination message read from `terminationMessagePath` (the log tail under
  `FallbackToLogsOnError`);
- on deletion runs the container's preStop `sleep`, sends SIGTERM, waits up to the grace
  period (the sleep's included), then SIGKILL, and removes the pod.

The provisioner binds every pending PersistentVolumeClaim to a new hostPath
PersistentVolume (a directory under the harness's root), as a storage driver would.

What a real kubelet does that this does not: pull images (the processes run this
checkout's `kiln` from the virtualenv), cgroups and resource limits, users
(`runAsUser` is not applied; processes run as the harness's user), network namespaces
(every pod shares the host's loopback: each gets its own 127.x address, and `kiln serve`
binds to it through `KILN_SERVE_HOST`; the service host is the API server's loopback
address), exec probes and preStop hooks other than `sleep`, init and sidecar containers, `kubectl logs`/`exec` (logs are files
under `<root>/pods`), image-level `USER`, and node-level eviction.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kiln.operator import kube as kubemod

from .controlplane import HARNESS_POD_LABEL, REPO

log = logging.getLogger("localcluster.kubelet")

LAUNCH = Path(__file__).with_name("launch.py")
POD_IP_PREFIX = "127.10"
MAX_TERMINATION_MESSAGE = 4096
FALLBACK_LOG_LINES = 80
MERGE_PATCH = "application/merge-patch+json"
CONFIG_REFRESH_SECONDS = 2.0


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------ images

@dataclasses.dataclass(frozen=True)
class Image:
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]


def images_from_dockerfile(path: Path = REPO / "Dockerfile") -> dict[str, Image]:
    """Dockerfile target -> its ENTRYPOINT, CMD and ENV (the image `kiln-<target>` runs them)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    images: dict[str, Image] = {}
    target = None
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if not words or words[0].startswith("#"):
            continue
        op, rest = words[0].upper(), (words[1] if len(words) > 1 else "")
        if op == "FROM":
            target = rest.split()[-1] if " AS " in rest.upper() else None
            if target:
                images[target] = Image([], [], {})
        elif target and op in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
            images[target] = dataclasses.replace(images[target], **{"entrypoint" if op == "ENTRYPOINT" else "cmd": value})
        elif target and op == "ENV":
            env = dict(images[target].env)
            env.update(dict(item.split("=", 1) for item in shlex.split(rest) if "=" in item))
            images[target] = dataclasses.replace(images[target], env=env)
    return images


def image_for(reference: str, images: dict[str, Image]) -> Image:
    repo = reference.rsplit("/", 1)[-1].split("@")[0].split(":")[0]
    target = repo.removeprefix("kiln-")
    if target not in images:
        raise LookupError(f"image {reference!r}: the harness runs only this repository's images "
                          f"(kiln-{'/kiln-'.join(sorted(images))})")
    return images[target]


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, `$$` escapes, the rest stays."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


# ------------------------------------------------------------------------ the harness

class Kubelet:
    def __init__(self, kubeconfig: Path, root: Path, api_port: int, extra_path: str | None = None) -> None:
        self.api = kubemod.Kube(kubemod.load_client(str(kubeconfig)), component="kubelet-harness")
        self.root = root
        self.api_port = api_port
        self.images = images_from_dockerfile()
        self.path = os.pathsep.join(p for p in (extra_path or str(Path(sys.executable).parent),
                                                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") if p)
        self.pods: dict[str, PodWorker] = {}
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.next_ip = 1
        self.threads: list[threading.Thread] = []

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> dict:
        return self.api._request_sync(method, path, body, None, content_type)

    def start(self) -> "Kubelet":
        for target in (self._watch_pods, self._watch_claims):
            t = threading.Thread(target=self._forever, args=(target,), daemon=True, name=target.__name__)
            t.start()
            self.threads.append(t)
        return self

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            workers = list(self.pods.values())
        for w in workers:
            w.kill(grace=5, delete=False)
        for w in workers:
            w.join(10)

    def allocate_ip(self) -> str:
        with self.lock:
            n = self.next_ip
            self.next_ip += 1
        return f"{POD_IP_PREFIX}.{n // 250}.{n % 250 + 1}"

    # ---- watching

    def _forever(self, loop) -> None:
        while not self.stopping.is_set():
            try:
                loop()
            except Exception as e:  # a dropped watch: list again
                if not self.stopping.is_set():
                    log.debug("%s: %s; watching again", loop.__name__, e)
                    time.sleep(0.5)

    def _watch(self, path: str, selector: str | None, handle) -> None:
        """List, then watch from the list's resourceVersion; each object goes to `handle`."""
        query = f"?labelSelector={selector}" if selector else ""
        listed = self.request("GET", path + query)
        for item in listed.get("items") or ():
            handle("ADDED", item)
        version = listed["metadata"]["resourceVersion"]
        sep = "&" if query else "?"
        client = self.api.client
        url = f"{path}{query}{sep}watch=1&allowWatchBookmarks=true&timeoutSeconds=60&resourceVersion={version}"
        m, full, headers, _, _ = client.param_serialize(method="GET", resource_path=url, header_params={},
                                                        auth_settings=["BearerToken"])
        resp = client.call_api(m, full, header_params=headers, _request_timeout=(5, 90)).response  # not read yet
        try:
            for line in _lines(resp):
                if self.stopping.is_set():
                    return
                event = json.loads(line)
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    handle(event["type"], event["object"])
                elif event["type"] == "ERROR":
                    return
        finally:
            resp.release_conn()

    def _watch_pods(self) -> None:
        self._watch("/api/v1/pods", "=".join(HARNESS_POD_LABEL), self._on_pod)

    def _watch_claims(self) -> None:
        self._watch("/api/v1/persistentvolumeclaims", None, self._on_claim)

    def _on_pod(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if not pod["spec"].get("nodeName"):
            return  # not scheduled yet
        with self.lock:
            worker = self.pods.get(uid)
            if worker is None and kind != "DELETED" and not self.stopping.is_set():
                worker = self.pods[uid] = PodWorker(self, pod)
                worker.start()
        if worker is not None and (kind == "DELETED" or pod["metadata"].get("deletionTimestamp")):
            worker.kill(grace=_grace(pod), delete=kind != "DELETED")

    # ---- volumes

    def _on_claim(self, kind: str, claim: dict) -> None:
        if kind == "DELETED" or claim["spec"].get("volumeName") or (claim.get("status") or {}).get("phase") == "Bound":
            return
        self.provision(claim)

    def provision(self, claim: dict) -> None:
        """A hostPath PersistentVolume for `claim`, pre-bound to it (the PV binder finishes)."""
        meta = claim["metadata"]
        directory = self.root / "volumes" / f"{meta['namespace']}-{meta['name']}-{meta['uid'][:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o777)
        size = ((claim["spec"].get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        volume = {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"pvc-{meta['uid']}", "labels": {"kiln.dev/provisioned-by": "local-harness"}},
            "spec": {"capacity": {"storage": size}, "accessModes": claim["spec"].get("accessModes") or ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain",
                     "storageClassName": claim["spec"].get("storageClassName") or "",
                     "volumeMode": claim["spec"].get("volumeMode") or "Filesystem",
                     "hostPath": {"path": str(directory), "type": "Directory"},
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                                  "name": meta["name"], "uid": meta["uid"]}},
        }
        try:
            self.request("POST", "/api/v1/persistentvolumes", volume)
        except kubemod.ApiError as e:
            if e.status != 409:
                raise

    def claim_directory(self, namespace: str, claim: str) -> Path:
        pvc = self.request("GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        volume = self.request("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
        source = volume["spec"].get("hostPath") or volume["spec"].get("local")
        if not source:
            raise RuntimeError(f"PersistentVolume {volume['metadata']['name']} has no local directory")
        return Path(source["path"])


def _lines(resp):
    """Watch events, one JSON document a line, as the chunks arrive."""
    buffer = b""
    for chunk in resp.stream(None):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line


def _grace(pod: dict) -> float:
    meta = pod["metadata"]
    if meta.get("deletionGracePeriodSeconds") is not None:
        return float(meta["deletionGracePeriodSeconds"])
    return float(pod["spec"].get("terminationGracePeriodSeconds", 30))


# ------------------------------------------------------------------------ one pod

class PodWorker(threading.Thread):
    """Owns one pod: volumes, the container process, probes, restarts, status, deletion."""

    def __init__(self, kubelet: Kubelet, pod: dict) -> None:
        meta = pod["metadata"]
        super().__init__(daemon=True, name=f"pod {meta['namespace']}/{meta['name']}")
        self.k = kubelet
        self.pod = pod
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = kubelet.root / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.ip = kubelet.allocate_ip()
        self.proc: subprocess.Popen | None = None
        self.deleting = threading.Event()
        self.grace = 30.0
        self.delete_after = True
        self.started_at = now()
        self.config_volumes: list[tuple[Path, dict]] = []  # (directory, configMap source): kept current

    # ---- API

    def _path(self, sub: str = "") -> str:
        return f"/api/v1/namespaces/{self.ns}/pods/{self.name}{sub}"

    def report(self, phase: str, container: dict, ready: bool, message: str = "") -> None:
        stamp = now()
        scheduled = [c for c in (self.pod.get("status") or {}).get("conditions") or () if c["type"] == "PodScheduled"]
        running = phase == "Running"
        conds = scheduled + [
            {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": self.started_at},
            {"type": "Initialized", "status": "True", "lastTransitionTime": self.started_at},
            {"type": "ContainersReady", "status": str(ready and running), "lastTransitionTime": stamp},
            {"type": "Ready", "status": str(ready and running), "lastTransitionTime": stamp},
        ]
        status = {"phase": phase, "conditions": conds, "podIP": self.ip, "podIPs": [{"ip": self.ip}],
                  "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "startTime": self.started_at,
                  "containerStatuses": [container]}
        if message:
            status["message"] = message
        try:
            self.k.request("PATCH", self._path("/status"), {"status": status}, MERGE_PATCH)
        except kubemod.ApiError as e:
            if e.status != 404:
                log.warning("%s: status: %s", self.name, e)

    # ---- deletion

    def kill(self, grace: float, delete: bool) -> None:
        self.grace, self.delete_after = grace, delete
        self.deleting.set()

    def _terminate(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        # A preStop sleep runs first, inside the grace period, as a kubelet runs it.
        container = self.pod["spec"]["containers"][0]
        pre_stop = float(((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {}).get("seconds", 0))
        if pre_stop > 0 and self.grace > 0:
            try:
                proc.wait(min(pre_stop, self.grace))
                return  # it ended by itself meanwhile
            except subprocess.TimeoutExpired:
                self.grace -= min(pre_stop, self.grace)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(max(self.grace, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    # ---- the pod's life

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # the pod fails; the harness goes on
            log.exception("%s/%s", self.ns, self.name)
            container = self.pod["spec"]["containers"][0]
            self.report("Failed", {"name": container["name"], "image": container.get("image", ""), "ready": False,
                                   "restartCount": 0, "state": {"terminated": {
                                       "exitCode": 128, "reason": "StartError", "message": str(e)[:1024],
                                       "startedAt": self.started_at, "finishedAt": now()}}}, False, str(e)[:1024])
        finally:
            if self.deleting.is_set():
                self._terminate()
                if self.delete_after:
                    try:
                        self.k.request("DELETE", self._path(), {"apiVersion": "v1", "kind": "DeleteOptions",
                                                                "gracePeriodSeconds": 0,
                                                                "preconditions": {"uid": self.uid}})
                    except kubemod.ApiError as e:
                        if e.status not in (404, 409):
                            log.warning("%s: delete: %s", self.name, e)

    def _run(self) -> None:
        spec = self.pod["spec"]
        if (self.pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            self.deleting.wait()
            return
        container = spec["containers"][0]
        if len(spec["containers"]) > 1 or spec.get("initContainers"):
            raise RuntimeError("the harness runs pods of one container and no init containers")
        self.dir.mkdir(parents=True, exist_ok=True)
        argv, env = self._command(container)
        mounts = self._mounts(container)
        termination = self.dir / f"{container['name']}.termination-log"
        mounts.append({"source": str(termination), "target": container.get("terminationMessagePath")
                       or "/dev/termination-log", "readOnly": False})
        mounts += [{"source": str(p), "target": str(p), "readOnly": True} for p in software()]
        policy = spec.get("restartPolicy", "Always")
        restarts, last_state = 0, None
        while not self.deleting.is_set():
            termination.write_text("")
            log_path = self.dir / f"{container['name']}.log"
            launch = self.dir / "launch.json"
            launch.write_text(json.dumps({"argv": argv, "env": env, "cwd": container.get("workingDir"),
                                          "mounts": mounts}))
            with open(log_path, "ab") as out:
                self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable,
                                              str(LAUNCH), str(launch)], stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            started = now()
            base = {"name": container["name"], "image": container.get("image", ""),
                    "imageID": container.get("image", ""), "containerID": f"harness://{self.proc.pid}",
                    "restartCount": restarts, **({"lastState": last_state} if last_state else {})}
            code, reason = self._supervise(container, base, started)
            finished = now()
            message = self._termination_message(container, termination, log_path, code)
            terminated = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                          "startedAt": started, "finishedAt": finished, "containerID": base["containerID"],
                          **({"message": message} if message else {})}
            if self.deleting.is_set():
                break
            again = policy == "Always" or (policy == "OnFailure" and code != 0)
            if not again:
                phase = "Succeeded" if code == 0 else "Failed"
                self.report(phase, {**base, "ready": False, "started": False, "state": {"terminated": terminated}},
                            False)
                self.deleting.wait()
                return
            restarts += 1
            last_state = {"terminated": terminated}
            self.report("Running", {**base, "restartCount": restarts, "lastState": last_state, "ready": False,
                                    "started": False, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}, False)
            if self.deleting.wait(min(10.0, 0.5 * 2 ** min(restarts, 5))):
                break

    def _supervise(self, container: dict, base: dict, started: str) -> tuple[int, str]:
        """Run probes until the process exits (exit code, reason) or is killed."""
        startup = container.get("startupProbe")
        readiness, liveness = container.get("readinessProbe"), container.get("livenessProbe")
        is_started = startup is None
        ready = readiness is None and is_started
        self.report("Running", {**base, "ready": ready, "started": is_started,
                                "state": {"running": {"startedAt": started}}}, ready)
        failures = {"startup": 0, "readiness": 0, "liveness": 0}
        due = {"startup": _initial(startup), "readiness": _initial(readiness), "liveness": _initial(liveness)}
        t0 = time.monotonic()
        next_refresh = CONFIG_REFRESH_SECONDS
        while True:
            if self.deleting.is_set():
                self._terminate()
            code = self.proc.poll()
            if code is not None:
                return (128 + -code if code < 0 else code), ("Error" if code else "")
            elapsed = time.monotonic() - t0
            changed = False
            for kind, probe in (("startup", startup), ("readiness", readiness), ("liveness", liveness)):
                if probe is None or elapsed < due[kind] or self.deleting.is_set():
                    continue
                if kind == "startup" and is_started:
                    continue
                if kind != "startup" and not is_started:
                    continue
                due[kind] = elapsed + float(probe.get("periodSeconds", 10))
                ok = self._probe(container, probe)
                failures[kind] = 0 if ok else failures[kind] + 1
                threshold = int(probe.get("failureThreshold", 3))
                if kind == "startup":
                    if ok:
                        is_started, changed = True, True
                        due["readiness"] = due["liveness"] = elapsed
                    elif failures[kind] >= threshold:
                        self._terminate()
                elif kind == "readiness":
                    want = ok if ok or failures[kind] >= threshold else ready
                    if want != ready:
                        ready, changed = want, True
                elif failures[kind] >= threshold:
                    self._terminate()
            if changed:
                self.report("Running", {**base, "ready": ready, "started": is_started,
                                        "state": {"running": {"startedAt": started}}}, ready)
            if self.config_volumes and elapsed >= next_refresh:
                next_refresh = elapsed + CONFIG_REFRESH_SECONDS
                self.refresh_config_volumes()
            time.sleep(0.1)

    def _probe(self, container: dict, probe: dict) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://{get.get('host') or self.ip}:{_port(container, get['port'])}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return 200 <= r.status < 400
            except (urllib.error.URLError, OSError, ValueError):
                return False
        if "tcpSocket" in probe:
            try:
                with socket.create_connection((self.ip, _port(container, probe["tcpSocket"]["port"])), timeout):
                    return True
            except OSError:
                return False
        raise RuntimeError(f"the harness runs httpGet and tcpSocket probes, not {sorted(probe)}")

    @staticmethod
    def _termination_message(container: dict, path: Path, log_path: Path, code: int) -> str:
        text = path.read_text(errors="replace")[:MAX_TERMINATION_MESSAGE] if path.exists() else ""
        if not text.strip() and code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            lines = log_path.read_text(errors="replace").splitlines()[-FALLBACK_LOG_LINES:]
            text = "\n".join(lines)[-MAX_TERMINATION_MESSAGE:]
        return text

    # ---- what the container sees

    def _command(self, container: dict) -> tuple[list[str], dict[str, str]]:
        image = image_for(container.get("image", ""), self.k.images)
        env = {"PATH": self.k.path, "HOSTNAME": self.name, **image.env,
               "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.k.api_port),
               "KUBERNETES_SERVICE_PORT_HTTPS": str(self.k.api_port), "KILN_SERVE_HOST": self.ip}
        fields = {"metadata.name": self.name, "metadata.namespace": self.ns, "metadata.uid": self.uid,
                  "spec.nodeName": self.pod["spec"]["nodeName"], "status.podIP": self.ip, "status.hostIP": "127.0.0.1",
                  "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName", "default")}
        for var in container.get("env") or ():
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") in fields:
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        if container.get("command"):
            argv = list(container["command"]) + list(container.get("args") or [])
        else:
            argv = image.entrypoint + (list(container["args"]) if "args" in container else image.cmd)
        return [expand(a, env) for a in argv], env

    def _mounts(self, container: dict) -> list[dict[str, Any]]:
        sources = {v["name"]: self._volume(v) for v in self.pod["spec"].get("volumes") or ()}
        mounts = []
        for m in container.get("volumeMounts") or ():
            source, read_only = sources[m["name"]]
            if m.get("subPath"):
                source = source / m["subPath"]
            mounts.append({"source": str(source), "target": m["mountPath"],
                           "readOnly": bool(m.get("readOnly") or read_only)})
        return mounts

    def _volume(self, volume: dict) -> tuple[Path, bool]:
        name = volume["name"]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            return self.k.claim_directory(self.ns, claim["claimName"]), bool(claim.get("readOnly"))
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"]), False
        directory = self.dir / "volumes" / name
        directory.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            directory.chmod(0o1777)
            return directory, False
        files: dict[str, str] = {}
        if "projected" in volume:
            for source in volume["projected"].get("sources") or ():
                files.update(self._projected(source))
        elif "configMap" in volume:
            files.update(self._config_items(volume["configMap"], "configmaps"))
            self.config_volumes.append((directory, volume["configMap"]))
        elif "secret" in volume:
            files.update(self._config_items(volume["secret"], "secrets"))
        else:
            raise RuntimeError(f"volume {name}: the harness does not support {sorted(set(volume) - {'name'})}")
        for path, content in files.items():
            target = directory / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        return directory, True

    def _projected(self, source: dict) -> dict[str, str]:
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            sa = self.pod["spec"].get("serviceAccountName") or "default"
            review = self.k.request("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [sat["audience"]] if sat.get("audience") else [],
                         "expirationSeconds": int(sat.get("expirationSeconds", 3607)),
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}}})
            return {sat["path"]: review["status"]["token"]}
        if "configMap" in source:
            return self._config_items(source["configMap"], "configmaps")
        if "secret" in source:
            return self._config_items(source["secret"], "secrets")
        if "downwardAPI" in source:
            fields = {"metadata.namespace": self.ns, "metadata.name": self.name, "metadata.uid": self.uid}
            return {item["path"]: fields[item["fieldRef"]["fieldPath"]] for item in source["downwardAPI"]["items"]
                    if (item.get("fieldRef") or {}).get("fieldPath") in fields}
        raise RuntimeError(f"projected source {sorted(source)} is not supported by the harness")

    def refresh_config_volumes(self) -> None:
        """A ConfigMap volume follows its ConfigMap while the pod runs, as a kubelet's does
        (there within its sync period, about a minute; here every CONFIG_REFRESH_SECONDS):
        each changed file replaced at once, a key gone removed."""
        for directory, ref in self.config_volumes:
            try:
                files = self._config_items(ref, "configmaps")
            except Exception as e:  # the API server busy or going away: the next round
                log.debug("pod %s: ConfigMap %s not refreshed: %s", self.name, ref.get("name"), e)
                continue
            for path in directory.rglob("*"):
                if path.is_file() and str(path.relative_to(directory)) not in files:
                    path.unlink()
            for path, content in files.items():
                target = directory / path
                if not target.exists() or target.read_text() != content:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    staged = target.with_name(f".{target.name}.new")
                    staged.write_text(content)
                    os.replace(staged, target)

    def _config_items(self, ref: dict, plural: str) -> dict[str, str]:
        import base64

        name = ref.get("name") or ref.get("secretName")
        try:
            obj = self.k.request("GET", f"/api/v1/namespaces/{self.ns}/{plural}/{name}")
        except Exception as e:
            if ref.get("optional") and getattr(e, "status", None) == 404:
                return {}  # an optional one that does not exist: an empty volume
            raise
        data = dict(obj.get("data") or {})
        if plural == "secrets":
            data = {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        items = ref.get("items")
        return {i["path"]: data[i["key"]] for i in items} if items else data


def software() -> list[Path]:
    """What stands in for the image: this checkout (with its virtualenv) and the Python it
    runs on, mounted read-only at their own paths last, so that a pod's volume over /tmp
    (an emptyDir) cannot hide a checkout that lives under /tmp."""
    paths: list[Path] = []
    for p in sorted({REPO, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}, key=lambda p: len(p.parts)):
        if not any(p.is_relative_to(q) for q in paths):
            paths.append(p)
    return paths


def _initial(probe: dict | None) -> float:
    return float((probe or {}).get("initialDelaySeconds", 0))


def _port(container: dict, port: Any) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or ():
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")
