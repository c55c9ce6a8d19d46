"""All of Bulletin's SQL, one typed function per statement.

Nothing else in the project writes SQL. Row locks (``FOR UPDATE SKIP LOCKED``) claim work;
LISTEN/NOTIFY (channel ``bulletin_events``) only wakes waiters, who re-read the tables.
Notification payloads: ``q`` (the queue or capacity changed: the scheduler should plan),
``n:<node_id>`` (a node has new work or revocations), ``i:<invocation_id>`` (news of an
invocation: logs, a state change). Every fenced write from a nodelet checks
``(id, node_id, epoch)`` in the statement that applies it, so a stale attempt changes nothing.
Times come from the database clock only.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Generic, TypeAlias, TypeVar

import asyncpg
import msgspec

from bulletin import wire
from scheduler import Pending, Running

CHANNEL = "bulletin_events"
#: The first nodelet protocol that acts on preemption orders.
PREEMPTING_PROTOCOL = 2
#: Nodelets older than this are never given work, even if they registered with an older
#: gateway and still poll (wire.MIN_PROTOCOL_VERSION): before protocol 4 they ran a mapped
#: node's calls as root, before 5 they had no incarnation (their node requests are refused).
SAFE_PROTOCOL = wire.MIN_PROTOCOL_VERSION
_LEASED = ("assigned", "running")

Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool
_S = TypeVar("_S", bound=msgspec.Struct)


# ------------------------------------------------------------------------------ migrations


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every numbered migration, in order."""
    found = []
    for entry in resources.files("gateway").joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text()))
    return sorted(found)


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply the migrations this database lacks; returns the names applied.

    Several gateways may start at once: a transaction-scoped advisory lock makes them take
    turns, and each re-reads the applied versions under it."""
    applied_now = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(7242001)")
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, name, sql in migration_files():
            if version in done:
                continue
            await conn.execute(sql)
            await conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name
            )
            applied_now.append(name)
    return applied_now


async def ensure_database(conn: asyncpg.Connection, name: str, template: str | None = None) -> None:
    """CREATE DATABASE unless it exists (the connection is to another database)."""
    if await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
        return
    if not name.replace("_", "").isalnum():
        raise ValueError(f"database name {name!r} must be letters, digits and underscores")
    suffix = "" if template is None else f' TEMPLATE "{template}"'
    await conn.execute(f'CREATE DATABASE "{name}"{suffix}')


# ------------------------------------------------------ the gateway's role (run as a superuser)
# Role and database names are quoted identifiers the caller checked (bulletin/admin.py); DDL
# takes no parameters, and the password arrives only as a SCRAM verifier.


async def is_superuser(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"))


async def set_login_role(conn: asyncpg.Connection, role: str, quoted: str, verifier: str) -> None:
    """Create or alter ``role`` into a plain LOGIN role (no superuser, no database or role
    creation, no replication, no RLS bypass) with the SCRAM ``verifier`` as its password."""
    exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role)
    attributes = (
        "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS "
        f"PASSWORD '{verifier}'"
    )
    await conn.execute(f"{'ALTER' if exists else 'CREATE'} ROLE {quoted} {attributes}")


async def own_database(
    conn: asyncpg.Connection, database: str, quoted_db: str, quoted_role: str
) -> None:
    """Make ``database`` (created if missing) the role's, and nobody else's to connect to."""
    if await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database):
        await conn.execute(f"ALTER DATABASE {quoted_db} OWNER TO {quoted_role}")
    else:
        await conn.execute(f"CREATE DATABASE {quoted_db} OWNER {quoted_role}")
    await conn.execute(f"REVOKE ALL ON DATABASE {quoted_db} FROM PUBLIC")


async def adopt_schema(conn: asyncpg.Connection, role: str, quoted_role: str) -> None:
    """Give the role the ``public`` schema of the connected database and everything in it
    (tables a superuser made before the role existed); nobody else may create there."""
    # PostgreSQL 15+ has the schema owned by pg_database_owner (so by the role, through
    # the database); older servers by the bootstrap superuser: hand it over either way.
    owner = await conn.fetchval(
        "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'public'"
    )
    if owner not in (role, "pg_database_owner"):
        await conn.execute(f"ALTER SCHEMA public OWNER TO {quoted_role}")
    await conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    # Tables first: their own sequences (serial, identity) follow them.
    for kinds, statement in ((["r", "p"], "TABLE"), (["v", "m"], "VIEW"), (["S"], "SEQUENCE")):
        names = await conn.fetch(
            "SELECT c.oid::regclass::text AS name, c.relkind::text AS kind FROM pg_class c"
            " WHERE c.relnamespace = 'public'::regnamespace AND c.relkind::text = ANY($1)"
            " AND c.relowner <> (SELECT oid FROM pg_roles WHERE rolname = $2)",
            kinds,
            role,
        )
        for row in names:
            kind = "MATERIALIZED VIEW" if row["kind"] == "m" else statement
            await conn.execute(f"ALTER {kind} {row['name']} OWNER TO {quoted_role}")


# -------------------------------------------------------------------------- users, nodes, tokens


@dataclass(frozen=True, slots=True)
class Principal:
    kind: str  # "user" or "node"
    user_id: int | None
    node_id: int | None
    name: str
    is_admin: bool = False
    #: A user's group (the quota unit); "" for a node.
    group: str = ""
    #: A node's current incarnation (0 for a user).
    incarnation: int = 0


async def create_user(
    conn: Conn, name: str, *, is_admin: bool = False, group: str = "default"
) -> int:
    row = await conn.fetchrow(
        "INSERT INTO users (name, is_admin, group_name) VALUES ($1, $2, $3) RETURNING id",
        name,
        is_admin,
        group,
    )
    assert row is not None
    return int(row["id"])


async def find_user(conn: Conn, name: str) -> int | None:
    value = await conn.fetchval("SELECT id FROM users WHERE name = $1", name)
    return None if value is None else int(value)


async def create_node(conn: Conn, name: str) -> int:
    """Create a node record (before its nodelet first registers) and return its id."""
    row = await conn.fetchrow(
        "INSERT INTO nodes (name) VALUES ($1)"
        " ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name RETURNING id",
        name,
    )
    assert row is not None
    return int(row["id"])


async def add_token(
    conn: Conn,
    token_hash: bytes,
    *,
    user_id: int | None = None,
    node_id: int | None = None,
    name: str = "",
    hint: str = "",
    expires_s: float | None = None,
) -> int:
    """Store a token's hash; its id. ``expires_s``: seconds it stays valid (None: always)."""
    kind = "user" if user_id is not None else "node"
    value = await conn.fetchval(
        "INSERT INTO tokens (token_hash, kind, user_id, node_id, name, hint, expires_at)"
        " VALUES ($1, $2, $3, $4, $5, $6,"
        "  clock_timestamp() + make_interval(secs => $7::float8)) RETURNING id",
        token_hash,
        kind,
        user_id,
        node_id,
        name,
        hint,
        expires_s,
    )
    return int(value)


@dataclass(frozen=True, slots=True)
class TokenRow:
    id: int
    kind: str
    owner: str
    name: str
    hint: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


async def tokens(conn: Conn, owner: str | None = None) -> list[TokenRow]:
    """Every token (of user or node ``owner`` when given), newest first; never the token."""
    rows = await conn.fetch(
        "SELECT t.id, t.kind, coalesce(u.name, n.name) AS owner, t.name, t.hint,"
        " extract(epoch FROM t.created_at) AS created_at,"
        " extract(epoch FROM t.expires_at) AS expires_at,"
        " extract(epoch FROM t.revoked_at) AS revoked_at"
        " FROM tokens t LEFT JOIN users u ON u.id = t.user_id LEFT JOIN nodes n ON n.id = t.node_id"
        " WHERE $1::text IS NULL OR coalesce(u.name, n.name) = $1 ORDER BY t.id DESC",
        owner,
    )
    return [
        TokenRow(
            r["id"],
            r["kind"],
            r["owner"],
            r["name"],
            r["hint"],
            float(r["created_at"]),
            _f(r["expires_at"]),
            _f(r["revoked_at"]),
        )
        for r in rows
    ]


async def revoke_token(conn: Conn, token_id: int) -> bool:
    """Revoke a token by id (at once: the next request with it gets 401); False if there is
    no such token or it was revoked already."""
    status = await conn.execute(
        "UPDATE tokens SET revoked_at = clock_timestamp() WHERE id = $1 AND revoked_at IS NULL",
        token_id,
    )
    return status.endswith(" 1")


async def lookup_token(conn: Conn, token_hash: bytes) -> Principal | None:
    row = await conn.fetchrow(
        "SELECT t.kind, t.user_id, t.node_id, coalesce(u.name, n.name) AS name,"
        " coalesce(u.is_admin, false) AS is_admin, coalesce(u.group_name, '') AS group_name,"
        " coalesce(n.incarnation, 0) AS incarnation"
        " FROM tokens t LEFT JOIN users u ON u.id = t.user_id"
        " LEFT JOIN nodes n ON n.id = t.node_id WHERE t.token_hash = $1"
        " AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp())",
        token_hash,
    )
    if row is None:
        return None
    return Principal(
        row["kind"],
        row["user_id"],
        row["node_id"],
        row["name"],
        row["is_admin"],
        row["group_name"],
        row["incarnation"],
    )


