"""The gateway's HTTP contract, driven with plain HTTP against a real gateway and PostgreSQL,
playing the nodelet's part by hand where a test needs exact control of a node."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import httpx
import msgspec
import pytest

from bulletin_core import wire
from tests.conftest import Cluster, running, wait_until


class Http:
    def __init__(self, url: str, token: str) -> None:
        self.client = httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=30
        )

    def post(self, path: str, msg: object, **kw: object) -> httpx.Response:
        return self.client.post(path, content=msgspec.json.encode(msg), **kw)  # type: ignore[arg-type]

    def get(self, path: str, **kw: object) -> httpx.Response:
        return self.client.get(path, **kw)  # type: ignore[arg-type]


def call(payload: bytes = b"opaque", **kw: object) -> wire.CallSpec:
    return wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=payload, **kw)  # type: ignore[arg-type]


def register(cluster: Cluster, name: str = "n1", gpus: int = 1) -> Http:
    node = Http(cluster.url, cluster.node_token(name).read_text())
    info = [
        wire.GpuInfo(index=i, uuid=f"g{i}", name="Fake", memory_mb=1, fake=True)
        for i in range(gpus)
    ]
    r = node.post("/v1/node/register", wire.RegisterRequest(name=name, gpus=info, cpu_slots=1))
    assert r.status_code == 200, r.text
    node.client.headers[wire.INCARNATION_HEADER] = str(r.json()["incarnation"])
    return node


def poll(node: Http, running: list[wire.Attempt] | None = None) -> wire.PollResponse:
    r = node.post("/v1/node/poll", wire.PollRequest(running=running or [], timeout_s=5))
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=wire.PollResponse)


def submit(user: Http, *calls: wire.CallSpec) -> list[str]:
    r = user.post("/v1/invocations", wire.SubmitRequest(calls=list(calls)))
    assert r.status_code == 201, r.text
    return msgspec.json.decode(r.content, type=wire.SubmitResponse).ids


def status(user: Http, invocation_id: str) -> wire.Invocation:
    r = user.get(f"/v1/invocations/{invocation_id}")
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=wire.Invocation)


def test_healthz_is_open_and_everything_else_needs_a_token(gateway: Cluster) -> None:
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok"}
    r = httpx.get(f"{gateway.url}/v1/invocations")
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["status"] == 401 and "Bearer" in r.json()["detail"]
    assert httpx.get(f"{gateway.url}/openapi.yaml").status_code == 401
    bad = httpx.get(f"{gateway.url}/v1/invocations", headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401


def test_token_kinds_only_work_on_their_own_routes(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = Http(gateway.url, gateway.node_token("n1").read_text())
    assert node.get("/v1/invocations").status_code == 403
    r = user.post("/v1/node/poll", wire.PollRequest(running=[]))
    assert r.status_code == 403
    assert "user token cannot be used on node routes" in r.json()["detail"]


def test_a_node_learns_its_name_and_the_shared_dir_without_disturbing_its_nodelet(
    shared_gateway: Cluster,
) -> None:
    """``GET /v1/node/cluster`` (what ``bulletin doctor node`` asks): read only, and with no
    incarnation to name, so it may be asked beside a running nodelet of the node."""
    url = shared_gateway.url
    nodelet = register(shared_gateway, "n1")
    token = nodelet.client.headers["authorization"].removeprefix("Bearer ")
    r = Http(url, token).get("/v1/node/cluster")  # no incarnation header, as the doctor asks
    assert r.status_code == 200, r.text
    info = msgspec.json.decode(r.content, type=wire.ClusterInfo)
    assert info.node == "n1" and info.user is None
    assert info.shared_dir == str(shared_gateway.shared_dir) and info.shared_dir_id
    user = Http(url, shared_gateway.token)
    told_user = msgspec.json.decode(user.get("/v1/cluster").content, type=wire.ClusterInfo)
    assert msgspec.structs.replace(info, node=None, user="alice") == told_user
    assert nodelet.get("/v1/node/cluster").json()["node"] == "n1"  # with its incarnation too

    # The nodelet is still the node's current incarnation, and gets its work.
    [invocation_id] = submit(user, call(gpus=1))
    [work] = poll(nodelet).assignments
    assert work.invocation_id == invocation_id

    r = user.get("/v1/node/cluster")
    assert r.status_code == 403 and r.json()["code"] == "wrong_token"
    r = httpx.get(f"{url}/v1/node/cluster")
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"


def test_submit_is_exactly_once_per_idempotency_key(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    spec = call()
    first = submit(user, spec)
    again = submit(user, spec, call())
    assert again[0] == first[0] and again[1] != first[0]
    listed = user.get("/v1/invocations").json()
    assert sorted(i["id"] for i in listed) == sorted(again)


def test_bad_submissions_get_problem_details_that_say_what_to_do(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    r = user.post("/v1/invocations", wire.SubmitRequest(calls=[call(gpus=-1)]))
    assert (
        r.status_code == 422 and "Expected `int` >= 0 - at `$.calls[0].gpus`" in r.json()["detail"]
    )
    big = call(payload=b"x" * (2 << 20))
    r = user.post("/v1/invocations", wire.SubmitRequest(calls=[big]))
    assert r.status_code == 413 and "PUT /v1/blobs" in r.json()["detail"]
    r = user.client.post("/v1/invocations", content=b"{not json")
    assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "malformed_json"
    assert "Traceback" not in r.text


def test_users_see_only_their_own_invocations(gateway: Cluster) -> None:
    alice = Http(gateway.url, gateway.token)
    bob = Http(gateway.url, gateway.add_user("bob"))
    [invocation_id] = submit(alice, call())
    assert bob.get(f"/v1/invocations/{invocation_id}").status_code == 404
    assert bob.client.post(f"/v1/invocations/{invocation_id}/cancel").status_code == 404
    r = bob.post(
        "/v1/invocations/watch", wire.WatchRequest(items=[wire.WatchItem(id=invocation_id)])
    )
    assert r.status_code == 404
    assert bob.get("/v1/invocations").json() == []
    # Among ids of his own, one of hers still gets 404 (never her call's state), a made-up
    # one too, and his own finished call is not marked fetched by the refused watch.
    [own] = submit(bob, call())
    assert bob.client.post(f"/v1/invocations/{own}/cancel").status_code == 200
    for foreign in (invocation_id, str(uuid.uuid4())):
        items = [wire.WatchItem(id=own), wire.WatchItem(id=foreign.upper())]
        r = bob.post("/v1/invocations/watch", wire.WatchRequest(items=items))
        assert r.status_code == 404 and foreign in r.json()["detail"], r.text
        assert "queued" not in r.text
    [listed] = msgspec.json.decode(bob.get("/v1/invocations").content, type=list[wire.Invocation])
    assert listed.state == "cancelled" and listed.timeline.fetched is None
    r = bob.post("/v1/invocations/watch", wire.WatchRequest(items=[wire.WatchItem(id=own)]))
    assert r.status_code == 200 and r.json()["invocations"][0]["timeline"]["fetched"]


def test_a_call_runs_through_the_node_routes_and_the_user_sees_logs_and_result(
    gateway: Cluster,
) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(payload=b"pickled-call", gpus=1))
    [work] = poll(node).assignments
    assert (work.invocation_id, work.payload, work.gpu_indices) == (
        invocation_id,
        b"pickled-call",
        [0],
    )
    base = f"/v1/node/invocations/{invocation_id}"
    assert node.post(f"{base}/start", wire.StartRequest(epoch=work.epoch)).status_code == 204
    chunks = [
        wire.NodeLogChunk(stream=wire.Stream.STDOUT, data=b"step 1\r"),
        wire.NodeLogChunk(stream=wire.Stream.STDERR, data=b"warn\n"),
    ]
    logs = wire.LogsRequest(epoch=work.epoch, first_seq=0, chunks=chunks)
    assert node.post(f"{base}/logs", logs).status_code == 204
    assert node.post(f"{base}/logs", logs).status_code == 204  # a retry appends nothing
    now = time.time()
    done = wire.CompleteRequest(
        epoch=work.epoch,
        state="succeeded",
        result=b"pickled-result",
        worker_acquired=now - 0.003,
        started=now - 0.002,
        finished=now - 0.001,
        warm=True,
    )
    assert node.post(f"{base}/complete", done).status_code == 204
    r = user.post(
        "/v1/invocations/watch", wire.WatchRequest(items=[wire.WatchItem(id=invocation_id)])
    )
    news = msgspec.json.decode(r.content, type=wire.WatchResponse)
    assert [(c.n, c.stream, c.data) for c in news.logs] == [
        (1, wire.Stream.STDOUT, b"step 1\r"),
        (2, wire.Stream.STDERR, b"warn\n"),
    ]
    [inv] = news.invocations
    assert inv.state == wire.State.SUCCEEDED and inv.result == b"pickled-result"
    t = inv.timeline
    steps = [t.submitted, t.scheduled, t.delivered, t.worker_acquired, t.started, t.finished]
    assert all(steps) and t.stored and t.fetched and t.warm is True, t
    assert steps == sorted(steps) and t.finished <= t.stored <= t.fetched  # type: ignore[operator]
    assert abs(t.started - done.started) < 1e-3  # type: ignore[operator]  # the node's clock
    # A second completion (a duplicate or a stale attempt) changes nothing.
    assert node.post(f"{base}/complete", done).status_code == 409


def complete_soon(node: Http, work: wire.Assignment, delay_s: float) -> None:
    """Complete ``work`` successfully from another thread, ``delay_s`` from now."""
    import threading

    def complete() -> None:
        time.sleep(delay_s)
        node.post(
            f"/v1/node/invocations/{work.invocation_id}/complete",
            wire.CompleteRequest(epoch=work.epoch, state="succeeded", result=b"r"),
        )

    threading.Thread(target=complete).start()


def test_watch_wakes_on_completion_without_waiting_for_the_recheck_timer(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(gpus=1))
    [work] = poll(node).assignments
    complete_soon(node, work, 0.3)
    started = time.monotonic()
    r = user.post(
        "/v1/invocations/watch",
        wire.WatchRequest(items=[wire.WatchItem(id=invocation_id)], timeout_s=5),
    )
    elapsed = time.monotonic() - started
    assert r.json()["invocations"][0]["state"] == "succeeded"
    # Woken by NOTIFY: well before the 1 s re-check timer would have fired after completion.
    assert elapsed < 0.3 + 0.5, elapsed


def test_a_watch_of_many_answers_those_that_finished_and_finds_one_whose_news_was_lost(
    gateway: Cluster,
) -> None:
    """A woken watch re-reads only the calls whose notifications came; the recheck timer
    still finds a call that finished without one (a notification lost to a reconnect)."""
    import asyncio
    import threading

    import asyncpg

    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    ids = submit(user, *[call() for _ in range(300)])
    watched = [wire.WatchItem(id=i) for i in ids]

    def watch() -> tuple[list[str], float]:
        started = time.monotonic()
        r = user.post("/v1/invocations/watch", wire.WatchRequest(items=watched, timeout_s=5))
        assert r.status_code == 200, r.text
        return [i["id"] for i in r.json()["invocations"]], time.monotonic() - started

    def finish_unheard(invocation_id: str) -> None:
        async def update() -> None:
            conn = await asyncpg.connect(gateway.database_url)
            try:  # as a completion would, but with no notification
                await conn.execute(
                    "UPDATE invocations SET state = 'succeeded', result = 'r', "
                    "finished_at = clock_timestamp() WHERE id = $1",
                    uuid.UUID(invocation_id),
                )
            finally:
                await conn.close()

        asyncio.run(update())

    # Woken by one completion among 300: the answer is that call.
    work = poll(node).assignments[0]
    complete_soon(node, work, 0.3)
    answered, _ = watch()
    assert answered == [work.invocation_id]
    # One that finishes with no notification while the watch waits: the recheck timer (1 s
    # here) re-reads them all and finds it.
    watched = [w for w in watched if w.id != work.invocation_id]
    unheard = next(i for i in reversed(ids) if i != work.invocation_id)
    threading.Timer(0.2, finish_unheard, args=(unheard,)).start()
    answered, took = watch()
    assert answered == [unheard] and 0.2 < took < 3, (answered, took)


def test_lost_lease_requeues_with_a_new_epoch_and_fences_the_old_attempt(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(gpus=1, max_retries=1))
    [first] = poll(node).assignments
    base = f"/v1/node/invocations/{invocation_id}"
    assert node.post(f"{base}/start", wire.StartRequest(epoch=first.epoch)).status_code == 204

    # Heartbeats keep the node alive but do not name the attempt, so its lease (3 s) runs out:
    # the scheduler returns the call to the queue and leases it again with the next epoch.
    def re_leased() -> bool:
        node.post("/v1/node/heartbeat", wire.HeartbeatRequest(running=[]))
        return status(user, invocation_id).attempts == 2

    wait_until(re_leased, 15, "the call to be re-leased")
    hb = node.post(
        "/v1/node/heartbeat",
        wire.HeartbeatRequest(
            running=[wire.Attempt(invocation_id=invocation_id, epoch=first.epoch)]
        ),
    )
    assert hb.json()["revoked"] == [{"invocation_id": invocation_id, "epoch": first.epoch}]
    late = wire.CompleteRequest(epoch=first.epoch, state="succeeded", result=b"stale")
    r = node.post(f"{base}/complete", late)
    assert r.status_code == 409 and r.json()["code"] == "stale_epoch"
    [second] = poll(node).assignments
    assert second.epoch == first.epoch + 1
    assert status(user, invocation_id).result is None


def test_a_new_incarnation_takes_back_what_the_old_held_counting_only_what_it_got(
    gateway: Cluster,
) -> None:
    """Registering again takes back the node's attempts: one it was delivered (it may have
    run) counts as an attempt, one it never got does not; and the old incarnation's
    requests are refused (409 superseded), its poll gets nothing more."""
    user = Http(gateway.url, gateway.token)
    old = register(gateway, gpus=2)
    [ran] = submit(user, call(gpus=1, max_retries=0))
    [first] = poll(old).assignments
    assert first.invocation_id == ran
    # A second call is assigned to the node too, but the node never polls for it.
    [never] = submit(user, call(gpus=1, max_retries=0))
    wait_until(lambda: status(user, never).state == "assigned", 10, "the second assignment")
    new = register(gateway, gpus=2)  # the nodelet restarted
    assert (status(user, ran).state, status(user, ran).error_kind) == ("failed", "node_lost")
    again = status(user, never)
    assert again.state in ("queued", "assigned") and again.attempts <= 1
    held = wire.HeartbeatRequest(running=[wire.Attempt(invocation_id=ran, epoch=first.epoch)])
    refused = old.post("/v1/node/heartbeat", held)
    assert refused.status_code == 409 and refused.json()["code"] == "superseded"
    [work] = poll(new).assignments
    assert work.invocation_id == never and work.epoch == 2
    assert status(user, never).attempts == 1  # its one counted attempt is this one


def test_work_placed_at_submission_goes_to_the_waiting_poll_of_its_nodes_current_start_only(
    gateway: Cluster,
) -> None:
    """A call placed as it is submitted is handed to its node's poll waiting on the same
    gateway as the placement commits; a poll of an earlier start of the node, still waiting
    when the node registered again, gets none of it."""
    user = Http(gateway.url, gateway.token)
    old = register(gateway)
    with ThreadPoolExecutor(2) as pool:
        stale = pool.submit(poll, old)
        time.sleep(0.5)  # the old start's poll is waiting
        new = register(gateway)  # the nodelet restarted
        waiting = pool.submit(poll, new)
        time.sleep(0.5)
        [invocation_id] = submit(user, call(gpus=1))
        [work] = waiting.result(10).assignments
        assert work.invocation_id == invocation_id and work.payload == b"opaque"
        assert stale.result(10).assignments == []
    assert status(user, invocation_id).timeline.delivered is not None


def test_a_poll_right_after_its_answer_may_skip_its_read_yet_misses_no_news(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A node polls again as soon as it is answered; when nothing changed since, that poll
    waits without reading first. It still misses nothing, though a lost notification would
    only be caught after 30 s here (recheck-s): work whose answer was lost (the node's next
    poll does not run it) comes again at once, and a cancellation while it waits wakes it."""
    with running(Cluster(database_url, tmp_path), request, options={"recheck-s": "30"}) as gw:
        user = Http(gw.url, gw.token)
        node = register(gw)
        [invocation_id] = submit(user, call(gpus=1))
        [work] = poll(node).assignments
        assert work.invocation_id == invocation_id
        [again] = poll(node).assignments  # the answer was lost: it is not running
        assert (again.invocation_id, again.epoch) == (invocation_id, work.epoch)
        attempt = wire.Attempt(invocation_id=invocation_id, epoch=work.epoch)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(poll, node, [attempt])  # it runs it now: nothing to read
            time.sleep(0.5)
            assert not waiting.done()
            cancelled = user.client.post(f"/v1/invocations/{invocation_id}/cancel")
            assert cancelled.json()["state"] == "cancelled"
            started = time.monotonic()
            assert waiting.result(10).revoked == [attempt]
            assert time.monotonic() - started < 4  # woken, not the 5 s hold's end


