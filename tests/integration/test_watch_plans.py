"""A watch names up to MAX_WATCH calls and is asked again at every completion of a map: its
statements must look each call up by its id, whatever the planner believes about the table.

A map grows the invocations table faster than autovacuum's statistics follow, and asyncpg
keeps each statement prepared, so PostgreSQL may settle on a generic plan made while the
table looked tiny. Such a plan once walked the owner's index for every id (every one of the
owner's calls, for each id named, at every watch: a map of 3,000 items spent most of the
database's time there). Real PostgreSQL, the gateway's own statements."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import pytest

from bulletin import admin
from bulletin_core import wire
from gateway import db
from gateway.db import invocations as statements


def _indexes(plan: dict[str, Any]) -> set[str]:
    """Every index a plan reads, and whether it scans the invocations table whole."""
    found = set()
    if plan.get("Relation Name") == "invocations" and plan["Node Type"] == "Seq Scan":
        found.add("whole table")
    if "Index Name" in plan:
        found.add(plan["Index Name"])
    for child in plan.get("Plans", ()):
        found |= _indexes(child)
    return found


def _literal(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "'{" + ",".join(str(v) for v in value) + "}'"
    assert isinstance(value, int)
    return str(value)


async def _stale_statistics(database_url: str) -> tuple[asyncpg.Connection, int, list[str]]:
    """A user with a few calls when the table was analyzed, and 5,000 more since."""
    await admin.add_user(database_url, "alice")
    conn = await asyncpg.connect(database_url)
    owner = await conn.fetchval("SELECT id FROM users WHERE name = 'alice'")

    async def add(n: int) -> list[str]:
        calls = [wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"x") for _ in range(n)]
        async with conn.transaction():
            return (await db.insert_calls(conn, owner, calls)).ids

    await add(5)
    await conn.execute("ANALYZE invocations")
    ids: list[str] = []
    for _ in range(10):
        ids += await add(500)
    return conn, owner, ids


@pytest.mark.parametrize("strict", [True, False], ids=["first read", "later reads"])
def test_a_watch_looks_each_call_up_by_id_even_in_a_plan_made_from_stale_statistics(
    database_url: str, strict: bool
) -> None:
    statement = statements._CHANGED_FETCHED

    async def main() -> set[str]:
        conn, owner, ids = await _stale_statistics(database_url)
        try:
            assert len(ids) == 5000
            # The plan a cached prepared statement may settle on: made without the values.
            args = (ids[:256], [0] * 256, owner, strict)
            await conn.execute(f"PREPARE watched AS {statement}")
            await conn.execute("SET plan_cache_mode = force_generic_plan")
            values = ", ".join(_literal(a) for a in args)  # EXECUTE takes no parameters
            rows = await conn.fetch(f"EXPLAIN (FORMAT JSON) EXECUTE watched({values})")
            await conn.execute("RESET plan_cache_mode")
            plan = json.loads(rows[0][0])[0]["Plan"]
            # ...and the statement still answers right, for ids of another owner too.
            assert await conn.fetch(statement, *args) == []  # queued, no logs: no news
            other = await conn.fetch(statement, ids[:3], [0] * 3, owner + 1, strict)
            if strict:  # the first read: the one row says which id is not the owner's
                assert len(other) == 1 and str(other[0]["unknown"]) in ids[:3]
            else:
                assert other == []
            return _indexes(plan)
        finally:
            await conn.close()

    used = asyncio.run(main())
    assert "invocations_pkey" in used
    assert not used & {"whole table", "invocations_owner", "invocations_queued_owner"}, used
