"""Hosts the scheduler loop. Every gateway runs it; one at a time leads, chosen by a
PostgreSQL session advisory lock, and the others stand by to take over if the leader's
connection drops. Each round: expire leases and accrue usage (on the clock), read a snapshot
under node row locks (live nodes, what runs on them, each user's queue head, quotas, decayed
usage), run the configured policy (``scheduler``: pure), and commit its placements and
preemptions in that same transaction."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import asyncpg

from bulletin_core import wire
from bulletin_core.backoff import Backoff
from gateway import db, expiry
from gateway.config import GatewayConfig
from gateway.expiry import Outages
from gateway.notify import Hub
from scheduler import (
    Gpu,
    NodeCapacity,
    Pending,
    Plan,
    Quota,
    Running,
    SharedGpu,
    Snapshot,
    lookahead,
    placement,
)

log = logging.getLogger(__name__)
#: How often the leader stores each queued call's position and reason (call.status()).
EXPLAIN_S = 2.0
# The leader lock lives as long as this connection. If the leader's host vanishes without
# closing it, TCP keepalives let PostgreSQL notice within about 11 s and free the lock.
_KEEPALIVE = {
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "10000",  # ms: unacknowledged data also ends it (Linux)
}


def capacity(nodes: list[db.NodeRow], leases: list[Running]) -> list[NodeCapacity]:
    """Each live node's inventory and what is free on it, given the leases held on it: a GPU
    held by calls that asked for part of one is shared (``NodeCapacity.shared``), not free."""
    used_gpus: dict[int, set[int]] = defaultdict(set)
    used_cpu: Counter[int] = Counter()
    parts: dict[int, list[Running]] = {}  # node -> the shares on it
    for lease in leases:
        if lease.gpus == 0:
            used_cpu[lease.node_id] += 1
        used_gpus[lease.node_id].update(lease.gpu_indices)
        if lease.share != 1.0:
            parts.setdefault(lease.node_id, []).append(lease)
    found = []
    for n in nodes:
        used = used_gpus.get(n.id)
        free = [g.index for g in n.gpus if g.index not in used] if used else None
        node = node_capacity(n, free_gpus=free, free_cpu_slots=max(0, n.cpu_slots - used_cpu[n.id]))
        if n.id in parts:
            node.shared = SharedGpu.of(parts[n.id])
        found.append(node)
    return found


def node_capacity(
    node: db.NodeRow, *, free_gpus: list[int] | None = None, free_cpu_slots: int | None = None
) -> NodeCapacity:
    """A node as the scheduler sees it: its GPUs, and what is free (all, unless given)."""
    return NodeCapacity(
        node_id=node.id,
        free_gpus=[g.index for g in node.gpus] if free_gpus is None else free_gpus,
        free_cpu_slots=node.cpu_slots if free_cpu_slots is None else free_cpu_slots,
        gpus=_inventory(node.gpus),
        warm=frozenset((w.owner, w.function) for w in node.warm) if node.warm else _NO_WARM,
    )


_NO_WARM: frozenset[tuple[str, str]] = frozenset()
#: The scheduler's view of each node's GPUs, by the identity of the stored tuple it was
#: made from (``db``'s reads give the same tuple for the same stored list; it is held here,
#: so that its identity cannot pass to another while kept): a round of 1,000 nodes made
#: 8,000 of them anew, most of its CPU.
_INVENTORIES: dict[int, tuple[tuple[wire.GpuInfo, ...], tuple[Gpu, ...]]] = {}


def _inventory(gpus: tuple[wire.GpuInfo, ...]) -> tuple[Gpu, ...]:
    kept = _INVENTORIES.get(id(gpus))
    if kept is not None and kept[0] is gpus:
        return kept[1]
    made = tuple(Gpu(g.index, g.name, g.memory_mb, g.nvlink_group) for g in gpus)
    if len(_INVENTORIES) >= 8192:
        _INVENTORIES.clear()  # a bound whatever happens; the live ones come back
    _INVENTORIES[id(gpus)] = (gpus, made)
    return made


NO_NODE = "no node is up to run it (none registered, or all draining or silent)"


def one_node_calls(
    calls: list[Pending], nodes: Sequence[NodeCapacity]
) -> tuple[list[Pending], list[tuple[Pending, str]]]:
    """The calls some node could hold whole, and the others with why they wait."""
    fit: list[Pending] = []
    wait: list[tuple[Pending, str]] = []
    largest: dict[tuple[str | None, int], int] = {}
    for call in calls:
        key = (call.gpu_model, call.min_memory_mib)
        if key not in largest:
            largest[key] = placement.largest_for(nodes, call)
        if call.gpus <= largest[key]:
            fit.append(call)
        else:
            wait.append(
                (
                    call,
                    f"needs {call.gpus} GPUs on one node; the largest live node has "
                    f"{largest[key]} it may use",
                )
            )
    return fit, wait


async def plan_round(
    conn: asyncpg.Connection,
    config: GatewayConfig,
    *,
    explain: bool = False,
    reserved: dict[str, float] | None = None,
    promised: dict[str, tuple[int, ...]] | None = None,
    reserved_on: dict[str, tuple[int, ...]] | None = None,
) -> int:
    """One planning round in one transaction; returns how many calls were placed or
    preempted (non-zero also when the policy asks for another round at once). With
    ``explain``, also stores where each pending call stands and why. ``reserved``: the calls
    the previous round reserved for, which the leader keeps between rounds (the policy
    reads them, and this round's replace them); ``promised`` likewise, the calls it preempted
    others for by least attained service, with the nodes of that room; ``reserved_on``
    likewise, the nodes of each reservation."""
    async with conn.transaction():
        # The live nodes, locked: capacity is read and committed under the same locks.
        nodes = await db.live_nodes(conn, config.node_timeout_s, lock=True)
        if not nodes:
            if explain:
                waiting = await db.queued(conn, 16, config.plan_batch)
                await db.explain_waits(conn, [(c.id, 1, NO_NODE) for c in waiting])
            return 0
        held = await db.holdings(conn, quotas=True)
        free = capacity(nodes, held.leases)
        per_user = lookahead.per_user(free, config.plan_batch)
        queued = await db.queued(conn, per_user, config.plan_batch, config.caller_late_s)
        if not queued:
            return 0
        # A call runs on one node: one bigger than every live node waits, reserving nothing,
        # until such a node is back (it fitted a registered node when it was submitted).
        queued, too_big = one_node_calls(queued, free)
        snapshot = _snapshot(
            config,
            free,
            queued,
            held,
            held.now,
            dict(reserved or {}),
            dict(promised or {}),
            dict(reserved_on or {}),
        )
        why: dict[str, tuple[int, str]] | None = {} if explain else None
        result = config.policy().plan(snapshot, why)
        if reserved is not None:
            reserved.clear()
            reserved.update(result.reserved)
        if promised is not None:
            promised.clear()
            promised.update(result.promised)
        if reserved_on is not None:
            reserved_on.clear()
            reserved_on.update(result.reserved_on)
        placed, _ = await _assign(conn, config, result)
        preempted = await db.preempt(
            conn, [(p.invocation_id, p.reason) for p in result.preemptions]
        )
        for invocation_id, reason in ((p.invocation_id, p.reason) for p in result.preemptions):
            log.info("preempting %s: %s", invocation_id, reason)
        if why is not None:
            waits = [(i, pos, reason) for i, (pos, reason) in why.items()]
            waits += [(c.id, len(queued) + 1, reason) for c, reason in too_big]
            await db.explain_waits(conn, waits)
        await db.notify_nodes(conn, {node for _, node in preempted})  # placed: assign did
    # The policy caps the preemptions of one round; it says when it wants another at once.
    return len(placed) + len(preempted) + (1 if result.more else 0)


async def place_at_once(
    conn: asyncpg.Connection,
    config: GatewayConfig,
    fresh: Sequence[Pending],
    nodes: list[db.NodeRow],
    hand_to: Callable[[int], bool] = lambda node: False,
) -> tuple[list[tuple[str, int]], dict[int, db.Handed]]:
    """Within a submission's transaction: place its new calls now, without waiting for the
    leader's round, when nothing else is queued (so none of higher standing waits). ``nodes``:
    the live nodes the submission's own statement locked (``db.insert_calls``' place_within),
    none when another call was queued. The configured policy decides, on the same snapshot a
    round would read (live nodes locked, leases, quotas, usage) with these calls as the whole
    queue, and the placements commit with the submission through the same capacity-checked
    statement as a round's. Returns the ``(invocation_id, node_id)`` placed; the rest, and
    any call the policy would preempt for, are left to the leader (which the caller wakes);
    and the work of the nodes ``hand_to`` says have a poll waiting here (``db.assign``)."""
    if not fresh or not nodes:
        return [], {}  # none live, or another call waits
    policy = config.policy()
    held = await db.holdings(conn, quotas=policy.uses_quotas)
    free = capacity(nodes, held.leases)
    fits, _ = one_node_calls(list(fresh), free)
    if not fits or not any(n.free_gpus or n.free_cpu_slots or n.shared for n in free):
        return [], {}
    now = max(p.submit_time for p in fits)
    result = policy.plan(_snapshot(config, free, fits, held, now))
    if result.preemptions or not result:
        return [], {}  # reclaiming capacity is the leader's to decide, with the whole queue
    return await _assign(conn, config, result, [d.node_id for d in result if hand_to(d.node_id)])


def _snapshot(
    config: GatewayConfig,
    free: list[NodeCapacity],
    pending: list[Pending],
    held: db.Holdings,
    now: float,
    reserved: Mapping[str, float] | None = None,
    promised: Mapping[str, tuple[int, ...]] | None = None,
    reserved_on: Mapping[str, tuple[int, ...]] | None = None,
) -> Snapshot:
    """What a policy plans on."""
    return Snapshot(
        nodes=free,
        pending=pending,
        running=held.leases,
        quotas={
            name: Quota(*limit, _models(held.model_quotas.get(name, ())))
            for name, limit in held.quotas.items()
        },
        usage=held.usage,
        user_usage=held.user_usage,
        now=now,
        reserved=reserved or {},
        share_across_users=config.share_gpus_across_users,
        promised=promised or {},
        reserved_on=reserved_on or {},
    )


def _models(rows: Iterable[tuple[str, int, int | None]]) -> tuple[tuple[str, Quota], ...]:
    return tuple((model, Quota(guaranteed, limit)) for model, guaranteed, limit in rows)


def group_quota(row: db.GroupRow) -> Quota:
    """A group's quota, as the scheduler reads it."""
    models = ((m.model, m.guaranteed_gpus, m.borrow_limit_gpus) for m in row.models)
    return Quota(row.guaranteed_gpus, row.borrow_limit_gpus, _models(models))


