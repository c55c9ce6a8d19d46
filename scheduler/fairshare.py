"""Decayed usage and the fair-share order among borrowers (SLURM Fair Tree, HTCondor).

Usage is GPU-seconds with an exponential half-life: a GPU-second used ``h`` seconds ago counts
half. A group's fair-share key is its decayed usage over its share (its guarantee, at least one
GPU), so a group that used less than its share recently goes first; inside a group, the user
with less decayed usage goes first (the tree's second level).

The gateway computes the snapshot's ``usage`` from its accounting rows with
:func:`decayed_total`; the replay simulator keeps a :class:`UsageMeter` that integrates running
calls as they run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Generic, TypeVar

from scheduler.model import DEFAULT_QUOTA, Pending, Quota

K = TypeVar("K", bound=Hashable)

#: HTCondor's PRIORITY_HALFLIFE default: one day (SLURM's PriorityDecayHalfLife is 7 days).
DEFAULT_HALF_LIFE_S = 24 * 3600.0


def decay(dt: float, half_life_s: float) -> float:
    """The weight now of a GPU-second used ``dt`` seconds ago."""
    return 0.5 ** (dt / half_life_s)


def decayed_total(
    records: Iterable[tuple[float, float, float]], now: float, half_life_s: float
) -> float:
    """Decayed GPU-seconds of (start, end, gpus) intervals as of ``now``; an interval still
    running should end at ``now``. Each interval is integrated exactly, not lumped at its end.
    """
    k = math.log(2) / half_life_s
    total = 0.0
    for start, end, gpus in records:
        end = min(end, now)
        if end > start:
            total += gpus * (math.exp(-k * (now - end)) - math.exp(-k * (now - start))) / k
    return total


class UsageMeter(Generic[K]):
    """Decayed GPU-seconds per key, integrating what runs now; O(1) per change."""

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self._k = math.log(2) / half_life_s
        self._value: dict[K, float] = {}
        self._rate: dict[K, float] = {}
        self._at: dict[K, float] = {}

    def _advance(self, key: K, now: float) -> None:
        dt = now - self._at.get(key, now)
        if dt > 0:
            d = math.exp(-self._k * dt)
            rate = self._rate.get(key, 0.0)
            self._value[key] = self._value.get(key, 0.0) * d + rate * (1 - d) / self._k
        self._at[key] = now

    def change(self, key: K, gpus: float, now: float) -> None:
        """``gpus`` more (or fewer, if negative) GPUs are in use for ``key`` from ``now``."""
        self._advance(key, now)
        self._rate[key] = self._rate.get(key, 0.0) + gpus

    def value(self, key: K, now: float) -> float:
        self._advance(key, now)
        return self._value.get(key, 0.0)

    def keys(self) -> list[K]:
        return list(self._at)

    def values(self, now: float) -> dict[K, float]:
        return {key: self.value(key, now) for key in list(self._at)}


def group_key(group: str, usage: Mapping[str, float], quota: Quota) -> float:
    """Decayed usage per guaranteed GPU: smaller goes first."""
    return usage.get(group, 0.0) / max(quota.guaranteed, 1)


_bucket_key = attrgetter("priority", "group", "user")


def fair_buckets(
    pending: Iterable[Pending],
    usage: Mapping[str, float],
    user_usage: Mapping[tuple[str, str], float],
    quotas: Mapping[str, Quota] | None = None,
    default: Quota = DEFAULT_QUOTA,
) -> list[list[Pending]]:
    """Pending calls by (priority, group, user), the buckets in fair-share order: priority
    first, then the group's key, then the user's decayed usage. Each bucket keeps queue order.
    One pass to bucket, then a sort of the (few) buckets."""
    buckets: dict[tuple[int, str, str], list[Pending]] = {}
    pending = pending if isinstance(pending, Sequence) else list(pending)
    for key, call in zip(map(_bucket_key, pending), pending, strict=True):  # (hot: every round)
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = [call]
        else:
            bucket.append(call)
    rank = bucket_rank(usage, user_usage, quotas, default)
    return [buckets[key] for key in sorted(buckets, key=rank)]


def bucket_rank(
    usage: Mapping[str, float],
    user_usage: Mapping[tuple[str, str], float],
    quotas: Mapping[str, Quota] | None = None,
    default: Quota = DEFAULT_QUOTA,
) -> Callable[[tuple[int, str, str]], tuple[int, float, float, str, str]]:
    """The sort key of a (priority, group, user) bucket in fair-share order (see
    :func:`fair_buckets`)."""
    quota = quotas or {}

    def rank(key: tuple[int, str, str]) -> tuple[int, float, float, str, str]:
        priority, group, user = key
        share = group_key(group, usage, quota.get(group, default))
        return (-priority, share, user_usage.get((group, user), 0.0), group, user)

    return rank


def fair_order(
    pending: Iterable[Pending],
    usage: Mapping[str, float],
    user_usage: Mapping[tuple[str, str], float],
    quotas: Mapping[str, Quota] | None = None,
    default: Quota = DEFAULT_QUOTA,
) -> list[Pending]:
    """The pending calls in fair-share order (see :func:`fair_buckets`)."""
    buckets = fair_buckets(pending, usage, user_usage, quotas, default)
    return [call for bucket in buckets for call in bucket]