def test_a_poll_never_waits_for_work_another_transaction_is_changing(gateway: Cluster) -> None:
    """A long poll re-reads with the running list it was sent with, so work given to the node
    since (a map's next items) is not in it; it delivers what is free at once and leaves a
    row another transaction holds for its next read, instead of waiting for it (it
    deadlocked with the completion that was giving the node those items)."""
    user = Http(gateway.url, gateway.token)
    node = register(gateway, gpus=2)
    held, free = submit(user, call(gpus=1), call(gpus=1))
    wait_until(lambda: status(user, free).state == "assigned", 10, "both assigned")

    async def main() -> None:
        conn = await asyncpg.connect(gateway.database_url)
        try:
            async with conn.transaction():
                await conn.execute(
                    "SELECT 1 FROM invocations WHERE id = $1 FOR UPDATE", uuid.UUID(held)
                )
                started = time.monotonic()
                answer = await asyncio.to_thread(poll, node)
                assert [a.invocation_id for a in answer.assignments] == [free]
                assert time.monotonic() - started < 3
                # What the poll took is not held against this transaction either.
                await conn.execute(
                    "UPDATE invocations SET wait_reason = NULL WHERE id = $1", uuid.UUID(free)
                )
        finally:
            await conn.close()

    asyncio.run(main())
    # Neither runs yet: both come now, the one that was held too.
    assert {a.invocation_id for a in poll(node).assignments} == {held, free}