async def register_node(
    conn: asyncpg.Connection,
    node_id: int,
    gpus: list[wire.GpuInfo],
    cpu_slots: int,
    protocol_version: int,
) -> tuple[int, list[tuple[str, str]]]:
    """A new incarnation of the node (a nodelet started): returns its number, and what its
    earlier incarnations held (``(invocation_id, new_state)``), taken back in the same
    transaction. Nothing leased to an earlier incarnation is delivered to this one: it went
    back to the queue with its attempt counted (or failed ``node_lost``), and the next
    assignment moves its epoch on."""
    async with conn.transaction():
        incarnation = await conn.fetchval(
            "UPDATE nodes SET gpus = $2::jsonb, cpu_slots = $3, protocol_version = $4,"
            " incarnation = incarnation + 1, registered_at = clock_timestamp(),"
            " last_heartbeat = clock_timestamp() WHERE id = $1 RETURNING incarnation",
            node_id,
            msgspec.json.encode(gpus).decode(),
            cpu_slots,
            protocol_version,
        )
        taken = await _take_back(
            conn,
            "node_id = $1",
            "the nodelet running this call restarted, and what it ran was lost (node lost)",
            node_id,
            skip_locked=False,
        )
        await _notify(conn, "q")
    return int(incarnation), taken


async def registered_nodes(conn: Conn) -> list[NodeRow]:
    """Every node that has registered, draining or not, live or not: what the cluster has."""
    rows = await conn.fetch(
        f"SELECT {_NODE_COLUMNS} FROM nodes WHERE registered_at IS NOT NULL ORDER BY id"
    )
    return [_node_row(r) for r in rows]


async def leave(conn: Conn, node_id: int, incarnation: int) -> None:
    """The node's ``incarnation`` is stopping: no more work goes to it until it registers
    again (not if a later incarnation registered meanwhile)."""
    await conn.execute(
        "UPDATE nodes SET last_heartbeat = NULL WHERE id = $1 AND incarnation = $2",
        node_id,
        incarnation,
    )


# ------------------------------------------------------------------------------ blobs


async def create_blob(conn: Conn, owner_id: int) -> str:
    blob_id = uuid.uuid4()
    await conn.execute("INSERT INTO blobs (id, owner_id) VALUES ($1, $2)", blob_id, owner_id)
    return str(blob_id)


async def append_blob_chunk(conn: Conn, blob_id: str, seq: int, data: bytes) -> None:
    """Store a chunk and add its bytes to the blob's size, so that an upload still in
    progress counts towards its owner's storage (``blob_usage``)."""
    await conn.execute(
        "WITH chunk AS (INSERT INTO blob_chunks (blob_id, seq, data) VALUES ($1, $2, $3))"
        " UPDATE blobs SET size = size + $4 WHERE id = $1",
        uuid.UUID(blob_id),
        seq,
        data,
        len(data),
    )


async def storage_usage(
    conn: Conn, owner_id: int, except_blob: str | None = None
) -> tuple[int, int]:
    """What ``owner_id`` stores, in one round trip: the bytes of their blobs but
    ``except_blob`` (``blob_usage``), and of what they keep in the shared directory as far
    as the gateway knows: payload files of calls that may still run (as the sdk declared
    them) and result files not yet fetched (as the nodes reported them; the sdk deletes
    one once it loaded it)."""
    row = await conn.fetchrow(
        "SELECT (SELECT coalesce(sum(size), 0) FROM blobs WHERE owner_id = $1"
        "  AND id IS DISTINCT FROM $2) AS blobs,"
        " (SELECT coalesce(sum(CASE WHEN payload_file IS NOT NULL"
        "  AND state IN ('queued', 'assigned', 'running') THEN payload_size ELSE 0 END), 0)"
        "  + coalesce(sum(CASE WHEN result_file IS NOT NULL AND fetched_at IS NULL"
        "  THEN result_size ELSE 0 END), 0)"
        "  FROM invocations WHERE owner_id = $1"
        "  AND (payload_file IS NOT NULL OR result_file IS NOT NULL)) AS shared",
        owner_id,
        None if except_blob is None else uuid.UUID(except_blob),
    )
    assert row is not None
    return int(row["blobs"]), int(row["shared"])


async def blob_usage(conn: Conn, owner_id: int, except_blob: str | None = None) -> int:
    """Bytes of the blobs ``owner_id`` owns, complete or still uploading (their chunks so
    far), leaving out ``except_blob``."""
    value = await conn.fetchval(
        "SELECT coalesce(sum(size), 0) FROM blobs WHERE owner_id = $1"
        " AND id IS DISTINCT FROM $2",
        owner_id,
        None if except_blob is None else uuid.UUID(except_blob),
    )
    return int(value)


async def finish_blob(conn: Conn, blob_id: str, size: int) -> None:
    await conn.execute(
        "UPDATE blobs SET size = $2, complete = true WHERE id = $1", uuid.UUID(blob_id), size
    )


async def delete_blob(conn: Conn, blob_id: str) -> None:
    """Delete a blob and its chunks (an upload cut off before it was complete)."""
    await conn.execute("DELETE FROM blobs WHERE id = $1", uuid.UUID(blob_id))


async def blob_size(conn: Conn, blob_id: str, owner_id: int | None) -> int | None:
    """Size of a complete blob owned by ``owner_id`` (None: by anyone); None if there is
    none."""
    value = await conn.fetchval(
        "SELECT size FROM blobs WHERE id = $1 AND ($2::bigint IS NULL OR owner_id = $2)"
        " AND complete",
        uuid.UUID(blob_id),
        owner_id,
    )
    return None if value is None else int(value)


async def blob_chunk(conn: Conn, blob_id: str, seq: int) -> bytes | None:
    value = await conn.fetchval(
        "SELECT data FROM blob_chunks WHERE blob_id = $1 AND seq = $2", uuid.UUID(blob_id), seq
    )
    return None if value is None else bytes(value)


# ------------------------------------------------------------------------------ submission


async def submit(
    conn: asyncpg.Connection,
    owner_id: int,
    calls: Sequence[wire.CallSpec],
    key: HttpKey | None = None,
) -> list[str]:
    """Insert the calls (exactly once per idempotency key) and return their ids in order.

    A retried batch finds its earlier rows through ``(owner_id, idempotency_key)``. With an
    Idempotency-Key header's ``key``, the request's key is taken in the same transaction
    (``KeyTaken`` if another request has it)."""
    ids = [uuid.uuid4() for _ in calls]
    async with conn.transaction():
        await _take_key(conn, owner_id, key, answered=True)
        await conn.execute(
            "INSERT INTO invocations (id, owner_id, idempotency_key, function_name, gpus,"
            " max_retries, timeout_s, payload, payload_blob, payload_file, payload_size,"
            " priority, gpu_model, gpu_memory_mb, expected_s, caller_session)"
            " SELECT u.id, $1, u.key, u.fn, u.gpus, u.retries, u.timeout, u.payload, u.blob,"
            "  u.file, coalesce(length(u.payload), b.size, CASE WHEN u.file IS NOT NULL"
            "  THEN u.declared END, 0), u.priority, u.model, u.memory, u.expected, u.session"
            " FROM unnest($2::uuid[], $3::text[], $4::text[], $5::int[], $6::int[],"
            "  $7::float8[], $8::bytea[], $9::uuid[], $10::text[], $11::int[], $12::text[],"
            "  $13::int[], $14::float8[], $15::bigint[], $16::uuid[]) WITH ORDINALITY"
            "  AS u(id, key, fn, gpus, retries, timeout, payload, blob, file, priority, model,"
            "  memory, expected, declared, session, ord)"
            " LEFT JOIN blobs b ON b.id = u.blob"
            # In input order, so that seq (the queue order) follows it.
            " ORDER BY u.ord"
            " ON CONFLICT (owner_id, idempotency_key) DO NOTHING",
            owner_id,
            ids,
            [c.idempotency_key for c in calls],
            [c.function_name for c in calls],
            [c.gpus for c in calls],
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
        )
        rows = await conn.fetch(
            "SELECT i.id, k.ord FROM unnest($2::text[]) WITH ORDINALITY AS k(key, ord)"
            " JOIN invocations i ON i.owner_id = $1 AND i.idempotency_key = k.key",
            owner_id,
            [c.idempotency_key for c in calls],
        )
        by_ord = {int(r["ord"]): str(r["id"]) for r in rows}
        made = [by_ord[i + 1] for i in range(len(calls))]
        await _key_made(conn, owner_id, key, made)
        await _notify(conn, "q")
    return made


async def owned_blobs(conn: Conn, owner_id: int, blob_ids: Iterable[str]) -> set[str]:
    """The ids among ``blob_ids`` that name complete blobs of this owner."""
    rows = await conn.fetch(
        "SELECT id FROM blobs WHERE id = ANY($1::uuid[]) AND owner_id = $2 AND complete",
        [uuid.UUID(b) for b in blob_ids],
        owner_id,
    )
    return {str(r["id"]) for r in rows}


async def live_payload_files(conn: Conn) -> set[str]:
    """Payload files (relative to the shared directory) of calls that may still run."""
    rows = await conn.fetch(
        "SELECT payload_file FROM invocations"
        " WHERE payload_file IS NOT NULL AND state IN ('queued', 'assigned', 'running')"
    )
    return {r["payload_file"] for r in rows}


async def start_sessions(conn: Conn, owner_id: int, sessions: Sequence[str]) -> None:
    """The owner's caller sessions submit calls: alive now (made if new). Not written again
    within a second (concurrent submits of one session do not queue on its row)."""
    await conn.execute(
        "INSERT INTO caller_sessions (owner_id, id) SELECT $1, s FROM unnest($2::uuid[]) AS s"
        " ON CONFLICT (owner_id, id) DO UPDATE SET seen_at = clock_timestamp()"
        "  WHERE caller_sessions.seen_at < clock_timestamp() - interval '1 second'",
        owner_id,
        [uuid.UUID(s) for s in sorted(sessions)],
    )


