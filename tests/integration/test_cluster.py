"""Cluster-level behaviour: several gateway replicas on one database, leader failover for
scheduling, and no call stalling until a re-check timer because a notification was missed."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

import sdk
from tests.conftest import Cluster, stop_process, wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def double(x: int) -> int:
    return 2 * x


def test_replicas_share_one_database_and_a_standby_takes_over_scheduling(
    database_url: str, tmp_path: Path
) -> None:
    first = Cluster(database_url, tmp_path / "a")
    second = Cluster(database_url, tmp_path / "b")
    for replica in (first, second):
        replica.dir.mkdir()
    # Only the leader places calls here (not a submission on an idle cluster): the point is
    # who schedules.
    only_rounds = {"place-at-submit": "false"}
    try:
        first.start_gateway(**only_rounds)
        leader_log = first.dir / "gateway.log"
        wait_until(lambda: "now leads scheduling" in leader_log.read_text(), 30, "a leader")
        second.start_gateway(**only_rounds)
        # The nodelet and the user talk only to the second replica; the first one schedules.
        second.start_nodelet()
        sdk.connect(second.url, second.token)
        call = sdk.function(gpus=1)(double)
        assert call(21) == 42
        assert "now leads scheduling" not in (second.dir / "gateway.log").read_text()

        assert first.gateway is not None
        stop_process(first.gateway, signal.SIGKILL)
        assert call(4) == 8  # scheduled by the standby once the leader's lock is released
        assert "now leads scheduling" in (second.dir / "gateway.log").read_text()
    finally:
        second.stop()
        first.stop()


@pytest.mark.parametrize("calls", [40])
def test_no_call_waits_for_the_recheck_timer(database_url: str, tmp_path: Path, calls: int) -> None:
    # With the timers at 5 s, any call that relied on a timer instead of a notification (a
    # lost or unsent NOTIFY, a waiter that subscribed too late) would take seconds.
    cluster = Cluster(database_url, tmp_path)
    try:
        cluster.start_gateway(**{"recheck-s": "5", "schedule-interval-s": "5"})
        cluster.start_nodelet()
        sdk.connect(cluster.url, cluster.token)
        fn = sdk.function()(double)
        fn(0)  # the nodelet is registered and a worker is warm
        slowest = 0.0
        for i in range(calls):
            started = time.monotonic()
            assert fn(i) == 2 * i
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < 2.0, f"a call stalled for {slowest:.1f} s"
    finally:
        cluster.stop()
        if os.environ.get("BULLETIN_TEST_KEEP_LOGS"):
            print(cluster.logs())


async def _cut_every_connection(database_url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        return len(
            await conn.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
    finally:
        await conn.close()


def test_calls_keep_working_after_the_database_drops_every_connection(cluster: Cluster) -> None:
    import asyncio

    fn = sdk.function()(double)
    assert fn(1) == 2
    # What a PostgreSQL restart or failover does to the gateway: its pool, its listener and
    # its scheduler leader connection all die at once.
    assert asyncio.run(_cut_every_connection(cluster.database_url)) >= 3
    started = time.monotonic()
    assert fn(2) == 4
    assert fn(3) == 6
    assert time.monotonic() - started < 20
