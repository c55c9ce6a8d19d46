"""Groups (the quota unit: guaranteed GPUs, a borrowing limit), users' membership, and GPU
usage: accounting per day and decayed fair-share usage, accrued on the database clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from gateway.db._common import TOKENS_CHANGED, Conn, _notify


@dataclass(frozen=True, slots=True)
class ModelQuotaRow:
    """A group's quota for its GPUs of one model (table group_model_quotas)."""

    model: str
    guaranteed_gpus: int
    #: None: no limit.
    borrow_limit_gpus: int | None


@dataclass(frozen=True, slots=True)
class GroupRow:
    name: str
    guaranteed_gpus: int
    #: None: may borrow every idle GPU.
    borrow_limit_gpus: int | None
    users: int = 0
    #: Its quotas per GPU model, by model name.
    models: tuple[ModelQuotaRow, ...] = ()


@dataclass(frozen=True, slots=True)
class UsageRow:
    user: str
    group: str
    gpu_seconds: float
    calls: int


_GROUPS = """
SELECT g.name, g.guaranteed_gpus, g.borrow_limit_gpus,
  (SELECT count(*) FROM users u WHERE u.group_name = g.name) AS users,
  array(SELECT m.model FROM group_model_quotas m WHERE m.group_name = g.name
        ORDER BY m.model COLLATE "C") AS models,
  array(SELECT m.guaranteed_gpus FROM group_model_quotas m WHERE m.group_name = g.name
        ORDER BY m.model COLLATE "C") AS model_guaranteed,
  array(SELECT m.borrow_limit_gpus FROM group_model_quotas m WHERE m.group_name = g.name
        ORDER BY m.model COLLATE "C") AS model_limits
FROM groups g
WHERE $1::text IS NULL OR g.name = $1
ORDER BY g.name
"""

# The group's row, locked until the transaction ends (a concurrent change of its quotas per
# model waits, then sees what this one wrote).
_SET_GROUP = """
INSERT INTO groups (name, guaranteed_gpus, borrow_limit_gpus) VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE SET guaranteed_gpus = EXCLUDED.guaranteed_gpus,
  borrow_limit_gpus = EXCLUDED.borrow_limit_gpus
"""

_LOCK_GROUP = """
SELECT 1 FROM groups WHERE name = $1 FOR UPDATE
"""

# The group's quotas per model replaced by those of $2..$4 (run after _SET_GROUP, in its
# transaction: a statement of its own, so it sees a concurrent change that committed first).
_SET_MODEL_QUOTAS = """
WITH dropped AS (
  DELETE FROM group_model_quotas WHERE group_name = $1 AND NOT model = ANY($2::text[])
)
INSERT INTO group_model_quotas (group_name, model, guaranteed_gpus, borrow_limit_gpus)
SELECT $1, m.model, m.guaranteed, m.borrow_limit
FROM unnest($2::text[], $3::int[], $4::int[]) AS m(model, guaranteed, borrow_limit)
ON CONFLICT (group_name, model) DO UPDATE SET guaranteed_gpus = EXCLUDED.guaranteed_gpus,
  borrow_limit_gpus = EXCLUDED.borrow_limit_gpus
"""

_GROUP_EXISTS = """
SELECT EXISTS (SELECT 1 FROM groups WHERE name = $1)
"""

_SET_USER_GROUP = """
UPDATE users SET group_name = $2 WHERE name = $1
"""

_LOCK_USAGE_CLOCK = """
SELECT accrued_at, clock_timestamp() AS now FROM usage_clock FOR UPDATE
"""

# Two index scans (leased calls; calls ended since): no pass over the whole table.
_USED_SINCE = """
WITH ran AS (
  -- (a call holding part of a GPU counts as that part)
  SELECT owner_id, gpus * gpu_share AS gpus, scheduled_at, finished_at FROM invocations
  WHERE state IN ('assigned', 'running')
  UNION ALL
  SELECT owner_id, gpus * gpu_share AS gpus, scheduled_at, finished_at FROM invocations
  WHERE finished_at > $1 AND scheduled_at IS NOT NULL
)
SELECT r.owner_id, u.name AS user_name, u.group_name,
  sum(r.gpus * extract(epoch FROM least($2, coalesce(r.finished_at, $2))
    - greatest($1, r.scheduled_at))) AS gpu_s,
  count(*) FILTER (WHERE r.finished_at > $1) AS ended
FROM ran r JOIN users u ON u.id = r.owner_id
WHERE r.scheduled_at < $2
GROUP BY r.owner_id, u.name, u.group_name
"""

_ADVANCE_USAGE_CLOCK = """
UPDATE usage_clock SET accrued_at = $1
"""

_DECAY_FAIR_USAGE = """
UPDATE fair_usage SET decayed_gpu_seconds = decayed_gpu_seconds * $1
"""

