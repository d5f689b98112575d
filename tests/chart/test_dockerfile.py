"""The Dockerfile cannot be built in CI (no Docker engine); check what a reviewer would.

Two targets, the bases the design names, non-root users, the entrypoints the chart and
the operator rely on, and a build context without the virtualenv or the tests.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stages() -> dict[str, list[str]]:
    """Dockerfile instructions per stage name (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM (\S+) AS (\w+)$", line)
        if m:
            current = m.group(2)
            base = re.sub(r"\$\{(\w+)\}", lambda a: args[a.group(1)], m.group(1))
            out[current] = [f"FROM {base}"]
        elif current:
            out[current].append(line)
    return out


def test_two_targets_on_the_expected_bases():
    s = stages()
    assert list(s) == ["operator", "runtime"]
    assert s["operator"][0] == "FROM python:3.11-slim"
    assert re.fullmatch(r"FROM nvcr\.io/nvidia/tensorrt:25\.\d\d-py3", s["runtime"][0])


def test_each_target_installs_its_extras_and_runs_kiln_as_non_root():
    s = stages()
    for name, extras, entry in (("operator", "operator", '["kiln", "operator"]'),
                                ("runtime", "gpu", '["kiln"]')):
        lines = s[name]
        assert any(f'"/src[{extras}]"' in ln and "pip install" in ln for ln in lines), name
        users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("0", "root"), name
        assert lines.index(next(ln for ln in lines if ln.startswith("USER "))) > max(
            i for i, ln in enumerate(lines) if ln.startswith("RUN ")), f"{name}: RUN after USER"
        assert f"ENTRYPOINT {entry}" in lines, name
    assert 'CMD ["serve"]' in s["runtime"]


def test_build_context_leaves_out_local_state_and_tests():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools", "tests", "**/__pycache__"} <= ignored
    assert not {"cli", "operator", "runtime", "crds", "pyproject.toml", "README.md"} & ignored
