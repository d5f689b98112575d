"""The pod's CPU signals (runtime/serving/cpu.py, metrics.PodCpuCollector): cgroup and /proc
files the tests write, hostile ones too (a real `kiln serve` showing them on /metrics:
tests/runtime/test_frontend.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kiln.runtime.serving import cpu
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.workers.engines import merge_metrics

TICKS = os.sysconf("SC_CLK_TCK")


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    return f"{pid} ({comm}) S {ppid} 1 1 0 -1 4194560 10 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 1 0 5 0 0\n"


# ------------------------------------------------------------------------ cgroup files

@pytest.mark.parametrize("content, seconds", [
    ("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n", 2.5),
    ("user_usec 1\nusage_usec 0\n", 0.0),
    ("usage_usec -5\n", None),
    ("usage_usec abc\n", None),
    ("usage_usec\n", None),
    ("user_usec 10\nsystem_usec 10\n", None),  # no usage_usec at all
    ("", None),
    (b"\xff\xfe\x00usage_usec 1\n", None),  # not text
    ("x" * 200_000, None),  # far longer than any cpu.stat
])
def test_cpu_stat_usage_is_read_or_nothing(tmp_path, content, seconds):
    write(tmp_path / "cpu.stat", content)
    assert cpu.cgroup_usage_seconds(tmp_path) == seconds


def test_no_cgroup_or_no_cpu_stat_reads_nothing(tmp_path):
    assert cpu.cgroup_usage_seconds(None) is None
    assert cpu.cgroup_usage_seconds(tmp_path) is None
    (tmp_path / "cpu.stat").mkdir()  # a directory where the file should be
    assert cpu.cgroup_usage_seconds(tmp_path) is None


@pytest.mark.parametrize("content, cores", [
    ("200000 100000\n", 2.0),
    ("50000 100000", 0.5),
    ("max 100000\n", None),
    ("0 100000\n", None),
    ("-1 100000\n", None),
    ("100000 0\n", None),
    ("100000\n", None),
    ("two 100000\n", None),
    ("1e400 1\n", None),
    ("", None),
])
def test_cpu_max_is_read_or_nothing(tmp_path, content, cores):
    write(tmp_path / "cpu.max", content)
    assert cpu.cgroup_cpu_limit(tmp_path) == cores


def test_the_limit_is_the_lower_of_quota_and_affinity(tmp_path):
    affinity = float(len(os.sched_getaffinity(0)))
    write(tmp_path / "cpu.max", "50000 100000\n")
    assert cpu.cpu_limit(tmp_path) == min(0.5, affinity)
    write(tmp_path / "cpu.max", "max 100000\n")
    assert cpu.cpu_limit(tmp_path) == affinity


def test_the_own_cgroup_is_the_v2_line_of_proc_self_cgroup(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (root / "kubepods" / "pod1").mkdir(parents=True)
    write(proc / "self" / "cgroup", "12:cpu,cpuacct:/kubepods\n0::/kubepods/pod1\n")
    assert cpu.own_cgroup(proc, root) == root / "kubepods" / "pod1"
    write(proc / "self" / "cgroup", "0::/\n")
    assert cpu.own_cgroup(proc, root) == root
    for hostile in ("0::/../../etc\n", "0::/not/there\n", "4:memory:/x\n", "0::\n", "", "\x00\x01"):
        write(proc / "self" / "cgroup", hostile)
        assert cpu.own_cgroup(proc, root) is None, hostile
    assert cpu.own_cgroup(tmp_path / "no-proc", root) is None


# ------------------------------------------------------------------------ /proc

def test_a_process_tree_counts_itself_its_children_and_what_they_reaped(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "10" / "stat", stat_line(10, "kiln serve (engine)", 1, 100, 50, cutime=30, cstime=20))
    write(proc / "11" / "stat", stat_line(11, "front) end", 10, 200, 0))
    write(proc / "12" / "stat", stat_line(12, "grandchild", 11, 10, 10))
    write(proc / "13" / "stat", stat_line(13, "someone else", 1, 9999, 9999))
    write(proc / "14" / "stat", "14 (truncated) S 10 1")  # a line cut short: skipped
    write(proc / "15" / "stat", stat_line(15, "negative", 10, -5, 0))
    write(proc / "16" / "stat", b"\xff garbage")
    write(proc / "self" / "stat", "not a pid dir")
    assert cpu.tree_seconds(10, proc) == pytest.approx((100 + 50 + 30 + 20 + 200 + 10 + 10) / TICKS)
    assert cpu.tree_seconds(99, proc) is None  # not there
    assert cpu.tree_seconds(10, tmp_path / "none") is None


def test_a_cycle_in_parents_does_not_loop(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "20" / "stat", stat_line(20, "a", 21, 1, 0))
    write(proc / "21" / "stat", stat_line(21, "b", 20, 1, 0))
    assert cpu.tree_seconds(20, proc) == pytest.approx(2 / TICKS)


def test_a_thread_reads_its_own_time(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "10" / "task" / "10" / "stat", stat_line(10, "loop", 1, 40, 10, cutime=1000))
    assert cpu.thread_seconds(10, 10, proc) == pytest.approx(50 / TICKS)  # not its children's
    assert cpu.thread_seconds(10, 11, proc) is None
    # this very thread, for real
    assert cpu.thread_seconds(os.getpid(), os.getpid()) >= 0


def test_loop_time_never_goes_down_as_front_ends_restart_or_hide(tmp_path):
    proc = tmp_path / "proc"
    loops = [(10, 10), (11, 11)]
    pod = cpu.PodCpu(2.0, lambda: loops, 2, pid=1, proc=proc, cgroup=tmp_path / "no-cgroup")
    assert pod.loop_seconds() is None  # nothing readable yet: nothing exported
    write(proc / "10" / "task" / "10" / "stat", stat_line(10, "fe0", 1, TICKS * 4, 0))
    write(proc / "11" / "task" / "11" / "stat", stat_line(11, "fe1", 1, TICKS * 2, 0))
    assert pod.loop_seconds() == 3.0  # (4 + 2) / 2 front ends
    (proc / "11" / "task" / "11" / "stat").unlink()  # front end 1 died: its time still counts
    assert pod.loop_seconds() == 3.0
    loops[1] = (12, 12)  # ...and was started again, from zero
    write(proc / "12" / "task" / "12" / "stat", stat_line(12, "fe1", 1, TICKS * 2, 0))
    assert pod.loop_seconds() == 4.0


def test_pod_usage_keeps_the_source_it_first_read(tmp_path):
    proc, group = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "10" / "stat", stat_line(10, "kiln", 1, TICKS * 7, 0))
    pod = cpu.PodCpu(None, lambda: [], 1, pid=10, proc=proc, cgroup=group)
    assert pod.limit is None
    assert pod.usage_seconds() == 7.0  # no cgroup: the process tree
    write(group / "cpu.stat", "usage_usec 100000000\n")
    assert pod.usage_seconds() == 7.0  # a cgroup that appears later does not switch the counter
    pod = cpu.PodCpu(float("nan"), lambda: [], 1, pid=10, proc=proc, cgroup=group)
    assert pod.limit is None and pod.usage_seconds() == 100.0
    write(group / "cpu.stat", "usage_usec 50000000\n")  # went down: the counter does not
    assert pod.usage_seconds() == 100.0
    write(group / "cpu.stat", "garbage")
    assert pod.usage_seconds() is None  # unreadable: left out, not 0


# ------------------------------------------------------------------------ /metrics

def test_an_engine_that_watches_nothing_exports_the_names_and_no_samples():
    text = generate_latest(ServerMetrics().registry).decode()
    for name in ("kiln_pod_cpu_seconds_total", "kiln_pod_cpu_limit_cores", "kiln_pod_front_end_busy_seconds_total"):
        assert name.removesuffix("_total") in text and f"\n{name} " not in text


def test_engine_processes_do_not_add_up_the_pods_cpu(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "10" / "stat", stat_line(10, "kiln", 1, TICKS * 3, 0))
    first, second = ServerMetrics(), ServerMetrics()
    first.pod_cpu.watch(cpu.PodCpu(4.0, lambda: [], 1, pid=10, proc=proc, cgroup=tmp_path / "none"))
    second.pod_cpu.watch(cpu.PodCpu(4.0, lambda: [], 1, pid=10, proc=proc, cgroup=tmp_path / "none"))
    merged = merge_metrics([generate_latest(first.registry), generate_latest(second.registry)], 2).decode()
    assert "\nkiln_pod_cpu_limit_cores 4.0\n" in merged and "\nkiln_pod_cpu_seconds_total 3.0\n" in merged
