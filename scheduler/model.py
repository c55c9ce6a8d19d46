"""What a scheduling round sees (:class:`Snapshot`) and what it decides (:class:`Plan`).

Plain dataclasses, no behaviour beyond small derived properties (and a call's class of
service, :func:`service_class`, which the policies and the replay's queue must agree on).
Fields added since the walking skeleton all have defaults, so ``NodeCapacity(node_id,
free_gpus, free_cpu_slots)``,
``Pending(id, gpus)`` and ``Snapshot(nodes, pending)`` still describe a valid round.

Exceptions::

    SchedulerError
     ├── UnknownPolicyError   no policy of that name is registered
     └── TraceError           a trace or quota file cannot be read (scheduler.traces)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field


class SchedulerError(Exception):
    """Base of every error the scheduler package raises."""


class UnknownPolicyError(SchedulerError, ValueError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(f"no scheduling policy named {name!r}; choose one of {self.known}")


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of a node's inventory."""

    index: int
    model: str = ""
    memory_mib: int = 0
    #: GPUs sharing an NVLink group id talk over NVLink; None when the topology is unknown.
    nvlink: int | None = None


#: Shares of one GPU are compared with this much slack (they are sums of floats).
EPSILON = 1e-9
def service_class(thresholds: Sequence[float], gpu_s: float) -> int:
    """A call's class under least attained service (Tiresias's 2D-LAS): how many of
    ``thresholds`` (GPU-seconds, ascending) the service it received has reached."""
    return bisect.bisect_right(thresholds, gpu_s)


#: The least share of a GPU a call may ask for (``bulletin_core.wire.MIN_GPU_SHARE``): at
#: most 20 calls, each a process, share one GPU.
MIN_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class SharedGpu:
    """A GPU that calls asking for part of a GPU (:attr:`Pending.share`) hold between them:
    ``used`` of it is taken (0 < used <= 1), by calls of ``users``."""

    index: int
    used: float
    users: frozenset[str] = frozenset()

    @property
    def left(self) -> float:
        return 1.0 - self.used

    @staticmethod
    def of(runs: Iterable[Running]) -> tuple[SharedGpu, ...]:
        """The shared GPUs of one node's running calls that hold part of a GPU."""
        on: dict[int, list[Running]] = {}
        for run in runs:
            if run.share != 1.0:
                on.setdefault(run.gpu_indices[0], []).append(run)
        return tuple(
            SharedGpu(g, sum(r.share for r in held), frozenset(r.user for r in held))
            for g, held in sorted(on.items())
        )


@dataclass(slots=True)
class NodeCapacity:
    """A live node and what it has free right now.

    ``free_gpus`` must already exclude the GPUs of running calls. ``gpus`` is the node's whole
    inventory; when it is empty the node's size and GPU models are unknown, so it takes only
    unconstrained single-node calls and never part of a multi-node gang.
    """

    node_id: int
    free_gpus: list[int] = field(default_factory=list)
    free_cpu_slots: int = 0
    gpus: tuple[Gpu, ...] = ()
    draining: bool = False
    #: (user, function) pairs with a warm worker here: a tie-breaker between equal nodes.
    warm: frozenset[tuple[str, str]] = frozenset()
    #: GPUs held in part by calls that asked for a share of one; never in ``free_gpus``.
    shared: tuple[SharedGpu, ...] = ()

    @property
    def size(self) -> int:
        """GPUs on the node: the inventory when known, else what is free (a lower bound)."""
        return len(self.gpus) or len(self.free_gpus)


