"""`make bench` (`python -m benchmarks`, see __main__.py)."""

import sys
from pathlib import Path

# The one insert of tests/ on sys.path, for what the benchmarks share with the tests
# (tests/support/: localcluster, monitoring, kubeemu, sequence_models): they import it as
# `support.*`, exactly as the tests do, where pytest's `pythonpath` (pyproject.toml) puts it.
_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
