"""What the scheduler loop reads and commits: the leader lock, its snapshot (live nodes,
leases, each user's queue head), placements and preemptions, why calls wait, and lease
expiry (taking back what nodes stopped renewing)."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import asyncpg

from bulletin_core import wire
from gateway.db._common import CHANNEL, PREEMPTING_PROTOCOL, SAFE_PROTOCOL, Conn, _notify
from gateway.db.nodes import NodeRow, _assignment, _node_row, _take_back
from scheduler import Pending, Running

#: The session advisory lock the scheduling leader holds (migrations take 7242001).
LEADER_LOCK = 7242002

_TRY_LEAD = """
-- Held for as long as the session lasts: the leader's connection dropping frees it.
SELECT pg_try_advisory_lock($1)
"""

# The protocol numbers in the next two statements are Python's constants (_common), put in
# as literals at import.

_LIVE_NODES = f"""
SELECT id, name, gpus::text AS gpus, cpu_slots, warm::text AS warm
FROM nodes
WHERE last_heartbeat > clock_timestamp() - make_interval(secs => $1) AND NOT draining
  AND removed_at IS NULL AND protocol_version >= {SAFE_PROTOCOL}
ORDER BY id
"""

_LIVE_NODES_LOCKED = f"""
SELECT id, name, gpus::text AS gpus, cpu_slots, warm::text AS warm
FROM nodes
WHERE last_heartbeat > clock_timestamp() - make_interval(secs => $1) AND NOT draining
  AND removed_at IS NULL AND protocol_version >= {SAFE_PROTOCOL}
ORDER BY id
FOR UPDATE
"""

# One row per slot lease: the attempts of a map's items that run one after another in one
# lease (lease_id) hold its capacity once, through the first of them (db/slots.py).
_LEASES = f"""
SELECT DISTINCT ON (coalesce(i.lease_id, i.id))
  i.id::text AS id, i.node_id, i.gpu_indices, u.name AS "user",
  u.group_name AS "group", i.function_name AS function, i.priority, i.borrowed,
  i.preempt_at IS NOT NULL AS preempting,
  extract(epoch FROM coalesce(i.scheduled_at, i.submitted_at))::float8 AS start_time,
  coalesce(i.expected_s, i.timeout_s) AS expected_s,
  -- Preempting frees GPUs only; nodelets before protocol 2 cannot be told to.
  i.gpus > 0 AND n.protocol_version >= {PREEMPTING_PROTOCOL} AS preemptible,
  extract(epoch FROM coalesce(i.queued_at, i.submitted_at))::float8 AS queued_time,
  -- Its GPUs' models, for quotas per model (its node may not be in the round's snapshot);
  -- NULL while no group has one (read once per statement).
  CASE WHEN EXISTS (SELECT 1 FROM group_model_quotas) THEN
    array(SELECT g->>'name' FROM jsonb_array_elements(n.gpus) g
          WHERE (g->>'index')::int = ANY(i.gpu_indices))
  END AS gpu_models,
  i.gpu_share AS share, i.attained_gpu_s
FROM invocations i
JOIN users u ON u.id = i.owner_id
JOIN nodes n ON n.id = i.node_id
WHERE i.state IN ('assigned', 'running')
ORDER BY coalesce(i.lease_id, i.id), i.seq
"""

# What the capacity on locked nodes is taken by, and (with $1) the quotas and decayed usage
# a policy weighs, with the database clock's now, in one round trip: ('now'), ('lease', the
# _LEASES columns), ('quota', group, guaranteed, borrow limit), ('model_quota', model as id,
# group, guaranteed, borrow limit) and ('usage', group, user, decayed GPU-seconds) rows.
_HOLDINGS = f"""
SELECT 'now' AS kind, NULL::text AS id, NULL::bigint AS node_id, NULL::int[] AS gpu_indices,
  NULL::text AS "user", NULL::text AS "group", NULL::text AS function, NULL::int AS priority,
  NULL::bool AS borrowed, NULL::bool AS preempting,
  extract(epoch FROM clock_timestamp())::float8 AS start_time, NULL::float8 AS expected_s,
  NULL::bool AS preemptible, NULL::float8 AS queued_time, NULL::text[] AS gpu_models,
  NULL::float8 AS share, NULL::float8 AS attained_gpu_s, NULL::int AS guaranteed_gpus,
  NULL::int AS borrow_limit_gpus, NULL::float8 AS decayed_gpu_seconds
