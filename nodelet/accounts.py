"""Which Unix account runs a user's calls on this node, and whose calls it runs at all.

Without a user mapping (the default) every worker runs as the nodelet's own account: a
single-tenant node. A call there could read what the nodelet can (its node token, its
files, other calls' workers), so such a node runs only the calls of administrators and of
the users it is told to trust (``trusted_users``; ``*``: everyone, for a cluster whose users
all trust each other); anyone else's call is refused with what to do.

With a mapping, a nodelet running as root runs each call as its owner's Unix account, as
SLURM does: ``same-name`` maps a Bulletin user to the account of the same name; a file maps
them line by line (``bulletin-user unix-account``, ``#`` comments). A user without an
account, or mapped to root, is refused.
"""

from __future__ import annotations

import os
import pwd
import site
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from bulletin_core import wire

SAME_NAME = "same-name"


class AccountError(Exception):
    """A call's owner cannot be run as any account here (the message says why)."""


#: ``trusted_users`` value: every user's calls run on a single-tenant node.
EVERYONE = "*"


@dataclass
class Accounts:
    """The node's user mapping (``mapping`` is None for ``same-name``; ``setting`` is empty
    for a single-tenant node), and the users a single-tenant node trusts."""

    setting: str = ""
    mapping: dict[str, str] | None = field(default=None)
    #: Single-tenant only: users whose calls run besides administrators' (``*``: everyone).
    trusted: frozenset[str] = frozenset()

    @classmethod
    def from_setting(cls, setting: str, trusted_users: str = "") -> Accounts:
        """Read a ``user_mapping`` setting ("", "same-name", or a file's path) and, for a
        single-tenant node, ``trusted_users`` (comma-separated user names, or ``*``)."""
        trusted = frozenset(u.strip() for u in trusted_users.split(",") if u.strip())
        if not setting:
            return cls(trusted=trusted)
        if os.geteuid() != 0:
            raise ValueError(
                f"user_mapping {setting!r} needs the nodelet to run as root (it switches "
                "each worker to its user's account); run it as root or unset user_mapping"
            )
        if setting == SAME_NAME:
            return cls(setting)
        try:
            with open(setting, encoding="utf-8") as file:
                lines = [line.split("#", 1)[0].split() for line in file]
        except OSError as exc:
            raise ValueError(f"cannot read the user mapping {setting}: {exc}") from None
        mapping = {}
        for number, words in enumerate(lines, 1):
            if not words:
                continue
            if len(words) != 2:
                raise ValueError(f"{setting} line {number}: expected 'bulletin-user unix-account'")
            mapping[words[0]] = words[1]
        return cls(setting, mapping)

    @property
    def single_tenant(self) -> bool:
        return not self.setting

    @staticmethod
    def check_interpreter() -> None:
        """Refuse to serve when the Python that workers run, and what it imports, cannot be
        read by other accounts: a worker switched to its user's account could not import
        anything more (say, a venv under /root, which is 0700)."""
        blocked = unreachable(_worker_paths())
        if blocked is not None:
            raise ValueError(
                f"user_mapping: workers switch to their users' accounts, which cannot reach "
                f"{blocked} on the way to this nodelet's Python ({sys.executable}) or its "
                "packages: install Bulletin in a virtual environment every account can read, "
                "made from an interpreter they can run (e.g. /usr/bin/python3 -m venv "
                "/opt/bulletin)"
            )

    def describe(self) -> str:
        """Whose calls this node runs, and as which account (for the log)."""
        if not self.single_tenant:
            return f"each call runs as its owner's Unix account (user mapping {self.setting})"
        if EVERYONE in self.trusted:
            whom = "every user's calls (trusted_users = *: users must trust each other)"
        else:
            whom = "only calls of administrators" + (
                f" and of {', '.join(sorted(self.trusted))}" if self.trusted else ""
            )
        return f"single-tenant: {whom} run, as this nodelet's own account {_me()!r}"

    def run_as(self, user: str, *, admin: bool = False) -> wire.RunAs | None:
        """The account for ``user``'s calls; None on a single-tenant node (the nodelet's own).
        Raises AccountError when this node must not run them."""
        if self.single_tenant:
            if admin or user in self.trusted or EVERYONE in self.trusted:
                return None
            raise AccountError(
                f"it is single-tenant: it runs every call as its own Unix account {_me()!r}, "
                "where a call could read the node's token and other users' work, so it runs "
                f"only calls of administrators and of the users it trusts, and not {user!r}'s. "
                "The cluster's admin can run the nodelet as root with --user-mapping same-name "
                "(each call runs as its owner's Unix account), or, only if every user may see "
                f"all this node can, add {user!r} to its --trusted-users"
            )
        account = user if self.mapping is None else self.mapping.get(user)
        if not account:
            raise AccountError(f"user {user!r} is not in this node's user mapping {self.setting}")
        try:
            entry = pwd.getpwnam(account)
        except KeyError:
            raise AccountError(
                f"user {user!r} has no Unix account {account!r} on this node: ask the admin "
                "to create it, or to map the user to an existing account"
            ) from None
        if entry.pw_uid == 0:
            raise AccountError(f"user {user!r} maps to {account!r}, a root account: refused")
        low, high = login_uid_range()
        if self.mapping is None and not low <= entry.pw_uid <= high:
            # Bulletin user names are anyone's to ask for: 'postgres', 'embedded_postgres' or
            # a service's name must not hand its account (its files, its database) to a call.
            raise AccountError(
                f"user {user!r} would run as {account!r} (uid {entry.pw_uid}), a system "
                f"account: same-name maps only to login accounts (uids {low} to {high}, "
                "UID_MIN and UID_MAX of /etc/login.defs); a mapping file may name it if that "
                "is meant"
            )
        groups = os.getgrouplist(account, entry.pw_gid)
        return wire.RunAs(
            user=account, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups, home=entry.pw_dir
        )


def unreachable(paths: Sequence[str]) -> str | None:
    """The first directory or file on the way to ``paths`` that other accounts cannot
    reach (a directory without o+x, a file without o+r), as "PATH (mode NNNN)"; None if all
    can be. Judged by the bits for "others": a user's account is neither owner nor group."""
    for path in paths:
        real = os.path.realpath(path)
        parts = real.split(os.sep)
        for end in range(1, len(parts) + 1):
            step = os.sep.join(parts[:end]) or os.sep
            try:
                mode = os.stat(step).st_mode
            except OSError:
                break  # a sys.path entry that does not exist: nothing to import from it
            need = stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH
            if not mode & need:
                return f"{step} (mode {stat.S_IMODE(mode):04o})"
    return None


def login_uid_range(path: str = "/etc/login.defs") -> tuple[int, int]:
    """UID_MIN and UID_MAX of ``path`` (1000 and 60000 where it does not say)."""
    found = {"UID_MIN": 1000, "UID_MAX": 60000}
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            for line in file:
                words = line.split()
                if len(words) >= 2 and words[0] in found and words[1].isdigit():
                    found[words[0]] = int(words[1])
    except OSError:
        pass
    return found["UID_MIN"], found["UID_MAX"]


def _worker_paths() -> list[str]:
    """What a worker reads to start and to import Bulletin and its dependencies."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [sys.executable, os.path.dirname(os.__file__), os.path.join(here, "worker_main.py")]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths += site.getsitepackages()
    return paths


def _me() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"
