"""Big call state through the gateway: the cluster route, payloads and results as files of the
shared directory (NAS), its sweeper, and the size limit on blobs. Real gateway and PostgreSQL;
the nodelet's part is played by hand."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import asyncpg
import httpx
import msgspec
import pytest

from bulletin_core import shared, wire
from tests.conftest import Cluster, GatewayExited, running, wait_until
from tests.integration.test_gateway_api import Http, call, poll, register, status, submit


def cluster_info(gateway: Cluster) -> wire.ClusterInfo:
    r = Http(gateway.url, gateway.token).get("/v1/cluster")
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=wire.ClusterInfo)


#: A payload file of alice's (the fixtures' user) in her directory of the shared directory.
ALICES = "bulletin/users/alice/payload-call.bin"


def file_call(name: str = ALICES, **kw: object) -> wire.CallSpec:
    return wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload_file=name, **kw)  # type: ignore[arg-type]


def test_the_cluster_route_says_there_is_no_shared_directory(gateway: Cluster) -> None:
    assert cluster_info(gateway) == wire.ClusterInfo(
        inline_limit=1 << 20,
        max_state_bytes=16 << 30,
        shared_dir=None,
        shared_dir_id=None,
        user="alice",
        keepalive_s=10.0,  # caller_timeout_s (60 s) / 6
    )
    assert httpx.get(f"{gateway.url}/v1/cluster").status_code == 401
    node = Http(gateway.url, gateway.node_token("n1").read_text())
    assert node.get("/v1/cluster").status_code == 403


def test_the_cluster_route_and_registration_name_the_shared_directory(
    shared_gateway: Cluster,
) -> None:
    root = shared_gateway.shared_dir
    assert root is not None
    info = cluster_info(shared_gateway)
    assert info.shared_dir == str(root)
    assert info.shared_dir_id == (root / shared.MARKER).read_text().strip()
    assert shared.sees(info.shared_dir, info.shared_dir_id)
    assert info.user == "alice" and info.shared_ttl_s == 86400
    # Anyone may make their own directory in users/; nobody may list or remove another's.
    assert (root / shared.USERS).stat().st_mode & 0o7777 == 0o1733
    node = Http(shared_gateway.url, shared_gateway.node_token("n1").read_text())
    r = node.post("/v1/node/register", wire.RegisterRequest(name="n1", gpus=[], cpu_slots=1))
    registered = msgspec.json.decode(r.content, type=wire.RegisterResponse)
    assert (registered.shared_dir, registered.shared_dir_id) == (
        info.shared_dir,
        info.shared_dir_id,
    )


def test_a_payload_file_needs_a_shared_directory(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    r = user.post("/v1/invocations", wire.SubmitRequest(calls=[call(), file_call()]))
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert detail.startswith("calls[1].payload_file: this cluster has no shared directory")
    assert "PUT /v1/blobs" in detail and "payload_blob" in detail


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "/etc/passwd",
        "bulletin/users/alice/../bob/payload-x.bin",
        "bulletin/users/alice/..",
        "bulletin/users/alice/result-x-1.bin",  # a result file is no payload
        "bulletin/users/alice/",
        "bulletin/users/alice/a/payload-b.bin",
        "bulletin/payloads/abc.bin",  # the old, shared layout
        # Another user's payload: submitting it would run their code on their arguments.
        "bulletin/users/bob/payload-call.bin",
    ],
)
def test_a_payload_file_must_be_a_payload_of_the_submitters_own(
    shared_gateway: Cluster, name: str
) -> None:
    user = Http(shared_gateway.url, shared_gateway.token)
    r = user.post("/v1/invocations", wire.SubmitRequest(calls=[call(), file_call(name)]))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    if name.startswith("bulletin/users/bob/"):
        assert r.json()["code"] == "payload_file_not_yours"
        assert "yours go in bulletin/users/alice/" in r.json()["detail"]


def test_a_call_carries_exactly_one_payload(shared_gateway: Cluster) -> None:
    user = Http(shared_gateway.url, shared_gateway.token)
    both = file_call(payload=b"inline")
    r = user.post("/v1/invocations", wire.SubmitRequest(calls=[both]))
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "calls[0] needs exactly one of payload, payload_blob and payload_file"
    )


def test_a_payload_file_reaches_the_node_and_the_result_file_the_caller(
    shared_gateway: Cluster,
) -> None:
    user = Http(shared_gateway.url, shared_gateway.token)
    node = register(shared_gateway)
    [invocation_id] = submit(user, file_call(ALICES, gpus=1))
    [work] = poll(node).assignments
    assert (work.payload, work.payload_file) == (None, ALICES)
    assert (work.owner_name, work.owner_admin) == ("alice", False)
    base = f"/v1/node/invocations/{invocation_id}"
    r = node.get(f"{base}/payload", params={"epoch": work.epoch})
    assert r.status_code == 404 and r.json()["code"] == "payload_is_a_file"
    assert ALICES in r.json()["detail"]

    def complete(**result: object) -> httpx.Response:
        return node.post(
            f"{base}/complete",
            wire.CompleteRequest(epoch=work.epoch, state="succeeded", **result),  # type: ignore[arg-type]
        )

    own = shared.result_name("alice", invocation_id, work.epoch)
    assert own == f"bulletin/users/alice/result-{invocation_id}-{work.epoch}.bin"
    assert complete(result_file="bulletin/users/alice/..").status_code == 422
    assert complete(result_file="../x").status_code == 422
    assert complete(result=b"r", result_file=own).status_code == 422
    # Any other file, even a well-formed one, is not this attempt's result: another user's
    # (which the gateway would then serve to alice), another invocation's, another epoch's.
    for other in (
        shared.result_name("bob", invocation_id, work.epoch),
        shared.result_name("alice", str(uuid.uuid4()), work.epoch),
        shared.result_name("alice", invocation_id, work.epoch + 1),
    ):
        r = complete(result_file=other)
        assert r.status_code == 422 and r.json()["code"] == "result_file_not_bound", r.text
        assert own in r.json()["detail"]
    assert status(user, invocation_id).state == wire.State.ASSIGNED
    assert complete(result_file=own).status_code == 204
    done = status(user, invocation_id)
    assert (done.state, done.result, done.result_blob, done.result_file) == (
        wire.State.SUCCEEDED,
        None,
        None,
        own,
    )
    [listed] = user.get("/v1/invocations").json()
    assert listed["result_file"] == own


def test_a_result_file_needs_a_shared_directory(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(gpus=1))
    [work] = poll(node).assignments
    done = wire.CompleteRequest(
        epoch=work.epoch,
        state="succeeded",
        result_file=shared.result_name("alice", invocation_id, work.epoch),
    )
    r = node.post(f"/v1/node/invocations/{invocation_id}/complete", done)
    assert r.status_code == 422 and "no shared directory" in r.json()["detail"]
    assert status(user, invocation_id).state == wire.State.ASSIGNED


def test_old_files_are_swept_from_the_shared_directory_and_new_ones_kept(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = tmp_path / "nas"
    root.mkdir()
    shared.prepare(str(root))
    hour_ago = time.time() - 3600
    mine = root / shared.user_dir("alice")
    mine.mkdir(mode=0o700)
    old_payload, old_result, new_payload, new_result, other = (
        mine / "payload-old.bin",
        mine / "result-old-1.bin",
        mine / "payload-new.bin",
        mine / "result-new-1.bin",
        mine / "notes.txt",  # not a file of the layout: never touched
    )
    for path in (old_payload, old_result, new_payload, new_result, other):
        path.write_bytes(b"state")
    os.utime(other, (hour_ago, hour_ago))
    for path in (old_payload, old_result):
        os.utime(path, (hour_ago, hour_ago))
    cluster = Cluster(database_url, tmp_path)
    cluster_id = (root / shared.MARKER).read_text()
    # Swept at start, then every quarter of the time to live (here 10 minutes).
    with running(cluster, request, shared_dir=root, options={"shared-ttl-s": "600"}):
        wait_until(lambda: not old_payload.exists() and not old_result.exists(), 10, "a sweep")
        assert new_payload.exists() and new_result.exists() and other.exists()
        assert (root / shared.MARKER).read_text() == cluster_id  # the same cluster again


def test_a_missing_shared_directory_stops_the_gateway(database_url: str, tmp_path: Path) -> None:
    cluster = Cluster(database_url, tmp_path)
    with pytest.raises(GatewayExited):
        cluster.start_gateway(**{"shared-dir": str(tmp_path / "not-mounted")})
    assert "does not exist" in (tmp_path / "gateway.log").read_text()


async def _blob_rows(database_url: str) -> tuple[int, int]:
    conn = await asyncpg.connect(database_url)
    try:
        blobs = await conn.fetchval("SELECT count(*) FROM blobs")
        chunks = await conn.fetchval("SELECT count(*) FROM blob_chunks")
        return int(blobs), int(chunks)
    finally:
        await conn.close()


def test_blobs_over_max_state_bytes_get_413_and_leave_nothing_stored(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    limit = 5 << 20  # more than one 4 MiB chunk row, so a cut-off upload has stored some
    cluster = Cluster(database_url, tmp_path)
    with running(cluster, request, options={"max-state-bytes": str(limit)}):
        user = Http(cluster.url, cluster.token)
        assert cluster_info(cluster).max_state_bytes == limit
        data = b"x" * (limit + 1)
        declared = user.client.put("/v1/blobs", content=data)
        assert declared.status_code == 413
        problem = declared.json()
        assert problem["code"] == "state_too_large"
        assert f"{limit + 1} bytes" in problem["detail"] and f"{limit} bytes" in problem["detail"]
        assert "max_state_bytes" in problem["detail"]
        # Streamed without a Content-Length: cut off once it runs over the limit.
        pieces = iter([data[: 3 << 20], data[3 << 20 :]])
        streamed = user.client.put("/v1/blobs", content=pieces)
        assert streamed.status_code == 413 and "max_state_bytes" in streamed.json()["detail"]
        assert asyncio.run(_blob_rows(database_url)) == (0, 0)
        # Exactly at the limit is fine.
        assert user.client.put("/v1/blobs", content=data[:limit]).status_code == 201
        # The node's result upload has the same limit.
        node = register(cluster)
        [invocation_id] = submit(user, call(gpus=1))
        [work] = poll(node).assignments
        r = node.client.put(
            f"/v1/node/invocations/{invocation_id}/result",
            params={"epoch": work.epoch},
            content=iter([data[: 3 << 20], data[3 << 20 :]]),
        )
        assert r.status_code == 413 and "max_state_bytes" in r.json()["detail"]
        assert asyncio.run(_blob_rows(database_url)) == (1, 2)  # the one complete upload


def test_the_sweep_keeps_the_payload_of_a_call_that_may_still_run(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = tmp_path / "nas"
    cluster = Cluster(database_url, tmp_path)
    # Files live 2 s; the sweep runs every half second.
    with running(cluster, request, shared_dir=root, options={"shared-ttl-s": "2"}):
        user = Http(cluster.url, cluster.token)
        mine = root / shared.user_dir("alice")
        mine.mkdir(mode=0o700)
        queued, orphan = mine / "payload-queued.bin", mine / "payload-x.bin"
        for path in (queued, orphan):
            path.write_bytes(b"state")
        [invocation_id] = submit(
            user, call(payload=None, payload_file="bulletin/users/alice/payload-queued.bin")
        )
        wait_until(lambda: not orphan.exists(), 10, "the orphan to be swept")
        assert queued.exists()  # no node: the call is still queued, its payload must stay
        cancelled = user.post("/v1/invocations/cancel", wire.CancelRequest(ids=[invocation_id]))
        assert cancelled.status_code == 200, cancelled.text
        wait_until(lambda: not queued.exists(), 10, "the cancelled call's payload to be swept")


def test_what_a_user_keeps_in_the_shared_directory_counts_towards_their_storage_limit(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The gateway cannot read a user's 0700 directory, so it counts what it is told: the
    payload files of the user's calls that may still run (as declared), and result files not
    yet fetched (as their node reported them). Over the limit, new calls get 507."""
    kib = 1024
    cluster = Cluster(database_url, tmp_path)
    options = {"user-storage-mb": "1"}
    with running(cluster, request, shared_dir=tmp_path / "nas", options=options):
        user = Http(cluster.url, cluster.token)
        node = register(cluster)
        first = file_call(ALICES, payload_size=800 * kib, gpus=1)
        [invocation_id] = submit(user, first)
        over = file_call("bulletin/users/alice/payload-more.bin", payload_size=300 * kib)
        r = user.post("/v1/invocations", wire.SubmitRequest(calls=[over]))
        assert r.status_code == 507 and r.json()["code"] == "storage_quota_exceeded", r.text
        assert "0.8 MiB in the shared directory" in r.json()["detail"]
        # The call ran; its 2 MiB result is a file of the shared directory, not fetched yet.
        [work] = poll(node).assignments
        done = wire.CompleteRequest(
            epoch=work.epoch,
            state="succeeded",
            result_file=shared.result_name("alice", invocation_id, work.epoch),
            result_size=2 << 20,
        )
        r = node.post(f"/v1/node/invocations/{invocation_id}/complete", done)
        assert r.status_code == 204, r.text
        small = file_call("bulletin/users/alice/payload-small.bin", payload_size=1)
        r = user.post("/v1/invocations", wire.SubmitRequest(calls=[small]))
        assert r.status_code == 507 and "2.0 MiB in the shared directory" in r.json()["detail"]
        # Fetched (the sdk then deletes the file): it no longer counts.
        assert status(user, invocation_id).state == wire.State.SUCCEEDED
        submit(user, small)