async def keep_alive(conn: Conn, owner_id: int, session: str) -> bool:
    """The owner's caller session is still waiting; False if it has no such session (it
    submitted nothing, or all its calls ended long ago): only a submission makes one."""
    status = await conn.execute(
        "UPDATE caller_sessions SET seen_at = clock_timestamp() WHERE owner_id = $1 AND id = $2",
        owner_id,
        uuid.UUID(session),
    )
    return status.endswith(" 1")


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


async def abandon_callers(
    conn: asyncpg.Connection, timeout_s: float, late_s: float
) -> list[str]:
    """Cancel the unfinished calls whose caller session has not kept alive for ``timeout_s``
    (their GPUs are free at once; nodes kill what runs); say of queued calls whose session
    is ``late_s`` late that they wait for their caller (they are not started meanwhile:
    :func:`queued`). Returns the ids cancelled."""
    async with conn.transaction():
        rows = await conn.fetch(
            "WITH gone AS (SELECT owner_id, id, extract(epoch FROM clock_timestamp() - seen_at)"
            "  AS silent FROM caller_sessions"
            "  WHERE seen_at < clock_timestamp() - make_interval(secs => $1)),"
            " doomed AS (SELECT i.id, i.node_id, g.silent FROM invocations i"
            "  JOIN gone g ON g.owner_id = i.owner_id AND g.id = i.caller_session"
            "  WHERE i.caller_session IS NOT NULL"
            "   AND i.state IN ('queued', 'assigned', 'running') ORDER BY i.id FOR UPDATE OF i)"
            " UPDATE invocations i SET state = 'cancelled', finished_at = clock_timestamp(),"
            "  lease_expires_at = NULL, error_message = $2 || round(doomed.silent) || $3"
            " FROM doomed WHERE i.id = doomed.id RETURNING i.id, doomed.node_id",
            timeout_s,
            *ABANDONED,
        )
        if rows:
            nodes = {f"n:{r['node_id']}" for r in rows if r["node_id"] is not None}
            await _notify(conn, *(f"i:{r['id']}" for r in rows), "q", *sorted(nodes))
        await conn.execute(
            "UPDATE invocations i SET wait_reason = $2"
            " FROM caller_sessions s WHERE s.owner_id = i.owner_id AND s.id = i.caller_session"
            "  AND i.caller_session IS NOT NULL AND i.state = 'queued'"
            "  AND s.seen_at < clock_timestamp() - make_interval(secs => $1)"
            "  AND i.wait_reason IS DISTINCT FROM $2",
            late_s,
            CALLER_LATE,
        )
    return [str(r["id"]) for r in rows]


# ------------------------------------------------------------------------------ user reads


def _invocation_columns(result: str = "i.result") -> str:
    """What ``to_invocation`` reads; ``result`` may be ``NULL::bytea`` where results are left
    out (listings: the JSON result too)."""
    result_json = "NULL::bytea" if result.startswith("NULL") else "i.result_json"
    return (
        "i.id, i.state, i.function_name, i.gpus, i.attempts, i.max_retries, n.name AS node,"
        f" i.error_kind, i.error_type, i.error_message, i.traceback, {result} AS result,"
        f" i.function_version, {result_json} AS result_json, i.result_json_error,"
        " i.result_blob, i.result_file, i.log_count,"
        # Whose code made the result: a registered function's owner (unknown, NULL, for one
        # unregistered before it was recorded), else the caller.
        " CASE WHEN i.function_version IS NOT NULL THEN i.function_owner"
        "  ELSE (SELECT u.name FROM users u WHERE u.id = i.owner_id) END AS code_owner,"
        " extract(epoch FROM i.submitted_at) AS t_submitted,"
        " extract(epoch FROM i.scheduled_at) AS t_scheduled,"
        " extract(epoch FROM i.delivered_at) AS t_delivered,"
        " extract(epoch FROM i.worker_acquired_at) AS t_worker_acquired,"
        " extract(epoch FROM i.code_started_at) AS t_started,"
        " extract(epoch FROM i.code_finished_at) AS t_finished,"
        " extract(epoch FROM i.finished_at) AS t_stored,"
        " extract(epoch FROM i.fetched_at) AS t_fetched, i.warm,"
        " i.priority, i.preemptions, i.preempt_reason, i.queue_position, i.wait_reason"
    )


def _f(value: Any) -> float | None:
    return None if value is None else float(value)


