"""What Prometheus and Alertmanager have in common here: a server binary run as a child
process on 127.0.0.1, its config written to and checked in its own work directory.

A start writes the config, validates it with the server's own checker (a bad config fails
with the checker's words, not a crash loop to dig out of a log), spawns the binary with its
output in `<workdir>/<name>.log`, and polls `/-/ready` until a deadline; a process that
exits early fails the start with its log tail. The children get SIGKILL when the thread
that started them dies (PR_SET_PDEATHSIG), so a killed test run leaves no server behind:
start them from the main thread or another thread that outlives them.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

T = TypeVar("T")
S = TypeVar("S", bound="ServerProcess")
HOST = "127.0.0.1"
# Everything here is on loopback: a proxy from the environment must not see it.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child (preexec_fn): SIGKILL when the thread that started it ends, so a killed
    test run leaves no server behind. The same as localcluster's; the harness stands alone
    (no control plane needed) and so has its own."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ConfigError(ValueError):
    """The server's own checker (promtool, amtool) rejected the config; the message is its output."""


class StartError(RuntimeError):
    """The server exited or was not ready in time; the message ends with its log tail."""


class HTTPError(RuntimeError):
    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        super().__init__(f"{method} {url}: HTTP {status}: {body.strip()[:2000]}")
        self.status, self.body = status, body


def wait_until(check: Callable[[], T], timeout: float, what: str, interval: float = 0.1,
               describe: Callable[[], str] | None = None) -> T:
    """Call `check` until it returns something truthy (returned) or `timeout` seconds pass
    (TimeoutError naming `what`, plus `describe()` where given: the last state seen)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            detail = f":\n{describe()}" if describe else ""
            raise TimeoutError(f"{what}: not within {timeout:g} s{detail}")
        time.sleep(interval)


def missing_binaries(*names: str) -> list[str]:
    return [name for name in names if shutil.which(name) is None]


def check_config(tool: list[str], path: Path) -> None:
    """Run `tool... path`; ConfigError with the tool's output when it fails."""
    result = subprocess.run([*tool, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=60)
    if result.returncode != 0:
        raise ConfigError(f"{' '.join(tool)} {path} failed ({result.returncode}):\n{result.stdout.strip()}")


class ServerProcess:
    """One server binary on 127.0.0.1:<port>. The port is chosen at construction, so `url` is
    known before `start()` (configs that name each other can be written first) and stays the
    same across a stop and a start."""

    name = "server"
    config_name = "config.yml"
    checker: list[str] = []

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir).resolve()  # the child runs in it: relative paths would break
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    # ---------------------------------------------------------------- what a subclass gives

    def render_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def args(self) -> list[str]:
        raise NotImplementedError

    # ---------------------------------------------------------------- paths

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / self.config_name

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ---------------------------------------------------------------- lifecycle

    def write_config(self) -> Path:
        """Write the config and check it with the server's own tool (ConfigError if rejected)."""
        self.config_path.write_text(yaml.safe_dump(self.render_config(), sort_keys=False))
        check_config(self.checker, self.config_path)
        return self.config_path

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self: S, timeout: float = 30) -> S:
        if self.running:
            raise StartError(f"{self.name} is already running (pid {self.proc.pid})")
        self.write_config()
        self.data_dir.mkdir(exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir,
                                         start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None:
                raise StartError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                self.kill()
                raise StartError(f"{self.name} was not ready after {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def _ready(self) -> bool:
        try:
            return self.request("GET", "/-/ready", timeout=1)[0] == 200
        except (OSError, HTTPError):
            return False

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (both servers flush and exit cleanly), SIGKILL after `timeout` seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, no shutdown: an outage as abrupt as a node loss."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- HTTP

    def request(self, method: str, path: str, params: dict[str, Any] | None = None,
                body: Any = None, timeout: float = 10) -> tuple[int, bytes]:
        """One HTTP request to the server; HTTPError for a status >= 400 (with its body)."""
        url = self.url + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with OPENER.open(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            raise HTTPError(method, url, e.code, e.read().decode(errors="replace")) from None

    def get_json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return json.loads(self.request("GET", path, params)[1])