async def _assign(
    conn: asyncpg.Connection,
    config: GatewayConfig,
    plan: Plan,
    hand_to: Collection[int] = (),
) -> tuple[list[tuple[str, int]], dict[int, db.Handed]]:
    """Commit a plan's placements (under the caller's node locks); those made, and the work
    of the nodes of ``hand_to`` (``db.assign``)."""
    return await db.assign(
        conn,
        [(d.invocation_id, d.node_id, d.gpu_indices, d.borrowed) for d in plan],
        config.lease_s,
        hand_to=hand_to,
        inline_limit=config.inline_limit,
    )


class Expiry:
    """The leader's lease expiry: held back while the database was away or most nodes went
    silent at once, capped per round otherwise (gateway/expiry.py)."""

    def __init__(self, config: GatewayConfig, outages: Outages) -> None:
        self.config = config
        self.outages = outages
        self.thresholds = expiry.Thresholds(
            fraction=config.silent_fraction,
            min_nodes=config.silent_min_nodes,
            hold_s=config.silent_hold_s,
            per_round=config.max_expiries_per_round,
        )
        self.storm_since: float | None = None
        #: Leases get a full term before the next expiry (the database was away).
        self.extend = True
        self.last = 0.0
        #: When this leader started leading: callers get a full caller_timeout_s from then
        #: (and from the database's return) to keep their calls alive before any is
        #: cancelled for want of them; none could while the control plane was away.
        self.since = time.monotonic()

    def database_lost(self) -> None:
        """The leader's connection died: nobody could renew meanwhile."""
        self.extend = True
        self.since = time.monotonic()

    def due(self) -> bool:
        """Leases lapse on the clock, not on news: expiring them on every wake-up would put a
        transaction on the path of each call for nothing."""
        return time.monotonic() - self.last >= self.config.schedule_interval_s

    async def run(self, conn: asyncpg.Connection) -> None:
        self.last = time.monotonic()
        await self._abandoned(conn)
        config = self.config
        if self.outages.within(config.lease_s):
            self.extend = True  # nodes kept their calls; none could renew
            return
        if self.extend:
            extended = await db.extend_leases(conn, config.lease_s)
            self.extend = False
            if extended:
                log.warning(
                    "the database was unavailable: gave %d held leases a full %.0f s to be "
                    "renewed before any expires",
                    extended,
                    config.lease_s,
                )
            return
        most = config.max_expiries_per_round
        # Nodes that stopped together did not all stop renewing in the same round: a node is
        # silent once it has missed renewals for half a lease.
        overdue, holding, silent = await db.silence(conn, config.lease_s / 2)
        if overdue:
            silence = expiry.Silence(holding=holding, silent=silent)
            was = self.storm_since
            most, self.storm_since = expiry.allowance(
                silence, self.thresholds, was, time.monotonic()
            )
            if self.storm_since is not None and was is None:
                log.warning(
                    "%d of the %d nodes holding calls stopped renewing at once: holding their "
                    "leases for up to %.0f s (a network or control-plane fault, not %d node "
                    "faults)",
                    silence.silent,
                    silence.holding,
                    config.silent_hold_s,
                    silence.silent,
                )
        elif self.storm_since is not None:
            log.info("every silent node renewed or restarted: lease expiry is back to normal")
            self.storm_since = None
        if most:
            grace = config.preemption_grace_s + config.lease_s
            expired = await db.expire_leases(conn, preempt_overdue_s=grace, most=most)
            if expired:
                log.warning("leases expired: %s", ", ".join(f"{i}->{s}" for i, s in expired))


    async def _abandoned(self, conn: asyncpg.Connection) -> None:
        """Cancel the calls whose caller stopped waiting (CallSpec.caller_session)."""
        timeout = self.config.caller_timeout_s
        if not timeout or self.outages.within(timeout):
            return
        if time.monotonic() - self.since < timeout:
            return
        cancelled = await db.abandon_callers(conn, timeout, self.config.caller_late_s)
        if cancelled:
            log.warning(
                "cancelled %d calls whose caller stopped waiting (no keepalive for %.0f s): %s",
                len(cancelled),
                timeout,
                ", ".join(cancelled),
            )


