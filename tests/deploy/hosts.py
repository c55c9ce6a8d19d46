"""Booted Debian hosts for the rollout tests: systemd-nspawn containers on this machine.

Each host is a Debian 12 root booted with ``systemd-nspawn --boot`` (a real systemd as PID 1,
units, journald), reached over SSH as root on a port of its own on 127.0.0.1: the containers
share this machine's network, so every service in them gets its own loopback port and
nothing is sent anywhere else. Their roots are overlays over one base image, made with
``debootstrap`` and kept in :data:`CACHE` between runs (about 75 s to make, 750 MB); each
host writes only to its own upper layer, removed when the host is.

The base image has what the playbook would otherwise download from Debian for every host
(``postgresql``, ``python3-venv``, ``openssh-server``, ``python3-apt``), so a test run needs
the Debian mirror only to build the image; PostgreSQL is installed but not enabled, as on a
host where the playbook has yet to configure it.

``python -m tests.deploy.hosts up DIR`` boots the three test hosts and leaves them running
(for working on the playbook by hand); ``python -m tests.deploy.hosts down DIR`` stops them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bulletin.pgserver import free_port

MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-venv",
    "python3-apt",
    "python3-packaging",
    "openssh-server",
    "postgresql",
    "iproute2",
    "ca-certificates",
    "procps",
)
#: Where base images are kept between runs; one per package list (its name has their hash).
CACHE = Path(os.environ.get("BULLETIN_TEST_IMAGE_CACHE", "/var/cache/bulletin-test"))
#: Where the shared directory (the lab's NAS) is mounted on every host.
SHARED_MOUNT = "/srv/bulletin-shared"
SSH_OPTIONS = (
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "BatchMode=yes",
    "-o", "ConnectTimeout=5",
)  # fmt: skip


class HostError(RuntimeError):
    """A test host could not be made, booted or reached (the message says why)."""


def base_image() -> Path:
    """The cached base root, made with debootstrap where it is missing."""
    digest = hashlib.sha256(" ".join((MIRROR, SUITE, *PACKAGES)).encode()).hexdigest()[:12]
    image = CACHE / f"{SUITE}-{digest}"
    if (image / "etc" / "os-release").exists():
        return image
    for tool in ("debootstrap", "systemd-nspawn"):
        if shutil.which(tool) is None:
            raise HostError(f"{tool} is missing: apt-get install debootstrap systemd-container")
    CACHE.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f"{image.name}.", dir=CACHE))
    try:
        _run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
             str(building), MIRROR],
            what="debootstrap of the base image",
        )  # fmt: skip
        # Installed, not yet configured by the playbook: off until it enables it.
        _run(["chroot", str(building), "systemctl", "disable", "postgresql"], what="chroot")
        _run(["chroot", str(building), "apt-get", "clean"], what="chroot")
        (building / "etc" / "machine-id").write_text("")  # each boot makes its own
        building.rename(image)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return image


@dataclass(frozen=True)
class Host:
    """A booted test host."""

    name: str
    ssh_port: int
    dir: str  # its overlay's layers and its log, on this machine
    pid: int  # systemd-nspawn's

    @property
    def root(self) -> Path:
        return Path(self.dir) / "merged"

    def ssh(
        self, command: str, *, key: Path, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (a shell line) on the host as root."""
        result = subprocess.run(
            ["ssh", "-i", str(key), "-p", str(self.ssh_port), *SSH_OPTIONS, "root@127.0.0.1",
             command],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise HostError(
                f"on {self.name}: {command!r} exited {result.returncode}: "
                f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        return result


def ssh_key(where: Path) -> Path:
    """A fresh SSH key pair for root on the test hosts (the private key's path)."""
    key = where / "id_ed25519"
    if not key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], what="ssh-keygen")
    return key


