"""Nodes and their protocol: registration (each start of a nodelet is a new incarnation),
polls for work (delivery), heartbeats (liveness, GPU health, lease renewal, stop orders),
leaving, draining, removal; and taking back the attempts a node lost."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import msgspec

from bulletin_core import wire
from gateway.db._common import (
    _HEALTH_LIST,
    TOKENS_CHANGED,
    Conn,
    NodeRow,
    _f,
    _node_row,
    _note,
    _notify,
    _preempted_note,
    attained,
)
from gateway.db.accounts import revoke_node_tokens


@dataclass(frozen=True)
class Drain:
    draining: bool
    reason: str | None


@dataclass(frozen=True)
class NodeStatus:
    name: str
    gpus: int
    cpu_slots: int
    last_heartbeat: float | None
    draining: bool
    drain_reason: str | None
    gpu_health: list[wire.GpuHealthReport]


@dataclass(frozen=True, slots=True)
class StopOrders:
    """What a node must stop: attempts no longer leased to it, and attempts to preempt
    (``(attempt, reason)``)."""

    revoked: list[wire.Attempt]
    preempt: list[tuple[wire.Attempt, str]]


_REGISTER_NODE = """
UPDATE nodes SET gpus = $2::jsonb, cpu_slots = $3, protocol_version = $4,
  incarnation = incarnation + 1, registered_at = clock_timestamp(),
  last_heartbeat = clock_timestamp()
WHERE id = $1
RETURNING incarnation
"""

_REGISTERED_NODES = """
SELECT id, name, gpus::text AS gpus, cpu_slots, warm::text AS warm
FROM nodes
WHERE registered_at IS NOT NULL AND removed_at IS NULL
ORDER BY id
"""

_LEAVE = """
UPDATE nodes SET last_heartbeat = NULL WHERE id = $1 AND incarnation = $2
"""

_HEARTBEAT_NODE = """
UPDATE nodes SET last_heartbeat = clock_timestamp(),
  gpu_health = CASE WHEN $2 THEN $3::jsonb ELSE gpu_health END,
  health_at = CASE WHEN $2 THEN clock_timestamp() ELSE health_at END,
  drain_reason = CASE WHEN $4 <> '' AND NOT draining THEN $4 ELSE drain_reason END,
  draining = draining OR $4 <> '', warm = $5::jsonb
WHERE id = $1 AND incarnation = $6
RETURNING draining, drain_reason
"""

_RENEW_LEASES = """
UPDATE invocations i
SET lease_expires_at = clock_timestamp() + make_interval(secs => $4)
FROM unnest($2::uuid[], $3::int[]) AS a(id, epoch)
WHERE i.id = a.id AND i.epoch = a.epoch AND i.node_id = $1
  AND i.state IN ('assigned', 'running')
RETURNING i.id, i.preempt_at IS NOT NULL AS preempt, i.preempt_reason
"""

_SET_DRAINING = """
-- The answer is the node as it was (locked first), so the caller can say what changed.
-- A node already draining keeps its reason (whoever drained it first said why).
UPDATE nodes n SET draining = $2,
  drain_reason = CASE WHEN NOT $2 THEN NULL
    WHEN old.draining THEN old.drain_reason ELSE coalesce($3, $4) END
FROM (SELECT id, draining, drain_reason FROM nodes
  WHERE name = $1 AND removed_at IS NULL FOR UPDATE) old
WHERE n.id = old.id
RETURNING old.draining, old.drain_reason
"""

_LOCK_NODE = """
SELECT id, draining, drain_reason FROM nodes
WHERE name = $1 AND removed_at IS NULL
FOR UPDATE
"""

_HELD_ON_NODE = """
-- Through the invocations_leased index.
SELECT count(i.id) AS held
FROM nodes n LEFT JOIN invocations i ON i.node_id = n.id AND i.state IN ('assigned', 'running')
WHERE n.name = $1 AND n.removed_at IS NULL
GROUP BY n.id
"""

_REMOVE_NODE = """
UPDATE nodes SET removed_at = clock_timestamp(), last_heartbeat = NULL WHERE id = $1
"""

_NODE_STATUSES = """
SELECT name, jsonb_array_length(gpus) AS gpus, cpu_slots,
  extract(epoch FROM last_heartbeat) AS heard, draining, drain_reason,
  gpu_health::text AS health
