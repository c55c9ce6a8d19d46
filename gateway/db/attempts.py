"""A nodelet's fenced writes and reads of one attempt: each statement checks the fence,
``i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')``
(the attempt is still this node's, at this epoch, and unfinished), in the statement that
applies it, so a stale attempt changes nothing."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import asyncpg
import msgspec

from bulletin_core import wire
from gateway.db._common import (
    ATTAINED,
    CHANNEL,
    Conn,
    _note,
    _notify,
    _preempted_note,
)
from gateway.db.invocations import _invocation_columns, to_invocation


@dataclass(frozen=True, slots=True)
class PayloadSource:
    """Where an attempt's payload is: exactly one of inline bytes, a blob, a shared file."""

    inline: bytes | None
    blob: str | None
    file: str | None
    size: int


@dataclass(frozen=True, slots=True)
class Owner:
    id: int
    name: str


_START = """
UPDATE invocations i SET state = 'running',
  started_at = coalesce(started_at, clock_timestamp())
WHERE i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')
"""

_LOCK_FOR_RELEASE = """
SELECT i.preempt_at IS NOT NULL AS preempted, i.preempt_reason
FROM invocations i
WHERE i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')
FOR UPDATE
"""

_RELEASE = f"""
UPDATE invocations i SET state = 'queued', attempts = i.attempts - 1,
  node_id = NULL, gpu_indices = '{{}}', lease_expires_at = NULL,
  delivered_at = NULL, started_at = NULL, scheduled_at = NULL, borrowed = false,
  preemptions = i.preemptions + (i.preempt_at IS NOT NULL)::int, preempt_at = NULL,
  queued_at = clock_timestamp(), attained_gpu_s = i.attained_gpu_s + {ATTAINED}
WHERE i.id = $1
"""

_PAYLOAD_SOURCE = """
SELECT i.payload, i.payload_blob, i.payload_file, i.payload_size
FROM invocations i
WHERE i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')
"""

_ATTEMPT_OWNER = """
SELECT u.id, u.name
FROM invocations i JOIN users u ON u.id = i.owner_id
WHERE i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')
"""

_LOCK_FOR_LOGS = """
SELECT i.log_count, i.log_ack
FROM invocations i
WHERE i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')
FOR UPDATE
"""

_INSERT_LOGS = """
INSERT INTO invocation_logs (invocation_id, n, stream, data)
SELECT $1, $2 + o - 1, s, d
FROM unnest($3::smallint[], $4::bytea[]) WITH ORDINALITY AS c(s, d, o)
"""

_COUNT_LOGS = """
UPDATE invocations SET log_count = log_count + $2, log_ack = $3 WHERE id = $1
"""

