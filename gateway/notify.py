"""Wakes waiters on PostgreSQL notifications. It only wakes: waiters always re-read the
tables, and also re-check on a short timer because a notification can be lost (a reconnect,
a listener busy elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import asyncpg

from bulletin_core.backoff import Backoff
from gateway.db import CHANNEL
from gateway.errors import ServiceUnavailable

log = logging.getLogger(__name__)


#: What a client whose long-poll the stopping gateway ended waits before it retries.
STOPPING_RETRY_AFTER_S = 1


class GatewayStopping(ServiceUnavailable):
    """This gateway is stopping: a long-poll ends with 503 and Retry-After, and the client
    asks again (another replica, or this one restarted)."""

    def __init__(self) -> None:
        super().__init__(
            f"this gateway is stopping; retry in {STOPPING_RETRY_AFTER_S} s (nothing was lost)",
            retry_after=STOPPING_RETRY_AFTER_S,
            code="gateway_stopping",
        )


#: How long a local wake waits for its notification to come back before it is forgotten.
ECHO_S = 1.0


class Subscription:
    def __init__(self, hub: Hub, stoppable: bool, handovers: bool) -> None:
        self.event = asyncio.Event()
        self._hub = hub
        self._stoppable = stoppable
        #: It takes what a transaction committed by this gateway hands over (Hub.woke).
        self.handovers = handovers
        # Which keys woke it since the last take_fired(); None: anything may have changed
        # (a reconnect, a stopping gateway), so the waiter must re-read everything.
        self._fired: set[str] | None = set()
        # What was handed over with its wake, by key (handovers only), and the keys woken
        # without a handover since the last take_handed(): for those, a handover is not all
        # the news.
        self._handed: dict[str, Any] = {}
        self._plain: set[str] = set()

    def fire(self, key: str | None, handed: Any = None) -> None:
        """Wake it for ``key`` (None: for everything), handing over ``handed``: all the news
        of ``key``, unless another wake for it came without a handover."""
        if key is None:
            self._fired = None
            self._handed.clear()
        else:
            if self._fired is not None:
                self._fired.add(key)
            if handed is None:
                self._handed.pop(key, None)
                self._plain.add(key)
            elif self.handovers and key not in self._plain:
                self._handed[key] = handed
        self.event.set()

    def take_fired(self) -> set[str] | None:
        """The keys that woke it since the last call (None: re-read everything), forgotten."""
        fired, self._fired = self._fired, set()
        return fired

    def take_handed(self) -> dict[str, Any]:
        """What was handed over since the last call, by key, for the keys nothing else woke
        it for meanwhile; forgotten."""
        handed, self._handed, self._plain = self._handed, {}, set()
        return handed

    async def wait(self, timeout: float) -> bool:
        """Wait for a notification or ``timeout``; True if woken. Clears for the next wait.
        Raises GatewayStopping once the gateway stops (a stoppable subscription)."""
        self._check()
        try:
            await asyncio.wait_for(self.event.wait(), max(timeout, 0))
            woken = True
        except TimeoutError:
            woken = False
        finally:
            self.event.clear()
        self._check()
        return woken

    def _check(self) -> None:
        if self._stoppable and self._hub.stopping:
            raise GatewayStopping()


class Polls:
    """What the last poll of each node start answered by this gateway knew: the node's mark
    (Hub.mark) before the read (or handover) it answered from, and the attempts it
    delivered. A node polls again as soon as it is answered, with those attempts among its
    running ones; when its mark has not moved since, nothing of its work changed (every
    change to it notifies the node, and the mark moves with each notification), so that
    poll need not read before it waits: one statement fewer on every call's path. A
    change no notification announced (a lease the leader let expire, a notification lost
    in a reconnect, which moves the mark) is found by the wait's timer (recheck_s), or by
    the node's heartbeat. Forgotten after KEEP_S."""

    KEEP_S = 60.0

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], tuple[tuple[int, int], frozenset[str], float]] = {}

    def answered(
        self, node: int, incarnation: int, mark: tuple[int, int], delivered: Iterable[str]
    ) -> None:
        now = time.monotonic()
        if len(self._known) > 4096:  # a bound whatever happens: drop what is old
            self._known = {k: v for k, v in self._known.items() if now - v[2] < self.KEEP_S}
        self._known[(node, incarnation)] = (mark, frozenset(delivered), now)

    def unchanged(
        self, node: int, incarnation: int, mark: tuple[int, int], running: Iterable[str]
    ) -> bool:
        """Whether a poll of this node start may wait without reading: its mark is where
        the last answer left it, and it runs what that answer delivered."""
        known = self._known.pop((node, incarnation), None)
        if known is None or known[0] != mark or time.monotonic() - known[2] > self.KEEP_S:
            return False
        return known[1] <= set(running)


