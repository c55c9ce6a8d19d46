"""Slot leases of maps: a node that completes items of a map is given the map's next items
in the same transaction, to run one after another in the slot (GPUs or CPU slot) the
completed ones held, while nothing but that map waits.

A call the scheduler places is a lease of its own (``lease_id`` NULL: its id). The items
given here join the lease of the item completed (``lease_id``); the lease counts for its
node's capacity once, through its first unfinished attempt (``scheduling._LEASES``), and
ends when its last attempt does. Every item stays an invocation of its own: its own attempt,
epoch, lease expiry, retries and outcome.

The scheduler stays the authority over contended capacity: an item is given only while no
call of another owner or map waits (two probes of ``invocations_queued_map``), its caller is
not late, and its node is live and not draining; the node's row is locked first, as a
scheduling round locks it, so a round and a completion never both give the same slot. What
the scheduler would place next in that slot is exactly that: the owner's next call in queue
order, the only one waiting, with the same resources and priority (``SubmitRequest.map_id``
guarantees them; an item that differs is left to the scheduler).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import asyncpg

from bulletin_core import wire
from gateway.db._common import CHANNEL, Conn
from gateway.db.attempts import _complete_sql, complete_args, handed_invocations
from gateway.db.nodes import _assignment

_LOCK_NODE = """
-- Locked as a scheduling round locks it, first; whether it may be given work.
SELECT incarnation = $2 AND NOT draining AND removed_at IS NULL AS open
FROM nodes WHERE id = $1
FOR UPDATE
"""

# $2: for each lease, an attempt of it completed in this transaction; $3: how many unfinished
# attempts the lease should hold. The attempts given are delivered in the answer (delivered_at
# now); a lost answer loses nothing: the node's next poll delivers them.
_TOP_UP = """
WITH w AS (
  SELECT * FROM unnest($2::uuid[], $3::int[]) AS w(last, want)
), l AS (
  SELECT coalesce(c.lease_id, c.id) AS lease, c.owner_id, c.map_id, c.gpus, c.priority,
    c.gpu_model, c.gpu_memory_mb, c.expected_s, c.timeout_s, c.caller_session, c.gpu_indices,
    c.gpu_share,
    c.borrowed, w.want - (SELECT count(*) FROM invocations r
      WHERE r.node_id = $1 AND r.state IN ('assigned', 'running')
        AND coalesce(r.lease_id, r.id) = coalesce(c.lease_id, c.id)) AS room
  FROM w JOIN invocations c ON c.id = w.last
  WHERE c.node_id = $1 AND c.map_id IS NOT NULL
    -- Nothing of another owner or map waits: the first and the last of what waits, in
    -- invocations_queued_map's order, are both of this map (each probe reads the index
    -- from one end and stops at the first row that still waits).
    AND (SELECT (q.owner_id, coalesce(q.map_id, q.id)) FROM invocations q
      WHERE q.state = 'queued' ORDER BY q.owner_id, coalesce(q.map_id, q.id) LIMIT 1)
      = (c.owner_id, c.map_id)
    AND (SELECT (q.owner_id, coalesce(q.map_id, q.id)) FROM invocations q
      WHERE q.state = 'queued'
      ORDER BY q.owner_id DESC, coalesce(q.map_id, q.id) DESC LIMIT 1)
      = (c.owner_id, c.map_id)
    -- The scheduler starts no call whose caller is late (db/scheduling.py: _queued_sql).
    AND NOT EXISTS (SELECT 1 FROM caller_sessions s
      WHERE s.owner_id = c.owner_id AND s.id = c.caller_session
        AND s.seen_at < clock_timestamp() - make_interval(secs => $5))
), pick AS (
  SELECT q.id, l.lease, l.gpu_indices, l.borrowed
  FROM l CROSS JOIN LATERAL (
    SELECT q.id FROM invocations q
    WHERE q.state = 'queued' AND q.owner_id = l.owner_id
      AND coalesce(q.map_id, q.id) = l.map_id AND q.gpus = l.gpus
      AND q.gpu_share = l.gpu_share
      AND q.priority = l.priority AND q.gpu_model IS NOT DISTINCT FROM l.gpu_model
      AND q.gpu_memory_mb IS NOT DISTINCT FROM l.gpu_memory_mb
      AND q.expected_s IS NOT DISTINCT FROM l.expected_s
      AND q.timeout_s IS NOT DISTINCT FROM l.timeout_s
      AND q.caller_session IS NOT DISTINCT FROM l.caller_session
    ORDER BY q.seq
    LIMIT greatest(l.room, 0)
    FOR UPDATE SKIP LOCKED
  ) q
), a AS (
  UPDATE invocations i SET state = 'assigned', node_id = $1, gpu_indices = p.gpu_indices,
    attempts = i.attempts + 1, epoch = i.epoch + 1, log_ack = -1,
    scheduled_at = clock_timestamp(), delivered_at = clock_timestamp(), started_at = NULL,
    worker_acquired_at = NULL, code_started_at = NULL, code_finished_at = NULL, warm = NULL,
    borrowed = p.borrowed, preempt_at = NULL, queue_position = NULL, wait_reason = NULL,
    lease_id = p.lease, lease_expires_at = clock_timestamp() + make_interval(secs => $4)
  FROM pick p, users u
  WHERE i.id = p.id AND i.state = 'queued' AND u.id = i.owner_id
  RETURNING i.id, i.epoch, i.gpu_indices, i.timeout_s, i.function_name, i.payload_size,
    i.owner_id, i.payload_file, i.arguments, i.function_owner,
    u.name AS owner_name, u.is_admin AS owner_admin,
    CASE WHEN i.payload_size <= $6 THEN i.payload END AS payload, p.lease, i.seq,
    i.gpu_share
)
SELECT * FROM a ORDER BY seq
"""

# The scheduling leader is woken when a lease of the node ended (its capacity is free) and
# something waits for capacity.
_WAKE_IF_FREED = f"""
SELECT pg_notify('{CHANNEL}', 'q')
WHERE EXISTS (SELECT 1 FROM invocations WHERE state = 'queued')
  AND EXISTS (SELECT 1 FROM unnest($2::uuid[]) AS l(lease)
    WHERE NOT EXISTS (SELECT 1 FROM invocations r
      WHERE r.node_id = $1 AND r.state IN ('assigned', 'running')
        AND coalesce(r.lease_id, r.id) = l.lease))
