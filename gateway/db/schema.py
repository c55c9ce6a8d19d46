"""The schema: numbered migrations (``migrations/NNNN_name.sql``, applied in order, each
once) and creating a database. ``schema.sql`` beside this module is what they build
(``tests/integration/test_schema.py`` checks it and rewrites it when run as a module)."""

from __future__ import annotations

from importlib import resources

import asyncpg

_LOCK_MIGRATIONS = """
-- Gateways starting at once take turns (the scheduler's leader lock is 7242002).
SELECT pg_advisory_xact_lock(7242001)
"""

_CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
  version integer PRIMARY KEY,
  name text NOT NULL,
  applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

_APPLIED_VERSIONS = """
SELECT version FROM schema_migrations
"""

_RECORD_MIGRATION = """
INSERT INTO schema_migrations (version, name) VALUES ($1, $2)
"""

_DATABASE_EXISTS = """
SELECT 1 FROM pg_database WHERE datname = $1
"""


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every numbered migration, in order."""
    found = []
    for entry in resources.files("gateway.db").joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text()))
    return sorted(found)


async def applied_migrations(conn: asyncpg.Connection) -> set[int]:
    """The versions of the migrations applied to this database (none before the first)."""
    try:
        return {row["version"] for row in await conn.fetch(_APPLIED_VERSIONS)}
    except asyncpg.UndefinedTableError:
        return set()


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply the migrations this database lacks; returns the names applied.

    Several gateways may start at once: a transaction-scoped advisory lock makes them take
    turns, and each re-reads the applied versions under it."""
    applied_now = []
    async with conn.transaction():
        await conn.execute(_LOCK_MIGRATIONS)
        await conn.execute(_CREATE_MIGRATIONS_TABLE)
        done = {r["version"] for r in await conn.fetch(_APPLIED_VERSIONS)}
        for version, name, sql in migration_files():
            if version in done:
                continue
            await conn.execute(sql)
            await conn.execute(_RECORD_MIGRATION, version, name)
            applied_now.append(name)
    return applied_now


async def ensure_database(conn: asyncpg.Connection, name: str, template: str | None = None) -> None:
    """CREATE DATABASE unless it exists (the connection is to another database)."""
    if await conn.fetchval(_DATABASE_EXISTS, name):
        return
    if not name.replace("_", "").isalnum():
        raise ValueError(f"database name {name!r} must be letters, digits and underscores")
    # Built here: DDL takes no parameters, so the (checked) names are quoted identifiers.
    suffix = "" if template is None else f' TEMPLATE "{template}"'
    await conn.execute(f'CREATE DATABASE "{name}"{suffix}')
