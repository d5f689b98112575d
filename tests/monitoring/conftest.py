"""tests/ on sys.path, so the tests import the harness as `monitoring` (and it imports
`localcluster`) exactly as benchmarks do."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
