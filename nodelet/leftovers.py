"""What a nodelet leaves on its machine, and its next start's sweep of it.

A nodelet keeps a record in its state directory (``state_dir``): its workers (pid and start
time, see :mod:`nodelet.procs`) and the cgroup directories it made for them. The record is
rewritten as workers come and go. A nodelet that is killed (SIGKILL, a crash) leaves it
behind: at its next start, before the node registers, :func:`sweep` kills every recorded
worker that still runs, with all that descends from it, and every process left in the
recorded cgroups, and removes those (DESIGN.md invariant 9: nothing a call started outlives
its nodelet). Processes of an earlier boot are gone already: a record of another boot is
dropped unread.

An earlier nodelet of the same state directory that still runs (a second start of a node on
its machine, while the first hangs, is stopped, or is still stopping) is killed first: its
registration frees every GPU of the node, and the new incarnation starts work on them at
once, so nothing of the old one may run by then, and an old nodelet that is frozen would
never notice it was superseded (nor would its workers, whose lifelines stay open). The sweep
checks that the recorded nodelet still has its recorded start time and runs as this
nodelet's account, stops it and everything below it (its workers, what their calls started,
the orphans it adopted) with SIGSTOP, SIGKILLs them through pidfds, waits until they are
gone, then kills the recorded workers and cgroups as above. Only then does the node register.
(Two nodelets of one node on two machines, with two state directories, cannot do this: the
later one's registration supersedes the earlier, which stops with exit status 3.) Should an
earlier nodelet write the record after all, a later one's record is never overwritten.

The nodelet runs as root and the calls' accounts must not be able to steer it, so the state
directory is made 0700, walked from ``/`` one directory at a time without following a link,
and refused if another account owns it or a directory above it that is not sticky could let
another account replace it. Its files are opened relative to its descriptor, with
``O_NOFOLLOW``, and the record is read only from a bounded regular file of the nodelet's own
account. A recorded process is signalled only while it has the recorded start time (a reused
pid is not the worker), and a recorded cgroup is swept only if it is a ``bulletin-`` directory
of a mounted cgroup hierarchy.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec
import platformdirs

from nodelet import cgroups, procs

if TYPE_CHECKING:
    from nodelet.config import NodeletConfig

log = logging.getLogger(__name__)

#: The record, in the state directory.
STATE_FILE = "processes.json"
#: A record bigger than this was not written by a nodelet.
_MAX_RECORD_BYTES = 1 << 20
#: How long the sweep waits for what it killed to be gone, before the node registers.
_GONE_S = 5.0
#: How often the sweep looks again for an earlier nodelet that wrote the record meanwhile.
_PREDECESSOR_ROUNDS = 3
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    """The state file's content (the nodelet's private record: no other component reads it)."""

    boot_id: str
    #: (pid, start time) of the nodelet that wrote it.
    nodelet: tuple[int, int] | None = None
    #: Directories of cgroups the workers were in.
    cgroups: list[str] = []
    #: (pid, start time) of each worker.
    workers: list[tuple[int, int]] = []


def default_state_dir(name: str) -> str:
    """Node ``name``'s state directory when none is set: under /var/lib as root, else in
    this account's state directory."""
    leaf = _safe(name)
    if os.geteuid() == 0:
        return os.path.join("/var/lib/bulletin-nodelet", leaf)
    return os.path.join(platformdirs.user_state_dir("bulletin-nodelet"), leaf)


def base_name(name: str, state_dir: str) -> str:
    """The name of the cgroup directory the nodelet of node ``name`` makes its workers'
    cgroups in: the same at every start, and another for each state directory (two nodelets
    of one machine never sweep each other's)."""
    digest = hashlib.sha256(os.path.normpath(state_dir).encode()).hexdigest()[:12]
    return f"bulletin-node-{_safe(name)[:64]}-{digest}"


#: A nodelet without a ``work_dir`` works in ``<tmp>/bulletin-nodelet-<pid>-<start>-*``.
_TEMP_DIR = re.compile(r"bulletin-nodelet-(\d+)-(\d+)-[A-Za-z0-9_]+")


def temporary_work_dir() -> str:
    """A fresh temporary work directory, named for this nodelet (pid and start time).

    First removes those of nodelets of this account that are gone without removing theirs
    (killed, crashed): only real directories (not links) this account owns, whose nodelet
    no longer runs with its recorded start time. Another account's directories, and a link
    planted under such a name, are left alone. Nothing is removed where start times cannot
    be read (no /proc), nor from a directory other accounts may write to that is not sticky
    (they could rename this account's directories there). A nodelet in another pid namespace
    sharing this temporary directory looks gone: give such nodelets a ``work_dir``."""
    base, pid = tempfile.gettempdir(), os.getpid()
    start, mode = procs.start_time(pid), os.stat(base).st_mode
    if start is not None and (mode & stat.S_ISVTX or not mode & stat.S_IWOTH):
        _remove_dead_dirs(base, os.geteuid())
    return tempfile.mkdtemp(prefix=f"bulletin-nodelet-{pid}-{start or 0}-")