def to_invocation(row: asyncpg.Record) -> wire.Invocation:
    return wire.Invocation(
        id=str(row["id"]),
        state=wire.State(row["state"]),
        function_name=row["function_name"],
        gpus=row["gpus"],
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
    rows = await conn.fetch(
        "UPDATE invocations SET fetched_at = clock_timestamp()"
        " WHERE id = ANY($1::uuid[]) AND owner_id = $2 AND fetched_at IS NULL"
        " AND state IN ('succeeded', 'failed', 'timed_out', 'cancelled')"
        " RETURNING id, extract(epoch FROM fetched_at) AS t",
        [uuid.UUID(i) for i in ids],
        owner_id,
    )
    return {str(r["id"]): float(r["t"]) for r in rows}


async def get_invocations(
    conn: Conn, owner_id: int | None, ids: Sequence[str]
) -> list[wire.Invocation]:
    """The invocations among ``ids`` that ``owner_id`` owns (others' are simply absent);
    ``owner_id`` None: anyone's (an administrator)."""
    rows = await conn.fetch(
        f"SELECT {_invocation_columns()} FROM invocations i LEFT JOIN nodes n ON n.id = i.node_id"
        " WHERE i.id = ANY($1::uuid[]) AND ($2::bigint IS NULL OR i.owner_id = $2)",
        [uuid.UUID(i) for i in ids],
        owner_id,
    )
    return [to_invocation(r) for r in rows]


async def missing(conn: Conn, owner_id: int, ids: Sequence[str]) -> list[str]:
    """The ids among ``ids`` that name no invocation of ``owner_id``."""
    rows = await conn.fetch(
        "SELECT c.id FROM unnest($1::uuid[]) AS c(id)"
        " LEFT JOIN invocations i ON i.id = c.id AND i.owner_id = $2 WHERE i.id IS NULL",
        list(ids),
        owner_id,
    )
    return [str(r["id"]) for r in rows]


async def changed(
    conn: Conn, owner_id: int | None, cursors: Sequence[tuple[str, int]]
) -> list[wire.Invocation]:
    """The invocations among the cursors ``(id, log chunks seen)`` that are terminal or have
    unseen log chunks: what a watch answers with (``owner_id`` None: anyone's)."""
    rows = await conn.fetch(
        f"SELECT {_invocation_columns()} FROM unnest($1::uuid[], $2::int[]) AS c(id, seen)"
        " JOIN invocations i ON i.id = c.id AND ($3::bigint IS NULL OR i.owner_id = $3)"
        " LEFT JOIN nodes n ON n.id = i.node_id"
        " WHERE i.state IN ('succeeded', 'failed', 'timed_out', 'cancelled')"
        "  OR i.log_count > c.seen",
        [i for i, _ in cursors],
        [seen for _, seen in cursors],
        owner_id,
    )
    return [to_invocation(r) for r in rows]


async def list_invocations(conn: Conn, owner_id: int, limit: int) -> list[wire.Invocation]:
    """The newest invocations of ``owner_id``, without their results (fetch one by id)."""
    rows = await conn.fetch(
        f"SELECT {_invocation_columns('NULL::bytea')}"
        " FROM invocations i LEFT JOIN nodes n ON n.id = i.node_id"
        " WHERE i.owner_id = $1 ORDER BY i.seq DESC LIMIT $2",
        owner_id,
        limit,
    )
    return [to_invocation(r) for r in rows]


async def logs_after(
    conn: Conn, cursors: Sequence[tuple[str, int]], limit: int
) -> list[wire.LogChunk]:
    """Log chunks past each cursor ``(invocation_id, seen)``; callers pass only owned ids."""
    rows = await conn.fetch(
        "SELECT l.invocation_id, l.n, l.stream, l.data"
        " FROM unnest($1::uuid[], $2::int[]) AS c(id, seen)"
        " JOIN invocation_logs l ON l.invocation_id = c.id AND l.n > c.seen"
        " ORDER BY l.invocation_id, l.n LIMIT $3",
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
        rows = await conn.fetch(
            "WITH doomed AS (SELECT id, node_id FROM invocations"
            "  WHERE id = ANY($1::uuid[]) AND owner_id = $2"
            "  AND state IN ('queued', 'assigned', 'running') FOR UPDATE)"
            " UPDATE invocations i SET state = 'cancelled', finished_at = clock_timestamp(),"
            "  lease_expires_at = NULL FROM doomed WHERE i.id = doomed.id"
            " RETURNING i.id, doomed.node_id",
            list(ids),
            owner_id,
        )
        if rows:
            nodes = {f"n:{r['node_id']}" for r in rows if r["node_id"] is not None}
            await _notify(conn, *(f"i:{r['id']}" for r in rows), "q", *sorted(nodes))
    return [str(r["id"]) for r in rows]


async def _notify(conn: Conn, *payloads: str) -> None:
    """Send the notifications (in order) in one round trip; they go out when the
    transaction commits."""
    if len(payloads) == 1:
        await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, payloads[0])
    elif payloads:
        await conn.execute(
            "SELECT pg_notify($1, p) FROM unnest($2::text[]) WITH ORDINALITY AS n(p, o)"
            " ORDER BY o",
            CHANNEL,
            list(payloads),
        )


# ------------------------------------------------------------------------------ scheduler


@dataclass(frozen=True, slots=True)
class NodeRow:
    id: int
    name: str
    gpus: list[wire.GpuInfo]
    cpu_slots: int
    warm: list[wire.WarmWorker] = dataclasses.field(default_factory=list)


class _Stored(Generic[_S]):
    """Reads a list of ``kind`` that this gateway or another stored as JSON, ignoring the
    fields this version does not know: the wire types refuse unknown fields in requests,
    but a newer replica or nodelet may have stored more (a rolling upgrade), and one such
    row must not stop scheduling."""

    def __init__(self, kind: type[_S]) -> None:
        self._kind = kind
        self._fields = frozenset(f.encode_name for f in msgspec.structs.fields(kind))
        self._strict = msgspec.json.Decoder(list[kind])  # type: ignore[valid-type]
        self._rows = msgspec.json.Decoder(list[dict[str, Any]])

    def decode(self, text: str) -> list[_S]:
        try:  # what this version stored: every planning round reads it, so fast
            return self._strict.decode(text)
        except msgspec.ValidationError:
            return [
                msgspec.convert({k: v for k, v in row.items() if k in self._fields}, self._kind)
                for row in self._rows.decode(text)
            ]


_GPU_LIST = _Stored(wire.GpuInfo)
_WARM_LIST = _Stored(wire.WarmWorker)


async def live_nodes(
    conn: Conn, heartbeat_timeout_s: float, *, lock: bool = False
) -> list[NodeRow]:
    """Nodes heard from within the timeout and not draining: those that may get new work.
    With ``lock``, their rows stay locked until the transaction ends (the scheduler plans and
    commits under these locks)."""
    rows = await conn.fetch(
        f"SELECT {_NODE_COLUMNS} FROM nodes"
        " WHERE last_heartbeat > clock_timestamp() - make_interval(secs => $1) AND NOT draining"
        f" AND protocol_version >= {SAFE_PROTOCOL}"
        " ORDER BY id" + (" FOR UPDATE" if lock else ""),
        heartbeat_timeout_s,
    )
    return [_node_row(r) for r in rows]


_NODE_COLUMNS = "id, name, gpus::text AS gpus, cpu_slots, warm::text AS warm"


def _node_row(r: asyncpg.Record) -> NodeRow:
    return NodeRow(
        r["id"],
        r["name"],
        _GPU_LIST.decode(r["gpus"]),
        r["cpu_slots"],
        _WARM_LIST.decode(r["warm"]),
    )


async def leases(conn: Conn) -> list[Running]:
    """Every call holding resources on a node (assigned or running), as the scheduler sees
    it; ``start_time`` is when it got them (database clock)."""
    rows = await conn.fetch(
        'SELECT i.id::text AS id, i.node_id, i.gpu_indices, u.name AS "user",'
        ' u.group_name AS "group", i.function_name AS function, i.priority, i.borrowed,'
        " i.preempt_at IS NOT NULL AS preempting,"
        " extract(epoch FROM coalesce(i.scheduled_at, i.submitted_at))::float8 AS start_time,"
        " coalesce(i.expected_s, i.timeout_s) AS expected_s,"
        # Preempting frees GPUs only; nodelets before protocol 2 cannot be told to.
        f" i.gpus > 0 AND n.protocol_version >= {PREEMPTING_PROTOCOL} AS preemptible"
        " FROM invocations i JOIN users u ON u.id = i.owner_id JOIN nodes n ON n.id = i.node_id"
        " WHERE i.state IN ('assigned', 'running')"
    )
    return [Running(**{**r, "gpu_indices": tuple(r["gpu_indices"])}) for r in rows]


def _queued_sql(per_user: int, most: int, late_s: float) -> str:
    # The LIMITs are literals on purpose: as prepared-statement parameters PostgreSQL
    # switched to a generic plan that ran for minutes on a 120k-row backlog. Per user, through
    # the (owner_id, seq) index: a long backlog of one user must not hide everyone else's
    # calls; the users' heads are taken in turns up to ``most``, then put in queue order.
    return (
        'SELECT id, gpus, "user", "group", function, priority, gpu_model, min_memory_mib,'
        " submit_time, expected_s FROM ("
        ' SELECT q.id::text AS id, q.gpus, u.name AS "user", u.group_name AS "group",'
        "  q.function_name AS function, q.priority, q.gpu_model,"
        "  coalesce(q.gpu_memory_mb, 0) AS min_memory_mib,"
        "  extract(epoch FROM q.submitted_at)::float8 AS submit_time,"
        "  coalesce(q.expected_s, q.timeout_s) AS expected_s, q.seq, q.turn"
        "  FROM users u CROSS JOIN LATERAL (SELECT id, gpus, function_name, priority,"
        "   gpu_model, gpu_memory_mb, seq, submitted_at, expected_s, timeout_s,"
        "   row_number() OVER (ORDER BY seq) AS turn FROM invocations i"
        "   WHERE owner_id = u.id AND state = 'queued' AND (caller_session IS NULL"
        # A call whose caller is late is not started: it is cancelled if the caller is gone.
        # (A session row a database crash lost, written without waiting for the WAL, leaves
        # its calls as if detached.)
        "    OR NOT EXISTS (SELECT 1 FROM caller_sessions s WHERE s.owner_id = u.id"
        "     AND s.id = i.caller_session"
        f"     AND s.seen_at < clock_timestamp() - make_interval(secs => {float(late_s)!r})))"
        f"   ORDER BY seq LIMIT {int(per_user)}) q"
        f"  ORDER BY q.turn, q.seq LIMIT {int(most)}) heads"
        " ORDER BY seq"
    )


async def queued(conn: Conn, per_user: int, most: int, late_s: float = 1e9) -> list[Pending]:
    """The first ``per_user`` queued calls of every user, at most ``most`` in all (the
    users' heads in turns), in queue (submission) order, as the scheduler sees them; not
    those whose caller session has not kept alive for ``late_s``."""
    if per_user <= 0 or most <= 0:
        return []
    return [Pending(**r) for r in await conn.fetch(_queued_sql(per_user, most, late_s))]


async def assign(
    conn: asyncpg.Connection,
    decisions: Sequence[tuple[str, int, Sequence[int], bool]],
    lease_s: float,
) -> list[tuple[str, int]]:
    """Lease still-queued invocations to nodes: ``(invocation_id, node_id, gpu_indices,
    borrowed)``. Returns the (invocation_id, node_id) pairs actually assigned (a call
    cancelled meanwhile is skipped). The caller holds the node rows locked
    (``live_nodes(lock=True)``) and computed capacity under that lock, in the same
    transaction."""
    rows = await conn.fetch(
        "UPDATE invocations i SET state = 'assigned', node_id = d.node_id,"
        " gpu_indices = d.gpus::int[], attempts = i.attempts + 1, epoch = i.epoch + 1,"
        " log_ack = -1, scheduled_at = clock_timestamp(), delivered_at = NULL, started_at = NULL,"
        " worker_acquired_at = NULL, code_started_at = NULL, code_finished_at = NULL, warm = NULL,"
        " borrowed = d.borrowed, preempt_at = NULL, queue_position = NULL, wait_reason = NULL,"
        " lease_expires_at = clock_timestamp() + make_interval(secs => $4)"
        " FROM unnest($1::uuid[], $2::bigint[], $3::text[], $5::bool[])"
        "  AS d(id, node_id, gpus, borrowed)"
        " WHERE i.id = d.id AND i.state = 'queued' RETURNING i.id, i.node_id",
        [uuid.UUID(d[0]) for d in decisions],
        [d[1] for d in decisions],
        ["{" + ",".join(map(str, d[2])) + "}" for d in decisions],
        lease_s,
        [d[3] for d in decisions],
    )
    return [(str(r["id"]), int(r["node_id"])) for r in rows]


async def preempt(
    conn: asyncpg.Connection, preemptions: Sequence[tuple[str, str]]
) -> list[tuple[str, int]]:
    """Tell the nodes running these calls to stop them: ``(invocation_id, reason)``. Their
    nodes see it in their next poll or heartbeat, give the call its grace, then hand it back
    (``release``) and it is queued again. Returns (invocation_id, node_id) of those marked."""
    if not preemptions:
        return []
    rows = await conn.fetch(
        "UPDATE invocations i SET preempt_at = clock_timestamp(), preempt_reason = p.reason"
        " FROM unnest($1::uuid[], $2::text[]) AS p(id, reason)"
        " WHERE i.id = p.id AND i.state IN ('assigned', 'running') AND i.preempt_at IS NULL"
        " RETURNING i.id, i.node_id",
        [uuid.UUID(p[0]) for p in preemptions],
        [p[1] for p in preemptions],
    )
    await _notify(conn, *(f"i:{r['id']}" for r in rows))
    return [(str(r["id"]), int(r["node_id"])) for r in rows]


async def explain_waits(conn: Conn, waits: Sequence[tuple[str, int, str]]) -> None:
    """Store where queued calls stand and why they wait: ``(id, position, reason)``."""
    if not waits:
        return
    await conn.execute(
        "UPDATE invocations i SET queue_position = w.position, wait_reason = w.reason"
        " FROM unnest($1::uuid[], $2::int[], $3::text[]) AS w(id, position, reason)"
        " WHERE i.id = w.id AND i.state = 'queued'"
        "  AND (i.queue_position, i.wait_reason) IS DISTINCT FROM (w.position, w.reason)",
        [uuid.UUID(w[0]) for w in waits],
        [w[1] for w in waits],
        [w[2] for w in waits],
    )


async def notify_nodes(conn: Conn, node_ids: Iterable[int]) -> None:
    await _notify(conn, *(f"n:{n}" for n in sorted(set(node_ids))))


async def expire_leases(
    conn: asyncpg.Connection, preempt_overdue_s: float | None = None, most: int | None = None
) -> list[tuple[str, str]]:
    """Return at most ``most`` attempts whose lease ran out to the queue (epoch moves on at
    the next assignment) while retries remain, else fail them as ``node_lost``. An attempt
    being preempted is queued again without using a retry, as if handed back; so is one whose
    preemption is more than ``preempt_overdue_s`` old (its node never handed it back: it
    sees it revoked). Returns (invocation_id, new_state) pairs."""
    overdue = 1e9 if preempt_overdue_s is None else preempt_overdue_s
    async with conn.transaction():
        return await _take_back(
            conn,
            "lease_expires_at < clock_timestamp()"
            " OR preempt_at < clock_timestamp() - make_interval(secs => $1)",
            "the node running this call stopped renewing its lease (node lost)",
            overdue,
            most=most,
        )


async def silence(conn: Conn, silent_s: float) -> tuple[int, int, int]:
    """Of the held attempts (assigned or running), how many leases ran out; how many nodes
    hold attempts; and how many of those have not been heard from for ``silent_s`` (or
    left)."""
    row = await conn.fetchrow(
        "SELECT count(*) FILTER (WHERE i.lease_expires_at < clock_timestamp()) AS overdue,"
        " count(DISTINCT i.node_id) AS holding, count(DISTINCT i.node_id) FILTER"
        "  (WHERE n.last_heartbeat IS NULL"
        "   OR n.last_heartbeat < clock_timestamp() - make_interval(secs => $1)) AS silent"
        " FROM invocations i JOIN nodes n ON n.id = i.node_id"
        " WHERE i.state IN ('assigned', 'running')",
        silent_s,
    )
    assert row is not None
    return int(row["overdue"]), int(row["holding"]), int(row["silent"])


async def extend_leases(conn: Conn, lease_s: float) -> int:
    """Give every held attempt at least a full lease from now: while the database was away
    no node could renew, and none may lose its work for that. Returns how many."""
    status = await conn.execute(
        "WITH held AS (SELECT id FROM invocations WHERE state IN ('assigned', 'running')"
        "  AND lease_expires_at < clock_timestamp() + make_interval(secs => $1)"
        "  ORDER BY id FOR UPDATE SKIP LOCKED)"
        " UPDATE invocations i SET"
        "  lease_expires_at = clock_timestamp() + make_interval(secs => $1)"
        " FROM held WHERE i.id = held.id",
        lease_s,
    )
    return int(status.split()[-1])


async def _take_back(
    conn: asyncpg.Connection,
    where: str,
    lost: str,
    arg: object,
    *,
    most: int | None = None,
    skip_locked: bool = True,
) -> list[tuple[str, str]]:
    """Take back the held attempts matching ``where`` (SQL on ``invocations``, ``$1`` being
    ``arg``): requeue those being preempted without using a retry, the others while retries
    remain; fail the rest ``node_lost``, saying ``lost`` (what happened to the node) first.
    An attempt its node never got (assigned, not delivered) never ran: it is requeued
    uncounted too. At most ``most``, those expired longest first (a literal LIMIT: see
    _queued_sql). Each call's log says what happened (:func:`_note`). The caller holds a
    transaction."""
    # In id order (and expired longest first when capped): concurrent takers lock alike.
    order = " ORDER BY id" if most is None else f" ORDER BY lease_expires_at, id LIMIT {int(most)}"
    rows = await conn.fetch(
        # An attempt never delivered never ran: like a preempted one, it is not counted.
        "WITH lost AS (SELECT id, preempt_at IS NOT NULL AS preempted,"
        "  preempt_at IS NOT NULL OR (state = 'assigned' AND delivered_at IS NULL) AS uncounted"
        f"  FROM invocations WHERE state IN ('assigned', 'running') AND ({where}){order}"
        f"  FOR UPDATE{' SKIP LOCKED' if skip_locked else ''}),"
        " e AS (SELECT i.id, e.uncounted OR i.attempts <= i.max_retries AS requeue,"
        "  e.preempted, e.uncounted FROM invocations i JOIN lost e ON e.id = i.id)"
        " UPDATE invocations i SET"
        "  state = CASE WHEN e.requeue THEN 'queued' ELSE 'failed' END,"
        "  attempts = i.attempts - e.uncounted::int,"
        "  preemptions = i.preemptions + e.preempted::int,"
        "  error_kind = CASE WHEN e.requeue THEN NULL ELSE 'node_lost' END,"
        "  error_message = CASE WHEN e.requeue THEN NULL ELSE $2"
        "   || ' after ' || i.attempts || ' attempt(s); raise max_retries to retry more' END,"
        "  finished_at = CASE WHEN e.requeue THEN NULL ELSE clock_timestamp() END,"
        "  scheduled_at = CASE WHEN e.requeue THEN NULL ELSE i.scheduled_at END,"
        "  node_id = NULL, gpu_indices = '{}', lease_expires_at = NULL,"
        "  borrowed = false, preempt_at = NULL"
        " FROM e WHERE i.id = e.id RETURNING i.id, i.state, e.preempted, e.uncounted,"
        "  i.preempt_reason, i.attempts, i.max_retries",
        arg,
        lost,
    )
    if rows:
        await _note(conn, [(str(r["id"]), _requeue_note(r, lost)) for r in rows])
        await _notify(conn, *(f"i:{r['id']}" for r in rows), "q")
    return [(str(r["id"]), r["state"]) for r in rows]


def _requeue_note(row: asyncpg.Record, lost: str) -> str:
    """What a call's log says when its attempt was taken back."""
    if row["preempted"]:
        return _preempted_note(row["preempt_reason"])
    if row["uncounted"]:
        return f"{lost} before the call reached it: queued again; no attempt is counted"
    if row["state"] == "queued":
        return (
            f"{lost}: queued again to run from the start (attempt {row['attempts'] + 1} of "
            f"at most {row['max_retries'] + 1})"
        )
    return f"{lost}: no retries left (max_retries={row['max_retries']}); the call failed"


def _preempted_note(reason: str | None) -> str:
    why = f" ({reason})" if reason else ""
    return f"preempted{why}: stopped and queued again; this run does not count as an attempt"


#: Bulletin's own lines in a call's log (stderr) start with this.
NOTE_PREFIX = "[bulletin] "


async def _note(conn: asyncpg.Connection, notes: Sequence[tuple[str, str]]) -> None:
    """Append a line of Bulletin's own to each call's log (``(invocation_id, text)``), after
    whatever its attempts wrote. The caller holds the calls' rows locked (updated in its
    transaction), as log appends do."""
    await conn.execute(
        "WITH c AS (UPDATE invocations i SET log_count = i.log_count + 1"
        "  FROM unnest($1::uuid[], $2::text[]) AS n(id, text) WHERE i.id = n.id"
        "  RETURNING i.id, i.log_count, n.text)"
        " INSERT INTO invocation_logs (invocation_id, n, stream, data)"
        " SELECT id, log_count, $3, convert_to($4 || text || chr(10), 'UTF8') FROM c",
        [uuid.UUID(i) for i, _ in notes],
        [text for _, text in notes],
        int(wire.Stream.STDERR),
        NOTE_PREFIX,
    )


# -------------------------------------------------------------------- groups, quotas, usage


@dataclass(frozen=True, slots=True)
class GroupRow:
    name: str
    guaranteed_gpus: int
    #: None: may borrow every idle GPU.
    borrow_limit_gpus: int | None
    users: int = 0


async def groups(conn: Conn) -> list[GroupRow]:
    rows = await conn.fetch(
        "SELECT g.name, g.guaranteed_gpus, g.borrow_limit_gpus, count(u.id) AS users"
        " FROM groups g LEFT JOIN users u ON u.group_name = g.name GROUP BY g.name ORDER BY g.name"
    )
    return [
        GroupRow(r["name"], r["guaranteed_gpus"], r["borrow_limit_gpus"], r["users"]) for r in rows
    ]


async def set_group(
    conn: Conn, name: str, guaranteed_gpus: int, borrow_limit_gpus: int | None
) -> GroupRow:
    """Create group ``name`` or change its quota; the group as it now is."""
    row = await conn.fetchrow(
        "INSERT INTO groups (name, guaranteed_gpus, borrow_limit_gpus) VALUES ($1, $2, $3)"
        " ON CONFLICT (name) DO UPDATE SET guaranteed_gpus = EXCLUDED.guaranteed_gpus,"
        " borrow_limit_gpus = EXCLUDED.borrow_limit_gpus"
        " RETURNING name, guaranteed_gpus, borrow_limit_gpus,"
        " (SELECT count(*) FROM users WHERE group_name = $1) AS users",
        name,
        guaranteed_gpus,
        borrow_limit_gpus,
    )
    assert row is not None
    await _notify(conn, "q")
    return GroupRow(**row)


async def group_exists(conn: Conn, name: str) -> bool:
    return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM groups WHERE name = $1)", name))