UNION ALL
SELECT 'lease', l.*, NULL, NULL, NULL FROM ({_LEASES}) l
UNION ALL
SELECT 'quota', NULL, NULL, NULL, NULL, name, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, guaranteed_gpus, borrow_limit_gpus, NULL
FROM groups WHERE $1
UNION ALL
SELECT 'model_quota', model, NULL, NULL, NULL, group_name, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, guaranteed_gpus, borrow_limit_gpus, NULL
FROM group_model_quotas WHERE $1
UNION ALL
SELECT 'usage', NULL, NULL, NULL, user_name, group_name, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, decayed_gpu_seconds
FROM fair_usage WHERE $1
"""

# Each node given work is woken in the same statement (one notification per node: PostgreSQL
# folds equal ones of a transaction). The nodes of $6 have a poll waiting on the committing
# gateway: their work is handed to it (``Handed``), delivered as the statement commits, so
# the statement returns it as a poll reads it (db/nodes.py: _POLL), with the node's
# incarnation (its row is locked by the caller: it cannot change before the commit). Should
# that poll end before it takes it, the next poll delivers it again (as any lost answer);
# it then counts as delivered when its node is lost, as one whose answer was lost does.
_ASSIGN = f"""
WITH a AS (
UPDATE invocations i SET state = 'assigned', node_id = d.node_id,
  gpu_indices = d.gpus::int[], attempts = i.attempts + 1, epoch = i.epoch + 1,
  log_ack = -1, scheduled_at = clock_timestamp(),
  delivered_at = CASE WHEN d.node_id = ANY($6::bigint[]) THEN clock_timestamp() END,
  started_at = NULL,
  worker_acquired_at = NULL, code_started_at = NULL, code_finished_at = NULL, warm = NULL,
  borrowed = d.borrowed, preempt_at = NULL, queue_position = NULL, wait_reason = NULL,
  lease_id = NULL, lease_expires_at = clock_timestamp() + make_interval(secs => $4)
FROM unnest($1::uuid[], $2::bigint[], $3::text[], $5::bool[])
  AS d(id, node_id, gpus, borrowed)
WHERE i.id = d.id AND i.state = 'queued'
RETURNING i.id, i.node_id, i.delivered_at IS NOT NULL AS handed, i.epoch, i.gpu_indices,
  i.timeout_s, i.function_name, i.payload_size, i.owner_id, i.payload_file, i.arguments,
  i.function_owner, i.payload, i.map_id, i.seq, i.gpu_share
)
SELECT a.id, a.node_id, pg_notify('{CHANNEL}', 'n:' || a.node_id), a.handed,
  n.incarnation, a.epoch, a.gpu_indices, a.gpu_share, a.timeout_s, a.function_name,
  a.payload_size,
  a.owner_id, a.payload_file, a.arguments, a.function_owner,
  u.name AS owner_name, u.is_admin AS owner_admin,
  CASE WHEN a.handed AND a.payload_size <= $7 THEN a.payload END AS payload,
  CASE WHEN a.map_id IS NOT NULL THEN a.id END AS lease
