"""Processes as ``/proc`` shows them: who descends from whom, and killing a set of them
without ever signalling a process that is not the one meant.

A process is named by its *identity*, its pid and its start time (clock ticks after boot,
``/proc/PID/stat`` field 22): a pid is reused once its process is gone, a pid and start time
are not. Signals go through a pidfd (Linux >= 5.3): the pidfd is opened first, then the
process is checked to still have the identity meant, then signalled through the pidfd, so a
pid reused in between gets nothing.

A tree is found through the kernel's lists of each thread's children
(``/proc/PID/task/TID/children``, where the kernel has ``CONFIG_PROC_CHILDREN``): it costs what
the tree holds, not what the machine runs, and a process with no children is known to have
no descendants after a read per thread. Where the kernel has no such lists, a tree is found
in a snapshot of every process in ``/proc``.

:func:`stop_and_kill` is the freezer of machines without a cgroup: SIGSTOP to everything
found, again until nothing new is found (a stopped process cannot fork), then SIGKILL.

Only the standard library is imported here: the worker uses this module too.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

#: pid -> start time.
Identities = dict[int, int]

_PR_SET_CHILD_SUBREAPER = 36
#: How often stop_and_kill looks for processes that appeared while it stopped the others.
_STOP_ROUNDS = 64
#: How long stop_and_kill goes on stopping what appears before it kills what it found.
STOP_S = 2.0


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of ``/proc/PID/stat`` used here."""

    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int
    start: int

    @property
    def alive(self) -> bool:
        """Running (or stopped), not a zombie waiting to be reaped."""
        return self.state not in ("Z", "X", "x")


def parse_stat(text: bytes) -> Stat:
    """``/proc/PID/stat`` text. The command name (field 2) may hold anything, spaces and
    parentheses included (a process names itself): the fields after it are found from the
    *last* closing parenthesis."""
    head, _, tail = text.rpartition(b")")
    fields = tail.split()
    return Stat(
        pid=int(head.split(b"(", 1)[0]),
        state=fields[0].decode("ascii", "replace"),
        ppid=int(fields[1]),
        pgrp=int(fields[2]),
        session=int(fields[3]),
        start=int(fields[19]),
    )