# Outcomes of many attempts in one statement, each fenced; every call completed is woken, and
# (``wake_leader``) the scheduling leader too when something waits for the capacity it freed
# (PostgreSQL folds equal notifications of a transaction). A single statement commits on its
# own: no transaction round trips. The calls of $19 have their owner waiting on this gateway
# for the result: it is handed to them as it commits (stamped fetched now), and the statement
# returns them as a watch reads them (``_invocation_columns``, but the result and its JSON,
# which the caller has), from what the update wrote (a read of the table here would see the
# rows as they were before it).
def _complete_sql(*, wake_leader: bool) -> str:
    leader = (
        f"CASE WHEN EXISTS (SELECT 1 FROM invocations q WHERE q.state = 'queued') "
        f"THEN pg_notify('{CHANNEL}', 'q') END"
        if wake_leader
        else "NULL"
    )
    return f"""
WITH c AS (
  UPDATE invocations i SET state = o.state, error_kind = o.error_kind,
    error_type = o.error_type, error_message = o.error_message, traceback = o.traceback,
    result = o.result, result_blob = o.result_blob, result_file = o.result_file,
    finished_at = clock_timestamp(), lease_expires_at = NULL,
    worker_acquired_at = to_timestamp(o.acquired), code_started_at = to_timestamp(o.started),
    code_finished_at = to_timestamp(o.finished), warm = o.warm, result_json = o.result_json,
    result_json_error = o.json_error,
    result_size = CASE WHEN o.result_file IS NULL THEN 0 ELSE o.result_size END,
    fetched_at = CASE WHEN o.id = ANY($19::uuid[]) THEN clock_timestamp() END
  FROM unnest($2::uuid[], $3::int[], $4::text[], $5::text[], $6::text[], $7::text[],
    $8::text[], $9::bytea[], $10::uuid[], $11::text[], $12::float8[], $13::float8[],
    $14::float8[], $15::bool[], $16::bytea[], $17::text[], $18::bigint[])
    AS o(id, epoch, state, error_kind, error_type, error_message, traceback, result,
      result_blob, result_file, acquired, started, finished, warm, result_json, json_error,
      result_size)
  WHERE i.id = o.id AND i.node_id = $1 AND i.epoch = o.epoch
    AND i.state IN ('assigned', 'running')
    AND (o.result_blob IS NULL OR EXISTS (SELECT 1 FROM blobs b
      WHERE b.id = o.result_blob AND b.owner_id = i.owner_id AND b.complete))
  -- What _invocation_columns reads, but the result (big, and the caller has it).
  RETURNING coalesce(i.lease_id, i.id) AS lease, i.map_id IS NOT NULL AS mapped,
    i.fetched_at IS NOT NULL AS handed, i.id, i.state, i.function_name, i.gpus, i.gpu_share,
    i.attempts,
    i.max_retries, i.node_id, i.error_kind, i.error_type, i.error_message, i.traceback,
    i.function_version, i.result_json_error, i.result_blob, i.result_file, i.log_count,
    i.function_owner, i.owner_id, i.submitted_at, i.scheduled_at, i.delivered_at,
    i.worker_acquired_at, i.code_started_at, i.code_finished_at, i.finished_at,
    i.fetched_at, i.warm, i.priority, i.preemptions, i.preempt_reason, i.queue_position,
    i.wait_reason
), woken AS (
  SELECT pg_notify('{CHANNEL}', 'i:' || c.id) FROM c
)
SELECT c.lease, c.mapped, c.handed, (SELECT count(*) FROM woken) AS woken,
  {leader} AS leader, {_invocation_columns("NULL::bytea", row="c")}
FROM c LEFT JOIN nodes n ON n.id = c.node_id
"""


_COMPLETE = _complete_sql(wake_leader=True)


async def start(conn: Conn, node_id: int, invocation_id: str, epoch: int) -> bool:
    status = await conn.execute(_START, uuid.UUID(invocation_id), node_id, epoch)
    if status.endswith(" 1"):
        await _notify(conn, f"i:{invocation_id}")
        return True
    return False


async def release(conn: asyncpg.Connection, node_id: int, invocation_id: str, epoch: int) -> bool:
    """Requeue an attempt its node hands back (it is stopping) without counting it against
    the call's retries; the next assignment moves the epoch on. False if stale."""
    async with conn.transaction():
        row = await conn.fetchrow(_LOCK_FOR_RELEASE, uuid.UUID(invocation_id), node_id, epoch)
        if row is None:
            return False
        await conn.execute(_RELEASE, uuid.UUID(invocation_id))
        if row["preempted"]:
            note = _preempted_note(row["preempt_reason"])
        else:
            note = "its node is stopping: queued again; this run does not count as an attempt"
        await _note(conn, [(invocation_id, note)])
        await _notify(conn, f"i:{invocation_id}", "q")
    return True


async def payload_source(
    conn: Conn, node_id: int, invocation_id: str, epoch: int
) -> PayloadSource | None:
    """Where the payload of a fenced attempt is; None if the attempt is stale."""
    row = await conn.fetchrow(_PAYLOAD_SOURCE, uuid.UUID(invocation_id), node_id, epoch)
    if row is None:
        return None
    return PayloadSource(
        inline=None if row["payload"] is None else bytes(row["payload"]),
        blob=None if row["payload_blob"] is None else str(row["payload_blob"]),
        file=row["payload_file"],
        size=int(row["payload_size"]),
    )


