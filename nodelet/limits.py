"""Per-call memory limits: find what this machine can enforce, and enforce it.

:meth:`MemoryLimiter.detect` picks the best mechanism at nodelet start and logs it, with the
reason each better one is not usable:

- ``cgroup2``: a child cgroup per worker in a delegated cgroup v2 subtree with the memory
  controller: ``memory.max``, ``memory.swap.max = 0`` and ``memory.oom.group = 1`` (an
  out-of-memory kill takes the whole call). OOM kills are counted in ``memory.events``.
- ``cgroup1``: a child cgroup per worker in a writable cgroup v1 memory hierarchy:
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted).
  The kernel kills the biggest process of the cgroup; kills are counted in
  ``memory.oom_control``.
- ``rlimit``: the last resort. The worker sets ``RLIMIT_AS`` on itself before it unpickles
  the call. That limits virtual address space, per process (each child gets its own), not
  resident memory: CUDA and torch reserve far more address space than they use. A
  ``MemoryError`` raised under it is reported as out of memory. The limit cannot be raised
  back, so such a worker runs one call only.
- ``none``: no limit (``memory_limit_mb = 0``).

Only the standard library is imported here: the worker imports this module too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import signal
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The WorkerTask env variable that asks a worker to set ``RLIMIT_AS`` (in MiB) on itself.
RLIMIT_ENV = "BULLETIN_RLIMIT_AS_MB"
_MiB = 1 << 20


class LimitUnavailable(Exception):
    """A mechanism cannot be used on this machine; the message says why."""


class MemoryLimiter:
    """No limit; the base of the mechanisms below. Each worker is confined by :meth:`apply`
    when it starts; :meth:`task_env` goes into every call's task."""

    mechanism = "none"
    #: Whether a worker may run another call after one under this limiter.
    reuses_workers = True

    def __init__(self, limit_mb: int = 0, *, unusable: str = "") -> None:
        self.limit_mb = limit_mb
        #: Why the cgroup mechanisms were not usable ("" when one is in use, or no limit).
        self.unusable = unusable

    @classmethod
    def detect(cls, limit_mb: int, *, pid: int | None = None) -> MemoryLimiter:
        """The best mechanism this machine offers for ``limit_mb`` MiB per call (0: none),
        logged with the reason each better one was not usable."""
        if limit_mb <= 0:
            log.info("no memory limit per call (memory_limit_mb = 0)")
            return MemoryLimiter()
        problems = []
        for version in (2, 1):
            try:
                cgroups = CgroupLimiter.create(version, limit_mb, pid=pid)
            except LimitUnavailable as exc:
                problems.append(str(exc))
                continue
            log.info(
                "memory limit: %s, a cgroup per worker under %s%s",
                cgroups.describe(),
                cgroups.base,
                f"; not {problems[0]}" if problems else "",
            )
            return cgroups
        limiter = RlimitLimiter(limit_mb, unusable="; ".join(problems))
        log.warning(
            "memory limit: %s, a last resort that counts virtual memory (CUDA and "
            "torch reserve much more than they use); cgroups are not usable: %s",
            limiter.describe(),
            limiter.unusable,
        )
        return limiter

    def describe(self) -> str:
        """The limit and how it is enforced, in words for logs and error messages."""
        return "none"

    def task_env(self) -> dict[str, str]:
        """Environment a call's WorkerTask carries for the worker to limit itself."""
        return {}

    def apply(self, pid: int) -> Cgroup | None:
        """Confine a new worker process (before it gets a call); its cgroup, if any."""
        return None

    def close(self) -> None:
        """Remove what the limiter made (once its workers are gone)."""


class RlimitLimiter(MemoryLimiter):
    """``RLIMIT_AS``, set by the worker on itself before it unpickles the call."""

    mechanism = "rlimit"
    reuses_workers = False

    def describe(self) -> str:
        return f"{self.limit_mb} MiB of address space per process (RLIMIT_AS)"

    def task_env(self) -> dict[str, str]:
        return {RLIMIT_ENV: str(self.limit_mb)}


