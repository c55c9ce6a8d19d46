"""What confines each call's worker: memory, CPU time and GPU device files. Find what this
machine can enforce, and enforce it (the cgroup plumbing is :mod:`nodelet.cgroups`).

:meth:`Limiter.detect` picks a mechanism per limit at nodelet start and logs it, with the
reason each better one is not usable. Each worker gets a cgroup of its own per hierarchy,
``<base>/worker-<pid>``, before it runs anything of a call; a nodelet's base is named for its
node (``bulletin-node-...``, so that its next start finds and sweeps it: :mod:`nodelet.leftovers`),
else ``bulletin-<nodelet pid>``.

Process tracking (``tracking``): every process a call starts is killed when the call ends.
``cgroup2`` or ``cgroup1`` give every worker a cgroup even without a limit (v2 where this
process's own v2 cgroup is writable, else the v1 freezer or pids hierarchy): membership is
inherited and cannot be left without root. ``subreaper``: no cgroup; the worker adopts the
orphans of what it starts (:func:`nodelet.procs.become_subreaper`), so its process tree holds
them all.

Memory (``memory_limit_mb``):

- ``cgroup2``: ``memory.max``, ``memory.swap.max = 0`` and ``memory.oom.group = 1`` (an
  out-of-memory kill takes the whole call), in a delegated cgroup v2 subtree. OOM kills are
  counted in ``memory.events``.
- ``cgroup1``: ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is
  accounted). The kernel kills the biggest process of the cgroup; kills are counted in
  ``memory.oom_control``.
- ``rlimit``: the last resort. The worker sets ``RLIMIT_AS`` on itself before it unpickles
  the call. That limits virtual address space, per process (each child gets its own), not
  resident memory: CUDA and torch reserve far more address space than they use. A
  ``MemoryError`` raised under it is reported as out of memory. The limit cannot be raised
  back, so such a worker runs one call only.
- ``none``: no limit (``memory_limit_mb = 0``).

CPU (``cpu_limit``): a CFS quota of that many cores per call, ``cpu.max`` (v2) or
``cpu.cfs_quota_us`` (v1). Since every worker has a cgroup of its own, concurrent calls also
share the CPU equally (the default weight), however many threads each starts. No cgroup: not
enforced, and the log says why.

GPU devices: a call's GPUs are ``CUDA_VISIBLE_DEVICES``; with the cgroup v1 devices
controller the worker is also denied the device files of every other GPU (``devices.deny``),
so resetting that variable, or opening ``/dev/nvidiaN`` directly, does not reach them. Spare
workers start with every GPU denied but their own, and are allowed their call's GPUs when
they get one. cgroup v2 filters devices only through an eBPF program, which is not done.

Only the standard library is imported here: the worker imports this module too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nodelet.cgroups import (
    Cgroup,
    LimitUnavailable,
    enable_below,
    make_base,
    own_cgroup_dir,
    write,
)

__all__ = ["RLIMIT_ENV", "Cgroup", "LimitUnavailable", "Limiter"]

log = logging.getLogger(__name__)

#: The WorkerTask env variable that asks a worker to set ``RLIMIT_AS`` (in MiB) on itself.
RLIMIT_ENV = "BULLETIN_RLIMIT_AS_MB"
_MiB = 1 << 20
#: The CFS period a CPU quota is counted in, in microseconds.
CPU_PERIOD_US = 100_000
_V2_ONLY_DEVICES = (
    "cgroup v2 filters devices only through an eBPF program, which the nodelet does not load"
)


class Limiter:
    """How each worker is confined. ``bases`` maps each controller in use ("memory",
    "cpu", "devices") to (cgroup version, this nodelet's directory there); ``gpu_devices``
    maps each GPU index to its device rules ("c 195:0")."""

    def __init__(
        self,
        memory_mb: int = 0,
        *,
        memory: str = "none",
        cpus: float = 0.0,
        bases: Mapping[str, tuple[int, str]] | None = None,
        gpu_devices: Mapping[int, tuple[str, ...]] | None = None,
        unusable: str = "",
        tracking: str = "subreaper",
        tracking_hierarchy: str = "",
    ) -> None:
        self.limit_mb = memory_mb
        #: How memory is limited: "none", "cgroup2", "cgroup1" or "rlimit".
        self.mechanism = memory
        self.cpus = cpus
        self.bases = dict(bases or {})
        self.gpu_devices = dict(gpu_devices or {})
        #: Why cgroups could not limit memory ("" when they do, or there is no limit).
        self.unusable = unusable
        #: How the processes a call starts are tracked: "cgroup2" or "cgroup1" (a cgroup
        #: per worker, ``bases["tracking"]``, in ``tracking_hierarchy``), or "subreaper".
        self.tracking = tracking
        self.tracking_hierarchy = tracking_hierarchy

    @classmethod
    def rlimit(cls, memory_mb: int) -> Limiter:
        """Memory limited by ``RLIMIT_AS`` only."""
        return cls(memory_mb, memory="rlimit")

    @classmethod
    def cgroups(
        cls,
        version: int,
        memory_mb: int = 0,
        *,
        cpus: float = 0.0,
        gpu_devices: Mapping[int, tuple[str, ...]] | None = None,
        pid: int | None = None,
    ) -> Limiter:
        """Every requested limit through cgroup v``version`` (devices: v1 only), or
        LimitUnavailable saying why that is not possible here."""
        pid = pid or os.getpid()
        wanted = _wanted(memory_mb, cpus, gpu_devices)
        if version == 2 and "devices" in wanted:
            raise LimitUnavailable(_V2_ONLY_DEVICES)
        here = own_cgroup_dir(2, pid) if version == 2 else ""
        name = f"bulletin-{pid}"
        bases = {c: (version, _base(version, c, pid, here, name)) for c in wanted}
        memory = f"cgroup{version}" if "memory" in bases else "none"
        return cls(memory_mb, memory=memory, cpus=cpus, bases=bases, gpu_devices=gpu_devices)

    @classmethod
    def detect(
        cls,
        memory_mb: int = 0,
        *,
        cpus: float = 0.0,
        gpu_devices: Mapping[int, tuple[str, ...]] | None = None,
        tracking: str = "subreaper",
        name: str | None = None,
        pid: int | None = None,
    ) -> Limiter:
        """The best mechanism for each limit this machine offers: ``memory_mb`` MiB and
        ``cpus`` cores per call (0: none), the GPUs' device files (``gpu_devices``, GPU
        index to device rules), and how the processes of a call are tracked (``tracking``,
        one of :data:`TRACKING`), logged with the reason each better one was not usable.
        The cgroups go into a directory ``name`` (default ``bulletin-<pid>``) below this
        process's own; LimitUnavailable if the ``tracking`` asked for is not usable."""
        pid = pid or os.getpid()
        name = name or f"bulletin-{pid}"
        bases: dict[str, tuple[int, str]] = {}
        problems: dict[str, list[str]] = {}
        # Read once: enabling a controller may move the nodelet into a leaf.
        v2_here: str | LimitUnavailable
        try:
            v2_here = own_cgroup_dir(2, pid)
        except LimitUnavailable as exc:
            v2_here = exc
        for controller in _wanted(memory_mb, cpus, gpu_devices):
            problems[controller] = []
            for version in (1,) if controller == "devices" else (2, 1):
                try:
                    if isinstance(v2_here, LimitUnavailable) and version == 2:
                        raise v2_here
                    here = v2_here if isinstance(v2_here, str) and version == 2 else ""
                    bases[controller] = (version, _base(version, controller, pid, here, name))
                    break
                except LimitUnavailable as exc:
                    problems[controller].append(str(exc))
        if "devices" in problems and "devices" not in bases:
            problems["devices"].append(_V2_ONLY_DEVICES)
        tracked = _tracking(tracking, pid, name, v2_here)
        problems["tracking"] = tracked.problems
        if tracked.base is not None:
            bases["tracking"] = tracked.base
        memory = "none"
        if memory_mb > 0:
            memory = f"cgroup{bases['memory'][0]}" if "memory" in bases else "rlimit"
        limiter = cls(
            memory_mb,
            memory=memory,
            cpus=cpus,
            bases=bases,
            gpu_devices=gpu_devices,
            unusable="; ".join(problems.get("memory", [])) if memory == "rlimit" else "",
            tracking=tracked.mechanism,
            tracking_hierarchy=tracked.hierarchy,
        )
        limiter._log(problems)
        return limiter

    def _log(self, problems: Mapping[str, list[str]]) -> None:
        if self.tracking == "subreaper" and problems.get("tracking"):
            log.warning(
                "process tracking: %s; no cgroup is usable for it: %s",
                self.describe_tracking(),
                "; ".join(problems["tracking"]),
            )
        else:
            log.info("process tracking: %s", self.describe_tracking())
        if self.mechanism == "none":
            log.info("no memory limit per call (memory_limit_mb = 0)")
        elif self.mechanism == "rlimit":
            log.warning(
                "memory limit: %s, a last resort that counts virtual memory (CUDA and "
                "torch reserve much more than they use); cgroups are not usable: %s",
                self.describe(),
                self.unusable,
            )
        else:
            log.info(
                "memory limit: %s, a cgroup per worker under %s%s",
                self.describe(),
                self.bases["memory"][1],
                f"; not {problems['memory'][0]}" if problems.get("memory") else "",
            )
        if self.cpus > 0 and "cpu" in self.bases:
            log.info("CPU limit: %s", self.describe_cpu())
        elif self.cpus > 0:
            log.warning(
                "CPU limit of %g cores per call NOT enforced: %s",
                self.cpus,
                "; ".join(problems.get("cpu", [])),
            )
        if "devices" in self.bases:
            log.info("GPU isolation: %s", self.describe_gpus())
        elif self.gpu_devices:
            log.warning(
                "GPU isolation: CUDA_VISIBLE_DEVICES only; device files NOT restricted: %s",
                "; ".join(problems.get("devices", [])),
            )

    @property
    def reuses_workers(self) -> bool:
        """Whether a worker may run another call: RLIMIT_AS cannot be raised back."""
        return self.mechanism != "rlimit"

    @property
    def base(self) -> str:
        """This nodelet's cgroup directory for memory (else for the first controller)."""
        version_base = self.bases.get("memory") or next(iter(self.bases.values()))
        return version_base[1]

    @property
    def version(self) -> int:
        return (self.bases.get("memory") or next(iter(self.bases.values())))[0]

    def describe(self) -> str:
        """The memory limit and how it is enforced, in words for logs and error messages."""
        if self.mechanism == "rlimit":
            return f"{self.limit_mb} MiB of address space per process (RLIMIT_AS)"
        if self.mechanism.startswith("cgroup"):
            knob = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
            return f"{self.limit_mb} MiB per call (cgroup v{self.version} {knob})"
        return "none"

    def describe_tracking(self) -> str:
        """How the processes of a call are tracked, to kill them all when it ends."""
        if self.tracking == "subreaper":
            also = sorted({f"cgroup v{v}" for v, _ in self.bases.values()})
            return (
                "subreaper (each worker, and the nodelet, adopts the orphans of what it "
                "started; a worker's process tree is killed)"
                + (f"; the limits' {', '.join(also)} cgroups catch it too" if also else "")
            )
        version, base = self.bases["tracking"]
        return (
            f"{self.tracking} (a cgroup per worker in the cgroup v{version} "
            f"{self.tracking_hierarchy} hierarchy, under {base}; frozen, then killed)"
        )

    def cgroup_bases(self) -> list[str]:
        """The directories this limiter made its workers' cgroups in."""
        return sorted({base for _, base in self.bases.values()})

    def describe_cpu(self) -> str:
        if "cpu" not in self.bases:
            return "none"
        version = self.bases["cpu"][0]
        knob = "cpu.max" if version == 2 else "cpu.cfs_quota_us"
        return f"{self.cpus:g} CPU cores per call (cgroup v{version} {knob})"

    def describe_gpus(self) -> str:
        if "devices" not in self.bases:
            return "CUDA_VISIBLE_DEVICES only"
        return "CUDA_VISIBLE_DEVICES, and other GPUs' device files denied (cgroup v1 devices)"

    def task_env(self) -> dict[str, str]:
        """Environment a call's WorkerTask carries for the worker to limit itself."""
        return {RLIMIT_ENV: str(self.limit_mb)} if self.mechanism == "rlimit" else {}

    def apply(self, pid: int, gpus: Iterable[int] = ()) -> Cgroup | None:
        """Confine a new worker process (before it gets a call); its cgroups, if any. Its
        device rules deny every GPU but ``gpus``."""
        if not self.bases:
            return None
        by_base: dict[str, list[str]] = {}
        for controller, (_, base) in self.bases.items():
            by_base.setdefault(base, []).append(controller)
        own = set(gpus)
        dirs: dict[str, str] = {}
        made: list[str] = []
        try:
            for base, controllers in by_base.items():
                path = os.path.join(base, f"worker-{pid}")
                try:
                    os.mkdir(path)
                except FileNotFoundError:  # removed by an earlier nodelet of this node, stopping
                    self._remake(base, controllers)
                    os.mkdir(path)
                made.append(path)
                for controller in controllers:
                    self._configure(controller, path, own)
                    dirs[controller] = path
                write(path, "cgroup.procs", str(pid))
        except OSError:
            for path in made:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        versions = {c: v for c, (v, _) in self.bases.items()}
        devices = self.gpu_devices if "devices" in self.bases else None
        return Cgroup(dirs, versions, gpu_devices=devices)

    def _remake(self, base: str, controllers: list[str]) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(base)
        handed_down = " ".join(f"+{c}" for c in controllers if c != "tracking")
        if self.bases[controllers[0]][0] == 2 and handed_down:
            write(base, "cgroup.subtree_control", handed_down)

    def _configure(self, controller: str, path: str, gpus: set[int]) -> None:
        version = self.bases[controller][0]
        if controller == "memory":
            limit = str(self.limit_mb * _MiB)
            if version == 2:
                write(path, "memory.max", limit)
                write(path, "memory.oom.group", "1", optional=True)  # Linux >= 4.19
                write(path, "memory.swap.max", "0", optional=True)
            else:
                write(path, "memory.limit_in_bytes", limit)
                write(path, "memory.memsw.limit_in_bytes", limit, optional=True)
        elif controller == "cpu":
            quota = max(1000, round(self.cpus * CPU_PERIOD_US))
            if version == 2:
                write(path, "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                write(path, "cpu.cfs_period_us", str(CPU_PERIOD_US))
                write(path, "cpu.cfs_quota_us", str(quota))
        elif controller == "devices":
            for index, rules in self.gpu_devices.items():
                if index not in gpus:
                    for rule in rules:
                        write(path, "devices.deny", f"{rule} rwm")

    def close(self) -> None:
        """Remove what the limiter made (once its workers are gone)."""
        for _, base in set(self.bases.values()):
            with contextlib.suppress(OSError):
                os.rmdir(base)


def _wanted(
    memory_mb: int, cpus: float, gpu_devices: Mapping[int, tuple[str, ...]] | None
) -> list[str]:
    wanted = [("memory", memory_mb > 0), ("cpu", cpus > 0), ("devices", bool(gpu_devices))]
    return [controller for controller, needed in wanted if needed]


def _base(version: int, controller: str, pid: int, v2_here: str, name: str) -> str:
    """This nodelet's directory for ``controller`` in cgroup v``version``."""
    if version == 2:
        here = v2_here or own_cgroup_dir(2, pid)
        enable_below(here, pid, controller)
    else:
        here = own_cgroup_dir(1, pid, controller)
    return make_base(here, name, version, [controller])


#: The settings of process tracking (``NodeletConfig.process_tracking``).
TRACKING = ("auto", "cgroup", "cgroup2", "cgroup1", "subreaper")
#: The cgroup v1 hierarchies tried for tracking, best first: the freezer stops every process
#: of a cgroup before the kill, so that none forks away meanwhile.
TRACKING_V1 = ("freezer", "pids")


@dataclass(frozen=True, slots=True)
class _Tracked:
    mechanism: str
    base: tuple[int, str] | None = None
    hierarchy: str = ""
    problems: list[str] = field(default_factory=list)


def _tracking(choice: str, pid: int, name: str, v2_here: str | LimitUnavailable) -> _Tracked:
    """How to track a call's processes, as ``choice`` asks, best first: a cgroup v2 where
    this process's own v2 cgroup is writable, else a v1 freezer or pids hierarchy; else the
    subreaper (unless a cgroup was asked for)."""
    if choice not in TRACKING:
        raise ValueError(f"process_tracking must be one of {', '.join(TRACKING)}: {choice!r}")
    versions = {"cgroup2": (2,), "cgroup1": (1,), "subreaper": ()}.get(choice, (2, 1))
    problems: list[str] = []
    for version in versions:
        for hierarchy in ("unified",) if version == 2 else TRACKING_V1:
            try:
                if version == 1:
                    here = own_cgroup_dir(1, pid, hierarchy)
                elif isinstance(v2_here, LimitUnavailable):
                    raise v2_here
                else:
                    here = v2_here
                base = make_base(here, name, version, [])
                return _Tracked(f"cgroup{version}", (version, base), hierarchy, problems)
            except LimitUnavailable as exc:
                problems.append(str(exc))
    if choice in ("auto", "subreaper"):
        return _Tracked("subreaper", problems=problems if choice == "auto" else [])
    raise LimitUnavailable(f"process tracking {choice!r} is not usable: {'; '.join(problems)}")


def device_rule(path: str) -> str | None:
    """The devices-cgroup rule ("c 195:0") for a device file, or None if it is not one."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if stat.S_ISCHR(info.st_mode):
        kind = "c"
    elif stat.S_ISBLK(info.st_mode):
        kind = "b"
    else:
        return None
    return f"{kind} {os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"


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