FROM nodes
WHERE removed_at IS NULL
ORDER BY name
"""

# A poll's one statement: which of the attempts the node runs ($2, $3) are still its own and
# whether they are preempted ('kept' rows; the others are revoked), and the work assigned to
# it that it does not run yet, delivered ('work' rows). One snapshot for both.
# The work is what is assigned to the node and not among what it runs, but what another
# transaction is changing (a completion, a lease's next items, a cancellation): a long poll
# re-reads with the running list it was sent with, so a map's items given to the node since
# are not in it; waiting for their rows, it deadlocked with the completion that gave them.
# What it skips it delivers at its next read, if it is still the node's.
_POLL = """
WITH running AS (
  SELECT * FROM unnest($2::uuid[], $3::int[]) AS a(id, epoch)
), due AS (
  SELECT i.id FROM invocations i
  WHERE i.node_id = $1 AND i.state = 'assigned'
    AND EXISTS (SELECT 1 FROM nodes n WHERE n.id = $1 AND n.incarnation = $6)
    AND NOT EXISTS (SELECT 1 FROM running a WHERE a.id = i.id AND a.epoch = i.epoch)
  FOR UPDATE SKIP LOCKED
), work AS (
  UPDATE invocations i SET delivered_at = coalesce(i.delivered_at, clock_timestamp()),
    lease_expires_at = clock_timestamp() + make_interval(secs => $5)
  FROM users u, due
  WHERE i.id = due.id AND u.id = i.owner_id
  RETURNING i.id, i.epoch, i.gpu_indices, i.timeout_s, i.function_name, i.payload_size,
    i.owner_id, i.payload_file, i.arguments, i.function_owner,
    u.name AS owner_name, u.is_admin AS owner_admin,
    CASE WHEN i.payload_size <= $4 THEN i.payload END AS payload,
    CASE WHEN i.map_id IS NOT NULL THEN coalesce(i.lease_id, i.id) END AS lease, i.seq,
    i.gpu_share
)
SELECT 'kept' AS kind, a.id, NULL::int AS epoch, NULL::int[] AS gpu_indices,
  NULL::float8 AS timeout_s, NULL::text AS function_name, NULL::bigint AS payload_size,
  NULL::bigint AS owner_id, NULL::text AS payload_file, NULL::bytea AS arguments,
  NULL::text AS function_owner, NULL::text AS owner_name, NULL::bool AS owner_admin,
  NULL::bytea AS payload, i.preempt_at IS NOT NULL AS preempt, i.preempt_reason,
  NULL::uuid AS lease, NULL::bigint AS seq, NULL::float8 AS gpu_share
FROM running a
JOIN invocations i ON i.id = a.id AND i.epoch = a.epoch AND i.node_id = $1
  AND i.state IN ('assigned', 'running')
UNION ALL
SELECT 'work', w.id, w.epoch, w.gpu_indices, w.timeout_s, w.function_name, w.payload_size,
  w.owner_id, w.payload_file, w.arguments, w.function_owner, w.owner_name, w.owner_admin,
  w.payload, NULL, NULL, w.lease, w.seq, w.gpu_share
FROM work w
-- A lease's attempts in their order.
ORDER BY seq NULLS FIRST
"""

#: Which held attempts ``register_node`` takes back (``$1``: the node).
_ON_NODE = "node_id = $1"


_UNTIL_LOST = attained("least(clock_timestamp(), coalesce(i.lease_expires_at, clock_timestamp()))")


def _take_back_sql(where: str, order: str, lock: str) -> str:
    """The statement of :func:`_take_back`. Built per caller: which held attempts
    (``where``), in which order (with a literal LIMIT when capped: see ``_queued_sql``), and
    whether locked ones are skipped differ; the rest is the same. (``'{}'`` below is the
    empty array, its braces doubled for the f-string.)"""
    return f"""
