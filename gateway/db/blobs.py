"""Blobs: payloads and results uploaded in chunks, owned by a user, and what a user stores
(blobs and shared-directory files) for their storage quota."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from gateway.db._common import Conn

_CREATE_BLOB = """
INSERT INTO blobs (id, owner_id) VALUES ($1, $2)
"""

_APPEND_BLOB_CHUNK = """
WITH chunk AS (
  INSERT INTO blob_chunks (blob_id, seq, data) VALUES ($1, $2, $3)
)
UPDATE blobs SET size = size + $4 WHERE id = $1
"""

_STORAGE_USAGE = """
SELECT
  (SELECT coalesce(sum(size), 0) FROM blobs
   WHERE owner_id = $1 AND id IS DISTINCT FROM $2) AS blobs,
  (SELECT
     coalesce(sum(CASE WHEN payload_file IS NOT NULL
       AND state IN ('queued', 'assigned', 'running') THEN payload_size ELSE 0 END), 0)
     + coalesce(sum(CASE WHEN result_file IS NOT NULL AND fetched_at IS NULL
       THEN result_size ELSE 0 END), 0)
   FROM invocations
   WHERE owner_id = $1 AND (payload_file IS NOT NULL OR result_file IS NOT NULL)) AS shared
"""

_BLOB_USAGE = """
SELECT coalesce(sum(size), 0) FROM blobs
WHERE owner_id = $1 AND id IS DISTINCT FROM $2
"""

_FINISH_BLOB = """
UPDATE blobs SET size = $2, complete = true WHERE id = $1
"""

_DELETE_BLOB = """
DELETE FROM blobs WHERE id = $1
"""

_BLOB_SIZE = """
SELECT size FROM blobs
WHERE id = $1 AND ($2::bigint IS NULL OR owner_id = $2) AND complete
"""

_BLOB_CHUNK = """
SELECT data FROM blob_chunks WHERE blob_id = $1 AND seq = $2
"""

_OWNED_BLOBS = """
SELECT id FROM blobs WHERE id = ANY($1::uuid[]) AND owner_id = $2 AND complete
"""


async def create_blob(conn: Conn, owner_id: int) -> str:
    blob_id = uuid.uuid4()
    await conn.execute(_CREATE_BLOB, blob_id, owner_id)
    return str(blob_id)


async def append_blob_chunk(conn: Conn, blob_id: str, seq: int, data: bytes) -> None:
    """Store a chunk and add its bytes to the blob's size, so that an upload still in
    progress counts towards its owner's storage (``blob_usage``)."""
    await conn.execute(_APPEND_BLOB_CHUNK, uuid.UUID(blob_id), seq, data, len(data))


async def storage_usage(
    conn: Conn, owner_id: int, except_blob: str | None = None
) -> tuple[int, int]:
    """What ``owner_id`` stores, in one round trip: the bytes of their blobs but
    ``except_blob`` (``blob_usage``), and of what they keep in the shared directory as far
    as the gateway knows: payload files of calls that may still run (as the sdk declared
    them) and result files not yet fetched (as the nodes reported them; the sdk deletes
    one once it loaded it)."""
    row = await conn.fetchrow(
        _STORAGE_USAGE, owner_id, None if except_blob is None else uuid.UUID(except_blob)
    )
    assert row is not None
    return int(row["blobs"]), int(row["shared"])


async def blob_usage(conn: Conn, owner_id: int, except_blob: str | None = None) -> int:
    """Bytes of the blobs ``owner_id`` owns, complete or still uploading (their chunks so
    far), leaving out ``except_blob``."""
    value = await conn.fetchval(
        _BLOB_USAGE, owner_id, None if except_blob is None else uuid.UUID(except_blob)
    )
    return int(value)


async def finish_blob(conn: Conn, blob_id: str, size: int) -> None:
    await conn.execute(_FINISH_BLOB, uuid.UUID(blob_id), size)


async def delete_blob(conn: Conn, blob_id: str) -> None:
    """Delete a blob and its chunks (an upload cut off before it was complete)."""
    await conn.execute(_DELETE_BLOB, uuid.UUID(blob_id))


async def blob_size(conn: Conn, blob_id: str, owner_id: int | None) -> int | None:
    """Size of a complete blob owned by ``owner_id`` (None: by anyone); None if there is
    none."""
    value = await conn.fetchval(_BLOB_SIZE, uuid.UUID(blob_id), owner_id)
    return None if value is None else int(value)


async def blob_chunk(conn: Conn, blob_id: str, seq: int) -> bytes | None:
    value = await conn.fetchval(_BLOB_CHUNK, uuid.UUID(blob_id), seq)
    return None if value is None else bytes(value)


async def owned_blobs(conn: Conn, owner_id: int, blob_ids: Iterable[str]) -> set[str]:
    """The ids among ``blob_ids`` that name complete blobs of this owner."""
    rows = await conn.fetch(_OWNED_BLOBS, [uuid.UUID(b) for b in blob_ids], owner_id)
    return {str(r["id"]) for r in rows}
