"""The checks and file handling `bulletin up` relies on, without starting anything: the user
mapping's root requirement, secret files that are never readable by others, the directory
that keeps PostgreSQL's account out, and the role's URL and SCRAM secret."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulletin import admin
from bulletin.pgserver import Account, EmbeddedPostgres, PostgresError, blocking_directory
from bulletin.secretfiles import SecretFileError, read_secret, write_secret
from bulletin.up import UpError, UpSettings, check_host, check_user_mapping, node_mode


def test_a_user_mapping_without_root_is_refused_saying_what_to_do() -> None:
    for setting in ("same-name", "/etc/bulletin/users"):
        with pytest.raises(UpError, match="needs 'bulletin up' to run as root") as info:
            check_user_mapping(setting, euid=1000)
        assert "leave --user-mapping out for a single-tenant node" in str(info.value)
    check_user_mapping("", euid=1000)  # single-tenant: no root needed
    check_user_mapping("same-name", euid=0)


def test_a_user_mapping_file_that_is_not_there_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    with pytest.raises(UpError, match="neither 'same-name' nor a mapping file"):
        check_user_mapping(str(tmp_path / "missing"), euid=0)
    mapping = tmp_path / "users"
    mapping.write_text("alice alice\n")
    check_user_mapping(str(mapping), euid=0)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_a_secret_file_is_0600_even_under_a_umask_of_0(tmp_path: Path, loose_umask: None) -> None:
    path = tmp_path / "admin.token"
    write_secret(path, "bu_first\n")
    write_secret(path, "bu_second\n")  # replaced, not appended, still private
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "bu_second\n"
    assert [p.name for p in tmp_path.iterdir()] == ["admin.token"]  # no temporary left


def test_a_secret_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    elsewhere.chmod(0o644)
    link = tmp_path / "node.token"
    link.symlink_to(elsewhere)
    write_secret(link, "bn_secret\n")
    assert elsewhere.read_text() == "untouched"  # the link was replaced, not followed
    assert not link.is_symlink() and stat.S_IMODE(link.stat().st_mode) == 0o600


def test_a_world_readable_password_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match=f"chmod 600 {path}"):
        read_secret(path)
    path.chmod(0o640)  # a group (the gateway's service group) may read it
    assert read_secret(path) == "s3cret"


def test_the_first_directory_the_account_cannot_traverse_is_named() -> None:
    stranger = Account("stranger", uid=54321, gid=54321, groups=frozenset({54321}))
    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o711)
        locked = base / "locked"
        locked.mkdir(mode=0o700)
        assert blocking_directory(locked / "state" / "pgdata", stranger) == locked
        assert blocking_directory(base / "open" / "pgdata", stranger) is None
        # Linux checks the owner's bits for the owner, even where others' would allow it.
        owner = Account("owner", uid=os.getuid(), gid=99999, groups=frozenset({99999}))
        base.chmod(0o611)
        assert blocking_directory(base / "x", owner) == base
    finally:
        base.chmod(0o700)
        locked.rmdir()
        base.rmdir()


def test_the_roles_url_keeps_the_server_and_shows_the_password_only_when_asked() -> None:
    server = "postgresql://postgres:SUPER@127.0.0.1:5433/postgres"
    assert admin.role_url(server, "bulletin", "bulletin") == (
        "postgresql://bulletin@127.0.0.1:5433/bulletin"
    )
    assert admin.role_url(server, "bulletin", "db", "a/b@c") == (
        "postgresql://bulletin:a%2Fb%40c@127.0.0.1:5433/db"
    )
    socket = "postgresql:///postgres?host=/run/postgresql"
    assert admin.role_url(socket, "bulletin", "bulletin") == (
        "postgresql://bulletin@/bulletin?host=/run/postgresql"
    )


def test_the_scram_secret_is_what_a_client_proves_it_knows() -> None:
    secret = admin.scram_verifier("correct horse")
    method, rest = secret.split("$", 1)
    iterations_salt, keys = rest.split("$")
    iterations, salt = iterations_salt.split(":")
    stored_key, server_key = (base64.b64decode(k) for k in keys.split(":"))
    salted = hashlib.pbkdf2_hmac(
        "sha256", b"correct horse", base64.b64decode(salt), int(iterations)
    )
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    assert method == "SCRAM-SHA-256" and int(iterations) >= 4096
    assert hashlib.sha256(client_key).digest() == stored_key
    assert hmac.new(salted, b"Server Key", "sha256").digest() == server_key
    assert "correct horse" not in secret
    with pytest.raises(admin.AdminError, match="printable ASCII"):
        admin.scram_verifier("naïve")


def test_the_banner_says_whose_calls_run_and_how_to_add_users() -> None:
    state = Path("/var/lib/bulletin")
    single = " ".join(node_mode(UpSettings(state)))
    assert "single-tenant" in single and "administrators only" in single
    assert "refused here unless you trust them (--trusted-users" in single
    trusted = " ".join(node_mode(UpSettings(state, trusted_users="alice,bob")))
    assert "administrators and the trusted users alice,bob" in trusted
    everyone = " ".join(node_mode(UpSettings(state, trusted_users="*")))
    assert "every user" in everyone
    multi = " ".join(node_mode(UpSettings(state, user_mapping="same-name")))
    assert "multi-tenant" in multi and "owner's Unix account" in multi


def test_up_refuses_to_serve_plain_http_beyond_loopback() -> None:
    check_host("127.0.0.1")
    with pytest.raises(UpError, match=r"plain HTTP.*--tls-cert-file"):
        check_host("0.0.0.0")


def test_the_embedded_servers_socket_is_used_only_where_its_path_works(tmp_path: Path) -> None:
    plain = EmbeddedPostgres(tmp_path / "pgdata", port=5432, unix_socket=True)
    assert plain.socket_dir == tmp_path.resolve() / "pgsocket"
    assert EmbeddedPostgres(tmp_path / "pgdata", port=5432).socket_dir is None  # not asked
    # A socket's path holds 107 bytes, and -k splits a list at commas (in a shell, too).
    deep = tmp_path / ("d" * 90) / "pgdata"
    assert EmbeddedPostgres(deep, port=5432, unix_socket=True).socket_dir is None
    odd = tmp_path / "a,b" / "pgdata"
    assert EmbeddedPostgres(odd, port=5432, unix_socket=True).socket_dir is None


def test_a_socket_directory_others_may_enter_is_refused(tmp_path: Path) -> None:
    # Local connections are trusted: a socket directory another account may enter, left
    # there (or planted) before the server starts, must not be used.
    pg = EmbeddedPostgres(tmp_path / "pgdata", port=5432, unix_socket=True)
    sockets = tmp_path / "pgsocket"
    pg._prepare_socket_dir(sockets, None)  # made, for the server's account (here: ours)
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
    os.chmod(sockets, 0o755)
    with pytest.raises(PostgresError, match="closed to every other account"):
        pg._prepare_socket_dir(sockets, None)
    sockets.rmdir()
    sockets.symlink_to(tmp_path)
    with pytest.raises(PostgresError, match="must be a directory"):
        pg._prepare_socket_dir(sockets, None)
    sockets.unlink()
    sockets.symlink_to(tmp_path / "nowhere")  # dangling: not made through
    with pytest.raises(PostgresError, match="must be a directory"):
        pg._prepare_socket_dir(sockets, None)
    assert not (tmp_path / "nowhere").exists()
