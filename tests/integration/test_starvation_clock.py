"""The fair policy's starvation guard counts a call's wait from when it last entered the
queue: the gateway's queries give the scheduler that time (``queued_time``), restarted by
each path that queues a call again, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg

from gateway import db
from scheduler.reclaim import protected

NODE = 7


async def _setup(conn: asyncpg.Connection, call: uuid.UUID) -> None:
    await conn.execute("INSERT INTO users (id, name) VALUES (1, 'ann')")
    await conn.execute(
        "INSERT INTO nodes (id, name, protocol_version, last_heartbeat) "
        "VALUES ($1, 'n7', 3, clock_timestamp())",
        NODE,
    )
    # Submitted two hours ago, placed a minute ago, on node 7.
    await conn.execute(
        "INSERT INTO invocations (id, owner_id, idempotency_key, gpus, max_retries, seq, "
        "payload, state, node_id, gpu_indices, epoch, attempts, submitted_at, scheduled_at, "
        "lease_expires_at) VALUES ($1::uuid, 1, $1::uuid::text, 1, 3, 1, '\\x00', 'running', "
        "$2, '{0}', 1, 1, clock_timestamp() - interval '2 hours', "
        "clock_timestamp() - interval '1 minute', clock_timestamp() + interval '1 hour')",
        call,
        NODE,
    )


async def _lease(conn: asyncpg.Connection, call: uuid.UUID) -> tuple[float, float]:
    (run,) = [r for r in await db.leases(conn) if r.id == str(call)]
    assert run.queued_time is not None
    return run.start_time, run.queued_time


def test_a_call_queued_again_starts_a_new_wait(database_url: str) -> None:
    async def check() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            call = uuid.uuid4()
            await _setup(conn, call)
            # Never queued again: it waited from submission to its start, two hours.
            start, queued = await _lease(conn, call)
            assert 7100 < start - queued < 7300
            run = next(r for r in await db.leases(conn) if r.id == str(call))
            assert protected(run, 3600) and not protected(run, 3 * 3600)
            # Its node hands it back (stopping, or preempted): it queues again, from now.
            before = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())")
            assert await db.release(conn, NODE, str(call), 1)
            (pending,) = await db.queued(conn, 16, 100)
            assert pending.queued_time is not None and pending.queued_time >= before
            assert pending.waiting_since == pending.queued_time
            assert pending.submit_time < pending.queued_time - 7000  # its queue place stays
            # Placed again at once: it waited (almost) nothing for this run.
            await conn.execute(
                "UPDATE invocations SET state = 'running', node_id = $2, epoch = 2, "
                "scheduled_at = clock_timestamp(), lease_expires_at = clock_timestamp() - "
                "interval '1 second' WHERE id = $1",
                call,
                NODE,
            )
            start, queued = await _lease(conn, call)
            assert 0 <= start - queued < 60
            # Its lease runs out (node lost): it queues again, a new wait once more.
            first = queued
            assert await db.expire_leases(conn) == [(str(call), "queued")]
            (pending,) = await db.queued(conn, 16, 100)
            assert pending.queued_time is not None and pending.queued_time > first
            # A call never queued again reads no queued_time: it waits from submission.
            fresh = uuid.uuid4()
            await conn.execute(
                "INSERT INTO invocations (id, owner_id, idempotency_key, gpus, max_retries, "
                "seq, payload) VALUES ($1::uuid, 1, $1::uuid::text, 1, 0, 2, '\\x00')",
                fresh,
            )
            pending_now = {p.id: p for p in await db.queued(conn, 16, 100)}
            assert pending_now[str(fresh)].queued_time is None
            assert pending_now[str(fresh)].waiting_since == pending_now[str(fresh)].submit_time
        finally:
            await conn.close()

    asyncio.run(check())
