"""Which Unix account runs a user's calls on this node.

Without a user mapping (the default) every worker runs as the nodelet's own account: a
single-tenant node, where users must trust each other (a call can read what the nodelet
can, its node token included). With one, a nodelet running as root runs each call as its
owner's Unix account, as SLURM does: ``same-name`` maps a Bulletin user to the account of
the same name; a file maps them line by line (``bulletin-user unix-account``, ``#``
comments). A user without an account, or mapped to root, is refused.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field

from bulletin import wire

SAME_NAME = "same-name"


class AccountError(Exception):
    """A call's owner cannot be run as any account here (the message says why)."""


@dataclass
class Accounts:
    """The node's user mapping; ``mapping`` is None for a single-tenant node."""

    setting: str = ""
    mapping: dict[str, str] | None = field(default=None)

    @classmethod
    def from_setting(cls, setting: str) -> Accounts:
        """Read a ``user_mapping`` setting ("", "same-name", or a file's path)."""
        if not setting:
            return cls()
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

    def run_as(self, user: str) -> wire.RunAs | None:
        """The account for ``user``'s calls; None on a single-tenant node."""
        if self.single_tenant:
            return None
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
        groups = os.getgrouplist(account, entry.pw_gid)
        return wire.RunAs(
            user=account, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups, home=entry.pw_dir
        )
