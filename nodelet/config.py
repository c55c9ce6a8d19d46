"""The nodelet's settings, read once at start."""

from __future__ import annotations

import os
import re
import socket

import msgspec

from nodelet.limits import TRACKING


class NodeletConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one nodelet runs. Validated on construction; errors name the bad setting."""

    gateway_url: str
    token: str
    #: This node's name; its token must have been made for it ('bulletin node add NAME').
    name: str = msgspec.field(default_factory=socket.gethostname)
    #: Offer N CPU-backed fake GPUs instead of the NVIDIA GPUs found (none found: 2 fakes).
    fake_gpus: int | None = None
    #: Fake GPUs only: a file of injected faults ("0 xid 79", "1 ecc 2", "0 lost"), re-read
    #: at each health sample (see nodelet/gpus.py); for tests and drills.
    fake_gpu_faults: str = ""
    #: Fake GPUs only: make a character device file per fake GPU in this directory (needs
    #: root; no driver backs it), so GPU device isolation can be tried without GPUs.
    fake_gpu_device_dir: str = ""
    #: Slots for CPU-only calls (gpus=0); 0 means one per core.
    cpu_slots: int = 0
    #: Idle worker processes kept started ahead of demand.
    spare_workers: int = 2
    #: Idle workers kept started per GPU with that GPU visible, so (with warm_torch) their
    #: CUDA context exists before a call arrives; 0: none.
    gpu_spare_workers: int = 1
    #: The GPU counts that get such spares, comma-separated: for N, each aligned block of N
    #: GPUs (0..N-1, N..2N-1, ...) gets gpu_spare_workers spares of its own. Each holds a
    #: CUDA context (some 300-500 MiB) on each of its GPUs.
    gpu_spare_shapes: str = "1"
    #: Where attempts keep their files; empty means a fresh temporary directory.
    work_dir: str = ""
    #: Where the nodelet keeps what must outlive it: the record of its workers and their
    #: cgroups, which its next start reads to kill whatever it left running (after a crash,
    #: a SIGKILL). Empty: /var/lib/bulletin-nodelet/NAME as root, else a per-user state
    #: directory. Made 0700 where missing; refused if it is reached through a symbolic
    #: link, or belongs to another account. One per nodelet of a machine.
    state_dir: str = ""
    #: How the processes a call starts are tracked, so that all of them (setsid children,
    #: double-forked daemons) are killed when it ends, and after a nodelet crash: "cgroup2"
    #: or "cgroup1" (a cgroup per worker; needs a writable cgroup v2 directory, or a v1
    #: freezer or pids hierarchy), "cgroup" (either), "subreaper" (each worker adopts the
    #: orphans of what it started; no cgroup), or "auto" (a cgroup where one is usable,
    #: else the subreaper). See docs/limits.md.
    process_tracking: str = "auto"
    #: HTTP timeout in seconds, on top of the long-poll hold for poll requests.
    http_timeout_s: float = 10.0
    #: How often a running call's output is sent to the gateway, in seconds.
    log_flush_s: float = 0.02
    #: Seconds a call stopped at its time limit has between SIGTERM and SIGKILL.
    kill_grace_s: float = 10.0
    #: Memory per call in MiB, for its worker and what it spawns (cgroups where usable, else
    #: RLIMIT_AS; see docs/limits.md); 0 means no limit.
    memory_limit_mb: int = 0
    #: CPU cores per call, a hard cap (CFS quota, through cgroups where usable; see
    #: docs/limits.md); 0 means no cap. Concurrent calls share the CPU equally either way
    #: where cgroups are usable.
    cpu_limit: float = 0.0
    #: Workers import torch and run a throwaway optimizer step (torch._dynamo and friends
    #: load lazily on the first one) before their first call, when torch is installed, so a
    #: call's first training step does not pay for them. Counts against memory_limit_mb.
    warm_torch: bool = True
    #: Whose account runs a call: empty, the nodelet's own (single-tenant: only calls of
    #: administrators and trusted_users run); "same-name", the owner's Unix account of the
    #: same name; or a file of "bulletin-user unix-account" lines. Mapping needs the
    #: nodelet to run as root (docs/security.md).
    user_mapping: str = ""
    #: Single-tenant nodes only: users whose calls run here besides administrators',
    #: comma-separated, or * for every user. Their code runs as this nodelet's account and
    #: can read its token and other calls' work: only for users who trust each other.
    trusted_users: str = ""
    #: Variables of the nodelet's environment that workers get too, comma-separated (NAME,
    #: or NAME=VALUE to set one), besides PATH, locale, time zone and library paths; never
    #: the nodelet's own BULLETIN_* settings. Workers get nothing else of it.
    worker_env: str = ""
    #: A worker is recycled (a fresh one takes its place) after this many calls; 0: never.
    worker_max_calls: int = 1000
    #: A worker whose resident memory is over this many MiB after a call is recycled; 0: no
    #: bound (a call that leaks, or caches too much, would otherwise keep it).
    worker_max_rss_mb: int = 0

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError("invalid nodelet config: " + "; ".join(problems))

    @property
    def spare_shapes(self) -> tuple[int, ...]:
        """``gpu_spare_shapes`` as numbers."""
        parts = self.gpu_spare_shapes.split(",")
        return tuple(sorted({int(part) for part in parts if part.strip()}))

    @property
    def effective_cpu_slots(self) -> int:
        """``cpu_slots``, or the machine's CPU count when it is 0."""
        return self.cpu_slots or os.cpu_count() or 1


