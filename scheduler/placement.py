"""Gang placement on one node: the filter and rank steps, each usable on a static node list.

A call's GPUs all come from one node. Filters: the node is not draining; a GPU qualifies when
its model name contains the call's model (case-insensitive: NVML's "NVIDIA A100-SXM4-80GB"
matches "A100"), or one of its models when it names several (``A100|H100``: each GPU is one of
them, so a node mixing both may give a call some of each), and it has at least the call's
memory. A node whose
inventory is unknown qualifies only for unconstrained calls. Rank, best first:

1. connected: all the call's GPUs in one NVLink group (nodes without topology count as
   connected, there is nothing to prefer);
2. plenty: GPUs of the node's model, cluster-wide (a node mixing models counts as its
   scarcest), the most first, so that a call any model will do for leaves a scarce model to
   the calls that need it;
3. best fit: the fewest qualifying free GPUs, so big holes stay whole for big calls;
4. warm: a worker for the call's (user, function) is already warm there;
5. the node's place in the snapshot.

:func:`rank` is the plain reference; :class:`scheduler.capacity.Capacity` is the indexed
version a round uses, and the tests hold one against the other.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from scheduler.model import Gpu, NodeCapacity, Pending

RankKey = tuple[int, int, int, int, int]
#: (model, memory, GPUs) of a node whose GPUs are all alike (see :func:`shape`).
Shape = tuple[str, int, int]


def constrained(call: Pending) -> bool:
    return call.gpu_model is not None or call.min_memory_mib > 0


@functools.lru_cache(maxsize=4096)  # (few names and wishes, asked per GPU per call: hot)
def model_ok(model: str, wanted: str | None) -> bool:
    """Whether a GPU model name satisfies a call's ``gpu_model``: a case-insensitive part of
    it, or of one of several separated by ``|`` (any of them); None: any."""
    if wanted is None:
        return True
    name = model.casefold()
    return any(part in name for part in alternatives(wanted))


@functools.lru_cache(maxsize=256)
def alternatives(wanted: str) -> tuple[str, ...]:
    """The models a ``gpu_model`` accepts, casefolded."""
    return tuple(part.casefold() for part in wanted.split("|"))


def model_words(wanted: str) -> str:
    """``A100``; ``A100 or H100``; ``A100, H100 or L40S``."""
    parts = wanted.split("|")
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def gpu_ok(gpu: Gpu, call: Pending) -> bool:
    """The GPU filter: model and memory."""
    return model_ok(gpu.model, call.gpu_model) and gpu.memory_mib >= call.min_memory_mib


def qualifying(node: NodeCapacity, call: Pending) -> int:
    """How many of ``node``'s GPUs the call may use, busy or not (draining or not)."""
    if not constrained(call):
        return node.size
    return sum(gpu_ok(g, call) for g in node.gpus)


def largest_for(nodes: Iterable[NodeCapacity], call: Pending) -> int:
    """The most GPUs one node that takes work has for ``call``, busy or not: the biggest call
    of its kind that can run on one node."""
    return max((qualifying(n, call) for n in nodes if not n.draining), default=0)


def largest_by_shape(shaped: Iterable[tuple[NodeCapacity, Shape | None]], call: Pending) -> int:
    """:func:`largest_for` over nodes given with their :func:`shape` (draining ones left
    out), each shape counted once."""
    best, seen = 0, set()
    for node, form in shaped:
        if form is not None:
            if form in seen:
                continue
            seen.add(form)
        best = max(best, qualifying(node, call))
    return best


def usable(node: NodeCapacity, free: Iterable[int], call: Pending) -> list[int]:
    """The free GPUs of ``node`` that the call may use, sorted; none on a draining node."""
    if node.draining:
        return []
    if not constrained(call):
        return sorted(free)
    by_index = inventory(node.gpus).by_index
    return sorted(i for i in free if i in by_index and gpu_ok(by_index[i], call))


def choose(node: NodeCapacity, free: Sequence[int], n: int) -> tuple[tuple[int, ...], bool]:
    """Pick ``n`` of the sorted ``free`` GPUs; also say whether they share one NVLink group.

    Best fit inside the node too: the smallest NVLink group that holds all ``n``; failing that,
    the fewest groups, largest first. Without topology: the lowest indices.
    """
    links = inventory(node.gpus).links
    if not links or n <= 1:
        return tuple(free[:n]), True
    groups: dict[int | None, list[int]] = defaultdict(list)
    for i in free:
        groups[links.get(i)].append(i)
    fitting = [g for k, g in groups.items() if k is not None and len(g) >= n]
    if fitting:
        return tuple(min(fitting, key=len)[:n]), True
    chosen: list[int] = []
    for g in sorted(groups.values(), key=len, reverse=True):
        chosen.extend(g[: n - len(chosen)])
    return tuple(sorted(chosen[:n])), False


def warm(node: NodeCapacity, call: Pending) -> bool:
    return bool(call.function) and (call.user, call.function) in node.warm