async def lead(conn: asyncpg.Connection, hub: Hub, config: GatewayConfig, leases: Expiry) -> None:
    """Plan whenever woken by a notification, and at least every schedule_interval_s,
    expiring leases on the clock (``leases``: kept across leaderships of this gateway)."""
    last_explain = 0.0
    # The calls the last round reserved for: the fair guard keeps their reservations. Only
    # this leadership's rounds: a new leader works them out afresh.
    reserved: dict[str, float] = {}
    # The calls the last round preempted others for by least attained service: they start
    # first. Likewise only this leadership's.
    promised: dict[str, tuple[int, ...]] = {}
    reserved_on: dict[str, tuple[int, ...]] = {}  # (the nodes of each reservation)
    while True:
        async with hub.subscribe(["q"], stoppable=False) as sub:
            if leases.due():
                await leases.run(conn)
                await db.accrue_usage(conn, config.fair_share_half_life_s)
            # Where each queued call stands is stored at most every EXPLAIN_S: it costs a
            # write per waiting call.
            explain = time.monotonic() - last_explain >= EXPLAIN_S
            if explain:
                last_explain = time.monotonic()
            placed = await plan_round(
                conn,
                config,
                explain=explain,
                reserved=reserved,
                promised=promised,
                reserved_on=reserved_on,
            )
            if placed:
                log.debug("placed %d calls", placed)
                continue  # there may be more queued than one round looks at
            await sub.wait(config.schedule_interval_s)


