"""A nodelet's fenced writes and reads of one attempt: each statement checks the fence,
``i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')``
(the attempt is still this node's, at this epoch, and unfinished), in the statement that
applies it, so a stale attempt changes nothing."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import asyncpg

from bulletin_core import wire
from gateway.db._common import Conn, _note, _notify, _preempted_note


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

_RELEASE = """
UPDATE invocations i SET state = 'queued', attempts = i.attempts - 1,
  node_id = NULL, gpu_indices = '{}', lease_expires_at = NULL,
  delivered_at = NULL, started_at = NULL, scheduled_at = NULL, borrowed = false,
  preemptions = i.preemptions + (i.preempt_at IS NOT NULL)::int, preempt_at = NULL
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

_COMPLETE = """
UPDATE invocations i SET state = $4, error_kind = $5, error_type = $6,
  error_message = $7, traceback = $8, result = $9, result_blob = $10,
  result_file = $11, finished_at = clock_timestamp(), lease_expires_at = NULL,
  worker_acquired_at = to_timestamp($12), code_started_at = to_timestamp($13),
  code_finished_at = to_timestamp($14), warm = $15, result_json = $16,
  result_json_error = $17, result_size = CASE WHEN $11::text IS NULL THEN 0
    ELSE $18 END
WHERE i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')
  AND ($10::uuid IS NULL OR EXISTS (SELECT 1 FROM blobs b
    WHERE b.id = $10 AND b.owner_id = i.owner_id AND b.complete))
"""


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
        row = await conn.fetchrow(
            _LOCK_FOR_LOGS, uuid.UUID(invocation_id), node_id, request.epoch
        )
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
    conn: asyncpg.Connection, node_id: int, invocation_id: str, request: wire.CompleteRequest
) -> bool:
    """Commit an attempt's outcome exactly once; False if the attempt is stale."""
    async with conn.transaction():
        status = await conn.execute(
            _COMPLETE,
            uuid.UUID(invocation_id),
            node_id,
            request.epoch,
            request.state,
            None if request.error_kind is None else str(request.error_kind),
            request.error_type,
            request.error_message,
            request.traceback,
            request.result,
            None if request.result_blob is None else uuid.UUID(request.result_blob),
            request.result_file,
            request.worker_acquired,
            request.started,
            request.finished,
            request.warm,
            request.result_json,
            request.result_json_error,
            request.result_size,
        )
        if not status.endswith(" 1"):
            return False
        await _notify(conn, f"i:{invocation_id}", "q")
    return True
