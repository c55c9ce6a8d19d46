"""The cluster's shared directory (the NAS): its layout, and how each side uses it safely.

Every node mounts the shared directory at the same path. The gateway writes a random id to
``bulletin/cluster-id`` in it and tells clients and nodes the path and the id; a side that
reads the same id there sees the same directory, and big payloads and results then go as
files instead of through the gateway.

Every file belongs to one user and one invocation::

    bulletin/                     the gateway's, 0755
    bulletin/cluster-id
    bulletin/users/               the gateway's, 1733: anyone may make a directory, nobody may
                                  list, rename or delete another's
    bulletin/users/<user>/        the user's own account, 0700 (made on first use)
        payload-<random>.bin      a call's payload, written by the user's sdk
        result-<invocation>-<epoch>.bin   a result, written by the user's worker

Names are derived, never trusted: the gateway accepts a payload file only under the
submitter's own directory and a result file only under the name derived from its
invocation, owner and epoch (:func:`result_name`). Files are opened relative to directory
descriptors with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``: a regular file
owned by the owner of its user directory, which nobody else may write to. So no user can
make another's call, worker, sdk or the gateway read a file of their choosing, and uploads of
different users never share a name.

A user who makes the directory of a user who has not used the shared directory yet only
takes that user's fast path: that user's sdk and workers see that the directory is not
their own (:class:`UnsafeSharedDir`), say so, and fall back to sending through the gateway.
The sdk deletes what it has consumed; the gateway sweeps what callers left, where its
account may (a user's 0700 directory is the user's to clean: the sdk removes its own old
files too).
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import re
import secrets
import stat
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from bulletin_core import wire

MARKER = "bulletin/cluster-id"
USERS = "bulletin/users"
_USER = re.compile(f"^{wire.SLUG}$")
_FILE = re.compile(wire.SHARED_FILE)
# O_PATH: a directory one may pass through but not list (users/ is 1733) is still opened.
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeSharedDir(OSError):
    """A user directory (or file) of the shared directory cannot be trusted: not a real
    directory, not its user's own, or writable by others. The message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Name:
    """A shared file's name, parsed."""

    user: str
    kind: str  # "payload" or "result"
    stem: str


def parse(relative: str) -> Name | None:
    """The parts of a payload or result file's name (relative to the root), or None."""
    match = _FILE.match(relative)
    if match is None:
        return None
    return Name(match["user"], match["kind"], match["stem"])


def valid_user(user: str) -> bool:
    """Whether ``user`` can name a directory of the shared directory."""
    return bool(_USER.match(user))


def user_dir(user: str) -> str:
    """The user's directory, relative to the root."""
    if not _USER.match(user):
        raise ValueError(f"user name {user!r} cannot name a directory of the shared directory")
    return f"{USERS}/{user}"


def payload_name(user: str) -> str:
    """A new payload file's name (relative to the root) in ``user``'s directory."""
    return f"{user_dir(user)}/payload-{uuid.uuid4().hex}.bin"


def result_name(user: str, invocation_id: str, epoch: int) -> str:
    """The one name the result of this attempt may have (relative to the root)."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "", invocation_id)[:80]
    return f"{user_dir(user)}/result-{stem}-{int(epoch)}.bin"


def is_payload_of(relative: str, user: str) -> bool:
    """Whether ``relative`` names a payload file in ``user``'s own directory."""
    name = parse(relative)
    return name is not None and name.kind == "payload" and name.user == user


def path(root: str, relative: str) -> str:
    """The absolute path of a payload or result file; refuses any other name."""
    if parse(relative) is None:
        raise ValueError(f"{relative!r} is not a payload or result file of the shared directory")
    return os.path.join(root, relative)


