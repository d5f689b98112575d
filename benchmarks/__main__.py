"""`make bench`: run every benchmark and write docs/benchmarks.md.

Each module `benchmarks/<name>.py` has `run(quick: bool) -> str` returning a markdown
section. Figures are ratios against a baseline measured in the same run, so they mean
something on any machine; the absolute numbers are for this machine only.

    python -m benchmarks [--quick] [--only NAME ...] [--output docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pkgutil
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for iterating")
    p.add_argument("--only", nargs="*", default=None, help="benchmark module names")
    p.add_argument("--output", default=str(HERE.parent / "docs" / "benchmarks.md"))
    args = p.parse_args(argv)

    names = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if not m.name.startswith("_"))
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            p.error(f"unknown benchmark(s) {sorted(unknown)}; available: {names}")
        names = [n for n in names if n in args.only]

    sections: list[str] = []
    kept: list[str] = []  # benchmarks that did not run: their recorded sections stay
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        started = time.monotonic()
        section = importlib.import_module(f"benchmarks.{name}").run(args.quick)
        if section is None:  # not runnable here (a GPU benchmark on a CPU machine)
            kept.append(name)
        else:
            sections.append(section.strip())
        print(f"   done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    header = (
        "# Benchmarks\n\n"
        f"Written by `make bench`{' --quick' if args.quick else ''} on "
        f"{datetime.date.today().isoformat()}: {machine()}.\n"
        "Each target is judged by a ratio against a baseline measured in the same run.\n"
    )
    output = Path(args.output)
    if (args.only or kept) and output.exists():  # replace just these sections, keep the others
        sections = _merge(output.read_text(), sections)
    output.write_text(header + "\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _merge(existing: str, new: list[str]) -> list[str]:
    """The sections of `existing` (split at `## ` headings) with those of `new` in place of
    the ones that have the same heading; new headings are appended."""
    old = ["## " + part.strip() for part in existing.split("\n## ")[1:]]
    fresh = {section.splitlines()[0]: section for section in new}
    merged = [fresh.pop(section.splitlines()[0], section) for section in old]
    return merged + list(fresh.values())


if __name__ == "__main__":
    sys.exit(main())
