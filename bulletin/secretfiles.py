"""Files that hold a secret (tokens, database passwords, client.toml).

Such a file is readable by no other account at any moment: it is created with mode 0600
(``O_EXCL | O_NOFOLLOW``, so never through a link someone planted), filled, and only then
renamed over its final name, so a reader never sees it half-written or with a wider mode.
Writing the text first and tightening the mode after would leave a window in which the file
has the umask's mode (0644 by default).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_secret(path: Path, text: str, *, uid: int = -1, gid: int = -1) -> None:
    """Write ``text`` to ``path`` (replacing it), mode 0600, owned by ``uid``/``gid`` when
    given (-1: the caller's)."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(temp, _CREATE, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            os.fchmod(fd, 0o600)  # the umask may only have narrowed it; make it exact
            if uid != -1 or gid != -1:
                os.fchown(fd, uid, gid)
            file.write(text)
            file.flush()
            os.fsync(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


class SecretFileError(Exception):
    """A file that should hold a secret is not fit to (the message says what to do)."""


def read_secret(path: Path) -> str:
    """The stripped text of a secret file, refused if it is not a regular file or if any
    account may read it (others' permission bits)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, encoding="utf-8") as file:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SecretFileError(f"{path} is not a regular file")
        if mode & 0o007:
            raise SecretFileError(
                f"{path} holds a secret but everyone may read it (mode {mode & 0o777:04o}): "
                f"chmod 600 {path}"
            )
        return file.read().strip()