async def attempt_owner(conn: Conn, node_id: int, invocation_id: str, epoch: int) -> Owner | None:
    """The owner of a fenced attempt (result blobs belong to them, its shared files are named
    after them); None if stale."""
    row = await conn.fetchrow(_ATTEMPT_OWNER, uuid.UUID(invocation_id), node_id, epoch)
    return None if row is None else Owner(int(row["id"]), str(row["name"]))


async def append_logs(
    conn: asyncpg.Connection,
    node_id: int,
    invocation_id: str,
    request: wire.LogsRequest,
) -> bool:
    """Append an attempt's log chunks, skipping any a retried request already applied.
    False if the attempt is stale."""
    async with conn.transaction():
        return await append_logs_in(conn, node_id, invocation_id, request)


async def append_logs_in(
    conn: asyncpg.Connection,
    node_id: int,
    invocation_id: str,
    request: wire.LogsRequest,
) -> bool:
    """:func:`append_logs` within the caller's transaction."""
    row = await conn.fetchrow(_LOCK_FOR_LOGS, uuid.UUID(invocation_id), node_id, request.epoch)
    if row is None:
        return False
    skip = max(0, row["log_ack"] + 1 - request.first_seq)
    fresh = request.chunks[skip:]
    if not fresh:
        return True
    first_n = row["log_count"] + 1
    await conn.execute(
        _INSERT_LOGS,
        uuid.UUID(invocation_id),
        first_n,
        [int(c.stream) for c in fresh],
        [c.data for c in fresh],
    )
    await conn.execute(
        _COUNT_LOGS,
        uuid.UUID(invocation_id),
        len(fresh),
        request.first_seq + len(request.chunks) - 1,
    )
    await _notify(conn, f"i:{invocation_id}")
    return True


async def complete(
    conn: Conn,
    node_id: int,
    outcomes: Sequence[tuple[str, wire.CompleteRequest]],
    handed: Collection[str] = (),
) -> dict[str, wire.Invocation | None]:
    """Commit attempts' outcomes ``(invocation_id, request)`` exactly once, in one statement;
    returns the invocation ids whose outcome was taken (the others' attempts are stale),
    with, for those among ``handed`` (their owner waits on this gateway), the finished
    invocation to hand them (stamped fetched: :func:`handed_invocations`)."""
    if not outcomes:
        return {}
    rows = await conn.fetch(_COMPLETE, *complete_args(node_id, outcomes, handed))
    return handed_invocations(rows, outcomes)


def handed_invocations(
    rows: Sequence[asyncpg.Record], outcomes: Sequence[tuple[str, wire.CompleteRequest]]
) -> dict[str, wire.Invocation | None]:
    """Each completed id, with the finished invocation (its result, and the JSON of it, from
    its request) where the statement stamped it fetched for a waiting owner, else None."""
    requests = dict(outcomes)
    taken: dict[str, wire.Invocation | None] = {}
    for r in rows:
        key = str(r["id"])
        if not r["handed"]:
            taken[key] = None
            continue
        req = requests[key]
        json = None if req.result_json is None else msgspec.Raw(req.result_json)
        found = msgspec.structs.replace(to_invocation(r), result=req.result, result_json=json)
        taken[key] = found
    return taken


def complete_args(
    node_id: int,
    outcomes: Sequence[tuple[str, wire.CompleteRequest]],
    handed: Collection[str] = (),
) -> tuple[object, ...]:
    """The parameters of :func:`_complete_sql` for these outcomes."""
    reqs = [r for _, r in outcomes]
    return (
        node_id,
        [uuid.UUID(i) for i, _ in outcomes],
        [r.epoch for r in reqs],
        [r.state for r in reqs],
        [None if r.error_kind is None else str(r.error_kind) for r in reqs],
        [r.error_type for r in reqs],
        [r.error_message for r in reqs],
        [r.traceback for r in reqs],
        [r.result for r in reqs],
        [None if r.result_blob is None else uuid.UUID(r.result_blob) for r in reqs],
        [r.result_file for r in reqs],
        [r.worker_acquired for r in reqs],
        [r.started for r in reqs],
        [r.finished for r in reqs],
        [r.warm for r in reqs],
        [r.result_json for r in reqs],
        [r.result_json_error for r in reqs],
        [r.result_size for r in reqs],
        [uuid.UUID(i) for i in handed],
    )
