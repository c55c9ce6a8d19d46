"""A round's working copy of free capacity, indexed so each placement costs next to nothing.

Only nodes with something free are indexed. Homogeneous nodes (one GPU model and memory size)
sit in a pool per (model, memory, size), bucketed by their free-GPU count, so best fit is the
first non-empty bucket at or above the call's size; nodes mixing GPU kinds are scanned with the
plain filters of :mod:`scheduler.placement`. Buckets are split again by how many free GPUs
share one NVLink group, so the connected-first rank is a lookup too; nodes with a warm worker
for the call are looked up directly. Capacity only shrinks during a round, so the smallest call
that failed to fit is remembered and larger ones of the same kind fail at once.

A call that asks for part of a GPU (``Pending.share``) goes on a GPU already shared if one has
room for it (the fullest that does: shares are packed), among one user's calls unless the
round allows sharing across users; else it takes a whole free GPU as a one-GPU call would,
and that GPU is shared from then on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence

from scheduler import placement
from scheduler.model import EPSILON, Gpu, NodeCapacity, Part, Pending

Choice = tuple["NodeState", tuple[int, ...]]
ConstraintKey = tuple[str | None, int]
FailKey = tuple[str | None, int, bool]


class NodeState:
    """One indexed node: its free GPUs (sorted) and CPU slots as the round goes on.

    ``conn`` is how many of its free GPUs one call could get inside a single NVLink group
    (all of them when the topology is unknown)."""

    __slots__ = ("conn", "cpu", "free", "links", "node", "order", "pool", "withdrawn")

    def __init__(self, node: NodeCapacity, order: int, pool: Pool | None) -> None:
        self.node = node
        self.order = order
        self.free = sorted(node.free_gpus)
        self.cpu = node.free_cpu_slots
        self.pool = pool
        self.withdrawn = False
        self.links: dict[int, int] | None = placement.inventory(node.gpus).links
        self.conn = 0

    def connected(self) -> int:
        if self.links is None:
            return len(self.free)
        counts: dict[int, int] = {}
        for g in self.free:
            k = self.links.get(g)
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        return max(max(counts.values(), default=0), min(1, len(self.free)))


class Pool:
    """Nodes of one kind by free GPUs: ``buckets[k][c]`` holds the nodes with ``k`` free, of
    which at most ``c`` share one NVLink group."""

    __slots__ = ("buckets", "many", "memory", "model", "size", "topology")

    def __init__(self, model: str | None, memory: int, size: int, many: int = 0) -> None:
        self.model = model  # casefolded; None: inventory unknown
        self.memory = memory
        self.size = size  # 0: unknown
        self.many = many  # GPUs of this model in the cluster (placement.plenty)
        self.topology = False
        self.buckets: list[list[dict[int, NodeState]]] = []  # (grown as nodes come)

    def _grow(self, k: int) -> None:
        while len(self.buckets) <= k:
            self.buckets.append([{} for _ in range(len(self.buckets) + 1)])

    def matches(self, call: Pending) -> bool:
        if not placement.constrained(call):
            return True
        if self.model is None:
            return False
        if not placement.model_ok(self.model, call.gpu_model):
            return False
        return self.memory >= call.min_memory_mib

    def add(self, state: NodeState) -> None:
        k = len(state.free)
        state.conn = state.connected()
        if state.links is not None:
            self.topology = True
        if k:
            self._grow(k)
            self.buckets[k][state.conn][state.node.node_id] = state

    def remove(self, state: NodeState) -> None:
        k = len(state.free)
        if k:
            del self.buckets[k][state.conn][state.node.node_id]

    def best(self, n: int, warm: list[NodeState]) -> tuple[placement.RankKey, NodeState] | None:
        """Best fit for ``n`` GPUs here: connected first, then fewest free, then warm."""
        fallback: tuple[placement.RankKey, NodeState] | None = None
        for k in range(n, len(self.buckets)):
            row = self.buckets[k]
            for c in range(n, k + 1) if self.topology else (k,):
                if row[c]:
                    return self._pick((0, k), row, range(n, k + 1), warm)
            if fallback is None and any(row[:n]):
                fallback = self._pick((1, k), row, range(n), warm)
        return fallback

    def _pick(
        self,
        rank: tuple[int, int],
        row: list[dict[int, NodeState]],
        conns: range,
        warm: list[NodeState],
    ) -> tuple[placement.RankKey, NodeState]:
        for state in warm:
            ok = state.pool is self and not state.withdrawn and state.conn in conns
            if ok and len(state.free) == rank[1]:
                return (rank[0], -self.many, rank[1], 0, state.order), state
        state = next(iter(next(d for d in (row[c] for c in conns) if d).values()))
        return (rank[0], -self.many, rank[1], 1, state.order), state


class Slot:
    """A shared GPU: what is left of it and whose calls hold it."""

    __slots__ = ("gpu", "index", "left", "node", "order", "users")

    def __init__(
        self, node: NodeCapacity, order: int, index: int, left: float, users: Iterable[str]
    ) -> None:
        self.node = node
        self.order = order
        self.index = index
        self.left = left
        self.users = set(users)
        self.gpu: Gpu | None = next((g for g in node.gpus if g.index == index), None)

    def takes(self, call: Pending, across: bool) -> bool:
        """Whether the call's share fits here (model, memory, room, owners)."""
        if self.left + EPSILON < call.share:
            return False
        if not across and self.users and self.users != {call.user}:
            return False
        if not placement.constrained(call):
            return True
        return self.gpu is not None and placement.gpu_ok(self.gpu, call)


