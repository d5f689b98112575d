"""`make demo`: the bundled example end to end on this machine's CPU.

Starts `kiln dev` on examples/demo/inferencemodel.yaml (an Iris flower classifier, ONNX
Runtime backend) in a subprocess on a free port, waits until it is ready, sends one real
inference request over HTTP, prints the request and the answer, and stops the server.

    python -m kiln.runtime.commands.demo [--cache-dir DIR] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

MANIFEST = Path("examples") / "demo" / "inferencemodel.yaml"
SPECIES = ["setosa", "versicolor", "virginica"]
# Four flowers from Fisher's Iris data (sepal length, sepal width, petal length, petal
# width in cm); the last is a versicolor that sits on the border with virginica.
FLOWERS = [[5.1, 3.5, 1.4, 0.2], [6.4, 3.2, 4.5, 1.5], [6.3, 3.3, 6.0, 2.5],
           [6.0, 2.7, 5.1, 1.6]]
_URL = re.compile(r"serving \S+ \(version [^)]*\) at (http://\S+)")


def find_manifest() -> Path:
    """The example in the current checkout (make runs from the repository root), else the
    one next to this module's source (the editable install links to the repository)."""
    here = Path(__file__).resolve().parents[2]
    for root in (Path.cwd(), here):
        if (root / MANIFEST).is_file():
            return root / MANIFEST
    raise FileNotFoundError(f"{MANIFEST} not found in {Path.cwd()} or {here}: run the demo "
                            f"from a Kiln checkout")


class DevServer:
    """`kiln dev` in a subprocess; its output is echoed, indented, as it arrives."""

    def __init__(self, manifest: Path, cache_dir: Path):
        cmd = [sys.executable, "-m", "kiln.cli", "dev", str(manifest.resolve()), "--port", "0",
               "--cache-dir", str(cache_dir.resolve())]
        # A neutral working directory: nothing in it can shadow the installed package.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, cwd=tempfile.gettempdir(),
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url: str | None = None
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            print(f"  | {line.rstrip()}", flush=True)
            m = _URL.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._found.set()
        self._found.set()  # the process ended

    def wait_url(self, timeout: float) -> str:
        if not self._found.wait(timeout):
            raise TimeoutError(f"kiln dev did not report a URL within {timeout:.0f}s")
        if self.url is None:
            raise RuntimeError(f"kiln dev exited with code {self.proc.wait()} before serving")
        return self.url

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(5)
        return code


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0
         ) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_ready(url: str, timeout: float, clock=time.monotonic, pause=time.sleep) -> None:
    deadline = clock() + timeout
    last = ""
    while clock() < deadline:
        try:
            status, doc = http("GET", f"{url}/v2/health/ready", timeout=2)
            if status == 200:
                return
            last = doc.get("error", f"HTTP {status}")
        except OSError as e:
            last = str(e)
        pause(0.2)
    raise TimeoutError(f"the server was not ready within {timeout:.0f}s: {last}")


def render_answer(answer: dict) -> list[str]:
    outputs = {o["name"]: o for o in answer["outputs"]}
    probs = outputs["probabilities"]["data"]
    species = outputs["species"]["data"]
    lines = ["  flower (sepal l, sepal w, petal l, petal w; cm)   species      "
             "p(setosa) p(versicolor) p(virginica)"]
    for i, flower in enumerate(FLOWERS):
        p = probs[3 * i:3 * i + 3]
        lines.append(f"  {str(flower):<47} {SPECIES[species[i]]:<12} "
                     f"{p[0]:9.3f} {p[1]:13.3f} {p[2]:12.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.commands.demo",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("--cache-dir", type=Path,
                        help="the engine cache (default: .kiln/cache in the checkout)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the server to be ready")
    args = parser.parse_args(argv)

    manifest = find_manifest()
    cache_dir = args.cache_dir or manifest.parents[2] / ".kiln" / "cache"
    if not manifest.with_name("model.onnx").is_file():
        subprocess.run([sys.executable, str(manifest.with_name("make_model.py"))], check=True)
    print(f"kiln demo: starting `kiln dev {manifest}`", flush=True)
    server = DevServer(manifest, cache_dir)
    try:
        url = server.wait_url(args.timeout)
        wait_ready(url, args.timeout)
        request = {"id": "demo-1", "inputs": [{"name": "features", "shape": [len(FLOWERS), 4],
                                               "datatype": "FP32", "data": FLOWERS}]}
        endpoint = f"{url}/v2/models/iris/infer"
        print(f"\nrequest: POST {endpoint}\n{json.dumps(request)}", flush=True)
        status, answer = http("POST", endpoint, request)
        print(f"\nanswer: HTTP {status}\n{json.dumps(answer)}\n", flush=True)
        if status != 200:
            print(f"kiln demo: the server answered {status}: {answer.get('error')}",
                  file=sys.stderr)
            return 1
        print("\n".join(render_answer(answer)), flush=True)
    except (TimeoutError, RuntimeError, OSError) as e:
        print(f"kiln demo: {e}", file=sys.stderr)
        server.stop()
        return 1
    code = server.stop()
    print(f"\nkiln demo: server stopped (exit code {code})", flush=True)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