def test_lease_expiry_without_retries_fails_the_call_as_node_lost(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(gpus=1, max_retries=0))
    [work] = poll(node).assignments
    wait_until(lambda: status(user, invocation_id).state == "failed", 15, "node-lost failure")
    inv = status(user, invocation_id)
    assert inv.error_kind == wire.ErrorKind.NODE_LOST and "node lost" in (inv.error_message or "")
    r = node.post(
        f"/v1/node/invocations/{invocation_id}/start", wire.StartRequest(epoch=work.epoch)
    )
    assert r.status_code == 409


def test_cancel_of_a_leased_call_revokes_it_on_the_node(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(gpus=1))
    [work] = poll(node).assignments
    attempt = wire.Attempt(invocation_id=invocation_id, epoch=work.epoch)
    r = user.client.post(f"/v1/invocations/{invocation_id}/cancel")
    assert r.json()["state"] == "cancelled"
    assert poll(node, [attempt]).revoked == [attempt]
    # Terminal states absorb: cancelling again leaves it as it is.
    assert (
        user.client.post(f"/v1/invocations/{invocation_id}/cancel").json()["state"] == "cancelled"
    )


# An empty blob is refused (422): tests/integration/test_refusals.py.
@pytest.mark.parametrize("size", [256, 5 << 20])
def test_blobs_stream_in_and_out(gateway: Cluster, size: int) -> None:
    user = Http(gateway.url, gateway.token)
    data = bytes(range(256)) * (size // 256)
    r = user.client.put("/v1/blobs", content=iter([data[: size // 2], data[size // 2 :]]))
    assert r.status_code == 201, r.text
    ref = msgspec.json.decode(r.content, type=wire.BlobRef)
    assert ref.size == size
    assert user.get(f"/v1/blobs/{ref.id}").content == data
    other = Http(gateway.url, gateway.add_user("bob"))
    assert other.get(f"/v1/blobs/{ref.id}").status_code == 404


def test_a_payload_blob_may_be_named_in_any_uuid_spelling(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    ref = msgspec.json.decode(
        user.client.put("/v1/blobs", content=b"payload").content, type=wire.BlobRef
    )
    spelled = ref.id.upper().replace("-", "")
    spec = wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload_blob=spelled)
    [invocation_id] = submit(user, spec)
    assert status(user, invocation_id).state == "queued"


def test_the_invocation_list_leaves_results_out(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(gpus=1))
    [work] = poll(node).assignments
    done = wire.CompleteRequest(epoch=work.epoch, state="succeeded", result=b"r" * 1000)
    assert node.post(f"/v1/node/invocations/{invocation_id}/complete", done).status_code == 204
    [listed] = user.get("/v1/invocations").json()
    assert listed["state"] == "succeeded" and listed["result"] is None
    assert status(user, invocation_id).result == b"r" * 1000


def test_release_requeues_without_using_a_retry_and_is_fenced(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    [invocation_id] = submit(user, call(gpus=1, max_retries=0))
    [work] = poll(node).assignments
    assert node.post("/v1/node/leave", {}).status_code == 204  # no more work for this node
    release = wire.ReleaseRequest(epoch=work.epoch)
    base = f"/v1/node/invocations/{invocation_id}"
    assert node.post(f"{base}/release", release).status_code == 204
    inv = status(user, invocation_id)
    assert (inv.state, inv.attempts) == ("queued", 0)
    assert node.post(f"{base}/release", release).status_code == 409
    late = wire.CompleteRequest(epoch=work.epoch, state="succeeded", result=b"stale")
    assert node.post(f"{base}/complete", late).status_code == 409


def test_bulk_cancel_cancels_only_the_callers_unfinished_calls(gateway: Cluster) -> None:
    alice = Http(gateway.url, gateway.token)
    bob = Http(gateway.url, gateway.add_user("bob"))
    mine = submit(alice, call(), call())
    [theirs] = submit(bob, call())
    r = alice.post("/v1/invocations/cancel", wire.CancelRequest(ids=[*mine, theirs]))
    assert r.status_code == 200
    assert sorted(r.json()["cancelled"]) == sorted(mine)
    assert status(bob, theirs).state == "queued"
    again = alice.post("/v1/invocations/cancel", wire.CancelRequest(ids=mine))
    assert again.json()["cancelled"] == []  # terminal states absorb


def test_calls_of_one_batch_are_delivered_in_submission_order(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    ids = submit(user, *(call(gpus=1) for _ in range(12)))
    node = register(gateway, gpus=1)
    delivered = []
    for _ in ids:
        [work] = poll(node).assignments
        delivered.append(work.invocation_id)
        done = wire.CompleteRequest(epoch=work.epoch, state="succeeded", result=b"")
        node.post(f"/v1/node/invocations/{work.invocation_id}/complete", done)
    assert delivered == ids


def test_tokens_expire_are_revoked_and_all_unusable_ones_get_the_same_401(
    gateway: Cluster,
) -> None:
    import asyncio

    from bulletin import admin

    db_url = gateway.database_url
    fresh = asyncio.run(admin.create_token(db_url, "alice", name="laptop"))
    brief = asyncio.run(admin.create_token(db_url, "alice", expires_s=1.0))
    assert fresh.startswith("bu_") and len(fresh) == 46
    assert Http(gateway.url, fresh).get("/v1/invocations").status_code == 200
    assert Http(gateway.url, brief).get("/v1/invocations").status_code == 200
    time.sleep(1.5)
    [listed] = [t for t in asyncio.run(admin.tokens(db_url, "alice")) if t.name == "laptop"]
    assert listed.hint == fresh[:9] + "…" and fresh not in repr(listed)
    asyncio.run(admin.revoke_token(db_url, listed.id))
    unknown = "bu_" + "A" * 43
    answers = [
        httpx.get(f"{gateway.url}/v1/invocations"),  # missing
        httpx.get(f"{gateway.url}/v1/invocations", headers={"authorization": "Bearer bu_%%"}),
        Http(gateway.url, unknown).get("/v1/invocations"),
        Http(gateway.url, brief).get("/v1/invocations"),  # expired
        Http(gateway.url, fresh).get("/v1/invocations"),  # revoked
    ]
    assert [r.status_code for r in answers] == [401] * 5
    assert len({r.text for r in answers}) == 1, "nothing tells the cases apart"
    assert answers[0].json()["code"] == "unauthorized"
    with pytest.raises(admin.AdminError, match="no token"):
        asyncio.run(admin.revoke_token(db_url, listed.id))
    assert Http(gateway.url, gateway.token).get("/v1/invocations").status_code == 200
    log = (gateway.dir / "gateway.log").read_text()
    assert fresh not in log and brief not in log


def test_the_token_commands(gateway: Cluster) -> None:
    from click.testing import CliRunner

    from bulletin import cli

    env = {"BULLETIN_DATABASE_URL": gateway.database_url}
    run = lambda *args: CliRunner().invoke(cli, list(args), env=env)  # noqa: E731
    made = run("token", "create", "alice", "--name", "ci", "--expires-in-days", "2")
    token = made.output.strip()
    assert made.exit_code == 0 and token.startswith("bu_")
    listed = run("token", "list", "--owner", "alice").output
    line = next(line for line in listed.splitlines() if "'ci'" in line)
    assert token not in listed and token[:9] in line and "valid for 2.0 more days" in line
    token_id = line.split(":")[0]
    assert run("token", "revoke", token_id).exit_code == 0
    assert "revoked" in run("token", "list", "--owner", "alice").output
    assert Http(gateway.url, token).get("/v1/invocations").status_code == 401
    assert "no user 'nobody'" in run("token", "create", "nobody").output


def test_a_caller_session_is_made_by_submitting_and_kept_alive_only_by_its_owner(
    gateway: Cluster,
) -> None:
    alice = Http(gateway.url, gateway.token)
    bob = Http(gateway.url, gateway.add_user("bob"))
    session = str(uuid.uuid4())
    keepalive = f"/v1/sessions/{session}/keepalive"
    unknown = alice.client.post(keepalive)
    assert unknown.status_code == 404 and unknown.json()["code"] == "no_session"
    r = alice.post("/v1/invocations", wire.SubmitRequest(calls=[call(caller_session=session)]))
    assert r.status_code == 201 and r.json()["keepalive_s"] == pytest.approx(10.0)
    assert alice.client.post(keepalive).status_code == 204
    # Another user cannot keep alice's session alive (or learn that it exists).
    other = bob.client.post(keepalive)
    assert other.status_code == 404 and other.json()["code"] == "no_session"
