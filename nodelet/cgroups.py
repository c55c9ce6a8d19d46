"""Cgroup plumbing for the nodelet's limits and process tracking (:mod:`nodelet.limits`):
where this process's cgroups are, making a directory of our own below them, one worker's
cgroups (killing all that is in them, or all but the worker, frozen first where the machine
can), and removing what a nodelet left.

A controller lives on one hierarchy: cgroup v2 (one tree for every controller enabled there)
or cgroup v1 (a tree per mounted controller, or per group of co-mounted ones). Machines mix
them: this module answers per controller. Only the standard library is imported here: the
worker imports :mod:`nodelet.limits`, which imports this.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nodelet import procs

#: How long a freeze may take before the kill goes on without it (a process in an
#: uninterruptible sleep delays it).
_FREEZE_WAIT_S = 0.5


class LimitUnavailable(Exception):
    """A mechanism cannot be used on this machine; the message says why."""


@dataclass(frozen=True, slots=True)
class Mount:
    """A cgroup filesystem mounted at ``point``, showing the hierarchy's ``root`` there."""

    point: str
    root: str
    version: int
    controllers: frozenset[str]


def cgroup_mounts(mountinfo: str) -> list[Mount]:
    """The cgroup mounts in ``/proc/<pid>/mountinfo`` text."""
    mounts = []
    for line in mountinfo.splitlines():
        fields, sep, tail = line.partition(" - ")
        parts, rest = fields.split(), tail.split()
        if not sep or len(parts) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        version = 2 if rest[0] == "cgroup2" else 1
        options = frozenset(rest[2].split(",")) if version == 1 else frozenset()
        mounts.append(Mount(_unescape(parts[4]), _unescape(parts[3]), version, options))
    return mounts


