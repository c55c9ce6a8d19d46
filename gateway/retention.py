"""Retention: invocations that ended more than ``retention_s`` ago are purged with their
logs, results, blobs nothing else refers to, files in the shared directory and
Idempotency-Keys. Every replica runs it; they take different rows (``SKIP LOCKED``)."""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from bulletin_core import shared
from gateway import db
from gateway.config import GatewayConfig

log = logging.getLogger(__name__)
BATCH = 1000


async def purge_once(config: GatewayConfig, pool: asyncpg.Pool) -> db.Purged:
    """One batch: what was purged."""
    async with pool.acquire() as conn:
        purged = await db.purge(conn, config.retention_s, BATCH)
    if config.shared_dir and purged.files:
        # Not a payload file another call that may still run names too.
        keep = frozenset(await db.live_payload_files(pool))
        await asyncio.to_thread(shared.remove, config.shared_dir, purged.files, keep)
    return purged


async def purge_forever(config: GatewayConfig, pool: asyncpg.Pool) -> None:
    """Purge at start and then every ``purge_interval_s`` (at once again while batches come
    back full, so a backlog drains)."""
    while True:
        try:
            purged = await purge_once(config, pool)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:  # next round
            log.warning("could not purge old invocations: %s", exc)
        else:
            if purged.invocations or purged.blobs:
                log.info(
                    "purged %d invocations, %d blobs, %d files and %d idempotency keys older "
                    "than %g s",
                    purged.invocations,
                    purged.blobs,
                    len(purged.files),
                    purged.keys,
                    config.retention_s,
                )
            if purged.invocations == BATCH:
                continue
        await asyncio.sleep(config.purge_interval_s)
