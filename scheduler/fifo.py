"""``fifo``: first come first served with EASY backfill, the SLURM-like baseline.

Calls are taken by priority, then in the order the snapshot lists them (the queue order).
Each goes where :mod:`scheduler.placement` ranks best. The first
call that does not fit gets a reservation (:mod:`scheduler.backfill`); later calls still start
if they fit outside it or cannot delay it. Quotas are not consulted. With no running calls
known (no ends to plan by) nothing can be reserved and every call that fits starts.

A round passes over calls that can do nothing: once a call found no room and could not
backfill, later calls of its kind (as many GPUs or more of its model) are skipped at the cost
of a lookup, and in a :class:`~scheduler.queue.Queue` (the replay's) a kind at a time
(:meth:`Queue.walk <scheduler.queue.Queue.walk>`). Explaining a round (``why``) and
``max_backfill`` look at every call in turn; what starts is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import ClassVar

from scheduler.backfill import Release, Reservation, releases, reserve
from scheduler.capacity import Capacity
from scheduler.model import Decision, Part, Pending, Plan, Snapshot
from scheduler.queue import Queue
from scheduler.reasons import Why, note, rest, shortfall, starting


@dataclass
class Fifo:
    """FIFO with EASY backfill. ``max_backfill`` bounds the calls examined after the first
    blocked one (SLURM's ``bf_max_job_test``); None examines them all."""

    max_backfill: int | None = None
    name: str = "fifo"
    uses_quotas: bool = False
    preempts: ClassVar[bool] = False  # (what the policy does, not a setting)
    #: What it reads of a replay's queue (scheduler.queue.Queue): the lists per kind only.
    queue_tiers: ClassVar[bool] = False

    def plan(self, snapshot: Snapshot, why: Why | None = None) -> Plan:
        cap = Capacity(snapshot.nodes, snapshot.share_across_users)
        out = Plan()
        if cap.exhausted():  # nothing to place, nothing worth reserving
            if why is not None:
                rest(why, queue_order(snapshot.pending), 1, "no free GPU; {ahead}")
            return out
        queue = snapshot.pending
        order = queue if isinstance(queue, Queue) else queue_order(queue)
        now = snapshot.now
        held: Reservation | None = None
        placed: list[tuple[tuple[Part, ...], float]] = []
        unreservable: set[tuple[int, str | None, int]] = set()
        rel: tuple[int, dict[int, list[Release]]] | None = None  # (len(placed), releases)

        def dead(call: Pending, expected_s: float | None = None) -> bool:
            """Whether nothing can be done for the call this round (nor, with ``expected_s``,
            for any call of its kind expected to run that long or longer)."""
            if not cap.hopeless(call):
                return False
            if held is None:
                return (call.gpus, call.gpu_model, call.min_memory_mib) in unreservable
            return held.refuses(call, cap, now, expected_s)

        # Explaining, or bounding the calls examined: every call in turn. Else calls the
        # round can do nothing for are passed over (a kind of call at a time in a Queue).
        if why is not None or self.max_backfill is not None:
            calls: Iterable[tuple[int, Pending]] = enumerate(order, 1)
        elif isinstance(queue, Queue) and queue.kinds:
            calls = ((0, call) for call in queue.walk(dead, dead))
        else:
            calls = ((0, call) for call in order if not dead(call))
        examined = 0
        for pos, call in calls:
            if cap.exhausted() and (held is None or not held.open(cap)):
                rest(why, order, pos, "no free GPU; {ahead}")
                break
            if held is not None:
                examined += 1
                if self.max_backfill is not None and examined > self.max_backfill:
                    rest(why, order, pos, "{ahead} (past the backfill depth)")
                    break
            parts = cap.place(call)
            if parts is None and held is not None:
                choice = held.admit(call, cap, now)
                parts = None if choice is None else (Part(choice[0].node.node_id, choice[1]),)
            if parts is not None:
                out.append(Decision.of(call.id, parts))
                if held is None:
                    end = now + call.expected_s if call.expected_s is not None else math.inf
                    placed.append((parts, end))
                note(why, call, pos, starting, parts)
                continue
            shape = (call.gpus, call.gpu_model, call.min_memory_mib)
            if held is None and shape not in unreservable:
                if rel is None or len(placed) != rel[0]:
                    rel = (len(placed), releases(snapshot, placed))
                held = reserve(call, cap, snapshot, rel[1])
                if held is None:
                    unreservable.add(shape)
                else:
                    out.reserved[call.id] = held.start
                    note(why, call, pos, _head, call, cap, held, now)
                    continue
            note(why, call, pos, _blocked, call, cap, held)
        return out


_priority = attrgetter("priority")


def queue_order(pending: Sequence[Pending]) -> Sequence[Pending]:
    """Higher priority first; the given order otherwise (not re-sorted when all are equal)."""
    if any(map(_priority, pending)):  # (map: this runs over the whole queue every round)
        return sorted(pending, key=lambda call: -call.priority)
    return pending


def _head(call: Pending, cap: Capacity, held: Reservation, now: float) -> str:
    wait = held.start - now
    when = f"from in about {wait:.0f} s" if wait < math.inf else "as they free up"
    return f"first in line: {shortfall(call, cap)}; GPUs reserved for it {when}"


def _blocked(call: Pending, cap: Capacity, held: Reservation | None) -> str:
    if held is not None and call.share != 1.0:
        return (
            f"{shortfall(call, cap)} outside the GPUs reserved for call {held.call_id} (part "
            "of a GPU never backfills onto reserved GPUs)"
        )
    if held is not None and call.gpus and call.gpus <= cap.largest_for(call):
        return (
            f"{shortfall(call, cap)} outside the GPUs reserved for call {held.call_id}, "
            "and it is not expected to end before that reservation starts"
        )
    return shortfall(call, cap)