async def run(hub: Hub, config: GatewayConfig, outages: Outages) -> None:
    """Run until cancelled, leading whenever this gateway holds the leader lock. Leases held
    when it starts leading, and after it lost its connection (the database with it, for all
    it knows), get a full term before any expires; a failure of another kind does not grant
    them another, so a round that keeps failing cannot hold expiry off for ever."""
    leases = Expiry(config, outages)
    # After a failure, replicas retry at jittered times within one interval (never later
    # than they used to), not all at once; a standby that merely did not get the lock asks
    # again every interval.
    backoff = Backoff(config.schedule_interval_s, config.schedule_interval_s)
    while True:
        conn = None
        failed = False
        try:
            conn = await asyncpg.connect(config.database_url, server_settings=_KEEPALIVE)
            if await db.try_lead(conn):
                log.info("this gateway now leads scheduling")
                await lead(conn, hub, config, leases)
        except Exception as exc:  # the loop must outlive any failure: nothing else schedules
            failed = True
            # A lost database is expected (a restart, an outage): no traceback for it.
            lost = isinstance(
                exc, OSError | asyncpg.PostgresConnectionError | asyncpg.InterfaceError
            )
            log.warning("scheduler loop failed (%s); retrying", exc, exc_info=not lost)
            if lost:
                leases.database_lost()
        finally:
            if conn is not None:
                await _close(conn)
        if failed:
            await backoff.sleep()
        else:
            backoff.reset()
            await asyncio.sleep(config.schedule_interval_s)


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), 2)
    except Exception:
        conn.terminate()