async def set_user_group(conn: Conn, user: str, group: str) -> bool:
    """Move a user to an existing group; False if there is no such user."""
    status = await conn.execute("UPDATE users SET group_name = $2 WHERE name = $1", user, group)
    return status.endswith(" 1")


async def now(conn: Conn) -> float:
    """The database clock, in seconds since the epoch."""
    return float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())"))


async def fair_usage(conn: Conn) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """Decayed GPU-seconds per group, and per (group, user), as of the last accrual."""
    rows = await conn.fetch("SELECT group_name, user_name, decayed_gpu_seconds FROM fair_usage")
    groups = {r["group_name"]: r["decayed_gpu_seconds"] for r in rows if r["user_name"] == ""}
    users = {
        (r["group_name"], r["user_name"]): r["decayed_gpu_seconds"]
        for r in rows
        if r["user_name"] != ""
    }
    return groups, users


async def accrue_usage(conn: asyncpg.Connection, half_life_s: float) -> None:
    """Add the GPU-seconds used since the last accrual: to each user's day (accounting) and,
    after decaying what is there by the time passed, to each group's and user's fair-share
    usage. Calls that ended since count up to their end."""
    async with conn.transaction():
        clock = await conn.fetchrow(
            "SELECT accrued_at, clock_timestamp() AS now FROM usage_clock FOR UPDATE"
        )
        assert clock is not None
        # Two index scans (leased calls; calls ended since): no pass over the whole table.
        ran = await conn.fetch(
            "WITH ran AS ("
            "  SELECT owner_id, gpus, scheduled_at, finished_at FROM invocations"
            "  WHERE state IN ('assigned', 'running')"
            "  UNION ALL"
            "  SELECT owner_id, gpus, scheduled_at, finished_at FROM invocations"
            "  WHERE finished_at > $1 AND scheduled_at IS NOT NULL)"
            " SELECT r.owner_id, u.name AS user_name, u.group_name,"
            " sum(r.gpus * extract(epoch FROM least($2, coalesce(r.finished_at, $2))"
            "  - greatest($1, r.scheduled_at))) AS gpu_s,"
            " count(*) FILTER (WHERE r.finished_at > $1) AS ended"
            " FROM ran r JOIN users u ON u.id = r.owner_id WHERE r.scheduled_at < $2"
            " GROUP BY r.owner_id, u.name, u.group_name",
            clock["accrued_at"],
            clock["now"],
        )
        await conn.execute("UPDATE usage_clock SET accrued_at = $1", clock["now"])
        seconds = (clock["now"] - clock["accrued_at"]).total_seconds()
        await conn.execute(
            "UPDATE fair_usage SET decayed_gpu_seconds = decayed_gpu_seconds * $1",
            0.5 ** (max(0.0, seconds) / half_life_s),
        )
        if not ran:
            return
        owners = [r["owner_id"] for r in ran]
        names = [r["user_name"] for r in ran]
        groups = [r["group_name"] for r in ran]
        used = [max(0.0, float(r["gpu_s"] or 0)) for r in ran]
        await conn.execute(
            "INSERT INTO usage_daily (day, user_id, group_name, gpu_seconds, calls)"
            " SELECT ($1::timestamptz AT TIME ZONE 'UTC')::date, u.owner, u.grp, u.used, u.ended"
            " FROM unnest($2::bigint[], $3::text[], $4::float8[], $5::bigint[])"
            "  AS u(owner, grp, used, ended)"
            " ON CONFLICT (day, user_id, group_name) DO UPDATE SET"
            " gpu_seconds = usage_daily.gpu_seconds + EXCLUDED.gpu_seconds,"
            " calls = usage_daily.calls + EXCLUDED.calls",
            clock["now"],
            owners,
            groups,
            used,
            [r["ended"] for r in ran],
        )
        await conn.execute(
            "INSERT INTO fair_usage (group_name, user_name, decayed_gpu_seconds)"
            " SELECT u.grp, k.who, sum(u.used)"
            " FROM unnest($1::text[], $2::text[], $3::float8[]) AS u(grp, name, used),"
            "  LATERAL (VALUES (u.name), ('')) AS k(who)"
            " GROUP BY u.grp, k.who"
            " ON CONFLICT (group_name, user_name) DO UPDATE SET"
            " decayed_gpu_seconds = fair_usage.decayed_gpu_seconds + EXCLUDED.decayed_gpu_seconds",
            groups,
            names,
            used,
        )