def _problems(config: NodeletConfig) -> list[str]:
    checks = [
        (
            config.gateway_url.startswith(("http://", "https://")),
            f"gateway_url must start with http:// or https://, got {config.gateway_url!r}",
        ),
        (bool(config.token.strip()), "token is empty: pass the node token (bn_...)"),
        (bool(config.name.strip()), "name is empty: give the node a name"),
        (
            config.fake_gpus is None or config.fake_gpus >= 0,
            f"fake_gpus must be None (discover) or >= 0, got {config.fake_gpus}",
        ),
        (config.cpu_slots >= 0, f"cpu_slots must be >= 0 (0 = all CPUs), got {config.cpu_slots}"),
        (config.spare_workers >= 0, f"spare_workers must be >= 0, got {config.spare_workers}"),
        (
            config.gpu_spare_workers >= 0,
            f"gpu_spare_workers must be >= 0, got {config.gpu_spare_workers}",
        ),
        (
            all(p.strip().isdigit() and int(p) > 0 for p in config.gpu_spare_shapes.split(","))
            or not config.gpu_spare_shapes.strip(),
            "gpu_spare_shapes must be GPU counts separated by commas (e.g. 1,2,8), got "
            f"{config.gpu_spare_shapes!r}",
        ),
        (config.cpu_limit >= 0, f"cpu_limit must be >= 0 (0 = no cap), got {config.cpu_limit}"),
        (config.http_timeout_s > 0, f"http_timeout_s must be > 0, got {config.http_timeout_s}"),
        (config.log_flush_s > 0, f"log_flush_s must be > 0, got {config.log_flush_s}"),
        (config.kill_grace_s >= 0, f"kill_grace_s must be >= 0, got {config.kill_grace_s}"),
        (
            config.process_tracking in TRACKING,
            f"process_tracking must be one of {', '.join(TRACKING)}, got "
            f"{config.process_tracking!r}",
        ),
        (
            not config.state_dir or os.path.isabs(config.state_dir),
            f"state_dir must be an absolute path, got {config.state_dir!r}",
        ),
        (
            config.worker_max_calls >= 0,
            f"worker_max_calls must be >= 0 (0: never), got {config.worker_max_calls}",
        ),
        (
            config.worker_max_rss_mb >= 0,
            f"worker_max_rss_mb must be >= 0 (0: no bound), got {config.worker_max_rss_mb}",
        ),
        (
            config.memory_limit_mb >= 0,
            f"memory_limit_mb must be >= 0 (0 = no limit), got {config.memory_limit_mb}",
        ),
        (
            not (config.trusted_users.strip() and config.user_mapping),
            "trusted_users is for single-tenant nodes: with a user_mapping every call runs as "
            "its owner's account; unset one of them",
        ),
        *((False, problem) for problem in _worker_env_problems(config.worker_env)),
    ]
    return [message for ok, message in checks if not ok]


def worker_env_names(setting: str) -> list[tuple[str, str | None]]:
    """``worker_env`` as (name, value) pairs; value None: taken from the nodelet's own."""
    pairs: list[tuple[str, str | None]] = []
    for item in (part.strip() for part in setting.split(",")):
        if item:
            name, equals, value = item.partition("=")
            pairs.append((name.strip(), value if equals else None))
    return pairs


def _worker_env_problems(setting: str) -> list[str]:
    problems = []
    for name, _ in worker_env_names(setting):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            problems.append(f"worker_env: {name!r} is not an environment variable name")
        elif name.upper().startswith("BULLETIN_"):
            problems.append(
                f"worker_env: {name} is one of the nodelet's own settings, which may hold "
                "secrets; workers never get them"
            )
    return problems
