"""Caller sessions: a process that submits calls keeps its session alive while it waits;
the calls of a session gone silent are cancelled (``spawn()`` calls have none)."""

from __future__ import annotations

import uuid

import asyncpg

from gateway.db._common import Conn, _notify

#: What a call cancelled for want of its caller says (around the seconds since its session
#: last kept it alive).
ABANDONED = (
    "cancelled: its caller stopped waiting for it (its session last kept it alive ",
    " s ago: the process ended, or lost the gateway); use spawn() for calls that should "
    "outlive their caller",
)


#: Why a queued call whose caller is late waits.
CALLER_LATE = (
    "its caller has stopped keeping it alive: it starts once the caller is back, and is "
    "cancelled if the caller does not come back within caller_timeout_s"
)

_KEEP_ALIVE = """
UPDATE caller_sessions SET seen_at = clock_timestamp()
WHERE owner_id = $1 AND id = $2
"""

_CANCEL_ABANDONED = """
WITH gone AS (
  SELECT owner_id, id, extract(epoch FROM clock_timestamp() - seen_at) AS silent
  FROM caller_sessions
  WHERE seen_at < clock_timestamp() - make_interval(secs => $1)
), doomed AS (
  SELECT i.id, i.node_id, g.silent
  FROM invocations i
  JOIN gone g ON g.owner_id = i.owner_id AND g.id = i.caller_session
  WHERE i.caller_session IS NOT NULL
    AND i.state IN ('queued', 'assigned', 'running')
  ORDER BY i.id
  FOR UPDATE OF i
)
UPDATE invocations i SET state = 'cancelled', finished_at = clock_timestamp(),
  lease_expires_at = NULL, error_message = $2 || round(doomed.silent) || $3
FROM doomed
WHERE i.id = doomed.id
RETURNING i.id, doomed.node_id
"""

_MARK_CALLER_LATE = """
UPDATE invocations i SET wait_reason = $2
FROM caller_sessions s
WHERE s.owner_id = i.owner_id AND s.id = i.caller_session
  AND i.caller_session IS NOT NULL AND i.state = 'queued'
  AND s.seen_at < clock_timestamp() - make_interval(secs => $1)
  AND i.wait_reason IS DISTINCT FROM $2
"""


async def keep_alive(conn: Conn, owner_id: int, session: str) -> bool:
    """The owner's caller session is still waiting; False if it has no such session (it
    submitted nothing, or all its calls ended long ago): only a submission makes one."""
    status = await conn.execute(_KEEP_ALIVE, owner_id, uuid.UUID(session))
    return status.endswith(" 1")


async def abandon_callers(
    conn: asyncpg.Connection, timeout_s: float, late_s: float
) -> list[str]:
    """Cancel the unfinished calls whose caller session has not kept alive for ``timeout_s``
    (their GPUs are free at once; nodes kill what runs); say of queued calls whose session
    is ``late_s`` late that they wait for their caller (they are not started meanwhile:
    :func:`queued`). Returns the ids cancelled."""
    async with conn.transaction():
        rows = await conn.fetch(_CANCEL_ABANDONED, timeout_s, *ABANDONED)
        if rows:
            nodes = {f"n:{r['node_id']}" for r in rows if r["node_id"] is not None}
            await _notify(conn, *(f"i:{r['id']}" for r in rows), "q", *sorted(nodes))
        await conn.execute(_MARK_CALLER_LATE, late_s, CALLER_LATE)
    return [str(r["id"]) for r in rows]