def read_stat(pid: int) -> Stat | None:
    """Process ``pid``'s stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return parse_stat(file.read())
    except (OSError, ValueError, IndexError):
        return None


def snapshot() -> dict[int, Stat]:
    """Every process on the machine (as this process's pid namespace shows them)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := read_stat(int(entry))) is not None:
            table[stat.pid] = stat
    return table


def descendants(roots: Iterable[int], table: Mapping[int, Stat]) -> set[int]:
    """The pids below ``roots`` in ``table`` (children, their children...), roots excluded."""
    children: dict[int, list[int]] = {}
    for stat in table.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def tree(roots: Mapping[int, int], *, spare: int | None = None) -> Identities:
    """The live processes of ``roots`` (identities; those no longer running are left out) and
    of everything that descends from them, but ``spare``."""
    if lists_children():
        found = _tree_by_children(roots)
    else:
        table = snapshot()
        living = [p for p, start in roots.items() if _is(table.get(p), start)]
        descent = [*living, *descendants(living, table)]
        found = {p: table[p].start for p in descent if table[p].alive}
    if spare is not None:
        found.pop(spare, None)
    return found


def _tree_by_children(roots: Mapping[int, int]) -> Identities:
    """:func:`tree` through the kernel's lists of children. A pid read from a list is taken
    only while its own stat names a parent in the tree: one that exited and whose pid was
    reused meanwhile is not."""
    found: Identities = {}
    inside: set[int] = set()
    for pid, start in roots.items():
        if _is(read_stat(pid), start):
            found[pid] = start
            inside.add(pid)
    todo = list(inside)
    while todo:
        for child in children(todo.pop()):
            if child in inside:
                continue
            stat = read_stat(child)
            if stat is None or stat.ppid not in inside:
                continue  # gone, re-parented out of the tree, or a reused pid
            inside.add(child)
            todo.append(child)
            if stat.alive:
                found[child] = stat.start
    return found


@functools.cache
def lists_children() -> bool:
    """Whether this kernel lists each thread's children (``/proc/PID/task/TID/children``)."""
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")


def children(pid: int) -> list[int]:
    """The children of process ``pid`` (of all its threads: a child's parent is the thread
    that started it, and an orphan goes to any thread of its subreaper), zombies included;
    none if it is gone. The kernel may skip a child while a sibling exits (the lists are
    read without a lock): a caller that must not miss one reads again once what it found is
    stopped. Only where :func:`lists_children`."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children", "rb") as file:
                found.extend(int(child) for child in file.read().split())
        except (OSError, ValueError):
            continue  # the thread ended: its children went to another thread
    return found


def childless(pid: int) -> bool:
    """Whether process ``pid`` is known to have no child (none running, none a zombie), and
    so no descendant at all: a list the kernel reads without a lock may skip a child, but
    never reads empty while one is there. False where the kernel does not list children."""
    if not lists_children():
        return False
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children", "rb") as file:
                if file.read().strip():
                    return False
        except OSError:
            continue  # the thread ended: its children went to another thread
    return True


def no_children() -> bool:
    """Whether this process has no child left, running or not: those that exited (a
    subreaper's adopted orphans among them) are reaped on the way. One system call where
    nothing was started, where :func:`childless` reads a file per thread."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        return True
    return False


def _is(stat: Stat | None, start: int) -> bool:
    return stat is not None and stat.alive and stat.start == start


def status_field(pid: int | str, name: str) -> list[str] | None:
    """The words of field ``name`` (e.g. ``Uid``) of ``/proc/PID/status``, or None if the
    process is gone or has no such field."""
    prefix = name.encode() + b":"
    try:
        with open(f"/proc/{pid}/status", "rb") as file:
            for line in file:
                if line.startswith(prefix):
                    return line.decode("ascii", "replace").split()[1:]
    except OSError:
        return None
    return None


def uids(pid: int) -> tuple[int, ...] | None:
    """Process ``pid``'s real, effective, saved and filesystem uids, or None if it is gone."""
    try:
        return tuple(int(field) for field in status_field(pid, "Uid") or ()) or None
    except ValueError:
        return None


def rss_mb(pid: int) -> int | None:
    """Process ``pid``'s resident memory in MiB (VmRSS), or None if it cannot be read."""
    words = status_field(pid, "VmRSS")
    try:
        return int(words[0]) // 1024 if words else None
    except ValueError:
        return None


def exists(pid: int | str) -> bool:
    """Whether a process ``pid`` exists (any state, zombies too)."""
    return os.path.exists(f"/proc/{pid}")


def mountinfo(pid: int | str = "self") -> str:
    """``/proc/PID/mountinfo`` (what that process sees mounted); OSError if unreadable."""
    with open(f"/proc/{pid}/mountinfo") as file:
        return file.read()


def cgroup_membership(pid: int | str = "self") -> str:
    """``/proc/PID/cgroup`` (that process's cgroup in each hierarchy); OSError if
    unreadable."""
    with open(f"/proc/{pid}/cgroup") as file:
        return file.read()


def ancestors(pid: int) -> list[int]:
    """The pids above process ``pid``: its parent, the parent's parent... up to init."""
    found: list[int] = []
    while (stat := read_stat(pid)) is not None and stat.ppid > 0 and stat.ppid not in found:
        found.append(stat.ppid)
        pid = stat.ppid
    return found


def start_time(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.start if stat is not None else None


def send(targets: Mapping[int, int], sig: int) -> set[int]:
    """Send ``sig`` to each process of ``targets`` (identities) that still has that identity
    once a pidfd holds it; the pids signalled. Processes this one may not signal are skipped."""
    opened: dict[int, int] = {}
    try:
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                opened[pid] = _pidfd(pid)
        sent = set()
        for pid, fd in opened.items():
            if not _is(read_stat(pid), targets[pid]):
                continue  # gone (or the pid reused) before the pidfd was opened
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if fd >= 0:
                    signal.pidfd_send_signal(fd, sig)
                else:  # no pidfds (Linux < 5.3): the check above narrows the race only
                    os.kill(pid, sig)
                sent.add(pid)
        return sent
    finally:
        for fd in opened.values():
            if fd >= 0:
                os.close(fd)


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid``, or -1 where the kernel has none; ProcessLookupError if gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except OSError:  # ENOSYS: an older kernel
        return -1


def stop_and_kill(find: Callable[[], Identities], timeout_s: float = STOP_S) -> Identities:
    """SIGSTOP every process ``find()`` names, again until it twice names none that was not
    stopped yet (stopped processes cannot fork, so this ends; twice, since a list of
    children may skip one), then SIGKILL them all (a stopped process dies of SIGKILL). After
    ``timeout_s`` (a tree that forks faster than it is stopped), SIGKILL what was found. The
    identities signalled."""
    stopped: Identities = {}
    deadline = time.monotonic() + timeout_s
    quiet = 0
    for _ in range(_STOP_ROUNDS):
        new = {p: s for p, s in find().items() if stopped.get(p) != s}
        if not new:
            quiet += 1
            if quiet == 2:
                break
            continue
        quiet = 0
        send(new, signal.SIGSTOP)
        stopped.update(new)  # also those it may not signal: they would be found forever
        if time.monotonic() >= deadline:
            break
    send(stopped, signal.SIGKILL)
    return stopped


def alive(identities: Mapping[int, int]) -> Identities:
    """Those of ``identities`` that still run (zombies do not)."""
    return {p: s for p, s in identities.items() if _is(read_stat(p), s)}


def wait_gone(identities: Mapping[int, int], timeout_s: float) -> Identities:
    """Wait (at most ``timeout_s``) until none of ``identities`` runs; those that still do."""
    deadline = time.monotonic() + timeout_s
    left = alive(identities)
    while left and time.monotonic() < deadline:
        time.sleep(0.005)
        left = alive(left)
    return left


def reap() -> None:
    """Reap every child of this process that has exited (a subreaper's adopted orphans)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def adopted(keep: Collection[int]) -> dict[int, Stat]:
    """Children of this process (a subreaper) that it did not start: not in ``keep`` and in
    another session than its own, which a process it started itself keeps unless it was
    started in a session of its own (workers: in ``keep``). Orphans of a worker's tree that
    were re-parented here are in the worker's session, or in one they made with setsid."""
    me, session = os.getpid(), os.getsid(0)
    if lists_children():
        stats = [read_stat(pid) for pid in set(children(me)) if pid not in keep]
        found = [stat for stat in stats if stat is not None]
    else:
        found = list(snapshot().values())
    return {s.pid: s for s in found if s.ppid == me and s.pid not in keep and s.session != session}


def become_subreaper() -> None:
    """Adopt the orphans of this process's descendants (instead of init), so that none
    leaves its tree (PR_SET_CHILD_SUBREAPER; kept across setuid and exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(error)}")


class Tree:
    """A worker's processes where it has no cgroup: the worker while it runs, what descends
    from it, and what was seen of them before (a child that ignores SIGTERM outlives the
    worker; the orphans of a worker that died re-parent to the nodelet, a subreaper). Safe
    to use from several threads."""

    def __init__(self, root: int, start: int | None) -> None:
        self.root = root
        self._seen: Identities = {root: start} if start is not None else {}
        self._lock = threading.Lock()

    @property
    def seen(self) -> Identities:
        """What the last look found (without a new look)."""
        return dict(self._seen)

    def members(self) -> Identities:
        """The live processes of the tree (the worker too, while it runs)."""
        with self._lock:
            self._seen = tree(self._seen)
            return dict(self._seen)

    def has_others(self, spare: int) -> bool:
        """Whether the tree may hold a live process but ``spare``: cheap where the kernel
        lists children (the lists of the root, and what was seen before; no descent)."""
        if not lists_children():
            return any(p != spare for p in self.members())
        seen = {p: s for p, s in self._seen.items() if p != spare}
        return bool(alive(seen)) or not childless(self.root)

    def signal(self, sig: int) -> None:
        send(self.members(), sig)

    def kill(self, *, spare: int | None = None) -> Identities:
        """Stop, then SIGKILL, every process of the tree but ``spare``."""
        return stop_and_kill(lambda: {p: s for p, s in self.members().items() if p != spare})


def boot_id() -> str:
    """This boot's random id: start times count from boot, so they name a process only
    within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return ""
