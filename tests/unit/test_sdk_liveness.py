"""The sdk's keepalive thread (sdk/_liveness.py): keepalives while a call is awaited, none
once nothing is, one thread for a loop of calls, and none left behind on a worker."""

from __future__ import annotations

import time

from nodelet.worker_main import THREAD_GRACE_S
from sdk._liveness import Liveness


def test_keepalives_are_sent_while_held_and_stop_when_nothing_is() -> None:
    sent: list[float] = []
    liveness = Liveness(lambda: sent.append(time.monotonic()))
    liveness.set_interval(0.05)
    with liveness.held():
        time.sleep(0.4)
    assert len(sent) >= 4
    stopped = len(sent)
    time.sleep(0.3)
    assert len(sent) == stopped
    assert liveness._thread is None


def test_a_loop_of_blocking_calls_keeps_one_thread() -> None:
    liveness = Liveness(lambda: None)
    seen = set()
    for _ in range(30):
        with liveness.held():
            time.sleep(0.001)  # the call
            seen.add(liveness._thread)
        time.sleep(0.001)  # the loop's own work between calls
    assert len(seen) == 1


def test_a_loop_of_blocking_calls_does_not_wake_the_thread_for_every_call() -> None:
    liveness = Liveness(lambda: None)
    woken = 0
    notify_all = liveness._wake.notify_all

    def counted() -> None:
        nonlocal woken
        woken += 1
        notify_all()

    liveness._wake.notify_all = counted  # type: ignore[method-assign]
    for _ in range(40):
        with liveness.held():
            time.sleep(0.001)
        time.sleep(0.0005)
    assert woken <= 40 * 0.0015 / 0.05 + 2  # about once per LINGER_S, not once per call


def test_no_thread_outlives_its_last_holder_past_a_workers_grace_for_threads() -> None:
    """A call that uses the sdk on a worker must leave nothing that the worker would count
    as a thread left running (and retire itself for)."""
    liveness = Liveness(lambda: None)
    with liveness.held():
        thread = liveness._thread
    assert thread is not None
    thread.join(THREAD_GRACE_S)
    assert not thread.is_alive()
