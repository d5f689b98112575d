"""Type-check the tensorrt backend's runtime half against stubs of TensorRT's real bindings.

The lean runtime bindings (`tensorrt_lean_bindings`, from PyPI) import without a GPU, so
pybind11-stubgen can generate stubs from them; mypy then checks every call the backend
makes on Runtime, ICudaEngine, IExecutionContext and ILogger (names, arguments, return
types). The builder half is Any by design (see the backend's docstring). A negative
control proves the check can fail: wrong calls, in a tiny module and in a mutated copy of
the backend itself, must be rejected.
"""

import ast
import keyword
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorrt_lean_bindings",
                    reason="needs tensorrt-lean-cu13-bindings (requirements-test.txt)")
pytest.importorskip("mypy", reason="needs mypy (requirements-test.txt)")

REPO = Path(__file__).resolve().parents[2]
BACKEND = REPO / "runtime" / "engine" / "backends" / "tensorrt.py"
STUBGEN = Path(sys.executable).parent / "pybind11-stubgen"

MYPY_CONFIG = """\
[mypy]
check_untyped_defs = True
# kiln.* and numpy are followed for their types, their own errors are not this test's.
follow_imports = silent

# Imported lazily by the backend and absent in CI (or without stubs): Any.
[mypy-tensorrt,tensorrt.*,pycuda,pycuda.*,tensorrt_lean_libs,tensorrt_lean_libs.*]
ignore_missing_imports = True

# The generated stubs carry pybind11's quirks (overloads mypy calls unreachable, C++
# names): use their types, do not lint them.
[mypy-tensorrt_lean_bindings,tensorrt_lean_bindings.*]
ignore_errors = True
"""


def _fix_stub(text: str) -> str:
    # Plugin methods name a parameter `in`, which is no valid Python identifier.
    text = re.sub(r"([(,]\s*)(%s)(?=\s*:)" % "|".join(keyword.kwlist), r"\1\2_", text)
    # The module defines `bool: DataType` (trt.bool), which would shadow the builtin in
    # every `-> bool` annotation and turn those into errors mypy treats as Any.
    text = re.sub(r"(?<![\w.'\"])bool\b(?!\s*:\s*(tensorrt_lean\.)?DataType)", "builtins.bool",
                  text)
    return text.replace("from __future__ import annotations\n",
                        "from __future__ import annotations\nimport builtins\n", 1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if not STUBGEN.exists():
        pytest.skip(f"needs pybind11-stubgen next to {sys.executable} (requirements-test.txt)")
    root = tmp_path_factory.mktemp("trt-types")
    stubs = root / "stubs"
    # --exit-code: any error not explicitly ignored below fails generation, so a new
    # binding quirk is seen rather than silently becoming `...`.
    # --ignore-invalid-expressions: pybind11 leaks raw C++ types (nvinfer1::..., detail::...)
    # into docstrings of members the backend does not use; they become `...`.
    # --enum-class-locations: default values print as `<DataType.FLOAT: 0>`; say where the
    # enum classes live so the defaults resolve.
    proc = subprocess.run(
        [str(STUBGEN), "tensorrt_lean_bindings", "-o", str(stubs), "--exit-code",
         "--ignore-invalid-expressions", r"(nvinfer1|detail)::",
         "--enum-class-locations",
         "DataType|PluginFieldType|ExecutionContextAllocationStrategy|EngineStat"
         ":tensorrt_lean_bindings.tensorrt_lean",
         "--enum-class-locations", "Severity:tensorrt_lean_bindings.tensorrt_lean.ILogger"],
        capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for stub in (stubs / "tensorrt_lean_bindings").glob("*.pyi"):
        fixed = _fix_stub(stub.read_text())
        ast.parse(fixed, str(stub))
        stub.write_text(fixed)
    # The backend is `kiln.runtime.engine.backends.tensorrt`, mapped from runtime/ by pyproject's
    # package-dir, which mypy does not read: rebuild that layout for it.
    src = root / "src"
    (src / "kiln").mkdir(parents=True)
    (src / "kiln" / "__init__.py").write_text("")
    (src / "kiln" / "runtime").symlink_to(REPO / "runtime", target_is_directory=True)
    (root / "mypy.ini").write_text(MYPY_CONFIG)
    return root


def _mypy(workdir: Path, *targets: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MYPYPATH": os.pathsep.join([str(workdir / "stubs"),
                                                     str(workdir / "src")])}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(workdir / "mypy.ini"),
         "--cache-dir", str(workdir / ".mypy_cache"), "--no-error-summary", *targets],
        capture_output=True, text=True, timeout=120, cwd=workdir, env=env)


def test_runtime_half_type_checks_against_the_lean_bindings(workdir):
    proc = _mypy(workdir, "-m", "kiln.runtime.engine.backends.tensorrt")
    assert proc.returncode == 0, f"mypy:\n{proc.stdout}{proc.stderr}"


# (what the backend says, a wrong version of it, what mypy must answer)
MUTATIONS = [
    ("ctx.execute_async_v3(", "ctx.execute_async_v2(",
     '"IExecutionContext" has no attribute "execute_async_v2"'),
    ("io_mode.INPUT", "io_mode.INPUTS", '"type[TensorIOMode]" has no attribute "INPUTS"'),
    ("runtime_class(logger)", "runtime_class()", 'Missing positional argument "logger"'),
    ("cuda_engine.create_execution_context()", "cuda_engine.create_execution_context(1.5)",
     'No overload variant of "create_execution_context"'),
]

TINY = """\
from __future__ import annotations
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import tensorrt_lean_bindings as trt_types

def shapes(ctx: trt_types.IExecutionContext, engine: trt_types.ICudaEngine) -> None:
    ctx.set_input_shape(1, 2)
    engine.no_such_method()
"""


def test_mypy_rejects_wrong_runtime_calls(workdir, tmp_path):
    source = BACKEND.read_text()
    for right, wrong, _ in MUTATIONS:
        assert source.count(right) == 1, f"the backend no longer says {right!r}: update MUTATIONS"
        source = source.replace(right, wrong)
    (tmp_path / "mutated_tensorrt.py").write_text(source)
    (tmp_path / "tiny.py").write_text(TINY)
    proc = _mypy(workdir, str(tmp_path / "mutated_tensorrt.py"), str(tmp_path / "tiny.py"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    expected = [message for _, _, message in MUTATIONS] + [
        'No overload variant of "set_input_shape" of "IExecutionContext" matches argument '
        'types "int", "int"',
        '"ICudaEngine" has no attribute "no_such_method"',
    ]
    missing = [message for message in expected if message not in out]
    assert not missing, f"mypy did not report {missing}:\n{out}"
