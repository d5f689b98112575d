"""The distribution's shape as a user meets it: one `kiln` command, no shadowed modules."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KILN = Path(sys.executable).with_name("kiln")


def test_kiln_lists_every_subcommand():
    out = subprocess.run([KILN, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("operator", "build", "serve", "dev"):
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