WITH lost AS (
  SELECT id, preempt_at IS NOT NULL AS preempted,
    -- An attempt never delivered never ran: like a preempted one, it is not counted.
    preempt_at IS NOT NULL OR (state = 'assigned' AND delivered_at IS NULL) AS uncounted
  FROM invocations
  WHERE state IN ('assigned', 'running') AND ({where})
  {order}
  FOR UPDATE{lock}
), e AS (
  SELECT i.id, e.uncounted OR i.attempts <= i.max_retries AS requeue,
    e.preempted, e.uncounted
  FROM invocations i JOIN lost e ON e.id = i.id
)
UPDATE invocations i SET
  state = CASE WHEN e.requeue THEN 'queued' ELSE 'failed' END,
  attempts = i.attempts - e.uncounted::int,
  preemptions = i.preemptions + e.preempted::int,
  error_kind = CASE WHEN e.requeue THEN NULL ELSE 'node_lost' END,
  error_message = CASE WHEN e.requeue THEN NULL ELSE $2
    || ' after ' || i.attempts || ' attempt(s); raise max_retries to retry more' END,
  finished_at = CASE WHEN e.requeue THEN NULL ELSE clock_timestamp() END,
  scheduled_at = CASE WHEN e.requeue THEN NULL ELSE i.scheduled_at END,
  -- A new wait starts, unless the attempt never reached its node (it never ran).
  queued_at = CASE WHEN e.requeue AND (e.preempted OR NOT e.uncounted)
    THEN clock_timestamp() ELSE i.queued_at END,
  node_id = NULL, gpu_indices = '{{}}', lease_expires_at = NULL,
  borrowed = false, preempt_at = NULL,
  -- (A run never delivered gave nothing; a lost node's ran until its lease ran out at most.)
  attained_gpu_s = i.attained_gpu_s + CASE WHEN i.delivered_at IS NULL THEN 0
    ELSE {_UNTIL_LOST} END
FROM e
WHERE i.id = e.id
RETURNING i.id, i.state, e.preempted, e.uncounted,
  i.preempt_reason, i.attempts, i.max_retries
"""


_JSON = msgspec.json.Encoder()


def _attempt_arrays(running: Sequence[wire.Attempt]) -> tuple[list[str], list[int]]:
    """Attempts as two parallel arrays, for ``unnest($n::uuid[], $m::int[])``."""
    return [a.invocation_id for a in running], [a.epoch for a in running]


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
            _REGISTER_NODE,
            node_id,
            msgspec.json.encode(gpus).decode(),
            cpu_slots,
            protocol_version,
        )
        taken = await _take_back(
            conn,
            _ON_NODE,
            "the nodelet running this call restarted, and what it ran was lost (node lost)",
            node_id,
            skip_locked=False,
        )
        await _notify(conn, "q", TOKENS_CHANGED)  # tokens grant the new incarnation now
    return int(incarnation), taken


async def registered_nodes(conn: Conn) -> list[NodeRow]:
    """Every node that has registered, draining or not, live or not: what the cluster has."""
    return [_node_row(r) for r in await conn.fetch(_REGISTERED_NODES)]


async def leave(conn: Conn, node_id: int, incarnation: int) -> None:
    """The node's ``incarnation`` is stopping: no more work goes to it until it registers
    again (not if a later incarnation registered meanwhile)."""
    await conn.execute(_LEAVE, node_id, incarnation)


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
    order = "ORDER BY id" if most is None else f"ORDER BY lease_expires_at, id LIMIT {int(most)}"
    lock = " SKIP LOCKED" if skip_locked else ""
    rows = await conn.fetch(_take_back_sql(where, order, lock), arg, lost)
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
            _HEARTBEAT_NODE,
            node_id,
            bool(health),
            _JSON.encode(list(health)).decode(),
            critical,
            _JSON.encode(list(warm)).decode(),
            incarnation,
        )
        held = await conn.fetch(_RENEW_LEASES, node_id, *_attempt_arrays(running), lease_s)
    orders = _orders(running, {str(r["id"]): r for r in held})
    drain = Drain(bool(row["draining"]), row["drain_reason"]) if row else Drain(False, None)
    return orders, drain


async def set_draining(
    conn: Conn, name: str, draining: bool, reason: str | None = None, default_reason: str = ""
) -> Drain | None:
    """Drain (no new work) or undrain a node by name; how it was before, None if there is no
    such node (or it was removed). Draining a node already draining keeps its reason;
    otherwise it sets ``reason``, or ``default_reason`` when None."""
    row = await conn.fetchrow(_SET_DRAINING, name, draining, reason, default_reason)
    if row is None:
        return None
    if not draining and row["draining"]:
        await _notify(conn, "q")  # it may take work again
    return Drain(row["draining"], row["drain_reason"])


async def lock_node(conn: asyncpg.Connection, name: str) -> tuple[int, Drain] | None:
    """Lock a node's row until the transaction ends; its id and whether it drains (None if
    there is no such node, or it was removed)."""
    row = await conn.fetchrow(_LOCK_NODE, name)
    return None if row is None else (row["id"], Drain(row["draining"], row["drain_reason"]))


async def held_attempts(conn: Conn, name: str) -> int | None:
    """How many attempts a node holds (assigned or running); None if there is no such node
    (or it was removed)."""
    held = await conn.fetchval(_HELD_ON_NODE, name)
    return None if held is None else int(held)


async def remove_node(conn: asyncpg.Connection, node_id: int) -> None:
    """Mark a node removed and revoke its tokens, in one transaction: not listed, not live,
    no capacity, refused at once (and still after ``node add`` brings it back, with a new
    token); its row stays, with its history."""
    async with conn.transaction():
        await conn.execute(_REMOVE_NODE, node_id)
        await revoke_node_tokens(conn, node_id)


async def node_statuses(conn: Conn) -> list[NodeStatus]:
    rows = await conn.fetch(_NODE_STATUSES)
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


async def poll(
    conn: Conn,
    node_id: int,
    incarnation: int,
    running: Sequence[wire.Attempt],
    inline_limit: int,
    lease_s: float,
) -> tuple[StopOrders, list[wire.Assignment]]:
    """In one statement: of the attempts in ``running``, those no longer leased to this node
    and those the scheduler preempts; and the assigned work of this node that it does not
    already run, if ``incarnation`` is still the node's (a poll that waited while a new start
    registered gets nothing). Work is redelivered until the node starts it, so a lost poll
    answer loses nothing. Delivery renews the lease: the node starts its own lease clock on
    receipt, and must never believe in more lease than it has."""
    rows = await conn.fetch(
        _POLL, node_id, *_attempt_arrays(running), inline_limit, lease_s, incarnation
    )
    kept = {str(r["id"]): r for r in rows if r["kind"] == "kept"}
    return _orders(running, kept), [_assignment(r) for r in rows if r["kind"] == "work"]


def _assignment(r: asyncpg.Record) -> wire.Assignment:
    return wire.Assignment(
        invocation_id=str(r["id"]),
        epoch=r["epoch"],
        gpu_indices=list(r["gpu_indices"]),
        gpu_share=float(r["gpu_share"]),
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
        lease=None if r["lease"] is None else str(r["lease"]),
    )
