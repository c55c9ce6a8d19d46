"""Invocations as their owners see them: submitting calls, reading them back (state,
timeline, result, logs) and cancelling them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg
import msgspec

from bulletin_core import wire
from gateway.db._common import SAFE_PROTOCOL, Conn, NodeRow, _f, _node_row, _notify
from gateway.db.idempotency import HttpKey, _key_made, _take_key

# A submission in one statement: the owner's room for more stored bytes (``room``: when a
# storage limit is set, what they store now, plus the bytes of new payload files, must fit
# it), their caller sessions alive (made if new; not written again within a second, so
# concurrent submits of one session do not queue on its row), the calls inserted, and, when
# the caller will place them at once (given the heartbeat timeout), the live nodes locked
# unless another call is queued (``place_at_once``). Nothing is written when there is no
# room. The capacity they have is read by the next statement (``holdings``): this one's
# snapshot was taken before it waited for the node locks, the next one's after. The JSON
# invocation of a registered function (db/functions.py) is submitted the same way.


def room_cte(owner: str, limit: str, adding: str) -> str:
    """The ``room`` CTE, for these parameters (``$n`` of the statement it goes in)."""
    return f"""room AS (
  SELECT b.blobs, s.shared,
    {limit}::bigint IS NULL OR b.blobs + s.shared + {adding}::bigint <= {limit}::bigint AS ok
  FROM (SELECT coalesce(sum(size), 0)::bigint AS blobs FROM blobs
        WHERE {limit}::bigint IS NOT NULL AND owner_id = {owner}) b,
       (SELECT (coalesce(sum(CASE WHEN payload_file IS NOT NULL
           AND state IN ('queued', 'assigned', 'running') THEN payload_size ELSE 0 END), 0)
         + coalesce(sum(CASE WHEN result_file IS NOT NULL AND fetched_at IS NULL
           THEN result_size ELSE 0 END), 0))::bigint AS shared
        FROM invocations
        WHERE {limit}::bigint IS NOT NULL AND owner_id = {owner}
          AND (payload_file IS NOT NULL OR result_file IS NOT NULL)) s
)"""


def live_cte(within: str) -> str:
    """The ``live`` CTE: the nodes heard from within ``within`` seconds (NULL: none),
    locked, none while another call is queued (its own statement's calls are not seen)."""
    return f"""live AS (
  SELECT id, name, gpus::text AS gpus, cpu_slots, warm::text AS warm
  FROM nodes
  WHERE {within}::float8 IS NOT NULL AND (SELECT ok FROM room)
    AND last_heartbeat > clock_timestamp() - make_interval(secs => {within}::float8)
    AND NOT draining AND removed_at IS NULL AND protocol_version >= {SAFE_PROTOCOL}
    AND NOT EXISTS (SELECT 1 FROM invocations WHERE state = 'queued')
  ORDER BY id
  FOR UPDATE
)"""


#: What a submission statement answers: one 'room' row, a 'call' row per call inserted, a
#: 'node' row per node locked (``submitted``).
SUBMITTED_ROWS = """
SELECT 'room' AS kind, NULL::uuid AS id, NULL::float8 AS submitted, room.blobs, room.shared,
  room.ok, NULL::bigint AS node_id, NULL::text AS name, NULL::text AS gpus,
  NULL::int AS cpu_slots, NULL::text AS warm
FROM room
UNION ALL
SELECT 'call', id, submitted, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM made
UNION ALL
SELECT 'node', NULL, NULL, NULL, NULL, NULL, id, name, gpus, cpu_slots, warm FROM live
"""

_SUBMIT = f"""
WITH {room_cte("$1", "$18", "$19")}, sessions AS (
  INSERT INTO caller_sessions (owner_id, id)
  SELECT DISTINCT $1::bigint, u.session FROM unnest($16::uuid[]) AS u(session), room
  WHERE room.ok AND u.session IS NOT NULL
  ON CONFLICT (owner_id, id) DO UPDATE SET seen_at = clock_timestamp()
    WHERE caller_sessions.seen_at < clock_timestamp() - interval '1 second'
), made AS (
  INSERT INTO invocations (id, owner_id, idempotency_key, function_name, gpus,
    max_retries, timeout_s, payload, payload_blob, payload_file, payload_size,
    priority, gpu_model, gpu_memory_mb, expected_s, caller_session, map_id, gpu_share)
  SELECT u.id, $1, u.key, u.fn, u.gpus, u.retries, u.timeout, u.payload, u.blob,
    u.file, coalesce(length(u.payload), b.size, CASE WHEN u.file IS NOT NULL
    THEN u.declared END, 0), u.priority, u.model, u.memory, u.expected, u.session, $17::uuid,
    u.share
  FROM unnest($2::uuid[], $3::text[], $4::text[], $5::int[], $6::int[],
    $7::float8[], $8::bytea[], $9::uuid[], $10::text[], $11::int[], $12::text[],
    $13::int[], $14::float8[], $15::bigint[], $16::uuid[], $21::float8[]) WITH ORDINALITY
    AS u(id, key, fn, gpus, retries, timeout, payload, blob, file, priority, model,
    memory, expected, declared, session, share, ord)
  CROSS JOIN room
  LEFT JOIN blobs b ON b.id = u.blob
  WHERE room.ok
  -- In input order, so that seq (the queue order) follows it.
  ORDER BY u.ord
  ON CONFLICT (owner_id, idempotency_key) DO NOTHING
  RETURNING id, extract(epoch FROM submitted_at)::float8 AS submitted
), {live_cte("$20")}
{SUBMITTED_ROWS}"""

_SUBMITTED = """
SELECT i.id, k.ord
FROM unnest($2::text[]) WITH ORDINALITY AS k(key, ord)
JOIN invocations i ON i.owner_id = $1 AND i.idempotency_key = k.key
"""

_LIVE_PAYLOAD_FILES = """
SELECT payload_file FROM invocations
WHERE payload_file IS NOT NULL AND state IN ('queued', 'assigned', 'running')
"""


def _invocation_columns(result: str = "i.result", row: str = "i") -> str:
    """What ``to_invocation`` reads, from the invocations row ``row`` (and ``n``, its node);
    ``result`` may be ``NULL::bytea`` where results are left out (listings: the JSON result
    too)."""
    result_json = "NULL::bytea" if result.startswith("NULL") else f"{row}.result_json"
    i = row
    return f"""
  {i}.id, {i}.state, {i}.function_name, {i}.gpus, {i}.gpu_share, {i}.attempts,
  {i}.max_retries,
  n.name AS node, {i}.error_kind, {i}.error_type, {i}.error_message, {i}.traceback,
  {result} AS result, {i}.function_version, {result_json} AS result_json,
  {i}.result_json_error, {i}.result_blob, {i}.result_file, {i}.log_count,
  -- Whose code made the result: a registered function's owner (unknown, NULL, for one
  -- unregistered before it was recorded), else the caller.
  CASE WHEN {i}.function_version IS NOT NULL THEN {i}.function_owner
    ELSE (SELECT u.name FROM users u WHERE u.id = {i}.owner_id) END AS code_owner,
  extract(epoch FROM {i}.submitted_at) AS t_submitted,
  extract(epoch FROM {i}.scheduled_at) AS t_scheduled,
  extract(epoch FROM {i}.delivered_at) AS t_delivered,
  extract(epoch FROM {i}.worker_acquired_at) AS t_worker_acquired,
  extract(epoch FROM {i}.code_started_at) AS t_started,
  extract(epoch FROM {i}.code_finished_at) AS t_finished,
  extract(epoch FROM {i}.finished_at) AS t_stored,
  extract(epoch FROM {i}.fetched_at) AS t_fetched, {i}.warm,
  {i}.priority, {i}.preemptions, {i}.preempt_reason, {i}.queue_position, {i}.wait_reason
"""


# The three reads of whole invocations share to_invocation's long column list: it is
# spliced in once, here, at import (print a constant for the statement as sent).

_GET_INVOCATIONS = f"""
SELECT {_invocation_columns()}
FROM invocations i LEFT JOIN nodes n ON n.id = i.node_id
WHERE i.id = ANY($1::uuid[]) AND ($2::bigint IS NULL OR i.owner_id = $2)
"""

_TERMINAL = "('succeeded', 'failed', 'timed_out', 'cancelled')"

_CHANGED = f"""
SELECT {_invocation_columns()}
FROM unnest($1::uuid[], $2::int[]) AS c(id, seen)
JOIN invocations i ON i.id = c.id AND ($3::bigint IS NULL OR i.owner_id = $3)
LEFT JOIN nodes n ON n.id = i.node_id
WHERE i.state IN {_TERMINAL} OR i.log_count > c.seen
"""

# What a watch answers, stamping the first fetch of terminal invocations by their owner in the
# same statement (the answer carries the stamp). Each named call is looked up by its id
# alone, the owner checked after (LATERAL ... OFFSET 0 keeps the planner from merging the
# two): statistics lag behind a fast-growing map, and a plan cached while the table was
# small walked the owner's index, every one of the owner's calls for every id, every watch.
# With $4 (a watch's first read), an id that is not the owner's is the one row answered
# (``unknown``), and nothing is stamped.
_CHANGED_FETCHED = f"""
WITH c AS MATERIALIZED (
  SELECT c.id, s.state, s.fetched_at, s.owner_id IS DISTINCT FROM $3 AS unknown
  FROM unnest($1::uuid[], $2::int[]) AS c(id, seen)
  LEFT JOIN LATERAL (
    SELECT owner_id, state, log_count, fetched_at FROM invocations WHERE id = c.id
    OFFSET 0
  ) s ON true
  WHERE s.owner_id IS DISTINCT FROM $3 OR s.state IN {_TERMINAL} OR s.log_count > c.seen
), unk AS (
  SELECT id FROM c WHERE unknown AND $4 LIMIT 1
), f AS (
  UPDATE invocations SET fetched_at = clock_timestamp()
  WHERE id = ANY(ARRAY(SELECT id FROM c
      WHERE NOT unknown AND fetched_at IS NULL AND state IN {_TERMINAL}))
    AND fetched_at IS NULL AND state IN {_TERMINAL} AND NOT EXISTS (SELECT 1 FROM unk)
  RETURNING invocations.id, invocations.fetched_at
)
SELECT (SELECT id FROM unk) AS unknown, {
    _invocation_columns().replace(
        "extract(epoch FROM i.fetched_at) AS t_fetched",
        "extract(epoch FROM coalesce(f.fetched_at, i.fetched_at)) AS t_fetched",
    )
}
FROM c
LEFT JOIN LATERAL (
  SELECT * FROM invocations WHERE id = c.id AND NOT c.unknown OFFSET 0
) i ON true
LEFT JOIN nodes n ON n.id = i.node_id
LEFT JOIN f ON f.id = i.id
WHERE NOT c.unknown OR c.id = (SELECT id FROM unk)
"""

_LIST_INVOCATIONS = f"""
SELECT {_invocation_columns("NULL::bytea")}
FROM invocations i LEFT JOIN nodes n ON n.id = i.node_id
WHERE i.owner_id = $1
ORDER BY i.seq DESC
LIMIT $2
"""

_MARK_FETCHED = f"""
UPDATE invocations SET fetched_at = clock_timestamp()
WHERE id = ANY($1::uuid[]) AND owner_id = $2 AND fetched_at IS NULL
  AND state IN {_TERMINAL}
RETURNING id, extract(epoch FROM fetched_at) AS t
"""

_LOGS_AFTER = """
SELECT l.invocation_id, l.n, l.stream, l.data
FROM unnest($1::uuid[], $2::int[]) AS c(id, seen)
JOIN invocation_logs l ON l.invocation_id = c.id AND l.n > c.seen
ORDER BY l.invocation_id, l.n
LIMIT $3
"""

_CANCEL = """
WITH doomed AS (
  SELECT id, node_id FROM invocations
  WHERE id = ANY($1::uuid[]) AND owner_id = $2
    AND state IN ('queued', 'assigned', 'running')
  FOR UPDATE
)
UPDATE invocations i SET state = 'cancelled', finished_at = clock_timestamp(),
  lease_expires_at = NULL
FROM doomed
WHERE i.id = doomed.id
RETURNING i.id, doomed.node_id
"""


@dataclass(frozen=True, slots=True)
class Submitted:
    """A submission's invocation ids in input order, and those it created (an idempotent
    retry finds the others), with when (database clock); the live nodes it locked to place
    them on (``place_within``), none if another call was queued."""

    ids: list[str]
    fresh: dict[str, float]
    nodes: list[NodeRow] = field(default_factory=list)


class NoRoom(Exception):
    """The owner stores as much as their storage limit allows (nothing was submitted):
    ``blobs`` bytes in blobs, ``shared`` in the shared directory."""

    def __init__(self, blobs: int, shared: int) -> None:
        super().__init__(f"no room: {blobs} bytes in blobs, {shared} in the shared directory")
        self.blobs, self.shared = blobs, shared


async def insert_calls(
    conn: asyncpg.Connection,
    owner_id: int,
    calls: Sequence[wire.CallSpec],
    key: HttpKey | None = None,
    new_ids: Sequence[str] | None = None,
    *,
    map_id: str | None = None,
    storage_limit: int | None = None,
    adding_bytes: int = 0,
    place_within: float | None = None,
) -> Submitted:
    """Within the caller's transaction, in one statement: insert the calls (exactly once per
    idempotency key) and start their caller sessions.

    A retried batch finds its earlier rows through ``(owner_id, idempotency_key)``. With an
    Idempotency-Key header's ``key``, the request's key is taken in the same transaction
    (``KeyTaken`` if another request has it). Nobody is woken: the caller places the calls
    or wakes the scheduler. ``new_ids``: the ids the new ones get (fresh random ones by
    default). ``map_id``: the calls are items of that map (the caller checked that they ask
    for the same resources). ``storage_limit``: ``NoRoom`` (nothing submitted) unless what
    the owner stores plus ``adding_bytes`` (at least 1: their results) fits it.
    ``place_within``: also lock the nodes heard from within that many seconds, not
    draining, unless another call is queued (``Submitted.nodes``), for the caller to place
    the calls on in the same transaction."""
    ids = [uuid.uuid4() for _ in calls] if new_ids is None else [uuid.UUID(i) for i in new_ids]
    await _take_key(conn, owner_id, key, answered=True)
    rows = await conn.fetch(
        _SUBMIT,
        owner_id,
        ids,
        [c.idempotency_key for c in calls],
        [c.function_name for c in calls],
        [wire.split_gpus(c.gpus)[0] for c in calls],
        [c.max_retries for c in calls],
        [c.timeout_s for c in calls],
        [c.payload for c in calls],
        [None if c.payload_blob is None else uuid.UUID(c.payload_blob) for c in calls],
        [c.payload_file for c in calls],
        [c.priority for c in calls],
        [c.gpu_model for c in calls],
        [c.gpu_memory_mb for c in calls],
        [c.expected_s for c in calls],
        [c.payload_size for c in calls],
        [None if c.caller_session is None else uuid.UUID(c.caller_session) for c in calls],
        None if map_id is None else uuid.UUID(map_id),
        storage_limit,
        max(1, adding_bytes),
        place_within,
        [wire.split_gpus(c.gpus)[1] for c in calls],
    )
    fresh, nodes = submitted(rows)
    if len(fresh) == len(calls):  # the common case: no retry, no earlier rows to find
        made = [str(i) for i in ids]
    else:
        found = await conn.fetch(_SUBMITTED, owner_id, [c.idempotency_key for c in calls])
        by_ord = {int(r["ord"]): str(r["id"]) for r in found}
        made = [by_ord[i + 1] for i in range(len(calls))]
    await _key_made(conn, owner_id, key, made)
    return Submitted(made, fresh, nodes)


def submitted(rows: Sequence[asyncpg.Record]) -> tuple[dict[str, float], list[NodeRow]]:
    """What a submission statement (``SUBMITTED_ROWS``) made, by id with when, and the
    nodes it locked; ``NoRoom`` when it had no room to make anything."""
    room = rows[0]
    if not room["ok"]:
        raise NoRoom(int(room["blobs"]), int(room["shared"]))
    fresh = {str(r["id"]): float(r["submitted"]) for r in rows if r["kind"] == "call"}
    return fresh, [_node_row(r, "node_id") for r in rows if r["kind"] == "node"]


async def live_payload_files(conn: Conn) -> set[str]:
    """Payload files (relative to the shared directory) of calls that may still run."""
    rows = await conn.fetch(_LIVE_PAYLOAD_FILES)
    return {r["payload_file"] for r in rows}


def to_invocation(row: asyncpg.Record) -> wire.Invocation:
    return wire.Invocation(
        id=str(row["id"]),
        state=wire.State(row["state"]),
        function_name=row["function_name"],
        gpus=wire.gpu_amount(row["gpus"], row["gpu_share"]),
        attempts=row["attempts"],
        max_retries=row["max_retries"],
        node=row["node"],
        error_kind=None if row["error_kind"] is None else wire.ErrorKind(row["error_kind"]),
        error_type=row["error_type"],
        error_message=row["error_message"],
        traceback=row["traceback"],
        result=None if row["result"] is None else bytes(row["result"]),
        result_blob=None if row["result_blob"] is None else str(row["result_blob"]),
        result_file=row["result_file"],
        log_count=row["log_count"],
        timeline=wire.Timeline(
            submitted=_f(row["t_submitted"]),
            scheduled=_f(row["t_scheduled"]),
            delivered=_f(row["t_delivered"]),
            worker_acquired=_f(row["t_worker_acquired"]),
            started=_f(row["t_started"]),
            finished=_f(row["t_finished"]),
            stored=_f(row["t_stored"]),
            fetched=_f(row["t_fetched"]),
            warm=row["warm"],
        ),
        priority=row["priority"],
        preemptions=row["preemptions"],
        preempt_reason=row["preempt_reason"],
        queue_position=row["queue_position"] if row["state"] == "queued" else None,
        wait_reason=row["wait_reason"] if row["state"] == "queued" else None,
        function_version=row["function_version"],
        result_json=None if row["result_json"] is None else msgspec.Raw(row["result_json"]),
        result_json_error=row["result_json_error"],
        code_owner=row["code_owner"],
    )


async def mark_fetched(conn: Conn, owner_id: int, ids: Sequence[str]) -> dict[str, float]:
    """Record that their owner fetched these terminal invocations (the first time only; an
    administrator reading another user's does not count); returns when, for those that were
    not marked before."""
    rows = await conn.fetch(_MARK_FETCHED, [uuid.UUID(i) for i in ids], owner_id)
    return {str(r["id"]): float(r["t"]) for r in rows}


async def make_durable(conn: Conn) -> None:
    """Return once every commit so far is on disk. On a connection whose commits wait for
    their WAL flush (the gateway's durable pool), a transaction that wrote WAL waits at its
    commit until the WAL up to its commit record is flushed, and so every asynchronous
    commit before it is on disk as well. What it writes: a transactional logical-decoding
    message (no table grows; a logical replication consumer, if the lab runs one, sees a
    message prefixed ``bulletin``), which any role may emit. A transaction that only took
    a transaction id writes no WAL, and its commit would not wait."""
    await conn.execute("SELECT pg_logical_emit_message(true, 'bulletin', 'durable')")


async def get_invocations(
    conn: Conn, owner_id: int | None, ids: Sequence[str]
) -> list[wire.Invocation]:
    """The invocations among ``ids`` that ``owner_id`` owns (others' are simply absent);
    ``owner_id`` None: anyone's (an administrator)."""
    rows = await conn.fetch(_GET_INVOCATIONS, [uuid.UUID(i) for i in ids], owner_id)
    return [to_invocation(r) for r in rows]


async def changed(
    conn: Conn, owner_id: int | None, cursors: Sequence[tuple[str, int]]
) -> list[wire.Invocation]:
    """The invocations among the cursors ``(id, log chunks seen)`` that are terminal or have
    unseen log chunks: what a watch answers with (``owner_id`` None: anyone's)."""
    rows = await conn.fetch(
        _CHANGED, [i for i, _ in cursors], [seen for _, seen in cursors], owner_id
    )
    return [to_invocation(r) for r in rows]


class NotOwned(Exception):
    """An id that names no invocation of the owner's (``args[0]``)."""


async def changed_fetched(
    conn: Conn, owner_id: int, cursors: Sequence[tuple[str, int]], *, strict: bool = False
) -> list[wire.Invocation]:
    """As :func:`changed` for the owner's own invocations, stamping the first fetch of the
    terminal ones (their answer carries the stamp). ``strict``: raise ``NotOwned`` for the
    first id that is not the owner's, stamping nothing (else such ids are left out)."""
    rows = await conn.fetch(
        _CHANGED_FETCHED, [i for i, _ in cursors], [seen for _, seen in cursors], owner_id, strict
    )
    if rows and rows[0]["unknown"] is not None:
        raise NotOwned(str(rows[0]["unknown"]))
    return [to_invocation(r) for r in rows]


async def list_invocations(conn: Conn, owner_id: int, limit: int) -> list[wire.Invocation]:
    """The newest invocations of ``owner_id``, without their results (fetch one by id)."""
    rows = await conn.fetch(_LIST_INVOCATIONS, owner_id, limit)
    return [to_invocation(r) for r in rows]


async def logs_after(
    conn: Conn, cursors: Sequence[tuple[str, int]], limit: int
) -> list[wire.LogChunk]:
    """Log chunks past each cursor ``(invocation_id, seen)``; callers pass only owned ids."""
    rows = await conn.fetch(
        _LOGS_AFTER,
        [uuid.UUID(i) for i, _ in cursors],
        [seen for _, seen in cursors],
        limit,
    )
    return [
        wire.LogChunk(
            invocation_id=str(r["invocation_id"]),
            n=r["n"],
            stream=wire.Stream(r["stream"]),
            data=bytes(r["data"]),
        )
        for r in rows
    ]


async def cancel(conn: asyncpg.Connection, owner_id: int, ids: Sequence[str]) -> list[str]:
    """Cancel the owner's non-terminal invocations among ``ids``; returns those cancelled.

    A leased attempt is cancelled at once (its GPU counts as free again) and its node is told
    to kill the worker: the node's next poll or heartbeat lists it as revoked."""
    async with conn.transaction():
        rows = await conn.fetch(_CANCEL, list(ids), owner_id)
        if rows:
            nodes = {f"n:{r['node_id']}" for r in rows if r["node_id"] is not None}
            await _notify(conn, *(f"i:{r['id']}" for r in rows), "q", *sorted(nodes))
    return [str(r["id"]) for r in rows]
