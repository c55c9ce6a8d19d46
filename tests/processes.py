"""Processes as the tests see them: alive or gone, and what a call starts to outlive it.

A process is alive while its ``/proc/PID/stat`` (read by :mod:`nodelet.procs`, the one
reader of ``/proc``) says it runs; a zombie waiting to be reaped is dead.
:func:`start_escapees` runs inside calls (it is pickled by value), so it imports what it
uses itself.
"""

from __future__ import annotations

import sys

import cloudpickle

from nodelet import procs

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z``...), None when there is none."""
    stat = procs.read_stat(pid)
    return None if stat is None else stat.state


def alive(pid: int) -> bool:
    """Running: not gone, not a zombie."""
    return state(pid) not in (None, "Z", "X")


def parent(pid: int) -> int:
    """The process's parent pid."""
    stat = procs.read_stat(pid)
    assert stat is not None, f"process {pid} is gone"
    return stat.ppid


def start_escapees(seconds: float) -> list[int]:
    """Start what tries to outlive its call, each sleeping ``seconds``: a plain child, a
    ``setsid`` child and a double-forked daemon (its parent exited; it leads its own
    session). Returns their pids."""
    import os
    import subprocess

    plain = subprocess.Popen(["sleep", str(seconds)])
    setsid = subprocess.Popen(["setsid", "sleep", str(seconds)])
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.execvp("sleep", ["sleep", str(seconds)])
        os.write(write, str(daemon).encode())
        os._exit(0)
    os.close(write)
    daemon = int(os.read(read, 32))
    os.close(read)
    os.waitpid(middle, 0)
    return [plain.pid, setsid.pid, daemon]
