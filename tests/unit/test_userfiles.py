"""Reading what a user's account left, as root, without trusting it: the nodelet's
``out`` directory (nodelet/userfiles.py) and the shared directory's user directories
(bulletin_core/shared.py). Each case is a file a user could plant."""

from __future__ import annotations

import os
import pwd
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulletin_core import shared
from nodelet.userfiles import UntrustedFile, make_private_dir, open_owned


@pytest.fixture
def out(tmp_path: Path) -> Iterator[int]:
    """A directory as the nodelet makes it for an attempt: ours, held open."""
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fd = make_private_dir(parent, "out", os.geteuid(), os.getegid())
    os.close(parent)
    yield fd
    os.close(fd)


def read_owned(directory: int, name: str, uid: int, *, max_bytes: int) -> bytes | None:
    """What the nodelet reads of ``name`` through :func:`open_owned`; None when missing."""
    try:
        opened = open_owned(directory, name, uid, max_bytes=max_bytes)
    except FileNotFoundError:
        return None
    try:
        return os.pread(opened.fd, opened.size, 0)
    finally:
        os.close(opened.fd)


def nobody() -> pwd.struct_passwd:
    return pwd.getpwnam("nobody")


def test_a_regular_file_of_the_account_is_read_whole(tmp_path: Path, out: int) -> None:
    (tmp_path / "out" / "outcome").write_bytes(b"abc")
    assert read_owned(out, "outcome", os.geteuid(), max_bytes=3) == b"abc"
    assert read_owned(out, "missing", os.geteuid(), max_bytes=3) is None
    longer = os.urandom(1 << 20)
    (tmp_path / "out" / "outcome").write_bytes(longer)
    assert read_owned(out, "outcome", os.geteuid(), max_bytes=len(longer)) == longer
    with pytest.raises(UntrustedFile, match="over the limit"):
        read_owned(out, "outcome", os.geteuid(), max_bytes=len(longer) - 1)


def test_a_symbolic_link_is_never_followed(tmp_path: Path, out: int) -> None:
    secret = tmp_path / "token"
    secret.write_text("bn_secret")
    (tmp_path / "out" / "outcome").symlink_to(secret)
    with pytest.raises(UntrustedFile, match="cannot be opened safely"):
        read_owned(out, "outcome", os.geteuid(), max_bytes=100)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path, out: int) -> None:
    os.mkfifo(tmp_path / "out" / "outcome")
    result: list[BaseException] = []

    def read() -> None:
        try:
            read_owned(out, "outcome", os.geteuid(), max_bytes=100)
        except BaseException as exc:
            result.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(result[0], UntrustedFile) and "not a regular file" in str(result[0])


def test_another_accounts_file_is_refused(tmp_path: Path, out: int) -> None:
    # A hard link to a file of another account (root's node token, say) looks just like it.
    planted = tmp_path / "out" / "outcome"
    planted.write_bytes(b"root's")
    os.chown(planted, nobody().pw_uid, nobody().pw_gid)
    with pytest.raises(UntrustedFile, match="owned by uid"):
        read_owned(out, "outcome", os.geteuid(), max_bytes=100)


def test_a_file_over_the_limit_is_refused_unread(tmp_path: Path, out: int) -> None:
    with open(tmp_path / "out" / "outcome", "wb") as file:
        file.truncate(1 << 40)  # sparse: a terabyte for free
    started = time.monotonic()
    with pytest.raises(UntrustedFile, match="over the limit"):
        read_owned(out, "outcome", os.geteuid(), max_bytes=1 << 20)
    assert time.monotonic() - started < 1


def test_what_is_opened_is_what_is_read_even_if_the_name_is_swapped(
    tmp_path: Path, out: int
) -> None:
    (tmp_path / "out" / "result").write_bytes(b"mine")
    opened = open_owned(out, "result", os.geteuid())
    try:
        secret = tmp_path / "token"
        secret.write_text("bn_secret")
        os.unlink(tmp_path / "out" / "result")
        (tmp_path / "out" / "result").symlink_to(secret)
        assert os.pread(opened.fd, 100, 0) == b"mine"
    finally:
        os.close(opened.fd)


def test_the_private_directory_is_the_accounts_alone(tmp_path: Path) -> None:
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    account = nobody()
    fd = make_private_dir(parent, "out", account.pw_uid, account.pw_gid)
    os.close(parent)
    info = os.fstat(fd)
    os.close(fd)
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (
        account.pw_uid,
        account.pw_gid,
        0o700,
    )


# ------------------------------------------------------------- the shared directory's layout