@dataclass(frozen=True, slots=True)
class UsageRow:
    user: str
    group: str
    gpu_seconds: float
    calls: int


async def usage(conn: Conn, days: int) -> list[UsageRow]:
    """GPU-seconds and ended calls per user and group over the last ``days`` days (UTC)."""
    rows = await conn.fetch(
        "SELECT u.name, d.group_name, sum(d.gpu_seconds) AS gpu_s, sum(d.calls) AS calls"
        " FROM usage_daily d JOIN users u ON u.id = d.user_id"
        " WHERE d.day > (now() AT TIME ZONE 'UTC')::date - $1::int"
        " GROUP BY u.name, d.group_name ORDER BY gpu_s DESC, u.name",
        days,
    )
    return [UsageRow(r["name"], r["group_name"], float(r["gpu_s"]), int(r["calls"])) for r in rows]


# ------------------------------------------------------------------------------ node routes


def _attempt_arrays(running: Sequence[wire.Attempt]) -> tuple[list[str], list[int]]:
    """Attempts as two parallel arrays, for ``unnest($n::uuid[], $m::int[])``."""
    return [a.invocation_id for a in running], [a.epoch for a in running]


_JSON = msgspec.json.Encoder()


@dataclass(frozen=True)
class Drain:
    draining: bool
    reason: str | None


async def heartbeat(
    conn: asyncpg.Connection,
    node_id: int,
    incarnation: int,
    running: Sequence[wire.Attempt],
    lease_s: float,
    health: Sequence[wire.GpuHealthReport] = (),
    warm: Sequence[wire.WarmWorker] = (),
) -> tuple[StopOrders, Drain]:
    """Mark the node alive, store its GPUs' health (a critical GPU drains the node), renew
    the leases it still holds; return the attempts it must stop and whether it drains. The
    node row is written only for its current ``incarnation`` (a heartbeat of an earlier one
    in flight across a new registration changes nothing of it)."""
    critical = "; ".join(f"GPU {h.index}: {h.critical}" for h in health if h.critical)
    async with conn.transaction():
        row = await conn.fetchrow(
            "UPDATE nodes SET last_heartbeat = clock_timestamp(),"
            " gpu_health = CASE WHEN $2 THEN $3::jsonb ELSE gpu_health END,"
            " health_at = CASE WHEN $2 THEN clock_timestamp() ELSE health_at END,"
            " drain_reason = CASE WHEN $4 <> '' AND NOT draining THEN $4 ELSE drain_reason END,"
            " draining = draining OR $4 <> '', warm = $5::jsonb"
            " WHERE id = $1 AND incarnation = $6 RETURNING draining, drain_reason",
            node_id,
            bool(health),
            _JSON.encode(list(health)).decode(),
            critical,
            _JSON.encode(list(warm)).decode(),
            incarnation,
        )
        held = await conn.fetch(
            "UPDATE invocations i"
            " SET lease_expires_at = clock_timestamp() + make_interval(secs => $4)"
            " FROM unnest($2::uuid[], $3::int[]) AS a(id, epoch)"
            " WHERE i.id = a.id AND i.epoch = a.epoch AND i.node_id = $1"
            "  AND i.state IN ('assigned', 'running')"
            " RETURNING i.id, i.preempt_at IS NOT NULL AS preempt, i.preempt_reason",
            node_id,
            *_attempt_arrays(running),
            lease_s,
        )
    orders = _orders(running, {str(r["id"]): r for r in held})
    drain = Drain(bool(row["draining"]), row["drain_reason"]) if row else Drain(False, None)
    return orders, drain


async def set_draining(conn: Conn, name: str, draining: bool, reason: str | None) -> bool:
    """Drain (no new work) or undrain a node by name; False if there is no such node."""
    status = await conn.execute(
        "UPDATE nodes SET draining = $2, drain_reason = $3 WHERE name = $1",
        name,
        draining,
        reason if draining else None,
    )
    if status.endswith(" 1") and not draining:
        await _notify(conn, "q")  # it may take work again
    return status.endswith(" 1")


@dataclass(frozen=True)
class NodeStatus:
    name: str
    gpus: int
    cpu_slots: int
    last_heartbeat: float | None
    draining: bool
    drain_reason: str | None
    gpu_health: list[wire.GpuHealthReport]


async def node_statuses(conn: Conn) -> list[NodeStatus]:
    rows = await conn.fetch(
        "SELECT name, jsonb_array_length(gpus) AS gpus, cpu_slots,"
        " extract(epoch FROM last_heartbeat) AS heard, draining, drain_reason,"
        " gpu_health::text AS health FROM nodes ORDER BY name"
    )
    return [
        NodeStatus(
            r["name"],
            r["gpus"],
            r["cpu_slots"],
            _f(r["heard"]),
            r["draining"],
            r["drain_reason"],
            _HEALTH_LIST.decode(r["health"]),
        )
        for r in rows
    ]


_HEALTH_LIST = _Stored(wire.GpuHealthReport)


@dataclass(frozen=True, slots=True)
class StopOrders:
    """What a node must stop: attempts no longer leased to it, and attempts to preempt
    (``(attempt, reason)``)."""

    revoked: list[wire.Attempt]
    preempt: list[tuple[wire.Attempt, str]]


def _orders(running: Sequence[wire.Attempt], kept: dict[str, asyncpg.Record]) -> StopOrders:
    """``kept``: the rows (``preempt``, ``preempt_reason``) of attempts still leased."""
    return StopOrders(
        revoked=[a for a in running if a.invocation_id not in kept],
        preempt=[
            (a, kept[a.invocation_id]["preempt_reason"] or "")
            for a in running
            if a.invocation_id in kept and kept[a.invocation_id]["preempt"]
        ],
    )


