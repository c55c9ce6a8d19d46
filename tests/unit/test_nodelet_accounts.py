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


def test_single_tenant_by_default_runs_only_administrators_and_trusted_users() -> None:
    accounts = Accounts.from_setting("", "bob, carol")
    assert accounts.single_tenant
    assert accounts.run_as("root-of-the-lab", admin=True) is None  # its own account
    assert accounts.run_as("bob") is None and accounts.run_as("carol") is None
    with pytest.raises(AccountError) as refused:
        accounts.run_as("mallory")
    # What to do, in words: enable mapping, or trust the user.
    assert "--user-mapping same-name" in str(refused.value)
    assert "--trusted-users" in str(refused.value)
    assert Accounts.from_setting("", "*").run_as("anyone") is None


@as_root
def test_a_mapping_file_maps_users_and_refuses_the_rest(
    tmp_path: Path, unix_accounts: dict[str, int]
) -> None:
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
    mapped = same.run_as("bt-alice")
    assert mapped is not None and mapped.uid == unix_accounts["bt-alice"]
    with pytest.raises(AccountError, match="has no Unix account"):
        same.run_as("no-such-user-here")
    # Anyone may be a Bulletin user named like a system account: same-name never maps to
    # one ('postgres' owns the database's files; 'nobody' is nobody's). A file may.
    for system in ("nobody", "postgres", "daemon"):
        with pytest.raises(AccountError, match="a system account"):
            same.run_as(system)


@as_root
def test_a_malformed_mapping_is_refused_at_start(tmp_path: Path) -> None:
    mapping = tmp_path / "users"
    mapping.write_text("alice\n")
    with pytest.raises(ValueError, match="line 1: expected 'bulletin-user unix-account'"):
        Accounts.from_setting(str(mapping))


@as_root
def test_a_worker_switched_to_an_account_cannot_read_what_the_node_can(
    tmp_path: Path, unix_accounts: dict[str, int]
) -> None:
    account = pwd.getpwnam("bt-alice")
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
        from nodelet.worker_main import become
        become(Accounts.from_setting("same-name").run_as("bt-alice"), {str(workdir)!r})
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
