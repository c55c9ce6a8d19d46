"""The numbered migrations, applied in order to a fresh database, build exactly the schema
checked in as ``gateway/db/schema.sql`` (``pg_dump --schema-only``, normalised), so a
migration's effect shows in review and the file documents the schema as it is.

After adding a migration, regenerate the file (it starts its own PostgreSQL)::

    .venv/bin/python -m tests.integration.test_schema
"""

from __future__ import annotations

import asyncio
import difflib
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from bulletin.pgserver import EmbeddedPostgres, binaries
from gateway import db
from tests.accounts import traversable_dir

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "gateway" / "db" / "schema.sql"
REGENERATE = ".venv/bin/python -m tests.integration.test_schema"


def normalise(dump: str) -> str:
    """The dump without what says nothing about the schema: comments, session settings
    (``SET``, ``set_config``), psql meta-commands (``\\restrict`` with its random key, in
    newer pg_dump releases) and runs of blank lines."""
    kept = [
        line.rstrip()
        for line in dump.splitlines()
        if not line.startswith(("--", "SET ", "SELECT pg_catalog.set_config(", "\\"))
    ]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip() + "\n"


def dump_schema(url: str) -> str:
    pg_dump = binaries() / "bin" / "pg_dump"
    done = subprocess.run(
        [str(pg_dump), "--schema-only", "--no-owner", "--no-privileges", "--dbname", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return normalise(done.stdout)


async def _migrated_fresh_database(server_url: str, url_of: Callable[[str], str]) -> str:
    """Create an empty database (from template1, not the tests' migrated template), apply
    every migration in order, and return its URL."""
    name = f"schema_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(server_url)
    try:
        await db.ensure_database(conn, name)
    finally:
        await conn.close()
    conn = await asyncpg.connect(url_of(name))
    try:
        await db.migrate(conn)
    finally:
        await conn.close()
    return url_of(name)


def built_schema(server_url: str, url_of: Callable[[str], str]) -> str:
    """What the migrations build on the server, normalised."""
    return dump_schema(asyncio.run(_migrated_fresh_database(server_url, url_of)))


def test_migrations_build_the_checked_in_schema(pg_server: EmbeddedPostgres) -> None:
    built = built_schema(pg_server.url("postgres"), pg_server.url)
    checked_in = SCHEMA.read_text() if SCHEMA.exists() else ""
    if built != checked_in:
        diff = difflib.unified_diff(
            checked_in.splitlines(), built.splitlines(), "schema.sql", "migrations", lineterm=""
        )
        shown = list(diff)[:60]
        pytest.fail(
            f"gateway/db/schema.sql is out of date: run {REGENERATE}\n" + "\n".join(shown),
            pytrace=False,
        )


def test_normalise_drops_noise() -> None:
    dump = (
        "--\n-- PostgreSQL database dump\n--\n\\restrict AbC123\n\n"
        "SET statement_timeout = 0;\n"
        "SELECT pg_catalog.set_config('search_path', '', false);\n\n\n\n"
        "CREATE TABLE public.t (\n    id integer\n);   \n\n\n\\unrestrict AbC123\n"
    )
    assert normalise(dump) == "CREATE TABLE public.t (\n    id integer\n);\n"


def main() -> None:
    """Write ``gateway/db/schema.sql`` from the migrations, on a PostgreSQL of its own."""
    with traversable_dir("bulletin-schema-") as parent:
        pg = EmbeddedPostgres(parent / "pgdata")
        server_url = pg.start()
        try:
            schema = built_schema(server_url, pg.url)
        finally:
            pg.stop()
    SCHEMA.write_text(schema)
    print(f"wrote {SCHEMA.relative_to(ROOT)} ({len(schema.splitlines())} lines)")


if __name__ == "__main__":
    main()
