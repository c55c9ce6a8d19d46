"""The fair policy's starvation guard counts a call's wait from when it last entered the
queue: the gateway's queries give the scheduler that time (``queued_time``), restarted by
each path that queues a call again, on a real PostgreSQL; and the leader carries the calls a
round reserved for to the next round."""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg

from bulletin_core import wire
from gateway import db, scheduling
from gateway.config import GatewayConfig
from scheduler.reclaim import starved

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
            assert starved(run, 3600) and not starved(run, 3 * 3600)
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


def test_a_call_queued_again_keeps_the_service_it_received(database_url: str) -> None:
    """Least attained service ranks calls by the GPU-seconds they received: each path that
    queues a call again adds its run's (from when it got its GPUs), and the scheduler's
    queries read them back."""

    async def check() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            call = uuid.uuid4()
            await _setup(conn, call)
            # Two GPUs since ten minutes ago.
            await conn.execute(
                "UPDATE invocations SET gpus = 2, gpu_indices = '{0,1}', "
                "scheduled_at = clock_timestamp() - interval '10 minutes' WHERE id = $1",
                call,
            )
            (run,) = [r for r in await db.leases(conn) if r.id == str(call)]
            assert run.attained_gpu_s == 0.0 and 1190 < run.attained(run.start_time + 600) < 1210
            assert await db.release(conn, NODE, str(call), 1)  # handed back (preempted)
            (pending,) = await db.queued(conn, 16, 100)
            assert 1190 < pending.attained_gpu_s < 1260, pending.attained_gpu_s
            got = pending.attained_gpu_s
            # Placed again five minutes ago; its node is lost: five more minutes on two GPUs.
            await conn.execute(
                "UPDATE invocations SET state = 'running', node_id = $2, epoch = 2, "
                "gpu_indices = '{0,1}', scheduled_at = clock_timestamp() - interval '5 minutes',"
                " delivered_at = clock_timestamp() - interval '5 minutes',"
                " lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = $1",
                call,
                NODE,
            )
            (run,) = [r for r in await db.leases(conn) if r.id == str(call)]
            assert run.attained_gpu_s == got  # what its earlier runs gave it
            assert await db.expire_leases(conn) == [(str(call), "queued")]
            (pending,) = await db.queued(conn, 16, 100)
            assert got + 590 < pending.attained_gpu_s < got + 660  # (till its lease ran out)
            # Handed to a node that never received it, then lost: it ran nothing.
            got = pending.attained_gpu_s
            await conn.execute(
                "UPDATE invocations SET state = 'assigned', node_id = $2, epoch = 3, "
                "gpu_indices = '{0,1}', scheduled_at = clock_timestamp() - interval '5 minutes',"
                " delivered_at = NULL, lease_expires_at = clock_timestamp() - interval '1 second'"
                " WHERE id = $1",
                call,
                NODE,
            )
            assert await db.expire_leases(conn) == [(str(call), "queued")]
            (pending,) = await db.queued(conn, 16, 100)
            assert pending.attained_gpu_s == got
        finally:
            await conn.close()

    asyncio.run(check())


def _gpus(n: int) -> str:
    return json.dumps(
        [{"index": g, "uuid": f"GPU-{g}", "name": "A100", "memory_mb": 40960} for g in range(n)]
    )


def test_the_leader_keeps_last_round_s_reservations_beyond_the_guard_s_share(
    database_url: str,
) -> None:
    """The fair guard lets starved whole-node calls hold only their share of the cluster, but
    a call the previous round reserved for keeps its reservation: the leader carries the
    reserved calls, and the nodes reserved for them, from one plan_round to the next
    (``reserved``, ``reserved_on``)."""

    async def check() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute("INSERT INTO users (id, name) VALUES (1, 'ann')")
            # 4 GPUs each. Node 1: a whole-node call that started after a two-hour wait (a
            # starved one), for 10 minutes. Node 2: three GPUs held for hours.
            for node, held, waited, limit in ((1, [0, 1, 2, 3], 7200, 600.0),
                                              (2, [0, 1, 2], 60, 36000.0)):  # fmt: skip
                await conn.execute(
                    "INSERT INTO nodes (id, name, gpus, protocol_version, last_heartbeat) "
                    "VALUES ($1, $2, $3::jsonb, $4, clock_timestamp())",
                    node, f"n{node}", _gpus(4), wire.PROTOCOL_VERSION,
                )  # fmt: skip
                await conn.execute(
                    "INSERT INTO invocations (id, owner_id, idempotency_key, gpus, max_retries, "
                    "seq, payload, state, node_id, gpu_indices, epoch, attempts, timeout_s, "
                    "submitted_at, scheduled_at, lease_expires_at) VALUES ($1::uuid, 1, "
                    "$1::uuid::text, $4, 0, $2, '\\x00', 'running', $2, $3, 1, 1, $5, "
                    "clock_timestamp() - make_interval(secs => $6), clock_timestamp() - "
                    "interval '1 minute', clock_timestamp() + interval '1 hour')",
                    uuid.uuid4(), node, held, len(held), limit, float(waited),
                )  # fmt: skip

            async def queue(gpus: int, seq: int) -> str:
                call = uuid.uuid4()
                await conn.execute(
                    "INSERT INTO invocations (id, owner_id, idempotency_key, gpus, max_retries, "
                    "seq, payload, submitted_at) VALUES ($1::uuid, 1, $1::uuid::text, $2, 0, "
                    "$3, '\\x00', clock_timestamp() - interval '2 hours')",
                    call, gpus, seq,
                )  # fmt: skip
                return str(call)

            big = await queue(4, 10)  # a whole node, waited two hours: reserved (node 1)
            # (The guard at an hour: these calls waited two.)
            config = GatewayConfig(database_url=database_url, fair_starve_after_s=3600.0)
            reserved: dict[str, float] = {}
            reserved_on: dict[str, tuple[int, ...]] = {}  # (and on which nodes: node 1)
            await scheduling.plan_round(conn, config, reserved=reserved, reserved_on=reserved_on)
            assert reserved.keys() == {big} and reserved_on == {big: (1,)}
            # Three 3-GPU calls that also waited two hours: starved whole-node calls (big, and
            # node 1's) may now hold 8 / 17 of the 8 GPUs, less than node 1's call holds.
            # Planned afresh, big gets no reservation; after the round that reserved for it,
            # it keeps it.
            for seq in (11, 12, 13):
                await queue(3, seq)
            fresh: dict[str, float] = {}
            await scheduling.plan_round(conn, config, reserved=fresh)
            assert fresh == {}
            await scheduling.plan_round(conn, config, reserved=reserved)
            assert reserved.keys() == {big}
        finally:
            await conn.close()

    asyncio.run(check())
