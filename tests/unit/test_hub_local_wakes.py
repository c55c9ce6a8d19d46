"""gateway.notify.Hub's local wakes: a commit's waiters here are woken at once, its
notification coming back wakes no one twice, and no other notification is ever swallowed."""

from __future__ import annotations

import asyncio

import pytest

from gateway import notify
from gateway.notify import Hub


def woken(sub: notify.Subscription) -> bool:
    was = sub.event.is_set()
    sub.event.clear()
    return was


def test_a_local_wake_and_its_echo_wake_once_and_the_next_notification_wakes() -> None:
    async def main() -> None:
        hub = Hub("postgresql://unused")
        async with hub.subscribe(["n:1"]) as sub:
            hub.woke(41, ["n:1"])
            assert woken(sub)
            hub._on_notify(None, 41, "ch", "n:1")  # its echo
            assert not woken(sub)
            hub._on_notify(None, 41, "ch", "n:1")  # a later commit on the same backend
            assert woken(sub)
            hub._on_notify(None, 7, "ch", "n:1")  # another backend's (another gateway's)
            assert woken(sub)

    asyncio.run(main())


def test_an_echo_that_comes_first_wakes_and_the_late_local_wake_is_skipped() -> None:
    async def main() -> None:
        hub = Hub("postgresql://unused")
        async with hub.subscribe(["i:a"]) as sub:
            hub._on_notify(None, 41, "ch", "i:a")
            assert woken(sub)
            hub.woke(41, ["i:a"])
            assert not woken(sub), "its waiters were already woken by its notification"
            hub._on_notify(None, 41, "ch", "i:a")  # the next commit's: never swallowed
            assert woken(sub)

    asyncio.run(main())


def test_a_lost_echo_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        hub = Hub("postgresql://unused")
        clock = [notify.time.monotonic()]
        monkeypatch.setattr(notify.time, "monotonic", lambda: clock[0])
        async with hub.subscribe(["q"]) as sub:
            hub.woke(41, ["q"])
            assert woken(sub)
            clock[0] += notify.ECHO_S * 2.5  # its notification never came (a reconnect)
            hub._on_notify(None, 41, "ch", "q")
            assert woken(sub)

    asyncio.run(main())


def test_a_subscription_tells_which_keys_woke_it_and_a_reconnect_says_everything() -> None:
    async def main() -> None:
        hub = Hub("postgresql://unused")
        async with hub.subscribe(["i:a", "i:b", "i:c"]) as sub:
            hub._on_notify(None, 7, "ch", "i:a")
            hub.woke(41, ["i:c"])
            hub._on_notify(None, 7, "ch", "i:z")  # not subscribed: names nothing
            assert await sub.wait(1)
            assert sub.take_fired() == {"i:a", "i:c"}
            assert sub.take_fired() == set(), "taken: forgotten"
            hub._on_notify(None, 7, "ch", "i:b")
            hub._wake_all()  # a reconnect: anything may have changed while it was away
            assert await sub.wait(1)
            assert sub.take_fired() is None
            assert not await sub.wait(0.01)
            assert sub.take_fired() == set()

    asyncio.run(main())


def test_a_handover_is_taken_only_by_a_subscription_that_takes_them_and_had_no_other_news() -> (
    None
):
    async def main() -> None:
        hub = Hub("postgresql://unused")
        async with (
            hub.subscribe(["i:a"], handovers=True) as owner,
            hub.subscribe(["i:a"]) as follower,
        ):
            assert hub.awaits_handover("i:a") and not hub.awaits_handover("i:b")
            hub.woke(41, ["i:a"], {"i:a": "finished"})
            assert woken(owner) and woken(follower)
            assert owner.take_handed() == {"i:a": "finished"}
            assert follower.take_handed() == {}  # an administrator's log stream, say
            # Another wake for the same key, before or after it: the handover is not all the
            # news, the waiter reads instead.
            hub._on_notify(None, 7, "ch", "i:a")
            hub.woke(42, ["i:a"], {"i:a": "finished"})
            assert owner.take_handed() == {}
            hub.woke(43, ["i:a"], {"i:a": "finished"})
            hub._on_notify(None, 7, "ch", "i:a")
            assert owner.take_handed() == {}

    asyncio.run(main())


def test_an_echo_that_comes_while_its_transaction_commits_waits_for_the_handover() -> None:
    async def main() -> None:
        hub = Hub("postgresql://unused")
        async with hub.subscribe(["i:a", "q"], handovers=True) as sub:
            async with hub.holding(41):
                hub._on_notify(None, 41, "ch", "i:a")  # before the commit returned here
                hub._on_notify(None, 41, "ch", "q")
                hub._on_notify(None, 7, "ch", "i:b")  # another backend's: not held
                assert not woken(sub)
                hub.woke(41, ["i:a"], {"i:a": "finished"})
            assert woken(sub)
            assert sub.take_handed() == {"i:a": "finished"}
            assert sub.take_fired() == {"i:a", "q"}  # "q" delivered as it came
            hub._on_notify(None, 41, "ch", "i:a")  # a later commit's: never swallowed
            assert woken(sub) and sub.take_fired() == {"i:a"}
            async with hub.holding(41):  # a transaction that failed after its notification came
                hub._on_notify(None, 41, "ch", "q")
                assert not woken(sub)
            assert woken(sub) and sub.take_fired() == {"q"}

    asyncio.run(main())


def test_a_nodes_mark_moves_with_every_wake_for_it_and_a_reconnect() -> None:
    hub = Hub("postgresql://unused")
    first = hub.mark("n:1")
    hub._on_notify(None, 7, "ch", "i:a")  # not the node's
    assert hub.mark("n:1") == first
    hub.woke(41, ["n:1"])
    second = hub.mark("n:1")
    assert second != first
    hub._on_notify(None, 41, "ch", "n:1")  # the echo of that wake: no news
    assert hub.mark("n:1") == second
    hub._wake_all()
    assert hub.mark("n:1") != second
    # A poll answered here, delivering x, leaves the mark: the next poll of that start may
    # wait without reading only if the mark has not moved and it runs x.
    polls = notify.Polls()
    mark = hub.mark("n:1")
    polls.answered(1, 5, mark, ["x"])
    assert not polls.unchanged(1, 5, mark, [])  # x's answer was lost: read, deliver again
    polls.answered(1, 5, mark, ["x"])
    assert not polls.unchanged(1, 6, mark, ["x"])  # another start of the node
    polls.answered(1, 5, mark, ["x"])
    assert polls.unchanged(1, 5, mark, ["x", "y"])
    assert not polls.unchanged(1, 5, mark, ["x"]), "one answer, one poll: taken"
    polls.answered(1, 5, mark, ["x"])
    hub.woke(41, ["n:1"])
    assert not polls.unchanged(1, 5, hub.mark("n:1"), ["x"])
