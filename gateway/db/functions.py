"""Registered functions: versions of a function stored by name for its owner, seen by whom
its visibility allows, and invoked with JSON arguments over HTTP."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import asyncpg

from bulletin_core import wire
from gateway.db._common import Conn
from gateway.db.accounts import Principal
from gateway.db.idempotency import HttpKey, _key_made, _take_key
from gateway.db.invocations import SUBMITTED_ROWS, Submitted, live_cte, room_cte, submitted


class FunctionGone(Exception):
    """The function version was unregistered: nothing was submitted."""


@dataclass(frozen=True, slots=True)
class FunctionRow:
    id: int
    owner_id: int
    info: wire.FunctionInfo


# The reads of functions share a column list (what _function_row reads) and a visibility
# test, spliced in here at import (print a constant for the statement as sent).

#: ``f`` (a function, ``o`` its owner) may be seen by the caller (``$1`` their user id, ``$2``
#: whether they see everything: an administrator, unless to run it).
_VISIBLE = """
($2 OR f.owner_id = $1 OR f.visibility = 'cluster'
  OR (f.visibility = 'group' AND o.group_name =
    (SELECT group_name FROM users WHERE id = $1)))
"""

_FUNCTION_COLUMNS = """
  f.id, f.owner_id, f.name, f.version, o.name AS owner, f.visibility, f.description,
  f.gpus, f.gpu_share, f.gpu_model, f.gpu_memory_mb, f.timeout_s, f.max_retries,
  f.expected_s, f.payload_size, extract(epoch FROM f.created_at)::float8 AS created,
  extract(epoch FROM f.registered_at)::float8 AS registered,
  f.id = (SELECT l.id FROM functions l WHERE l.owner_id = f.owner_id AND l.name = f.name
    ORDER BY l.registered_at DESC, l.id DESC LIMIT 1) AS latest
"""

_LOCK_NAME = """
-- One registration of a name at a time: which version is the latest stays clear.
SELECT pg_advisory_xact_lock(hashtext($1), $2::int)
"""

_INSERT_FUNCTION = """
INSERT INTO functions (owner_id, name, version, visibility, description, gpus,
  gpu_model, gpu_memory_mb, timeout_s, max_retries, expected_s, payload,
  payload_blob, payload_size, gpu_share, created_at, registered_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
  clock_timestamp(), clock_timestamp())
ON CONFLICT (owner_id, name, version) DO NOTHING
RETURNING true
"""

_MAKE_LATEST = """
UPDATE functions f SET registered_at = clock_timestamp()
WHERE owner_id = $1 AND name = $2 AND version = $3 AND f.id <> (SELECT l.id
  FROM functions l WHERE l.owner_id = $1 AND l.name = $2
  ORDER BY l.registered_at DESC, l.id DESC LIMIT 1)
"""

_SHARE_FUNCTION = """
UPDATE functions SET visibility = $3, description = $4
WHERE owner_id = $1 AND name = $2 AND (visibility, description) <> ($3, $4)
"""

_FUNCTION_VERSION = f"""
SELECT {_FUNCTION_COLUMNS}
FROM functions f JOIN users o ON o.id = f.owner_id
WHERE f.owner_id = $1 AND f.name = $2 AND f.version = $3
"""

_FIND_FUNCTION = f"""
SELECT {_FUNCTION_COLUMNS}
FROM functions f JOIN users o ON o.id = f.owner_id
WHERE f.name = $3 AND (CASE WHEN $4::text IS NULL THEN o.id = $1 ELSE o.name = $4 END)
  AND ($5::text IS NULL OR f.version = $5)
  AND {_VISIBLE}
ORDER BY f.registered_at DESC, f.id DESC
LIMIT 1
"""

# The latest version of each name: the first row of each name, DISTINCT ON it.
_LIST_FUNCTIONS = f"""
SELECT DISTINCT ON (f.name) {_FUNCTION_COLUMNS}
FROM functions f JOIN users o ON o.id = f.owner_id
WHERE (CASE WHEN $3::text IS NULL THEN o.id = $1 ELSE o.name = $3 END)
  AND {_VISIBLE} AND ($4::text IS NULL OR f.name = $4)
ORDER BY f.name, f.registered_at DESC, f.id DESC
"""

_LIST_VERSIONS = f"""
SELECT {_FUNCTION_COLUMNS}
FROM functions f JOIN users o ON o.id = f.owner_id
WHERE (CASE WHEN $3::text IS NULL THEN o.id = $1 ELSE o.name = $3 END)
  AND {_VISIBLE} AND ($4::text IS NULL OR f.name = $4)