_ADD_DAILY_USAGE = """
INSERT INTO usage_daily (day, user_id, group_name, gpu_seconds, calls)
SELECT ($1::timestamptz AT TIME ZONE 'UTC')::date, u.owner, u.grp, u.used, u.ended
FROM unnest($2::bigint[], $3::text[], $4::float8[], $5::bigint[])
  AS u(owner, grp, used, ended)
ON CONFLICT (day, user_id, group_name) DO UPDATE SET
  gpu_seconds = usage_daily.gpu_seconds + EXCLUDED.gpu_seconds,
  calls = usage_daily.calls + EXCLUDED.calls
"""

_ADD_FAIR_USAGE = """
INSERT INTO fair_usage (group_name, user_name, decayed_gpu_seconds)
SELECT u.grp, k.who, sum(u.used)
FROM unnest($1::text[], $2::text[], $3::float8[]) AS u(grp, name, used),
  -- Each user's row, and their group's (user_name '').
  LATERAL (VALUES (u.name), ('')) AS k(who)
GROUP BY u.grp, k.who
ON CONFLICT (group_name, user_name) DO UPDATE SET
  decayed_gpu_seconds = fair_usage.decayed_gpu_seconds + EXCLUDED.decayed_gpu_seconds
"""

_USAGE = """
SELECT u.name, d.group_name, sum(d.gpu_seconds) AS gpu_s, sum(d.calls) AS calls
FROM usage_daily d JOIN users u ON u.id = d.user_id
WHERE d.day > (now() AT TIME ZONE 'UTC')::date - $1::int
GROUP BY u.name, d.group_name
ORDER BY gpu_s DESC, u.name
"""


async def groups(conn: Conn, name: str | None = None) -> list[GroupRow]:
    """Every group (or the one named), with its quotas per model."""
    out = []
    for r in await conn.fetch(_GROUPS, name):
        models = map(ModelQuotaRow, r["models"], r["model_guaranteed"], r["model_limits"])
        out.append(GroupRow(r["name"], r["guaranteed_gpus"], r["borrow_limit_gpus"], r["users"],
                            tuple(models)))  # fmt: skip
    return out


async def set_group(
    conn: asyncpg.Connection,
    name: str,
    guaranteed_gpus: int,
    borrow_limit_gpus: int | None,
    models: Sequence[ModelQuotaRow] | None = None,
) -> GroupRow:
    """Create group ``name`` or change its quota, and replace its quotas per model with
    ``models`` (None: keep them), in one transaction; the group as it now is."""
    given = list(models or ())
    async with conn.transaction():
        await conn.execute(_SET_GROUP, name, guaranteed_gpus, borrow_limit_gpus)
        if models is not None:
            await conn.execute(
                _SET_MODEL_QUOTAS, name, [m.model for m in given],
                [m.guaranteed_gpus for m in given], [m.borrow_limit_gpus for m in given],
            )  # fmt: skip
        await _notify(conn, "q")
        (row,) = await groups(conn, name)
    return row


async def lock_group(conn: asyncpg.Connection, name: str) -> None:
    """Lock group ``name``'s row (if it exists) until the transaction ends, so that a
    read-modify-write of its quota sees no concurrent change."""
    await conn.execute(_LOCK_GROUP, name)


async def group_exists(conn: Conn, name: str) -> bool:
    return bool(await conn.fetchval(_GROUP_EXISTS, name))


async def set_user_group(conn: Conn, user: str, group: str) -> bool:
    """Move a user to an existing group; False if there is no such user."""
    status = await conn.execute(_SET_USER_GROUP, user, group)
    await _notify(conn, TOKENS_CHANGED)
    return status.endswith(" 1")


async def accrue_usage(conn: asyncpg.Connection, half_life_s: float) -> None:
    """Add the GPU-seconds used since the last accrual: to each user's day (accounting) and,
    after decaying what is there by the time passed, to each group's and user's fair-share
    usage. Calls that ended since count up to their end."""
    async with conn.transaction():
        clock = await conn.fetchrow(_LOCK_USAGE_CLOCK)
        assert clock is not None
        ran = await conn.fetch(_USED_SINCE, clock["accrued_at"], clock["now"])
        await conn.execute(_ADVANCE_USAGE_CLOCK, clock["now"])
        seconds = (clock["now"] - clock["accrued_at"]).total_seconds()
        await conn.execute(_DECAY_FAIR_USAGE, 0.5 ** (max(0.0, seconds) / half_life_s))
        if not ran:
            return
        owners = [r["owner_id"] for r in ran]
        names = [r["user_name"] for r in ran]
        groups = [r["group_name"] for r in ran]
        used = [max(0.0, float(r["gpu_s"] or 0)) for r in ran]
        await conn.execute(
            _ADD_DAILY_USAGE, clock["now"], owners, groups, used, [r["ended"] for r in ran]
        )
        await conn.execute(_ADD_FAIR_USAGE, groups, names, used)


async def usage(conn: Conn, days: int) -> list[UsageRow]:
    """GPU-seconds and ended calls per user and group over the last ``days`` days (UTC)."""
    rows = await conn.fetch(_USAGE, days)
    return [UsageRow(r["name"], r["group_name"], float(r["gpu_s"]), int(r["calls"])) for r in rows]
