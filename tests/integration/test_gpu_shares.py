"""Calls that ask for part of a GPU, live: they run beside each other on one GPU (of one
user's unless the gateway allows sharing across users), each told its part, charged its part,
and bad amounts are refused with what to ask for instead."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import sdk
from bulletin import admin
from tests.conftest import Cluster, running, wait_until


def share_hold(directory: str, name: str) -> str:
    """Notes its GPUs and its part of them, then runs until ``directory/release`` exists."""
    import os
    import time

    seen = f"{os.environ.get('CUDA_VISIBLE_DEVICES')} {os.environ.get('BULLETIN_GPU_SHARE')}"
    with open(os.path.join(directory, f"{name}.started"), "w") as file:
        file.write(seen)
    while not os.path.exists(os.path.join(directory, "release")):
        time.sleep(0.05)
    return f"{name} done"


def started(directory: Path, name: str) -> str | None:
    path = directory / f"{name}.started"
    return path.read_text() if path.exists() else None


@pytest.fixture
def fair(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with running(Cluster(database_url, tmp_path), request,
                 options={"scheduler-policy": "fair"}) as cluster:  # fmt: skip
        yield cluster


def test_parts_of_a_gpu_run_beside_each_other_and_are_charged_their_part(
    fair: Cluster, tmp_path: Path
) -> None:
    fair.set_group("vision", 1)
    alice = fair.add_user("alice", group="vision")
    bob = fair.add_user("bob", group="vision")
    fair.start_nodelet(fake_gpus=1)
    half = sdk.function(gpus=0.5, max_retries=0)(share_hold)
    quarter = sdk.function(gpus=0.25, max_retries=0)(share_hold)
    sdk.connect(fair.url, alice)
    first = half.spawn(str(tmp_path), "a1")
    wait_until(lambda: started(tmp_path, "a1"), 30, "alice's first half")
    assert started(tmp_path, "a1") == "0 0.5"  # its GPU, and its part of it
    assert first.info().gpus == 0.5

    sdk.connect(fair.url, bob)  # half the GPU is free, but it is alice's to share
    bobs = quarter.spawn(str(tmp_path), "b1")
    wait_until(lambda: bobs.status().reason is not None, 30, "the scheduler's explanation")
    assert bobs.status() == "queued" and "0.25 of one GPU" in (bobs.status().reason or "")

    sdk.connect(fair.url, alice)
    second = half.spawn(str(tmp_path), "a2")
    wait_until(lambda: started(tmp_path, "a2"), 30, "alice's second half beside her first")
    assert started(tmp_path, "a2") == "0 0.5" and bobs.status() == "queued"
    third = half.spawn(str(tmp_path), "a3")  # the GPU is full
    wait_until(lambda: third.status().reason is not None, 30, "the scheduler's explanation")
    assert third.status() == "queued"
    assert "0.5 of one GPU" in (third.status().reason or "")

    (tmp_path / "release").touch()
    assert first.result(timeout=60) == "a1 done" and second.result(timeout=60) == "a2 done"
    assert third.result(timeout=60) == "a3 done" and bobs.result(timeout=60) == "b1 done"
    b, a = bobs.info().timeline, third.info().timeline  # never on the GPU together
    assert b.started >= a.finished or a.started >= b.finished, (a, b)  # type: ignore[operator]

    rows: list[admin.db.UsageRow] = []

    def accounted() -> bool:
        rows[:] = asyncio.run(admin.usage(fair.database_url, 1))
        calls = {r.user: r.calls for r in rows}
        return calls.get("alice") == 3 and calls.get("bob") == 1

    wait_until(accounted, 15, "the leader to accrue the usage")
    alices = next(r for r in rows if r.user == "alice")
    held = sum(
        0.5 * (c.info().timeline.finished - c.info().timeline.scheduled)  # type: ignore[operator]
        for c in (first, second, third)
    )
    assert held * 0.9 - 0.5 <= alices.gpu_seconds <= held * 1.1 + 0.5, (alices, held)


def test_the_admin_may_let_users_share_a_gpu(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options = {"scheduler-policy": "fair", "share-gpus-across-users": "true"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        alice, bob = cluster.add_user("alice"), cluster.add_user("bob")
        cluster.start_nodelet(fake_gpus=1)
        sdk.connect(cluster.url, alice)
        mine = sdk.function(gpus=0.5, max_retries=0)(share_hold).spawn(str(tmp_path), "a")
        wait_until(lambda: started(tmp_path, "a"), 30, "alice's half")
        sdk.connect(cluster.url, bob)
        bobs = sdk.function(gpus=0.25, max_retries=0)(share_hold).spawn(str(tmp_path), "b")
        wait_until(lambda: started(tmp_path, "b"), 30, "bob's quarter beside alice's half")
        assert started(tmp_path, "b") == "0 0.25"
        (tmp_path / "release").touch()
        assert mine.result(timeout=60) == "a done" and bobs.result(timeout=60) == "b done"


def test_amounts_that_are_not_whole_gpus_nor_part_of_one_are_refused(fair: Cluster) -> None:
    for amount in (1.5, -0.5, 1.0):
        with pytest.raises(TypeError, match="or part of one between 0 and 1"):
            sdk.function(gpus=amount)
    with pytest.raises(ValueError, match="gpus must be"):
        sdk.function(gpus=-1)
    headers = {"Authorization": f"Bearer {fair.token}"}
    with pytest.raises(ValueError, match="gpus must be"):
        sdk.function(gpus=0.001)  # 1,000 calls on one GPU would be 1,000 processes on its node
    for bad in ("1.5", "1.0", "0.0", "0.001"):
        body = f'{{"calls": [{{"payload": "", "gpus": {bad}}}]}}'
        r = httpx.post(f"{fair.url}/v1/invocations", content=body, headers=headers, timeout=30)
        assert r.status_code == 422, (bad, r.text)
        assert "`gpus`: The GPUs the call needs: a whole number" in r.text, r.text
        assert "from 0.05 to below 1" in r.text, r.text


def gpu_part() -> str:
    import os

    return os.environ["BULLETIN_GPU_SHARE"]


def test_a_registered_function_keeps_its_part_of_a_gpu_when_invoked_with_json(
    fair: Cluster,
) -> None:
    fair.start_nodelet(fake_gpus=1)
    sdk.connect(fair.url, fair.token)
    info = sdk.function(gpus=0.25)(gpu_part).register("part")
    assert info.resources.gpus == 0.25
    r = httpx.post(
        f"{fair.url}/v1/functions/part/invoke",
        params={"wait": "60"},
        json={"args": []},
        headers={"Authorization": f"Bearer {fair.token}"},
        timeout=90,
    )
    assert r.status_code == 200, r.text
    assert r.json()["result_json"] == "0.25" and r.json()["gpus"] == 0.25