def boot(name: str, where: Path, *, key: Path, shared: Path) -> Host:
    """Boot host ``name`` with its layers under ``where``/``name`` and ``shared`` mounted at
    :data:`SHARED_MOUNT`; returns once root can log in over SSH."""
    image = base_image()
    layers = where / name
    for part in ("upper", "work", "merged"):
        (layers / part).mkdir(parents=True, exist_ok=True)
    merged = layers / "merged"
    _run(
        ["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={image},upperdir={layers / 'upper'},workdir={layers / 'work'}", str(merged)],
        what="mounting the host's overlay",
    )  # fmt: skip
    port = free_port()
    (merged / "etc" / "hostname").write_text(f"{name}\n")
    (merged / "etc" / "ssh" / "sshd_config.d" / "test.conf").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\n"
    )
    dot_ssh = merged / "root" / ".ssh"
    dot_ssh.mkdir(mode=0o700, exist_ok=True)
    (dot_ssh / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    (dot_ssh / "authorized_keys").chmod(0o600)
    log = open(layers / "console.log", "wb")  # noqa: SIM115 - kept by the container's process
    process = subprocess.Popen(
        ["systemd-nspawn", "--quiet", "--boot", "--register=no", "--keep-unit",
         "--console=passive", f"--machine={name}", f"--hostname={name}",
         f"--bind={shared}:{SHARED_MOUNT}", "-D", str(merged)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()
    host = Host(name=name, ssh_port=port, dir=str(layers), pid=process.pid)
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            _unmount(merged)
            console = (layers / "console.log").read_text(errors="replace")[-3000:]
            raise HostError(f"{name} did not boot (systemd-nspawn exited):\n{console}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            if host.ssh("true", key=key, check=False, timeout=10).returncode == 0:
                break
        if time.monotonic() > deadline:
            stop(host, key=key)
            raise HostError(f"{name}: no SSH on 127.0.0.1:{port} within 120 s")
        time.sleep(0.3)
    state = host.ssh("systemctl is-system-running --wait", key=key, check=False, timeout=120)
    if state.stdout.strip() not in ("running", "degraded"):
        raise HostError(f"{name} booted to {state.stdout.strip()!r}")
    return host


def stop(host: Host, *, key: Path) -> None:
    """Power the host off (SIGKILL after 30 s) and remove its overlay."""
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        host.ssh("systemctl poweroff --no-block", key=key, check=False, timeout=10)
    deadline = time.monotonic() + 30
    while _alive(host.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(host.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(host.pid, signal.SIGKILL)
        while _alive(host.pid):
            time.sleep(0.1)
    _unmount(host.root)
    shutil.rmtree(host.dir, ignore_errors=True)


@contextlib.contextmanager
def hosts(names: Sequence[str], where: Path) -> Iterator[tuple[list[Host], Path, Path]]:
    """Boot ``names`` with a shared directory between them: (hosts, ssh key, shared dir)."""
    key = ssh_key(where)
    shared = where / "shared"
    shared.mkdir(exist_ok=True)
    booted: list[Host] = []
    try:
        for name in names:
            booted.append(boot(name, where, key=key, shared=shared))
        yield booted, key, shared
    finally:
        for host in booted:
            stop(host, key=key)


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (another process booted it): probe it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return waited == 0


def _unmount(path: Path) -> None:
    if os.path.ismount(path):
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def _run(command: list[str], *, what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise HostError(f"{what} failed ({result.returncode}): {result.stderr[-3000:]}")


def main(argv: Sequence[str]) -> None:
    """``up DIR`` boots head, node1 and node2 and writes DIR/hosts.json; ``down DIR``."""
    action, where = argv[0], Path(argv[1]).resolve()
    where.mkdir(parents=True, exist_ok=True)
    state = where / "hosts.json"
    key = ssh_key(where)
    if action == "up":
        shared = where / "shared"
        shared.mkdir(exist_ok=True)
        booted = [boot(name, where, key=key, shared=shared) for name in ("head", "node1", "node2")]
        state.write_text(json.dumps([asdict(host) for host in booted]))
        for host in booted:
            print(f"{host.name}: ssh -i {key} -p {host.ssh_port} root@127.0.0.1")
    else:
        for entry in json.loads(state.read_text()):
            stop(Host(**entry), key=key)
        state.unlink()


if __name__ == "__main__":
    main(sys.argv[1:])