FROM a JOIN nodes n ON n.id = a.node_id JOIN users u ON u.id = a.owner_id
ORDER BY a.seq
"""

_PREEMPT = """
UPDATE invocations i SET preempt_at = clock_timestamp(), preempt_reason = p.reason
FROM unnest($1::uuid[], $2::text[]) AS p(id, reason)
WHERE i.id = p.id AND i.state IN ('assigned', 'running') AND i.preempt_at IS NULL
RETURNING i.id, i.node_id
"""

_EXPLAIN_WAITS = """
UPDATE invocations i SET queue_position = w.position, wait_reason = w.reason
FROM unnest($1::uuid[], $2::int[], $3::text[]) AS w(id, position, reason)
WHERE i.id = w.id AND i.state = 'queued'
  AND (i.queue_position, i.wait_reason) IS DISTINCT FROM (w.position, w.reason)
"""

#: Which held attempts ``expire_leases`` takes back (``$1``: how old a preemption is overdue).
_EXPIRED = (
    "lease_expires_at < clock_timestamp()"
    " OR preempt_at < clock_timestamp() - make_interval(secs => $1)"
)

_SILENCE = """
SELECT count(*) FILTER (WHERE i.lease_expires_at < clock_timestamp()) AS overdue,
  count(DISTINCT i.node_id) AS holding,
  count(DISTINCT i.node_id) FILTER (WHERE n.last_heartbeat IS NULL
    OR n.last_heartbeat < clock_timestamp() - make_interval(secs => $1)) AS silent
FROM invocations i JOIN nodes n ON n.id = i.node_id
WHERE i.state IN ('assigned', 'running')
"""

_EXTEND_LEASES = """
WITH held AS (
  SELECT id FROM invocations
  WHERE state IN ('assigned', 'running')
    AND lease_expires_at < clock_timestamp() + make_interval(secs => $1)
  ORDER BY id
  FOR UPDATE SKIP LOCKED
)
UPDATE invocations i SET lease_expires_at = clock_timestamp() + make_interval(secs => $1)
FROM held
WHERE i.id = held.id
"""


def _queued_sql(per_user: int, most: int, late_s: float) -> str:
    # The LIMITs are literals on purpose: as prepared-statement parameters PostgreSQL
    # switched to a generic plan that ran for minutes on a 120k-row backlog. Per user, through
    # the (owner_id, seq) index: a long backlog of one user must not hide everyone else's
    # calls; the users' heads are taken in turns up to ``most``, then put in queue order.
    return f"""
SELECT id, gpus, "user", "group", function, priority, gpu_model, min_memory_mib,
  submit_time, expected_s, queued_time, share, attained_gpu_s
FROM (
  SELECT q.id::text AS id, q.gpus, q.gpu_share AS share, u.name AS "user",
    u.group_name AS "group",
    q.function_name AS function, q.priority, q.gpu_model,
    coalesce(q.gpu_memory_mb, 0) AS min_memory_mib,
    extract(epoch FROM q.submitted_at)::float8 AS submit_time,
    coalesce(q.expected_s, q.timeout_s) AS expected_s,
    extract(epoch FROM q.queued_at)::float8 AS queued_time, q.attained_gpu_s, q.seq, q.turn
  FROM users u CROSS JOIN LATERAL (
    SELECT id, gpus, gpu_share, function_name, priority, gpu_model, gpu_memory_mb, seq,
      submitted_at, queued_at, expected_s, timeout_s, attained_gpu_s,
      row_number() OVER (ORDER BY seq) AS turn
    FROM invocations i
    WHERE owner_id = u.id AND state = 'queued' AND (caller_session IS NULL
      -- A call whose caller is late is not started: it is cancelled if the caller is gone.
      -- (A session row a database crash lost, written without waiting for the WAL, leaves
      -- its calls as if detached.)
      OR NOT EXISTS (SELECT 1 FROM caller_sessions s WHERE s.owner_id = u.id
        AND s.id = i.caller_session
        AND s.seen_at < clock_timestamp() - make_interval(secs => {float(late_s)!r})))
    ORDER BY seq LIMIT {int(per_user)}
  ) q
  ORDER BY q.turn, q.seq LIMIT {int(most)}
) heads
ORDER BY seq
"""


async def try_lead(conn: asyncpg.Connection) -> bool:
    """Take the scheduling leader lock if no other session holds it; it stays this
    connection's until the connection closes."""
    return bool(await conn.fetchval(_TRY_LEAD, LEADER_LOCK))