def prepare(root: str) -> str:
    """Create the layout under ``root`` (the gateway, at start) and return the cluster id,
    made on first use."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"the shared directory {root!r} does not exist or is no directory")
    for sub, mode in (("bulletin", 0o755), (USERS, 0o1733)):
        where = os.path.join(root, sub)
        with contextlib.suppress(FileExistsError):
            os.mkdir(where, mode)
        info = os.lstat(where)
        if not stat.S_ISDIR(info.st_mode):
            raise UnsafeSharedDir(f"{where} is not a directory (a link?): remove it")
        if info.st_uid == os.geteuid():
            # Users' sdks and workers make their own directories in users/; sticky and not
            # listable (1733), nobody may see, replace or delete another's.
            os.chmod(where, mode)
        elif info.st_uid != 0:
            raise UnsafeSharedDir(
                f"{where} belongs to uid {info.st_uid}, neither the gateway's account nor "
                "root: someone else made it; remove it and restart the gateway"
            )
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


def _open_users(root: str) -> int:
    """``root/bulletin/users`` as a descriptor, never through a symbolic link; neither
    ``bulletin`` nor ``users`` may let another account replace what is in them (``users``
    may be writable by all only when sticky, as the gateway makes it)."""
    fd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the root itself: the admin's mount
    try:
        for part in USERS.split("/"):
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            mode = os.fstat(fd).st_mode
            if mode & 0o022 and not mode & stat.S_ISVTX:
                raise UnsafeSharedDir(
                    f"{root}/{part} is writable by others and not sticky (mode "
                    f"{stat.S_IMODE(mode):o}): anyone could replace its entries; the gateway "
                    "makes it right at start (or chmod it yourself)"
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_user_dir(root: str, user: str, *, uid: int | None = None, create: bool = False) -> int:
    """``user``'s directory as a descriptor, made (0700) when ``create`` and missing.

    Raises :class:`UnsafeSharedDir` when it is not a real directory, is writable by its
    group or others, or is not owned by ``uid`` (when given; the caller's own account when
    it creates it)."""
    name = user_dir(user).rsplit("/", 1)[1]
    users = _open_users(root)
    try:
        if create:
            uid = os.geteuid() if uid is None else uid
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=users)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=users)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                where = f"{root}/{user_dir(user)}"
                raise UnsafeSharedDir(f"{where} is not a directory (a link?)") from None
            raise
    finally:
        os.close(users)
    try:
        _check_dir(os.fstat(fd), f"{root}/{user_dir(user)}", uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_dir(info: os.stat_result, where: str, uid: int | None) -> None:
    if uid is not None and info.st_uid != uid:
        raise UnsafeSharedDir(
            f"{where} belongs to uid {info.st_uid}, not to uid {uid}: another account made it "
            "before its user did; the cluster's admin should remove it (until then, big state "
            "goes through the gateway)"
        )
    if info.st_mode & 0o022:
        raise UnsafeSharedDir(
            f"{where} is writable by its group or others (mode {stat.S_IMODE(info.st_mode):o}): "
            "anyone could put files there; make it 0700 (chmod 700)"
        )


def open_file(root: str, relative: str, *, uid: int | None = None) -> BinaryIO:
    """Open a payload or result file for reading (see :func:`open_fd`)."""
    return os.fdopen(open_fd(root, relative, uid=uid), "rb")


def open_fd(root: str, relative: str, *, uid: int | None = None) -> int:
    """A descriptor of a payload or result file, for reading: a regular file in its user's
    directory, owned by that directory's owner (who must be ``uid`` when given), never
    through a link, never blocking (a FIFO is refused, not waited on). Raises ValueError for
    a name outside the layout, :class:`UnsafeSharedDir` for a file that is not what it
    claims to be, OSError when it cannot be read (missing, no access)."""
    name = parse(relative)
    if name is None:
        raise ValueError(f"{relative!r} is not a payload or result file of the shared directory")
    directory = open_user_dir(root, name.user, uid=uid)
    try:
        fd = os.open(relative.rsplit("/", 1)[1], _READ_FLAGS, dir_fd=directory)
        owner = os.fstat(directory).st_uid
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeSharedDir(f"{root}/{relative} is a symbolic link") from None
        raise
    finally:
        os.close(directory)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != owner:
        os.close(fd)
        raise UnsafeSharedDir(
            f"{root}/{relative} is not a regular file of its directory's owner (uid {owner})"
        )
    return fd


def write_file(
    root: str, relative: str, pieces: Iterable[bytes | memoryview], *, create: bool = True
) -> str:
    """Write a payload or result file of one's own (in one's own user directory, made on
    first use when ``create``), through a temporary name no one else can take; returns its
    absolute path. Raises :class:`UnsafeSharedDir` when the user directory is not this
    account's own, FileNotFoundError when it is missing and not ``create``."""
    name = parse(relative)
    if name is None:
        raise ValueError(f"{relative!r} is not a payload or result file of the shared directory")
    directory = open_user_dir(root, name.user, uid=os.geteuid(), create=create)
    final = relative.rsplit("/", 1)[1]
    temp = f".{final}.{secrets.token_hex(6)}.part"
    try:
        fd = os.open(temp, _CREATE_FLAGS, 0o600, dir_fd=directory)
        try:
            with os.fdopen(fd, "wb") as file:
                for piece in pieces:
                    file.write(piece)
            os.rename(temp, final, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise
    finally:
        os.close(directory)
    return os.path.join(root, relative)


def remove(root: str, names: Iterable[str], keep: frozenset[str] = frozenset()) -> int:
    """Delete these payload and result files (relative to the root), except those in
    ``keep``, where this account may; never anything outside the layout. Returns how many."""
    removed = 0
    for relative in names:
        name = parse(relative)
        if name is None or relative in keep:
            continue
        with contextlib.suppress(OSError):
            directory = open_user_dir(root, name.user)
            try:
                os.unlink(relative.rsplit("/", 1)[1], dir_fd=directory)  # a link, never its target
                removed += 1
            finally:
                os.close(directory)
    return removed


def sweep(
    root: str,
    older_than_s: float,
    keep: frozenset[str] = frozenset(),
    user: str | None = None,
    kinds: tuple[str, ...] = ("payload", "result"),
) -> int:
    """Delete files of ``kinds`` and left-over temporary files older than ``older_than_s``,
    except those named in ``keep`` (relative to the root), in every user directory this
    account may enter (only ``user``'s when given); returns how many."""
    cutoff = time.time() - older_than_s
    removed = 0
    try:
        users = [user] if user is not None else _user_names(root)
    except OSError:
        return 0
    for name in users:
        try:
            directory = _listable(open_user_dir(root, name))
        except (OSError, ValueError):
            continue  # not ours to enter (a user's 0700 directory), or gone
        try:
            removed += _sweep_dir(directory, user_dir(name), cutoff, keep, kinds)
        finally:
            os.close(directory)
    return removed


def _user_names(root: str) -> list[str]:
    users = _listable(_open_users(root))
    try:
        return [entry for entry in os.listdir(users) if _USER.match(entry)]
    finally:
        os.close(users)


def _listable(directory: int) -> int:
    """A descriptor of the same directory that can be listed (``directory`` is closed)."""
    try:
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
    finally:
        os.close(directory)


def _sweep_dir(
    directory: int, prefix: str, cutoff: float, keep: frozenset[str], kinds: tuple[str, ...]
) -> int:
    removed = 0
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            name = parse(f"{prefix}/{entry.name}")
            ours = name.kind in kinds if name is not None else entry.name.endswith(".part")
            if not ours or f"{prefix}/{entry.name}" in keep:
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode) and info.st_mtime < cutoff:
                    os.unlink(entry.name, dir_fd=directory)
                    removed += 1
    return removed


_doomed: queue.SimpleQueue[str] = queue.SimpleQueue()
_remover: threading.Thread | None = None
_remover_lock = threading.Lock()


def remove_later(path: str) -> None:
    """Delete a file in a background thread: unlinking a GiB file frees its page cache, which
    takes a noticeable fraction of a second that the caller need not wait for. A file left
    behind when the process exits first is swept later."""
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
