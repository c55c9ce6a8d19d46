"""Hosts the scheduler loop. Every gateway runs it; one at a time leads, chosen by a
PostgreSQL session advisory lock, and the others stand by to take over if the leader's
connection drops. Each round: expire leases, read a snapshot under node row locks, call the
pure ``scheduler.plan``, commit the decisions in that same transaction."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict

import asyncpg

from gateway import db
from gateway.config import GatewayConfig
from gateway.notify import Hub
from scheduler import NodeCapacity, Pending, Snapshot, plan

log = logging.getLogger(__name__)
LEADER_LOCK = 7242002
# The leader lock lives as long as this connection. If the leader's host vanishes without
# closing it, TCP keepalives let PostgreSQL notice within about a minute and free the lock.
_KEEPALIVE = {
    "tcp_keepalives_idle": "30",
    "tcp_keepalives_interval": "10",
    "tcp_keepalives_count": "3",
}


def capacity(nodes: list[db.NodeRow], leases: list[db.LeaseRow]) -> list[NodeCapacity]:
    """Free GPUs and CPU slots of each live node, given the leases held on it."""
    used_gpus: dict[int, set[int]] = defaultdict(set)
    used_cpu: Counter[int] = Counter()
    for lease in leases:
        if lease.gpus == 0:
            used_cpu[lease.node_id] += 1
        used_gpus[lease.node_id].update(lease.gpu_indices)
    return [
        NodeCapacity(
            node_id=n.id,
            free_gpus=[g.index for g in n.gpus if g.index not in used_gpus[n.id]],
            free_cpu_slots=max(0, n.cpu_slots - used_cpu[n.id]),
        )
        for n in nodes
    ]


def look_ahead(free: list[NodeCapacity], most: int) -> int:
    """How far down the queue a round looks: enough to fill what is free, with room to
    backfill past calls that do not fit, without re-reading a huge backlog every round."""
    units = sum(len(n.free_gpus) + n.free_cpu_slots for n in free)
    return max(1, min(most, 64 + 16 * units)) if units else 0


async def plan_round(conn: asyncpg.Connection, config: GatewayConfig) -> int:
    """One planning round in one transaction; returns how many calls were placed."""
    async with conn.transaction():
        # The live nodes, locked: capacity is read and committed under the same locks.
        nodes = await db.live_nodes(conn, config.node_timeout_s, lock=True)
        if not nodes:
            return 0
        free = capacity(nodes, await db.leases(conn))
        pending = await db.queued(conn, look_ahead(free, config.plan_batch))
        if not pending:
            return 0
        snapshot = Snapshot(nodes=free, pending=[Pending(q.id, q.gpus) for q in pending])
        decisions = plan(snapshot)
        if not decisions:
            return 0
        placed = await db.assign(
            conn, [(d.invocation_id, d.node_id, d.gpu_indices) for d in decisions], config.lease_s
        )
        await db.notify_nodes(conn, {node for _, node in placed})
    return len(placed)


async def lead(conn: asyncpg.Connection, hub: Hub, config: GatewayConfig) -> None:
    """Plan whenever woken by a notification, and at least every schedule_interval_s."""
    last_expiry = 0.0
    while True:
        async with hub.subscribe(["q"]) as sub:
            # Leases lapse on the clock, not on news: expiring them on every wake-up would put
            # a transaction on the path of each call for nothing.
            if time.monotonic() - last_expiry >= config.schedule_interval_s:
                last_expiry = time.monotonic()
                expired = await db.expire_leases(conn)
                if expired:
                    log.warning("leases expired: %s", ", ".join(f"{i}->{s}" for i, s in expired))
            placed = await plan_round(conn, config)
            if placed:
                log.debug("placed %d calls", placed)
                continue  # there may be more queued than one round looks at
            await sub.wait(config.schedule_interval_s)


async def run(hub: Hub, config: GatewayConfig) -> None:
    """Run until cancelled, leading whenever this gateway holds the leader lock."""
    while True:
        conn = None
        try:
            conn = await asyncpg.connect(config.database_url, server_settings=_KEEPALIVE)
            if await conn.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK):
                log.info("this gateway now leads scheduling")
                await lead(conn, hub, config)
        except Exception as exc:  # the loop must outlive any failure: nothing else schedules
            log.warning("scheduler loop failed (%s); retrying", exc, exc_info=True)
        finally:
            if conn is not None:
                await _close(conn)
        await asyncio.sleep(config.schedule_interval_s)


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), 2)
    except Exception:
        conn.terminate()