async def live_nodes(
    conn: Conn, heartbeat_timeout_s: float, *, lock: bool = False
) -> list[NodeRow]:
    """Nodes heard from within the timeout and not draining: those that may get new work.
    With ``lock``, their rows stay locked until the transaction ends (the scheduler plans and
    commits under these locks)."""
    rows = await conn.fetch(_LIVE_NODES_LOCKED if lock else _LIVE_NODES, heartbeat_timeout_s)
    return [_node_row(r) for r in rows]


async def leases(conn: Conn) -> list[Running]:
    """Every call holding resources on a node (assigned or running), as the scheduler sees
    it; ``start_time`` is when it got them (database clock)."""
    rows = await conn.fetch(_LEASES)
    tuples = ("gpu_indices", "gpu_models")
    return [Running(**{**r, **{k: tuple(r[k] or ()) for k in tuples}}) for r in rows]


@dataclass(frozen=True, slots=True)
class Holdings:
    """What holds capacity (``leases``, as :func:`leases`), the database clock's ``now``, and
    when asked for, each group's (guaranteed, borrow limit) and the decayed GPU-seconds per
    group and per (group, user), as of the last accrual."""

    leases: list[Running]
    now: float
    quotas: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    #: Each group's quotas per model: (model, guaranteed, borrow limit), by model name.
    model_quotas: dict[str, list[tuple[str, int, int | None]]] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)
    user_usage: dict[tuple[str, str], float] = field(default_factory=dict)


_LEASE_FIELDS = (
    "id", "node_id", "gpu_indices", "user", "group", "function", "priority", "borrowed",
    "preempting", "start_time", "expected_s", "preemptible", "queued_time", "share",
    "attained_gpu_s",
)  # fmt: skip


async def holdings(conn: Conn, *, quotas: bool) -> Holdings:
    """:class:`Holdings` in one statement (the quotas and usage only with ``quotas``)."""
    rows = await conn.fetch(_HOLDINGS, quotas)
    now = 0.0
    leases: list[Running] = []
    limits: dict[str, tuple[int, int | None]] = {}
    per_model: dict[str, list[tuple[str, int, int | None]]] = {}
    usage: dict[str, float] = {}
    user_usage: dict[tuple[str, str], float] = {}
    for r in rows:
        kind = r["kind"]
        if kind == "lease":
            fields = {name: r[name] for name in _LEASE_FIELDS}
            leases.append(Running(**{**fields, "gpu_indices": tuple(r["gpu_indices"]),
                                     "gpu_models": tuple(r["gpu_models"] or ())}))  # fmt: skip
        elif kind == "quota":
            limits[r["group"]] = (r["guaranteed_gpus"], r["borrow_limit_gpus"])
        elif kind == "model_quota":
            per_model.setdefault(r["group"], []).append(
                (r["id"], r["guaranteed_gpus"], r["borrow_limit_gpus"])
            )
        elif kind == "usage" and r["user"] == "":
            usage[r["group"]] = r["decayed_gpu_seconds"]
        elif kind == "usage":
            user_usage[(r["group"], r["user"])] = r["decayed_gpu_seconds"]
        else:
            now = float(r["start_time"])
    for models in per_model.values():
        models.sort()
    return Holdings(leases, now, limits, per_model, usage, user_usage)


async def queued(conn: Conn, per_user: int, most: int, late_s: float = 1e9) -> list[Pending]:
    """The first ``per_user`` queued calls of every user, at most ``most`` in all (the
    users' heads in turns), in queue (submission) order, as the scheduler sees them; not
    those whose caller session has not kept alive for ``late_s``."""
    if per_user <= 0 or most <= 0:
        return []
    return [Pending(**r) for r in await conn.fetch(_queued_sql(per_user, most, late_s))]