@pytest.fixture
def nas(tmp_path: Path) -> Path:
    root = tmp_path / "nas"
    root.mkdir()
    shared.prepare(str(root))
    return root


def test_names_are_derived_and_parsed_back(nas: Path) -> None:
    name = shared.result_name("alice", "0b3c-d", 2)
    assert name == "bulletin/users/alice/result-0b3c-d-2.bin"
    assert shared.parse(name) == shared.Name("alice", "result", "0b3c-d-2")
    assert shared.is_payload_of(shared.payload_name("alice"), "alice")
    assert not shared.is_payload_of(shared.payload_name("alice"), "bob")
    for bad in ("../x", "bulletin/users/../x/payload-a.bin", "bulletin/users/a/b/payload-c.bin"):
        assert shared.parse(bad) is None
    with pytest.raises(ValueError):
        shared.user_dir("../etc")


def test_a_file_is_written_privately_and_read_back(nas: Path) -> None:
    name = shared.payload_name("alice")
    path = shared.write_file(str(nas), name, [b"a", memoryview(b"bc")])
    assert Path(path).read_bytes() == b"abc"
    user_dir = nas / shared.user_dir("alice")
    assert user_dir.stat().st_mode & 0o777 == 0o700 and Path(path).stat().st_mode & 0o777 == 0o600
    with shared.open_file(str(nas), name, uid=os.geteuid()) as file:
        assert file.read() == b"abc"


def test_a_user_directory_that_is_a_link_or_anothers_or_open_to_all_is_refused(
    nas: Path, tmp_path: Path
) -> None:
    name = shared.payload_name("alice")
    user_dir = nas / shared.user_dir("alice")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    user_dir.symlink_to(elsewhere)
    with pytest.raises(shared.UnsafeSharedDir, match="not a directory"):
        shared.write_file(str(nas), name, [b"x"])
    user_dir.unlink()
    user_dir.mkdir(mode=0o700)
    os.chown(user_dir, nobody().pw_uid, nobody().pw_gid)
    with pytest.raises(shared.UnsafeSharedDir, match="belongs to uid"):
        shared.write_file(str(nas), name, [b"x"])
    os.chown(user_dir, 0, 0)
    user_dir.chmod(0o777)
    with pytest.raises(shared.UnsafeSharedDir, match="writable by its group or others"):
        shared.open_file(str(nas), name)


def test_a_shared_file_that_is_a_link_a_fifo_or_not_its_owners_is_refused(
    nas: Path, tmp_path: Path
) -> None:
    shared.write_file(str(nas), shared.payload_name("alice"), [b"x"])  # makes the directory
    user_dir = nas / shared.user_dir("alice")
    secret = tmp_path / "token"
    secret.write_text("bn_secret")
    link, fifo, foreign = (shared.payload_name("alice") for _ in range(3))
    (nas / link).symlink_to(secret)
    os.mkfifo(nas / fifo)
    (nas / foreign).write_bytes(b"planted")
    os.chown(nas / foreign, nobody().pw_uid, nobody().pw_gid)
    with pytest.raises(shared.UnsafeSharedDir, match="symbolic link"):
        shared.open_fd(str(nas), link)
    for name in (fifo, foreign):
        with pytest.raises(shared.UnsafeSharedDir, match="not a regular file of its"):
            shared.open_fd(str(nas), name)
    assert user_dir.is_dir()


def test_the_sweep_removes_only_old_files_of_the_layout(nas: Path) -> None:
    old = shared.write_file(str(nas), shared.result_name("alice", "a", 1), [b"x"])
    new = shared.write_file(str(nas), shared.result_name("alice", "b", 1), [b"x"])
    payload = shared.write_file(str(nas), shared.payload_name("alice"), [b"x"])
    other = nas / shared.user_dir("alice") / "notes.txt"
    other.write_text("mine")
    hour_ago = time.time() - 3600
    for path in (old, payload, other):
        os.utime(path, (hour_ago, hour_ago))
    assert shared.sweep(str(nas), 60, user="alice", kinds=("result",)) == 1
    assert not Path(old).exists() and Path(new).exists() and Path(payload).exists()
    assert other.exists()


def test_a_layout_whose_users_directory_anyone_may_rename_in_is_refused(nas: Path) -> None:
    (nas / shared.USERS).chmod(0o777)  # not sticky: anyone could rename another's directory
    with pytest.raises(shared.UnsafeSharedDir, match="not sticky"):
        shared.write_file(str(nas), shared.payload_name("alice"), [b"x"])
    shared.prepare(str(nas))  # the gateway puts it right at start
    shared.write_file(str(nas), shared.payload_name("alice"), [b"x"])