def plain_call(call: Pending) -> bool:
    return call.gpu_model is None and call.min_memory_mib <= 0


def kind(node: NodeCapacity) -> tuple[str | None, int] | None:
    """(model, memory) of a homogeneous node, (None, 0) if unknown, None if mixed."""
    return placement.inventory(node.gpus).kind


class Capacity:
    """Free GPUs and CPU slots of the usable nodes, shrinking as a round places calls."""

    def __init__(self, nodes: Sequence[NodeCapacity], share_across_users: bool = False) -> None:
        self.nodes = nodes
        self.across = share_across_users
        #: Shared GPUs of the usable nodes (see the module's doc).
        self.slots: list[Slot] = []
        #: Per kind of share (its user unless shared across users, model, memory), the least
        #: that found no room: shared GPUs' room only shrinks, and a new one is opened only
        #: on a free GPU that such a share would have taken, so no larger one finds room.
        self._share_failed: dict[tuple[str | None, str | None, int], float] = {}
        self.states: dict[int, NodeState] = {}
        self.pools: dict[tuple[str | None, int, int], Pool] = {}
        self.mixed: list[NodeState] = []
        self.cpu: dict[int, NodeState] = {}
        self.free_gpus = 0  # on indexed, not withdrawn nodes
        self.cpu_slots = 0
        self.largest = 0  # the largest usable node, free or not
        self.warm: dict[tuple[str, str], list[NodeState]] = {}
        self._largest: dict[ConstraintKey, int] = {}
        self._shaped: list[tuple[NodeCapacity, placement.Shape | None]] | None = None
        self._failed: dict[FailKey, int] = {}
        #: Every node withdrawn this round, busy ones (no state) included.
        self.withdrawn: set[int] = set()
        #: GPUs per model (placement.plenty), counted only where models differ.
        self.many: dict[str, int] = {}
        largest = 0
        for order, node in enumerate(nodes):
            if node.draining:
                continue
            size = len(node.gpus) or len(node.free_gpus)
            if size > largest:
                largest = size
            if node.free_gpus or node.free_cpu_slots > 0:
                self._index(node, order)
            if node.shared:
                for shared in node.shared:
                    if shared.left > EPSILON:
                        slot = Slot(node, order, shared.index, shared.left, shared.users)
                        self.slots.append(slot)
        self.largest = largest
        if self.mixed or len({pool.model for pool in self.pools.values()}) > 1:
            self.many = placement.plenty(nodes)
            for pool in self.pools.values():
                pool.many = self.many.get(pool.model or "", 0)

    def _index(self, node: NodeCapacity, order: int) -> None:
        shape = kind(node)
        pool = None
        if shape is not None:
            key = (shape[0], shape[1], len(node.gpus))
            pool = self.pools.get(key)
            if pool is None:
                pool = self.pools[key] = Pool(*key)
        state = NodeState(node, order, pool)
        self.states[node.node_id] = state
        if pool is None:
            self.mixed.append(state)
        else:
            pool.add(state)
        self.free_gpus += len(state.free)
        if state.cpu > 0:
            self.cpu[node.node_id] = state
            self.cpu_slots += state.cpu
        for pair in node.warm:
            self.warm.setdefault(pair, []).append(state)

    # ------------------------------------------------------------------ queries

    def exhausted(self) -> bool:
        return self.free_gpus == 0 and self.cpu_slots == 0 and not self.slots

    def free_of(self, node_id: int) -> list[int]:
        """Free GPUs of a node right now (withdrawn or not)."""
        state = self.states.get(node_id)
        return state.free if state is not None else []

    def largest_for(self, call: Pending) -> int:
        """GPUs of the largest usable node that qualify for the call, free or not."""
        if not placement.constrained(call):
            return self.largest
        key = (call.gpu_model, call.min_memory_mib)
        if key not in self._largest:
            if self._shaped is None:  # (each shape of node is looked at once per call kind)
                self._shaped = [(n, placement.shape(n)) for n in self.nodes if not n.draining]
            self._largest[key] = placement.largest_by_shape(self._shaped, call)
        return self._largest[key]

    def most_free(self, call: Pending) -> int:
        """The most qualifying free GPUs on one indexed node (for explanations)."""
        return max((len(placement.usable(s.node, s.free, call)) for s in self._live()), default=0)

    def whole_free(self, call: Pending) -> list[NodeState]:
        """Indexed nodes that are entirely free and may be whole nodes of the call's gang."""
        return [
            s
            for s in self._live()
            if s.node.gpus
            and len(s.free) == len(s.node.gpus)
            and placement.whole_node_ok(s.node, call)
        ]

    def _live(self) -> Iterable[NodeState]:
        return (s for s in self.states.values() if not s.withdrawn)

    def hopeless(self, call: Pending) -> bool:
        """Whether :meth:`place` is sure to find no room for the call, by what has failed
        this round already (it would then change nothing): room only shrinks in a round."""
        n = call.gpus
        if call.share != 1.0:
            kind = (None if self.across else call.user, call.gpu_model, call.min_memory_mib)
            return call.share >= self._share_failed.get(kind, math.inf)
        if n == 0:
            return not self.cpu
        if n > self.free_gpus:
            return True
        whole = n > (self.largest if plain_call(call) else self.largest_for(call))
        return n >= self._failed.get((call.gpu_model, call.min_memory_mib, whole), n + 1)

    # ------------------------------------------------------------------ placement

    def place(self, call: Pending, limit: float = math.inf) -> tuple[Part, ...] | None:
        """Find room for the whole call and take it; None if it does not fit now, or if it
        would take more than ``limit`` GPUs (a gang on whole nodes takes all their GPUs, which
        may be more than it asks for: see :meth:`find_whole`)."""
        n = call.gpus
        if call.share != 1.0:
            return self._place_share(call, limit)
        if n == 0:
            state = self._find_cpu(call)
            if state is None:
                return None
            self.take_cpu(state)
            return (Part(state.node.node_id, ()),)
        whole = n > (self.largest if plain_call(call) else self.largest_for(call))
        key = (call.gpu_model, call.min_memory_mib, whole)
        if n > limit or n > self.free_gpus or n >= self._failed.get(key, n + 1):
            return None
        if not whole:
            choice = self.find(call)
            choices = [choice] if choice is not None else None
        else:
            choices = self.find_whole(call)
        if choices is None:
            self._failed[key] = n
            return None
        if sum(len(gpus) for _, gpus in choices) > limit:
            return None  # fits, but not within the limit (another call's may be higher)
        for state, gpus in choices:
            self.take(state, gpus)
        return tuple(Part(s.node.node_id, gpus) for s, gpus in choices)

    def _place_share(self, call: Pending, limit: float) -> tuple[Part, ...] | None:
        """A share of one GPU: on the fullest shared GPU with room for it, else on a whole
        free GPU (which is shared from then on)."""
        if call.share > limit + EPSILON:
            return None
        kind = (None if self.across else call.user, call.gpu_model, call.min_memory_mib)
        if call.share >= self._share_failed.get(kind, math.inf):
            return None
        best: tuple[tuple[float, bool, int, int], Slot] | None = None
        warm = {s.node.node_id for s in self.warm_nodes(call)}
        for slot in self.slots:
            if slot.node.node_id in self.withdrawn or not slot.takes(call, self.across):
                continue
            key = (slot.left, slot.node.node_id not in warm, slot.order, slot.index)
            if best is None or key < best[0]:
                best = (key, slot)
        if best is not None:
            slot = best[1]
            self.take_share(slot, call)
            return (Part(slot.node.node_id, (slot.index,)),)
        parts = self.place(dataclasses.replace(call, share=1.0))
        if parts is None:
            self._share_failed[kind] = min(call.share, self._share_failed.get(kind, math.inf))
            return None
        node = self.states[parts[0].node_id]
        slot = Slot(node.node, node.order, parts[0].gpu_indices[0], 1.0, ())
        self.slots.append(slot)
        self.take_share(slot, call)
        return parts

    def take_share(self, slot: Slot, call: Pending) -> None:
        slot.left -= call.share
        slot.users.add(call.user)
        if slot.left <= EPSILON:
            self.slots.remove(slot)

    def find(self, call: Pending) -> Choice | None:
        """The best node for a single-node call (see :mod:`scheduler.placement`), or None."""
        n = call.gpus
        warm = self.warm_nodes(call)
        best: tuple[placement.RankKey, NodeState] | None = None
        for pool in self.pools.values():
            if pool.matches(call):
                found = pool.best(n, warm)
                if found is not None and (best is None or found[0] < best[0]):
                    best = found
        for state in self.mixed:
            if state.withdrawn:
                continue
            free = placement.usable(state.node, state.free, call)
            if len(free) >= n:
                many = placement.node_plenty(state.node, self.many)
                key = placement.rank_key(state.node, free, call, state.order, many)
                if best is None or key < best[0]:
                    best = (key, state)
        if best is None:
            return None
        state = best[1]
        free = (
            state.free if state.pool is not None else placement.usable(state.node, state.free, call)
        )
        return state, placement.choose(state.node, free, n)[0]

    def find_whole(self, call: Pending) -> list[Choice] | None:
        """Whole free nodes for a gang: the fewest GPUs at or above the call's, then the
        fewest nodes, largest first (:func:`scheduler.placement.fewest_whole`); None if too
        few. Several sets may hold the call: 12 GPUs fit on two free 8-GPU nodes (16) or on
        an 8 and a 4 (12), and the gang takes every GPU of its nodes, so the second is what
        it gets: no GPU is held idle, and its group is charged no more than needed. Among
        nodes of one size, those of the most plentiful model go first (as for a call on one
        node: the scarce ones stay free for the calls that need them)."""
        many = self.many

        def key(s: NodeState) -> tuple[int, int, int]:
            return (-len(s.free), -placement.node_plenty(s.node, many) if many else 0, s.order)

        nodes = sorted(self.whole_free(call), key=key)
        picked = placement.fewest_whole([len(s.free) for s in nodes], call.gpus)
        if picked is None:
            return None
        return [(nodes[i], tuple(nodes[i].free)) for i in picked]

    def whole_gpus(self, call: Pending) -> int | None:
        """GPUs the gang would take on the whole nodes free now; None if they are too few."""
        choices = self.find_whole(call)
        return None if choices is None else sum(len(gpus) for _, gpus in choices)

    def warm_nodes(self, call: Pending) -> list[NodeState]:
        if not call.function or not self.warm:
            return []
        return self.warm.get((call.user, call.function), [])

    def _find_cpu(self, call: Pending) -> NodeState | None:
        for state in self.warm_nodes(call):
            if state.cpu > 0:
                return state
        return next(iter(self.cpu.values()), None)

    def take(self, state: NodeState, gpus: tuple[int, ...]) -> None:
        """Mark the GPUs used (they must be free on the node)."""
        if not state.withdrawn:
            if state.pool is not None:
                state.pool.remove(state)
            self.free_gpus -= len(gpus)
        taken = set(gpus)
        state.free = [g for g in state.free if g not in taken]
        if state.pool is not None and not state.withdrawn:
            state.pool.add(state)

    def take_cpu(self, state: NodeState) -> None:
        state.cpu -= 1
        self.cpu_slots -= 1
        if state.cpu <= 0:
            self.cpu.pop(state.node.node_id, None)

    def withdraw(self, node_id: int) -> NodeState | None:
        """Hide a node's free GPUs from :meth:`place` (it is reserved), free GPUs or not;
        returns its state."""
        self.withdrawn.add(node_id)
        state = self.states.get(node_id)
        if state is None or state.withdrawn:
            return state
        if state.pool is not None:
            state.pool.remove(state)
        self.free_gpus -= len(state.free)
        state.withdrawn = True
        return state

    @contextlib.contextmanager
    def hiding(self, node_ids: Iterable[int]) -> Iterator[None]:
        """Withdraw these nodes while the block runs, and give them back after (what was
        placed meanwhile stays placed); what failed to fit meanwhile is forgotten, since it
        may fit once they are back."""
        hidden = [n for n in dict.fromkeys(node_ids) if n not in self.withdrawn]
        failed, share_failed = dict(self._failed), dict(self._share_failed)
        for node_id in hidden:
            self.withdraw(node_id)
        try:
            yield
        finally:
            for node_id in hidden:
                self.withdrawn.discard(node_id)
                state = self.states.get(node_id)
                if state is None or not state.withdrawn:
                    continue
                state.withdrawn = False
                self.free_gpus += len(state.free)
                if state.pool is not None:
                    state.pool.add(state)
            self._failed, self._share_failed = failed, share_failed