ORDER BY f.name, f.registered_at DESC, f.id DESC
"""

_DELETE_FUNCTION = """
DELETE FROM functions WHERE owner_id = $1 AND name = $2
"""

# A JSON invocation submitted as db/invocations.py submits calls, in one statement: the
# caller's room, the call made from the function's stored envelope and resources, the live
# nodes locked when the caller places it at once.
_INVOKE = f"""
WITH {room_cte("$2", "$6", "1")}, made AS (
  INSERT INTO invocations (id, owner_id, idempotency_key, function_name, gpus,
    max_retries, timeout_s, payload, payload_blob, payload_size, gpu_model,
    gpu_memory_mb, expected_s, function_id, function_version, function_owner,
    arguments, gpu_share)
  SELECT $1, $2, $5, f.name, f.gpus, f.max_retries, f.timeout_s, f.payload,
    f.payload_blob, f.payload_size, f.gpu_model, f.gpu_memory_mb, f.expected_s,
    f.id, f.version, u.name, $4, f.gpu_share
  FROM functions f JOIN users u ON u.id = f.owner_id CROSS JOIN room
  WHERE f.id = $3 AND room.ok
  RETURNING id, extract(epoch FROM submitted_at)::float8 AS submitted
), {live_cte("$7")}
{SUBMITTED_ROWS}"""


def _function_row(r: asyncpg.Record) -> FunctionRow:
    return FunctionRow(
        id=int(r["id"]),
        owner_id=int(r["owner_id"]),
        info=wire.FunctionInfo(
            name=r["name"],
            version=r["version"],
            owner=r["owner"],
            visibility=r["visibility"],
            description=r["description"],
            resources=wire.FunctionResources(
                gpus=wire.gpu_amount(r["gpus"], r["gpu_share"]),
                gpu_model=r["gpu_model"],
                gpu_memory_mb=r["gpu_memory_mb"],
                timeout_s=r["timeout_s"],
                max_retries=r["max_retries"],
                expected_s=r["expected_s"],
            ),
            payload_size=int(r["payload_size"]),
            created=float(r["created"]),
            registered=float(r["registered"]),
            latest=bool(r["latest"]),
        ),
    )


async def register_function(
    conn: asyncpg.Connection,
    owner_id: int,
    name: str,
    version: str,
    registration: wire.FunctionRegistration,
    size: int,
) -> tuple[FunctionRow, bool]:
    """Store a version of a function (or find it again: a no-op when it is already the
    latest; an older version registered again becomes the latest). Visibility and
    description apply to every version of the name. Returns the row and whether it is new."""
    r = registration.resources
    async with conn.transaction():
        await conn.execute(_LOCK_NAME, name, owner_id)
        created = await conn.fetchval(
            _INSERT_FUNCTION,
            owner_id,
            name,
            version,
            registration.visibility,
            registration.description,
            wire.split_gpus(r.gpus)[0],
            r.gpu_model,
            r.gpu_memory_mb,
            r.timeout_s,
            r.max_retries,
            r.expected_s,
            registration.payload,
            None if registration.payload_blob is None else uuid.UUID(registration.payload_blob),
            size,
            wire.split_gpus(r.gpus)[1],
        )
        if not created:
            await conn.execute(_MAKE_LATEST, owner_id, name, version)
        await conn.execute(
            _SHARE_FUNCTION, owner_id, name, registration.visibility, registration.description
        )
        row = await conn.fetchrow(_FUNCTION_VERSION, owner_id, name, version)
    assert row is not None
    return _function_row(row), bool(created)


async def find_function(
    conn: Conn,
    caller: Principal,
    owner: str | None,
    name: str,
    version: str | None,
    *,
    to_run: bool = False,
) -> FunctionRow | None:
    """The function ``name`` of ``owner`` (None: the caller) that the caller may see (or,
    ``to_run``, invoke: administrators see every function but run only those shared with
    them): the given version, or the latest."""
    row = await conn.fetchrow(
        _FIND_FUNCTION,
        caller.user_id,
        caller.is_admin and not to_run,
        name,
        owner,
        version,
    )
    return None if row is None else _function_row(row)


async def list_functions(
    conn: Conn, caller: Principal, owner: str | None, name: str | None = None
) -> list[wire.FunctionInfo]:
    """The latest version of each function of ``owner`` (None: the caller) that the caller
    may see, by name; with ``name``, every version of that one function, newest first."""
    statement = _LIST_FUNCTIONS if name is None else _LIST_VERSIONS
    rows = await conn.fetch(statement, caller.user_id, caller.is_admin, owner, name)
    return [_function_row(r).info for r in rows]


async def delete_function(conn: Conn, owner_id: int, name: str) -> int:
    """Unregister every version of the owner's function ``name``; how many there were.
    Invocations already submitted keep their copy (or share the blob, which retention
    removes once nothing refers to it)."""
    status = await conn.execute(_DELETE_FUNCTION, owner_id, name)
    return int(status.split()[-1])


async def invoke(
    conn: asyncpg.Connection,
    owner_id: int,
    function_id: int,
    arguments: bytes,
    key: HttpKey | None = None,
    *,
    invocation_id: str | None = None,
    storage_limit: int | None = None,
    place_within: float | None = None,
) -> Submitted:
    """Within the caller's transaction: submit a JSON invocation of a registered function
    version for ``owner_id`` (who may be another user than the function's owner), as
    ``invocations.insert_calls`` submits calls (``storage_limit``, ``place_within`` as
    there: ``NoRoom``, the nodes locked); ``FunctionGone`` if the function was unregistered
    meanwhile (the transaction is then spoilt: the caller lets it roll back). With ``key``
    (an Idempotency-Key), the key is taken in the same transaction, unanswered until
    ``answer_key`` (``KeyTaken`` if another request has it). Nobody is woken: the caller
    places the call or wakes the scheduler. ``invocation_id``: the id it gets (a fresh
    random one by default)."""
    new_id = uuid.uuid4() if invocation_id is None else uuid.UUID(invocation_id)
    await _take_key(conn, owner_id, key, answered=False)
    try:
        rows = await conn.fetch(
            _INVOKE,
            new_id,
            owner_id,
            function_id,
            arguments,
            str(new_id),
            storage_limit,
            place_within,
        )
    except asyncpg.ForeignKeyViolationError:  # unregistered while this inserted
        raise FunctionGone(function_id) from None
    fresh, nodes = submitted(rows)
    if not fresh:
        raise FunctionGone(function_id)  # unregistered before the statement began
    made = [str(new_id)]
    await _key_made(conn, owner_id, key, made)
    return Submitted(made, fresh, nodes)
