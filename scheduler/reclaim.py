"""Reclaim: make room for a group's guaranteed work by preempting other groups' borrowing.

A running call is a candidate if it is preemptible, not already stopping, not protected (a
gang on whole nodes that waited past the starvation bound before it started, the guard's:
see :func:`protected` and :mod:`scheduler.fair`), of another
group, and its group holds more than its guarantee when it is picked (for a run on GPUs of
models its group's quota lists: more than its guarantee of each of them, see
:meth:`scheduler.quotas.Book.reclaimable`), so reclaim never eats into anyone's guarantee.
Nodes reserved for a starving call are left alone. Candidates are taken those flagged
borrowed first, of those the calls of the groups that borrow most for their weight
(:meth:`~scheduler.quotas.Book.lent`, as the round's first reclaim finds them) first, then
youngest first (before
session 19, youngest first whatever the group: a small group that borrowed big calls kept
them while bigger groups lost theirs), and only as many as make the call fit: for a single-node
call, walking the candidates in that order, the first node whose free GPUs plus its candidates
so far hold the call wins, with those candidates as victims. A multi-node gang clears the whole
nodes needing the fewest victims, leaving out nodes that would take its group past its ceiling
(a gang holds every GPU of its nodes). GPUs of calls already stopping count as free, so a round
never preempts twice for the same need. The chosen nodes are withdrawn from the round's index,
so borrowers cannot take the room back before the reclaiming call starts; later reclaims may
still use what is left there beyond the GPUs promised.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from scheduler import placement
from scheduler.capacity import Capacity, kind
from scheduler.model import NodeCapacity, Pending, Running, Snapshot
from scheduler.quotas import Book, Released

_NONE: dict[str | tuple[str, str], float] = {}  # (nothing released yet)


@dataclass(slots=True)
class Reclaim:
    node_ids: list[int]
    victims: list[Running] = field(default_factory=list)
    #: GPUs the call will take there: all of its nodes' for a gang on whole nodes.
    gpus: int = 0


@dataclass(slots=True)
class _Room:
    """Room being gathered on one node for one call."""

    node: NodeCapacity
    have: int
    victims: list[Running] = field(default_factory=list)
    released: Released = field(default_factory=dict)


class Reclaimer:
    """Victim selection for one round; remembers what it already chose."""

    def __init__(
        self,
        snapshot: Snapshot,
        cap: Capacity,
        book: Book,
        protect_after_s: float | None = None,
        sizes: WholeSizes | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.cap = cap
        self.book = book
        #: Whole-node runs that waited this long before they started are never victims
        #: (None: none is protected; see :func:`protected`).
        self.protect_after_s = protect_after_s
        #: The nodes' WholeSizes (see :func:`protected`), the round's own when it has one.
        self.sizes = WholeSizes(snapshot.nodes) if sizes is None else sizes
        #: Nodes held for reservations: no room is sought there (the caller may add to it).
        self.reserved: set[int] = set()
        #: Nodes left alone for the call at hand only (another reservation's, which the
        #: guard has not renewed yet): the caller sets and clears it.
        self.avoid: Container[int] = frozenset()
        self.chosen: set[str] = set()
        self._ready = False
        #: Per shared GPU whose calls may all be preempted, its calls, under the id of the
        #: one that stands for them in the walk: a shared GPU comes back only with all of them.
        self._sharers: dict[str, list[Running]] = {}
        self.nodes: dict[int, NodeCapacity] = {}
        self._by_node: dict[int, list[Running]] = defaultdict(list)
        self._stopping: dict[int, list[tuple[int, ...]]] = defaultdict(list)
        self._queue: list[Running] = []
        self._start = 0  # self._queue[:start] can never be picked again this round
        self._cursor = 0  # how far the shared walk has gone
        self._rooms: dict[int, _Room] = {}
        self._tiers: dict[int, dict[int, _Room]] = {}  # room.have -> rooms, in walk order
        self._clearable: list[tuple[int, int, NodeCapacity, list[Running]]] | None = None
        #: Nodes where GPUs on their way back may not all be promised yet (an ordered set).
        self._returning: dict[int, None] = {}
        #: Per node: GPUs on their way back less those promised (all GPUs counted).
        self._back: dict[int, int] = {}
        #: GPUs of each node set aside for calls that reclaimed there this round.
        self._promised: dict[int, int] = {}

    def _prepare(self) -> None:
        """Index the running calls, once per round and only if some call needs reclaim."""
        self._ready = True
        self.nodes = {n.node_id: n for n in self.snapshot.nodes}
        shares: dict[tuple[int, int], list[Running]] = defaultdict(list)
        for run in self.snapshot.running:
            if run.share != 1.0:
                shares[(run.node_id, run.gpu_indices[0])].append(run)
                continue
            if not run.preempting:
                self._by_node[run.node_id].append(run)
                for part in run.more:
                    self._by_node[part.node_id].append(run)
                continue
            for part in run.parts:
                self._stopping[part.node_id].append(part.gpu_indices)
                self._back[part.node_id] = self._back.get(part.node_id, 0) + len(part.gpu_indices)
                self._returning[part.node_id] = None
        queue = [
            r
            for r in self.snapshot.running
            if r.share == 1.0 and self._victim_ok(r) and not r.preempting
        ]
        for (node_id, index), runs in shares.items():
            live = [r for r in runs if not r.preempting]
            if not live:  # all told to stop: the GPU is on its way back
                self._stopping[node_id].append((index,))
                self._back[node_id] = self._back.get(node_id, 0) + 1
                self._returning[node_id] = None
                continue
            self._by_node[node_id].extend(live)
            if all(self._victim_ok(r) for r in live):
                first = min(live, key=_walk_key)
                self._sharers[first.id] = live
                queue.append(first)
        lent = {group: self.book.lent(group) for group in {run.group for run in queue}}
        self._queue = sorted(
            queue, key=lambda r: (not r.borrowed, -lent[r.group], -r.start_time)
        )  # (borrowed first; of those, the groups borrowing most for their weight first)

    def _victim_ok(self, run: Running) -> bool:
        """Whether the run may ever be preempted by reclaim."""
        return run.preemptible and not protected(run, self.protect_after_s, self.nodes, self.sizes)

    def reclaim(self, call: Pending, limit: float = math.inf) -> Reclaim | None:
        """Pick room for ``call`` (victims possibly none), withdraw it, charge the groups;
        the room holds at most ``limit`` GPUs (what the call's group may still take)."""
        if call.gpus == 0 or call.amount > limit:  # (a share needs room for its share)
            return None
        if not self._ready:
            self._prepare()
        if call.gpus > self.cap.largest_for(call):
            found = self._whole_nodes(call, limit)
            if found is not None:
                found.gpus = sum(len(self.nodes[i].gpus) for i in found.node_ids)
        else:
            found = self._one_node(call)
            if found is not None:
                found.gpus = call.gpus
        if found is None:
            return None
        counted: set[tuple[int, int]] = set()  # shared GPUs (their calls all go)
        for victim in found.victims:
            self.book.add_run(victim, -1)
            self.chosen.add(victim.id)
            if victim.share != 1.0:
                gpu = (victim.node_id, victim.gpu_indices[0])
                if gpu in counted:
                    continue
                counted.add(gpu)
            for part in victim.parts:
                self._stopping[part.node_id].append(part.gpu_indices)
                self._back[part.node_id] = self._back.get(part.node_id, 0) + len(part.gpu_indices)
                self._returning[part.node_id] = None
        for node_id in found.node_ids:
            self.cap.withdraw(node_id)
            self._promised[node_id] = self._promised.get(node_id, 0) + call.gpus
            self._back[node_id] = self._back.get(node_id, 0) - call.gpus
        return found

    def _node(self, node_id: int, call: Pending, whole: bool) -> NodeCapacity | None:
        """The node, if it may hold (part of) the call: live and big enough; for a whole node,
        nothing on it promised to another call."""
        node = self.nodes.get(node_id)
        if node is None or node.draining or node_id in self.reserved or node_id in self.avoid:
            return None
        if whole and self._promised.get(node_id):
            return None
        ok = placement.whole_node_ok if whole else placement.node_fits_ever
        return node if ok(node, call) else None

    def _have(self, node: NodeCapacity, call: Pending) -> int:
        """The call's GPUs on the node that are free or on their way back."""
        if not placement.constrained(call):
            return len(self.cap.free_of(node.node_id)) + self._back.get(node.node_id, 0)
        free = len(placement.usable(node, self.cap.free_of(node.node_id), call))
        return (
            free
            - self._promised.get(node.node_id, 0)
            + sum(
                len(placement.usable(node, gpus, call))
                for gpus in self._stopping.get(node.node_id, ())
            )
        )

    def _pickable(self, run: Running, released: Released) -> bool:
        """Whether the run's group still borrows after ``released`` is taken back (in all,
        or of a model the run holds, for quotas per model)."""
        return self.book.reclaimable(run, released)

    def _one_node(self, call: Pending) -> Reclaim | None:
        for node_id in list(self._returning):  # enough already on the way back?
            node = self._node(node_id, call, whole=False)
            have = 0 if node is None else self._have(node, call)
            if have >= call.gpus:
                return Reclaim([node_id])
            if node is not None and have <= 0 and not placement.constrained(call):
                del self._returning[node_id]  # all promised: no use to anyone this round
        if placement.constrained(call):
            return self._walk_for(call)
        return self._walk(call)

    def _walk(self, call: Pending) -> Reclaim | None:
        """The candidates walk, shared by this round's unconstrained calls: the rooms gathered
        on each node so far are kept (by how many GPUs their candidates hold), and the walk
        resumes where the last call left it."""
        n = call.gpus
        for node_id in self._returning:  # fewer victims where GPUs are already coming back
            room = self._rooms.get(node_id)
            if room is not None and room.have and room.have + self._have(room.node, call) >= n:
                found = self._settle(room, call)
                if found is not None:
                    return found
        for have in sorted(h for h, rooms in self._tiers.items() if h >= n and rooms):
            for room in list(itertools.islice(self._tiers[have].values(), 64)):
                found = self._settle(room, call)
                if found is not None:
                    return found
        while self._cursor < len(self._queue):
            run = self._queue[self._cursor]
            self._cursor += 1
            if not self._live(run):
                continue
            for part in run.parts:
                room = self._rooms.get(part.node_id)
                if room is None:
                    node = self.nodes.get(part.node_id)
                    if node is None or node.draining or part.node_id in self.reserved:
                        continue
                    room = self._rooms[part.node_id] = _Room(node, 0)
                room.victims.append(run)
                self._gathered(room, room.have + len(part.gpu_indices))
                found = self._settle(room, call)
                if found is not None:
                    return found
        return None

    def _gathered(self, room: _Room, have: int) -> None:
        """Set the GPUs the room's candidates hold, keeping the tiers up to date."""
        node_id = room.node.node_id
        if room.have:
            self._tiers[room.have].pop(node_id, None)
        room.have = have
        if have:
            self._tiers.setdefault(have, {})[node_id] = room

    def _settle(self, room: _Room, call: Pending) -> Reclaim | None:
        """Take just enough of the room's candidates, in the walk's order, if that fits the
        call."""
        node = room.node
        if node.node_id in self.reserved or node.node_id in self.avoid:
            return None  # (reserved, or to be avoided, since its room was gathered)
        base = self._have(node, call)
        if base + room.have < call.gpus or not placement.node_fits_ever(node, call):
            return None
        released: Released = {}
        victims, got = [], base
        for run in room.victims:
            if got >= call.gpus:
                break
            sharers = self._sharers.get(run.id)
            if sharers is None:
                if run.id in self.chosen or not self._pickable(run, released):
                    continue
                victims.append(run)
                self.book.count_release(released, run)
            else:
                after = self._release_all(sharers, released)
                if after is None:
                    continue
                released = after
                victims.extend(sharers)
            got += self._gpus_on(run, node.node_id)
        if got < call.gpus:
            room.victims = [r for r in room.victims if self._live(r)]
            self._gathered(room, sum(self._gpus_on(r, node.node_id) for r in room.victims))
            return None
        taken = {r.id for r in victims}
        room.victims = [r for r in room.victims if r.id not in taken]
        self._gathered(room, sum(self._gpus_on(r, node.node_id) for r in room.victims))
        return Reclaim([node.node_id], victims)

    def _release_all(self, runs: list[Running], released: Released) -> Released | None:
        """``released`` with all of ``runs`` taken back too, if reclaim may take each
        (else None; ``released`` is left as it was)."""
        after = dict(released)
        for run in runs:
            if run.id in self.chosen or not self._pickable(run, after):
                return None
            self.book.count_release(after, run)
        return after

    @staticmethod
    def _gpus_on(run: Running, node_id: int) -> int:
        if not run.more:  # (the common case, without building the parts: this is hot)
            return len(run.gpu_indices) if run.node_id == node_id else 0
        return sum(len(p.gpu_indices) for p in run.parts if p.node_id == node_id)

    def _walk_for(self, call: Pending) -> Reclaim | None:
        """A walk of its own for a call with GPU constraints (only some GPUs count)."""
        start = self._start
        while start < len(self._queue) and not self._live(self._queue[start]):
            start += 1
        self._start = start
        rooms: dict[int, _Room | None] = {}
        for run in self._queue[start:]:
            sharers = self._sharers.get(run.id, [run])
            if any(r.group == call.group for r in sharers) or not self._live(run):
                continue
            for part in run.parts:
                if part.node_id not in rooms:
                    node = self._node(part.node_id, call, whole=False)
                    rooms[part.node_id] = (
                        None if node is None else _Room(node, self._have(node, call))
                    )
                room = rooms[part.node_id]
                after = None if room is None else self._release_all(sharers, room.released)
                if room is None or after is None:
                    continue
                room.victims.extend(sharers)
                room.released = after
                room.have += len(placement.usable(room.node, part.gpu_indices, call))
                if room.have >= call.gpus:
                    return Reclaim([part.node_id], room.victims)
        return None

    def _live(self, run: Running) -> bool:
        """Could still be picked this round (not chosen, its group still borrows; for a
        shared GPU, each of its calls)."""
        sharers = self._sharers.get(run.id)
        if sharers is not None:
            return all(r.id not in self.chosen and self._pickable(r, _NONE) for r in sharers)
        return run.id not in self.chosen and self._pickable(run, _NONE)

    def _whole_nodes(self, call: Pending, limit: float) -> Reclaim | None:
        """Whole nodes to clear for a gang, those with the fewest calls on them first, adding
        up to no more than ``limit`` GPUs."""
        if self._clearable is None:
            self._clearable = []
            for order, each in enumerate(self.snapshot.nodes):
                runs = self._by_node.get(each.node_id, [])
                if each.gpus and all(self._victim_ok(r) for r in runs):
                    self._clearable.append((len(runs), order, each, runs))
            self._clearable.sort(key=lambda o: o[:2])
        released: Released = {}
        found = Reclaim([])
        total = 0
        for _, _, option, runs in self._clearable:
            node = self._node(option.node_id, call, whole=True)
            if node is None or any(r.id in self.chosen for r in runs):
                continue
            if total + len(node.gpus) > limit:
                continue  # the gang would take its group past its ceiling
            after = dict(released)
            taken = {r.id for r in found.victims}  # (a gang on nodes cleared already)
            for run in runs:
                if run.id in taken:
                    continue
                if run.group == call.group or not self._pickable(run, after):
                    break  # clearing this node would eat into a guarantee
                self.book.count_release(after, run)
            else:
                released = after
                found.node_ids.append(node.node_id)
                found.victims.extend(r for r in runs if r.id not in taken)
                total += len(node.gpus)
                if total >= call.gpus:
                    return found
        return None


def _walk_key(run: Running) -> tuple[bool, float]:
    """The order of a shared GPU's calls: those placed borrowed first, youngest first."""
    return (not run.borrowed, -run.start_time)


def starved(run: Running, after_s: float | None) -> bool:
    """Whether ``run`` waited ``after_s`` or longer in the queue before this start. Unknown
    wait: no."""
    if after_s is None or run.queued_time is None:
        return False
    return run.start_time - run.queued_time >= after_s


class WholeSizes:
    """The GPUs of the largest live node of each kind (model, memory; None for a node mixing
    models): a call of as many GPUs on a node of that kind is a whole-node call, the
    starvation guard's kind. Worked out when first asked (one per round, shared by the
    round's steps); kinds are looked at only if some node is smaller than the largest."""

    def __init__(self, nodes: Iterable[NodeCapacity]) -> None:
        self._all = nodes
        self._nodes: list[NodeCapacity] | None = None
        self._largest = 0
        self._by_kind: dict[tuple[str | None, int] | None, int] | None = None
        self._smallest: int | None = None

    def smallest(self) -> int:
        """The GPUs of the smallest node with a known inventory, draining or not (0: none):
        a run holding fewer on its first node is not a whole-node call."""
        if self._smallest is None:
            self._smallest = min((len(n.gpus) for n in self._all if n.gpus), default=0)
        return self._smallest

    def whole(self, node: NodeCapacity, size: int) -> bool:
        """Whether ``size`` GPUs on ``node`` are as many as the largest node of its kind."""
        if self._nodes is None:
            self._nodes = [n for n in self._all if not n.draining and n.gpus]
            self._largest = max((len(n.gpus) for n in self._nodes), default=0)
        if size >= self._largest:
            return True
        if self._by_kind is None:
            self._by_kind = {}
            for other in self._nodes:
                shape = kind(other)
                self._by_kind[shape] = max(self._by_kind.get(shape, 0), len(other.gpus))
        shape = kind(node)
        return shape is None or size >= self._by_kind.get(shape, 0)


def starved_whole(
    run: Running,
    after_s: float | None,
    nodes: Mapping[int, NodeCapacity],
    sizes: WholeSizes | None = None,
) -> bool:
    """Whether ``run`` is one of the starvation guard's kind of call, running after a wait
    of ``after_s`` or longer: a whole-node call (it holds every GPU of each of its nodes:
    whole nodes for a gang, else a node as big as the largest of its kind). A smaller call
    that waited as long is not (nor one that happens to fill a node smaller than others of
    its kind). ``sizes``: the nodes' :class:`WholeSizes` (worked out if not given)."""
    if not starved(run, after_s):  # (the cheap tests first: this runs per running call)
        return False
    if sizes is not None and len(run.gpu_indices) < sizes.smallest():
        return False  # (fewer GPUs on its first node than any node has)
    size = run.whole_size(nodes)
    if not size or run.more:
        return size > 0
    if sizes is None:
        sizes = WholeSizes(nodes.values())
    return sizes.whole(nodes[run.node_id], size)


def protected(
    run: Running,
    after_s: float | None,
    nodes: Mapping[int, NodeCapacity],
    sizes: WholeSizes | None = None,
) -> bool:
    """Whether reclaim leaves ``run`` alone: a gang on whole nodes (several of them) that
    waited ``after_s`` or longer before this start, the starvation guard's hardest call to
    place again. Least attained service and fair share among borrowers leave every
    :func:`starved_whole` run alone. A whole-node call on one node that waited as long may
    be reclaimed since session 20: on an overloaded cluster every whole-node call waits past
    the bound, and keeping them all from reclaim left much of the cluster out of reach of
    guarantees (the Philly trace at 64 x 8: docs/benchmarks.md, session 20); if sent back it
    queues again, and the guard serves it again on one node. Before session 17 every call
    that waited that long was kept in place, which left guarantees unenforceable. ``sizes``
    as for :func:`starved_whole`."""
    return bool(run.more) and starved_whole(run, after_s, nodes, sizes)