class Hub:
    """One LISTEN connection per gateway process, fanning out to in-process waiters."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._waiters: dict[str, set[Subscription]] = defaultdict(set)
        self._conn: asyncpg.Connection | None = None
        # Local wakes (see woke): by (backend pid, key), when each local wake whose
        # notification has not come back yet was made, and when each notification that no
        # local wake has claimed yet came. Both forgotten after ECHO_S.
        self._expected: dict[tuple[int, str], list[float]] = defaultdict(list)
        self._arrived: dict[tuple[int, str], list[float]] = defaultdict(list)
        # Notifications from the backends of committing transactions (see holding): kept
        # until the transaction's woke, which wakes with what it hands over.
        self._held: dict[int, list[str]] = {}
        self._pruned = time.monotonic()
        #: The gateway is stopping: waiting requests end (GatewayStopping).
        self.stopping = False
        # For each node (key n:<id>): how many wakes it had, and how many times the listener
        # reconnected (any notification may have been lost then): see mark(). And what each
        # node start's last poll answered here knew: see Polls.
        self._node_wakes: Counter[str] = Counter()
        self._epoch = 0
        self.polls = Polls()

    def stop_waiters(self) -> None:
        """End every request's wait now (they answer 503 with Retry-After, or end their
        stream), so a stopping gateway closes its long-polls instead of having them cut."""
        self.stopping = True
        self._wake_all()

    async def run(self) -> None:
        """Keep a listening connection up until cancelled; reconnects with backoff."""
        backoff = Backoff(0.1, 5.0)
        while True:
            lost = asyncio.Event()  # one per connection: a closing old one cannot trip a new one
            connected_at = time.monotonic()
            try:
                self._conn = await asyncpg.connect(self._url)
                self._conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await self._conn.add_listener(CHANNEL, self._on_notify)
                self._wake_all()  # anything may have happened while we were away
                await lost.wait()
            except Exception as exc:  # any failure must lead to a reconnect, never to silence
                log.warning("notification listener lost (%s); reconnecting", exc)
            finally:
                await self._close()
            if time.monotonic() - connected_at > 10:
                backoff.reset()  # it had been up a while: this is a fresh failure
            await backoff.sleep()

    async def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close(timeout=2)
            self._conn = None

    def woke(
        self, pid: int, keys: Iterable[str], handed: Mapping[str, Any] | None = None
    ) -> None:
        """Wake this process's waiters on ``keys`` at once, for a transaction that notified
        them and just committed on the database backend ``pid``; called while the connection
        is still held, so that nothing else commits on that backend in between. The
        notification itself still goes to every gateway; here it comes back from that
        backend after the wake (each backend's notifications arrive in commit order) and
        wakes no one a second time. One that came back first already woke everyone: then
        the wake is skipped instead (and its waiters read what ``handed`` would have given
        them). ``handed``: by key, what that transaction committed for the subscriptions
        that take handovers (:meth:`awaits_handover`), which need not read it again: a
        finished invocation for its owner's request waiting for its result, the work given
        to a node for its poll."""
        now = time.monotonic()
        self._prune(now)
        held = self._held.pop(pid, [])
        for key in dict.fromkeys(keys):
            if key in held:  # its echo came while the transaction committed: kept for this
                held.remove(key)
            elif arrived := self._arrived.get((pid, key)):
                arrived.pop(0)
                continue
            else:
                self._expected[(pid, key)].append(now)
            self._count(key)
            found = None if handed is None else handed.get(key)
            for sub in self._waiters.get(key, ()):
                sub.fire(key, found)
        for payload in held:  # the transaction's other notifications ("q", ...)
            self._deliver(pid, payload, now)

    @contextlib.asynccontextmanager
    async def holding(self, pid: int) -> AsyncIterator[None]:
        """Around the commit of a transaction on backend ``pid`` whose :meth:`woke` hands
        over what it wrote: a notification of it that comes back before its ``woke`` is
        kept for the ``woke`` (delivered first, it woke its waiters without the handover,
        and they read what they would have been given: one call in five here). Without a
        ``woke`` (the transaction failed after all), what came is delivered at the end."""
        self._held[pid] = []
        try:
            yield
        finally:
            now = time.monotonic()
            for payload in self._held.pop(pid, []):
                self._deliver(pid, payload, now)

    def mark(self, key: str) -> tuple[int, int]:
        """Where node key ``key`` (``n:<id>``) stands: changed between two marks if any wake
        for it came, or the listener reconnected, in between."""
        return self._epoch, self._node_wakes[key]

    def _count(self, key: str) -> None:
        if key.startswith("n:"):  # nodes only: one entry each (invocations are countless)
            self._node_wakes[key] += 1

    def awaits_handover(self, key: str) -> bool:
        """Whether a request of this process waits on ``key`` and takes handovers: a request
        of the owner of the call ``i:<id>`` waiting for its result (a submission's wait, a
        watch, a JSON invocation's answer), the poll of node ``n:<id>``."""
        return any(sub.handovers for sub in self._waiters.get(key, ()))

    def _on_notify(self, _conn: object, pid: int, _channel: str, payload: str) -> None:
        now = time.monotonic()
        self._prune(now)
        expected = self._expected.get((pid, payload))
        if expected:
            expected.pop(0)  # the echo of a local wake: its waiters are already awake
            return
        held = self._held.get(pid)
        if held is not None:
            held.append(payload)  # of a transaction committing here: for its woke
            return
        self._deliver(pid, payload, now)

    def _deliver(self, pid: int, payload: str, now: float) -> None:
        self._arrived[(pid, payload)].append(now)
        self._count(payload)
        for sub in self._waiters.get(payload, ()):
            sub.fire(payload)

    def _prune(self, now: float) -> None:
        """Forget local wakes and notifications older than ECHO_S (an echo lost to a
        reconnect, notifications of transactions that woke no one locally)."""
        if now - self._pruned < ECHO_S:
            return
        self._pruned = now
        for table in (self._expected, self._arrived):
            for key in list(table):
                times = [t for t in table[key] if now - t < ECHO_S]
                if times:
                    table[key] = times
                else:
                    del table[key]

    def _wake_all(self) -> None:
        self._epoch += 1
        self._expected.clear()
        self._arrived.clear()
        for held in self._held.values():
            held.clear()  # everything wakes now
        for subs in self._waiters.values():
            for sub in subs:
                sub.fire(None)

    @contextlib.asynccontextmanager
    async def subscribe(
        self, keys: Iterable[str], *, stoppable: bool = True, handovers: bool = False
    ) -> AsyncIterator[Subscription]:
        """Register before reading the tables, so a change between read and wait still wakes.
        A request's subscription is ``stoppable`` (see :meth:`stop_waiters`); the gateway's
        own loops are stopped by cancellation. ``handovers``: it takes what this gateway's
        transactions hand over (:meth:`woke`): results of the calls ``keys`` name
        (``i:<id>``, for their owner: stamped as fetched), work of a node (``n:<id>``)."""
        sub = Subscription(self, stoppable, handovers)
        keys = list(keys)
        for key in keys:
            self._waiters[key].add(sub)
        try:
            yield sub
        finally:
            for key in keys:
                subs = self._waiters.get(key)
                if subs is not None:
                    subs.discard(sub)
                    if not subs:
                        del self._waiters[key]