@dataclass(frozen=True, slots=True)
class Part:
    """The GPUs a call holds (or gets) on one node."""

    node_id: int
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Pending:
    """A queued call. ``expected_s`` is its time limit or expected duration, if given.

    ``share`` below 1 asks for that part of one GPU (``gpus`` is then 1): the call is packed
    onto a GPU with other such calls and counts as ``share`` GPUs in quotas and usage."""

    id: str
    gpus: int
    user: str = ""
    group: str = ""
    function: str = ""
    gpu_model: str | None = None
    min_memory_mib: int = 0
    priority: int = 0
    submit_time: float = 0.0
    expected_s: float | None = None
    #: GPU-seconds of service it received before it was queued again (a preempted call's
    #: runs so far); 0 for a call that never ran.
    attained_gpu_s: float = 0.0
    #: When it last entered the queue: at submission, or when it was queued again after a
    #: preemption, a lost node or a retry (None: at ``submit_time``). Its queue place stays
    #: by ``submit_time``; how long it has been waiting counts from here.
    queued_time: float | None = None
    #: The part of one GPU it asks for (0 < share <= 1); 1: whole GPUs.
    share: float = 1.0

    @property
    def waiting_since(self) -> float:
        return self.submit_time if self.queued_time is None else self.queued_time

    @property
    def amount(self) -> float:
        """The GPUs it counts as in quotas and usage: ``gpus``, or its share of one."""
        return self.gpus if self.share == 1.0 else self.share


@dataclass(frozen=True, slots=True)
class Running:
    """A call holding GPUs. ``more`` lists the other nodes of a multi-node gang."""

    id: str
    node_id: int
    gpu_indices: tuple[int, ...]
    user: str = ""
    group: str = ""
    function: str = ""
    priority: int = 0
    start_time: float = 0.0
    expected_s: float | None = None
    #: Placed above its group's guarantee (a plan's ``Decision.borrowed``).
    borrowed: bool = False
    preemptible: bool = True
    #: Already told to stop (a preemption notice is out); its GPUs free up within the grace.
    preempting: bool = False
    more: tuple[Part, ...] = ()
    #: GPU-seconds of service it received before this run started (``attained`` adds the
    #: run's own).
    attained_gpu_s: float = 0.0
    #: When it last entered the queue before this run (None: unknown); ``start_time`` minus
    #: this is how long it waited for this run.
    queued_time: float | None = None
    #: The model names of its GPUs, for quotas per model, when its node may be missing from
    #: the snapshot (live: read with the lease); empty: the snapshot's nodes say.
    gpu_models: tuple[str, ...] = ()
    #: The part of its GPU it holds when it asked for a share of one (see ``Pending.share``).
    share: float = 1.0

    @property
    def amount(self) -> float:
        """The GPUs it counts as in quotas and usage: ``gpus``, or its share of one."""
        return self.gpus if self.share == 1.0 else self.share

    @property
    def parts(self) -> tuple[Part, ...]:
        return (Part(self.node_id, self.gpu_indices), *self.more)

    @property
    def gpus(self) -> int:
        if not self.more:
            return len(self.gpu_indices)
        return len(self.gpu_indices) + sum(len(p.gpu_indices) for p in self.more)

    def attained(self, now: float) -> float:
        """GPU-seconds of service received by ``now``, this run included."""
        return self.attained_gpu_s + self.amount * max(0.0, now - self.start_time)

    def expected_end(self, now: float) -> float:
        """When its GPUs are expected back: never (inf) without a limit, not before ``now``."""
        if self.expected_s is None:
            return math.inf
        return max(now, self.start_time + self.expected_s)

    def whole_size(self, nodes: Mapping[int, NodeCapacity]) -> int:
        """The GPUs of its largest node if it holds every GPU of each of its nodes, else 0
        (also 0 when one of its nodes is missing from ``nodes`` or reports no inventory)."""
        if not self.more:  # (the common case, without building the parts: this is hot)
            node = nodes.get(self.node_id)
            if node is None or not node.gpus or len(self.gpu_indices) < len(node.gpus):
                return 0
            return len(node.gpus)
        size = 0
        for part in self.parts:
            node = nodes.get(part.node_id)
            if node is None or not node.gpus or len(part.gpu_indices) < len(node.gpus):
                return 0
            size = max(size, len(node.gpus))
        return size


@dataclass(frozen=True, slots=True)
class Quota:
    """A group's guaranteed GPUs and how many more it may borrow while they sit idle."""

    guaranteed: int = 0
    #: None: may borrow every idle GPU.
    borrow_limit: int | None = None
    #: Quotas for the group's GPUs of some models (Kueue's resource flavours), as (model,
    #: quota) pairs: a GPU counts against the longest listed model that is part of its model
    #: name (case-insensitive, as ``gpu_model`` matches), if any; its GPUs of other models
    #: only against this quota. A model's quota has no ``models`` of its own.
    models: tuple[tuple[str, Quota], ...] = ()

    @property
    def ceiling(self) -> float:
        """The most GPUs the group may hold at once."""
        return math.inf if self.borrow_limit is None else self.guaranteed + self.borrow_limit