class CgroupLimiter(MemoryLimiter):
    """One child cgroup per worker under ``base``, this nodelet's own directory."""

    def __init__(self, limit_mb: int, base: str, version: int) -> None:
        super().__init__(limit_mb)
        self.base = base
        self.version = version
        self.mechanism = f"cgroup{version}"

    @classmethod
    def create(cls, version: int, limit_mb: int, *, pid: int | None = None) -> CgroupLimiter:
        """Make this nodelet's cgroup directory in the cgroup v``version`` hierarchy, or
        raise LimitUnavailable saying why that is not possible here."""
        pid = pid or os.getpid()
        here = own_cgroup_dir(version, pid)
        _sweep(here)
        if version == 2:
            _enable_memory_below(here, pid)
        base = os.path.join(here, f"bulletin-{pid}")
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(base)
            if version == 2:
                _write(base, "cgroup.subtree_control", "+memory")
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(base)
            why = _why(exc)
            raise LimitUnavailable(f"cgroup v{version}: cannot set up {base}: {why}") from None
        return cls(limit_mb, base, version)

    def describe(self) -> str:
        knob = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return f"{self.limit_mb} MiB per call (cgroup v{self.version} {knob})"

    def apply(self, pid: int) -> Cgroup:
        path = os.path.join(self.base, f"worker-{pid}")
        os.mkdir(path)
        limit = str(self.limit_mb * _MiB)
        try:
            if self.version == 2:
                _write(path, "memory.max", limit)
                _write(path, "memory.oom.group", "1", optional=True)  # Linux >= 4.19
                _write(path, "memory.swap.max", "0", optional=True)
            else:
                _write(path, "memory.limit_in_bytes", limit)
                _write(path, "memory.memsw.limit_in_bytes", limit, optional=True)
            _write(path, "cgroup.procs", str(pid))
        except OSError:
            os.rmdir(path)
            raise
        return Cgroup(path, self.version)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self.base)


