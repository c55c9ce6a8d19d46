"""Retention: what ended long enough ago is deleted, in batches replicas can run at once
(each takes rows the others have not locked)."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg


@dataclass(frozen=True, slots=True)
class Purged:
    invocations: int
    blobs: int
    keys: int
    #: Shared-directory files (relative to its root) of the purged invocations: the caller
    #: deletes them.
    files: list[str]


# The batch LIMITs are literals, as in the scheduler's queue read (scheduling._queued_sql,
# where a LIMIT parameter got a generic plan that ran for minutes on a long backlog).


def _purge_invocations_sql(batch: int) -> str:
    return f"""
DELETE FROM invocations WHERE id IN (
  SELECT id FROM invocations
  WHERE finished_at < clock_timestamp() - make_interval(secs => $1)
    AND state IN ('succeeded', 'failed', 'timed_out', 'cancelled')
  ORDER BY finished_at
  LIMIT {int(batch)}
  FOR UPDATE SKIP LOCKED
)
RETURNING payload_file, result_file
"""


def _purge_blobs_sql(batch: int) -> str:
    return f"""
DELETE FROM blobs WHERE id IN (
  SELECT b.id FROM blobs b
  WHERE b.created_at < clock_timestamp() - make_interval(secs => $1)
    AND NOT EXISTS (SELECT 1 FROM invocations i WHERE i.payload_blob = b.id)
    AND NOT EXISTS (SELECT 1 FROM invocations i WHERE i.result_blob = b.id)
    AND NOT EXISTS (SELECT 1 FROM functions f WHERE f.payload_blob = b.id)
  LIMIT {int(batch)}
  FOR UPDATE SKIP LOCKED
)
"""


_PURGE_KEYS = """
DELETE FROM idempotency_keys
WHERE created_at < clock_timestamp() - make_interval(secs => $1)
"""

_PURGE_SESSIONS = """
-- A caller session silent that long, with no unfinished call, waits for nothing.
DELETE FROM caller_sessions s
WHERE seen_at < clock_timestamp() - make_interval(secs => $1)
  AND NOT EXISTS (SELECT 1 FROM invocations i WHERE i.owner_id = s.owner_id
    AND i.caller_session = s.id AND i.state IN ('queued', 'assigned', 'running'))
"""


async def purge(conn: asyncpg.Connection, retention_s: float, batch: int = 1000) -> Purged:
    """Delete up to ``batch`` invocations that ended more than ``retention_s`` ago (with their
    logs), the blobs nothing refers to any more that are that old, and Idempotency-Keys and
    idle caller sessions that old. Replicas may run it at once: each takes rows the others
    have not locked."""
    async with conn.transaction():
        rows = await conn.fetch(_purge_invocations_sql(batch), retention_s)
        blobs = await conn.execute(_purge_blobs_sql(batch), retention_s)
        keys = await conn.execute(_PURGE_KEYS, retention_s)
        await conn.execute(_PURGE_SESSIONS, retention_s)
    files = [f for r in rows for f in (r["payload_file"], r["result_file"]) if f is not None]
    return Purged(len(rows), int(blobs.split()[-1]), int(keys.split()[-1]), files)
