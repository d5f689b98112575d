"""The peers of `benchmarks/peers.py`: MLServer and KServe's Python model server, where their
Python comes from, the model code each serves the ONNX file with, and their start-up.

Each peer is installed by the benchmark into its own virtual environment under
.tools/bench-peers/<peer>-<version>/ (made with the benchmark's Python, once: a marker file
holds the pins installed), with the ONNX Runtime and numpy versions of the interpreter running
the benchmark, so that every server runs the model on the same ONNX Runtime. Offline (a host
with no network), KILN_BENCH_PEER_SITES=DIR names `pip install --target` directories instead,
DIR/kserve and DIR/mlserver: the peer runs on the benchmark's own interpreter with that
directory first on its PYTHONPATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from benchmarks.serving import REPO, Model, _free_port, started

# The peers, pinned: the releases issue 12 names, plus the benchmark interpreter's onnxruntime
# and numpy (1.32.0 and 2.4.6 when this was written); pip resolves the rest from PyPI (checked
# on a fresh venv, Python 3.11). One more pin: MLServer 1.7.1 leaves uvloop unpinned, and
# uvloop 0.22 on raises in `asyncio.get_event_loop()` with no loop set, which MLServer's
# inference worker processes call as they start (they die, the model never loads); 0.21.0 is
# the uvloop of MLServer 1.7.1's release.
MLSERVER_VERSION = "1.7.1"
KSERVE_VERSION = "0.21.0"
PEER_PINS = {
    "mlserver": (MLSERVER_VERSION, [f"mlserver=={MLSERVER_VERSION}", "uvloop==0.21.0"]),
    "kserve": (KSERVE_VERSION, [f"kserve=={KSERVE_VERSION}"]),
}
PEERS_DIR = REPO / ".tools" / "bench-peers"
MARKER = ".kiln-installed"
SITES_ENV = "KILN_BENCH_PEER_SITES"

# MLServer's adaptive batching: Kiln's default maxBatchSize (32); MLServer needs a batch time
# above 0 to batch at all (it waits that long for a batch to fill, also for a lone request):
# 1 ms, Kiln's queue delay before issue 12.
MLSERVER_MAX_BATCH_SIZE = 32
MLSERVER_MAX_BATCH_TIME = 0.001


@dataclass(frozen=True)
class PeerConfig:
    """One way to run a peer. `threads`: each ONNX Runtime session's intra-op threads (0:
    ONNX Runtime's default, sized from the CPUs the process may use)."""
    peer: str  # "kserve" or "mlserver"
    threads: int = 0
    workers: int = 1  # KServe: ModelServer(workers=...), uvicorn worker processes
    parallel_workers: int = 0  # MLServer: inference processes beside the HTTP process
    batching: bool = False  # MLServer: adaptive batching
    replicas: int = 1  # MLServer: separate `mlserver start` processes, each on its own ports

    @property
    def label(self) -> str:
        threads = "ORT default threads" if not self.threads else _plural(self.threads, "thread")
        if self.peer == "kserve":
            return f"KServe {KSERVE_VERSION}, {_plural(self.workers, 'worker')} x {threads}"
        if self.replicas > 1:
            return (f"MLServer {MLSERVER_VERSION}, {self.replicas} replicas x {threads} "
                    f"(parallel_workers {self.parallel_workers}, no batching)")
        default = " (its default)" if self.parallel_workers == 1 else ""
        batching = "adaptive batching" if self.batching else "no batching"
        return (f"MLServer {MLSERVER_VERSION}, parallel_workers {self.parallel_workers}{default}, "
                f"{batching}, {threads}")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


@dataclass
class PeerServer:
    name: str  # the table's label
    urls: list[str]  # one per replica
    binary: bool  # speaks the binary tensor extension on REST


# -- the peers' Python ---------------------------------------------------------------------

@dataclass
class PeerPython:
    python: str
    env: dict[str, str]  # the environment the peer starts in


def _same_runtime_pins() -> list[str]:
    import onnxruntime

    return [f"onnxruntime=={onnxruntime.__version__}", f"numpy=={np.__version__}"]


