"""Files a call's account writes, read by the nodelet without trusting them.

An attempt has a directory of its own in the nodelet's work directory, owned by the
nodelet; inside it the call's account owns one directory, ``out``: the call's working
directory, where its worker leaves a result too big to inline (its outcome comes on a pipe:
``nodelet.outcomes``). The user may put anything there: a symbolic link to the node token,
a FIFO that blocks whoever opens it, a hard link, a file of gigabytes. So the nodelet never
opens anything there by path: it keeps a descriptor of ``out`` from the moment it made it,
opens names relative to it with ``O_NOFOLLOW | O_NONBLOCK`` (a link is refused, a FIFO does
not block), checks with ``fstat`` that it has a regular file owned by the call's account,
and bounds its size. What it then uploads comes from that same descriptor.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from nodelet.errors import UntrustedFile

__all__ = [
    "Opened",
    "UntrustedFile",
    "make_private_dir",
    "open_owned",
]

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Opened:
    """A checked file: its descriptor (the caller closes it) and its size when opened."""

    fd: int
    size: int


def make_private_dir(parent: int, name: str, uid: int, gid: int) -> int:
    """Make directory ``name`` in ``parent`` (a descriptor), owned by ``uid``:``gid`` and
    mode 0700; return a descriptor of it, taken before the account could touch it."""
    os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        if (uid, gid) != (os.geteuid(), os.getegid()):
            os.fchown(fd, uid, gid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_owned(directory: int, name: str, uid: int, *, max_bytes: int | None = None) -> Opened:
    """Open ``name`` in ``directory`` for reading: a regular file owned by ``uid``, at most
    ``max_bytes`` long. Raises FileNotFoundError when it is not there, UntrustedFile when it
    is anything else."""
    try:
        fd = os.open(name, _OPEN, dir_fd=directory)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link; ENXIO: a socket; ...
        raise UntrustedFile(f"{name}: cannot be opened safely ({exc.strerror})") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "not a regular file"
    elif info.st_uid != uid:
        problem = f"owned by uid {info.st_uid}, not by the call's account (uid {uid})"
    elif max_bytes is not None and info.st_size > max_bytes:
        problem = f"{info.st_size} bytes, over the limit of {max_bytes}"
    if problem is not None:
        os.close(fd)
        raise UntrustedFile(f"{name}: {problem}")
    return Opened(fd, info.st_size)


def read_exactly(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes of ``fd`` from ``offset``; UntrustedFile if the file is shorter now."""
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise UntrustedFile(f"the result file shrank while it was uploaded (at byte {offset})")
    return data
