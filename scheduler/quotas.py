"""GPUs each group holds against its quota, as a round goes on (Kueue / Run:ai semantics).

A group's guarantee is the GPUs it gets back whenever it has work for them; above it, a group
borrows idle GPUs up to its ceiling (guarantee + borrowing limit), and borrowed GPUs may be
reclaimed. A call is *nominal* if its group, holding it, stays within its guarantee; otherwise
it borrows. Groups without a configured quota get ``DEFAULT_QUOTA``: nothing guaranteed, may
borrow every idle GPU. Calls already told to stop do not count: their GPUs are on the way back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from scheduler.model import DEFAULT_QUOTA, Pending, Quota, Running


class Book:
    """GPUs held per group during one round."""

    def __init__(
        self,
        running: Sequence[Running],
        quotas: Mapping[str, Quota],
        default: Quota = DEFAULT_QUOTA,
    ) -> None:
        self.quotas = quotas
        self.default = default
        self.used: dict[str, int] = defaultdict(int)
        for run in running:
            if not run.preempting:
                self.used[run.group] += run.gpus

    def quota(self, group: str) -> Quota:
        return self.quotas.get(group, self.default)

    def nominal(self, call: Pending) -> bool:
        """Whether the call fits inside its group's guarantee."""
        return self.used[call.group] + call.gpus <= self.quota(call.group).guaranteed

    def within_ceiling(self, call: Pending) -> bool:
        """Whether the call's request fits under its group's ceiling (a gang on whole nodes
        may take more than it asks for: place it within :meth:`room`)."""
        return self.used[call.group] + call.gpus <= self.quota(call.group).ceiling

    def room(self, group: str) -> float:
        """The most GPUs the group may still take (inf: no ceiling)."""
        return self.quota(group).ceiling - self.used[group]

    def borrowing(self, group: str) -> bool:
        """Whether the group holds more than its guarantee (so some of it is reclaimable)."""
        return self.used[group] > self.quota(group).guaranteed

    def any_borrowing(self) -> bool:
        return any(self.borrowing(g) for g in list(self.used))

    def add(self, group: str, gpus: int) -> None:
        self.used[group] += gpus

    def ceiling_reason(self, call: Pending, taking: int | None = None) -> str:
        """Why the call would pass its group's ceiling; ``taking``: the GPUs its whole nodes
        would take, when more than it asks for."""
        quota = self.quota(call.group)
        nodes = "" if taking is None else f"; the whole nodes free for it would take {taking}"
        return (
            f"group {call.group or '(none)'} is at its quota ceiling: it holds "
            f"{self.used[call.group]} of at most {quota.ceiling:g} GPUs "
            f"(guarantee {quota.guaranteed} + borrowing limit {quota.borrow_limit}){nodes}"
        )
