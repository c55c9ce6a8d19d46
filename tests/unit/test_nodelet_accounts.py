"""Which Unix account runs a call: the user mapping, and a worker switching accounts for
real (as root, to 'nobody')."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from nodelet.accounts import AccountError, Accounts

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching accounts needs root")


def nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no 'nobody' account")


def test_single_tenant_by_default() -> None:
    accounts = Accounts.from_setting("")
    assert accounts.single_tenant and accounts.run_as("alice") is None


@as_root
def test_a_mapping_file_maps_users_and_refuses_the_rest(tmp_path: Path) -> None:
    account = nobody()
    mapping = tmp_path / "users"
    mapping.write_text(f"# lab accounts\nalice {account.pw_name}\nmallory root\n")
    accounts = Accounts.from_setting(str(mapping))
    run_as = accounts.run_as("alice")
    assert run_as is not None and (run_as.uid, run_as.gid) == (account.pw_uid, account.pw_gid)
    with pytest.raises(AccountError, match="not in this node's user mapping"):
        accounts.run_as("bob")
    with pytest.raises(AccountError, match="root account: refused"):
        accounts.run_as("mallory")
    same = Accounts.from_setting("same-name")
    assert same.run_as(account.pw_name) is not None
    with pytest.raises(AccountError, match="has no Unix account"):
        same.run_as("no-such-user-here")


@as_root
def test_a_malformed_mapping_is_refused_at_start(tmp_path: Path) -> None:
    mapping = tmp_path / "users"
    mapping.write_text("alice\n")
    with pytest.raises(ValueError, match="line 1: expected 'bulletin-user unix-account'"):
        Accounts.from_setting(str(mapping))


@as_root
def test_a_worker_switched_to_an_account_cannot_read_what_the_node_can(tmp_path: Path) -> None:
    account = nobody()
    secret = tmp_path / "node.token"
    secret.write_text("bn_secret")
    secret.chmod(0o600)
    # Like the nodelet's work directory: traversable (0711), the attempt's own inside it.
    work = Path(tempfile.mkdtemp(prefix="bulletin-accounts-"))
    work.chmod(0o711)
    workdir = work / "attempt"
    workdir.mkdir()
    os.chown(workdir, account.pw_uid, account.pw_gid)
    script = textwrap.dedent(
        f"""
        import os
        from nodelet.accounts import Accounts
        from nodelet.worker import become
        become(Accounts.from_setting("same-name").run_as("nobody"), {str(workdir)!r})
        try:
            open({str(secret)!r}).read()
            readable = True
        except PermissionError:
            readable = False
        print(os.getuid(), os.getgid(), os.getcwd(), os.environ["USER"], readable)
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    uid, gid, cwd, user, readable = done.stdout.split()
    assert (int(uid), int(gid)) == (account.pw_uid, account.pw_gid)
    assert cwd == str(workdir) and user == account.pw_name and readable == "False"
