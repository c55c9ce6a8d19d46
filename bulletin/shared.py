"""The cluster's shared directory (the NAS): its layout, and how each side checks it sees it.

Every node mounts the shared directory at the same path. The gateway writes a random id to
``bulletin/cluster-id`` in it and tells clients and nodes the path and the id; a side that
reads the same id there sees the same directory, and big payloads and results then go as
files instead of through the gateway. Payload files are written by the sdk under
``bulletin/payloads/``, result files by workers under ``bulletin/results/``; both are named
by wire messages relative to the root (``wire.SharedPayload``, ``wire.SharedResult``).
The sdk deletes what it has consumed; the gateway sweeps what callers left behind.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import stat
import threading
import time
import uuid
from collections.abc import Iterable
from typing import BinaryIO

MARKER = "bulletin/cluster-id"
PAYLOADS = "bulletin/payloads"
RESULTS = "bulletin/results"
_RELATIVE = re.compile(r"^bulletin/(payloads|results)/[A-Za-z0-9_.-]{1,100}$")


def prepare(root: str) -> str:
    """Create the layout under ``root`` (writable by every user of the cluster) and return
    the cluster id, made on first use."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"the shared directory {root!r} does not exist or is no directory")
    for sub, mode in (("bulletin", 0o755), (PAYLOADS, 0o1777), (RESULTS, 0o1777)):
        path = os.path.join(root, sub)
        os.makedirs(path, exist_ok=True)
        # Users' notebooks write payloads and workers write results: everyone may create
        # files there, but (sticky, like /tmp) only replace or delete their own; nobody but
        # the gateway may replace the directories themselves.
        with contextlib.suppress(PermissionError):
            os.chmod(path, mode)
    marker = os.path.join(root, MARKER)
    with contextlib.suppress(FileNotFoundError):
        with open(marker, encoding="ascii") as file:
            existing = file.read().strip()
        if existing:
            return existing
    cluster_id = str(uuid.uuid4())
    temp = f"{marker}.{secrets.token_hex(4)}"
    with open(temp, "w", encoding="ascii") as file:
        file.write(cluster_id + "\n")
    os.replace(temp, marker)
    return cluster_id


def sees(root: str | None, cluster_id: str | None) -> bool:
    """Whether ``root`` here is the cluster's shared directory with id ``cluster_id``."""
    if not root or not cluster_id:
        return False
    try:
        with open(os.path.join(root, MARKER), encoding="ascii") as file:
            return file.read().strip() == cluster_id
    except (OSError, UnicodeDecodeError):
        return False


def resolve(root: str, relative: str) -> str:
    """The absolute path of a file named relative to the root; refuses any other name."""
    if not _RELATIVE.match(relative) or ".." in relative:
        raise ValueError(f"{relative!r} is not a payload or result file of the shared directory")
    return os.path.join(root, relative)


def relative(root: str, path: str) -> str | None:
    """``path`` relative to the root if it names a payload or result file there, else None."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    return rel if _RELATIVE.match(rel) and ".." not in rel else None


def new_payload(root: str) -> tuple[str, str]:
    """(relative, absolute) path for a new payload file."""
    rel = f"{PAYLOADS}/{uuid.uuid4().hex}.bin"
    return rel, os.path.join(root, rel)


def new_result(root: str, invocation_id: str) -> tuple[str, str]:
    """(relative, absolute) path for a new result file of an invocation."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "", invocation_id)[:40]
    rel = f"{RESULTS}/{safe}-{secrets.token_hex(8)}.bin"
    return rel, os.path.join(root, rel)


def _real_dir(root: str, sub: str) -> bool:
    """Whether ``root/sub`` is that directory itself, not a link to somewhere else."""
    path = os.path.join(root, sub)
    return os.path.realpath(path) == os.path.join(os.path.realpath(root), sub)


def open_file(root: str, name: str) -> BinaryIO | None:
    """Open a payload or result file (``name`` relative to the root) for reading, as the
    gateway serves it: a regular file inside the layout, never through a symbolic link a
    user put there (which could point at anything the gateway may read). None otherwise."""
    try:
        path = resolve(root, name)
    except ValueError:
        return None
    if not _real_dir(root, os.path.dirname(name)):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def remove(root: str, names: Iterable[str], keep: frozenset[str] = frozenset()) -> int:
    """Delete these payload and result files (relative to the root), except those in
    ``keep``; never anything outside the layout. Returns how many."""
    removed = 0
    for name in names:
        if name in keep:
            continue
        try:
            path = resolve(root, name)
        except ValueError:
            continue
        if _real_dir(root, os.path.dirname(name)):
            with contextlib.suppress(OSError):
                os.unlink(path)  # a link itself, never what it points at
                removed += 1
    return removed


def sweep(root: str, older_than_s: float, keep: frozenset[str] = frozenset()) -> int:
    """Delete payload and result files older than ``older_than_s``, except those named in
    ``keep`` (relative to the root); returns how many."""
    cutoff = time.time() - older_than_s
    removed = 0
    for sub in (PAYLOADS, RESULTS):
        if not _real_dir(root, sub):
            continue
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(os.path.join(root, sub)):
                if f"{sub}/{entry.name}" in keep:
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
    return removed


_doomed: queue.SimpleQueue[str] = queue.SimpleQueue()
_remover: threading.Thread | None = None
_remover_lock = threading.Lock()


def remove_later(path: str) -> None:
    """Delete a file in a background thread: unlinking a GiB file frees its page cache, which
    takes a noticeable fraction of a second that the caller need not wait for. A file left
    behind when the process exits first is swept by the gateway."""
    global _remover
    _doomed.put(path)
    with _remover_lock:
        if _remover is None:
            _remover = threading.Thread(target=_remove_forever, name="bulletin-remove", daemon=True)
            _remover.start()


def _remove_forever() -> None:
    while True:
        path = _doomed.get()
        with contextlib.suppress(OSError):
            os.unlink(path)
