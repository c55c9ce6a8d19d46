"""Processes by identity (nodelet/procs.py): /proc parsing that a process cannot fool by its
name, descent, signals that never reach a reused pid, and stop-then-kill of a tree that
keeps forking. Real processes, killed afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from nodelet import procs

# Renames itself to look, to a naive parser, like a zombie child of init; then waits.
DISGUISED = (
    "import time; open('/proc/self/comm', 'w').write(') Z 1 1 1'); "
    "print('ready', flush=True); time.sleep(60)"
)
# Forks a child every millisecond (each child sleeps), up to 300 of them; says "forking"
# once the first child is there.
FORKING = (
    "import os, time\n"
    "for n in range(300):\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(60); os._exit(0)\n"
    "    if n == 0:\n"
    "        print('forking', flush=True)\n"
    "    time.sleep(0.001)\n"
    "time.sleep(60)\n"
)


def _start(started: list[subprocess.Popen[bytes]], code: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    started.append(process)
    return process


def test_a_process_cannot_fake_its_fields_through_its_name(
    started: list[subprocess.Popen[bytes]],
) -> None:
    process = _start(started, DISGUISED)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    stat = procs.read_stat(process.pid)
    assert stat is not None
    assert (stat.pid, stat.ppid, stat.session) == (process.pid, os.getpid(), process.pid)
    assert stat.alive and stat.start > 0


def test_parse_stat_takes_the_fields_after_the_last_parenthesis() -> None:
    text = b"42 (a) b (c) Z 1 1 1) S 7 42 42 0 -1 4194560" + b" 0" * 12 + b" 987654 0"
    stat = procs.parse_stat(text)
    assert (stat.pid, stat.state, stat.ppid, stat.pgrp, stat.session) == (42, "S", 7, 42, 42)
    assert stat.start == 987654


def _stat(pid: int, ppid: int, state: str = "S") -> procs.Stat:
    return procs.Stat(pid=pid, state=state, ppid=ppid, pgrp=pid, session=pid, start=pid)


def test_descendants_are_found_through_every_generation() -> None:
    table = {s.pid: s for s in [_stat(1, 0), _stat(10, 1), _stat(11, 10), _stat(12, 11)]}
    table |= {s.pid: s for s in [_stat(20, 1), _stat(13, 10, "Z")]}
    assert procs.descendants([10], table) == {11, 12, 13}
    assert procs.descendants([12], table) == set()
    assert procs.descendants([1], table) == {10, 11, 12, 13, 20}


def test_a_signal_for_another_start_time_is_not_sent(
    started: list[subprocess.Popen[bytes]],
) -> None:
    process = _start(started, "import time; time.sleep(60)")
    start = procs.start_time(process.pid)
    assert start is not None
    # A reused pid: the same number, another process (another start time).
    assert procs.send({process.pid: start + 1}, signal.SIGKILL) == set()
    time.sleep(0.1)
    assert process.poll() is None
    assert procs.send({process.pid: start}, signal.SIGKILL) == {process.pid}
    assert process.wait(10) == -signal.SIGKILL


def test_stop_and_kill_takes_a_tree_that_keeps_forking(
    started: list[subprocess.Popen[bytes]],
) -> None:
    process = _start(started, FORKING)
    start = procs.start_time(process.pid)
    assert start is not None
    assert process.stdout is not None and process.stdout.readline() == b"forking\n"
    killed = procs.stop_and_kill(lambda: procs.tree({process.pid: start}))
    assert process.pid in killed and len(killed) > 1
    assert process.wait(10) == -signal.SIGKILL
    # Its children were re-parented (to init, or a subreaper) and die there.
    assert procs.wait_gone(killed, 10) == {}


def test_a_tree_spares_the_process_asked_to(started: list[subprocess.Popen[bytes]]) -> None:
    parent = _start(
        started,
        "import subprocess, time; c = subprocess.Popen(['sleep', '60']); "
        "print(c.pid, flush=True); time.sleep(60)",
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    start = procs.start_time(parent.pid)
    assert start is not None
    tree = procs.Tree(parent.pid, start)
    assert set(tree.members()) == {parent.pid, child}
    assert set(tree.kill(spare=parent.pid)) == {child}
    assert procs.wait_gone({child: procs.start_time(child) or 0}, 10) == {}
    assert parent.poll() is None
    assert set(tree.members()) == {parent.pid}


# Starts a child that starts a setsid child and a double-forked daemon (re-parented to this
# process, a subreaper), prints "ready", waits.
FAMILY = (
    "import ctypes, os, subprocess, time\n"
    "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
    "child = subprocess.Popen(['sh', '-c', 'setsid sleep 60 & sleep 60'])\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(60)\n"
    "    os._exit(0)\n"
    "os.wait()\n"
    "time.sleep(0.2)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_tree_read_from_the_kernels_lists_of_children_is_the_tree_a_snapshot_shows(
    started: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not procs.lists_children():
        pytest.skip("this kernel does not list children (CONFIG_PROC_CHILDREN)")
    process = _start(started, FAMILY)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    start = procs.start_time(process.pid)
    assert start is not None
    listed = procs.tree({process.pid: start})
    assert not procs.childless(process.pid)
    monkeypatch.setattr(procs, "lists_children", lambda: False)
    scanned = procs.tree({process.pid: start})
    assert listed == scanned and len(listed) == 5  # it, sh, two sleeps, the daemon
    assert procs.tree({process.pid: start + 1}) == {}


def test_a_process_without_children_is_childless_and_one_with_a_zombie_is_not(
    started: list[subprocess.Popen[bytes]],
) -> None:
    if not procs.lists_children():
        pytest.skip("this kernel does not list children (CONFIG_PROC_CHILDREN)")
    lone = _start(started, "print('ready', flush=True); import time; time.sleep(60)")
    assert lone.stdout is not None and lone.stdout.readline() == b"ready\n"
    assert procs.childless(lone.pid)
    code = (
        "import os, time\n"
        "child = os.fork() or os._exit(0)\n"
        "os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)  # exited, not reaped\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    parent = _start(started, code)
    assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
    assert not procs.childless(parent.pid)  # its child is a zombie it never reaps
    assert set(procs.tree({parent.pid: procs.start_time(parent.pid) or 0})) == {parent.pid}


def test_status_fields_memory_and_mounts_come_from_one_reader() -> None:
    me = os.getpid()
    uids = procs.uids(me)
    assert uids is not None and uids[:3] == os.getresuid()
    rss = procs.rss_mb(me)
    assert rss is not None and rss > 1
    assert procs.status_field(me, "NoSuchField") is None
    assert procs.rss_mb(2**22 + 7) is None  # beyond pid_max: never a process
    assert procs.exists(me) and not procs.exists(2**22 + 7)
    assert " / " in procs.mountinfo()
    assert procs.cgroup_membership().strip()


def test_no_module_but_procs_reads_proc() -> None:
    """`/proc` is parsed in one place (nodelet/procs.py): the others ask it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for package in ("bulletin_core", "gateway", "nodelet", "sdk", "scheduler", "bulletin"):
        for path in (root / package).rglob("*.py"):
            if path == root / "nodelet" / "procs.py":
                continue
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
                and node.body
                and isinstance(node.body[0], ast.Expr)
            }
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and node.value.startswith("/proc")
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"/proc read outside nodelet/procs.py: {found}"


def test_no_children_reaps_the_exited_and_sees_a_running_one() -> None:
    script = (
        "import os, subprocess, sys, time\n"
        "from nodelet import procs\n"
        "assert procs.no_children()\n"
        "subprocess.Popen(['true']).pid\n"
        "time.sleep(0.5)\n"  # exited, not reaped: a zombie, reaped by the check
        "assert procs.no_children()\n"
        "child = subprocess.Popen(['sleep', '30'])\n"
        "assert not procs.no_children()\n"
        "child.kill(); child.wait()\n"
        "assert procs.no_children()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
