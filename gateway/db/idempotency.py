"""Idempotency-Keys: a request's key is taken in the transaction that submits its calls,
so a retry finds what the first one made (or that it still runs)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import asyncpg

from gateway.db._common import Conn

#: An Idempotency-Key header and the hash of the request it came with.
HttpKey: TypeAlias = tuple[str, bytes]


class KeyTaken(Exception):
    """Another request holds this Idempotency-Key (nothing was submitted)."""


@dataclass(frozen=True, slots=True)
class KeyHeld:
    """What an earlier request with an Idempotency-Key left: its request's hash, the
    invocations it made, whether it has answered, and how long ago it came."""

    request_hash: bytes
    invocation_ids: list[str]
    answered: bool
    age_s: float


_FIND_KEY = """
SELECT request_hash, invocation_ids, answered_at IS NOT NULL AS answered,
  extract(epoch FROM clock_timestamp() - created_at)::float8 AS age
FROM idempotency_keys
WHERE owner_id = $1 AND key = $2
"""

_TAKE_KEY = """
INSERT INTO idempotency_keys (owner_id, key, request_hash, answered_at)
VALUES ($1, $2, $3, CASE WHEN $4 THEN clock_timestamp() END)
ON CONFLICT (owner_id, key) DO NOTHING
RETURNING true
"""

_KEY_MADE = """
UPDATE idempotency_keys SET invocation_ids = $3::uuid[]
WHERE owner_id = $1 AND key = $2
"""

_ANSWER_KEY = """
UPDATE idempotency_keys SET answered_at = clock_timestamp()
WHERE owner_id = $1 AND key = $2 AND answered_at IS NULL
"""


async def find_key(conn: Conn, owner_id: int, key: str) -> KeyHeld | None:
    row = await conn.fetchrow(_FIND_KEY, owner_id, key)
    if row is None:
        return None
    ids = [str(i) for i in row["invocation_ids"]]
    return KeyHeld(bytes(row["request_hash"]), ids, row["answered"], float(row["age"]))


async def _take_key(
    conn: asyncpg.Connection, owner_id: int, key: HttpKey | None, *, answered: bool
) -> None:
    """Within a submission's transaction, before its inserts: take the key, or raise
    ``KeyTaken`` (a concurrent holder's insert makes this wait for its commit)."""
    if key is None:
        return
    taken = await conn.fetchval(_TAKE_KEY, owner_id, key[0], key[1], answered)
    if not taken:
        raise KeyTaken(key[0])


async def _key_made(
    conn: asyncpg.Connection, owner_id: int, key: HttpKey | None, ids: Sequence[str]
) -> None:
    if key is not None:
        await conn.execute(_KEY_MADE, owner_id, key[0], [uuid.UUID(i) for i in ids])


async def answer_key(conn: Conn, owner_id: int, key: str) -> None:
    """The request holding ``key`` has answered: retries get its invocations from now on."""
    await conn.execute(_ANSWER_KEY, owner_id, key)
