"""The hot path's shortcuts keep every guarantee: a call placed in its submission's
transaction only when nothing waits, a submission that waits answering the result, a short
blocking call costing the sdk one request, and kept token lookups dropped at once on
revocation. Real gateway, PostgreSQL and nodes on loopback."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import httpx
import msgspec
import pytest

import sdk
from bulletin_core import wire
from tests.conftest import Cluster, running, wait_until
from tests.integration.test_gateway_api import Http, call, poll, register, status, submit

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NoLeader:
    """Holds the scheduling leader's lock, so that no gateway leads (no round runs) until
    :meth:`release`."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._held, self._release = threading.Event(), threading.Event()
        self._holder = threading.Thread(target=asyncio.run, args=(self._hold(),), daemon=True)
        self._holder.start()
        assert self._held.wait(30), "could not take the leader lock"

    async def _hold(self) -> None:
        import asyncpg

        from gateway.db import LEADER_LOCK

        conn = await asyncpg.connect(self._url)
        try:
            await conn.execute("SELECT pg_advisory_lock($1)", LEADER_LOCK)
            self._held.set()
            await asyncio.to_thread(self._release.wait)
        finally:
            await conn.close()

    def release(self) -> None:
        self._release.set()
        self._holder.join(30)


def test_a_call_on_an_idle_cluster_is_placed_by_its_submission_and_never_ahead_of_one_waiting(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    no_leader = NoLeader(database_url)
    try:
        with running(Cluster(database_url, tmp_path), request) as gateway:
            user = Http(gateway.url, gateway.token)
            node = register(gateway, gpus=1)  # and 1 CPU slot
            # No round runs: only the submission itself can place a call.
            [first] = submit(user, call(gpus=1))
            assert status(user, first).state == "assigned"
            # The GPU is taken: the next waits. A CPU call after it finds the CPU slot free,
            # but a call waits: the submission leaves it to the leader's policy.
            [second] = submit(user, call(gpus=1))
            [third] = submit(user, call(gpus=0))
            time.sleep(1.5)  # more than a round's interval: nothing places them meanwhile
            assert status(user, second).state == "queued"
            assert status(user, third).state == "queued"
            no_leader.release()  # the gateway leads at its next try
            wait_until(lambda: status(user, third).state == "assigned", 10, "the backfill")
            assert status(user, second).state == "queued"
            [work] = [w for w in poll(node).assignments if w.invocation_id == first]
            done = wire.CompleteRequest(epoch=work.epoch, state="succeeded", result=b"r")
            assert node.post(f"/v1/node/invocations/{first}/complete", done).status_code == 204
            # The freed GPU goes to the call that waited.
            wait_until(lambda: status(user, second).state == "assigned", 10, "the waiting call")
    finally:
        no_leader.release()


def test_a_submission_that_waits_answers_with_the_result(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway, gpus=1)
    answers: list[httpx.Response] = []
    body = wire.SubmitRequest(calls=[call(gpus=1)])
    waiting = threading.Thread(
        target=lambda: answers.append(user.post("/v1/invocations?wait=20", body))
    )
    started = time.monotonic()
    waiting.start()
    [work] = poll(node).assignments
    result = wire.CompleteRequest(epoch=work.epoch, state="succeeded", result=b"the result")
    completed = node.post(f"/v1/node/invocations/{work.invocation_id}/complete", result)
    assert completed.status_code == 204
    waiting.join(20)
    assert time.monotonic() - started < 15, "it answered once the call finished, not at the hold"
    [answer] = answers
    assert answer.status_code == 201, answer.text
    got = msgspec.json.decode(answer.content, type=wire.SubmitResponse)
    assert got.ids == [work.invocation_id]
    [finished] = got.invocations
    assert finished.state == "succeeded" and finished.result == b"the result"
    assert finished.timeline.fetched is not None, "the answer is the first fetch"
    # Without news within the hold, it answers the ids alone.
    quiet = user.post("/v1/invocations?wait=0.2", wire.SubmitRequest(calls=[call(gpus=1)]))
    assert quiet.status_code == 201
    assert msgspec.json.decode(quiet.content, type=wire.SubmitResponse).invocations == []
    bad = user.post("/v1/invocations?wait=forever", wire.SubmitRequest(calls=[call()]))
    assert bad.status_code == 422 and "wait must be a number of seconds" in bad.text


def test_a_completion_carries_the_last_log_chunks_in_order_and_only_once(
    gateway: Cluster,
) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway, gpus=1)
    [invocation_id] = submit(user, call(gpus=1))
    [work] = poll(node).assignments
    base = f"/v1/node/invocations/{invocation_id}"
    out = wire.Stream.STDOUT
    first = [wire.NodeLogChunk(stream=out, data=b"one\n")]
    posted = wire.LogsRequest(epoch=work.epoch, first_seq=0, chunks=first)
    assert node.post(f"{base}/logs", posted).status_code == 204
    last = [wire.NodeLogChunk(stream=out, data=b"two\n"), wire.NodeLogChunk(stream=out, data=b"3")]
    done = wire.CompleteRequest(
        epoch=work.epoch, state="succeeded", result=b"r", logs=last, logs_first_seq=1
    )
    # A stale attempt's chunks are refused with its outcome, and appended nothing.
    stale = msgspec.structs.replace(done, epoch=work.epoch + 1)
    assert node.post(f"{base}/complete", stale).status_code == 409
    assert node.post(f"{base}/complete", done).status_code == 204
    answer = user.post(
        "/v1/invocations/watch", wire.WatchRequest(items=[wire.WatchItem(id=invocation_id)])
    )
    news = msgspec.json.decode(answer.content, type=wire.WatchResponse)
    assert [(c.n, c.data) for c in news.logs] == [(1, b"one\n"), (2, b"two\n"), (3, b"3")]
    [finished] = news.invocations
    assert finished.state == "succeeded" and finished.log_count == 3


