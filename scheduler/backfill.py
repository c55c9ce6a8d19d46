"""EASY backfill (SLURM's ``sched/backfill`` in its simplest form).

The first call in line that does not fit gets a reservation: the earliest time enough GPUs
free up on one node (or enough whole nodes free up, for a multi-node gang), from the running
calls' expected ends (start time + time limit or expected duration; a call without one never
ends as far as planning knows). The reserved nodes leave the round's index; a later call may
still use them if it is expected to end before the reservation starts, or if it fits in the
GPUs the reservation leaves over. Calls placed earlier in the same round count as running.
When the room depends on calls without a limit, no time can be promised and nothing is
reserved: every call that fits starts (so snapshots without running calls or limits, such as
the walking skeleton's, are planned work-conservingly). Give calls time limits to get
reservations.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from scheduler import placement
from scheduler.capacity import Capacity, Choice
from scheduler.model import NodeCapacity, Part, Pending, Snapshot

#: (expected end, GPUs on one node) of something holding GPUs.
Release = tuple[float, tuple[int, ...]]


@dataclass(slots=True)
class Reservation:
    """GPUs held back for ``call_id`` from ``start`` on, for one round."""

    call_id: str
    start: float
    #: Reserved node id -> GPUs still free at ``start`` beyond what the call needs there.
    spare: dict[int, int] = field(default_factory=dict)
    #: Kinds of call (GPUs, model, memory; whether it ends before ``start``) :meth:`admit`
    #: refused: a round's free and spare GPUs only shrink, so it refuses them again.
    refused: set[tuple[int, str | None, int, bool]] = field(default_factory=set)

    def ends_before(self, call: Pending, now: float) -> bool:
        """Whether ``call``, started now, is expected to end before the reservation starts."""
        if call.expected_s is None:
            return False
        end = now + call.expected_s
        return end <= self.start and end < math.inf

    def refuses(
        self, call: Pending, cap: Capacity, now: float, expected_s: float | None = None
    ) -> bool:
        """Whether :meth:`admit` is sure to refuse the call (it would then change nothing);
        ``expected_s``: judge it as if it were expected to run that long."""
        n = call.gpus
        if call.share != 1.0 or n == 0:
            return True  # parts of a GPU and CPU calls stay off reserved nodes
        if expected_s is not None:
            before = now + expected_s <= self.start and now + expected_s < math.inf
        else:
            before = self.ends_before(call, now)
        if (n, call.gpu_model, call.min_memory_mib, before) in self.refused:
            return True
        return n > cap.largest_for(call)  # (gangs stay off reserved nodes)

    def admit(self, call: Pending, cap: Capacity, now: float) -> Choice | None:
        """Backfill ``call`` onto a reserved node if that cannot delay the reservation: one
        that ends before it starts on any free GPU of a reserved node, another only on its
        spare GPUs (so if a call that ends before it finds no room, none of its kind does)."""
        if self.refuses(call, cap, now):
            return None  # (a long backlog is scanned at the cost of a set lookup per call)
        n = call.gpus
        before = self.ends_before(call, now)
        kind = (n, call.gpu_model, call.min_memory_mib, before)
        for node_id, spare in self.spare.items():
            state = cap.states.get(node_id)
            if state is None or len(state.free) < n or (not before and n > spare):
                continue
            free = placement.usable(state.node, state.free, call)
            if len(free) >= n:
                gpus, _ = placement.choose(state.node, free, n)
                cap.take(state, gpus)
                if not before:
                    self.spare[node_id] = spare - n
                return state, gpus
        self.refused.add(kind)
        if before:  # (one that ends later fits no better)
            self.refused.add((*kind[:3], False))
        return None

    def open(self, cap: Capacity) -> bool:
        """Whether any reserved node still has a free GPU."""
        for node_id in self.spare:
            state = cap.states.get(node_id)
            if state is not None and state.free:
                return True
        return False


def releases(
    snapshot: Snapshot, placed: Iterable[tuple[tuple[Part, ...], float]]
) -> dict[int, list[Release]]:
    """Per node, when which of its busy GPUs are expected back, in order of those times (a
    time already past means now). A GPU that calls share comes back when the last of them
    ends. Read the lists, never change them (they may be ``Snapshot.ends``'s own)."""
    out: dict[int, list[Release]]
    if snapshot.ends is not None:
        out, shared = snapshot.ends.by_node, snapshot.ends.shared > 0
    else:
        out, shared = defaultdict(list), False
        for run in snapshot.running:
            limit = run.expected_s
            end = math.inf if limit is None else run.start_time + limit
            out[run.node_id].append((end, run.gpu_indices))
            for part in run.more:
                out[part.node_id].append((end, part.gpu_indices))
            shared = shared or run.share != 1.0
        for entries in out.values():
            entries.sort()
    if placed:
        out = dict(out)
        ones: set[tuple[int, int]] = set()  # (a GPU shares placed this round may share)
        for parts, end in placed:
            for part in parts:
                out[part.node_id] = sorted([*out.get(part.node_id, ()), (end, part.gpu_indices)])
                if len(part.gpu_indices) == 1 and not shared:
                    one = (part.node_id, part.gpu_indices[0])
                    shared = one in ones
                    ones.add(one)
    return _last_ends(out) if shared else out


def _last_ends(rel: dict[int, list[Release]]) -> dict[int, list[Release]]:
    """``rel`` with each GPU listed once, at the latest of its ends."""
    out: dict[int, list[Release]] = defaultdict(list)
    for node_id, entries in rel.items():
        last: dict[int, float] = {}
        for end, gpus in entries:
            for g in gpus:
                last[g] = max(end, last.get(g, end))
        out[node_id] = sorted((end, (g,)) for g, end in last.items())
    return out


def reserve(
    call: Pending,
    cap: Capacity,
    snapshot: Snapshot,
    rel: dict[int, list[Release]],
    limit: float = math.inf,
    avoid: Container[int] = (),
) -> Reservation | None:
    """Reserve the earliest room for ``call`` and withdraw it from ``cap``; None if the call
    can never fit on these nodes as far as the running calls' ends tell. ``rel`` comes from
    :func:`releases`; whole nodes for a gang add up to no more than ``limit`` GPUs; nodes
    withdrawn this round (reserved or reclaimed already, free GPUs or not) are not used, nor
    those in ``avoid``."""
    if call.gpus == 0:
        return None
    if call.gpus > cap.largest_for(call):
        found = _whole_nodes(call, cap, snapshot, rel, limit, avoid)
    else:
        found = _one_node(call, cap, snapshot, rel, avoid)
    if found is None or found.start == math.inf:
        return None  # no known end to plan by: nothing is held back (work-conserving)
    for node_id in found.spare:
        cap.withdraw(node_id)
    return found


def _one_node(
    call: Pending,
    cap: Capacity,
    snapshot: Snapshot,
    rel: dict[int, list[Release]],
    avoid: Container[int],
) -> Reservation | None:
    n, now = call.gpus, snapshot.now
    if not placement.constrained(call):  # (any GPU will do: the common case, and hot)
        return _plain_room(call, cap, snapshot, rel, avoid)
    best: tuple[float, int, int] | None = None  # (start, -spare, node id)
    for node in _usable(snapshot.nodes, call, cap, avoid):
        have = len(placement.usable(node, cap.free_of(node.node_id), call))
        start = now
        for end, gpus in rel.get(node.node_id, ()):
            if have >= n and end > start:
                break
            have += len(placement.usable(node, gpus, call))
            start = end if end > start else start
        if have >= n and (best is None or (start, n - have) < best[:2]):
            best = (start, n - have, node.node_id)
    if best is None:
        return None
    return Reservation(call.id, best[0], {best[2]: -best[1]})


def _plain_room(
    call: Pending, cap: Capacity, snapshot: Snapshot, rel: dict[int, list[Release]],
    avoid: Container[int],
) -> Reservation | None:  # fmt: skip
    """:func:`_one_node` for a call any GPU will do, without the generic filters, passing
    over a node as soon as it cannot start the call before the best so far."""
    n, now, withdrawn, states = call.gpus, snapshot.now, cap.withdrawn, cap.states
    sized = n <= cap.largest  # (else sizes are checked as the room is counted)
    best_start, best_short, best_node = math.inf, 0, -1
    for node in snapshot.nodes:
        node_id = node.node_id
        if node.draining or node_id in withdrawn or node_id in avoid:
            continue
        if sized and node.gpus and len(node.gpus) < n:
            continue  # (never big enough)
        state = states.get(node_id)
        have = len(state.free) if state is not None else 0
        start = now
        for end, gpus in rel.get(node_id, ()):
            if have >= n and end > start:
                break
            if end > start:
                if end > best_start:
                    break  # (it starts later than the best so far: no better)
                start = end
            have += len(gpus)
        if have >= n and (start < best_start or (start == best_start and n - have < best_short)):
            best_start, best_short, best_node = start, n - have, node_id
    if best_node < 0:
        return None
    return Reservation(call.id, best_start, {best_node: -best_short})


def _whole_nodes(
    call: Pending,
    cap: Capacity,
    snapshot: Snapshot,
    rel: dict[int, list[Release]],
    limit: float,
    avoid: Container[int],
) -> Reservation | None:
    now, withdrawn, plain = snapshot.now, cap.withdrawn, not placement.constrained(call)
    ready: list[tuple[float, int, NodeCapacity]] = []
    for node in snapshot.nodes:  # (_usable's and _ready's tests inlined: this is hot)
        node_id = node.node_id
        if node.draining or node_id in withdrawn or node_id in avoid or not node.gpus:
            continue
        if not plain and not placement.whole_node_ok(node, call):
            continue
        ends = rel.get(node_id)
        ready.append((max(ends[-1][0], now) if ends else now, len(ready), node))
    ready.sort()
    total = 0
    chosen: list[int] = []
    for start, _, node in ready:
        if total + len(node.gpus) > limit:
            continue  # the gang would hold more GPUs than its group may
        total += len(node.gpus)
        chosen.append(node.node_id)
        if total >= call.gpus:
            return Reservation(call.id, start, dict.fromkeys(chosen, 0))
    return None


def _ready(ends: list[Release] | None, now: float) -> float:
    """When all of a node's busy GPUs are expected back (its last release), not before now."""
    return max(ends[-1][0], now) if ends else now


def _usable(
    nodes: Iterable[NodeCapacity], call: Pending, cap: Capacity, avoid: Container[int]
) -> Iterable[NodeCapacity]:
    """Nodes the call may be reserved on: live, not already held for another call (nor in
    ``avoid``), big enough (a node of unknown size may be, once its running calls end)."""
    for node in nodes:
        if node.draining or node.node_id in cap.withdrawn or node.node_id in avoid:
            continue
        if not node.gpus or call.gpus > cap.largest_for(call):
            yield node  # sizes are checked as the room is counted
        elif placement.node_fits_ever(node, call):
            yield node


class Horizon:
    """Reservations for calls that need whole nodes, many in one round: every node's *ready*
    time (when all its GPUs are expected back: its last release, not before now), the nodes
    sorted by it. Each reservation takes the earliest ready nodes that qualify, as
    :func:`reserve` does, without a pass over every node and its releases per call (a cursor
    per kind of call skips the nodes already held or not of its kind). Only for clusters
    whose nodes all have a known inventory of one model (:meth:`serves`); ``rel`` as for
    :func:`reserve`, and built again when it changes."""

    def __init__(self, snapshot: Snapshot, rel: dict[int, list[Release]]) -> None:
        now = snapshot.now
        self.order = sorted(
            (
                (_ready(rel.get(node.node_id), now), i, node)
                for i, node in enumerate(snapshot.nodes)
                if not node.draining
            ),
            key=lambda entry: entry[:2],
        )
        #: Per kind of call (model, memory): entries before it are held or not of its kind.
        self.cursor: dict[tuple[str | None, int], int] = {}

    @staticmethod
    def serves(nodes: Iterable[NodeCapacity], cap: Capacity) -> bool:
        """Whether the cluster's nodes suit it: known inventories, none mixing models."""
        return not cap.mixed and all(node.gpus for node in nodes)

    def reserve(
        self,
        call: Pending,
        cap: Capacity,
        limit: float = math.inf,
        avoid: Container[int] = (),
    ) -> Reservation | None:
        """What :func:`reserve` gives a call of at least ``cap.largest_for(call)`` GPUs."""
        key = (call.gpu_model, call.min_memory_mib)
        gang = call.gpus > cap.largest_for(call)
        start = k = self.cursor.get(key, 0)
        chosen: list[int] = []
        total, spare, ready = 0, 0, math.inf
        while k < len(self.order):
            ready, _, node = self.order[k]
            k += 1
            if node.node_id in cap.withdrawn or not placement.whole_node_ok(node, call):
                if k - 1 == start:
                    start = k  # never of use to this kind again this round
                continue
            if node.node_id in avoid:
                continue  # (of use to the next call, maybe)
            size = len(node.gpus)
            if not gang:
                if size >= call.gpus:
                    chosen, spare = [node.node_id], size - call.gpus
                    break
            elif total + size <= limit:  # else the gang would hold more than its group may
                total += size
                chosen.append(node.node_id)
                if total >= call.gpus:
                    break
        self.cursor[key] = start
        if not chosen or (gang and total < call.gpus) or ready == math.inf:
            return None
        for node_id in chosen:
            cap.withdraw(node_id)
        return Reservation(call.id, ready, dict.fromkeys(chosen, spare))