def rank_key(
    node: NodeCapacity, free: Sequence[int], call: Pending, order: int, many: int = 0
) -> RankKey:
    """Smaller is better; ``free`` are the node's usable free GPUs (at least ``call.gpus``),
    ``many`` its :func:`node_plenty`."""
    _, connected = choose(node, free, call.gpus)
    return (not connected, -many, len(free), not warm(node, call), order)


def plenty(nodes: Iterable[NodeCapacity]) -> dict[str, int]:
    """GPUs of each model (casefolded; ``""`` for nodes of unknown inventory, counted by their
    free GPUs) on the nodes that are not draining, free or busy."""
    count: dict[str, int] = defaultdict(int)
    for node in nodes:
        if node.draining:
            continue
        if not node.gpus:
            count[""] += len(node.free_gpus)
            continue
        for model, n in inventory(node.gpus).models:
            count[model] += n
    out: dict[str, int] = defaultdict(int)
    for model, n in count.items():
        out[model.casefold()] += n
    return out


def node_plenty(node: NodeCapacity, many: dict[str, int]) -> int:
    """How plentiful the node's model is: its scarcest model's count in ``many``."""
    if not node.gpus:
        return many.get("", 0)
    return min(many.get(g.model.casefold(), 0) for g in node.gpus)


def rank(nodes: Sequence[NodeCapacity], call: Pending) -> list[NodeCapacity]:
    """The nodes that can take the single-node GPU call now, best first (the reference)."""
    keyed = []
    many = plenty(nodes)
    for order, node in enumerate(nodes):
        free = usable(node, node.free_gpus, call)
        if len(free) >= call.gpus:
            keyed.append((rank_key(node, free, call, order, node_plenty(node, many)), node))
    keyed.sort(key=lambda kn: kn[0])
    return [node for _, node in keyed]


def node_fits_ever(node: NodeCapacity, call: Pending) -> bool:
    """Whether the node could ever hold the whole single-node call (draining aside)."""
    if not constrained(call):
        return node.size >= call.gpus
    return sum(gpu_ok(g, call) for g in node.gpus) >= call.gpus


class Fits:
    """The nodes that may ever hold each kind of single-node call (:func:`node_fits_ever`),
    draining ones aside, in their order; each shape of node (one model and memory size for
    all its GPUs, and their number) is judged once per kind, not each node."""

    def __init__(self, nodes: Iterable[NodeCapacity]) -> None:
        self.nodes = [n for n in nodes if not n.draining]
        #: The same nodes by id.
        self.by_id = {n.node_id: n for n in self.nodes}
        self._kinds: dict[tuple[int, str | None, int], list[NodeCapacity]] = {}
        self._wholes: dict[tuple[str | None, int], set[int]] = {}

    def __call__(self, call: Pending) -> list[NodeCapacity]:
        kind = (call.gpus, call.gpu_model, call.min_memory_mib)
        found = self._kinds.get(kind)
        if found is not None:
            return found
        if not constrained(call):
            found = [n for n in self.nodes if n.size >= call.gpus]
        else:
            found = _by_shape(self.nodes, lambda node: node_fits_ever(node, call))
        self._kinds[kind] = found
        return found

    def wholes(self, call: Pending) -> set[int]:
        """The ids of the nodes that may be whole nodes of the call's gang."""
        key = (call.gpu_model, call.min_memory_mib)
        found = self._wholes.get(key)
        if found is None:
            if not constrained(call):  # (every GPU qualifies)
                found = {n.node_id for n in self.nodes if n.gpus}
            else:
                ok = _by_shape(self.nodes, lambda node: whole_node_ok(node, call))
                found = {n.node_id for n in ok}
            self._wholes[key] = found
        return found


#: The last :class:`Fits` made by :func:`fits_of`, with what it was made of.
_last_fits: tuple[list[tuple[NodeCapacity, bool, tuple[Gpu, ...], int]], Fits] | None = None


def fits_of(nodes: Sequence[NodeCapacity]) -> Fits:
    """A :class:`Fits` of ``nodes``: the last one made, while the same nodes are as they were
    then (draining or not, inventory, size), so its verdicts per kind of call carry from one
    round to the next (a replay's nodes stay, the gateway keeps unchanged inventories); read
    it, never change it."""
    global _last_fits
    # (the nodes themselves, compared first by identity: equal fields are as good; their
    # inventory tuples are kept alive in here with them)
    key = [(n, n.draining, n.gpus, 0 if n.gpus else len(n.free_gpus)) for n in nodes]
    if _last_fits is not None and _last_fits[0] == key:
        return _last_fits[1]
    made = Fits(nodes)
    _last_fits = (key, made)
    return made


def _by_shape(
    nodes: Iterable[NodeCapacity], test: Callable[[NodeCapacity], bool]
) -> list[NodeCapacity]:
    """The nodes that pass ``test``, in order; a test that depends only on a node's GPUs, so
    each :func:`shape` of node is judged once (nodes of mixed or unknown GPUs each)."""
    verdicts: dict[Shape, bool] = {}
    found = []
    for node in nodes:
        form = inventory(node.gpus).shape
        ok = verdicts.get(form) if form is not None else None
        if ok is None:
            ok = test(node)
            if form is not None:
                verdicts[form] = ok
        if ok:
            found.append(node)
    return found


