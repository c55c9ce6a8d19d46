"""Processes as the tests see them: alive or gone, and what a call starts to outlive it.

A process is alive while ``/proc/PID/stat`` says it runs; a zombie waiting to be reaped is
dead. :func:`start_escapees` runs inside calls (it is pickled by value), so it imports what
it uses itself.
"""

from __future__ import annotations

import sys

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z``...), None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running: not gone, not a zombie."""
    return state(pid) not in (None, "Z", "X")


def parent(pid: int) -> int:
    """The process's parent pid."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[1])


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
