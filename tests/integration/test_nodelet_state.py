"""The nodelet's handling of big call state, against a real gateway and PostgreSQL: payloads
streamed from the gateway into a file, inline or read in place from the shared directory;
results inline, streamed up from a spilled file, or passed on by name from the shared
directory. Attempts run in a stand-in worker process (``stand_in_worker.py``) that speaks the
worker protocol but unpickles nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bulletin_core import shared, wire
from nodelet.accounts import Accounts
from nodelet.agent import shared_dir_seen
from nodelet.attempt import Attempt, NodeFacts, removals_done
from nodelet.client import GatewayClient
from nodelet.gpus import FakeGpuProvider
from nodelet.pool import WorkerPool
from nodelet.userfiles import Opened
from tests.conftest import Cluster, running
from tests.integration.test_gateway_api import Http, status, submit

STAND_IN = [sys.executable, str(Path(__file__).with_name("stand_in_worker.py"))]
MiB = 1 << 20


@dataclass
class Node:
    """A registered node: its client, its registration and a pool of stand-in workers."""

    client: GatewayClient
    registration: wire.RegisterResponse
    pool: WorkerPool
    work_dir: Path

    async def facts(self, registration: wire.RegisterResponse | None = None) -> NodeFacts:
        registration = registration or self.registration
        return NodeFacts(
            node="n1",
            work_dir=str(self.work_dir),
            inline_limit=registration.inline_limit,
            log_flush_s=0.02,
            gpus=FakeGpuProvider(1),
            cluster_shared_dir=registration.shared_dir,
            shared_dir=await shared_dir_seen(registration),
            accounts=Accounts.from_setting("", trusted_users="*"),
        )

    async def run_one(self, facts: NodeFacts | None = None) -> None:
        """Poll for one assignment and run it to completion."""
        poll = await self.client.poll([], hold_s=5)
        [assignment] = poll.assignments
        attempt = Attempt(
            assignment, client=self.client, pool=self.pool, facts=facts or await self.facts()
        )
        await asyncio.wait_for(attempt.start(), 60)
        await removals_done(10)  # the attempt's directory goes in a task of its own

    def tasks(self) -> list[dict[str, Any]]:
        """What the stand-in worker recorded of each task it ran."""
        path = self.work_dir / "tasks.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]


def node(cluster: Cluster, tmp_path: Path) -> AbstractAsyncContextManager[Node]:
    """Node n1 of the cluster, registered when entered (in the test's event loop)."""
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    return _registered(cluster.url, cluster.node_token("n1").read_text(), work_dir)


@asynccontextmanager
async def _registered(url: str, token: str, work_dir: Path) -> AsyncIterator[Node]:
    client = GatewayClient(url, token)
    pool = WorkerPool(0, cwd=str(work_dir), command=STAND_IN)
    try:
        registration = await client.register(
            wire.RegisterRequest(name="n1", gpus=FakeGpuProvider(1).discover(), cpu_slots=1)
        )
        yield Node(client, registration, pool, work_dir)
    finally:
        await pool.close()
        await client.aclose()


def run_one(cluster: Cluster, tmp_path: Path) -> list[dict[str, Any]]:
    """Register node n1, run the one call assigned to it, and say what its worker saw."""
    n1 = node(cluster, tmp_path)  # outside the event loop: it makes n1's token

    async def run() -> list[dict[str, Any]]:
        async with n1 as n:
            await n.run_one()
            return n.tasks()

    return asyncio.run(run())


def blob(user: Http, data: bytes) -> str:
    r = user.client.put("/v1/blobs", content=data)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def spec(**payload: Any) -> wire.CallSpec:
    return wire.CallSpec(idempotency_key=uuid.uuid4().hex, **payload)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_big_payload_arrives_in_a_file_and_a_spilled_result_goes_up_as_a_blob(
    gateway: Cluster, tmp_path: Path
) -> None:
    user = Http(gateway.url, gateway.token)
    data = os.urandom(9 * MiB + 7)  # over two 4 MiB transfer chunks, and not a multiple
    payload = b"echo\n" + data
    [invocation_id] = submit(user, spec(payload_blob=blob(user, payload)))

    [task] = run_one(gateway, tmp_path)
    # Streamed into the attempt's directory, byte for byte; never down the worker's pipe.
    assert not task["inline"] and task["payload_path"].endswith("/payload.bin")
    assert (task["payload_size"], task["payload_sha256"]) == (len(payload), sha256(payload))
    # The worker writes into the account's own directory of the attempt's.
    assert task["spill_dir"] == os.path.join(os.path.dirname(task["payload_path"]), "out")
    assert (task["device"], task["inline_limit"], task["shared_dir"]) == ("cpu", MiB, None)
    done = status(user, invocation_id)
    assert done.state == wire.State.SUCCEEDED, done
    assert done.result is None and done.result_file is None and done.result_blob is not None
    assert user.get(f"/v1/blobs/{done.result_blob}").content == data
    # The attempt's directory, with the payload and the spilled result, is gone.
    assert not list((tmp_path / "work").glob("attempt-*"))


def test_a_small_payload_and_result_travel_inline(gateway: Cluster, tmp_path: Path) -> None:
    user = Http(gateway.url, gateway.token)
    [invocation_id] = submit(user, spec(payload=b"echo\nsmall"))

    [task] = run_one(gateway, tmp_path)
    assert task["inline"] and task["payload_path"] is None and task["spill_dir"]
    done = status(user, invocation_id)
    assert (done.state, done.result, done.result_blob) == (wire.State.SUCCEEDED, b"small", None)


def test_a_shared_directory_payload_is_read_in_place_and_a_shared_result_passes_by_name(
    shared_gateway: Cluster, tmp_path: Path
) -> None:
    root = shared_gateway.shared_dir
    assert root is not None
    user = Http(shared_gateway.url, shared_gateway.token)
    data = os.urandom(3 * MiB)
    name = shared.payload_name("alice")
    shared.write_file(str(root), name, [b"echo-shared\n" + data])
    [invocation_id] = submit(user, spec(payload_file=name))

    [task] = run_one(shared_gateway, tmp_path)
    assert not task["inline"] and task["payload_path"] is None and task["payload_file"] == name
    assert task["shared_dir"] == str(root)
    # The one name this attempt's result may have, in the owner's directory.
    assert task["shared_result"] == shared.result_name("alice", invocation_id, 1)
    done = status(user, invocation_id)
    assert done.state == wire.State.SUCCEEDED, done
    assert done.result is None and done.result_blob is None
    assert done.result_file == task["shared_result"]
    assert (root / done.result_file).read_bytes() == data


def test_a_node_that_does_not_see_the_shared_directory_fails_such_calls_clearly(
    shared_gateway: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = shared_gateway.shared_dir
    assert root is not None
    user = Http(shared_gateway.url, shared_gateway.token)
    name = shared.payload_name("alice")
    shared.write_file(str(root), name, [b"echo\nx"])
    [invocation_id] = submit(user, spec(payload_file=name))

    n1 = node(shared_gateway, tmp_path)

    async def run() -> list[dict[str, Any]]:
        async with n1 as n:
            # This node has the path, but another cluster's directory is mounted there.
            elsewhere = msgspec.structs.replace(n.registration, shared_dir_id="another-cluster")
            facts = await n.facts(elsewhere)
            assert facts.shared_dir is None and facts.cluster_shared_dir == str(root)
            await n.run_one(facts)
            return n.tasks()

    with caplog.at_level(logging.WARNING, logger="nodelet.agent"):
        assert asyncio.run(run()) == []  # no worker ever saw the call
    [warning] = [r.getMessage() for r in caplog.records if r.name == "nodelet.agent"]
    assert f"does not see the cluster's shared directory {root}" in warning
    done = status(user, invocation_id)
    assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.BAD_PAYLOAD)
    message = done.error_message or ""
    assert str(root) in message and "'n1' does not see" in message
    assert "mount the shared directory at the same path on every node" in message


def test_without_the_shared_directory_a_big_result_goes_as_a_blob(
    shared_gateway: Cluster, tmp_path: Path
) -> None:
    user = Http(shared_gateway.url, shared_gateway.token)
    data = os.urandom(2 * MiB)
    [invocation_id] = submit(user, spec(payload_blob=blob(user, b"echo-shared\n" + data)))

    n1 = node(shared_gateway, tmp_path)

    async def run() -> list[dict[str, Any]]:
        async with n1 as n:
            unmounted = msgspec.structs.replace(n.registration, shared_dir=str(tmp_path / "no"))
            await n.run_one(await n.facts(unmounted))
            return n.tasks()

    [task] = asyncio.run(run())
    assert task["shared_dir"] is None
    done = status(user, invocation_id)
    assert done.state == wire.State.SUCCEEDED and done.result_file is None
    assert user.get(f"/v1/blobs/{done.result_blob}").content == data


def test_a_result_file_outside_the_spill_and_shared_directories_is_refused(
    gateway: Cluster, tmp_path: Path
) -> None:
    user = Http(gateway.url, gateway.token)
    [invocation_id] = submit(user, spec(payload=b"outside\nsecret"))

    run_one(gateway, tmp_path)
    done = status(user, invocation_id)
    assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.WORKER_DIED)
    assert "neither its spill_dir's result.bin nor" in (done.error_message or "")
    assert done.result is None and done.result_blob is None