class Cgroup:
    """One worker's cgroup: its out-of-memory kills, and killing what is left in it."""

    def __init__(self, path: str, version: int) -> None:
        self.path = path
        self.version = version
        self._final_oom_kills: int | None = None

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for memory (kept after removal)."""
        if self._final_oom_kills is not None:
            return self._final_oom_kills
        try:
            if self.version == 2:
                return _keyed(_read(self.path, "memory.events")).get("oom_kill", 0)
            counts = _keyed(_read(self.path, "memory.oom_control"))
            if "oom_kill" in counts:
                return counts["oom_kill"]
            # Kernels before 4.13 do not count kills: count the times the limit was hit.
            return int(_read(self.path, "memory.failcnt"))
        except (OSError, ValueError):
            return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup, those that left the worker's group too."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(self.path, "cgroup.kill", "1")
                return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        try:
            return [int(line) for line in _read(self.path, "cgroup.procs").split()]
        except OSError:
            return []

    def try_remove(self) -> bool:
        """Kill what is left and remove the cgroup; False while dying processes keep it
        busy (call again)."""
        if self._final_oom_kills is None:
            self._final_oom_kills = self.oom_kills()
        self.kill()
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise
        return True


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


def own_cgroup_dir(version: int, pid: int) -> str:
    """The directory of process ``pid``'s cgroup in the v``version`` memory hierarchy;
    LimitUnavailable when there is none or it is not visible."""
    try:
        with open(f"/proc/{pid}/mountinfo") as file:
            mounts = cgroup_mounts(file.read())
        with open(f"/proc/{pid}/cgroup") as file:
            paths = own_cgroups(file.read())
    except OSError as exc:
        raise LimitUnavailable(f"cannot read this process's cgroups: {_why(exc)}") from None
    key = "" if version == 2 else "memory"
    found = [m for m in mounts if m.version == version and (version == 2 or key in m.controllers)]
    if not found:
        what = "cgroup v2 hierarchy" if version == 2 else "cgroup v1 memory hierarchy"
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


def _enable_memory_below(here: str, pid: int) -> None:
    """Enable the v2 memory controller for ``here``'s children. The kernel refuses that
    while ``here`` holds processes (except at the root), so the nodelet first moves itself
    into a leaf ``bulletin-nodelet-<pid>``; other processes there make it impossible."""
    try:
        controllers = _read(here, "cgroup.controllers").split()
    except OSError as exc:
        raise LimitUnavailable(f"cgroup v2: cannot read {here}: {_why(exc)}") from None
    if "memory" not in controllers:
        why = (
            "it is bound to the cgroup v1 hierarchy"
            if _memory_on_v1(pid)
            else "run the nodelet in a cgroup with it delegated (systemd: Delegate=yes)"
        )
        raise LimitUnavailable(
            f"cgroup v2: the memory controller is not available in {here} (it has: "
            f"{' '.join(controllers) or 'none'}): {why}"
        )
    if "memory" in _read(here, "cgroup.subtree_control").split():
        return
    try:
        _write(here, "cgroup.subtree_control", "+memory")
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise LimitUnavailable(
                f"cgroup v2: cannot enable the memory controller below {here}: {_why(exc)}"
            ) from None
    leaf = os.path.join(here, f"bulletin-nodelet-{pid}")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf)
        _write(leaf, "cgroup.procs", str(pid))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(leaf)
        raise LimitUnavailable(f"cgroup v2: cannot use {here}: {_why(exc)}") from None
    try:
        _write(here, "cgroup.subtree_control", "+memory")
    except OSError as exc:
        with contextlib.suppress(OSError):
            _write(here, "cgroup.procs", str(pid))
            os.rmdir(leaf)
        others = len(_read(here, "cgroup.procs").split())
        raise LimitUnavailable(
            f"cgroup v2: cannot enable the memory controller below {here} ({_why(exc)}): "
            f"{others} other processes live there; run the nodelet in a cgroup of its own "
            "with the memory controller delegated (systemd: Delegate=yes)"
        ) from None


def _memory_on_v1(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/mountinfo") as file:
            mounts = cgroup_mounts(file.read())
    except OSError:
        return False
    return any(m.version == 1 and "memory" in m.controllers for m in mounts)


def _sweep(here: str) -> None:
    """Remove the empty cgroups that nodelets which are gone left behind (killed ones)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(here):
            prefix, _, owner = name.rpartition("-")
            if prefix not in ("bulletin", "bulletin-nodelet") or not owner.isdigit():
                continue
            if os.path.exists(f"/proc/{owner}"):
                continue
            directory = os.path.join(here, name)
            with contextlib.suppress(OSError):
                for child in os.listdir(directory):
                    if os.path.isdir(os.path.join(directory, child)):
                        os.rmdir(os.path.join(directory, child))
                os.rmdir(directory)


def set_address_space_limit(env: dict[str, str]) -> int | None:
    """In the worker: set ``RLIMIT_AS`` when the task asks for it (``RLIMIT_ENV``); the
    limit in MiB, or None. It can only be lowered, so the worker must not run another call."""
    limit_mb = address_space_limit(env)
    if limit_mb is None:
        return None
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = limit_mb * _MiB
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit_mb


def address_space_limit(env: dict[str, str]) -> int | None:
    """The ``RLIMIT_AS`` a task asks for, in MiB, or None."""
    value = env.get(RLIMIT_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _keyed(text: str) -> dict[str, int]:
    """``name value`` lines (memory.events, memory.oom_control) as a dict."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as file:
        return file.read()


def _write(directory: str, name: str, value: str, *, optional: bool = False) -> None:
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


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)