#: Groups without a configured quota: nothing guaranteed, may borrow everything idle.
DEFAULT_QUOTA = Quota(guaranteed=0, borrow_limit=None)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one scheduling round may look at. ``plan`` never mutates it."""

    nodes: Sequence[NodeCapacity]
    pending: Sequence[Pending]
    running: Sequence[Running] = ()
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    #: Decayed GPU-seconds per group and per (group, user), running calls included up to now
    #: (see scheduler.fairshare).
    usage: Mapping[str, float] = field(default_factory=dict)
    user_usage: Mapping[tuple[str, str], float] = field(default_factory=dict)
    now: float = 0.0
    #: Calls the previous round's plan reserved for, with when each was due, in the order it
    #: reserved them (its ``Plan.reserved``; the leader keeps them between rounds): the fair
    #: guard serves them first, in that order, and beyond its share.
    reserved: Mapping[str, float] = field(default_factory=dict)
    #: Whether calls of different users may share one GPU (:attr:`Pending.share`); by
    #: default a GPU is shared only among one user's calls.
    share_across_users: bool = False
    #: Calls the previous round preempted their own group's calls for (its
    #: ``Plan.promised``, kept by the leader between rounds), with the nodes that room is on:
    #: the fair policy places them first.
    promised: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: The nodes each of ``reserved`` was reserved on (its ``Plan.reserved_on``, kept by the
    #: leader between rounds): a reserved call starts there when they have room for it, not
    #: on nodes another reservation counts on.
    reserved_on: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: The running calls' expected ends per node, kept up to date by the caller (the
    #: replay); None: derived from ``running`` when a round needs them.
    ends: Ends | None = None
    #: GPUs held per group by the running calls not being preempted (a share counted as its
    #: part of a GPU), kept up to date by the caller (the replay); None: derived from
    #: ``running`` when a round needs them.
    held: Mapping[str, float] | None = None
    #: The running calls a preemptive policy may take, per node in the order of its
    #: standing key, kept up to date by the caller (the replay); None: a round ranks the
    #: running calls itself. A policy uses it only if its ``key`` is the policy's own.
    standing: Standing | None = None


class Standing:
    """Per node, the running calls a policy may preempt (whole GPUs, preemptible, not told to
    stop yet) as ``(key, start, id, run)`` in ascending order, ``key`` being the policy's
    standing key: a time-invariant value that the policy's class of a running call never
    decreases with, at any instant (``srtf``: its expected end; see
    :meth:`scheduler.yardsticks.Srtf.standing_key`). So a node's worst-ranked call is its
    last, and its calls worst first are its list reversed (up to ties in class), without a
    class worked out for any other. Also the GPUs of the calls told to stop, per node (they
    are on their way back). The replay keeps one as calls start, are told to stop and end
    (``Snapshot.standing``); it must list exactly the snapshot's running calls."""

    __slots__ = ("by_node", "key", "leaving")

    def __init__(self, key: Callable[[Running], float], running: Iterable[Running] = ()) -> None:
        self.key = key
        self.by_node: dict[int, list[tuple[float, float, str, Running]]] = {}
        self.leaving: dict[int, list[int]] = {}
        for run in running:
            self.add(run)

    def add(self, run: Running) -> None:
        if run.share != 1.0:
            return  # (never a victim: its GPU is busy until all its sharers end)
        if run.preempting:
            for part in run.parts:
                self.leaving.setdefault(part.node_id, []).extend(part.gpu_indices)
            return
        if not run.preemptible:
            return
        entry = (self.key(run), run.start_time, run.id, run)
        for part in run.parts:
            bisect.insort(self.by_node.setdefault(part.node_id, []), entry)

    def remove(self, run: Running) -> None:
        """Take out a call :meth:`add` was given (as it was then, or an equal one)."""
        if run.share != 1.0:
            return
        if run.preempting:
            for part in run.parts:
                gpus = self.leaving[part.node_id]
                for g in part.gpu_indices:
                    gpus.remove(g)
                if not gpus:
                    del self.leaving[part.node_id]
            return
        if not run.preemptible:
            return
        entry = (self.key(run), run.start_time, run.id)
        for part in run.parts:
            held = self.by_node[part.node_id]
            at = bisect.bisect_left(held, entry)  # (ids are unique: no other entry ties)
            if at == len(held) or held[at][2] != run.id:
                raise ValueError(f"call {run.id} is not in the standing of node {part.node_id}")
            del held[at]
            if not held:
                del self.by_node[part.node_id]


