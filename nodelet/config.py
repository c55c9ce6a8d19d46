"""The nodelet's settings, read once at start."""

from __future__ import annotations

import os
import re
import socket
from typing import Annotated

import msgspec

from bulletin_core.settings import AT_LEAST_0, POSITIVE, check, doc
from nodelet.limits import TRACKING


class NodeletConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one nodelet runs. Validated on construction; errors name the bad setting."""

    gateway_url: Annotated[str, doc("The gateway's URL, e.g. http://head:8420")]
    token: Annotated[str, doc("This node's token (bn_...), made by 'bulletin node add NAME'.")]
    ca_file: Annotated[str, doc("""
        The CA certificate (PEM) that signed an https:// gateway's certificate, when it is not
        one the system trusts. Empty: the system's CAs.
    """)] = ""
    name: Annotated[str, doc("""
        This node's name; its token must have been made for it ('bulletin node add NAME').
    """)] = msgspec.field(default_factory=socket.gethostname)
    fake_gpus: (
        Annotated[int, AT_LEAST_0, doc("""
            Offer N CPU-backed fake GPUs instead of the NVIDIA GPUs found (none found: 2
            fakes).
        """)]
        | None
    ) = None
    fake_gpu_faults: Annotated[str, doc("""
        Fake GPUs only: a file of injected faults ("0 xid 79", "1 ecc 2", "0 lost"), re-read at
        each health sample (see nodelet/gpus.py); for tests and drills.
    """)] = ""
    fake_gpu_model: Annotated[str, doc("""
        Fake GPUs only: the model name they report (empty: "Fake GPU"), so that placement
        by model and quotas per model can be tried without GPUs.
    """)] = ""
    fake_gpu_device_dir: Annotated[str, doc("""
        Fake GPUs only: make a character device file per fake GPU in this directory (needs root;
        no driver backs it), so GPU device isolation can be tried without GPUs.
    """)] = ""
    cpu_slots: Annotated[int, AT_LEAST_0, doc("""
        Slots for CPU-only calls (gpus=0); 0 means one per core.
    """)] = 0
    spare_workers: Annotated[int, AT_LEAST_0, doc("""
        Idle worker processes kept started ahead of demand.
    """)] = 2
    gpu_spare_workers: Annotated[int, AT_LEAST_0, doc("""
        Idle workers kept started per GPU with that GPU visible, so (with warm_torch) their CUDA
        context exists before a call arrives; 0: none.
    """)] = 1
    gpu_spare_shapes: Annotated[str, doc("""
        The GPU counts that get such spares, comma-separated: for N, each aligned block of N
        GPUs (0..N-1, N..2N-1, ...) gets gpu_spare_workers spares of its own. Each holds a CUDA
        context (some 300-500 MiB) on each of its GPUs.
    """)] = "1"
    work_dir: Annotated[str, doc("""
        Where attempts keep their files; empty means a fresh temporary directory, removed
        when the nodelet stops (one a killed nodelet left is removed by the next nodelet of
        the same account to start on the machine).
    """)] = ""
    state_dir: Annotated[str, doc("""
        Where the nodelet keeps what must outlive it: the record of its workers and their
        cgroups, which its next start reads to kill whatever it left running (after a crash, a
        SIGKILL). Empty: /var/lib/bulletin-nodelet/NAME as root, else a per-user state
        directory. Made 0700 where missing; refused if it is reached through a symbolic link, or
        belongs to another account. One per nodelet of a machine.
    """)] = ""
    process_tracking: Annotated[str, doc("""
        How the processes a call starts are tracked, so that all of them (setsid children,
        double-forked daemons) are killed when it ends, and after a nodelet crash: "cgroup2" or
        "cgroup1" (a cgroup per worker; needs a writable cgroup v2 directory, or a v1 freezer or
        pids hierarchy), "cgroup" (either), "subreaper" (each worker adopts the orphans of what
        it started; no cgroup), or "auto" (a cgroup where one is usable, else the subreaper).
        See docs/limits.md.
    """)] = "auto"
    http_timeout_s: Annotated[float, POSITIVE, doc("""
        HTTP timeout in seconds, on top of the long-poll hold for poll requests.
    """)] = 10.0
    log_flush_s: Annotated[float, POSITIVE, doc("""
        How often a running call's output is sent to the gateway, in seconds.
    """)] = 0.02
    kill_grace_s: Annotated[float, AT_LEAST_0, doc("""
        Seconds a call stopped at its time limit has between SIGTERM and SIGKILL.
    """)] = 10.0
    memory_limit_mb: Annotated[int, AT_LEAST_0, doc("""
        Memory per call in MiB, for its worker and what it spawns (cgroups where usable, else
        RLIMIT_AS; see docs/limits.md); 0 means no limit.
    """)] = 0
    cpu_limit: Annotated[float, AT_LEAST_0, doc("""
        CPU cores per call, a hard cap (CFS quota, through cgroups where usable; see
        docs/limits.md); 0 means no cap. Concurrent calls share the CPU equally either way where
        cgroups are usable.
    """)] = 0.0
    warm_torch: Annotated[bool, doc("""
        Workers import torch and run a throwaway optimizer step (torch._dynamo and friends load
        lazily on the first one) before their first call, when torch is installed, so a call's
        first training step does not pay for them. Counts against memory_limit_mb.
    """)] = True
    user_mapping: Annotated[str, doc("""
        Whose account runs a call: empty, the nodelet's own (single-tenant: only calls of
        administrators and trusted_users run); "same-name", the owner's Unix account of the same
        name; or a file of "bulletin-user unix-account" lines. Mapping needs the nodelet to run
        as root (docs/security.md).
    """)] = ""
    trusted_users: Annotated[str, doc("""
        Single-tenant nodes only: users whose calls run here besides administrators', comma-
        separated, or * for every user. Their code runs as this nodelet's account and can read
        its token and other calls' work: only for users who trust each other.
    """)] = ""
    worker_env: Annotated[str, doc("""
        Variables of the nodelet's environment that workers get too, comma-separated (NAME, or
        NAME=VALUE to set one), besides PATH, locale, time zone and library paths; never the
        nodelet's own BULLETIN_* settings. Workers get nothing else of it.
    """)] = ""
    worker_max_calls: Annotated[int, AT_LEAST_0, doc("""
        A worker is recycled (a fresh one takes its place) after this many calls; 0: never.
        Each recycling costs a process start with its imports (torch: about a second of CPU),
        so a low bound slows down maps of short calls.
    """)] = 100_000
    worker_max_rss_mb: Annotated[int, AT_LEAST_0, doc("""
        A worker whose resident memory is over this many MiB after a call is recycled; 0: no
        bound (a call that leaks, or caches too much, would otherwise keep it).
    """)] = 0

    def __post_init__(self) -> None:
        check(self, "nodelet", _problems(self))

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
            all(p.strip().isdigit() and int(p) > 0 for p in config.gpu_spare_shapes.split(","))
            or not config.gpu_spare_shapes.strip(),
            "gpu_spare_shapes must be GPU counts separated by commas (e.g. 1,2,8), got "
            f"{config.gpu_spare_shapes!r}",
        ),
        (
            not config.ca_file or os.path.isfile(config.ca_file),
            f"ca_file {config.ca_file!r} is not a file: give the PEM file of the CA that signed "
            "the gateway's certificate",
        ),
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
