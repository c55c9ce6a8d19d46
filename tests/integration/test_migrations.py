"""The numbered migrations build the schema the code uses, and applying them is idempotent."""

from __future__ import annotations

import asyncio

import asyncpg

from gateway import db


async def _schema(url: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT table_name, column_name, data_type FROM information_schema.columns"
            " WHERE table_schema = 'public' ORDER BY table_name, column_name"
        )
        return [(r[0], r[1], r[2]) for r in rows]
    finally:
        await conn.close()


async def _migrate(url: str) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        return await db.migrate(conn)
    finally:
        await conn.close()


def test_migrations_are_recorded_and_idempotent(database_url: str) -> None:
    # The per-test database is cloned from a template the session already migrated.
    before = asyncio.run(_schema(database_url))
    assert asyncio.run(_migrate(database_url)) == []
    assert asyncio.run(_schema(database_url)) == before
    names = [name for _, name, _ in db.migration_files()]
    assert names[0] == "0001_init.sql" and len(set(names)) == len(names)


def test_schema_has_what_the_state_machine_and_fencing_need(database_url: str) -> None:
    columns = {(t, c) for t, c, _ in asyncio.run(_schema(database_url))}
    for column in ("state", "epoch", "attempts", "node_id", "lease_expires_at", "log_ack"):
        assert ("invocations", column) in columns
    assert ("schema_migrations", "version") in columns
