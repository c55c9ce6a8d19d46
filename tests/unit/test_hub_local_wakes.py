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
