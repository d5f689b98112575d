"""The CPU a pod may use and has used, read from its cgroup and /proc.

On CPU engines the engine's busy fraction misses where a pod really saturates (front ends
parsing HTTP, the quota), so the autoscaling signal also reads these (`PodCpu`, exported
by metrics.PodCpuCollector). The files are the kernel's, but a container may see them
half-mounted, absent or odd: every read here returns None on anything unexpected, never
raises.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Iterable

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
_MAX_TEXT = 64 * 1024  # cgroup and stat files are a few hundred bytes; never read more


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_TEXT).decode("ascii")
    except (OSError, ValueError):
        return None


def own_cgroup(proc: Path = PROC, root: Path = CGROUP_ROOT) -> Path | None:
    """The cgroup v2 directory of this process (`0::<path>` in /proc/self/cgroup, under the
    mount), None without cgroup v2 or when the path leaves the mount."""
    text = _read(proc / "self" / "cgroup")
    for line in (text or "").splitlines():
        if line.startswith("0::/"):
            relative = line[4:].strip()
            if ".." in relative.split("/"):
                return None
            directory = root / relative if relative else root
            return directory if directory.is_dir() else None
    return None


def cgroup_cpu_limit(cgroup: Path | None) -> float | None:
    """cpu.max's quota over its period in cores; None for `max` or anything unreadable."""
    text = _read(cgroup / "cpu.max") if cgroup is not None else None
    try:
        quota, period = (text or "").split()[:2]
        if quota == "max":
            return None
        cores = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return cores if math.isfinite(cores) and cores > 0 else None


def cpu_limit(cgroup: Path | None = None) -> float | None:
    """The CPUs this process may use: the lower of its cgroup's quota (a pod's CPU limit)
    and its affinity mask (taskset, a CPU manager's exclusive cores), each when set; None
    when neither can be read."""
    limits = [c for c in (cgroup_cpu_limit(cgroup or own_cgroup()),) if c is not None]
    try:
        limits.append(float(len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        pass
    return min(limits) if limits else None


def cgroup_usage_seconds(cgroup: Path | None) -> float | None:
    """cpu.stat's `usage_usec` (every process of the cgroup, since it was made) in seconds."""
    text = _read(cgroup / "cpu.stat") if cgroup is not None else None
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            try:
                usec = int(value.strip())
            except ValueError:
                return None
            return usec / 1e6 if usec >= 0 else None
    return None


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(text: str | None) -> list[str] | None:
    """A /proc stat line's fields after the command (which may hold spaces and parentheses):
    [state, ppid, ...], or None."""
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields if len(fields) >= 15 else None


def _seconds(fields: list[str], children: bool) -> float | None:
    """utime + stime (+ cutime + cstime: its reaped children's) in seconds."""
    try:
        ticks = [int(f) for f in fields[11:15 if children else 13]]
    except ValueError:
        return None
    return sum(ticks) / _TICKS if all(t >= 0 for t in ticks) else None


def thread_seconds(pid: int, tid: int, proc: Path = PROC) -> float | None:
    """CPU seconds one thread has used."""
    fields = stat_fields(_read(proc / str(pid) / "task" / str(tid) / "stat"))
    return _seconds(fields, children=False) if fields else None


def tree_seconds(pid: int, proc: Path = PROC) -> float | None:
    """CPU seconds of `pid` and every process under it, with the children they have reaped
    (a front end that exited is in its parent's count): the container's, when `pid` is its
    first process."""
    parents: dict[int, list[int]] = {}
    own: dict[int, float] = {}
    try:
        entries = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return None
    for name in entries:
        fields = stat_fields(_read(proc / name / "stat"))
        seconds = _seconds(fields, children=True) if fields else None
        if fields is None or seconds is None or not fields[1].lstrip("-").isdigit():
            continue
        own[int(name)] = seconds
        parents.setdefault(int(fields[1]), []).append(int(name))
    if pid not in own:
        return None
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += own.get(p, 0.0)
        todo.extend(parents.get(p, ()))
    return total


class Monotonic:
    """A sum over parts that come and go (a front end restarted is a new thread) as a counter
    that never goes down: a part keeps its last reading while it cannot be read, and once it
    is gone."""

    def __init__(self) -> None:
        self._last: dict[object, float] = {}
        self._gone = 0.0

    def total(self, parts: Iterable[object], readings: dict[object, float]) -> float:
        parts = set(parts)
        for key in set(self._last) - parts:
            self._gone += self._last.pop(key)
        for key, value in readings.items():
            if key in parts:
                self._last[key] = max(value, self._last.get(key, 0.0))
        return self._gone + sum(self._last.values())


class PodCpu:
    """What the pod's first process exports: CPU used by the pod (its cgroup v2's `usage_usec`
    where readable, else its process tree from /proc, whichever read first; fixed after
    that, so a counter never switches source), its CPU limit in cores, and the CPU seconds
    of the event loops that serve HTTP (the front ends'; the one process's loop when there
    are none), over their number."""

    def __init__(self, limit: float | None, loops: Callable[[], Iterable[tuple[int, int]]],
                 loop_count: int, pid: int | None = None, proc: Path = PROC,
                 cgroup: Path | None = None):
        self.limit = limit if limit is not None and math.isfinite(limit) and limit > 0 else None
        self._loops, self._loop_count = loops, max(1, loop_count)
        self._pid, self._proc = pid or os.getpid(), proc
        self._cgroup = own_cgroup(proc) if cgroup is None else cgroup  # a path not there: none
        self._source: str | None = None
        self._usage_high = 0.0
        self._loop_sum = Monotonic()

    def usage_seconds(self) -> float | None:
        value = None
        if self._source in (None, "cgroup"):
            value = cgroup_usage_seconds(self._cgroup)
            if value is not None:
                self._source = "cgroup"
        if self._source in (None, "proc"):
            value = tree_seconds(self._pid, self._proc)
            if value is not None:
                self._source = "proc"
        if value is None:
            return None
        self._usage_high = max(self._usage_high, value)
        return self._usage_high

    def loop_seconds(self) -> float | None:
        """The loops' CPU seconds over their number: its rate is their mean busy fraction."""
        parts = list(self._loops())
        readings = {}
        for pid, tid in parts:
            seconds = thread_seconds(pid, tid, self._proc)
            if seconds is not None:
                readings[(pid, tid)] = seconds
        total = self._loop_sum.total(parts, readings)
        return total / self._loop_count if readings or total else None