def test_a_result_over_max_state_bytes_fails_the_call(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = Cluster(database_url, tmp_path)
    with running(cluster, request, options={"max-state-bytes": str(2 * MiB)}):
        user = Http(cluster.url, cluster.token)
        # A payload under the limit whose result (twice its data) is over it.
        [invocation_id] = submit(
            user, spec(payload_blob=blob(user, b"double\n" + b"x" * (MiB + 1)))
        )

        run_one(cluster, tmp_path)
        done = status(user, invocation_id)
        assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.USER)
        message = done.error_message or ""
        assert message.startswith("the call's result could not be stored: the body is")
        assert "max_state_bytes" in message


# ------------------------------------------------------------------ the client streams, bounded


async def _transfer(
    n1: AbstractAsyncContextManager[Node], path: Path
) -> tuple[list[int], list[wire.BlobRef]]:
    """Download the payload into ``path``, then upload it twice as result blobs (as a retry
    would); the traced memory peak of each step, and the blobs."""
    async with n1 as n:
        [work] = (await n.client.poll([], hold_s=5)).assignments
        ids = (work.invocation_id, work.epoch)
        peaks, refs = [], []
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            size = await n.client.payload_to_file(*ids, fd)
            peaks.append(tracemalloc.get_traced_memory()[1])
            for _ in range(2):
                tracemalloc.reset_peak()
                opened = Opened(fd, os.fstat(fd).st_size)
                refs.append(await n.client.upload_result_file(*ids, opened))
                peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
            os.close(fd)
        assert size == path.stat().st_size
        return peaks, refs


def test_the_client_streams_payloads_and_results_through_files(
    gateway: Cluster, tmp_path: Path
) -> None:
    user = Http(gateway.url, gateway.token)
    data = os.urandom(64 * MiB)
    submit(user, spec(payload_blob=blob(user, data)))
    target = tmp_path / "transfer" / "payload.bin"
    target.parent.mkdir()
    peaks, refs = asyncio.run(_transfer(node(gateway, tmp_path), target))
    assert target.read_bytes() == data
    for ref in refs:  # each upload read the file afresh
        assert ref.size == len(data)
        assert user.get(f"/v1/blobs/{ref.id}").content == data
    # A few 4 MiB chunks at most in memory, never the 64 MiB whole.
    assert max(peaks) < 16 * MiB, peaks
