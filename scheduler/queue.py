"""The pending calls in queue order, indexed by kind of call, kept up to date as calls come
and go.

A round that scans a long backlog for calls to backfill looks at most of them only to learn
again what it learnt from the first of their kind: that a call of that many GPUs of that model
fits nowhere. :class:`Queue` keeps, beside the queue order, one list per kind of call (GPUs,
model, memory, share), also in queue order, so that a round can pass over a kind at once
(:meth:`Queue.walk`). It also keeps each (priority, group, user)'s calls split into *tiers* by
the service they received (``thresholds``, the fair policy's least-attained-service classes),
so that the fair policy's buckets need neither a pass over every call nor a sort per round
(:meth:`Queue.buckets`). The replay keeps one Queue for the whole trace and updates it as jobs
arrive, start and are requeued; a live round's calls come as a list. Either way a policy sees
a ``Sequence[Pending]`` in queue order: higher priority first, then by sequence number.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast, overload

from scheduler.model import Pending, service_class

#: A call's place in the queue: (-priority, sequence number).
Key = tuple[int, int]
#: Calls a round treats alike: GPUs, model, memory, share (and user, for a share: shares are
#: packed per user).
Kind = tuple[int, str | None, int, float, str]
#: A fair-share bucket: (priority, group, user).
Bucket = tuple[int, str, str]
#: A call's standing under a replay-only yardstick (scheduler.yardsticks): lower goes first;
#: unique per call.
Rank = tuple[float, float, str]


def kind(call: Pending) -> Kind:
    user = call.user if call.share != 1.0 else ""
    return (call.gpus, call.gpu_model, call.min_memory_mib, call.share, user)


class _Seq:
    """Calls in queue order."""

    __slots__ = ("calls", "keys")

    def __init__(self) -> None:
        self.keys: list[tuple[float | str, ...]] = []
        self.calls: list[Pending] = []

    def add(self, key: tuple[float | str, ...], call: Pending) -> int:
        i = bisect.bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.calls.insert(i, call)
        return i

    def remove(self, key: tuple[float | str, ...]) -> int:
        i = bisect.bisect_left(self.keys, key)
        del self.keys[i], self.calls[i]
        return i


class _Run(_Seq):
    """One kind's calls in queue order with their expected durations (:func:`expected`), and
    those durations sorted (the shortest says at once whether any of them may backfill
    before a reservation); and, once first asked for (:meth:`oldest`), the calls oldest
    first."""

    __slots__ = ("_aged", "expected", "lengths")

    def __init__(self) -> None:
        super().__init__()
        self.expected: list[float] = []
        self.lengths: list[float] = []  # (in queue order, beside calls)
        self._aged: _Seq | None = None  # (by _age(key, call); None until asked for)

    def add(self, key: tuple[float | str, ...], call: Pending) -> int:
        i = super().add(key, call)
        length = expected(call)
        self.lengths.insert(i, length)
        bisect.insort(self.expected, length)
        if self._aged is not None:
            self._aged.add(_age(key, call), call)
        return i

    def drop(self, key: Key, call: Pending) -> None:
        del self.lengths[self.remove(key)]
        del self.expected[bisect.bisect_left(self.expected, expected(call))]
        if self._aged is not None:
            self._aged.remove(_age(key, call))

    def oldest(self) -> _Seq:
        """The calls oldest first, kept from the first time asked for (only the fair guard
        asks: other policies' queues never pay for it)."""
        if self._aged is None:
            self._aged = _Seq()
            pairs = sorted(zip(map(_age, self.keys, self.calls), self.calls, strict=True),
                           key=lambda pair: pair[0])  # fmt: skip
            self._aged.keys = [age for age, _ in pairs]
            self._aged.calls = [c for _, c in pairs]
        return self._aged


def _age(key: tuple[float | str, ...], call: Pending) -> tuple[float | str, ...]:
    """A call's place among the oldest first: higher priority first, then by when it entered
    the queue, then in queue order (``key``: its place in the queue)."""
    return (key[0], call.waiting_since, key[1])


def expected(call: Pending) -> float:
    """The call's expected duration; infinite when it has none (it sorts last)."""
    return math.inf if call.expected_s is None else call.expected_s


class Queue(Sequence[Pending]):
    """Pending calls in queue order (higher priority first, then by sequence number), with a
    list per :func:`kind` of call, and per bucket per tier of service received (a call's tier:
    how many of ``thresholds``, GPU-seconds ascending, its ``attained_gpu_s`` has reached).
    Ids are unique; a call is added with its sequence number (the replay: its job's index;
    live: its place in the order read)."""

    def __init__(
        self,
        thresholds: tuple[float, ...] = (),
        shortest_first: bool = False,
        rank: Callable[[Pending], Rank] | None = None,
        kinds: bool = True,
        tiers: bool = True,
    ) -> None:
        self.thresholds = thresholds
        #: Each tier in order of expected duration, shortest first (then in queue order).
        self.shortest_first = shortest_first
        #: Also keep every call in the order of this rank (:meth:`ranked`), if given.
        self.rank = rank
        #: Whether to keep the lists per kind of call (:meth:`walk`, :meth:`waiting_large`:
        #: fifo and fair), and the tiers per bucket with the GPUs queued by when they came
        #: (:meth:`buckets`, :meth:`waited`: fair). A replay of a policy that reads neither
        #: keeps neither, and its calls come and go cheaper.
        self.kinds, self.tiers = kinds, tiers
        self._ranked = _Seq()
        self._keys: list[Key] = []
        self._calls: list[Pending] = []
        self._by_id: dict[str, Key] = {}
        self._runs: dict[Kind, _Run] = {}
        self._tiers: dict[Bucket, list[_Seq]] = {}
        self._sizes: dict[Bucket, int] = {}
        self._waits = _Waits()

    @classmethod
    def of(
        cls,
        calls: Iterable[Pending],
        thresholds: tuple[float, ...] = (),
        shortest_first: bool = False,
        rank: Callable[[Pending], Rank] | None = None,
        kinds: bool = True,
        tiers: bool = True,
    ) -> Queue:
        """A queue of ``calls`` in the order given (calls of higher priority are moved ahead
        of lower ones; the order is kept otherwise)."""
        queue = cls(thresholds, shortest_first, rank, kinds, tiers)
        for seq, call in enumerate(calls):
            queue.add(call, seq)
        return queue

    def add(self, call: Pending, seq: int) -> None:
        if call.id in self._by_id:
            raise ValueError(f"call {call.id} is queued already")
        key = (-call.priority, seq)
        i = bisect.bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            raise ValueError(f"call {call.id} has the place of call {self._calls[i].id}")
        self._keys.insert(i, key)
        self._calls.insert(i, call)
        self._by_id[call.id] = key
        if self.kinds:
            run = self._runs.get(kind(call))
            if run is None:
                run = self._runs[kind(call)] = _Run()
            run.add(key, call)
        if self.tiers:
            bucket = (call.priority, call.group, call.user)
            tiers = self._tiers.get(bucket)
            if tiers is None:
                tiers = self._tiers[bucket] = [_Seq() for _ in range(len(self.thresholds) + 1)]
                self._sizes[bucket] = 0
            tiers[self.tier(call)].add(self._tier_key(key, call), call)
            self._sizes[bucket] += 1
            self._waits.add(call)
        if self.rank is not None:
            self._ranked.add(self.rank(call), call)

    def tier(self, call: Pending) -> int:
        return service_class(self.thresholds, call.attained_gpu_s)

    def _tier_key(self, key: Key, call: Pending) -> tuple[float, ...]:
        """A call's place in its tier: its place in the queue, after the calls expected to
        end sooner with ``shortest_first`` (a bucket's calls share one priority)."""
        if not self.shortest_first:
            return key
        return (key[0], expected(call), key[1])

    def pop(self, call_id: str) -> Pending:
        """Take the call out of the queue (KeyError if it is not in it)."""
        key = self._by_id.pop(call_id)
        i = bisect.bisect_left(self._keys, key)
        call = self._calls[i]
        del self._keys[i], self._calls[i]
        if self.kinds:
            k = kind(call)
            run = self._runs[k]
            run.drop(key, call)
            if not run.keys:
                del self._runs[k]
        if self.tiers:
            bucket = (call.priority, call.group, call.user)
            self._tiers[bucket][self.tier(call)].remove(self._tier_key(key, call))
            self._sizes[bucket] -= 1
            if not self._sizes[bucket]:
                del self._tiers[bucket], self._sizes[bucket]
            self._waits.remove(call)
        if self.rank is not None:
            self._ranked.remove(self.rank(call))
        return call

    def key(self, call_id: str) -> Key:
        """The call's place in the queue (KeyError if it is not queued)."""
        return self._by_id[call_id]

    def waited(self, since: float) -> float | None:
        """GPUs asked by the queued calls that have waited since ``since`` or earlier
        (:attr:`Pending.waiting_since`), shares of a GPU included; None when calls did not
        enter the queue in the order of those times (then count them one by one)."""
        return self._waits.total(since) if self.tiers else None

    def waiting_large(
        self, since: float, largest: int, usable: Callable[[Pending], bool]
    ) -> list[Pending]:
        """The queued calls of whole GPUs that have waited since ``since`` or earlier and ask
        for ``largest`` GPUs or more, or for a model or memory, of the kinds ``usable`` says
        yes to (asked of one call of each kind); oldest first: higher priority first, then by
        when each entered the queue, then in queue order (no sort: each kind keeps its calls
        in that order)."""
        self._needs(self.kinds, "kinds")
        found = []
        for (gpus, model, memory, share, _), run in self._runs.items():
            if share != 1.0 or (gpus < largest and model is None and not memory):
                continue
            if not usable(run.calls[0]):
                continue
            aged = run.oldest()
            pairs = zip(aged.keys, aged.calls, strict=True)
            found.append([(k, c) for k, c in pairs if c.waiting_since <= since])
        return [call for _, call in heapq.merge(*found)]

    def among(self, ids: Iterable[str]) -> list[Pending]:
        """The queued calls of these ids, in queue order (ids not queued are left out)."""
        keys = sorted(key for key in map(self._by_id.get, ids) if key is not None)
        return [self._calls[bisect.bisect_left(self._keys, key)] for key in keys]

    def ranked(self) -> Iterator[tuple[Rank, Pending]]:
        """The queued calls with their :attr:`rank`, lowest first (as worked out when each
        call came); none without a rank."""
        return zip(cast("list[Rank]", self._ranked.keys), self._ranked.calls, strict=True)

    def buckets(self) -> dict[Bucket, list[list[Pending]]]:
        """Per (priority, group, user) with calls queued: its calls of each tier, lowest
        first, each in queue order (with ``shortest_first``, by expected duration, then in
        queue order). The lists are the queue's own: read them, never change them."""
        self._needs(self.tiers, "tiers")
        return {b: [seq.calls for seq in tiers] for b, tiers in self._tiers.items()}

    @staticmethod
    def _needs(kept: bool, view: str) -> None:
        if not kept:
            raise RuntimeError(f"this queue keeps no {view} (made with {view}=False)")

    def __contains__(self, call: object) -> bool:
        return isinstance(call, Pending) and self._by_id.get(call.id) is not None

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._calls)

    @overload
    def __getitem__(self, index: int) -> Pending: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Pending]: ...
    def __getitem__(self, index: int | slice) -> Pending | Sequence[Pending]:
        return self._calls[index]

    def walk(
        self, dead: Callable[[Pending], bool], dead_kind: Callable[[Pending, float], bool]
    ) -> Iterator[Pending]:
        """The calls in queue order, less calls ``dead`` says nothing can be done for. A
        kind's calls are passed over together once ``dead_kind(call, shortest)`` says so for
        one of them (``shortest``: the least expected duration among that kind's calls).
        Both are asked again before each call is yielded, so the caller may change what
        they say as it goes; what they say of a call may only ever turn from alive to dead.
        ``dead`` must say of a kind's calls that it is dead of each one expected to run as
        long as a dead one, or longer (as backfill does: one that ends later fits no
        better), so that such calls are passed over without asking."""
        self._needs(self.kinds, "kinds")
        heap = [(run.keys[0], 0, k) for k, run in self._runs.items()]
        heapq.heapify(heap)
        runs = self._runs
        while heap:
            _, i, k = heap[0]
            run = runs[k]
            calls = run.calls
            if dead_kind(calls[i], run.expected[0]):
                heapq.heappop(heap)  # (the whole kind: none of its calls can be done)
                continue
            alive = not dead(calls[i])
            j = i + 1
            if not alive:
                lengths, n = run.lengths, len(calls)
                longest = lengths[i]  # (a call expected this long or longer is dead)
                while j < n:
                    length = lengths[j]
                    if length < longest:
                        if not dead(calls[j]):
                            break
                        longest = length
                    j += 1
            if j < len(calls):
                heapq.heapreplace(heap, (run.keys[j], j, k))
            else:
                heapq.heappop(heap)
            if alive:  # (else the call of kind k found is put back in its turn, above)
                yield calls[i]


