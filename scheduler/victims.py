"""Victims for preemption by rank: the running calls a waiting call of a better class may
displace (the yardsticks of :mod:`scheduler.yardsticks`, and ``fair``'s least-attained-service
step, :mod:`scheduler.fair`).

A call that fits on one node frees GPUs there, the node where it preempts the fewest GPUs
(then the fewest calls); a gang frees whole nodes whose every running call ranks worse. Only
calls of a strictly worse class are taken, worst first (the latest started first among
equals); GPUs already on their way back count as free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from scheduler import placement
from scheduler.capacity import Capacity
from scheduler.model import NodeCapacity, Pending, Running, Standing
from scheduler.quotas import Released


class Victims:
    """The running calls a round may still preempt, by node, worst ranked first.

    Calls ask in rank order, so each asks with a class no better than the last one's: once a
    call of ``n`` GPUs found nothing, no later call of ``n`` or more can, and no call of a
    class at or below the worst running one's can either."""

    def __init__(
        self,
        nodes: Iterable[NodeCapacity],
        running: Iterable[Running],
        klass: Callable[[Running], float],
        may: Callable[[Running, Released], bool] | None = None,
        count: Callable[[Released, Running], None] | None = None,
        look: int | None = None,
        fits: placement.Fits | None = None,
        standing: Standing | None = None,
    ) -> None:
        #: Whether a run may still be taken, what this choice takes already considered (and
        #: how to count it): None, every run may.
        self.may, self.count = may, count
        #: A single-node call compares the first ``look`` nodes where preempting makes room
        #: (None: every node).
        self.look = look
        #: Per node: (class, start, id, call), sorted worst first when first looked at.
        self.by_node: dict[int, list[tuple[float, float, str, Running]]] = {}
        self.sorted: set[int] = set()
        #: The running calls by node in an order their class never decreases with, kept by
        #: the caller (then ``running`` is not read, and a node's calls are ranked only when
        #: it is looked at, its worst call's class read off its last): see :class:`Standing`.
        self.standing = standing
        self.klass = klass
        #: The calls this index chose (left out of the nodes ranked after).
        self.taken: set[str] = set()
        #: Per node looked at, the class of its worst call that may still be taken.
        self._tops: dict[int, float] = {}
        #: GPUs per node already on their way back (preempting, or chosen this round), by
        #: index (a call kept to some models counts only those it may use).
        self.leaving: dict[int, list[int]] = {}
        #: The nodes that may ever hold a kind of call (GPUs, model, memory), live nodes by
        #: id, and those that may be whole nodes of a gang: may be shared by the indexes of
        #: one round (made of the same nodes).
        self.fits = placement.fits_of(list(nodes)) if fits is None else fits
        #: Live nodes not yet freed for a call.
        self.nodes = dict(self.fits.by_id)
        #: The nodes the last choice freed for its call.
        self.freed: list[int] = []
        self.worst = -math.inf
        #: Per kind of asker (what ``may`` lets it take: see :meth:`free_for`) and the nodes it
        #: may use (model, memory), the fewest GPUs a call of that kind asked for and got
        #: nothing.
        self.failed: dict[object, float] = {}
        #: A call that may take whatever any later one may found nothing for one GPU.
        self.exhausted = False
        #: Per kind of call, the nodes of ``fits`` where some run of this index is.
        self._holding: dict[tuple[int, str | None, int], list[NodeCapacity]] = {}
        by_node = self.by_node
        if standing is not None:
            self.leaving = {n: list(gpus) for n, gpus in standing.leaving.items()}
            for held in standing.by_node.values():
                k = klass(held[-1][3])
                if k > self.worst:
                    self.worst = k
            return
        for run in running:
            if run.share != 1.0:
                continue  # (never a victim; its GPU is busy until all its sharers end)
            if run.preempting:
                for part in run.parts:
                    self._leave(part.node_id, part.gpu_indices)
            elif run.preemptible:
                k = klass(run)
                if k > self.worst:
                    self.worst = k
                entry = (k, run.start_time, run.id, run)
                if not run.more:  # (the common case, without a tuple of nodes: this is hot)
                    if run.node_id in by_node:
                        by_node[run.node_id].append(entry)
                    else:
                        by_node[run.node_id] = [entry]
                    continue
                for node_id in (run.node_id, *(p.node_id for p in run.more)):
                    if node_id in by_node:
                        by_node[node_id].append(entry)
                    else:
                        by_node[node_id] = [entry]

    def spent(self, klass: float) -> bool:
        """Whether no call of this class or after it can free anything by preempting."""
        return klass >= self.worst or self.exhausted

    def free_for(
        self,
        call: Pending,
        klass: float,
        cap: Capacity,
        alone: bool = False,
        asker: object = None,
        widest: bool = True,
    ) -> list[Running]:
        """Running calls to preempt so that ``call`` fits (none if it cannot be done). The
        nodes they free are withdrawn from ``cap`` for the rest of the round: what they free
        is the call's, not a later one's. ``alone``: the victims alone must free all the
        call asks for, on one node (it takes their GPUs only, no free ones). ``asker``: what
        ``may`` lets the call take (a failure says nothing of calls that may take other
        runs); ``widest``: it may take whatever any later call may."""
        if call.gpus <= 0 or klass >= self.worst:
            return []
        # (the nodes it may use, and whether on one of them: a failure on one node says
        # nothing of a gang of whole nodes)
        key = (asker, call.gpu_model, call.min_memory_mib, bool(self.fits(call)))
        if call.gpus >= self.failed.get(key, math.inf):
            return []
        chosen = self._free_for(call, klass, cap, alone)
        if not chosen and not alone:
            self.failed[key] = call.gpus
            if call.gpu_model is None and not call.min_memory_mib:
                self.exhausted = self.exhausted or (widest and call.gpus <= 1)
        return chosen

    def _free_for(self, call: Pending, klass: float, cap: Capacity, alone: bool) -> list[Running]:
        gone = cap.withdrawn  # (reserved or reclaimed since this index was made)
        best: tuple[tuple[int, int], int, list[Running]] | None = None
        kind = (call.gpus, call.gpu_model, call.min_memory_mib)
        fitting = self.fits(call)
        single, found = bool(fitting), 0  # (a call some node may hold is never a gang)
        kept_to = placement.constrained(call)  # (a model or memory: not every GPU will do)
        holding, tops, standing = self._holding.get(kind), self._tops, self.standing
        if holding is None:  # (the nodes where this index has runs, in the same order)
            by_node = self.by_node if standing is None else standing.by_node
            holding = self._holding[kind] = [n for n in fitting if n.node_id in by_node]
        for node in holding:
            if node.node_id in gone or node.node_id not in self.nodes:
                continue
            top = tops.get(node.node_id)
            if (self._top(node.node_id) if top is None else top) <= klass:
                continue  # (nothing there of a lower class than the call's)
            have = 0
            if not alone and not kept_to:
                have = len(cap.free_of(node.node_id)) + len(self.leaving.get(node.node_id, ()))
            elif not alone:  # (only the GPUs it may use count: on a node mixing models
                # the others are no room for it, and preempting for them would churn)
                back = self.leaving.get(node.node_id, [])
                have = len(placement.usable(node, [*cap.free_of(node.node_id), *back], call))
            runs: list[Running] = []
            taken: Released = {}
            # (worst first: those of a lower class than the call's)
            for k, _, _, run in self._worst_first(node.node_id):
                if k <= klass or have >= call.gpus:
                    break
                if not self._may(run, taken):
                    continue
                runs.append(run)
                have += _on_for(run, node, call) if kept_to else _on(run, node.node_id)
            if have >= call.gpus and runs:
                cost = _cost(runs)
                if best is None or cost < best[0]:
                    best = (cost, node.node_id, runs)
                    if cost == _LEAST:
                        break  # (no node can cost less: a later one never replaces it)
                found += 1
                if self.look is not None and found >= self.look:
                    break  # (enough nodes compared)
        if single:
            return [] if best is None else self._take(best[2], [best[1]], cap)
        if alone:
            return []
        # A gang: whole nodes whose every running call is of a lower class.
        whole: list[tuple[int, int, list[Running]]] = []
        took: Released = {}
        wholes = self.fits.wholes(call)
        for node in self.nodes.values():
            if node.node_id in gone or node.node_id not in wholes:
                continue
            runs = self._lower(node.node_id, klass)
            busy = node.size - len(cap.free_of(node.node_id))
            busy -= len(self.leaving.get(node.node_id, ()))
            if sum(_on(r, node.node_id) for r in runs) < busy:
                continue  # (a run of its class or better holds the node)
            if self.may is not None:
                mark = dict(took)
                if not all(self._may(r, mark) for r in runs):
                    continue  # (a run it may not take holds the node)
            whole.append((busy, node.node_id, runs))
        whole.sort(key=lambda w: (w[0], w[1]))
        got, nodes, chosen = 0, [], []
        for _, node_id, runs in whole:
            if got >= call.gpus:
                break
            fresh = [r for r in runs if r not in chosen]
            if self.may is not None and not all(self._may(r, took) for r in fresh):
                continue
            got += self.nodes[node_id].size
            nodes.append(node_id)
            chosen += fresh
        if got < call.gpus or not chosen:
            return []
        return self._take(chosen, nodes, cap)

    def _lower(self, node: int, klass: float) -> list[Running]:
        out = []
        for k, _, _, run in self._worst_first(node):
            if k <= klass:
                break
            out.append(run)
        return out

    def _worst_first(self, node: int) -> Iterator[tuple[float, float, str, Running]]:
        """The node's calls that may still be taken, worst first: off the standing, ranked
        only as far as they are read, until the node is ranked whole (:meth:`_held`)."""
        if self.standing is None or node in self.by_node:
            return iter(self._held(node))
        return self._off_standing(self.standing.by_node.get(node, []))

    def _off_standing(
        self, index: list[tuple[float, float, str, Running]]
    ) -> Iterator[tuple[float, float, str, Running]]:
        """A node's calls on the standing (``index``) that may still be taken, worst first,
        as a sort by (class, start, id) would give them: the standing's order reversed, each
        run of calls of one class (adjacent there: a class never decreases with the key)
        sorted."""
        klass, taken = self.klass, self.taken
        i = len(index) - 1
        while i >= 0:
            e = index[i]
            i -= 1
            if e[2] in taken:
                continue
            k = klass(e[3])
            tied = [(k, e[1], e[2], e[3])]
            while i >= 0:
                e = index[i]
                if e[2] in taken:
                    i -= 1
                    continue
                if klass(e[3]) != k:
                    break
                tied.append((k, e[1], e[2], e[3]))
                i -= 1
            if len(tied) > 1:
                tied.sort(reverse=True)
            yield from tied

    def _held(self, node: int) -> list[tuple[float, float, str, Running]]:
        """The node's calls that may still be taken, worst first, ranked whole (kept for
        the round)."""
        held = self.by_node.get(node)
        if held is None:
            if self.standing is None:
                return []
            index = self.standing.by_node.get(node, [])
            held = self.by_node[node] = list(self._off_standing(index))
            self.sorted.add(node)
        elif node not in self.sorted:
            held.sort(reverse=True)
            self.sorted.add(node)
        return held

    def _top(self, node: int) -> float:
        """The worst class among the node's calls that may still be taken (-inf: none),
        kept until a call is taken there."""
        index = None if self.standing is None else self.standing.by_node.get(node)
        if node not in self.by_node and index and index[-1][2] not in self.taken:
            top = self.klass(index[-1][3])  # (the worst: its class is the node's)
        else:
            held = self._held(node)
            top = held[0][0] if held else -math.inf
        self._tops[node] = top
        return top

    def _may(self, run: Running, taken: Released) -> bool:
        """Whether ``run`` may be taken besides ``taken`` (then counted in it)."""
        if self.may is None:
            return True
        if not self.may(run, taken):
            return False
        if self.count is not None:
            self.count(taken, run)
        return True

    def _leave(self, node: int, gpus: tuple[int, ...]) -> None:
        self.leaving.setdefault(node, []).extend(gpus)

    def _take(self, runs: list[Running], nodes: list[int], cap: Capacity) -> list[Running]:
        for run in runs:
            self.taken.add(run.id)
            for part in run.parts:
                self._tops.pop(part.node_id, None)
                self._leave(part.node_id, part.gpu_indices)
                held = self.by_node.get(part.node_id)
                if held is not None:  # (else left out when ranked)
                    held[:] = [e for e in held if e[3] is not run]
        for node_id in nodes:
            cap.withdraw(node_id)
            self.nodes.pop(node_id)
        self.freed = nodes
        return runs


def _on(run: Running, node: int) -> int:
    if not run.more:  # (the common case, without building the parts: this is hot)
        return len(run.gpu_indices) if run.node_id == node else 0
    return sum(len(p.gpu_indices) for p in run.parts if p.node_id == node)


def _on_for(run: Running, node: NodeCapacity, call: Pending) -> int:
    """The GPUs ``run`` holds on ``node`` that ``call`` may use."""
    mine = {i for part in run.parts if part.node_id == node.node_id for i in part.gpu_indices}
    return sum(1 for g in node.gpus if g.index in mine and placement.gpu_ok(g, call))


#: The least a choice can cost: one run of one GPU.
_LEAST = (1, 1)


def _cost(runs: list[Running]) -> tuple[int, int]:
    return (sum(r.gpus for r in runs), len(runs))