def shape(node: NodeCapacity) -> Shape | None:
    """(model, memory, GPUs) of a node whose GPUs are all alike; None if they differ or are
    unknown."""
    return inventory(node.gpus).shape


class Inventory:
    """What a round reads of a node's GPU inventory, worked out once per inventory (see
    :func:`inventory`): read it, never change it."""

    __slots__ = ("by_index", "kind", "links", "models", "shape")

    def __init__(self, gpus: tuple[Gpu, ...]) -> None:
        #: (model, memory, GPUs) when all its GPUs are alike (:func:`shape`), else None.
        self.shape: Shape | None = None
        #: (model casefolded, memory) when all alike, (None, 0) if unknown, None if mixed
        #: (:func:`scheduler.capacity.kind`).
        self.kind: tuple[str | None, int] | None = (None, 0)
        if gpus:
            first = gpus[0]
            alike = all(g.model == first.model and g.memory_mib == first.memory_mib
                        for g in gpus)  # fmt: skip
            self.shape = (first.model, first.memory_mib, len(gpus)) if alike else None
            folded = first.model.casefold()
            same = all(g.memory_mib == first.memory_mib and g.model.casefold() == folded
                       for g in gpus)  # fmt: skip
            self.kind = (folded, first.memory_mib) if same else None
        #: NVLink group by GPU index; None without topology.
        self.links: dict[int, int] | None = {
            g.index: g.nvlink for g in gpus if g.nvlink is not None
        } or None
        #: The GPUs by index.
        self.by_index: dict[int, Gpu] = {g.index: g for g in gpus}
        #: (model, how many GPUs of it), models as named.
        counts: dict[str, int] = {}
        for g in gpus:
            counts[g.model] = counts.get(g.model, 0) + 1
        self.models: tuple[tuple[str, int], ...] = tuple(counts.items())


#: Inventories already read, by the id of their tuple, each kept with its tuple (alive in
#: here, so its id is not another's): a replay's nodes keep theirs for good, and the
#: gateway's nodes keep theirs while unchanged, so each is read once, not once per node per
#: round. Emptied when it grows past _MEMO entries.
_memo: dict[int, tuple[tuple[Gpu, ...], Inventory]] = {}
_MEMO = 4096


def inventory(gpus: tuple[Gpu, ...]) -> Inventory:
    """The :class:`Inventory` of a node's GPUs, shared: read it, never change it."""
    found = _memo.get(id(gpus))
    if found is not None:
        return found[1]
    made = Inventory(gpus)
    if len(_memo) >= _MEMO:
        _memo.clear()
    _memo[id(gpus)] = (gpus, made)
    return made


def whole_node_ok(node: NodeCapacity, call: Pending) -> bool:
    """Whether a node may be one of a multi-node gang's whole nodes: known size, all GPUs
    qualify."""
    if not constrained(call):  # (every GPU qualifies: this runs per node, per round)
        return bool(node.gpus)
    return bool(node.gpus) and all(gpu_ok(g, call) for g in node.gpus)


def fewest_whole(sizes: Sequence[int], n: int) -> list[int] | None:
    """Which whole nodes (given by their sizes, best first) a gang of ``n`` GPUs gets: those
    adding up to the fewest GPUs at or above ``n`` (a gang holds every GPU of its nodes, so
    this is the least it can take), then the fewest nodes, then the earliest in the list.
    Indices into ``sizes``, in order; None if all of them add up to fewer than ``n``."""
    if n <= 0:
        return []
    if sum(sizes) < n:
        return None
    by_size: dict[int, list[int]] = defaultdict(list)
    for i, size in enumerate(sizes):
        if size > 0:
            by_size[size].append(i)
    kinds = sorted(by_size, reverse=True)
    if len(kinds) == 1:
        s = kinds[0]
        return by_size[s][: -(-n // s)]
    # Some set totals under n + the largest size (adding nodes until n is reached overshoots
    # by less than the last one), so totals past that need not be looked at.
    top = n + kinds[0] - 1
    never = len(sizes) + 1
    fewest = [0] + [never] * top  # fewest nodes adding up to exactly t, with the kinds so far
    steps: list[list[int]] = []  # per kind: how many of its nodes that uses, per total
    for s in kinds:
        most = len(by_size[s])
        now, step = fewest[:], [0] * (top + 1)
        for t in range(s, top + 1):
            for j in range(1, min(most, t // s) + 1):
                if fewest[t - j * s] + j < now[t]:
                    now[t], step[t] = fewest[t - j * s] + j, j
        fewest = now
        steps.append(step)
    total = next(t for t in range(n, top + 1) if fewest[t] < never)
    chosen: list[int] = []
    for s, step in zip(reversed(kinds), reversed(steps), strict=True):
        j = step[total]
        chosen.extend(by_size[s][:j])
        total -= j * s
    return sorted(chosen)