async def stop_orders(conn: Conn, node_id: int, running: Sequence[wire.Attempt]) -> StopOrders:
    """Of the attempts in ``running``: those no longer leased to this node, and those the
    scheduler preempts."""
    if not running:
        return StopOrders([], [])
    rows = await conn.fetch(
        "SELECT a.id, i.preempt_at IS NOT NULL AS preempt, i.preempt_reason"
        " FROM unnest($2::uuid[], $3::int[]) AS a(id, epoch)"
        " JOIN invocations i ON i.id = a.id AND i.epoch = a.epoch AND i.node_id = $1"
        "  AND i.state IN ('assigned', 'running')",
        node_id,
        *_attempt_arrays(running),
    )
    return _orders(running, {str(r["id"]): r for r in rows})


async def deliver(
    conn: Conn,
    node_id: int,
    incarnation: int,
    running: Sequence[wire.Attempt],
    inline_limit: int,
    lease_s: float,
) -> list[wire.Assignment]:
    """Assigned work of this node that it does not already run, if ``incarnation`` is still
    the node's (a poll that waited while a new start registered gets nothing). Redelivered
    until the node starts it, so a lost poll answer loses nothing. Delivery renews the lease:
    the node starts its own lease clock on receipt, and must never believe in more lease than
    it has."""
    rows = await conn.fetch(
        "UPDATE invocations i SET delivered_at = coalesce(i.delivered_at, clock_timestamp()),"
        " lease_expires_at = clock_timestamp() + make_interval(secs => $5)"
        " FROM users u"
        " WHERE u.id = i.owner_id AND i.node_id = $1 AND i.state = 'assigned'"
        "  AND EXISTS (SELECT 1 FROM nodes n WHERE n.id = $1 AND n.incarnation = $6)"
        "  AND NOT EXISTS (SELECT 1 FROM unnest($2::uuid[], $3::int[]) AS a(id, epoch)"
        "   WHERE a.id = i.id AND a.epoch = i.epoch)"
        " RETURNING i.id, i.epoch, i.gpu_indices, i.timeout_s, i.function_name, i.payload_size,"
        "  i.owner_id, i.payload_file, i.arguments, i.function_owner,"
        "  u.name AS owner_name, u.is_admin AS owner_admin,"
        "  CASE WHEN i.payload_size <= $4 THEN i.payload END AS payload",
        node_id,
        *_attempt_arrays(running),
        inline_limit,
        lease_s,
        incarnation,
    )
    return [
        wire.Assignment(
            invocation_id=str(r["id"]),
            epoch=r["epoch"],
            gpu_indices=list(r["gpu_indices"]),
            timeout_s=r["timeout_s"],
            function_name=r["function_name"],
            payload_size=r["payload_size"],
            payload=None if r["payload"] is None else bytes(r["payload"]),
            payload_file=r["payload_file"],
            owner=str(r["owner_id"]),
            owner_name=r["owner_name"] or "",
            owner_admin=bool(r["owner_admin"]),
            function_owner=r["function_owner"] or "",
            arguments=None if r["arguments"] is None else bytes(r["arguments"]),
        )
        for r in rows
    ]


_FENCE = "i.id = $1 AND i.node_id = $2 AND i.epoch = $3 AND i.state IN ('assigned', 'running')"


async def start(conn: Conn, node_id: int, invocation_id: str, epoch: int) -> bool:
    status = await conn.execute(
        "UPDATE invocations i SET state = 'running',"
        " started_at = coalesce(started_at, clock_timestamp())"
        f" WHERE {_FENCE}",
        uuid.UUID(invocation_id),
        node_id,
        epoch,
    )
    if status.endswith(" 1"):
        await _notify(conn, f"i:{invocation_id}")
        return True
    return False


async def release(conn: asyncpg.Connection, node_id: int, invocation_id: str, epoch: int) -> bool:
    """Requeue an attempt its node hands back (it is stopping) without counting it against
    the call's retries; the next assignment moves the epoch on. False if stale."""
    async with conn.transaction():
        row = await conn.fetchrow(
            "SELECT i.preempt_at IS NOT NULL AS preempted, i.preempt_reason"
            f" FROM invocations i WHERE {_FENCE} FOR UPDATE",
            uuid.UUID(invocation_id),
            node_id,
            epoch,
        )
        if row is None:
            return False
        await conn.execute(
            "UPDATE invocations i SET state = 'queued', attempts = i.attempts - 1,"
            " node_id = NULL, gpu_indices = '{}', lease_expires_at = NULL,"
            " delivered_at = NULL, started_at = NULL, scheduled_at = NULL, borrowed = false,"
            " preemptions = i.preemptions + (i.preempt_at IS NOT NULL)::int, preempt_at = NULL"
            " WHERE i.id = $1",
            uuid.UUID(invocation_id),
        )
        if row["preempted"]:
            note = _preempted_note(row["preempt_reason"])
        else:
            note = "its node is stopping: queued again; this run does not count as an attempt"
        await _note(conn, [(invocation_id, note)])
        await _notify(conn, f"i:{invocation_id}", "q")
    return True


@dataclass(frozen=True, slots=True)
class PayloadSource:
    """Where an attempt's payload is: exactly one of inline bytes, a blob, a shared file."""

    inline: bytes | None
    blob: str | None
    file: str | None
    size: int


async def payload_source(
    conn: Conn, node_id: int, invocation_id: str, epoch: int
) -> PayloadSource | None:
    """Where the payload of a fenced attempt is; None if the attempt is stale."""
    row = await conn.fetchrow(
        "SELECT i.payload, i.payload_blob, i.payload_file, i.payload_size"
        f" FROM invocations i WHERE {_FENCE}",
        uuid.UUID(invocation_id),
        node_id,
        epoch,
    )
    if row is None:
        return None
    return PayloadSource(
        inline=None if row["payload"] is None else bytes(row["payload"]),
        blob=None if row["payload_blob"] is None else str(row["payload_blob"]),
        file=row["payload_file"],
        size=int(row["payload_size"]),
    )


@dataclass(frozen=True, slots=True)
class Owner:
    id: int
    name: str