@dataclass(frozen=True, slots=True)
class Handed:
    """Work given to a node whose poll waits on this gateway, delivered to it as the
    assignment commits: for the node's ``incarnation`` (as locked), in queue order."""

    incarnation: int
    work: list[wire.Assignment]


async def assign(
    conn: asyncpg.Connection,
    decisions: Sequence[tuple[str, int, Sequence[int], bool]],
    lease_s: float,
    *,
    hand_to: Collection[int] = (),
    inline_limit: int = 0,
) -> tuple[list[tuple[str, int]], dict[int, Handed]]:
    """Lease still-queued invocations to nodes: ``(invocation_id, node_id, gpu_indices,
    borrowed)``. Returns the (invocation_id, node_id) pairs actually assigned (a call
    cancelled meanwhile is skipped), and the work of the nodes of ``hand_to`` (their poll
    waits on this gateway: it is stamped delivered, its payload inline up to
    ``inline_limit``), by node. The caller holds the node rows locked
    (``live_nodes(lock=True)``) and computed capacity under that lock, in the same
    transaction."""
    rows = await conn.fetch(
        _ASSIGN,
        [uuid.UUID(d[0]) for d in decisions],
        [d[1] for d in decisions],
        ["{" + ",".join(map(str, d[2])) + "}" for d in decisions],
        lease_s,
        [d[3] for d in decisions],
        list(hand_to),
        inline_limit,
    )
    handed: dict[int, Handed] = {}
    for r in rows:
        if r["handed"]:
            node = int(r["node_id"])
            handed.setdefault(node, Handed(int(r["incarnation"]), [])).work.append(_assignment(r))
    return [(str(r["id"]), int(r["node_id"])) for r in rows], handed


async def preempt(
    conn: asyncpg.Connection, preemptions: Sequence[tuple[str, str]]
) -> list[tuple[str, int]]:
    """Tell the nodes running these calls to stop them: ``(invocation_id, reason)``. Their
    nodes see it in their next poll or heartbeat, give the call its grace, then hand it back
    (``release``) and it is queued again. Returns (invocation_id, node_id) of those marked."""
    if not preemptions:
        return []
    rows = await conn.fetch(
        _PREEMPT, [uuid.UUID(p[0]) for p in preemptions], [p[1] for p in preemptions]
    )
    await _notify(conn, *(f"i:{r['id']}" for r in rows))
    return [(str(r["id"]), int(r["node_id"])) for r in rows]


async def explain_waits(conn: Conn, waits: Sequence[tuple[str, int, str]]) -> None:
    """Store where queued calls stand and why they wait: ``(id, position, reason)``."""
    if not waits:
        return
    await conn.execute(
        _EXPLAIN_WAITS,
        [uuid.UUID(w[0]) for w in waits],
        [w[1] for w in waits],
        [w[2] for w in waits],
    )


async def wake_scheduler(conn: Conn) -> None:
    """Wake the scheduling leader (at commit): there are calls to plan."""
    await _notify(conn, "q")


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
            _EXPIRED,
            "the node running this call stopped renewing its lease (node lost)",
            overdue,
            most=most,
        )


async def silence(conn: Conn, silent_s: float) -> tuple[int, int, int]:
    """Of the held attempts (assigned or running), how many leases ran out; how many nodes
    hold attempts; and how many of those have not been heard from for ``silent_s`` (or
    left)."""
    row = await conn.fetchrow(_SILENCE, silent_s)
    assert row is not None
    return int(row["overdue"]), int(row["holding"]), int(row["silent"])


async def extend_leases(conn: Conn, lease_s: float) -> int:
    """Give every held attempt at least a full lease from now: while the database was away
    no node could renew, and none may lose its work for that. Returns how many."""
    status = await conn.execute(_EXTEND_LEASES, lease_s)
    return int(status.split()[-1])
