"""The distribution's shape as a user meets it: one `kiln` command, no shadowed modules."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KILN = Path(sys.executable).with_name("kiln")


def test_kiln_lists_every_subcommand():
    out = subprocess.run([KILN, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("operator", "build", "serve", "dev", "rollout"):
        assert f"    {command} " in out


def test_repository_root_shadows_neither_stdlib_operator_nor_kiln():
    # From the root, '' is first on sys.path: `operator/` must not replace the standard
    # library's module, and no folder there may hide the installed `kiln` package.
    code = "import operator, kiln.operator, kiln.runtime; print(operator.__file__); print(operator.add(2, 3))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    assert "site-packages" not in out[0] and out[0].endswith("/operator.py")
    assert not out[0].startswith(str(REPO))
    assert out[1] == "5"


# ------------------------------------------------------------------------ import rules

import ast  # noqa: E402

# What the operator may import of the runtime half: its room of shared contracts, nothing that serves.
OPERATOR_MAY_IMPORT = "kiln.runtime.api"
# The step modules and the reconcile: every function short enough to read on one screen.
STEP_MODULES = ("reconcile", "steps", "engines", "scaling", "rollout", "serving")


def _named(node: ast.AST) -> set[str]:
    """The modules one import statement names (`from kiln.runtime.api import spec` names
    kiln.runtime.api and kiln.runtime.api.spec); nothing for other nodes."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return set()


def _imports(path: Path) -> set[str]:
    """Every module a file imports, wherever the statement is."""
    return set().union(*map(_named, ast.walk(ast.parse(path.read_text()))))


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings}


def test_the_operator_imports_nothing_of_the_serving_code():
    for path in sorted((REPO / "operator").glob("*.py")):
        runtime = {m for m in _imports(path) if m.startswith("kiln.runtime.")}
        outside = {m for m in runtime if m != OPERATOR_MAY_IMPORT and not m.startswith(OPERATOR_MAY_IMPORT + ".")}
        assert not outside, f"{path.name} imports {sorted(outside)}"


# Import name -> distribution, for the packages whose names differ.
DISTRIBUTIONS = {"yaml": "pyyaml", "prometheus_client": "prometheus-client", "celpy": "cel-python"}