async def attempt_owner(conn: Conn, node_id: int, invocation_id: str, epoch: int) -> Owner | None:
    """The owner of a fenced attempt (result blobs belong to them, its shared files are named
    after them); None if stale."""
    row = await conn.fetchrow(
        "SELECT u.id, u.name FROM invocations i JOIN users u ON u.id = i.owner_id"
        f" WHERE {_FENCE}",
        uuid.UUID(invocation_id),
        node_id,
        epoch,
    )
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
            f"SELECT i.log_count, i.log_ack FROM invocations i WHERE {_FENCE} FOR UPDATE",
            uuid.UUID(invocation_id),
            node_id,
            request.epoch,
        )
        if row is None:
            return False
        skip = max(0, row["log_ack"] + 1 - request.first_seq)
        fresh = request.chunks[skip:]
        if not fresh:
            return True
        first_n = row["log_count"] + 1
        await conn.execute(
            "INSERT INTO invocation_logs (invocation_id, n, stream, data)"
            " SELECT $1, $2 + o - 1, s, d FROM unnest($3::smallint[], $4::bytea[])"
            "  WITH ORDINALITY AS c(s, d, o)",
            uuid.UUID(invocation_id),
            first_n,
            [int(c.stream) for c in fresh],
            [c.data for c in fresh],
        )
        await conn.execute(
            "UPDATE invocations SET log_count = log_count + $2, log_ack = $3 WHERE id = $1",
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
            "UPDATE invocations i SET state = $4, error_kind = $5, error_type = $6,"
            " error_message = $7, traceback = $8, result = $9, result_blob = $10,"
            " result_file = $11, finished_at = clock_timestamp(), lease_expires_at = NULL,"
            " worker_acquired_at = to_timestamp($12), code_started_at = to_timestamp($13),"
            " code_finished_at = to_timestamp($14), warm = $15, result_json = $16,"
            " result_json_error = $17, result_size = CASE WHEN $11::text IS NULL THEN 0"
            "  ELSE $18 END"
            f" WHERE {_FENCE} AND ($10::uuid IS NULL OR EXISTS (SELECT 1 FROM blobs b"
            "  WHERE b.id = $10 AND b.owner_id = i.owner_id AND b.complete))",
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


# ------------------------------------------------------------------- registered functions


class _Gone(Exception):
    """The row a statement needed is no longer there (its transaction rolls back)."""


@dataclass(frozen=True, slots=True)
class FunctionRow:
    id: int
    owner_id: int
    info: wire.FunctionInfo


def _visible(caller: str, is_admin: str) -> str:
    """SQL: ``f`` (a function, ``o`` its owner) may be seen by the caller (user id and
    admin flag parameters)."""
    return (
        f"({is_admin} OR f.owner_id = {caller} OR f.visibility = 'cluster'"
        f" OR (f.visibility = 'group' AND o.group_name ="
        f"  (SELECT group_name FROM users WHERE id = {caller})))"
    )


_FUNCTION_COLUMNS = (
    "f.id, f.owner_id, f.name, f.version, o.name AS owner, f.visibility, f.description,"
    " f.gpus, f.gpu_model, f.gpu_memory_mb, f.timeout_s, f.max_retries, f.expected_s,"
    " f.payload_size, extract(epoch FROM f.created_at)::float8 AS created,"
    " extract(epoch FROM f.registered_at)::float8 AS registered,"
    " f.id = (SELECT l.id FROM functions l WHERE l.owner_id = f.owner_id AND l.name = f.name"
    "  ORDER BY l.registered_at DESC, l.id DESC LIMIT 1) AS latest"
)


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
                gpus=r["gpus"],
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
        # One registration of a name at a time: which version is the latest stays clear.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1), $2::int)", name, owner_id)
        created = await conn.fetchval(
            "INSERT INTO functions (owner_id, name, version, visibility, description, gpus,"
            " gpu_model, gpu_memory_mb, timeout_s, max_retries, expected_s, payload,"
            " payload_blob, payload_size, created_at, registered_at)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14,"
            "  clock_timestamp(), clock_timestamp())"
            " ON CONFLICT (owner_id, name, version) DO NOTHING RETURNING true",
            owner_id,
            name,
            version,
            registration.visibility,
            registration.description,
            r.gpus,
            r.gpu_model,
            r.gpu_memory_mb,
            r.timeout_s,
            r.max_retries,
            r.expected_s,
            registration.payload,
            None if registration.payload_blob is None else uuid.UUID(registration.payload_blob),
            size,
        )
        if not created:
            await conn.execute(
                "UPDATE functions f SET registered_at = clock_timestamp()"
                " WHERE owner_id = $1 AND name = $2 AND version = $3 AND f.id <> (SELECT l.id"
                "  FROM functions l WHERE l.owner_id = $1 AND l.name = $2"
                "  ORDER BY l.registered_at DESC, l.id DESC LIMIT 1)",
                owner_id,
                name,
                version,
            )
        await conn.execute(
            "UPDATE functions SET visibility = $3, description = $4"
            " WHERE owner_id = $1 AND name = $2 AND (visibility, description) <> ($3, $4)",
            owner_id,
            name,
            registration.visibility,
            registration.description,
        )
        row = await conn.fetchrow(
            f"SELECT {_FUNCTION_COLUMNS} FROM functions f JOIN users o ON o.id = f.owner_id"
            " WHERE f.owner_id = $1 AND f.name = $2 AND f.version = $3",
            owner_id,
            name,
            version,
        )
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
        f"SELECT {_FUNCTION_COLUMNS} FROM functions f JOIN users o ON o.id = f.owner_id"
        " WHERE f.name = $3 AND (CASE WHEN $4::text IS NULL THEN o.id = $1 ELSE o.name = $4 END)"
        "  AND ($5::text IS NULL OR f.version = $5)"
        f"  AND {_visible('$1', '$2')}"
        " ORDER BY f.registered_at DESC, f.id DESC LIMIT 1",
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
    # Without a name, only the first (latest) row of each name: DISTINCT ON the name.
    distinct = "DISTINCT ON (f.name)" if name is None else ""
    rows = await conn.fetch(
        f"SELECT {distinct} {_FUNCTION_COLUMNS}"
        " FROM functions f JOIN users o ON o.id = f.owner_id"
        " WHERE (CASE WHEN $3::text IS NULL THEN o.id = $1 ELSE o.name = $3 END)"
        f"  AND {_visible('$1', '$2')} AND ($4::text IS NULL OR f.name = $4)"
        " ORDER BY f.name, f.registered_at DESC, f.id DESC",
        caller.user_id,
        caller.is_admin,
        owner,
        name,
    )
    return [_function_row(r).info for r in rows]


async def delete_function(conn: Conn, owner_id: int, name: str) -> int:
    """Unregister every version of the owner's function ``name``; how many there were.
    Invocations already submitted keep their copy (or share the blob, which retention
    removes once nothing refers to it)."""
    status = await conn.execute(
        "DELETE FROM functions WHERE owner_id = $1 AND name = $2", owner_id, name
    )
    return int(status.split()[-1])


async def invoke(
    conn: asyncpg.Connection,
    owner_id: int,
    function_id: int,
    arguments: bytes,
    key: HttpKey | None = None,
) -> str | None:
    """Queue a JSON invocation of a registered function version for ``owner_id`` (who may be
    another user than the function's owner); its id, or None if the function is gone. With
    ``key`` (an Idempotency-Key), the key is taken in the same transaction, unanswered until
    ``answer_key`` (``KeyTaken`` if another request has it)."""
    invocation_id = uuid.uuid4()
    try:
        async with conn.transaction():
            await _take_key(conn, owner_id, key, answered=False)
            status = await conn.execute(
                "INSERT INTO invocations (id, owner_id, idempotency_key, function_name, gpus,"
                " max_retries, timeout_s, payload, payload_blob, payload_size, gpu_model,"
                " gpu_memory_mb, expected_s, function_id, function_version, function_owner,"
                " arguments)"
                " SELECT $1, $2, $5, f.name, f.gpus, f.max_retries, f.timeout_s, f.payload,"
                "  f.payload_blob, f.payload_size, f.gpu_model, f.gpu_memory_mb, f.expected_s,"
                "  f.id, f.version, u.name, $4"
                " FROM functions f JOIN users u ON u.id = f.owner_id WHERE f.id = $3",
                invocation_id,
                owner_id,
                function_id,
                arguments,
                str(invocation_id),
            )
            if not status.endswith(" 1"):
                raise _Gone
            await _key_made(conn, owner_id, key, [str(invocation_id)])
            await _notify(conn, "q")
    except (_Gone, asyncpg.ForeignKeyViolationError):  # unregistered meanwhile
        return None
    return str(invocation_id)


# ------------------------------------------------------------------------ idempotency keys


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


async def find_key(conn: Conn, owner_id: int, key: str) -> KeyHeld | None:
    row = await conn.fetchrow(
        "SELECT request_hash, invocation_ids, answered_at IS NOT NULL AS answered,"
        " extract(epoch FROM clock_timestamp() - created_at)::float8 AS age"
        " FROM idempotency_keys WHERE owner_id = $1 AND key = $2",
        owner_id,
        key,
    )
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
    taken = await conn.fetchval(
        "INSERT INTO idempotency_keys (owner_id, key, request_hash, answered_at)"
        " VALUES ($1, $2, $3, CASE WHEN $4 THEN clock_timestamp() END)"
        " ON CONFLICT (owner_id, key) DO NOTHING RETURNING true",
        owner_id,
        key[0],
        key[1],
        answered,
    )
    if not taken:
        raise KeyTaken(key[0])


async def _key_made(
    conn: asyncpg.Connection, owner_id: int, key: HttpKey | None, ids: Sequence[str]
) -> None:
    if key is not None:
        await conn.execute(
            "UPDATE idempotency_keys SET invocation_ids = $3::uuid[]"
            " WHERE owner_id = $1 AND key = $2",
            owner_id,
            key[0],
            [uuid.UUID(i) for i in ids],
        )


async def answer_key(conn: Conn, owner_id: int, key: str) -> None:
    """The request holding ``key`` has answered: retries get its invocations from now on."""
    await conn.execute(
        "UPDATE idempotency_keys SET answered_at = clock_timestamp()"
        " WHERE owner_id = $1 AND key = $2 AND answered_at IS NULL",
        owner_id,
        key,
    )


# ------------------------------------------------------------------------------- retention


@dataclass(frozen=True, slots=True)
class Purged:
    invocations: int
    blobs: int
    keys: int
    #: Shared-directory files (relative to its root) of the purged invocations: the caller
    #: deletes them.
    files: list[str]


async def purge(conn: asyncpg.Connection, retention_s: float, batch: int = 1000) -> Purged:
    """Delete up to ``batch`` invocations that ended more than ``retention_s`` ago (with their
    logs), the blobs nothing refers to any more that are that old, and Idempotency-Keys and
    idle caller sessions that old. Replicas may run it at once: each takes rows the others
    have not locked."""
    async with conn.transaction():
        rows = await conn.fetch(
            "DELETE FROM invocations WHERE id IN (SELECT id FROM invocations"
            "  WHERE finished_at < clock_timestamp() - make_interval(secs => $1)"
            "  AND state IN ('succeeded', 'failed', 'timed_out', 'cancelled')"
            f"  ORDER BY finished_at LIMIT {int(batch)} FOR UPDATE SKIP LOCKED)"
            " RETURNING payload_file, result_file",
            retention_s,
        )
        blobs = await conn.execute(
            "DELETE FROM blobs WHERE id IN (SELECT b.id FROM blobs b"
            "  WHERE b.created_at < clock_timestamp() - make_interval(secs => $1)"
            "  AND NOT EXISTS (SELECT 1 FROM invocations i WHERE i.payload_blob = b.id)"
            "  AND NOT EXISTS (SELECT 1 FROM invocations i WHERE i.result_blob = b.id)"
            "  AND NOT EXISTS (SELECT 1 FROM functions f WHERE f.payload_blob = b.id)"
            f"  LIMIT {int(batch)} FOR UPDATE SKIP LOCKED)",
            retention_s,
        )
        keys = await conn.execute(
            "DELETE FROM idempotency_keys"
            " WHERE created_at < clock_timestamp() - make_interval(secs => $1)",
            retention_s,
        )
        # A caller session silent that long, with no unfinished call, waits for nothing.
        await conn.execute(
            "DELETE FROM caller_sessions s"
            " WHERE seen_at < clock_timestamp() - make_interval(secs => $1)"
            " AND NOT EXISTS (SELECT 1 FROM invocations i WHERE i.owner_id = s.owner_id"
            "  AND i.caller_session = s.id AND i.state IN ('queued', 'assigned', 'running'))",
            retention_s,
        )
    files = [f for r in rows for f in (r["payload_file"], r["result_file"]) if f is not None]
    return Purged(len(rows), int(blobs.split()[-1]), int(keys.split()[-1]), files)