class _Waits:
    """Whole GPUs queued by when their calls entered the queue, summed in a Fenwick tree over
    the order they entered it (which is the order of those times for as long as each call
    enters no earlier than the last, as in the replay); and the calls asking for a share."""

    def __init__(self) -> None:
        self.times: list[float] = []  # per slot: when its call entered
        self.gpus: list[int] = []  # per slot: its GPUs, 0 once it left
        self.tree: list[int] = [0]
        self.slots: dict[str, int] = {}
        self.shares: dict[str, Pending] = {}
        self.timely = True

    def add(self, call: Pending) -> None:
        t = call.waiting_since
        if self.times and t < self.times[-1]:
            self.timely = False
        slot = len(self.times)
        self.slots[call.id] = slot
        self.times.append(t)
        self.gpus.append(0)
        if len(self.times) >= len(self.tree):
            self._grow()
        if call.share != 1.0:
            self.shares[call.id] = call
        else:
            self._bump(slot, call.gpus)

    def remove(self, call: Pending) -> None:
        slot = self.slots.pop(call.id)
        if self.shares.pop(call.id, None) is None:
            self._bump(slot, -call.gpus)

    def total(self, since: float) -> float | None:
        if not self.timely:
            return None
        i, whole = bisect.bisect_right(self.times, since), 0
        while i > 0:
            whole += self.tree[i]
            i -= i & -i
        parts = [c.share for c in self.shares.values() if c.waiting_since <= since]
        return whole + math.fsum(parts)

    def _bump(self, slot: int, gpus: int) -> None:
        self.gpus[slot] += gpus
        i = slot + 1
        while i < len(self.tree):
            self.tree[i] += gpus
            i += i & -i

    def _grow(self) -> None:
        size = 2 * len(self.tree)
        tree = [0] * size
        for slot, gpus in enumerate(self.gpus):  # (linear-time Fenwick build)
            i = slot + 1
            tree[i] += gpus
            parent = i + (i & -i)
            if parent < size:
                tree[parent] += tree[i]
        self.tree = tree
