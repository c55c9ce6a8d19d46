"""The replay's look-ahead (scheduler.lookahead.visible) picks what the gateway's queue
query (gateway.db.queued) reads, on the same queue in a real PostgreSQL."""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg

from gateway import db
from scheduler import lookahead


def test_visible_is_the_gateways_query(database_url: str) -> None:
    rng = random.Random(7)
    users = {1: "ann", 2: "bob", 3: "cy"}
    # 60 queued calls, most of ann's, in random users' turns; seq is submission order.
    queue = [(str(uuid.uuid4()), rng.choice([1, 1, 1, 2, 3]), seq) for seq in range(1, 61)]

    async def check() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.executemany(
                "INSERT INTO users (id, name) VALUES ($1, $2)", list(users.items())
            )
            await conn.executemany(
                "INSERT INTO invocations (id, owner_id, idempotency_key, gpus, max_retries, "
                "seq, payload) VALUES ($1::uuid, $2, $1::uuid::text, 1, 0, $3, '\\x00')",
                [(uuid.UUID(i), owner, seq) for i, owner, seq in queue],
            )
            for per, most in [(1, 5000), (4, 5000), (16, 5000), (4, 7), (100, 20), (2, 1)]:
                read = [c.id for c in await db.queued(conn, per, most)]
                shown = lookahead.visible(queue, per, most, lambda c: c[1], lambda c: c[2])
                assert read == [c[0] for c in shown], (per, most)
        finally:
            await conn.close()

    asyncio.run(check())
