"""The gateway's database role (least privilege): made by ``admin.ensure_role`` or
``bulletin db setup``, it owns Bulletin's database and can run every migration and what the
gateway does (advisory locks, LISTEN/NOTIFY), but no superuser action, and other roles of
the same server cannot even connect to its database."""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from bulletin import admin
from bulletin.pgserver import EmbeddedPostgres
from gateway import db


def fresh(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


async def refused(conn: asyncpg.Connection, statement: str) -> None:
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await conn.execute(statement)


async def _plain_owner(server_url: str) -> None:
    role, database, password = fresh("r"), fresh("d"), secrets.token_urlsafe(16)
    await admin.ensure_role(server_url, role, password, database)
    await admin.ensure_role(server_url, role, password, database)  # idempotent
    url = admin.role_url(server_url, role, database, password)
    assert len(await admin.migrate(url)) == len(db.migration_files())
    conn = await asyncpg.connect(url)
    try:
        me = await conn.fetchrow(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls"
            " FROM pg_roles WHERE rolname = current_user"
        )
        assert not any(me.values())
        owner = "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()"
        assert await conn.fetchval(owner) == role
        # What the gateway does besides plain SQL on its tables.
        assert await conn.fetchval("SELECT pg_try_advisory_lock(42)")
        heard: asyncio.Queue[str] = asyncio.Queue()
        await conn.add_listener(db.CHANNEL, lambda *args: heard.put_nowait(args[3]))
        await conn.execute("SELECT pg_notify($1, 'q')", db.CHANNEL)
        assert await asyncio.wait_for(heard.get(), 5) == "q"
        # A later migration may alter the tables: the role owns them.
        await conn.execute("ALTER TABLE users ADD COLUMN probe integer")
        for statement in (
            "COPY (SELECT 1) TO PROGRAM 'true'",
            "CREATE ROLE intruder",
            "ALTER SYSTEM SET work_mem = '8MB'",
            "CREATE DATABASE another",
            f"ALTER ROLE {role} SUPERUSER",
        ):
            await refused(conn, statement)
    finally:
        await conn.close()
    token = await admin.add_user(url, "alice")
    assert await admin.token_valid(url, token)


def test_the_role_owns_its_database_and_nothing_more(pg_server: EmbeddedPostgres) -> None:
    asyncio.run(_plain_owner(pg_server.url()))


async def _adopts(server_url: str) -> None:
    # A database a superuser made and migrated, as `bulletin up` did before it had a role.
    role, database, password = fresh("r"), fresh("d"), secrets.token_urlsafe(16)
    await admin.ensure_database(server_url, database)
    superuser_db = server_url.rsplit("/", 1)[0] + f"/{database}"
    await admin.migrate(superuser_db)
    token = await admin.add_user(superuser_db, "bob")
    await admin.ensure_role(server_url, role, password, database)
    url = admin.role_url(server_url, role, database, password)
    assert await admin.migrate(url) == []
    assert await admin.token_valid(url, token)
    await admin.add_node(url, "gpu-01")
    conn = await asyncpg.connect(url)
    try:
        others = await conn.fetchval(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace"
            " AND relowner <> (SELECT oid FROM pg_roles WHERE rolname = current_user)"
        )
        assert others == 0
        await conn.execute("ALTER TABLE invocations ADD COLUMN probe integer")
    finally:
        await conn.close()


def test_the_role_adopts_a_database_a_superuser_migrated_before(
    pg_server: EmbeddedPostgres,
) -> None:
    asyncio.run(_adopts(pg_server.url()))


async def _strangers(server_url: str) -> None:
    mine, theirs = fresh("r"), fresh("r")
    database, password = fresh("d"), secrets.token_urlsafe(16)
    await admin.ensure_role(server_url, mine, password, database)
    await admin.ensure_role(server_url, theirs, password, fresh("d"))
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await asyncpg.connect(admin.role_url(server_url, theirs, database, password))


def test_another_role_of_the_server_cannot_connect_to_bulletins_database(
    pg_server: EmbeddedPostgres,
) -> None:
    asyncio.run(_strangers(pg_server.url()))


def setup_command(server_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bulletin", "db", "setup", *args],
        env={**os.environ, "BULLETIN_SUPERUSER_URL": server_url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_db_setup_prints_the_url_without_the_password_and_keeps_it_private(
    pg_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    role, database, password_file = fresh("r"), fresh("d"), tmp_path / "bulletin.password"
    args = ["--role", role, "--database", database, "--password-file", str(password_file)]
    first = setup_command(pg_server.url(), *args)
    assert first.returncode == 0, first.stderr
    password = password_file.read_text().strip()
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    url = first.stdout.strip()
    assert url == f"postgresql://{role}@127.0.0.1:{pg_server.port}/{database}"
    assert password not in first.stdout + first.stderr
    again = setup_command(pg_server.url(), *args)  # reuses the password it made
    assert again.returncode == 0, again.stderr
    assert password_file.read_text().strip() == password
    with_password = admin.role_url(pg_server.url(), role, database, password)
    assert asyncio.run(admin.migrate(with_password))
    password_file.chmod(0o644)
    refused = setup_command(pg_server.url(), *args)
    assert refused.returncode != 0 and f"chmod 600 {password_file}" in refused.stderr