class Ends:
    """Per node, when the running calls' GPUs are expected back: ``(end, GPUs)`` pairs in
    order, ``end`` being start + expected duration (inf without one; possibly already past).
    A round derives it from the running calls (:func:`scheduler.backfill.releases`); the
    replay keeps one up to date as calls start and stop (``Snapshot.ends``) so that its rounds
    need not. It must list exactly the snapshot's running calls."""

    __slots__ = ("_entries", "by_node", "shared")

    def __init__(self, running: Iterable[Running] = ()) -> None:
        self.by_node: dict[int, list[tuple[float, tuple[int, ...]]]] = {}
        #: How many of the calls hold a share of a GPU (a shared GPU comes back last).
        self.shared = 0
        self._entries: dict[str, list[tuple[int, tuple[float, tuple[int, ...]]]]] = {}
        for run in running:
            self.add(run)

    def add(self, run: Running) -> None:
        end = math.inf if run.expected_s is None else run.start_time + run.expected_s
        entries = []
        for part in run.parts:
            entry = (end, part.gpu_indices)
            bisect.insort(self.by_node.setdefault(part.node_id, []), entry)
            entries.append((part.node_id, entry))
        self._entries[run.id] = entries
        self.shared += run.share != 1.0

    def remove(self, run: Running) -> None:
        for node_id, entry in self._entries.pop(run.id):
            self.by_node[node_id].remove(entry)  # (an equal entry is as good as its own)
        self.shared -= run.share != 1.0


@dataclass(frozen=True, slots=True)
class Decision:
    """Start a call. A multi-node gang gets whole nodes: the first here, the rest in ``more``."""

    invocation_id: str
    node_id: int
    gpu_indices: tuple[int, ...]
    more: tuple[Part, ...] = ()
    #: Above its group's guarantee: may be preempted when another group reclaims.
    borrowed: bool = False

    @property
    def parts(self) -> tuple[Part, ...]:
        return (Part(self.node_id, self.gpu_indices), *self.more)

    @classmethod
    def of(cls, call_id: str, parts: tuple[Part, ...], borrowed: bool = False) -> Decision:
        first, *more = parts
        return cls(call_id, first.node_id, first.gpu_indices, tuple(more), borrowed)


@dataclass(frozen=True, slots=True)
class Preemption:
    """Tell a running call to stop (it is requeued); ``reason`` is shown to its owner."""

    invocation_id: str
    reason: str


class Plan(list[Decision]):
    """A round's placements, in order, plus its preemptions.

    A list of :class:`Decision` so that callers which only place calls keep working. ``more``
    says the round stopped short of all it could do (a bound on its work): plan again soon.
    ``reserved`` maps each call the round reserved GPUs for to when the reservation is due.
    """

    def __init__(
        self,
        placements: Iterable[Decision] = (),
        preemptions: Iterable[Preemption] = (),
        more: bool = False,
    ) -> None:
        super().__init__(placements)
        self.preemptions: list[Preemption] = list(preemptions)
        self.more = more
        self.reserved: dict[str, float] = {}
        #: Calls the round preempted others for, and the nodes of that room (see
        #: ``Snapshot.promised``).
        self.promised: dict[str, tuple[int, ...]] = {}
        #: The nodes each reservation of ``reserved`` holds (see ``Snapshot.reserved_on``).
        self.reserved_on: dict[str, tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return f"Plan({list(self)!r}, preemptions={self.preemptions!r})"