def _peer_env() -> dict[str, str]:
    """The environment a peer starts in: ours without Kiln's import path or venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def peer_python(peer: str) -> PeerPython:
    """The peer's Python: from KILN_BENCH_PEER_SITES when set, else its virtual environment,
    installed first when missing or stale."""
    env = _peer_env()
    sites = os.environ.get(SITES_ENV)
    if sites:
        site = Path(sites) / peer
        if not site.is_dir():
            raise RuntimeError(f"{SITES_ENV}={sites}: no {site} (pip install --target {site} ...)")
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
        return PeerPython(sys.executable, env)
    return PeerPython(str(_installed_venv(peer)), env)


def _installed_venv(peer: str) -> Path:
    version, pins = PEER_PINS[peer]
    pins = pins + _same_runtime_pins()
    root = PEERS_DIR / f"{peer}-{version}"
    python = root / "bin" / "python"
    marker = root / MARKER
    wanted = "\n".join(pins) + "\n"
    if marker.exists() and marker.read_text() == wanted and python.exists():
        return python
    print(f"   installing {peer} {version} into {root} ...", file=sys.stderr, flush=True)
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *pins], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(pins)} failed for the {peer} benchmark peer:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    marker.write_text(wanted)
    return python


def peer_versions(peer: str, py: PeerPython) -> dict[str, str]:
    """The versions the peer runs (itself, uvicorn, fastapi, onnxruntime, numpy); raises
    unless the peer and its ONNX Runtime and numpy are the ones pinned (a --target directory
    may hold others)."""
    names = (peer, "uvicorn", "fastapi", "onnxruntime", "numpy")
    code = ("import json, sys\nfrom importlib import metadata\n"
            "print(json.dumps({n: metadata.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([py.python, "-c", code, *names], capture_output=True, text=True,
                         check=True, env=py.env)
    versions = json.loads(out.stdout)
    wanted = {peer: PEER_PINS[peer][0],
              **dict(pin.split("==") for pin in _same_runtime_pins())}
    wrong = {name: v for name, v in versions.items() if name in wanted and v != wanted[name]}
    if wrong:
        raise RuntimeError(f"the {peer} benchmark peer has {wrong}, the benchmark pins {wanted}")
    return versions


# -- the peers' model code (written into a temporary directory) ----------------------------

ORT_SESSION = '''
def make_session(path, threads):
    import os
    import onnxruntime as ort

    # Kiln's session settings: intra-op threads ONNX Runtime's default unless given,
    # inter-op 1, no spinning (Kiln's default), the default graph optimization level.
    # PEER_PROVIDERS=CUDAExecutionProvider: the GPU benchmark's CUDA session.
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = os.environ.get("PEER_PROVIDERS", "CPUExecutionProvider").split(",")
    if "CUDAExecutionProvider" in providers:
        ort.preload_dlls()
    session = ort.InferenceSession(path, so, providers=providers)
    assert session.get_providers()[0] == providers[0], session.get_providers()
    return session
'''

MLSERVER_MODEL = ORT_SESSION + '''
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        params = self.settings.parameters
        self._session = make_session(params.uri, int(params.extra.get("threads", 0)))
        self._outputs = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        return InferenceResponse(
            model_name=self.name, id=payload.id,
            outputs=[NumpyCodec.encode_output(n, r) for n, r in zip(self._outputs, results)])
'''

KSERVE_SERVER = ORT_SESSION + '''
import copy
import json
import logging
import os

from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve.utils.utils import from_np_dtype, generate_uuid


class OnnxModel(Model):
    def __init__(self, name, path, threads):
        super().__init__(name)
        self.path, self.threads = path, threads
        self.load()

    def load(self) -> bool:
        self._session = make_session(self.path, self.threads)
        self._outputs = [o.name for o in self._session.get_outputs()]
        self.ready = True
        return self.ready

    # ModelServer(workers > 1) pickles the model into each worker process it spawns; an ONNX
    # Runtime session does not pickle, so each worker opens its own.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_session"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.load()

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        feeds = {i.name: i.as_numpy() for i in payload.inputs}
        binary = payload.use_binary_outputs
        outputs = []
        for name, value in zip(self._outputs, self._session.run(self._outputs, feeds)):
            out = InferOutput(name=name, shape=list(value.shape), datatype=from_np_dtype(value.dtype))
            out.set_data_from_numpy(value, binary_data=binary)
            outputs.append(out)
        return InferResponse(response_id=payload.id or generate_uuid(), model_name=self.name,
                             infer_outputs=outputs, use_binary_outputs=binary,
                             requested_outputs=payload.request_outputs)


if __name__ == "__main__":
    from kserve.logging import KSERVE_LOG_CONFIG
    from kserve.model_server import args

    # No line per request (Kiln writes none): KServe's own log config with uvicorn's access
    # log at WARNING, in the file given as --log_config_file, which ModelServer applies in
    # every worker process it spawns; KSERVE_LOGLEVEL=WARNING (set by the benchmark)
    # silences the kserve.trace timing lines.
    config = copy.deepcopy(KSERVE_LOG_CONFIG)
    config["loggers"]["uvicorn.access"]["level"] = logging.getLevelName(logging.WARNING)
    with open(args.log_config_file, "w") as f:
        json.dump(config, f)
    env = os.environ
    model = OnnxModel(env["PEER_MODEL_NAME"], env["PEER_MODEL_PATH"], int(env["PEER_THREADS"]))
    server = ModelServer(http_port=int(env["PEER_HTTP_PORT"]), workers=int(env["PEER_WORKERS"]),
                         enable_grpc=False, enable_latency_logging=False)
    server.start([model])
'''


# -- start-up ------------------------------------------------------------------------------

@contextmanager
def peer_server(cfg: PeerConfig, py: PeerPython, model: Model, workdir: Path) -> Iterator[PeerServer]:
    """`cfg` up and ready (every replica), stopped on exit."""
    with ExitStack() as stack:
        if cfg.peer == "kserve":
            urls = [stack.enter_context(_kserve(cfg, py, model, workdir))]
        else:
            urls = [stack.enter_context(_mlserver(cfg, py, model, workdir))
                    for _ in range(cfg.replicas)]
        yield PeerServer(cfg.label, urls, binary=cfg.peer == "kserve")


@contextmanager
def _mlserver(cfg: PeerConfig, py: PeerPython, model: Model, workdir: Path) -> Iterator[str]:
    root = Path(tempfile.mkdtemp(prefix="mlserver-", dir=workdir))
    model_dir = root / model.name
    model_dir.mkdir()
    (model_dir / "kiln_peer_model.py").write_text(MLSERVER_MODEL)
    (model_dir / "model-settings.json").write_text(json.dumps({
        "name": model.name, "implementation": "kiln_peer_model.OnnxModel",
        "max_batch_size": MLSERVER_MAX_BATCH_SIZE if cfg.batching else 0,
        "max_batch_time": MLSERVER_MAX_BATCH_TIME if cfg.batching else 0,
        "parameters": {"uri": str(model.onnx_path), "extra": {"threads": cfg.threads}}}))
    port = _free_port()
    (root / "settings.json").write_text(json.dumps({
        "debug": False, "host": "127.0.0.1", "http_port": port, "grpc_port": _free_port(),
        "metrics_port": _free_port(), "parallel_workers": cfg.parallel_workers}))
    url = f"http://127.0.0.1:{port}"
    # mlserver's console script is `mlserver.cli:main`: called through the interpreter, it
    # runs the same from a venv and from a --target directory (which has no usable script).
    cmd = [py.python, "-c", "from mlserver.cli import main; main()", "start", str(root)]
    with started(cmd, f"{url}/v2/models/{model.name}/ready", root / "mlserver.log",
                 env=py.env, cwd=root, what="mlserver start", own_group=True):
        yield url


@contextmanager
def _kserve(cfg: PeerConfig, py: PeerPython, model: Model, workdir: Path) -> Iterator[str]:
    run_dir = Path(tempfile.mkdtemp(prefix="kserve-", dir=workdir))
    script = run_dir / "kiln_peer_kserve.py"
    script.write_text(KSERVE_SERVER)
    port = _free_port()
    env = {**py.env, "PEER_MODEL_NAME": model.name, "PEER_MODEL_PATH": str(model.onnx_path),
           "PEER_THREADS": str(cfg.threads), "PEER_HTTP_PORT": str(port),
           "PEER_WORKERS": str(cfg.workers), "KSERVE_LOGLEVEL": "WARNING"}
    url = f"http://127.0.0.1:{port}"
    cmd = [py.python, str(script), "--log_config_file", str(run_dir / "log-config.json")]
    log = run_dir / "kserve.log"
    with started(cmd, f"{url}/v2/models/{model.name}/ready", log, env=env, cwd=run_dir,
                 what="kserve ModelServer", own_group=True):
        # Ready answers once the first worker is up: wait for all of them.
        _wait_for_lines(log, "Application startup complete", cfg.workers)
        yield url


def _wait_for_lines(log: Path, text: str, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} x {text!r} not in {log} after {timeout:.0f} s:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)

