"""`make cluster` / `make cluster-down`: a local control plane with Kiln installed, left running.

From tests/ (where `support` is importable):

    python -m support.localcluster start   # start in the background, print the KUBECONFIG to export
    python -m support.localcluster stop    # stop it and remove its state
    python -m support.localcluster run     # in the foreground until Ctrl-C
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from . import LocalCluster
from .controlplane import REPO

STATE = REPO / ".kiln" / "cluster"
TESTS = REPO / "tests"  # the folder `python -m support.localcluster` runs from
PID, READY, FAILED = STATE / "pid", STATE / "ready", STATE / "failed"


def run() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(STATE)
    try:
        cluster.up()
        cluster.seed_demo()
    except Exception as e:
        FAILED.write_text(f"{e}\n")
        raise
    READY.write_text(str(cluster.kubeconfig))
    print(f"cluster is up; export KUBECONFIG={cluster.kubeconfig}", flush=True)
    stop.wait()
    cluster.down()
    return 0


def start(timeout: float) -> int:
    if PID.exists():
        print(f"a cluster is already running (pid {PID.read_text().strip()}); `make cluster-down` stops it")
        return 1
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir(parents=True)
    log = open(STATE / "cluster.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "support.localcluster", "run"], cwd=TESTS,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    PID.write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if READY.exists():
            print(f"Kiln is installed on a local control plane (logs: {STATE}/logs, {STATE}/pods).\n"
                  f"  export KUBECONFIG={READY.read_text()}\n"
                  f"  kubectl apply -f examples/demo/cluster.yaml   # then: kubectl get kim -w\n"
                  f"`make cluster-down` stops it.")
            return 0
        if proc.poll() is not None or FAILED.exists():
            print(f"the cluster did not start:\n{(STATE / 'cluster.log').read_text()[-4000:]}", file=sys.stderr)
            PID.unlink(missing_ok=True)
            return 1
        time.sleep(0.5)
    print(f"the cluster was not up after {timeout:.0f} s; see {STATE}/cluster.log", file=sys.stderr)
    return 1


def stop() -> int:
    if PID.exists():
        pid = int(PID.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
            for _ in range(120):
                os.killpg(pid, 0)
                time.sleep(0.5)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(STATE, ignore_errors=True)
    print("the local cluster is stopped and its state removed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m support.localcluster", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["start", "stop", "run"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds `start` waits for the cluster")
    args = parser.parse_args()
    return {"start": lambda: start(args.timeout), "stop": stop, "run": run}[args.command]()


if __name__ == "__main__":
    sys.exit(main())
