"""fair's least attained service, live: a new call takes the place of its group's call that
has received more GPU service, that call is preempted (SIGTERM) and queued again keeping the
service it received, and it finishes once the new call is done."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

import sdk
from tests.conftest import Cluster, running, wait_until


def hold(directory: str, name: str) -> str:
    """Notes each start, then runs until ``directory/release`` exists."""
    import os
    import time

    with open(os.path.join(directory, f"{name}.started"), "a") as file:
        file.write("x")
    while not os.path.exists(os.path.join(directory, "release")):
        time.sleep(0.05)
    return f"{name} done"


def quick(name: str) -> str:
    return f"{name} done"


@pytest.fixture
def fair(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with running(Cluster(database_url, tmp_path), request,
                 options={"scheduler-policy": "fair"}) as cluster:  # fmt: skip
        yield cluster


async def _served(database_url: str, call: str, set_to: float | None = None) -> float:
    conn = await asyncpg.connect(database_url)
    try:
        if set_to is not None:
            await conn.execute(
                "UPDATE invocations SET attained_gpu_s = $2 WHERE id = $1", uuid.UUID(call), set_to
            )
        return float(
            await conn.fetchval(
                "SELECT attained_gpu_s FROM invocations WHERE id = $1", uuid.UUID(call)
            )
        )
    finally:
        await conn.close()


def test_a_new_call_takes_the_place_of_one_that_received_more_service(
    fair: Cluster, tmp_path: Path
) -> None:
    fair.set_group("vision", 1)
    alice = fair.add_user("alice", group="vision")
    fair.start_nodelet(fake_gpus=1)
    sdk.connect(fair.url, alice)
    long = sdk.function(gpus=1)(hold).spawn(str(tmp_path), "long")
    wait_until(lambda: (tmp_path / "long.started").exists(), 30, "the long call to start")
    # As if it had already run for 14 GPU-hours before an earlier preemption: class 2.
    asyncio.run(_served(fair.database_url, long.id, 50_000.0))

    new = sdk.function(gpus=1)(quick).spawn("new")
    assert new.result(timeout=90) == "new done"  # it did not wait for the long call
    status = long.status()
    assert status.preemptions == 1, status
    assert "received less service" in (status.preempt_reason or ""), status.preempt_reason
    # Queued again with what it received: its runs so far, the one just stopped included.
    assert asyncio.run(_served(fair.database_url, long.id)) > 50_000.0

    (tmp_path / "release").touch()
    assert long.result(timeout=90) == "long done"
    assert (tmp_path / "long.started").read_text() == "xx"  # it ran again, after "new"