def test_the_operator_image_installs_what_the_operator_imports():
    """`pip install .[operator]` (the operator image) must bring every third-party module
    the operator's code imports (found missing once: prometheus-client)."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower()
              for d in project["dependencies"] + project["optional-dependencies"]["operator"]}
    for path in sorted((REPO / "operator").glob("*.py")):
        top = {m.split(".")[0] for m in _imports(path)} - {"kiln"} - set(sys.stdlib_module_names)
        missing = {DISTRIBUTIONS.get(m, m) for m in top} - wanted
        assert not missing, f"{path.name} imports {sorted(missing)}, not in the operator extra"


def test_the_runtime_never_imports_the_operator():
    for path in sorted((REPO / "runtime").rglob("*.py")):
        assert not {m for m in _imports(path) if m.startswith("kiln.operator")}, path


def test_the_contract_stands_alone():
    stdlib = {"__future__", "json", "typing"}
    assert {m.split(".")[0] for m in _imports(REPO / "runtime" / "api" / "contract.py")} <= stdlib


def test_shared_names_live_only_in_the_contract():
    import importlib

    contract = importlib.import_module("kiln.runtime.api.contract")
    shared = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str) and "/" in v or
              k in ("ENGINE_INDEX", "KIND")}
    for path in sorted([*(REPO / "operator").glob("*.py"), *(REPO / "runtime").rglob("*.py")]):
        if path.name == "contract.py":
            continue
        restated = _string_constants(path) & shared
        assert not restated, f"{path.relative_to(REPO)} restates {sorted(restated)}: import kiln.runtime.api.contract"


def test_reconcile_and_step_functions_fit_on_one_screen():
    for name in STEP_MODULES:
        tree = ast.parse((REPO / "operator" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 50, f"operator/{name}.py:{node.name} is {length} lines"


# ------------------------------------------------------------------------ extras

import json  # noqa: E402

import pytest  # noqa: E402

# Runs `kiln ARGS` with the modules named in argv[1] (comma-separated) unimportable, exactly
# as when their package is not installed (None in sys.modules makes `import` raise
# ModuleNotFoundError); "*" leaves only the base install: the standard library, PyYAML, numpy.
WITHOUT = """
import importlib.abc, sys
blocked = sys.argv[1]
class BaseInstallOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top not in ("kiln", "yaml", "numpy", "_yaml"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
if blocked == "*":
    sys.meta_path.insert(0, BaseInstallOnly())
else:
    for name in blocked.split(","):
        sys.modules[name] = None
from kiln.cli import main
sys.exit(main(sys.argv[2:]))
"""


def kiln_without(modules: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, *args], capture_output=True,
                          text=True, cwd=cwd, timeout=60)


def manifest(tmp: Path) -> Path:
    (tmp / "m.onnx").write_bytes(b"not read: the command stops before")
    path = tmp / "m.yaml"
    path.write_text("apiVersion: kiln.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: m}\n"
                    "spec:\n  model: {uri: 'file://./m.onnx', version: '1'}\n"
                    "  engine: {backend: onnxruntime, precision: fp32, targets: [cpu]}\n")
    return path


BUILD_REQUEST = json.dumps({"namespace": "ml", "name": "m", "model": {"uri": "pvc://models/m.onnx", "version": "1"},
                            "engine": {"backend": "onnxruntime", "precision": "fp32"}, "target": "cpu"})

# (command line, a module of its extra to take away, the extra, the exit code)
EXTRA_CASES = [
    (["dev", "m.yaml"], "jsonschema", "runtime", 2),
    (["dev", "m.yaml"], "celpy", "runtime", 2),
    (["serve", "--model-name", "m", "--engine", "cpu=ml/m/0123", "--port", "0"], "aiohttp", "runtime", 2),
    (["serve", "--model-name", "m", "--engine", "cpu=ml/m/0123", "--port", "0"], "prometheus_client", "runtime", 2),
    (["serve", "--model-name", "m", "--engine", "cpu=ml/m/0123", "--port", "0"], "grpc", "runtime", 2),
    (["build", "--request", BUILD_REQUEST, "--pvc-root", ".", "--cache-dir", "cache",
      "--termination-log", "term"], "onnxruntime", "runtime", 6),
    (["operator", "--standalone"], "kopf", "operator", 2),
    (["rollout", "status", "m"], "kubernetes", "operator", 2),
]


@pytest.mark.parametrize("argv, module, extra, code", EXTRA_CASES, ids=lambda c: c if isinstance(c, str) else None)
def test_a_command_without_its_extra_names_the_extra(tmp_path, argv, module, extra, code):
    manifest(tmp_path)
    proc = kiln_without(module, *argv, cwd=tmp_path)
    line = f"kiln {argv[0]} needs the {extra} extra: pip install 'kiln-operator[{extra}]' (missing module {module})"
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and line in proc.stderr, proc.stderr
    if argv[0] == "build":  # the build Job's contract: the reason is in the termination message
        assert json.loads((tmp_path / "term").read_text()) == {"ok": False, "reason": "Unsupported", "message": line}
    else:
        assert proc.stderr == line + "\n"


@pytest.mark.parametrize("argv, module, extra, code", EXTRA_CASES, ids=lambda c: c if isinstance(c, str) else None)
def test_the_base_install_alone_names_the_extra_too(tmp_path, argv, module, extra, code):
    # `pip install kiln-operator`: every module of every extra is missing at once.
    manifest(tmp_path)
    proc = kiln_without("*", *argv, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"kiln {argv[0]} needs the {extra} extra: pip install 'kiln-operator[{extra}]' (missing module " \
        in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in ("operator", "build", "serve", "dev", "rollout"))],
                         ids=" ".join)
def test_help_works_with_the_base_install(tmp_path, argv):
    proc = kiln_without("*", *argv, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith(f"usage: kiln {' '.join(argv[:-1])}".rstrip())


# ------------------------------------------------------------------------ the runtime's rooms

RUNTIME = REPO / "runtime"
# Who may import whom, by room: a room imports only the rooms listed for it (and itself).
ROOMS_MAY_IMPORT = {
    "api": set(),
    "engine": {"api"},
    "serving": {"api", "engine"},
    "commands": {"api", "engine", "serving"},
}
# The largest a runtime file may grow (generated stubs aside): past it, split along its rulers.
MAX_RUNTIME_FILE_LINES = 425


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return "kiln." + ".".join(parts)


def _runtime_files() -> list[Path]:
    return sorted(p for p in RUNTIME.rglob("*.py") if not p.name.endswith("_pb2.py"))


def _top_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported: module-level statements only, not
    those under `if TYPE_CHECKING:` or inside functions (imported when they run)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found |= set().union(*map(_named, ast.walk(node)))
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kiln", "runtime"] else None


def test_each_room_imports_only_the_rooms_below_it():
    for path in _runtime_files():
        room = _room(_module_of(path))
        if room is None:
            continue
        used = {_room(m) for m in _imports(path)} - {None, room}
        assert used <= ROOMS_MAY_IMPORT[room], f"{path.relative_to(REPO)} ({room}/) imports {sorted(used)}"


def test_transports_never_import_each_other():
    for mine, theirs in (("rest", "grpc"), ("grpc", "rest")):
        for path in sorted((RUNTIME / "serving" / mine).rglob("*.py")):
            bad = {m for m in _imports(path) if m.startswith(f"kiln.runtime.serving.{theirs}")}
            assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_the_dataplane_and_sequences_know_no_transport():
    transport = ("aiohttp", "grpc", "google.protobuf", "kiln.runtime.serving.rest",
                 "kiln.runtime.serving.grpc")
    paths = [RUNTIME / "serving" / "dataplane.py", RUNTIME / "serving" / "refusals.py",
             *sorted((RUNTIME / "serving" / "sequences").rglob("*.py"))]
    for path in paths:
        bad = {m for m in _imports(path) if m.startswith(transport)}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_no_runtime_file_outgrows_one_concern():
    for path in _runtime_files():
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_RUNTIME_FILE_LINES, f"{path.relative_to(REPO)} has {lines} lines"


def test_no_import_circles_in_the_runtime():
    modules = {_module_of(p): p for p in _runtime_files()}
    graph = {m: {i for i in _top_level_imports(p) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for child in sorted(graph[module]):
            assert state.get(child) != "open", "import circle: " + " -> ".join([*trail, module, child])
            if child not in state:
                visit(child, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