def own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """A process's cgroup path per v1 controller (``"memory"``, ...) and for v2 (``""``),
    from ``/proc/<pid>/cgroup`` text."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths[""] = path
        for controller in filter(None, controllers.split(",")):
            paths[controller] = path
    return paths


def own_cgroup_dir(version: int, pid: int, controller: str = "memory") -> str:
    """The directory of process ``pid``'s cgroup in the v2 hierarchy, or in the v1 hierarchy
    of ``controller``; LimitUnavailable when there is none or it is not visible."""
    try:
        mounts = cgroup_mounts(procs.mountinfo(pid))
        paths = own_cgroups(procs.cgroup_membership(pid))
    except OSError as exc:
        raise LimitUnavailable(f"cannot read this process's cgroups: {why(exc)}") from None
    key = "" if version == 2 else controller
    found = [m for m in mounts if m.version == version and (version == 2 or key in m.controllers)]
    if not found:
        what = "cgroup v2 hierarchy" if version == 2 else f"cgroup v1 {controller} hierarchy"
        raise LimitUnavailable(f"no {what} is mounted")
    if key not in paths:
        raise LimitUnavailable(f"cgroup v{version}: this process is in no such cgroup")
    path = paths[key]
    for mount in found:
        relative = os.path.relpath(path, mount.root)
        if not relative.startswith(".."):
            here = os.path.normpath(os.path.join(mount.point, relative))
            if os.path.isdir(here):
                return here
    raise LimitUnavailable(f"cgroup v{version}: this process's cgroup {path} is not visible")


def on_v1(controller: str, pid: int) -> bool:
    """Whether ``controller`` is bound to a mounted cgroup v1 hierarchy."""
    try:
        mounts = cgroup_mounts(procs.mountinfo(pid))
    except OSError:
        return False
    return any(m.version == 1 and controller in m.controllers for m in mounts)


def enable_below(here: str, pid: int, controller: str) -> None:
    """Enable a v2 ``controller`` for ``here``'s children. The kernel refuses that while
    ``here`` holds processes (except at the root), so the nodelet first moves itself into a
    leaf ``bulletin-nodelet-<pid>``; other processes there make it impossible."""
    try:
        controllers = read(here, "cgroup.controllers").split()
    except OSError as exc:
        raise LimitUnavailable(f"cgroup v2: cannot read {here}: {why(exc)}") from None
    if controller not in controllers:
        reason = (
            "it is bound to the cgroup v1 hierarchy"
            if on_v1(controller, pid)
            else "run the nodelet in a cgroup with it delegated (systemd: Delegate=yes)"
        )
        raise LimitUnavailable(
            f"cgroup v2: the {controller} controller is not available in {here} (it has: "
            f"{' '.join(controllers) or 'none'}): {reason}"
        )
    if controller in read(here, "cgroup.subtree_control").split():
        return
    try:
        write(here, "cgroup.subtree_control", f"+{controller}")
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise LimitUnavailable(
                f"cgroup v2: cannot enable the {controller} controller below {here}: {why(exc)}"
            ) from None
    leaf = os.path.join(here, f"bulletin-nodelet-{pid}")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf)
        write(leaf, "cgroup.procs", str(pid))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(leaf)
        raise LimitUnavailable(f"cgroup v2: cannot use {here}: {why(exc)}") from None
    try:
        write(here, "cgroup.subtree_control", f"+{controller}")
    except OSError as exc:
        with contextlib.suppress(OSError):
            write(here, "cgroup.procs", str(pid))
            os.rmdir(leaf)
        others = len(read(here, "cgroup.procs").split())
        raise LimitUnavailable(
            f"cgroup v2: cannot enable the {controller} controller below {here} ({why(exc)}): "
            f"{others} other processes live there; run the nodelet in a cgroup of its own "
            "with the controller delegated (systemd: Delegate=yes)"
        ) from None


def make_base(here: str, name: str, version: int, controllers: Iterable[str]) -> str:
    """This nodelet's directory ``name`` below ``here`` (the workers' cgroups go in it), with
    ``controllers`` handed down to them on v2. What an earlier nodelet of the same name left
    in it is killed and removed first."""
    sweep(here)
    base = os.path.join(here, name)
    try:
        if os.path.isdir(base):
            remove_tree(base, keep_top=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(base)
        wanted = " ".join(f"+{c}" for c in controllers)
        if version == 2 and wanted:
            write(base, "cgroup.subtree_control", wanted)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(base)
        raise LimitUnavailable(f"cgroup v{version}: cannot set up {base}: {why(exc)}") from None
    return base


def sweep(here: str) -> None:
    """Kill what is left in the cgroups of nodelets which are gone (killed ones) that were
    named for their pid, ``bulletin-<pid>`` (nodelets named for their node are swept by
    :mod:`nodelet.leftovers`), and remove them."""
    with contextlib.suppress(OSError):
        for name in os.listdir(here):
            prefix, _, owner = name.rpartition("-")
            if prefix not in ("bulletin", "bulletin-nodelet") or not owner.isdigit():
                continue
            if procs.exists(owner):
                continue
            with contextlib.suppress(OSError):
                remove_tree(os.path.join(here, name))


def remove_tree(directory: str, *, keep_top: bool = False, timeout_s: float = 5.0) -> int:
    """Kill every process in cgroup ``directory`` and below, and remove those cgroups,
    deepest first (``directory`` too, unless ``keep_top``); how many processes were
    killed. OSError if one is still busy after ``timeout_s``."""
    killed = 0
    for path, _, _ in os.walk(directory, topdown=False):
        cgroup = Cgroup.at(path)
        killed += len(cgroup.members())
        if keep_top and path == directory:
            cgroup.kill()
            continue
        deadline = time.monotonic() + timeout_s
        while not cgroup.try_remove():
            if time.monotonic() >= deadline:
                raise OSError(errno.EBUSY, f"cgroup {path} is still busy", path)
            time.sleep(0.01)
    return killed


class Cgroup:
    """One worker's cgroups, a directory per hierarchy (``dirs``: controller -> directory;
    controllers sharing a hierarchy share one): its out-of-memory kills, the GPUs its device
    rules allow, and killing what is left in it."""

    def __init__(
        self,
        dirs: Mapping[str, str],
        versions: Mapping[str, int],
        *,
        gpu_devices: Mapping[int, tuple[str, ...]] | None = None,
    ) -> None:
        self.dirs = dict(dirs)
        self.versions = dict(versions)
        #: The version of the memory controller's hierarchy (or of the first one).
        self.version = self.versions.get("memory") or next(iter(self.versions.values()))
        #: Device rules ("c 195:0") per GPU index, where the devices controller is used.
        self.gpu_devices = dict(gpu_devices or {})
        self._final_oom_kills: int | None = None
        #: ``cgroup.procs`` of :attr:`path`, held open where it is cgroup v2 (see has_others).
        self._procs_fd: int | None = None

    @property
    def path(self) -> str:
        """The memory controller's directory, else the first one."""
        return self.dirs.get("memory") or next(iter(self.dirs.values()))

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for memory (kept after removal)."""
        if self._final_oom_kills is not None:
            return self._final_oom_kills
        memory = self.dirs.get("memory")
        if memory is None:
            return 0
        try:
            if self.version == 2:
                return keyed(read(memory, "memory.events")).get("oom_kill", 0)
            counts = keyed(read(memory, "memory.oom_control"))
            if "oom_kill" in counts:
                return counts["oom_kill"]
            # Kernels before 4.13 do not count kills: count the times the limit was hit.
            return int(read(memory, "memory.failcnt"))
        except (OSError, ValueError):
            return 0

    def allow_gpus(self, gpus: Iterable[int]) -> None:
        """Let the worker open the device files of ``gpus`` (its call's), denied until now."""
        devices = self.dirs.get("devices")
        if devices is None:
            return
        for index in gpus:
            for rule in self.gpu_devices.get(index, ()):
                write(devices, "devices.allow", f"{rule} rwm")

    @classmethod
    def at(cls, directory: str) -> Cgroup:
        """The cgroup at ``directory``, found on disk (to sweep what a nodelet left)."""
        version = 2 if os.path.exists(os.path.join(directory, "cgroup.controllers")) else 1
        return cls({"": directory}, {"": version})

    def kill(self, *, spare: int | None = None) -> None:
        """SIGKILL every process in the cgroups (but ``spare``), those that left the worker's
        process group or session too. Frozen first where the machine can (cgroup v2, the v1
        freezer), else stopped with SIGSTOP first: nothing forks away during the kill."""
        if spare is None:
            for directory in self.dirs.values():  # cgroup v2, Linux >= 5.14: all at once
                with contextlib.suppress(OSError):
                    write(directory, "cgroup.kill", "1")
                    return

        def others() -> procs.Identities:
            return {p: s for p, s in self.members().items() if p != spare}

        freezer = self._freezer()
        if freezer is None:
            procs.stop_and_kill(others)
            return
        self._freeze(freezer, frozen=True)
        try:
            procs.send(others(), signal.SIGKILL)
        finally:
            self._freeze(freezer, frozen=False)  # a v1-frozen process dies once thawed

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process in the cgroups."""
        procs.send(self.members(), sig)

    def _freezer(self) -> tuple[str, bool] | None:
        """A directory that freezes every process of the worker, and whether it is v2's."""
        for directory in self.dirs.values():
            if os.path.exists(os.path.join(directory, "cgroup.freeze")):
                return directory, True
        for directory in self.dirs.values():
            if os.path.exists(os.path.join(directory, "freezer.state")):
                return directory, False
        return None

    @staticmethod
    def _freeze(freezer: tuple[str, bool], *, frozen: bool) -> None:
        directory, v2 = freezer
        if v2:
            write(directory, "cgroup.freeze", "1" if frozen else "0")
        else:
            write(directory, "freezer.state", "FROZEN" if frozen else "THAWED")
        deadline = time.monotonic() + _FREEZE_WAIT_S
        while frozen and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if v2 and keyed(read(directory, "cgroup.events")).get("frozen") == 1:
                    return
                if not v2 and read(directory, "freezer.state").strip() == "FROZEN":
                    return
            time.sleep(0.001)

    def members(self) -> procs.Identities:
        """The live processes in the cgroups (identities)."""
        found = {}
        for pid in self.pids():
            stat = procs.read_stat(pid)
            if stat is not None and stat.alive:
                found[pid] = stat.start
        return found

    def has_others(self, pid: int) -> bool:
        """Whether a process other than ``pid`` is in the cgroups: read in one hierarchy
        (:attr:`path`), once per call, where :meth:`pids` reads each. Every hierarchy holds
        the same processes: the worker is put in each before its first call, what it starts
        inherits all of them, and moving a process out of one takes writing to a root-owned
        ``cgroup.procs`` (a process that became root may leave them all alike)."""
        try:
            text = self._read_procs()
        except OSError:  # removed (the worker died): the full reads find what is left
            return True
        try:
            return len(text) >= _PROCS_READ or any(int(line) != pid for line in text.split())
        except ValueError:  # not a list of pids: not the file it was
            return True

    def _read_procs(self) -> bytes:
        """``cgroup.procs`` of :attr:`path`. In cgroup v2 it is held open and read again
        from its start (each read from offset 0 lists the members anew: 2 µs against 20 µs
        for an open, read and close). Not in v1: a v1 descriptor keeps the list its first
        read made."""
        if self.version != 2:  # the version of :attr:`path`'s hierarchy
            with open(os.path.join(self.path, "cgroup.procs"), "rb") as file:
                return file.read(_PROCS_READ)
        if self._procs_fd is None:
            flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
            self._procs_fd = os.open(os.path.join(self.path, "cgroup.procs"), flags)
        return os.pread(self._procs_fd, _PROCS_READ, 0)

    def close(self) -> None:
        """Close what :meth:`has_others` holds open (before removing the cgroups: in the
        event loop's thread, where has_others runs)."""
        if self._procs_fd is not None:
            os.close(self._procs_fd)
            self._procs_fd = None

    def pids(self) -> list[int]:
        found: set[int] = set()
        for directory in set(self.dirs.values()):
            with contextlib.suppress(OSError):
                found.update(int(line) for line in read(directory, "cgroup.procs").split())
        return sorted(found)

    def try_remove(self) -> bool:
        """Kill what is left and remove the cgroups; False while dying processes keep one
        busy (call again)."""
        if self._final_oom_kills is None:
            self._final_oom_kills = self.oom_kills()
        self.kill()
        busy = False
        for directory in set(self.dirs.values()):
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                busy = True
        return not busy


#: What :meth:`Cgroup.has_others` reads of ``cgroup.procs`` at most: a list that fills it
#: holds more than the worker.
_PROCS_READ = 1 << 16


def keyed(text: str) -> dict[str, int]:
    """``name value`` lines (memory.events, memory.oom_control) as a dict."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as file:
        return file.read()


def write(directory: str, name: str, value: str, *, optional: bool = False) -> None:
    path = os.path.join(directory, name)
    if optional and not os.path.exists(path):
        return
    with open(path, "w") as file:
        file.write(value)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def why(exc: OSError) -> str:
    return exc.strerror or str(exc)