"""


@dataclass(frozen=True, slots=True)
class Completed:
    """An outcome committed: its attempt's lease, and whether it was an item of a map."""

    id: str
    lease: str
    mapped: bool
    gpus: int
    max_retries: int
    #: The finished invocation, for an owner waiting on this gateway (else None).
    invocation: wire.Invocation | None = None


async def lock_node_for_work(conn: asyncpg.Connection, node_id: int, incarnation: int) -> bool:
    """Within the caller's transaction: lock the node's row, as a scheduling round does;
    whether it may be given work (this start of it, not draining, not removed)."""
    return bool(await conn.fetchval(_LOCK_NODE, node_id, incarnation))


async def complete_in(
    conn: asyncpg.Connection,
    node_id: int,
    outcomes: Sequence[tuple[str, wire.CompleteRequest]],
    handed: Collection[str] = (),
) -> list[Completed]:
    """Within the caller's transaction: commit the outcomes as ``attempts.complete`` does
    (``handed`` as there), without waking the scheduling leader (:func:`wake_if_freed`
    does, once the leases are topped up); returns those taken."""
    if not outcomes:
        return []
    args = complete_args(node_id, outcomes, handed)
    rows = await conn.fetch(_complete_sql(wake_leader=False), *args)
    invocations = handed_invocations(rows, outcomes)
    return [
        Completed(
            str(r["id"]),
            str(r["lease"]),
            r["mapped"],
            r["gpus"],
            r["max_retries"],
            invocations[str(r["id"])],
        )
        for r in rows
    ]


async def top_up(
    conn: asyncpg.Connection,
    node_id: int,
    wants: Mapping[str, tuple[str, int]],
    *,
    lease_s: float,
    inline_limit: int,
    late_s: float,
) -> list[wire.Assignment]:
    """Within the caller's transaction, which locked the node (:func:`lock_node_for_work`) and
    completed an attempt of each lease: give each lease of ``wants`` (lease id ->
    ``(attempt completed, attempts it should hold)``) the next items of its map, up to that
    many unfinished attempts, while nothing else waits. Returns the assignments, in queue
    order."""
    if not wants:
        return []
    lasts = [uuid.UUID(last) for last, _ in wants.values()]
    rows = await conn.fetch(
        _TOP_UP,
        node_id,
        lasts,
        [want for _, want in wants.values()],
        lease_s,
        late_s,
        inline_limit,
    )
    return [_assignment(r) for r in rows]


async def wake_if_freed(conn: Conn, node_id: int, leases: Sequence[str]) -> None:
    """Wake the scheduling leader (at commit) if one of ``leases`` of the node ended and
    something waits."""
    if leases:
        await conn.execute(_WAKE_IF_FREED, node_id, [uuid.UUID(lease) for lease in leases])
