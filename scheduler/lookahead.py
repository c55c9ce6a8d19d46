"""What a live planning round sees of a long queue: each user's first calls, not all of them.

The gateway does not read the whole queue every round (``gateway/db/scheduling.py``'s
``queued``): it takes the first :func:`per_user` queued calls of every user in submission
order, takes those heads in turns (every user's first, then every user's second...) up to
``most`` calls, and hands them to the policy in submission order. :func:`visible` is the same
selection on calls already in memory, for the replay's ``--look-ahead``; a round's policy
only ever orders and places what it is shown.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

from scheduler.model import NodeCapacity, Pending

#: The gateway's default ``--plan-batch``: most queued calls one round looks at.
MOST = 5000
T = TypeVar("T")


def per_user(free: Iterable[NodeCapacity], most: int) -> int:
    """How far down each user's queue a round looks: enough to fill what is free, with room
    to backfill past calls that do not fit, and some even when nothing is free (a group
    owed its guarantee reclaims GPUs), without re-reading a huge backlog every round."""
    units = sum(len(n.free_gpus) + n.free_cpu_slots for n in free if not n.draining)
    return max(1, min(most, 16 + 16 * units))


def visible(
    queue: Sequence[T], per: int, most: int, user: Callable[[T], Hashable], seq: Callable[[T], int]
) -> list[T]:
    """The calls of ``queue`` a round is shown: each user's first ``per`` by ``seq``, taken in
    turns up to ``most``, returned in ``seq`` order."""
    heads: dict[Hashable, list[T]] = {}
    for call in sorted(queue, key=seq):
        mine = heads.setdefault(user(call), [])
        if len(mine) < per:
            mine.append(call)
    turns = sorted(
        ((turn, seq(call), call) for mine in heads.values() for turn, call in enumerate(mine)),
        key=lambda t: (t[0], t[1]),
    )
    return sorted((call for _, _, call in turns[:most]), key=seq)


def shown(
    pending: Sequence[Pending], free: Iterable[NodeCapacity], most: int = MOST
) -> list[Pending]:
    """:func:`visible` for a replay's pending calls (their ids are their submission order)."""
    return visible(pending, per_user(free, most), most, lambda c: c.user, lambda c: int(c.id))