def test_a_short_blocking_call_costs_the_sdk_one_request(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    @sdk.function()
    def double(x: int) -> int:
        return 2 * x

    @sdk.function()
    def loud(x: int) -> int:
        print("doubling", x)
        return 2 * x

    client = sdk.connect(cluster.url, cluster.token)
    assert double(1) == 2 and loud(1) == 2  # the connection, the limits, warm workers
    sent: list[str] = []
    client.request_hooks.append(lambda method, path: sent.append(f"{method} {path.split('?')[0]}"))
    for x in range(5):
        assert double(x) == 2 * x
    # Submitted, run and answered with its result in one request each.
    assert sent == ["POST /v1/invocations"] * 5
    assert double.last_call is not None and double.last_call.timings.fetched is not None
    # A call that prints is answered once its output arrives (live, as ever), then watched
    # until it ends: two requests, its output printed once and in full.
    sent.clear()
    capsys.readouterr()
    for x in range(3):
        assert loud(x) == 2 * x
    assert sent.count("POST /v1/invocations") == 3 and len(sent) <= 6, sent
    assert capsys.readouterr().out == "doubling 0\ndoubling 1\ndoubling 2\n"


def test_a_revoked_token_is_refused_at_once_by_a_gateway_that_keeps_lookups(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from bulletin import admin

    # Lookups kept for a minute: only the revocation's notification can end them in time.
    with running(
        Cluster(database_url, tmp_path), request, options={"token-cache-s": "60"}
    ) as gateway:
        token = asyncio.run(admin.create_token(database_url, "alice", name="laptop"))
        user = Http(gateway.url, token)
        assert user.get("/v1/invocations").status_code == 200  # looked up, now kept
        [made] = [t for t in asyncio.run(admin.tokens(database_url, "alice")) if t.name == "laptop"]
        asyncio.run(admin.revoke_token(database_url, made.id))
        wait_until(lambda: user.get("/v1/invocations").status_code == 401, 1.0, "the revocation")
        # A removed node's kept token is refused at once as well.
        node = register(gateway, "n9")
        beat = wire.HeartbeatRequest(running=[])
        assert node.post("/v1/node/heartbeat", beat).status_code == 200  # now kept
        asyncio.run(admin.drain(database_url, "n9", "leaving"))
        assert node.post("/v1/node/heartbeat", beat).status_code == 200  # draining: still in
        assert asyncio.run(admin.remove_node(database_url, "n9"))
        wait_until(
            lambda: node.post("/v1/node/heartbeat", beat).status_code == 401, 1.0, "the removal"
        )
