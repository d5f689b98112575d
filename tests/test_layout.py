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

# What the operator may import of the runtime half: the shared contracts, nothing that serves.
OPERATOR_MAY_IMPORT = {"kiln.runtime.contract", "kiln.runtime.spec", "kiln.runtime.enginekey", "kiln.runtime.errors"}
# The step modules and the reconcile: every function short enough to read on one screen.
STEP_MODULES = ("reconcile", "steps", "engines", "scaling", "rollout", "serving")


def _imports(path: Path) -> set[str]:
    """Every module a file imports (`from kiln.runtime import spec` counts as kiln.runtime.spec)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings}


def test_the_operator_imports_nothing_of_the_serving_code():
    for path in sorted((REPO / "operator").glob("*.py")):
        runtime = {m for m in _imports(path) if m.startswith("kiln.runtime.")}
        # `from kiln.runtime import contract` names the module; `from kiln.runtime.contract import X` its members.
        modules = {m if m in OPERATOR_MAY_IMPORT or m.count(".") == 2 else m.rsplit(".", 1)[0] for m in runtime}
        assert modules <= OPERATOR_MAY_IMPORT, f"{path.name} imports {sorted(modules - OPERATOR_MAY_IMPORT)}"


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
    assert {m.split(".")[0] for m in _imports(REPO / "runtime" / "contract.py")} <= stdlib


def test_shared_names_live_only_in_the_contract():
    import importlib

    contract = importlib.import_module("kiln.runtime.contract")
    shared = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str) and "/" in v or
              k in ("ENGINE_INDEX", "KIND")}
    for path in sorted([*(REPO / "operator").glob("*.py"), *(REPO / "runtime").glob("*.py")]):
        if path.name == "contract.py":
            continue
        restated = _string_constants(path) & shared
        assert not restated, f"{path.relative_to(REPO)} restates {sorted(restated)}: import kiln.runtime.contract"


def test_reconcile_and_step_functions_fit_on_one_screen():
    for name in STEP_MODULES:
        tree = ast.parse((REPO / "operator" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 50, f"operator/{name}.py:{node.name} is {length} lines"