def _remove_dead_dirs(base: str, me: int) -> None:
    with os.scandir(base) as entries:
        for entry in entries:
            match = _TEMP_DIR.fullmatch(entry.name)
            if match is None:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            pid, start = int(match[1]), int(match[2])
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != me:
                continue
            if procs.start_time(pid) == start:
                continue  # its nodelet still runs
            log.info("removing %s, left by a nodelet that is gone", entry.path)
            try:
                shutil.rmtree(entry.path, ignore_errors=True)  # fd-based: follows no link
            except RecursionError:  # (a call's tree too deep: the nodelet must start anyway)
                log.warning("could not remove %s (nested too deeply); left in place", entry.path)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "node"


class NodeState:
    """A nodelet's state directory, held open, and its record of workers and cgroups."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self._boot_id = procs.boot_id()
        me = os.getpid()
        self._me = (me, procs.start_time(me) or 0)

    @classmethod
    def open(cls, path: str) -> NodeState:
        """Open (make) the state directory ``path``; ValueError if it is not safe to use."""
        return cls(open_private_dir(path), path)

    def read(self) -> _Record | None:
        """The record an earlier nodelet left, or None (none, or not one it wrote)."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(STATE_FILE, flags, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("ignored the record %s in %s: %s", STATE_FILE, self.path, exc)
            return None
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if (
                not stat.S_ISREG(info.st_mode)
                or info.st_uid != os.geteuid()
                or info.st_size > _MAX_RECORD_BYTES
            ):
                log.warning("ignored the record %s in %s: not ours", STATE_FILE, self.path)
                return None
            data = file.read(_MAX_RECORD_BYTES + 1)
        try:
            return msgspec.json.decode(data, type=_Record)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignored the record %s in %s: %s", STATE_FILE, self.path, exc)
            return None

    def other_writer(self, record: _Record) -> tuple[int, int] | None:
        """(pid, start time) of the nodelet that wrote ``record``, if it still runs and is
        not this one."""
        if record.nodelet is None or tuple(record.nodelet) == self._me:
            return None
        pid, start = record.nodelet
        alive = record.boot_id == self._boot_id and procs.alive({pid: start})
        return (pid, start) if alive else None

    def record(self, cgroup_dirs: Sequence[str], workers: Mapping[int, int]) -> None:
        """Replace the record (atomically): these cgroup directories, these workers; unless a
        later start of this node that still runs wrote it (this nodelet is superseded)."""
        with self._locked():
            current = self.read()
            writer = self.other_writer(current) if current is not None else None
            if writer is not None and writer[1] > self._me[1]:
                return
            self._write(
                _Record(
                    boot_id=self._boot_id,
                    nodelet=self._me,
                    cgroups=list(cgroup_dirs),
                    workers=sorted(workers.items()),
                )
            )

    def sweep(self) -> None:
        """Kill the nodelet that wrote the record if it still runs, with all it runs; kill
        what it left running; then own the record. ValueError if that nodelet runs as
        another account (it is not killed)."""
        # First without the lock: a nodelet stopped (SIGSTOP) while it held it would hold it
        # forever; killed, it lets go.
        self._kill_predecessor(self.read())
        with self._locked():
            record = self.read()
            for _ in range(_PREDECESSOR_ROUNDS):  # another start that wrote it meanwhile
                if not self._kill_predecessor(record):
                    break
                record = self.read()
            if record is None:
                self._write(_Record(boot_id=self._boot_id, nodelet=self._me))
                return
            killed = kill_recorded(record)
            if killed:
                log.warning(
                    "killed %d processes that an earlier nodelet of this node left running "
                    "(its workers, and what their calls started)",
                    killed,
                )
            self._write(_Record(boot_id=self._boot_id, nodelet=self._me))

    def _kill_predecessor(self, record: _Record | None) -> bool:
        """Kill the nodelet that wrote ``record`` if it still runs (it and all below it), and
        wait until they are gone; whether there was one."""
        writer = self.other_writer(record) if record is not None else None
        if writer is None:
            return False
        pid, start = writer
        me = os.geteuid()
        uids = procs.uids(pid)
        if uids is not None and set(uids) != {me}:
            raise ValueError(
                f"an earlier nodelet of this node's state directory {self.path} (pid {pid}) "
                f"runs as uid {uids[0]}, not as this nodelet's (uid {me}): stop it before "
                "this one starts"
            )
        if pid in procs.ancestors(os.getpid()):
            raise ValueError(
                f"the earlier nodelet of this node's state directory {self.path} (pid {pid}) "
                "started this one: give this one a state directory of its own (--state-dir)"
            )
        log.warning(
            "an earlier nodelet of this node still runs (pid %d); killing it and all it runs "
            "before this one registers",
            pid,
        )
        killed = procs.stop_and_kill(functools.partial(procs.tree, {pid: start}))
        left = procs.wait_gone(killed, _GONE_S)
        if left:
            log.warning("processes %s of the earlier nodelet are still running", sorted(left))
        else:
            log.info(
                "killed the earlier nodelet (pid %d) and %d processes below it",
                pid,
                len(killed) - 1,
            )
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive among the nodelets of this state directory (one stopping, one starting)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _write(self, record: _Record) -> None:
        temp = f"{STATE_FILE}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=self.fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o600, dir_fd=self.fd)
        with os.fdopen(fd, "wb") as file:
            file.write(msgspec.json.encode(record))
        os.replace(temp, STATE_FILE, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def close(self) -> None:
        os.close(self.fd)


def open_private_dir(path: str) -> int:
    """A descriptor of directory ``path``, made (0700) where missing: walked from ``/``
    without following links, each directory above it owned by root or this account and,
    if others may write it, sticky (as /tmp); ``path`` itself this account's and writable
    by it alone. ValueError saying what is wrong otherwise."""
    parts = [part for part in os.path.normpath(path).split(os.sep) if part]
    if not os.path.isabs(path) or not parts:
        raise ValueError(f"state_dir must be an absolute path below /, got {path!r}")
    fd = os.open("/", _DIR_FLAGS)
    try:
        where = "/"
        for index, part in enumerate(parts):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
            where = os.path.join(where, part)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise ValueError(
                    f"state_dir {path}: {where} is a symbolic link or not a directory ({exc})"
                ) from None
            os.close(fd)
            fd = child
            _check_dir(os.fstat(fd), where, path, last=index == len(parts) - 1)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_dir(info: os.stat_result, where: str, path: str, *, last: bool) -> None:
    me = os.geteuid()
    others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if last and (info.st_uid != me or others_write):
        raise ValueError(
            f"state_dir {path} belongs to uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}: it must be this account's (uid {me}) and "
            "writable by it alone"
        )
    if not last and (
        info.st_uid not in (0, me) or (others_write and not info.st_mode & stat.S_ISVTX)
    ):
        raise ValueError(
            f"state_dir {path}: {where} (uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):o}) can be changed by another account: choose a "
            "state directory below directories only root or this account may change"
        )


def open_state(config: NodeletConfig) -> NodeState:
    """The state directory of the nodelet ``config`` describes (made if need be)."""
    return NodeState.open(config.state_dir or default_state_dir(config.name))


def sweep(config: NodeletConfig) -> None:
    """Kill what an earlier nodelet of this node left on the machine (from its record in the
    state directory, made if need be), and wait until it is gone. Run at start, before the
    node registers. ValueError if the state directory is not safe to use."""
    state = open_state(config)
    try:
        state.sweep()
    finally:
        state.close()
    log.info("swept what earlier nodelets of this node left (state in %s)", state.path)


def kill_recorded(record: _Record) -> int:
    """Kill the record's workers still running with their trees, and what is in its cgroups
    (and remove those); how many processes were killed."""
    if record.boot_id != procs.boot_id():
        return 0  # rebooted since: all of it is gone
    killed: procs.Identities = {}
    for pid, start in record.workers:
        killed.update(procs.stop_and_kill(functools.partial(procs.tree, {pid: start})))
    left = procs.wait_gone(killed, _GONE_S)
    if left:
        log.warning("processes %s an earlier nodelet left are still running", sorted(left))
    count = len(killed)
    for directory in record.cgroups:
        if not os.path.lexists(directory):
            continue  # removed already
        if not _is_a_nodelet_cgroup(directory):
            log.warning("ignored %s in the record: not a nodelet's cgroup", directory)
            continue
        try:
            count += cgroups.remove_tree(directory, timeout_s=_GONE_S)
        except OSError as exc:
            log.warning("could not sweep the cgroup %s an earlier nodelet left: %s", directory, exc)
    return count


def _is_a_nodelet_cgroup(directory: str) -> bool:
    """Whether ``directory`` is a ``bulletin-`` cgroup directory of a mounted hierarchy."""
    if os.path.normpath(directory) != directory or not os.path.isabs(directory):
        return False
    if not os.path.basename(directory).startswith("bulletin-") or os.path.islink(directory):
        return False
    try:
        mounts = cgroups.cgroup_mounts(procs.mountinfo())
    except OSError:
        return False
    return os.path.isdir(directory) and any(
        directory.startswith(mount.point.rstrip("/") + "/") for mount in mounts
    )
